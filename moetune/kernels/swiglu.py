"""Fused SwiGLU: ``silu(gate) * up`` in one kernel forward and one kernel backward.

``gate_up`` is ``[..., 2I]`` with the gate in the first half and up in the second, Transformers'
``gate, up = gate_up.chunk(2, dim=-1)`` convention (Qwen3-MoE's fused ``gate_up_proj``). The math
runs in fp32 and the result is stored once in the input dtype (Transformers rounds silu(gate) to
bf16 before the product; this kernel rounds only the product, so it differs by bf16 rounding).

``num_valid`` (a device tensor) limits the work to the first rows: the expert-parallel dispatchers
hand the experts row buffers sized for the worst case, whose tail is padding that the grouped GEMM
skips; the kernels skip it too (its output rows, and their gradients, are left undefined).

Shape legend: R = rows (every leading dim flattened), I = intermediate (expert) width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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

_MAX_BLOCK_N = 1024


def swiglu_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch SwiGLU on ``[..., 2I]``: fp32 inside (float64 stays float64), input dtype out."""
    gate, up = gate_up.chunk(2, dim=-1)
    return swiglu_split_reference(gate, up)


def swiglu_split_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch ``silu(gate) * up`` for separate tensors, fp32 inside."""
    compute_dtype = torch.promote_types(gate.dtype, torch.float32)
    return (F.silu(gate.to(compute_dtype)) * up.to(compute_dtype)).to(gate.dtype)


if HAS_TRITON:

    @triton.jit
    def _swiglu_fwd_kernel(
        g_ptr, u_ptr, y_ptr, num_valid_ptr,
        num_rows, num_cols, stride_g, stride_u, stride_y,
        HAS_VALID: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        if HAS_VALID:
            num_rows = tl.minimum(num_rows, tl.load(num_valid_ptr).to(tl.int32))
        mask = (rows < num_rows)[:, None] & (cols < num_cols)[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        g = tl.load(g_ptr + rows64 * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + rows64 * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        y = g * tl.sigmoid(g) * u
        tl.store(y_ptr + rows64 * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_bwd_kernel(
        dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, num_valid_ptr,
        num_rows, num_cols, stride_dy, stride_g, stride_u, stride_dg, stride_du,
        HAS_VALID: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        if HAS_VALID:
            num_rows = tl.minimum(num_rows, tl.load(num_valid_ptr).to(tl.int32))
        mask = (rows < num_rows)[:, None] & (cols < num_cols)[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        dy = tl.load(dy_ptr + rows64 * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + rows64 * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + rows64 * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(g)
        silu = g * sig
        # silu'(g) = sig * (1 + g * (1 - sig))
        dg = dy * u * sig * (1.0 + g * (1.0 - sig))
        du = dy * silu
        tl.store(dg_ptr + rows64 * stride_dg + cols[None, :], dg.to(dg_ptr.dtype.element_ty), mask=mask)
        tl.store(du_ptr + rows64 * stride_du + cols[None, :], du.to(du_ptr.dtype.element_ty), mask=mask)


def _fwd_triton(gate: torch.Tensor, up: torch.Tensor, num_valid: torch.Tensor | None = None) -> torch.Tensor:
    g2d, u2d = unit_stride_rows(gate), unit_stride_rows(up)
    num_rows, num_cols = g2d.shape
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if y.numel() == 0:
        return y
    y2d = y.view(num_rows, num_cols)
    grid, sizes = rows_grid(num_rows, num_cols, max_block_n=_MAX_BLOCK_N)
    valid_ptr, has_valid = valid_rows_arg(num_valid, g2d)
    with device_of(g2d):
        _swiglu_fwd_kernel[grid](
            g2d, u2d, y2d, valid_ptr, num_rows, num_cols, g2d.stride(0), u2d.stride(0), y2d.stride(0),
            HAS_VALID=has_valid, **sizes,
        )  # fmt: skip
    return y


def _bwd_triton(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, dg: torch.Tensor, du: torch.Tensor,
    num_valid: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """Write d(gate) into ``dg`` and d(up) into ``du`` (views with unit column stride)."""
    g2d, u2d, dy2d = unit_stride_rows(gate), unit_stride_rows(up), unit_stride_rows(dy)
    dg2d, du2d = dg.view(-1, dg.shape[-1]), du.view(-1, du.shape[-1])
    num_rows, num_cols = g2d.shape
    if num_rows * num_cols == 0:
        return
    grid, sizes = rows_grid(num_rows, num_cols, max_block_n=_MAX_BLOCK_N)
    valid_ptr, has_valid = valid_rows_arg(num_valid, g2d)
    with device_of(dy2d):
        _swiglu_bwd_kernel[grid](
            dy2d, g2d, u2d, dg2d, du2d, valid_ptr, num_rows, num_cols,
            dy2d.stride(0), g2d.stride(0), u2d.stride(0), dg2d.stride(0), du2d.stride(0),
            HAS_VALID=has_valid, **sizes,
        )  # fmt: skip


def _fwd_torch(gate: torch.Tensor, up: torch.Tensor, num_valid: torch.Tensor | None = None) -> torch.Tensor:
    return swiglu_split_reference(gate, up)  # computes the padding rows too (allowed: undefined)


def _bwd_torch(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, dg: torch.Tensor, du: torch.Tensor,
    num_valid: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """The kernel's backward math in torch ops (lets CPU tests gradcheck the formula)."""
    compute_dtype = torch.promote_types(gate.dtype, torch.float32)
    g, u, d = gate.to(compute_dtype), up.to(compute_dtype), dy.to(compute_dtype)
    sig = torch.sigmoid(g)
    dg.copy_(d * u * sig * (1 + g * (1 - sig)))
    du.copy_(d * g * sig)


