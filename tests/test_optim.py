"""moetune.optim.AdamW follows torch.optim.AdamW (CPU fallback exactly; CUDA kernel within bf16 rounding)."""

from __future__ import annotations

import pytest
import torch

from moetune.optim import AdamW
from tests.conftest import rel_err


def _run(optimizer_cls, param, grads, **kwargs):
    param = torch.nn.Parameter(param.clone())
    optimizer = optimizer_cls([param], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, **kwargs)
    for grad in grads:
        param.grad = grad.clone()
        optimizer.step()
    return param.detach(), optimizer.state[param]


def test_cpu_matches_torch_adamw_exactly():
    torch.manual_seed(0)
    start, grads = torch.randn(64, 8), [torch.randn(64, 8) for _ in range(4)]
    ours, state = _run(AdamW, start, grads)
    ref, ref_state = _run(torch.optim.AdamW, start, grads)
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)
    torch.testing.assert_close(state["exp_avg_sq"], ref_state["exp_avg_sq"], rtol=0, atol=0)
    assert int(state["step"]) == 4


def test_rejects_bad_hyperparameters():
    with pytest.raises(ValueError, match="lr=-1"):
        AdamW([torch.nn.Parameter(torch.zeros(2))], lr=-1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton kernel)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernel_matches_torch_fused_adamw(dtype):
    torch.manual_seed(0)
    start = torch.randn(1 << 20, device="cuda").to(dtype)
    grads = [torch.randn(1 << 20, device="cuda").to(dtype) for _ in range(3)]
    ours, _ = _run(AdamW, start, grads)
    ref, _ = _run(torch.optim.AdamW, start, grads, fused=True)
    assert rel_err(ours.float(), ref.float()) < (1e-6 if dtype == torch.float32 else 1e-2)


def _clipped_run(model: torch.nn.Module, optimizer, batches, *, fold: bool) -> list[float]:
    """Clip to 0.05 (every step clips) and step; ``fold``: the coefficient goes to the optimizer."""
    from moetune.distributed import clip_grad_norm_

    norms = []
    for x in batches:
        model(x).square().mean().backward()
        if fold:
            norms.append(float(clip_grad_norm_(model, 0.05, optimizer=optimizer)))
        else:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return norms


def _mlp(device: str, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).to(dtype)


