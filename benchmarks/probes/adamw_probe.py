"""Bandwidth of moetune's AdamW kernel per launch configuration (BLOCK, num_warps) on one expert
tensor of Qwen3-30B-A3B (128 x 1536 x 2048 bf16, 403M elements), plus a plain copy for the ceiling.

    python benchmarks/probes/adamw_probe.py
"""

from __future__ import annotations

import json

import torch
from triton.testing import do_bench

import moetune.optim.adamw as adamw


def main() -> None:
    n = 128 * 1536 * 2048
    param, grad, exp_avg, exp_avg_sq = (torch.randn(n, device="cuda").to(torch.bfloat16) for _ in range(4))
    exp_avg_sq.abs_()
    step, lr = torch.ones((), device="cuda"), torch.full((), 1e-5, device="cuda")
    bytes_moved = 14 * n  # read param, grad, 2 moments; write param, 2 moments (bf16)
    copy_ms = do_bench(lambda: grad.copy_(param), rep=200)
    print(json.dumps({"what": "copy", "tb_per_s": 4 * n / copy_ms / 1e9}), flush=True)
    for block, warps in [(1024, 4), (2048, 4), (4096, 8), (4096, 4), (8192, 8), (8192, 16), (16384, 16)]:
        adamw._BLOCK, adamw._NUM_WARPS = block, warps
        ms = do_bench(lambda: adamw._triton_step(param, grad, exp_avg, exp_avg_sq, lr=lr, beta1=0.9, beta2=0.999,
                                                 eps=1e-8, weight_decay=0.0, step=step), rep=200)  # fmt: skip
        print(json.dumps({"block": block, "num_warps": warps, "ms": ms, "tb_per_s": bytes_moved / ms / 1e9}), flush=True)


if __name__ == "__main__":
    main()
