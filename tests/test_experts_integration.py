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
