"""Checkpoints: exact resume, atomic writes, keep-last-N, refusals, NaN stop, Ctrl-C."""

from __future__ import annotations

import math
import os
import signal

import pytest

from moetune.recipe import checkpointing, train
from moetune.recipe.config import DEFAULT_ASSETS
from moetune.recipe.train import NonFiniteLossError, finetune


def test_resume_reproduces_the_uninterrupted_losses(tiny_job, tmp_path):
    full = finetune(tiny_job(tmp_path / "full", training__steps=6))
    first = finetune(tiny_job(tmp_path / "split", training__steps=3, checkpoint__every=3))
    assert first.losses == full.losses[:3]
    resumed = finetune(tiny_job(tmp_path / "split", training__steps=6, checkpoint__resume="auto"))
    assert resumed.losses == full.losses[3:]  # bit-identical: model, optimizer, lr, data, RNG
    # The expert-load counts (the final record, the plots) cover all six steps, as without the resume.
    assert _final_expert_tokens(tmp_path / "split") == _final_expert_tokens(tmp_path / "full") is not None


def _final_expert_tokens(out):
    import json

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in records if r.get("final")][-1]["expert_tokens"]


def test_checkpoints_are_atomic_and_only_the_last_n_are_kept(tiny_job, tmp_path):
    out = tmp_path / "ck"
    finetune(tiny_job(out, training__steps=5, checkpoint__every=1, checkpoint__keep_last=2))
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["step_00000004", "step_00000005"]  # no .tmp_* left behind


def test_resume_refuses_a_checkpoint_of_another_model(tiny_job, tmp_path):
    out = tmp_path / "ck"
    finetune(tiny_job(out, training__steps=2, checkpoint__every=2))
    other = tmp_path / "other_model"
    other.mkdir()
    shipped = (DEFAULT_ASSETS / "model" / "config.json").read_text()
    (other / "config.json").write_text(shipped.replace('"hidden_size": 128', '"hidden_size": 64'))
    with pytest.raises(ValueError, match="different model; hidden_size: checkpoint 128, this job 64"):
        finetune(tiny_job(out, training__steps=4, checkpoint__resume="auto", model__config_path=other))


def test_resume_refuses_rows_packed_another_way(tiny_job, tmp_path):
    """The data position counts packed rows: a resume with another data.packing_strategy (or of a
    checkpoint written before the option, which packed in order) is refused before any tensor loads."""
    import json

    out = tmp_path / "ck"
    finetune(tiny_job(out, training__steps=2, checkpoint__every=2))
    with pytest.raises(ValueError, match="packed with data.packing_strategy 'best_fit', this job packs with 'in_order'"):
        finetune(tiny_job(out, training__steps=4, checkpoint__resume="auto", data__packing_strategy="in_order"))
    state_file = out / "checkpoints" / "step_00000002" / checkpointing.STATE_FILE
    state = json.loads(state_file.read_text())
    del state["data"]["packing_strategy"]  # as written before the option existed
    state_file.write_text(json.dumps(state))
    with pytest.raises(ValueError, match="Resume with --data.packing_strategy in_order"):
        finetune(tiny_job(out, training__steps=4, checkpoint__resume="auto"))
    resumed = finetune(tiny_job(out, training__steps=4, checkpoint__resume="auto", data__packing_strategy="in_order"))
    assert len(resumed.losses) == 2


def test_nan_loss_stops_with_a_clear_message_and_keeps_the_last_good_checkpoint(tiny_job, tmp_path, monkeypatch):
    out = tmp_path / "nan"
    real_step = train.train_step
    calls = {"n": 0}

    def poisoned(model, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # poison the weights: the next loss is NaN
            next(model.parameters()).data.fill_(math.nan)
        return real_step(model, *args, **kwargs)

    monkeypatch.setattr(train, "train_step", poisoned)
    with pytest.raises(NonFiniteLossError, match=r"step 3: loss nan.*last good checkpoint is .*step_00000002"):
        finetune(tiny_job(out, training__steps=5, checkpoint__every=2))
    assert [p.name for p in checkpointing.list_checkpoints(str(out))] == ["step_00000002"]


def test_ctrl_c_saves_a_checkpoint_before_exiting(tiny_job, tmp_path, monkeypatch):
    out = tmp_path / "sigint"
    real_step = train.train_step
    calls = {"n": 0}

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        result = real_step(*args, **kwargs)
        if calls["n"] == 2:
            os.kill(os.getpid(), signal.SIGINT)  # as if the user pressed Ctrl-C during step 2
        return result

    monkeypatch.setattr(train, "train_step", interrupted)
    result = finetune(tiny_job(out, training__steps=10))
    assert result.interrupted and result.step == 2
    assert [p.name for p in checkpointing.list_checkpoints(str(out))] == ["step_00000002"]


def test_a_second_signal_aborts_at_once_and_handlers_are_restored():
    from moetune.recipe.interrupts import StopRequest

    before = signal.getsignal(signal.SIGTERM)
    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGTERM)  # Slurm preemption / torchrun shutdown
        assert stop.requested
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGTERM) is before


