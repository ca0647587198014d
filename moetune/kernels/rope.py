"""Fused rotary position embedding for q and k in one launch (Transformers' rotate_half convention).

``q_embed = q * cos + rotate_half(q) * sin`` with ``rotate_half(x) = cat(-x2, x1)`` (x1, x2 the
two halves of head_dim), the same for k, and ``cos``/``sin`` ``[B, S, D]`` broadcast over heads
(``unsqueeze_dim=1`` for ``[B, heads, S, D]``, ``unsqueeze_dim=2`` for ``[B, S, heads, D]``).
Writing c1, c2 / s1, s2 for the halves of cos / sin, the forward is
``y1 = x1 c1 - x2 s1``, ``y2 = x2 c2 + x1 s2``, and the backward is its transpose
``dx1 = dy1 c1 + dy2 s2``, ``dx2 = dy2 c2 - dy1 s1``: the same kernel with
``(s1, s2) -> (-s2, -s1)``, which is the rotation by -sin when cos = cat(freqs, freqs).

``cos``/``sin`` may also hold each frequency once, ``[B, S, D / 2]`` (GPT-OSS's rotary tables, whose
``_apply_rotary_emb`` multiplies both halves by the same table): then c2 = c1 and s2 = s1, read from
the one half, with no ``cat`` of the tables per layer.

Shape legend: B batch, S sequence, Hq / Hk query / key heads, D head_dim.
q and k may be strided views (Qwen3's ``q_norm(...).transpose(1, 2)``); only D must be contiguous.
"""

from __future__ import annotations

import torch

from moetune.kernels._triton_utils import HAS_TRITON, Impl, device_of, next_pow2, tl, triton, use_triton, warps_for

_TILE = 2048  # elements per half-tile (heads x D/2) held in registers


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Transformers' ``apply_rotary_pos_emb``, op for op."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


