"""Attention sinks (GPT-OSS) folded into an attention kernel's output, and the sinks' gradient, one
pass each.

A sink is one more logit per head, ``s_h``, in every row's softmax, with no value. Given a causal
attention kernel's output O (softmax over the keys only) and its log-sum-exp ``lse`` over the keys,
the sink attention's output is ``O w`` with ``w = exp(lse - lse')`` and ``lse' = logaddexp(lse,
s_h)``, the log-sum-exp over the keys and the sink. Its backward is the kernel's own backward called
with ``lse'`` and the sink output ``O w``: the kernel recomputes ``P' = exp(S - lse')``, the sink
attention's probabilities, and ``D = dO . (O w)``, so its ``dS = P' (dO V^T - D)`` is the softmax
gradient over the keys and the sink (whose value is zero). The sink's own gradient is
``-sum over rows of (1 - w) D``, with ``1 - w = exp(s_h - lse')``.

- ``sink_scale(out, lse, sinks, lse_all)``: returns ``O w`` in O's dtype and writes ``lse'`` into
  ``lse_all`` (a copy of the kernel's log-sum-exp tensor, which its backward then reads). Not in
  place: a program's threads hold each head's value several times over, and one thread's store
  could land before another thread's load of the same element.
- ``sink_grad(grad, out_sink, lse', sinks)``: the sinks' gradient, in fp32.

Layouts: ``out`` / ``grad`` / ``out_sink`` [B, S, H, D] and ``lse`` [B, H, S], any strides (the
flash kernels' [T, H, D] rows and [H, T] log-sum-exp, cuDNN's [B, H, S, D]-shaped views of
[B, S, H, D] memory and its [B, H, S, 1] statistics, all as views). The Triton kernels read and
write each element once: torch's ops took five to eight passes over [T, H, D] between them.

Letters: B batch, S sequence, H heads, D head dim.
"""

from __future__ import annotations

import torch

from moetune.kernels._triton_utils import HAS_TRITON, Impl, device_of, next_pow2, tl, triton, use_triton, warps_for

_TILE = 4096  # elements (heads x D) a program holds per row
_GRAD_ROWS = 16  # rows per program of the sinks' gradient (partial sums [programs, H], summed after)

