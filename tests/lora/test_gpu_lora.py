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

    # Training mode with labels takes the fused LM-head loss path. Its loss is compared with the same
    # adapted model in fp32: within bf16's 1e-2, and nearer to it than the base model's loss is (the
    # adapters' effect on a random model's loss is ~3e-3, the bf16 noise ~4e-4: a bound of a tenth of
    # the effect against the bf16 merged copy, whose weights are rounded too, failed on that noise).
    reference = copy.deepcopy(model).float()
    for m in (model, reference, base):
        m.train()
    loss = model(tokens, labels=tokens).loss
    with torch.no_grad():
        reference_loss, base_loss = (m(tokens, labels=tokens).loss.item() for m in (reference, base))
    assert abs(loss.item() - reference_loss) < 1e-2 * abs(reference_loss)
    assert abs(loss.item() - reference_loss) < abs(base_loss - reference_loss)
    loss.backward()
    for name, param in lora_parameters(model):
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, name
