"""FLOPs per token (the brief's convention), expert-load counting, the learning-rate schedule."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3MoeConfig

from moetune.recipe.config import OptimConfig
from moetune.flops import training_flops_per_token
from moetune.recipe.metrics import ExpertLoad, moe_layer_ids, num_routed_experts
from moetune.recipe.optim import lr_at


def qwen3_30b_a3b() -> Qwen3MoeConfig:
    return Qwen3MoeConfig(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                          vocab_size=151936, intermediate_size=6144)


def test_flops_per_token_matches_the_brief_for_qwen3_30b_a3b():
    assert training_flops_per_token(qwen3_30b_a3b(), seq_len=4096) == pytest.approx(23.0e9, rel=0.01)


def test_dense_layers_count_the_dense_mlp():
    config = qwen3_30b_a3b()
    config.mlp_only_layers = [0]
    assert moe_layer_ids(config)[0] == 1
    delta = training_flops_per_token(config, seq_len=4096) - training_flops_per_token(qwen3_30b_a3b(), seq_len=4096)
    assert delta == pytest.approx(3 * (3 * 2 * 2048 * 6144 - 8 * 3 * 2 * 2048 * 768))


def test_expert_load_counts_top_k_of_real_tokens_only():
    load = ExpertLoad(num_layers=1, num_experts=4, top_k=2, device=torch.device("cpu"))
    logits_TE = torch.tensor([[5.0, 4.0, 0.0, 0.0], [0.0, 0.0, 5.0, 4.0], [9.0, 0.0, 0.0, 8.0]])
    load.add((logits_TE,), torch.tensor([True, True, False]))
    assert load.as_lists() == [[1, 1, 1, 1]]


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    config = OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    lrs = [lr_at(s, config, total_steps=100) for s in range(101)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:])) and lrs[100] == pytest.approx(0.1)


def test_moe_layer_ids_follow_each_family_rule():
    from transformers import DeepseekV3Config, NemotronHConfig

    assert moe_layer_ids(DeepseekV3Config(num_hidden_layers=5, first_k_dense_replace=2)) == [2, 3, 4]
    assert moe_layer_ids(NemotronHConfig(num_hidden_layers=4, hybrid_override_pattern="ME*E")) == [1, 3]


def test_each_familys_expert_count_is_read_under_its_own_name():
    """Nemotron-H's and DeepSeek-V3's n_routed_experts, which Transformers 5.10 does not alias to
    num_local_experts (the recipe counted no expert load for Nemotron-H there)."""
    from transformers import DeepseekV3Config, LlamaConfig, MixtralConfig, NemotronHConfig

    assert num_routed_experts(NemotronHConfig(n_routed_experts=12)) == 12
    assert num_routed_experts(DeepseekV3Config(n_routed_experts=10)) == 10
    assert num_routed_experts(MixtralConfig(num_local_experts=6)) == 6
    assert num_routed_experts(Qwen3MoeConfig(num_experts=5)) == 5
    assert num_routed_experts(LlamaConfig()) == 0


def test_expert_load_records_the_routers_actual_choices():
    """DeepSeek-style routers choose with a bias the logits do not show: recording counts what the
    router chose (the balanced gate here: slot j -> expert j mod E), not the logits' top-k."""
    from moetune.moe import GroupLimitedSigmoidRouter

    router = GroupLimitedSigmoidRouter(hidden_size=4, num_experts=4, top_k=2, num_groups=2, top_k_groups=1,
                                       normalize_top_k=True, scaling_factor=1.0, balanced=True)  # fmt: skip
    model = torch.nn.Sequential(router)
    load = ExpertLoad(num_layers=1, num_experts=4, top_k=2, device=torch.device("cpu"))
    with load.recording(model):
        routing = model(torch.randn(3, 4))
    load.add((routing.logits_TE,), torch.tensor([True, True, False]))
    assert load.as_lists() == [[1, 1, 1, 1]]  # tokens 0, 1 -> experts (0, 1), (2, 3)
    model(torch.randn(3, 4))  # hooks removed: nothing recorded outside the block
    assert load._chosen == []


def test_plots_are_skipped_with_a_note_without_matplotlib(tmp_path, monkeypatch, capsys):
    """A finished job must not fail on its last, optional output."""
    import sys

    from moetune.recipe.plots import write_plots

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert write_plots(tmp_path, moe_layer_ids=[0]) is None
    assert "matplotlib is not installed" in capsys.readouterr().err


def test_logged_tflops_count_each_packed_sample_at_its_own_length(tiny_job, tmp_path):
    """The recipe's TFLOP/s (and MFU) divide real FLOPs by time: attention of packed samples at their
    own lengths, not at data.max_length."""
    import json

    from moetune.flops import FlopsCounter
    from moetune.recipe.config import DEFAULT_ASSETS
    from moetune.recipe.train import finetune
    from transformers import AutoConfig

    out = tmp_path / "out"
    finetune(tiny_job(out, training__steps=2))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    record = next(r for r in records if "tflops_per_gpu" in r)
    flops_per_token = record["tflops_per_gpu"] * 1e12 / record["tokens_per_s_per_gpu"]
    counter = FlopsCounter(AutoConfig.from_pretrained(DEFAULT_ASSETS / "model"))
    assert counter.per_token(1) < flops_per_token < counter.per_token(64)  # tiny_job packs rows of 64


def test_lora_steps_count_no_weight_gradients(tiny_job, tmp_path):
    """A LoRA run's TFLOP/s use the frozen-weight count (no weight gradients), below full fine-tuning's."""
    import json

    from moetune.flops import FlopsCounter
    from moetune.recipe.config import DEFAULT_ASSETS
    from moetune.recipe.train import finetune
    from transformers import AutoConfig

    out = tmp_path / "out"
    finetune(tiny_job(out, training__steps=2, lora__enabled="true", checkpoint__export_final="false"))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    record = next(r for r in records if "tflops_per_gpu" in r)
    flops_per_token = record["tflops_per_gpu"] * 1e12 / record["tokens_per_s_per_gpu"]
    counter = FlopsCounter(AutoConfig.from_pretrained(DEFAULT_ASSETS / "model"))
    assert counter.per_token(1, frozen_weights=True) < flops_per_token < counter.per_token(64, frozen_weights=True)
    assert flops_per_token < counter.per_token(1)  # below any full fine-tuning count
