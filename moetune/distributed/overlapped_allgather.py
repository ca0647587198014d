"""The all-gather dispatcher with its collectives hidden behind the experts (``ep_dispatch=
"allgather_overlap"``): the experts run on this rank's own tokens while the peers' tokens are in
flight, and the second projection of the own tokens runs while the partial sums of the peers' tokens
travel back. Results equal ``AllGatherExpertParallelDispatcher``'s (up to rounding); CUDA-graph capturable as it is.

Why: in the all-gather dispatcher each collective sits on its layer's critical path: the experts
need the gathered tokens, the next layer needs the reduce-scattered outputs. On 2 H200s (row B of
benchmarks/README.md) that is ~5 ms of a ~113 ms step, most of it the forward's fp32 reduce-scatter.
The experts' work splits by where a token comes from, without changing what any GEMM computes: each
rank runs its local experts on its own tokens (no communication needed) and on its peers' tokens.

Forward of one MoE layer (S = compute stream, K = communication stream; time goes right):

    S: pack | own: sort, gate_up, act | wait G: peers: sort, gate_up, act, down, combine | own: down, combine | wait R: add
    K:        G: all-gather own tokens ...                                     R: reduce-scatter peers' sums ....

The all-gather G travels while the own tokens' first projection computes, the reduce-scatter R while
their second projection and combine compute. Each token's output is its own rank's partial sum plus
the peers' (received through R: the own block of R's input is zero), in fp32, rounded to the model
dtype once, as in the all-gather dispatcher. (Not bit-equal to it: each expert's weight gradient is
now the sum of two GEMMs', the own rows' and the peers'.) Experts that are not ``GroupedExperts`` run whole (own, then peers): only the combine
overlaps R.

Backward (autograd runs the ready op created last in forward first; the Functions below launch each
collective as soon as its input exists and wait for it only where its output is read):

    S: own combine' | own down', act' | wait G': peers: combine', down', act', gate_up' | own gate_up' | wait R': add
    K: G': all-gather the output's gradient ...                        R': reduce-scatter dx of peers' tokens ...

Rows: the own call sorts the T * K routed copies of this rank's tokens, the peers' call the G * K of
the gathered ones with the own block marked as padding (routed to no local expert): the kernels skip
padding rows, so each routed copy is computed once. Each call's GEMMs have about half the rows of the
all-gather dispatcher's single call (benchmarks/README.md measures what that costs).

Shape legend: T tokens on this rank, H hidden, K experts per token, R = ep ranks, G = R * T gathered
tokens, E experts in the model, L = E / R experts on this rank, N routed rows of a call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from moetune.distributed.allgather_dispatcher import (
    AllGatherExpertParallelDispatcher,
    _gather,
    _pack_rows,
    _pad_tokens,
    _partial_dtype,
    _scatter_sum,
    _unpack,
)
from moetune.distributed.comm_stream import CommStream, InFlight
from moetune.distributed.dispatcher import scale_grad
from moetune.distributed.peer_exchange import PeerExchange
from moetune.kernels.permute import combine_rows, combine_rows_backward
from moetune.moe.dispatch import apply_experts, sort_ids
from moetune.moe.experts import GroupedExperts
from moetune.moe.routing import Routing


class NcclTransport:
    """The dispatcher's all-gather and reduce-scatter as NCCL (gloo on CPU) collectives launched from
    the communication stream (comm_stream.py); any ep."""

    def __init__(self, *, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group, self.world = group, dist.get_world_size(group)
        self.comm = CommStream.on(device)

    def gather(self, x: torch.Tensor) -> InFlight:
        return self.comm.launch(lambda t: _gather(t, self.group, self.world), x)

    def scatter_sum(self, x: torch.Tensor) -> InFlight:
        return self.comm.launch(lambda t: _scatter_sum(t, self.group, self.world), x)


@dataclass
class _Layer:
    """One MoE layer call's collectives in flight, handed from the Function that launches each to the
    Function that reads its output (forward and backward)."""

    transport: NcclTransport | PeerExchange
    world: int
    tokens: InFlight | None = None  # forward: the packed rows of every rank's tokens
    peer_sums: InFlight | None = None  # forward: the peers' partial sums of this rank's tokens
    output_grad: InFlight | None = None  # backward: every rank's output gradient
    token_grads: list[InFlight] = field(default_factory=list)  # backward: this rank's tokens' gradients from the peers

    def gather(self, x: torch.Tensor) -> InFlight:
        return self.transport.gather(x)

    def scatter_sum(self, x: torch.Tensor) -> InFlight:
        return self.transport.scatter_sum(x)

    def wait(self, pending: InFlight) -> torch.Tensor:
        return self.transport.comm.wait(pending)


class _LaunchTokenGather(torch.autograd.Function):
    """Starts the all-gather of this rank's tokens, routing weights and expert ids (one packed
    collective) and returns the gathered parts while they are still in flight: ``_AwaitTokens`` makes
    the compute stream wait before anything reads them. The backward returns the gradients of this
    rank's tokens and weights that the peers computed (reduce-scattered, launched by ``_AwaitTokens``'s
    backward)."""

    @staticmethod
    def forward(ctx, x_TH, weights_TK, experts_TK, layer: _Layer):
        ctx.layer = layer
        parts = [x_TH, weights_TK, experts_TK]
        layer.tokens = layer.gather(_pack_rows(parts))
        x_GH, weights_GK, experts_GK = _unpack(layer.tokens.tensor, parts)
        ctx.mark_non_differentiable(experts_GK)
        return x_GH, weights_GK, experts_GK

    @staticmethod
    def backward(ctx, _dx_GH, _dweights_GK, _):
        layer = ctx.layer
        dx_TH, dweights_TK = (layer.wait(pending) if pending is not None else None for pending in layer.token_grads)
        return dx_TH, dweights_TK, None, None


class _AwaitTokens(torch.autograd.Function):
    """The compute stream waits for the gathered tokens (identity on them). The backward launches the
    reduce-scatter of the peers' tokens' gradients as soon as they exist; the own tokens' backward
    computes while it travels."""

    @staticmethod
    def forward(ctx, x_GH, weights_GK, layer: _Layer):
        ctx.layer = layer
        layer.wait(layer.tokens)
        return x_GH.view_as(x_GH), weights_GK.view_as(weights_GK)

    @staticmethod
    def backward(ctx, dx_GH, dweights_GK):
        layer = ctx.layer
        layer.token_grads = [
            None if grad is None else layer.scatter_sum(grad.contiguous()) for grad in (dx_GH, dweights_GK)
        ]
        return dx_GH, dweights_GK, None


class _CombineAndSendPeerSums(torch.autograd.Function):
    """The weighted sums of this rank's expert outputs for every gathered token (fp32; zero for the own
    block, whose copies are the own call's), reduce-scattered to the tokens' ranks on the communication
    stream. Returns an empty tensor that only links this op into the graph: ``_FinishCombine`` reads the
    result. The backward reads the all-gathered output gradient (launched by ``_FinishCombine``'s
    backward) and scales the rows' gradient by 1 / ep (see ``dispatcher.rows_by_source``)."""

    @staticmethod
    def forward(ctx, y_NH, weights_GK, order_N, num_valid, layer: _Layer):
        ctx.save_for_backward(y_NH, weights_GK, order_N, num_valid)
        ctx.layer = layer
        partial_GH = combine_rows(y_NH, weights_GK, order_N, num_valid=num_valid, out_dtype=_partial_dtype(y_NH))
        layer.peer_sums = layer.scatter_sum(partial_GH)
        return y_NH.new_empty(0)

    @staticmethod
    def backward(ctx, _):
        y_NH, weights_GK, order_N, num_valid = ctx.saved_tensors
        dout_GH = ctx.layer.wait(ctx.layer.output_grad)
        dy_NH, dw_GK = combine_rows_backward(
            dout_GH, y_NH, weights_GK, order_N, num_valid=num_valid, need_weights_grad=ctx.needs_input_grad[1],
            rows_grad_scale=1.0 / ctx.layer.world,
        )  # fmt: skip
        return dy_NH, dw_GK, None, None, None


