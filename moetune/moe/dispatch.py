"""Token dispatchers: move each token to the experts that hold its routed copies, and back.

A dispatcher turns (tokens, routing) into rows sorted by local expert plus the count per local
expert, and turns the experts' outputs back into one weighted sum per token; ``run`` does both
around the experts' call. The single-device dispatcher only permutes; the expert-parallel ones
(moetune.distributed) add the all-to-all, and the pipelined one overlaps it with the experts by
overriding ``run``; a DeepEP-style fused backend is one more implementation of this interface.

Shape legend: T tokens, H hidden, K experts per token, N = T*K routed rows, E experts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from moetune.kernels import moe_combine, moe_permute
from moetune.moe.experts import GroupedExperts
from moetune.moe.routing import Routing


Experts = Callable[..., torch.Tensor]
"""``experts(rows sorted by local expert, rows per local expert) -> output rows`` (a ``GroupedExperts``).
A ``GroupedExperts`` also takes ``gather_order=`` / ``gather_top_k=`` and gathers its rows itself."""


class TokenDispatcher(Protocol):
    """Subclass it to get ``run``; ``MoEBlock`` calls only ``run``."""

    def dispatch(self, x_TH: torch.Tensor, routing: Routing, *, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Return (rows sorted by local expert, tokens per local expert, state for combine)."""

    def combine(self, y_NH: torch.Tensor, state: Any) -> torch.Tensor:
        """Return the per-token weighted sum of the experts' outputs [T, H]."""

    def run(self, x_TH: torch.Tensor, routing: Routing, experts: Experts, *, num_experts: int) -> torch.Tensor:
        """dispatch -> experts -> combine: the per-token output [T, H]. A dispatcher that overlaps its
        communication with the experts' compute (moetune.distributed's pipelined one) overrides it."""
        x_NH, counts, state = self.dispatch(x_TH, routing, num_experts=num_experts)
        return self.combine(apply_experts(experts, x_NH, counts), state)


def apply_experts(
    experts: Experts,
    x: torch.Tensor,
    counts: torch.Tensor,
    *,
    gather_order: torch.Tensor | None = None,
    gather_top_k: int = 1,
) -> torch.Tensor:
    """``experts(x, counts)``, made a function of ``x`` also when it has no rows. An experts module
    given no rows may return an output that ignores them; autograd would then skip this rank's backward
    of the all-to-all that delivered them, while the ranks that sent it rows run theirs: the
    collectives would pair up wrongly.

    With ``gather_order`` ``x`` holds the un-gathered tokens and the rows are
    ``x[gather_order // gather_top_k]`` (those past ``counts.sum()`` are padding): a ``GroupedExperts``
    gathers them inside its first GEMM and keeps no copy of them for the backward; any other experts
    callable gets them gathered."""
    if gather_order is None:
        y_NH = experts(x, counts)
    elif isinstance(experts, GroupedExperts):
        y_NH = experts(x, counts, gather_order=gather_order, gather_top_k=gather_top_k)
    else:
        y_NH = experts(moe_permute(x, gather_order, gather_top_k, num_valid=counts.sum().reshape(1)), counts)
    return y_NH + 0 * x.sum() if x.shape[0] == 0 else y_NH


def sort_ids(ids_N: torch.Tensor, num_ids: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the stable order that sorts ``ids_N``, the count of each id in ``[0, num_ids)`` as int64),
    without a host sync (``bincount`` sizes its output on the host).

    The keys are narrowed to the smallest integer type that holds the ids first: torch's radix sort
    makes one pass per key byte, so 128 experts sort in one pass instead of eight for int64 ids. The
    counts come from the sorted keys (a binary search per id) instead of E-way atomic adds."""
    key_dtype = torch.uint8 if num_ids <= 256 else torch.int16 if num_ids <= 32768 else torch.int32
    sorted_N, order_N = torch.sort(ids_N.to(key_dtype), stable=True)
    ids = torch.arange(num_ids, device=ids_N.device, dtype=key_dtype)
    ends = torch.searchsorted(sorted_N, ids, right=True)
    return order_N, torch.diff(ends, prepend=ends.new_zeros(1))


@dataclass
class PermutationState:
    order_N: torch.Tensor
    """Routed slot (token * K + k) of each sorted row."""
    weights_TK: torch.Tensor


def sort_by_expert(routing: Routing, *, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, PermutationState]:
    """The order that sorts the T*K routed slots by expert (stable, so equal experts keep token order):
    (``order_N``, tokens per expert, state for ``unpermute``)."""
    order_N, counts_E = sort_ids(routing.experts_TK.reshape(-1), num_experts)
    return order_N, counts_E, PermutationState(order_N, routing.weights_TK)


def permute(x_TH: torch.Tensor, routing: Routing, *, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, PermutationState]:
    """Sort the T*K routed copies of the tokens by expert: (rows, tokens per expert, state)."""
    order_N, counts_E, state = sort_by_expert(routing, num_experts=num_experts)
    return moe_permute(x_TH, order_N, routing.experts_TK.shape[1]), counts_E, state


def unpermute(y_NH: torch.Tensor, state: PermutationState) -> torch.Tensor:
    """Weighted sum of each token's K expert outputs, in fp32 (one fused gather-and-sum kernel on
    GPU: no scatter, no atomics, deterministic)."""
    return moe_combine(y_NH, state.weights_TK, state.order_N)


class LocalTokenDispatcher(TokenDispatcher):
    """Single device (or no expert parallelism): permutation only, no communication, no host sync.

    ``run`` hands the experts the tokens un-gathered, with the order (``apply_experts``): a
    ``GroupedExperts`` gathers them inside its first GEMM and keeps only the tokens for the backward,
    not the K-times larger sorted copy (``moetune.moe.experts.GatheredGroupedMM``)."""

    def dispatch(self, x_TH, routing, *, num_experts):
        return permute(x_TH, routing, num_experts=num_experts)

    def combine(self, y_NH, state):
        return unpermute(y_NH, state)

    def run(self, x_TH, routing, experts, *, num_experts):
        order_N, counts_E, state = sort_by_expert(routing, num_experts=num_experts)
        y_NH = apply_experts(experts, x_TH, counts_E, gather_order=order_N, gather_top_k=routing.experts_TK.shape[1])
        return unpermute(y_NH, state)
