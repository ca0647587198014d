"""``make_plan``: every setting moetune can run the request with, its memory and step time, the
fastest that fits; and, when none fits, what would (recomputation, LoRA, more GPUs)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch

from moetune.bench.models import with_layers
from moetune.plan.calibration import Calibration, load_calibration
from moetune.plan.inventory import Inventory, build_inventory
from moetune.plan.memory import GIB, MemoryBreakdown, memory_breakdown
from moetune.plan.model_spec import resolve_model
from moetune.plan.setting import PlanRequest, Setting
from moetune.plan.throughput import TimeBreakdown, step_time

MICRO_BATCHES = (1, 2, 4, 8)
RECOMPUTE_ORDER = ("none", "selective", "full")


@dataclass(frozen=True)
class Candidate:
    setting: Setting
    memory: MemoryBreakdown
    time: TimeBreakdown | None
    fits: bool


@dataclass
class Plan:
    request: PlanRequest
    model_name: str
    inventory: Inventory
    gpu: str
    """The calibration's GPU name, or "cpu" (memory only, no limit)."""
    gpu_memory: float | None
    """Bytes of one GPU (None on CPU)."""
    candidates: list[Candidate]
    """Every setting evaluated, the chosen one first, then the others by speed (or memory)."""
    suggestions: list[str] = field(default_factory=list)
    calibration: Calibration | None = None

    @property
    def best(self) -> Candidate:
        return self.candidates[0]

    @property
    def fits(self) -> bool:
        return self.best.fits


def make_plan(request: PlanRequest, *, config: Any = None, setting: Setting | None = None, suggest: bool = True) -> Plan:
    """The plan of ``request``: every setting it can run with (or only ``setting``), the best first.
    ``config``: the model's config object, instead of reading ``request.model`` (a name then)."""
    name, inventory = _inventory_for(request, config)
    calibration = None if request.gpu == "cpu" else load_calibration(request.gpu)
    gpu_memory = None
    if calibration is not None:
        gpu_memory = (request.gpu_memory_gib or calibration["memory_gib"]) * GIB
    elif request.gpu_memory_gib:
        gpu_memory = request.gpu_memory_gib * GIB
    candidates = []
    for candidate in [setting] if setting is not None else settings_for(request, inventory):
        memory = memory_breakdown(inventory, request, candidate, calibration)
        time = step_time(inventory, request, candidate, calibration) if calibration is not None else None
        fits = gpu_memory is None or memory.total <= gpu_memory
        candidates.append(Candidate(setting=candidate, memory=memory, time=time, fits=fits))
    if not candidates:
        raise ValueError(_no_setting_reason(request, inventory))
    candidates.sort(key=_rank)
    plan = Plan(request=request, model_name=name, inventory=inventory, gpu=calibration.gpu if calibration else "cpu",
                gpu_memory=gpu_memory, candidates=candidates, calibration=calibration)
    if suggest and not plan.fits:
        plan.suggestions = what_would_fit(request, config=config)
    return plan


def _rank(candidate: Candidate) -> tuple:
    """Fitting settings first; among them the fastest (or, without a time model, the least
    recomputation and the largest micro-batch); then the least memory."""
    s = candidate.setting
    speed = -candidate.time.tokens_per_s if candidate.time is not None else (
        RECOMPUTE_ORDER.index(s.recompute), -s.micro_batch)
    return (not candidate.fits, speed if candidate.fits else candidate.memory.total, candidate.memory.total)


def _inventory_for(request: PlanRequest, config: Any) -> tuple[str, Inventory]:
    key = (request.layers, request.lora_rank, request.lora_targets, request.lora_experts, request.precision)
    if config is None:
        return cached_inventory(request.model, *key)
    return request.model, _build(request.model, config, *key)


@lru_cache(maxsize=32)
def cached_inventory(model: str, layers: int | None, lora_rank: int, lora_targets: tuple[str, ...], lora_experts: bool,
                     precision: str) -> tuple[str, Inventory]:
    """(short name, inventory) of a model named by a string (shipped name or path), kept for reuse:
    the suggestions and the validation plan the same model many times."""
    name, config = resolve_model(model, layers=layers)
    return name, _build(name, config, None, lora_rank, lora_targets, lora_experts, precision)


def _build(name: str, config: Any, layers: int | None, lora_rank: int, lora_targets: tuple[str, ...],
           lora_experts: bool, precision: str) -> Inventory:
    if layers is not None:
        config = with_layers(copy.deepcopy(config), layers)
    lora = None
    if lora_rank:
        from moetune.bench.lora import lora_settings
        from moetune.lora import LoraSettings

        targets = list(lora_targets) or lora_settings(lora_rank, None, config).target_modules
        lora = LoraSettings(rank=lora_rank, target_modules=targets, target_experts=lora_experts)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    return build_inventory(name, config, lora=lora, dtype=dtype)


