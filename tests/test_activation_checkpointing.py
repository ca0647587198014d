"""Full and selective activation checkpointing give the same loss and gradients as none."""

from __future__ import annotations

import pytest
import torch

import moetune
from moetune.layers.activation_checkpointing import enable_activation_checkpointing
from tests.conftest import rel_err, tiny_qwen3_moe_config


def _loss_and_grads(mode: str):
    torch.manual_seed(0)
    model = moetune.AutoModelForCausalLM.from_config(tiny_qwen3_moe_config()).train()
    enable_activation_checkpointing(model, mode)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointing_matches_no_checkpointing(mode):
    loss, grads = _loss_and_grads("none")
    got_loss, got_grads = _loss_and_grads(mode)
    assert rel_err(got_loss, loss) < 1e-6
    for name, grad in grads.items():
        assert rel_err(got_grads[name], grad) < 1e-6, name


def test_unknown_mode_is_refused():
    model = moetune.AutoModelForCausalLM.from_config(tiny_qwen3_moe_config())
    with pytest.raises(ValueError, match="'sometimes'"):
        enable_activation_checkpointing(model, "sometimes")
