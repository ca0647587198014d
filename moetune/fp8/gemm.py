"""The FP8 GEMMs of a training step on quantised operands, each routed to a backend's kernel.

Operands come from ``moetune.kernels.fp8_quantize`` (values in e4m3, power-of-two fp32 scales):

- ``rows_mm``: ``[N, K] x [E, C, K] -> [N, C]`` per group of rows (experts: forward and data gradient;
  a dense layer: one group, ``offsets_E=None``).
- ``weight_grad``: ``[M, N'] x [C, N'] -> [E, M, C]`` per group of the (transposed, 16-aligned) token
  columns ``quantize_columns`` writes.

Backends (``Fp8Settings.backend``): ``reference`` -> the torch references (any device); ``triton`` ->
``moetune.kernels.fp8_grouped_gemm``; ``auto`` -> torch's cuBLAS / CUTLASS FP8 GEMMs where torch has
them (``torch._scaled_mm`` for dense layers in both recipes, on the shapes ``cublas_takes_mm`` /
``cublas_takes_weight_grad`` accept; ``torch._scaled_grouped_mm`` for rowwise groups on sm90), Triton
elsewhere. Every one of them computes the same sums of the same quantised values; they differ by fp32
summation order.

Block-scaled cuBLAS and torch's check: cuBLAS reads the 128 x 128 tile scales of a weight ``[N, K]``
as rows of ``L = ceil(K / 128)`` K-blocks with a row stride of ``L`` rounded up to a multiple of 4
(16 bytes; torch's own tests pad to it, and torch pull request 166752 reports silent wrong answers
where ``L % 4 != 0``). ``torch._scaled_mm`` hands cuBLAS the pointer without a stride and checks the
layout itself (``is_blockwise_128x128_scaling``): torch 2.11 and torch's current source accept row
stride exactly ``L`` (builds of October 2025 briefly wanted ``L`` rounded up to 4). So a padded layout
is refused ("Invalid scaling configuration": Nemotron 3 Nano's 2688 -> 3712 and Moonlight's 2816 ->
2048 on an H100, torch 2.11, 2026-12-07) and an unpadded one is misread, unless ``L % 4 == 0`` (K a
multiple of 512), where the two layouts are one and either check passes. The other block-scaled dense
GEMMs go to the Triton kernel (``cublas_takes_mm``). The 1 x 128 slices' scales (activations,
gradients) need no padding.
"""

from __future__ import annotations

import torch

from moetune.fp8.settings import Fp8Settings
from moetune.kernels.fp8_grouped_gemm import fp8_rows_mm, fp8_weight_grad
from moetune.kernels.fp8_quantize import BLOCK, GROUP_ALIGN

_scaled_grouped_mm = getattr(torch, "_scaled_grouped_mm", None)
TILE_SCALE_ALIGN = 4
"""cuBLAS pads a row of 128 x 128 tile scales to a multiple of 4 (16 bytes of fp32)."""


def _impl(settings: Fp8Settings) -> str:
    return "torch" if settings.backend == "reference" else "triton"


def _torch_grouped_applies(a: torch.Tensor) -> bool:
    """torch's rowwise FP8 grouped GEMM (CUTLASS) is built for sm90 (Hopper)."""
    return _scaled_grouped_mm is not None and a.is_cuda and torch.cuda.get_device_capability(a.device) == (9, 0)


def rows_mm(
    a_NK: torch.Tensor, a_scale: torch.Tensor, b_ECK: torch.Tensor, b_scale: torch.Tensor,
    offsets_E: torch.Tensor | None, *, settings: Fp8Settings, out_dtype: torch.dtype, fast_accum: bool = False,
) -> torch.Tensor:  # fmt: skip
    """``dequant(a_rows) @ dequant(b[e])^T`` per group (``offsets_E`` its row ends; None: one group of
    all rows, then ``b`` is [1, C, K]). Scales as ``fp8_rows_mm`` takes them. ``fast_accum``: Hopper's
    fast FP8 accumulation in cuBLAS / CUTLASS (their rowwise forward GEMMs only)."""
    dense = offsets_E is None
    if settings.backend == "auto" and a_NK.is_cuda:
        # torch's FP8 GEMMs write bf16 (fp32 results, for fp32 weights' gradients, are cast from it).
        if dense and cublas_takes_mm(settings, out_features=b_ECK.shape[1], in_features=b_ECK.shape[2]):
            out = _cublas_mm(a_NK, a_scale, b_ECK[0], b_scale[0], blockwise=settings.blockwise, fast_accum=fast_accum)
            return out.to(out_dtype)
        # CUTLASS's grouped GEMM only with fast accumulation (the forward): without it (the input
        # gradient) it ran at a third of moetune's Triton kernel on an H100 (0.97 against 0.31 ms at
        # Qwen3-30B-A3B's shapes; forward 0.29 against 0.28; benchmarks/results/h100_20261207_aa8c3d1/fp8/).
        if not settings.blockwise and fast_accum and _torch_grouped_applies(a_NK):
            return _scaled_grouped_mm(
                a_NK, b_ECK.transpose(-2, -1), a_scale.reshape(-1), b_scale.reshape(b_ECK.shape[0], -1),
                offs=offsets_E, out_dtype=torch.bfloat16, use_fast_accum=fast_accum,
            ).to(out_dtype)  # fmt: skip
    if dense:
        offsets_E = torch.full((1,), a_NK.shape[0], dtype=torch.int32, device=a_NK.device)
    return fp8_rows_mm(a_NK, a_scale, b_ECK, b_scale, offsets_E, blockwise=settings.blockwise, out_dtype=out_dtype,
                       impl=_impl(settings))  # fmt: skip


