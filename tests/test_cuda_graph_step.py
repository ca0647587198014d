"""CUDAGraphTrainStep: the captured step trains exactly like the eager loop (GPU), the eager path
off CUDA, and its checks."""

from __future__ import annotations

import copy

import pytest
import torch

import moetune
from moetune.distributed import clip_grad_norm_
from moetune.optim import AdamW
from moetune.training import CUDAGraphTrainStep, set_learning_rate
from tests.conftest import rel_err, tiny_qwen3_moe_config

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _model(device: str, dtype: torch.dtype, *, aux_loss: bool = True, attention: str = "sdpa"):
    torch.manual_seed(0)
    config = tiny_qwen3_moe_config(vocab_size=128, hidden_size=64, moe_intermediate_size=32, output_router_logits=aux_loss)
    with torch.device(device):
        return moetune.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention).train()


def _batches(n: int, device: str) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (2, 24), generator=generator).to(device) for _ in range(n)]


def _eager_losses(model, optimizer, batches, *, max_grad_norm=None) -> list[float]:
    losses = []
    for ids in batches:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), max_grad_norm, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_off_cuda_it_runs_the_eager_loop_exactly():
    model = _model("cpu", torch.float32)
    reference = copy.deepcopy(model)
    step = CUDAGraphTrainStep(model, AdamW(model.parameters(), lr=1e-2), max_grad_norm=0.5)
    batches = _batches(4, "cpu")
    losses = [step(input_ids=ids, labels=ids).item() for ids in batches]
    expected = _eager_losses(reference, AdamW(reference.parameters(), lr=1e-2), batches, max_grad_norm=0.5)
    assert not step.captured
    assert losses == expected
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def _eager_accumulated_losses(model, optimizer, steps, *, max_grad_norm=None, scale=None) -> list[list[float]]:
    losses = []
    for micro_batches in steps:
        losses.append([])
        for ids in micro_batches:
            loss = model(input_ids=ids, labels=ids).loss * (1 / len(micro_batches) if scale is None else scale)
            loss.backward()
            losses[-1].append(loss.item())
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), max_grad_norm, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses


