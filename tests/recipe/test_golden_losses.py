"""Golden loss curve of a short deterministic run (CPU, fp32), checked in.

A change to the model, data or training code that moves these numbers must be deliberate:
regenerate with ``MOETUNE_UPDATE_GOLDEN=1 python -m pytest tests/recipe/test_golden_losses.py``
and say why in the commit.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from moetune.recipe.train import finetune

GOLDEN = Path(__file__).with_name("golden_tiny_losses.json")


def test_tiny_job_matches_the_golden_loss_curve(tiny_job, tmp_path):
    result = finetune(tiny_job(tmp_path / "golden", training__steps=8))
    if os.environ.get("MOETUNE_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(json.dumps({"losses": result.losses}, indent=1) + "\n")
    golden = json.loads(GOLDEN.read_text())["losses"]
    assert result.losses == pytest.approx(golden, rel=1e-4)
