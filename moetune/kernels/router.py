"""Softmax top-k routing (Qwen3-MoE / Mixtral) in one kernel forward and one backward.

``softmax_topk(logits_TE, top_k, normalize)`` returns the combine weights (in the logits' dtype) and
the chosen experts (int64), as Transformers computes them: fp32 softmax over all experts, top-k,
optionally divided by their sum, cast to the logits' dtype. torch needs about eight launches for
that (softmax, top-k, its sort, sum, divide, cast) and as many in the backward (scatter into zeros,
softmax backward, ...); here each direction is one launch and reads the [T, E] logits once.

Selection runs on the logits: softmax is monotonic and keeps distinct bf16 / fp32 logits distinct,
so the chosen set is torch's; ties go to the lower expert index (``tl.argmax``). The k experts come
in descending weight order, as ``torch.topk`` returns them.

Backward, with p = softmax(logits), s_k = p[e_k], S = sum_k s_k, g = d loss / d weights:
``ds_k = (g_k - sum_j g_j s_j / S) / S`` when normalised (else ``g_k``), scattered to experts as dp,
then ``dlogits = p * (dp - sum_i p_i dp_i)``.

Shape legend: T tokens, E experts, K chosen experts per token.
"""

from __future__ import annotations

import torch

from moetune.kernels._triton_utils import HAS_TRITON, Impl, device_of, next_pow2, tl, triton, use_triton

_TILE = 2048  # logits per program: 16 tokens of 128 experts


def softmax_topk_reference(logits_TE: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Transformers' Qwen3-MoE routing in torch ops (autograd through softmax and top-k)."""
    probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.promote_types(logits_TE.dtype, torch.float32))
    weights_TK, experts_TK = torch.topk(probs_TE, top_k, dim=-1)
    if normalize:
        weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
    return weights_TK.to(logits_TE.dtype), experts_TK


if HAS_TRITON:

    @triton.jit
    def _softmax_rows(logits_ptr, tokens, experts, num_tokens, num_experts, stride_t):
        mask = (tokens < num_tokens)[:, None] & (experts < num_experts)[None, :]
        ptrs = logits_ptr + tokens.to(tl.int64)[:, None] * stride_t + experts[None, :]
        logits = tl.load(ptrs, mask=mask, other=float("-inf")).to(tl.float32)
        logits = tl.where((tokens < num_tokens)[:, None], logits, 0.0)  # rows past the end: no -inf - -inf
        shifted = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        return logits, shifted / tl.sum(shifted, axis=1)[:, None]

    @triton.jit
    def _softmax_topk_fwd_kernel(
        logits_ptr, weights_ptr, experts_ptr, num_tokens, num_experts, stride_t,
        K: tl.constexpr, K_POW2: tl.constexpr, NORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
    ):  # fmt: skip
        tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        experts = tl.arange(0, BLOCK_E)
        logits, probs = _softmax_rows(logits_ptr, tokens, experts, num_tokens, num_experts, stride_t)
        # The K best, best first, gathered into [BLOCK_T, K_POW2] tiles: one argmax per choice.
        slots = tl.arange(0, K_POW2)
        weights = tl.zeros([BLOCK_T, K_POW2], dtype=tl.float32)
        chosen_experts = tl.zeros([BLOCK_T, K_POW2], dtype=tl.int32)
        remaining = logits
        for k in tl.static_range(K):
            chosen = tl.argmax(remaining, axis=1)
            is_chosen = experts[None, :] == chosen[:, None]
            weight = tl.sum(tl.where(is_chosen, probs, 0.0), axis=1)
            weights = tl.where(slots[None, :] == k, weight[:, None], weights)
            chosen_experts = tl.where(slots[None, :] == k, chosen[:, None], chosen_experts)
            remaining = tl.where(is_chosen, float("-inf"), remaining)
        if NORMALIZE:
            weights = weights / tl.sum(weights, axis=1)[:, None]
        out = tokens.to(tl.int64)[:, None] * K + slots[None, :]
        mask = (tokens < num_tokens)[:, None] & (slots < K)[None, :]
        tl.store(weights_ptr + out, weights.to(weights_ptr.dtype.element_ty), mask=mask)
        tl.store(experts_ptr + out, chosen_experts.to(tl.int64), mask=mask)

    @triton.jit
    def _softmax_topk_bwd_kernel(
        logits_ptr, experts_ptr, grad_ptr, dlogits_ptr, num_tokens, num_experts, stride_t, stride_dt,
        K: tl.constexpr, NORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
    ):  # fmt: skip
        tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        experts = tl.arange(0, BLOCK_E)
        token_mask = tokens < num_tokens
        _, probs = _softmax_rows(logits_ptr, tokens, experts, num_tokens, num_experts, stride_t)
        base = tokens.to(tl.int64) * K
        # s_k, g_k and their sums, then ds_k scattered into dp over the experts.
        total = tl.zeros([BLOCK_T], dtype=tl.float32)
        g_dot_s = tl.zeros([BLOCK_T], dtype=tl.float32)
        for k in tl.static_range(K):
            e_k = tl.load(experts_ptr + base + k, mask=token_mask, other=0)
            g_k = tl.load(grad_ptr + base + k, mask=token_mask, other=0.0).to(tl.float32)
            s_k = tl.sum(tl.where(experts[None, :] == e_k[:, None], probs, 0.0), axis=1)
            total += s_k
            g_dot_s += g_k * s_k
        dp = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
        for k in tl.static_range(K):
            e_k = tl.load(experts_ptr + base + k, mask=token_mask, other=0)
            g_k = tl.load(grad_ptr + base + k, mask=token_mask, other=0.0).to(tl.float32)
            ds_k = (g_k - g_dot_s / total) / total if NORMALIZE else g_k
            dp += tl.where(experts[None, :] == e_k[:, None], ds_k[:, None], 0.0)
        dlogits = probs * (dp - tl.sum(probs * dp, axis=1)[:, None])
        mask = token_mask[:, None] & (experts < num_experts)[None, :]
        ptrs = dlogits_ptr + tokens.to(tl.int64)[:, None] * stride_dt + experts[None, :]
        tl.store(ptrs, dlogits.to(dlogits_ptr.dtype.element_ty), mask=mask)


