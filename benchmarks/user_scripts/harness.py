"""What the user scripts share that is not the user's: their command line and the measurement.

The scripts in this folder are written as users write them; the benchmark only adds
``parse_args`` (the checkpoint, tokens, step count and the one import that differs) and
``Measurement``, a ``TrainerCallback`` that records, per optimizer step:

- the time between the ends of consecutive steps, on the GPU's timeline (CUDA events recorded at
  each step's end, read once after the run: no synchronisation the user's script would not have;
  data loading and the trainer's own work included, as gaps where the GPU waits for the host);
- the real tokens of the step: the attention mask's ones (padded batches) or every token
  (padding-free and fixed-length rows), counted on the device by a forward pre-hook;
- the model's own loss of each step (exact; the trainer's log rounds it) and the logged loss;
- peak memory (``torch.cuda.max_memory_allocated``) since a reset after the warm-up steps;
- with ``--profile-step``, one step under ``torch.profiler``: the GPU's busy and idle time in it and
  its kernels by GPU time (that step is left out of tokens/s: the profiler slows the host);
and writes them, with tokens/s after the warm-up (median and mean) and the run's settings, to
``--result`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

IMPORTS = ("transformers", "moetune")
GIB = 1024**3


def parse_args(description: str | None, argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--import-from", choices=IMPORTS, required=True, help="where the model (and trainer) class comes from")
    parser.add_argument("--checkpoint", required=True, help="a Hugging Face checkpoint folder (weights, config, tokenizer)")
    parser.add_argument("--data", required=True, help="JSONL of pre-tokenised samples ({'input_ids': [...]} per line)")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--result", required=True, help="where the measurement's JSON goes")
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--warmup-steps", type=int, default=10, help="steps left out of tokens/s and peak memory")
    parser.add_argument("--batch-size", type=int, default=1, help="per_device_train_batch_size")
    parser.add_argument("--grad-accum", type=int, default=1, help="gradient_accumulation_steps")
    parser.add_argument("--max-length", type=int, default=4096, help="SFTConfig.max_length (packing's row length)")
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    parser.add_argument("--packing", action="store_true", help="SFTConfig(packing=True)")
    parser.add_argument("--padding-free", action="store_true", help="SFTConfig(padding_free=True)")
    parser.add_argument("--torch-compile", action="store_true", help="TrainingArguments(torch_compile=True)")
    parser.add_argument("--moetune-trainer", action="store_true", help="with --import-from moetune: moetune's Trainer too")
    parser.add_argument("--torch-compile-backend", default=None)
    parser.add_argument("--non-blocking", action="store_true",
                        help="TrainingArguments(accelerator_config={'non_blocking': True}): batches copied without blocking the host")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--cpu", action="store_true", help="train on the CPU in fp32 (the smoke tests)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile-step", type=int, default=None,
                        help="profile this optimizer step (0-based, after the warm-up; left out of tokens/s): the GPU's "
                        "busy and idle time and the kernels by GPU time, in the result's 'profile'")
    parser.add_argument("--logging-steps", type=int, default=10,
                        help="TrainingArguments.logging_steps (the Trainer reads the loss on the host at each log)")
    args = parser.parse_args(argv)
    if args.profile_step is not None and not args.warmup_steps <= args.profile_step < args.max_steps:
        parser.error(f"--profile-step must be a measured step: {args.warmup_steps} to {args.max_steps - 1}, got {args.profile_step}")
    args.bf16 = not args.cpu
    args.dtype = torch.float32 if args.cpu else torch.bfloat16
    return args


def common_training_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """What every script passes to ``TrainingArguments`` / ``SFTConfig`` (the rest is Transformers' defaults:
    AdamW, linear schedule, ``max_grad_norm=1.0``)."""
    return dict(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum, learning_rate=args.learning_rate, bf16=args.bf16,
        use_cpu=args.cpu, logging_steps=args.logging_steps, save_strategy="no", report_to=[], seed=args.seed,
        dataloader_num_workers=0, disable_tqdm=True, torch_compile=args.torch_compile,
        torch_compile_backend=args.torch_compile_backend,
        **({"accelerator_config": {"non_blocking": True}} if args.non_blocking else {}),
    )  # fmt: skip


def lora_targets(model_type: str) -> tuple[list[str], list[str]]:
    """(target_modules, target_parameters) of the benchmark's LoRA: the attention projections and
    every expert weight, by the module names Transformers v5 gives each family."""
    experts = {
        "qwen3_moe": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        "gpt_oss": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        "deepseek_v3": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        "nemotron_h": ["mixer.experts.up_proj", "mixer.experts.down_proj"],
    }
    attention = {"deepseek_v3": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]}
    return attention.get(model_type, ["q_proj", "k_proj", "v_proj", "o_proj"]), experts[model_type]


# A step's phases between the marks the callbacks record: (name, from mark, to mark). "forward" is
# the last micro-batch's forward; "backward_and_clip" its backward, the gradient norm and clipping;
# "optimizer" the optimizer's step; "after_optimizer" the scheduler, zero_grad and the callbacks.
PHASES = (
    ("forward", "begin", "forward"),
    ("backward_and_clip", "forward", "clipped"),
    ("optimizer", "clipped", "stepped"),
    ("after_optimizer", "stepped", "end"),
)


class Measurement(TrainerCallback):
    """Tokens/s, peak memory and losses of a Trainer run (see the module); JSON to ``args.result``."""

    def __init__(self, args: argparse.Namespace, *, script: str) -> None:
        self.args, self.script = args, script
        self.tokens: list[int] = []
        self.losses: list[float] = []
        self.logged_losses: list[float] = []
        self._counted = None  # device tensors: the step's real tokens and loss, summed over micro-batches
        self._loss = None
        self._handles: list = []
        self._peak: int | None = None
        # Replays of CUDA graphs allocate nothing (their memory was taken while capturing, maybe before
        # the reset): the reserved peak, which holds the graphs' pools, is the comparable footprint.
        self._peak_reserved: int | None = None
        self._start = None  # the mark at the start of training
        self._steps: list[tuple[dict, Any, Any]] = []  # per step: its marks, real tokens and loss (device tensors)
        self.step_s: list[float] = []  # read from the marks after the run
        self._model = None
        self._optimizer: str | None = None
        # Where a step's GPU time goes: CUDA events at the step's marks (read after the run, so they add
        # no synchronisation), one list of milliseconds per phase.
        self._marks: dict[str, Any] = {}
        self.phases_ms: dict[str, list[float]] = {name: [] for name, _, _ in PHASES}
        self._profiler = None
        self.profile: dict[str, Any] | None = None

    # -- hooks on the model: every micro-batch's tokens and loss, on the device (no synchronisation) --

    def _count_tokens(self, _module, args, kwargs) -> None:
        ids, mask = kwargs.get("input_ids", args[0] if args else None), kwargs.get("attention_mask")
        if ids is None or not torch.is_grad_enabled():
            return
        counted = mask.sum() if mask is not None else torch.tensor(ids.numel(), device=ids.device)
        self._counted = counted if self._counted is None else self._counted + counted

    def _record_loss(self, _module, _args, _kwargs, output) -> None:
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if loss is None or not torch.is_grad_enabled():
            return
        loss = loss.detach().float()
        self._loss = loss if self._loss is None else self._loss + loss
        self._mark("forward")  # the last micro-batch's forward ends here

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._model = model
        self._optimizer = type(getattr(optimizer, "optimizer", optimizer)).__module__ + "." + type(getattr(optimizer, "optimizer", optimizer)).__name__
        self._handles = [
            model.register_forward_pre_hook(self._count_tokens, with_kwargs=True),
            model.register_forward_hook(self._record_loss, with_kwargs=True),
        ]
        self._start = self._new_mark()

    def _new_mark(self):
        if torch.cuda.is_available() and not self.args.cpu:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return _HostMark()

    # The "forward" mark is set from a hook inside the model's forward, which torch.compile
    # (TrainingArguments(torch_compile=True)) would trace: an event recorded at tracing time only.
    @torch.compiler.disable
    def _mark(self, name: str) -> None:
        self._marks[name] = self._new_mark()

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.args.profile_step and self._profiler is None and self.profile is None:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() and not self.args.cpu else [])
            self._profiler = profile(activities=activities)
            self._profiler.__enter__()
        self._marks = {}
        self._mark("begin")

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._mark("clipped")

    def on_optimizer_step(self, args, state, control, **kwargs):
        self._mark("stepped")

    def on_step_end(self, args, state, control, **kwargs):
        self._mark("end")
        if self._profiler is not None:
            _synchronize()  # the step's kernels, all of them, inside the profile
            self._profiler.__exit__(None, None, None)
            self.profile = _profile_summary(self._profiler)
            self._profiler = None
        self._steps.append((self._marks, self._counted, self._loss))  # read after the run
        self._counted = self._loss = None
        if len(self._steps) == self.args.warmup_steps and torch.cuda.is_available() and not self.args.cpu:
            torch.cuda.reset_peak_memory_stats()  # the allocator's own counters, on the host: no synchronisation

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.logged_losses.append(float(logs["loss"]))

    def on_train_end(self, args, state, control, **kwargs):
        for handle in self._handles:
            handle.remove()
        self._read_steps()
        if torch.cuda.is_available() and not self.args.cpu:
            self._peak = torch.cuda.max_memory_allocated()
            self._peak_reserved = torch.cuda.max_memory_reserved()
        Path(self.args.result).parent.mkdir(parents=True, exist_ok=True)
        Path(self.args.result).write_text(json.dumps(self.summary(), indent=1) + "\n")

    def _read_steps(self) -> None:
        """Every step's times, tokens and loss, read once the run is over (one synchronisation)."""
        _synchronize()
        previous_end = self._start
        for marks, counted, loss in self._steps:
            self.step_s.append(previous_end.elapsed_time(marks["end"]) / 1e3)
            previous_end = marks["end"]
            for name, start, stop in PHASES:
                self.phases_ms[name].append(marks[start].elapsed_time(marks[stop]) if start in marks and stop in marks else None)
            self.tokens.append(int(counted.item()) if counted is not None else 0)
            self.losses.append(float(loss.item()) / max(1, self.args.grad_accum) if loss is not None else float("nan"))

    def summary(self) -> dict[str, Any]:
        step_s = self.step_s
        measured = [i for i in range(min(self.args.warmup_steps, len(step_s)), len(step_s)) if i != self.args.profile_step]
        rates = [self.tokens[i] / step_s[i] for i in measured if step_s[i] > 0]
        total_s = sum(step_s[i] for i in measured)
        return {
            "script": self.script,
            "import_from": self.args.import_from,
            "steps": len(step_s),
            "warmup_steps": self.args.warmup_steps,
            "tokens_per_s_median": statistics.median(rates) if rates else None,
            "tokens_per_s_mean": sum(self.tokens[i] for i in measured) / total_s if total_s > 0 else None,
            "step_s_median": statistics.median([step_s[i] for i in measured]) if measured else None,
            "peak_memory_gib": None if self._peak is None else self._peak / GIB,
            "peak_reserved_gib": None if self._peak_reserved is None else self._peak_reserved / GIB,
            "losses": self.losses,
            "logged_losses": self.logged_losses,
            "tokens": self.tokens,
            "step_s": step_s,
            "phases_ms_median": {
                name: statistics.median(kept) if measured and None not in (kept := [times[i] for i in measured]) else None
                for name, times in self.phases_ms.items()
            },
            "profile": self.profile,
            "graph_replays": _graph_replays(self._model),
            "graph_eager_reason": _graph_eager_reason(self._model),
            "optimizer": self._optimizer,
            "settings": {k: v for k, v in vars(self.args).items() if k != "dtype"} | {"dtype": str(self.args.dtype)},
            "pid": os.getpid(),
        }


