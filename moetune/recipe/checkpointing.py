"""Resumable training checkpoints: written atomically, the last N kept, resumed exactly.

A checkpoint is a directory ``<output_dir>/checkpoints/step_<N>/`` holding
- ``state/``: model and optimizer states through ``torch.distributed.checkpoint`` (each rank
  writes its own shards under FSDP2; plain tensors in one process),
- ``rng_rank<R>.pt``: every random generator of rank R,
- ``train_state.json``: step, data position, model fingerprint; written last.
It is written to ``.tmp_step_<N>`` and renamed, so a crash never leaves a half checkpoint
under a real name. The learning rate is a function of the step and needs no state.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from moetune.recipe.distributed_setup import Runtime, barrier

STATE_FILE = "train_state.json"


@dataclass
class TrainState:
    """What a checkpoint says about the run besides tensors."""

    step: int
    """Optimizer steps completed."""
    data: dict[str, int]
    """The batch stream's position (``BatchStream.state_dict``)."""
    fingerprint: dict[str, Any]
    """Model architecture and shapes, plus the LoRA settings: must match to resume."""
    world_size: int
    """Data-parallel ranks that wrote it (the data order depends on it)."""


def checkpoint_root(output_dir: str) -> Path:
    return Path(output_dir) / "checkpoints"


def save_checkpoint(*, output_dir: str, state: TrainState, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    runtime: Runtime, keep_last: int, rank_tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """Write the checkpoint of ``state.step`` (collective: every rank calls it). ``rank_tensors``:
    this rank's own tensors to keep beside its RNG states (the recipe's expert-load counts)."""
    root = checkpoint_root(output_dir)
    final = root / f"step_{state.step:08d}"
    tmp = root / f".tmp_step_{state.step:08d}"
    if runtime.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(runtime)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with _single_process_quiet(runtime):
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "state"))
    torch.save({**_rng_state(), "tensors": {k: v.cpu() for k, v in (rank_tensors or {}).items()}},
               tmp / f"rng_rank{runtime.rank}.pt")
    barrier(runtime)
    if runtime.is_main:
        (tmp / STATE_FILE).write_text(json.dumps(state.__dict__, indent=1))
        if final.exists():  # a re-run of the same step (e.g. Ctrl-C right after a periodic save)
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in list_checkpoints(output_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    barrier(runtime)
    return final


def list_checkpoints(output_dir: str) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step_*") if (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


def resolve_resume(resume: str, *, output_dir: str) -> Path | None:
    """``checkpoint.resume`` -> the checkpoint directory to load, or None."""
    if not resume:
        return None
    if resume == "auto":
        found = list_checkpoints(output_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        raise ValueError(f"checkpoint.resume: {path} is not a complete checkpoint (no {STATE_FILE})")
    return path


def read_train_state(path: Path) -> TrainState:
    """The step, data position and fingerprint of the checkpoint at ``path`` (no tensors read)."""
    return TrainState(**json.loads((path / STATE_FILE).read_text()))


def fingerprint_differences(checkpoint: dict[str, Any], job: dict[str, Any]) -> list[str]:
    """``key: checkpoint X, this job Y`` for each fingerprint key that differs. A key only this job
    has is not compared: an older moetune wrote the checkpoint and did not record it (its tensors'
    shapes are still checked when they load)."""
    return [f"{key}: checkpoint {checkpoint.get(key)!r}, this job {job.get(key)!r}"
            for key in sorted(checkpoint.keys() | job.keys())
            if key in checkpoint and checkpoint[key] != job.get(key)]


def load_checkpoint(path: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, runtime: Runtime,
                    fingerprint: dict[str, Any]) -> tuple[TrainState, dict[str, torch.Tensor]]:
    """Load ``path`` into model and optimizer in place, restore the RNGs; return its TrainState and
    this rank's ``rank_tensors`` (on the CPU).

    Refuses a checkpoint of another model (or other LoRA settings, or world size), saying what
    differs, before touching any tensor."""
    state = read_train_state(path)
    differences = fingerprint_differences(state.fingerprint, fingerprint)
    if differences:
        raise ValueError(f"checkpoint.resume: {path} was written for a different model; "
                         + "; ".join(differences))
    if state.world_size != runtime.world_size:
        raise ValueError(f"checkpoint.resume: {path} was written by {state.world_size} ranks, this job has "
                         f"{runtime.world_size}; the data order would differ, so the resume would not be exact")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    both = {"model": model_sd, "optim": optim_sd}
    with _single_process_quiet(runtime):
        dcp.load(both, checkpoint_id=str(path / "state"))
    set_state_dict(model, optimizer, model_state_dict=both["model"], optim_state_dict=both["optim"])
    # weights_only: tensors, tuples and ints (the RNG states) load; nothing else is unpickled.
    rank_state = torch.load(path / f"rng_rank{runtime.rank}.pt", weights_only=True)
    _set_rng_state(rank_state)
    return state, rank_state.get("tensors", {})


@contextlib.contextmanager
def _single_process_quiet(runtime: Runtime) -> Iterator[None]:
    """DCP warns that it runs without a process group; in one process that is the intent."""
    with warnings.catch_warnings():
        if not runtime.distributed:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