def test_clipping_coefficient_handed_to_the_optimizer_equals_clipping_the_gradients():
    """clip_grad_norm_(..., optimizer=AdamW) measures torch's norm and hands the coefficient to
    AdamW's next step (no pass over the gradients): on CPU exactly torch's clip + AdamW."""
    batches = [torch.randn(8, 64, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    folded, reference = _mlp("cpu", torch.float32), _mlp("cpu", torch.float32)
    fold_norms = _clipped_run(folded, AdamW(folded.parameters(), lr=1e-2), batches, fold=True)
    ref_norms = _clipped_run(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), batches, fold=False)
    assert fold_norms == ref_norms and min(fold_norms) > 0.05  # every step clipped
    for a, b in zip(folded.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_non_finite_norm_skips_the_update():
    """A NaN or infinite gradient: the norm is not finite, the coefficient NaN, and AdamW leaves
    parameters and moments as they were (clipping or only measuring)."""
    from moetune.distributed import clip_grad_norm_

    for max_norm, bad in ((1.0, float("nan")), (float("inf"), float("inf"))):
        model = _mlp("cpu", torch.float32)
        optimizer = AdamW(model.parameters(), lr=1e-2)
        model(torch.randn(4, 64)).sum().backward()
        clip_grad_norm_(model, max_norm, optimizer=optimizer)
        optimizer.step()  # one good step: moments exist
        optimizer.zero_grad(set_to_none=True)
        before = [t.clone() for p in model.parameters() for t in (p.detach(), *optimizer.state[p].values())]
        model(torch.randn(4, 64)).sum().backward()
        model[0].weight.grad[0, 0] = bad
        norm = clip_grad_norm_(model, max_norm, optimizer=optimizer)
        optimizer.step()
        assert not torch.isfinite(norm)
        after = [t for p in model.parameters() for t in (p.detach(), *optimizer.state[p].values())]
        for a, b in zip(after, before):
            if a.dim():  # the step counts advance
                assert torch.equal(a, b)


def test_gradient_scale_stays_until_cleared_and_in_backward_refuses_it():
    from moetune.optim import AdamWInBackward

    param = torch.nn.Parameter(torch.zeros(4))
    optimizer = AdamW([param], lr=0.1, weight_decay=0.0)
    optimizer.set_gradient_scale(0.0)  # a zero gradient: Adam's update is 0
    for _ in range(2):
        param.grad = torch.ones(4)
        optimizer.step()
    assert torch.equal(param.detach(), torch.zeros(4))
    optimizer.set_gradient_scale(None)
    param.grad = torch.ones(4)
    optimizer.step()
    assert bool((param.detach() < 0).all())
    with pytest.raises(ValueError, match="no gradient clipping"):
        AdamWInBackward([torch.nn.Parameter(torch.zeros(2))]).set_gradient_scale(0.5)
    with pytest.raises(ValueError, match=r"one number .* shape \(2,\)"):
        optimizer.set_gradient_scale(torch.ones(2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton kernel)")
@pytest.mark.parametrize("capturable", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernel_applies_the_clipping_coefficient(dtype, capturable):
    """The kernel's scaled gradient read against torch's clipping pass before the same AdamW: the
    same norms and parameters in fp32 (the same product, rounded once); in bf16 within its rounding
    (the clipping pass rounds the scaled gradient to bf16, the kernel does not)."""
    batches = [torch.randn(8, 64, device="cuda", dtype=dtype) for _ in range(4)]
    folded, reference = _mlp("cuda", dtype), _mlp("cuda", dtype)
    fold_norms = _clipped_run(folded, AdamW(folded.parameters(), lr=1e-2, capturable=capturable), batches, fold=True)
    ref_norms = _clipped_run(reference, AdamW(reference.parameters(), lr=1e-2, capturable=capturable), batches,
                             fold=False)  # fmt: skip
    assert fold_norms == pytest.approx(ref_norms, rel=1e-6 if dtype == torch.float32 else 1e-2)
    for a, b in zip(folded.parameters(), reference.parameters()):
        assert rel_err(a.float(), b.float()) < (1e-6 if dtype == torch.float32 else 1e-2)


def test_in_backward_equals_step_after_backward():
    from moetune.optim import AdamWInBackward

    torch.manual_seed(0)
    model_a = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    model_b = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    model_b.load_state_dict(model_a.state_dict())
    opt_a = AdamW(model_a.parameters(), lr=1e-2)
    opt_b = AdamWInBackward(model_b.parameters(), lr=1e-2)
    for _ in range(3):
        x = torch.randn(5, 8)
        model_a(x).square().sum().backward()
        opt_a.step()
        opt_a.zero_grad()
        model_b(x).square().sum().backward()
        assert all(p.grad is None for p in model_b.parameters())  # freed during backward
        opt_b.step()
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_one_parameter_steps_use_the_loaded_groups():
    """``step_parameter`` (the updates inside the backward) after ``load_state_dict`` reads the
    loaded hyper-parameters, not the replaced groups' (a resume that changes the rate)."""
    param = torch.nn.Parameter(torch.ones(4))
    optimizer = AdamW([param], lr=0.1)
    param.grad = torch.ones(4)
    optimizer.step_parameter(param)
    state = optimizer.state_dict()
    state["param_groups"][0]["lr"] = 0.0
    optimizer.load_state_dict(state)
    before = param.detach().clone()
    param.grad = torch.ones(4)
    optimizer.step_parameter(param)
    assert torch.equal(param.detach(), before)


def test_takes_torch_adamw_arguments_and_refuses_the_variants_it_does_not_implement():
    """Code written for torch.optim.AdamW runs unchanged (foreach / fused only pick torch's kernels);
    amsgrad / maximize / differentiable are refused wherever they come from (constructor, a group,
    add_param_group, a torch state dict), never silently ignored."""
    torch.manual_seed(0)
    start, grads = torch.randn(16, 4), [torch.randn(16, 4) for _ in range(3)]
    flags = dict(amsgrad=False, maximize=False, foreach=False, fused=None, differentiable=False)
    ours, _ = _run(AdamW, start, grads, **flags)
    ref, _ = _run(torch.optim.AdamW, start, grads, **flags)
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)

    param = torch.nn.Parameter(torch.zeros(2))
    for kwargs in ({"amsgrad": True}, {"maximize": True}, {"differentiable": True}):
        with pytest.raises(ValueError, match=f"does not implement {next(iter(kwargs))}=True"):
            AdamW([param], **kwargs)
    with pytest.raises(ValueError, match="amsgrad=True .a parameter group"):
        AdamW([{"params": [param], "amsgrad": True}])
    optimizer = AdamW([param])
    with pytest.raises(ValueError, match="maximize=True"):
        optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "maximize": True})
    torch_optimizer = torch.optim.AdamW([param], amsgrad=True)
    param.grad = torch.ones(2)
    torch_optimizer.step()
    with pytest.raises(ValueError, match="amsgrad=True .load_state_dict"):
        optimizer.load_state_dict(torch_optimizer.state_dict())
    sparse = torch.nn.Embedding(4, 2, sparse=True)
    sparse(torch.tensor([1])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        AdamW(sparse.parameters()).step()


def test_state_dicts_move_between_torch_adamw_and_ours():
    """A run continues exactly after its optimizer state moves torch -> moetune -> torch."""
    torch.manual_seed(0)
    start, grads = torch.randn(16, 4), [torch.randn(16, 4) for _ in range(6)]
    ref, _ = _run(torch.optim.AdamW, start, grads)
    param = torch.nn.Parameter(start.clone())
    optimizer = None
    for i, grad in enumerate(grads):
        if i % 2 == 0:  # swap the optimizer class every two steps
            cls = torch.optim.AdamW if i % 4 == 0 else AdamW
            fresh = cls([param], lr=1.0, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
            if optimizer is not None:
                fresh.load_state_dict(optimizer.state_dict())
                assert fresh.param_groups[0]["lr"] == 1e-2
            optimizer = fresh if optimizer is not None else cls([param], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
        param.grad = grad.clone()
        optimizer.step()
    torch.testing.assert_close(param.detach(), ref, rtol=0, atol=0)
