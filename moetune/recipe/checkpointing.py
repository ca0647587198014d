"""Resumable training checkpoints: written atomically, the last N kept, resumed exactly.

A checkpoint is a directory ``<output_dir>/checkpoints/step_<N>/`` holding
- ``state/``: model and optimizer states through ``torch.distributed.checkpoint`` (each rank
  writes its own shards under FSDP2; plain tensors in one process),
- ``rng_rank<R>.pt``: every random generator of rank R,
- ``train_state.json``: step, data position, data settings, model fingerprint; written last.
It is written to ``.tmp_step_<N>`` and renamed, so a crash never leaves a half checkpoint
under a real name; a write that fails (a full disk) removes its temporary folder and names the file,
and the next run in the folder removes what a killed one left. Reading unpickles nothing but DCP's
own metadata records and plain values (``moetune.distributed.dcp_files``). The learning rate is a
function of the step and needs no state. One ``output_dir`` holds one run's history
(``check_output_dir``).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pickle
import random
import shutil
import warnings
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from moetune.distributed.dcp_files import CheckpointFileError, check_dcp_folder, load_dcp, save_dcp
from moetune.lora import LoraSettings
from moetune.recipe.distributed_setup import Runtime, all_reduce_sum, barrier
from moetune.utils.file_errors import naming_file, os_error_in
from moetune.utils.json_files import read_json

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
    settings: dict[str, Any] = field(default_factory=dict)
    """The data and batching settings the data position depends on (``train.resume_settings``), by
    dotted config key; empty in checkpoints of older moetune versions."""


def checkpoint_root(output_dir: str) -> Path:
    return Path(output_dir) / "checkpoints"


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (a full disk, a lost filesystem); the partial one is removed."""


