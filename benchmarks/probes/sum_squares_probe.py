"""The global gradient norm of clipping: torch's foreach norm (``torch.nn.utils.get_total_norm``)
against moetune's sum-of-squares kernel (moetune/kernels/sum_squares.py) for several launch
settings, on the bf16 gradients of a Qwen3-30B-A3B model of ``--layers`` layers on one GPU.

    python benchmarks/probes/sum_squares_probe.py [--layers 8]

One JSON line per variant: milliseconds (triton.testing.do_bench), TB/s read, relative difference
to a float64 norm.
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

import moetune.kernels.sum_squares as kernel

SETTINGS = [  # (BLOCK, PROGRAMS_PER_SM, NUM_WARPS)
    (4096, 8, 8), (4096, 4, 8), (8192, 4, 8), (8192, 8, 16), (2048, 16, 4), (4096, 16, 8), (16384, 2, 16),
]  # fmt: skip


def qwen3_grads(layers: int, device) -> list[torch.Tensor]:
    hidden, experts, width, vocab, heads, kv_heads, head_dim = 2048, 128, 768, 151936, 32, 4, 128
    shapes = [(vocab, hidden), (vocab, hidden), (hidden,)]
    for _ in range(layers):
        shapes += [(heads * head_dim, hidden), (kv_heads * head_dim, hidden), (kv_heads * head_dim, hidden),
                   (hidden, heads * head_dim), (head_dim,), (head_dim,), (hidden,), (hidden,), (experts, hidden),
                   (experts, 2 * width, hidden), (experts, hidden, width)]  # fmt: skip
    generator = torch.Generator(device=device).manual_seed(0)
    return [torch.randn(shape, device=device, generator=generator, dtype=torch.bfloat16) for shape in shapes]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    grads = qwen3_grads(args.layers, torch.device("cuda"))
    nbytes = sum(g.numel() * g.element_size() for g in grads)
    exact = float(sum(g.double().square().sum() for g in grads).sqrt())

    def emit(name: str, fn, **extra) -> None:
        value = float(fn())
        ms = do_bench(fn, rep=300)
        print(json.dumps({"variant": name, **extra, "ms": round(ms, 3), "tb_per_s": round(nbytes / ms / 1e9, 2),
                          "rel_diff": f"{abs(value - exact) / exact:.1e}", "gb": round(nbytes / 1e9, 2)}), flush=True)

    emit("torch get_total_norm (foreach)", lambda: torch.nn.utils.get_total_norm(grads, 2.0))
    for block, per_sm, warps in SETTINGS:
        kernel.BLOCK, kernel.PROGRAMS_PER_SM, kernel.NUM_WARPS = block, per_sm, warps
        emit("moetune sum_of_squares", lambda: kernel.sum_of_squares(grads).sqrt(), block=block, programs_per_sm=per_sm,
             num_warps=warps)  # fmt: skip


if __name__ == "__main__":
    main()
