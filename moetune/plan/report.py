"""A plan as text (``format_plan``) and as JSON-ready data (``plan_to_dict``)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from moetune.plan.memory import GIB, MemoryBreakdown
from moetune.plan.search import Candidate, Plan
from moetune.plan.throughput import TimeBreakdown

MEMORY_PARTS = ("parameters", "gradients", "optimizer", "activations", "communication", "cuda_graph_pool", "reserve")
TIME_LABELS = (("dense GEMMs", "dense_gemm"), ("experts", "experts"), ("attention", "attention"),
               ("scans/routers", "other_compute"), ("memory-bound", "memory_bound"), ("communication", "communication"),
               ("host", "host_idle"), ("optimizer", "optimizer"))
MEMORY_LABELS = {
    "parameters": "parameters", "gradients": "gradients", "optimizer": "optimizer states", "activations": "activations",
    "communication": "communication buffers", "cuda_graph_pool": "CUDA-graph pool",
    "reserve": "CUDA context, NCCL, fragmentation",
}


def memory_dict(memory: MemoryBreakdown) -> dict[str, Any]:
    parts = {name: round(getattr(memory, name) / GIB, 3) for name in MEMORY_PARTS}
    return {"gib": parts, "peak_allocated_gib": round(memory.peak / GIB, 3), "total_gib": round(memory.total / GIB, 3),
            "gradients_total_gib": round(memory.gradients_total / GIB, 3),
            "activations_max_gib": round(memory.activations_max / GIB, 3), "peak_stage": memory.peak_stage}


def time_dict(time: TimeBreakdown | None, peak_tflops: float | None) -> dict[str, Any] | None:
    if time is None:
        return None
    parts = ("dense_gemm", "experts", "attention", "other_compute", "memory_bound", "communication", "host_idle",
             "optimizer")
    return {
        "step_s": round(time.step, 5), "tokens_per_s_per_gpu": round(time.tokens_per_s, 1),
        "tokens_per_step_per_gpu": time.tokens_per_step, "tflops_per_gpu": round(time.tokens_per_s * time.flops_per_token / 1e12, 1),
        "mfu": None if not peak_tflops else round(time.mfu(peak_tflops), 4),
        "seconds": {name: round(getattr(time, name), 5) for name in parts},
    }


def candidate_dict(candidate: Candidate, peak_tflops: float | None) -> dict[str, Any]:
    return {"setting": asdict(candidate.setting), "fits": candidate.fits, "memory": memory_dict(candidate.memory),
            "time": time_dict(candidate.time, peak_tflops)}


def plan_to_dict(plan: Plan, *, alternatives: int = 5) -> dict[str, Any]:
    inventory = plan.inventory
    peak = plan.calibration["matmul_tflops"] if plan.calibration else None
    return {
        "model": plan.model_name,
        "request": asdict(plan.request),
        "world": plan.request.world,
        "gpu": plan.gpu,
        "gpu_memory_gib": None if plan.gpu_memory is None else round(plan.gpu_memory / GIB, 2),
        "parameters": inventory.total_params,
        "trainable_parameters": inventory.trainable_params,
        "layers": len(inventory.layers),
        "experts": inventory.num_experts,
        "fits": plan.fits,
        "plan": candidate_dict(plan.best, peak),
        "alternatives": [candidate_dict(c, peak) for c in plan.candidates[1:1 + alternatives]],
        "suggestions": plan.suggestions,
        "recipe_overrides": recipe_overrides(plan.best),
        "assumptions": assumptions(plan),
    }


def recipe_overrides(candidate: Candidate) -> list[str]:
    """The ``moetune finetune`` overrides that run this setting."""
    s = candidate.setting
    out = [f"--distributed.ep_size {s.ep}", f"--training.micro_batch_size {s.micro_batch}",
           f"--training.grad_accum_steps {s.grad_accum}",
           f"--model.activation_checkpointing {'false' if s.recompute == 'none' else 'true'}"]
    if s.recompute != "none":
        out.append(f"--model.activation_checkpointing_mode {s.recompute}")
    if s.dense_parallel != "fsdp":
        out.append(f"--distributed.dense_parallel {s.dense_parallel}")
    if s.ep_dispatch != "alltoall":
        out.append(f"--distributed.ep_dispatch {s.ep_dispatch}")
    out.append(f"--training.cuda_graph {'true' if s.cuda_graph else 'false'}")
    return out


def assumptions(plan: Plan) -> list[str]:
    notes = ["memory: parameters, gradients and optimizer states are exact per rank (moetune's sharding, FSDP2's "
             "padding); activations and buffers are modelled per kernel (docs/planning.md)"]
    if plan.calibration is None:
        notes.append("no GPU calibration (--gpu cpu, or a GPU type without one): memory only, without the reserve; "
                     "no step time" + ("" if plan.gpu_memory else "; no GPU memory to fit"))
    else:
        notes.append(f"step time: calibrated on {plan.calibration.gpu} (moetune/plan/calibration/); real routing "
                     "unless --routing balanced")
        if plan.request.world > plan.request.gpus_per_node:
            notes.append("inter-node bandwidth: assumed one 400 Gb/s NIC per GPU at 80% (not measured here)")
    if plan.request.fp8:
        c = plan.calibration
        notes.append(f"FP8: forward and input-gradient GEMM time / {c['fp8_gemm_speedup']:g}, each FP8 weight quantised "
                     f"in two layouts every micro-batch at {c['fp8_weight_quantize_tbps']:g} TB/s, activations x "
                     f"{c['fp8_activation_ratio']:g} (calibration fp8_*: fitted to three measured H100 steps at 4k-32k "
                     "tokens, where FP8 went from 0.86x to 1.02x of bf16; docs/fp8.md)")
    return notes


def _gib(value: float) -> str:
    if value and value < GIB / 10:
        return f"{value / 1024**2:7.1f} MiB"
    return f"{value / GIB:7.1f} GiB"


def _count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(int(n))


def format_plan(plan: Plan, *, alternatives: int = 3) -> str:
    r, best, inventory = plan.request, plan.best, plan.inventory
    memory = "" if plan.gpu_memory is None else f" ({plan.gpu_memory / GIB:.1f} GiB)"
    lines = [
        f"moetune plan: {plan.model_name} ({_count(inventory.total_params)} parameters, "
        f"{_count(inventory.trainable_params)} trainable, {len(inventory.layers)} layers, "
        f"{inventory.num_experts} experts) on {r.nodes} x {r.gpus_per_node} {plan.gpu}{memory}",
        f"  sequence {r.seq_len}, {'LoRA rank ' + str(r.lora_rank) if r.lora_rank else 'full fine-tuning'}, "
        f"{r.precision}" + (", FP8" if r.fp8 else ""),
    ]
    s = best.setting
    verdict = "fits" if best.fits else "DOES NOT FIT"
    lines += [
        "",
        f"{'Settings' if best.fits else 'Closest setting'} ({verdict}): ep_size {s.ep}, dense_parallel {s.dense_parallel}, "
        f"ep_dispatch {s.ep_dispatch}, activation checkpointing {s.recompute}, micro-batch {s.micro_batch}, "
        f"gradient accumulation {s.grad_accum}, CUDA graph {'on' if s.cuda_graph else 'off'}",
        "  moetune finetune ... " + " ".join(recipe_overrides(best)),
        "",
        f"Memory per GPU (peak during {best.memory.peak_stage}):",
    ]
    for name in MEMORY_PARTS:
        lines.append(f"  {MEMORY_LABELS[name]:<36}{_gib(getattr(best.memory, name))}")
    lines.append(f"  {'peak allocated':<36}{_gib(best.memory.peak)}")
    limit = "" if plan.gpu_memory is None else f" of {plan.gpu_memory / GIB:.1f} GiB"
    lines.append(f"  {'total':<36}{_gib(best.memory.total)}{limit}")
    if best.time is not None:
        t = best.time
        peak = plan.calibration["matmul_tflops"]
        lines += [
            "",
            f"Step time {t.step * 1e3:.1f} ms: {t.tokens_per_s:,.0f} tokens/s/GPU, "
            f"{t.tokens_per_s * t.flops_per_token / 1e12:.0f} TFLOP/s/GPU, MFU {100 * t.mfu(peak):.1f}% of {peak:.0f}",
            "  " + ", ".join(f"{label} {getattr(t, name) * 1e3:.1f}" for label, name in TIME_LABELS) + " ms",
        ]
    if plan.suggestions:
        lines += ["", "Does not fit. What would:"] + [f"  - {text}" for text in plan.suggestions]
    others = [c for c in plan.candidates[1:] if c.fits][:alternatives]
    if others:
        lines += ["", "Next best settings:"]
        for c in others:
            s = c.setting
            speed = "" if c.time is None else f", {c.time.tokens_per_s:,.0f} tokens/s/GPU"
            lines.append(f"  ep {s.ep}, {s.dense_parallel}/{s.ep_dispatch}, recompute {s.recompute}, micro-batch "
                         f"{s.micro_batch}, graph {'on' if s.cuda_graph else 'off'}: {c.memory.total / GIB:.1f} GiB{speed}")
    lines += [""] + [f"Note: {text}" for text in assumptions(plan)]
    return "\n".join(lines)
