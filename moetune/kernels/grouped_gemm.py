"""Grouped GEMMs of the experts in Triton, with the token gather fused into the operand loads.

Two kernels, both with the group boundaries on the device (no host sync, CUDA-graph capturable):

- ``grouped_rows_mm(a, b_EKN, offsets_E, *, gather_order=, top_k=)``: ragged M. Rows
  ``offsets[e-1]:offsets[e]`` of the output are ``a_rows @ b[e]``, where ``a_rows`` are ``a``'s
  rows or, with ``gather_order``, rows ``a[gather_order // top_k]`` read straight from ``a`` (the
  MoE dispatch gather, without writing the [N, H] permuted copy). Rows ``>= offsets[-1]`` are
  padding: left unwritten. ``b`` may have any strides (a transposed view of a weight).
- ``grouped_weight_grad(p, q, offsets_E, *, out=, q_gather_order=, top_k=)``: ragged K.
  ``out[e] = p[rows_e]^T @ q[rows_e]``, the weight gradient of the GEMM above; an expert with no
  rows gets zeros; ``q``'s rows may be gathered the same way.

Why: torch's ``_grouped_mm`` (CUTLASS) runs these shapes (128 experts of ~256 rows, H 2048, I 768)
at ~440 TFLOP/s on an H200 while dense GEMMs reach 700-800, and the dispatch gather is a separate
bandwidth-bound pass; ``benchmarks/probes/grouped_gemm_probe.py`` measures both against this file.

How the ragged M tiles find their expert: each program loads the E group ends (one small vector),
counts the M tiles of every group (``cdiv(count, BLOCK_M)``), takes their running sum and finds its
own tile's group by comparison; the grid is the upper bound ``cdiv(N, BLOCK_M) + E`` tiles and the
programs past the last real tile return at once.

Shape legend: N rows sorted by expert, E experts, K reduction width, C output columns.
"""

from __future__ import annotations

import torch

from moetune.kernels._triton_utils import HAS_TRITON, Impl, device_of, next_pow2, tl, triton, use_triton

grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
"""torch's bf16 grouped GEMM (``F.grouped_mm`` where torch has it, ``torch._grouped_mm`` before)."""


def grouped_mm_supported(x: torch.Tensor) -> bool:
    """torch's grouped GEMM: CUDA sm80+, bf16. (CPU has no autograd-safe kernel for fp32 weights.)"""
    return grouped_mm_runs(x.device, x.dtype)


def grouped_mm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """``grouped_mm_supported`` for rows of ``dtype`` on ``device``."""
    return (
        grouped_mm is not None
        and device.type == "cuda"
        and dtype == torch.bfloat16
        and torch.cuda.get_device_capability(device) >= (8, 0)
    )


