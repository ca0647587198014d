"""Fallback MoE models (Transformers' classes) can run moetune's experts path."""

from __future__ import annotations

import pytest
import torch
import transformers

from moetune.integrations import IMPLEMENTATION_NAME, register_moetune_experts
from tests.conftest import check_bf16_training_parity, rel_err


def _mixtral_config(**overrides) -> transformers.MixtralConfig:
    sizes = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2)  # fmt: skip
    return transformers.MixtralConfig(**{**sizes, **overrides})


def _check_same_training(ours, reference) -> None:
    """Logits, loss and every gradient of ``ours`` equal ``reference``'s (fp32) on one batch."""
    ids = torch.randint(0, 64, (2, 9))
    expected, got = reference(input_ids=ids, labels=ids), ours(input_ids=ids, labels=ids)
    assert rel_err(got.logits, expected.logits) < 1e-5
    expected.loss.backward()
    got.loss.backward()
    ref_params = dict(reference.named_parameters())
    for name, param in ours.named_parameters():
        assert rel_err(param.grad, ref_params[name].grad) < 1e-5, name


def test_mixtral_with_moetune_experts_matches_eager():
    register_moetune_experts()
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(_mixtral_config(), experts_implementation="eager")
    ours = transformers.AutoModelForCausalLM.from_config(_mixtral_config(), experts_implementation=IMPLEMENTATION_NAME)
    ours.load_state_dict(reference.state_dict())
    _check_same_training(ours, reference)


def _mixtral_checkpoint(tmp_path, *, router_std: float | None = None, **overrides):
    """Transformers' Mixtral (eager experts, seed 0) saved to ``tmp_path``; ``router_std`` redraws the
    routers' weights N(0, std): decisive routing, which bf16 rounding does not flip (the default
    init's near-ties route some tokens differently in bf16 than in fp32, in Transformers' own model too)."""
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(_mixtral_config(**overrides), experts_implementation="eager")
    if router_std is not None:
        with torch.no_grad():
            for name, param in reference.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    param.normal_(0.0, router_std)
    reference.save_pretrained(tmp_path)
    return reference


def test_an_experts_backend_runs_a_fallback_model_through_moetunes_experts(tmp_path, monkeypatch):
    """experts_backend on a Transformers MoE model: moetune's experts path with that backend (on CPU
    too: the caller asked), the same training as Transformers' eager experts, nothing saved of it."""
    import moetune
    import moetune.integrations.transformers_experts as integration

    reference = _mixtral_checkpoint(tmp_path)
    seen = []
    real_run = integration.run_experts
    monkeypatch.setattr(integration, "run_experts", lambda *a, **k: seen.append(k["backend"]) or real_run(*a, **k))
    ours, info = moetune.AutoModelForCausalLM.from_pretrained(tmp_path, experts_backend="triton", output_loading_info=True)
    assert type(ours) is type(reference) and not info["missing_keys"]
    assert ours.config._experts_implementation == IMPLEMENTATION_NAME
    _check_same_training(ours, reference)
    assert seen and set(seen) == {"triton"}
    ours.save_pretrained(tmp_path / "saved")
    assert "moetune" not in (tmp_path / "saved" / "config.json").read_text()
    built = moetune.AutoModelForCausalLM.from_config(reference.config, experts_backend="loop")
    assert {getattr(m, integration.BACKEND_ATTRIBUTE, None) for m in built.modules() if hasattr(m, "gate_up_proj")} == {"loop"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("experts_backend", ["grouped_mm", "triton", "quack"])
def test_a_fallback_model_in_bf16_on_gpu_through_each_experts_backend(tmp_path, experts_backend):
    """Mixtral (a fallback model) with moetune's experts on CUDA in bf16: loss and gradients within
    1e-2 of Transformers in fp32 holding the same weights (or no further than Transformers' bf16)."""
    _mixtral_checkpoint(tmp_path, router_std=0.3, hidden_size=128, intermediate_size=64, num_local_experts=8)
    check_bf16_training_parity(tmp_path, vocab=64, experts_backend=experts_backend)


@pytest.mark.parametrize("experts_backend", ["loop", "triton"])
def test_a_fallback_model_in_bf16_on_cpu_stays_as_close_to_fp32_as_transformers(tmp_path, experts_backend):
    """The same check on CPU (the loop, and the Triton backend's torch path): moetune's experts in bf16
    are no further from fp32 than Transformers' own bf16 model."""
    _mixtral_checkpoint(tmp_path, router_std=0.3, hidden_size=128, intermediate_size=64, num_local_experts=8)
    check_bf16_training_parity(tmp_path, vocab=64, experts_backend=experts_backend, device="cpu")


def test_experts_backend_errors_on_fallback_models(tmp_path, monkeypatch):
    import sys

    import pytest

    import moetune
    from moetune.kernels import quack_grouped_gemm

    _mixtral_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="cannot be combined with experts_implementation='eager'"):
        moetune.AutoModelForCausalLM.from_pretrained(tmp_path, experts_backend="loop", experts_implementation="eager")
    llama = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    with pytest.raises(ValueError, match="'llama' takes none"):
        moetune.AutoModelForCausalLM.from_config(llama, experts_backend="loop")
    quack_grouped_gemm.require.cache_clear()
    monkeypatch.setitem(sys.modules, "quack.gemm_interface", None)
    try:
        with pytest.raises(RuntimeError, match="quack-kernels"):
            moetune.AutoModelForCausalLM.from_pretrained(tmp_path, experts_backend="quack")
    finally:
        quack_grouped_gemm.require.cache_clear()


