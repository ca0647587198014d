"""Profile moetune's expert-parallel training step (rank 0 prints; every rank writes its trace).

    torchrun --standalone --nproc-per-node 2 benchmarks/profile_ep.py --layers 16 \
        --option ep_dispatch=allgather --option dense_parallel=replicate --cuda-graph --out DIR

Built as ``moetune.bench`` builds its moetune side (same weights, optimizer, options). Prints the
median step, the top kernels of the profiled steps, and the GPU timeline split by stream kind:
time any compute kernel ran, time NCCL kernels ran, the NCCL time no compute kernel overlapped
(exposed communication) and the idle time; so the expert-parallel overhead is measured, not guessed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

from moetune.bench.cli import _moetune_options
from moetune.bench.measure import make_optimizer
from moetune.bench.models import build_moetune, load_config
from moetune.utils.timeline import interval_union, total


def minus(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of union ``a`` not covered by union ``b`` (both merged and sorted)."""
    covered, j = 0.0, 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            covered += min(end, b[k][1]) - max(start, b[k][0])
            k += 1
    return total(a) - covered


def timeline(trace_path: Path, steps: int) -> dict:
    """Per step: span, compute-busy, NCCL-busy, exposed NCCL and idle time (ms), from a chrome trace."""
    events = json.loads(trace_path.read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel" and e.get("dur", 0) > 0]
    is_comm = lambda e: e["name"].startswith(("ncclDevKernel", "ncclKernel"))  # noqa: E731
    comm = interval_union([(e["ts"], e["ts"] + e["dur"]) for e in kernels if is_comm(e)])
    compute = interval_union([(e["ts"], e["ts"] + e["dur"]) for e in kernels if not is_comm(e)])
    busy = interval_union(comm + compute)
    span = max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)
    by_name: dict[str, float] = {}
    for e in kernels:
        key = e["name"][:70]
        by_name[key] = by_name.get(key, 0.0) + e["dur"]
    per_step = lambda us: round(us / steps / 1e3, 3)  # noqa: E731
    # Per collective kind: busy, exposed (no compute kernel running) and alone (no compute and no
    # other collective kind running: time nothing else explains).
    kinds: dict[str, list[tuple[float, float]]] = {}
    for e in kernels:
        if is_comm(e):
            kinds.setdefault(e["name"].split("(")[0].removeprefix("ncclDevKernel_"), []).append((e["ts"], e["ts"] + e["dur"]))
    by_kind = {}
    for kind, intervals in kinds.items():
        mine = interval_union(intervals)
        others = interval_union(compute + [i for k, v in kinds.items() if k != kind for i in v])
        by_kind[kind] = {"calls": len(intervals) / steps, "busy_ms": per_step(total(mine)),
                         "exposed_ms": per_step(minus(mine, compute)), "alone_ms": per_step(minus(mine, others))}  # fmt: skip
    # Which streams each kind of kernel ran on (eager steps show the real streams; graph replays run
    # on internal ones): two kinds sharing a stream are serialized in issue order.
    streams: dict[str, dict[str, int]] = {}
    for e in kernels:
        kind = e["name"].split("(")[0].removeprefix("ncclDevKernel_") if is_comm(e) else (
            "adamw" if "adamw" in e["name"] else "compute")  # fmt: skip
        stream = str(e.get("args", {}).get("stream"))
        streams.setdefault(kind, {}).setdefault(stream, 0)
        streams[kind][stream] += 1
    return {
        "streams_by_kind": streams,
        "largest_gaps": largest_gaps(kernels, compute, is_comm, steps),
        "span_ms": per_step(span),
        "compute_busy_ms": per_step(total(compute)),
        "nccl_busy_ms": per_step(total(comm)),
        "nccl_exposed_ms": per_step(minus(comm, compute)),
        "idle_ms": per_step(span - total(busy)),
        "nccl_by_kind": by_kind,
        "top_kernels_ms": {k: per_step(v) for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:40]},
    }


