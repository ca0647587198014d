"""Two ranks swap blocks of a tensor through symmetric memory with the copy engines: the overlapped
all-gather dispatcher's collectives without NCCL kernels (``ep_transport="copy_engine"``).

Why: a collective that overlaps the experts' GEMMs must not take their SMs. An NCCL kernel holds SMs
for as long as it runs (and, with real routing, while it waits for a slower peer), so a GEMM launched
beside it runs its last tiles late. A copy into the peer's memory runs on a copy engine; the ranks
meet at a symmetric-memory barrier (one small kernel).

At ep = 2 each of the dispatcher's collectives is one swap: the all-gather's output needs only the
peer's block (the own block is never read: its routed copies are the own call's), and the
reduce-scatter's output is the peer's block of the peer's partial sums (the own block of this rank's
input is its own call's, zero here). On the communication stream, per swap: a barrier (the peer has
copied out what the last swap left in its receive buffer), the push into the peer's receive buffer, a
barrier (both pushes landed), the copy out of the own receive buffer into the output. All of it is
captured in CUDA graphs. The receive buffer is symmetric memory sized by the largest swap: allocated
(a collective rendezvous) on the first call that needs more, which must not be inside a capture (the
eager warm-up steps make it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moetune.distributed.comm_stream import CommStream, InFlight

# The barriers' signal-pad channel: peer_copy.py (the replicated gradients, another stream) uses 0.
_CHANNEL = 1


class PeerExchange:
    """Block swaps between the two ranks of ``group`` (one CUDA device each), on ``comm``'s stream."""

    def __init__(self, *, group: dist.ProcessGroup, device: torch.device) -> None:
        if dist.get_world_size(group) != 2:
            raise ValueError(
                f"ep_transport='copy_engine' swaps blocks between two ranks (one NVLinked pair); this expert-parallel "
                f"group has {dist.get_world_size(group)}: use ep_transport='nccl'"
            )
        if device.type != "cuda":
            raise ValueError(f"ep_transport='copy_engine' needs CUDA devices, got {device}: use ep_transport='nccl'")
        self.group, self.device = group, device
        self.rank = dist.get_rank(group)
        self.peer = 1 - self.rank
        self.comm = CommStream.on(device)
        self._received: torch.Tensor | None = None  # this rank's receive buffer (bytes)
        self._peer_received: torch.Tensor | None = None  # the peer's, mapped here
        self._handle = None

    def gather(self, x_TX: torch.Tensor) -> InFlight:
        """[2T, ...]: the peer's ``x`` in its block; the own block is left unwritten."""
        out = x_TX.new_empty((2 * x_TX.shape[0], *x_TX.shape[1:]))
        rows = x_TX.shape[0]
        return self._swap(x_TX, out, out[self.peer * rows : (self.peer + 1) * rows])

    def scatter_sum(self, x_GX: torch.Tensor) -> InFlight:
        """[T, ...]: the peer's block of its ``x`` for this rank (the own block of ``x`` is not sent)."""
        rows = x_GX.shape[0] // 2
        out = x_GX.new_empty((rows, *x_GX.shape[1:]))
        return self._swap(x_GX[self.peer * rows : (self.peer + 1) * rows], out, out, own=x_GX)

    def _swap(self, send: torch.Tensor, out: torch.Tensor, receive_into: torch.Tensor, *, own=None) -> InFlight:
        nbytes = send.numel() * send.element_size()
        self._reserve(nbytes)
        stream = self.comm.stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._handle.barrier(channel=_CHANNEL)
            self._peer_received[:nbytes].copy_(send.contiguous().view(-1).view(torch.uint8))
            self._handle.barrier(channel=_CHANNEL)
            receive_into.view(-1).view(torch.uint8).copy_(self._received[:nbytes])
        (own if own is not None else send).record_stream(stream)
        out.record_stream(stream)
        return InFlight(out, stream.record_event())

    def _reserve(self, nbytes: int) -> None:
        if self._received is not None and self._received.numel() >= nbytes:
            return
        import torch.distributed._symmetric_memory as symm_mem  # CUDA builds only

        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # required before rendezvous in older torch
            symm_mem.enable_symm_mem_for_group(self.group.group_name)
        buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._handle = symm_mem.rendezvous(buffer, self.group.group_name)
        self._received = buffer
        self._peer_received = self._handle.get_buffer(self.peer, (nbytes,), torch.uint8)