# Transformers' MoE architectures whose experts take an experts implementation, as tiny fp32 configs
# (sizes shared, then each architecture's own fields): shared experts (qwen2_moe, granitemoeshared,
# dots1, ...), sigmoid / group-limited routers (glm4_moe, dots1, deepseek_v2), Mamba / linear-attention
# hybrids (jamba, qwen3_next, lfm2_moe), zero-computation experts (longcat_flash). Mixtral is above.
_SIZES = dict(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=24, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4, num_local_experts=4,
              n_routed_experts=4, num_experts_per_tok=2, max_position_embeddings=64, output_router_logits=True,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
_MLA = dict(q_lora_rank=8, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, n_group=1, topk_group=1,
            first_k_dense_replace=0, n_shared_experts=1)  # fmt: skip
FALLBACK_MOE_CONFIGS = {
    "qwen2_moe": dict(shared_expert_intermediate_size=24),
    "olmoe": {},
    "granitemoe": {},
    "granitemoeshared": dict(shared_intermediate_size=24),
    "phimoe": {},
    "minimax": {},
    "flex_olmo": {},
    "ernie4_5_moe": dict(moe_num_experts=4, moe_k=2, moe_num_shared_experts=1),
    "hunyuan_v1_moe": {},
    "glm4_moe": dict(n_group=1, topk_group=1, first_k_dense_replace=0, n_shared_experts=1),
    "dots1": dict(n_group=1, topk_group=1, first_k_dense_replace=0, n_shared_experts=1),
    "deepseek_v2": dict(_MLA, head_dim=None),
    "afmoe": dict(num_dense_layers=0, n_group=1, topk_group=1, layer_types=None),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=1, expert_layer_offset=0,
                  mamba_d_state=4, mamba_dt_rank=4, mamba_d_conv=4),  # fmt: skip
    "qwen3_next": dict(num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
                       linear_value_head_dim=8, shared_expert_intermediate_size=24, layer_types=None),  # fmt: skip
    "lfm2_moe": dict(num_hidden_layers=3, num_dense_layers=1, layer_types=["full_attention", "conv", "full_attention"]),
    "longcat_flash": dict(_MLA, num_layers=1, moe_topk=2, zero_expert_num=2, expert_ffn_hidden_size=24, ffn_hidden_size=32,
                          head_dim=4),  # fmt: skip
}


def _fallback_moe_config(model_type: str) -> transformers.PretrainedConfig:
    if model_type not in transformers.CONFIG_MAPPING:
        pytest.skip(f"Transformers {transformers.__version__} has no {model_type!r}")
    default = transformers.AutoConfig.for_model(model_type)
    fields = {**_SIZES, **FALLBACK_MOE_CONFIGS[model_type]}
    fields = {k: v for k, v in fields.items() if hasattr(default, k) or k == "output_router_logits"}
    return transformers.AutoConfig.for_model(model_type, **fields)


