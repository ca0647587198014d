"""The measured constants of one GPU type (``calibration/<gpu>.json``), each with the file it comes from.

The files are the only place the planner's numbers live: kernel rates (dense and grouped GEMMs,
attention, Mamba-2's scan), bandwidths (HBM, AdamW, NCCL), and the few fitted constants, each
marked as measured, derived, fitted or an assumption in its ``source``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

CALIBRATION_DIR = Path(__file__).resolve().parent / "calibration"


@dataclass(frozen=True)
class Calibration:
    gpu: str
    constants: dict[str, dict[str, Any]]

    def __getitem__(self, name: str) -> Any:
        if name not in self.constants:
            raise KeyError(f"calibration of {self.gpu} has no constant {name!r}")
        return self.constants[name]["value"]

    def source(self, name: str) -> str:
        return self.constants[name]["source"]

    def with_overrides(self, **values: Any) -> Calibration:
        """A copy with some values replaced (validation scripts, what-if plans)."""
        constants = {name: dict(entry) for name, entry in self.constants.items()}
        for name, value in values.items():
            if name not in constants:
                raise KeyError(f"calibration of {self.gpu} has no constant {name!r}")
            constants[name]["value"] = value
            constants[name]["source"] = "overridden by the caller"
        return Calibration(gpu=self.gpu, constants=constants)


def known_gpus() -> dict[str, Path]:
    """GPU name or alias (lower case) -> its calibration file."""
    found: dict[str, Path] = {}
    for path in sorted(CALIBRATION_DIR.glob("*.json")):
        data = json.loads(path.read_text())
        for name in (path.stem, data["gpu"], *data.get("aliases", ())):
            found[name.lower()] = path
    return found


@cache
def load_calibration(gpu: str) -> Calibration:
    """The calibration of ``gpu`` (``h100``, ``h200``, or a ``torch.cuda.get_device_name`` string)."""
    files = known_gpus()
    path = files.get(gpu.lower())
    if path is None:  # "NVIDIA H100 80GB HBM3" and other spellings of a known card
        path = next((p for name, p in files.items() if name in gpu.lower() and len(name) > 3), None)
    if path is None:
        raise ValueError(f"gpu: no calibration for {gpu!r}; known: {', '.join(sorted({p.stem for p in files.values()}))}")
    data = json.loads(path.read_text())
    return Calibration(gpu=data["gpu"], constants=data["constants"])
