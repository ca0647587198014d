"""A training step replayed from CUDA graphs: forward + backward in one graph, the optimizer step
(with optional gradient clipping) in another; with gradient accumulation a second forward + backward
graph adds each further micro-batch's gradients to the first one's.

Why: moetune's one-GPU step launches about a thousand kernels from Python; on an H200 the host
cannot issue them as fast as the GPU runs them and the GPU waits ~9 ms of a ~77 ms step
(benchmarks/README.md). The one-GPU MoE path never synchronises with the host (group sizes of
the grouped GEMM stay on the device), so the whole step can be captured once and replayed with
one launch per graph.

How (PyTorch's "whole-network capture"): the first ``warmup_steps`` calls train eagerly on a
side stream (lazy initialisation: cuBLAS / cuDNN plans, Triton compilation, optimizer states);
the next call copies the batch into static input tensors and captures, then every call copies
its batch into them and replays. Gradients are set to None before the capture, so the captured
backward allocates them in the graph's memory pool and writes (does not accumulate) them; the
same buffers are overwritten by each replay and read by the optimizer graph.

Gradient accumulation: call ``forward_backward`` once per micro-batch, then ``optimizer_step``.
The first micro-batch after an optimizer step replays the graph that writes the gradients; the
others replay a second graph, captured once the gradients exist, whose backward adds into those
same buffers in place (autograd accumulates into an existing ``.grad`` in place when no graph of
the gradient is built). So gradients are never zeroed (a write costs what a zeroing would) and the
single-micro-batch step keeps its one graph. Both graphs share one memory pool and always replay
in the order they were captured (write, then accumulate), as sharing a pool requires. The losses
are summed as returned: scale them in ``loss_fn`` (e.g. divide by the number of micro-batches, or
pass ``num_items_in_batch`` as a tensor in the batch), exactly as in an eager loop. With
``micro_batches=N`` the step knows which micro-batch is the last: the others run under the model's
``no_sync()`` (DDP, ``dense_parallel="replicate"``), so gradients are reduced once per step, by the
last backward (a third graph: first, middle and last micro-batches each have their own), and the
overlapped updates below run in that last backward; calling more or fewer micro-batches raises.

Requirements, checked before the capture: CUDA; every call's tensors have the shapes and dtypes
of the captured batch (pack sequences to a fixed length); a capturable optimizer
(``moetune.optim.AdamW(capturable=True)``, or torch's with ``capturable=True``); no host
synchronisation in the step. Expert parallelism is captured
with ``ep_dispatch="allgather"`` and ``dense_parallel="replicate"`` (fixed shapes, collectives
on the device only; the all-to-all dispatcher needs its split sizes on the host and FSDP2 manages
parameter memory from the host); gradient clipping then goes through
``moetune.distributed.clip_grad_norm_``. With ``max_grad_norm`` (``inf``: measure only) the norm is
measured in the optimizer graph and left in ``grad_norm``; moetune's AdamW takes the clipping
coefficient in its kernel and skips the update when the norm is not finite, so a replayed step
needs no host check before its update. Learning-rate changes reach the
replays when the rate is a device tensor updated in place (torch's schedulers do that; see
``set_learning_rate``). Off CUDA the object runs the same steps eagerly.

``overlap_optimizer=True`` (moetune's AdamW, no clipping; with gradient accumulation pass
``micro_batches``) updates each parameter as soon as its gradient is final, inside the forward +
backward graph, on a second stream (the graph's own stream is created with the high priority): the
memory-bound updates run beside the backward's kernels and fill its waits for expert-parallel
collectives, and the optimizer graph only updates what the backward did not. A replicated
parameter's update waits for its own all-reduce (``ReplicatedGradientSync.wait_for``), on the
second stream. Measured on H200s: 120.3 -> 115.3 ms per 16-layer step on one GPU, 119.7 -> 117.0
ms with ep=2 on two (benchmarks/README.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping

import torch

LossFn = Callable[[torch.nn.Module, Mapping[str, torch.Tensor]], torch.Tensor]


def default_loss(model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every group's rate in place when it is a tensor (what a captured step reads), else assign."""
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


