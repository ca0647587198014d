"""Shared fixtures: a tiny job on a small slice of the shipped arithmetic data, on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moetune.recipe.config import JobConfig
from moetune.recipe.config_loading import load_config
from recipe_helpers import shipped_rows, write_jsonl


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

    # One thread, as the job's own training.num_threads, restored afterwards: other tests' fp32
    # tolerances assume the suite's thread count (a different reduction order rounds differently).
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield make
    torch.set_num_threads(threads_before)
