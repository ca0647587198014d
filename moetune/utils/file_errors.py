"""I/O errors that name the file: ``OSError.filename`` set where the OS error did not say it, and
why a safetensors file could not be read, in words."""

from __future__ import annotations

import contextlib
import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def naming_file(path: str | os.PathLike) -> Iterator[None]:
    """Errors of the block name ``path``: an OSError without a file name gets it, and so does the
    OSError behind torch.save's "unexpected pos" RuntimeError (a write into a full disk)."""
    try:
        yield
    except OSError as err:
        raise with_filename(err, path) from err
    except RuntimeError as err:
        cause = os_error_in(err)
        if cause is None:
            raise
        raise with_filename(cause, path) from err


def os_error_in(err: BaseException) -> OSError | None:
    """The OSError an exception was raised from or while handling, if any."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def with_filename(err: OSError, path: str | os.PathLike) -> OSError:
    """``err``, or the same error naming ``path`` when it names no file."""
    if err.filename is not None:
        return err
    return type(err)(err.errno, err.strerror or str(err), str(path)) if err.errno else OSError(f"{err} ({path})")


def unreadable_safetensors(path: Path, error: BaseException, *, shard: str = "") -> str:
    """Why safetensors could not read ``path``, in words: truncated (and by how much) or damaged."""
    name = f"{path} ({shard})" if shard else str(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as file:
            prefix = file.read(8)
            header_size = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else None
            header = file.read(header_size) if header_size is not None and header_size <= 100_000_000 else b""
    except OSError as err:
        return f"{name} cannot be read: {err.strerror or err}"
    if header_size is None or 8 + header_size > size:
        described = "" if header_size is None else f"; its header alone should take {8 + header_size} bytes"
        return f"{name} is truncated: {size} bytes{described} (an interrupted download or copy?); fetch it again"
    try:
        entries = json.loads(header)
        data_end = max((e["data_offsets"][1] for k, e in entries.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        return f"{name} is not a valid safetensors file (its header is damaged: {error})"
    expected = 8 + header_size + data_end
    if size < expected:
        return (f"{name} is truncated: {size} of the {expected} bytes its header describes (an interrupted download "
                "or copy?); fetch it again")
    return f"{name} is not a valid safetensors file ({error})"
