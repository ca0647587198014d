"""I/O errors that name the file: ``OSError.filename`` set where the OS error did not say it."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


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
