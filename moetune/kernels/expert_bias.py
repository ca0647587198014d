"""Per-expert biases on rows sorted by expert (GPT-OSS's experts), with a backward that sums each
expert's rows instead of scattering them.

Autograd's gradient of ``bias_EX.index_select(0, expert_N)`` is an atomic ``index_add_`` of all N
rows into E bias rows: thousands of rows collide on each expert's row, and the adds run in bf16.
On an H200 at GPT-OSS-20B's shapes (16,384 routed rows, 32 experts, 5760 wide) it took 618 us per
bias (profiled on 2026-12-01 at 83e5786). The rows are sorted by expert, so each
bias gradient is a plain sum over one contiguous block of rows: ``segment_sum`` reads the gradient
once, accumulates in fp32, and is deterministic. The forward adds each row's bias in one pass
(no gathered [N, X] bias tensor).

Shape legend: N sorted rows (rows past ``offsets_E[-1]`` are padding), E experts, X width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moetune.kernels._triton_utils import HAS_TRITON, Impl, device_of, rows_grid, tl, triton, unit_stride_rows, use_triton

_BLOCK_ROWS = 32
_BLOCK_COLS = 128

if HAS_TRITON:

    @triton.jit
    def _segment_sum_kernel(x_ptr, offsets_ptr, out_ptr, num_cols, stride_row, BLOCK_R: tl.constexpr,
                            BLOCK_C: tl.constexpr):  # fmt: skip
        # One program per (expert, column block): the sum of the expert's rows in those columns.
        expert = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        col_mask = cols < num_cols
        start = tl.load(offsets_ptr + expert - 1, mask=expert > 0, other=0).to(tl.int64)
        end = tl.load(offsets_ptr + expert).to(tl.int64)
        acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        r = tl.arange(0, BLOCK_R)
        for row0 in range(start, end, BLOCK_R):
            rows = row0 + r
            mask = (rows < end)[:, None] & col_mask[None, :]
            tile = tl.load(x_ptr + rows[:, None] * stride_row + cols[None, :], mask=mask, other=0.0)
            acc += tl.sum(tile.to(tl.float32), axis=0)
        tl.store(out_ptr + expert.to(tl.int64) * num_cols + cols, acc, mask=col_mask)


    @triton.jit
    def _add_bias_rows_kernel(h_ptr, bias_ptr, expert_ptr, out_ptr, num_rows, num_cols, num_experts, stride_h,
                              stride_out, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
        # out = h + bias[expert of the row]; padding rows (expert E) add nothing.
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < num_rows
        mask = row_mask[:, None] & (cols < num_cols)[None, :]
        expert = tl.load(expert_ptr + rows, mask=row_mask, other=num_experts).to(tl.int64)
        rows64 = rows.to(tl.int64)[:, None]
        h = tl.load(h_ptr + rows64 * stride_h + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        bias_mask = mask & (expert < num_experts)[:, None]
        bias = tl.load(bias_ptr + expert[:, None] * num_cols + cols[None, :], mask=bias_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows64 * stride_out + cols[None, :], (h + bias).to(out_ptr.dtype.element_ty), mask=mask)


def add_bias_rows_reference(h_NX: torch.Tensor, bias_EX: torch.Tensor, expert_N: torch.Tensor) -> torch.Tensor:
    """``h_NX + bias_EX[expert_N]``, zero for padding rows (expert E)."""
    return h_NX + F.pad(bias_EX, (0, 0, 0, 1)).index_select(0, expert_N)


def _add_bias_rows_triton(h_NX: torch.Tensor, bias_EX: torch.Tensor, expert_N: torch.Tensor) -> torch.Tensor:
    """One pass: each row of ``h_NX`` read once and written once plus its (cached) bias row, instead
    of a gathered [N, X] bias tensor written and read back."""
    h_NX = unit_stride_rows(h_NX)
    bias_EX = bias_EX.contiguous()
    out = torch.empty(h_NX.shape, dtype=torch.promote_types(h_NX.dtype, bias_EX.dtype), device=h_NX.device)
    if out.numel():
        grid, sizes = rows_grid(*h_NX.shape)
        with device_of(h_NX):
            _add_bias_rows_kernel[grid](h_NX, bias_EX, expert_N, out, h_NX.shape[0], h_NX.shape[1], bias_EX.shape[0],
                                        h_NX.stride(0), out.stride(0), **sizes)  # fmt: skip
    return out


def segment_sum_reference(x_NX: torch.Tensor, offsets_E: torch.Tensor, *, dtype: torch.dtype) -> torch.Tensor:
    """The sum of each expert's rows (``offsets_E``: the cumulative row counts), in fp32."""
    rows = torch.arange(x_NX.shape[0], device=x_NX.device)
    expert_N = torch.searchsorted(offsets_E.to(rows.dtype), rows, right=True)  # E for padding rows
    sums = x_NX.new_zeros(offsets_E.shape[0] + 1, x_NX.shape[1], dtype=torch.float32)
    return sums.index_add_(0, expert_N, x_NX.float())[:-1].to(dtype)


def segment_sum(x_NX: torch.Tensor, offsets_E: torch.Tensor, *, dtype: torch.dtype, impl: Impl = "auto") -> torch.Tensor:
    """[E, X] sums of the row blocks ``[offsets_E[e-1], offsets_E[e])`` of ``x_NX`` (no host sync)."""
    if not use_triton(impl, x_NX, offsets_E):
        return segment_sum_reference(x_NX, offsets_E, dtype=dtype)
    x_NX = x_NX if x_NX.stride(-1) == 1 else x_NX.contiguous()
    num_experts, num_cols = offsets_E.shape[0], x_NX.shape[1]
    out = torch.empty(num_experts, num_cols, dtype=torch.float32, device=x_NX.device)
    if num_experts and num_cols:
        with device_of(x_NX):
            _segment_sum_kernel[(num_experts, triton.cdiv(num_cols, _BLOCK_COLS))](
                x_NX, offsets_E, out, num_cols, x_NX.stride(0), BLOCK_R=_BLOCK_ROWS, BLOCK_C=_BLOCK_COLS, num_warps=4,
            )  # fmt: skip
    return out.to(dtype)


class ExpertBiasRows(torch.autograd.Function):
    """``h_NX + bias_EX[expert_N]`` (padding rows, expert E, get zeros); the bias gradient is each
    expert's row sum of the output gradient."""

    @staticmethod
    def forward(ctx, h_NX, bias_EX, expert_N, offsets_E, impl):
        ctx.save_for_backward(offsets_E)
        ctx.bias_dtype, ctx.impl = bias_EX.dtype, impl
        if use_triton(impl, h_NX, bias_EX, expert_N):
            return _add_bias_rows_triton(h_NX, bias_EX, expert_N)
        return add_bias_rows_reference(h_NX, bias_EX, expert_N)

    @staticmethod
    def backward(ctx, grad_NX):
        (offsets_E,) = ctx.saved_tensors
        grad_bias = segment_sum(grad_NX, offsets_E, dtype=ctx.bias_dtype, impl=ctx.impl) if ctx.needs_input_grad[1] else None
        return grad_NX, grad_bias, None, None, None


def add_expert_bias(
    h_NX: torch.Tensor, bias_EX: torch.Tensor, expert_N: torch.Tensor, offsets_E: torch.Tensor, *, impl: Impl = "auto"
) -> torch.Tensor:
    """Each row plus its expert's bias (``expert_N``: each row's expert, E for padding rows;
    ``offsets_E``: cumulative rows per expert, rows sorted by expert)."""
    return ExpertBiasRows.apply(h_NX, bias_EX, expert_N, offsets_E, impl)
