"""Tiny fp32 models and helpers for the LoRA tests (CPU, a few ms per forward)."""

from __future__ import annotations

import torch
import transformers


def tiny_qwen3_moe_config(**overrides) -> transformers.Qwen3MoeConfig:
    # Layer 0 is MoE, layer 1 dense (mlp_only_layers), so both MLP kinds are covered.
    fields = dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        mlp_only_layers=[1], tie_word_embeddings=False,
    )
    fields.update(overrides)
    return transformers.Qwen3MoeConfig(**fields)


def build_moetune_model(config) -> transformers.PreTrainedModel:
    """moetune's model for `config`, seeded, fp32, in eval mode."""
    from moetune import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    assert type(model).__module__.startswith("moetune."), type(model)
    return model.float().eval()


def randomize_adapters(model) -> None:
    """Non-zero B (the default init makes adapters no-ops, which would hide any mapping error)."""
    from moetune.lora import lora_parameters

    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for _, param in lora_parameters(model):
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()
