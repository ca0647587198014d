"""One optimizer step of the job: forward/backward over the micro-batches, clipping, the update;
run eagerly (``train_step``) or replayed from CUDA graphs (``GraphedTrainStep``,
``training.cuda_graph``).

Why graphs: an eager MoE step launches thousands of kernels from Python, and on a fast GPU the
host cannot keep up (Qwen3-30B-A3B layers on H200s, the recipe's own tokens/s: 1.14x on one GPU,
1.15x with expert parallelism on two; recipe README). Both ways compute the same
step: the same loss per micro-batch (``micro_batch_loss``), the global gradient norm checked for
NaN before the update, the same update.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from moetune.recipe import metrics
from moetune.recipe.config import JobConfig
from moetune.recipe.distributed_setup import Runtime, all_reduce_sum, clip_grad_norm
from moetune.recipe.packing import Batch

Autocast = Callable[[], contextlib.AbstractContextManager]


class NonFiniteLossError(RuntimeError):
    """The loss or gradient norm became NaN/inf; the run stopped without saving over good checkpoints."""


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    num_tokens: int
    """Real tokens of this step, summed over ranks."""


def micro_batch_loss(model: torch.nn.Module, inputs: Mapping, *, num_items: float | torch.Tensor, aux_coef: float,
                     num_micro_batches: int, autocast: Autocast, expert_load: metrics.ExpertLoad | None,
                     real_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss to backpropagate, LM loss) of one micro-batch. The loss is normalised by ``num_items``
    (the answer tokens of the whole global step per rank), so every token weighs the same whatever
    micro-batch or rank it is on; the aux loss is averaged over the micro-batches. With
    ``expert_load`` (MoE models) the routed experts of the real tokens ``real_T`` are counted."""
    recording = expert_load.recording(model) if expert_load is not None else contextlib.nullcontext()
    with autocast(), recording:
        out = model(**inputs, num_items_in_batch=num_items, output_router_logits=expert_load is not None)
    lm_loss = loss = out.loss
    if getattr(out, "aux_loss", None) is not None and aux_coef:
        # The model added aux_coef * aux per micro-batch; keep the LM part and average the aux part.
        lm_loss = out.loss - aux_coef * out.aux_loss
        loss = lm_loss + aux_coef * out.aux_loss / num_micro_batches
    if expert_load is not None:
        expert_load.add(out.router_logits, real_T)
    return loss, lm_loss.detach()


def _items_and_tokens(micro_batches: list[Batch], runtime: Runtime) -> tuple[float, int]:
    # DP averages gradients over ranks, hence / world_size.
    num_label, num_tokens = all_reduce_sum(
        [sum(b.num_label_tokens for b in micro_batches), sum(b.num_tokens for b in micro_batches)], runtime)
    return max(num_label, 1.0) / runtime.world_size, int(num_tokens)


def _checked(loss_sum: torch.Tensor, grad_norm: float, runtime: Runtime) -> float:
    """The step's loss (mean over ranks); raises NonFiniteLossError when it or the norm is not finite."""
    (loss_value,) = all_reduce_sum([float(loss_sum)], runtime)
    loss_value /= runtime.world_size
    if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
        raise NonFiniteLossError(f"loss {loss_value}, grad norm {grad_norm}")
    return loss_value


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, micro_batches: list[Batch], *,
               runtime: Runtime, grad_clip: float, aux_coef: float, autocast: Autocast,
               expert_load: metrics.ExpertLoad | None, document_offsets: bool = False) -> StepResult:
    """Forward/backward over the micro-batches, clip, optimizer step. Raises NonFiniteLossError
    (before the optimizer step) when the loss or gradients are not finite."""
    items_per_rank, num_tokens = _items_and_tokens(micro_batches, runtime)
    loss_sum = torch.zeros((), device=runtime.device)
    # DDP and dense_parallel='replicate' reduce the gradients once, in the last micro-batch's backward
    # (DDP's no_sync must cover the forward too).
    no_sync = getattr(model, "no_sync", None)
    for index, batch in enumerate(micro_batches):
        last = index == len(micro_batches) - 1
        sync = no_sync() if no_sync is not None and not last else contextlib.nullcontext()
        with sync:
            loss, lm_loss = micro_batch_loss(
                model, batch.model_inputs(runtime.device, document_offsets=document_offsets), num_items=items_per_rank,
                aux_coef=aux_coef, num_micro_batches=len(micro_batches), autocast=autocast, expert_load=expert_load,
                real_T=batch.real_BT.flatten())  # fmt: skip
            loss.backward()
        loss_sum += lm_loss
    grad_norm = clip_grad_norm(model, max_norm=grad_clip, optimizer=optimizer)
    try:
        loss_value = _checked(loss_sum, grad_norm, runtime)
    except NonFiniteLossError:
        optimizer.zero_grad(set_to_none=True)
        raise
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss=loss_value, grad_norm=grad_norm, num_tokens=num_tokens)