class _FinishCombine(torch.autograd.Function):
    """This rank's tokens' output: the weighted sum of the own call's rows plus the peers' sums (fp32),
    rounded to ``out_dtype`` once. The backward first launches the all-gather of the output gradient
    (the peers' calls need it), then computes the own rows' gradient while it travels."""

    @staticmethod
    def forward(ctx, y_NH, weights_TK, order_N, num_valid, link, layer: _Layer, out_dtype: torch.dtype):
        ctx.save_for_backward(y_NH, weights_TK, order_N, num_valid)
        ctx.layer, ctx.link = layer, (link.dtype, link.device)
        own_TH = combine_rows(y_NH, weights_TK, order_N, num_valid=num_valid, out_dtype=_partial_dtype(y_NH))
        return own_TH.add_(layer.wait(layer.peer_sums)).to(out_dtype)

    @staticmethod
    def backward(ctx, dout_TH):
        y_NH, weights_TK, order_N, num_valid = ctx.saved_tensors
        layer = ctx.layer
        layer.output_grad = layer.gather(dout_TH.contiguous())
        dy_NH, dw_TK = combine_rows_backward(
            dout_TH, y_NH, weights_TK, order_N, num_valid=num_valid, need_weights_grad=ctx.needs_input_grad[1],
            rows_grad_scale=1.0 / layer.world,
        )  # fmt: skip
        dlink = torch.empty(0, dtype=ctx.link[0], device=ctx.link[1])  # runs the peers' sums' backward
        return dy_NH, dw_TK, None, None, dlink, None, None


