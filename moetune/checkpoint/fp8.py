"""Block-scaled FP8 weights (the Hub's DeepSeek-V3 / Kimi-K2 and Qwen3 "-FP8" checkpoints)
dequantized while loading.

A weight ``W`` [rows, cols] is stored as ``W`` in float8 e4m3 plus ``W_scale_inv`` [ceil(rows /
128), ceil(cols / 128)] (fp32): every 128 x 128 block of W times its block's scale gives the
original values. Only the block of W a process holds is read, with the scales that cover it.
"""

from __future__ import annotations

import math

import torch

BLOCK = 128
SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")


def scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    rows, cols = shape
    return math.ceil(rows / BLOCK), math.ceil(cols / BLOCK)


def scale_rows_cols(row: slice, col: slice) -> tuple[slice, slice]:
    """The slice of the scales that covers rows ``row`` and columns ``col`` of the weight."""
    return slice(row.start // BLOCK, (row.stop - 1) // BLOCK + 1), slice(col.start // BLOCK, (col.stop - 1) // BLOCK + 1)


def dequantize(weight: torch.Tensor, scales: torch.Tensor, row: slice, col: slice, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` = rows ``row`` x columns ``col`` of the FP8 tensor; ``scales`` = the scales that
    cover them (``scale_rows_cols``). Returns the dequantized block in ``dtype``."""
    block_rows = torch.arange(row.start, row.stop) // BLOCK - row.start // BLOCK
    block_cols = torch.arange(col.start, col.stop) // BLOCK - col.start // BLOCK
    scale = scales.float()[block_rows][:, block_cols]
    return (weight.float() * scale).to(dtype)
