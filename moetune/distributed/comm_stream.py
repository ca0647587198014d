"""Collectives on a side CUDA stream, so that they run while the compute stream keeps computing.

The only stream code of the pipelined dispatcher; on CPU (gloo) both methods are plain calls.

Why the collective is launched *from* the communication stream: ProcessGroupNCCL orders a collective
after the work queued on the stream that is current at launch (its internal stream waits for that
stream; a synchronous one, ``async_op=False``, even runs on it in recent PyTorch: seen with torch 2.11
on 2 H200s). Launched from the compute stream, a collective would wait for all compute queued before
it (e.g. the experts of the previous chunk); launched from the communication stream, after that stream
waited for exactly the work that produced the input, it waits for nothing else. When the synchronous
call returns, the current stream, again the communication stream, is ordered after the collective
(it ran there, or was made to wait for NCCL's stream), so an event recorded on it marks the
collective's end; the compute stream waits for that event before it reads the output.

Memory: the caching allocator reuses a freed block as soon as the stream it was allocated on is past
the free. The input (allocated on the compute stream) is read by the communication stream, and the
output (allocated on the communication stream) is read by the compute stream; ``record_stream`` tells
the allocator about the other stream, so neither block is reused while the other stream may still
read it.

Autograd: the backward of an op runs on the stream its forward ran on, with the waits for gradients
made on other streams inserted by the engine, so the backward all-to-alls also run from the
communication stream.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class InFlight:
    """A collective's output and, on CUDA, the event that marks its end (None when it ran inline)."""

    tensor: torch.Tensor
    done: torch.cuda.Event | None


class CommStream:
    """A communication stream on CUDA; on other devices collectives run inline (synchronously)."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def launch(self, collective: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> InFlight:
        """``collective(x)`` on the communication stream. Call it right after ``x`` is produced: the
        communication stream waits for the compute stream's work queued so far (which ends with x's
        producer), never for compute queued later."""
        if self.stream is None:
            return InFlight(collective(x), None)
        self.stream.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(self.stream):
            out = collective(x)
        x.record_stream(self.stream)
        return InFlight(out, self.stream.record_event())

    def wait(self, pending: InFlight) -> torch.Tensor:
        """The collective's output, safe to read on the current (compute) stream."""
        if pending.done is not None:
            compute = torch.cuda.current_stream(pending.tensor.device)
            compute.wait_event(pending.done)
            pending.tensor.record_stream(compute)
        return pending.tensor
