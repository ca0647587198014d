"""Process group, device and data-parallel wrapping: the recipe's only distributed code.

Single process: nothing is initialised. Under torchrun (``moetune finetune --nproc-per-node N``
or Slurm + torchrun) each rank takes its local GPU (``LOCAL_RANK``); rank 0 (the global one, never
"local rank 0", of which there is one per node) alone writes the shared files. Several nodes must
share ``training.output_dir`` (``check_shared_folder``); what every rank must decide alike from
the filesystem, rank 0 reads for all (``rank0_decides``). The model comes already sharded from moetune's
``from_pretrained`` / ``from_config`` (``moetune.distributed``: expert parallelism with
``distributed.ep_size > 1``, FSDP2 on one mesh; FSDP2 alone for an architecture moetune implements),
each rank reading only its own weights, and is not wrapped again; its gradient norm is clipped by
``moetune.distributed.clip_grad_norm_``. DDP, and FSDP2 of the architectures that fall back to
Transformers' classes, wrap the loaded model (``fully_shard`` per decoder layer, then the root).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from moetune.distributed.mesh import is_sharded_by_moetune
from moetune.models.registry import family_for
from moetune.recipe.config import DistributedConfig, TrainingConfig
from moetune.utils.process import ProcessInfo

T = TypeVar("T")


@dataclass(frozen=True)
class Runtime(ProcessInfo):
    """Where this process runs (``local_rank``: its GPU index on the node)."""

    local_rank: int = 0
    nodes: int = 1
    """torchrun agents in the job (GROUP_WORLD_SIZE): nodes, each with its own local rank 0."""
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
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE") or world_size)
    nodes = int(os.environ.get("GROUP_WORLD_SIZE") or -(-world_size // max(local_world_size, 1)))
    want_cuda = training.device == "cuda" or (training.device == "auto" and torch.cuda.is_available())
    if want_cuda and not torch.cuda.is_available():
        raise ValueError("training.device: 'cuda' was asked for but no GPU is visible")
    if want_cuda and world_size > 1 and "LOCAL_RANK" not in os.environ:
        # The GPU is the node's LOCAL_RANK-th, never the global RANK-th; without it every process
        # of a node would take GPU 0.
        raise ValueError(f"WORLD_SIZE is {world_size} but LOCAL_RANK is not set: launch the processes with torchrun "
                         "(one per node under Slurm: srun ... torchrun --nnodes N --nproc-per-node GPUS ...)")
    if want_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    timeout = timedelta(minutes=dist_config.timeout_minutes)
    if world_size > 1 and not dist.is_initialized():
        backend = dist_config.backend or ("nccl" if device.type == "cuda" else "gloo")
        dist.init_process_group(backend=backend, device_id=device if device.type == "cuda" else None, timeout=timeout)
    use_gloo = world_size > 1 and dist_config.host_gloo_group
    host_group = dist.new_group(backend="gloo", timeout=timeout) if use_gloo else None  # collective: every rank
    return Runtime(rank=rank, world_size=world_size, local_rank=local_rank, nodes=nodes, device=device,
                   host_group=host_group)


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


def rank0_decides(decide: Callable[[], T], runtime: Runtime) -> T:
    """``decide()`` run by rank 0 alone, its result given to every rank; its ValueError raised on
    every rank (an error on rank 0 only would leave the others waiting in the next collective). For
    what is read from the filesystem and must be the same on every rank: another node may see a
    shared folder differently for a while (a network filesystem caches directory listings for up
    to a minute: the checkpoint a preempted run wrote just before its requeue, say)."""
    if not runtime.distributed:
        return decide()
    box: list[Any] = [None]
    error: Exception | None = None
    if runtime.is_main:
        try:
            box[0] = (decide(), None)
        except Exception as err:  # told to the others, then raised here as it is
            error, box[0] = err, (None, (isinstance(err, ValueError), str(err), type(err).__name__))
    dist.broadcast_object_list(box, src=0, group=runtime.host_group)
    value, failure = box[0]
    if error is not None:
        raise error
    if failure is not None:
        user_error, message, kind = failure
        raise ValueError(message) if user_error else RuntimeError(f"rank 0 failed: {kind}: {message}")
    return value


def _gathered(value: Any, runtime: Runtime) -> list[Any]:
    """``value`` of every rank, by rank (a collective)."""
    values: list[Any] = [None] * runtime.world_size
    dist.all_gather_object(values, value, group=runtime.host_group)
    return values


def check_same_on_every_rank(value: Any, runtime: Runtime, *, what: str) -> None:
    """Raise a ValueError on every rank when ``value`` (small, picklable) differs between ranks."""
    if not runtime.distributed:
        return
    values = _gathered(value, runtime)
    others = [f"rank {r}: {v}" for r, v in enumerate(values) if v != values[0]]
    if others:
        shown = "; ".join(others[:3]) + (f"; and {len(others) - 3} more ranks" if len(others) > 3 else "")
        raise ValueError(f"{what} differs between the processes (rank 0: {values[0]}; {shown})")


def check_shared_folder(folder: Path, runtime: Runtime, *, field: str, wait_s: float = 30.0) -> None:
    """On several nodes: that ``folder`` is one folder for all of them (a shared filesystem). Rank 0
    creates a file in it, every rank looks for it (for up to ``wait_s``: a network filesystem may
    show it late). A checkpoint needs it: every rank writes its shards into the folder that rank 0
    then renames, so on node-local folders it would be incomplete (and resume fail)."""
    if runtime.nodes <= 1:
        return

    def create() -> str:
        folder.mkdir(parents=True, exist_ok=True)
        name = f".moetune-shared-{socket.gethostname()}-{os.getpid()}-{time.time_ns()}"
        (folder / name).touch()
        return name

    marker = folder / rank0_decides(create, runtime)
    deadline = time.monotonic() + wait_s
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    seen = _gathered((marker.exists(), socket.gethostname()), runtime)
    if runtime.is_main:
        marker.unlink()
    blind = [f"{r} ({host})" for r, (ok, host) in enumerate(seen) if not ok]
    if blind:
        raise ValueError(
            f"{field}: {folder} is not one folder for all {runtime.nodes} nodes: ranks {', '.join(blind[:8])} do not "
            f"see the file rank 0 ({seen[0][1]}) created in it after {wait_s:.0f} s. Every rank writes its shards of a "
            "checkpoint into it: put it on a filesystem every node mounts (or a path that names the same folder on "
            "each)")


def shutdown(runtime: Runtime, *, clean: bool = True) -> None:
    """Leave the process group. After a clean run every rank first waits for the others (tearing
    gloo down while a peer still sends can abort the process); after an error it does not wait, as
    the other ranks may never arrive."""
    if runtime.distributed and dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()
