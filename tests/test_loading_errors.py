"""Bad input fails early with an error that names the path or tensor."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import moetune
from moetune import auto
from tests.conftest import save_per_expert_checkpoint, tiny_qwen3_moe_config


@pytest.fixture
def checkpoint(reference_qwen3_moe, tmp_path):
    return save_per_expert_checkpoint(reference_qwen3_moe(), tmp_path / "ckpt")


def _edit(folder, fn):
    path = folder / "model.safetensors"
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _never_allocate(monkeypatch):
    def fail(*_args, **_kwargs):
        raise AssertionError("the model was allocated before the checkpoint was validated")

    monkeypatch.setattr(auto, "materialize", fail)


def test_missing_folder():
    with pytest.raises(FileNotFoundError, match="/definitely/not/here"):
        moetune.AutoModelForCausalLM.from_pretrained("/definitely/not/here")


def test_missing_config(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        moetune.AutoModelForCausalLM.from_pretrained(tmp_path / "empty")


def test_unknown_architecture(tmp_path):
    folder = tmp_path / "weird"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "not-a-real-arch"}))
    with pytest.raises(ValueError, match="neither moetune nor Transformers"):
        moetune.AutoModelForCausalLM.from_pretrained(folder)


def test_missing_tensor(checkpoint, monkeypatch):
    _edit(checkpoint, lambda t: t.pop("model.layers.2.mlp.experts.5.up_proj.weight"))
    _never_allocate(monkeypatch)
    with pytest.raises(ValueError, match=r"missing tensors \(1\): model.layers.2.mlp.experts.5.up_proj.weight"):
        moetune.AutoModelForCausalLM.from_pretrained(checkpoint)


def test_unexpected_tensor(checkpoint, monkeypatch):
    _edit(checkpoint, lambda t: t.update({"model.layers.0.mlp.bogus.weight": torch.zeros(2)}))
    _never_allocate(monkeypatch)
    with pytest.raises(ValueError, match="unexpected tensors .*model.layers.0.mlp.bogus.weight"):
        moetune.AutoModelForCausalLM.from_pretrained(checkpoint)


@pytest.mark.parametrize(
    "key, shape",
    [("model.layers.0.self_attn.q_proj.weight", (3, 32)), ("model.layers.0.mlp.experts.2.down_proj.weight", (32, 15))],
)
def test_misshaped_tensor(checkpoint, monkeypatch, key, shape):
    _edit(checkpoint, lambda t: t.update({key: torch.zeros(shape)}))
    _never_allocate(monkeypatch)
    with pytest.raises(ValueError, match=rf"mis-shaped tensors \(1\): {key} \[{shape[0]}, {shape[1]}\]") as error:
        moetune.AutoModelForCausalLM.from_pretrained(checkpoint)
    assert "missing" not in str(error.value)  # the tensor is there, only its shape is wrong


def test_pickle_only_checkpoint_is_refused(checkpoint):
    (checkpoint / "model.safetensors").rename(checkpoint / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="never unpickles"):
        moetune.AutoModelForCausalLM.from_pretrained(checkpoint)


def test_index_naming_a_missing_shard(reference_qwen3_moe, tmp_path):
    folder = save_per_expert_checkpoint(reference_qwen3_moe(), tmp_path / "s", max_tensors_per_shard=10)
    next(folder.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(FileNotFoundError, match="model-00002"):
        moetune.AutoModelForCausalLM.from_pretrained(folder)


def test_unknown_keyword(checkpoint):
    with pytest.raises(TypeError, match="not_an_option"):
        moetune.AutoModelForCausalLM.from_pretrained(checkpoint, not_an_option=3)


def test_bad_dtype_and_device_map(checkpoint):
    with pytest.raises(ValueError, match="dtype 'float99'"):
        moetune.AutoModelForCausalLM.from_pretrained(checkpoint, dtype="float99")
    with pytest.raises(ValueError, match="one device"):
        moetune.AutoModelForCausalLM.from_pretrained(checkpoint, device_map={"model.embed_tokens": 0, "lm_head": "cpu"})


def test_bad_experts_backend(checkpoint):
    with pytest.raises(ValueError, match="experts_backend"):
        moetune.AutoModelForCausalLM.from_pretrained(checkpoint, experts_backend="magic")


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("balanced_gate", "yes", "balanced_gate must be True or False"),
        ("reshard_after_forward", "no", "reshard_after_forward must be True or False"),
        ("experts_backend", None, "experts_backend must be one of"),
        ("param_dtype", "bf16", "param_dtype must be a floating torch dtype"),
        ("reduce_dtype", torch.int32, "reduce_dtype must be a floating torch dtype"),
        ("ep_capacity_factor", -1.0, "ep_capacity_factor must be a positive number"),
        ("lora", {"rank": 8}, "lora must be a moetune.lora.LoraSettings"),
    ],
)
def test_bad_moetune_options_name_the_option(option, value, message):
    """Checked where they are given, on one process too (not only once expert parallelism reads them)."""
    config = tiny_qwen3_moe_config(num_hidden_layers=1)
    with pytest.raises((ValueError, TypeError), match=message):
        moetune.AutoModelForCausalLM.from_config(config, **{option: value})
    from moetune.options import MoetuneOptions

    MoetuneOptions(param_dtype="bfloat16", reduce_dtype=torch.float32, ep_capacity_factor=2)  # the valid forms


@pytest.mark.parametrize("disable_mmap", [False, True])
def test_a_truncated_shard_names_the_file_the_shard_and_the_sizes(reference_qwen3_moe, tmp_path, monkeypatch,
                                                                  disable_mmap):
    folder = save_per_expert_checkpoint(reference_qwen3_moe(), tmp_path / "s", max_tensors_per_shard=10)
    shard = next(folder.glob("model-00002-of-*.safetensors"))
    num_shards = len(list(folder.glob("model-*.safetensors")))
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    _never_allocate(monkeypatch)
    with pytest.raises(ValueError, match=rf"{shard} \(shard 2 of {num_shards} listed in model.safetensors.index.json\) is "
                                         rf"truncated: {len(data) // 2} of the {len(data)} bytes its header describes"):
        moetune.AutoModelForCausalLM.from_pretrained(folder, disable_mmap=disable_mmap)
    shard.write_bytes(data[:5])
    with pytest.raises(ValueError, match=rf"{shard} .* is truncated: 5 bytes"):
        moetune.AutoModelForCausalLM.from_pretrained(folder, disable_mmap=disable_mmap)


@pytest.mark.parametrize("mmap", [True, False])
def test_a_file_truncated_after_it_was_listed_is_named_where_it_is_read(checkpoint, mmap):
    from moetune.checkpoint.loader import TensorReader

    path = checkpoint / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-8])
    with pytest.raises(ValueError, match=rf"{path} is truncated: {len(data) - 8} of the {len(data)} bytes"):
        with TensorReader(mmap=mmap).open(path):
            pass


def test_a_config_or_index_that_is_not_json_names_the_file_line_and_column(reference_qwen3_moe, checkpoint, tmp_path):
    config = checkpoint / "config.json"
    config.write_text(config.read_text().replace(",", "", 1))
    with pytest.raises(ValueError, match=rf"{config} is not valid JSON: Expecting ',' delimiter \(line \d+, column \d+\)"):
        moetune.AutoModelForCausalLM.from_pretrained(checkpoint)
    folder = save_per_expert_checkpoint(reference_qwen3_moe(), tmp_path / "s", max_tensors_per_shard=10)
    index = folder / "model.safetensors.index.json"
    index.write_text(index.read_text()[:-2])
    with pytest.raises(ValueError, match=rf"{index} is not valid JSON: .* \(line 1, column \d+\)"):
        moetune.AutoModelForCausalLM.from_pretrained(folder)


def test_an_encoder_built_as_a_causal_lm_warns_naming_the_field(tmp_path):
    """Transformers builds BERT's causal-LM class without is_decoder and only logs a line; moetune
    builds it too (a drop-in) but warns, naming model_type and is_decoder."""
    bert = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                   intermediate_size=32)
    with pytest.warns(UserWarning, match=r"not causal: model_type 'bert': BertLMHeadModel attends in both directions "
                                         r"unless the config field is_decoder is true"):
        model = moetune.AutoModelForCausalLM.from_config(bert)
    model.save_pretrained(tmp_path / "bert")
    with pytest.warns(UserWarning, match=r"model_type 'bert'.*is_decoder"):
        moetune.AutoModelForCausalLM.from_pretrained(tmp_path / "bert")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="this causal LM is not causal")  # a decoder config: no warning
        moetune.AutoModelForCausalLM.from_config(transformers.BertConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
            is_decoder=True))
