"""Checkpoint faults: a full disk while writing one, and damaged or crafted checkpoints on resume. Each
ends in an error that names the file; the last good checkpoint is kept; no code in a checkpoint runs."""

from __future__ import annotations

import builtins
import io
import json
import pickle

import pytest
import torch

from moetune.distributed.dcp_files import METADATA_NAME
from moetune.recipe import checkpointing, train
from moetune.recipe.train import finetune

from recipe_helpers import losses, read_metrics


class CreatesMarker:
    """Unpickled, it creates the file ``path``: what a crafted checkpoint's code could do."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


def _fail_if_built(monkeypatch):
    monkeypatch.setattr(train, "build_model", lambda *a, **k: pytest.fail("the model was built"))


@pytest.mark.parametrize("failing_file", ["__0_0.distcp", "rng_rank0.pt", checkpointing.STATE_FILE])
def test_a_full_disk_while_checkpointing_is_named_and_the_last_good_checkpoint_kept(tiny_job, tmp_path, monkeypatch,
                                                                                   failing_file):
    """The second checkpoint's ``failing_file`` is written to /dev/full, whose every write fails with
    the kernel's ENOSPC (the model and optimizer shards, the RNG states, or the train state written last)."""
    out = tmp_path / "out"
    real_open = io.open

    def disk_full_at_step_4(file, mode="r", *args, **kwargs):
        if any(flag in mode for flag in "wax") and ".tmp_step_00000004" in str(file) and str(file).endswith(failing_file):
            return real_open("/dev/full", mode, *args, **kwargs)
        return real_open(file, mode, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(io, "open", disk_full_at_step_4)
        patch.setattr(builtins, "open", disk_full_at_step_4)
        with pytest.raises(checkpointing.CheckpointWriteError,
                           match=rf"checkpoint not saved: no space left on device while writing "
                                 rf"{out / 'checkpoints' / '.tmp_step_00000004'}/.*{failing_file}\. The partial "
                                 rf".tmp_step_00000004 was removed; the last good checkpoint is .*step_00000002"):
            finetune(tiny_job(out, training__steps=6, checkpoint__every=2))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000002"]
    resumed = finetune(tiny_job(out, training__steps=6, checkpoint__every=2, checkpoint__resume="auto"))
    assert resumed.step == 6 and sorted(losses(read_metrics(out))) == [1, 2, 3, 4, 5, 6]


@pytest.fixture
def checkpointed(tiny_job, tmp_path):
    """A run of 2 steps with its checkpoint, and the config that resumes it."""
    out = tmp_path / "out"
    finetune(tiny_job(out, training__steps=2, checkpoint__every=2))
    return out / "checkpoints" / "step_00000002", tiny_job(out, training__steps=4, checkpoint__resume="auto")


def test_a_checkpoint_whose_metadata_would_run_code_is_refused_before_anything_is_built(checkpointed, tmp_path,
                                                                                       monkeypatch):
    path, resume = checkpointed
    metadata_file = path / "state" / METADATA_NAME
    with metadata_file.open("rb") as file:
        metadata = pickle.load(file)
    metadata.planner_data["model.lm_head.weight"] = CreatesMarker(tmp_path / "marker")
    metadata_file.write_bytes(pickle.dumps(metadata))
    _fail_if_built(monkeypatch)
    with pytest.raises(ValueError, match=rf"checkpoint.resume: {metadata_file} was refused: it names (builtins|io).open"):
        finetune(resume)
    assert not (tmp_path / "marker").exists()


def test_rng_states_that_would_run_code_are_refused(checkpointed, tmp_path):
    path, resume = checkpointed
    torch.save({"torch": torch.get_rng_state(), "python": CreatesMarker(tmp_path / "marker")}, path / "rng_rank0.pt")
    with pytest.raises(ValueError, match=rf"{path / 'rng_rank0.pt'} cannot be read \(UnpicklingError: Weights only load "
                                         "failed.*not a moetune checkpoint's RNG state"):
        finetune(resume)
    assert not (tmp_path / "marker").exists()


def test_a_truncated_shard_or_damaged_train_state_is_named_before_anything_is_built(checkpointed, monkeypatch):
    path, resume = checkpointed
    _fail_if_built(monkeypatch)
    shard = path / "state" / "__0_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[:1000])
    with pytest.raises(ValueError, match=rf"checkpoint.resume: {shard} is truncated: 1000 bytes, the checkpoint's "
                                         r"metadata describes at least \d+"):
        finetune(resume)
    shard.write_bytes(data)
    (path / "rng_rank0.pt").unlink()
    with pytest.raises(ValueError, match=rf"checkpoint.resume: {path} lacks rng_rank0.pt; it is incomplete"):
        finetune(resume)
    state_file = path / checkpointing.STATE_FILE
    state_file.write_text(state_file.read_text()[:-20])
    with pytest.raises(ValueError, match=rf"{state_file} is not valid JSON: .* \(line \d+, column \d+\)"):
        finetune(resume)
    state_file.write_text(json.dumps({"step": 2}))
    with pytest.raises(ValueError, match=rf"{state_file} is not a checkpoint's train state"):
        finetune(resume)
