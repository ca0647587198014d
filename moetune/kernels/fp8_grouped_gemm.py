"""FP8 (e4m3) grouped GEMMs in Triton, scaled by rows or by 128-blocks, fp32 accumulation.

The operands come from ``moetune.kernels.fp8_quantize``; a dense linear is the one-group case.

- ``fp8_rows_mm(a_NK, a_scale, b_ECK, b_scale, offsets_E, *, block)``: ragged M, as the experts'
  forward and data-gradient GEMMs. Rows ``offsets[e-1]:offsets[e]`` of the output are
  ``dequant(a_rows) @ dequant(b[e])^T``; ``b`` is in the weight's [E, out, in] layout (any strides; the
  kernel reads it K-major when its last dimension is contiguous, which Hopper's FP8 tensor-core
  instruction wants). Rows ``>= offsets[-1]`` are padding: left unwritten.
  Scales: rows ``a_scale`` [N, 1] and ``b_scale`` [E, C, 1] (applied once to the fp32 sum), or
  blocks ``a_scale`` [N, ceil(K / 128)] and ``b_scale`` [E, ceil(C / 128), ceil(K / 128)] (each
  128-wide slice of K accumulated, scaled and added in fp32, as DeepSeek-V3's kernels promote).
- ``fp8_weight_grad(p_MN, p_scale, q_CN, q_scale, padded_offsets_E, block_starts_E, *, block)``: ragged
  K, the weight gradient: ``out[e] = dequant(p[:, rows_e]) @ dequant(q[:, rows_e])^T`` over group e's
  columns of the transposed, 16-aligned layout ``quantize_columns`` writes (``padded_offsets_E`` its
  group ends); scales [E, M] / [E, C] per group, or [NB, M] / [NB, C] per 128 columns of a group
  (block ``block_starts_E[e] + j``). A group with no rows gets zeros.

Why Triton: torch has FP8 GEMMs scaled by rows (``torch._scaled_mm``, ``torch._scaled_grouped_mm``)
and, for dense GEMMs, by DeepSeek-V3's blocks (cuBLAS), but no grouped GEMM scaled by blocks; these
kernels are that one (and an alternative for the others; ``moetune/fp8/README.md`` records which
runs where, by measurement).

Shape legend: N rows sorted by group, K reduction width, C output columns, E groups, M gradient rows.
"""

from __future__ import annotations

import torch

from moetune.kernels._triton_utils import HAS_TRITON, Impl, device_of, next_pow2, tl, triton, use_triton
from moetune.kernels.fp8_quantize import BLOCK

if HAS_TRITON:
    from moetune.kernels.grouped_gemm import _rows_tile


def _dequantize_along(values: torch.Tensor, scale: torch.Tensor, dim: int) -> torch.Tensor:
    """fp32 ``values * scale`` with ``scale`` holding one value per ``BLOCK`` entries (or one in all)
    along ``dim``."""
    values = values.float()
    if scale.shape[dim] == 1:
        return values * scale
    expanded = scale.repeat_interleave(BLOCK, dim=dim).narrow(dim, 0, values.shape[dim])
    return values * expanded


def _dequantize_weight(b_CK: torch.Tensor, scale: torch.Tensor, *, blockwise: bool) -> torch.Tensor:
    """``b`` [C, K] with scale [C, 1] (rows) or [ceil(C/128), ceil(K/128)] (blocks), in fp32."""
    if not blockwise:
        return b_CK.float() * scale
    full = scale.repeat_interleave(BLOCK, 0)[: b_CK.shape[0]].repeat_interleave(BLOCK, 1)[:, : b_CK.shape[1]]
    return b_CK.float() * full


def fp8_rows_mm_reference(a_NK, a_scale, b_ECK, b_scale, offsets_E, *, blockwise: bool, out_dtype=torch.bfloat16):
    """Per-group loop (one host sync), dequantised operands multiplied in fp32; padding rows zero."""
    a = _dequantize_along(a_NK, a_scale, 1)
    out = torch.zeros(a_NK.shape[0], b_ECK.shape[1], dtype=out_dtype, device=a_NK.device)
    ends = offsets_E.tolist()
    for group, (start, end) in enumerate(zip([0, *ends[:-1]], ends)):
        if end > start:
            out[start:end] = (a[start:end] @ _dequantize_weight(b_ECK[group], b_scale[group], blockwise=blockwise).t()).to(out_dtype)
    return out


