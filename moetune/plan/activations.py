"""Activation memory per decoder layer: the bytes per token each layer keeps for its backward, for
each activation-checkpointing mode of ``moetune.layers.activation_checkpointing``.

- ``none``: every tensor the layer's kernels keep for the backward (counted below, op by op, from
  what moetune's kernels save on GPU: GEMM inputs, RMSNorm inputs and their fp32 inverse RMS,
  RoPE'd queries and keys, attention output and log-sum-exp (cuDNN / flash, O(S) memory), SwiGLU
  inputs, the experts' routed rows, Mamba-2's fp32 scan intermediates).
- ``selective``: the layer's input plus the outputs of its GEMMs, grouped GEMMs and attention (the
  ops whose outputs selective checkpointing keeps); norms, RoPE, activations and permutations are
  recomputed.
- ``full``: the layer's input only; the backward recomputes the layer, so for the duration of one
  layer's backward its ``none`` activations exist again.

The backward of a layer also needs room for its gradients' temporaries (``transient``): a fraction
of the layer's ``none`` activations, calibrated per GPU type (``calibration/*.json``).

Token counts: ``T`` tokens per micro-batch and rank. With expert parallelism, each rank's experts
see the routed rows the all-to-all brings (``top_k`` per token on average, more on the busiest
rank: ``routing_imbalance``), and keep the received rows themselves for the weight gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

from moetune.plan.inventory import (
    AttentionShape,
    DenseMLPShape,
    Inventory,
    LayerShape,
    MambaShape,
    MoEShape,
)

MODES = ("none", "selective", "full")
FP32 = 4


@dataclass(frozen=True)
class LayerActivations:
    """Bytes per token one decoder layer keeps, per mode."""

    none: float
    selective: float
    full: float
    weight_grad_only: float = 0.0
    """The part of ``none`` kept only for a weight gradient that the layer's own backward does not
    hold at its peak (Mamba-2's convolution: fp32 copies of its input). It counts in what the forward
    leaves for the backward, not in the running layer's working set nor its memory traffic."""

    @property
    def held_in_backward(self) -> float:
        """``none`` without ``weight_grad_only``: what the layer holds while its backward runs."""
        return self.none - self.weight_grad_only

    def saved(self, mode: str) -> float:
        if mode not in MODES:
            raise ValueError(f"activation checkpointing mode must be one of {MODES}, got {mode!r}")
        return getattr(self, mode)


def layer_activations(layer: LayerShape, *, act_bytes: int = 2, ep: int = 1, lora_rank: int = 0,
                      routed_rows: float | None = None, seq_len: int = 4096) -> LayerActivations:
    """``routed_rows``: routed rows per token this rank's experts see (top-k x imbalance); default top-k."""
    h = layer.hidden
    none = selective = 0.0
    weight_grad_only = _conv_weight_grad_copies(layer.mamba, lora_rank=lora_rank)
    # The layer input (kept by the first norm, and all that full checkpointing keeps), the other
    # norms' inputs (the residual stream after each sub-block) and every norm's fp32 inverse RMS.
    none += layer.norms * h * act_bytes + layer.norms * FP32
    selective += h * act_bytes
    for part in (layer.attention, layer.mamba, layer.moe, layer.mlp):
        if part is None:
            continue
        kept, outputs = _part(part, h=h, act_bytes=act_bytes, ep=ep, lora_rank=lora_rank,
                              routed_rows=routed_rows, seq_len=seq_len)
        none += h * act_bytes + kept  # the normed input, shared by the part's first GEMMs
        selective += outputs
    return LayerActivations(none=none + weight_grad_only, selective=selective, full=h * act_bytes,
                            weight_grad_only=weight_grad_only)


def _part(part, **kwargs) -> tuple[float, float]:
    if isinstance(part, AttentionShape):
        return (_latent_attention if part.latent else _attention)(part, **kwargs)
    if isinstance(part, MambaShape):
        return _mamba(part, **kwargs)
    if isinstance(part, MoEShape):
        return _moe(part, **kwargs)
    if isinstance(part, DenseMLPShape):
        return _dense_mlp(part, **kwargs)
    raise TypeError(type(part).__name__)


def _attention(a: AttentionShape, *, h: int, act_bytes: int, lora_rank: int, **_) -> tuple[float, float]:
    """(kept by ``none`` without the normed input, GEMM / attention outputs kept by ``selective``)."""
    q, kv = a.heads * a.qk_head_dim, a.kv_heads * a.qk_head_dim
    lse = a.heads * FP32
    kept = (q + 2 * kv) * act_bytes  # RoPE'd q, k and v, kept by the attention kernel
    kept += (q + kv) * act_bytes if a.qk_norm else 0  # q / k before their RMSNorm (its backward)
    kept += a.heads * a.v_head_dim * act_bytes + lse  # attention output (o_proj's input) and log-sum-exp
    kept += 4 * lora_rank * act_bytes  # x A^T of the q / k / v / o adapters
    outputs = (q + 2 * kv + a.heads * a.v_head_dim + h) * act_bytes + lse
    return kept, outputs


def _latent_attention(a: AttentionShape, *, h: int, act_bytes: int, lora_rank: int, **_) -> tuple[float, float]:
    """DeepSeek-V3's MLA: latent projections and norms, then the assembled q / k / v (one Triton
    kernel, which keeps none of its inputs), attention, o_proj."""
    qk, v = a.heads * a.qk_head_dim, a.heads * a.v_head_dim
    latent_q = 2 * a.q_lora_rank * act_bytes + (FP32 if a.q_lora_rank else 0)  # q_a output and its norm's output
    latent_kv = (a.kv_lora_rank + a.rope_dim + a.kv_lora_rank) * act_bytes + FP32
    kept = latent_q + latent_kv + (2 * qk + v) * act_bytes + v * act_bytes + a.heads * FP32
    kept += 4 * lora_rank * act_bytes
    outputs = (a.q_lora_rank + qk + a.kv_lora_rank + a.rope_dim + a.heads * (a.qk_head_dim - a.rope_dim + a.v_head_dim)
               + v + h) * act_bytes + a.heads * FP32
    return kept, outputs


def _mamba(m: MambaShape, *, h: int, act_bytes: int, seq_len: int, **_) -> tuple[float, float]:
    """Mamba-2 (moetune/layers/mamba2.py): in_proj output, the convolution's output, the chunked scan's
    fp32 tensors (per chunk of L tokens: the [L, L] scores and decays per head, C.B per group, the
    states per head), the gated norm's fp32 input, out_proj's input; plus the [C, C] decay between
    chunks per head (quadratic in the sequence)."""
    chunks = -(-seq_len // m.chunk)
    scan = FP32 * (2 * m.heads * m.chunk + m.groups * m.chunk + 4 * m.d_inner + 3 * m.d_inner * m.state / m.chunk)
    carry = 2 * FP32 * m.heads * chunks * chunks / seq_len
    kept = (m.in_proj_width + m.conv_width + m.d_inner) * act_bytes + scan + carry + FP32 * m.d_inner
    outputs = (m.in_proj_width + h) * act_bytes
    return kept, outputs


def _conv_weight_grad_copies(m: MambaShape | None, *, lora_rank: int) -> float:
    """Mamba-2's causal convolution, compiled (``moetune.layers.mamba2``), keeps three fp32 copies of its
    [tokens, conv_width] input for its weight gradient: 73.7 KB a token in Nemotron 3 Nano. They are
    not kept when the weights are frozen (LoRA). Counted on CPU (``benchmarks/mamba_saved_bytes.py``,
    benchmarks/results/cpu_20261207_bcf9bbd/). On an H100, six Nemotron layers (three Mamba-2) kept
    210 KB a token more than planned without them (benchmarks/results/h100_20261207_3690952/), where
    three blocks' copies make 221 KB. Full recompute's long-sequence peaks fit without them in the
    recomputed block's working set, so they count only in what the forward keeps."""
    if m is None or lora_rank:
        return 0.0
    return 3 * m.conv_width * FP32


def _moe(moe: MoEShape, *, h: int, act_bytes: int, ep: int, lora_rank: int, routed_rows: float | None,
         **_) -> tuple[float, float]:
    rows = moe.top_k if routed_rows is None else routed_rows
    x = 2 * moe.intermediate if moe.gated else moe.intermediate
    width = moe.expert_in
    router = moe.num_experts * FP32 + moe.top_k * (8 + 4 + 8)  # fp32 logits; top-k ids, weights; sort order
    per_row = (x + moe.intermediate + width) * act_bytes  # in-proj output, activation, down output (combine)
    per_row += width * act_bytes if ep > 1 else 0  # rows received by the all-to-all, kept for the weight gradient
    per_row += 2 * lora_rank * act_bytes
    kept = router + rows * per_row
    outputs = router + rows * (x + width) * act_bytes
    if moe.latent:  # fc1's output (the experts' input) and fc2's input (the combined rows)
        kept += 2 * width * act_bytes
        outputs += (width + h) * act_bytes
    if moe.shared_intermediate:
        shared = moe.shared_intermediate
        kept += (2 * shared + shared) * act_bytes if moe.gated else 2 * shared * act_bytes
        outputs += ((2 * shared if moe.gated else shared) + h) * act_bytes
    return kept, outputs


def _dense_mlp(mlp: DenseMLPShape, *, h: int, act_bytes: int, **_) -> tuple[float, float]:
    x = 2 * mlp.intermediate if mlp.gated else mlp.intermediate
    return (x + mlp.intermediate) * act_bytes, (x + h) * act_bytes


@dataclass(frozen=True)
class HeadActivations:
    """The final norm, the fused LM-head loss (``moetune.layers.linear_cross_entropy``): the hidden
    states' gradient is computed in the forward and kept (T x H), as is the head's gradient (V x H,
    when it trains); one chunk of logits (at most 512 MiB) exists at a time."""

    per_token: float
    """Final norm input and output, the hidden states' gradient: bytes per token."""
    logits_chunk: float
    """Bytes of one chunk of logits (and its in-place gradient), during the forward only."""
    head_grad: float
    """Bytes of the LM head's gradient, from the forward to the backward of the root (0 when frozen)."""


def head_activations(inventory: Inventory, *, tokens: int, act_bytes: int = 2, head_trainable: bool = True,
                     head_rows: int | None = None) -> HeadActivations:
    """``head_rows``: vocabulary rows this rank computes (all, or its share under vocab_parallel)."""
    h, v = inventory.hidden, head_rows or inventory.vocab
    chunk_rows = max(1, (1 << 29) // (v * act_bytes))
    return HeadActivations(per_token=3 * h * act_bytes + FP32, logits_chunk=min(tokens, chunk_rows) * v * act_bytes,
                           head_grad=v * h * act_bytes if head_trainable else 0.0)
