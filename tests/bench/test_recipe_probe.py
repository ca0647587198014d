"""``benchmarks/recipe_probe.py`` end to end on the CPU with the shipped tiny model: every variant
runs as its own `moetune finetune`, the result file holds each one's rate and losses, and a rerun
into the same work folder does not mix the earlier run's metrics in."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _probe(tmp_path: Path, out: Path) -> dict:
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "recipe_probe.py"), "--model-config",
         str(ROOT / "moetune" / "assets" / "default" / "model" / "config.json"), "--layers", "2", "--max-length", "128",
         "--min-chars", "20", "--max-chars", "60", "--steps", "4", "--log-every", "2", "--skip-steps", "0",
         "--variants", "eager,graph", "--work", str(tmp_path / "work"), "--out", str(out)],
        check=True, cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    (result_file,) = out.glob("recipe_*.json")
    return json.loads(result_file.read_text())


def test_recipe_probe_runs_each_variant_in_its_own_process(tmp_path):
    record = _probe(tmp_path, tmp_path / "first")
    eager, graph = record["results"]
    assert [eager["variant"], graph["variant"]] == ["eager", "graph"]
    for result in (eager, graph):
        assert result["returncode"] == 0 and result["tokens_per_s_per_gpu"] > 0 and len(result["windows"]) == 2
    assert graph["losses"] == eager["losses"]  # on CPU the graphed step runs the same code eagerly
    again = _probe(tmp_path, tmp_path / "second")  # same work folder: metrics.jsonl must start empty
    assert len(again["results"][0]["windows"]) == 2


def test_a_terminated_probe_stops_its_run_and_keeps_what_it_logged(tmp_path):
    """An outer ``timeout`` sends the probe SIGTERM: its training run (a process session of its own) must not
    outlive it, holding the GPU through the next variant, and the windows logged so far are kept."""
    work, out = tmp_path / "work", tmp_path / "out"
    probe = subprocess.Popen(
        [sys.executable, str(ROOT / "benchmarks" / "recipe_probe.py"), "--model-config",
         str(ROOT / "moetune" / "assets" / "default" / "model" / "config.json"), "--layers", "2", "--max-length", "128",
         "--min-chars", "20", "--max-chars", "60", "--steps", "1000", "--log-every", "2", "--skip-steps", "0",
         "--variants", "eager", "--timeout", "600", "--work", str(work), "--out", str(out)],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    metrics = work / "eager" / "metrics.jsonl"
    deadline = time.time() + 240
    while not (metrics.is_file() and "tokens_per_s_per_gpu" in metrics.read_text()):
        assert probe.poll() is None and time.time() < deadline, "the run logged no window"
        time.sleep(0.5)
    probe.send_signal(signal.SIGTERM)
    probe.wait(timeout=60)
    left = subprocess.run(["pgrep", "-f", str(work / "eager")], capture_output=True, text=True).stdout.split()
    assert left == [], f"the training run outlived its probe: pids {left}"
    (result_file,) = out.glob("recipe_*.json")
    (result,) = json.loads(result_file.read_text())["results"]
    assert result["returncode"] != 0 and len(result["windows"]) >= 1
