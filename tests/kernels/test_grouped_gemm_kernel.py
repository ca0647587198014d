"""moetune's Triton grouped GEMMs (moetune/kernels/grouped_gemm.py): the references against plain
per-expert matmuls, the kernels under the CPU interpreter (gathered rows, transposed weights, empty
groups, padding rows never read, the weight gradient into a strided ``out``), the experts'
``GatheredGroupedMM`` backward with the Triton row GEMMs, and bf16 against torch's ``_grouped_mm`` on the GPU."""

from __future__ import annotations

import pytest
import torch

from moetune.kernels.grouped_gemm import (
    grouped_rows_mm,
    grouped_rows_mm_reference,
    grouped_weight_grad,
    grouped_weight_grad_reference,
)
from moetune.moe.experts import GatheredGroupedMM
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
