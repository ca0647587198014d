"""``dense_parallel="replicate"``: every rank keeps full copies of the non-expert parameters (attention,
norms, router, embeddings, LM head) and their gradients are averaged over the ranks, DDP's job.

Why, next to FSDP2's default sharding: when ep == world each rank owns its experts outright and the
non-expert parameters are small (0.9B of Qwen3-30B-A3B's 30B). Replicated, they cost 8 bytes per
parameter more on every rank, but the step has no FSDP2 all-gathers, no per-layer hooks that manage
parameter storage, and nothing that needs the host: with the all-gather dispatcher the whole
expert-parallel step can be captured in a CUDA graph (moetune.training.CUDAGraphTrainStep).

How: each parameter's gradient is all-reduced (averaged) as soon as autograd has accumulated it, on
NCCL's stream, overlapping the rest of the backward; the end of the backward waits for all of them.
The gradient is reduced in its own dtype (bf16 for bf16 models: one rounding of a two-term sum at
ep = 2). Ranks start equal: the parameters are broadcast from the group's first rank once.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn


class ReplicatedGradientSync:
    """Averages the gradients of ``params`` over ``group`` in every backward."""

    def __init__(self, params: Iterable[nn.Parameter], *, group: dist.ProcessGroup) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.world = dist.get_world_size(group)
        # gloo has no AVG reduction: sum, then divide once the reduction is done.
        self.average_in_collective = "nccl" in str(dist.get_backend(group)).lower()
        self._pending: list[tuple[torch.Tensor, dist.Work]] = []
        self._handles = [p.register_post_accumulate_grad_hook(self._reduce) for p in self.params]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _reduce(self, param: nn.Parameter) -> None:
        if not self._pending:
            torch.autograd.Variable._execution_engine.queue_callback(self._wait_all)
        op = dist.ReduceOp.AVG if self.average_in_collective else dist.ReduceOp.SUM
        self._pending.append((param.grad, dist.all_reduce(param.grad, op=op, group=self.group, async_op=True)))

    def _wait_all(self) -> None:
        pending, self._pending = self._pending, []
        for grad, work in pending:
            work.wait()
            if not self.average_in_collective:
                grad.div_(self.world)


@torch.no_grad()
def broadcast_parameters(params: Iterable[torch.Tensor], *, group: dist.ProcessGroup) -> None:
    """Make every rank's copy equal to the group's first rank's (after random init or loading)."""
    src = dist.get_global_rank(group, 0)
    for param in params:
        dist.broadcast(param.data, src=src, group=group)
