"""Row-wise collectives shared by the all-gather dispatcher and the vocabulary-parallel layers:
block r of a gathered tensor is rank r's rows, and a reduce-scatter sends block r of the sum to rank r."""

from __future__ import annotations

import torch
import torch.distributed as dist

# torch >= 2.13 renamed the tensor collectives; older versions only have the first names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def gather_rows(x: torch.Tensor, group, world: int) -> torch.Tensor:
    """[world * N, ...]: every rank's ``x`` [N, ...], in rank order."""
    out = x.new_empty((world * x.shape[0], *x.shape[1:]))
    _all_gather(out, x.contiguous(), group=group)
    return out


def scatter_sum_rows(x: torch.Tensor, group, world: int) -> torch.Tensor:
    """[N / world, ...]: this rank's block of the sum of every rank's ``x`` [N, ...]."""
    out = x.new_empty((x.shape[0] // world, *x.shape[1:]))
    _reduce_scatter(out, x.contiguous(), group=group)
    return out


def pad_rows(x: torch.Tensor, num_rows: int, value: float = 0) -> torch.Tensor:
    """``x`` with rows of ``value`` appended up to ``num_rows`` (a shorter rank's part of a collective)."""
    extra = num_rows - x.shape[0]
    return x if extra == 0 else torch.cat([x, x.new_full((extra, *x.shape[1:]), value)])