class CUDAGraphTrainStep:
    """``loss = step(input_ids=..., labels=...)`` trains one step: forward, backward, optional
    clipping to ``max_grad_norm``, ``optimizer.step()``. ``forward_backward`` and ``optimizer_step``
    run the two halves separately (to time them, or to read gradients in between; with gradient
    accumulation call ``forward_backward`` once per micro-batch, and pass ``micro_batches`` to reduce
    once per step). Do not call ``optimizer.zero_grad()`` or ``optimizer.step()`` yourself: the
    graphs own the gradients."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        warmup_steps: int = 2,
        max_grad_norm: float | None = None,
        loss_fn: LossFn = default_loss,
        overlap_optimizer: bool = False,
        micro_batches: int | None = None,
    ) -> None:
        if warmup_steps < 1:
            raise ValueError(f"warmup_steps must be >= 1 (lazy initialisation cannot be captured), got {warmup_steps}")
        if micro_batches is not None and micro_batches < 1:
            raise ValueError(f"CUDA-graph step: micro_batches must be >= 1, got {micro_batches}")
        if overlap_optimizer:
            _check_overlappable(model, optimizer, max_grad_norm)
        # This step captures the model's whole forward and backward itself: the graphs a moetune model
        # replays under a user's own loop (moetune.training.graphed_backbone) would only hold memory.
        from moetune.training.graphed_backbone import set_training_graphs

        set_training_graphs(model, False)
        self.model = model
        self.optimizer = optimizer
        self.warmup_steps = warmup_steps
        self.max_grad_norm = max_grad_norm
        self.loss_fn = loss_fn
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        # The gradients' norm measured by the last optimizer step (with max_grad_norm; inf only
        # measures it): a static tensor the optimizer graph writes, to read after optimizer_step().
        self.grad_norm = torch.full((), float("nan"), device=self.params[0].device if self.params else "cpu")
        self.use_graphs = all(p.is_cuda for p in self.params) and torch.cuda.is_available()
        if self.use_graphs:
            _check_capturable(optimizer)
        self._eager_steps = 0
        self._static_batch: dict[str, torch.Tensor] | None = None
        self._static_grads: list[torch.Tensor | None] = []
        # (accumulates into existing gradients, last micro-batch of the step) -> (graph, static loss)
        self._graphs: dict[tuple[bool, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None  # the first graph's memory pool, shared by the others
        self._accumulated = 0  # micro-batches since the last optimizer step
        self.micro_batches = micro_batches
        # With a known count, the gradients are reduced once per step (DDP's / dense_parallel='replicate''s
        # no_sync around all but the last micro-batch), and overlapped updates run in the last one.
        self._no_sync = getattr(model, "no_sync", None) if (micro_batches or 1) > 1 else None
        # The optimizer graph's replay once captured (a no-op when the overlapped updates left it nothing).
        self._optimizer_replay: Callable[[], None] | None = None
        self.overlap_optimizer = overlap_optimizer
        # The step's own stream; with overlapped updates it has the high priority, so that the
        # backward's kernels get the SMs first and the updates take what is left (eager launches
        # honour it; a graph replay may run every node at the launching stream's priority).
        self._side_stream = torch.cuda.Stream(priority=-1 if overlap_optimizer else 0) if self.use_graphs else None
        self._update_stream = torch.cuda.Stream() if self.use_graphs and overlap_optimizer else None
        self._updated: set[torch.Tensor] = set()  # parameters updated by this backward's hooks
        self._updating = False  # the hooks update only in this object's last backward of a step
        self._hooks = (
            [p.register_post_accumulate_grad_hook(self._update_now) for p in self.params if p.requires_grad]
            if overlap_optimizer else []
        )  # fmt: skip

    def close(self) -> None:
        """Drop the graphs, their static tensors and the update hooks (the model trains eagerly again)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._graphs, self._pool, self._optimizer_replay = {}, None, None
        self._static_batch = None
        self._accumulated = 0
        self._static_grads = []
        self.optimizer.zero_grad(set_to_none=True)

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def __call__(self, **batch: torch.Tensor) -> torch.Tensor:
        loss = self.forward_backward(**batch)
        self.optimizer_step()
        return loss

    def forward_backward(self, **batch: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one micro-batch; its gradients are added to those of the earlier
        micro-batches since the last ``optimizer_step``. Returns the loss (detached)."""
        index = self._accumulated
        if self.micro_batches is not None and index >= self.micro_batches:
            raise RuntimeError(f"CUDA-graph step: {self.micro_batches} micro-batches per step; call optimizer_step()")
        if self.micro_batches is None and index > 0 and self.overlap_optimizer:
            raise RuntimeError(
                "CUDA-graph step: overlap_optimizer updates the parameters in the step's last backward; for "
                "gradient accumulation pass micro_batches=N so that the step knows which one that is"
            )
        last = self.micro_batches is None or index == self.micro_batches - 1
        key = (index > 0, last)
        self._accumulated += 1
        if not self.use_graphs or self._eager_steps < self.warmup_steps:
            return self._eager(lambda: self._eager_forward_backward(batch, last=last))
        if not self._graphs:  # warm-up steps just ended: a step's first micro-batch
            self._capture_first(batch, key)
        else:
            self._copy_into_static(batch)
            if key not in self._graphs:
                self._capture_more(key)
        graph, loss = self._graphs[key]
        graph.replay()
        self._restore_grads()
        return loss.clone()

    def optimizer_step(self) -> None:
        if self._accumulated == 0:
            raise RuntimeError("CUDA-graph step: optimizer_step() without a forward_backward() since the last step")
        if self.micro_batches is not None and self._accumulated != self.micro_batches:
            raise RuntimeError(
                f"CUDA-graph step: optimizer_step() after {self._accumulated} of {self.micro_batches} micro-batches"
            )
        self._accumulated = 0
        if not self._graphs:
            self._eager(self._eager_optimizer_step)
            self._eager_steps += 1
            return
        if self._optimizer_replay is None:
            self._optimizer_replay = self._capture_optimizer_step()
        self._optimizer_replay()

    def _capture_optimizer_step(self) -> Callable[[], None]:
        if self.overlap_optimizer and self._backward_updated_all():
            self._updated.clear()  # nothing left for an optimizer graph (CUDA warns of empty graphs)
            return lambda: None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._clip_and_step()
        return graph.replay

    def _backward_updated_all(self) -> bool:
        return all(param.grad is None or param in self._updated for param in self.params)

    # -- eager steps (warm-up, or off CUDA) --

    def _eager(self, fn):
        if self._side_stream is None:
            return fn()
        self._side_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._side_stream):
            result = fn()
        torch.cuda.current_stream().wait_stream(self._side_stream)
        return result

    def _eager_forward_backward(self, batch: Mapping[str, torch.Tensor], *, last: bool = True) -> torch.Tensor:
        sync = contextlib.nullcontext() if last or self._no_sync is None else self._no_sync()
        with sync:  # DDP's no_sync must cover the forward too
            loss = self.loss_fn(self.model, batch)
            self._updating = last
            try:
                loss.backward()
            finally:
                self._updating = False
        # The updates launched by the gradient hooks (only a step's last backward launches any; a
        # capture of an earlier micro-batch must not wait on the update stream's uncaptured work).
        if self._update_stream is not None and last and self._updated:
            torch.cuda.current_stream().wait_stream(self._update_stream)
        return loss.detach()

    def _update_now(self, param: torch.Tensor) -> None:
        """Gradient hook of ``overlap_optimizer``: this parameter's AdamW step (after its all-reduce
        when it is replicated), on the update stream."""
        if not self._updating:  # an earlier micro-batch, or a backward of other code (evaluation, a check)
            return
        if param in self._updated:
            raise RuntimeError(
                f"CUDA-graph step: overlap_optimizer got a second gradient for a {tuple(param.shape)} parameter in "
                "one backward (reentrant activation checkpointing, or a parameter used in two backwards): turn "
                "overlap_optimizer off"
            )
        self._updated.add(param)
        if self._update_stream is None:
            self._step_after_reduction(param)
            return
        self._update_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._update_stream):
            self._step_after_reduction(param)

    def _step_after_reduction(self, param: torch.Tensor) -> None:
        # Read at each update: resize_token_embeddings replaces the model's dense sync in that list.
        for sync in getattr(self.model, "replicated_gradient_syncs", ()):
            if sync.reduces(param):
                if not sync.enabled:
                    raise RuntimeError("CUDA-graph step: overlap_optimizer cannot run inside model.no_sync()")
                if not sync.wait_for(param):
                    raise RuntimeError(
                        "CUDA-graph step: a replicated parameter's gradient was not all-reduced before its overlapped "
                        "update (build the CUDAGraphTrainStep after parallelising the model)"
                    )
        self.optimizer.step_parameter(param)

    def _eager_optimizer_step(self) -> None:
        self._clip_and_step()
        self.optimizer.zero_grad(set_to_none=True)

    def _clip_and_step(self) -> None:
        if self.overlap_optimizer:  # the backward's hooks updated the others
            for param in self.params:
                if param.grad is not None and param not in self._updated:
                    self.optimizer.step_parameter(param)
            self._updated.clear()
            return
        if self.max_grad_norm is not None:
            from moetune.distributed import clip_before_update

            norm = clip_before_update(self.params, self.max_grad_norm, self.optimizer)
            self.grad_norm.copy_(norm)
        self.optimizer.step()

    # -- capture --

    def _capture_first(self, batch: Mapping[str, torch.Tensor], key: tuple[bool, bool]) -> None:
        for name, value in batch.items():
            if not isinstance(value, torch.Tensor) or not value.is_cuda:
                raise ValueError(f"CUDA-graph step: batch[{name!r}] must be a CUDA tensor, got {type(value).__name__}"
                                 f"{'' if not isinstance(value, torch.Tensor) else ' on ' + str(value.device)}")  # fmt: skip
        self._static_batch = {name: value.clone() for name, value in batch.items()}
        self.optimizer.zero_grad(set_to_none=True)  # the captured backward then allocates and writes them
        self._graphs[key] = self._capture(last=key[1])
        self._pool = self._graphs[key][0].pool()
        self._static_grads = [p.grad for p in self.params]
        if all(grad is None for grad in self._static_grads):
            raise RuntimeError("CUDA-graph step: the captured backward produced no gradient")

    def _capture_more(self, key: tuple[bool, bool]) -> None:
        """A later micro-batch's graph: the same forward + backward, captured while the gradients exist,
        so its backward adds into them. Captured into the first graph's pool; replays follow the
        capture order (first, middle, last micro-batch), as sharing a pool requires."""
        self._restore_grads()
        graph, loss = self._capture(pool=self._pool, last=key[1])
        replaced = [name for name, param, grad in zip(self._param_names(), self.params, self._static_grads)
                    if param.grad is not grad]  # fmt: skip
        if replaced:
            raise RuntimeError(
                f"CUDA-graph step: the accumulating backward replaced the gradient of {replaced[:3]} instead of adding "
                "to it in place (a gradient hook that returns a new tensor, or a parameter without a gradient in "
                "the first micro-batch); use one micro-batch per step or train eagerly"
            )
        self._graphs[key] = (graph, loss)

    def _capture(self, pool=None, *, last: bool = True) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """(graph, static loss) of forward + backward on the static batch."""
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=pool, stream=self._side_stream if self.overlap_optimizer else None):
                loss = self._eager_forward_backward(self._static_batch, last=last)
        except RuntimeError as error:
            raise RuntimeError(
                "CUDA-graph step: capturing forward + backward failed; the step probably synchronises with "
                "the host (expert parallelism's all-to-all split sizes or FSDP2: use ep_dispatch='allgather' "
                "with dense_parallel='replicate'; the fp32 / loop experts path; .item() in a loss or hook). "
                f"Train eagerly instead. Cause: {error}"
            ) from error
        return graph, loss

    def _param_names(self) -> list[str]:
        names = {param: name for name, param in self.model.named_parameters()}
        return [names.get(param, f"param {i}") for i, param in enumerate(self.params)]

    def _copy_into_static(self, batch: Mapping[str, torch.Tensor]) -> None:
        if batch.keys() != self._static_batch.keys():
            raise ValueError(f"CUDA-graph step: batch keys {sorted(batch)} differ from the captured {sorted(self._static_batch)}")
        for key, value in batch.items():
            static = self._static_batch[key]
            if value.shape != static.shape or value.dtype != static.dtype:
                raise ValueError(
                    f"CUDA-graph step: batch[{key!r}] is {tuple(value.shape)} {value.dtype}, the captured step "
                    f"takes {tuple(static.shape)} {static.dtype} (pad or pack every batch to one shape)"
                )
            static.copy_(value, non_blocking=True)

    def _restore_grads(self) -> None:
        """User code may read (or set to None) ``.grad`` between calls; the graphs keep their buffers."""
        for param, grad in zip(self.params, self._static_grads):
            param.grad = grad


def _check_capturable(optimizer: torch.optim.Optimizer) -> None:
    if not all(group.get("capturable", False) for group in optimizer.param_groups):
        raise ValueError(
            f"CUDA-graph step: the optimizer ({type(optimizer).__name__}) must be capturable: use "
            "moetune.optim.AdamW(..., capturable=True) or torch.optim.AdamW(..., capturable=True)"
        )


def _check_overlappable(model: torch.nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float | None) -> None:
    if max_grad_norm is not None:
        raise ValueError(
            "CUDA-graph step: overlap_optimizer updates parameters during the backward, so it cannot clip by the "
            "global gradient norm (set max_grad_norm=None)"
        )
    if not hasattr(optimizer, "step_parameter"):
        raise ValueError(
            f"CUDA-graph step: overlap_optimizer needs moetune.optim.AdamW (per-parameter steps), got {type(optimizer).__name__}"
        )
    if any(type(module).__name__.startswith("FSDP") for module in model.modules()):
        raise ValueError(
            "CUDA-graph step: overlap_optimizer cannot update FSDP2-sharded parameters during the backward (their "
            "gradients are reduce-scattered after it); use dense_parallel='replicate'"
        )
