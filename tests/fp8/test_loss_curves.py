"""``benchmarks/fp8_loss_curves.py``: the figures FP8's loss comparison quotes, from runs' metrics files
(the GPU runs that feed it are scarce, so its arithmetic is checked here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import load_benchmark_script


@pytest.fixture(scope="module")
def curves():
    return load_benchmark_script("fp8_loss_curves")


def _metrics(path: Path, losses: list[float], validation: float) -> str:
    lines = [{"step": 0, "sharding": "one process"}]
    lines += [{"step": 10 * (i + 1), "loss": loss} for i, loss in enumerate(losses)]
    lines += [{"step": 10 * len(losses), "val_loss": validation}, {"step": 10 * len(losses), "final": True}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def test_settings_are_summarised_over_their_seeds(curves, tmp_path, capsys):
    runs = {
        "bf16/seed1": ([4.0, 2.0, 1.0, 0.5], 0.6),
        "bf16/seed2": ([4.0, 2.0, 1.0, 1.5], 1.0),
        "fp8/seed1": ([4.0, 2.0, 1.0, 0.8], 0.9),
    }
    argv = [f"{label}={_metrics(tmp_path / (label.replace('/', '_') + '.jsonl'), losses, val)}"
            for label, (losses, val) in runs.items()]  # fmt: skip
    out = tmp_path / "curves.png"
    curves.main([*argv, "--tail", "2", "--out", str(out)])
    printed = capsys.readouterr().out
    settings = curves.summarize({label: curves._read(path.split("=", 1)[1]) for label, path in zip(runs, argv)}, 2)
    # bf16: tails 0.75 and 1.25; fp8: 0.9
    assert settings["bf16"]["tail_mean"] == pytest.approx(1.0) and settings["bf16"]["tail_min"] == pytest.approx(0.75)
    assert settings["bf16"]["validation_max"] == pytest.approx(1.0) and settings["fp8"]["runs"] == 1
    assert "setting fp8: over 1 runs, mean of the last 2 0.9000 (range 0.9000-0.9000; -10.00%)" in printed
    assert "final validation loss 0.9000 (range 0.9000-0.9000; +12.50%)" in printed
    assert out.is_file() or "matplotlib is not installed" in printed
    # fp8/seed1 against bf16/seed1: tail 0.9 / 0.75, validation 0.9 / 0.6
    assert ("setting fp8 against bf16, run by run (same seed), over 1 pairs: mean of the last 2 +20.00% on average "
            "(range +20.00% to +20.00%), final validation loss +50.00% on average") in printed


def test_a_run_without_logged_losses_is_named(curves, tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"step": 0, "sharding": "one process"}) + "\n")
    with pytest.raises(SystemExit):
        curves.main([f"fp8={empty}", "--out", str(tmp_path / "c.png")])
    assert f"no logged training loss in fp8={empty}" in capsys.readouterr().err
