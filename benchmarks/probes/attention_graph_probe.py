"""Causal attention forward + backward per SDPA backend, eager and replayed from a CUDA graph.

Why: the whole-step CUDA graph ran cuDNN attention ~3x slower than eager (profile_graph_h200.txt),
so this measures each backend both ways at Qwen3-30B-A3B's attention shapes.

    python benchmarks/probes/attention_graph_probe.py [--seq-len 4096] [--heads 32] [--kv-heads 4]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F
from graph_timing import capture  # benchmarks/probes/graph_timing.py (the script's own folder is on sys.path)
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def time_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def probe(backend: str, layout: str, args) -> dict:
    """layout ``repeated``: contiguous [B, H, S, D] q, k, v with K/V repeated to every head;
    ``gqa``: what moetune's attention passes: [B, S, H, D] projections transposed (strided), K/V
    with ``kv_heads`` heads and ``enable_gqa=True``."""
    kv_heads = args.heads if layout == "repeated" else args.kv_heads

    def leaf(heads: int) -> torch.Tensor:
        return torch.randn(1, args.seq_len, heads, args.head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    q_leaf, k_leaf, v_leaf = leaf(args.heads), leaf(kv_heads), leaf(kv_heads)
    grad = torch.randn(1, args.heads, args.seq_len, args.head_dim, device="cuda", dtype=torch.bfloat16)

    def step():
        q, k, v = (t.transpose(1, 2) for t in (q_leaf, k_leaf, v_leaf))
        if layout == "repeated":
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        with sdpa_kernel([BACKENDS[backend]]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=layout == "gqa")
        out.backward(grad)
        q_leaf.grad = k_leaf.grad = v_leaf.grad = None

    result = {"backend": backend, "layout": layout}
    try:
        result["eager_ms"] = time_ms(step)
        result["graph_ms"] = time_ms(capture(step).replay)
    except Exception as error:  # noqa: BLE001 -- a backend may not support the shapes
        result["error"] = f"{type(error).__name__}: {str(error)[:200]}"
    flops = 4 * args.seq_len**2 * args.head_dim * args.heads / 2 * 3.5  # causal fwd + 2.5x bwd
    for key in ("eager_ms", "graph_ms"):
        if key in result:
            result[key.replace("_ms", "_tflops")] = flops / (result[key] * 1e-3) / 1e12
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    for layout in ("repeated", "gqa"):
        for backend in BACKENDS:
            print(json.dumps({**vars(args), **probe(backend, layout, args)}), flush=True)


if __name__ == "__main__":
    main()