def grouped_rows_mm_reference(
    a: torch.Tensor, b_EKC: torch.Tensor, offsets_E: torch.Tensor, *,
    gather_order: torch.Tensor | None = None, top_k: int = 1,
) -> torch.Tensor:  # fmt: skip
    """Per-expert loop (one host sync for the boundaries); padding rows are zero here."""
    rows = a if gather_order is None else a.index_select(0, gather_order // top_k)
    out = rows.new_zeros(rows.shape[0], b_EKC.shape[-1])
    compute = torch.promote_types(a.dtype, torch.float32)
    ends = offsets_E.tolist()
    for expert, (start, end) in enumerate(zip([0, *ends[:-1]], ends)):
        if end > start:
            out[start:end] = (rows[start:end].to(compute) @ b_EKC[expert].to(compute)).to(out.dtype)
    return out


def grouped_weight_grad_reference(
    p: torch.Tensor, q: torch.Tensor, offsets_E: torch.Tensor, *,
    q_gather_order: torch.Tensor | None = None, top_k: int = 1,
) -> torch.Tensor:  # fmt: skip
    q_rows = q if q_gather_order is None else q.index_select(0, q_gather_order // top_k)
    out = p.new_zeros(offsets_E.numel(), p.shape[1], q.shape[1])
    compute = torch.promote_types(p.dtype, torch.float32)
    ends = offsets_E.tolist()
    for expert, (start, end) in enumerate(zip([0, *ends[:-1]], ends)):
        out[expert] = (p[start:end].to(compute).t() @ q_rows[start:end].to(compute)).to(out.dtype)
    return out


# Launch settings (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); measured on an H200 by
# benchmarks/probes/grouped_gemm_probe.py. Overridable for the probe through ``config=``.
ROWS_CONFIG = (128, 128, 64, 8, 4)
WEIGHT_GRAD_CONFIG = (128, 128, 64, 8, 4)


if HAS_TRITON:

    @triton.jit
    def _group_of_tile(offsets_ptr, tile, E: tl.constexpr, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr):
        # (group, first row of the tile, end row of the group); group == E past the last tile.
        groups = tl.arange(0, E_POW2)
        ends = tl.load(offsets_ptr + groups, mask=groups < E, other=0).to(tl.int32)
        starts = tl.load(offsets_ptr + groups - 1, mask=(groups > 0) & (groups < E), other=0).to(tl.int32)
        tiles = tl.where(groups < E, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
        tile_ends = tl.cumsum(tiles, 0)
        group = tl.sum((tile_ends <= tile).to(tl.int32), 0)
        chosen = groups == group
        first_tile = tl.sum(tl.where(chosen, tile_ends - tiles, 0), 0)
        row = tl.sum(tl.where(chosen, starts, 0), 0) + (tile - first_tile) * BLOCK_M
        end = tl.sum(tl.where(chosen, ends, 0), 0)
        return group, row, end

    @triton.jit
    def _rows_tile(offsets_ptr, num_cols, E: tl.constexpr, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        # This program's (group, rows, row mask, columns, column mask) of a ragged-M GEMM, column
        # tiles innermost; group == E past the last tile.
        pid = tl.program_id(0)
        num_col_tiles = tl.cdiv(num_cols, BLOCK_N)
        group, row0, end = _group_of_tile(offsets_ptr, pid // num_col_tiles, E, E_POW2, BLOCK_M)
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = (pid % num_col_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        return group, rows, rows < end, cols, cols < num_cols

    @triton.jit
    def _grouped_rows_kernel(
        a_ptr, order_ptr, b_ptr, c_ptr, offsets_ptr,
        num_cols, K, top_k,
        stride_am, stride_ak, stride_be, stride_bk, stride_bc, stride_cm, stride_cc,
        E: tl.constexpr, E_POW2: tl.constexpr, GATHER: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        # Program = (M tile, column tile), column tiles innermost: the programs that run together
        # share the A tile, and the next M tile of the same group finds b[group] in L2.
        group, rows, row_mask, cols, col_mask = _rows_tile(offsets_ptr, num_cols, E, E_POW2, BLOCK_M, BLOCK_N)
        if group >= E:
            return
        src = rows.to(tl.int64)
        if GATHER:
            src = tl.load(order_ptr + rows, mask=row_mask, other=0).to(tl.int64) // top_k
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + src[:, None] * stride_am + ks[None, :] * stride_ak
        b_ptrs = b_ptr + group.to(tl.int64) * stride_be + ks[:, None] * stride_bk + cols[None, :] * stride_bc
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = k0 + ks < K
            a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            acc = tl.dot(a, b, acc)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :] * stride_cc
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])

    @triton.jit
    def _grouped_weight_grad_kernel(
        p_ptr, q_ptr, order_ptr, out_ptr, offsets_ptr,
        M, num_cols, top_k,
        stride_pn, stride_pm, stride_qn, stride_qc, stride_oe, stride_om, stride_oc,
        GATHER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        # Program = (group, M tile, column tile), group outermost: the tiles of one group run
        # together and share its rows of p and q in L2. The reduction runs over the group's rows.
        pid = tl.program_id(0)
        num_m_tiles = tl.cdiv(M, BLOCK_M)
        num_col_tiles = tl.cdiv(num_cols, BLOCK_N)
        tiles_per_group = num_m_tiles * num_col_tiles
        group = pid // tiles_per_group
        tile = pid % tiles_per_group
        ms = (tile // num_col_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = (tile % num_col_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask, col_mask = ms < M, cols < num_cols
        start = tl.load(offsets_ptr + group - 1, mask=group > 0, other=0).to(tl.int32)
        end = tl.load(offsets_ptr + group).to(tl.int32)
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r0 in range(start, end, BLOCK_K):
            rows = r0 + ks
            r_mask = rows < end
            src = rows.to(tl.int64)
            if GATHER:
                src = tl.load(order_ptr + rows, mask=r_mask, other=0).to(tl.int64) // top_k
            p = tl.load(p_ptr + rows.to(tl.int64)[None, :] * stride_pn + ms[:, None] * stride_pm,
                        mask=r_mask[None, :] & m_mask[:, None], other=0.0)  # fmt: skip
            q = tl.load(q_ptr + src[:, None] * stride_qn + cols[None, :] * stride_qc,
                        mask=r_mask[:, None] & col_mask[None, :], other=0.0)  # fmt: skip
            acc = tl.dot(p, q, acc)
        out_ptrs = out_ptr + group.to(tl.int64) * stride_oe + ms[:, None] * stride_om + cols[None, :] * stride_oc
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & col_mask[None, :])


def _check_operands(name: str, a: torch.Tensor, offsets_E: torch.Tensor, gather_order: torch.Tensor | None) -> None:
    if offsets_E.dim() != 1 or offsets_E.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: offsets_E must be a 1-D int32/int64 tensor of group ends, got {offsets_E.dtype} {tuple(offsets_E.shape)}")  # fmt: skip
    if gather_order is not None and (gather_order.dim() != 1 or gather_order.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"{name}: gather_order must be a 1-D int32/int64 tensor, got {gather_order.dtype} {tuple(gather_order.shape)}")  # fmt: skip
    if a.dim() != 2:
        raise ValueError(f"{name}: expected 2-D rows, got {tuple(a.shape)}")


def grouped_rows_mm(
    a: torch.Tensor, b_EKC: torch.Tensor, offsets_E: torch.Tensor, *,
    gather_order: torch.Tensor | None = None, top_k: int = 1, impl: Impl = "auto",
    config: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:  # fmt: skip
    """[N, C] rows ``a_rows[offsets[e-1]:offsets[e]] @ b_EKC[e]`` (fp32 accumulation, a's dtype out);
    N = ``gather_order.numel()`` with a gather, else ``a.shape[0]``; rows ``>= offsets[-1]`` unwritten."""
    _check_operands("grouped_rows_mm", a, offsets_E, gather_order)
    if b_EKC.dim() != 3 or b_EKC.shape[0] != offsets_E.numel() or b_EKC.shape[1] != a.shape[1]:
        raise ValueError(f"grouped_rows_mm: b must be [E={offsets_E.numel()}, K={a.shape[1]}, C], got {tuple(b_EKC.shape)}")  # fmt: skip
    if not use_triton(impl, a, b_EKC):
        return grouped_rows_mm_reference(a, b_EKC, offsets_E, gather_order=gather_order, top_k=top_k)
    num_rows = a.shape[0] if gather_order is None else gather_order.numel()
    num_experts, k, num_cols = b_EKC.shape
    out = torch.empty(num_rows, num_cols, dtype=a.dtype, device=a.device)
    if num_rows == 0 or num_cols == 0:
        return out
    block_m, block_n, block_k, num_warps, num_stages = config or ROWS_CONFIG
    grid = ((triton.cdiv(num_rows, block_m) + num_experts) * triton.cdiv(num_cols, block_n),)
    with device_of(a):
        _grouped_rows_kernel[grid](
            a, gather_order if gather_order is not None else offsets_E, b_EKC, out, offsets_E,
            num_cols, k, top_k,
            a.stride(0), a.stride(1), b_EKC.stride(0), b_EKC.stride(1), b_EKC.stride(2), out.stride(0), out.stride(1),
            E=num_experts, E_POW2=next_pow2(num_experts), GATHER=gather_order is not None,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
    return out


def grouped_weight_grad(
    p: torch.Tensor, q: torch.Tensor, offsets_E: torch.Tensor, *,
    out: torch.Tensor | None = None, q_gather_order: torch.Tensor | None = None, top_k: int = 1,
    impl: Impl = "auto", config: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:  # fmt: skip
    """[E, M, C] with ``out[e] = p[rows_e]^T @ q_rows[rows_e]`` (rows_e = offsets[e-1]:offsets[e];
    ``q_rows = q[q_gather_order // top_k]`` with a gather); written into ``out`` when given (any
    strides: the layout of the weight whose gradient this is)."""
    _check_operands("grouped_weight_grad", p, offsets_E, q_gather_order)
    num_experts = offsets_E.numel()
    shape = (num_experts, p.shape[1], q.shape[1])
    if out is not None and tuple(out.shape) != shape:
        raise ValueError(f"grouped_weight_grad: out must be {shape}, got {tuple(out.shape)}")
    if not use_triton(impl, p, q):
        result = grouped_weight_grad_reference(p, q, offsets_E, q_gather_order=q_gather_order, top_k=top_k)
        return result if out is None else out.copy_(result)
    out = torch.empty(shape, dtype=p.dtype, device=p.device) if out is None else out
    if out.numel() == 0:
        return out
    block_m, block_n, block_k, num_warps, num_stages = config or WEIGHT_GRAD_CONFIG
    grid = (num_experts * triton.cdiv(shape[1], block_m) * triton.cdiv(shape[2], block_n),)
    with device_of(p):
        _grouped_weight_grad_kernel[grid](
            p, q, q_gather_order if q_gather_order is not None else offsets_E, out, offsets_E,
            shape[1], shape[2], top_k,
            p.stride(0), p.stride(1), q.stride(0), q.stride(1), out.stride(0), out.stride(1), out.stride(2),
            GATHER=q_gather_order is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
    return out