def fp8_weight_grad_reference(
    p_MN, p_scale, q_CN, q_scale, padded_offsets_E, block_starts_E, *, blockwise: bool, out_dtype=torch.bfloat16
) -> torch.Tensor:
    num_groups = padded_offsets_E.numel()
    out = torch.zeros(num_groups, p_MN.shape[0], q_CN.shape[0], dtype=out_dtype, device=p_MN.device)
    ends = padded_offsets_E.tolist()
    for group, (start, end) in enumerate(zip([0, *ends[:-1]], ends)):
        p, q = p_MN[:, start:end].float(), q_CN[:, start:end].float()
        if not blockwise:
            p, q = p * p_scale[group][:, None], q * q_scale[group][:, None]
        else:
            first = int(block_starts_E[group])
            for j, c0 in enumerate(range(0, end - start, BLOCK)):
                p[:, c0 : c0 + BLOCK] *= p_scale[first + j][:, None]
                q[:, c0 : c0 + BLOCK] *= q_scale[first + j][:, None]
        out[group] = (p @ q.t()).to(out_dtype)
    return out


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); BLOCK_K = 128 keeps each k-step inside one
# scale block.
ROWS_CONFIG = (128, 128, 128, 8, 3)
WEIGHT_GRAD_CONFIG = (128, 128, 128, 8, 3)


