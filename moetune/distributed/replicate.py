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
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.distributed.tensor import DTensor

from moetune.distributed.token_counts import LargestTokenCount


DEFAULT_BUCKET_MB = 64.0


class _Bucket:
    """Gradients of several parameters (one dtype, in the order the backward produces them) reduced as
    one flat tensor: each gradient is copied in as it arrives, the bucket's all-reduce starts when the
    last one has, and the averaged values are copied back into the parameters' own ``.grad`` tensors
    (which are never replaced, so captured graphs and accumulating backwards keep their buffers)."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        sizes = [p.numel() for p in params]
        self.params = params
        self.flat = torch.empty(sum(sizes), dtype=params[0].dtype, device=params[0].device)
        self.views = list(self.flat.split(sizes))
        self.slot = {id(p): i for i, p in enumerate(params)}
        self.reset()

    def reset(self) -> None:
        self.arrived: dict[int, torch.Tensor] = {}  # slot -> the gradient copied in (copied back to)
        self.alone: set[int] = set()  # slots reduced on their own in this backward (see _reduce)
        self.reduction: _Reduction | None = None
        self.waiting: list[Callable[[], None]] = []  # after_reduction callbacks until the launch

    @property
    def complete(self) -> bool:
        return len(self.arrived) + len(self.alone - self.arrived.keys()) == len(self.params)


class _Reduction:
    """One issued all-reduce; ``finish`` (once) waits for it, averages on backends without AVG and
    copies a bucket's values back."""

    def __init__(self, tensor: torch.Tensor, work: dist.Work, bucket: _Bucket | None = None) -> None:
        self.tensor, self.work, self.bucket = tensor, work, bucket
        self.done = False

    def finish(self, divide_by: int | None) -> None:
        if self.done:
            return
        self.done = True
        self.work.wait()
        if divide_by is not None:
            self.tensor.div_(divide_by)
        if self.bucket is not None:
            for slot, grad in self.bucket.arrived.items():
                if slot not in self.bucket.alone:
                    grad.copy_(self.bucket.views[slot].view_as(grad))


