"""``moetune plan``: the command, its input checks, the search and the relations its models must keep."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moetune.cli import main
from moetune.plan import PlanRequest, Setting, make_plan, plan_to_dict
from moetune.plan.calibration import load_calibration
from moetune.plan.memory import GIB, memory_breakdown
from moetune.plan.search import cached_inventory
from moetune.plan.throughput import step_time

REPO = Path(__file__).resolve().parents[2]


def _setting(**changes) -> Setting:
    base = dict(ep=8, dense_parallel="fsdp", ep_dispatch="alltoall", recompute="none", micro_batch=1, grad_accum=1,
                cuda_graph=False)
    return Setting(**{**base, **changes})


def test_plan_help_lists_the_inputs(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for option in ("--gpus-per-node", "--nodes", "--gpu-memory", "--seq-len", "--micro-batch", "--global-batch",
                   "--lora-rank", "--fp8", "--recompute", "--ep", "--dense-parallel", "--json"):
        assert option in out


def test_json_plan_of_a_shipped_model(capsys):
    assert main(["plan", "qwen3_30b_a3b", "--gpu", "h100", "--micro-batch", "1", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    best = plan["plan"]
    setting, memory = best["setting"], best["memory"]
    assert plan["fits"] and best["fits"]
    assert plan["world"] % setting["ep"] == 0 and plan["experts"] % setting["ep"] == 0
    parts = memory["gib"]
    in_peak = sum(parts[k] for k in ("parameters", "gradients", "optimizer", "activations", "communication"))
    assert in_peak == pytest.approx(memory["peak_allocated_gib"], abs=0.01)
    assert memory["total_gib"] == pytest.approx(in_peak + parts["cuda_graph_pool"] + parts["reserve"], abs=0.01)
    assert memory["total_gib"] <= plan["gpu_memory_gib"]
    assert best["time"]["tokens_per_s_per_gpu"] > 0 and 0 < best["time"]["mfu"] < 1
    assert f"--distributed.ep_size {setting['ep']}" in plan["recipe_overrides"]


def test_a_model_that_cannot_fit_says_what_would(capsys):
    assert main(["plan", "deepseek_v3", "--gpu", "h100", "--nodes", "1", "--micro-batch", "1"]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "What would" in out
    plan = make_plan(PlanRequest(model="deepseek_v3", gpus_per_node=8, nodes=4, gpu="h100", micro_batch=1))
    assert not plan.fits
    assert any("LoRA" in s for s in plan.suggestions) and any("GPUs" in s for s in plan.suggestions)
    # What is suggested does fit.
    nodes = int(next(s for s in plan.suggestions if "GPUs" in s).split(" nodes")[0])
    assert make_plan(PlanRequest(model="deepseek_v3", gpus_per_node=8, nodes=nodes, gpu="h100", micro_batch=1)).fits
    assert make_plan(PlanRequest(model="deepseek_v3", gpus_per_node=8, nodes=4, gpu="h100", micro_batch=1,
                                 lora_rank=16)).fits


def test_the_chosen_setting_is_the_fastest_that_fits():
    plan = make_plan(PlanRequest(model="nemotron_3_nano_30b_a3b", gpus_per_node=8, gpu="h100", micro_batch=1))
    fitting = [c for c in plan.candidates if c.fits]
    assert plan.best is fitting[0]
    assert all(plan.best.time.tokens_per_s >= c.time.tokens_per_s for c in fitting)


def test_checkpointing_trades_memory_for_time():
    request = PlanRequest(model="qwen3_30b_a3b", gpus_per_node=1, gpu="h100", micro_batch=1, layers=8)
    _, inventory = cached_inventory(request.model, 8, 0, (), True, "bf16")
    calibration = load_calibration("h100")
    results = {mode: (memory_breakdown(inventory, request, _setting(ep=1, recompute=mode), calibration),
                      step_time(inventory, request, _setting(ep=1, recompute=mode), calibration))
               for mode in ("none", "selective", "full")}
    memory = {mode: m.activations_max for mode, (m, _) in results.items()}
    time = {mode: t.step for mode, (_, t) in results.items()}
    assert memory["full"] < memory["selective"] < memory["none"]
    assert time["none"] < time["selective"] < time["full"]
    # Parameters, gradients and optimizer states do not depend on checkpointing.
    assert len({(m.parameters, m.optimizer, m.gradients_total) for m, _ in results.values()}) == 1


def test_more_ranks_hold_less_and_lora_holds_less_than_full_fine_tuning():
    calibration = load_calibration("h200")
    sizes = {}
    for nodes in (2, 4, 8):
        request = PlanRequest(model="kimi_k2", gpus_per_node=8, nodes=nodes, gpu="h200", micro_batch=1)
        _, inventory = cached_inventory(request.model, 4, 0, (), True, "bf16")
        m = memory_breakdown(inventory, request, _setting(ep=16), calibration)
        sizes[nodes] = m.parameters + m.optimizer + m.gradients_total
    assert sizes[2] > sizes[4] > sizes[8]
    full = make_plan(PlanRequest(model="qwen3_30b_a3b", gpus_per_node=1, gpu="h200", micro_batch=1, layers=8))
    lora = make_plan(PlanRequest(model="qwen3_30b_a3b", gpus_per_node=1, gpu="h200", micro_batch=1, layers=8,
                                 lora_rank=16))
    assert lora.best.memory.optimizer < full.best.memory.optimizer / 10
    assert lora.inventory.trainable_params < full.inventory.trainable_params / 10


def test_global_batch_sets_the_gradient_accumulation():
    plan = make_plan(PlanRequest(model="qwen3_30b_a3b", gpus_per_node=8, gpu="h100", micro_batch=1, global_batch=64))
    assert plan.best.setting.grad_accum == 8
    assert plan.best.time.tokens_per_step == 8 * 4096
    with pytest.raises(ValueError, match="global_batch=60"):
        make_plan(PlanRequest(model="qwen3_30b_a3b", gpus_per_node=8, gpu="h100", micro_batch=1, global_batch=60))


def test_fp8_is_priced_as_measured():
    """FP8 plans follow the measured FP8 steps (an H100, 2026-12-07): slower than bf16 at 4,096 tokens a
    micro-batch, the same activations; the plan says where the price comes from."""
    request = PlanRequest(model="qwen3_30b_a3b", gpus_per_node=8, gpu="h100", micro_batch=1, ep=8, recompute="none",
                          dense_parallel="fsdp", cuda_graph=False)
    bf16, fp8 = make_plan(request), make_plan(request.but(fp8=True))
    assert fp8.best.time.step > bf16.best.time.step
    assert fp8.best.memory.activations == bf16.best.memory.activations
    assert any("FP8" in note and "measured" in note for note in plan_to_dict(fp8)["assumptions"])


@pytest.mark.parametrize("micro_batch, bf16_ms, fp8_ms", [(1, 76.4, 89.2), (4, 209.6, 211.4), (8, 388.9, 380.2)])
def test_fp8_pricing_matches_the_measured_steps(micro_batch, bf16_ms, fp8_ms):
    """The fitted constants reproduce the steps they were fitted to: Qwen3-30B-A3B, 8 layers, one H100,
    graphed, FP8 rowwise with bf16 weight gradients (the default) against bf16 at 4,096, 16,384 and
    32,768 tokens a step (benchmarks/results/h100_20261207_3690952/, h100_20261207_32faff3/): FP8's
    weight quantisation is a fixed cost a micro-batch, its GEMM savings grow with the tokens, so its
    ratio to bf16 falls from 1.17 to 0.98 as measured."""
    from moetune.plan.calibration import load_calibration
    from moetune.plan.search import cached_inventory
    from moetune.plan.setting import Setting
    from moetune.plan.throughput import step_time

    request = PlanRequest(model="qwen3_30b_a3b", gpus_per_node=1, gpu="h100", micro_batch=micro_batch, layers=8, ep=1,
                          clip_grad=False)  # fmt: skip
    _, inventory = cached_inventory("qwen3_30b_a3b", 8, 0, (), True, "bf16")
    setting = Setting(ep=1, dense_parallel="fsdp", ep_dispatch="alltoall", recompute="none", micro_batch=micro_batch,
                      grad_accum=1, cuda_graph=True)  # fmt: skip
    calibration = load_calibration("h100")
    bf16 = step_time(inventory, request, setting, calibration).step
    fp8 = step_time(inventory, request.but(fp8=True), setting, calibration).step
    assert fp8 / bf16 == pytest.approx(fp8_ms / bf16_ms, rel=0.01)


@pytest.mark.parametrize("model, message", [
    ("no_such_model", "model 'no_such_model'"),
])
def test_bad_input_names_the_field(model, message):
    with pytest.raises(ValueError, match=message):
        make_plan(PlanRequest(model=model))


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match="ep=3 must divide"):
        make_plan(PlanRequest(model="qwen3_30b_a3b", gpus_per_node=8, ep=3))
    with pytest.raises(ValueError, match="gpu: no calibration for 'a100'"):
        make_plan(PlanRequest(model="qwen3_30b_a3b", gpu="a100"))
    with pytest.raises(ValueError, match="recompute"):
        PlanRequest(model="qwen3_30b_a3b", recompute="half")
    with pytest.raises(ValueError, match="seq_len"):
        PlanRequest(model="qwen3_30b_a3b", seq_len=0)


def test_config_json_and_hub_folders_are_read_kimi_k2_as_deepseek_v3(tmp_path, capsys):
    config = json.loads((REPO / "moetune/assets/configs/kimi_k2.json").read_text())
    config.update(model_type="kimi_k2", auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config"})
    folder = tmp_path / "Kimi-K2-Instruct"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    as_folder = make_plan(PlanRequest(model=str(folder), gpus_per_node=8, nodes=32, gpu="h100", micro_batch=1))
    as_file = make_plan(PlanRequest(model=str(folder / "config.json"), gpus_per_node=8, nodes=32, gpu="h100",
                                    micro_batch=1))
    shipped = make_plan(PlanRequest(model="kimi_k2", gpus_per_node=8, nodes=32, gpu="h100", micro_batch=1))
    assert as_folder.inventory.total_params == as_file.inventory.total_params == shipped.inventory.total_params
    assert as_folder.best.memory.total == shipped.best.memory.total


def test_the_brief_flop_count_is_the_sum_of_the_planner_parts():
    """The time model splits the brief's FLOPs per token into dense GEMMs, experts and attention."""
    _, inventory = cached_inventory("gpt_oss_20b", None, 0, (), True, "bf16")
    seq = 8192
    attention = 0.0
    for layer in inventory.layers:
        a = layer.attention
        keys = seq / 2 if not (a.window and a.window < seq) else a.window - a.window * (a.window - 1) / (2 * seq)
        attention += 2 * a.heads * (a.qk_head_dim + a.v_head_dim) * keys
    head = 2 * inventory.hidden * inventory.vocab
    weights = sum(layer.dense_forward_flops + layer.expert_forward_flops for layer in inventory.layers) + head
    assert 3 * (weights + attention) == pytest.approx(inventory.flops.per_token(seq), rel=1e-9)


def test_cpu_plans_memory_only():
    plan = make_plan(PlanRequest(model="tiny", gpus_per_node=1, gpu="cpu", precision="fp32", micro_batch=2,
                                 seq_len=64))
    assert plan.fits and plan.best.time is None and plan.gpu_memory is None
    assert plan.best.memory.parameters == sum(p.numel for p in plan.inventory.params) * 4 + plan.inventory.buffer_bytes
    assert plan.best.memory.reserve == 0 and plan.best.memory.peak > 0
    assert plan.best.memory.peak < GIB
