"""FP8 (e4m3) quantisation for training GEMMs: scales computed on the device, no host sync.

Every scale is a power of two: the smallest ``2**k`` with ``amax / 2**k <= 448`` (e4m3's largest
value), found from amax's exponent and mantissa bits. Dequantising is then exact, and the quantised
values are the same bits whichever kernel computed them (the Triton kernels on a GPU equal the
torch references here; Triton's interpreter truncates instead of rounding to nearest, so on CPU
they differ by one e4m3 step at most).

Three layouts, one per role in a GEMM (the scaling runs along the GEMM's contraction dimension):

- ``quantize_rows(x_BRC, *, block)``: rows of ``x`` [R, C] or [B, R, C] (any strides: a transposed
  weight view reads in place), one scale per row (``block=None``, "rowwise") or per 1 x 128 slice
  (``block=128``, DeepSeek-V3's activation tiles). Output contiguous, scales [B, R, ceil(C / block)].
- ``quantize_blocks(w_BRC)``: 128 x 128 tiles (DeepSeek-V3's weight blocks); scales
  [B, ceil(R / 128), ceil(C / 128)].
- ``quantize_columns(x_NC, offsets_E, *, block)``: the token dimension of a weight gradient. Rows
  sorted into groups (experts) by ``offsets_E``; one scale per (group, column) or per (128 rows of a
  group, column). Output transposed, [C, N'] with each group's rows starting at a multiple of 16
  (``padded_offsets_E``, the alignment the grouped FP8 GEMMs need; the gaps are zeros); rows at or
  past ``offsets_E[-1]`` (padding) are never read.

Shape legend: B batch (experts), R rows, C columns, N rows sorted by group, E groups, NB blocks of
128 rows over all groups (``column_blocks_bound``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moetune.kernels._triton_utils import HAS_TRITON, Impl, device_of, next_pow2, tl, triton, use_triton

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128
"""DeepSeek-V3's block: 1 x 128 activation slices, 128 x 128 weight tiles, 128-token gradient slices."""
GROUP_ALIGN = 16
"""Rows of a group in ``quantize_columns``' output start at multiples of this (16 bytes of e4m3)."""
_MIN_AMAX = 2.0**-100  # an all-zero slice gets a finite scale (2**-108) and quantises to zeros


# ---------------------------------------------------------------------------------------------
# torch references
# ---------------------------------------------------------------------------------------------


def pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """The smallest power of two ``s`` with ``amax / s <= 448`` (fp32), from amax's bits: 448 is
    1.75 * 2**8, so ``s = 2**(e - 8)`` for a mantissa up to 1.75 and ``2**(e - 7)`` above."""
    bits = amax.float().clamp(min=_MIN_AMAX).view(torch.int32)
    k = ((bits >> 23) & 0xFF) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    return ((k + 127) << 23).view(torch.float32)