def test_fingerprint_holds_every_familys_shapes_and_older_checkpoints_still_resume():
    """DeepSeek-V3's routed experts and MLA ranks and Nemotron-H's layer pattern are part of what a
    resume checks; a key an older moetune did not record is not held against its checkpoint."""
    from transformers import DeepseekV3Config, NemotronHConfig

    from moetune.recipe.model_loading import model_fingerprint

    deepseek = model_fingerprint(DeepseekV3Config(n_routed_experts=16, kv_lora_rank=32))
    assert deepseek["n_routed_experts"] == 16 and deepseek["kv_lora_rank"] == 32
    other = model_fingerprint(DeepseekV3Config(n_routed_experts=8, kv_lora_rank=32))
    assert checkpointing.fingerprint_differences(deepseek, other) == [
        "n_routed_experts: checkpoint 16, this job 8"]
    nemotron = model_fingerprint(NemotronHConfig())
    assert {"mamba_num_heads", "ssm_state_size", "n_routed_experts"} <= nemotron.keys()
    assert any(key in nemotron for key in ("hybrid_override_pattern", "layers_block_type"))
    older = {k: v for k, v in deepseek.items() if k != "kv_lora_rank"}  # written before the key was recorded
    assert checkpointing.fingerprint_differences(older, deepseek) == []
    assert checkpointing.fingerprint_differences(deepseek, older) == [
        "kv_lora_rank: checkpoint 32, this job None"]


def _step_records(out):
    import json

    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _fail_if_built(monkeypatch):
    """Refusals come from the checkpoint's small files, before any data is read or model built."""
    monkeypatch.setattr(train, "build_model", lambda *a, **k: pytest.fail("the model was built"))


def test_a_new_run_refuses_an_output_dir_with_checkpoints(tiny_job, tmp_path, monkeypatch):
    """Keep-last would delete the earlier run's checkpoints and `resume auto` would later pick them."""
    out = tmp_path / "ck"
    finetune(tiny_job(out, training__steps=4, checkpoint__every=2))
    with monkeypatch.context() as patch:
        _fail_if_built(patch)
        with pytest.raises(ValueError, match=rf"training.output_dir: {out / 'checkpoints'} already holds checkpoints "
                                             r"\(step_00000002, step_00000004\) .*--checkpoint.resume auto"):
            finetune(tiny_job(out, training__steps=2, checkpoint__every=1))
    assert [p.name for p in checkpointing.list_checkpoints(str(out))] == ["step_00000002", "step_00000004"]
    assert finetune(tiny_job(out, training__steps=5, checkpoint__resume="auto")).losses  # resuming it is fine


def test_a_resume_never_mixes_two_histories_in_one_folder(tiny_job, tmp_path, monkeypatch):
    out = tmp_path / "ck"
    finetune(tiny_job(out, training__steps=4, checkpoint__every=2, checkpoint__keep_last=3))
    older = out / "checkpoints" / "step_00000002"
    other = tmp_path / "other"
    finetune(tiny_job(other, training__steps=2, checkpoint__every=2))
    with monkeypatch.context() as patch:
        _fail_if_built(patch)
        with pytest.raises(ValueError, match=r"step_00000002 is older than step_00000004 in the same folder.*"
                                             "another training.output_dir"):
            finetune(tiny_job(out, training__steps=6, checkpoint__every=2, checkpoint__resume=older))
        with pytest.raises(ValueError, match=r"step_00000002 is not one of the checkpoints in .*other/checkpoints"):
            finetune(tiny_job(other, training__steps=6, checkpoint__every=2, checkpoint__resume=older))
        with pytest.raises(ValueError, match=r"checkpoint.resume: .*nowhere does not exist"):
            finetune(tiny_job(tmp_path / "new", checkpoint__resume=tmp_path / "nowhere"))
        with pytest.raises(ValueError, match=r"ck is not a complete checkpoint .*latest checkpoint is .*step_00000004"):
            finetune(tiny_job(tmp_path / "new", checkpoint__resume=out))
    # From the older checkpoint into a folder of its own: a branch, with nothing of the first run touched.
    branch = finetune(tiny_job(tmp_path / "branch", training__steps=4, checkpoint__every=2, checkpoint__resume=older))
    assert branch.step == 4 and len(branch.losses) == 2
    assert [p.name for p in checkpointing.list_checkpoints(str(out))] == ["step_00000002", "step_00000004"]