def _profile_summary(profiler) -> dict[str, Any]:
    """The profiled step: GPU span, busy and idle milliseconds, where the idle time was, the kernels by
    GPU time (empty on a CPU), and the host's time in the step."""
    from moetune.bench.timeline import gpu_timeline, top_kernels

    events = profiler.events()
    host = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    host_ms = (max(e.time_range.end for e in host) - min(e.time_range.start for e in host)) / 1e3 if host else None
    return {**gpu_timeline(events), "top_kernels": top_kernels(events), "host_span_ms": host_ms}


def _graph_replays(model) -> int | None:
    """Forwards that moetune replayed from CUDA graphs (None for a Transformers model)."""
    runners = [m.__dict__["_training_graphs"] for m in model.modules() if "_training_graphs" in m.__dict__] if model else []
    return sum(r.replays for r in runners) if runners else None


def _graph_eager_reason(model) -> str | None:
    """Why moetune's last training forward ran eagerly (None when it replayed, or for Transformers)."""
    runners = [m.__dict__["_training_graphs"] for m in model.modules() if "_training_graphs" in m.__dict__] if model else []
    return next((r.disabled_reason or r.eager_reason for r in runners if r.disabled_reason or r.eager_reason), None)


class _HostMark:
    """A mark of a CPU run (the host's clock: the CPU runs each op as it is issued), read like a CUDA event."""

    def __init__(self) -> None:
        self.time = time.perf_counter()

    def elapsed_time(self, end: _HostMark) -> float:
        return (end.time - self.time) * 1e3


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
