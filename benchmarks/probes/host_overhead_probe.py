"""Host time of an eager training step (CUDA): what the CPU spends issuing one step's kernels.

At a short sequence the step's GPU work is a few milliseconds, so the host's time to issue the
step (forward, backward, optimizer) is what the wall clock measures. An eager step at seq 4096 is
host-bound whenever this time exceeds its GPU time (Moonlight's eager LoRA step: 104 ms for 50 ms
of GPU work). Per side, per model:

- ``issue_ms``: host time from the step's start until the optimizer call returns (no waiting on
  the GPU in between, except where the code synchronises), median over steps;
- ``wall_ms`` and ``gpu_ms``: the same step to the end of its GPU work, and the GPU's own time;
- ``launches``: kernels launched per step (one profiled step), and ``issue_us_per_launch``;
- the top host-side ops of the profiled step (``--top``), by self CPU time.

And the floors: a bare Triton launch, a torch elementwise op, a ``torch.cuda.device`` switch.

    python benchmarks/probes/host_overhead_probe.py --configs qwen3_30b_a3b,moonlight_16b_a3b --lora-ranks 0,16 \\
        --sides hf,moetune --out host_overhead.jsonl
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

LAUNCH_EVENTS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaGraphLaunch")


def _time_host(fn, calls: int) -> tuple[float, float]:
    """(host us per call while issuing, wall us per call to the GPU's end)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / calls * 1e6, (t2 - t0) / calls * 1e6


def _switch_device(device: torch.device) -> None:
    with torch.cuda.device(device):
        pass


def floors(calls: int = 2000) -> list[dict]:
    import triton
    import triton.language as tl

    @triton.jit
    def _noop(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)

    x = torch.zeros(1024, device="cuda")
    device = x.device
    rows = []
    for name, fn in (
        ("triton launch (3 args)", lambda: _noop[(1,)](x, 1024, BLOCK=1024)),
        ("torch add", lambda: torch.add(x, x)),
        ("torch.cuda.device enter/exit", lambda: _switch_device(device)),
        ("torch.cuda.get_device_properties", lambda: torch.cuda.get_device_properties(device)),
        ("torch.empty", lambda: torch.empty(1024, device=device)),
    ):
        issue, wall = _time_host(fn, calls)
        rows.append({"kind": "floor", "name": name, "issue_us": round(issue, 2), "wall_us": round(wall, 2)})
    return rows


def _train_step(model, args):
    """One eager training step as a user's loop runs it: forward with labels, backward, torch's fused
    AdamW over the trainable parameters (all of them, or LoRA's adapters), zero_grad."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=True)
    gen = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (1, args.seq_len), device="cuda", generator=gen)

    def step():
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def measure_step(config_name: str, side: str, lora_rank: int, args) -> dict:
    from moetune.bench.lora import lora_settings
    from moetune.bench.models import build_side, load_config

    _, config = load_config(config_name, layers=args.layers)
    lora = lora_settings(lora_rank, None, config) if lora_rank else None
    bench_model = build_side(side, config, device=torch.device("cuda"), seed=0, lora=lora)
    model = bench_model.model
    step = _train_step(model, args)
    issue, wall, gpu = [], [], []
    with bench_model.routing_context(False):
        for i in range(args.warmup + args.steps):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            step()
            end.record()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            if i >= args.warmup:
                issue.append((t1 - t0) * 1e3)
                wall.append((t2 - t0) * 1e3)
                gpu.append(start.elapsed_time(end))
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        if args.cprofile:
            _cprofile(step, args.top)
        if args.sync_debug:
            _sync_debug(step)
    averages = prof.key_averages()
    launches = sum(e.count for e in averages if e.key in LAUNCH_EVENTS)
    row = {
        "kind": "step", "config": config_name, "side": side, "lora_rank": lora_rank, "layers": config.num_hidden_layers,
        "seq_len": args.seq_len, "issue_ms": round(statistics.median(issue), 3), "wall_ms": round(statistics.median(wall), 3),
        "gpu_ms": round(statistics.median(gpu), 3), "launches": launches,
        "issue_us_per_launch": round(statistics.median(issue) * 1e3 / max(launches, 1), 2),
    }
    print(f"==== {config_name} {side} lora={lora_rank}: {json.dumps(row)}")
    print(averages.table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=60))
    del model, bench_model, step, prof
    gc.collect()
    torch.cuda.empty_cache()
    return row


def _cprofile(step, top: int) -> None:
    """Python-level attribution of the issue time: the top functions of three steps by own time."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(3):
        step()
    profiler.disable()
    torch.cuda.synchronize()
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(top)
        print(f"---- cProfile, 3 steps, by {order} ----")
        print("\n".join(line[:220] for line in text.getvalue().splitlines()[4:]))


def _sync_debug(step) -> None:
    """Every host synchronisation in one step, with where it happened (innermost moetune frame)."""
    import warnings
    from collections import Counter

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    places = Counter()
    for w in caught:
        places[f"{Path(w.filename).name}:{w.lineno}: {str(w.message)[:80]}"] += 1
    print(f"---- host synchronisations in one step: {sum(places.values())} ----")
    for place, count in places.most_common(20):
        print(f"{count:5d}  {place}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="qwen3_30b_a3b", help="comma-separated shipped configs")
    p.add_argument("--sides", default="hf,moetune")
    p.add_argument("--lora-ranks", default="0,16", help="comma-separated; 0 = full fine-tuning")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--cprofile", action="store_true", help="print cProfile's top functions of three steps")
    p.add_argument("--sync-debug", action="store_true", help="list the host synchronisations of one step")
    p.add_argument("--out", default=None, help="JSONL file to append the rows to")
    args = p.parse_args(argv)
    rows = floors()
    for row in rows:
        print(json.dumps(row))
    for config_name in args.configs.split(","):
        for rank in (int(r) for r in args.lora_ranks.split(",")):
            for side in args.sides.split(","):
                rows.append(measure_step(config_name, side, rank, args))
    if args.out:
        import os
        import subprocess

        commit = os.environ.get("MOETUNE_COMMIT") or subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": commit,
                "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "argv": sys.argv[1:]}  # fmt: skip
        with Path(args.out).open("a") as f:
            for row in rows:
                f.write(json.dumps({**meta, **row}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
