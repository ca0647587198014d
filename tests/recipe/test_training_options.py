"""Training options: gradient accumulation is exact, precisions and activation checkpointing run,
optional sinks degrade gracefully."""

from __future__ import annotations

import json

import pytest

from moetune.recipe.train import finetune


def test_grad_accumulation_matches_one_big_micro_batch(tiny_job, tmp_path):
    big = finetune(tiny_job(tmp_path / "big", training__micro_batch_size=2, training__steps=3))
    accum = finetune(tiny_job(tmp_path / "acc", training__micro_batch_size=1, training__grad_accum_steps=2,
                              training__steps=3))
    # Same rows per step; every answer token weighs the same however the rows are split. (Not
    # bit-equal: the MoE balancing loss is computed per micro-batch, and sums reorder.)
    assert accum.losses == pytest.approx(big.losses, rel=1e-4)


@pytest.mark.parametrize("precision", ["bf16", "bf16_autocast"])
def test_bf16_precisions_train(tiny_job, tmp_path, precision):
    result = finetune(tiny_job(tmp_path / precision, training__precision=precision, training__steps=3))
    assert len(result.losses) == 3 and all(loss == loss for loss in result.losses)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_gives_the_same_losses(tiny_job, tmp_path, mode):
    plain = finetune(tiny_job(tmp_path / "plain", training__steps=2))
    recomputed = finetune(tiny_job(tmp_path / "ckpt", training__steps=2, model__activation_checkpointing="true",
                                   model__activation_checkpointing_mode=mode))
    assert recomputed.losses == pytest.approx(plain.losses, rel=1e-5)


def test_missing_optional_sinks_only_warn(tiny_job, tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard were not installed
    finetune(tiny_job(tmp_path / "tb", training__steps=1, metrics__tensorboard="true"))
    assert "tensorboard is not installed" in capsys.readouterr().err


def test_tensorboard_receives_the_metrics(tiny_job, tmp_path):
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator", reason="tensorboard is a test extra"
    )
    finetune(tiny_job(tmp_path / "tb", training__steps=2, metrics__tensorboard="true", metrics__log_every="1"))
    events = event_accumulator.EventAccumulator(str(tmp_path / "tb" / "tensorboard"))
    events.Reload()
    assert "loss" in events.Tags()["scalars"]
    assert [e.step for e in events.Scalars("loss")] == [1, 2]


def test_wandb_receives_the_run_config_and_each_logged_step(tiny_job, tmp_path, monkeypatch):
    """``metrics.wandb_project``: one run in that project with the job's config, every log step's
    numbers at its step, finished at the end. wandb itself is replaced by a recording module (its
    client needs an account or a local server); what the recipe hands it is checked."""
    import sys
    import types

    calls = []

    class RecordingRun:
        def log(self, numbers, step):
            calls.append(("log", step, numbers))

        def finish(self):
            calls.append(("finish",))

    def init(*, project, config, dir):
        calls.append(("init", project, config, dir))
        return RecordingRun()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    finetune(tiny_job(tmp_path / "wb", training__steps=2, metrics__wandb_project="moe-sft", metrics__log_every="1"))
    (kind, project, run_config, folder), *logs, finish = calls
    assert (kind, project, finish) == ("init", "moe-sft", ("finish",))
    assert run_config["training"]["steps"] == 2 and folder == str(tmp_path / "wb")
    # The same records as metrics.jsonl, numbers only, each at its step.
    records = [json.loads(line) for line in (tmp_path / "wb" / "metrics.jsonl").read_text().splitlines()]
    numbers = [{k: v for k, v in r.items() if isinstance(v, (int, float)) and k != "step"} for r in records]
    assert [(step, logged) for _, step, logged in logs] == [(r.get("step", 0), n) for r, n in zip(records, numbers)]
    assert [step for _, step, logged in logs if "loss" in logged] == [1, 2]


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss", "nemotron_h"])
def test_every_moetune_family_fine_tunes_and_exports(tiny_job, tmp_path, family):
    """The recipe on a tiny model of each family moetune implements (the default tokenizer's
    vocabulary): it trains, counts the routers' expert choices and exports a checkpoint that plain
    Transformers loads."""
    import transformers

    from tests.test_deepseek_v3_parity import tiny_deepseek_v3_config
    from tests.test_gpt_oss_parity import tiny_gpt_oss_config
    from tests.test_nemotron_h_parity import tiny_nemotron_h_config

    build = {"deepseek_v3": tiny_deepseek_v3_config, "gpt_oss": tiny_gpt_oss_config, "nemotron_h": tiny_nemotron_h_config}
    build[family](vocab_size=309, max_position_embeddings=512).save_pretrained(tmp_path / "model")
    result = finetune(tiny_job(tmp_path / "out", model__config_path=tmp_path / "model", training__steps=2,
                               checkpoint__export_final="true"))  # fmt: skip
    assert len(result.losses) == 2 and all(loss == loss for loss in result.losses)
    exported = transformers.AutoModelForCausalLM.from_pretrained(result.exported["final"])
    assert exported.config.model_type == family
    final = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[-1])
    counts = final["expert_tokens"]  # each tiny config has two MoE layers
    assert len(counts) == 2 and all(sum(layer) > 0 for layer in counts)


