"""Both sides get identical weights and routing switches; the Transformers patch is undone."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.qwen3_moe import modeling_qwen3_moe

import moetune
from moetune.bench.models import CONFIGS_DIR, build_side, hf_balanced_gate, load_config
from moetune.bench.weights import init_weights
from moetune.bench.run import tokens

CPU = torch.device("cpu")


def _sides(**kwargs):
    _, config = load_config("tiny", layers=2)
    return config, [build_side(side, config, device=CPU, seed=3, **kwargs) for side in ("hf", "moetune")]


def test_identical_weights_without_copy():
    _, (hf, mt) = _sides(dtype=torch.bfloat16)
    hf_params, mt_params = dict(hf.model.named_parameters()), dict(mt.model.named_parameters())
    assert hf_params.keys() == mt_params.keys()
    for name, param in hf_params.items():
        assert torch.equal(param, mt_params[name]), name
    assert torch.equal(hf_params["model.norm.weight"], torch.ones_like(hf_params["model.norm.weight"]))
    assert abs(hf_params["lm_head.weight"].float().std().item() - 0.02) < 2e-3


def test_rounded_fp32_reference_holds_the_bf16_weights():
    _, config = load_config("tiny", layers=2)
    bf16 = build_side("hf", config, device=CPU, dtype=torch.bfloat16, seed=1)
    ref = build_side("hf", config, device=CPU, dtype=torch.float32, seed=1, round_to=torch.bfloat16)
    for (name, a), (_, b) in zip(sorted(bf16.model.named_parameters()), sorted(ref.model.named_parameters())):
        assert b.dtype == torch.float32 and torch.equal(a.float(), b), name


def test_same_losses_with_real_and_balanced_routing():
    config, (hf, mt) = _sides(dtype=torch.float32)
    ids = tokens(vocab_size=config.vocab_size, micro_batch=2, seq_len=16, seed=0, rank=0, device=CPU)
    for balanced in (False, True):
        with hf.routing_context(balanced), mt.routing_context(balanced):
            hf_loss, mt_loss = hf.loss(ids), mt.loss(ids)
        torch.testing.assert_close(mt_loss, hf_loss, rtol=1e-5, atol=1e-5)
    with hf.routing_context(False):
        real = hf.loss(ids)
    with hf.routing_context(True):
        balanced = hf.loss(ids)
    assert not torch.allclose(real, balanced)


def test_balanced_patch_routes_slot_j_to_expert_j_mod_e_and_is_restored():
    original = modeling_qwen3_moe.Qwen3MoeTopKRouter.forward
    _, config = load_config("tiny")
    router = modeling_qwen3_moe.Qwen3MoeTopKRouter(config)
    init_weights(router, seed=0)
    x = torch.randn(5, config.hidden_size)
    with hf_balanced_gate(enabled=True, top_k=config.num_experts_per_tok):
        logits, weights, experts = router(x)
    assert logits.shape == (5, config.num_experts)
    assert torch.equal(experts.flatten(), torch.arange(10) % config.num_experts)
    assert torch.all(weights == 0.5)
    assert modeling_qwen3_moe.Qwen3MoeTopKRouter.forward is original


@pytest.mark.parametrize("name", sorted(p.stem for p in CONFIGS_DIR.glob("*.json")))
def test_every_shipped_config_loads_cut_to_its_first_layers(name):
    """Each shipped config reads through Transformers; ``layers`` cuts the per-layer kinds with it
    (Nemotron-H derives its number of layers from its pattern), and both sides build on meta."""
    _, config = load_config(name, layers=2)
    assert config.num_hidden_layers == 2
    if isinstance(getattr(config, "layer_types", None), list):
        assert len(config.layer_types) == 2
    with torch.device("meta"):
        ours = moetune.AutoModelForCausalLM.from_config(config)
        theirs = transformers.AutoModelForCausalLM.from_config(config)
    assert {n for n, _ in ours.named_parameters()} == {n for n, _ in theirs.named_parameters()}
