"""The planner against measurements: one measured setting (a ``moetune bench`` row) next to what the
planner predicts for it. Used by ``benchmarks/plan_validation.py`` for the recorded results and for
new GPU measurements."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moetune.plan.calibration import load_calibration
from moetune.plan.memory import GIB, layout_for, memory_breakdown
from moetune.plan.search import cached_inventory
from moetune.plan.setting import PlanRequest, Setting
from moetune.plan.sharding import rank_state
from moetune.plan.throughput import step_time


@dataclass(frozen=True)
class Measured:
    """One measured training setting (what ``moetune bench`` records per row)."""

    model: str
    """A shipped config name."""
    layers: int
    gpu: str
    world: int = 1
    seq_len: int = 4096
    micro_batch: int = 1
    recompute: str = "none"
    lora_rank: int = 0
    cuda_graph: bool = False
    dense_parallel: str = "fsdp"
    ep_dispatch: str = "alltoall"
    step_s: float | None = None
    peak_gib: float | None = None
    reserved_gib: float | None = None
    state_gib: float | None = None
    forward_saved_gib: float | None = None
    """The allocated memory a training forward (loss included) added, most over the measured steps: the
    activations kept for the backward."""
    first_step: bool = False
    """A one-step measurement (the longest-sequence probe): the optimizer's states appear only at its end."""
    source: str = ""
    note: str = ""
    fitted: tuple[str, ...] = field(default=())
    """Calibration constants fitted to this measurement (its prediction is then no test)."""
    memory_note: str = ""
    """Why the memory prediction is not held to the documented tolerance here (``note`` is the step time's)."""


def predict(m: Measured) -> dict[str, Any]:
    """The planner's numbers for a measured setting, and the relative differences."""
    request = PlanRequest(model=m.model, gpus_per_node=m.world, nodes=1, gpu=m.gpu, seq_len=m.seq_len,
                          micro_batch=m.micro_batch, layers=m.layers, lora_rank=m.lora_rank, recompute=m.recompute,
                          ep=m.world, clip_grad=False)
    _, inventory = cached_inventory(m.model, m.layers, m.lora_rank, (), True, "bf16")
    setting = Setting(ep=m.world, dense_parallel=m.dense_parallel, ep_dispatch=m.ep_dispatch, recompute=m.recompute,
                      micro_batch=m.micro_batch, grad_accum=1, cuda_graph=m.cuda_graph)
    calibration = load_calibration(m.gpu)
    memory = memory_breakdown(inventory, request, setting, calibration, first_step=m.first_step)
    time = step_time(inventory, request, setting, calibration)
    full = rank_state(inventory, layout_for(request, setting), 0)
    state = (full.params_allocated + full.grads_allocated + full.optimizer) / GIB  # as the benchmark counts it
    out: dict[str, Any] = {
        "planned_step_s": time.step, "planned_peak_gib": memory.peak / GIB,
        "planned_activations_gib": memory.activations / GIB, "planned_state_gib": state,
        "planned_reserved_gib": (memory.peak + memory.cuda_graph_pool) / GIB, "peak_stage": memory.peak_stage,
        "planned_forward_saved_gib": memory.forward_saved / GIB,
    }
    if m.forward_saved_gib:
        out["forward_saved_error"] = memory.forward_saved / GIB / m.forward_saved_gib - 1
    if m.step_s:
        out["step_error"] = time.step / m.step_s - 1
    if m.peak_gib is not None and not m.cuda_graph:
        # A graphed step's activations are in the graph's pool, outside the peak torch reports (the
        # measured peak is then the state alone): compare the reserved memory instead.
        out["peak_error"] = memory.peak / GIB / m.peak_gib - 1
    if m.reserved_gib is not None and m.cuda_graph:
        out["reserved_error"] = out["planned_reserved_gib"] / m.reserved_gib - 1
    if m.state_gib is not None:
        out["state_error"] = state / m.state_gib - 1
    if m.peak_gib is not None and m.state_gib is not None and not m.cuda_graph and m.lora_rank:
        # LoRA: the state is the frozen weights, so everything above it is activations and buffers.
        out["working_measured_gib"] = m.peak_gib - m.state_gib
        out["working_error"] = (memory.peak / GIB - state) / (m.peak_gib - m.state_gib) - 1
    return out