def test_packing_is_refused_for_layers_that_carry_state_across_documents(tiny_job, tmp_path):
    """A fallback architecture with Mamba layers (Jamba, Transformers' classes) would carry their state
    from one packed sample into the next; moetune's Nemotron-H runs each alone (the test above)."""
    from transformers import JambaConfig

    JambaConfig(vocab_size=309, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, attn_layer_period=2, attn_layer_offset=1,
                expert_layer_period=2, expert_layer_offset=1, mamba_d_state=4, mamba_d_conv=4, mamba_expand=2,
                mamba_dt_rank=4, use_mamba_kernels=False).save_pretrained(tmp_path / "model")
    with pytest.raises(ValueError, match=r"data.packing: jamba has recurrent layers \(.*Mamba"):
        finetune(tiny_job(tmp_path / "out", model__config_path=tmp_path / "model"))


def test_nemotron_h_packed_rows_recompute_the_same_under_activation_checkpointing(tiny_job, tmp_path):
    """The Mamba-2 path with packed documents kept apart, inside a recomputed block, gives the same losses."""
    from tests.test_nemotron_h_parity import tiny_nemotron_h_config

    tiny_nemotron_h_config(vocab_size=309, max_position_embeddings=512).save_pretrained(tmp_path / "model")
    options = {"model__config_path": tmp_path / "model", "training__steps": 2}
    plain = finetune(tiny_job(tmp_path / "plain", **options))
    recomputed = finetune(tiny_job(tmp_path / "ckpt", model__activation_checkpointing="true", **options))
    assert recomputed.losses == pytest.approx(plain.losses, rel=1e-5)


def test_profile_steps_write_a_trace_and_the_top_operators(tiny_job, tmp_path):
    """metrics.profile_start / profile_steps: torch.profiler over those steps of the loop; the trace,
    the operator table and a summary land in output_dir/profile, and training goes on after it."""
    out = tmp_path / "profiled"
    result = finetune(tiny_job(out, metrics__profile_start=2, metrics__profile_steps=2))
    assert len(result.losses) == 4
    profile = out / "profile"
    trace = json.loads((profile / "trace_rank0.json").read_text())
    assert any(event.get("name", "").startswith("aten::mm") for event in trace["traceEvents"])
    assert "aten::" in (profile / "ops_rank0.txt").read_text()
    summary = json.loads((profile / "summary_rank0.json").read_text())
    assert summary["steps"] == 2 and summary["wall_ms_per_step"] > 0 and summary["device_busy_ms_per_step"] is None
    assert summary["top"] and all(entry["ms_per_step"] >= 0 for entry in summary["top"])


def test_profile_settings_are_checked(tiny_job):
    with pytest.raises(ValueError, match="metrics.profile_steps"):
        tiny_job(metrics__profile_start=1, metrics__profile_steps=0)
    with pytest.raises(ValueError, match="metrics.profile_start"):
        tiny_job(metrics__profile_start=-1)


def test_validation_runs_every_val_every_steps_whatever_log_every_is(tiny_job, tmp_path):
    out = tmp_path / "val"
    finetune(tiny_job(out, training__steps=9, training__val_every=3, metrics__log_every=2))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "final" not in r]
    assert [r["step"] for r in steps if "val_loss" in r] == [3, 6, 9]
    assert [r["step"] for r in steps if "loss" in r] == [2, 4, 6, 8, 9]
    assert all(r["val_loss"] > 0 for r in steps if "val_loss" in r)
