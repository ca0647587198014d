"""``dense_parallel="replicate"``: every rank keeps full copies of the non-expert parameters (attention,
norms, router, embeddings, LM head) and their gradients are averaged over the ranks, DDP's job.

Why, next to FSDP2's default sharding: with expert parallelism each rank holds only its experts and
the non-expert parameters are small (0.9B of Qwen3-30B-A3B's 30B). Replicated, they cost 8 bytes per
parameter more on every rank, but the step has no FSDP2 all-gathers, no per-layer hooks that manage
parameter storage, and nothing that needs the host: with the all-gather dispatcher the whole
expert-parallel step can be captured in a CUDA graph (moetune.training.CUDAGraphTrainStep).

How: each parameter's gradient is all-reduced (averaged) as soon as autograd has accumulated it, on
NCCL's stream, overlapping the rest of the backward; the end of the backward waits for all of them.
The gradient is reduced in its own dtype (bf16 for bf16 models: one rounding of a two-term sum at
ep = 2). Ranks start equal: the parameters are broadcast from the group's first rank once. With
ep < world (several data-parallel replicas of each expert group, e.g. one ep group per node) the
experts are replicated the same way over the ranks that hold the same experts: each expert's
gradient is all-reduced over those ranks only (``replicate_dense_parameters``). With
gradient accumulation every backward reduces the accumulated gradient again, which is still the
average (the part averaged before is equal on every rank).

The input embedding is the exception (``gather_embedding_gradients``): its gradient is nonzero only
in the rows of the tokens this step saw, so instead of all-reducing the full [vocab, hidden]
gradient (622 MB for Qwen3-30B-A3B, ~2 ms on 2 H200s, exposed: it is the backward's last gradient)
each rank all-gathers every rank's token ids and output gradients (16 MB at 4096 tokens) and builds
the averaged gradient itself.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.distributed.tensor import DTensor

from moetune.distributed.token_counts import LargestTokenCount
from moetune.options import REPLICATE_TRANSPORTS


class ReplicatedGradientSync:
    """Averages the gradients of ``params`` over ``group`` in every backward: NCCL / gloo all-reduces, or
    with ``transport="copy_engine"`` (two CUDA ranks) copy-engine pushes through symmetric memory for
    the plain tensors (``peer_copy.PeerCopyAverage``; DTensor gradients still all-reduce)."""

    def __init__(self, params: Iterable[nn.Parameter], *, group: dist.ProcessGroup, transport: str = "nccl") -> None:
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.world = dist.get_world_size(group)
        # gloo has no AVG reduction: sum, then divide once the reduction is done.
        self.average_in_collective = "nccl" in str(dist.get_backend(group)).lower()
        self.transport = transport
        self._peer = None  # 'copy_engine': plain gradients averaged through symmetric memory (peer_copy.py)
        if transport == "copy_engine":
            from moetune.distributed.peer_copy import PeerCopyAverage

            plain = [p for p in self.params if not isinstance(p, DTensor)]
            self._peer = PeerCopyAverage(plain, group=group) if plain else None
        elif transport not in REPLICATE_TRANSPORTS:
            raise ValueError(f"replicate_transport must be one of {REPLICATE_TRANSPORTS}, got {transport!r}")
        self._ids = {id(p) for p in self.params}
        # id(param) -> its (gradient, all-reduce, averaged) entries issued in this backward (two if autograd
        # accumulated it twice, e.g. reentrant checkpointing), in issue order.
        self._pending: dict[int, list[tuple[torch.Tensor, dist.Work, bool]]] = {}
        self.enabled = True
        """False inside ``no_gradient_sync``: gradients accumulate locally, unreduced."""
        self._handles = [p.register_post_accumulate_grad_hook(self._reduce) for p in self.params]
        _install_optimizer_check()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _reduce(self, param: nn.Parameter) -> None:
        if not self.enabled:
            return
        op = dist.ReduceOp.AVG if self.average_in_collective else dist.ReduceOp.SUM
        # An expert's DTensor gradient (replicated over the ranks holding the same experts): its local
        # tensor, in place.
        grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
        if self._peer is not None and self._peer.covers(param, grad):
            work, averaged = self._peer.average(param, grad), True
        else:
            work, averaged = dist.all_reduce(grad, op=op, group=self.group, async_op=True), self.average_in_collective
        self._pending.setdefault(id(param), []).append((grad, work, averaged))
        # Queued by every hook (the later calls find nothing left to wait for): no state that a
        # backward interrupted by an exception could leave stale for the next one.
        torch.autograd.Variable._execution_engine.queue_callback(self._wait_all)

    def wait_for(self, param: nn.Parameter) -> bool:
        """Make the current stream wait for ``param``'s all-reduce of this backward (averaged once this
        returns); False if this sync did not issue one. For work that needs one reduced gradient before
        the backward ends (``CUDAGraphTrainStep(overlap_optimizer=True)`` updates each parameter then)."""
        pending = self._pending.pop(id(param), [])
        for grad, work, averaged in pending:
            self._finish(grad, work, averaged)
        return bool(pending)

    def reduces(self, param: nn.Parameter) -> bool:
        """Whether ``param``'s gradient is averaged by this sync (in the backwards it is enabled for)."""
        return id(param) in self._ids

    def _wait_all(self) -> None:
        pending, self._pending = self._pending, {}
        for entries in pending.values():
            for grad, work, averaged in entries:
                self._finish(grad, work, averaged)

    def _finish(self, grad: torch.Tensor, work, averaged: bool) -> None:
        work.wait()
        if not averaged:
            grad.div_(self.world)


