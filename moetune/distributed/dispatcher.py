"""Expert-parallel token dispatcher: permute -> all-to-all (uneven splits) -> sort by local expert,
and the reverse for combine.

Implements ``moetune.moe.TokenDispatcher``; ``MoEBlock`` and ``GroupedExperts`` are unchanged. A fused
dispatcher or a DeepEP backend replaces this class, nothing else; pipelined_dispatcher.py overlaps
these all-to-alls with the experts by chunking the tokens, with the helpers below.

Host synchronisation: ``ExpertParallelDispatcher`` has exactly one per MoE layer and forward, in
``dispatch``: the all-to-all of the rows needs its split sizes on the host (``exchange_counts``);
combine and the backward reuse them. ``CapacityExpertParallelDispatcher`` sends fixed-size blocks
per peer (``ep_capacity_factor``), sized from the group's largest token count: none inside a CUDA-graph
capture or a ``torch.compile`` trace (this rank's own count, equal counts required), one per MoE layer
in eager calls (the counts, so ranks with fewer tokens size their blocks as their peers do). (The CPU /
``loop`` experts path adds its own sync for per-expert sizes.)

Shape legend: T tokens on this rank, H hidden, K experts per token, N = T*K routed rows sent,
M rows received, E experts in the model, L = E / ep experts on this rank, R = ep ranks, C chunks
of tokens (pipelined_dispatcher.py; one here).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moetune.distributed.token_counts import LargestTokenCount
from moetune.kernels import moe_permute
from moetune.moe.dispatch import PermutationState, TokenDispatcher, permute, sort_ids, unpermute
from moetune.moe.routing import Routing


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits; the backward is the transposed all-to-all.

    The input may hold rows past ``sum(input_splits)`` (not sent; their gradient is zero) and the
    output ``output_rows`` >= ``sum(output_splits)`` rows (the rows past the received ones are zeros,
    their gradient is dropped): the padding of ``bucketed_row_count``, with no copy to add or cut it.
    """

    @staticmethod
    def forward(ctx, x, output_splits: list[int], input_splits: list[int], group, output_rows: int | None):
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        ctx.input_rows = x.shape[0]
        return _exchange_rows(x, output_splits, input_splits, group, output_rows)

    @staticmethod
    def backward(ctx, grad_out):
        grad_in = _exchange_rows(grad_out, ctx.input_splits, ctx.output_splits, ctx.group, ctx.input_rows)
        return grad_in, None, None, None, None


def _exchange_rows(x, output_splits: list[int], input_splits: list[int], group, output_rows: int | None):
    """The leading ``sum(input_splits)`` rows of ``x`` sent, received into the leading rows of an
    ``output_rows``-row tensor whose remaining rows are zeros."""
    sent, received = sum(input_splits), sum(output_splits)
    rows = received if output_rows is None else output_rows
    out = x.new_empty((rows, *x.shape[1:]))
    # Slices only where there is padding: the unpadded call (every layer, twice per direction) stays
    # the plain collective, with no extra views or fill on the host-bound path.
    send = x if x.shape[0] == sent else x[:sent]
    dist.all_to_all_single(out if rows == received else out[:received], send.contiguous(), output_splits, input_splits,
                           group=group)  # fmt: skip
    if rows > received:
        out[received:].zero_()
    return out


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by ``scale`` in backward."""

    @staticmethod
    def forward(ctx, x, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` unchanged; its gradient multiplied by ``scale`` (see ``rows_by_source``)."""
    return _ScaleGrad.apply(x, scale)


def all_to_all(
    x: torch.Tensor, *, output_splits: list[int], input_splits: list[int], group, output_rows: int | None = None
) -> torch.Tensor:
    """Autograd-correct all-to-all of rows: send ``input_splits[r]`` rows to rank r, receive
    ``output_splits[r]``; rows of ``x`` past the sent ones stay here, and ``output_rows`` pads the
    output with zero rows (see ``_AllToAll``)."""
    return _AllToAll.apply(x, output_splits, input_splits, group, output_rows)