def ep_choices(request: PlanRequest, inventory: Inventory) -> list[int]:
    if request.ep is not None:
        return [request.ep]
    if not inventory.num_experts:
        return [1]
    return [d for d in range(1, request.world + 1) if request.world % d == 0 and inventory.num_experts % d == 0]


def settings_for(request: PlanRequest, inventory: Inventory) -> list[Setting]:
    """The settings moetune can run ``request`` with."""
    world = request.world
    micro_batches = [request.micro_batch] if request.micro_batch else list(MICRO_BATCHES)
    recomputes = [request.recompute] if request.recompute != "auto" else list(RECOMPUTE_ORDER)
    settings = []
    for ep in ep_choices(request, inventory):
        if world % ep or (inventory.num_experts and inventory.num_experts % ep):
            continue
        for dense, dispatch, graph in _parallel_kinds(request, ep):
            for recompute in recomputes:
                for micro_batch in micro_batches:
                    accum = _accumulation(request, micro_batch)
                    if accum is None:
                        continue
                    settings.append(Setting(ep=ep, dense_parallel=dense, ep_dispatch=dispatch, recompute=recompute,
                                            micro_batch=micro_batch, grad_accum=accum, cuda_graph=graph))
    return settings


def _parallel_kinds(request: PlanRequest, ep: int) -> list[tuple[str, str, bool]]:
    """(dense_parallel, ep_dispatch, cuda_graph) combinations: FSDP2 with the all-to-all (eager), or
    replicated dense parameters with the all-gather dispatcher, which a CUDA graph can capture."""
    graphs_allowed = request.cuda_graph is not False and request.gpu != "cpu"
    if request.world == 1:
        kinds = [("fsdp", "alltoall", False)]
        if graphs_allowed:
            kinds.append(("fsdp", "alltoall", True))
        return kinds if request.cuda_graph is not True else kinds[1:]
    kinds = []
    if request.dense_parallel in (None, "fsdp"):
        kinds.append(("fsdp", "alltoall", False))
    if request.dense_parallel in (None, "replicate"):
        dispatch = "allgather" if ep > 1 else "alltoall"
        kinds.append(("replicate", dispatch, graphs_allowed and ep > 1))
    return kinds


def _accumulation(request: PlanRequest, micro_batch: int) -> int | None:
    if request.global_batch is None:
        return 1
    per_step = request.world * micro_batch
    if request.global_batch % per_step:
        return None
    return request.global_batch // per_step


def _no_setting_reason(request: PlanRequest, inventory: Inventory) -> str:
    if request.ep is not None and (request.world % request.ep or (inventory.num_experts and inventory.num_experts % request.ep)):
        return (f"ep={request.ep} must divide the number of GPUs ({request.world}) and of experts "
                f"({inventory.num_experts})")
    if request.global_batch is not None:
        return (f"global_batch={request.global_batch} is not a multiple of GPUs x micro-batch for any micro-batch "
                f"{[request.micro_batch] if request.micro_batch else list(MICRO_BATCHES)} on {request.world} GPUs")
    return "no setting matches the request"


def what_would_fit(request: PlanRequest, *, config: Any = None) -> list[str]:
    """Changes to ``request`` that make it fit, each with the memory it then needs."""
    found = []

    def attempt(label: str, changed: PlanRequest) -> bool:
        try:
            plan = make_plan(changed, config=config, suggest=False)
        except ValueError:
            return False
        if plan.fits:
            c = plan.best
            found.append(f"{label}: {c.memory.total / GIB:.1f} GiB per GPU with ep={c.setting.ep}, "
                         f"recompute={c.setting.recompute}, micro-batch {c.setting.micro_batch}")
        return plan.fits

    if request.recompute in ("none", "selective"):
        attempt("activation checkpointing (--recompute full)", request.but(recompute="full"))
    if request.micro_batch and request.micro_batch > 1:
        attempt("micro-batch 1", request.but(micro_batch=1, global_batch=None))
    if not request.lora_rank:
        attempt("LoRA (--lora-rank 16)", request.but(lora_rank=16))
    for factor in (2, 4, 8, 16, 32, 64):
        nodes = request.nodes * factor
        if attempt(f"{nodes} nodes ({nodes * request.gpus_per_node} GPUs)", request.but(nodes=nodes, ep=None,
                                                                                          global_batch=None)):
            break
    if not found:
        found.append("nothing tried fits: fewer tokens per GPU (--seq-len), or more GPUs than 64x these")
    return found