if HAS_TRITON:

    @triton.jit
    def _with_sink(lse_ptr, sinks_ptr, b, s, heads, head_mask, lse_b, lse_h, lse_s):
        # (each head's lse of row (b, s), the log-sum-exp over the keys and the sink)
        lse = tl.load(lse_ptr + b * lse_b + heads * lse_h + s * lse_s, mask=head_mask, other=0.0).to(tl.float32)
        sink = tl.load(sinks_ptr + heads, mask=head_mask, other=0.0).to(tl.float32)
        top = tl.maximum(lse, sink)
        return lse, top + tl.log(tl.exp(lse - top) + tl.exp(sink - top))

    @triton.jit
    def _sink_scale_kernel(out_ptr, lse_ptr, sinks_ptr, res_ptr, lse_all_ptr, S, H, D, out_b, out_s, out_h, lse_b,
                           lse_h, lse_s, res_b, res_s, res_h, all_b, all_h, all_s, BLOCK_H: tl.constexpr,
                           BLOCK_D: tl.constexpr):  # fmt: skip
        # One program per (row, block of heads): res = out * exp(lse - lse'), lse_all = lse'.
        row = tl.program_id(0).to(tl.int64)
        b, s = row // S, row % S
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        head_mask = heads < H
        dims = tl.arange(0, BLOCK_D)
        lse, lse_all = _with_sink(lse_ptr, sinks_ptr, b, s, heads, head_mask, lse_b, lse_h, lse_s)
        keep = tl.exp(lse - lse_all)
        tl.store(lse_all_ptr + b * all_b + heads * all_h + s * all_s, lse_all, mask=head_mask)
        mask = head_mask[:, None] & (dims < D)[None, :]
        out = tl.load(out_ptr + b * out_b + s * out_s + heads[:, None] * out_h + dims[None, :], mask=mask, other=0.0)
        res = (out.to(tl.float32) * keep[:, None]).to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + b * res_b + s * res_s + heads[:, None] * res_h + dims[None, :], res, mask=mask)

    @triton.jit
    def _sink_grad_kernel(grad_ptr, res_ptr, lse_ptr, sinks_ptr, partial_ptr, rows, S, H, D, grad_b, grad_s, grad_h,
                          res_b, res_s, res_h, lse_b, lse_h, lse_s, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
                          BLOCK_D: tl.constexpr):  # fmt: skip
        # One program per (ROWS rows, block of heads): partial[program, h] = sum (1 - w) (dO . O w).
        block = tl.program_id(0)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        head_mask = heads < H
        dims = tl.arange(0, BLOCK_D)
        sink = tl.load(sinks_ptr + heads, mask=head_mask, other=0.0).to(tl.float32)
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for i in range(ROWS):
            row = block.to(tl.int64) * ROWS + i
            b, s = row // S, row % S
            # the row test as a vector: Triton 3.9's interpreter turns bool-vector & bool-scalar into int32
            row_mask = head_mask & ((heads.to(tl.int64) * 0 + row) < rows)
            mask = row_mask[:, None] & (dims < D)[None, :]
            grad = tl.load(grad_ptr + b * grad_b + s * grad_s + heads[:, None] * grad_h + dims[None, :], mask=mask,
                           other=0.0)  # fmt: skip
            res = tl.load(res_ptr + b * res_b + s * res_s + heads[:, None] * res_h + dims[None, :], mask=mask, other=0.0)
            lse_all = tl.load(lse_ptr + b * lse_b + heads * lse_h + s * lse_s, mask=row_mask, other=float("inf"))
            dot = tl.sum(grad.to(tl.float32) * res.to(tl.float32), axis=1)
            acc += tl.where(row_mask, tl.exp(sink - lse_all.to(tl.float32)) * dot, 0.0)
        tl.store(partial_ptr + block * H + heads, acc, mask=head_mask)


