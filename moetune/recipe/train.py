"""The fine-tuning job: ``finetune(config)`` wires the small parts together and runs the loop."""

from __future__ import annotations

import contextlib
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from moetune.flops import FlopsCounter
from moetune.recipe import checkpointing, evaluation, export, metrics, optim, plots
from moetune.recipe.config import JobConfig
from moetune.recipe.config_loading import save_config, to_dict
from moetune.recipe.dataset import PreparedData, data_digest, prepare_data
from moetune.recipe.distributed_setup import (
    Runtime, all_reduce_sum, check_same_on_every_rank, check_shared_folder, init_runtime, rank0_decides,
    sharding_options, shutdown, wrap_model,
)
from moetune.recipe.interrupts import StopRequest
from moetune.recipe.output_lock import OutputLock
from moetune.recipe.model_loading import (
    build_model, check_model_for_job, check_weight_files, load_model_config, load_tokenizer, model_fingerprint,
)
from moetune.recipe.packing import Batch, BatchStream, check_resumable, fixed_batches, max_documents_per_row
from moetune.recipe.planning import check_job_fits, job_shape
from moetune.recipe.profiling import StepProfiler
from moetune.recipe.step import GraphedTrainStep, NonFiniteLossError, StepResult, train_step, uses_cuda_graph
from moetune.training import set_learning_rate


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


def autocast_for(precision: str, device: torch.device, *,
                 cache_enabled: bool = True) -> Callable[[], contextlib.AbstractContextManager]:
    """``cache_enabled=False`` for CUDA-graph captures (torch's AMP notes: autocast's cache of cast
    weights must not be used across a capture)."""
    if precision == "bf16_autocast":
        return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16, cache_enabled=cache_enabled)
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
    threads_before = torch.get_num_threads()  # restored at the end: a library call must not leak it
    clean = False
    # Rank 0 holds the output folder for the whole run (the other ranks write into it under its lock).
    lock = OutputLock(Path(config.training.output_dir)) if runtime.is_main else None
    try:
        if config.training.num_threads:
            torch.set_num_threads(config.training.num_threads)
        seed_everything(config.training.seed)
        # First of all (a refusal costs nothing): the folder is usable and no other run holds it.
        rank0_decides(lambda: _hold_output_dir(lock, config), runtime)
        check_shared_folder(Path(config.training.output_dir), runtime, field="training.output_dir")
        # Before anything is built (a refusal costs nothing); read by rank 0 for all (rank0_decides).
        resume = rank0_decides(lambda: checkpoint_to_resume(config, runtime), runtime)
        job = build_job(config, runtime)
        step = resume_from(job, resume)
        sink = open_sink(job, config, step)
        result = FinetuneResult(step=step)
        if step == 0:
            result.accuracy_before = held_out_accuracy(job, config, sink, step=step, label="before")
        result.step, result.interrupted = training_loop(job, config, sink, step=step, losses=result.losses)
        if result.interrupted:
            sink.close()
            clean = True
            return result
        finish(job, config, sink, result)
        clean = True
        return result
    finally:
        if lock is not None:
            lock.release()
        torch.set_num_threads(threads_before)
        shutdown(runtime, clean=clean)


def _hold_output_dir(lock: OutputLock, config: JobConfig) -> None:
    """Take ``training.output_dir`` for this run (rank 0); remove what a killed run left half-written."""
    lock.acquire()
    gone = lock.taken_over
    if gone is not None:
        print(f"{config.training.output_dir}: the run that held it (pid {gone.get('pid')} on host {gone.get('host')}, "
              f"since {gone.get('since')}) is gone; this run holds it now", flush=True)
    for partial in checkpointing.remove_partial_checkpoints(config.training.output_dir):
        print(f"removed {partial}, a checkpoint that an earlier run did not finish writing", flush=True)