def test_metrics_hold_one_history(tiny_job, tmp_path):
    """A new run keeps an earlier run's metrics.jsonl under another name; a resumed run drops the records
    after its checkpoint (the steps it redoes), so every step is logged once."""
    out = tmp_path / "m"
    finetune(tiny_job(out, training__steps=2))  # no checkpoint: the folder may be used again
    earlier = (out / "metrics.jsonl").read_text()
    finetune(tiny_job(out, training__steps=5, checkpoint__every=3))
    kept = list(out.glob("metrics.*.jsonl"))
    assert len(kept) == 1 and kept[0].read_text() == earlier
    assert [r["step"] for r in _step_records(out) if "loss" in r] == [1, 2, 3, 4, 5]
    finetune(tiny_job(out, training__steps=5, checkpoint__resume="auto"))  # from step 3, as after a crash at 5
    records = _step_records(out)
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in records if r.get("final")] == [5]


def test_resume_refuses_other_data_or_batching_settings_naming_each(tiny_job, tmp_path, monkeypatch):
    import json

    out = tmp_path / "ck"
    finetune(tiny_job(out, training__steps=4, checkpoint__every=4))
    with monkeypatch.context() as patch:
        _fail_if_built(patch)
        with pytest.raises(ValueError, match=r"other data or batching settings.*data.max_length: checkpoint 64, this job 48; "
                                             r"training.micro_batch_size: checkpoint 2, this job 3; "
                                             r"training.seed: checkpoint 1234, this job 7\. "):
            finetune(tiny_job(out, training__steps=6, checkpoint__resume="auto", training__micro_batch_size=3,
                              training__seed=7, data__max_length=48))
        with pytest.raises(ValueError, match=r"data.train_path: checkpoint .*train.jsonl', this job .*other.jsonl'"):
            (tmp_path / "other.jsonl").write_text((tmp_path / "train.jsonl").read_text())
            finetune(tiny_job(out, training__steps=6, checkpoint__resume="auto", data__train_path=tmp_path / "other.jsonl"))
        with pytest.raises(ValueError, match="the checkpoint is at step 4, training.steps is 3"):
            finetune(tiny_job(out, training__steps=3, checkpoint__resume="auto"))
    # A checkpoint of an older moetune, which recorded none of these: not held against it.
    state_file = out / "checkpoints" / "step_00000004" / checkpointing.STATE_FILE
    state = json.loads(state_file.read_text())
    assert state["settings"]["training.grad_accum_steps"] == 1
    del state["settings"]
    state_file.write_text(json.dumps(state))
    assert finetune(tiny_job(out, training__steps=5, checkpoint__resume="auto", training__seed=7)).step == 5


def test_lora_resume_compares_only_what_shapes_or_trains_the_adapters(tiny_job, tmp_path, monkeypatch):
    """The export switch and the order of the targets do not change the adapters; the rank does. A
    checkpoint of an older moetune (every field of the lora section, in the order given) still resumes."""
    import json

    out = tmp_path / "lora"
    lora = {"lora__enabled": "true", "lora__rank": 2, "checkpoint__export_final": "false"}
    finetune(tiny_job(out, training__steps=2, checkpoint__every=2, lora__target_modules="q_proj,v_proj", **lora))
    state_file = out / "checkpoints" / "step_00000002" / checkpointing.STATE_FILE
    state = json.loads(state_file.read_text())
    assert state["fingerprint"]["lora"]["target_modules"] == ["q_proj", "v_proj"]
    state["fingerprint"]["lora"] = {"rank": 2, "alpha": 32.0, "dropout": 0.0, "target_modules": ["v_proj", "q_proj"],
                                    "target_experts": True, "enabled": True, "export_merged": True}  # older: no adapter_dtype
    state_file.write_text(json.dumps(state))
    with monkeypatch.context() as patch:
        _fail_if_built(patch)
        with pytest.raises(ValueError, match=r"different model; lora.rank: checkpoint 2, this job 4"):
            finetune(tiny_job(out, training__steps=3, checkpoint__resume="auto",
                              lora__target_modules="v_proj,q_proj", **{**lora, "lora__rank": 4}))
        with pytest.raises(ValueError, match=r"different model; lora: checkpoint True, this job False"):
            finetune(tiny_job(out, training__steps=3, checkpoint__resume="auto"))
    resumed = finetune(tiny_job(out, training__steps=3, checkpoint__resume="auto", lora__export_merged="false",
                                lora__target_modules="v_proj,q_proj", **lora))
    assert resumed.step == 3 and len(resumed.losses) == 1
