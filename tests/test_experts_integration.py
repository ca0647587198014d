"""Fallback MoE models (Transformers' classes) can run moetune's experts path."""

from __future__ import annotations

import torch
import transformers

from moetune.integrations import IMPLEMENTATION_NAME, register_moetune_experts
from tests.conftest import rel_err


def test_mixtral_with_moetune_experts_matches_eager():
    register_moetune_experts()
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(config, experts_implementation="eager")
    ours = transformers.AutoModelForCausalLM.from_config(config, experts_implementation=IMPLEMENTATION_NAME)
    ours.load_state_dict(reference.state_dict())
    ids = torch.randint(0, 64, (2, 9))
    expected = reference(input_ids=ids, labels=ids)
    got = ours(input_ids=ids, labels=ids)
    assert rel_err(got.logits, expected.logits) < 1e-5
    expected.loss.backward()
    got.loss.backward()
    ref_params = dict(reference.named_parameters())
    for name, param in ours.named_parameters():
        assert rel_err(param.grad, ref_params[name].grad) < 1e-5, name
