"""MXFP4 expert weights (GPT-OSS's Hub checkpoints) dequantized to bf16 / fp32 while loading.

A parameter ``P`` [E, in, out] is stored as ``P_blocks`` [E, out, in / 32, 16] (uint8, two e2m1
4-bit values per byte, low nibble first) and ``P_scales`` [E, out, in / 32] (uint8 power-of-two
exponents, bias 127) for each group of 32 values. Dequantization equals Transformers'
``convert_moe_packed_tensors``; only the experts (and rows) a process holds are read.
"""

from __future__ import annotations

import torch

# e2m1: the 16 values of a 4-bit code.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"


def quantized_shapes(param_shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(blocks, scales) shapes that store a parameter [E, in, out]."""
    experts, fan_in, fan_out = param_shape
    return (experts, fan_out, fan_in // GROUP, GROUP // 2), (experts, fan_out, fan_in // GROUP)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[E, out, groups, 16] codes and [E, out, groups] exponents -> [E, in, out] in ``dtype``."""
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match")
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    codes = blocks.to(torch.uint8)
    values = torch.stack((lut[(codes & 0x0F).int()], lut[(codes >> 4).int()]), dim=-1).flatten(-2)
    values = torch.ldexp(values, (scales.to(torch.int32) - 127).unsqueeze(-1))
    return values.flatten(-2).transpose(-2, -1).contiguous()
