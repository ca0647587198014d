"""Causal attention with attention sinks (GPT-OSS) and an optional sliding window, without
materialising the [heads, S, S] scores: SDPA's cuDNN kernels (full attention of unpacked rows on
Hopper / datacenter Blackwell) or torch's flash kernels on CUDA, Transformers' eager math elsewhere.

A sink is one more logit per head, ``s_h``, in every row's softmax, with no value: the output is
the kernel's output O (softmax over the keys only) times ``w = exp(lse - lse')``, where ``lse`` is
the row's log-sum-exp over the keys, which both kernels return, and ``lse'`` the log-sum-exp over
the keys and the sink. The backward is the kernel's own backward called with ``lse'`` and the sink
output; ``moetune.kernels.attention_sinks`` has the derivation and the two one-pass kernels.

Why cuDNN where it runs: at GPT-OSS-20B's full-attention shapes (64 query heads, 8 key / value
heads of 64, 4096 positions) on an H200 its forward + backward took 1,284 us against 2,031 us for
the flash kernels (benchmarks/probes/sink_attention_probe.py, benchmarks/results/sink_attention_probe_h200_ae7f8c0.jsonl). torch's cuDNN
op has no sliding window and no document offsets: those layers keep the flash kernels.

Letters: B = rows, S = tokens, H = query heads, K = key/value heads, D = head dim, T = B x S.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from moetune.kernels.attention_sinks import sink_grad, sink_scale
from moetune.layers.document_attention import cudnn_attention_applies, document_causal_mask, flash_kernels_apply
from moetune.utils.autocast import cuda_autocast_dtype


def sink_attention(
    q_BHSD: torch.Tensor,
    k_BKSD: torch.Tensor,
    v_BKSD: torch.Tensor,
    sinks_H: torch.Tensor,
    *,
    scaling: float,
    sliding_window: int | None = None,
    offsets_N: torch.Tensor | None = None,
    max_length: int | None = None,
) -> torch.Tensor:
    """Causal attention (each query sees the ``sliding_window`` latest keys, itself included, when
    given) with one sink logit per head; returns [B, S, H, D] (Transformers' attention output
    layout). Transformers' layouts in: q [B, H, S, D], k and v [B, K, S, D]. Under CUDA autocast the
    projections run in autocast's dtype but RoPE's fp32 cos / sin promote q and k back to fp32:
    they are cast to autocast's dtype here, as SDPA would.

    Packed rows: ``offsets_N`` (``cu_seq_lens_q``: the documents' starts in the flattened batch and
    its end, possibly padded with repeats) keeps each query inside its document; ``max_length`` is
    the longest document (the row length when not given)."""
    dtype = cuda_autocast_dtype(q_BHSD)
    if dtype is not None:
        q_BHSD, k_BKSD, v_BKSD = q_BHSD.to(dtype), k_BKSD.to(dtype), v_BKSD.to(dtype)
    B, H, S, D = q_BHSD.shape
    if offsets_N is None and sliding_window is None and cudnn_attention_applies(q_BHSD):
        return _CudnnWithSinks.apply(q_BHSD, k_BKSD, v_BKSD, sinks_H, scaling)
    if flash_kernels_apply(q_BHSD):
        to_rows = lambda t: t.transpose(1, 2).reshape(B * S, t.shape[1], D)  # noqa: E731
        if offsets_N is None:
            offsets_N, max_length = torch.arange(0, (B + 1) * S, S, device=q_BHSD.device), S
        out_THD = _FlashWithSinks.apply(
            to_rows(q_BHSD), to_rows(k_BKSD), to_rows(v_BKSD), sinks_H, offsets_N.to(torch.int32),
            max_length or S, scaling, -1 if sliding_window is None else sliding_window - 1,
        )  # fmt: skip
        return out_THD.view(B, S, H, D)
    allowed_BSS = _allowed_keys(B, S, sliding_window=sliding_window, offsets_N=offsets_N, device=q_BHSD.device)
    return _eager_sink_attention(q_BHSD, k_BKSD, v_BKSD, sinks_H, scaling=scaling, allowed_BSS=allowed_BSS)


def _allowed_keys(B: int, S: int, *, sliding_window: int | None, offsets_N: torch.Tensor | None,
                  device: torch.device) -> torch.Tensor:
    """[B or 1, S, S]: key s is visible to query t (causal, inside the window and t's document)."""
    q_idx = torch.arange(S, device=device)[:, None]
    kv_idx = torch.arange(S, device=device)[None, :]
    if offsets_N is None:
        allowed = (kv_idx <= q_idx)[None]
    else:
        allowed = document_causal_mask(offsets_N.to(device), batch=B, seq_len=S)[:, 0]
    if sliding_window is not None:
        allowed = allowed & (q_idx - kv_idx < sliding_window)
    return allowed


def _eager_sink_attention(q_BHSD, k_BKSD, v_BKSD, sinks_H, *, scaling, allowed_BSS=None, sliding_window=None):
    """Transformers' GPT-OSS eager attention with the mask built here (``allowed_BSS``, else the
    causal mask with ``sliding_window``)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import repeat_kv

    B, S, groups = q_BHSD.shape[0], q_BHSD.shape[2], q_BHSD.shape[1] // k_BKSD.shape[1]
    if allowed_BSS is None:
        allowed_BSS = _allowed_keys(B, S, sliding_window=sliding_window, offsets_N=None, device=q_BHSD.device)
    scores = torch.matmul(q_BHSD, repeat_kv(k_BKSD, groups).transpose(2, 3)) * scaling
    scores = scores.masked_fill(~allowed_BSS[:, None], torch.finfo(scores.dtype).min)
    sinks = sinks_H.reshape(1, -1, 1, 1).expand(q_BHSD.shape[0], -1, S, -1)
    logits = torch.cat([scores, sinks], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].to(v_BKSD.dtype)
    return torch.matmul(probs, repeat_kv(v_BKSD, groups)).transpose(1, 2).contiguous()


class _FlashWithSinks(torch.autograd.Function):
    """torch's variable-length flash kernels on [T, H, D] rows (packed documents, sliding windows)."""

    @staticmethod
    def forward(ctx, q_THD, k_TKD, v_TKD, sinks_H, offsets, seq_len: int, scaling: float, window_left: int):
        out_THD, lse_HT, rng_state, _, _ = torch.ops.aten._flash_attention_forward(
            q_THD, k_TKD, v_TKD, offsets, offsets, seq_len, seq_len, 0.0, True,
            return_debug_mask=False, scale=scaling, window_size_left=window_left, window_size_right=0,
        )  # fmt: skip
        rows, lse_all_HT = q_THD.shape[0], lse_HT.clone()  # the clone keeps the kernel's padding columns
        out_sink_THD = sink_scale(out_THD[None], _lse_BHS(lse_HT, rows), sinks_H, _lse_BHS(lse_all_HT, rows))[0]
        ctx.save_for_backward(q_THD, k_TKD, v_TKD, out_sink_THD, lse_all_HT, sinks_H, offsets, rng_state)
        ctx.seq_len, ctx.scaling, ctx.window_left = seq_len, scaling, window_left
        return out_sink_THD

    @staticmethod
    def backward(ctx, grad_THD):
        q_THD, k_TKD, v_TKD, out_sink_THD, lse_all_HT, sinks_H, offsets, rng_state = ctx.saved_tensors
        grad_THD = grad_THD.contiguous()
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad_THD, q_THD, k_TKD, v_TKD, out_sink_THD, lse_all_HT, offsets, offsets, ctx.seq_len, ctx.seq_len,
            0.0, True, rng_state, torch.empty(0, device=q_THD.device),
            scale=ctx.scaling, window_size_left=ctx.window_left, window_size_right=0,
        )  # fmt: skip
        grad_sinks_H = sink_grad(grad_THD[None], out_sink_THD[None], _lse_BHS(lse_all_HT, q_THD.shape[0]), sinks_H)
        return dq, dk, dv, grad_sinks_H.to(sinks_H.dtype), None, None, None, None


