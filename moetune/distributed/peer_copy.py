"""Two ranks average replicated gradients through symmetric memory and the copy engines, without
NCCL kernels (``dense_parallel="replicate"``, ``replicate_transport="copy_engine"``).

Why: on 2 H200s the per-parameter NCCL all-reduces of the replicated gradients cost ~5 ms of a
~113 ms expert-parallel step, although their bytes do not (2026-11-30, commit e73f328; benchmarks/README.md):
each all-reduce is a kernel whose CTAs hold SMs while it waits for the peer, beside the backward's
GEMMs and the experts' own collectives. Here a gradient travels by a device-to-device copy into the
peer's receive buffer (a copy engine, no SM), the ranks meet at a symmetric-memory barrier (one small
kernel), and each adds what it received: ``(own + peer) / 2``, the same rounding as NCCL's bf16
average, and the same value on both ranks (the sum's two terms are the same numbers).

How, per gradient, on a stream of its own: (first of a backward only) a barrier, so that the peer has
consumed last step's buffer before it is overwritten; the push; a barrier (both pushes landed); the
add. A receive buffer of the gradients' size per rank (symmetric memory). A second gradient of one
parameter in one backward goes through NCCL instead (``covers``). The caller waits for the event
recorded after the add. Everything is a kernel, a memcpy or an event, so it is captured in CUDA
graphs. Two ranks on one node (NVLink / P2P), CUDA only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class _EventWork:
    """What ``dist.Work.wait()`` does for an async collective: the current stream waits for it."""

    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.event)


class PeerCopyAverage:
    """Averages the gradients of ``params`` (contiguous CUDA tensors, one device) between the two ranks
    of ``group``; one symmetric receive buffer per dtype, a slot per parameter."""

    def __init__(self, params: list[nn.Parameter], *, group: dist.ProcessGroup) -> None:
        if dist.get_world_size(group) != 2:
            raise ValueError(
                f"replicate_transport='copy_engine' averages between two ranks (one NVLinked pair); this group has "
                f"{dist.get_world_size(group)}: use replicate_transport='nccl'"
            )
        devices = {p.device for p in params}
        if any(d.type != "cuda" for d in devices) or len(devices) != 1:
            raise ValueError(f"replicate_transport='copy_engine' needs the parameters on one CUDA device, got {devices}")
        device = devices.pop()
        import torch.distributed._symmetric_memory as symm_mem  # CUDA builds only

        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # required before rendezvous in older torch
            symm_mem.enable_symm_mem_for_group(group.group_name)
        peer = 1 - dist.get_rank(group)
        self.slots: dict[int, tuple[torch.dtype, int]] = {}
        sizes: dict[torch.dtype, int] = {}
        for param in params:
            self.slots[id(param)] = (param.dtype, sizes.get(param.dtype, 0))
            sizes[param.dtype] = sizes.get(param.dtype, 0) + param.numel()
        self.received: dict[torch.dtype, torch.Tensor] = {}
        self.peer_received: dict[torch.dtype, torch.Tensor] = {}
        self.handles = {}
        for dtype, size in sizes.items():  # the same dtypes and sizes on both ranks: replicas
            buffer = symm_mem.empty(size, dtype=dtype, device=device)
            handle = symm_mem.rendezvous(buffer, group.group_name)
            self.received[dtype], self.handles[dtype] = buffer, handle
            self.peer_received[dtype] = handle.get_buffer(peer, (size,), dtype)
        self.stream = torch.cuda.Stream(device=device)
        # The backward (autograd graph task) that pushed last, and what it pushed: a new task id is a
        # new backward, so no end-of-backward reset is needed (nor missed after an exception).
        self._task: int | None = None
        self._pushed: set[int] = set()

    def covers(self, param: nn.Parameter, grad: torch.Tensor) -> bool:
        """Whether this gradient can go through the peer's buffer: a second gradient of a parameter in
        one backward (reentrant checkpointing) cannot, as the peer may not have read the first yet."""
        first = id(param) not in self._pushed or torch._C._current_graph_task_id() != self._task
        return first and id(param) in self.slots and grad.is_contiguous() and grad.dtype == param.dtype

    def average(self, param: nn.Parameter, grad: torch.Tensor) -> _EventWork:
        dtype, start = self.slots[id(param)]
        handle, end = self.handles[dtype], start + grad.numel()
        self.stream.wait_stream(torch.cuda.current_stream())
        task = torch._C._current_graph_task_id()
        with torch.cuda.stream(self.stream):
            if task != self._task:  # a new backward: the peer is done with what this rank pushed before
                self._task, self._pushed = task, set()
                for each in self.handles.values():
                    each.barrier(channel=0)
            self._pushed.add(id(param))
            self.peer_received[dtype][start:end].copy_(grad.reshape(-1))
            handle.barrier(channel=0)
            grad.add_(self.received[dtype][start:end].view_as(grad)).mul_(0.5)
            event = torch.cuda.Event()
            event.record(self.stream)
        return _EventWork(event)
