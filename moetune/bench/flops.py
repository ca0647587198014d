"""Training FLOPs per token by the brief's convention (Megatron / NeMo): matmuls only, causal
attention counted half, router ignored, backward = 2x forward:

    3 x [ sum over layers (2H(q + 2kv + q) + 2 S q + mlp_l) + 2 H V ]

with q = heads x head_dim, kv = kv_heads x head_dim, and mlp_l = top_k x 3 x 2 H I_moe for a
sparse layer or 3 x 2 H I_dense for a dense one (``mlp_only_layers`` / ``decoder_sparse_step``).
"""

from __future__ import annotations

from typing import Any


def is_sparse_layer(config: Any, layer_idx: int) -> bool:
    """Qwen3-MoE's rule (the same as Transformers' and moetune's model code)."""
    num_experts = getattr(config, "num_experts", 0) or 0
    step = getattr(config, "decoder_sparse_step", 1) or 1
    dense_only = getattr(config, "mlp_only_layers", None) or []
    return layer_idx not in dense_only and num_experts > 0 and (layer_idx + 1) % step == 0


def flops_per_token(config: Any, *, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token of a Qwen3-MoE-shaped config at ``seq_len``."""
    hidden = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q = config.num_attention_heads * head_dim
    kv = config.num_key_value_heads * head_dim
    attention = 2 * hidden * (q + 2 * kv + q) + 2 * seq_len * q
    sparse_mlp = config.num_experts_per_tok * 3 * 2 * hidden * config.moe_intermediate_size
    dense_mlp = 3 * 2 * hidden * config.intermediate_size
    layers = sum(
        attention + (sparse_mlp if is_sparse_layer(config, i) else dense_mlp) for i in range(config.num_hidden_layers)
    )
    return 3.0 * (layers + 2 * hidden * config.vocab_size)