def _collectives(trace_path: Path) -> dict[str, list[tuple[float, float]]]:
    """Each collective kind's kernels as (start, end) in microseconds on the host clock, in start
    order (traces that count from ``baseTimeNanoseconds`` are shifted onto it)."""
    data = json.loads(trace_path.read_text())
    base = float(data.get("baseTimeNanoseconds", 0)) / 1e3
    kinds: dict[str, list[tuple[float, float]]] = {}
    for e in data["traceEvents"]:
        if e.get("cat") == "kernel" and e.get("dur", 0) > 0 and e["name"].startswith(("ncclDevKernel", "ncclKernel")):
            kind = e["name"].split("(")[0].removeprefix("ncclDevKernel_")
            kinds.setdefault(kind, []).append((base + e["ts"], base + e["ts"] + e["dur"]))
    return {kind: sorted(calls) for kind, calls in kinds.items()}


def peer_waits(trace_paths: list[Path], steps: int) -> dict:
    """Per collective kind and rank (ms per step): how long its kernels ran before the last rank
    reached the same call (waiting for a later peer: load imbalance or a delayed launch there), and
    the median time from that arrival to the kernel's end (the transfer itself). The i-th call of a
    kind is paired across ranks; the ranks' traces must share a clock (one host)."""
    per_rank = [_collectives(path) for path in trace_paths]
    result = {}
    for kind in sorted(set.intersection(*(set(kinds) for kinds in per_rank))):
        calls = min(len(kinds[kind]) for kinds in per_rank)
        waits = [0.0] * len(per_rank)
        transfers = []
        for i in range(calls):
            arrival = max(kinds[kind][i][0] for kinds in per_rank)
            for rank, kinds in enumerate(per_rank):
                start, end = kinds[kind][i]
                waits[rank] += min(arrival, end) - start
                transfers.append(max(0.0, end - arrival))
        result[kind] = {"calls": calls / steps, "peer_wait_ms_by_rank": [round(w / steps / 1e3, 3) for w in waits],
                        "transfer_us_median": round(statistics.median(transfers), 1)}  # fmt: skip
    return result