class OverlappedAllGatherDispatcher(AllGatherExpertParallelDispatcher):
    """``AllGatherExpertParallelDispatcher`` with the own tokens' experts computed while the collectives
    travel (module docstring). ``transport``: 'nccl' (NCCL / gloo collectives, any ep) or 'copy_engine'
    (ep = 2 on CUDA: copy-engine swaps through symmetric memory, no SMs; ``peer_exchange.py``)."""

    def __init__(self, *, group: dist.ProcessGroup, ep_size: int, transport: str = "nccl") -> None:
        super().__init__(group=group, ep_size=ep_size)
        self.transport = transport
        self._transports: dict[torch.device, NcclTransport | PeerExchange] = {}

    def run(self, x_TH: torch.Tensor, routing: Routing, experts, *, num_experts: int) -> torch.Tensor:
        ep, top_k = self.ep_size, routing.experts_TK.shape[1]
        num_tokens = x_TH.shape[0]
        num_local = num_experts // ep
        padded_tokens = self._padded_tokens(num_tokens)
        if padded_tokens > num_tokens:  # a shorter micro-batch than a peer's (eager only): pad it
            x_TH, routing = _pad_tokens(x_TH, routing, padded_tokens, num_experts=num_experts)
        layer = _Layer(self._transport(x_TH.device), ep)
        # Expert weights' gradients: see dispatcher.rows_by_source (as in the all-gather dispatcher).
        x_TH = scale_grad(x_TH, float(ep))
        x_GH, weights_GK, experts_GK = _LaunchTokenGather.apply(x_TH, routing.weights_TK, routing.experts_TK, layer)
        staged = isinstance(experts, GroupedExperts)

        own_order_N, own_counts_L, own_valid = self._sort(routing.experts_TK, num_local)
        own = dict(gather_order=own_order_N, gather_top_k=top_k)
        own_rows = experts(x_TH, own_counts_L, part="in", **own) if staged else apply_experts(experts, x_TH, own_counts_L, **own)

        x_GH, weights_GK = _AwaitTokens.apply(x_GH, weights_GK, layer)
        own_block = slice(self.rank * padded_tokens, (self.rank + 1) * padded_tokens)
        experts_GK = experts_GK.clone()
        experts_GK[own_block] = num_experts  # the own call's copies: padding here
        peer_order_N, peer_counts_L, peer_valid = self._sort(experts_GK, num_local)
        y_peer_NH = apply_experts(experts, x_GH, peer_counts_L, gather_order=peer_order_N, gather_top_k=top_k)
        link = _CombineAndSendPeerSums.apply(y_peer_NH, weights_GK, peer_order_N, peer_valid, layer)

        y_own_NH = experts(own_rows, own_counts_L, part="out") if staged else own_rows
        out_TH = _FinishCombine.apply(y_own_NH, routing.weights_TK, own_order_N, own_valid, link, layer, x_TH.dtype)
        return out_TH if padded_tokens == num_tokens else out_TH[:num_tokens]

    def _transport(self, device: torch.device) -> NcclTransport | PeerExchange:
        if device not in self._transports:
            kind = PeerExchange if self.transport == "copy_engine" else NcclTransport
            self._transports[device] = kind(group=self.group, device=device)
        return self._transports[device]

    def _sort(self, experts_XK: torch.Tensor, num_local: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(order of the routed copies by local expert, copies per local expert, valid rows [1]): copies
        routed to another rank's experts sort last, as padding."""
        local_XK = experts_XK - self.rank * num_local
        key_N = torch.where((local_XK >= 0) & (local_XK < num_local), local_XK, num_local).reshape(-1)
        order_N, counts = sort_ids(key_N, num_local + 1)
        counts_L = counts[:num_local]
        return order_N, counts_L, counts_L.sum().reshape(1)

    def __repr__(self) -> str:
        return f"OverlappedAllGatherDispatcher(ep_size={self.ep_size}, transport={self.transport!r})"