def quantize_with(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` as e4m3 (scale a power of two broadcast against x: the division is exact)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _as_batched(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dim() == 2:
        return x.unsqueeze(0)
    if x.dim() != 3:
        raise ValueError(f"{name}: expected a 2-D or 3-D tensor, got shape {tuple(x.shape)}")
    return x


def quantize_rows_reference(x: torch.Tensor, *, block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    x_BRC = _as_batched(x, "quantize_rows")
    num_cols = x_BRC.shape[-1]
    width = num_cols if block is None else block
    num_blocks = -(-num_cols // width) if num_cols else 0
    padded = F.pad(x_BRC.float(), (0, num_blocks * width - num_cols))
    tiles = padded.unflatten(-1, (num_blocks, width))
    scale_BRK = pow2_scale(tiles.abs().amax(-1))
    q = quantize_with(tiles, scale_BRK.unsqueeze(-1)).flatten(-2)[..., :num_cols]
    return q.reshape(x.shape).contiguous(), scale_BRK.reshape(*x.shape[:-1], num_blocks)


def quantize_blocks_reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w_BRC = _as_batched(w, "quantize_blocks")
    B, R, C = w_BRC.shape
    nr, nc = -(-R // BLOCK), -(-C // BLOCK)
    tiles = F.pad(w_BRC.float(), (0, nc * BLOCK - C, 0, nr * BLOCK - R)).reshape(B, nr, BLOCK, nc, BLOCK)
    scale = pow2_scale(tiles.abs().amax(dim=(2, 4)))
    q = quantize_with(tiles, scale[:, :, None, :, None]).reshape(B, nr * BLOCK, nc * BLOCK)[:, :R, :C]
    return q.reshape(w.shape).contiguous(), scale.reshape(*w.shape[:-2], nr, nc)


def _group_bounds(offsets_E: torch.Tensor) -> list[tuple[int, int]]:
    ends = offsets_E.tolist()
    return list(zip([0, *ends[:-1]], ends))


def column_blocks_bound(num_rows: int, num_groups: int, block: int = BLOCK) -> int:
    """Blocks of ``block`` rows over all groups, at most (each group starts a new block)."""
    return -(-num_rows // block) + num_groups


def padded_rows_bound(num_rows: int, num_groups: int) -> int:
    """Columns of ``quantize_columns``' output: every group padded to a multiple of 16, rounded up to 16."""
    return -(-(num_rows + (GROUP_ALIGN - 1) * num_groups) // GROUP_ALIGN) * GROUP_ALIGN


def column_layout(offsets_E: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(padded group ends, first 128-row block of each group), both int32 on the device."""
    counts = torch.diff(offsets_E.to(torch.int64), prepend=offsets_E.new_zeros(1, dtype=torch.int64))
    padded = torch.cumsum((counts + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN, 0).to(torch.int32)
    blocks = (counts + block - 1) // block
    block_starts = (torch.cumsum(blocks, 0) - blocks).to(torch.int32)
    return padded, block_starts


def quantize_columns_reference(
    x_NC: torch.Tensor, offsets_E: torch.Tensor | None = None, *, block: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    num_rows, num_cols = x_NC.shape
    if offsets_E is None:
        offsets_E = torch.tensor([num_rows], dtype=torch.int32, device=x_NC.device)
    num_groups = offsets_E.numel()
    padded_E, block_starts_E = column_layout(offsets_E)
    q_CN = torch.zeros(num_cols, padded_rows_bound(num_rows, num_groups), dtype=FP8_DTYPE, device=x_NC.device)
    if block is None:
        scale = torch.empty(num_groups, num_cols, device=x_NC.device)
    else:
        scale = torch.empty(column_blocks_bound(num_rows, num_groups, block), num_cols, device=x_NC.device)
    pad_starts = [0, *padded_E.tolist()[:-1]]
    for group, (start, end) in enumerate(_group_bounds(offsets_E)):
        rows = x_NC[start:end].float()
        if block is None:
            scale[group] = pow2_scale(rows.abs().amax(0) if end > start else rows.new_zeros(num_cols))
            q = quantize_with(rows, scale[group])
        else:
            first = int(block_starts_E[group])
            q = torch.empty_like(rows, dtype=FP8_DTYPE)
            for j, b0 in enumerate(range(0, end - start, block)):
                scale[first + j] = pow2_scale(rows[b0 : b0 + block].abs().amax(0))
                q[b0 : b0 + block] = quantize_with(rows[b0 : b0 + block], scale[first + j])
        q_CN[:, pad_starts[group] : pad_starts[group] + end - start] = q.t()
    return q_CN, scale, padded_E


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _pow2_scale(amax, MIN_AMAX: tl.constexpr):
        # (scale, 1 / scale): both exact powers of two, as pow2_scale computes them.
        bits = tl.maximum(amax, MIN_AMAX).to(tl.int32, bitcast=True)
        k = ((bits >> 23) & 0xFF) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
        scale = ((k + 127) << 23).to(tl.float32, bitcast=True)
        inverse = ((127 - k) << 23).to(tl.float32, bitcast=True)
        return scale, inverse

    @triton.jit
    def _quantize_rows_kernel(
        x_ptr, q_ptr, s_ptr, R, C, num_blocks,
        stride_xb, stride_xr, stride_xc,
        FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr, ROWWISE: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        # Program = BLOCK_R rows of one batch entry. Rowwise: two passes over the columns (amax, then
        # quantise); blockwise: one pass, BLOCK_C (= the block) columns at a time.
        pid = tl.program_id(0)
        tiles_per_batch = tl.cdiv(R, BLOCK_R)
        b = pid // tiles_per_batch
        rows = (pid % tiles_per_batch) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_mask = rows < R
        cs = tl.arange(0, BLOCK_C)
        x_base = x_ptr + b.to(tl.int64) * stride_xb + rows.to(tl.int64)[:, None] * stride_xr
        out_rows = b.to(tl.int64) * R + rows.to(tl.int64)
        q_base = q_ptr + out_rows[:, None] * C
        if ROWWISE:
            amax = tl.zeros((BLOCK_R,), dtype=tl.float32)
            for c0 in range(0, C, BLOCK_C):
                cols = c0 + cs
                mask = row_mask[:, None] & (cols < C)[None, :]
                x = tl.load(x_base + cols[None, :] * stride_xc, mask=mask, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
            scale, inverse = _pow2_scale(amax, MIN_AMAX)
            tl.store(s_ptr + out_rows, scale, mask=row_mask)
            for c0 in range(0, C, BLOCK_C):
                cols = c0 + cs
                mask = row_mask[:, None] & (cols < C)[None, :]
                x = tl.load(x_base + cols[None, :] * stride_xc, mask=mask, other=0.0).to(tl.float32)
                q = tl.clamp(x * inverse[:, None], -FP8_MAX, FP8_MAX)
                tl.store(q_base + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
        else:
            for c0 in range(0, C, BLOCK_C):
                cols = c0 + cs
                mask = row_mask[:, None] & (cols < C)[None, :]
                x = tl.load(x_base + cols[None, :] * stride_xc, mask=mask, other=0.0).to(tl.float32)
                scale, inverse = _pow2_scale(tl.max(tl.abs(x), axis=1), MIN_AMAX)
                tl.store(s_ptr + out_rows * num_blocks + c0 // BLOCK_C, scale, mask=row_mask)
                q = tl.clamp(x * inverse[:, None], -FP8_MAX, FP8_MAX)
                tl.store(q_base + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _quantize_blocks_kernel(
        x_ptr, q_ptr, s_ptr, R, C,
        stride_xb, stride_xr, stride_xc,
        FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        # Program = one BLOCK x BLOCK tile: its amax, its scale, its quantised values.
        pid = tl.program_id(0)
        nr, nc = tl.cdiv(R, BLOCK), tl.cdiv(C, BLOCK)
        b = pid // (nr * nc)
        tile = pid % (nr * nc)
        rows = (tile // nc) * BLOCK + tl.arange(0, BLOCK)
        cols = (tile % nc) * BLOCK + tl.arange(0, BLOCK)
        mask = (rows < R)[:, None] & (cols < C)[None, :]
        x_ptrs = x_ptr + b.to(tl.int64) * stride_xb + rows.to(tl.int64)[:, None] * stride_xr + cols[None, :] * stride_xc
        x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
        scale, inverse = _pow2_scale(tl.max(tl.max(tl.abs(x), axis=1), axis=0), MIN_AMAX)
        tl.store(s_ptr + pid, scale)
        q = tl.clamp(x * inverse, -FP8_MAX, FP8_MAX)
        q_ptrs = q_ptr + (b.to(tl.int64) * R + rows.to(tl.int64))[:, None] * C + cols[None, :]
        tl.store(q_ptrs, q.to(q_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _block_of_group(ends_ptr, block_starts_ptr, b, E: tl.constexpr, E_POW2: tl.constexpr, BLOCK: tl.constexpr):
        # (group, first row of global block b, end row of its group, block's index in its group);
        # group == E past the last block.
        groups = tl.arange(0, E_POW2)
        valid = groups < E
        ends = tl.load(ends_ptr + groups, mask=valid, other=0).to(tl.int32)
        starts = tl.load(ends_ptr + groups - 1, mask=(groups > 0) & valid, other=0).to(tl.int32)
        first = tl.load(block_starts_ptr + groups, mask=valid, other=0)
        blocks = tl.where(valid, (ends - starts + BLOCK - 1) // BLOCK, 0)
        group = tl.sum(((first + blocks <= b) & valid).to(tl.int32), 0)
        chosen = groups == group
        j = b - tl.sum(tl.where(chosen, first, 0), 0)
        row0 = tl.sum(tl.where(chosen, starts, 0), 0) + j * BLOCK
        return group, row0, tl.sum(tl.where(chosen, ends, 0), 0), j

    @triton.jit
    def _quantize_columns_kernel(
        x_ptr, q_ptr, s_ptr, ends_ptr, padded_ends_ptr, block_starts_ptr, C, stride_qc,
        stride_xn, stride_xc,
        E: tl.constexpr, E_POW2: tl.constexpr, MODE: tl.constexpr,
        FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        # Program = (BLOCK rows of one group, BLOCK_C columns). MODE 0: write the block's column amax
        # into s (partials, reduced per group by the caller); 1: quantise with the group's scales s[E, C];
        # 2: the block's own scales (blockwise), written to s, and quantise. Quantised rows go to their
        # padded place in q [C, N'] (transposed); the last block of a group also zeroes the gap.
        group, row0, end, j = _block_of_group(ends_ptr, block_starts_ptr, tl.program_id(0), E, E_POW2, BLOCK)
        if group >= E:
            return
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        col_mask = cols < C
        rows = row0 + tl.arange(0, BLOCK)
        row_mask = rows < end
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xn + cols[None, :] * stride_xc, mask=mask, other=0.0)
        x = x.to(tl.float32)
        block_index = tl.program_id(0)
        if MODE == 0:
            tl.store(s_ptr + block_index.to(tl.int64) * C + cols, tl.max(tl.abs(x), axis=0), mask=col_mask)
        else:
            if MODE == 1:
                scale = tl.load(s_ptr + group * C + cols, mask=col_mask, other=1.0)
                inverse = ((254 << 23) - scale.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)  # 1 / 2**k
            else:
                scale, inverse = _pow2_scale(tl.max(tl.abs(x), axis=0), MIN_AMAX)
                tl.store(s_ptr + block_index.to(tl.int64) * C + cols, scale, mask=col_mask)
            q = tl.clamp(x * inverse[None, :], -FP8_MAX, FP8_MAX)
            padded_start = tl.load(padded_ends_ptr + group - 1, mask=group > 0, other=0)
            padded_end = tl.load(padded_ends_ptr + group)
            places = padded_start + j * BLOCK + tl.arange(0, BLOCK)
            q = tl.where(row_mask[:, None], q, 0.0)  # the gap up to the next multiple of 16 gets zeros
            q_ptrs = q_ptr + cols.to(tl.int64)[None, :] * stride_qc + places[:, None]
            tl.store(q_ptrs, q.to(q_ptr.dtype.element_ty), mask=(places < padded_end)[:, None] & col_mask[None, :])


def _launch_settings(block_r: int, block_c: int) -> int:
    return 8 if block_r * block_c >= 8192 else 4


def _rows_tile(x_BRC: torch.Tensor, block: int | None) -> tuple[int, int]:
    """(rows, columns) per program of ``_quantize_rows_kernel``. Contiguous rows up to 8192 wide are
    held whole (one read: the rowwise kernel's two passes then run over registers' worth of data, the
    second from L1/L2); a transposed view (columns strided, rows contiguous) goes in 64 x 64 tiles, so
    that each load is 64 contiguous values per column."""
    num_cols = x_BRC.shape[-1]
    if block is not None:
        return (64 if x_BRC.stride(-1) != 1 else 32), block
    if x_BRC.stride(-1) != 1 and x_BRC.stride(-2) == 1:
        return 64, 64
    block_c = min(next_pow2(num_cols), 8192)
    return max(1, min(64, 8192 // block_c)), block_c


def quantize_rows(x: torch.Tensor, *, block: int | None = None, impl: Impl = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, contiguous and shaped like ``x``; fp32 scales [..., R, ceil(C / block)], 1 column
    for ``block=None``). ``x`` [R, C] or [B, R, C], any strides; ``x == q * scale`` up to e4m3 rounding."""
    if block not in (None, BLOCK):
        raise ValueError(f"quantize_rows: block must be None (one scale per row) or {BLOCK}, got {block!r}")
    if not use_triton(impl, x):
        return quantize_rows_reference(x, block=block)
    x_BRC = _as_batched(x, "quantize_rows")
    B, R, C = x_BRC.shape
    num_blocks = 1 if block is None else -(-C // block)
    q = torch.empty((B, R, C), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((B, R, num_blocks), dtype=torch.float32, device=x.device)
    if q.numel():
        block_r, block_c = _rows_tile(x_BRC, block)
        with device_of(x):
            _quantize_rows_kernel[(B * triton.cdiv(R, block_r),)](
                x_BRC, q, scale, R, C, num_blocks, x_BRC.stride(0), x_BRC.stride(1), x_BRC.stride(2),
                FP8_MAX=FP8_MAX, MIN_AMAX=_MIN_AMAX, ROWWISE=block is None, BLOCK_R=block_r, BLOCK_C=block_c,
                num_warps=_launch_settings(block_r, block_c),
            )  # fmt: skip
    return q.reshape(x.shape), scale.reshape(*x.shape[:-1], num_blocks)


def quantize_blocks(w: torch.Tensor, *, impl: Impl = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, contiguous and shaped like ``w``; fp32 scales [..., ceil(R / 128), ceil(C / 128)])
    of ``w`` [R, C] or [B, R, C] (any strides) in 128 x 128 tiles."""
    if not use_triton(impl, w):
        return quantize_blocks_reference(w)
    w_BRC = _as_batched(w, "quantize_blocks")
    B, R, C = w_BRC.shape
    nr, nc = -(-R // BLOCK), -(-C // BLOCK)
    q = torch.empty((B, R, C), dtype=FP8_DTYPE, device=w.device)
    scale = torch.empty((B, nr, nc), dtype=torch.float32, device=w.device)
    if q.numel():
        with device_of(w):
            _quantize_blocks_kernel[(B * nr * nc,)](
                w_BRC, q, scale, R, C, w_BRC.stride(0), w_BRC.stride(1), w_BRC.stride(2),
                FP8_MAX=FP8_MAX, MIN_AMAX=_MIN_AMAX, BLOCK=BLOCK, num_warps=8,
            )  # fmt: skip
    return q.reshape(w.shape), scale.reshape(*w.shape[:-2], nr, nc)


def quantize_columns(
    x_NC: torch.Tensor, offsets_E: torch.Tensor | None = None, *, block: int | None = None, impl: Impl = "auto",
    layout: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(e4m3 [C, N'] transposed with each group's rows from a multiple of 16 on, the gaps zero; fp32
    scales [E, C] (``block=None``) or [NB, C] (``block=128``: group e's j-th block of 128 rows is
    ``column_layout(offsets_E)[1][e] + j``); padded group ends [E] int32). ``offsets_E`` (group ends;
    None: one group of all rows) stays on the device. ``layout``: ``column_layout(offsets_E)`` where
    the caller has it already (a weight gradient quantises two operands on the same groups; each
    ``column_layout`` is a dozen small kernel launches)."""
    if block not in (None, BLOCK):
        raise ValueError(f"quantize_columns: block must be None (one scale per group and column) or {BLOCK}, got {block!r}")
    if x_NC.dim() != 2:
        raise ValueError(f"quantize_columns: expected [N, C] rows, got shape {tuple(x_NC.shape)}")
    if not use_triton(impl, x_NC):
        return quantize_columns_reference(x_NC, offsets_E, block=block)
    num_rows, num_cols = x_NC.shape
    if offsets_E is None:
        offsets_E = torch.full((1,), num_rows, dtype=torch.int32, device=x_NC.device)
    num_groups = offsets_E.numel()
    padded_E, block_starts_E = column_layout(offsets_E) if layout is None else layout
    num_padded = padded_rows_bound(num_rows, num_groups)
    num_blocks = column_blocks_bound(num_rows, num_groups)
    q_CN = torch.empty(num_cols, num_padded, dtype=FP8_DTYPE, device=x_NC.device)
    scale = torch.empty(num_groups if block is None else num_blocks, num_cols, dtype=torch.float32, device=x_NC.device)
    if num_cols == 0:
        return q_CN, scale, padded_E
    block_c = 64
    grid = (num_blocks, triton.cdiv(num_cols, block_c))
    common = {"E": num_groups, "E_POW2": next_pow2(num_groups), "FP8_MAX": FP8_MAX, "MIN_AMAX": _MIN_AMAX,
              "BLOCK": BLOCK, "BLOCK_C": block_c, "num_warps": 8}  # fmt: skip
    args = (offsets_E, padded_E, block_starts_E, num_cols, num_padded, x_NC.stride(0), x_NC.stride(1))
    with device_of(x_NC):
        if block is None:
            # Per-block column amax, then each group's max over its blocks (a small [NB, C] reduction).
            partial = torch.zeros(num_blocks, num_cols, dtype=torch.float32, device=x_NC.device)
            _quantize_columns_kernel[grid](x_NC, q_CN, partial, *args, MODE=0, **common)
            if num_groups == 1:  # a dense layer: every block is the group's (the unused ones zeros)
                scale = pow2_scale(partial.amax(0, keepdim=True))
            else:
                blocks = torch.arange(num_blocks, device=x_NC.device, dtype=torch.int32)
                group_of_block = torch.searchsorted(block_starts_E, blocks, right=True) - 1
                scale = pow2_scale(_group_amax(partial, group_of_block, num_groups))
            _quantize_columns_kernel[grid](x_NC, q_CN, scale, *args, MODE=1, **common)
        else:
            _quantize_columns_kernel[grid](x_NC, q_CN, scale, *args, MODE=2, **common)
    return q_CN, scale, padded_E


def _group_amax(partial_BC: torch.Tensor, group_of_block: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Max over each group's rows of ``partial_BC`` (blocks past the last real one are zeros, and a
    group with no blocks gets zeros)."""
    index = group_of_block.clamp(min=0).to(torch.int64)[:, None].expand_as(partial_BC)
    out = partial_BC.new_zeros(num_groups, partial_BC.shape[1])
    return out.scatter_reduce_(0, index, partial_BC, reduce="amax", include_self=True)