class ReplicatedGradientSync:
    """Averages the gradients of ``params`` over ``group`` in every backward.

    ``bucket_mb``: gradients smaller than this are all-reduced together in buckets of about that
    size, DDP's way; each collective is a rendezvous of the ranks and a kernel that holds SMs until
    the peer arrives, and one per parameter (146 per step for a 16-layer Qwen3-30B-A3B) cost ~5 ms of
    a ~113 ms expert-parallel step on 2 H200s (benchmarks/README.md). Buckets hold consecutive
    parameters in reverse registration order (about the backward's order); larger gradients and
    DTensor gradients are reduced on their own, in place. Every rank must produce the gradients in
    the same order, as for any collective.
    """

    def __init__(
        self, params: Iterable[nn.Parameter], *, group: dist.ProcessGroup, bucket_mb: float | None = DEFAULT_BUCKET_MB
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.world = dist.get_world_size(group)
        # gloo has no AVG reduction: sum, then divide once the reduction is done.
        self.average_in_collective = "nccl" in str(dist.get_backend(group)).lower()
        self.bucket_mb = bucket_mb
        self.bucket_bytes = None if not bucket_mb else int(bucket_mb * 2**20)
        self._ids = {id(p) for p in self.params}
        self._buckets = _make_buckets(self.params, self.bucket_bytes) if self.bucket_bytes else []
        self._bucket_of = {id(p): bucket for bucket in self._buckets for p in bucket.params}
        # id(param) -> the reductions issued for it in this backward (its bucket's, and its own if
        # autograd accumulated it twice, e.g. reentrant checkpointing), in issue order.
        self._pending: dict[int, list[_Reduction]] = {}
        self._task: int | None = None  # the backward (autograd graph task) the buckets' state belongs to
        self._warned = False
        self.enabled = True
        """False inside ``no_gradient_sync``: gradients accumulate locally, unreduced."""
        self._handles = [p.register_post_accumulate_grad_hook(self._reduce) for p in self.params]
        _install_optimizer_check()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    def _reduce(self, param: nn.Parameter) -> None:
        if not self.enabled:
            return
        # An expert's DTensor gradient (replicated over the ranks holding the same experts): its local
        # tensor, in place.
        grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
        task = torch._C._current_graph_task_id()
        if self._task is None:
            self._task = task  # the backward whose end (_wait_all) launches what is left and resets the buckets
        bucket = self._bucket_of.get(id(param))
        if task != self._task:
            # A backward nested in the one that owns the buckets (reentrant checkpointing), or one after
            # a backward that an exception interrupted (its buckets never reset): reduced on its own.
            self._warn_unbucketed()
            if bucket is not None:
                bucket.alone.add(bucket.slot[id(param)])
            self._reduce_alone(param, grad)
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_pending)
            return
        if bucket is None:
            self._reduce_alone(param, grad)
        else:
            slot = bucket.slot[id(param)]
            if slot in bucket.arrived or slot in bucket.alone or not grad.is_contiguous():
                # A second gradient in one backward (its first may already be in flight in the bucket)
                # or a layout the flat copy cannot take: this gradient is reduced on its own and the
                # bucket does not copy its slot back.
                bucket.alone.add(slot)
                self._reduce_alone(param, grad)
            else:
                bucket.views[slot].copy_(grad.reshape(-1))
                bucket.arrived[slot] = grad
            if bucket.reduction is None and bucket.complete:
                self._launch(bucket)
        # Queued by every hook (the later calls find nothing left to do).
        torch.autograd.Variable._execution_engine.queue_callback(self._wait_all)

    def _warn_unbucketed(self) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(
                "ReplicatedGradientSync: gradients produced in a nested backward (reentrant checkpointing) or after "
                "an interrupted backward are all-reduced one by one, outside the buckets",
                stacklevel=3,
            )

    def _reduce_alone(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        work = dist.all_reduce(grad, op=self._op(), group=self.group, async_op=True)
        self._pending.setdefault(id(param), []).append(_Reduction(grad, work))

    def _launch(self, bucket: _Bucket) -> None:
        work = dist.all_reduce(bucket.flat, op=self._op(), group=self.group, async_op=True)
        bucket.reduction = _Reduction(bucket.flat, work, bucket)
        for slot in bucket.arrived:
            self._pending.setdefault(id(bucket.params[slot]), []).append(bucket.reduction)
        waiting, bucket.waiting = bucket.waiting, []
        for callback in waiting:
            callback()

    def _op(self):
        return dist.ReduceOp.AVG if self.average_in_collective else dist.ReduceOp.SUM

    def after_reduction(self, param: nn.Parameter, callback: Callable[[], None]) -> None:
        """Call ``callback`` once ``param``'s all-reduce of this backward has been issued: now, or when
        the last gradient of its bucket arrives. For work that needs the reduced gradient before the
        backward ends (``CUDAGraphTrainStep(overlap_optimizer=True)`` updates each parameter then); the
        callback calls ``wait_for``."""
        bucket = self._bucket_of.get(id(param))
        if bucket is not None and bucket.reduction is None and id(param) not in self._pending:
            bucket.waiting.append(callback)
        else:
            callback()

    def wait_for(self, param: nn.Parameter) -> bool:
        """Make the current stream wait for ``param``'s all-reduce of this backward (averaged once this
        returns); False if this sync did not issue one."""
        pending = self._pending.pop(id(param), [])
        for reduction in pending:
            reduction.finish(self._divide_by())
        return bool(pending)

    def reduces(self, param: nn.Parameter) -> bool:
        """Whether ``param``'s gradient is averaged by this sync (in the backwards it is enabled for)."""
        return id(param) in self._ids

    def _divide_by(self) -> int | None:
        return None if self.average_in_collective else self.world

    def _finish_pending(self) -> None:
        pending, self._pending = self._pending, {}
        for reductions in pending.values():
            for reduction in reductions:
                reduction.finish(self._divide_by())

    def _wait_all(self) -> None:
        for bucket in self._buckets:  # gradients that never came (unused parameters): reduce the rest
            if bucket.reduction is None and bucket.arrived:
                self._launch(bucket)
        self._finish_pending()
        for bucket in self._buckets:
            bucket.reset()
        self._task = None


def _make_buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[_Bucket]:
    """Buckets of consecutive parameters in reverse registration order (about the order in which the
    backward produces their gradients, DDP's first guess), one dtype and device each; parameters of
    ``bucket_bytes`` or more and DTensors stay out (reduced on their own, in place). Fixed from the
    first backward on: a resumed run reduces exactly as the run it continues."""
    groups: list[list[nn.Parameter]] = [[]]
    for param in reversed(params):
        size = param.numel() * param.element_size()
        if isinstance(param, DTensor) or size >= bucket_bytes:
            continue
        current = groups[-1]
        if current and (param.dtype != current[0].dtype or param.device != current[0].device
                        or sum(p.numel() * p.element_size() for p in current) + size > bucket_bytes):  # fmt: skip
            groups.append(current := [])
        current.append(param)
    return [_Bucket(group) for group in groups if len(group) > 1]



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
