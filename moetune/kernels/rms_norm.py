"""Fused RMSNorm: one kernel forward, one kernel backward (dx and per-program dweight partials).

Semantics are exactly Transformers' ``Qwen3MoeRMSNorm`` (T5 style):
``weight * (x.float() * rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)``,
so the normalised activations are rounded to ``x.dtype`` before the weight multiplies them and
the output dtype is ``promote_types(x.dtype, weight.dtype)``; or, with
``round_before_weight=False``, ``GptOssRMSNorm``'s: ``(weight * x_hat).to(x.dtype)``, the weight
multiplied in fp32 and one rounding to ``x.dtype`` at the end.

Shape legend: R = rows (every leading dim flattened), C = normalised (last) dim.
The kernels work on any tensor whose last dim is contiguous: ``[T, H]`` hidden states as well as
q/k norms over ``head_dim`` on ``[B, S, heads, D]`` views.
"""

from __future__ import annotations

import torch
from torch import nn

from moetune.kernels._triton_utils import HAS_TRITON, Impl, device_of, next_pow2, num_sms, tl, triton, use_triton, warps_for

# One row must fit in a program's registers; wider rows take the reference.
MAX_TRITON_COLS = 32768
_TILE = 2048  # elements per program: several short rows (q/k norm) or one long row (hidden)
# The backward's persistent programs loop over row tiles. Launch settings per row width, measured on
# an H200 (benchmarks/probes/rms_norm_probe.py, benchmarks/results/rms_norm_probe_h200_2c019ae.jsonl):
# hidden rows [4096, 2048] 49.9 us with 2048-element tiles and 4 programs per SM (60.8 with the
# 8192 / 2 used before); head_dim rows (q_norm [131072, 128]) 58.0 us with 8192-element tiles, 2 per
# SM and 4 warps (82.1 with the default warps). None: the per-width default below.
_BWD_TILE: int | None = None
_BWD_PROGRAMS_PER_SM: int | None = None
_BWD_NUM_WARPS: int | None = None


# Partial-sum reduction, latency-bound: 512 partial rows per load round and 8 warps; for the hidden
# norms (2048 columns) 16 columns per program (128 programs), for the q / k norms (head_dim columns)
# all of them in one program. On an H200 (benchmarks/probes/sum_partials_probe.py,
# benchmarks/results/sum_partials_probe_h200_6d5e468.jsonl): [528, 2048] 8.7 us alone and
# 5.8 beside a streaming copy (12.5 / 7.3 with the 16-column, 128-row, 4-warp setting used before);
# [264, 128] 8.2 / 6.4 (9.9 / 28.6: its 8 programs stalled beside the copy, as beside the overlapped
# AdamW updates of the graphed expert-parallel step, where the kernel took ~29 us per call).
# None: the per-width default.
_PARTIALS_BLOCK_N: int | None = None
_PARTIALS_BLOCK_P = 512
_PARTIALS_NUM_WARPS = 8


def _bwd_launch_settings(num_cols: int) -> tuple[int, int, int | None]:
    """(row tile in elements, programs per SM, warps or None for warps_for) of the backward."""
    if next_pow2(num_cols) <= 256:  # q / k norms over head_dim
        tile, per_sm, warps = 8192, 2, 4
    else:
        tile, per_sm, warps = 2048, 4, None
    return _BWD_TILE or tile, _BWD_PROGRAMS_PER_SM or per_sm, _BWD_NUM_WARPS or warps


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
                       round_before_weight: bool = True) -> torch.Tensor:  # fmt: skip
    """Plain PyTorch RMSNorm, the Transformers formulas (float64 stays float64 for gradcheck)."""
    compute_dtype = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(compute_dtype)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if not round_before_weight:
        return (weight * xf).to(x.dtype)
    return weight * xf.to(x.dtype)