def _check_accumulation_equals_eager(step, reference, steps, **eager_settings) -> None:
    """``step``'s losses and parameters after the accumulated ``steps`` equal the eager loop's exactly."""
    losses = []
    for micro_batches in steps:
        losses.append([step.forward_backward(input_ids=ids, labels=ids).item() for ids in micro_batches])
        step.optimizer_step()
    assert losses == _eager_accumulated_losses(reference, AdamW(reference.parameters(), lr=1e-2), steps, **eager_settings)
    for (name, a), b in zip(step.model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def _halved_loss(model, batch):
    return model(**batch).loss / 2


def test_gradient_accumulation_off_cuda_equals_the_eager_loop():
    model = _model("cpu", torch.float32)
    reference = copy.deepcopy(model)
    step = CUDAGraphTrainStep(model, AdamW(model.parameters(), lr=1e-2), max_grad_norm=0.5, loss_fn=_halved_loss)
    batches = _batches(6, "cpu")
    _check_accumulation_equals_eager(step, reference, [batches[i:i + 2] for i in range(0, 6, 2)], max_grad_norm=0.5)
    with pytest.raises(RuntimeError, match="optimizer_step\\(\\) without a forward_backward"):
        step.optimizer_step()


def test_overlapped_optimizer_equals_the_step_after_backward():
    """overlap_optimizer (off CUDA: each update runs from its gradient hook, no stream) leaves the
    parameters exactly where optimizer.step() after the backward does."""
    model = _model("cpu", torch.float32)
    reference = copy.deepcopy(model)
    step = CUDAGraphTrainStep(model, AdamW(model.parameters(), lr=1e-2), overlap_optimizer=True)
    batches = _batches(3, "cpu")
    losses = [step(input_ids=ids, labels=ids).item() for ids in batches]
    assert losses == _eager_losses(reference, AdamW(reference.parameters(), lr=1e-2), batches)
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    step.forward_backward(input_ids=batches[0], labels=batches[0])
    with pytest.raises(RuntimeError, match="pass micro_batches=N"):
        step.forward_backward(input_ids=batches[0], labels=batches[0])


@pytest.mark.parametrize("overlap_optimizer", [False, True])
def test_known_micro_batch_count_off_cuda_equals_the_eager_loop(overlap_optimizer):
    """micro_batches=3: the same parameters as the eager accumulating loop, with and without the
    updates in the last backward; a fourth micro-batch, or a step after two, raises."""
    model = _model("cpu", torch.float32)
    reference = copy.deepcopy(model)
    step = CUDAGraphTrainStep(model, AdamW(model.parameters(), lr=1e-2), micro_batches=3,
                              overlap_optimizer=overlap_optimizer, loss_fn=_halved_loss)  # fmt: skip
    batches = _batches(6, "cpu")
    _check_accumulation_equals_eager(step, reference, [batches[0:3], batches[3:6]], scale=0.5)
    for ids in batches[:3]:
        step.forward_backward(input_ids=ids, labels=ids)
    with pytest.raises(RuntimeError, match="3 micro-batches per step"):
        step.forward_backward(input_ids=batches[0], labels=batches[0])
    step.optimizer_step()
    step.forward_backward(input_ids=batches[0], labels=batches[0])
    with pytest.raises(RuntimeError, match="after 1 of 3 micro-batches"):
        step.optimizer_step()
    with pytest.raises(ValueError, match="micro_batches must be >= 1"):
        CUDAGraphTrainStep(model, AdamW(model.parameters()), micro_batches=0)


def test_overlapped_optimizer_checks():
    model = _model("cpu", torch.float32)
    with pytest.raises(ValueError, match="cannot clip"):
        CUDAGraphTrainStep(model, AdamW(model.parameters()), overlap_optimizer=True, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="needs moetune.optim.AdamW"):
        CUDAGraphTrainStep(model, torch.optim.AdamW(model.parameters()), overlap_optimizer=True)
    step = CUDAGraphTrainStep(model, AdamW(model.parameters()), overlap_optimizer=True)
    before = [p.detach().clone() for p in model.parameters()]
    ids = _batches(1, "cpu")[0]
    for _ in range(2):  # backwards outside the step object's calls update nothing (and do not raise)
        model(input_ids=ids, labels=ids).loss.backward()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    model.zero_grad(set_to_none=True)
    step(input_ids=ids, labels=ids)
    assert not any(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    step.close()  # removes the hooks


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])])
def test_non_finite_gradients_skip_the_update_and_leave_the_norm(device):
    """With max_grad_norm and moetune's AdamW the optimizer step (a graph replay on CUDA) measures
    the norm into ``grad_norm`` and, when it is not finite, updates nothing: no host check needed."""
    model = _model(device, torch.float32 if device == "cpu" else torch.bfloat16)
    optimizer = AdamW(model.parameters(), lr=1e-3, capturable=device == "cuda")
    step = CUDAGraphTrainStep(model, optimizer, max_grad_norm=1.0)
    batches = _batches(5, device)
    for ids in batches[:4]:  # two eager steps, then the captures and a replay
        step(input_ids=ids, labels=ids)
    assert step.captured == (device == "cuda") and bool(torch.isfinite(step.grad_norm))
    with torch.no_grad():
        model.model.norm.weight.fill_(float("nan"))  # every gradient below it becomes NaN
    before = {name: [p.detach().clone(), *(t.clone() for k, t in optimizer.state[p].items() if k != "step")]
              for name, p in model.named_parameters()}  # fmt: skip
    step(input_ids=batches[4], labels=batches[4])
    assert bool(torch.isnan(step.grad_norm))
    for name, p in model.named_parameters():
        now = [p.detach(), *(t for k, t in optimizer.state[p].items() if k != "step")]
        assert all(torch.equal(a, b) for a, b in zip(now, before[name]) if name != "model.norm.weight"), name


def test_rejects_zero_warmup():
    model = _model("cpu", torch.float32)
    with pytest.raises(ValueError, match="warmup_steps must be >= 1"):
        CUDAGraphTrainStep(model, AdamW(model.parameters()), warmup_steps=0)


def test_set_learning_rate_fills_tensor_rates_in_place():
    rate = torch.tensor(1.0)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=rate)
    set_learning_rate(optimizer, 0.25)
    assert optimizer.param_groups[0]["lr"] is rate and rate.item() == 0.25


