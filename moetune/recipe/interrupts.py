"""Ctrl-C (SIGINT) or SIGTERM as a request to stop at the next step boundary, where a checkpoint
is consistent. SIGTERM is what Slurm sends before preempting a job and what torchrun forwards
to its workers when it is stopped (it waits ~30 s before SIGKILL)."""

from __future__ import annotations

import signal
from types import FrameType, TracebackType

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """Context manager: while active, the first SIGINT/SIGTERM sets ``requested``; a second one
    raises KeyboardInterrupt at once (for a user who does not want to wait for the checkpoint)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> StopRequest:
        for sig in SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: signals cannot be caught here
                pass
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)  # type: ignore[arg-type]
