"""GPU: LoRA through moetune's CUDA paths (grouped_mm experts, fused kernels, fused LM-head loss).

The adapted model must compute what its merged copy computes: a fused kernel that read a targeted
weight directly (bypassing the adapter) would show up here, not in the CPU tests.
"""

from __future__ import annotations

import copy

import pytest
import torch

from moetune.lora import LoraSettings, apply_lora, lora_parameters, merge_lora

from .helpers import build_moetune_model, randomize_adapters, tiny_qwen3_moe_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (grouped_mm, Triton kernels)"),
]


def _mean_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    # Mean, not max: bf16 rounding can flip a near-tied top-k choice for a token or two.
    return ((a.float() - b.float()).abs().mean() / b.float().abs().mean()).item()


def test_lora_matches_merged_copy_on_gpu_bf16():
    config = tiny_qwen3_moe_config(hidden_size=64, moe_intermediate_size=32, intermediate_size=128)
    model = build_moetune_model(config).to(device="cuda", dtype=torch.bfloat16)
    apply_lora(model, LoraSettings(rank=4, alpha=8))
    randomize_adapters(model)
    merged = merge_lora(copy.deepcopy(model))
    tokens = torch.randint(0, config.vocab_size, (2, 64), device="cuda")

    with torch.no_grad():
        assert _mean_rel(model(tokens).logits, merged(tokens).logits) < 2e-2

    # Training mode with labels takes the fused LM-head loss path.
    model.train()
    merged.train()
    loss = model(tokens, labels=tokens).loss
    with torch.no_grad():
        merged_loss = merged(tokens, labels=tokens).loss
    assert abs(loss.item() - merged_loss.item()) < 2e-2 * merged_loss.item()
    loss.backward()
    for name, param in lora_parameters(model):
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, name
