"""The user scripts (benchmarks/user_scripts) run with both imports on a tiny fp32 model on the CPU,
through the side-by-side driver: every script finishes on both sides, their losses agree, and the
result JSON has what the GPU runs report."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="TRL is a test extra")
pytest.importorskip("datasets", reason="datasets is a test extra")
pytest.importorskip("peft", reason="PEFT is a test extra")

SCRIPTS_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "user_scripts"


@pytest.fixture(scope="module")
def compare():
    sys.path.insert(0, str(SCRIPTS_DIR))
    try:
        import compare as module

        yield module
    finally:
        sys.path.remove(str(SCRIPTS_DIR))


@pytest.fixture
def padded_plans(monkeypatch):
    """moetune's decoder stacks take every batch through the bucket padding of the CUDA-graph path,
    run eagerly (the CPU has no graphs): the padding under Transformers' and TRL's real collators.
    Yields the plans made (None where a batch kept its own path)."""
    from moetune.models import causal_lm
    from moetune.training import graphed_backbone

    plans = []
    real_plan = graphed_backbone.plan_batch

    def plan_batch(*args, **kwargs):
        plans.append(real_plan(*args, **kwargs))
        return plans[-1]

    def eager_padded(backbone):
        if "_training_graphs" not in backbone.__dict__:
            backbone.__dict__["_training_graphs"] = graphed_backbone.TrainingGraphs(backbone, use_graphs=False)
        return backbone.__dict__["_training_graphs"]

    monkeypatch.setattr(graphed_backbone, "plan_batch", plan_batch)
    monkeypatch.setattr(causal_lm, "training_graphs", eager_padded)
    return plans


def test_every_script_trains_alike_with_both_imports(compare, tmp_path, padded_plans):
    scripts = ["trainer_rows", "sft_padded", "sft_packing", "sft_padding_free", "sft_lora", "trainer_rows_moetune_trainer",
               "trainer_rows_non_blocking"]
    argv = ["--cpu", "--in-process", "--layers", "2", "--max-steps", "3", "--warmup-steps", "1", "--seq-len", "48",
            "--chat-lengths", "6,40", "--num-chat", "24", "--out", str(tmp_path), "--scripts", ",".join(scripts),
            "--extra=--lora-rank=4"]  # fmt: skip
    assert compare.main(argv) == 0
    report = json.loads(next(tmp_path.glob("user_scripts_*.json")).read_text())
    assert {"date", "gpu", "versions", "commit", "settings", "checkpoint"} <= report.keys()
    assert report["versions"]["trl"] and report["checkpoint"]["layers"] == 2
    for name in scripts:
        entry = report["scripts"][name]
        sides = entry["sides"]
        if name == "trainer_rows_moetune_trainer":  # only moetune's side; the Transformers side is script 1's
            assert entry["baseline"] == "trainer_rows" and set(sides) == {"moetune"}
            sides = {**sides, "transformers": report["scripts"]["trainer_rows"]["sides"]["transformers"]}
        for side in ("transformers", "moetune"):
            result = sides[side]
            assert "error" not in result, (name, side, result.get("error"))
            assert result["steps"] == 3 and len(result["losses"]) == 3 and all(t > 0 for t in result["tokens"])
            assert result["tokens_per_s_median"] > 0 and result["settings"]["import_from"] == side
            assert result["peak_memory_gib"] is None  # the CPU has no allocator statistics
            # Every phase of every step marked (read once after the run, as on a GPU).
            assert all(ms is not None and ms >= 0 for ms in result["phases_ms_median"].values()), result["phases_ms_median"]
        # fp32 on the CPU: the same function, trained the same way
        assert entry["loss_max_rel_diff"] < 1e-4, (name, sides["transformers"]["losses"], sides["moetune"]["losses"])
        assert entry["speedup_median"] > 0
    kinds = {plan.key[0] for plan in padded_plans if plan is not None}
    assert kinds == {"rows", "documents"} and len(padded_plans) >= 6 * 3
    # Every batch the collators made took the graphs' path: TRL's packed rows too, whose position_ids
    # come without the documents' offsets under SDPA.
    assert None not in padded_plans
    padded = report["scripts"]["sft_padded"]["sides"]["moetune"]["tokens"]
    packed = report["scripts"]["sft_padding_free"]["sides"]["moetune"]["tokens"]
    assert max(padded) <= 2 * 40 and max(packed) <= 2 * 40  # real tokens only: pads are not counted


def test_a_profiled_step_is_summarised_and_left_out_of_the_rates(compare, tmp_path):
    """``--profile-step``: that step runs under torch.profiler (on the CPU: the host's span only, no
    GPU kernels), its summary lands in the result, and tokens/s is taken over the other steps."""
    argv = ["--cpu", "--in-process", "--layers", "2", "--max-steps", "4", "--warmup-steps", "1", "--seq-len", "32",
            "--out", str(tmp_path), "--scripts", "trainer_rows", "--sides", "moetune", "--extra=--profile-step=2"]  # fmt: skip
    assert compare.main(argv) == 0
    result = json.loads(next(tmp_path.glob("user_scripts_*.json")).read_text())["scripts"]["trainer_rows"]["sides"]["moetune"]
    assert result["profile"]["host_span_ms"] > 0 and result["profile"]["top_kernels"] == []
    tokens, step_s = result["tokens"], result["step_s"]
    rates = sorted(tokens[i] / step_s[i] for i in (1, 3))  # steps 1 and 3: after the warm-up, not the profiled one
    assert result["tokens_per_s_median"] == pytest.approx((rates[0] + rates[1]) / 2)


def test_a_profile_step_outside_the_measured_steps_is_refused(compare):
    sys.path.insert(0, str(SCRIPTS_DIR))
    try:
        from harness import parse_args
    finally:
        sys.path.remove(str(SCRIPTS_DIR))
    common = ["--import-from", "moetune", "--checkpoint", "c", "--data", "d", "--output-dir", "o", "--result", "r"]
    with pytest.raises(SystemExit):
        parse_args(None, [*common, "--max-steps", "5", "--warmup-steps", "2", "--profile-step", "1"])
    assert parse_args(None, [*common, "--max-steps", "5", "--warmup-steps", "2", "--profile-step", "4"]).profile_step == 4


# Packed rows (scripts 3 and 4) only where Transformers keeps the documents apart on the CPU: its
# GPT-OSS lets packed documents attend to each other (moetune's does not: test_packed_documents.py),
# its Nemotron-H refuses packed rows without the mamba_ssm kernels.
OTHER_FAMILY_SCRIPTS = {
    "deepseek_v3": ["trainer_rows", "sft_packing", "sft_lora"],
    "gpt_oss": ["trainer_rows", "sft_padded"],
    "nemotron_h": ["trainer_rows", "sft_padded"],
}


@pytest.mark.parametrize("family", sorted(OTHER_FAMILY_SCRIPTS))
def test_the_other_families_train_alike_in_the_trainer_and_trl_scripts(compare, tmp_path, padded_plans, family):
    """The user scripts on the parity tests' tiny configs of the other three families: the same
    losses with both imports, and every moetune batch through the graphs' padding."""
    from tests.conftest import tiny_family_config

    config = tiny_family_config(family, vocab_size=512)  # the default tokenizer's ids fit
    config.save_pretrained(tmp_path / "config")
    scripts = OTHER_FAMILY_SCRIPTS[family]
    argv = ["--cpu", "--in-process", "--config", str(tmp_path / "config"), "--layers", "2", "--max-steps", "3",
            "--warmup-steps", "1", "--seq-len", "48", "--chat-lengths", "6,40", "--num-chat", "24",
            "--out", str(tmp_path / "out"), "--scripts", ",".join(scripts), "--extra=--lora-rank=4"]  # fmt: skip
    assert compare.main(argv) == 0
    report = json.loads(next((tmp_path / "out").glob("user_scripts_*.json")).read_text())
    assert report["checkpoint"]["model_type"] == config.model_type
    for name in scripts:
        entry = report["scripts"][name]
        assert all(len(side["losses"]) == 3 for side in entry["sides"].values()), name
        assert entry["loss_max_rel_diff"] < 1e-4, (name, {k: v["losses"] for k, v in entry["sides"].items()})
    assert padded_plans and None not in padded_plans