def _launch_sizes(num_experts: int) -> tuple[int, int]:
    block_e = next_pow2(num_experts)
    return max(1, _TILE // block_e), block_e


class _SoftmaxTopK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_TE: torch.Tensor, top_k: int, normalize: bool):
        logits_TE = logits_TE if logits_TE.stride(-1) == 1 else logits_TE.contiguous()
        num_tokens, num_experts = logits_TE.shape
        weights_TK = torch.empty(num_tokens, top_k, dtype=logits_TE.dtype, device=logits_TE.device)
        experts_TK = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits_TE.device)
        block_t, block_e = _launch_sizes(num_experts)
        if num_tokens:
            with device_of(logits_TE):
                _softmax_topk_fwd_kernel[(triton.cdiv(num_tokens, block_t),)](
                    logits_TE, weights_TK, experts_TK, num_tokens, num_experts, logits_TE.stride(0),
                    K=top_k, K_POW2=next_pow2(top_k), NORMALIZE=normalize, BLOCK_T=block_t, BLOCK_E=block_e,
                    num_warps=4,
                )  # fmt: skip
        ctx.save_for_backward(logits_TE, experts_TK)
        ctx.normalize = normalize
        ctx.mark_non_differentiable(experts_TK)
        return weights_TK, experts_TK

    @staticmethod
    def backward(ctx, grad_weights_TK: torch.Tensor, _grad_experts):
        logits_TE, experts_TK = ctx.saved_tensors
        grad_weights_TK = grad_weights_TK.contiguous()
        num_tokens, num_experts = logits_TE.shape
        dlogits_TE = torch.empty_like(logits_TE)
        block_t, block_e = _launch_sizes(num_experts)
        if num_tokens:
            with device_of(logits_TE):
                _softmax_topk_bwd_kernel[(triton.cdiv(num_tokens, block_t),)](
                    logits_TE, experts_TK, grad_weights_TK, dlogits_TE, num_tokens, num_experts,
                    logits_TE.stride(0), dlogits_TE.stride(0),
                    K=experts_TK.shape[1], NORMALIZE=ctx.normalize, BLOCK_T=block_t, BLOCK_E=block_e, num_warps=4,
                )  # fmt: skip
        return dlogits_TE, None, None


def softmax_topk(
    logits_TE: torch.Tensor, top_k: int, *, normalize: bool, impl: Impl = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, K] in the logits' dtype, experts [T, K] int64): Transformers' softmax top-k routing."""
    if logits_TE.dim() != 2 or not 0 < top_k <= logits_TE.shape[-1]:
        raise ValueError(f"softmax_topk: logits must be [T, E] with 0 < top_k <= E, got {tuple(logits_TE.shape)}, top_k={top_k}")  # fmt: skip
    if not use_triton(impl, logits_TE) or logits_TE.dtype == torch.float64:
        return softmax_topk_reference(logits_TE, top_k, normalize)
    return _SoftmaxTopK.apply(logits_TE, top_k, normalize)
