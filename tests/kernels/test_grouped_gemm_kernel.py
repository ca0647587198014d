"""moetune's Triton grouped GEMMs (moetune/kernels/grouped_gemm.py): the references against plain
per-expert matmuls, the kernels under the CPU interpreter (gathered rows, transposed weights, empty
groups, padding rows never read, the weight gradient into a strided ``out``, the AdamW epilogue
against the gradient followed by the AdamW kernel), the experts' ``GatheredGroupedMM`` backward
with the Triton row GEMMs, and bf16 against torch's ``_grouped_mm`` on the GPU."""

from __future__ import annotations

import pytest
import torch

from moetune.kernels.grouped_gemm import (
    grouped_rows_mm,
    grouped_rows_mm_reference,
    grouped_weight_grad,
    grouped_weight_grad_reference,
)
from moetune.kernels.adamw_update import AdamWUpdate, adamw_update_reference
from moetune.moe.experts import GatheredGroupedMM
from moetune.optim.adamw import _triton_step
from kernel_test_utils import gpu

SMALL = (16, 16, 16, 4, 2)  # BLOCK_M, BLOCK_N, BLOCK_K, warps, stages: several tiles per group here


def case(*, counts=(0, 9, 1, 0, 8), tokens=7, top_k=3, k=24, cols=40, dtype=torch.float32, device="cpu"):
    """Groups with empty members and rows past the last group (padding), slots sorted by a permutation."""
    torch.manual_seed(0)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32).to(device)
    order = torch.randperm(tokens * top_k).to(device)
    x = torch.randn(tokens, k, dtype=dtype, device=device)
    b = torch.randn(len(counts), k, cols, dtype=dtype, device=device)
    return offsets, order, x, b


def per_expert(rows, b, offsets):
    ends = offsets.tolist()
    return torch.cat([rows[s:e] @ b[i] for i, (s, e) in enumerate(zip([0, *ends[:-1]], ends))])


