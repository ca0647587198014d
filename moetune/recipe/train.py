"""The fine-tuning job: ``finetune(config)`` wires the small parts together and runs the loop."""

from __future__ import annotations

import contextlib
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from moetune.recipe import checkpointing, evaluation, export, metrics, optim, plots
from moetune.recipe.config import JobConfig
from moetune.recipe.config_loading import save_config, to_dict
from moetune.recipe.dataset import prepare_data
from moetune.recipe.distributed_setup import (
    Runtime, all_reduce_sum, clip_grad_norm, init_runtime, shutdown, unwrap, wrap_model,
)
from moetune.recipe.interrupts import StopRequest
from moetune.recipe.model_loading import build_model, is_moe, load_model_config, load_tokenizer, model_fingerprint
from moetune.recipe.packing import Batch, BatchStream, fixed_batches


class NonFiniteLossError(RuntimeError):
    """The loss or gradient norm became NaN/inf; the run stopped without saving over good checkpoints."""


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    num_tokens: int
    """Real tokens of this step, summed over ranks."""


@dataclass
class FinetuneResult:
    """What a finished (or interrupted) job reports back."""

    step: int
    losses: list[float] = field(default_factory=list)
    """Training loss of every step run by this process (after a resume: from the resume on)."""
    val_loss: float | None = None
    accuracy_before: float | None = None
    accuracy_after: float | None = None
    interrupted: bool = False
    exported: dict[str, str] = field(default_factory=dict)
    """Paths written at the end: "final" (Hugging Face model), "adapter" (PEFT), "plots"."""


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, micro_batches: list[Batch], *,
               runtime: Runtime, grad_clip: float, aux_coef: float, moe: bool,
               autocast: Callable[[], contextlib.AbstractContextManager],
               expert_load: metrics.ExpertLoad | None) -> StepResult:
    """Forward/backward over the micro-batches, clip, optimizer step. Raises NonFiniteLossError
    (before the optimizer step) when the loss or gradients are not finite."""
    # Normalise by the answer tokens of the whole global step, so every token weighs the same
    # whatever micro-batch or rank it is on; DP averages gradients over ranks, hence / world_size.
    num_label, num_tokens = all_reduce_sum(
        [sum(b.num_label_tokens for b in micro_batches), sum(b.num_tokens for b in micro_batches)], runtime)
    items_per_rank = max(num_label, 1.0) / runtime.world_size
    loss_sum = torch.zeros((), device=runtime.device)
    for batch in micro_batches:
        with autocast():
            out = model(**batch.model_inputs(runtime.device), num_items_in_batch=items_per_rank,
                        output_router_logits=moe)
        lm_loss = out.loss
        if getattr(out, "aux_loss", None) is not None and aux_coef:
            # The model added aux_coef * aux per micro-batch; keep the LM part and average the aux part.
            lm_loss = out.loss - aux_coef * out.aux_loss
            loss = lm_loss + aux_coef * out.aux_loss / len(micro_batches)
        else:
            loss = lm_loss
        loss.backward()
        loss_sum += lm_loss.detach()
        if expert_load is not None:
            expert_load.add(out.router_logits, batch.real_BT.flatten())
    grad_norm = clip_grad_norm(model, max_norm=grad_clip)
    (loss_value,) = all_reduce_sum([float(loss_sum)], runtime)
    loss_value /= runtime.world_size
    if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
        optimizer.zero_grad(set_to_none=True)
        raise NonFiniteLossError(f"loss {loss_value}, grad norm {grad_norm}")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss=loss_value, grad_norm=grad_norm, num_tokens=int(num_tokens))