@contextlib.contextmanager
def no_gradient_sync(syncs: Iterable[ReplicatedGradientSync]) -> Iterator[None]:
    """DDP's ``no_sync``: the backwards inside leave their gradients unreduced (each rank accumulates
    its own); the first backward after it reduces the accumulated sums, which averages them all, as
    the sum of averages would (averaging is linear). For gradient accumulation: all but the last
    micro-batch inside, so each step all-reduces once instead of once per micro-batch. The input
    embedding's gathered gradient is averaged in every backward either way (it stays correct)."""
    syncs = list(syncs)
    previous = [sync.enabled for sync in syncs]
    for sync in syncs:
        sync.enabled = False
    try:
        yield
    finally:
        for sync, enabled in zip(syncs, previous):
            sync.enabled = enabled


class _EmbeddingGatheredGrad(torch.autograd.Function):
    """``F.embedding(ids, weight)`` whose weight gradient is the average over the ranks of
    ``token_counts.group``, built on every rank from all ranks' ids and output gradients (rows no rank
    saw stay zero)."""

    @staticmethod
    def forward(ctx, ids, weight, padding_idx, token_counts: LargestTokenCount):
        ctx.save_for_backward(ids)
        ctx.padding_idx, ctx.num_weights, ctx.token_counts = padding_idx, weight.shape[0], token_counts
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad_out):
        (ids,) = ctx.saved_tensors
        ids_N, grad_NH = _gather_padded(ids.reshape(-1), grad_out.reshape(-1, grad_out.shape[-1]), ctx.token_counts)
        padding_idx = -1 if ctx.padding_idx is None else ctx.padding_idx
        grad_weight = torch.ops.aten.embedding_dense_backward(grad_NH, ids_N, ctx.num_weights, padding_idx, False)
        return None, grad_weight.div_(dist.get_world_size(ctx.token_counts.group)), None, None


def _gather_padded(ids_N, grad_NH, token_counts: LargestTokenCount):
    """Every rank's ids and gradient rows, concatenated. Ranks with fewer tokens than the longest
    (eager calls only, ``token_counts``) are padded with zero rows of id 0: they add nothing."""
    group, world = token_counts.group, dist.get_world_size(token_counts.group)
    num = ids_N.shape[0]
    longest = token_counts(num)
    if longest > num:
        ids_N = torch.cat([ids_N, ids_N.new_zeros(longest - num)])
        grad_NH = torch.cat([grad_NH, grad_NH.new_zeros(longest - num, grad_NH.shape[1])])
    all_ids = ids_N.new_empty(world * longest)
    all_grads = grad_NH.new_empty(world * longest, grad_NH.shape[1])
    dist.all_gather_into_tensor(all_ids, ids_N.contiguous(), group=group)
    dist.all_gather_into_tensor(all_grads, grad_NH.contiguous(), group=group)
    return all_ids, all_grads


