"""MoE token permutation and combine without atomics: every row is written by exactly one program.

Conventions of ``moetune.moe.dispatch`` (and Transformers' grouped_mm experts): the T*K routed
copies of the tokens are sorted by expert, ``order_N[n]`` is the routed slot ``t * K + k`` of
sorted row n, so the dispatch gather is ``x_TH[order_N // K]`` and the combine is
``out_TH[t] = sum_k weights_TK[t, k] * y_NH[inverse(order_N)[t * K + k]]``.

- ``moe_permute(x_TH, order_N, top_k, *, num_valid)``: the gather. Forward copies rows; the backward
  is a gather-sum over the K copies of each token (fp32 accumulation, deterministic), instead of the
  atomic ``index_add_`` that autograd uses for ``index_select``; sorted rows ``>= num_valid`` (a
  device count: padding) are left out of it. ``permute_rows`` / ``permute_rows_backward`` are the
  two halves without autograd, for a Function that gathers inside (the experts' first GEMM).
- ``moe_combine(y_NH, weights_TK, order_N)``: weighted sum of each token's K expert rows in fp32,
  one program per token. Backward: one program per sorted row writes ``weight * dout[token]`` and
  the weight's gradient ``dot(dout[token], y[n])``.

Plain ``index_select`` is close to bandwidth-bound on its own; the gain here is the backward
(no atomics, no fp32 scratch of T*K*H) and the fused weighting of the combine.

Shape legend: T tokens, H hidden, K experts per token, N = T*K sorted rows.
"""

from __future__ import annotations

import torch

from moetune.kernels._triton_utils import HAS_TRITON, Impl, device_of, next_pow2, tl, triton, use_triton, warps_for

_MAX_BLOCK_H = 2048
# Elements per program of the gather, without and with the second read (y, for the weights'
# gradient), and its warps (None: warps_for). Measured on an H200 (benchmarks/probes/gather_probe.py,
# benchmarks/results/gather_probe_h200_4cf0eeb.jsonl; 32768 rows of 2048 bf16): one row and 4
# warps 52.6 us (59.0 with 8 warps); with the dot products two rows and 4 warps 101.5 us (108.3).
_GATHER_TILE = 2048
_GATHER_DOT_TILE = 4096
_GATHER_NUM_WARPS: int | None = 4


