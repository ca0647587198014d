"""``moetune bench --config tiny`` end to end on CPU: both sides, both routings, parity, JSON + chart."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch

from moetune.bench.cli import main
from moetune.bench.report import summarize

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def test_bench_tiny_end_to_end(tmp_path, capsys):
    code = main(
        [
            "--config", "tiny", "--layers", "2", "--seq-len", "32", "--steps", "2", "--warmup", "1",
            "--device", "cpu", "--out", str(tmp_path),
        ]
    )
    assert code == 0
    [path] = tmp_path.glob("tiny-2l_cpu_*.json")
    data = json.loads(path.read_text())
    assert data["versions"]["torch"] and data["versions"]["transformers"] and "commit" in data["commit"]
    assert data["model_config"]["num_hidden_layers"] == 2
    assert {(r["side"], r["routing"]) for r in data["rows"]} == {
        ("hf", "real"), ("hf", "balanced"), ("moetune", "real"), ("moetune", "balanced")
    }
    for row in data["rows"]:
        assert row["error"] is None and row["tokens_per_s_per_gpu"] > 0 and len(row["losses"]) == 2
        assert row["tflops_per_gpu"] == row["tokens_per_s_per_gpu"] * data["flops_per_token"] / 1e12
    losses = {r["side"]: r["losses"] for r in data["rows"] if r["routing"] == "real"}
    assert abs(losses["hf"][0] - losses["moetune"][0]) < 0.05  # same weights, tokens and optimizer
    assert len(data["comparison"]) == 2 and all(c["speedup"] > 0 for c in data["comparison"])
    assert path.with_suffix(".png").is_file() == HAS_MATPLOTLIB
    assert "speed-up" in capsys.readouterr().out
    assert "tiny-2l" in summarize([str(path)])


@pytest.mark.parametrize("moetune_optimizer", ["torch", "moetune"])
def test_max_grad_norm_clips_both_sides_before_each_update(tmp_path, moetune_optimizer):
    """Clipped to a norm far below AdamW's epsilon, the update all but vanishes on both sides: the
    second step's loss (same tokens) equals the first; unclipped, the step moves it."""
    losses = {}
    for clip in (None, "1e-12"):
        out = tmp_path / str(clip)
        flags = ["--max-grad-norm", clip] if clip else []
        code = main(["--config", "tiny", "--layers", "2", "--seq-len", "32", "--steps", "2", "--warmup", "0",
                     "--routing", "real", "--lr", "1e-2", "--moetune-optimizer", moetune_optimizer, "--device", "cpu",
                     "--no-chart", "--out", str(out), *flags])  # fmt: skip
        assert code == 0
        [path] = out.glob("*.json")
        data = json.loads(path.read_text())
        assert data["config"]["max_grad_norm"] == (float(clip) if clip else None)
        assert path.name.startswith("tiny-2l-clip1e-12_" if clip else "tiny-2l_")
        losses[clip] = {row["side"]: row["losses"] for row in data["rows"]}
    for side in ("hf", "moetune"):
        first, second = losses["1e-12"][side]
        assert second == pytest.approx(first, rel=1e-5)
        first, second = losses[None][side]
        assert abs(second - first) > 1e-3


def test_autocast_runs_both_sides_forwards_under_autocast(tmp_path, monkeypatch):
    """Trainer's bf16=True runs the forward under torch.autocast: the bench's like-for-like setting."""
    import moetune.bench.models as models

    seen = []
    loss = models.BenchModel.loss
    monkeypatch.setattr(models.BenchModel, "loss", lambda self, ids: seen.append(torch.is_autocast_enabled("cpu")) or loss(self, ids))
    code = main(["--config", "tiny", "--layers", "2", "--seq-len", "32", "--steps", "1", "--warmup", "0", "--routing", "real",
                 "--autocast", "--max-grad-norm", "1", "--device", "cpu", "--no-chart", "--out", str(tmp_path)])  # fmt: skip
    assert code == 0
    [path] = tmp_path.glob("tiny-2l-clip1-autocast_cpu_*.json")
    data = json.loads(path.read_text())
    assert data["config"]["autocast"] is True and seen == [True, True]
    assert all(row["error"] is None and all(map(math.isfinite, row["losses"])) for row in data["rows"])


def test_parity_only_passes_on_tiny(tmp_path, capsys):
    code = main(["--config", "tiny", "--parity-only", "--parity-layers", "2", "--parity-seq-len", "32",
                 "--device", "cpu", "--out", str(tmp_path)])
    assert code == 0
    [path] = tmp_path.glob("tiny-2l-parity_cpu_*.json")
    parity = json.loads(path.read_text())["parity"]
    assert parity["passed"] and set(parity["checks"]) == {"loss", "logits", "grads"}
    for side in ("hf", "moetune"):
        assert parity["errors"][side]["grads_missing_or_extra"] == []
        assert 0 < parity["errors"][side]["logits"] < 0.05  # bf16 vs fp32: small but not zero
    assert "parity vs fp32" in capsys.readouterr().out