class _GatheredGradEmbedding:
    """Mixed into an ``nn.Embedding``'s class (FSDP2's pattern: the module and its state dict stay
    as they are): the forward's weight gradient comes averaged over the replicas."""

    _token_counts: LargestTokenCount  # its group is the replicas'

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return _EmbeddingGatheredGrad.apply(input, self.weight, self.padding_idx, self._token_counts)


_gathered_classes: dict[type, type] = {}


def gather_embedding_gradients(embedding: nn.Module, *, group: dist.ProcessGroup) -> bool:
    """Make ``embedding`` (a plain, trainable ``nn.Embedding``) produce its weight gradient already
    averaged over ``group`` from the gathered tokens; returns False (nothing changed) for any other
    module, which then needs the all-reduce."""
    if isinstance(embedding, _GatheredGradEmbedding):  # already (a resize keeps the module)
        return embedding.weight.requires_grad
    plain = type(embedding).forward is nn.Embedding.forward and isinstance(embedding, nn.Embedding)
    if not plain or not embedding.weight.requires_grad or embedding.max_norm is not None or embedding.sparse \
            or embedding.scale_grad_by_freq:  # fmt: skip
        return False
    cls = type(embedding)
    if cls not in _gathered_classes:
        _gathered_classes[cls] = type(f"GatheredGrad{cls.__name__}", (_GatheredGradEmbedding, cls), {})
    embedding.__class__ = _gathered_classes[cls]
    embedding._token_counts = LargestTokenCount(group, what="dense_parallel='replicate' (the input embedding's gradient)")
    return True


@torch.no_grad()
def broadcast_parameters(params: Iterable[torch.Tensor], *, group: dist.ProcessGroup) -> None:
    """Make every rank's copy equal to the group's first rank's (after random init or loading)."""
    src = dist.get_global_rank(group, 0)
    for param in params:
        dist.broadcast(param.to_local() if isinstance(param, DTensor) else param.data, src=src, group=group)


_checked_optimizers: weakref.WeakSet = weakref.WeakSet()
_optimizer_check_installed = False


def _install_optimizer_check() -> None:
    global _optimizer_check_installed
    if not _optimizer_check_installed:
        register_optimizer_step_pre_hook(check_optimizer_tensor_kinds)
        _optimizer_check_installed = True


def mixes_plain_and_dtensors(params: Iterable[torch.Tensor]) -> bool:
    """Whether ``params`` hold both plain tensors and DTensors (what torch's foreach / fused
    optimizer kernels cannot take in one list)."""
    return len({isinstance(p, DTensor) for p in params}) > 1


def check_optimizer_tensor_kinds(optimizer: torch.optim.Optimizer, *_args) -> None:
    """A replicated model mixes plain parameters with the experts' DTensors; torch's foreach / fused
    kernels cannot take both in one list (a DTensor "mixed torch.Tensor and DTensor" error deep in the
    step). Raise a clear error on an optimizer's first step instead; moetune's AdamW steps each
    tensor on its own and takes both."""
    if optimizer in _checked_optimizers:
        return
    _checked_optimizers.add(optimizer)
    if type(optimizer).__module__.startswith("moetune."):
        return
    for index, group in enumerate(optimizer.param_groups):
        params = group["params"]
        mixed = mixes_plain_and_dtensors(params)
        multi_tensor = group.get("fused") or group.get("foreach") or (
            group.get("foreach") is None and all(p.is_cuda for p in params)  # torch's default on CUDA
        )
        if mixed and multi_tensor:
            raise ValueError(
                f"{type(optimizer).__name__} param group {index} mixes replicated plain parameters with expert-parallel "
                "DTensors (dense_parallel='replicate'), which torch's foreach / fused kernels cannot step together: "
                "use moetune.optim.AdamW, pass foreach=False, or put the experts' parameters in their own param group"
            )