@dataclass
class Job:
    """The parts of a running job, built once by ``build_job``."""

    runtime: Runtime
    tokenizer: PreTrainedTokenizerBase
    model_config: PretrainedConfig
    data: PreparedData
    model: torch.nn.Module
    """What the loop calls: the data-parallel wrapper under DDP, else the model itself."""
    hf_model: PreTrainedModel
    """The Transformers model inside ``model`` (for generate, save_pretrained)."""
    optimizer: torch.optim.Optimizer
    stream: BatchStream
    val_batches: list[Batch]
    expert_load: metrics.ExpertLoad | None
    fingerprint: dict[str, Any]
    base_path: str
    """The base checkpoint a LoRA adapter applies to (an absolute path)."""
    autocast: Callable[[], contextlib.AbstractContextManager]
    out_dir: Path
    num_offsets: int | None = None
    """Packed rows into a model whose attention takes document offsets: how many offsets a
    micro-batch's padded offsets hold (the fixed shape of a CUDA-graph step); else None."""
    cuda_graph: bool = False
    """Whether the steps replay CUDA graphs (``training.cuda_graph`` resolved, ``uses_cuda_graph``)."""


def build_job(config: JobConfig, runtime: Runtime) -> Job:
    precision = resolve_precision(config.training.precision, runtime.device)
    out_dir = Path(config.training.output_dir)
    tokenizer = load_tokenizer(config.model)
    model_config = load_model_config(config.model)
    takes_offsets = check_model_for_job(model_config, packing=config.data.packing,
                                        cuda_graph=config.training.cuda_graph == "true", tokenizer_size=len(tokenizer))
    check_weight_files(config.model)
    cuda_graph = uses_cuda_graph(config, runtime, takes_offsets=takes_offsets)
    _check_graph_sharding(config, runtime)
    # The plan, before any data or weight is read: a job that cannot fit its GPUs stops here.
    check_job_fits(config, model_config, job_shape(runtime, cuda_graph=cuda_graph),
                   announce=lambda text: print(text, flush=True) if runtime.is_main else None)
    data = prepare_data(config.data, tokenizer, seed=config.training.seed)
    # Each rank reads and tokenizes on its own and takes its share of one order: the same samples
    # everywhere, or some are seen twice and others never (and unequal validation batches hang).
    if runtime.distributed:  # the hash reads every token: not for one process
        check_same_on_every_rank(data_digest(data), runtime, what="the data (data.train_path as each process read it)")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    lora = config.lora if config.lora.enabled else None
    sharding = sharding_options(runtime, config.distributed, lora=lora, model_config=model_config)
    hf_model = build_model(config.model, model_config=model_config, dtype=dtype, device=runtime.device,
                           sharding=sharding)
    base_path = config.model.pretrained_path
    if lora is not None:
        base_path = base_path or _save_random_base(hf_model, tokenizer, out_dir / "base", runtime)
        # Absolute: the adapter's base_model_name_or_path is read from wherever the adapter is loaded.
        base_path = str(Path(base_path).resolve())
        if sharding is None:  # sharded models got their adapters between expert parallelism and FSDP2
            from moetune.lora import apply_lora

            apply_lora(hf_model, config.lora)
    model = wrap_model(hf_model, runtime, config.distributed)
    batching = {"micro_batch_size": config.training.micro_batch_size, "max_length": config.data.max_length,
                "packed": config.data.packing, "pad_id": tokenizer.pad_token_id, "rank": runtime.rank,
                "world_size": runtime.world_size, "packing_strategy": config.data.packing_strategy,
                "pad_to_multiple_of": config.data.pad_to_multiple_of}
    moe_layers = metrics.moe_layer_ids(model_config)
    return Job(
        runtime=runtime, tokenizer=tokenizer, model_config=model_config, data=data, model=model,
        hf_model=hf_model,
        optimizer=optim.build_optimizer([p for p in model.parameters() if p.requires_grad], config.optim,
                                        device=runtime.device, capturable=cuda_graph),
        stream=BatchStream(data.train, seed=config.training.seed, **batching),
        val_batches=fixed_batches(data.val, **batching),
        expert_load=metrics.ExpertLoad(num_layers=len(moe_layers), num_experts=metrics.num_routed_experts(model_config),
                                       top_k=model_config.num_experts_per_tok, device=runtime.device)
        if moe_layers else None,
        fingerprint=job_fingerprint(config, model_config),
        base_path=base_path, autocast=autocast_for(precision, runtime.device), out_dir=out_dir,
        num_offsets=_num_document_offsets(data, config) if takes_offsets else None, cuda_graph=cuda_graph,
    )


