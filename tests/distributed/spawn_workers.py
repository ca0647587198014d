"""Workers that crash on purpose, for the tests of the spawn helper itself."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def abort_in_teardown(rank: int, world_size: int) -> None:
    """Passes, then rank 0 aborts inside ``destroy_process_group`` (what gloo's teardown rarely does)."""
    dist.all_reduce(torch.ones(1))
    if rank == 0:
        dist.destroy_process_group = os.abort


def abort_while_working(rank: int, world_size: int) -> None:
    """Rank 1 aborts before its checks are done."""
    if rank == 1:
        os.abort()
    dist.barrier()