def test_a_failing_side_is_reported_not_fatal(tmp_path, monkeypatch):
    from moetune.bench import cli

    def broken(side, config, **kwargs):
        raise RuntimeError("no such backend")

    monkeypatch.setattr(cli, "build_side", broken)
    code = main(["--config", "tiny", "--layers", "1", "--seq-len", "16", "--steps", "1", "--warmup", "0",
                 "--device", "cpu", "--routing", "balanced", "--sides", "moetune", "--out", str(tmp_path / "r.json")])
    assert code == 1
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["rows"][0]["error"].startswith("build failed: RuntimeError: no such backend")


def test_moetune_compile_compiles_each_decoder_layer(tmp_path, monkeypatch):
    """--moetune-compile: every decoder layer goes through torch.compile (the eager backend here:
    the CPU suite does not generate inductor code), and the run is recorded as compiled."""
    import torch

    compiled = []
    real_compile = torch.nn.Module.compile

    def compile_eagerly(self, *args, **kwargs):
        compiled.append(type(self).__name__)
        return real_compile(self, backend="eager")

    monkeypatch.setattr(torch.nn.Module, "compile", compile_eagerly)
    code = main(["--config", "tiny", "--layers", "2", "--seq-len", "16", "--steps", "1", "--warmup", "1",
                 "--device", "cpu", "--routing", "real", "--sides", "moetune", "--moetune-compile",
                 "--out", str(tmp_path / "r.json")])  # fmt: skip
    assert code == 0
    assert len(compiled) == 2 and all(name.endswith("DecoderLayer") for name in compiled), compiled
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["config"]["moetune_compile"] is True and data["rows"][0].get("error") is None


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss", "nemotron_h"])
def test_bench_runs_every_moetune_family(tmp_path, family):
    """Both sides, both routings (Transformers' router patched for the balanced gate), the same
    first loss, on a tiny config of each family written as a config.json."""
    from tests.test_deepseek_v3_parity import tiny_deepseek_v3_config
    from tests.test_gpt_oss_parity import tiny_gpt_oss_config
    from tests.test_nemotron_h_parity import tiny_nemotron_h_config

    config = {
        "deepseek_v3": tiny_deepseek_v3_config, "gpt_oss": tiny_gpt_oss_config, "nemotron_h": tiny_nemotron_h_config,
    }[family](vocab_size=512)  # fmt: skip
    folder = tmp_path / family
    config.save_pretrained(folder)
    code = main(["--config", str(folder), "--seq-len", "16", "--steps", "1", "--warmup", "1", "--device", "cpu",
                 "--out", str(tmp_path / "out"), "--no-chart"])  # fmt: skip
    [path] = (tmp_path / "out").glob("*.json")
    data = json.loads(path.read_text())
    rows = {(r["side"], r["routing"]): r for r in data["rows"]}
    routings = ["real", "balanced"]
    hf_balanced_error = rows[("hf", "balanced")]["error"]
    if hf_balanced_error is not None:  # older Transformers route outside the router class
        assert "returns logits only" in hf_balanced_error and code == 1
        routings = ["real"]
    else:
        assert code == 0
    for routing in routings:
        hf, ours = rows[("hf", routing)], rows[("moetune", routing)]
        assert hf["error"] is None and ours["error"] is None, routing
        assert abs(hf["losses"][0] - ours["losses"][0]) < 0.05, routing


def test_lora_bench_gives_both_sides_the_same_adapters(tmp_path):
    """``--lora-rank``: PEFT on Transformers' side, moetune.lora on moetune's, the same trainable
    parameters and adapter values (equal first losses, which the non-zero adapters change), and the
    FLOPs of a frozen-weight step."""
    from moetune.bench.models import load_config
    from moetune.flops import training_flops_per_token

    code = main(["--config", "tiny", "--layers", "2", "--seq-len", "32", "--steps", "2", "--warmup", "1",
                 "--device", "cpu", "--routing", "real", "--lora-rank", "4", "--out", str(tmp_path), "--no-chart"])
    assert code == 0
    [path] = tmp_path.glob("tiny-2l_cpu_*.json")
    data = json.loads(path.read_text())
    assert data["config"]["lora"]["rank"] == 4 and data["config"]["lora"]["alpha"] == 8.0
    built = data["built"]
    assert built["hf"]["lora"].startswith("peft") and built["moetune"]["lora"].startswith("moetune.lora")
    assert built["hf"]["trainable_parameters"] == built["moetune"]["trainable_parameters"] > 0
    losses = {r["side"]: r["losses"] for r in data["rows"]}
    assert abs(losses["hf"][0] - losses["moetune"][0]) < 0.02
    _, config = load_config("tiny", layers=2)
    full = training_flops_per_token(config, seq_len=32)
    assert full * 2 / 3 < data["flops_per_token"] < full

    # Without the adapters' values the first loss would be the base model's.
    base = main(["--config", "tiny", "--layers", "2", "--seq-len", "32", "--steps", "1", "--warmup", "0",
                 "--device", "cpu", "--routing", "real", "--sides", "moetune", "--out", str(tmp_path / "base"),
                 "--no-chart"])
    assert base == 0
    [base_path] = (tmp_path / "base").glob("*.json")
    base_loss = json.loads(base_path.read_text())["rows"][0]["losses"][0]
    assert abs(base_loss - losses["moetune"][0]) > 1e-4