def largest_gaps(kernels: list[dict], compute: list[tuple[float, float]], is_comm, steps: int, count: int = 25) -> list[dict]:
    """The longest stretches with no compute kernel running (of the profiled steps): where in the step
    they fall, which collectives ran in them and which compute kernel ended the wait, so that exposed
    communication is attributed to a phase and a collective, not just totalled."""
    first = min(e["ts"] for e in kernels)
    span = (max(e["ts"] + e["dur"] for e in kernels) - first) / steps
    gaps = [(compute[i][1], compute[i + 1][0]) for i in range(len(compute) - 1) if compute[i + 1][0] - compute[i][1] > 5]
    starts = sorted(((e["ts"], e) for e in kernels if not is_comm(e)), key=lambda pair: pair[0])  # dicts do not compare
    comm = [e for e in kernels if is_comm(e)]
    rows = []
    for start, end in sorted(gaps, key=lambda g: g[0] - g[1])[:count]:
        during = [f"{e['name'].split('(')[0].removeprefix('ncclDevKernel_')} {e['dur']:.0f}us@{e['ts'] - start:+.0f}"
                  for e in comm if e["ts"] < end and e["ts"] + e["dur"] > start]  # fmt: skip
        waiting = next((e for ts, e in starts if ts >= end), None)
        ended = [e for _, e in starts if e["ts"] + e["dur"] <= start + 0.5]  # the kernel whose end began the gap
        previous = max(ended, key=lambda e: e["ts"] + e["dur"])["name"][:60] if ended else "-"
        row = {"us": round(end - start, 1), "at_ms_in_step": round(((start - first) % span) / 1e3, 2),
               "after": previous, "before": "-" if waiting is None else waiting["name"][:60], "collectives": during[:6]}
        if waiting is not None:  # what its own stream did last: long idle = it waited on another stream
            stream = waiting.get("args", {}).get("stream")
            last = max((e["ts"] + e["dur"] for e in kernels if e.get("args", {}).get("stream") == stream
                        and e["ts"] + e["dur"] <= waiting["ts"]), default=None)  # fmt: skip
            row["before_stream"] = stream
            row["its_stream_idle_us"] = None if last is None else round(waiting["ts"] - last, 1)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--option", action="append", default=[], help="a moetune option, key=value (repeatable)")
    parser.add_argument("--routing", choices=["real", "balanced"], default="real")
    parser.add_argument("--cuda-graph", action="store_true")
    parser.add_argument("--overlap-optimizer", action="store_true", help="with --cuda-graph: updates during backward")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--graph-warmup-steps", type=int, default=2,
                        help="with --cuda-graph: eager steps before the capture (more than the run's steps: the "
                             "profiled steps run eagerly on the step's real streams)")
    parser.add_argument("--profile-steps", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--label", default="ep")
    parser.add_argument("--rebalance-experts", action="store_true",
                        help="relabel the experts for balanced ranks first (moetune.distributed.placement)")  # fmt: skip
    args = parser.parse_args()
    rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    device = torch.device("cuda", rank)
    options = _moetune_options(argparse.Namespace(moetune_option=args.option))
    _, config = load_config("qwen3_30b_a3b", layers=args.layers)
    bench = build_moetune(config, device=device, seed=0, world_size=dist.get_world_size(), options=options,
                          balanced_gate=args.routing == "balanced",
                          rebalance_seq_len=args.seq_len if args.rebalance_experts else None)  # fmt: skip
    model = bench.model
    opt = make_optimizer(model, lr=1e-5, device=device, kind="moetune", capturable=args.cuda_graph)
    generator = torch.Generator(device).manual_seed(rank)
    ids = torch.randint(0, config.vocab_size, (1, args.seq_len), device=device, generator=generator)
    if args.routing == "real":  # how evenly the measured tokens' routed rows split over the ranks
        from moetune.distributed.placement import expert_loads, rows_per_rank

        world = dist.get_world_size()
        ratios = [(rows_per_rank(rows, world).max() / (rows.sum() / world)).item()
                  for rows in expert_loads(model, [{"input_ids": ids}]).values()]  # fmt: skip
        if rank == 0:
            print(f"routed rows, busiest rank over the mean, per MoE layer: {[round(r, 3) for r in ratios]}", flush=True)
    if args.cuda_graph:
        from moetune.training import CUDAGraphTrainStep

        graphed = CUDAGraphTrainStep(model, opt, warmup_steps=args.graph_warmup_steps,
                                     overlap_optimizer=args.overlap_optimizer)
        step = lambda: graphed(input_ids=ids, labels=ids)  # noqa: E731
    else:

        def step():
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    for _ in range(4):
        step()
    times = []
    for _ in range(args.steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    from torch.profiler import ProfilerActivity, profile, schedule

    dist.barrier()
    torch.cuda.synchronize()
    # One unrecorded step first: the ranks' hosts reach the profiler at different times, and the
    # first collective of the first recorded step would count that skew as NCCL time.
    args.out.mkdir(parents=True, exist_ok=True)
    trace = args.out / f"trace_{args.label}_rank{rank}.json"
    # With a schedule the recorded steps reach only on_trace_ready (exporting after the block is empty).
    with profile(activities=[ProfilerActivity.CUDA], schedule=schedule(wait=0, warmup=1, active=args.profile_steps),
                 on_trace_ready=lambda p: p.export_chrome_trace(str(trace))) as prof:  # fmt: skip
        for _ in range(1 + args.profile_steps):
            step()
            torch.cuda.synchronize()
            prof.step()
    summary = {"label": args.label, "rank": rank, "options": options, "routing": args.routing,
               "cuda_graph": args.cuda_graph, "layers": args.layers, "step_ms_median": round(statistics.median(times), 2),
               **timeline(trace, args.profile_steps)}  # fmt: skip
    (args.out / f"timeline_{args.label}_rank{rank}.json").write_text(json.dumps(summary, indent=1))
    dist.barrier()  # every rank's trace is written
    if rank == 0:
        print(json.dumps({k: v for k, v in summary.items() if k != "top_kernels_ms"}, indent=1), flush=True)
        traces = [args.out / f"trace_{args.label}_rank{r}.json" for r in range(dist.get_world_size())]
        waits = peer_waits(traces, args.profile_steps)
        (args.out / f"peer_waits_{args.label}.json").write_text(json.dumps(waits, indent=1))
        print("peer waits:", json.dumps(waits), flush=True)
    dist.barrier()
    os._exit(0)  # skip NCCL teardown with live CUDA graphs (it hung until torchrun's timeout)


if __name__ == "__main__":
    main()
