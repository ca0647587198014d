"""moetune's FP8 Triton kernels (quantisers, grouped GEMMs) against their torch references, in Triton's
interpreter on CPU (``test_interpret_mode.py`` runs them); tests/fp8/test_fp8_gpu.py checks them on a GPU."""

from __future__ import annotations

import pytest
import torch

from moetune.kernels import fp8_grouped_gemm
from moetune.kernels.fp8_quantize import column_layout, quantize_blocks, quantize_columns, quantize_rows
from tests.conftest import rel_err
from tests.fp8.helpers import wide_range

SMALL_TILES = (16, 16, 128, 4, 1)  # the interpreter's cost grows with the tile


def _close_to_reference(q, q_ref) -> bool:
    """The interpreter truncates where the GPU rounds to nearest: at most one e4m3 step, or a binade
    at the rounding boundary, apart, on a few percent of the values."""
    differ = q.float() != q_ref.float()
    return differ.float().mean().item() < 0.1 and bool(((q.float() - q_ref.float()).abs() <= q_ref.float().abs() * 0.5 + 2**-9).all())


@pytest.mark.parametrize("block", [None, 128])
def test_quantizer_kernels_in_the_interpreter(interpret, block):
    generator = torch.Generator().manual_seed(3)
    x = wide_range(37, 300, generator=generator)
    for t in (x, x.t()):
        (q, s), (q_ref, s_ref) = quantize_rows(t, block=block, impl="triton"), quantize_rows(t, block=block, impl="torch")
        assert torch.equal(s, s_ref) and _close_to_reference(q, q_ref)
    w = wide_range(2, 130, 140, generator=generator)
    for t in (w, w.transpose(-2, -1)):
        (q, s), (q_ref, s_ref) = quantize_blocks(t, impl="triton"), quantize_blocks(t, impl="torch")
        assert torch.equal(s, s_ref) and _close_to_reference(q, q_ref)
    counts = [0, 140, 3, 0, 60]
    rows = torch.cat([wide_range(sum(counts), 24, generator=generator), torch.full((4, 24), float("nan"))])
    offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    q, s, padded = quantize_columns(rows, offsets, block=block, impl="triton")
    q_ref, s_ref, padded_ref = quantize_columns(rows, offsets, block=block, impl="torch")
    used, num_scales = int(padded_ref[-1]), len(counts) if block is None else 4
    assert torch.equal(padded, padded_ref) and torch.equal(s[:num_scales], s_ref[:num_scales])
    assert _close_to_reference(q[:, :used], q_ref[:, :used])


@pytest.mark.parametrize("block", [None, 128])
def test_column_quantizer_in_the_interpreter_with_the_callers_layout_and_one_group(interpret, block):
    """A weight gradient hands both operands' quantisations one ``column_layout``; a dense layer is one
    group (its per-column amax a plain reduction)."""
    generator = torch.Generator().manual_seed(5)
    rows = wide_range(200, 24, generator=generator)
    offsets = torch.tensor([90, 200], dtype=torch.int32)
    (q, s, padded), (q_own, s_own, padded_own) = (
        quantize_columns(rows, offsets, block=block, impl="triton", layout=layout)
        for layout in (column_layout(offsets), None)
    )  # fmt: skip
    used, num_scales = int(padded_own[-1]), 2  # past them: never written
    assert torch.equal(padded, padded_own) and torch.equal(s[:num_scales], s_own[:num_scales])
    assert torch.equal(q[:, :used].float(), q_own[:, :used].float())
    q, s, padded = quantize_columns(rows, None, block=block, impl="triton")
    q_ref, s_ref, padded_ref = quantize_columns(rows, None, block=block, impl="torch")
    used, num_scales = int(padded_ref[-1]), 1 if block is None else 2
    assert torch.equal(padded, padded_ref) and torch.equal(s[:num_scales], s_ref[:num_scales])
    assert _close_to_reference(q[:, :used], q_ref[:, :used])


@pytest.mark.parametrize("blockwise", [False, True])
def test_fp8_gemm_kernels_in_the_interpreter(interpret, blockwise):
    """Both GEMMs on operands the reference quantised: ragged groups (empty ones too), partial 128-blocks,
    a transposed weight view; equal to the dequantised fp32 GEMMs up to summation order."""
    generator = torch.Generator().manual_seed(4)
    block = 128 if blockwise else None
    counts = [0, 70, 1, 0, 60]
    offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    x = wide_range(sum(counts) + 3, 144, generator=generator)
    w = torch.randn(5, 144, 32, generator=generator).transpose(-2, -1)  # [E, 32 out, 144 in], strided
    x_q, x_s = quantize_rows(x, block=block, impl="torch")
    w_q, w_s = quantize_blocks(w, impl="torch") if blockwise else quantize_rows(w, impl="torch")
    out = fp8_grouped_gemm.fp8_rows_mm(x_q, x_s, w_q, w_s, offsets, blockwise=blockwise, out_dtype=torch.float32,
                                       impl="triton", config=SMALL_TILES)  # fmt: skip
    ref = fp8_grouped_gemm.fp8_rows_mm(x_q, x_s, w_q, w_s, offsets, blockwise=blockwise, out_dtype=torch.float32, impl="torch")
    valid = sum(counts)
    assert rel_err(out[:valid], ref[:valid]) < 1e-6
    dy = torch.randn(sum(counts) + 3, 48, generator=generator)
    p_q, p_s, padded = quantize_columns(dy, offsets, block=block, impl="torch")
    q_q, q_s, _ = quantize_columns(x, offsets, block=block, impl="torch")
    starts = column_layout(offsets)[1]
    out = fp8_grouped_gemm.fp8_weight_grad(p_q, p_s, q_q, q_s, padded, starts, blockwise=blockwise,
                                           out_dtype=torch.float32, impl="triton", config=SMALL_TILES)  # fmt: skip
    ref = fp8_grouped_gemm.fp8_weight_grad(p_q, p_s, q_q, q_s, padded, starts, blockwise=blockwise,
                                           out_dtype=torch.float32, impl="torch")  # fmt: skip
    assert rel_err(out, ref) < 1e-6 and torch.all(out[[0, 3]] == 0)  # empty experts get zeros
