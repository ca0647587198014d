"""How steady is the bf16 matmul peak that MFU is reported against? Calls moetune.bench's
matmul_peak_tflops repeatedly with several settings on one GPU, then times constant operands (a GPU
at its power limit clocks higher when fewer bits toggle). Prints one dict per call.

    PYTHONPATH=$PWD python benchmarks/probes/matmul_peak_probe.py --trials 4

The 2026-12-05 run (H100 80GB HBM3, torch 2.11, commit 5b44751; one 50-matmul median per call, as
the bench then measured) is benchmarks/results/h100_20261205_5b44751/matmul_peak_probe.log.
"""

from __future__ import annotations

import argparse
import time

import torch

from moetune.bench.measure import matmul_peak_tflops

SETTINGS = (  # size, warmup, windows, reps
    (8192, 10, 1, 50),
    (8192, 200, 1, 200),
    (16384, 20, 1, 30),
    (8192, 10, 5, 20),  # the bench's setting
)


def constant_operands_tflops(device: torch.device, size: int = 8192, reps: int = 100) -> float:
    a = torch.full((size, size), 0.5, device=device, dtype=torch.bfloat16)
    b = a.clone()
    for _ in range(20):
        a @ b
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize(device)
    return 2 * size**3 / ((time.perf_counter() - start) / reps) / 1e12


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=4)
    args = parser.parse_args()
    device = torch.device("cuda")
    for trial in range(args.trials):
        for size, warmup, windows, reps in SETTINGS:
            tflops = matmul_peak_tflops(device, size=size, warmup=warmup, windows=windows, reps=reps)
            print(dict(trial=trial, size=size, warmup=warmup, windows=windows, reps=reps, tflops=round(tflops, 1)))
    print("constant operands, 8192:", round(constant_operands_tflops(device), 1))


if __name__ == "__main__":
    main()