def save_checkpoint(*, output_dir: str, state: TrainState, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    runtime: Runtime, keep_last: int, rank_tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """Write the checkpoint of ``state.step`` (collective: every rank calls it). ``rank_tensors``:
    this rank's own tensors to keep beside its RNG states (the recipe's expert-load counts).

    A write that fails on any rank (no space left, an I/O error) removes the temporary folder and
    raises ``CheckpointWriteError`` on every rank, naming the file and the last good checkpoint,
    which is kept (older ones are pruned only after a checkpoint is complete)."""
    root = checkpoint_root(output_dir)
    final = root / f"step_{state.step:08d}"
    tmp = root / f".tmp_step_{state.step:08d}"

    def prepare() -> None:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)

    def write_shards() -> None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        with _single_process_quiet(runtime):
            save_dcp({"model": model_sd, "optim": optim_sd}, tmp / "state")
        # Through a Python file: its OSError (ENOSPC) survives, where torch's own file writer loses it.
        rng_path = tmp / f"rng_rank{runtime.rank}.pt"
        with naming_file(rng_path), rng_path.open("wb") as file:
            torch.save({**_rng_state(), "tensors": {k: v.cpu() for k, v in (rank_tensors or {}).items()}}, file)

    def finish() -> None:
        with naming_file(tmp / STATE_FILE):
            (tmp / STATE_FILE).write_text(json.dumps(state.__dict__, indent=1))

    _written_on_every_rank(prepare, runtime, tmp, output_dir, only_main=True)
    _written_on_every_rank(write_shards, runtime, tmp, output_dir)
    _written_on_every_rank(finish, runtime, tmp, output_dir, only_main=True)
    if runtime.is_main:
        if final.exists():  # a re-run of the same step (e.g. Ctrl-C right after a periodic save)
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in list_checkpoints(output_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    barrier(runtime)
    return final


def _written_on_every_rank(write: Callable[[], None], runtime: Runtime, tmp: Path, output_dir: str, *,
                           only_main: bool = False) -> None:
    """Run ``write`` (on rank 0 only with ``only_main``); when it fails on any rank, remove ``tmp``
    and raise ``CheckpointWriteError`` on every rank (the others would wait at the next barrier)."""
    error: BaseException | None = None
    if runtime.is_main or not only_main:
        try:
            write()
        except (OSError, RuntimeError) as err:
            error = err
    failed = all_reduce_sum([float(error is not None)], runtime)[0]
    if not failed:
        return
    if runtime.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    barrier(runtime)
    last = list_checkpoints(output_dir)
    kept = f"the last good checkpoint is {last[-1]}" if last else "no checkpoint was written yet"
    what = _write_failure(error, tmp) if error is not None else f"another rank failed to write its part of {tmp}"
    raise CheckpointWriteError(f"checkpoint not saved: {what}. The partial {tmp.name} was removed; {kept}") from error


def _write_failure(error: BaseException, tmp: Path) -> str:
    """What went wrong, in words: "no space left on device while writing <file>" for a full disk."""
    cause = os_error_in(error)
    where = getattr(cause, "filename", None) or tmp
    if isinstance(cause, OSError) and cause.errno == errno.ENOSPC:
        return f"no space left on device while writing {where}"
    if isinstance(cause, OSError) and cause.errno == errno.EDQUOT:
        return f"disk quota exceeded while writing {where}"
    if isinstance(cause, OSError):
        return f"{cause.strerror or cause} while writing {where}"
    return f"{type(error).__name__} while writing {tmp}: {error}"


def remove_partial_checkpoints(output_dir: str) -> list[Path]:
    """Remove the temporary folders of checkpoints that a killed run did not finish (kill -9, a lost
    node): never complete, never resumed. Called by the run that holds the folder, before it writes."""
    root = checkpoint_root(output_dir)
    partial = sorted(root.glob(".tmp_step_*")) if root.is_dir() else []
    for path in partial:
        shutil.rmtree(path, ignore_errors=True)
    return partial


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
    if not path.exists():
        raise ValueError(f"checkpoint.resume: {path} does not exist")
    if not (path / STATE_FILE).is_file():
        found = list_checkpoints(str(path))
        hint = (f"; it is a run's output folder, whose latest checkpoint is {found[-1]} (or resume it with "
                f"--checkpoint.resume auto --training.output_dir {path})") if found else ""
        raise ValueError(f"checkpoint.resume: {path} is not a complete checkpoint (no {STATE_FILE}){hint}")
    return path


def check_output_dir(output_dir: str, *, resume: Path | None) -> None:
    """Refuse to put a run's checkpoints beside another history's in ``output_dir``: keep-last would
    delete some of them and ``checkpoint.resume auto`` would later pick the newest, whichever run
    wrote it. A fresh run needs a folder without checkpoints; a resume, a folder whose checkpoints are
    its own past: none newer than the one it resumes, none at all when it resumes from elsewhere."""
    found = list_checkpoints(output_dir)
    if not found:
        return
    root = checkpoint_root(output_dir)
    names = ", ".join(p.name for p in found)
    if resume is None:
        raise ValueError(
            f"training.output_dir: {root} already holds checkpoints ({names}) of an earlier run, which this new run "
            "would mix with or delete. Resume that run with --checkpoint.resume auto, or choose another "
            "training.output_dir (or move that folder away)")
    if resume.resolve().parent != root.resolve():
        raise ValueError(
            f"checkpoint.resume: {resume} is not one of the checkpoints in {root} ({names}), which belong to "
            "another run and would be mixed with this one's; resume into another training.output_dir")
    step = read_train_state(resume).step
    newer = [p.name for p in found if int(p.name.split("_")[1]) > step]
    if newer:
        raise ValueError(
            f"checkpoint.resume: {resume} is older than {', '.join(newer)} in the same folder; going on from it "
            f"there would mix two histories in {root} (its steps would replace or sit beside the newer ones, and "
            "--checkpoint.resume auto would pick the newest). Resume from it into another training.output_dir")


def read_train_state(path: Path) -> TrainState:
    """The step, data position and fingerprint of the checkpoint at ``path`` (no tensors read)."""
    state_file = path / STATE_FILE
    data = read_json(state_file)
    names = {f.name for f in fields(TrainState)}
    required = {f.name for f in fields(TrainState) if f.default is MISSING and f.default_factory is MISSING}
    if not isinstance(data, dict) or not required <= data.keys() or not data.keys() <= names:
        got = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{state_file} is not a checkpoint's train state (expected the keys {sorted(names)}, got {got})")
    return TrainState(**data)


def check_files(path: Path, state: TrainState) -> None:
    """That the checkpoint at ``path`` holds every file it needs, none truncated, and that its DCP
    metadata is made of DCP's own records only (read without running code): refused here, before
    any data is read or model built, rather than halfway through loading it."""
    try:
        check_dcp_folder(path / "state")
    except CheckpointFileError as err:
        raise ValueError(f"checkpoint.resume: {err}") from None
    missing = [name for name in (f"rng_rank{rank}.pt" for rank in range(state.world_size)) if not (path / name).is_file()]
    if missing:
        raise ValueError(f"checkpoint.resume: {path} lacks {', '.join(missing)}; it is incomplete")


def lora_fingerprint(lora: LoraSettings | None) -> dict[str, Any] | None:
    """What a resume compares of the LoRA settings: those of ``moetune.lora.LoraSettings`` (they shape
    or train the adapters), the targets as a set; not the recipe's switches (``lora.export_merged``)."""
    if lora is None:
        return None
    settings = {f.name: getattr(lora, f.name) for f in fields(LoraSettings)}
    settings["target_modules"] = sorted(set(settings["target_modules"]))
    return settings


def _comparable(fingerprint: dict[str, Any]) -> dict[str, Any]:
    """The fingerprint with its LoRA settings as flat ``lora.<name>`` keys, each compared on its own:
    older checkpoints stored every field of the recipe's lora section (switches included, targets in
    the order given), and a setting one of them did not record is not held against it."""
    if "lora" not in fingerprint:
        return fingerprint
    out = {k: v for k, v in fingerprint.items() if k != "lora"}
    lora = fingerprint["lora"]
    out["lora"] = lora is not None  # on or off
    for f in fields(LoraSettings):
        if lora is not None and f.name in lora:
            value = lora[f.name]
            out[f"lora.{f.name}"] = sorted(set(value)) if f.name == "target_modules" else value
    return out


def fingerprint_differences(checkpoint: dict[str, Any], job: dict[str, Any]) -> list[str]:
    """``key: checkpoint X, this job Y`` for each fingerprint key that differs. A key only this job
    has is not compared: an older moetune wrote the checkpoint and did not record it (its tensors'
    shapes are still checked when they load)."""
    checkpoint, job = _comparable(checkpoint), _comparable(job)
    return [f"{key}: checkpoint {checkpoint.get(key)!r}, this job {job.get(key)!r}"
            for key in sorted(checkpoint.keys() | job.keys())
            if key in checkpoint and checkpoint[key] != job.get(key)]


def check_compatible(path: Path, state: TrainState, *, fingerprint: dict[str, Any], world_size: int) -> None:
    """Refuse the checkpoint at ``path`` (its ``state``) for another model (or other LoRA settings) or
    another number of ranks, saying what differs."""
    differences = fingerprint_differences(state.fingerprint, fingerprint)
    if differences:
        raise ValueError(f"checkpoint.resume: {path} was written for a different model; "
                         + "; ".join(differences))
    if state.world_size != world_size:
        raise ValueError(f"checkpoint.resume: {path} was written by {state.world_size} ranks, this job has "
                         f"{world_size}; the data order would differ, so the resume would not be exact")


def load_checkpoint(path: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, runtime: Runtime,
                    fingerprint: dict[str, Any]) -> tuple[TrainState, dict[str, torch.Tensor]]:
    """Load ``path`` into model and optimizer in place, restore the RNGs; return its TrainState and
    this rank's ``rank_tensors`` (on the CPU).

    Refuses a checkpoint of another model (or other LoRA settings, or world size), saying what
    differs, before touching any tensor."""
    state = read_train_state(path)
    check_compatible(path, state, fingerprint=fingerprint, world_size=runtime.world_size)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    both = {"model": model_sd, "optim": optim_sd}
    try:
        with _single_process_quiet(runtime):
            load_dcp(both, path / "state")  # DCP's metadata and values without unpickling code
    except CheckpointFileError as err:
        raise ValueError(f"checkpoint.resume: {err}") from None
    set_state_dict(model, optimizer, model_state_dict=both["model"], optim_state_dict=both["optim"])
    # weights_only: tensors, tuples and ints (the RNG states) load; nothing else is unpickled.
    rng_file = path / f"rng_rank{runtime.rank}.pt"
    try:
        rank_state = torch.load(rng_file, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as err:
        raise ValueError(f"{rng_file} cannot be read ({type(err).__name__}: {str(err).splitlines()[0]}); it is damaged, "
                         "truncated or not a moetune checkpoint's RNG state") from None
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
