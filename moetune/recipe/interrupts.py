"""Ctrl-C as a request to stop at the next step boundary (where a checkpoint is consistent)."""

from __future__ import annotations

import signal
from types import FrameType, TracebackType


class StopRequest:
    """Context manager: while active, the first SIGINT sets ``requested``; a second one raises
    KeyboardInterrupt at once (for a user who does not want to wait for the checkpoint)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: object = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> StopRequest:
        try:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        except ValueError:  # not the main thread: signals cannot be caught here
            self._previous = None
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)  # type: ignore[arg-type]