if HAS_TRITON:

    @triton.jit
    def _rms_norm_fwd_kernel(
        x_ptr, w_ptr, y_ptr, rstd_ptr,
        num_rows, num_cols, stride_x, stride_y, eps,
        ROUND_X_HAT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        row_mask = rows < num_rows
        col_mask = cols < num_cols
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)  # rows * stride can pass 2**31 on long sequences

        x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / num_cols + eps)
        x_hat = x * rstd[:, None]
        if ROUND_X_HAT:  # to x's dtype before the weight multiplies, as Qwen3's norm does
            x_hat = x_hat.to(x_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        y = w[None, :] * x_hat
        tl.store(y_ptr + rows64[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)

    @triton.jit
    def _rms_norm_bwd_kernel(
        dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_partial_ptr,
        num_rows, num_cols, stride_dy, stride_x, stride_dx, row_step,
        COMPUTE_DW: tl.constexpr, ROUND_X_HAT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        # Persistent grid of P programs: program pid takes row tiles pid, pid + P, ... (row_step =
        # P * BLOCK_M rows) and keeps its share of dweight in fp32 registers; the host sums the P
        # partial rows (deterministic, no atomics). The loop bounds are plain scalars because the
        # interpreter cannot take program_id in range().
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < num_cols
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for row_start in range(0, num_rows, row_step):
            rows = row_start + pid * BLOCK_M + tl.arange(0, BLOCK_M)
            row_mask = rows < num_rows
            mask = row_mask[:, None] & col_mask[None, :]
            rows64 = rows.to(tl.int64)
            x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
            x_hat = x * rstd[:, None]
            g = dy * w[None, :]
            # d/dx of x * rstd(x): rstd * (g - x_hat * mean(g * x_hat))
            c = tl.sum(g * x_hat, axis=1) / num_cols
            dx = (g - x_hat * c[:, None]) * rstd[:, None]
            tl.store(dx_ptr + rows64[:, None] * stride_dx + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
            if COMPUTE_DW:
                if ROUND_X_HAT:  # the forward multiplied the weight by x_hat rounded to x's dtype
                    x_hat = x_hat.to(x_ptr.dtype.element_ty).to(tl.float32)
                dw_acc += tl.sum(dy * x_hat, axis=0)
        if COMPUTE_DW:
            tl.store(dw_partial_ptr + pid * num_cols + cols, dw_acc, mask=col_mask)

    @triton.jit
    def _sum_partials_kernel(
        partial_ptr, out_ptr, num_partials, num_cols, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr
    ):
        # out[c] = sum_p partial[p, c] in fp32, stored in the weight's dtype: one launch instead of
        # torch's column reduction plus a cast.
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < num_cols
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for p0 in range(0, num_partials, BLOCK_P):
            ps = p0 + tl.arange(0, BLOCK_P)
            mask = (ps < num_partials)[:, None] & col_mask[None, :]
            acc += tl.sum(tl.load(partial_ptr + ps[:, None] * num_cols + cols[None, :], mask=mask, other=0.0), axis=0)
        tl.store(out_ptr + cols, acc.to(out_ptr.dtype.element_ty), mask=col_mask)


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """[..., C] -> [R, C] with a unit column stride (a view whenever possible)."""
    t2d = t.reshape(-1, t.shape[-1])
    return t2d if t2d.stride(-1) == 1 else t2d.contiguous()


def _launch_sizes(num_cols: int, tile: int = _TILE) -> tuple[int, int, int]:
    block_n = next_pow2(num_cols)
    block_m = max(1, tile // block_n)
    return block_m, block_n, warps_for(block_m * block_n)


def _out_dtype(x: torch.Tensor, weight: torch.Tensor, round_x_hat: bool) -> torch.dtype:
    return torch.promote_types(x.dtype, weight.dtype) if round_x_hat else x.dtype


def _fwd_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, round_x_hat: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    x2d = _as_rows(x)
    weight = weight.contiguous()
    num_rows, num_cols = x2d.shape
    y = torch.empty(x.shape, dtype=_out_dtype(x, weight, round_x_hat), device=x.device)
    rstd = torch.empty(num_rows, dtype=torch.float32, device=x.device)
    if num_rows == 0:
        return y, rstd
    y2d = y.view(num_rows, num_cols)
    block_m, block_n, num_warps = _launch_sizes(num_cols)
    grid = (triton.cdiv(num_rows, block_m),)
    with device_of(x2d):
        _rms_norm_fwd_kernel[grid](
            x2d, weight, y2d, rstd, num_rows, num_cols, x2d.stride(0), y2d.stride(0), eps,
            ROUND_X_HAT=round_x_hat, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
        )  # fmt: skip
    return y, rstd


def _bwd_triton(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, *, compute_dw: bool, round_x_hat: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    x2d = _as_rows(x)
    dy2d = _as_rows(dy)
    weight = weight.contiguous()
    num_rows, num_cols = x2d.shape
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return dx, torch.zeros_like(weight) if compute_dw else None
    dx2d = dx.view(num_rows, num_cols)
    tile, per_sm, warps = _bwd_launch_settings(num_cols)
    block_m, block_n, num_warps = _launch_sizes(num_cols, tile)
    num_warps = warps or num_warps
    num_programs = min(triton.cdiv(num_rows, block_m), per_sm * num_sms(x.device))
    dw_partial = torch.empty((num_programs, num_cols) if compute_dw else (1,), dtype=torch.float32, device=x.device)
    with device_of(dy2d):
        _rms_norm_bwd_kernel[(num_programs,)](
            dy2d, x2d, weight, rstd, dx2d, dw_partial,
            num_rows, num_cols, dy2d.stride(0), x2d.stride(0), dx2d.stride(0), num_programs * block_m,
            COMPUTE_DW=compute_dw, ROUND_X_HAT=round_x_hat, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
        )  # fmt: skip
    return dx, sum_partials(dw_partial, weight) if compute_dw else None


def sum_partials(partial_PC: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The weight gradient from fp32 per-program partial rows [P, C]: their sum in ``weight``'s dtype."""
    num_partials, num_cols = partial_PC.shape
    dw = torch.empty_like(weight)
    block_n = _PARTIALS_BLOCK_N or (min(128, next_pow2(num_cols)) if num_cols <= 256 else 16)
    with device_of(partial_PC):
        _sum_partials_kernel[(triton.cdiv(num_cols, block_n),)](
            partial_PC, dw, num_partials, num_cols, BLOCK_P=_PARTIALS_BLOCK_P, BLOCK_N=block_n,
            num_warps=_PARTIALS_NUM_WARPS,
        )  # fmt: skip
    return dw


def _fwd_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, round_x_hat: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' math in torch ops (lets CPU tests gradcheck the hand-written backward)."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
    x_hat = xf * rstd[..., None]
    y = weight * x_hat.to(x.dtype) if round_x_hat else (weight * x_hat).to(x.dtype)
    return y, rstd.reshape(-1)


def _bwd_torch(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, *, compute_dw: bool, round_x_hat: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    compute_dtype = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(compute_dtype)
    rstd = rstd.view(*x.shape[:-1], 1).to(compute_dtype)
    x_hat = xf * rstd
    g = dy.to(compute_dtype) * weight.to(compute_dtype)
    dx = (g - x_hat * (g * x_hat).mean(-1, keepdim=True)) * rstd
    dw = None
    if compute_dw:
        x_hat_used = x_hat.to(x.dtype).to(compute_dtype) if round_x_hat else x_hat
        dw = (dy.to(compute_dtype) * x_hat_used).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
    return dx.to(x.dtype), dw


class RMSNormFunction(torch.autograd.Function):
    """Autograd wrapper; saves only ``x`` and the fp32 per-row ``rstd`` for the backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str, round_x_hat: bool = True):
        fwd = _fwd_triton if backend == "triton" else _fwd_torch
        y, rstd = fwd(x, weight, eps, round_x_hat)
        ctx.save_for_backward(x, weight, rstd)
        ctx.backend, ctx.round_x_hat = backend, round_x_hat
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        bwd = _bwd_triton if ctx.backend == "triton" else _bwd_torch
        dx, dw = bwd(dy, x, weight, rstd, compute_dw=ctx.needs_input_grad[1], round_x_hat=ctx.round_x_hat)
        return dx, dw, None, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, round_before_weight: bool = True,
             impl: Impl = "auto") -> torch.Tensor:  # fmt: skip
    """RMSNorm over the last dim of ``x`` (any leading shape): Transformers' Qwen3 semantics, or
    with ``round_before_weight=False`` its GPT-OSS ones (the weight multiplied in fp32, output in
    ``x``'s dtype).

    ``impl="auto"`` runs the Triton kernels on CUDA tensors when Triton is installed and the
    reference otherwise; ``"torch"`` / ``"triton"`` force one of them.
    """
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight must have shape ({x.shape[-1]},) to match x's last dim, got {tuple(weight.shape)}")
    if use_triton(impl, x, weight):
        if x.shape[-1] <= MAX_TRITON_COLS:
            return RMSNormFunction.apply(x, weight, eps, "triton", round_before_weight)
        if impl == "triton":
            raise ValueError(f"the Triton RMSNorm handles rows up to {MAX_TRITON_COLS}, got {x.shape[-1]}")
    return rms_norm_reference(x, weight, eps, round_before_weight=round_before_weight)


class RMSNorm(nn.Module):
    """Drop-in for ``Qwen3MoeRMSNorm`` (same parameter name, init and repr) using the fused kernel;
    ``round_before_weight=False`` makes it ``GptOssRMSNorm``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, round_before_weight: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps  # Transformers' attribute name, kept for code that reads it
        self.round_before_weight = round_before_weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon, round_before_weight=self.round_before_weight)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"
