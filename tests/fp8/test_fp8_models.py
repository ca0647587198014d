"""``fp8=`` on moetune's four architectures, on CPU through the reference backend: the option and its
refusals, what is converted, training within 2% of bf16, checkpoints, activation checkpointing,
LoRA and Hub FP8 checkpoints."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from safetensors.torch import load_file

import moetune
from moetune.fp8 import Fp8Linear, Fp8Settings
from moetune.layers.activation_checkpointing import enable_activation_checkpointing
from moetune.lora import LoraSettings
from moetune.models.fp8 import enable_fp8, fp8_layers
from moetune.moe import ROUTERS, GroupedExperts
from tests.conftest import quantize_fp8_checkpoint, save_per_expert_checkpoint, tiny_qwen3_moe_config
from tests.fp8.helpers import FAMILIES, bf16_and_fp8_models, family_config, token_batches, train_losses

REFERENCE = {"fp8_backend": "reference"}


def test_fp8_without_fp8_hardware_is_refused_naming_the_reference(tmp_path):
    config = tiny_qwen3_moe_config()
    for fp8 in ("rowwise", "blockwise"):
        with pytest.raises(ValueError, match=r"needs a GPU with FP8 tensor cores, but no CUDA GPU.*fp8_backend='reference'"):
            moetune.AutoModelForCausalLM.from_config(config, fp8=fp8)
    moetune.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="fp8_backend='reference'"):
        moetune.AutoModelForCausalLM.from_pretrained(tmp_path, fp8="rowwise")


def test_fp8_kernels_refuse_cpu_tensors_at_run_time_naming_the_reference():
    """A model switched to the GPU kernels (or moved off the GPU) stops at its first FP8 layer."""
    _, model = bf16_and_fp8_models("qwen3_moe", Fp8Settings("rowwise", "auto"))
    ids = token_batches(model.config.vocab_size, 1)[0]
    with pytest.raises(ValueError, match="the tensors are on cpu.*fp8_backend='reference'"):
        model(input_ids=ids, labels=ids)
    enable_fp8(model, Fp8Settings("rowwise", "reference"))
    assert torch.isfinite(model(input_ids=ids, labels=ids).loss)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"fp8": "fp4"}, ValueError, r"fp8 must be None or one of \('rowwise', 'blockwise'\), got 'fp4'"),
        ({"fp8": True}, TypeError, "fp8 must be None or one of"),
        ({"fp8": "rowwise", "fp8_backend": "cublas"}, ValueError, "fp8_backend must be one of"),
        ({"fp8_backend": "reference"}, ValueError, "fp8_backend='reference' needs fp8="),
        ({"fp8": "rowwise", "fp8_weight_grad": "fp16"}, ValueError, "fp8_weight_grad must be one of"),
        ({"fp8_weight_grad": "fp8"}, ValueError, "fp8_weight_grad='fp8' needs fp8="),
    ],
)
def test_bad_fp8_options_name_the_field(kwargs, error, message):
    with pytest.raises(error, match=message):
        moetune.AutoModelForCausalLM.from_config(tiny_qwen3_moe_config(), **kwargs)


def test_architectures_moetune_does_not_implement_refuse_fp8():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2)  # fmt: skip
    with pytest.raises(ValueError, match="fp8='rowwise' trains moetune's architectures"):
        moetune.AutoModelForCausalLM.from_config(config, fp8="rowwise", **REFERENCE)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_decoder_linears_and_experts_run_in_fp8_and_the_rest_keeps_its_precision(family):
    model = moetune.AutoModelForCausalLM.from_config(family_config(family), fp8="blockwise", **REFERENCE)
    converted = set(fp8_layers(model))
    experts = [name for name, m in model.named_modules() if isinstance(m, GroupedExperts)]
    assert experts and set(experts) <= converted
    assert any(isinstance(m, Fp8Linear) for m in model.modules())
    assert "lm_head" not in converted and not isinstance(model.lm_head, Fp8Linear)
    for name, module in model.named_modules():
        if isinstance(module, ROUTERS) or "norm" in name.rsplit(".", 1)[-1]:
            assert name not in converted
        if isinstance(module, Fp8Linear):
            assert module.in_features % 16 == 0 and module.out_features % 16 == 0
    assert all(p.dtype == model.dtype for p in model.parameters())  # master weights untouched
    enable_fp8(model, None)
    assert not fp8_layers(model) and not any(isinstance(m, Fp8Linear) for m in model.modules())


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("recipe, weight_grad", [("rowwise", "fp8"), ("blockwise", "fp8"), ("rowwise", "bf16")])
def test_each_family_trains_in_fp8_within_two_percent_of_bf16(family, recipe, weight_grad):
    """The same weights and batch, bf16 against FP8 (reference backend), four AdamW steps."""
    bf16, fp8 = bf16_and_fp8_models(family, Fp8Settings(recipe, "reference", weight_grad=weight_grad))
    batches = token_batches(bf16.config.vocab_size, 1) * 4
    bf16_losses, fp8_losses = train_losses(bf16, batches, lr=3e-3), train_losses(fp8, batches, lr=3e-3)
    assert fp8_losses[-1] < fp8_losses[0]  # it learns
    assert all(abs(a - b) <= 0.02 * b for a, b in zip(fp8_losses, bf16_losses)), (fp8_losses, bf16_losses)


def test_save_pretrained_writes_the_bf16_checkpoint_transformers_loads(tmp_path):
    model = moetune.AutoModelForCausalLM.from_config(tiny_qwen3_moe_config(), dtype=torch.bfloat16, fp8="rowwise", **REFERENCE)
    train_losses(model.train(), token_batches(model.config.vocab_size, 1))
    plain = enable_fp8(copy.deepcopy(model), None)
    model.save_pretrained(tmp_path / "fp8")
    plain.save_pretrained(tmp_path / "plain")
    saved, expected = load_file(tmp_path / "fp8" / "model.safetensors"), load_file(tmp_path / "plain" / "model.safetensors")
    assert saved.keys() == expected.keys() and all(torch.equal(saved[k], expected[k]) for k in saved)
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}
    assert "fp8" not in (tmp_path / "fp8" / "config.json").read_text()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp8")
    ours = dict(model.named_parameters())
    for name, param in loaded.named_parameters():
        if name in ours:
            assert torch.equal(param, ours[name]), name


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_recomputes_the_same_fp8_gradients(mode):
    _, model = bf16_and_fp8_models("qwen3_moe", Fp8Settings("blockwise", "reference", weight_grad="fp8"), dtype=torch.float32)
    checkpointed = copy.deepcopy(model)
    enable_activation_checkpointing(checkpointed, mode)
    ids = token_batches(model.config.vocab_size, 1)[0]
    for m in (model, checkpointed):
        m(input_ids=ids, labels=ids).loss.backward()
    for (name, a), b in zip(model.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, msg=name)


def test_lora_keeps_the_frozen_base_in_fp8_and_trains_its_adapters_in_their_dtype():
    config = tiny_qwen3_moe_config()
    lora = LoraSettings(rank=4, target_experts=True)
    torch.manual_seed(0)
    plain = moetune.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, lora=lora).train()
    fp8 = enable_fp8(copy.deepcopy(plain), Fp8Settings("rowwise", "reference"))
    assert isinstance(fp8.model.layers[0].self_attn.q_proj, Fp8Linear) and fp8.model.layers[0].mlp.experts.fp8 is not None
    ids = token_batches(config.vocab_size, 1)[0]
    losses = []
    for model in (plain, fp8):
        with torch.no_grad():  # the adapters' B starts at zero: make them matter
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.full_like(p, 0.01))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
    adapters = {n: p for n, p in fp8.named_parameters() if "lora_" in n}
    assert adapters and all(p.grad is not None and p.dtype == torch.float32 for p in adapters.values())  # LoraSettings' dtype
    assert all(p.grad is None for n, p in fp8.named_parameters() if "lora_" not in n)  # frozen base: no weight GEMM
    assert abs(losses[1] - losses[0]) <= 0.02 * losses[0]


def test_block_scaled_fp8_hub_checkpoints_load_for_blockwise_training(tmp_path):
    """DeepSeek-V3's / Kimi-K2's block-scaled FP8 files (partial 128-blocks here) load as the bf16
    master weights they dequantize to, and train in blockwise FP8."""
    config = family_config("deepseek_v3")
    config.hidden_size, config.moe_intermediate_size, config.intermediate_size = 160, 144, 272
    torch.manual_seed(0)
    reference = transformers.DeepseekV3ForCausalLM(config)
    folder = save_per_expert_checkpoint(reference, tmp_path / "fp8")
    expected = quantize_fp8_checkpoint(folder)
    model = moetune.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, fp8="blockwise", **REFERENCE)
    assert getattr(model.config, "quantization_config", None) is None and fp8_layers(model)
    params = dict(model.named_parameters())
    for key in (k for k in expected if "experts" not in k):
        torch.testing.assert_close(params[key], expected[key], rtol=0, atol=0, msg=key)
    losses = train_losses(model.train(), token_batches(config.vocab_size, 1) * 3, lr=3e-3)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
