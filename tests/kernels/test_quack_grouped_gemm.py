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


class _RecordingQuack:
    """Stands in for quack's gemm_interface on CPU: records which calls tuned and which reused a
    config, and computes the GEMMs with torch so the results can be checked."""

    def __init__(self):
        self.calls = []
        outer = self

        class Tuner:
            def __call__(self, a, b, out, **varlen):
                outer.calls.append(("tune", out.shape))
                outer.compute(a, b, out, **varlen)
                return f"config{len(outer.calls)}", 1, False, None

            def fn(self, a, b, out, *, config, **varlen):
                outer.calls.append((config, out.shape))
                outer.compute(a, b, out, **varlen)

        self.gemm_tuned = Tuner()

    @staticmethod
    def compute(a, b, out, cu_seqlens_m=None, cu_seqlens_k=None, A_idx=None):
        ends = (cu_seqlens_m if cu_seqlens_m is not None else cu_seqlens_k).tolist()
        for e, (start, end) in enumerate(zip(ends[:-1], ends[1:])):
            if cu_seqlens_m is not None:
                rows = a[A_idx[start:end]] if A_idx is not None else a[start:end]
                out[start:end] = rows @ b[e]
            else:
                out[e] = a[:, start:end] @ b[start:end]


def test_one_tuning_per_gemm_shape_and_power_of_two_row_bucket(monkeypatch):
    """quack's autotuner keys on exact shapes; moetune tunes once per GEMM shape and row bucket and
    launches the winning config for every other count of the bucket (a new row count every step
    from unpacked batches or the all-to-all dispatchers costs no sweep). The kernels are replaced by
    torch here: this checks moetune's bookkeeping and operands on CPU; the GPU test below runs quack."""
    fake = _RecordingQuack()
    monkeypatch.setattr(quack_grouped_gemm, "require", lambda: fake)
    monkeypatch.setattr(quack_grouped_gemm, "check_supported", lambda x: None)
    monkeypatch.setattr(quack_grouped_gemm, "tuned_configs", quack_grouped_gemm.TunedConfigs())
    monkeypatch.setattr(quack_grouped_gemm, "SMALLEST_ROW_BUCKET", 4)
    torch.manual_seed(0)
    w_EKC, offsets = torch.randn(2, 8, 16), torch.tensor([3, 5], dtype=torch.int32)
    for rows in (5, 6, 7, 8, 5):  # bucket 8: one tuning, the rest reuse its config
        a = torch.randn(rows, 8)
        got = quack_grouped_gemm.rows_mm(a, w_EKC, offsets)
        torch.testing.assert_close(got[:5], torch.cat([a[:3] @ w_EKC[0], a[3:5] @ w_EKC[1]]))
        q = torch.randn(rows, 16)
        got_w = quack_grouped_gemm.weight_grad(a, q, offsets)
        torch.testing.assert_close(got_w, torch.stack([a[:3].t() @ q[:3], a[3:5].t() @ q[3:5]]))
    assert [c[0] for c in fake.calls[:4]] == ["tune", "tune", "config1", "config2"]
    assert sum(c[0] == "tune" for c in fake.calls) == 2 and len(fake.calls) == 10
    quack_grouped_gemm.rows_mm(torch.randn(9, 8), w_EKC, offsets)  # bucket 16: tunes
    quack_grouped_gemm.rows_mm(torch.randn(16, 8), w_EKC, offsets)  # reuses
    assert [c[0] for c in fake.calls[10:]] == ["tune", "config11"]
    x, order = torch.randn(4, 8), torch.tensor([5, 0, 2, 7, 1, 3])  # gathered rows: a GEMM of its own
    got = quack_grouped_gemm.rows_mm(x, w_EKC, offsets, gather_order=order, top_k=2)
    rows = x[order // 2]
    torch.testing.assert_close(got[:5], torch.cat([rows[:3] @ w_EKC[0], rows[3:5] @ w_EKC[1]]))
    assert fake.calls[-1][0] == "tune" and quack_grouped_gemm.tuned_configs.tunings == 4
    assert quack_grouped_gemm.rows_mm(torch.randn(0, 8), w_EKC, offsets).shape == (0, 16)  # no kernel
    assert torch.equal(quack_grouped_gemm.weight_grad(torch.randn(0, 8), torch.randn(0, 16), offsets), torch.zeros(2, 8, 16))
    assert len(fake.calls) == 13
    assert [quack_grouped_gemm.row_bucket(n) for n in (0, 3, 4, 5, 4096, 4097, 8192)] == [4, 4, 4, 8, 4096, 8192, 8192]
    monkeypatch.undo()
    assert [quack_grouped_gemm.row_bucket(n) for n in (1, 8192, 8193, 24000, 32768)] == [8192, 8192, 16384, 32768, 32768]


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


@pytest.mark.gpu
@gpu
def test_row_counts_of_one_bucket_reuse_the_tuned_config_and_stay_exact_bf16_cuda(monkeypatch):
    """A GEMM tuned at one row count runs other counts of its power-of-two bucket with that config:
    no new tuning, results equal to torch's grouped GEMM."""
    pytest.importorskip("quack.gemm_interface", reason="quack-kernels is not installed")
    monkeypatch.setattr(quack_grouped_gemm, "tuned_configs", quack_grouped_gemm.TunedConfigs())
    grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    torch.manual_seed(0)
    w = torch.randn(4, 256, 384, device="cuda", dtype=torch.bfloat16) * 256**-0.5  # [E, K, N]
    for rows in (10000, 9001, 16384, 12345):  # one bucket
        counts = torch.tensor([rows // 4, 0, rows // 2, rows - rows // 4 - rows // 2], device="cuda")
        offsets = counts.cumsum(0).to(torch.int32)
        a = torch.randn(rows, 256, device="cuda", dtype=torch.bfloat16)
        _close(quack_grouped_gemm.rows_mm(a, w, offsets), grouped_mm(a, w, offs=offsets))
        dh = torch.randn(rows, 384, device="cuda", dtype=torch.bfloat16)
        got_w = quack_grouped_gemm.weight_grad(a, dh, offsets)
        _close(got_w, grouped_mm(a.t(), dh, offs=offsets))
        assert torch.equal(got_w[1], torch.zeros_like(got_w[1]))
    assert quack_grouped_gemm.tuned_configs.tunings == 2