def _check_graph_sharding(config: JobConfig, runtime: Runtime) -> None:
    distributed = config.distributed
    if config.training.cuda_graph == "true" and runtime.world_size > 1 and not (
            distributed.ep_size > 1 and distributed.ep_dispatch == "allgather" and distributed.dense_parallel == "replicate"):
        raise ValueError(
            "config field training.cuda_graph: with several processes the step is capturable with expert parallelism "
            "only (distributed.ep_size > 1, ep_dispatch 'allgather', dense_parallel 'replicate'); FSDP2 and DDP "
            "manage memory or buckets from the host.")


def _num_document_offsets(data: PreparedData, config: JobConfig) -> int | None:
    """Job.num_offsets: a bound on a micro-batch's documents (+ 1), or None without packing."""
    if not config.data.packing:
        return None
    per_row = max_documents_per_row(data.train, max_length=config.data.max_length)
    return config.training.micro_batch_size * per_row + 1


def job_fingerprint(config: JobConfig, model_config: PretrainedConfig) -> dict[str, Any]:
    """What a checkpoint's model must match to resume into this job: architecture, shapes, LoRA settings."""
    return {**model_fingerprint(model_config),
            "lora": checkpointing.lora_fingerprint(config.lora if config.lora.enabled else None)}


def resume_settings(config: JobConfig) -> dict[str, Any]:
    """The settings the data position in a checkpoint counts in, by dotted key: a resume with other
    values would not continue the same data (other samples, rows or batches per step), so it is
    refused. ``training.steps`` may grow (the schedule is a function of it: a longer run), the optimizer
    settings may change (a deliberate choice); ``data.packing_strategy`` is checked with the position."""
    data, training = config.data, config.training
    train_path = Path(data.train_path)
    settings: dict[str, Any] = {
        # Resolved, so that the same file named from another directory is the same data.
        "data.train_path": str(train_path.resolve()) if train_path.exists() else data.train_path,
        "data.split": data.split, "data.messages_column": data.messages_column,
        "data.prompt_column": data.prompt_column, "data.answer_column": data.answer_column,
        "data.max_length": data.max_length, "data.val_fraction": data.val_fraction, "data.packing": data.packing,
        "training.micro_batch_size": training.micro_batch_size, "training.grad_accum_steps": training.grad_accum_steps,
        "training.seed": training.seed,
    }
    if not data.packing:  # packed rows are always max_length wide
        settings["data.pad_to_multiple_of"] = data.pad_to_multiple_of
    return settings


def checkpoint_to_resume(config: JobConfig, runtime: Runtime) -> Path | None:
    """The checkpoint ``checkpoint.resume`` points to (None: a fresh run), checked against this job
    from its small files before any data is read or model built: that it exists and is complete, that
    the output folder holds no other history (``checkpointing.check_output_dir``), and that it resumes
    exactly (the same data and batching settings, packing, model, LoRA settings and ranks, and
    steps left to train)."""
    path = checkpointing.resolve_resume(config.checkpoint.resume, output_dir=config.training.output_dir)
    checkpointing.check_output_dir(config.training.output_dir, resume=path)
    if path is None:
        return None
    where = f"checkpoint.resume: {path}"
    state = checkpointing.read_train_state(path)
    if config.training.steps < state.step:
        raise ValueError(f"{where}: the checkpoint is at step {state.step}, training.steps is {config.training.steps}; "
                         f"set training.steps to {state.step} or more to resume it")
    # A key an older checkpoint did not record is not compared (fingerprint_differences).
    changed = checkpointing.fingerprint_differences(state.settings, resume_settings(config))
    if changed:
        raise ValueError(f"{where} was written with other data or batching settings, so the resume would not continue "
                         f"the same data: {'; '.join(changed)}. Resume with the checkpoint's values, or start a new run "
                         "in another training.output_dir")
    check_resumable(state.data, packed=config.data.packing, packing_strategy=config.data.packing_strategy, where=where)
    checkpointing.check_compatible(path, state, fingerprint=job_fingerprint(config, load_model_config(config.model)),
                                   world_size=runtime.world_size)
    checkpointing.check_files(path, state)
    return path


