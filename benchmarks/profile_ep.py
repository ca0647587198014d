"""Profile one expert-parallel training step of moetune (rank 0 prints the tables).

    torchrun --standalone --nproc-per-node 2 benchmarks/profile_ep.py --layers 16
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import transformers

import moetune
from moetune.optim import AdamW

from profile_step import QWEN3_30B_A3B  # noqa: E402  (same directory)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    cfg = transformers.Qwen3MoeConfig(**{**QWEN3_30B_A3B, "num_hidden_layers": args.layers})
    model = moetune.AutoModelForCausalLM.from_config(
        cfg, dtype=torch.bfloat16, ep_size=dist.get_world_size(), reduce_dtype=torch.bfloat16
    ).train()
    opt = AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
    ids = torch.randint(0, cfg.vocab_size, (1, args.seq_len), device="cuda", generator=torch.Generator("cuda").manual_seed(rank))

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) / 3 * 1e3
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    if rank == 0:
        print(f"wall per step {wall_ms:.1f} ms")
        averages = prof.key_averages()
        print(averages.table(sort_by="cuda_time_total", row_limit=args.top, max_name_column_width=60))
        print(averages.table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=60))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
