"""Helpers shared by the recipe tests (a module, not conftest, so tests can import them)."""

from __future__ import annotations

import json
import os
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
