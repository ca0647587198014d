"""The experts' weight-gradient GEMM with AdamW in its epilogue (moetune/kernels/grouped_weight_update.py):
its reference against torch's AdamW on the materialised gradient, the kernel under the CPU
interpreter (gathered rows, a strided weight, empty groups, padding rows never read, the rate and
step read from the device), and bf16 on the GPU against the reference."""

from __future__ import annotations

import pytest
import torch

from kernel_test_utils import gpu
from moetune.kernels.grouped_gemm import grouped_weight_grad_reference
from moetune.kernels.grouped_weight_update import grouped_weight_adamw_, grouped_weight_adamw_reference

SMALL = (16, 16, 16, 4, 2)  # BLOCK_M, BLOCK_N, BLOCK_K, warps, stages: several tiles per group here
HYPER = dict(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def case(*, counts=(0, 9, 1, 0, 8), tokens=7, top_k=3, m=20, cols=24, dtype=torch.float32, device="cpu"):
    """p [N, m] with NaN padding rows past the last group, q's source rows [tokens, cols], a slot order,
    and a weight [E, m, cols] stored transposed (the strides of a [E, cols, m] tensor) with its moments."""
    torch.manual_seed(0)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32).to(device)
    order = torch.randperm(tokens * top_k).to(device)
    p = torch.randn(tokens * top_k, m, dtype=dtype, device=device)
    p[int(offsets[-1]) :] = float("nan")  # padding rows: never read
    q = torch.randn(tokens, cols, dtype=dtype, device=device)
    weight = torch.randn(len(counts), cols, m, dtype=dtype, device=device).transpose(1, 2)
    exp_avg = (torch.randn(len(counts), cols, m, device=device) * 0.1).to(dtype).transpose(1, 2)
    exp_avg_sq = (torch.rand(len(counts), cols, m, device=device) * 0.1).to(dtype).transpose(1, 2)
    return offsets, order, p, q, [weight, exp_avg, exp_avg_sq]


def test_reference_is_torch_adamw_on_the_materialised_gradient():
    offsets, order, p, q, (weight, exp_avg, exp_avg_sq) = case(dtype=torch.float64)
    param = torch.nn.Parameter(weight.clone())
    param.grad = grouped_weight_grad_reference(p, q, offsets, q_gather_order=order, top_k=3)
    torch_adamw = torch.optim.AdamW([param], lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    for _ in range(2):  # the second step exercises the bias corrections at step 2
        torch_adamw.step()
    state = torch_adamw.state[param]
    ours = [t.clone() for t in (weight, exp_avg, exp_avg_sq)]
    ours[1].zero_(), ours[2].zero_()
    for step in (1, 2):
        grouped_weight_adamw_reference(*ours, p, q, offsets, lr=3e-3, step=step, q_gather_order=order, top_k=3, **HYPER)
    for got, want in zip(ours, (param, state["exp_avg"], state["exp_avg_sq"])):
        torch.testing.assert_close(got, want.detach(), rtol=1e-12, atol=1e-14)
    assert torch.equal(ours[0][0], (weight[0] * (1 - 3e-3 * 0.1) * (1 - 3e-3 * 0.1)))  # empty group: decay only


def test_states_must_share_the_weights_strides():
    offsets, order, p, q, (weight, exp_avg, exp_avg_sq) = case()
    with pytest.raises(ValueError, match="exp_avg must have the parameter's shape and strides"):
        grouped_weight_adamw_(weight, exp_avg.contiguous(), exp_avg_sq, p, q, offsets, lr=1e-3, step=1,
                              q_gather_order=order, top_k=3, **HYPER)  # fmt: skip
    with pytest.raises(ValueError, match="param must be"):
        grouped_weight_adamw_(weight[:, :3], exp_avg, exp_avg_sq, p, q, offsets, lr=1e-3, step=1, **HYPER)


@pytest.mark.parametrize("gather", [True, False], ids=["gathered", "rows"])
@pytest.mark.parametrize("scalars", ["host", "device"])
def test_kernel_equals_reference_interpreter(interpret, gather, scalars):
    offsets, order, p, q, tensors = case()
    if not gather:
        q = torch.randn(p.shape[0], q.shape[1])
    kwargs = dict(q_gather_order=order, top_k=3) if gather else {}
    lr, step = (3e-3, 4) if scalars == "host" else (torch.tensor(3e-3), torch.tensor(4.0))
    expected = [t.clone() for t in tensors]
    grouped_weight_adamw_reference(*expected, p, q, offsets, lr=3e-3, step=4, **HYPER, **kwargs)
    grouped_weight_adamw_(*tensors, p, q, offsets, lr=lr, step=step, impl="triton", config=SMALL, **HYPER, **kwargs)
    for got, want in zip(tensors, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@gpu
@pytest.mark.parametrize("gather", [True, False], ids=["gathered", "rows"])
def test_kernel_bf16_on_gpu(gather):
    """Qwen3-MoE-like shapes in bf16: the fused step equals the reference computed in fp32 to bf16's rounding."""
    offsets, order, p, q, tensors = case(counts=(0, 300, 17, 0, 211, 64), tokens=200, m=256, cols=192,
                                         dtype=torch.bfloat16, device="cuda")  # fmt: skip
    if not gather:
        q = torch.randn(p.shape[0], q.shape[1], dtype=torch.bfloat16, device="cuda")
    kwargs = dict(q_gather_order=order, top_k=3) if gather else {}
    expected = [t.float().clone() for t in tensors]
    grouped_weight_adamw_reference(*expected, p.float(), q.float(), offsets, lr=1e-2, step=3, **HYPER, **kwargs)
    grouped_weight_adamw_(*tensors, p, q, offsets, lr=torch.tensor(1e-2, device="cuda"),
                          step=torch.tensor(3.0, device="cuda"), **HYPER, **kwargs)  # fmt: skip
    for got, want in zip(tensors, expected):
        torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)
