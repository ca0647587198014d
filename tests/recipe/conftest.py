"""Shared fixtures: a tiny job on a small slice of the shipped arithmetic data, on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moetune.recipe.config import DEFAULT_ASSETS, JobConfig
from moetune.recipe.config_loading import load_config


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def shipped_rows(name: str, n: int) -> list[dict]:
    lines = (DEFAULT_ASSETS / "data" / name).read_text().splitlines()[:n]
    return [json.loads(line) for line in lines]


@pytest.fixture
def tiny_job(tmp_path: Path):
    """Make a JobConfig for a few fast steps; keyword overrides as dotted keys."""
    train = write_jsonl(tmp_path / "train.jsonl", shipped_rows("train.jsonl", 240))
    test = write_jsonl(tmp_path / "test.jsonl", shipped_rows("test.jsonl", 8))

    def make(output_dir: Path | None = None, **overrides: object) -> JobConfig:
        values = {
            "data.train_path": train, "data.test_path": test, "data.max_length": 64,
            "data.val_fraction": 0.1, "training.steps": 4, "training.micro_batch_size": 2,
            "training.output_dir": output_dir or tmp_path / "out", "training.num_threads": 1,
            "training.val_every": 0, "metrics.log_every": 1, "metrics.progress_bar": False,
            "metrics.plots": False, "checkpoint.export_final": False, "optim.warmup_steps": 2,
        }
        values.update({k.replace("__", "."): v for k, v in overrides.items()})
        return load_config(overrides=[f"{k}={v}" for k, v in values.items()])

    torch.set_num_threads(1)
    return make
