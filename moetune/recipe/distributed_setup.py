"""Process group, device and data-parallel wrapping: the recipe's only distributed code.

Single process: nothing is initialised. Under torchrun (``moetune finetune --nproc-per-node N``
or Slurm + torchrun) each rank takes its local GPU. The model comes already sharded from moetune's
``from_pretrained`` / ``from_config`` (``moetune.distributed``: expert parallelism with
``distributed.ep_size > 1``, FSDP2 on one mesh; FSDP2 alone for an architecture moetune implements),
each rank reading only its own weights, and is not wrapped again; its gradient norm is clipped by
``moetune.distributed.clip_grad_norm_``. DDP, and FSDP2 of the architectures that fall back to
Transformers' classes, wrap the loaded model (``fully_shard`` per decoder layer, then the root).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from moetune.distributed.mesh import is_sharded_by_moetune
from moetune.models.registry import family_for
from moetune.recipe.config import DistributedConfig, TrainingConfig
from moetune.utils.process import ProcessInfo


@dataclass(frozen=True)
class Runtime(ProcessInfo):
    """Where this process runs (``local_rank``: its GPU index on the node)."""

    local_rank: int = 0
    host_group: Any = None
    """A gloo group of the same ranks, for numbers the host holds (each step's token counts, the stop
    flag, the loss after the norm's read): summed over it they never wait for the GPU. On NCCL a
    device tensor's ``tolist()`` waits for everything queued before it, so the count of step N + 1
    waited for step N's update and the host could not queue the next forward behind the update.
    None: sum over the default group (one process, or a Runtime built by hand)."""


def init_runtime(training: TrainingConfig, dist_config: DistributedConfig) -> Runtime:
    """Pick the device; join the process group when launched by torchrun (WORLD_SIZE > 1)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    want_cuda = training.device == "cuda" or (training.device == "auto" and torch.cuda.is_available())
    if want_cuda and not torch.cuda.is_available():
        raise ValueError("training.device: 'cuda' was asked for but no GPU is visible")
    if want_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        backend = dist_config.backend or ("nccl" if device.type == "cuda" else "gloo")
        dist.init_process_group(backend=backend, device_id=device if device.type == "cuda" else None)
    use_gloo = world_size > 1 and dist_config.host_gloo_group
    host_group = dist.new_group(backend="gloo") if use_gloo else None  # collective: every rank
    return Runtime(rank=rank, world_size=world_size, local_rank=local_rank, device=device, host_group=host_group)


def sharding_options(runtime: Runtime, config: DistributedConfig, *, lora, model_config=None) -> dict | None:
    """moetune's ``from_pretrained`` options for expert parallelism, or for FSDP2 without it on an
    architecture moetune implements (``model_config``; a (world, 1) mesh: moetune shards the model on
    the meta device and each rank reads only its own weights, where wrapping a loaded model would
    have every rank read all of them first); None for DDP and the fallback architectures, which
    ``wrap_model`` wraps after loading."""
    if not runtime.distributed:
        return None
    common = {"reduce_dtype": getattr(torch, config.reduce_dtype), "lora": lora, "global_aux_loss": config.global_aux_loss}
    if config.ep_size == 1:
        if config.parallelism != "fsdp" or model_config is None or family_for(model_config) is None:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        from moetune.distributed import MESH_DIM_NAMES

        mesh = init_device_mesh(runtime.device.type, (runtime.world_size, 1), mesh_dim_names=MESH_DIM_NAMES)
        return {"device_mesh": mesh, **common}
    return {
        **common,
        "ep_size": config.ep_size,
        "ep_overlap_chunks": config.ep_overlap_chunks,
        "ep_dispatch": config.ep_dispatch,
        "dense_parallel": config.dense_parallel,
        "replicate_max_ctas": config.replicate_max_ctas or None,
        "replicate_transport": config.replicate_transport,
        "vocab_parallel": config.vocab_parallel,
    }


def wrap_model(model: torch.nn.Module, runtime: Runtime, config: DistributedConfig) -> torch.nn.Module:
    """Data-parallel wrapping (identity in one process or for a model moetune already sharded).
    Returns the module to call."""
    if not runtime.distributed or is_sharded_by_moetune(model):
        return model
    if config.parallelism == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [runtime.local_rank] if runtime.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def clip_grad_norm(model: torch.nn.Module, *, max_norm: float, optimizer: torch.optim.Optimizer | None = None) -> float:
    """Clip the global gradient norm (over all ranks' shards) to ``max_norm`` (0: only measure it).
    With moetune's AdamW the clipping coefficient goes to the optimizer, which applies it as its
    step reads each gradient (no pass over the gradients here)."""
    from moetune.distributed import clip_grad_norm_, scales_gradients

    limit = max_norm if max_norm > 0 else float("inf")
    folded = optimizer if scales_gradients(optimizer) else None
    if folded is not None or is_sharded_by_moetune(model):  # moetune's: plain, FSDP2 and EP shards alike
        return float(clip_grad_norm_(model, limit, optimizer=folded))
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm=limit)
    if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor norm
        norm = norm.full_tensor()
    return float(norm)


def barrier(runtime: Runtime) -> None:
    if runtime.distributed:
        dist.barrier()


def all_reduce_sum(values: list[float], runtime: Runtime) -> list[float]:
    """Sum of ``values`` over ranks (one small collective; over ``runtime.host_group`` when there is
    one, on the CPU, so that it does not wait for the GPU's queue)."""
    if not runtime.distributed:
        return values
    device = "cpu" if runtime.host_group is not None else runtime.device
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, group=runtime.host_group)
    return t.tolist()


def shutdown(runtime: Runtime, *, clean: bool = True) -> None:
    """Leave the process group. After a clean run every rank first waits for the others (tearing
    gloo down while a peer still sends can abort the process); after an error it does not wait, as
    the other ranks may never arrive."""
    if runtime.distributed and dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()
