"""GPT-OSS's clamped SwiGLU in one kernel forward and one kernel backward.

Transformers' ``GptOssExperts`` on the fused projection ``h = [gate0, up0, gate1, up1, ...]``
(gate and up interleaved column by column)::

    gate = h[..., ::2].clamp(max=limit);  up = h[..., 1::2].clamp(-limit, limit)
    y = (up + 1) * gate * sigmoid(alpha * gate)

In torch ops that is about six elementwise kernels forward and ten backward over strided halves of
the [rows, 2I] projection (GPT-OSS-20B: 16,384 routed rows x 5760 per layer at 4096 tokens). The
kernels read the interleaved pairs directly, compute in fp32 and store once (the output, or the
interleaved gradient). The clamps pass gradients as the running torch's ``clamp`` does: where the
input lies inside the bounds; at a bound itself through torch 2.13, not from 2.14 on (pytorch#184574
made scalar-bound clamps take the minimum-norm subgradient, 0, as ``hardtanh``): probed once at import
(``CLAMP_PASSES_GRADIENT_AT_BOUND``), so the kernel equals Transformers' torch ops on either.

``num_valid`` (a device tensor) limits the work to the first rows, as ``moetune.kernels.swiglu``'s
(the expert-parallel dispatchers' padding rows: outputs and gradients left undefined there).

Shape legend: R = rows (every leading dim flattened), I = the activation's width (half of 2I).
"""

from __future__ import annotations

import torch

from moetune.kernels._triton_utils import (
    HAS_TRITON,
    Impl,
    device_of,
    rows_grid,
    tl,
    triton,
    unit_stride_rows,
    use_triton,
    valid_rows_arg,
)

def clamped_swiglu_reference(h: torch.Tensor, *, alpha: float, limit: float) -> torch.Tensor:
    """Transformers' GPT-OSS activation, op for op, on interleaved ``[..., 2I]``."""
    gate, up = h[..., ::2], h[..., 1::2]
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _clamp_passes_gradient_at_bound() -> bool:
    """Whether this torch's ``clamp`` with scalar bounds gives an input exactly at a bound gradient 1
    (torch <= 2.13) or 0 (>= 2.14); both bounds follow the same convention."""
    with torch.enable_grad():
        x = torch.tensor([-1.0, 1.0], requires_grad=True)
        (grad,) = torch.autograd.grad(x.clamp(min=-1.0, max=1.0).sum(), x)
    return bool(grad.all())


CLAMP_PASSES_GRADIENT_AT_BOUND = _clamp_passes_gradient_at_bound()
"""Probed once at import, not in the kernel's backward, which torch.compile may trace."""


