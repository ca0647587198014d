"""Helpers shared by the recipe tests (a module, not conftest, so tests can import them)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from moetune.recipe.config import DEFAULT_ASSETS

REPO = Path(__file__).resolve().parents[2]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def shipped_rows(name: str, n: int) -> list[dict]:
    lines = (DEFAULT_ASSETS / "data" / name).read_text().splitlines()[:n]
    return [json.loads(line) for line in lines]


def short_job_args(tmp_path: Path, out: Path) -> list[str]:
    """``moetune finetune`` overrides that shorten the embedded default job for the multi-process
    tests: 120 training rows of 64 tokens, one row per process and step, 4 held-out prompts, no
    validation before the end, no progress bar or plots; the output in ``out``."""
    train = write_jsonl(tmp_path / "train.jsonl", shipped_rows("train.jsonl", 120))
    test = write_jsonl(tmp_path / "test.jsonl", shipped_rows("test.jsonl", 4))
    return ["--data.train_path", str(train), "--data.test_path", str(test), "--data.max_length", "64",
            "--training.micro_batch_size", "1", "--training.output_dir", str(out), "--training.num_threads", "1",
            "--metrics.progress_bar", "false", "--metrics.log_every", "1", "--metrics.plots", "false",
            "--training.val_every", "0", "--optim.warmup_steps", "2"]


def subprocess_env() -> dict[str, str]:
    """The environment of a ``moetune`` subprocess: this checkout first on the path, one thread."""
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def losses(records: list[dict]) -> dict[int, float]:
    """The training loss by step, from metrics.jsonl's records."""
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


def run_concurrently(commands: list[list[str]], logs: list[Path], *, env: dict[str, str],
                     grace_s: float = 20.0, timeout_s: float = 150.0) -> list[int]:
    """Start ``commands`` at once (stdout and stderr to ``logs``), wait for all; returns their exit
    codes. When one fails the others get ``grace_s`` to follow; then, or after ``timeout_s``, every
    process still running below each command is killed."""
    procs = []
    try:
        for cmd, log in zip(commands, logs):
            with log.open("w") as out:
                procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                              start_new_session=True))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and None in (codes := [p.poll() for p in procs]):
            if any(code not in (None, 0) for code in codes):
                deadline = min(deadline, time.monotonic() + grace_s)
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                for pid in process_tree(p.pid):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            p.wait()
    return [p.returncode for p in procs]