if HAS_TRITON:

    @triton.jit
    def _rope_kernel(
        q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr,
        seq_len, num_q_heads, num_k_heads, half_dim,
        sq_b, sq_h, sq_s, sk_b, sk_h, sk_s,
        sqo_b, sqo_h, sqo_s, sko_b, sko_h, sko_s,
        sc_b, sc_s, second_half,
        BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        # One program per (batch, position): cos/sin are read once and applied to every q and k head.
        # second_half: where the tables' second half starts (half_dim; 0 for half-width tables).
        pid = tl.program_id(0)
        b = (pid // seq_len).to(tl.int64)
        s = (pid % seq_len).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        d_mask = d < half_dim
        cs_off = b * sc_b + s * sc_s + d
        c1 = tl.load(cos_ptr + cs_off, mask=d_mask, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + cs_off + second_half, mask=d_mask, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + cs_off, mask=d_mask, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + cs_off + second_half, mask=d_mask, other=0.0).to(tl.float32)
        if BACKWARD:  # transpose of the rotation: (s1, s2) -> (-s2, -s1)
            s_first = -s2
            s2 = -s1
            s1 = s_first
        c1 = c1[None, :]
        c2 = c2[None, :]
        s1 = s1[None, :]
        s2 = s2[None, :]
        h = tl.arange(0, BLOCK_H)

        for h0 in range(0, num_q_heads, BLOCK_H):
            heads = (h0 + h).to(tl.int64)
            mask = (heads < num_q_heads)[:, None] & d_mask[None, :]
            src = q_ptr + b * sq_b + s * sq_s + heads[:, None] * sq_h + d[None, :]
            x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(src + half_dim, mask=mask, other=0.0).to(tl.float32)
            dst = qo_ptr + b * sqo_b + s * sqo_s + heads[:, None] * sqo_h + d[None, :]
            tl.store(dst, (x1 * c1 - x2 * s1).to(qo_ptr.dtype.element_ty), mask=mask)
            tl.store(dst + half_dim, (x2 * c2 + x1 * s2).to(qo_ptr.dtype.element_ty), mask=mask)

        for h0 in range(0, num_k_heads, BLOCK_H):
            heads = (h0 + h).to(tl.int64)
            mask = (heads < num_k_heads)[:, None] & d_mask[None, :]
            src = k_ptr + b * sk_b + s * sk_s + heads[:, None] * sk_h + d[None, :]
            x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(src + half_dim, mask=mask, other=0.0).to(tl.float32)
            dst = ko_ptr + b * sko_b + s * sko_s + heads[:, None] * sko_h + d[None, :]
            tl.store(dst, (x1 * c1 - x2 * s1).to(ko_ptr.dtype.element_ty), mask=mask)
            tl.store(dst + half_dim, (x2 * c2 + x1 * s2).to(ko_ptr.dtype.element_ty), mask=mask)


def _full_width(table: torch.Tensor, head_dim: int) -> torch.Tensor:
    return table if table.shape[-1] == head_dim else torch.cat((table, table), dim=-1)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _rope_triton(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    q_out: torch.Tensor, k_out: torch.Tensor, *, backward: bool,
) -> None:  # fmt: skip
    """Rotate ``q`` [B, Hq, S, D] into ``q_out`` and ``k`` [B, Hk, S, D] into ``k_out``."""
    batch, num_q_heads, seq_len, head_dim = q.shape
    num_k_heads = k.shape[1]
    if batch * seq_len == 0:
        return
    table_width = cos.shape[-1]  # head_dim, or head_dim / 2 for half-width tables
    cos = cos.expand(batch, seq_len, table_width)  # a batch-1 cos gets batch stride 0
    sin = sin.expand(batch, seq_len, table_width)
    if cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    half_dim = head_dim // 2
    second_half = half_dim if table_width == head_dim else 0
    block_d = next_pow2(half_dim)
    block_h = max(1, min(next_pow2(max(num_q_heads, num_k_heads)), _TILE // block_d))
    with device_of(q):
        _rope_kernel[(batch * seq_len,)](
            q, k, cos, sin, q_out, k_out,
            seq_len, num_q_heads, num_k_heads, half_dim,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            q_out.stride(0), q_out.stride(1), q_out.stride(2), k_out.stride(0), k_out.stride(1), k_out.stride(2),
            cos.stride(0), cos.stride(1), second_half,
            BACKWARD=backward, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=warps_for(block_h * block_d),
        )  # fmt: skip


def _rope_torch(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    q_out: torch.Tensor, k_out: torch.Tensor, *, backward: bool,
) -> None:  # fmt: skip
    """The kernel's math in torch ops, fp32 inside (lets CPU tests gradcheck the backward)."""
    compute_dtype = torch.promote_types(q.dtype, torch.float32)
    cos, sin = _full_width(cos, q.shape[-1]), _full_width(sin, q.shape[-1])
    c1, c2 = cos.to(compute_dtype).unsqueeze(1).chunk(2, dim=-1)
    s1, s2 = sin.to(compute_dtype).unsqueeze(1).chunk(2, dim=-1)
    if backward:
        s1, s2 = -s2, -s1
    for x, out in ((q, q_out), (k, k_out)):
        x1, x2 = x.to(compute_dtype).chunk(2, dim=-1)
        out.copy_(torch.cat((x1 * c1 - x2 * s1, x2 * c2 + x1 * s2), dim=-1))


class RoPEFunction(torch.autograd.Function):
    """Rotates q [B, Hq, S, D] and k [B, Hk, S, D]; no gradient flows to cos/sin."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, backend: str):
        out_dtype_q = torch.promote_types(q.dtype, cos.dtype)
        out_dtype_k = torch.promote_types(k.dtype, cos.dtype)
        q_out = torch.empty_like(q, dtype=out_dtype_q)  # keeps q's (possibly transposed) layout
        k_out = torch.empty_like(k, dtype=out_dtype_k)
        rope = _rope_triton if backend == "triton" else _rope_torch
        rope(q, k, cos, sin, q_out, k_out, backward=False)
        ctx.save_for_backward(cos, sin)
        ctx.backend = backend
        ctx.dtypes = (q.dtype, k.dtype)
        return q_out, k_out

    @staticmethod
    def backward(ctx, dq_out, dk_out):
        cos, sin = ctx.saved_tensors
        # Autograd materialises a zero grad for an unused output, so both are tensors here.
        dq_out, dk_out = _unit_last(dq_out), _unit_last(dk_out)
        dq = torch.empty_like(dq_out, dtype=ctx.dtypes[0])
        dk = torch.empty_like(dk_out, dtype=ctx.dtypes[1])
        rope = _rope_triton if ctx.backend == "triton" else _rope_torch
        rope(dq_out, dk_out, cos, sin, dq, dk, backward=True)
        return dq, dk, None, None, None


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    *, unsqueeze_dim: int = 1, impl: Impl = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Rotary embedding of q and k, same semantics and signature as Transformers' ``apply_rotary_pos_emb``.

    q [B, Hq, S, D], k [B, Hk, S, D] (or [B, S, H, D] with ``unsqueeze_dim=2``), cos/sin [B or 1, S, D],
    or [B or 1, S, D / 2] holding each frequency once (the same as ``cat((cos, cos), -1)``).
    The Triton path handles q and k in one launch and does not differentiate through cos/sin
    (they come from the rotary buffer); when cos or sin requires grad the reference runs instead.
    """
    if unsqueeze_dim not in (1, 2):
        raise ValueError(f"unsqueeze_dim must be 1 ([B, H, S, D]) or 2 ([B, S, H, D]), got {unsqueeze_dim}")
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.shape != cos.shape:
        raise ValueError(f"expected 4-D q, k and 3-D cos, sin of one shape, got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")  # fmt: skip
    seq_dim = 3 - unsqueeze_dim  # 2 for [B, H, S, D], 1 for [B, S, H, D]
    if k.shape[0] != q.shape[0] or k.shape[seq_dim] != q.shape[seq_dim] or cos.shape[1] != q.shape[seq_dim]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and cos {tuple(cos.shape)} disagree on batch or "
                         f"sequence length (unsqueeze_dim={unsqueeze_dim})")  # fmt: skip
    if q.shape[-1] % 2 or k.shape[-1] != q.shape[-1] or cos.shape[-1] not in (q.shape[-1], q.shape[-1] // 2):
        raise ValueError(f"head_dim must be even and equal in q and k, and cos must be head_dim or head_dim / 2 "
                         f"wide: q {q.shape[-1]}, k {k.shape[-1]}, cos {cos.shape[-1]}")  # fmt: skip
    differentiable_cos = torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad)
    if use_triton(impl, q, k, cos, sin) and not differentiable_cos:
        cos, sin = _unit_last(cos), _unit_last(sin)
        if unsqueeze_dim == 2:  # strided views: the kernel takes any head/sequence strides
            q_out, k_out = RoPEFunction.apply(_unit_last(q.transpose(1, 2)), _unit_last(k.transpose(1, 2)), cos, sin, "triton")
            return q_out.transpose(1, 2), k_out.transpose(1, 2)
        return RoPEFunction.apply(_unit_last(q), _unit_last(k), cos, sin, "triton")
    head_dim = q.shape[-1]
    return apply_rope_reference(q, k, _full_width(cos, head_dim), _full_width(sin, head_dim), unsqueeze_dim=unsqueeze_dim)
