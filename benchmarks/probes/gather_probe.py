"""Time the MoE gather kernel (moetune/kernels/permute.py) per launch configuration (elements per
program, warps) at Qwen3-30B-A3B's shapes: 4096 tokens x top-8 -> 32768 sorted rows of 2048 bf16,
as the experts' input gather and as the combine's backward (routing weights, dot products for
their gradient); plus a copy of the output's bytes for the ceiling.

    python benchmarks/probes/gather_probe.py
"""

from __future__ import annotations

import importlib
import itertools
import json

import torch
from triton.testing import do_bench

permute = importlib.import_module("moetune.kernels.permute")


def main() -> None:
    tokens, top_k, hidden = 4096, 8, 2048
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    experts = torch.rand(tokens, 128, device="cuda").argsort(dim=-1)[:, :top_k]
    order = torch.argsort(experts.reshape(-1), stable=True)
    weights = torch.rand(tokens * top_k, device="cuda")
    y = torch.randn(tokens * top_k, hidden, device="cuda", dtype=torch.bfloat16)
    out_bytes = tokens * top_k * hidden * 2
    source = torch.empty_like(y)
    copy_ms = do_bench(lambda: y.copy_(source), rep=100)
    print(json.dumps({"what": "copy (read + write of the output bytes)", "us": round(copy_ms * 1e3, 1)}), flush=True)
    for tile, warps in itertools.product((2048, 4096, 8192, 16384), (None, 4, 8, 16)):
        permute._GATHER_TILE, permute._GATHER_DOT_TILE, permute._GATHER_NUM_WARPS = tile, tile // 2, warps
        gather_ms = do_bench(lambda: permute._gather_rows_triton(x, order, top_k), rep=100)
        dot_ms = do_bench(lambda: permute._gather_rows_triton(x, order, top_k, weights=weights, y_for_dot=y), rep=100)
        print(json.dumps({"tile": tile, "warps": warps, "gather_us": round(gather_ms * 1e3, 1),
                          "gather_tb_per_s": round(out_bytes / gather_ms / 1e9, 2),
                          "dot_us": round(dot_ms * 1e3, 1)}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