def moe_permute_reference(x_TH: torch.Tensor, order_N: torch.Tensor, top_k: int) -> torch.Tensor:
    """``x_TH[order_N // top_k]`` (autograd's backward is an index_add)."""
    return x_TH.index_select(0, order_N // top_k)


def moe_combine_reference(y_NH: torch.Tensor, weights_TK: torch.Tensor, order_N: torch.Tensor) -> torch.Tensor:
    """Weight each sorted row, put it back in slot order, sum each token's K rows (fp32 inside)."""
    num_tokens, top_k = weights_TK.shape
    compute_dtype = torch.promote_types(y_NH.dtype, torch.float32)
    weights_N = weights_TK.reshape(-1).index_select(0, order_N).to(compute_dtype)
    weighted_NH = y_NH.to(compute_dtype) * weights_N.unsqueeze(-1)
    slots_NH = torch.zeros_like(weighted_NH).index_copy(0, order_N, weighted_NH)
    return slots_NH.view(num_tokens, top_k, slots_NH.shape[1]).sum(dim=1).to(y_NH.dtype)  # also for T = 0


def inverse_order(order_N: torch.Tensor) -> torch.Tensor:
    """The sorted row of each routed slot (inverse permutation), on device, no host sync."""
    inverse_N = torch.empty_like(order_N)
    return inverse_N.scatter_(0, order_N, torch.arange(order_N.numel(), device=order_N.device, dtype=order_N.dtype))


if HAS_TRITON:

    @triton.jit
    def _gather_rows_kernel(
        x_ptr, order_ptr, w_ptr, y_ptr, out_ptr, dw_ptr, num_valid_ptr,
        num_rows, num_cols, top_k, stride_x, stride_y, stride_out, weight_scale,
        HAS_WEIGHTS: tl.constexpr, COMPUTE_DOT: tl.constexpr, HAS_NUM_VALID: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
    ):  # fmt: skip
        # BLOCK_R sorted rows n per program: out[n] = weight_scale * w[slot] * x[slot // K]; optionally
        # dw[slot] = <x[slot // K], y[n]>. Rows n >= num_valid are padding: out[n] is left unwritten
        # (never read) and dw[slot] = 0. Several rows per program keep more loads in flight than one.
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        in_range = rows < num_rows
        slot = tl.load(order_ptr + rows, mask=in_range, other=0).to(tl.int64)
        active = in_range
        if HAS_NUM_VALID:
            active = in_range & (rows < tl.load(num_valid_ptr).to(tl.int64))
        token = slot // top_k
        scale = tl.full([BLOCK_R], 1.0, tl.float32)
        if HAS_WEIGHTS:
            scale = tl.load(w_ptr + slot, mask=active, other=0.0).to(tl.float32) * weight_scale
        cols = tl.arange(0, BLOCK_H)
        dot = tl.zeros([BLOCK_R], dtype=tl.float32)
        for h0 in range(0, num_cols, BLOCK_H):
            mask = active[:, None] & (h0 + cols < num_cols)[None, :]
            x = tl.load(x_ptr + token[:, None] * stride_x + h0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            out = (x * scale[:, None]).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + rows[:, None] * stride_out + h0 + cols[None, :], out, mask=mask)
            if COMPUTE_DOT:
                y = tl.load(y_ptr + rows[:, None] * stride_y + h0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                dot += tl.sum(x * y, axis=1)
        if COMPUTE_DOT:
            tl.store(dw_ptr + slot, tl.where(active, dot, 0.0), mask=in_range)

    @triton.jit
    def _sum_rows_kernel(
        y_ptr, inverse_ptr, w_ptr, num_valid_ptr, out_ptr,
        num_cols, top_k, stride_y, stride_out,
        HAS_WEIGHTS: tl.constexpr, HAS_NUM_VALID: tl.constexpr, BLOCK_H: tl.constexpr,
    ):  # fmt: skip
        # Token t = program (axis 0), column block (axis 1): out[t] = sum_k w[t, k] * y[inverse[t * K + k]],
        # skipping sorted rows >= num_valid (never loaded: their memory may hold NaNs).
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = cols < num_cols
        num_valid = 0
        if HAS_NUM_VALID:
            num_valid = tl.load(num_valid_ptr).to(tl.int64)
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for k in range(0, top_k):
            row = tl.load(inverse_ptr + t * top_k + k).to(tl.int64)
            row_mask = mask
            if HAS_NUM_VALID:  # broadcast the row's flag to the block (Triton 3.9's interpreter needs it)
                row_mask = mask & ((cols * 0 + row) < num_valid)
            y = tl.load(y_ptr + row * stride_y + cols, mask=row_mask, other=0.0).to(tl.float32)
            if HAS_WEIGHTS:
                y = y * tl.load(w_ptr + t * top_k + k).to(tl.float32)
            acc += y
        tl.store(out_ptr + t * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _gather_rows_triton(
    x: torch.Tensor, order_N: torch.Tensor, top_k: int, *,
    weights: torch.Tensor | None = None, y_for_dot: torch.Tensor | None = None,
    num_valid: torch.Tensor | None = None, out_dtype: torch.dtype | None = None, weights_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """out[n] = weights_scale * weights[order[n]] * x[order[n] // K]; with y_for_dot also
    dw[order[n]] = <x[...], y[n]>; rows n >= num_valid are skipped (out undefined there, dw 0)."""
    x = _rows(x)
    num_rows, num_cols = order_N.numel(), x.shape[1]
    out = torch.empty((num_rows, num_cols), dtype=out_dtype or x.dtype, device=x.device)
    dw = torch.empty(num_rows, dtype=torch.float32, device=x.device) if y_for_dot is not None else None
    if num_rows == 0:
        return out, dw
    y = _rows(y_for_dot) if y_for_dot is not None else x
    block_h = min(next_pow2(num_cols), _MAX_BLOCK_H)
    block_r = max(1, (_GATHER_DOT_TILE if y_for_dot is not None else _GATHER_TILE) // block_h)
    num_warps = _GATHER_NUM_WARPS or warps_for(block_r * block_h)
    with device_of(x):
        _gather_rows_kernel[(triton.cdiv(num_rows, block_r),)](
            x, order_N, weights if weights is not None else x, y, out, dw if dw is not None else out,
            num_valid if num_valid is not None else order_N,
            num_rows, num_cols, top_k, x.stride(0), y.stride(0), out.stride(0), float(weights_scale),
            HAS_WEIGHTS=weights is not None, COMPUTE_DOT=y_for_dot is not None, HAS_NUM_VALID=num_valid is not None,
            BLOCK_R=block_r, BLOCK_H=block_h, num_warps=num_warps,
        )  # fmt: skip
    return out, dw


def _sum_rows_triton(
    y: torch.Tensor, inverse_N: torch.Tensor, top_k: int, *,
    weights: torch.Tensor | None = None, num_valid: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
) -> torch.Tensor:  # fmt: skip
    """out[t] = sum_k weights[t*K + k] * y[inverse[t*K + k]] in fp32, stored in y's dtype; with
    ``num_valid`` (a one-element device tensor) the rows ``inverse[...] >= num_valid`` are left out."""
    y = _rows(y)
    num_tokens, num_cols = inverse_N.numel() // top_k, y.shape[1]
    out = torch.empty((num_tokens, num_cols), dtype=out_dtype or y.dtype, device=y.device)
    if num_tokens == 0:
        return out
    block_h = min(next_pow2(num_cols), _MAX_BLOCK_H)
    with device_of(y):
        _sum_rows_kernel[(num_tokens, triton.cdiv(num_cols, block_h))](
            y, inverse_N, weights if weights is not None else y, num_valid if num_valid is not None else inverse_N, out,
            num_cols, top_k, y.stride(0), out.stride(0),
            HAS_WEIGHTS=weights is not None, HAS_NUM_VALID=num_valid is not None,
            BLOCK_H=block_h, num_warps=warps_for(block_h),
        )  # fmt: skip
    return out


def _gather_rows_torch(x, order_N, top_k, *, weights=None, y_for_dot=None, num_valid=None, out_dtype=None,
                       weights_scale=1.0):
    """The kernels' math in torch ops (lets CPU tests gradcheck the backward formulas); padding rows
    (n >= num_valid) are computed (allowed: undefined) but give dw 0."""
    compute_dtype = torch.promote_types(x.dtype, torch.float32)
    rows = x.index_select(0, order_N // top_k).to(compute_dtype)
    if weights is None:
        out = rows
    else:
        out = rows * (weights.index_select(0, order_N).to(compute_dtype) * weights_scale)[:, None]
    dw = None
    if y_for_dot is not None:
        dots = (rows * y_for_dot.to(compute_dtype)).sum(-1)
        if num_valid is not None:  # where, not a multiply: padding rows of y may hold NaNs
            valid = torch.arange(order_N.numel(), device=x.device) < num_valid.reshape(())
            dots = torch.where(valid, dots, 0.0)
        dw = torch.empty(order_N.numel(), dtype=compute_dtype, device=x.device)
        dw[order_N] = dots
    return out.to(out_dtype or x.dtype), dw


def _sum_rows_torch(y, inverse_N, top_k, *, weights=None, num_valid=None, out_dtype=None):
    compute_dtype = torch.promote_types(y.dtype, torch.float32)
    rows = y.index_select(0, inverse_N).to(compute_dtype)
    if num_valid is not None:  # where, not a multiply: padding rows may hold NaNs
        rows = torch.where((inverse_N < num_valid.reshape(()))[:, None], rows, 0.0)
    if weights is not None:
        rows = rows * weights.to(compute_dtype)[:, None]
    return rows.view(-1, top_k, y.shape[1]).sum(1).to(out_dtype or y.dtype)


def permute_rows(
    x_TH: torch.Tensor, order_N: torch.Tensor, top_k: int, *,
    num_valid: torch.Tensor | None = None, impl: Impl = "auto",
) -> torch.Tensor:  # fmt: skip
    """``moe_permute``'s forward alone, outside autograd: ``x_TH[order_N // top_k]``; the kernel
    leaves rows ``>= num_valid`` (padding) unwritten."""
    gather = _gather_rows_triton if use_triton(impl, x_TH, order_N) else _gather_rows_torch
    return gather(x_TH, order_N, top_k, num_valid=num_valid)[0]


def permute_rows_backward(
    dx_NH: torch.Tensor, order_N: torch.Tensor, top_k: int, *,
    num_valid: torch.Tensor | None = None, impl: Impl = "auto",
) -> torch.Tensor:  # fmt: skip
    """``moe_permute``'s backward alone: each token's K sorted rows of ``dx_NH`` summed in fp32 (no
    atomics, deterministic), leaving out the sorted rows ``>= num_valid`` (padding)."""
    sum_rows = _sum_rows_triton if use_triton(impl, dx_NH, order_N) else _sum_rows_torch
    return sum_rows(dx_NH, inverse_order(order_N), top_k, num_valid=num_valid)


class MoEPermuteFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, order_N, top_k: int, backend: str, num_valid=None):
        ctx.save_for_backward(order_N, num_valid)
        ctx.top_k, ctx.backend = top_k, backend
        return permute_rows(x_TH, order_N, top_k, impl=backend)

    @staticmethod
    def backward(ctx, dx_NH):
        order_N, num_valid = ctx.saved_tensors
        dx_TH = permute_rows_backward(dx_NH, order_N, ctx.top_k, num_valid=num_valid, impl=ctx.backend)
        return dx_TH, None, None, None, None


def combine_rows(
    y_NH: torch.Tensor, weights_TK: torch.Tensor, order_N: torch.Tensor, *,
    num_valid: torch.Tensor | None = None, out_dtype: torch.dtype | None = None, impl: Impl = "auto",
) -> torch.Tensor:  # fmt: skip
    """``moe_combine``'s forward alone, outside autograd."""
    sum_rows = _sum_rows_triton if use_triton(impl, y_NH, order_N) else _sum_rows_torch
    # The kernels index the weights by routed slot: a dense [T * K] vector.
    return sum_rows(
        y_NH, inverse_order(order_N), weights_TK.shape[1], weights=weights_TK.reshape(-1).contiguous(),
        num_valid=num_valid, out_dtype=out_dtype,
    )  # fmt: skip


def combine_rows_backward(
    dout_TH: torch.Tensor, y_NH: torch.Tensor, weights_TK: torch.Tensor, order_N: torch.Tensor, *,
    num_valid: torch.Tensor | None = None, need_weights_grad: bool = True, rows_grad_scale: float = 1.0,
    impl: Impl = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """``moe_combine``'s backward alone: (gradient of ``y_NH`` times ``rows_grad_scale``, gradient of
    ``weights_TK`` or None). ``dout_TH`` may be in any float dtype (the kernel computes in fp32);
    the kernel multiplies the scale into the weights it applies anyway (no pass over the rows)."""
    gather = _gather_rows_triton if use_triton(impl, dout_TH, order_N) else _gather_rows_torch
    dy_NH, dw_N = gather(
        dout_TH, order_N, weights_TK.shape[1], weights=weights_TK.reshape(-1).contiguous(),
        y_for_dot=y_NH if need_weights_grad else None, num_valid=num_valid, out_dtype=y_NH.dtype,
        weights_scale=rows_grad_scale,
    )  # fmt: skip
    return dy_NH, dw_N.view_as(weights_TK).to(weights_TK.dtype) if need_weights_grad else None


class MoECombineFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_NH, weights_TK, order_N, backend: str, num_valid=None, out_dtype=None):
        ctx.save_for_backward(y_NH, weights_TK, order_N, num_valid)
        ctx.backend = backend
        return combine_rows(y_NH, weights_TK, order_N, num_valid=num_valid, out_dtype=out_dtype, impl=backend)

    @staticmethod
    def backward(ctx, dout_TH):
        y_NH, weights_TK, order_N, num_valid = ctx.saved_tensors
        dy_NH, dw_TK = combine_rows_backward(
            dout_TH, y_NH, weights_TK, order_N, num_valid=num_valid, need_weights_grad=ctx.needs_input_grad[1],
            impl=ctx.backend,
        )  # fmt: skip
        return dy_NH, dw_TK, None, None, None, None


def _check_order(order_N: torch.Tensor, num_slots: int) -> None:
    if order_N.dim() != 1 or order_N.numel() != num_slots:
        raise ValueError(f"order_N must be a permutation of the {num_slots} routed slots, got shape {tuple(order_N.shape)}")
    if order_N.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"order_N must be int32 or int64, got {order_N.dtype}")


def moe_permute(
    x_TH: torch.Tensor, order_N: torch.Tensor, top_k: int, *,
    num_valid: torch.Tensor | None = None, impl: Impl = "auto",
) -> torch.Tensor:  # fmt: skip
    """``x_TH[order_N // top_k]``: the routed copies sorted by expert, with an atomics-free backward.

    ``order_N`` must be a permutation of ``range(T * top_k)`` (checked by shape only: no host sync).
    ``num_valid`` (a one-element integer tensor on ``x_TH``'s device): sorted rows from there on are
    padding whose gradient is dropped, not summed into ``x_TH``'s (it may be undefined memory).
    """
    _check_order(order_N, x_TH.shape[0] * top_k)
    if x_TH.dim() != 2:
        raise ValueError(f"x_TH must be [T, H], got {tuple(x_TH.shape)}")
    if num_valid is not None and num_valid.numel() != 1:
        raise ValueError(f"num_valid must hold one count, got shape {tuple(num_valid.shape)}")
    if use_triton(impl, x_TH, order_N):
        return MoEPermuteFunction.apply(x_TH, order_N.contiguous(), top_k, "triton", num_valid)
    if num_valid is not None:
        return MoEPermuteFunction.apply(x_TH, order_N, top_k, "torch", num_valid)
    return moe_permute_reference(x_TH, order_N, top_k)


def moe_combine(
    y_NH: torch.Tensor, weights_TK: torch.Tensor, order_N: torch.Tensor, *,
    num_valid: torch.Tensor | None = None, out_dtype: torch.dtype | None = None, impl: Impl = "auto",
) -> torch.Tensor:  # fmt: skip
    """``out_TH[t] = sum_k weights_TK[t, k] * y_NH[row of slot t*K + k]`` in fp32, stored in y's dtype
    (or ``out_dtype``: fp32 partial sums that are added up elsewhere, rounded once).

    ``y_NH`` rows are sorted as ``order_N`` says (the output of ``moe_permute`` pushed through
    the experts); ``weights_TK`` are the router's weights in token order and get a gradient.
    ``num_valid`` (one-element device tensor): sorted rows from there on are padding, never read
    (they may hold NaNs); their slots add nothing and their weights get a zero gradient.
    """
    if weights_TK.dim() != 2 or y_NH.dim() != 2:
        raise ValueError(f"expected y_NH [N, H] and weights_TK [T, K], got {tuple(y_NH.shape)} and {tuple(weights_TK.shape)}")
    _check_order(order_N, weights_TK.numel())
    if y_NH.shape[0] != order_N.numel():
        raise ValueError(f"y_NH has {y_NH.shape[0]} rows but there are {order_N.numel()} routed slots")
    if num_valid is not None and num_valid.numel() != 1:
        raise ValueError(f"num_valid must hold one count, got shape {tuple(num_valid.shape)}")
    if use_triton(impl, y_NH, weights_TK, order_N):
        return MoECombineFunction.apply(y_NH, weights_TK, order_N.contiguous(), "triton", num_valid, out_dtype)
    if num_valid is not None or out_dtype is not None:
        return MoECombineFunction.apply(y_NH, weights_TK, order_N, "torch", num_valid, out_dtype)
    return moe_combine_reference(y_NH, weights_TK, order_N)
