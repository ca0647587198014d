"""Profile one training step of Transformers v5 and moetune side by side (CUDA).

    python benchmarks/profile_step.py --layers 8 --seq-len 4096 [--routing balanced] [--sides hf,moetune]
    python benchmarks/profile_step.py --config moonlight_16b_a3b --sides hf,moetune+graph --profile

Prints per side: median fwd+bwd and optimizer times, peak memory, and the top CUDA kernels of one
profiled step, so optimisation goes after the largest measured cost first.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics

import torch

from moetune.bench.timeline import gpu_timeline


def build(side: str, args) -> tuple[torch.nn.Module, contextlib.AbstractContextManager]:
    """The side as ``moetune bench`` builds it (same weights from the seed, same attention and experts
    implementations), and the context that sets its routing."""
    from moetune.bench.lora import lora_settings
    from moetune.bench.models import build_side, load_config

    _, config = load_config(args.config, layers=args.layers)
    lora = lora_settings(args.lora_rank, None, config) if args.lora_rank else None
    bench_model = build_side(side, config, device=torch.device("cuda"), seed=0, lora=lora)
    return bench_model.model, bench_model.routing_context(args.routing == "balanced")


def run(side: str, args) -> dict:
    """Sides: hf, moetune, and moetune variants: +adamw (moetune's AdamW kernel), +inbwd (stepped
    during backward), +graph (moetune.training.CUDAGraphTrainStep with the capturable kernel)."""
    model, routing = build(side.split("+")[0], args)
    with routing:
        return _run(model, side, args)


def _run(model: torch.nn.Module, side: str, args) -> dict:
    if "+adamw" in side or "+graph" in side:
        from moetune.optim import AdamW

        opt = AdamW(model.parameters(), lr=1e-5, capturable="+graph" in side)
    elif "+inbwd" in side:
        from moetune.optim import AdamWInBackward

        opt = AdamWInBackward(model.parameters(), lr=1e-5)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    gen = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (args.micro_batch, args.seq_len), device="cuda", generator=gen)

    if "+graph" in side:
        from moetune.training import CUDAGraphTrainStep

        graphed = CUDAGraphTrainStep(model, opt, warmup_steps=2)

        def step():
            return graphed.forward_backward(input_ids=ids, labels=ids)

        def optimizer_step():
            graphed.optimizer_step()
    else:
        def step():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            return loss

        def optimizer_step():
            opt.step()
            opt.zero_grad(set_to_none=True)

    fwd_bwd, optim = [], []
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            torch.cuda.reset_peak_memory_stats()
        t0 = torch.cuda.Event(enable_timing=True)
        t1 = torch.cuda.Event(enable_timing=True)
        t2 = torch.cuda.Event(enable_timing=True)
        t0.record()
        step()
        t1.record()
        optimizer_step()
        t2.record()
        torch.cuda.synchronize()
        if i >= args.warmup:
            fwd_bwd.append(t0.elapsed_time(t1))
            optim.append(t1.elapsed_time(t2))
    peak = torch.cuda.max_memory_allocated() / 2**30
    result = {
        "side": side,
        "fwd_bwd_ms": statistics.median(fwd_bwd),
        "optim_ms": statistics.median(optim),
        "tokens_per_s": args.micro_batch * args.seq_len / (statistics.median(fwd_bwd) + statistics.median(optim)) * 1e3,
        "peak_gib": peak,
    }
    if args.sync_debug and "+graph" not in side:
        import warnings

        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")  # prints every host synchronisation with its stack
        step()
        optimizer_step()
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if args.cpu_profile else [])
        torch.cuda.synchronize()
        with profile(activities=activities, record_shapes=args.cpu_profile) as prof:
            step()
            optimizer_step()
            torch.cuda.synchronize()
        print(f"==== {side}: top CUDA kernels of one step (by self CUDA time) ====")
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.top, max_name_column_width=90))
        result.update(gpu_timeline(prof.events()))
        print(f"==== {side}: GPU timeline: {json.dumps({k: v for k, v in result.items() if k.startswith('timeline')})}")
        if args.cpu_profile:
            print(f"==== {side}: top CPU ops of one step ====")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=70))
            print(f"==== {side}: aten ops by the GPU time of the kernels they launch (eager sides only) ====")
            ops = [e for e in prof.key_averages(group_by_input_shape=True) if e.key.startswith("aten::")]
            for e in sorted(ops, key=lambda e: e.self_device_time_total, reverse=True)[: args.top]:
                print(f"{e.self_device_time_total / 1e3:9.3f} ms {e.count:5d}  {e.key}  {str(e.input_shapes)[:110]}")
    return result  # the model and optimizer go with this frame (the caller frees them)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="qwen3_30b_a3b", help="a shipped bench config or a config.json")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--routing", choices=["real", "balanced"], default="real")
    parser.add_argument("--sides", default="hf,moetune")
    parser.add_argument("--lora-rank", type=int, default=0, help="LoRA on both sides, as moetune bench --lora-rank")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--sdpa-backend", choices=["auto", "cudnn", "flash", "efficient"], default="auto",
                        help="force one SDPA backend for every step (capture included)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--cpu-profile", action="store_true", help="also profile host-side ops")
    parser.add_argument("--sync-debug", action="store_true", help="warn on every host sync during one step")
    args = parser.parse_args()
    backend = contextlib.nullcontext()
    if args.sdpa_backend != "auto":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        names = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}
        backend = sdpa_kernel([getattr(SDPBackend, names[args.sdpa_backend])])
    results = []
    with backend:
        for side in args.sides.split(","):
            results.append(run(side, args))
            gc.collect()  # the side's model, optimizer and graphs (their hooks hold reference cycles)
            torch.cuda.empty_cache()
    for r in results:
        print(json.dumps({**vars(args), **r}))


if __name__ == "__main__":
    main()
