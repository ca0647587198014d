"""Expert parallelism that a CUDA graph can capture: all-gather the tokens of the ep group, run this
rank's experts on every routed copy that chose one of them, reduce-scatter the partial outputs back
(Megatron-LM's all-gather token dispatcher). With equal token counts on the ranks every shape is
fixed and nothing waits for the host.

Why: ``ExpertParallelDispatcher``'s all-to-all needs its split sizes on the host, one
synchronisation per MoE layer, so its step cannot be captured in a CUDA graph and on 2 H200s it
is bound by the host (benchmarks/README.md). Here every shape depends only on (ep, T, K, H): with
``dense_parallel="replicate"`` the whole expert-parallel step is captured by
``moetune.training.CUDAGraphTrainStep``.

Bytes: each rank receives the (ep - 1) * T tokens of its peers once, where the all-to-all sends
the ~T * K * (ep - 1) / ep routed copies: fewer bytes whenever ep <= K (4x fewer at ep = 2, K = 8).
Rows: the experts' row buffer holds all ep * T * K routed copies of the gathered tokens, those of
local experts first (sorted by expert) and the rest as padding that the grouped GEMM skips; the
experts take the gathered tokens and the order (``gather_order``) and keep no second copy of the
rows for the backward; the permutation, SwiGLU and combine kernels skip the padding rows (their
count stays on the device). Outputs are combined per token in fp32 and reduce-scattered in fp32
(twice the bytes of bf16, 32 MB per layer at 4096 tokens x 2048), so every output is rounded to
the model dtype once, as on one device.

Ranks may pass different numbers of tokens in eager calls (generation, unpacked batches): each call
first gathers the counts (one host synchronisation per layer, as the all-to-all dispatcher) and
pads the shorter ranks with tokens routed nowhere. Calls being captured in a CUDA graph skip that
exchange and need equal counts (packed micro-batches); an uneven eager warm-up makes the capture
raise.

Shape legend: T tokens on this rank, H hidden, K experts per token, R = ep ranks, G = R * T
gathered tokens, E experts in the model, L = E / R experts on this rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moetune.distributed.collectives import gather_rows, scatter_sum_rows
from moetune.distributed.dispatcher import scale_grad
from moetune.distributed.token_counts import LargestTokenCount
from moetune.kernels.permute import combine_rows, combine_rows_backward
from moetune.moe.dispatch import TokenDispatcher, apply_experts, sort_ids
from moetune.moe.routing import Routing

class CombineReduceScatter(torch.autograd.Function):
    """Each gathered token's weighted sum of this rank's expert outputs (fp32 partial sums), summed
    over the ranks and scattered back to the tokens' ranks, rounded to ``out_dtype`` once.

    Padding rows (copies routed to other ranks) are undefined memory: the combine never reads them.
    The partial sums stay in fp32 through the reduce-scatter, so each token's output is rounded to
    the model dtype once, as on one device: bf16 outputs equal the local dispatcher's, and routing
    decisions downstream do not flip on rounding differences. The backward all-gathers the output's
    gradient in that dtype (exact: it is the gradient of a rounded tensor; half the bytes of fp32)
    and hands it to the combine's backward, which scales the rows' gradient by 1 / ep in the
    weights it multiplies by anyway (``dispatcher.rows_by_source``)."""

    @staticmethod
    def forward(ctx, y_NH, weights_GK, order_N, num_valid, group, world: int, out_dtype: torch.dtype):
        ctx.save_for_backward(y_NH, weights_GK, order_N, num_valid)
        ctx.group, ctx.world = group, world
        partial_GH = combine_rows(y_NH, weights_GK, order_N, num_valid=num_valid, out_dtype=_partial_dtype(y_NH))
        return scatter_sum_rows(partial_GH, group, world).to(out_dtype)

    @staticmethod
    def backward(ctx, dout_TH):
        y_NH, weights_GK, order_N, num_valid = ctx.saved_tensors
        dout_GH = gather_rows(dout_TH, ctx.group, ctx.world)
        dy_NH, dw_GK = combine_rows_backward(
            dout_GH, y_NH, weights_GK, order_N, num_valid=num_valid, need_weights_grad=ctx.needs_input_grad[1],
            rows_grad_scale=1.0 / ctx.world,
        )  # fmt: skip
        return dy_NH, dw_GK, None, None, None, None, None


class _AllGatherTokens(torch.autograd.Function):
    """The dispatch's three all-gathers (tokens, routing weights, expert ids) as one collective: the
    bytes of each token's row of the three are packed side by side, so a layer pays one collective's
    latency on its critical path instead of three. The gathered parts are strided views of the
    packed rows (the gather kernel takes a row stride), in their own dtypes: no cast kernels. The
    backward reduce-scatters the two gradients: block r of the summed gradient goes to rank r."""

    @staticmethod
    def forward(ctx, x_TH, weights_TK, experts_TK, group, world: int):
        ctx.group, ctx.world = group, world
        parts = [x_TH, weights_TK, experts_TK]
        rows = [_as_bytes(part) for part in parts]
        pad = -sum(row.shape[1] for row in rows) % _ROW_ALIGN  # every gathered token row starts on a line
        if pad:
            rows.append(rows[0].new_empty(rows[0].shape[0], pad))  # never read: no fill kernel
        packed_GB = gather_rows(torch.cat(rows, 1), group, world)
        x_GH, weights_GK, experts_GK = _unpack(packed_GB, parts)
        ctx.mark_non_differentiable(experts_GK)
        return x_GH, weights_GK, experts_GK

    @staticmethod
    def backward(ctx, dx_GH, dweights_GK, _):
        dx_TH = scatter_sum_rows(dx_GH, ctx.group, ctx.world) if ctx.needs_input_grad[0] else None
        dweights_TK = scatter_sum_rows(dweights_GK, ctx.group, ctx.world) if ctx.needs_input_grad[1] else None
        return dx_TH, dweights_TK, None, None, None


_ALIGN = 8  # bytes: every packed part starts where any dtype's view of it is aligned
# Bytes: packed rows are padded to whole 128-byte lines, so that the experts' gather reads each
# token's hidden row from aligned lines (a Qwen3-30B-A3B token's 4096-byte row + its weights and ids -> 4224).
_ROW_ALIGN = 128


def _as_bytes(x_TX: torch.Tensor) -> torch.Tensor:
    """[T, X] as [T, bytes] of uint8, padded (never read) to a multiple of ``_ALIGN`` bytes."""
    bytes_TB = x_TX.contiguous().view(torch.uint8)
    pad = -bytes_TB.shape[1] % _ALIGN
    return bytes_TB if pad == 0 else torch.cat([bytes_TB, bytes_TB.new_empty(bytes_TB.shape[0], pad)], 1)


def _unpack(packed_GB: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Strided views of ``packed_GB``'s parts, in the dtypes and widths of ``like``."""
    parts, start = [], 0
    for part in like:
        width = part.shape[1] * part.element_size()
        parts.append(packed_GB[:, start : start + width].view(part.dtype))
        start += width + (-width % _ALIGN)
    return parts