def test_lora_bench_with_peft_on_the_moetune_side(tmp_path):
    """``--moetune-lora peft``: PEFT's get_peft_model on moetune's model, the same adapters as Transformers'."""
    code = main(["--config", "tiny", "--layers", "2", "--seq-len", "32", "--steps", "1", "--warmup", "1",
                 "--device", "cpu", "--routing", "real", "--lora-rank", "4", "--moetune-lora", "peft",
                 "--out", str(tmp_path), "--no-chart"])  # fmt: skip
    assert code == 0
    [path] = tmp_path.glob("*.json")
    data = json.loads(path.read_text())
    assert data["config"]["lora"]["moetune_side"] == "peft"
    built = data["built"]
    assert built["moetune"]["lora"].startswith("peft") and built["moetune"]["class"].startswith("moetune.")
    assert built["hf"]["trainable_parameters"] == built["moetune"]["trainable_parameters"]
    losses = {r["side"]: r["losses"][0] for r in data["rows"]}
    assert abs(losses["hf"] - losses["moetune"]) < 0.02


def test_lora_bench_refuses_what_it_cannot_run(tmp_path):
    with pytest.raises(SystemExit, match="lora-rank must be >= 0"):
        main(["--config", "tiny", "--device", "cpu", "--lora-rank", "-1"])
    with pytest.raises(SystemExit, match="drop --probe-max-seq"):
        main(["--config", "tiny", "--device", "cpu", "--lora-rank", "4", "--probe-max-seq"])


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss", "nemotron_h"])
def test_lora_bench_runs_every_moetune_family(tmp_path, family):
    """``--lora-rank`` on each family's attention projections (DeepSeek-V3's latent ones included) and
    experts: the same trainable parameters and first loss on both sides."""
    from tests.test_deepseek_v3_parity import tiny_deepseek_v3_config
    from tests.test_gpt_oss_parity import tiny_gpt_oss_config
    from tests.test_nemotron_h_parity import tiny_nemotron_h_config

    config = {
        "deepseek_v3": tiny_deepseek_v3_config, "gpt_oss": tiny_gpt_oss_config, "nemotron_h": tiny_nemotron_h_config,
    }[family](vocab_size=512)  # fmt: skip
    config.save_pretrained(tmp_path / family)
    code = main(["--config", str(tmp_path / family), "--seq-len", "16", "--steps", "1", "--warmup", "1", "--device", "cpu",
                 "--routing", "real", "--lora-rank", "4", "--out", str(tmp_path / "out"), "--no-chart"])  # fmt: skip
    assert code == 0
    [path] = (tmp_path / "out").glob("*.json")
    data = json.loads(path.read_text())
    assert data["config"]["lora"]["target_modules"]
    assert data["built"]["hf"]["trainable_parameters"] == data["built"]["moetune"]["trainable_parameters"]
    losses = {r["side"]: r["losses"][0] for r in data["rows"]}
    assert abs(losses["hf"] - losses["moetune"]) < 0.02


def test_the_commit_named_by_the_caller_wins_over_git(monkeypatch):
    """A copied tree's .git can be stale (the GPU machines'): $MOETUNE_COMMIT names what was sent."""
    from moetune.bench.env import commit

    monkeypatch.setenv("MOETUNE_COMMIT", "abc1234")
    assert commit() == {"commit": "abc1234", "dirty": None, "source": "MOETUNE_COMMIT"}
    monkeypatch.delenv("MOETUNE_COMMIT")
    assert commit()["source"] in ("git", None)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--warmup", "-1"], "--warmup must be >= 0"),
        (["--micro-batch", "1", "0"], "--micro-batch must be >= 1"),
        (["--seq-len", "1"], "--seq-len must be >= 2"),
        (["--layers", "0"], "--layers must be >= 1"),
        (["--probe-max-seq", "--probe-step", "0"], "--probe-step must be >= 1"),
        (["--config", "no_such_model"], "neither a shipped config"),
        (["--device", "gpu0"], "--device must be auto, cpu, cuda or cuda:N"),
        (["--summarize", "no_such_result.json"], "no such result file"),
        (["--max-grad-norm", "0"], "--max-grad-norm must be > 0"),
    ],
)
def test_bad_flags_stop_with_a_usage_error_before_building(tmp_path, capsys, monkeypatch, flags, message):
    """Not a traceback, nor rows that fail after both sides were built (exit status 0 or 1)."""
    from moetune.bench import cli

    monkeypatch.setattr(cli, "build_side", lambda *args, **kwargs: pytest.fail("built a side"))
    with pytest.raises(SystemExit) as exited:
        main(["--config", "tiny", "--device", "cpu", "--out", str(tmp_path), *flags])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