if HAS_TRITON:

    @triton.jit
    def _row_block(num_valid_ptr, num_rows, num_cols, HAS_VALID: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):  # fmt: skip
        """This program's rows (int64, as a column), columns and mask (rows past ``num_valid`` out)."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        if HAS_VALID:
            num_rows = tl.minimum(num_rows, tl.load(num_valid_ptr).to(tl.int32))
        mask = (rows < num_rows)[:, None] & (cols < num_cols)[None, :]
        return rows.to(tl.int64)[:, None], cols[None, :], mask

    @triton.jit
    def _gate_up(h_ptr, rows, cols, mask, stride_h):
        """The interleaved (gate, up) pairs of columns ``cols``, in fp32."""
        h_row = h_ptr + rows * stride_h + 2 * cols
        gate = tl.load(h_row, mask=mask, other=0.0).to(tl.float32)
        return gate, tl.load(h_row + 1, mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _clamped_swiglu_fwd_kernel(
        h_ptr, y_ptr, num_valid_ptr, num_rows, num_cols, stride_h, stride_y, alpha, limit,
        HAS_VALID: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        rows, cols, mask = _row_block(num_valid_ptr, num_rows, num_cols, HAS_VALID, BLOCK_M, BLOCK_N)
        gate, up = _gate_up(h_ptr, rows, cols, mask, stride_h)
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        y = (up + 1.0) * gate * tl.sigmoid(alpha * gate)
        tl.store(y_ptr + rows * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _clamped_swiglu_bwd_kernel(
        dy_ptr, h_ptr, dh_ptr, num_valid_ptr, num_rows, num_cols, stride_dy, stride_h, stride_dh, alpha, limit,
        HAS_VALID: tl.constexpr, BOUND_PASSES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        rows, cols, mask = _row_block(num_valid_ptr, num_rows, num_cols, HAS_VALID, BLOCK_M, BLOCK_N)
        dy = tl.load(dy_ptr + rows * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        gate_in, up_in = _gate_up(h_ptr, rows, cols, mask, stride_h)
        gate = tl.minimum(gate_in, limit)
        up = tl.minimum(tl.maximum(up_in, -limit), limit)
        sig = tl.sigmoid(alpha * gate)
        glu = gate * sig
        d_gate = dy * (up + 1.0) * (sig + alpha * glu * (1.0 - sig))
        d_up = dy * glu
        if BOUND_PASSES:  # torch <= 2.13's clamp: an input at a bound gets the gradient
            d_gate = tl.where(gate_in <= limit, d_gate, 0.0)
            d_up = tl.where((up_in >= -limit) & (up_in <= limit), d_up, 0.0)
        else:
            d_gate = tl.where(gate_in < limit, d_gate, 0.0)
            d_up = tl.where((up_in > -limit) & (up_in < limit), d_up, 0.0)
        dh_row = dh_ptr + rows * stride_dh + 2 * cols
        tl.store(dh_row, d_gate.to(dh_ptr.dtype.element_ty), mask=mask)
        tl.store(dh_row + 1, d_up.to(dh_ptr.dtype.element_ty), mask=mask)


class ClampedSwiGLUFunction(torch.autograd.Function):
    """``[..., 2I]`` interleaved -> ``[..., I]``; the backward writes the interleaved gradient."""

    @staticmethod
    def forward(ctx, h, alpha: float, limit: float, num_valid: torch.Tensor | None):
        h2d = unit_stride_rows(h)
        num_rows, num_cols = h2d.shape[0], h2d.shape[1] // 2
        y = torch.empty(*h.shape[:-1], num_cols, dtype=h.dtype, device=h.device)
        if y.numel():
            grid, sizes = rows_grid(num_rows, num_cols)
            valid_ptr, has_valid = valid_rows_arg(num_valid, h2d)
            with device_of(h2d):
                _clamped_swiglu_fwd_kernel[grid](
                    h2d, y.view(num_rows, num_cols), valid_ptr, num_rows, num_cols, h2d.stride(0), num_cols,
                    float(alpha), float(limit), HAS_VALID=has_valid, **sizes,
                )  # fmt: skip
        ctx.save_for_backward(h2d, num_valid)
        ctx.alpha, ctx.limit, ctx.shape = alpha, limit, h.shape
        return y

    @staticmethod
    def backward(ctx, dy):
        h2d, num_valid = ctx.saved_tensors
        dy2d = unit_stride_rows(dy)
        num_rows, num_cols = dy2d.shape
        dh = torch.empty(num_rows, 2 * num_cols, dtype=h2d.dtype, device=h2d.device)
        if dh.numel():
            grid, sizes = rows_grid(num_rows, num_cols)
            valid_ptr, has_valid = valid_rows_arg(num_valid, h2d)
            with device_of(h2d):
                _clamped_swiglu_bwd_kernel[grid](
                    dy2d, h2d, dh, valid_ptr, num_rows, num_cols, dy2d.stride(0), h2d.stride(0), dh.stride(0),
                    float(ctx.alpha), float(ctx.limit), HAS_VALID=has_valid,
                    BOUND_PASSES=CLAMP_PASSES_GRADIENT_AT_BOUND, **sizes,
                )  # fmt: skip
        return dh.view(ctx.shape), None, None, None


def clamped_swiglu(
    h: torch.Tensor, *, alpha: float, limit: float, num_valid: torch.Tensor | None = None, impl: Impl = "auto"
) -> torch.Tensor:
    """GPT-OSS's activation on interleaved ``[..., 2I]`` (gate at even, up at odd columns)."""
    if h.shape[-1] % 2:
        raise ValueError(f"h's last dim must be even (interleaved gate / up pairs), got {h.shape[-1]}")
    if use_triton(impl, h):
        return ClampedSwiGLUFunction.apply(h, alpha, limit, num_valid)
    return clamped_swiglu_reference(h, alpha=alpha, limit=limit)
