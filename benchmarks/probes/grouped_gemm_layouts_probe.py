"""Does the operand orientation change the speed of torch's grouped GEMM on the experts' shapes?

    python benchmarks/probes/grouped_gemm_layouts_probe.py

For the one-GPU (128 experts, ~256 rows each) and ep=2 (64 experts, ~512 rows each) shapes of a
Qwen3-30B-A3B layer at 4096 tokens per rank, top-8: each of the experts' GEMMs as moetune computes it
and in the other orientation that gives the same numbers (C = A @ B computed as (B^T @ A^T)^T);
microseconds (triton.testing.do_bench) and TFLOP/s. One JSON line per case.
"""

from __future__ import annotations

import json

import torch
from triton.testing import do_bench

_grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm


def ends_for(experts: int, rows: int, skewed: bool, device) -> torch.Tensor:
    if skewed:  # like a random-init router: a per-expert bias plus noise
        weights = torch.softmax(torch.randn(experts, generator=torch.Generator().manual_seed(0)) * 0.5, 0)
        counts = torch.distributions.Multinomial(rows, weights).sample().long()
    else:
        counts = torch.full((experts,), rows // experts, dtype=torch.long)
    return torch.cumsum(counts, 0).to(device=device, dtype=torch.int32)


def main() -> None:
    device, dtype = torch.device("cuda"), torch.bfloat16
    hidden, width = 2048, 768
    torch.manual_seed(0)
    for experts, rows in ((128, 32768), (64, 32768)):
        w_in = torch.randn(experts, 2 * width, hidden, device=device, dtype=dtype) * 0.02  # [E, out, in]
        w_down = torch.randn(experts, hidden, width, device=device, dtype=dtype) * 0.02
        x = torch.randn(rows, hidden, device=device, dtype=dtype)
        h = torch.randn(rows, 2 * width, device=device, dtype=dtype)
        a = torch.randn(rows, width, device=device, dtype=dtype)
        dy = torch.randn(rows, hidden, device=device, dtype=dtype)
        for skewed in (False, True):
            ends = ends_for(experts, rows, skewed, device)
            cases = {
                # forward / data-gradient GEMMs: rows grouped (2-D x 3-D)
                "fwd_gate_up x @ W^T": (2 * rows * hidden * 2 * width, lambda: _grouped_mm(x, w_in.transpose(-2, -1), offs=ends)),
                "fwd_down a @ W^T": (2 * rows * width * hidden, lambda: _grouped_mm(a, w_down.transpose(-2, -1), offs=ends)),
                "dx_gate_up dh @ W": (2 * rows * 2 * width * hidden, lambda: _grouped_mm(h, w_in, offs=ends)),
                "dx_down dy @ W": (2 * rows * hidden * width, lambda: _grouped_mm(dy, w_down, offs=ends)),
                # weight gradients: the reduction grouped (2-D x 2-D), as moetune computes them ...
                "dw_gate_up dh^T @ x": (2 * rows * 2 * width * hidden, lambda: _grouped_mm(h.t(), x, offs=ends)),
                "dw_down dy^T @ a": (2 * rows * hidden * width, lambda: _grouped_mm(dy.t(), a, offs=ends)),
                # ... and transposed (the same numbers, [E, in, out] instead of [E, out, in])
                "dw_gate_up (x^T @ dh)": (2 * rows * 2 * width * hidden, lambda: _grouped_mm(x.t(), h, offs=ends)),
                "dw_down (a^T @ dy)": (2 * rows * hidden * width, lambda: _grouped_mm(a.t(), dy, offs=ends)),
            }
            for name, (flops, fn) in cases.items():
                try:
                    us = do_bench(fn, rep=200) * 1e3
                    record = {"experts": experts, "rows_per_expert": rows // experts, "skewed": skewed, "gemm": name,
                              "us": round(us, 1), "tflops": round(flops / us / 1e6, 1)}  # fmt: skip
                except Exception as error:  # an orientation torch does not take
                    record = {"experts": experts, "skewed": skewed, "gemm": name, "error": repr(error)[:200]}
                print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
