"""The FP8 quantisers' references (CPU); tests/kernels/test_fp8_kernels.py checks the Triton kernels against them."""

from __future__ import annotations

import pytest
import torch

from moetune.kernels.fp8_quantize import (
    FP8_MAX,
    column_layout,
    pow2_scale,
    quantize_blocks,
    quantize_columns,
    quantize_rows,
)
from tests.fp8.helpers import wide_range

E4M3_STEP = 2.0**-3  # e4m3 keeps 3 mantissa bits: a normal value rounds within half of 2**-3 relative
E4M3_MIN_NORMAL = 2.0**-6


def _dequantized_error_ok(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> bool:
    """Every value round-trips within half an e4m3 step (relative), or within half the smallest
    subnormal step (2**-10 x scale) where it falls below e4m3's normal range."""
    back = q.float() * scale
    bound = torch.maximum(x.float().abs() * E4M3_STEP / 2, scale * 2.0**-10)
    return bool(((back - x.float()).abs() <= bound * (1 + 1e-6)).all())


def test_pow2_scale_is_the_smallest_power_of_two_that_fits_448():
    amax = torch.cat([torch.tensor([448.0, 449.0, 1.0, 1.75, 1.7500001, 3e38, 1e-30, 0.0]), torch.rand(1000) * 1e4])
    scale = pow2_scale(amax)
    mantissa, _ = torch.frexp(scale)
    assert torch.all(mantissa == 0.5)  # powers of two
    fits = amax.clamp(min=2.0**-100) / scale <= FP8_MAX
    assert fits.all() and (amax.clamp(min=2.0**-100) / (scale / 2) > FP8_MAX).all()  # and the smallest such
    assert pow2_scale(torch.tensor([448.0])).item() == 1.0 and pow2_scale(torch.tensor([449.0])).item() == 2.0


@pytest.mark.parametrize("block", [None, 128])
def test_rows_round_trip_and_scale_per_row_or_slice(block):
    generator = torch.Generator().manual_seed(0)
    x = wide_range(7, 300, generator=generator)
    q, scale = quantize_rows(x, block=block, impl="torch")
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and q.is_contiguous()
    if block is None:
        assert scale.shape == (7, 1)
        amax = x.abs().amax(1, keepdim=True)
        assert torch.equal(scale, pow2_scale(amax))
        assert _dequantized_error_ok(x, q, scale)
    else:
        assert scale.shape == (7, 3)
        for j in range(3):
            part = x[:, 128 * j : 128 * (j + 1)]
            assert torch.equal(scale[:, j], pow2_scale(part.abs().amax(1)))
            assert _dequantized_error_ok(part, q[:, 128 * j : 128 * (j + 1)], scale[:, j : j + 1])


def test_rows_of_a_transposed_batched_view_equal_its_copy():
    w = torch.randn(3, 40, 272)
    for block in (None, 128):
        q, scale = quantize_rows(w.transpose(-2, -1), block=block, impl="torch")
        q_copy, scale_copy = quantize_rows(w.transpose(-2, -1).contiguous(), block=block, impl="torch")
        assert torch.equal(q.float(), q_copy.float()) and torch.equal(scale, scale_copy) and scale.shape[:2] == (3, 272)


def test_blocks_scale_each_128_tile():
    generator = torch.Generator().manual_seed(1)
    w = wide_range(2, 200, 300, generator=generator)
    q, scale = quantize_blocks(w, impl="torch")
    assert scale.shape == (2, 2, 3)
    for e in range(2):
        for i in range(2):
            for j in range(3):
                tile = w[e, 128 * i : 128 * (i + 1), 128 * j : 128 * (j + 1)]
                assert scale[e, i, j] == pow2_scale(tile.abs().amax())
                assert _dequantized_error_ok(tile, q[e, 128 * i : 128 * (i + 1), 128 * j : 128 * (j + 1)], scale[e, i, j])


@pytest.mark.parametrize("block", [None, 128])
def test_columns_per_group_transposed_aligned_and_padding_rows_unread(block):
    generator = torch.Generator().manual_seed(2)
    counts = [0, 200, 3, 0, 129]
    x = wide_range(sum(counts) + 5, 48, generator=generator)
    x[sum(counts) :] = float("nan")  # padding rows past the last group
    offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    q, scale, padded = quantize_columns(x, offsets, block=block, impl="torch")
    assert padded.tolist() == [0, 208, 224, 224, 368]  # each group from a multiple of 16 on
    assert q.shape[0] == 48 and q.shape[1] % 16 == 0
    assert not torch.isnan(q.float()).any() and not torch.isnan(scale).any()
    starts, block_starts = [0, 0, 208, 224, 224], column_layout(offsets)[1].tolist()
    assert block_starts == [0, 0, 2, 3, 3]
    row = 0
    for group, count in enumerate(counts):
        rows, values = x[row : row + count], q[:, starts[group] : starts[group] + count].t()
        gap = q[:, starts[group] + count : int(padded[group])]
        assert torch.all(gap.float() == 0)
        for j in range(-(-count // 128)):
            part = slice(128 * j, 128 * (j + 1))
            s = scale[group] if block is None else scale[block_starts[group] + j]
            expected = pow2_scale(rows.abs().amax(0)) if block is None else pow2_scale(rows[part].abs().amax(0))
            assert torch.equal(s, expected)
            assert _dequantized_error_ok(rows[part], values[part], s)
        row += count


def test_quantizers_name_bad_arguments():
    with pytest.raises(ValueError, match="block must be None .* or 128"):
        quantize_rows(torch.zeros(2, 4), block=64)
    with pytest.raises(ValueError, match="2-D or 3-D"):
        quantize_rows(torch.zeros(4), impl="torch")
    with pytest.raises(ValueError, match=r"expected \[N, C\] rows"):
        quantize_columns(torch.zeros(2, 3, 4))
