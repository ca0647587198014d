"""Time the expert-parallel collectives of one Qwen3-30B-A3B layer as a CUDA-graph replay sees them.

    torchrun --standalone --nproc-per-node 2 benchmarks/nccl_probe.py --out probe.jsonl

The all-gather dispatcher's per-layer collectives at seq 4096, hidden 2048 (ep = world): the tokens'
all-gather (bf16), the partial sums' reduce-scatter (fp32), and in the backward the output gradient's
all-gather (bf16) and the token gradient's reduce-scatter (bf16). Each is captured in a CUDA graph
of ``--reps`` calls and replayed, so the time is NCCL's, not the host's. Run it under different
NCCL settings (NCCL_PROTO, NCCL_MIN_NCHANNELS, ...) to pick the ones to launch with; the settings
are recorded with each line.
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

        for _ in range(3):
            call()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(args.reps):
                call()
        graph.replay()
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
        us = (time.perf_counter() - start) / (5 * args.reps) * 1e6
        sent = x.numel() * x.element_size() * (world - 1) / world  # bytes each rank sends
        line = {"case": name, "us": round(us, 1), "send_GBps": round(sent / us / 1e3, 1), "bytes_in": x.numel() * x.element_size(),
                "world": world, "env": {k: os.environ.get(k) for k in ENV_KEYS}}  # fmt: skip
        if rank == 0:
            print(json.dumps(line), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(line) + "\n")
    dist.barrier()
    os._exit(0)  # skip NCCL teardown with live graphs (it can hang)


if __name__ == "__main__":
    main()