def test_references_equal_per_expert_matmuls():
    offsets, order, x, b = case(dtype=torch.float64)
    rows = x[order // 3]
    valid = int(offsets[-1])
    out = grouped_rows_mm_reference(x, b, offsets, gather_order=order, top_k=3)
    torch.testing.assert_close(out[:valid], per_expert(rows, b, offsets))
    q = torch.randn(rows.shape[0], 5, dtype=torch.float64)
    grad = grouped_weight_grad_reference(rows, q, offsets)
    ends = offsets.tolist()
    for i, (s, e) in enumerate(zip([0, *ends[:-1]], ends)):
        torch.testing.assert_close(grad[i], rows[s:e].t() @ q[s:e])  # zeros for empty groups


def test_bad_operands_are_named():
    offsets, order, x, b = case()
    with pytest.raises(ValueError, match=r"b must be \[E=5, K=24"):
        grouped_rows_mm(x, b[:, :3], offsets)
    with pytest.raises(ValueError, match="offsets_E must be"):
        grouped_rows_mm(x, b, offsets.float())
    with pytest.raises(ValueError, match="out must be"):
        grouped_weight_grad(x, x, offsets, out=torch.empty(5, 3, 3))


@pytest.mark.parametrize("gather", [True, False], ids=["gathered", "rows"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_rows_kernel_interpreter(interpret, gather, layout):
    offsets, order, x, b = case()
    if layout == "transposed":  # a [E, out, in] weight used as [E, in, out]: strided B
        b = b.transpose(1, 2).contiguous().transpose(1, 2)
    a = x if gather else torch.randn(order.numel(), x.shape[1])
    kwargs = dict(gather_order=order, top_k=3) if gather else {}
    got = grouped_rows_mm(a, b, offsets, impl="triton", config=SMALL, **kwargs)
    expected = grouped_rows_mm_reference(a, b, offsets, **kwargs)
    valid = int(offsets[-1])
    torch.testing.assert_close(got[:valid], expected[:valid], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("gather", [True, False], ids=["gathered", "rows"])
def test_weight_grad_kernel_into_strided_out_interpreter(interpret, gather):
    offsets, order, x, _ = case()
    p = torch.randn(order.numel(), 20)
    q = x if gather else torch.randn(order.numel(), x.shape[1])
    # Padding rows of p hold NaNs: they must never be read.
    p[int(offsets[-1]) :] = float("nan")
    out = torch.full((5, x.shape[1], 20), float("nan")).transpose(1, 2)  # [E, 20, K] with the K-major strides
    kwargs = dict(q_gather_order=order, top_k=3) if gather else {}
    got = grouped_weight_grad(p, q, offsets, out=out, impl="triton", config=SMALL, **kwargs)
    assert got.data_ptr() == out.data_ptr()
    expected = grouped_weight_grad_reference(p[: int(offsets[-1])], q, offsets, **kwargs)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[0], torch.zeros_like(got[0]))  # an empty group: zeros, not the NaNs out held


def _linear_grads(x, w, offsets, order, top_k, impl):
    h = GatheredGroupedMM.apply(x, w.transpose(1, 2), order, offsets, top_k, impl, "triton")
    valid = int(offsets[-1])
    probe = torch.randn_like(h)
    probe[valid:] = float("nan")  # padding rows' upstream gradient: never read
    return (h[:valid], *torch.autograd.grad(h, [x, w], probe))


def test_triton_rows_backward_interpreter(interpret):
    offsets, order, x, b = case()
    w = b.transpose(1, 2).contiguous().requires_grad_()  # [E, out, in]
    x.requires_grad_()
    torch.manual_seed(1)
    got = _linear_grads(x, w, offsets, order, 3, "triton")
    torch.manual_seed(1)
    expected = _linear_grads(x, w, offsets, order, 3, "torch")
    for a, e in zip(got, expected):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)


def test_triton_rows_backward_matches_autograd_float64():
    """The hand-written backward (reference kernels) equals autograd through gather + per-expert matmuls."""
    offsets, order, x, b = case(dtype=torch.float64)
    w = b.transpose(1, 2).contiguous().requires_grad_()
    x.requires_grad_()
    h = GatheredGroupedMM.apply(x, w.transpose(1, 2), order, offsets, 3, "torch", "triton")
    valid = int(offsets[-1])
    expected = per_expert(x[order[:valid] // 3], w.transpose(1, 2), offsets)
    probe = torch.randn(valid, w.shape[1], dtype=torch.float64)
    grads = torch.autograd.grad(h[:valid], [x, w], probe)
    grads_ref = torch.autograd.grad(expected, [x, w], probe)
    torch.testing.assert_close(h[:valid], expected)
    for a, e in zip(grads, grads_ref):
        torch.testing.assert_close(a, e)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("gather", [True, False], ids=["gathered", "rows"])
def test_kernels_match_torch_grouped_mm_bf16_cuda(gather):
    grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    counts = [0, 300, 1, 700, 0, 257, 128, 0]
    tokens, top_k, k, cols = 1024, 2, 512, 384
    torch.manual_seed(0)
    offsets = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    order = torch.randperm(tokens * top_k, device="cuda")
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(len(counts), cols, k, device="cuda", dtype=torch.bfloat16)  # [E, out, in]
    rows = x[order // top_k] if gather else torch.randn(tokens * top_k, k, device="cuda", dtype=torch.bfloat16)
    a, kwargs = (x, dict(gather_order=order, top_k=top_k)) if gather else (rows, {})
    valid = int(offsets[-1])
    got = grouped_rows_mm(a, w.transpose(1, 2), offsets, **kwargs)[:valid].float()
    expected = grouped_mm(rows, w.transpose(1, 2), offs=offsets)[:valid].float()
    assert (got - expected).norm() / expected.norm() < 4e-3
    dh = torch.randn(tokens * top_k, cols, device="cuda", dtype=torch.bfloat16)
    got_w = grouped_weight_grad(dh, a, offsets, q_gather_order=order if gather else None, top_k=top_k).float()
    expected_w = grouped_mm(dh.t(), rows, offs=offsets).float()
    assert (got_w - expected_w).norm() / expected_w.norm() < 4e-3
    assert torch.equal(got_w[0], torch.zeros_like(got_w[0]))


def _moments(weight: torch.Tensor, *, on_device: bool) -> AdamWUpdate:
    generator = torch.Generator().manual_seed(2)
    exp_avg = (torch.randn(weight.shape, generator=generator) * 0.1).to(weight.device, weight.dtype)
    exp_avg_sq = (torch.rand(weight.shape, generator=generator) * 0.1).to(weight.device, weight.dtype)
    # Same strides as the weight (the optimizer's zeros_like preserves them).
    exp_avg = torch.empty_like(weight).copy_(exp_avg)
    exp_avg_sq = torch.empty_like(weight).copy_(exp_avg_sq)
    lr, step = (torch.tensor(1e-2, device=weight.device), torch.tensor(3.0, device=weight.device)) if on_device else (1e-2, 3)
    return AdamWUpdate(exp_avg, exp_avg_sq, lr, 0.9, 0.99, 1e-8, 0.1, step)


def _clone(update: AdamWUpdate) -> AdamWUpdate:
    return AdamWUpdate(update.exp_avg.clone(), update.exp_avg_sq.clone(), *[getattr(update, f) for f in
                       ("lr", "beta1", "beta2", "eps", "weight_decay", "step")])  # fmt: skip


@pytest.mark.parametrize("gather", [True, False], ids=["gathered", "rows"])
@pytest.mark.parametrize("on_device", [False, True], ids=["host-step", "device-step"])
def test_weight_grad_adamw_epilogue_equals_gradient_then_adamw_interpreter(interpret, gather, on_device):
    """The epilogue's update equals the stored gradient followed by the AdamW kernel, bit for bit
    (same tiles, same arithmetic), into a strided weight; empty groups get the update of a zero
    gradient; padding rows are never read; the reference path agrees."""
    offsets, order, x, _ = case()
    p = torch.randn(order.numel(), 20)
    p[int(offsets[-1]) :] = float("nan")
    q = x if gather else torch.randn(order.numel(), x.shape[1])
    kwargs = dict(q_gather_order=order, top_k=3) if gather else {}
    weight = torch.randn(5, x.shape[1], 20).transpose(1, 2)  # [E, 20, K] with K-major strides
    update = _moments(weight, on_device=on_device)
    expected_weight, expected = weight.clone(memory_format=torch.preserve_format), _clone(update)
    grad = grouped_weight_grad(p, q, offsets, impl="triton", config=SMALL, **kwargs)
    _triton_step(expected_weight, grad.contiguous().transpose(1, 2).contiguous().transpose(1, 2), expected.exp_avg,
                 expected.exp_avg_sq, lr=update.lr, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1,
                 step=update.step)  # fmt: skip
    got_weight = weight.clone(memory_format=torch.preserve_format)
    got = _clone(update)
    out = grouped_weight_grad(p, q, offsets, out=got_weight, adamw=got, impl="triton", config=SMALL, **kwargs)
    assert out.data_ptr() == got_weight.data_ptr()
    for a, b in ((got_weight, expected_weight), (got.exp_avg, expected.exp_avg), (got.exp_avg_sq, expected.exp_avg_sq)):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    ref_weight, ref = weight.clone(memory_format=torch.preserve_format), _clone(update)
    grouped_weight_grad(p[: int(offsets[-1])], q, offsets, out=ref_weight, adamw=ref, impl="torch", **kwargs)
    torch.testing.assert_close(ref_weight, expected_weight, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ref.exp_avg_sq, expected.exp_avg_sq, rtol=1e-5, atol=1e-7)


def test_adamw_update_reference_equals_torch_adamw():
    torch.manual_seed(0)
    param, grad = torch.randn(1000), torch.randn(1000)
    update = _moments(param, on_device=False)
    expected = [param.clone(), update.exp_avg.clone(), update.exp_avg_sq.clone()]
    torch.optim._functional.adamw(
        [expected[0]], [grad], [expected[1]], [expected[2]], [], [torch.tensor(2.0)], amsgrad=False, beta1=0.9,
        beta2=0.99, lr=1e-2, weight_decay=0.1, eps=1e-8, maximize=False,
    )  # fmt: skip  (the functional step increments 2 -> 3)
    adamw_update_reference(param, grad, update)
    for got, want in zip((param, update.exp_avg, update.exp_avg_sq), expected):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_adamw_epilogue_errors_name_the_operand():
    offsets, order, x, _ = case()
    p = torch.randn(order.numel(), 20)
    weight = torch.randn(5, 20, x.shape[1])
    update = _moments(weight, on_device=False)
    with pytest.raises(ValueError, match="out is missing"):
        grouped_weight_grad(p, x, offsets, q_gather_order=order, top_k=3, adamw=update)
    transposed = AdamWUpdate(update.exp_avg.transpose(1, 2).contiguous().transpose(1, 2), update.exp_avg_sq, 1e-2,
                             0.9, 0.99, 1e-8, 0.0, 1)  # fmt: skip
    with pytest.raises(ValueError, match="exp_avg must have the parameter's shape and strides"):
        grouped_weight_grad(p, x, offsets, q_gather_order=order, top_k=3, out=weight, adamw=transposed)


@pytest.mark.gpu
@gpu
def test_adamw_epilogue_bf16_cuda():
    """bf16 on the GPU: bit-equal to moetune's weight-gradient kernel followed by the AdamW kernel,
    and close to CUTLASS's gradient followed by it."""
    grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    counts = [0, 300, 1, 700, 0, 257, 128, 0]
    tokens, top_k, k, cols = 1024, 2, 512, 384
    torch.manual_seed(0)
    offsets = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    order = torch.randperm(tokens * top_k, device="cuda")
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    dh = torch.randn(tokens * top_k, cols, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(len(counts), cols, k, device="cuda", dtype=torch.bfloat16)  # [E, out, in]
    update = _moments(weight, on_device=True)
    results = []
    for grad in (grouped_weight_grad(dh, x, offsets, q_gather_order=order, top_k=top_k),
                 grouped_mm(dh.t(), x[order // top_k], offs=offsets)):  # fmt: skip
        w, u = weight.clone(), _clone(update)
        _triton_step(w, grad, u.exp_avg, u.exp_avg_sq, lr=u.lr, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, step=u.step)
        results.append((w, u))
    w, u = weight.clone(), _clone(update)
    grouped_weight_grad(dh, x, offsets, out=w, q_gather_order=order, top_k=top_k, adamw=u)
    (triton_w, triton_u), (cutlass_w, cutlass_u) = results
    assert torch.equal(w, triton_w) and torch.equal(u.exp_avg, triton_u.exp_avg) and torch.equal(u.exp_avg_sq, triton_u.exp_avg_sq)
    moved = (cutlass_w.float() - weight.float()).norm()
    assert (w.float() - cutlass_w.float()).norm() / moved < 2e-2
    assert (u.exp_avg.float() - cutlass_u.exp_avg.float()).norm() / cutlass_u.exp_avg.float().norm() < 1e-2