if HAS_TRITON:

    @triton.jit
    def _fp8_rows_kernel(
        a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, offsets_ptr,
        num_cols, K, num_k_blocks,
        stride_am, stride_ak, stride_be, stride_bc, stride_bk, stride_bse, stride_bsc, stride_bsk, stride_cm,
        E: tl.constexpr, E_POW2: tl.constexpr, BLOCKWISE: tl.constexpr, SCALE_BLOCK: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        # Program = (M tile, column tile), column tiles innermost, as moetune.kernels.grouped_gemm's.
        group, rows, row_mask, cols, col_mask = _rows_tile(offsets_ptr, num_cols, E, E_POW2, BLOCK_M, BLOCK_N)
        if group >= E:
            return
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_am + ks[None, :] * stride_ak
        b_ptrs = b_ptr + group.to(tl.int64) * stride_be + cols.to(tl.int64)[None, :] * stride_bc + ks[:, None] * stride_bk
        as_rows = as_ptr + rows.to(tl.int64) * num_k_blocks
        bs_base = bs_ptr + group.to(tl.int64) * stride_bse
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = k0 + ks < K
            a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            if BLOCKWISE:
                a_scale = tl.load(as_rows + k0 // SCALE_BLOCK, mask=row_mask, other=0.0)
                b_scale = tl.load(bs_base + (cols // SCALE_BLOCK) * stride_bsc + (k0 // SCALE_BLOCK) * stride_bsk,
                                  mask=col_mask, other=0.0)  # fmt: skip
                acc += tl.dot(a, b) * (a_scale[:, None] * b_scale[None, :])
            else:
                acc = tl.dot(a, b, acc)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        if not BLOCKWISE:
            a_scale = tl.load(as_rows, mask=row_mask, other=0.0)
            b_scale = tl.load(bs_base + cols * stride_bsc, mask=col_mask, other=0.0)
            acc = acc * (a_scale[:, None] * b_scale[None, :])
        c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])

    @triton.jit
    def _fp8_weight_grad_kernel(
        p_ptr, ps_ptr, q_ptr, qs_ptr, out_ptr, ends_ptr, block_starts_ptr,
        M, num_cols, stride_pm, stride_qc, stride_oe, stride_om,
        BLOCKWISE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        # Program = (group, M tile, column tile), group outermost; the reduction runs over the group's
        # padded columns (the gaps hold zeros), BLOCK_K (= the scale block) at a time.
        pid = tl.program_id(0)
        num_m_tiles = tl.cdiv(M, BLOCK_M)
        num_col_tiles = tl.cdiv(num_cols, BLOCK_N)
        group = pid // (num_m_tiles * num_col_tiles)
        tile = pid % (num_m_tiles * num_col_tiles)
        ms = (tile // num_col_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = (tile % num_col_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask, col_mask = ms < M, cols < num_cols
        start = tl.load(ends_ptr + group - 1, mask=group > 0, other=0)
        end = tl.load(ends_ptr + group)
        first_block = tl.load(block_starts_ptr + group)
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r0 in range(start, end, BLOCK_K):
            r = r0 + ks
            r_mask = r < end
            p = tl.load(p_ptr + ms.to(tl.int64)[:, None] * stride_pm + r[None, :], mask=m_mask[:, None] & r_mask[None, :], other=0.0)
            q = tl.load(q_ptr + cols.to(tl.int64)[None, :] * stride_qc + r[:, None], mask=r_mask[:, None] & col_mask[None, :], other=0.0)
            if BLOCKWISE:
                block = (first_block + (r0 - start) // BLOCK_K).to(tl.int64)
                p_scale = tl.load(ps_ptr + block * M + ms, mask=m_mask, other=0.0)
                q_scale = tl.load(qs_ptr + block * num_cols + cols, mask=col_mask, other=0.0)
                acc += tl.dot(p, q) * (p_scale[:, None] * q_scale[None, :])
            else:
                acc = tl.dot(p, q, acc)
        if not BLOCKWISE:
            p_scale = tl.load(ps_ptr + group.to(tl.int64) * M + ms, mask=m_mask, other=0.0)
            q_scale = tl.load(qs_ptr + group.to(tl.int64) * num_cols + cols, mask=col_mask, other=0.0)
            acc = acc * (p_scale[:, None] * q_scale[None, :])
        out_ptrs = out_ptr + group.to(tl.int64) * stride_oe + ms[:, None] * stride_om + cols[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & col_mask[None, :])


def _check_fp8(name: str, *tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dtype != torch.float8_e4m3fn:
            raise TypeError(f"{name}: operands must be float8_e4m3fn (moetune.kernels.fp8_quantize), got {t.dtype}")


def fp8_rows_mm(
    a_NK: torch.Tensor, a_scale: torch.Tensor, b_ECK: torch.Tensor, b_scale: torch.Tensor, offsets_E: torch.Tensor,
    *, blockwise: bool, out_dtype: torch.dtype = torch.bfloat16, impl: Impl = "auto",
    config: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:  # fmt: skip
    """[N, C]: rows of group e times ``b[e]^T``, both dequantised (see the module docstring)."""
    _check_fp8("fp8_rows_mm", a_NK, b_ECK)
    if b_ECK.dim() != 3 or b_ECK.shape[0] != offsets_E.numel() or b_ECK.shape[2] != a_NK.shape[1]:
        raise ValueError(f"fp8_rows_mm: b must be [E={offsets_E.numel()}, C, K={a_NK.shape[1]}], got {tuple(b_ECK.shape)}")
    if not use_triton(impl, a_NK, b_ECK):
        return fp8_rows_mm_reference(a_NK, a_scale, b_ECK, b_scale, offsets_E, blockwise=blockwise, out_dtype=out_dtype)
    num_rows, k = a_NK.shape
    num_experts, num_cols, _ = b_ECK.shape
    out = torch.empty(num_rows, num_cols, dtype=out_dtype, device=a_NK.device)
    if num_rows == 0 or num_cols == 0:
        return out
    a_scale = a_scale.contiguous()
    block_m, block_n, block_k, num_warps, num_stages = config or ROWS_CONFIG
    grid = ((triton.cdiv(num_rows, block_m) + num_experts) * triton.cdiv(num_cols, block_n),)
    with device_of(a_NK):
        _fp8_rows_kernel[grid](
            a_NK, a_scale, b_ECK, b_scale, out, offsets_E,
            num_cols, k, a_scale.shape[-1],
            a_NK.stride(0), a_NK.stride(1), b_ECK.stride(0), b_ECK.stride(1), b_ECK.stride(2),
            b_scale.stride(0), b_scale.stride(1), b_scale.stride(2), out.stride(0),
            E=num_experts, E_POW2=next_pow2(num_experts), BLOCKWISE=blockwise, SCALE_BLOCK=BLOCK,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
    return out


def fp8_weight_grad(
    p_MN: torch.Tensor, p_scale: torch.Tensor, q_CN: torch.Tensor, q_scale: torch.Tensor,
    padded_offsets_E: torch.Tensor, block_starts_E: torch.Tensor, *, blockwise: bool,
    out_dtype: torch.dtype = torch.bfloat16, impl: Impl = "auto", config: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:  # fmt: skip
    """[E, M, C]: group e's columns of ``p`` times those of ``q``, transposed, both dequantised."""
    _check_fp8("fp8_weight_grad", p_MN, q_CN)
    if p_MN.shape[1] != q_CN.shape[1] or p_MN.stride(1) != 1 or q_CN.stride(1) != 1:
        raise ValueError(
            f"fp8_weight_grad: p and q must be [M, N'] and [C, N'] with contiguous rows (quantize_columns), got "
            f"{tuple(p_MN.shape)} / {tuple(q_CN.shape)}"
        )
    if not use_triton(impl, p_MN, q_CN):
        return fp8_weight_grad_reference(p_MN, p_scale, q_CN, q_scale, padded_offsets_E, block_starts_E,
                                         blockwise=blockwise, out_dtype=out_dtype)  # fmt: skip
    num_groups, m, num_cols = padded_offsets_E.numel(), p_MN.shape[0], q_CN.shape[0]
    out = torch.empty(num_groups, m, num_cols, dtype=out_dtype, device=p_MN.device)
    if out.numel() == 0:
        return out
    block_m, block_n, block_k, num_warps, num_stages = config or WEIGHT_GRAD_CONFIG
    grid = (num_groups * triton.cdiv(m, block_m) * triton.cdiv(num_cols, block_n),)
    with device_of(p_MN):
        _fp8_weight_grad_kernel[grid](
            p_MN, p_scale, q_CN, q_scale, out, padded_offsets_E, block_starts_E,
            m, num_cols, p_MN.stride(0), q_CN.stride(0), out.stride(0), out.stride(1),
            BLOCKWISE=blockwise, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
    return out
