"""The job's plan (``moetune.plan``), printed before anything is loaded, and the refusal of a job that
cannot fit its GPUs.

The job's own settings are planned (not searched): its ``distributed.ep_size``, ``dense_parallel``,
``ep_dispatch``, activation checkpointing, micro-batch, accumulation, precision and LoRA, for
``data.max_length``-token rows on the job's processes. Rules:
- on CUDA, the plan uses the visible GPU's memory and, for a GPU type moetune has calibrated (H100,
  H200), its step time; a job whose planned memory (peak, CUDA-graph pool, CUDA context and
  fragmentation) exceeds the GPU is refused with the plan's numbers and what would fit, before any
  weight or data is read (``training.plan_check: false`` prints the plan and runs it anyway); a GPU
  type without calibration is refused only when the planned peak alone exceeds its memory;
- on CPU there is no GPU memory to check: the plan (memory only) is printed and the job runs;
- architectures moetune does not implement (Transformers' classes) are not planned.
``moetune finetune --dry-run`` prints the plan and exits without running, for the machine it runs on
or another GPU type (``--plan-gpu h100``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from moetune.models.registry import family_for
from moetune.recipe.config import JobConfig


@dataclass(frozen=True)
class JobShape:
    """Where the job runs: its processes and the GPU they have."""

    world: int
    gpus_per_node: int
    gpu: str
    """A calibrated GPU type (h100, h200), the visible GPU's name, or "cpu"."""
    gpu_memory_gib: float | None
    cuda_graph: bool


def plan_job(config: JobConfig, model_config: PretrainedConfig, shape: JobShape):
    """The plan of ``config``'s own settings (a ``moetune.plan.Plan``), or None for architectures
    moetune does not implement."""
    from moetune.plan import PlanRequest, Setting, make_plan
    from moetune.plan.calibration import known_gpus

    if family_for(model_config) is None:
        return None
    dist = config.distributed
    recompute = config.model.activation_checkpointing_mode if config.model.activation_checkpointing else "none"
    gpu = shape.gpu if _calibrated(shape.gpu, known_gpus()) else "cpu"
    precision = {"bf16": "bf16", "bf16_autocast": "fp32_master", "fp32": "fp32"}[_precision(config, gpu)]
    lora = config.lora if config.lora.enabled else None
    nodes = max(1, shape.world // shape.gpus_per_node)
    request = PlanRequest(
        model=str(getattr(model_config, "_name_or_path", "") or model_config.model_type), gpus_per_node=shape.world // nodes,
        nodes=nodes, gpu=gpu, gpu_memory_gib=shape.gpu_memory_gib, seq_len=config.data.max_length,
        micro_batch=config.training.micro_batch_size, lora_rank=lora.rank if lora else 0,
        lora_targets=tuple(lora.target_modules) if lora else (), lora_experts=lora.target_experts if lora else True,
        recompute=recompute, ep=dist.ep_size, precision=precision,
        optimizer="moetune" if shape.gpu != "cpu" else "torch", clip_grad=config.optim.grad_clip > 0,
    )
    replicate = dist.dense_parallel == "replicate" or dist.parallelism == "ddp"
    setting = Setting(ep=dist.ep_size, dense_parallel="replicate" if replicate and shape.world > 1 else "fsdp",
                      ep_dispatch=dist.ep_dispatch if dist.ep_size > 1 else "alltoall", recompute=recompute,
                      micro_batch=config.training.micro_batch_size, grad_accum=config.training.grad_accum_steps,
                      cuda_graph=shape.cuda_graph)
    return make_plan(request, config=model_config, setting=setting)


def _calibrated(gpu: str, known: dict) -> bool:
    return gpu != "cpu" and (gpu.lower() in known or any(name in gpu.lower() for name in known if len(name) > 3))


def _precision(config: JobConfig, gpu: str) -> str:
    if config.training.precision == "auto":
        return "bf16_autocast" if gpu != "cpu" else "fp32"
    return config.training.precision


def job_shape(runtime, *, cuda_graph: bool, gpu: str | None = None) -> JobShape:
    """The shape of a running job (``runtime``: the recipe's ``Runtime``); ``gpu`` overrides the GPU type."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or runtime.world_size)
    if gpu is None and runtime.device.type == "cuda":
        props = torch.cuda.get_device_properties(runtime.device)
        return JobShape(world=runtime.world_size, gpus_per_node=per_node, gpu=props.name,
                        gpu_memory_gib=props.total_memory / 1024**3, cuda_graph=cuda_graph)
    return JobShape(world=runtime.world_size, gpus_per_node=per_node, gpu=gpu or "cpu", gpu_memory_gib=None,
                    cuda_graph=cuda_graph)


def dry_run_cuda_graph(config: JobConfig, model_config: PretrainedConfig, *, world: int, gpu: str) -> bool:
    """Whether the job's steps would replay CUDA graphs on ``world`` GPUs of type ``gpu`` (the recipe's
    rule, ``uses_cuda_graph``, without a running process)."""
    from moetune.recipe.model_loading import check_model_for_job
    from moetune.recipe.step import uses_cuda_graph
    from moetune.utils.process import ProcessInfo

    takes_offsets = check_model_for_job(model_config, packing=config.data.packing,
                                        cuda_graph=config.training.cuda_graph == "true")
    device = torch.device("cpu" if gpu == "cpu" else "cuda")
    return uses_cuda_graph(config, ProcessInfo(device=device, world_size=world), takes_offsets=takes_offsets)


def check_job_fits(config: JobConfig, model_config: PretrainedConfig, shape: JobShape, *, announce) -> None:
    """Print the plan (through ``announce``, rank 0's printer) and refuse a job that cannot fit."""
    from moetune.plan import format_plan
    from moetune.plan.memory import GIB

    plan = plan_job(config, model_config, shape)
    if plan is None:
        announce(f"plan: not available for {model_config.model_type!r} (moetune plans the architectures it implements)")
        return
    announce(format_plan(plan, alternatives=0))
    if plan.fits or shape.gpu == "cpu" or not config.training.plan_check:
        return
    memory = plan.best.memory
    raise ValueError(
        f"the job needs {memory.total / GIB:.1f} GiB per GPU (peak {memory.peak / GIB:.1f} GiB: parameters "
        f"{memory.parameters / GIB:.1f}, gradients {memory.gradients / GIB:.1f}, optimizer states "
        f"{memory.optimizer / GIB:.1f}, activations {memory.activations / GIB:.1f}, communication "
        f"{memory.communication / GIB:.1f}; CUDA-graph pool {memory.cuda_graph_pool / GIB:.1f}; context and "
        f"fragmentation {memory.reserve / GIB:.1f}) and the GPU has {plan.gpu_memory / GIB:.1f} GiB. What would fit: "
        + "; ".join(plan.suggestions) + ". (training.plan_check: false runs it anyway.)"
    )
