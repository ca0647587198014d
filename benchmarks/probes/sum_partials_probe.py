"""Time the RMSNorm weight gradient's partial-sum kernel (``rms_norm.sum_partials``) per launch setting
on the shapes the backward hands it for Qwen3-30B-A3B at 4096 tokens on an H200: [528, 2048] fp32 (the
hidden norms: 4 programs per SM) and [264, 128] (q / k norms: 2 per SM); alone, and beside a copy
that streams memory on another stream, as the overlapped AdamW updates do in the graphed step.

    python benchmarks/probes/sum_partials_probe.py
"""

from __future__ import annotations

import importlib
import itertools
import json
import statistics

import torch
from triton.testing import do_bench

rms = importlib.import_module("moetune.kernels.rms_norm")  # the package exports a function of that name


def beside_a_copy(fn, side: torch.cuda.Stream, src: torch.Tensor, dst: torch.Tensor, reps: int = 30) -> float:
    """Median microseconds of ``fn`` while ``side`` copies ``src`` into ``dst`` (a long stream of bytes)."""
    times = []
    for _ in range(5):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            dst.copy_(src)
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            times.append((start, end))
        torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times) * 1e3


def main() -> None:
    side = torch.cuda.Stream()
    src = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for rows, cols in ((528, 2048), (264, 128)):
        partial = torch.randn(rows, cols, device="cuda")
        weight = torch.empty(cols, device="cuda", dtype=torch.bfloat16)
        expected = partial.sum(0).to(torch.bfloat16)
        for block_n, block_p, warps in itertools.product((16, 32, 64, 128, None), (128, 256, 512, 1024), (4, 8)):
            rms._PARTIALS_BLOCK_N, rms._PARTIALS_BLOCK_P, rms._PARTIALS_NUM_WARPS = block_n, block_p, warps
            fn = lambda: rms.sum_partials(partial, weight)  # noqa: E731
            try:
                got = fn()
                alone = do_bench(fn, rep=50) * 1e3
                busy = beside_a_copy(fn, side, src, dst)
            except Exception as error:  # noqa: BLE001 -- e.g. too many registers: report and go on
                print(json.dumps({"rows": rows, "cols": cols, "block_n": block_n, "block_p": block_p, "warps": warps,
                                  "error": str(error)[:80]}), flush=True)  # fmt: skip
                continue
            block_n = block_n or "default"
            ok = torch.allclose(got.float(), expected.float(), rtol=1e-2, atol=1e-2)
            print(json.dumps({"rows": rows, "cols": cols, "block_n": block_n, "block_p": block_p, "warps": warps,
                              "us_alone": round(alone, 2), "us_beside_copy": round(busy, 2), "ok": ok}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
