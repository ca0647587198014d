"""Qwen3's per-head q/k RMSNorm fused with RoPE: one kernel forward, one kernel backward.

The attention computes ``apply_rope(q_norm(q), k_norm(k), cos, sin, unsqueeze_dim=2)``: three
launches forward (``rms_norm`` twice, ``apply_rope``) and three backward, with the normalised q and
k written to memory and read back in between. Here one program takes all q and all k heads of a
position (cos/sin read once) and does both steps in registers, so each direction saves one write
and one read of q and k and two launches (four per layer).

Math per head (x one head's D values of q or k, w the norm's weight, c / s the position's cos /
sin with halves c1, c2 / s1, s2, n1, n2 the halves of n):

    rstd = rsqrt(mean(x^2) + eps)                                   (fp32)
    n = (w * (x * rstd).to(x.dtype)).to(norm dtype)                 (moetune's RMSNorm, as it stores it)
    y1 = n1 c1 - n2 s1,  y2 = n2 c2 + n1 s2                         (moetune's RoPE, fp32, stored once)

with norm dtype ``promote(x, w)`` and output dtype ``promote(norm dtype, cos)``: the roundings the
unfused kernels make, so the output equals their chain up to the order of rstd's fp32 sum.
The backward undoes the rotation (``dn1 = dy1 c1 + dy2 s2``, ``dn2 = dy2 c2 - dy1 s1``), rounds
dn to the norm dtype as ``apply_rope``'s backward stores it, then runs RMSNorm's backward
``dx = rstd * (g - x_hat * mean(g * x_hat))`` with ``g = dn * w`` and accumulates
``dw += dn * x_hat.to(x.dtype)`` in fp32 per program (persistent programs over positions; the
partials are summed by rms_norm's ``_sum_partials_kernel``). Saved for the backward: the pre-norm q
and k (views of the projection outputs, which autograd keeps anyway) and the fp32 per-head rstd.
No gradient flows into cos/sin (Transformers' rotary tables are buffers).

Shape legend: B batch, S sequence, Hq / Hk query / key heads, D head_dim (even). q [B, S, Hq, D]
and k [B, S, Hk, D] may be strided views (only D contiguous); cos/sin [B or 1, S, D]; the outputs
are contiguous [B, S, H, D] (the layout the unfused chain returns).
"""

from __future__ import annotations

import torch

from moetune.kernels._triton_utils import HAS_TRITON, Impl, device_of, next_pow2, num_sms, tl, triton, use_triton, warps_for
from moetune.kernels.rms_norm import rms_norm_reference, sum_partials
from moetune.kernels.rms_norm import _bwd_torch as _rms_norm_bwd_torch
from moetune.kernels.rms_norm import _fwd_torch as _rms_norm_fwd_torch
from moetune.kernels.rope import _rope_torch, _unit_last, apply_rope_reference

_TILE = 2048  # elements per half-tile (heads x D/2) held in registers, as in rope.py
# Launch settings measured on an H200 with the forward + backward replayed from a CUDA graph
# (benchmarks/probes/qk_norm_rope_probe.py, benchmarks/results/qk_norm_rope_probe_graphed_h200_800f0d2.jsonl;
# Qwen3-30B-A3B, 4096 positions): 4 warps forward, 2 persistent programs per SM with 4 warps
# backward: 119.1 us per layer against 129.3 for the unfused norms + RoPE; more warps were slower
# (8 / 16 backward warps: 189-275 us).
_BWD_PROGRAMS_PER_SM = 2
_BWD_NUM_WARPS: int | None = 4
_FWD_NUM_WARPS: int | None = 4


