"""Architectures moetune does not implement load through Transformers' own classes and train."""

from __future__ import annotations

import pytest
import torch
import transformers

import moetune

CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1
    ),
    "mixtral": lambda: transformers.MixtralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
    ),
}


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_fallback_loads_and_trains(arch, tmp_path):
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(CONFIGS[arch]())
    reference.save_pretrained(tmp_path)
    model = moetune.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(model) is type(reference)
    ids = torch.randint(0, 64, (2, 8))
    reference.eval()
    torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = model(input_ids=ids, labels=ids).loss
    before.backward()
    optimizer.step()
    assert torch.isfinite(before)
    assert model(input_ids=ids, labels=ids).loss.item() < before.item()


def test_fallback_refuses_expert_parallel():
    with pytest.raises(ValueError, match="ep_size / device_mesh need an architecture moetune implements"):
        moetune.AutoModelForCausalLM.from_config(CONFIGS["llama"](), ep_size=2)


def test_fallback_keeps_loading_arguments_and_applies_config_overrides(tmp_path):
    transformers.AutoModelForCausalLM.from_config(CONFIGS["llama"]()).save_pretrained(tmp_path)
    model = moetune.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, rms_norm_eps=1e-3)
    assert model.dtype == torch.bfloat16  # a loading argument, not a config field
    assert model.config.rms_norm_eps == 1e-3