def resume_from(job: Job, path: Path | None) -> int:
    """Load the checkpoint at ``path`` (``checkpoint_to_resume``), if any; returns the step to start from."""
    if path is None:
        return 0
    state, rank_tensors = checkpointing.load_checkpoint(path, model=job.model, optimizer=job.optimizer,
                                                        runtime=job.runtime, fingerprint=job.fingerprint)
    if job.expert_load is not None and "expert_tokens" in rank_tensors:  # the counts go on from the resume
        job.expert_load.counts_LE.copy_(rank_tensors["expert_tokens"])
    job.stream.load_state_dict(state.data)
    return state.step


def open_sink(job: Job, config: JobConfig, step: int) -> metrics.MetricsSink | metrics.NullSink:
    if not job.runtime.is_main:
        return metrics.NullSink()
    save_config(config, job.out_dir / "config.yaml")
    sink = metrics.MetricsSink(config.metrics, output_dir=job.out_dir, total_steps=config.training.steps,
                               initial_step=step, run_config=to_dict(config))
    stats = job.data.stats
    sink.message(f"data: {len(job.data.train)} train / {len(job.data.val)} validation samples; "
                 f"{stats.dropped(max_length=config.data.max_length)}"
                 + (f" (first problems: {' | '.join(stats.examples)})" if stats.examples else "")
                 + (f"; resuming at step {step}" if step else ""))
    layout = sharding_description(job)
    sink.message(f"model: {layout}; steps {'replayed from CUDA graphs' if job.cuda_graph else 'eager'} "
                 f"(training.cuda_graph {config.training.cuda_graph})")
    runtime = job.runtime
    if runtime.distributed:
        sink.message(f"processes: {runtime.world_size} on {runtime.nodes} node{'s' * (runtime.nodes > 1)}; "
                     "rank 0 writes the output folder")
    sink.log({"step": step, "sharding": layout, "cuda_graph": job.cuda_graph, "processes": runtime.world_size,
              "nodes": runtime.nodes})
    return sink


def sharding_description(job: Job) -> str:
    """How the model is spread over the processes, in words (printed and logged at the start)."""
    mesh = getattr(job.hf_model, "parallel_mesh", None)
    if mesh is not None:
        dense = "replicated" if getattr(job.hf_model, "replicated_gradient_syncs", None) else "FSDP2"
        return (f"sharded by moetune over {mesh.world_size} processes (expert parallelism {mesh.ep_size}, "
                f"the rest {dense}); each process read only its own weights")
    if not job.runtime.distributed:
        return "one process"
    return "DDP" if job.model is not job.hf_model else "FSDP2, wrapped after every process loaded the whole model"


def held_out_accuracy(job: Job, config: JobConfig, sink: metrics.MetricsSink | metrics.NullSink, *, step: int,
                      label: str) -> float | None:
    if job.data.eval_set is None:
        return None
    em = evaluation.exact_match(job.hf_model, job.tokenizer, job.data.eval_set, device=job.runtime.device,
                                max_new_tokens=config.data.max_new_tokens, autocast=job.autocast)
    sink.log({"step": step, f"accuracy_{label}": em["accuracy"], "examples": em["examples"]})
    first = em["examples"][0] if em["examples"] else {"prompt": "", "got": "", "expected": ""}
    sink.message(f"held-out exact match {label} training: {100 * em['accuracy']:.1f}% of {em['num_samples']} "
                 f"(e.g. {first['prompt']!r} -> {first['got']!r}, expected {first['expected']!r})")
    return em["accuracy"]