ROW_BUCKETS_PER_DOUBLING = 8
"""``bucketed_row_count``'s sizes between two powers of two: at most 1/8 of the rows are padding."""


def bucketed_row_count(rows: int) -> int:
    """``rows`` rounded up to the next of ``ROW_BUCKETS_PER_DOUBLING`` evenly spaced sizes per power of two
    (e.g. 32768, 36864, 40960, ...): the received row counts an expert-parallel step gives its experts
    then take a few values, not a new one every step, for experts that compile or tune per exact shape
    (a user's own kernels; moetune's quack path buckets its tuning itself). The padding rows are zeros
    past every expert's rows, which the grouped GEMMs skip."""
    step = 1 << max(rows.bit_length() - ROW_BUCKETS_PER_DOUBLING.bit_length(), 0)
    return -(-rows // step) * step


def exchange_counts(
    counts_CE: torch.Tensor, *, ep_size: int, group
) -> tuple[torch.Tensor, list[list[int]], list[list[int]]]:
    """Every rank learns how many rows each rank sends to each of its local experts, for each of C
    chunks; then the one host sync of the layer fetches all send / receive split sizes together.

    Returns ``recv_counts_CRL`` (rows of chunk c from rank r for local expert l) and the split sizes
    ``send_splits[c][r]``, ``recv_splits[c][r]``.
    """
    num_chunks, num_experts = counts_CE.shape
    send_counts_RCL = counts_CE.view(num_chunks, ep_size, num_experts // ep_size).transpose(0, 1).contiguous()
    recv_counts_RCL = torch.empty_like(send_counts_RCL)  # block r: what rank r sends us
    dist.all_to_all_single(recv_counts_RCL, send_counts_RCL, group=group)
    splits = torch.stack([send_counts_RCL.sum(dim=2).T, recv_counts_RCL.sum(dim=2).T]).tolist()  # host sync
    return recv_counts_RCL.transpose(0, 1), splits[0], splits[1]


def received_expert_order(
    recv_counts_CRL: torch.Tensor, *, num_rows_C: list[int], padded_rows_C: list[int] | None = None
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Received rows are grouped by (source rank, local expert); the experts want them by local expert.

    For each of C chunks (rows ``num_rows_C[c]``), returns ``sort_M`` (the received row of each
    expert-sorted row), and the rows per (chunk, local expert) ``counts_CL``: one sort for all chunks.
    With ``padded_rows_C`` chunk c's buffer has that many rows, the padding last: its ``sort_M`` leaves
    them in place, after every expert's rows.
    """
    num_chunks, ep_size, num_local = recv_counts_CRL.shape
    device = recv_counts_CRL.device
    key_CL = torch.arange(num_chunks * num_local, device=device).view(num_chunks, 1, num_local)
    key_M = torch.repeat_interleave(
        key_CL.expand(num_chunks, ep_size, num_local).reshape(-1),
        recv_counts_CRL.reshape(-1),
        output_size=sum(num_rows_C),
    )
    order_M = torch.argsort(key_M, stable=True)  # chunk by chunk, each in local-expert order
    sort_C, start = [], 0
    for num_rows, padded_rows in zip(num_rows_C, padded_rows_C or num_rows_C):
        sort_M = order_M[start : start + num_rows] - start if start else order_M[:num_rows]
        if padded_rows > num_rows:
            sort_M = torch.cat([sort_M, torch.arange(num_rows, padded_rows, device=device)])
        sort_C.append(sort_M)
        start += num_rows
    return sort_C, recv_counts_CRL.sum(dim=1)


def rows_by_expert(x_MH: torch.Tensor, sort_M: torch.Tensor, *, ep_size: int) -> torch.Tensor:
    """Received rows in the experts' order; the gradient leaving the experts is scaled by ep
    (see ``rows_by_source``). moe_permute with K=1 is x[sort_M] with a gather backward
    (index_select's is an atomic scatter)."""
    return scale_grad(moe_permute(x_MH, sort_M, 1), float(ep_size))


def rows_by_source(y_MH: torch.Tensor, sort_M: torch.Tensor, *, ep_size: int) -> torch.Tensor:
    """The experts' output rows back in received order (grouped by source rank), ready to return.

    Expert gradients: the experts' FSDP2 group (dp_shard_mod_ep) averages over world / ep ranks, but
    each rank's expert gradient already sums the tokens of ep ranks; scaling the gradient entering the
    experts by 1 / ep (here, and the one leaving them by ep, in ``rows_by_expert``) makes the expert
    weights' gradients the world average like every other parameter's, while the activations'
    gradients are unchanged. (Exact for power-of-two ep.) This avoids FSDP2's custom divide factor,
    which gloo's sum-only reductions apply twice on a one-rank group.
    """
    y_MH = scale_grad(y_MH, 1.0 / ep_size)
    return torch.empty_like(y_MH).index_copy(0, sort_M, y_MH)


@dataclass
class ExpertParallelState:
    local: PermutationState
    """The rank-local permutation (by global expert) that ``unpermute`` undoes."""
    sort_M: torch.Tensor
    """Received row of each expert-sorted row."""
    send_splits: list[int]
    recv_splits: list[int]


class ExpertParallelDispatcher(TokenDispatcher):
    """Tokens go to the rank holding their expert (rank r holds experts [r*L, (r+1)*L)).

    ``bucket_rows``: pad the rows the experts receive to ``bucketed_row_count`` (off by default: for
    experts that compile or tune per exact row count); results are the same either way.
    """

    def __init__(self, *, group: dist.ProcessGroup, ep_size: int, bucket_rows: bool = False) -> None:
        self.group = group
        self.ep_size = ep_size
        self.bucket_rows = bucket_rows

    def dispatch(self, x_TH: torch.Tensor, routing: Routing, *, num_experts: int):
        x_NH, counts_E, local = permute(x_TH, routing, num_experts=num_experts)
        recv_counts_CRL, send_splits, recv_splits = exchange_counts(
            counts_E[None], ep_size=self.ep_size, group=self.group
        )
        num_rows = sum(recv_splits[0])
        padded_rows = bucketed_row_count(num_rows) if self.bucket_rows else num_rows
        x_MH = all_to_all(
            x_NH, output_splits=recv_splits[0], input_splits=send_splits[0], group=self.group, output_rows=padded_rows
        )
        (sort_M,), counts_CL = received_expert_order(
            recv_counts_CRL, num_rows_C=[num_rows], padded_rows_C=[padded_rows]
        )
        x_sorted_MH = rows_by_expert(x_MH, sort_M, ep_size=self.ep_size)
        return x_sorted_MH, counts_CL[0], ExpertParallelState(local, sort_M, send_splits[0], recv_splits[0])

    def combine(self, y_MH: torch.Tensor, state: ExpertParallelState) -> torch.Tensor:
        y_received_MH = rows_by_source(y_MH, state.sort_M, ep_size=self.ep_size)  # padding rows last, not sent
        y_NH = all_to_all(y_received_MH, output_splits=state.send_splits, input_splits=state.recv_splits, group=self.group)
        return unpermute(y_NH, state.local)

    def __repr__(self) -> str:
        return f"ExpertParallelDispatcher(ep_size={self.ep_size}, bucket_rows={self.bucket_rows})"


@dataclass
class CapacityState:
    local: PermutationState
    sort_M: torch.Tensor
    slot_N: torch.Tensor
    """Send-buffer row of each routed row; ``ep * capacity`` (a trash row) for dropped rows."""
    kept_N: torch.Tensor


class CapacityExpertParallelDispatcher(TokenDispatcher):
    """Expert parallelism with shapes known to the host: every rank sends each peer ``capacity`` rows.

    ``capacity = ceil(capacity_factor * T*K / ep)``, T the largest token count of the group (every
    rank must send and receive blocks of one size; ``LargestTokenCount``: no host sync under
    CUDA-graph capture or torch.compile, where the counts must be equal); with ``capacity_factor >= ep`` no row is ever
    dropped (results equal ``ExpertParallelDispatcher``'s) at the cost of buffers and expert rows
    ep times the average. Rows over capacity are dropped: their expert output is zero (the token
    keeps its other experts and the residual). Padding rows are sorted last and left out of the
    per-expert counts, so the grouped GEMM never computes them (their output rows are never
    gathered back, and their gradients never reach a token).
    """

    def __init__(self, *, group: dist.ProcessGroup, ep_size: int, capacity_factor: float) -> None:
        if capacity_factor <= 0:
            raise ValueError(f"ep capacity_factor must be positive, got {capacity_factor}")
        self.group = group
        self.ep_size = ep_size
        self.capacity_factor = capacity_factor
        self._largest_tokens = LargestTokenCount(group, what="ep_capacity_factor (the expert-parallel group's tokens)")

    def dispatch(self, x_TH: torch.Tensor, routing: Routing, *, num_experts: int):
        x_NH, counts_E, local = permute(x_TH, routing, num_experts=num_experts)
        num_rows, num_local, ep = x_NH.shape[0], num_experts // self.ep_size, self.ep_size
        # Sized from the group's largest count: a rank with fewer tokens sends padding, so every block
        # of the all-to-all has one size on both sides.
        largest_rows = self._largest_tokens(x_TH.shape[0]) * routing.experts_TK.shape[1]
        capacity = max(1, math.ceil(self.capacity_factor * largest_rows / ep))
        expert_N = routing.experts_TK.reshape(-1).index_select(0, local.order_N)
        dest_N = torch.div(expert_N, num_local, rounding_mode="floor")
        rows_R = counts_E.view(ep, num_local).sum(dim=1)
        start_R = torch.cumsum(rows_R, dim=0) - rows_R
        position_N = torch.arange(num_rows, device=x_NH.device) - start_R.index_select(0, dest_N)
        kept_N = position_N < capacity
        trash = ep * capacity
        slot_N = torch.where(kept_N, dest_N * capacity + position_N, torch.full_like(position_N, trash))
        send_SH = x_NH.new_zeros(trash + 1, x_NH.shape[1]).index_copy(0, slot_N, x_NH)[:trash]
        meta_S = torch.full((trash + 1,), num_local, dtype=torch.int64, device=x_NH.device)
        meta_S = meta_S.index_copy(0, slot_N, expert_N % num_local)[:trash]
        splits = [capacity] * ep
        x_MH = all_to_all(send_SH, output_splits=splits, input_splits=splits, group=self.group)
        expert_M = torch.empty_like(meta_S)
        dist.all_to_all_single(expert_M, meta_S, group=self.group)
        sort_M, counts_L = sort_ids(expert_M, num_local + 1)  # padding (id num_local) last
        counts_L = counts_L[:num_local]
        x_sorted_MH = rows_by_expert(x_MH, sort_M, ep_size=ep)
        return x_sorted_MH, counts_L, CapacityState(local, sort_M, slot_N, kept_N)

    def combine(self, y_MH: torch.Tensor, state: CapacityState) -> torch.Tensor:
        y_received_MH = rows_by_source(y_MH, state.sort_M, ep_size=self.ep_size)
        splits = [y_MH.shape[0] // self.ep_size] * self.ep_size
        y_SH = all_to_all(y_received_MH, output_splits=splits, input_splits=splits, group=self.group)
        y_NH = y_SH.index_select(0, state.slot_N.clamp(max=y_SH.shape[0] - 1))
        y_NH = torch.where(state.kept_N.unsqueeze(-1), y_NH, torch.zeros_like(y_NH))
        return unpermute(y_NH, state.local)

    def __repr__(self) -> str:
        return f"CapacityExpertParallelDispatcher(ep_size={self.ep_size}, capacity_factor={self.capacity_factor})"
