"""DeepSeek-V3's latent attention (MLA): queries, keys and values for the attention kernel in one
launch each way, instead of Transformers' splits, RoPE ops, ``expand`` and concatenations.

Per token and head (Dn non-rotary, R rotary, Dv value dims; DeepSeek-V3 / Kimi-K2 / Moonlight:
128, 64, 128):

- query  ``[q_pass | rope(q_rot)]``            from the query projection's head ``[q_pass | q_rot]``
- key    ``[k_pass | rope(k_rot)]``            ``k_pass`` from ``kv_b_proj``'s head ``[k_pass | v]``,
                                                ``k_rot`` [R] shared by all heads (``kv_a_proj``)
- value  ``v`` (a view of ``kv_b_proj``'s output), or zero-padded to the query width where the
  flash kernels need equal widths.

RoPE follows Transformers' DeepSeek-V3: with ``interleaved`` (``config.rope_interleave``) the
rotary dims are pairs ``(x[2i], x[2i+1])``, otherwise halves ``(x[i], x[i + R/2])``; either way
the output is in halves: ``y[i] = a cos[i] - b sin[i]``, ``y[i + R/2] = b cos[i + R/2] + a sin[i + R/2]``.
The backward is the transpose, and the shared key's gradient is the sum over heads, rotated once.

At Moonlight-16B-A3B's shapes on an H200 Transformers' ops for this took ~520 us of each layer's
~1.8 ms attention forward + backward (five concatenations at ~51 us, copies and elementwise RoPE
kernels; profiled on 2026-12-01 at 352bfe1, benchmarks/probes/mla_attention_probe.py --profile).

Shape legend: B batch, S sequence, H heads, Q = Dn + R query / key width, X = Dn + Dv.
"""

from __future__ import annotations

import torch

from moetune.kernels._triton_utils import HAS_TRITON, Impl, device_of, next_pow2, tl, triton, use_triton
from moetune.kernels.rope import _unit_last

_TILE = 4096  # elements per [heads, dims] tile held in registers

