"""Which dense FP8 GEMMs backend ``auto`` sends to cuBLAS (``torch._scaled_mm``), and the scale layouts
it hands over, on CPU: the block-scaled GEMMs whose 128 x 128 tile scales no layout can serve both
torch's check and cuBLAS's read go to moetune's Triton kernel (torch 2.11 refused Nemotron 3 Nano's and
Moonlight's shared-expert GEMMs on an H100 on 2026-12-07; Qwen3's ran)."""

from __future__ import annotations

import pytest
import torch

from moetune.fp8 import Fp8Settings
from moetune.fp8.gemm import TILE_SCALE_ALIGN, block_scales_for_cublas, cublas_takes_mm, cublas_takes_weight_grad

BLOCKWISE, ROWWISE = Fp8Settings("blockwise"), Fp8Settings("rowwise")
# (out_features, in_features) of dense layers, forward and input gradient (the transposed weight).
REFUSED_ON_H100 = [(3712, 2688), (2048, 2816)]  # Nemotron 3 Nano's shared expert up, Moonlight's down
RAN_ON_H100 = [(4096, 2048), (512, 2048), (2048, 4096)]  # Qwen3-30B-A3B's q / k / o projections
NEVER_CUBLAS_BLOCKWISE = [(2688, 3712), (4096, 2880), (2880, 4096)]  # 29 K-blocks; GPT-OSS's partial blocks
CUBLAS_BLOCKWISE = [(2816, 2048), (128, 512)]


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _torch_accepts_tiles(scale_b: torch.Tensor, out_features: int, in_features: int) -> bool:
    """torch 2.11's ``is_blockwise_128x128_scaling`` on ``scale_b.t()`` for ``b.t()`` = [N, K]
    (aten/src/ATen/native/cuda/ScaledBlas.cpp): size (ceil(N/128), L), strides (L, 1), a stride of a
    dimension of size 1 not checked."""
    scale, num_k = scale_b.t(), -(-in_features // 128)
    sizes_ok = tuple(scale.shape) == (-(-out_features // 128), num_k)
    return sizes_ok and all(size <= 1 or scale.stride(d) == want for d, (size, want) in enumerate(zip(scale.shape, (num_k, 1))))


def _torch_accepts_slices(scale_a: torch.Tensor, rows: int, in_features: int) -> bool:
    """torch's ``is_blockwise_1x128_scaling``: size (M, L), strides (1, M)."""
    return tuple(scale_a.shape) == (rows, -(-in_features // 128)) and scale_a.stride() == (1, rows)


def _cublas_reads_tiles(scale_b: torch.Tensor, num_n: int, num_k: int) -> torch.Tensor:
    """[N / 128, L] as cuBLAS reads the tile scales from their pointer: rows of L K-blocks, row
    stride L rounded up to 4."""
    stride = _round_up(num_k, TILE_SCALE_ALIGN)
    memory = torch.full((num_n * stride,), float("nan"))  # past the allocation: nothing the weight owns
    stored = torch.as_strided(scale_b, (min(scale_b.untyped_storage().nbytes() // 4, memory.numel()),), (1,), 0)
    memory[: stored.numel()] = stored
    return memory.reshape(num_n, stride)[:, :num_k]


def _tile_scales(out_features: int, in_features: int) -> torch.Tensor:
    """Distinct values, as ``quantize_blocks`` lays them out ([N / 128, L], contiguous)."""
    return torch.arange(out_features // 128 * (in_features // 128), dtype=torch.float32).reshape(out_features // 128, -1) + 1


@pytest.mark.parametrize("shape", REFUSED_ON_H100 + NEVER_CUBLAS_BLOCKWISE)
def test_block_scaled_gemms_cublas_cannot_take_go_to_triton(shape):
    out_features, in_features = shape
    assert not cublas_takes_mm(BLOCKWISE, out_features=out_features, in_features=in_features)
    assert cublas_takes_mm(ROWWISE, out_features=out_features, in_features=in_features)


@pytest.mark.parametrize("shape", RAN_ON_H100 + CUBLAS_BLOCKWISE)
def test_block_scaled_gemms_go_to_cublas_where_its_layout_is_torchs(shape):
    out_features, in_features = shape
    assert cublas_takes_mm(BLOCKWISE, out_features=out_features, in_features=in_features)
    rows = 40
    a_scale = torch.rand(rows, in_features // 128)
    b_scale = _tile_scales(out_features, in_features)
    scale_a, scale_b = block_scales_for_cublas(a_scale, b_scale)
    assert _torch_accepts_slices(scale_a, rows, in_features) and torch.equal(scale_a, a_scale)
    assert _torch_accepts_tiles(scale_b, out_features, in_features) and torch.equal(scale_b.t(), b_scale)
    assert torch.equal(_cublas_reads_tiles(scale_b, out_features // 128, in_features // 128), b_scale)


@pytest.mark.parametrize("shape", REFUSED_ON_H100)
def test_no_tile_scale_layout_serves_torch_and_cublas_where_routing_refuses(shape):
    """The layout torch accepts is misread by cuBLAS; the padded layout cuBLAS reads (what the
    2026-12-07 run passed) is refused by torch."""
    out_features, in_features = shape
    num_n, num_k = out_features // 128, in_features // 128
    b_scale = _tile_scales(out_features, in_features)
    _, accepted = block_scales_for_cublas(torch.ones(8, num_k), b_scale)
    assert _torch_accepts_tiles(accepted, out_features, in_features)
    assert not torch.equal(_cublas_reads_tiles(accepted, num_n, num_k), b_scale)
    padded = torch.nn.functional.pad(b_scale, (0, _round_up(num_k, TILE_SCALE_ALIGN) - num_k))[:, :num_k].t()
    assert torch.equal(_cublas_reads_tiles(padded, num_n, num_k), b_scale)
    assert not _torch_accepts_tiles(padded, out_features, in_features)


def test_weight_gradients_need_whole_blocks_only():
    """1 x 128 slices along the tokens on both sides: no tile scales, so no padding rule."""
    assert cublas_takes_weight_grad(BLOCKWISE, rows=3712, cols=2688, tokens=4096)
    assert not cublas_takes_weight_grad(BLOCKWISE, rows=2880, cols=4096, tokens=4096)
    assert not cublas_takes_weight_grad(BLOCKWISE, rows=2048, cols=4096, tokens=4000)
    assert cublas_takes_weight_grad(ROWWISE, rows=2880, cols=4096, tokens=4000)