class _CudnnWithSinks(torch.autograd.Function):
    """SDPA's cuDNN kernels on unpacked [B, H, S, D] rows (views of [B, S, H, D] memory), GQA
    included; full causal attention only."""

    @staticmethod
    def forward(ctx, q_BHSD, k_BKSD, v_BKSD, sinks_H, scaling: float):
        out_BHSD, lse_BHS1, cum_q, cum_k, max_q, max_k, seed, offset, _ = (
            torch.ops.aten._scaled_dot_product_cudnn_attention(q_BHSD, k_BKSD, v_BKSD, None, True, 0.0, True, False,
                                                              scale=scaling)  # fmt: skip
        )
        lse_all_BHS1 = torch.empty_like(lse_BHS1)
        out_sink_BSHD = sink_scale(out_BHSD.transpose(1, 2), lse_BHS1[..., 0], sinks_H, lse_all_BHS1[..., 0])
        ctx.save_for_backward(q_BHSD, k_BKSD, v_BKSD, out_sink_BSHD, lse_all_BHS1, sinks_H, cum_q, cum_k, seed, offset)
        ctx.scaling, ctx.max_q, ctx.max_k = scaling, max_q, max_k
        return out_sink_BSHD

    @staticmethod
    def backward(ctx, grad_BSHD):
        q_BHSD, k_BKSD, v_BKSD, out_sink_BSHD, lse_all_BHS1, sinks_H, cum_q, cum_k, seed, offset = ctx.saved_tensors
        grad_BSHD = grad_BSHD.contiguous()  # the output's layout, which cuDNN wants for the gradient too
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            grad_BSHD.transpose(1, 2), q_BHSD, k_BKSD, v_BKSD, out_sink_BSHD.transpose(1, 2), lse_all_BHS1, seed, offset,
            None, cum_q, cum_k, ctx.max_q, ctx.max_k, 0.0, True, scale=ctx.scaling,
        )  # fmt: skip
        grad_sinks_H = sink_grad(grad_BSHD, out_sink_BSHD, lse_all_BHS1[..., 0], sinks_H)
        return dq, dk, dv, grad_sinks_H.to(sinks_H.dtype), None


def _lse_BHS(lse_HT: torch.Tensor, rows: int) -> torch.Tensor:
    """The flash kernels' [H, T(+ padding)] log-sum-exp as a [1, H, T] view."""
    return lse_HT[:, :rows][None]