class AllGatherExpertParallelDispatcher(TokenDispatcher):
    """Rank r holds experts [r*L, (r+1)*L); ``run`` = all-gather -> local experts -> reduce-scatter."""

    def __init__(self, *, group: dist.ProcessGroup, ep_size: int) -> None:
        self.group = group
        self.ep_size = ep_size
        self.rank = dist.get_rank(group)
        # The largest token count of the group (eager: one host sync); under capture this rank's own.
        self._padded_tokens = LargestTokenCount(
            group, what="ep_dispatch='allgather' (the tokens of the expert-parallel group)"
        )  # fmt: skip

    # Eager inside a torch.compile'd layer (its experts run eagerly there anyway): torch 2.11's dynamo,
    # tracing CombineReduceScatter after the experts' graph break, returned an output with no gradient
    # path (the MoE block's parameters got none; tests/distributed/workers.compiled_layers_parity).
    @torch.compiler.disable
    def run(self, x_TH: torch.Tensor, routing: Routing, experts, *, num_experts: int) -> torch.Tensor:
        ep, group, top_k = self.ep_size, self.group, routing.experts_TK.shape[1]
        num_tokens = x_TH.shape[0]
        num_local = num_experts // ep
        padded_tokens = self._padded_tokens(num_tokens)
        if padded_tokens > num_tokens:  # a shorter micro-batch than a peer's (eager only): pad it
            x_TH, routing = _pad_tokens(x_TH, routing, padded_tokens, num_experts=num_experts)
        # Expert weights' gradients: see dispatcher.rows_by_source (scaled by 1/ep entering the experts,
        # folded into the combine's backward; by ep leaving them, applied here to the T rows, not the ep*T).
        x_GH, weights_GK, experts_GK = _AllGatherTokens.apply(
            scale_grad(x_TH, float(ep)), routing.weights_TK, routing.experts_TK, group, ep
        )  # fmt: skip
        # Local expert id, or num_local for copies routed to another rank (sorted last: padding).
        local_GK = experts_GK - self.rank * num_local
        key_N = torch.where((local_GK >= 0) & (local_GK < num_local), local_GK, num_local).reshape(-1)
        order_N, counts_L = sort_ids(key_N, num_local + 1)
        counts_L = counts_L[:num_local]
        num_valid = counts_L.sum().reshape(1)  # this rank's rows; the rest of the ep*T*K slots are padding
        y_NH = apply_experts(experts, x_GH, counts_L, gather_order=order_N, gather_top_k=top_k)
        out_TH = CombineReduceScatter.apply(y_NH, weights_GK, order_N, num_valid, group, ep, x_TH.dtype)
        return out_TH if padded_tokens == num_tokens else out_TH[:num_tokens]

    def dispatch(self, x_TH, routing, *, num_experts):
        raise NotImplementedError("AllGatherExpertParallelDispatcher combines inside run(); call run()")

    def combine(self, y_NH, state):
        raise NotImplementedError("AllGatherExpertParallelDispatcher combines inside run(); call run()")

    def __repr__(self) -> str:
        return f"AllGatherExpertParallelDispatcher(ep_size={self.ep_size})"


def _pad_tokens(x_TH: torch.Tensor, routing: Routing, num_tokens: int, *, num_experts: int) -> tuple[torch.Tensor, Routing]:
    """Pad to ``num_tokens`` with zero rows routed to expert id ``num_experts`` (on no rank: padding
    slots everywhere) with weight 0; the caller drops their outputs."""
    extra = num_tokens - x_TH.shape[0]
    x_TH = torch.cat([x_TH, x_TH.new_zeros(extra, x_TH.shape[1])])
    weights_TK = torch.cat([routing.weights_TK, routing.weights_TK.new_zeros(extra, routing.weights_TK.shape[1])])
    experts_TK = torch.cat([routing.experts_TK, routing.experts_TK.new_full((extra, routing.experts_TK.shape[1]), num_experts)])
    return x_TH, Routing(routing.logits_TE, weights_TK, experts_TK)


def _partial_dtype(y: torch.Tensor) -> torch.dtype:
    return torch.promote_types(y.dtype, torch.float32)