@pytest.mark.slow  # dynamo traces the whole model on the CPU (no CUDA graphs there): ~1 min on 2 cores
def test_torch_compile_trains_moetunes_model_in_the_trainer(compare, tmp_path):
    """``TrainingArguments(torch_compile=True)`` with moetune's model (dynamo's eager backend: tracing
    only, no code generation on the CPU): the same losses as without."""
    argv = ["--cpu", "--in-process", "--layers", "2", "--max-steps", "2", "--warmup-steps", "1", "--seq-len", "32",
            "--out", str(tmp_path), "--scripts", "trainer_rows,trainer_rows_compile"]  # fmt: skip
    import harness

    real_parse = harness.parse_args

    def parse_with_eager_backend(description, argv=None):
        args = real_parse(description, argv)
        if args.torch_compile:
            args.torch_compile_backend = "eager"
        return args

    harness.parse_args = parse_with_eager_backend
    try:
        assert compare.main(argv) == 0
    finally:
        harness.parse_args = real_parse
    report = json.loads(next(tmp_path.glob("user_scripts_*.json")).read_text())
    compiled = report["scripts"]["trainer_rows_compile"]
    assert compiled["sides"]["moetune"]["settings"]["torch_compile"]
    assert compiled["vs_import_only"]["loss_max_rel_diff"] < 1e-5