def sink_scale_reference(out_BSHD: torch.Tensor, lse_BHS: torch.Tensor, sinks_H: torch.Tensor,
                         lse_all_BHS: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """``out * exp(lse - lse')`` in ``out``'s dtype; ``lse' = logaddexp(lse, sinks)`` into ``lse_all``.
    fp32 math (float64 for float64 inputs)."""
    compute = torch.promote_types(out_BSHD.dtype, torch.float32)
    lse = lse_BHS.to(compute)
    lse_all = torch.logaddexp(lse, sinks_H.to(compute)[None, :, None])
    keep_BSH = torch.exp(lse - lse_all).transpose(1, 2)
    lse_all_BHS.copy_(lse_all)
    return (out_BSHD.to(compute) * keep_BSH[..., None]).to(out_BSHD.dtype)


def sink_grad_reference(grad_BSHD, out_sink_BSHD, lse_all_BHS, sinks_H) -> torch.Tensor:
    """The sinks' gradient: ``-sum over rows of exp(s_h - lse') (dO . O w)``, [H] in fp32 (float64
    for float64 inputs)."""
    compute = torch.promote_types(out_sink_BSHD.dtype, torch.float32)
    dot_BSH = (grad_BSHD.to(compute) * out_sink_BSHD.to(compute)).sum(-1)
    drop_BSH = torch.exp(sinks_H.to(compute)[None, :, None] - lse_all_BHS.to(compute)).transpose(1, 2)
    return -(drop_BSH * dot_BSH).sum((0, 1))


def _head_blocks(H: int, D: int) -> tuple[int, int]:
    block_d = next_pow2(D)
    return max(1, min(next_pow2(H), _TILE // block_d)), block_d


def _check(out_BSHD: torch.Tensor, lse_BHS: torch.Tensor, sinks_H: torch.Tensor) -> None:
    B, S, H, _ = out_BSHD.shape
    if lse_BHS.shape != (B, H, S) or sinks_H.shape != (H,):
        raise ValueError(f"attention sinks: out {tuple(out_BSHD.shape)} (B, S, H, D) needs lse (B, H, S) and sinks (H,), "
                         f"got lse {tuple(lse_BHS.shape)} and sinks {tuple(sinks_H.shape)}")  # fmt: skip
    if out_BSHD.stride(-1) != 1:
        raise ValueError("attention sinks: the head dim of out must be contiguous")


def sink_scale(out_BSHD: torch.Tensor, lse_BHS: torch.Tensor, sinks_H: torch.Tensor, lse_all_BHS: torch.Tensor, *,
               impl: Impl = "auto") -> torch.Tensor:  # fmt: skip
    """The sink attention's output [B, S, H, D] (contiguous, ``out``'s dtype); the log-sum-exp
    over the keys and the sink goes into ``lse_all_BHS`` (fp32, ``lse_BHS``'s shape)."""
    _check(out_BSHD, lse_BHS, sinks_H)
    if lse_all_BHS.shape != lse_BHS.shape:
        raise ValueError(f"attention sinks: lse_all {tuple(lse_all_BHS.shape)} must have lse's shape {tuple(lse_BHS.shape)}")
    if not use_triton(impl, out_BSHD, lse_BHS, sinks_H):
        return sink_scale_reference(out_BSHD, lse_BHS, sinks_H, lse_all_BHS)
    B, S, H, D = out_BSHD.shape
    res = torch.empty(B, S, H, D, dtype=out_BSHD.dtype, device=out_BSHD.device)
    if res.numel():
        block_h, block_d = _head_blocks(H, D)
        with device_of(out_BSHD):
            _sink_scale_kernel[(B * S, triton.cdiv(H, block_h))](
                out_BSHD, lse_BHS, sinks_H, res, lse_all_BHS, S, H, D, *out_BSHD.stride()[:3], *lse_BHS.stride(),
                *res.stride()[:3], *lse_all_BHS.stride(), BLOCK_H=block_h, BLOCK_D=block_d,
                num_warps=warps_for(block_h * block_d),
            )  # fmt: skip
    return res


def sink_grad(grad_BSHD: torch.Tensor, out_sink_BSHD: torch.Tensor, lse_all_BHS: torch.Tensor, sinks_H: torch.Tensor,
              *, impl: Impl = "auto") -> torch.Tensor:  # fmt: skip
    """The sinks' gradient [H] in fp32 (deterministic: per-program partial sums, then one sum)."""
    _check(out_sink_BSHD, lse_all_BHS, sinks_H)
    if grad_BSHD.stride(-1) != 1:
        grad_BSHD = grad_BSHD.contiguous()
    if not use_triton(impl, grad_BSHD, out_sink_BSHD, lse_all_BHS, sinks_H):
        return sink_grad_reference(grad_BSHD, out_sink_BSHD, lse_all_BHS, sinks_H)
    B, S, H, D = out_sink_BSHD.shape
    rows = B * S
    block_h, block_d = _head_blocks(H, D)
    partial = torch.zeros(max(1, triton.cdiv(rows, _GRAD_ROWS)), H, dtype=torch.float32, device=grad_BSHD.device)
    if rows:
        with device_of(grad_BSHD):
            _sink_grad_kernel[(partial.shape[0], triton.cdiv(H, block_h))](
                grad_BSHD, out_sink_BSHD, lse_all_BHS, sinks_H, partial, rows, S, H, D, *grad_BSHD.stride()[:3],
                *out_sink_BSHD.stride()[:3], *lse_all_BHS.stride(), ROWS=_GRAD_ROWS, BLOCK_H=block_h, BLOCK_D=block_d,
                num_warps=warps_for(block_h * block_d),
            )  # fmt: skip
    return -partial.sum(0)
