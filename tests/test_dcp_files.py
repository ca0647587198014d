"""torch.distributed.checkpoint folders are read without running code, and their errors name the file."""

from __future__ import annotations

import builtins
import errno
import io
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from moetune.distributed import load_distributed_checkpoint, save_distributed_checkpoint
from moetune.distributed.dcp_files import (
    METADATA_NAME, CheckpointFileError, check_dcp_folder, load_dcp, read_metadata_file, save_dcp,
)

# One process without a process group is the intent here (DCP warns about it).
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class CreatesMarker:
    """Unpickled, it creates the file ``path``: what a crafted checkpoint's code could do."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


def _saved(path: Path) -> dict:
    state = {"weight": torch.arange(6.0).reshape(2, 3), "lr": 0.5, "betas": (0.9, 0.98)}
    save_dcp(state, path)
    return state


def _poison_metadata(folder: Path, marker: Path) -> None:
    """The checkpoint's real metadata with code riding along in one of its fields."""
    with (folder / METADATA_NAME).open("rb") as file:
        metadata = pickle.load(file)
    metadata.planner_data = {"weight": CreatesMarker(marker)}
    (folder / METADATA_NAME).write_bytes(pickle.dumps(metadata))


def test_a_checkpoint_round_trips_through_the_restricted_reader(tmp_path):
    saved = _saved(tmp_path / "ck")
    loaded = {"weight": torch.zeros(2, 3), "lr": 0.0, "betas": (0.0, 0.0)}
    load_dcp(loaded, tmp_path / "ck")
    assert torch.equal(loaded["weight"], saved["weight"])
    assert loaded["lr"] == 0.5 and tuple(loaded["betas"]) == (0.9, 0.98)


def test_metadata_that_would_run_code_is_refused_and_nothing_runs(tmp_path):
    _saved(tmp_path / "ck")
    proof = tmp_path / "proof"
    _poison_metadata(tmp_path / "ck", proof)
    with (tmp_path / "ck" / METADATA_NAME).open("rb") as file:
        pickle.load(file)  # what torch's own reader does: the code runs
    assert proof.exists()

    marker = tmp_path / "marker"
    _poison_metadata(tmp_path / "ck", marker)
    with pytest.raises(CheckpointFileError, match=rf"{METADATA_NAME} was refused: it names (builtins|io).open.*Nothing in it was run"):
        load_dcp({"weight": torch.zeros(2, 3), "lr": 0.0, "betas": (0.0, 0.0)}, tmp_path / "ck")
    with pytest.raises(CheckpointFileError, match=r"(builtins|io).open"):
        check_dcp_folder(tmp_path / "ck")
    assert not marker.exists()


def test_a_value_that_would_run_code_is_refused(tmp_path):
    """DCP reads non-tensor values with torch.load(weights_only=False); moetune's planner does not."""
    dcp.save({"evil": CreatesMarker(tmp_path / "proof"), "lr": 0.5}, checkpoint_id=str(tmp_path / "proof_ck"))
    dcp.load({"evil": None, "lr": 0.0}, checkpoint_id=str(tmp_path / "proof_ck"))  # torch's own planner: it runs
    assert (tmp_path / "proof").exists()
    dcp.save({"evil": CreatesMarker(tmp_path / "marker"), "lr": 0.5}, checkpoint_id=str(tmp_path / "ck"))
    with pytest.raises(CheckpointFileError, match=r"value of 'evil' was refused: it is not plain data"):
        load_dcp({"evil": None, "lr": 0.0}, tmp_path / "ck")
    assert not (tmp_path / "marker").exists()


def test_metadata_pointing_outside_the_folder_is_refused(tmp_path):
    _saved(tmp_path / "ck")
    with (tmp_path / "ck" / METADATA_NAME).open("rb") as file:
        metadata = pickle.load(file)
    for info in metadata.storage_data.values():
        info.relative_path = "../../outside.distcp"
    (tmp_path / "ck" / METADATA_NAME).write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointFileError, match=r"points to '../../outside.distcp', outside the checkpoint folder"):
        read_metadata_file(tmp_path / "ck" / METADATA_NAME)


def test_a_truncated_or_missing_shard_is_named(tmp_path):
    _saved(tmp_path / "ck")
    shard = next((tmp_path / "ck").glob("*.distcp"))
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointFileError, match=rf"{shard} is truncated: {len(data) // 2} bytes, .* at least"):
        check_dcp_folder(tmp_path / "ck")
    with pytest.raises(CheckpointFileError, match=rf"{shard} cannot be read .*damaged or truncated"):  # unchecked
        load_dcp({"weight": torch.zeros(2, 3), "lr": 0.0, "betas": (0.0, 0.0)}, tmp_path / "ck")
    shard.unlink()
    with pytest.raises(CheckpointFileError, match=rf"{shard} is missing"):
        check_dcp_folder(tmp_path / "ck")
    (tmp_path / "ck" / METADATA_NAME).write_bytes(b"\x80\x04garbage")
    with pytest.raises(CheckpointFileError, match=rf"{METADATA_NAME} cannot be read .*damaged or truncated"):
        check_dcp_folder(tmp_path / "ck")


def test_a_full_disk_names_the_file_being_written(tmp_path, monkeypatch):
    """Writes into the folder go to /dev/full, whose every write fails with the kernel's ENOSPC."""
    real_open = io.open
    folder = tmp_path / "ck"

    def open_full_disk(file, mode="r", *args, **kwargs):
        if any(flag in mode for flag in "wax") and str(file).startswith(str(folder)):
            return real_open("/dev/full", mode, *args, **kwargs)
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(io, "open", open_full_disk)
    monkeypatch.setattr(builtins, "open", open_full_disk)
    with pytest.raises(OSError) as raised:
        save_dcp({"weight": torch.ones(100)}, folder)
    assert raised.value.errno == errno.ENOSPC and raised.value.filename.startswith(str(folder))


def test_the_trainer_checkpoints_resume_through_the_restricted_reader(tmp_path):
    """moetune.Trainer's moetune_dcp/ folder is read by load_distributed_checkpoint."""
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    save_distributed_checkpoint(model, optimizer, tmp_path / "moetune_dcp")
    other = torch.nn.Linear(3, 2)
    other_optimizer = torch.optim.AdamW(other.parameters(), lr=0.1)
    load_distributed_checkpoint(other, other_optimizer, tmp_path / "moetune_dcp")
    assert torch.equal(other.weight, model.weight)
    _poison_metadata(tmp_path / "moetune_dcp", tmp_path / "marker")
    with pytest.raises(CheckpointFileError, match="was refused"):
        load_distributed_checkpoint(other, other_optimizer, tmp_path / "moetune_dcp")
    assert not (tmp_path / "marker").exists()
