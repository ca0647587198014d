"""LoRA on attention and grouped experts: names, frozen base, training step, merge."""

from __future__ import annotations

import pytest
import torch
import transformers

from moetune.lora import LoraSettings, apply_lora, lora_state_dict, merge_lora, merged_state_dict
from moetune.moe import GroupedExperts

from .helpers import build_moetune_model, randomize_adapters, rel_err, tiny_qwen3_moe_config


def test_apply_keeps_base_names_and_trains_only_adapters(tokens):
    model = build_moetune_model(tiny_qwen3_moe_config())
    base_keys = list(model.state_dict())
    with torch.no_grad():
        before = model(tokens).logits
    apply_lora(model, LoraSettings(rank=2, alpha=4))

    keys = list(model.state_dict())
    assert [k for k in keys if ".lora_" not in k] == base_keys
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(lora_state_dict(model))
    assert "model.layers.0.mlp.experts.lora_A_gate_up_proj" in trainable
    assert "model.layers.0.mlp.experts.lora_B_down_proj" in trainable
    assert "model.layers.1.self_attn.o_proj.lora_B" in trainable
    # B starts at zero: the adapted model computes the base model's function.
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, before, rtol=0, atol=0)


def test_expert_adapter_shapes():
    model = apply_lora(build_moetune_model(tiny_qwen3_moe_config()), LoraSettings(rank=3, target_modules=[]))
    adapters = lora_state_dict(model)
    assert set(adapters) == {
        f"model.layers.0.mlp.experts.lora_{ab}_{w}" for ab in "AB" for w in ("gate_up_proj", "down_proj")
    }
    assert adapters["model.layers.0.mlp.experts.lora_A_gate_up_proj"].shape == (4, 3, 32)  # [E, r, H]
    assert adapters["model.layers.0.mlp.experts.lora_B_gate_up_proj"].shape == (4, 32, 3)  # [E, 2I, r]
    assert adapters["model.layers.0.mlp.experts.lora_A_down_proj"].shape == (4, 3, 16)  # [E, r, I]
    assert adapters["model.layers.0.mlp.experts.lora_B_down_proj"].shape == (4, 32, 3)  # [E, H, r]


def test_grouped_experts_see_per_expert_delta():
    torch.manual_seed(0)
    experts = GroupedExperts(num_experts=3, hidden_size=8, intermediate_size=4, backend="loop")
    torch.nn.init.normal_(experts.gate_up_proj)
    torch.nn.init.normal_(experts.down_proj)
    x_NH, counts_E = torch.randn(7, 8), torch.tensor([2, 0, 5])
    reference = GroupedExperts(num_experts=3, hidden_size=8, intermediate_size=4, backend="loop")

    from moetune.lora.experts import add_expert_adapters

    add_expert_adapters(experts, ("gate_up_proj", "down_proj"), rank=2, scaling=0.5, dtype=torch.float32)
    randomize_adapters(experts)
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj"):
            a, b = experts._parameters[f"lora_A_{name}"], experts._parameters[f"lora_B_{name}"]
            delta = torch.stack([0.5 * b[e] @ a[e] for e in range(3)])
            getattr(reference, name).copy_(experts._parameters[name] + delta)
    torch.testing.assert_close(experts(x_NH, counts_E), reference(x_NH, counts_E))
    # Outside the forward the attribute is the Parameter itself (FSDP2 and initialisers getattr it).
    assert experts.gate_up_proj is experts._parameters["gate_up_proj"]