def training_loop(job: Job, config: JobConfig, sink: metrics.MetricsSink | metrics.NullSink, *, step: int,
                  losses: list[float]) -> tuple[int, bool]:
    """Steps from ``step`` to ``training.steps``; returns (last step, interrupted by Ctrl-C)."""
    flops = FlopsCounter(job.model_config)
    aux_coef = float(getattr(job.model_config, "router_aux_loss_coef", 0.0) or 0.0) if job.expert_load else 0.0
    step_options = {"runtime": job.runtime, "grad_clip": config.optim.grad_clip, "aux_coef": aux_coef,
                    "autocast": job.autocast, "expert_load": job.expert_load}
    graphed = None
    if job.cuda_graph:
        precision = resolve_precision(config.training.precision, job.runtime.device)
        graphed = GraphedTrainStep(job.model, job.optimizer, micro_batches=config.training.grad_accum_steps,
                                   num_offsets=job.num_offsets, **{**step_options, "autocast": autocast_for(
                                       precision, job.runtime.device, cache_enabled=False)})
    profiler = StepProfiler(start=config.metrics.profile_start, count=config.metrics.profile_steps,
                            out_dir=job.out_dir, rank=job.runtime.rank, device=job.runtime.device)
    try:
        return _run_steps(job, config, sink, step=step, losses=losses, graphed=graphed, step_options=step_options,
                          flops=flops, profiler=profiler)
    finally:
        profiler.close()
        if graphed is not None:
            graphed.close()


def _run_steps(job: Job, config: JobConfig, sink: metrics.MetricsSink | metrics.NullSink, *, step: int,
               losses: list[float], graphed: GraphedTrainStep | None, step_options: dict[str, Any],
               flops: FlopsCounter, profiler: StepProfiler) -> tuple[int, bool]:
    window: list[StepResult] = []
    window_flops = window_tokens = 0.0  # this rank's own documents: FLOPs per real token of the window
    window_slots = 0  # this rank's token positions (real + padding), for the rows' fill
    window_start = time.perf_counter()
    with StopRequest() as stop:
        while step < config.training.steps:
            profiler.begin(step + 1)
            set_learning_rate(job.optimizer, optim.lr_at(step, config.optim, total_steps=config.training.steps))
            micro_batches = [next(job.stream) for _ in range(config.training.grad_accum_steps)]
            try:
                if graphed is not None:
                    result = graphed(micro_batches)
                else:
                    result = train_step(job.model, job.optimizer, micro_batches, **step_options,
                                        document_offsets=job.num_offsets is not None)
            except NonFiniteLossError as err:
                last = checkpointing.list_checkpoints(config.training.output_dir)
                kept = f"the last good checkpoint is {last[-1]}" if last else "no checkpoint was written"
                raise NonFiniteLossError(f"training stopped at step {step + 1}: {err}. Nothing was saved; {kept}. "
                                         "Try a lower optim.lr or optim.grad_clip.") from err
            step += 1
            profiler.end(step)
            losses.append(result.loss)
            window.append(result)
            # LoRA trains no base weight: its steps compute no weight gradients (moetune.flops)
            window_flops += flops.of_documents([n for batch in micro_batches for n in batch.sample_lengths],
                                               frozen_weights=config.lora.enabled)
            window_tokens += sum(batch.num_tokens for batch in micro_batches)
            window_slots += sum(batch.input_ids_BT.numel() for batch in micro_batches)

            val_loss = None
            validating = bool(config.training.val_every and step % config.training.val_every == 0 and job.val_batches)
            if validating:  # on its own schedule, whether or not the step is also a logging step
                val_start = time.perf_counter()
                val_loss = evaluation.validation_loss(job.model, job.val_batches, runtime=job.runtime,
                                                      autocast=job.autocast, document_offsets=job.num_offsets is not None)
                sink.message(f"step {step}: validation loss {val_loss:.4f}")
                window_start += time.perf_counter() - val_start  # not training time: kept out of tokens/s
            if step % config.metrics.log_every == 0 or step == config.training.steps:
                record = _step_record(step, window, time.perf_counter() - window_start, job,
                                      window_flops / max(window_tokens, 1.0), config)
                record["row_fill"] = window_tokens / max(window_slots, 1)
                if validating:
                    record["val_loss"] = val_loss
                sink.log(record)
                sink.advance(len(window), metrics.format_postfix(record))
                window, window_start = [], time.perf_counter()
                window_flops = window_tokens = 0.0
                window_slots = 0
            elif validating:
                sink.log({"step": step, "val_loss": val_loss})

            # Every rank must agree to stop at the same step (saving is collective).
            stopping = all_reduce_sum([float(stop.requested)], job.runtime)[0] > 0
            if stopping or (config.checkpoint.every and step % config.checkpoint.every == 0):
                path = save(job, config, step)
                if stopping:
                    sink.message(f"interrupted: saved {path}; resume with --checkpoint.resume auto")
                    return step, True
    return step, False


