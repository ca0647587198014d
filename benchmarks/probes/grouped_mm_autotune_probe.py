"""Does inductor's persistent TMA grouped-GEMM template (``torch.compile`` max-autotune) beat torch's
CUTLASS ``_grouped_mm`` on the experts' six GEMMs? Row A's shape (128 experts, ~256 rows each) and
row B's (64 experts, ~512 rows each) of Qwen3-30B-A3B, H 2048, I 768, 32,768 routed rows.

    python benchmarks/probes/grouped_mm_autotune_probe.py [--shapes rowA,rowB] [--routing balanced,skewed]

Inductor autotunes each GEMM once on evenly spread group offsets (its own rule) and prints its
choice table to stderr; this script then times the compiled call and torch's eager call on the
same operands with balanced and skewed group sizes (triton.testing.do_bench, L2 flushed), checks
the compiled result against eager, and writes one JSON line per (shape, GEMM, routing).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from triton.testing import do_bench

_grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm

SHAPES = {"rowA": 128, "rowB": 64}  # experts on the GPU; the routed rows are 4096 tokens x top-8 either way


def group_ends(kind: str, rows: int, experts: int, device) -> torch.Tensor:
    if kind == "balanced":
        counts = torch.full((experts,), rows // experts)
    else:  # skewed like a random-init router: log-normal loads, the same total
        generator = torch.Generator().manual_seed(0)
        weights = torch.exp(0.5 * torch.randn(experts, generator=generator))
        counts = torch.floor(weights / weights.sum() * rows).long()
        counts[0] += rows - counts.sum()
    return torch.cumsum(counts, 0).to(device=device, dtype=torch.int32)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="rowA,rowB")
    parser.add_argument("--routing", default="balanced,skewed")
    args = parser.parse_args()
    import torch._inductor.config as inductor_config

    inductor_config.max_autotune_gemm_backends = "ATEN,TRITON"
    device, dtype = torch.device("cuda"), torch.bfloat16
    rows, hidden, width = 4096 * 8, 2048, 768
    torch.manual_seed(0)
    x = torch.randn(rows, hidden, device=device, dtype=dtype)
    act = torch.randn(rows, width, device=device, dtype=dtype)
    dy = torch.randn(rows, hidden, device=device, dtype=dtype)
    dh = torch.randn(rows, 2 * width, device=device, dtype=dtype)

    def mm(a, b, offs):
        return _grouped_mm(a, b, offs=offs)

    for shape in args.shapes.split(","):
        experts = SHAPES[shape]
        gate_up = torch.randn(experts, 2 * width, hidden, device=device, dtype=dtype) * 0.02  # [E, out, in]
        down = torch.randn(experts, hidden, width, device=device, dtype=dtype) * 0.02
        gemms = {  # name -> (a, b, flops); the layouts moetune/moe/experts.py passes
            "fwd_gate_up": (x, gate_up.transpose(-2, -1), 2 * rows * hidden * 2 * width),
            "fwd_down": (act, down.transpose(-2, -1), 2 * rows * width * hidden),
            "dx_down": (dy, down, 2 * rows * hidden * width),
            "dx_gate_up": (dh, gate_up, 2 * rows * 2 * width * hidden),
            "dw_down": (dy.t(), act, 2 * rows * hidden * width),
            "dw_gate_up": (dh.t(), x, 2 * rows * 2 * width * hidden),
        }
        for name, (a, b, flops) in gemms.items():
            torch._dynamo.reset()
            compiled = torch.compile(mm, mode="max-autotune-no-cudagraphs", dynamic=False, fullgraph=True)
            start = time.perf_counter()
            compiled(a, b, group_ends("balanced", rows, experts, device))
            torch.cuda.synchronize()
            tune_s = time.perf_counter() - start
            for kind in args.routing.split(","):
                offs = group_ends(kind, rows, experts, device)
                ref = mm(a, b, offs)
                got = compiled(a, b, offs)
                err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
                eager_us = do_bench(lambda: mm(a, b, offs), rep=200) * 1e3
                compiled_us = do_bench(lambda: compiled(a, b, offs), rep=200) * 1e3
                record = dict(shape=shape, experts=experts, gemm=name, routing=kind, tune_s=round(tune_s, 1),
                              eager_us=round(eager_us, 1), eager_tflops=round(flops / eager_us / 1e6, 1),
                              compiled_us=round(compiled_us, 1), compiled_tflops=round(flops / compiled_us / 1e6, 1),
                              speedup=round(eager_us / compiled_us, 3), rel_err=f"{err:.1e}")  # fmt: skip
                print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