def test_optimizer_step_changes_only_adapters(tokens):
    model = build_moetune_model(tiny_qwen3_moe_config()).train()
    apply_lora(model, LoraSettings(rank=2, alpha=4))
    base_before = {k: v.clone() for k, v in model.state_dict().items() if ".lora_" not in k}
    adapters_before = {k: v.clone() for k, v in lora_state_dict(model).items()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)

    for _ in range(2):  # B starts at zero, so A's gradient is zero until B has moved once
        loss = model(tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    for key, value in model.state_dict().items():
        if ".lora_" not in key:
            assert torch.equal(value, base_before[key]), key
    for key, value in lora_state_dict(model).items():
        assert not torch.equal(value, adapters_before[key]), key
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


def test_merge_restores_plain_model_with_same_logits(tokens):
    model = apply_lora(build_moetune_model(tiny_qwen3_moe_config()), LoraSettings(rank=2, alpha=4))
    randomize_adapters(model)
    with torch.no_grad():
        adapted = model(tokens).logits
    plain_type = type(model.model.layers[0].mlp.experts).__bases__[0]

    merge_lora(model)

    assert lora_state_dict(model) == {}
    assert type(model.model.layers[0].mlp.experts) is plain_type
    assert not model.model.layers[0].self_attn.q_proj._forward_hooks
    assert all(p.requires_grad for p in model.parameters())
    with torch.no_grad():
        assert rel_err(model(tokens).logits, adapted) < 1e-5


def test_merged_checkpoint_loads_in_plain_transformers(tmp_path, tokens):
    model = apply_lora(build_moetune_model(tiny_qwen3_moe_config()), LoraSettings(rank=2, alpha=4))
    randomize_adapters(model)
    with torch.no_grad():
        adapted = model(tokens).logits

    merge_lora(model).save_pretrained(tmp_path)
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()

    assert type(plain).__module__.startswith("transformers.")
    with torch.no_grad():
        assert rel_err(plain(tokens).logits, adapted) < 1e-5


def test_merged_state_dict_equals_merge_lora_and_keeps_the_adapters():
    model = apply_lora(build_moetune_model(tiny_qwen3_moe_config()), LoraSettings(rank=2, alpha=4))
    randomize_adapters(model)
    adapters = lora_state_dict(model)

    merged = dict(merged_state_dict(model))  # read now: the mapping folds each weight when it is read

    assert lora_state_dict(model).keys() == adapters.keys()  # the model is unchanged
    expected = merge_lora(model).state_dict()
    assert merged.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(merged[name], value), name


def test_dense_mlp_and_dropout(tokens):
    # Dense layer 1's MLP via target_modules; dropout is applied on the Linear adapters in train mode only.
    model = build_moetune_model(tiny_qwen3_moe_config())
    apply_lora(model, LoraSettings(rank=2, dropout=0.5, target_modules=["gate_proj", "up_proj", "down_proj"]))
    randomize_adapters(model)
    assert "model.layers.1.mlp.down_proj.lora_A" in lora_state_dict(model)
    with torch.no_grad():
        eval_a, eval_b = model(tokens).logits, model(tokens).logits
        model.train()
        train_a = model(tokens).logits
    torch.testing.assert_close(eval_a, eval_b, rtol=0, atol=0)
    assert not torch.allclose(train_a, eval_a)


def test_bf16_base_with_fp32_adapters(tokens):
    model = build_moetune_model(tiny_qwen3_moe_config()).to(torch.bfloat16)
    apply_lora(model, LoraSettings(rank=2))
    assert all(p.dtype == torch.float32 for p in lora_state_dict(model).values())
    assert model.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    model(tokens, labels=tokens).loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize(
    "settings, error, match",
    [
        (LoraSettings(target_modules=["qq_proj"]), ValueError, "no module name ends with 'qq_proj'"),
        (LoraSettings(target_modules=["experts"]), TypeError, "not nn.Linear"),
        (LoraSettings(target_modules=["q_proj", "lm_head"]), ValueError, "lm_head is the LM head"),
    ],
)
def test_bad_targets_are_reported(settings, error, match):
    with pytest.raises(error, match=match):
        apply_lora(build_moetune_model(tiny_qwen3_moe_config()), settings)


def test_apply_twice_and_merge_without_adapters_are_errors():
    model = build_moetune_model(tiny_qwen3_moe_config())
    with pytest.raises(ValueError, match="no LoRA adapters"):
        merge_lora(model)
    apply_lora(model, LoraSettings())
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        apply_lora(model, LoraSettings())


def test_target_experts_without_experts_is_an_error():
    model = build_moetune_model(tiny_qwen3_moe_config(mlp_only_layers=[0, 1]))
    with pytest.raises(ValueError, match="target_experts"):
        apply_lora(model, LoraSettings())


def test_remove_lora_restores_base_model(tokens):
    from moetune.lora import remove_lora

    model = build_moetune_model(tiny_qwen3_moe_config())
    with torch.no_grad():
        before = model(tokens).logits
    apply_lora(model, LoraSettings(rank=2))
    randomize_adapters(model)
    remove_lora(model)
    assert lora_state_dict(model) == {}
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, before, rtol=0, atol=0)


def test_apply_on_meta_device_then_reset():
    # The sharded-loading flow: build on meta, add adapters, materialise, then initialise them.
    from moetune import AutoModelForCausalLM
    from moetune.lora import reset_lora_parameters

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_qwen3_moe_config())
    apply_lora(model, LoraSettings(rank=2))
    assert all(p.is_meta for p in lora_state_dict(model).values())
    model.to_empty(device="cpu")
    reset_lora_parameters(model)
    for name, value in lora_state_dict(model).items():
        if ".lora_B" in name:
            assert not value.any(), name
        else:
            bound = value.shape[-1] ** -0.5
            assert 0 < value.abs().max() <= bound, name


def test_deepcopy_gives_an_independent_lora_model(tokens):
    # Reference / EMA models are often deep copies; the swapped class and the hooks must copy too.
    import copy

    model = apply_lora(build_moetune_model(tiny_qwen3_moe_config()), LoraSettings(rank=2))
    clone = copy.deepcopy(model)
    randomize_adapters(clone)
    merge_lora(clone)
    assert lora_state_dict(model) and model.model.layers[0].self_attn.q_proj._forward_hooks
    with torch.no_grad():
        assert not torch.allclose(clone(tokens).logits, model(tokens).logits)
