"""experts_backend="quack" (moetune/kernels/quack_grouped_gemm.py): clear errors where quack cannot
run (package missing, CPU tensors), and on the GPU, where quack-kernels is installed, its grouped
GEMMs and the experts' ``GatheredGroupedMM`` (gathered rows, transposed weights, empty experts,
padding rows) against torch's ``_grouped_mm`` in bf16."""

from __future__ import annotations

import sys

import pytest
import torch

from moetune.kernels import quack_grouped_gemm
from moetune.moe.experts import GatheredGroupedMM
from kernel_test_utils import gpu


@pytest.fixture
def quack_missing(monkeypatch):
    quack_grouped_gemm.require.cache_clear()
    monkeypatch.setitem(sys.modules, "quack.gemm_interface", None)  # import fails
    yield
    quack_grouped_gemm.require.cache_clear()


def test_a_missing_package_is_named(quack_missing):
    assert not quack_grouped_gemm.available()
    with pytest.raises(RuntimeError, match="pip install quack-kernels"):
        quack_grouped_gemm.require()
    from moetune.models.options import set_moe_options

    with pytest.raises(RuntimeError, match="quack-kernels"):
        set_moe_options(torch.nn.Linear(2, 2), experts_backend="quack")


def test_cpu_tensors_are_refused_before_any_kernel():
    x = torch.ones(4, 8)
    with pytest.raises(RuntimeError, match="compute capability 9.0"):
        GatheredGroupedMM.apply(x, torch.ones(2, 8, 8), None, torch.tensor([1, 4], dtype=torch.int32), 1, "auto", "quack")


def test_many_row_counts_warn_once_that_quack_retunes_each(monkeypatch):
    """quack tunes every new operand shape: a GEMM that keeps seeing new row counts (unpacked batches)
    gets one warning with the way out; repeated shapes never warn. (The
    kernels themselves are replaced: this checks moetune's bookkeeping, on CPU.)"""
    import warnings

    calls = []
    monkeypatch.setattr(quack_grouped_gemm, "require", lambda: lambda *args, **kwargs: calls.append(args[0].shape))
    monkeypatch.setattr(quack_grouped_gemm, "check_supported", lambda x: None)
    monkeypatch.setattr(quack_grouped_gemm, "watch_row_counts", quack_grouped_gemm.RowCountWatch(limit=4))
    w_EKC, offsets = torch.ones(2, 8, 16), torch.tensor([3, 5], dtype=torch.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning while the counts repeat or stay within the limit
        for rows in (5, 6, 7, 5, 6, 7, 8):
            quack_grouped_gemm.rows_mm(torch.ones(rows, 8), w_EKC, offsets)
            quack_grouped_gemm.weight_grad(torch.ones(rows, 8), torch.ones(rows, 16), offsets)
    with pytest.warns(UserWarning, match="row GEMM with weights \\[2, 8, 16\\] has run 5 different row counts") as seen:
        quack_grouped_gemm.rows_mm(torch.ones(9, 8), w_EKC, offsets)
    assert len(seen) == 1 and "batches packed to one length" in str(seen[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        for rows in (10, 11, 12):
            quack_grouped_gemm.rows_mm(torch.ones(rows, 8), w_EKC, offsets, gather_order=torch.arange(rows), top_k=1)
    assert len(calls) == 7 * 2 + 1 + 3


def _case():
    counts = [0, 300, 1, 700, 0, 257, 128, 0]  # empty experts; 1386 of 2048 rows routed, the rest padding
    tokens, top_k, k, cols = 1024, 2, 512, 384
    torch.manual_seed(0)
    offsets = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    order = torch.randperm(tokens * top_k, device="cuda")
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(len(counts), cols, k, device="cuda", dtype=torch.bfloat16) * k**-0.5  # [E, out, in]
    return offsets, order, x, w, top_k


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    got, expected = got.float(), expected.float()
    assert (got - expected).norm() / expected.norm() < 4e-3


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("gather", [True, False], ids=["gathered", "rows"])
def test_kernels_match_torch_grouped_mm_bf16_cuda(gather):
    pytest.importorskip("quack.gemm_interface", reason="quack-kernels is not installed")
    grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    offsets, order, x, w, top_k = _case()
    rows = x[order // top_k] if gather else torch.randn(order.numel(), x.shape[1], device="cuda", dtype=torch.bfloat16)
    a, kwargs = (x, dict(gather_order=order, top_k=top_k)) if gather else (rows, {})
    valid = int(offsets[-1])
    _close(quack_grouped_gemm.rows_mm(a, w.transpose(1, 2), offsets, **kwargs)[:valid], grouped_mm(rows, w.transpose(1, 2), offs=offsets)[:valid])
    dh = torch.randn(order.numel(), w.shape[1], device="cuda", dtype=torch.bfloat16)
    dh[valid:] = float("nan")  # padding rows' gradients are never read
    got_w = quack_grouped_gemm.weight_grad(dh, rows, offsets)
    _close(got_w, grouped_mm(dh.t(), rows, offs=offsets))
    for empty in (0, 4, 7):
        assert torch.equal(got_w[empty], torch.zeros_like(got_w[empty]))


@pytest.mark.gpu
@gpu
def test_gathered_experts_backward_equals_grouped_mm_bf16_cuda():
    pytest.importorskip("quack.gemm_interface", reason="quack-kernels is not installed")
    offsets, order, x, w, top_k = _case()
    valid = int(offsets[-1])
    probe = torch.randn(order.numel(), w.shape[1], device="cuda", dtype=torch.bfloat16)
    results = {}
    for backend in ("quack", "grouped_mm"):
        xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
        h = GatheredGroupedMM.apply(xb, wb.transpose(1, 2), order, offsets, top_k, "auto", backend)
        h[:valid].backward(probe[:valid])
        results[backend] = (h[:valid], xb.grad, wb.grad)
    for got, expected in zip(results["quack"], results["grouped_mm"]):
        assert torch.isfinite(got).all()
        _close(got, expected)
