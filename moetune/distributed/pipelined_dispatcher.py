"""Pipelined expert-parallel dispatcher: each MoE layer's tokens are split into C chunks, and on CUDA
the all-to-alls of one chunk run while the experts compute another, in forward and backward (the
overlap DeepEP gives). Results equal ``ExpertParallelDispatcher``'s; on CPU (gloo) the same chunked
code runs with synchronous collectives.

Chunk c is a contiguous range of tokens. One ``permute`` sorts all routed rows by (chunk, expert), so
chunk c's rows are contiguous and sorted by expert; then per chunk: all-to-all (dispatch) -> sort by
local expert -> experts -> unsort -> all-to-all (combine); one ``unpermute`` of all chunks' returned
rows at the end. (Per-chunk permutes and unpermutes were measured slower on 2 H200s: a MoE layer of
4096 tokens is bound by kernel launches once its host sync has drained the GPU, so everything that
does not need a chunk of its own is done once.) One host sync per layer and forward, as
``ExpertParallelDispatcher``: one all-to-all of the per-(chunk, local expert) counts, then one
``.tolist()`` of every chunk's split sizes; the backward reuses them. Every rank issues the same
collectives in the same order, and C does not depend on the rank's token count (a chunk may be
empty), so ranks never disagree.

Streams (moetune/distributed/comm_stream.py): S = the compute stream, K = the communication stream.
Dc / Cc = chunk c's dispatch / combine all-to-all, Ec = its sort + experts + unsort, P / U = the
permute / unpermute. NCCL runs one group's collectives in the order they are issued.

Forward, on the device (time goes right; the code below issues it in this order):

    S: P counts+sync | wait D0: E0 | wait D1: E1 | wait D2: E2 | wait C*: U
    K:                 D0 D1 D2 ..... C0 ......... C1 ......... C2

Every dispatch is queued before any expert runs, so D(c+1) travels while Ec computes, and C(c-1)
while Ec computes; only D0 and the last combine are exposed. K waits for S only when a collective is
launched, for the work queued on S so far, which ends with that collective's input (the permute for
the dispatches, Ec for Cc), never for later compute; S waits for a collective's event on K only
right before it reads the output. The unpermute comes after the last combine is launched, so S never
waits for a combine while there are experts left to compute.

Backward: autograd runs each op's backward on the stream its forward used (the all-to-all's backward,
the transposed all-to-all, on K) and makes a stream wait for a gradient made on another; of the ops
that are ready it runs the one created last in forward first. With the forward order above:

    S: U' | wait C2': E2' | wait C1': E1' | wait C0': E0' | wait D*': P'
    K:      C2' C1' C0' ............................ D2' D1' D0'

The unpermute was created last, so its backward runs first and makes every combine's gradient
ready at once: K sends C2', C1', C0' back to back while S computes E2', E1' (each waits only for its
own chunk's combine). The dispatches were created before any chunk's experts, so their backwards are
issued after all of S's chunk work, but each waits only for its own chunk's E' (an event recorded on
S when its gradient was made): D2' and D1' travel while E0' computes. C2' and D0' are exposed.

Shape legend: T tokens on this rank, H hidden, C chunks, E experts in the model, L = E / ep local
experts, R = ep ranks, N = T*K routed rows, M rows a chunk receives.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from moetune.distributed.comm_stream import CommStream
from moetune.distributed.dispatcher import (
    ExpertParallelDispatcher,
    all_to_all,
    bucketed_row_count,
    exchange_counts,
    received_expert_order,
    rows_by_expert,
    rows_by_source,
)
from moetune.moe.dispatch import Experts, apply_experts, permute, unpermute
from moetune.moe.routing import Routing
from moetune.options import check_ep_overlap_chunks


def chunk_of_tokens(num_tokens: int, num_chunks: int, *, device: torch.device) -> torch.Tensor:
    """Chunk of each token: contiguous ranges [c*T // C, (c+1)*T // C), whose sizes differ by at most
    one; some are empty when T < C (every rank issues the same C collectives whatever its T).
    Token t's chunk is the largest c with c*T // C <= t, which is ((t+1)*C - 1) // T: computed on the
    device, no host-to-device copy."""
    return ((torch.arange(num_tokens, device=device) + 1) * num_chunks - 1) // max(num_tokens, 1)


class PipelinedExpertParallelDispatcher(ExpertParallelDispatcher):
    """``ExpertParallelDispatcher`` whose ``run`` pipelines C chunks of tokens (see the module docstring);
    ``dispatch`` / ``combine`` are the unchunked ones."""

    def __init__(
        self, *, group: dist.ProcessGroup, ep_size: int, num_chunks: int, bucket_rows: bool = False
    ) -> None:
        check_ep_overlap_chunks(num_chunks, capacity_factor=None)
        super().__init__(group=group, ep_size=ep_size, bucket_rows=bucket_rows)
        self.num_chunks = num_chunks
        self._comm_streams: dict[torch.device, CommStream] = {}

    def run(self, x_TH: torch.Tensor, routing: Routing, experts: Experts, *, num_experts: int) -> torch.Tensor:
        comm, ep, num_chunks = self._comm_stream(x_TH.device), self.ep_size, self.num_chunks
        # One permutation for all chunks: the key (chunk, expert) puts each chunk's rows together, sorted
        # by expert as permute() sorts one chunk's; one unpermute at the end undoes it.
        chunk_T = chunk_of_tokens(x_TH.shape[0], num_chunks, device=x_TH.device)
        keyed = routing._replace(experts_TK=routing.experts_TK + num_experts * chunk_T[:, None])
        x_NH, counts, local = permute(x_TH, keyed, num_experts=num_chunks * num_experts)
        recv_counts_CRL, send_splits, recv_splits = exchange_counts(
            counts.view(num_chunks, num_experts), ep_size=ep, group=self.group
        )
        num_rows_C = [sum(r) for r in recv_splits]
        padded_rows_C = num_rows_C
        if self.bucket_rows:
            padded_rows_C = [bucketed_row_count(rows) for rows in num_rows_C]
        sort_C, counts_CL = received_expert_order(recv_counts_CRL, num_rows_C=num_rows_C, padded_rows_C=padded_rows_C)

        def dispatch(c: int):
            return partial(
                all_to_all, output_splits=recv_splits[c], input_splits=send_splits[c], group=self.group,
                output_rows=padded_rows_C[c],
            )  # fmt: skip

        def combine(c: int):
            return partial(all_to_all, output_splits=send_splits[c], input_splits=recv_splits[c], group=self.group)

        # Every chunk's dispatch before any expert: chunk c+1's travels while chunk c computes. (split,
        # not slicing: its backward is one concatenation, not a full-size gradient per chunk.)
        x_chunks = torch.split(x_NH, [sum(s) for s in send_splits])
        dispatched = [comm.launch(dispatch(c), x_nH) for c, x_nH in enumerate(x_chunks)]
        returning = []
        for c, in_flight in enumerate(dispatched):
            x_MH = rows_by_expert(comm.wait(in_flight), sort_C[c], ep_size=ep)
            y_MH = rows_by_source(apply_experts(experts, x_MH, counts_CL[c]), sort_C[c], ep_size=ep)
            returning.append(comm.launch(combine(c), y_MH))
        # Unpermute once every combine is queued (see the module docstring).
        return unpermute(torch.cat([comm.wait(y) for y in returning]), local)

    def _comm_stream(self, device: torch.device) -> CommStream:
        if device not in self._comm_streams:
            self._comm_streams[device] = CommStream(device)
        return self._comm_streams[device]

    def __repr__(self) -> str:
        return (
            f"PipelinedExpertParallelDispatcher(ep_size={self.ep_size}, num_chunks={self.num_chunks}, "
            f"bucket_rows={self.bucket_rows})"
        )