def save(job: Job, config: JobConfig, step: int) -> Path:
    state = checkpointing.TrainState(step=step, data=job.stream.state_dict(), fingerprint=job.fingerprint,
                                     world_size=job.runtime.world_size, settings=resume_settings(config))
    counts = {"expert_tokens": job.expert_load.counts_LE} if job.expert_load is not None else None
    return checkpointing.save_checkpoint(output_dir=config.training.output_dir, state=state, model=job.model,
                                         optimizer=job.optimizer, runtime=job.runtime,
                                         keep_last=config.checkpoint.keep_last, rank_tensors=counts)


def finish(job: Job, config: JobConfig, sink: metrics.MetricsSink | metrics.NullSink,
           result: FinetuneResult) -> None:
    """Final validation loss and accuracy, export, plots, summary."""
    if job.val_batches:
        result.val_loss = evaluation.validation_loss(job.model, job.val_batches, runtime=job.runtime,
                                                     autocast=job.autocast, document_offsets=job.num_offsets is not None)
    result.accuracy_after = held_out_accuracy(job, config, sink, step=result.step, label="after")
    sink.log({"step": result.step, "final": True, "val_loss": result.val_loss,
              "accuracy_before": result.accuracy_before, "accuracy_after": result.accuracy_after,
              "expert_tokens": job.expert_load.as_lists() if job.expert_load is not None else None})
    sink.close()
    if config.checkpoint.export_final:
        if config.lora.enabled:
            paths = export.export_lora(job.hf_model, job.tokenizer, job.out_dir, base_model_name_or_path=job.base_path,
                                       merged=config.lora.export_merged, runtime=job.runtime)
        else:
            paths = {"final": export.export_model(job.hf_model, job.tokenizer, job.out_dir / "final",
                                                  runtime=job.runtime)}
        result.exported.update({k: str(v) for k, v in paths.items()})
    if job.runtime.is_main:
        if config.metrics.plots:
            plot_dir = plots.write_plots(job.out_dir, moe_layer_ids=metrics.moe_layer_ids(job.model_config))
            if plot_dir is not None:
                result.exported["plots"] = str(plot_dir)
        _print_summary(result, job.out_dir)


def _step_record(step: int, window: list[StepResult], elapsed: float, job: Job, flops_per_token: float,
                 config: JobConfig) -> dict[str, Any]:
    runtime = job.runtime
    tokens_per_s_per_gpu = sum(r.num_tokens for r in window) / max(elapsed, 1e-9) / runtime.world_size
    tflops = tokens_per_s_per_gpu * flops_per_token / 1e12
    return {
        "step": step,
        "loss": sum(r.loss for r in window) / len(window),
        "lr": float(job.optimizer.param_groups[0]["lr"]),  # a device tensor when the step is graphed
        "grad_norm": window[-1].grad_norm,
        "tokens_per_s_per_gpu": tokens_per_s_per_gpu,
        "tflops_per_gpu": tflops,
        # MFU against a GPU's bf16 peak means nothing on a CPU.
        "mfu": tflops / config.metrics.peak_tflops if runtime.device.type == "cuda" else None,
        "peak_mem_gib": metrics.peak_memory_gib(runtime.device),
        "time": time.time(),
    }


def _save_random_base(model: torch.nn.Module, tokenizer: Any, path: Path, runtime: Runtime) -> str:
    """LoRA on a randomly initialised model: save that base, so the PEFT adapter has one to load onto."""
    from moetune.lora.apply import is_lora_param_name
    from moetune.distributed.mesh import is_sharded_by_moetune
    from moetune.recipe.distributed_setup import barrier

    if is_sharded_by_moetune(model):
        # A collective (every rank gathers its shards); the adapters, already added between expert
        # parallelism and FSDP2, are not part of the base.
        base = {k: v for k, v in model.state_dict().items() if not is_lora_param_name(k)}
        model.save_pretrained(path, is_main_process=runtime.is_main, state_dict=base)
    elif runtime.is_main:
        model.save_pretrained(path)
    if runtime.is_main:
        tokenizer.save_pretrained(path)
    barrier(runtime)
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