if HAS_TRITON:

    @triton.jit
    def _load_pairs(base, j, mask, HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
        if INTERLEAVED:
            a = tl.load(base + 2 * j, mask=mask, other=0.0).to(tl.float32)
            b = tl.load(base + 2 * j + 1, mask=mask, other=0.0).to(tl.float32)
        else:
            a = tl.load(base + j, mask=mask, other=0.0).to(tl.float32)
            b = tl.load(base + HALF + j, mask=mask, other=0.0).to(tl.float32)
        return a, b

    @triton.jit
    def _store_pairs(base, j, a, b, mask, HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
        if INTERLEAVED:  # tl.store casts to the pointer's element type
            tl.store(base + 2 * j, a, mask=mask)
            tl.store(base + 2 * j + 1, b, mask=mask)
        else:
            tl.store(base + j, a, mask=mask)
            tl.store(base + HALF + j, b, mask=mask)

    @triton.jit
    def _rope_tables(cos_ptr, sin_ptr, b, s, sc_b, sc_s, j, jm, HALF: tl.constexpr):
        """The token's cos / sin halves (lo: dims < R/2, hi: the rest) in fp32."""
        cs = b * sc_b + s * sc_s
        c_lo = tl.load(cos_ptr + cs + j, mask=jm, other=0.0).to(tl.float32)
        c_hi = tl.load(cos_ptr + cs + HALF + j, mask=jm, other=0.0).to(tl.float32)
        s_lo = tl.load(sin_ptr + cs + j, mask=jm, other=0.0).to(tl.float32)
        s_hi = tl.load(sin_ptr + cs + HALF + j, mask=jm, other=0.0).to(tl.float32)
        return c_lo, c_hi, s_lo, s_hi

    @triton.jit
    def _mla_fwd_kernel(
        q_ptr, kv_ptr, krot_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, vo_ptr,
        seq_len, num_heads,
        sq_b, sq_s, sq_h, skv_b, skv_s, skv_h, skr_b, skr_s, sc_b, sc_s,
        DN: tl.constexpr, HALF: tl.constexpr, DV: tl.constexpr, INTERLEAVED: tl.constexpr, PAD_V: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_DN: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_Q: tl.constexpr,
    ):  # fmt: skip
        # One program per (batch, position): cos / sin and the shared rotated key are computed once.
        pid = tl.program_id(0)
        b = (pid // seq_len).to(tl.int64)
        s = (pid % seq_len).to(tl.int64)
        DQ: tl.constexpr = DN + 2 * HALF
        j = tl.arange(0, BLOCK_HALF)
        jm = j < HALF
        c_lo, c_hi, s_lo, s_hi = _rope_tables(cos_ptr, sin_ptr, b, s, sc_b, sc_s, j, jm, HALF)
        ka, kb = _load_pairs(krot_ptr + b * skr_b + s * skr_s, j, jm, HALF, INTERLEAVED)
        k_lo = (ka * c_lo - kb * s_lo)[None, :]
        k_hi = (kb * c_hi + ka * s_hi)[None, :]
        c_lo, c_hi, s_lo, s_hi = c_lo[None, :], c_hi[None, :], s_lo[None, :], s_hi[None, :]
        n = tl.arange(0, BLOCK_DN)
        h = tl.arange(0, BLOCK_H)
        for h0 in range(0, num_heads, BLOCK_H):
            heads = (h0 + h).to(tl.int64)
            hm = (heads < num_heads)[:, None]
            out_row = ((b * seq_len + s) * num_heads + heads)[:, None] * DQ
            q_src = q_ptr + b * sq_b + s * sq_s + heads[:, None] * sq_h
            kv_src = kv_ptr + b * skv_b + s * skv_s + heads[:, None] * skv_h
            pass_mask = hm & (n < DN)[None, :]
            tl.store(qo_ptr + out_row + n[None, :], tl.load(q_src + n[None, :], mask=pass_mask), mask=pass_mask)
            tl.store(ko_ptr + out_row + n[None, :], tl.load(kv_src + n[None, :], mask=pass_mask), mask=pass_mask)
            rot_mask = hm & jm[None, :]
            qa, qb = _load_pairs(q_src + DN, j[None, :], rot_mask, HALF, INTERLEAVED)
            q_dst = qo_ptr + out_row + DN + j[None, :]
            tl.store(q_dst, (qa * c_lo - qb * s_lo).to(qo_ptr.dtype.element_ty), mask=rot_mask)
            tl.store(q_dst + HALF, (qb * c_hi + qa * s_hi).to(qo_ptr.dtype.element_ty), mask=rot_mask)
            k_dst = ko_ptr + out_row + DN + j[None, :]
            zeros = tl.zeros([BLOCK_H, BLOCK_HALF], dtype=tl.float32)
            tl.store(k_dst, (zeros + k_lo).to(ko_ptr.dtype.element_ty), mask=rot_mask)
            tl.store(k_dst + HALF, (zeros + k_hi).to(ko_ptr.dtype.element_ty), mask=rot_mask)
            if PAD_V:  # the values zero-padded to the query width
                d = tl.arange(0, BLOCK_Q)
                v = tl.load(kv_src + DN + d[None, :], mask=hm & (d < DV)[None, :], other=0.0)
                tl.store(vo_ptr + out_row + d[None, :], v, mask=hm & (d < DQ)[None, :])

    @triton.jit
    def _mla_bwd_kernel(
        dq_ptr, dk_ptr, dv_ptr, cos_ptr, sin_ptr, dqi_ptr, dkv_ptr, dkr_ptr,
        seq_len, num_heads,
        sdq_b, sdq_s, sdq_h, sdk_b, sdk_s, sdk_h, sdv_b, sdv_s, sdv_h, sc_b, sc_s,
        DN: tl.constexpr, HALF: tl.constexpr, DV: tl.constexpr, INTERLEAVED: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_DN: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_DV: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        b = (pid // seq_len).to(tl.int64)
        s = (pid % seq_len).to(tl.int64)
        DQ: tl.constexpr = DN + 2 * HALF
        DX: tl.constexpr = DN + DV
        j = tl.arange(0, BLOCK_HALF)
        jm = j < HALF
        c_lo, c_hi, s_lo, s_hi = _rope_tables(cos_ptr, sin_ptr, b, s, sc_b, sc_s, j, jm, HALF)
        c_lo, c_hi, s_lo, s_hi = c_lo[None, :], c_hi[None, :], s_lo[None, :], s_hi[None, :]
        n = tl.arange(0, BLOCK_DN)
        dvi = tl.arange(0, BLOCK_DV)
        h = tl.arange(0, BLOCK_H)
        key_lo = tl.zeros([BLOCK_HALF], dtype=tl.float32)
        key_hi = tl.zeros([BLOCK_HALF], dtype=tl.float32)
        for h0 in range(0, num_heads, BLOCK_H):
            heads = (h0 + h).to(tl.int64)
            hm = (heads < num_heads)[:, None]
            token_head = (b * seq_len + s) * num_heads + heads
            dq_src = dq_ptr + b * sdq_b + s * sdq_s + heads[:, None] * sdq_h
            dk_src = dk_ptr + b * sdk_b + s * sdk_s + heads[:, None] * sdk_h
            dq_dst = dqi_ptr + token_head[:, None] * DQ
            dkv_dst = dkv_ptr + token_head[:, None] * DX
            pass_mask = hm & (n < DN)[None, :]
            tl.store(dq_dst + n[None, :], tl.load(dq_src + n[None, :], mask=pass_mask), mask=pass_mask)
            tl.store(dkv_dst + n[None, :], tl.load(dk_src + n[None, :], mask=pass_mask), mask=pass_mask)
            v_mask = hm & (dvi < DV)[None, :]
            dv = tl.load(dv_ptr + b * sdv_b + s * sdv_s + heads[:, None] * sdv_h + dvi[None, :], mask=v_mask)
            tl.store(dkv_dst + DN + dvi[None, :], dv, mask=v_mask)
            rot_mask = hm & jm[None, :]
            # The rotation's transpose: (a, b) from the output halves (lo, hi).
            d_lo = tl.load(dq_src + DN + j[None, :], mask=rot_mask, other=0.0).to(tl.float32)
            d_hi = tl.load(dq_src + DN + HALF + j[None, :], mask=rot_mask, other=0.0).to(tl.float32)
            _store_pairs(dq_dst + DN, j[None, :], d_lo * c_lo + d_hi * s_hi, d_hi * c_hi - d_lo * s_lo, rot_mask,
                         HALF, INTERLEAVED)  # fmt: skip
            # The shared key: every head's gradient, summed, then rotated back once.
            key_lo += tl.sum(tl.load(dk_src + DN + j[None, :], mask=rot_mask, other=0.0).to(tl.float32), axis=0)
            key_hi += tl.sum(tl.load(dk_src + DN + HALF + j[None, :], mask=rot_mask, other=0.0).to(tl.float32), axis=0)
        key_lo, key_hi = key_lo[None, :], key_hi[None, :]
        _store_pairs(dkr_ptr + (b * seq_len + s) * 2 * HALF, j[None, :], key_lo * c_lo + key_hi * s_hi,
                     key_hi * c_hi - key_lo * s_lo, jm[None, :], HALF, INTERLEAVED)  # fmt: skip


def _launch_sizes(num_heads: int, nope: int, half: int, value: int) -> dict:
    widest = next_pow2(max(nope, value, 2 * half + nope))
    return {"BLOCK_H": max(1, min(next_pow2(num_heads), _TILE // widest)), "BLOCK_DN": next_pow2(nope),
            "BLOCK_HALF": next_pow2(half)}  # fmt: skip


def _rows(cos: torch.Tensor, batch: int, seq_len: int) -> torch.Tensor:
    return _unit_last(cos.expand(batch, seq_len, cos.shape[-1]))  # a batch-1 cos gets batch stride 0


class MLAQueriesKeysValues(torch.autograd.Function):
    """Queries and keys [B, S, H, Q] (new, contiguous) and values: a view of ``kv`` [B, S, H, X]
    (its last Dv dims) or, with ``pad_values``, a new [B, S, H, Q] zero-padded copy."""

    @staticmethod
    def forward(ctx, q, kv, k_rot, cos, sin, interleaved: bool, pad_values: bool):
        batch, seq_len, num_heads, width = q.shape
        rope_dim = k_rot.shape[-1]
        nope, value = width - rope_dim, kv.shape[-1] - (width - rope_dim)
        cos, sin = _rows(cos, batch, seq_len), _rows(sin, batch, seq_len)
        if cos.stride() != sin.stride():
            cos, sin = cos.contiguous(), sin.contiguous()
        q_out = torch.empty(batch, seq_len, num_heads, width, dtype=q.dtype, device=q.device)
        k_out = torch.empty_like(q_out)
        v_out = torch.empty_like(q_out) if pad_values else q_out  # unused pointer without padding
        if batch * seq_len:
            sizes = _launch_sizes(num_heads, nope, rope_dim // 2, value)
            with device_of(q):
                _mla_fwd_kernel[(batch * seq_len,)](
                    q, kv, k_rot, cos, sin, q_out, k_out, v_out, seq_len, num_heads,
                    q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1), kv.stride(2),
                    k_rot.stride(0), k_rot.stride(1), cos.stride(0), cos.stride(1),
                    DN=nope, HALF=rope_dim // 2, DV=value, INTERLEAVED=interleaved, PAD_V=pad_values,
                    BLOCK_Q=next_pow2(width), num_warps=4, **sizes,
                )  # fmt: skip
        ctx.save_for_backward(cos, sin)
        ctx.meta = (nope, rope_dim, value, interleaved, kv.dtype, k_rot.dtype)
        return q_out, k_out, (v_out if pad_values else kv[..., nope:])

    @staticmethod
    def backward(ctx, dq, dk, dv):
        cos, sin = ctx.saved_tensors
        nope, rope_dim, value, interleaved, kv_dtype, k_rot_dtype = ctx.meta
        dq, dk, dv = _unit_last(dq), _unit_last(dk), _unit_last(dv)
        batch, seq_len, num_heads, width = dq.shape
        dq_in = torch.empty(batch, seq_len, num_heads, width, dtype=dq.dtype, device=dq.device)
        dkv = torch.empty(batch, seq_len, num_heads, nope + value, dtype=kv_dtype, device=dq.device)
        dk_rot = torch.empty(batch, seq_len, rope_dim, dtype=k_rot_dtype, device=dq.device)
        if batch * seq_len:
            sizes = _launch_sizes(num_heads, nope, rope_dim // 2, value)
            with device_of(dq):
                _mla_bwd_kernel[(batch * seq_len,)](
                    dq, dk, dv, cos, sin, dq_in, dkv, dk_rot, seq_len, num_heads,
                    dq.stride(0), dq.stride(1), dq.stride(2), dk.stride(0), dk.stride(1), dk.stride(2),
                    dv.stride(0), dv.stride(1), dv.stride(2), cos.stride(0), cos.stride(1),
                    DN=nope, HALF=rope_dim // 2, DV=value, INTERLEAVED=interleaved, BLOCK_DV=next_pow2(value),
                    num_warps=4, **sizes,
                )  # fmt: skip
        return dq_in, dkv, dk_rot, None, None, None, None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    half = x.shape[-1] // 2
    a, b = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :half], x[..., half:])
    return torch.cat((a * cos[..., :half] - b * sin[..., :half], b * cos[..., half:] + a * sin[..., half:]), dim=-1)


def mla_queries_keys_values_reference(
    q: torch.Tensor, kv: torch.Tensor, k_rot: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    *, interleaved: bool, pad_values: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The same in torch ops, fp32 inside (the kernels' test reference)."""
    width, rope_dim = q.shape[-1], k_rot.shape[-1]
    nope = width - rope_dim
    compute = torch.promote_types(q.dtype, torch.float32)
    cos, sin = cos.to(compute).unsqueeze(2), sin.to(compute).unsqueeze(2)  # over heads
    q_out = torch.cat((q[..., :nope].to(compute), _rotate(q[..., nope:].to(compute), cos, sin, interleaved)), dim=-1)
    k_shared = _rotate(k_rot.to(compute).unsqueeze(2), cos, sin, interleaved)
    k_out = torch.cat((kv[..., :nope].to(compute), k_shared.expand(*kv.shape[:-1], rope_dim)), dim=-1)
    v = kv[..., nope:]
    if pad_values:
        v = torch.nn.functional.pad(v, (0, width - v.shape[-1]))
    return q_out.to(q.dtype), k_out.to(kv.dtype), v


def mla_queries_keys_values(
    q: torch.Tensor, kv: torch.Tensor, k_rot: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    *, interleaved: bool, pad_values: bool = False, impl: Impl = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Queries, keys and values [B, S, H, *] for the attention kernel from the query projection's
    heads ``q`` [B, S, H, Dn + R], ``kv_b_proj``'s heads ``kv`` [B, S, H, Dn + Dv], the shared
    rotary key ``k_rot`` [B, S, R] and ``cos`` / ``sin`` [B or 1, S, R] (Transformers' rotary
    embedding). Inputs may be strided views with a unit last stride. No gradient reaches cos / sin."""
    batch, seq_len, num_heads, width = q.shape
    rope_dim = k_rot.shape[-1]
    if (kv.shape[:3] != q.shape[:3] or k_rot.shape[:2] != (batch, seq_len) or cos.shape[-2:] != (seq_len, rope_dim)
            or sin.shape != cos.shape or rope_dim % 2 or not 0 < rope_dim < width or kv.shape[-1] <= width - rope_dim):
        raise ValueError(f"MLA shapes disagree: q {tuple(q.shape)}, kv {tuple(kv.shape)}, k_rot {tuple(k_rot.shape)}, "
                         f"cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")  # fmt: skip
    if use_triton(impl, q, kv, k_rot, cos, sin):
        return MLAQueriesKeysValues.apply(_unit_last(q), _unit_last(kv), _unit_last(k_rot), cos, sin, interleaved,
                                          pad_values)  # fmt: skip
    return mla_queries_keys_values_reference(q, kv, k_rot, cos, sin, interleaved=interleaved, pad_values=pad_values)