class GraphedTrainStep:
    """``train_step`` replayed from CUDA graphs (``moetune.training.CUDAGraphTrainStep``): each
    micro-batch's forward + backward is one graph (its batch copied into the graph's static
    tensors: packed rows, fixed shapes, the document offsets padded to ``num_offsets``), then the
    gradient norm is measured and clipped eagerly (with moetune's AdamW the coefficient goes to its
    kernel), checked for NaN on the host, and the update replays a second graph. The first
    ``warmup_steps`` steps run eagerly. Off CUDA every step runs eagerly through the same code.

    Measuring the norm inside the update's graph instead (``CUDAGraphTrainStep(max_grad_norm=)``,
    the AdamW kernel skipping a non-finite update) was 7% slower on an H200 (41,651 against 44,847
    tokens/s, Qwen3 shapes, 8 layers): the host then reads the norm after the update, and its work
    for the next step no longer overlaps the update's ~18 ms (2026-12-01, commit b893fe8)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, runtime: Runtime,
                 grad_clip: float, aux_coef: float, autocast: Autocast, expert_load: metrics.ExpertLoad | None,
                 micro_batches: int, num_offsets: int | None, warmup_steps: int = 2) -> None:
        from moetune.training import CUDAGraphTrainStep

        self.model, self.optimizer, self.runtime, self.grad_clip = model, optimizer, runtime, grad_clip
        self.num_offsets = num_offsets
        self._loss_options = {"aux_coef": aux_coef, "num_micro_batches": micro_batches, "autocast": autocast,
                              "expert_load": expert_load}
        self._lm_loss = torch.zeros((), device=runtime.device)  # written by every replay
        self._graphs = CUDAGraphTrainStep(model, optimizer, warmup_steps=warmup_steps, max_grad_norm=None,
                                          loss_fn=self._loss, micro_batches=micro_batches)

    def close(self) -> None:
        """Release the graphs. Before the process group is destroyed: NCCL's teardown waits for every
        graph that captured its collectives to be gone (an expert-parallel run hung in
        ``destroy_process_group`` with them alive)."""
        self._graphs.close()
        if torch.cuda.is_available() and self.runtime.device.type == "cuda":
            torch.cuda.synchronize(self.runtime.device)

    def _loss(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Captured once per graph: everything here reads the static batch and writes static tensors."""
        inputs = {k: v for k, v in batch.items() if k not in ("num_items", "real_T")}
        if "cu_seq_lens_q" in inputs:  # the padded offsets' bound: a document fills at most a row
            inputs["max_length_q"] = inputs["max_length_k"] = batch["input_ids"].shape[1]
        loss, lm_loss = micro_batch_loss(model, {**inputs, "use_cache": False}, num_items=batch["num_items"],
                                         real_T=batch["real_T"], **self._loss_options)
        self._lm_loss.copy_(lm_loss)
        return loss

    def __call__(self, micro_batches: list[Batch]) -> StepResult:
        items_per_rank, num_tokens = _items_and_tokens(micro_batches, self.runtime)
        device = self.runtime.device
        # A fill on the device, not a blocking copy: the host prepares this step while the GPU still
        # runs the previous update.
        num_items = torch.full((), items_per_rank, dtype=torch.float32, device=device)
        loss_sum = torch.zeros((), device=device)
        for batch in micro_batches:
            inputs = batch.model_inputs(device, document_offsets=self.num_offsets is not None,
                                        num_offsets=self.num_offsets)
            tensors = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
            self._graphs.forward_backward(**tensors, num_items=num_items,
                                          real_T=batch.real_BT.flatten().to(device, non_blocking=True))
            loss_sum += self._lm_loss
        grad_norm = clip_grad_norm(self.model, max_norm=self.grad_clip, optimizer=self.optimizer)  # eager: the host reads it
        loss_value = _checked(loss_sum, grad_norm, self.runtime)  # before the update, as train_step
        self._graphs.optimizer_step()
        return StepResult(loss=loss_value, grad_norm=grad_norm, num_tokens=num_tokens)


def uses_cuda_graph(config: JobConfig, runtime: Runtime, *, takes_offsets: bool) -> bool:
    """Whether the steps replay CUDA graphs: ``training.cuda_graph`` "true" (checked elsewhere), or
    "auto" for LoRA in one CUDA process with packed rows into a model that takes the offsets (the
    eager LoRA step waits for the host: 42,725 against 79,661 tokens/s graphed on one H200, Qwen3
    shapes, 8 layers;
    benchmarks/results/h200_20261201_fc9e582/recipe_lora_qwen3-30b-a3b-8l_1gpu_20261201T065411Z.json)."""
    setting = config.training.cuda_graph
    if setting != "auto":
        return setting == "true"
    return (runtime.device.type == "cuda" and runtime.world_size == 1 and config.data.packing and takes_offsets
            and config.lora.enabled)