@pytest.mark.gpu
@needs_cuda
def test_needs_a_capturable_optimizer():
    model = _model("cuda", torch.bfloat16)
    with pytest.raises(ValueError, match="must be capturable"):
        CUDAGraphTrainStep(model, AdamW(model.parameters()))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "num_micro_batches, settings",
    [
        (1, {"max_grad_norm": 1.0}),
        (1, {"overlap_optimizer": True}),
        (2, {"max_grad_norm": 1.0}),
        (3, {"micro_batches": 3, "overlap_optimizer": True}),
    ],
    ids=["one-graph-clipped", "one-graph-overlapped", "two-graphs-clipped", "three-graphs-overlapped"],
)
def test_graphed_steps_train_like_eager_steps(num_micro_batches, settings):
    """Step by step, the replayed losses, (accumulated) gradients and updates equal an eager loop's
    (same kernels, same capturable optimizer), through the eager warm-up, the captures and the
    replays. One micro-batch per step: one graph (with the updates inside it when overlapped).
    Without a micro-batch count the first micro-batch replays the graph that writes the gradients and
    the others the one that adds into them; with micro_batches=3 first, middle and last micro-batches
    each have a graph. Deterministic kernels only (SDPA's math backend, no aux loss: the fused
    attention backwards and the aux loss's scatter_add use atomics, whose rounding differences Adam
    amplifies from step to step)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    max_grad_norm = settings.get("max_grad_norm")
    scaled = lambda m, batch: m(**batch).loss / num_micro_batches  # noqa: E731
    with sdpa_kernel([SDPBackend.MATH]):
        model = _model("cuda", torch.bfloat16, aux_loss=False)
        reference = copy.deepcopy(model)
        step = CUDAGraphTrainStep(model, AdamW(model.parameters(), lr=1e-3, capturable=True), loss_fn=scaled, **settings)
        ref_optimizer = AdamW(reference.parameters(), lr=1e-3, capturable=True)
        batches = _batches(5 * num_micro_batches, "cuda")
        for i in range(5):
            for ids in batches[num_micro_batches * i:num_micro_batches * (i + 1)]:
                loss = step.forward_backward(input_ids=ids, labels=ids)
                ref_loss = scaled(reference, {"input_ids": ids, "labels": ids})
                ref_loss.backward()
                assert abs(loss.item() - ref_loss.item()) <= 1e-4 * abs(ref_loss.item()), f"loss of step {i}"
            for (name, a), b in zip(model.named_parameters(), reference.parameters()):
                assert rel_err(a.grad.float(), b.grad.float()) < 1e-3, f"gradient of {name} at step {i}"
            step.optimizer_step()
            if max_grad_norm is not None:  # as the step clips: the coefficient read by AdamW's kernel
                clip_grad_norm_(list(reference.parameters()), max_grad_norm, optimizer=ref_optimizer)
            ref_optimizer.step()
            ref_optimizer.zero_grad(set_to_none=True)
            for (name, a), b in zip(model.named_parameters(), reference.parameters()):
                assert rel_err(a.float(), b.float()) < 1e-3, f"{name} after step {i}"
        assert step.captured and len(step._graphs) == min(num_micro_batches, 3)
        assert all(p.grad is not None for p in model.parameters())  # the static gradients stay readable


@pytest.mark.gpu
@needs_cuda
def test_graphed_steps_with_aux_loss_and_sdpa_track_the_eager_losses():
    model = _model("cuda", torch.bfloat16)
    reference = copy.deepcopy(model)
    step = CUDAGraphTrainStep(model, AdamW(model.parameters(), lr=1e-3, capturable=True))
    batches = _batches(6, "cuda")
    losses = [step(input_ids=ids, labels=ids).item() for ids in batches]
    expected = _eager_losses(reference, AdamW(reference.parameters(), lr=1e-3, capturable=True), batches)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-3, atol=0)


@pytest.mark.gpu
@needs_cuda
def test_learning_rate_changes_reach_the_replays_and_shapes_are_checked():
    model = _model("cuda", torch.bfloat16)
    optimizer = AdamW(model.parameters(), lr=1e-2, weight_decay=0.0, capturable=True)
    step = CUDAGraphTrainStep(model, optimizer, warmup_steps=1)
    ids, other = _batches(2, "cuda")
    step(input_ids=ids, labels=ids)
    step(input_ids=ids, labels=ids)  # captured
    set_learning_rate(optimizer, 0.0)
    before = [p.detach().clone() for p in model.parameters()]
    step(input_ids=other, labels=other)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with pytest.raises(ValueError, match=r"batch\['input_ids'\] is \(2, 12\)"):
        step(input_ids=other[:, :12], labels=other)