@pytest.mark.parametrize("model_type", list(FALLBACK_MOE_CONFIGS))
def test_fallback_moe_architectures_train_as_transformers_through_moetunes_experts(tmp_path, model_type):
    """Each fallback MoE architecture loaded by moetune from a checkpoint plain Transformers saved, on
    moetune's experts path: logits, loss with its aux loss, every gradient as Transformers' eager
    experts (1e-5, fp32); an optimizer step trains; its save_pretrained reloads in Transformers."""
    import moetune

    config = _fallback_moe_config(model_type)
    torch.manual_seed(0)
    if not transformers.AutoModelForCausalLM._model_mapping[type(config)]._can_set_experts_implementation():
        # Transformers 5.10's GraniteMoe(Shared) (ParallelExperts) and LongcatFlash experts take no experts
        # implementation (later versions' do): moetune refuses an experts_backend for them, by name.
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "reference")
        with pytest.raises(ValueError, match=f"{model_type}' takes none"):
            moetune.AutoModelForCausalLM.from_pretrained(tmp_path / "reference", experts_backend="loop")
        return
    reference = transformers.AutoModelForCausalLM.from_config(config, experts_implementation="eager")
    with torch.no_grad():  # experts weights larger than the init's: their errors would show in the logits
        for name, param in reference.named_parameters():
            if param.dim() == 3 and name.endswith("_proj"):
                param.normal_(0.0, 0.3)
    reference.save_pretrained(tmp_path / "reference")
    ours = moetune.AutoModelForCausalLM.from_pretrained(tmp_path / "reference", experts_backend="loop")
    assert type(ours) is type(reference) and ours.config._experts_implementation == IMPLEMENTATION_NAME
    ids = torch.randint(0, 64, (2, 9))
    expected, got = reference(input_ids=ids, labels=ids), ours(input_ids=ids, labels=ids)
    assert rel_err(got.logits, expected.logits) < 1e-5
    assert rel_err(got.loss, expected.loss) < 1e-5
    if getattr(expected, "aux_loss", None) is not None:
        assert rel_err(got.aux_loss, expected.aux_loss) < 1e-5
    expected.loss.backward()
    got.loss.backward()
    ref_params = dict(reference.named_parameters())
    for name, param in ours.named_parameters():
        if ref_params[name].grad is not None:
            assert rel_err(param.grad, ref_params[name].grad) < 1e-5, name
    torch.optim.AdamW(ours.parameters(), lr=1e-3).step()
    assert ours(input_ids=ids, labels=ids).loss.item() < got.loss.item()
    ours.save_pretrained(tmp_path / "trained")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "trained").eval()
    ours.eval()
    torch.testing.assert_close(reloaded(input_ids=ids).logits, ours(input_ids=ids).logits)


def _experts_module(model_type: str, class_name: str, **config_fields) -> torch.nn.Module:
    import importlib

    try:
        module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    except ModuleNotFoundError:
        pytest.skip(f"Transformers {transformers.__version__} has no {model_type!r}")
    config = transformers.AutoConfig.for_model(model_type)
    config = getattr(config, "text_config", config)
    for key, value in config_fields.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    experts = getattr(module, class_name)(config)
    with torch.no_grad():
        for param in experts.parameters():
            param.normal_(0.0, 0.5)
    return experts


# Experts whose gating is the class's own ``_apply_gate`` (moetune runs it between its GEMMs), and
# experts in a layout moetune's path does not take (Transformers' default forward runs them).
OWN_GATE_EXPERTS = {
    "deepseek_v4 (clamped SwiGLU)": ("deepseek_v4", "DeepseekV4Experts", dict(swiglu_limit=0.3)),
    "inkling2 (activation of gate and up)": ("inkling2", "Inkling2Experts", {}),
    "aria (transposed weights)": ("aria", "AriaExperts", {}),
}


@pytest.mark.parametrize("case", list(OWN_GATE_EXPERTS))
def test_moetunes_experts_path_keeps_the_experts_own_gating_and_layout(case, monkeypatch):
    import moetune.integrations.transformers_experts as integration

    model_type, class_name, fields = OWN_GATE_EXPERTS[case]
    sizes = dict(hidden_size=16, moe_intermediate_size=24, intermediate_size=24, num_experts=4, num_local_experts=4,
                 n_routed_experts=4, moe_num_experts=4)  # fmt: skip
    experts = _experts_module(model_type, class_name, **sizes, **fields)
    if not hasattr(experts, "has_gate"):  # set by Transformers' experts decorator
        pytest.skip(f"Transformers {transformers.__version__}'s {class_name} takes no experts implementation "
                    "(5.10's AriaExperts: fc1 / fc2 modules, forward(hidden_states, router_logits))")
    if getattr(experts, "limit", None) is not None:
        experts.limit = 0.3  # the clamp bites: a plain SwiGLU would differ
    register_moetune_experts()
    calls = []
    real_run = integration.run_experts
    monkeypatch.setattr(integration, "run_experts", lambda *a, **k: calls.append(1) or real_run(*a, **k))
    x = torch.randn(7, 16, requires_grad=True)
    top_k_index = torch.stack([torch.randperm(4)[:2] for _ in range(7)])
    top_k_weights = torch.rand(7, 2)
    results = {}
    for implementation in ("eager", IMPLEMENTATION_NAME):
        experts.config._experts_implementation = implementation
        x.grad = None
        experts.zero_grad()
        y = experts(x, top_k_index, top_k_weights)
        y.square().sum().backward()
        results[implementation] = [y, x.grad] + [p.grad for p in experts.parameters()]
    for got, expected in zip(results[IMPLEMENTATION_NAME], results["eager"]):
        assert rel_err(got, expected) < 1e-5
    assert bool(calls) == integration._has_moetune_layout(experts)
