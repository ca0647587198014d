"""GPU: LoRA through moetune's CUDA paths (grouped_mm experts, fused kernels, fused LM-head loss).

The adapted model must compute what its merged copy computes: a fused kernel that read a targeted
weight directly (bypassing the adapter) would show up here, not in the CPU tests.
"""

from __future__ import annotations

import copy

import pytest
import torch

from moetune.lora import LoraSettings, apply_lora, lora_parameters, merge_lora, remove_lora

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
    base = remove_lora(copy.deepcopy(model))
    tokens = torch.randint(0, config.vocab_size, (2, 64), device="cuda")

    # bf16 noise is compared with the adapters' effect: a bypassed adapter would be as large as that.
    with torch.no_grad():
        logits, merged_logits, base_logits = (m(tokens).logits for m in (model, merged, base))
    assert _mean_rel(logits, merged_logits) < 0.1 * _mean_rel(base_logits, merged_logits)

    # Training mode with labels takes the fused LM-head loss path.
    for m in (model, merged, base):
        m.train()
    loss = model(tokens, labels=tokens).loss
    with torch.no_grad():
        merged_loss, base_loss = (m(tokens, labels=tokens).loss.item() for m in (merged, base))
    assert abs(loss.item() - merged_loss) < 0.1 * abs(base_loss - merged_loss)
    loss.backward()
    for name, param in lora_parameters(model):
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, name