def weight_grad(
    p_MN: torch.Tensor, p_scale: torch.Tensor, q_CN: torch.Tensor, q_scale: torch.Tensor,
    padded_offsets_E: torch.Tensor, block_starts_E: torch.Tensor, *, num_rows: int, dense: bool,
    settings: Fp8Settings, out_dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """[E, M, C]: group e's token columns of ``p`` and ``q`` contracted (``quantize_columns``' layout;
    ``num_rows`` the rows it quantised, which bounds a single group's columns without a host sync)."""
    if settings.backend == "auto" and p_MN.is_cuda:
        width = -(-num_rows // GROUP_ALIGN) * GROUP_ALIGN  # one group's padded end, known on the host
        if dense and cublas_takes_weight_grad(settings, rows=p_MN.shape[0], cols=q_CN.shape[0], tokens=width):
            out = _cublas_weight_grad(p_MN[:, :width], p_scale, q_CN[:, :width], q_scale, blockwise=settings.blockwise)
            return out.unsqueeze(0).to(out_dtype)
        if not settings.blockwise and _torch_grouped_applies(p_MN):
            return _scaled_grouped_mm(
                p_MN, q_CN.t(), p_scale.reshape(-1), q_scale.reshape(-1), offs=padded_offsets_E, out_dtype=torch.bfloat16
            ).to(out_dtype)
    return fp8_weight_grad(p_MN, p_scale, q_CN, q_scale, padded_offsets_E, block_starts_E, blockwise=settings.blockwise,
                           out_dtype=out_dtype, impl=_impl(settings))  # fmt: skip


def cublas_takes_mm(settings: Fp8Settings, *, out_features: int, in_features: int) -> bool:
    """Whether backend ``auto`` runs a dense ``[T, in_features] x [out_features, in_features]^T`` FP8
    GEMM in cuBLAS (``torch._scaled_mm``) rather than moetune's Triton kernel. Rowwise: always (any
    multiple of 16, which ``Fp8Linear`` guarantees). Blockwise (1 x 128 slices times 128 x 128 tiles):
    on whole 128-blocks (the Triton kernel masks partial ones), and only where the tiles' scales have a
    layout both torch and cuBLAS accept: ``in_features / 128`` a multiple of 4 (module docstring)."""
    if not settings.blockwise:
        return True
    whole_blocks = out_features % BLOCK == 0 and in_features % BLOCK == 0
    return whole_blocks and (in_features // BLOCK) % TILE_SCALE_ALIGN == 0


def cublas_takes_weight_grad(settings: Fp8Settings, *, rows: int, cols: int, tokens: int) -> bool:
    """Whether backend ``auto`` runs a dense weight gradient ``[rows, tokens] x [cols, tokens]^T`` in
    cuBLAS. Blockwise: 1 x 128 slices along the tokens on both sides (no tile scales, no padding), on
    whole 128-blocks."""
    return not settings.blockwise or all(width % BLOCK == 0 for width in (rows, cols, tokens))


def _cublas_mm(a_MK, a_scale, b_NK, b_scale, *, blockwise: bool, fast_accum: bool) -> torch.Tensor:
    """``torch._scaled_mm`` (cuBLAS): rows [M, 1] x [N, 1], or 1 x 128 slices x 128 x 128 tiles in the
    layouts ``block_scales_for_cublas`` builds."""
    if not blockwise:
        return torch._scaled_mm(a_MK, b_NK.t(), scale_a=a_scale, scale_b=b_scale.reshape(1, -1),
                                out_dtype=torch.bfloat16, use_fast_accum=fast_accum)  # fmt: skip
    scale_a, scale_b = block_scales_for_cublas(a_scale, b_scale)
    return torch._scaled_mm(a_MK, b_NK.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)


def block_scales_for_cublas(a_scale_ML: torch.Tensor, b_scale_NL: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The scales of ``a [M, K]`` (1 x 128 slices, [M, L]) and ``b [N, K]`` (128 x 128 tiles,
    [N / 128, L]) as ``torch._scaled_mm(a, b.t(), ...)`` takes them: the slices' M-major ([M, L],
    stride (1, M)), the tiles' [L, N / 128] with stride (1, L), which is also cuBLAS's layout (stride
    rounded up to 4) when ``cublas_takes_mm`` holds."""
    return a_scale_ML.t().contiguous().t(), b_scale_NL.contiguous().t()


def _cublas_weight_grad(p_MN, p_scale, q_CN, q_scale, *, blockwise: bool) -> torch.Tensor:
    """One group's ``p @ q^T`` through ``torch._scaled_mm``: rows [M, 1] x [C, 1], or 1 x 128 slices on
    both sides (along the tokens)."""
    if not blockwise:
        return torch._scaled_mm(p_MN, q_CN.t(), scale_a=p_scale.reshape(-1, 1), scale_b=q_scale.reshape(1, -1),
                                out_dtype=torch.bfloat16)  # fmt: skip
    num_blocks = -(-p_MN.shape[1] // 128)
    scale_a = p_scale[:num_blocks].t()  # [M, blocks], M-major (outer-dim-major)
    scale_b = q_scale[:num_blocks].contiguous()  # [blocks, C]
    return torch._scaled_mm(p_MN, q_CN.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
