"""Time moetune's RMSNorm backward kernel per launch configuration (row tile, programs per SM,
warps) on the shapes of Qwen3-30B-A3B at 4096 tokens: the hidden norms [4096, 2048], q_norm
[131072, 128] and k_norm [16384, 128], bf16, weight gradient on; plus a copy of the same bytes for
the ceiling.

    python benchmarks/probes/rms_norm_probe.py
"""

from __future__ import annotations

import importlib
import itertools
import json

import torch
from triton.testing import do_bench

rms = importlib.import_module("moetune.kernels.rms_norm")  # the package exports a function of that name

SHAPES = {"hidden": (4096, 2048), "q_norm": (131072, 128), "k_norm": (16384, 128)}


def main() -> None:
    for name, (rows, cols) in SHAPES.items():
        x, dy = (torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        weight = torch.randn(cols, device="cuda", dtype=torch.bfloat16)
        _, rstd = rms._fwd_triton(x, weight, 1e-6)
        bytes_moved = 3 * x.numel() * 2
        copy_ms = do_bench(lambda: dy.copy_(x), rep=100)
        print(json.dumps({"shape": name, "what": "copy of 2/3 of the bytes", "us": copy_ms * 1e3}), flush=True)
        for tile, per_sm, warps in itertools.product((2048, 4096, 8192, 16384), (1, 2, 4, 8), (None, 4, 8, 16)):
            rms._BWD_TILE, rms._BWD_PROGRAMS_PER_SM, rms._BWD_NUM_WARPS = tile, per_sm, warps
            try:
                ms = do_bench(lambda: rms._bwd_triton(dy, x, weight, rstd, compute_dw=True), rep=50)
            except Exception as error:  # noqa: BLE001 -- e.g. too many registers: report and go on
                print(json.dumps({"shape": name, "tile": tile, "per_sm": per_sm, "warps": warps, "error": str(error)[:80]}))
                continue
            print(json.dumps({"shape": name, "tile": tile, "per_sm": per_sm, "warps": warps, "us": round(ms * 1e3, 1),
                              "tb_per_s": round(bytes_moved / ms / 1e9, 2)}), flush=True)


if __name__ == "__main__":
    main()