class SwiGLUFunction(torch.autograd.Function):
    """``[..., 2I] -> [..., I]``; the backward writes the whole ``[..., 2I]`` grad in one kernel."""

    @staticmethod
    def forward(ctx, gate_up: torch.Tensor, backend: str, num_valid: torch.Tensor | None = None) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        y = (_fwd_triton if backend == "triton" else _fwd_torch)(gate, up, num_valid)
        ctx.save_for_backward(gate_up, num_valid)
        ctx.backend = backend
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        gate_up, num_valid = ctx.saved_tensors
        gate, up = gate_up.chunk(2, dim=-1)
        d_gate_up = torch.empty(gate_up.shape, dtype=gate_up.dtype, device=gate_up.device)
        dg, du = d_gate_up.chunk(2, dim=-1)
        (_bwd_triton if ctx.backend == "triton" else _bwd_torch)(dy, gate, up, dg, du, num_valid)
        return d_gate_up, None, None


class SwiGLUSplitFunction(torch.autograd.Function):
    """``silu(gate) * up`` for separate ``gate`` and ``up`` tensors of the same shape."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, backend: str) -> torch.Tensor:
        y = (_fwd_triton if backend == "triton" else _fwd_torch)(gate, up)
        ctx.save_for_backward(gate, up)
        ctx.backend = backend
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        gate, up = ctx.saved_tensors
        dg = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        du = torch.empty(up.shape, dtype=up.dtype, device=up.device)
        (_bwd_triton if ctx.backend == "triton" else _bwd_torch)(dy, gate, up, dg, du)
        return dg, du, None


def swiglu(gate_up: torch.Tensor, *, num_valid: torch.Tensor | None = None, impl: Impl = "auto") -> torch.Tensor:
    """``silu(gate) * up`` where ``gate, up = gate_up.chunk(2, dim=-1)``; returns ``[..., I]``.

    ``num_valid`` (1-element device tensor, 2-D input): rows from it on are padding, skipped by
    the kernels (outputs and gradients undefined there)."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dim must be even (gate and up halves), got {gate_up.shape[-1]}")
    if use_triton(impl, gate_up):
        return SwiGLUFunction.apply(gate_up, "triton", num_valid)
    return swiglu_reference(gate_up)


def swiglu_split(gate: torch.Tensor, up: torch.Tensor, *, impl: Impl = "auto") -> torch.Tensor:
    """``silu(gate) * up`` for separate tensors (same shape and dtype), fp32 inside."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate and up must match in shape and dtype, got {tuple(gate.shape)} {gate.dtype} "
                         f"and {tuple(up.shape)} {up.dtype}")  # fmt: skip
    if use_triton(impl, gate, up):
        return SwiGLUSplitFunction.apply(gate, up, "triton")
    return swiglu_split_reference(gate, up)
