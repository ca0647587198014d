"""``moetune bench``: Transformers v5 and moetune trained side by side on the same config, weights,
tokens and optimizer, in one invocation (one process, or every rank of a torchrun launch).

    moetune bench --layers 8 --seq-len 4096 --routing both --parity          # one GPU
    torchrun --nproc-per-node 2 -m moetune.bench --layers 16                 # FSDP2 vs moetune EP
    moetune bench --probe-max-seq                                            # longest sequence
    moetune bench --config tiny --seq-len 64 --device cpu                    # smoke test

See benchmarks/README.md for what is measured and how.
"""

from __future__ import annotations

import argparse
import ast
import gc
import json
import os
import sys
import time
from typing import Any

import torch

from moetune.bench.env import RunEnv, commit, gpu_name, hardware_slug, setup, teardown, utc_now, versions
from moetune.bench.measure import OPTIMIZERS, matmul_peak_tflops
from moetune.bench.models import SIDES, SideUnavailable, build_side, load_config
from moetune.bench.probe import EXIT_OOM, RESULT_PREFIX, probe_side
from moetune.bench.report import (
    comparisons,
    format_header,
    format_parity,
    format_probe,
    format_table,
    resolve_out,
    result_stem,
    summarize,
    write_chart,
    write_json,
)
from moetune.bench.run import Row, RowResult, is_oom, make_rows, run_rows
from moetune.flops import training_flops_per_token as flops_per_token
from moetune.fp8.settings import DEFAULT_WEIGHT_GRAD, FP8_WEIGHT_GRADS

