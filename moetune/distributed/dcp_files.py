"""torch.distributed.checkpoint (DCP) folders read without running code, and errors that name the file.

DCP pickles its metadata (``.metadata``) and reads non-tensor values (the optimizer's
hyper-parameters) back with ``torch.load(weights_only=False)``: a crafted checkpoint would run code
when resumed. Here the metadata is read by an unpickler that admits only the classes DCP's metadata
is made of (``torch.distributed.checkpoint.metadata``'s dataclasses and enums, its storage records,
``torch.Size``, dtypes, layouts, paths), each file it names must lie in the checkpoint folder, the
values are read with ``weights_only=True`` (as DCP already reads tensors), and an error while
reading or writing a file names it.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import pathlib
import pickle
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from moetune.utils.file_errors import naming_file

METADATA_NAME = ".metadata"


class CheckpointFileError(ValueError):
    """A checkpoint file that cannot be read (damaged, truncated, or holding what a checkpoint never holds)."""


def load_dcp(state: dict[str, Any], path: str | os.PathLike) -> None:
    """``dcp.load(state, checkpoint_id=path)`` without unpickling anything but DCP's own records.
    Raises ``CheckpointFileError`` naming the file and what is wrong with it."""
    reader = RestrictedFileSystemReader(path)
    try:
        dcp.load(state, storage_reader=reader, planner=RestrictedLoadPlanner())
    except CheckpointException as err:  # DCP collects each rank's failure (a BaseException, not an Exception)
        if reader.errors:  # DCP rewords them (and tries other metadata files): the first one as it was
            raise reader.errors[0] from None
        raise CheckpointFileError(_failures(err)) from None


def save_dcp(state: dict[str, Any], path: str | os.PathLike) -> None:
    """``dcp.save(state, checkpoint_id=path)``; a failed write raises the OSError of the file it was
    writing (``filename`` set: "No space left on device" and where), any other failure a RuntimeError."""
    writer = FileSystemWriter(path)
    writer.fs = NamingFileSystem()
    try:
        dcp.save(state, storage_writer=writer)
    except CheckpointException as err:
        for failure in _exceptions(err):
            if isinstance(failure, OSError):
                raise failure from None
        raise RuntimeError(_failures(err)) from None


class NamingFileSystem(FileSystem):
    """DCP's local filesystem whose errors name the file: an OSError gets its ``filename``, a file
    that cannot be deserialised becomes a ``CheckpointFileError``."""

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        try:
            with naming_file(path), super().create_stream(path, mode) as stream:
                yield stream
        except (RuntimeError, pickle.UnpicklingError, EOFError) as err:
            if "r" in mode:
                raise CheckpointFileError(f"{path} cannot be read ({type(err).__name__}: {err}); the file is damaged "
                                          "or truncated") from err
            raise


class RestrictedFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` admits only DCP's metadata classes."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self.fs = NamingFileSystem()
        self.errors: list[CheckpointFileError] = []
        """What this reader refused or could not read, first first."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        path = Path(self.path) / (METADATA_NAME if rank is None else f"__{rank}{METADATA_NAME}")
        try:
            metadata = read_metadata_file(path)
        except CheckpointFileError as err:
            self.errors.append(err)
            raise
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        try:
            return super().read_data(plan, planner)
        except CheckpointFileError as err:
            self.errors.append(err)
            raise


def read_metadata_file(path: Path) -> Metadata:
    """A DCP ``.metadata`` file, unpickled with only DCP's metadata classes admitted; its storage
    records must name files inside the checkpoint folder."""
    try:
        with path.open("rb") as file:
            metadata = _MetadataUnpickler(file).load()
    except FileNotFoundError:
        raise CheckpointFileError(f"{path} does not exist: the folder is no complete torch.distributed.checkpoint") from None
    except _RefusedGlobal as err:
        raise CheckpointFileError(
            f"{path} was refused: it names {err}, which a torch.distributed.checkpoint's metadata never holds "
            "(unpickling it could run code). Nothing in it was run; do not resume from this checkpoint") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as err:
        raise CheckpointFileError(f"{path} cannot be read ({type(err).__name__}: {err}); the file is damaged "
                                  "or truncated") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointFileError(f"{path} holds a {type(metadata).__name__}, not a checkpoint's metadata")
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
            raise CheckpointFileError(f"{path} was refused: it points to {name!r}, outside the checkpoint folder")
    return metadata


def check_dcp_folder(folder: Path) -> Metadata:
    """Read ``folder``'s metadata (restricted, as ``load_dcp`` does) and check that every file it
    lists is there and long enough: a truncated or missing shard is named before anything is built
    or loaded. Returns the metadata."""
    metadata = read_metadata_file(folder / METADATA_NAME)
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), int(info.offset) + int(info.length))
    for name, end in sorted(ends.items()):
        path = folder / name
        if not path.is_file():
            raise CheckpointFileError(f"{path} is missing; the checkpoint's metadata ({METADATA_NAME}) lists it")
        size = path.stat().st_size
        if size < end:
            raise CheckpointFileError(f"{path} is truncated: {size} bytes, the checkpoint's metadata describes at least "
                                      f"{end}")
    return metadata


class RestrictedLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, its non-tensor values read with ``weights_only=True``: plain
    Python values (numbers, strings, tuples, dicts) and tensors; nothing else is unpickled."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            raise CheckpointFileError(f"the checkpoint's value of {fqn!r} was refused: it is not plain data "
                                      f"({str(err).splitlines()[0]})") from None
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element  # as DefaultLoadPlanner.load_bytes

            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


class _RefusedGlobal(pickle.UnpicklingError):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = _allowed_global(module, name)
        if allowed is None:
            raise _RefusedGlobal(f"{module}.{name}")
        return allowed

    def persistent_load(self, pid: Any) -> Any:
        raise _RefusedGlobal(f"a persistent id {pid!r}")


_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_OTHER_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch", "Size"): torch.Size,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): None,  # resolved on use (a private name)
    ("torch.serialization", "_get_layout"): None,  # a layout by its name (torch.strided)
    ("pathlib", "PosixPath"): pathlib.PurePosixPath,  # StorageMeta.checkpoint_id: where it was written
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,
    ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
    ("collections", "OrderedDict"): OrderedDict,
}


def _allowed_global(module: str, name: str) -> Any:
    """What a name in DCP's metadata may resolve to: DCP's metadata dataclasses and enums (the classes
    defined in its metadata module), its storage record, torch's sizes, dtypes and layouts; else None."""
    if module == "torch":
        value = getattr(torch, name, None)
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)) or value is torch.Size:
            return value
        return None
    if module == _METADATA_MODULE:
        value = getattr(importlib.import_module(module), name, None)
        return value if isinstance(value, type) and value.__module__ == module else None
    if (module, name) not in _OTHER_GLOBALS:
        return None
    value = _OTHER_GLOBALS[(module, name)]
    return value if value is not None else getattr(importlib.import_module(module), name, None)


def _exceptions(err: CheckpointException) -> list[BaseException]:
    failures = getattr(err, "failures", None) or {}
    return [failure[0] if isinstance(failure, tuple) else failure for failure in failures.values()]


def _failures(err: CheckpointException) -> str:
    """Each distinct failure of a CheckpointException in one line (a CheckpointFileError's message as it is)."""
    messages: list[str] = []
    for failure in _exceptions(err):
        message = str(failure) if isinstance(failure, (CheckpointFileError, OSError)) else f"{type(failure).__name__}: {failure}"
        if message not in messages:
            messages.append(message)
    return "; ".join(messages) or str(err)