def autocast_for(precision: str, device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    if precision == "bf16_autocast":
        return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def resolve_precision(precision: str, device: torch.device) -> str:
    if precision == "auto":
        return "bf16_autocast" if device.type == "cuda" else "fp32"
    return precision


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def finetune(config: JobConfig) -> FinetuneResult:
    """Run the job described by ``config`` (already validated) and export the result."""
    runtime = init_runtime(config.training, config.distributed)
    try:
        return _finetune(config, runtime)
    finally:
        shutdown(runtime)


def _finetune(config: JobConfig, runtime: Runtime) -> FinetuneResult:
    if config.training.num_threads:
        torch.set_num_threads(config.training.num_threads)
    seed_everything(config.training.seed)
    out_dir = Path(config.training.output_dir)
    precision = resolve_precision(config.training.precision, runtime.device)
    autocast = autocast_for(precision, runtime.device)

    tokenizer = load_tokenizer(config.model)
    model_config = load_model_config(config.model)
    data = prepare_data(config.data, tokenizer, seed=config.training.seed)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = build_model(config.model, model_config=model_config, dtype=dtype, device=runtime.device)
    moe = is_moe(model_config)
    base_path = config.model.pretrained_path
    if config.lora.enabled:
        base_path = base_path or _save_random_base(model, tokenizer, out_dir / "base", runtime)
        from moetune.lora import apply_lora

        apply_lora(model, config.lora)
    fingerprint = {**model_fingerprint(model_config),
                   "lora": to_dict(config.lora) if config.lora.enabled else None}
    hf_model = model
    model = wrap_model(model, runtime, config.distributed)
    optimizer = optim.build_optimizer([p for p in model.parameters() if p.requires_grad], config.optim,
                                      device=runtime.device)
    stream = BatchStream(data.train, micro_batch_size=config.training.micro_batch_size,
                         max_length=config.data.max_length, packed=config.data.packing,
                         pad_id=tokenizer.pad_token_id, seed=config.training.seed,
                         rank=runtime.rank, world_size=runtime.world_size)
    val_batches = fixed_batches(data.val, micro_batch_size=config.training.micro_batch_size,
                                max_length=config.data.max_length, packed=config.data.packing,
                                pad_id=tokenizer.pad_token_id, rank=runtime.rank, world_size=runtime.world_size)
    moe_layers = metrics.moe_layer_ids(model_config)
    expert_load = (metrics.ExpertLoad(num_layers=len(moe_layers), num_experts=_num_experts(model_config),
                                      top_k=model_config.num_experts_per_tok, device=runtime.device)
                   if moe and moe_layers else None)

    step = 0
    resume_from = checkpointing.resolve_resume(config.checkpoint.resume, output_dir=config.training.output_dir)
    if resume_from is not None:
        state = checkpointing.load_checkpoint(resume_from, model=model, optimizer=optimizer, runtime=runtime,
                                              fingerprint=fingerprint)
        step = state.step
        stream.load_state_dict(state.data)

    sink = None
    if runtime.is_main:
        save_config(config, out_dir / "config.yaml")
        sink = metrics.MetricsSink(config.metrics, output_dir=out_dir, total_steps=config.training.steps,
                                   initial_step=step, run_config=to_dict(config))
        sink.message(f"data: {len(data.train)} train / {len(data.val)} validation samples; "
                     f"{data.stats.bad_rows} malformed rows skipped, {data.stats.truncated} truncated to "
                     f"{config.data.max_length} tokens, {data.stats.empty} without answer tokens dropped"
                     + (f"; resumed from {resume_from}" if resume_from else ""))
    result = FinetuneResult(step=step)

    def accuracy(label: str) -> float | None:
        if data.eval_set is None:
            return None
        em = evaluation.exact_match(hf_model, tokenizer, data.eval_set, device=runtime.device,
                                    max_new_tokens=config.data.max_new_tokens, autocast=autocast)
        if sink is not None:
            sink.log({"step": step, f"accuracy_{label}": em["accuracy"], "examples": em["examples"]})
            sink.message(f"held-out exact match {label} training: {100 * em['accuracy']:.1f}% "
                         f"of {em['num_samples']} (e.g. {em['examples'][0]['prompt']!r} -> "
                         f"{em['examples'][0]['got']!r}, expected {em['examples'][0]['expected']!r})")
        return em["accuracy"]

    if step == 0:
        result.accuracy_before = accuracy("before")

    flops_per_token = metrics.training_flops_per_token(model_config, seq_len=config.data.max_length)
    aux_coef = float(getattr(model_config, "router_aux_loss_coef", 0.0) or 0.0) if moe else 0.0
    window: list[StepResult] = []
    window_start = time.perf_counter()
    with StopRequest() as stop:
        while step < config.training.steps:
            optim.set_lr(optimizer, optim.lr_at(step, config.optim, total_steps=config.training.steps))
            micro_batches = [next(stream) for _ in range(config.training.grad_accum_steps)]
            try:
                step_result = train_step(model, optimizer, micro_batches, runtime=runtime,
                                         grad_clip=config.optim.grad_clip, aux_coef=aux_coef, moe=moe,
                                         autocast=autocast, expert_load=expert_load)
            except NonFiniteLossError as err:
                last = checkpointing.list_checkpoints(config.training.output_dir)
                kept = f"the last good checkpoint is {last[-1]}" if last else "no checkpoint was written"
                raise NonFiniteLossError(f"training stopped at step {step + 1}: {err}. Nothing was saved; {kept}. "
                                         "Try a lower optim.lr or optim.grad_clip.") from err
            step += 1
            result.losses.append(step_result.loss)
            window.append(step_result)

            if step % config.metrics.log_every == 0 or step == config.training.steps:
                elapsed = time.perf_counter() - window_start
                record = _step_record(step, window, elapsed, optimizer, runtime, flops_per_token, config)
                if config.training.val_every and step % config.training.val_every == 0 and val_batches:
                    record["val_loss"] = evaluation.validation_loss(model, val_batches, runtime=runtime,
                                                                    autocast=autocast)
                if sink is not None:
                    sink.log(record)
                    sink.advance(len(window), metrics.format_postfix(record))
                    if "val_loss" in record:
                        sink.message(f"step {step}: validation loss {record['val_loss']:.4f}")
                window, window_start = [], time.perf_counter()

            periodic = config.checkpoint.every and step % config.checkpoint.every == 0
            if periodic or stop.requested:
                path = checkpointing.save_checkpoint(
                    output_dir=config.training.output_dir,
                    state=checkpointing.TrainState(step=step, data=stream.state_dict(), fingerprint=fingerprint,
                                                   world_size=runtime.world_size),
                    model=model, optimizer=optimizer, runtime=runtime, keep_last=config.checkpoint.keep_last)
                if stop.requested:
                    if sink is not None:
                        sink.message(f"interrupted: saved {path}; resume with --checkpoint.resume auto")
                        sink.close()
                    result.step, result.interrupted = step, True
                    return result

    result.step = step
    if val_batches:
        result.val_loss = evaluation.validation_loss(model, val_batches, runtime=runtime, autocast=autocast)
    result.accuracy_after = accuracy("after")
    if sink is not None:
        sink.log({"step": step, "final": True, "val_loss": result.val_loss,
                  "accuracy_before": result.accuracy_before, "accuracy_after": result.accuracy_after,
                  "expert_tokens": expert_load.as_lists() if expert_load is not None else None})
        sink.close()
    if config.checkpoint.export_final:
        if config.lora.enabled:
            paths = export.export_lora(hf_model, tokenizer, out_dir, base_model_name_or_path=base_path,
                                       merged=config.lora.export_merged, runtime=runtime)
        else:
            paths = {"final": export.export_model(hf_model, tokenizer, out_dir / "final", runtime=runtime)}
        result.exported.update({k: str(v) for k, v in paths.items()})
    if runtime.is_main and config.metrics.plots:
        result.exported["plots"] = str(plots.write_plots(out_dir, moe_layer_ids=moe_layers))
    if runtime.is_main:
        _print_summary(result, out_dir)
    return result


def _step_record(step: int, window: list[StepResult], elapsed: float, optimizer: torch.optim.Optimizer,
                 runtime: Runtime, flops_per_token: float, config: JobConfig) -> dict[str, Any]:
    tokens_per_s_per_gpu = sum(r.num_tokens for r in window) / max(elapsed, 1e-9) / runtime.world_size
    tflops = tokens_per_s_per_gpu * flops_per_token / 1e12
    return {
        "step": step,
        "loss": sum(r.loss for r in window) / len(window),
        "lr": optimizer.param_groups[0]["lr"],
        "grad_norm": window[-1].grad_norm,
        "tokens_per_s_per_gpu": tokens_per_s_per_gpu,
        "tflops_per_gpu": tflops,
        # MFU against a GPU's bf16 peak means nothing on a CPU.
        "mfu": tflops / config.metrics.peak_tflops if runtime.device.type == "cuda" else None,
        "peak_mem_gib": metrics.peak_memory_gib(runtime.device),
        "time": time.time(),
    }


def _num_experts(model_config: Any) -> int:
    return getattr(model_config, "num_experts", None) or model_config.num_local_experts


def _save_random_base(model: torch.nn.Module, tokenizer: Any, path: Path, runtime: Runtime) -> str:
    """LoRA on a randomly initialised model: save that base, so the PEFT adapter has one to load onto."""
    if runtime.is_main:
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    return str(path)


def _print_summary(result: FinetuneResult, out_dir: Path) -> None:
    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{100 * x:.1f}%"

    lines = [f"done: {result.step} steps; final train loss {result.losses[-1]:.4f}" if result.losses
             else f"done: {result.step} steps"]
    if result.val_loss is not None:
        lines.append(f"validation loss {result.val_loss:.4f}")
    lines.append(f"held-out exact match: before {pct(result.accuracy_before)}, after {pct(result.accuracy_after)}")
    for name, path in result.exported.items():
        lines.append(f"{name}: {path}")
    lines.append(f"metrics: {out_dir / 'metrics.jsonl'}")
    print("\n".join(lines), flush=True)
