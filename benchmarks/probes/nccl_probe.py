"""Time the expert-parallel collectives of one Qwen3-30B-A3B layer as a CUDA-graph replay sees them.

    torchrun --standalone --nproc-per-node 2 benchmarks/probes/nccl_probe.py --out probe.jsonl

The all-gather dispatcher's per-layer collectives at seq 4096, hidden 2048 (ep = world): the tokens'
all-gather (bf16), the partial sums' reduce-scatter (fp32), and in the backward the output gradient's
all-gather (bf16) and the token gradient's reduce-scatter (bf16). Each is captured in a CUDA graph
of ``--reps`` calls and replayed, so the time is NCCL's, not the host's. Run it under different
NCCL settings (NCCL_PROTO, NCCL_MIN_NCHANNELS, ...) to pick the ones to launch with; the settings
are recorded with each line.

``--copy-engine`` also times the same all-gather and fp32 reduce-scatter done without NCCL and
without SMs for the transfer: each rank pushes its rows into the peers' symmetric-memory buffers
with device-to-device copies (copy engines over NVLink), between two symmetric-memory barriers
(the buffers are reused, as a layer loop reuses them); the reduce-scatter then adds the received
partial sums to its own with one elementwise kernel. A candidate for the forward's per-layer
collectives, which sit on the critical path (benchmarks/README.md, row B). Not run yet.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

ENV_KEYS = ("NCCL_PROTO", "NCCL_ALGO", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS", "NCCL_NVLS_ENABLE", "NCCL_VERSION")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", default=None)
    parser.add_argument("--copy-engine", action="store_true", help="also time copy-engine pushes into symmetric memory")
    args = parser.parse_args()
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    world = dist.get_world_size()
    t, h = args.tokens, args.hidden
    cases = {
        "allgather_bf16": (torch.empty(t, h, dtype=torch.bfloat16, device="cuda"), "gather"),
        "reduce_scatter_fp32": (torch.empty(world * t, h, dtype=torch.float32, device="cuda"), "scatter"),
        "reduce_scatter_bf16": (torch.empty(world * t, h, dtype=torch.bfloat16, device="cuda"), "scatter"),
    }
    for name, (x, kind) in cases.items():
        x.normal_()
        out = x.new_empty((world * t, h)) if kind == "gather" else x.new_empty((t, h))

        def call():
            if kind == "gather":
                dist.all_gather_into_tensor(out, x)
            else:
                dist.reduce_scatter_tensor(out, x)

        report(name, time_graph(call, args.reps), x, world, rank, args.out)
    if args.copy_engine:
        try:
            for name, call, x in copy_engine_cases(t, h, world, rank):
                report(name, time_graph(call, args.reps), x, world, rank, args.out)
        except Exception as error:  # noqa: BLE001 -- the NCCL lines above are already written
            report_error("copy_engine", error, rank, args.out)
    dist.barrier()
    os._exit(0)  # skip NCCL teardown with live graphs (it can hang)


def time_graph(call, reps: int) -> float:
    """Microseconds per call, from replays of a graph of ``reps`` calls (after 3 eager calls)."""
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            call()
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / (5 * reps) * 1e6


def report(name: str, us: float, x: torch.Tensor, world: int, rank: int, out: str | None) -> None:
    sent = x.numel() * x.element_size() * (world - 1) / world  # bytes each rank sends
    line = {"case": name, "us": round(us, 1), "send_GBps": round(sent / us / 1e3, 1), "bytes_in": x.numel() * x.element_size(),
            "world": world, "env": {k: os.environ.get(k) for k in ENV_KEYS}}  # fmt: skip
    _write(line, rank, out)


def report_error(name: str, error: Exception, rank: int, out: str | None) -> None:
    _write({"case": name, "error": f"{type(error).__name__}: {error}"[:500]}, rank, out)


def _write(line: dict, rank: int, out: str | None) -> None:
    if rank == 0:
        print(json.dumps(line), flush=True)
        if out:
            with open(out, "a") as f:
                f.write(json.dumps(line) + "\n")


def copy_engine_cases(t: int, h: int, world: int, rank: int):
    """(name, call, input) of the copy-engine all-gather (bf16 [t, h] per rank) and fp32
    reduce-scatter ([world * t, h] partial sums per rank), on symmetric-memory buffers."""
    import torch.distributed._symmetric_memory as symm_mem

    group_name = dist.group.WORLD.group_name
    if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed before rendezvous in older torch
        symm_mem.enable_symm_mem_for_group(group_name)
    gathered = symm_mem.empty(world * t, h, dtype=torch.bfloat16, device="cuda")
    gather_handle = symm_mem.rendezvous(gathered, group_name)
    x = torch.randn(t, h, dtype=torch.bfloat16, device="cuda")

    def all_gather():
        gather_handle.barrier(channel=0)  # every peer is done reading the previous contents
        for peer in range(world):
            dst = gather_handle.get_buffer(peer, (world * t, h), torch.bfloat16)
            dst[rank * t:(rank + 1) * t].copy_(x)  # device-to-device over NVLink: a copy engine
        gather_handle.barrier(channel=1)  # every peer's rows have landed here

    received = symm_mem.empty(world, t, h, dtype=torch.float32, device="cuda")
    scatter_handle = symm_mem.rendezvous(received, group_name)
    partial = torch.randn(world * t, h, dtype=torch.float32, device="cuda")
    summed = torch.empty(t, h, dtype=torch.bfloat16, device="cuda")

    def reduce_scatter():
        scatter_handle.barrier(channel=0)
        for peer in range(world):  # my partial sums of peer's tokens into its slot `rank`
            dst = scatter_handle.get_buffer(peer, (world, t, h), torch.float32)
            dst[rank].copy_(partial[peer * t:(peer + 1) * t])
        scatter_handle.barrier(channel=1)
        summed.copy_(received.sum(dim=0))  # own + received partial sums, rounded once

    return [("allgather_bf16_copy_engine", all_gather, x), ("reduce_scatter_fp32_copy_engine", reduce_scatter, partial)]


if __name__ == "__main__":
    main()