DEFAULT_LAYERS = 8
RECORDED_ENV_PREFIXES = ("PYTORCH_CUDA_ALLOC", "CUDA_VISIBLE", "CUDA_DEVICE_MAX", "NCCL_", "TORCH_", "MOETUNE_")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="moetune bench",
        description="Train Transformers v5 and moetune side by side and compare tokens/s/GPU, TFLOP/s, MFU and memory.",
    )
    p.add_argument(
        "--config", default="qwen3_30b_a3b", help="shipped config (qwen3_30b_a3b, tiny, nemotron_3_nano_30b_a3b, gpt_oss_20b, moonlight_16b_a3b), a config.json or a folder"
    )
    p.add_argument(
        "--layers", type=int, default=None, help=f"decoder layers (default: min({DEFAULT_LAYERS}, the config's))"
    )
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, nargs="+", default=[1], help="one or more micro-batch sizes")
    p.add_argument("--routing", choices=("real", "balanced", "both"), default="both")
    p.add_argument("--sides", default="hf,moetune", help="comma-separated subset of hf,moetune")
    p.add_argument(
        "--activation-checkpointing", nargs="?", const="on", choices=("off", "on", "both"), default=None,
        help="per-layer activation checkpointing on both sides (default off; on for --probe-max-seq)",
    )
    p.add_argument("--steps", type=int, default=10, help="measured steps per setting (median reported)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps per setting")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument(
        "--moetune-optimizer", choices=OPTIMIZERS, default="torch",
        help="moetune side's AdamW: torch's fused one (same as Transformers' side), moetune's kernel, or "
        "moetune's stepped during backward",
    )
    p.add_argument(
        "--moetune-cuda-graph", action="store_true",
        help="moetune side replays each step from CUDA graphs (moetune.training.CUDAGraphTrainStep, capturable "
        "optimizer; on several GPUs with ep_dispatch=allgather and dense_parallel=replicate)",
    )
    p.add_argument(
        "--moetune-overlap-optimizer", action="store_true",
        help="with --moetune-cuda-graph and --moetune-optimizer moetune: each parameter's AdamW update runs during "
        "the backward on a low-priority stream, as soon as its gradient is final (same update, no clipping)",
    )
    p.add_argument(
        "--max-grad-norm", type=float, default=None,
        help="clip the gradients to this norm on both sides before each update, as Trainer's max_grad_norm (default 1.0) "
        "does: torch's clipping on Transformers' side, moetune's (the coefficient handed to its AdamW) on moetune's",
    )
    p.add_argument(
        "--autocast", action="store_true",
        help="both sides' forwards under torch.autocast to bf16, as Trainer's bf16=True runs them (the parameters stay bf16)",
    )
    p.add_argument(
        "--moetune-rebalance-experts", action="store_true",
        help="moetune side: relabel each layer's experts so that the expert-parallel ranks get balanced loads, "
        "counted on one calibration sequence per rank (moetune.distributed.placement; the same model function)",
    )
    p.add_argument(
        "--moetune-compile", action="store_true",
        help="moetune side: torch.compile each decoder layer (inductor; the experts run eagerly inside under EP)",
    )
    p.add_argument(
        "--lora-rank", type=int, default=0,
        help="LoRA fine-tuning instead of full: PEFT's adapters on Transformers' side, moetune.lora's on moetune's, "
        "on the attention projections and every expert, this rank (FLOPs count no weight gradients)",
    )
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default 2 x rank)")
    p.add_argument(
        "--moetune-lora", choices=("moetune", "peft"), default="moetune",
        help="with --lora-rank, the moetune side's adapters: moetune.lora's (experts' adapters on the activations) "
        "or PEFT's get_peft_model on moetune's model (user code unchanged but the import)",
    )
    p.add_argument(
        "--fp8", choices=("rowwise", "blockwise"), default=None,
        help="moetune side trains in FP8 (from_config(fp8=...): the decoder's linears and experts; bf16 weights)",
    )
    p.add_argument(
        "--fp8-backend", choices=("auto", "triton", "reference"), default="auto",
        help="with --fp8: torch's cuBLAS / CUTLASS FP8 GEMMs where torch has them (auto), moetune's Triton GEMMs, or "
        "the plain-PyTorch reference",
    )
    p.add_argument(
        "--fp8-weight-grad", choices=FP8_WEIGHT_GRADS, default=DEFAULT_WEIGHT_GRAD,
        help="with --fp8: the weight gradients' GEMM from the unquantised operands (bf16, the default) or quantised along the tokens (fp8)",
    )
    p.add_argument("--device", default="auto", help="auto, cuda, cuda:N or cpu (torchrun: each rank's GPU)")
    p.add_argument(
        "--out", default="benchmarks/results", help="folder for <model>_<hardware>_<date>.json/.png, or a .json path"
    )
    p.add_argument("--no-chart", action="store_true")
    p.add_argument(
        "--moetune-option", action="append", default=[], metavar="KEY=VALUE",
        help="extra moetune from_config option, repeatable (e.g. reduce_dtype=bfloat16, ep_capacity_factor=2.0)",
    )
    g = p.add_argument_group("correctness check (bf16 parity against an fp32 reference)")
    g.add_argument("--parity", action="store_true", help="run the parity check before timing")
    g.add_argument("--parity-only", action="store_true", help="run only the parity check")
    g.add_argument("--parity-layers", type=int, default=2)
    g.add_argument("--parity-seq-len", type=int, default=1024)
    g.add_argument("--parity-routing", choices=("real", "balanced"), default="real")
    g = p.add_argument_group("longest-sequence probe")
    g.add_argument("--probe-max-seq", action="store_true", help="find the longest sequence each side trains (one GPU)")
    g.add_argument("--probe-start", type=int, default=4096)
    g.add_argument("--probe-step", type=int, default=1024)
    g.add_argument("--probe-max", type=int, default=262144)
    g.add_argument("--probe-search", choices=("bisect", "linear"), default="bisect")
    g.add_argument("--probe-timeout", type=float, default=600.0, help="seconds per child process")
    g.add_argument("--probe-budget", type=float, default=None, help="seconds after which no new length is tried")
    g.add_argument("--probe-child", choices=SIDES, default=None, help=argparse.SUPPRESS)
    p.add_argument("--summarize", nargs="+", metavar="JSON", help="print the tables of existing result files and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.summarize:
        missing = [path for path in args.summarize if not os.path.isfile(path)]
        if missing:
            parser.error(f"--summarize: no such result file: {', '.join(missing)}")
        print(summarize(args.summarize))
        return 0
    _check_args(parser, args)
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if not sides or any(s not in SIDES for s in sides):
        raise SystemExit(f"--sides must be a comma-separated subset of {','.join(SIDES)}, got {args.sides!r}")
    if args.probe_child:
        return _probe_child(args)
    if args.lora_rank < 0:
        raise SystemExit(f"--lora-rank must be >= 0 (0: full fine-tuning), got {args.lora_rank}")
    if args.lora_rank and args.probe_max_seq:
        raise SystemExit("--lora-rank times training steps: drop --probe-max-seq")
    if args.probe_max_seq:
        return _probe(args, sides)
    try:
        env = setup(args.device)
    except ValueError as error:
        parser.error(str(error))
    if args.moetune_cuda_graph and env.device.type != "cuda":
        teardown(env)
        raise SystemExit("--moetune-cuda-graph needs CUDA GPUs")
    if args.moetune_cuda_graph and env.distributed and not _graph_capturable_ep(_moetune_options(args)):
        teardown(env)
        raise SystemExit(
            "--moetune-cuda-graph on several GPUs needs the capturable expert-parallel step: "
            "--moetune-option ep_dispatch=allgather --moetune-option dense_parallel=replicate "
            "(the all-to-all dispatcher and FSDP2 synchronise with the host)"
        )
    if args.moetune_overlap_optimizer and not (args.moetune_cuda_graph and args.moetune_optimizer == "moetune"):
        teardown(env)
        raise SystemExit("--moetune-overlap-optimizer needs --moetune-cuda-graph and --moetune-optimizer moetune")
    if args.moetune_overlap_optimizer and args.max_grad_norm is not None:
        teardown(env)
        raise SystemExit("--moetune-overlap-optimizer updates each parameter before the gradients' norm is known: no --max-grad-norm")
    if args.moetune_cuda_graph and args.moetune_optimizer == "moetune-in-backward":
        teardown(env)
        raise SystemExit("--moetune-cuda-graph cannot capture --moetune-optimizer moetune-in-backward")
    try:
        return _bench(args, env, sides)
    finally:
        teardown(env)


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A user's mistake in the numbers or the config ends here, with the flag named, before any model is
    built (not as a traceback, nor as a failed row after both sides were built)."""
    minimums = {
        "--steps": (args.steps, 1), "--warmup": (args.warmup, 0), "--seq-len": (args.seq_len, 2),
        "--micro-batch": (min(args.micro_batch), 1), "--layers": (args.layers, 1),
        "--parity-layers": (args.parity_layers, 1), "--parity-seq-len": (args.parity_seq_len, 2),
        "--probe-start": (args.probe_start, 1), "--probe-step": (args.probe_step, 1), "--probe-max": (args.probe_max, 1),
    }  # fmt: skip
    for flag, (value, minimum) in minimums.items():
        if value is not None and value < minimum:
            parser.error(f"{flag} must be >= {minimum}, got {value}")
    for flag, value in (("--probe-timeout", args.probe_timeout), ("--max-grad-norm", args.max_grad_norm)):
        if value is not None and not value > 0:
            parser.error(f"{flag} must be > 0, got {value}")
    try:
        load_config(args.config)
    except ValueError as error:
        parser.error(str(error))


def _graph_capturable_ep(options: dict[str, Any]) -> bool:
    return options.get("ep_dispatch") == "allgather" and options.get("dense_parallel") == "replicate"


def _moetune_options(args: argparse.Namespace) -> dict[str, Any]:
    """``--moetune-option KEY=VALUE`` pairs; values are Python literals (2.0, None, True) or strings."""
    options = {}
    for item in args.moetune_option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--moetune-option expects KEY=VALUE, got {item!r}")
        try:
            options[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            options[key] = value
    if getattr(args, "fp8", None):
        options.update(fp8=args.fp8, fp8_backend=args.fp8_backend, fp8_weight_grad=args.fp8_weight_grad)
    return options


def _layers(args: argparse.Namespace) -> int:
    if args.layers is not None:
        return args.layers
    _, config = load_config(args.config)
    return min(DEFAULT_LAYERS, config.num_hidden_layers)


def _ac_values(args: argparse.Namespace, default: str) -> list[bool]:
    value = args.activation_checkpointing or default
    return {"off": [False], "on": [True], "both": [False, True]}[value]


def _log(env: RunEnv, message: str) -> None:
    if env.is_main:
        print(message, flush=True)


def _record(args: argparse.Namespace, env: RunEnv, *, model: str, config, kind: str) -> dict[str, Any]:
    now = utc_now()
    return {
        "kind": kind,
        "model": model,
        "date": now.isoformat(),
        "gpu": gpu_name(env.device),
        "hardware": hardware_slug(env.device, env.world_size),
        "world_size": env.world_size,
        "device": str(env.device),
        "versions": versions(),
        "commit": commit(),
        "command": " ".join(sys.argv),
        "env": {k: v for k, v in os.environ.items() if k.startswith(RECORDED_ENV_PREFIXES)},
        "config": {
            "name": args.config,
            "layers": config.num_hidden_layers,
            "seq_len": args.seq_len,
            "micro_batch": args.micro_batch,
            "routing": args.routing,
            "activation_checkpointing": args.activation_checkpointing,
            "steps": args.steps,
            "warmup": args.warmup,
            "seed": args.seed,
            "lr": args.lr,
            "dtype": "bfloat16 parameters, gradients and AdamW states",
            "optimizer": _optimizer_name(env.device),
            "moetune_optimizer": args.moetune_optimizer,
            "moetune_cuda_graph": args.moetune_cuda_graph,
            "moetune_overlap_optimizer": args.moetune_overlap_optimizer,
            "max_grad_norm": args.max_grad_norm,
            "autocast": args.autocast,
            "moetune_rebalance_experts": args.moetune_rebalance_experts,
            "moetune_compile": args.moetune_compile,
            "moetune_options": _moetune_options(args),
            "lora": _lora_record(args, config),
        },
        "model_config": config.to_dict(),
        "flops_per_token": flops_per_token(config, seq_len=args.seq_len, frozen_weights=bool(args.lora_rank)),
        "_stamp": now.strftime("%Y%m%dT%H%M%SZ"),
    }


_LORA_FIELDS = ("rank", "alpha", "target_modules", "target_experts", "adapter_dtype")


def _lora_record(args: argparse.Namespace, config) -> dict[str, Any] | None:
    """The run's LoRA settings as recorded in the results (``_lora`` builds the sides' from it)."""
    if not args.lora_rank:
        return None
    from moetune.bench.lora import lora_settings

    settings = lora_settings(args.lora_rank, args.lora_alpha, config)
    return {**{name: getattr(settings, name) for name in _LORA_FIELDS}, "moetune_side": args.moetune_lora,
            "flops": "forward + input gradients of the frozen weights (2x) + attention (3x); no weight gradients"}


def _lora(data: dict[str, Any]):
    """The ``LoraSettings`` the results record, or None for full fine-tuning."""
    record = data["config"]["lora"]
    if record is None:
        return None
    from moetune.lora import LoraSettings

    return LoraSettings(**{name: record[name] for name in _LORA_FIELDS})


def _optimizer_name(device: torch.device) -> str:
    return f"torch.optim.AdamW({'fused' if device.type == 'cuda' else 'foreach'}=True, weight_decay=0)"


def _write(
    args: argparse.Namespace,
    env: RunEnv,
    data: dict[str, Any],
    *,
    suffix: str = "",
    chart: bool = False,
    quiet: bool = False,
) -> None:
    """Write the JSON (and the chart); called again as results come in, so a run killed by a
    time limit still leaves what it measured."""
    if not env.is_main:
        return
    stamp = data["_stamp"]
    model = f"{data['model']}-{data['config']['layers']}l{suffix}"
    stem = result_stem(model=model, hardware=data["hardware"], date=stamp)
    json_path, png_path = resolve_out(args.out, stem)
    write_json({k: v for k, v in data.items() if k != "_stamp"}, json_path)
    if not quiet:
        print(f"wrote {json_path}", flush=True)
    if chart and not args.no_chart:
        if write_chart(data, png_path):
            print(f"wrote {png_path}", flush=True)
        else:
            print("no chart (matplotlib is not installed, or no setting ran)", flush=True)


def _bench(args: argparse.Namespace, env: RunEnv, sides: list[str]) -> int:
    model, config = load_config(args.config, layers=args.parity_layers if args.parity_only else _layers(args))
    routings = ["real", "balanced"] if args.routing == "both" else [args.routing]
    rows = make_rows(
        routings=routings, micro_batches=args.micro_batch, seq_len=args.seq_len,
        activation_checkpointing=_ac_values(args, "off"),
    )
    if args.steps < 10 or args.warmup < 3:
        _log(env, f"note: {args.warmup} warm-up / {args.steps} measured steps (the brief's minimum is 3 / 10)")
    data = _record(args, env, model=model, config=config, kind="parity" if args.parity_only else "bench")
    data["matmul_peak_tflops"] = matmul_peak_tflops(env.device)
    _log(env, format_header(data))

    parity_ok = True
    if args.parity or args.parity_only:
        parity_ok = _parity(args, env, data)
    if args.parity_only:
        _write(args, env, data, suffix="-parity")
        return 0 if parity_ok else 1

    data["built"], results = {}, []
    for side in sides:
        _bench_side(side, config, rows, args=args, env=env, data=data, results=results)
    data["rows"] = [r.to_json() for r in results]
    data["comparison"] = comparisons(data["rows"])
    if env.is_main:
        print(format_table(data), flush=True)
    _write(args, env, data, suffix=_fp8_suffix(args), chart=True)
    return 0 if parity_ok and not any(r.error for r in results) else 1


def _parity(args: argparse.Namespace, env: RunEnv, data: dict[str, Any]) -> bool:
    from moetune.bench.parity import run_parity

    if env.distributed:
        raise SystemExit("--parity runs in one process (one GPU); drop it under torchrun")
    _, parity_config = load_config(args.config, layers=args.parity_layers)
    _log(env, f"parity: {args.parity_layers} layers, seq {args.parity_seq_len}, {args.parity_routing} routing ...")
    started = time.perf_counter()
    data["parity"] = parity = run_parity(
        parity_config, env=env, seed=args.seed, seq_len=args.parity_seq_len, routing=args.parity_routing,
        moetune_options=_moetune_options(args),
    )
    _log(env, f"{format_parity(parity)} ({time.perf_counter() - started:.0f} s)")
    if not args.parity_only:
        _write(args, env, data, quiet=True)
    return parity["passed"]


def _bench_side(
    side: str,
    config,
    rows: list[Row],
    *,
    args: argparse.Namespace,
    env: RunEnv,
    data: dict[str, Any],
    results: list[RowResult],
) -> None:
    """Build one side once, time every row on it, append to ``results`` (the JSON is rewritten after
    each row), free it."""
    started = time.perf_counter()
    try:
        bench = build_side(
            side, config, device=env.device, dtype=torch.bfloat16, seed=args.seed, world_size=env.world_size,
            balanced_gate=rows[0].routing == "balanced", options=_moetune_options(args),
            rebalance_seq_len=max(row.seq_len for row in rows) if args.moetune_rebalance_experts else None,
            compile_layers=args.moetune_compile, lora=_lora(data), lora_with_peft=args.moetune_lora == "peft",
        )
    except Exception as error:  # noqa: BLE001 -- report the side as failed and keep the other one
        if env.distributed and not isinstance(error, SideUnavailable):
            raise
        failure = "OOM" if is_oom(error) else f"{type(error).__name__}: {error}"
    else:
        failure = None
    if failure is not None:  # freed outside the except block, whose traceback holds the partial model
        _log(env, f"[{side}] cannot build: {failure}")
        results += [RowResult(side, row, error=f"build failed: {failure}") for row in rows]
        data["rows"] = [r.to_json() for r in results]
        _free(env)
        return
    data["built"][side] = {**bench.notes, "build_s": round(time.perf_counter() - started, 1)}
    _log(env, f"[{side}] built in {time.perf_counter() - started:.1f} s: {bench.notes}")

    def on_result(result: RowResult) -> None:
        results.append(result)
        _log(env, f"[{side}] {_row_line(result)}")
        data["rows"] = [r.to_json() for r in results]
        _write(args, env, data, suffix=_fp8_suffix(args), quiet=True)

    run_rows(
        bench, rows, env=env, flops_per_token={args.seq_len: data["flops_per_token"]},
        peak_tflops=data["matmul_peak_tflops"], warmup=args.warmup, steps=args.steps, seed=args.seed, lr=args.lr,
        on_result=on_result, moetune_optimizer=args.moetune_optimizer, moetune_cuda_graph=args.moetune_cuda_graph,
        moetune_overlap_optimizer=args.moetune_overlap_optimizer, max_grad_norm=args.max_grad_norm, autocast=args.autocast,
    )
    del bench
    _free(env)


def _fp8_suffix(args: argparse.Namespace) -> str:
    """Result files of an FP8 run are named apart from the bf16 run's of the same model and date."""
    wgrad = "-fp8wgrad" if getattr(args, "fp8_weight_grad", DEFAULT_WEIGHT_GRAD) == "fp8" else ""
    clip = f"-clip{args.max_grad_norm:g}" if getattr(args, "max_grad_norm", None) is not None else ""
    autocast = "-autocast" if getattr(args, "autocast", False) else ""
    return (f"-fp8-{args.fp8}-{args.fp8_backend}{wgrad}" if args.fp8 else "") + clip + autocast


