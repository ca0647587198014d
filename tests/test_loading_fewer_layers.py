"""``from_pretrained(path, num_hidden_layers=N)`` and ``output_loading_info=True``, as Transformers takes them.

Transformers loads the first N decoder layers of a deeper checkpoint (the rest are reported as
unexpected keys, with a warning) and returns its loading report as a second value when asked.
moetune does the same where the caller chose the architecture, and still refuses unexpected
tensors otherwise.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers

import moetune
from tests.conftest import parity_batch, save_per_expert_checkpoint, tiny_family_config


@pytest.fixture
def checkpoint(reference_qwen3_moe, tmp_path):
    return save_per_expert_checkpoint(reference_qwen3_moe(), tmp_path / "ckpt")  # 3 decoder layers


def test_fewer_layers_load_like_transformers(checkpoint):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, num_hidden_layers=2)
    with pytest.warns(UserWarning, match=r"decoder layers beyond the model's 2 \(num_hidden_layers\)"):
        model = moetune.AutoModelForCausalLM.from_pretrained(checkpoint, num_hidden_layers=2)
    assert type(model).__module__.startswith("moetune.") and model.config.num_hidden_layers == 2
    ids, mask, _ = parity_batch(model.config.vocab_size, padded=False)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, attention_mask=mask).logits, reference(ids, attention_mask=mask).logits,
                                   rtol=1e-5, atol=1e-6)  # fmt: skip


def test_loading_info_lists_the_layers_left_unread(checkpoint):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, reference_info = transformers.AutoModelForCausalLM.from_pretrained(
            checkpoint, num_hidden_layers=2, output_loading_info=True
        )
        model, info = moetune.AutoModelForCausalLM.from_pretrained(checkpoint, num_hidden_layers=2, output_loading_info=True)
    assert type(model).__module__.startswith("moetune.")
    assert set(info) == set(reference_info)
    assert info["unexpected_keys"] == reference_info["unexpected_keys"]  # model-level names: experts.gate_up_proj
    assert info["unexpected_keys"] and all(key.startswith("model.layers.2.") for key in info["unexpected_keys"])
    assert not info["missing_keys"] and not info["mismatched_keys"] and not info["error_msgs"]


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss", "nemotron_h"])
def test_the_other_families_load_fewer_layers_like_transformers(family, tmp_path):
    config = tiny_family_config(family)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)  # their Hub layouts
    fewer = config.num_hidden_layers - 1
    # Nemotron-H counts its layers from its pattern, so a shallower model is asked for through it.
    shallower = {"layers_block_type": config.layers_block_type[:fewer]} if family == "nemotron_h" else {"num_hidden_layers": fewer}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference, reference_info = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path, output_loading_info=True, **shallower
        )
        model, info = moetune.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True, **shallower)
    assert type(model).__module__.startswith("moetune.") and model.config.num_hidden_layers == fewer
    assert info["unexpected_keys"] == reference_info["unexpected_keys"] != set()
    ids = torch.randint(0, config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(0))
    reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-6)


def test_loading_info_of_a_full_load_is_empty(checkpoint):
    model, info = moetune.AutoModelForCausalLM.from_pretrained(checkpoint, output_loading_info=True)
    assert model.config.num_hidden_layers == 3
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": []}


def test_extra_layers_without_asking_for_fewer_are_still_refused(checkpoint):
    config_path = checkpoint / "config.json"
    config = transformers.AutoConfig.from_pretrained(checkpoint)
    config.num_hidden_layers = 2  # the checkpoint's own config disagrees with its tensors
    config.save_pretrained(checkpoint)
    assert config_path.is_file()
    with pytest.raises(ValueError, match=r"unexpected tensors .*model\.layers\.2\."):
        moetune.AutoModelForCausalLM.from_pretrained(checkpoint)


def test_a_shallower_config_of_the_callers_loads_its_layers(checkpoint):
    config = transformers.AutoConfig.from_pretrained(checkpoint)
    config.num_hidden_layers = 1
    with pytest.warns(UserWarning, match=r"beyond the model's 1 \(num_hidden_layers\)"):
        model = moetune.AutoModelForCausalLM.from_pretrained(checkpoint, config=config)
    assert len(model.model.layers) == 1


def test_a_deeper_model_than_the_checkpoint_is_still_missing_tensors(checkpoint):
    with pytest.raises(ValueError, match=r"missing tensors .*model\.layers\.3\."):
        moetune.AutoModelForCausalLM.from_pretrained(checkpoint, num_hidden_layers=4, mlp_only_layers=[1])
