"""The PEFT export, loaded by `peft` onto plain Transformers v5, computes the LoRA model's logits."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from moetune.lora import LoraSettings, apply_lora, export_peft_adapter

from .helpers import build_moetune_model, randomize_adapters, rel_err, tiny_qwen3_moe_config

peft = pytest.importorskip("peft")
# peft 0.21 calls Transformers' deprecated `is_gradient_checkpointing`; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")


def _export_and_load_with_peft(tmp_path, settings: LoraSettings, tokens, config=None):
    model = build_moetune_model(config or tiny_qwen3_moe_config())
    model.save_pretrained(tmp_path / "base")
    apply_lora(model, settings)
    randomize_adapters(model)
    with torch.no_grad():
        adapted = model(tokens).logits
    export_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(tmp_path / "base"))

    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    assert type(plain).__module__.startswith("transformers.")
    with torch.no_grad():
        base_logits = plain(tokens).logits
    loaded = peft.PeftModel.from_pretrained(plain, tmp_path / "adapter").eval()
    with torch.no_grad():
        peft_logits = loaded(tokens).logits
    return adapted, base_logits, peft_logits, loaded


@pytest.mark.parametrize(
    "settings",
    [
        LoraSettings(rank=2, alpha=4),
        LoraSettings(rank=3, alpha=2, target_modules=[]),  # experts only
        LoraSettings(rank=2, alpha=8, dropout=0.1, target_modules=["q_proj", "v_proj"], target_experts=False),
    ],
    ids=["attention+experts", "experts", "attention"],
)
def test_peft_loads_export_with_same_logits(tmp_path, tokens, settings):
    adapted, base_logits, peft_logits, _ = _export_and_load_with_peft(tmp_path, settings, tokens)
    assert rel_err(base_logits, adapted) > 1e-2  # the adapters matter, so a dropped one would show
    assert rel_err(peft_logits, adapted) < 1e-5


def test_export_files_are_peft_format(tmp_path, tokens):
    _, _, _, loaded = _export_and_load_with_peft(tmp_path, LoraSettings(rank=2, alpha=4), tokens)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 2 and config["lora_alpha"] == 4
    assert sorted(config["target_parameters"]) == ["experts.down_proj", "experts.gate_up_proj"]
    assert config["base_model_name_or_path"] == str(tmp_path / "base")
    # Every LoRA weight peft created was filled from the file (none left at peft's init).
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    peft_keys = {k.replace(".default", "") for k in loaded.state_dict() if "lora_" in k}
    assert set(saved) == peft_keys
    assert saved["base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight"].shape == (4 * 2, 32)
    assert saved["base_model.model.model.layers.0.mlp.experts.lora_B.weight"].shape == (32, 2 * 4)


def test_merge_in_peft_matches_moetune_merge(tmp_path, tokens):
    adapted, _, _, loaded = _export_and_load_with_peft(tmp_path, LoraSettings(rank=2, alpha=4), tokens)
    merged = loaded.merge_and_unload()
    with torch.no_grad():
        assert rel_err(merged(tokens).logits, adapted) < 1e-5


def test_dense_mlp_targets_export_where_peft_keeps_them(tmp_path, tokens):
    """peft < 0.22 rewrote `down_proj` & co. to the experts of a qwen3_moe model when loading, so a dense
    layer's adapter would be lost: the export refuses it. peft 0.22 keeps a name whose modules are all
    linear layers (and also targets the experts' parameter of that name, which the file leaves at its
    zero init): the export must then load with the same logits."""
    settings = LoraSettings(target_modules=["q_proj", "down_proj"])
    if _peft_version() < (0, 22):
        model = apply_lora(build_moetune_model(tiny_qwen3_moe_config()), settings)
        with pytest.raises(ValueError, match=r"target_modules \['down_proj'\]"):
            export_peft_adapter(model, tmp_path / "adapter")
        return
    adapted, base_logits, peft_logits, _ = _export_and_load_with_peft(tmp_path, settings, tokens)
    assert rel_err(base_logits, adapted) > 1e-2
    assert rel_err(peft_logits, adapted) < 1e-5


def _peft_version() -> tuple[int, ...]:
    return tuple(int(part) for part in peft.__version__.split(".")[:2])


# The same functions on plain Transformers models of other MoE families: transposed expert storage
# (GPT-OSS, `is_transposed`), MLA attention + shared experts (DeepSeek-V3), Mixtral.
_OTHER_FAMILIES = {
    "gpt_oss": (
        lambda: transformers.GptOssConfig(
            vocab_size=128, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        ),
        ["q_proj", "k_proj", "v_proj", "o_proj"],
    ),
    "deepseek_v3": (
        lambda: transformers.DeepseekV3Config(
            vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
            topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
            qk_nope_head_dim=4, v_head_dim=8, n_shared_experts=1,
        ),
        ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
    ),
    "mixtral": (
        lambda: transformers.MixtralConfig(
            vocab_size=128, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
        ),
        ["q_proj", "o_proj"],
    ),
}


@pytest.mark.parametrize("family", sorted(_OTHER_FAMILIES))
def test_peft_parity_on_other_transformers_families(tmp_path, tokens, family):
    make_config, target_modules = _OTHER_FAMILIES[family]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(make_config()).float().eval()
    model.save_pretrained(tmp_path / "base")
    apply_lora(model, LoraSettings(rank=2, alpha=4, target_modules=target_modules))
    randomize_adapters(model)
    with torch.no_grad():
        adapted = model(tokens).logits
    export_peft_adapter(model, tmp_path / "adapter")

    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    loaded = peft.PeftModel.from_pretrained(plain, tmp_path / "adapter").eval()
    with torch.no_grad():
        assert rel_err(loaded(tokens).logits, adapted) < 1e-5


def test_load_peft_adapter_round_trip(tmp_path, tokens):
    from moetune.lora import load_peft_adapter, lora_state_dict

    adapted, _, _, _ = _export_and_load_with_peft(tmp_path, LoraSettings(rank=2, alpha=4), tokens)
    model = load_peft_adapter(build_moetune_model(tiny_qwen3_moe_config()), tmp_path / "adapter")
    with torch.no_grad():
        assert rel_err(model(tokens).logits, adapted) < 1e-6
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(lora_state_dict(model))


def test_load_adapter_written_by_peft(tmp_path, tokens):
    # An adapter trained with peft on plain Transformers continues in moetune with the same function.
    from moetune import AutoModelForCausalLM
    from moetune.lora import load_peft_adapter

    build_moetune_model(tiny_qwen3_moe_config()).save_pretrained(tmp_path / "base")
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    config = peft.LoraConfig(
        r=2, lora_alpha=6, target_modules=["q_proj", "o_proj"], init_lora_weights=False,
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    peft_model = peft.get_peft_model(plain, config).eval()
    peft_model.save_pretrained(tmp_path / "adapter")
    with torch.no_grad():
        expected = peft_model(tokens).logits

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    load_peft_adapter(model, tmp_path / "adapter")
    with torch.no_grad():
        assert rel_err(model(tokens).logits, expected) < 1e-5


def test_load_rejects_partial_expert_targets(tmp_path):
    from moetune.lora import load_peft_adapter, lora_state_dict

    build_moetune_model(tiny_qwen3_moe_config()).save_pretrained(tmp_path / "base")
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    config = peft.LoraConfig(r=2, target_modules=["q_proj"], target_parameters=["mlp.experts.down_proj"])
    peft.get_peft_model(plain, config).save_pretrained(tmp_path / "adapter")

    model = build_moetune_model(tiny_qwen3_moe_config())
    with pytest.raises(ValueError, match="target_parameters"):
        load_peft_adapter(model, tmp_path / "adapter")
    assert lora_state_dict(model) == {}


def test_peft_on_the_moetune_model_trains_as_on_transformers(tmp_path, tokens):
    """User code that keeps calling ``peft.get_peft_model`` after changing the import: PEFT's adapters
    (its ParamWrapper on the experts' weights) on moetune's model give Transformers + PEFT's loss
    and adapter gradients, fp32."""
    from moetune import AutoModelForCausalLM

    build_moetune_model(tiny_qwen3_moe_config()).save_pretrained(tmp_path / "base")
    config = dict(r=3, lora_alpha=6, target_modules=["q_proj", "v_proj"], init_lora_weights=False, lora_dropout=0.0,
                  target_parameters=["experts.gate_up_proj", "experts.down_proj"])  # fmt: skip
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    assert type(ours).__module__.startswith("moetune.")
    torch.manual_seed(1)
    expected_model = peft.get_peft_model(plain, peft.LoraConfig(**config))
    model = peft.get_peft_model(ours, peft.LoraConfig(**config))
    model.load_state_dict(expected_model.state_dict())
    from moetune.moe import GroupedExperts

    taken = []  # moetune's experts apply PEFT's factors to the activations (no adapted weight formed)
    original = GroupedExperts._peft_factors
    GroupedExperts._peft_factors = lambda self, name: taken.append(original(self, name)) or taken[-1]
    try:
        losses = [m(input_ids=tokens, labels=tokens).loss for m in (model, expected_model)]
    finally:
        GroupedExperts._peft_factors = original
    assert taken and all(factors is not None for factors in taken)
    assert rel_err(losses[0], losses[1]) < 1e-5
    for loss in losses:
        loss.backward()
    grads = [{n: p.grad for n, p in m.named_parameters() if p.requires_grad} for m in (model, expected_model)]
    assert grads[0].keys() == grads[1].keys() and any(".experts." in n for n in grads[0])
    for name in grads[1]:
        assert rel_err(grads[0][name], grads[1][name]) < 1e-5, name


def test_a_damaged_adapter_is_named(tmp_path):
    """A truncated adapter_model.safetensors and an adapter_config.json that is not JSON name the file."""
    from moetune.lora import load_peft_adapter

    model = build_moetune_model(tiny_qwen3_moe_config())
    apply_lora(model, LoraSettings(rank=2, alpha=4))
    export_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(tmp_path / "base"))
    weights, config = tmp_path / "adapter" / "adapter_model.safetensors", tmp_path / "adapter" / "adapter_config.json"
    data = weights.read_bytes()
    weights.write_bytes(data[:-100])
    with pytest.raises(ValueError, match=rf"{weights} is truncated: {len(data) - 100} of the {len(data)} bytes"):
        load_peft_adapter(build_moetune_model(tiny_qwen3_moe_config()), tmp_path / "adapter")
    config.write_text(config.read_text().replace(":", "", 1))
    with pytest.raises(ValueError, match=rf"{config} is not valid JSON: Expecting ':' delimiter \(line \d+, column \d+\)"):
        load_peft_adapter(build_moetune_model(tiny_qwen3_moe_config()), tmp_path / "adapter")


def test_peft_on_transposed_experts_takes_the_factors_too():
    """GPT-OSS-style [E, in, out] experts under PEFT's ParamWrapper: the factors applied to the
    activations give the parametrized weight's function and gradients."""
    from moetune.moe import GroupedExperts

    torch.manual_seed(0)
    experts = GroupedExperts(num_experts=3, hidden_size=8, intermediate_size=6, transposed=True, bias=True,
                             activation="clamped_swiglu")  # fmt: skip
    for param in experts.parameters():
        torch.nn.init.normal_(param, std=0.3)
    wrapper = torch.nn.Module()
    wrapper.experts = experts
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=[], init_lora_weights=False,
                             target_parameters=["experts.gate_up_proj", "experts.down_proj"])  # fmt: skip
    model = peft.get_peft_model(wrapper, config)
    x = torch.randn(10, 8)
    counts = torch.tensor([4, 0, 6])
    results = []
    for fast in (True, False):
        model.zero_grad()
        if not fast:
            GroupedExperts._peft_factors, saved = (lambda self, name: None), GroupedExperts._peft_factors
        try:
            out = model.base_model.model.experts(x, counts)
        finally:
            if not fast:
                GroupedExperts._peft_factors = saved
        out.square().sum().backward()
        results.append((out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}))
    assert rel_err(results[0][0], results[1][0]) < 1e-5
    for name, grad in results[1][1].items():
        assert rel_err(results[0][1][name], grad) < 1e-5, name