def qk_norm_rope_reference(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor, eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Transformers' math op for op: ``apply_rotary_pos_emb(q_norm(q), k_norm(k), cos, sin, unsqueeze_dim=2)``."""
    q_norm = rms_norm_reference(q, q_weight, eps)
    k_norm = rms_norm_reference(k, k_weight, eps)
    return apply_rope_reference(q_norm, k_norm, cos, sin, unsqueeze_dim=2)


if HAS_TRITON:

    @triton.jit
    def _rotate(x1, x2, c1, c2, s1, s2):
        # rope.py's rotation, written the same way so both compile to the same arithmetic; the
        # backward passes (s1, s2) -> (-s2, -s1) as rope.py's BACKWARD branch does.
        return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2

    @triton.jit
    def _norm_rope_heads_fwd(
        x_ptr, w1, w2, out_ptr, rstd_ptr, b, s, pos, num_heads, half_dim, head_dim, eps,
        sx_b, sx_s, sx_h, so_b, so_s, so_h, c1, c2, s1, s2,
        NORM_DTYPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        # All heads of one position of q (or k), BLOCK_H heads at a time, as [heads, D/2] halves.
        d = tl.arange(0, BLOCK_D)
        d_mask = d < half_dim
        for h0 in range(0, num_heads, BLOCK_H):
            heads = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)
            head_mask = heads < num_heads
            mask = head_mask[:, None] & d_mask[None, :]
            src = x_ptr + b * sx_b + s * sx_s + heads[:, None] * sx_h + d[None, :]
            x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(src + half_dim, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.math.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / head_dim + eps)
            # RMSNorm as rms_norm's kernel stores it: x_hat rounded to x's dtype, times the weight,
            # rounded to the norm's output dtype; then the rotation in fp32 on those values.
            n1 = (w1 * (x1 * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)).to(NORM_DTYPE).to(tl.float32)
            n2 = (w2 * (x2 * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)).to(NORM_DTYPE).to(tl.float32)
            y1, y2 = _rotate(n1, n2, c1, c2, s1, s2)
            dst = out_ptr + b * so_b + s * so_s + heads[:, None] * so_h + d[None, :]
            tl.store(dst, y1.to(out_ptr.dtype.element_ty), mask=mask)
            tl.store(dst + half_dim, y2.to(out_ptr.dtype.element_ty), mask=mask)
            tl.store(rstd_ptr + pos * num_heads + heads, rstd, mask=head_mask)

    @triton.jit
    def _qk_norm_rope_fwd_kernel(
        q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, rstd_q_ptr, rstd_k_ptr,
        seq_len, num_q_heads, num_k_heads, half_dim, head_dim, eps,
        sq_b, sq_s, sq_h, sk_b, sk_s, sk_h,
        sqo_b, sqo_s, sqo_h, sko_b, sko_s, sko_h,
        sc_b, sc_s,
        Q_NORM_DTYPE: tl.constexpr, K_NORM_DTYPE: tl.constexpr,
        BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        # One program per (batch, position): cos/sin are read once for every q and k head.
        pos = tl.program_id(0).to(tl.int64)
        b = pos // seq_len
        s = pos % seq_len
        d = tl.arange(0, BLOCK_D)
        d_mask = d < half_dim
        cs_off = b * sc_b + s * sc_s + d
        c1 = tl.load(cos_ptr + cs_off, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        c2 = tl.load(cos_ptr + cs_off + half_dim, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        s1 = tl.load(sin_ptr + cs_off, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        s2 = tl.load(sin_ptr + cs_off + half_dim, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        qw1 = tl.load(qw_ptr + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        qw2 = tl.load(qw_ptr + half_dim + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        kw1 = tl.load(kw_ptr + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        kw2 = tl.load(kw_ptr + half_dim + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        _norm_rope_heads_fwd(
            q_ptr, qw1, qw2, qo_ptr, rstd_q_ptr, b, s, pos, num_q_heads, half_dim, head_dim, eps,
            sq_b, sq_s, sq_h, sqo_b, sqo_s, sqo_h, c1, c2, s1, s2, Q_NORM_DTYPE, BLOCK_HQ, BLOCK_D,
        )  # fmt: skip
        _norm_rope_heads_fwd(
            k_ptr, kw1, kw2, ko_ptr, rstd_k_ptr, b, s, pos, num_k_heads, half_dim, head_dim, eps,
            sk_b, sk_s, sk_h, sko_b, sko_s, sko_h, c1, c2, s1, s2, K_NORM_DTYPE, BLOCK_HK, BLOCK_D,
        )  # fmt: skip

    @triton.jit
    def _norm_rope_heads_bwd(
        dy_ptr, x_ptr, w1, w2, rstd_ptr, dx_ptr, b, s, pos, num_positions, num_heads, half_dim, head_dim,
        sdy_b, sdy_s, sdy_h, sx_b, sx_s, sx_h, sdx_b, sdx_s, sdx_h, c1, c2, s1, s2,
        NORM_DTYPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        # dx for all heads of one position; returns this position's dweight halves (fp32).
        d = tl.arange(0, BLOCK_D)
        d_mask = d < half_dim
        dw1 = tl.zeros([BLOCK_D], dtype=tl.float32)
        dw2 = tl.zeros([BLOCK_D], dtype=tl.float32)
        for h0 in range(0, num_heads, BLOCK_H):
            heads = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)
            # The last loop round of a persistent program may be past the end: pos is a scalar,
            # broadcast to the heads explicitly (Triton 3.9's interpreter wants block-shaped masks).
            head_mask = (heads < num_heads) & ((heads * 0 + pos) < num_positions)
            mask = head_mask[:, None] & d_mask[None, :]
            src = dy_ptr + b * sdy_b + s * sdy_s + heads[:, None] * sdy_h + d[None, :]
            dy1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
            dy2 = tl.load(src + half_dim, mask=mask, other=0.0).to(tl.float32)
            # RoPE's backward (c, s already transposed by the caller), rounded to the norm's output
            # dtype as apply_rope's backward stores the grad it hands to rms_norm's backward.
            dn1, dn2 = _rotate(dy1, dy2, c1, c2, s1, s2)
            dn1 = dn1.to(NORM_DTYPE).to(tl.float32)
            dn2 = dn2.to(NORM_DTYPE).to(tl.float32)
            src = x_ptr + b * sx_b + s * sx_s + heads[:, None] * sx_h + d[None, :]
            x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(src + half_dim, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + pos * num_heads + heads, mask=head_mask, other=0.0)[:, None]
            x_hat1 = x1 * rstd
            x_hat2 = x2 * rstd
            g1 = dn1 * w1
            g2 = dn2 * w2
            # d/dx of x * rstd(x): rstd * (g - x_hat * mean(g * x_hat)), the mean over both halves
            proj = (tl.sum(g1 * x_hat1, axis=1) + tl.sum(g2 * x_hat2, axis=1)) / head_dim
            dx1 = (g1 - x_hat1 * proj[:, None]) * rstd
            dx2 = (g2 - x_hat2 * proj[:, None]) * rstd
            dst = dx_ptr + b * sdx_b + s * sdx_s + heads[:, None] * sdx_h + d[None, :]
            tl.store(dst, dx1.to(dx_ptr.dtype.element_ty), mask=mask)
            tl.store(dst + half_dim, dx2.to(dx_ptr.dtype.element_ty), mask=mask)
            # The forward multiplied the weight by x_hat rounded to x's dtype.
            dw1 += tl.sum(dn1 * x_hat1.to(x_ptr.dtype.element_ty).to(tl.float32), axis=0)
            dw2 += tl.sum(dn2 * x_hat2.to(x_ptr.dtype.element_ty).to(tl.float32), axis=0)
        return dw1, dw2

    @triton.jit
    def _qk_norm_rope_bwd_kernel(
        dqo_ptr, dko_ptr, q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, rstd_q_ptr, rstd_k_ptr,
        dq_ptr, dk_ptr, dqw_partial_ptr, dkw_partial_ptr,
        num_positions, seq_len, num_q_heads, num_k_heads, half_dim, head_dim, num_programs,
        sdqo_b, sdqo_s, sdqo_h, sdko_b, sdko_s, sdko_h,
        sq_b, sq_s, sq_h, sk_b, sk_s, sk_h,
        sdq_b, sdq_s, sdq_h, sdk_b, sdk_s, sdk_h,
        sc_b, sc_s,
        Q_NORM_DTYPE: tl.constexpr, K_NORM_DTYPE: tl.constexpr, COMPUTE_DQW: tl.constexpr, COMPUTE_DKW: tl.constexpr,
        BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        # Persistent grid of P programs: program pid takes positions pid, pid + P, ... and keeps
        # its share of both dweights in fp32 registers; _sum_partials_kernel sums the P partial
        # rows (deterministic, no atomics). The loop bounds are plain scalars because the
        # interpreter cannot take program_id in range().
        pid = tl.program_id(0)
        d = tl.arange(0, BLOCK_D)
        d_mask = d < half_dim
        qw1 = tl.load(qw_ptr + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        qw2 = tl.load(qw_ptr + half_dim + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        kw1 = tl.load(kw_ptr + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        kw2 = tl.load(kw_ptr + half_dim + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        dqw1 = tl.zeros([BLOCK_D], dtype=tl.float32)
        dqw2 = tl.zeros([BLOCK_D], dtype=tl.float32)
        dkw1 = tl.zeros([BLOCK_D], dtype=tl.float32)
        dkw2 = tl.zeros([BLOCK_D], dtype=tl.float32)
        for pos0 in range(0, num_positions, num_programs):
            pos = (pos0 + pid).to(tl.int64)
            b = pos // seq_len
            s = pos % seq_len
            cs_mask = d_mask & ((d * 0 + pos) < num_positions)
            cs_off = b * sc_b + s * sc_s + d
            c1 = tl.load(cos_ptr + cs_off, mask=cs_mask, other=0.0).to(tl.float32)[None, :]
            c2 = tl.load(cos_ptr + cs_off + half_dim, mask=cs_mask, other=0.0).to(tl.float32)[None, :]
            # Transpose of the rotation: (s1, s2) -> (-s2, -s1).
            s1_t = -tl.load(sin_ptr + cs_off + half_dim, mask=cs_mask, other=0.0).to(tl.float32)[None, :]
            s2_t = -tl.load(sin_ptr + cs_off, mask=cs_mask, other=0.0).to(tl.float32)[None, :]
            dw1, dw2 = _norm_rope_heads_bwd(
                dqo_ptr, q_ptr, qw1, qw2, rstd_q_ptr, dq_ptr, b, s, pos, num_positions, num_q_heads, half_dim, head_dim,
                sdqo_b, sdqo_s, sdqo_h, sq_b, sq_s, sq_h, sdq_b, sdq_s, sdq_h, c1, c2, s1_t, s2_t,
                Q_NORM_DTYPE, BLOCK_HQ, BLOCK_D,
            )  # fmt: skip
            if COMPUTE_DQW:
                dqw1 += dw1
                dqw2 += dw2
            dw1, dw2 = _norm_rope_heads_bwd(
                dko_ptr, k_ptr, kw1, kw2, rstd_k_ptr, dk_ptr, b, s, pos, num_positions, num_k_heads, half_dim, head_dim,
                sdko_b, sdko_s, sdko_h, sk_b, sk_s, sk_h, sdk_b, sdk_s, sdk_h, c1, c2, s1_t, s2_t,
                K_NORM_DTYPE, BLOCK_HK, BLOCK_D,
            )  # fmt: skip
            if COMPUTE_DKW:
                dkw1 += dw1
                dkw2 += dw2
        row = pid * head_dim + d  # partial rows are [P, D]
        if COMPUTE_DQW:
            tl.store(dqw_partial_ptr + row, dqw1, mask=d_mask)
            tl.store(dqw_partial_ptr + row + half_dim, dqw2, mask=d_mask)
        if COMPUTE_DKW:
            tl.store(dkw_partial_ptr + row, dkw1, mask=d_mask)
            tl.store(dkw_partial_ptr + row + half_dim, dkw2, mask=d_mask)


def _launch_sizes(num_q_heads: int, num_k_heads: int, head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_HQ, BLOCK_HK, BLOCK_D, num_warps): up to _TILE elements per [heads, D/2] half-tile."""
    block_d = next_pow2(head_dim // 2)
    block_hq = max(1, min(next_pow2(num_q_heads), _TILE // block_d))
    block_hk = max(1, min(next_pow2(num_k_heads), _TILE // block_d))
    return block_hq, block_hk, block_d, warps_for(max(block_hq, block_hk) * block_d)


def _norm_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, weight.dtype)  # RMSNorm's output dtype


def _tl_norm_dtype(x: torch.Tensor, weight: torch.Tensor):
    """RMSNorm's output dtype as a Triton dtype (a constexpr: the kernels round to it)."""
    return getattr(tl, str(_norm_dtype(x, weight)).removeprefix("torch."))


def _tables(cos: torch.Tensor, sin: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin as [B, S, D] with one set of strides (a batch-1 table gets batch stride 0)."""
    cos = cos.expand(batch, -1, -1)
    sin = sin.expand(batch, -1, -1)
    if cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    return cos, sin


def _fwd_triton(q, k, q_weight, k_weight, cos, sin, eps):
    batch, seq_len, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[2]
    q_norm_dtype, k_norm_dtype = _norm_dtype(q, q_weight), _norm_dtype(k, k_weight)
    q_out = torch.empty(q.shape, dtype=torch.promote_types(q_norm_dtype, cos.dtype), device=q.device)
    k_out = torch.empty(k.shape, dtype=torch.promote_types(k_norm_dtype, cos.dtype), device=k.device)
    rstd_q = torch.empty(batch * seq_len * num_q_heads, dtype=torch.float32, device=q.device)
    rstd_k = torch.empty(batch * seq_len * num_k_heads, dtype=torch.float32, device=k.device)
    if batch * seq_len == 0:
        return q_out, k_out, rstd_q, rstd_k
    cos, sin = _tables(cos, sin, batch)
    block_hq, block_hk, block_d, num_warps = _launch_sizes(num_q_heads, num_k_heads, head_dim)
    num_warps = _FWD_NUM_WARPS or num_warps
    with device_of(q):
        _qk_norm_rope_fwd_kernel[(batch * seq_len,)](
            q, k, q_weight.contiguous(), k_weight.contiguous(), cos, sin, q_out, k_out, rstd_q, rstd_k,
            seq_len, num_q_heads, num_k_heads, head_dim // 2, head_dim, eps,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            q_out.stride(0), q_out.stride(1), q_out.stride(2), k_out.stride(0), k_out.stride(1), k_out.stride(2),
            cos.stride(0), cos.stride(1),
            Q_NORM_DTYPE=_tl_norm_dtype(q, q_weight), K_NORM_DTYPE=_tl_norm_dtype(k, k_weight),
            BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_D=block_d, num_warps=num_warps,
        )  # fmt: skip
    return q_out, k_out, rstd_q, rstd_k


def _bwd_triton(dq_out, dk_out, q, k, q_weight, k_weight, cos, sin, rstd_q, rstd_k, *, compute_dw):
    batch, seq_len, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[2]
    q_weight, k_weight = q_weight.contiguous(), k_weight.contiguous()
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    num_positions = batch * seq_len
    if num_positions == 0:
        dws = (torch.zeros_like(w) if need else None for w, need in zip((q_weight, k_weight), compute_dw))
        return dq, dk, *dws
    cos, sin = _tables(cos, sin, batch)
    block_hq, block_hk, block_d, num_warps = _launch_sizes(num_q_heads, num_k_heads, head_dim)
    num_warps = _BWD_NUM_WARPS or min(16, 2 * num_warps)
    num_programs = min(num_positions, _BWD_PROGRAMS_PER_SM * num_sms(q.device))
    partials = [
        torch.empty((num_programs, head_dim) if need else (1,), dtype=torch.float32, device=q.device)
        for need in compute_dw
    ]
    with device_of(q):
        _qk_norm_rope_bwd_kernel[(num_programs,)](
            dq_out, dk_out, q, k, q_weight, k_weight, cos, sin, rstd_q, rstd_k, dq, dk, *partials,
            num_positions, seq_len, num_q_heads, num_k_heads, head_dim // 2, head_dim, num_programs,
            dq_out.stride(0), dq_out.stride(1), dq_out.stride(2), dk_out.stride(0), dk_out.stride(1), dk_out.stride(2),
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            dq.stride(0), dq.stride(1), dq.stride(2), dk.stride(0), dk.stride(1), dk.stride(2),
            cos.stride(0), cos.stride(1),
            Q_NORM_DTYPE=_tl_norm_dtype(q, q_weight), K_NORM_DTYPE=_tl_norm_dtype(k, k_weight),
            COMPUTE_DQW=compute_dw[0], COMPUTE_DKW=compute_dw[1],
            BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_D=block_d, num_warps=num_warps,
        )  # fmt: skip
    weights = (q_weight, k_weight)
    dws = [sum_partials(partial, w) if need else None for w, partial, need in zip(weights, partials, compute_dw)]
    return dq, dk, *dws


def _fwd_torch(q, k, q_weight, k_weight, cos, sin, eps):
    """The kernels' math in torch ops: rms_norm's and rope's torch twins chained, with the same
    roundings in between (lets CPU tests gradcheck the hand-written backward)."""
    q_norm, rstd_q = _rms_norm_fwd_torch(q, q_weight, eps)
    k_norm, rstd_k = _rms_norm_fwd_torch(k, k_weight, eps)
    q_out = torch.empty(q.shape, dtype=torch.promote_types(q_norm.dtype, cos.dtype), device=q.device)
    k_out = torch.empty(k.shape, dtype=torch.promote_types(k_norm.dtype, cos.dtype), device=k.device)
    # _rope_torch takes [B, H, S, D]; transposed views write through to the [B, S, H, D] outputs.
    _rope_torch(q_norm.transpose(1, 2), k_norm.transpose(1, 2), cos, sin,
                q_out.transpose(1, 2), k_out.transpose(1, 2), backward=False)  # fmt: skip
    return q_out, k_out, rstd_q, rstd_k


def _bwd_torch(dq_out, dk_out, q, k, q_weight, k_weight, cos, sin, rstd_q, rstd_k, *, compute_dw):
    dq_norm = torch.empty(q.shape, dtype=_norm_dtype(q, q_weight), device=q.device)
    dk_norm = torch.empty(k.shape, dtype=_norm_dtype(k, k_weight), device=k.device)
    _rope_torch(dq_out.transpose(1, 2), dk_out.transpose(1, 2), cos, sin,
                dq_norm.transpose(1, 2), dk_norm.transpose(1, 2), backward=True)  # fmt: skip
    dq, dq_weight = _rms_norm_bwd_torch(dq_norm, q, q_weight, rstd_q, compute_dw=compute_dw[0])
    dk, dk_weight = _rms_norm_bwd_torch(dk_norm, k, k_weight, rstd_k, compute_dw=compute_dw[1])
    return dq, dk, dq_weight, dk_weight


class QKNormRoPEFunction(torch.autograd.Function):
    """q/k RMSNorm + RoPE; saves q, k (pre-norm), the weights, cos/sin and the fp32 per-head rstd.
    No gradient flows to cos/sin."""

    @staticmethod
    def forward(ctx, q, k, q_weight, k_weight, cos, sin, eps: float, backend: str):
        fwd = _fwd_triton if backend == "triton" else _fwd_torch
        q_out, k_out, rstd_q, rstd_k = fwd(q, k, q_weight, k_weight, cos, sin, eps)
        ctx.save_for_backward(q, k, q_weight, k_weight, cos, sin, rstd_q, rstd_k)
        ctx.backend = backend
        return q_out, k_out

    @staticmethod
    def backward(ctx, dq_out, dk_out):
        q, k, q_weight, k_weight, cos, sin, rstd_q, rstd_k = ctx.saved_tensors
        # Autograd materialises a zero grad for an unused output, so both are tensors here.
        dq_out, dk_out = _unit_last(dq_out), _unit_last(dk_out)
        bwd = _bwd_triton if ctx.backend == "triton" else _bwd_torch
        compute_dw = (ctx.needs_input_grad[2], ctx.needs_input_grad[3])
        dq, dk, dq_weight, dk_weight = bwd(dq_out, dk_out, q, k, q_weight, k_weight, cos, sin, rstd_q, rstd_k,
                                           compute_dw=compute_dw)  # fmt: skip
        return dq, dk, dq_weight, dk_weight, None, None, None, None


def _check_shapes(q, k, q_weight, k_weight, cos, sin) -> None:
    if q.dim() != 4:
        raise ValueError(f"q must be [B, S, Hq, D], got shape {tuple(q.shape)}")
    batch, seq_len, _, head_dim = q.shape
    if head_dim % 2:
        raise ValueError(f"head_dim (q's last dim) must be even for RoPE, got {head_dim}")
    if k.dim() != 4 or k.shape[:2] != q.shape[:2] or k.shape[-1] != head_dim:
        raise ValueError(f"k must be [B, S, Hk, D] with q's B, S, D = {batch}, {seq_len}, {head_dim}, "
                         f"got shape {tuple(k.shape)}")  # fmt: skip
    for name, weight in (("q_weight", q_weight), ("k_weight", k_weight)):
        if weight.shape != (head_dim,):
            raise ValueError(f"{name} must have shape ({head_dim},) to match head_dim, got {tuple(weight.shape)}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 3 or table.shape[0] not in (1, batch) or table.shape[1:] != (seq_len, head_dim):
            raise ValueError(f"{name} must be [B or 1, S, D] with B, S, D = {batch}, {seq_len}, {head_dim}, "
                             f"got shape {tuple(table.shape)}")  # fmt: skip


def qk_norm_rope(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor, eps: float = 1e-6, *, impl: Impl = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``apply_rope(rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps), cos, sin, unsqueeze_dim=2)`` fused.

    q [B, S, Hq, D], k [B, S, Hk, D] (views with a contiguous last dim are used in place), the
    norms' weights [D], cos/sin [B or 1, S, D]. Returns contiguous [B, S, H, D] tensors of dtype
    ``promote(q, q_weight, cos)`` / ``promote(k, k_weight, cos)``. ``impl="auto"`` runs the Triton
    kernels on CUDA tensors when Triton is installed and the reference otherwise; the Triton path
    does not differentiate through cos/sin, so when either requires grad the reference runs.
    """
    _check_shapes(q, k, q_weight, k_weight, cos, sin)
    differentiable_cos = torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad)
    if use_triton(impl, q, k, q_weight, k_weight, cos, sin) and not differentiable_cos:
        return QKNormRoPEFunction.apply(
            _unit_last(q), _unit_last(k), q_weight, k_weight, _unit_last(cos), _unit_last(sin), eps, "triton"
        )
    return qk_norm_rope_reference(q, k, q_weight, k_weight, cos, sin, eps)