def _row_line(result: RowResult) -> str:
    if result.error:
        return f"{result.row.label}: {result.error}"
    peak = "-" if result.peak_gib is None else f"{result.peak_gib:.1f} GiB"
    return (
        f"{result.row.label}: {result.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, {result.tflops_per_gpu:.1f} TFLOP/s, "
        f"step {1e3 * result.step_s:.1f} ms (fwd+bwd {1e3 * result.fwd_bwd_s:.1f}), peak {peak}, "
        f"loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f}"
    )


def _free(env: RunEnv) -> None:
    gc.collect()
    if env.device.type == "cuda":
        torch.cuda.empty_cache()


def _probe(args: argparse.Namespace, sides: list[str]) -> int:
    """The parent never touches the GPU (a CUDA context here would take memory from the children);
    the GPU's name comes from the children's reports."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise SystemExit("--probe-max-seq runs on one GPU (it starts its own processes); drop torchrun")
    env = RunEnv(torch.device("cpu"), 0, 1)
    layers = _layers(args)
    model, config = load_config(args.config, layers=layers)
    routing = "real" if args.routing == "both" else args.routing
    data = _record(args, env, model=model, config=config, kind="probe")
    data["config"].update(routing=routing, micro_batch=[1], search=args.probe_search, step=args.probe_step)
    data["probe"] = {}
    deadline = None if args.probe_budget is None else time.monotonic() + args.probe_budget
    for side in sides:
        tried = []
        for ac in _ac_values(args, "on"):
            common = [
                "--config", args.config, "--layers", str(layers), "--routing", routing, "--seed", str(args.seed),
                "--lr", str(args.lr), "--device", args.device, "--activation-checkpointing", "on" if ac else "off",
                *(f"--moetune-option={item}" for item in args.moetune_option),
            ]
            result = probe_side(
                side=side, common_args=common, start=args.probe_start, step=args.probe_step,
                maximum=args.probe_max, search=args.probe_search, timeout=args.probe_timeout, deadline=deadline,
            )
            tried.append({**result, "activation_checkpointing": ac})
        best = max(tried, key=lambda r: r["longest"] or 0)
        data["probe"][side] = {**best, "other_settings": [r for r in tried if r is not best]}
        reports = [a for r in tried for a in r["attempts"] if a.get("gpu")]
        if reports:
            data.update(gpu=reports[0]["gpu"], hardware=reports[0]["hardware"], device=reports[0]["device"])
            data["config"]["optimizer"] = _optimizer_name(torch.device(reports[0]["device"]))
        _write(args, env, data, suffix="-probe", quiet=True)
    print(format_probe(data), flush=True)
    _write(args, env, data, suffix="-probe")
    return 0


def _probe_child(args: argparse.Namespace) -> int:
    """One side, one sequence length, one full training step; prints a result line."""
    env = setup(args.device)
    ac = _ac_values(args, "on")[-1]
    routing = "real" if args.routing == "both" else args.routing
    row = Row(routing, 1, args.seq_len, ac)
    report: dict[str, Any] = {
        "side": args.probe_child, "activation_checkpointing": ac, "gpu": gpu_name(env.device),
        "hardware": hardware_slug(env.device, 1), "device": str(env.device),
    }
    try:
        _, config = load_config(args.config, layers=_layers(args))
        bench = build_side(
            args.probe_child, config, device=env.device, dtype=torch.bfloat16, seed=args.seed,
            balanced_gate=routing == "balanced", options=_moetune_options(args),
        )
        [result] = run_rows(
            bench, [row], env=env, flops_per_token={args.seq_len: flops_per_token(config, seq_len=args.seq_len)},
            peak_tflops=None, warmup=0, steps=1, seed=args.seed, lr=args.lr,
        )
        error = result.error
        report.update(step_s=result.step_s, peak_gib=result.peak_gib, reserved_gib=result.reserved_gib)
    except Exception as exc:  # noqa: BLE001 -- the parent needs a status, not a traceback
        error = "OOM" if is_oom(exc) else f"{type(exc).__name__}: {exc}"
    report["status"] = "ok" if error is None else ("oom" if error == "OOM" else "error")
    if error is not None:
        report["error"] = error[:2000]
    print(RESULT_PREFIX + json.dumps(report), flush=True)
    return 0 if error is None else (EXIT_OOM if error == "OOM" else 1)
