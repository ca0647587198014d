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


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss", "nemotron_h"])
def test_packed_rows_with_offsets_checkpoint_to_the_same_gradients(family, mode):
    """The other families' own layers (latent attention, sinks, Mamba-2 scan) on packed rows with
    their documents' offsets, recomputed under checkpointing: the same gradients."""
    import copy

    from tests.test_deepseek_v3_parity import tiny_deepseek_v3_config
    from tests.test_gpt_oss_parity import tiny_gpt_oss_config
    from tests.test_nemotron_h_parity import tiny_nemotron_h_config

    config = {"deepseek_v3": tiny_deepseek_v3_config, "gpt_oss": tiny_gpt_oss_config,
              "nemotron_h": tiny_nemotron_h_config}[family]()
    torch.manual_seed(0)
    base = moetune.AutoModelForCausalLM.from_config(config).train()
    ids = torch.randint(3, 90, (2, 16))
    batch = dict(input_ids=ids, labels=ids, position_ids=torch.tensor([list(range(9)) + list(range(7)), list(range(16))]),
                 cu_seq_lens_q=torch.tensor([0, 9, 16, 32], dtype=torch.int32), max_length_q=16, use_cache=False)
    grads = []
    for checkpointing in ("none", mode):
        model = copy.deepcopy(base)
        enable_activation_checkpointing(model, checkpointing)
        model(**batch).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name, grad in grads[0].items():
        assert rel_err(grads[1][name], grad) < 1e-6, name
