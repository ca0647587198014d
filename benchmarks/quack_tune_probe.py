"""How long quack takes on a GEMM shape's first call (its autotuning sweep) against a repeat call, at
Qwen3-30B-A3B's expert shapes (128 experts, H 2048, I 768, top-8) for a few routed-row counts: the
cost every new row count pays under experts_backend='quack' (unpacked batches, data.pad_to_multiple_of).

    python benchmarks/quack_tune_probe.py --rows 4096,8192,12288 --out results.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from moetune.kernels import quack_grouped_gemm as quack

EXPERTS, HIDDEN, INTERMEDIATE = 128, 2048, 768


def _timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def probe(rows: int) -> dict:
    """First and repeat call seconds of the three GEMMs of one expert projection at ``rows`` rows."""
    device = torch.device("cuda")
    a = torch.randn(rows, HIDDEN, device=device, dtype=torch.bfloat16)
    w = torch.randn(EXPERTS, HIDDEN, 2 * INTERMEDIATE, device=device, dtype=torch.bfloat16) * 0.02
    grad = torch.randn(rows, 2 * INTERMEDIATE, device=device, dtype=torch.bfloat16)
    counts = torch.full((EXPERTS,), rows // EXPERTS, device=device)
    counts[: rows % EXPERTS] += 1
    offsets = counts.cumsum(0)
    gemms = {
        "row_forward": lambda: quack.rows_mm(a, w, offsets),
        "row_input_grad": lambda: quack.rows_mm(grad, w.transpose(1, 2), offsets),
        "weight_grad": lambda: quack.weight_grad(a, grad, offsets),
    }
    result = {"rows": rows}
    for name, fn in gemms.items():
        first = _timed(fn)
        repeat = min(_timed(fn) for _ in range(3))
        result[name] = {"first_s": round(first, 3), "repeat_ms": round(repeat * 1e3, 3)}
        print(json.dumps({"rows": rows, "gemm": name, **result[name]}), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="4096,8192,12288", help="comma list of routed-row counts")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    quack.require()
    results = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "shapes": {"experts": EXPERTS, "hidden": HIDDEN, "intermediate": INTERMEDIATE},
        "probes": [probe(int(r)) for r in args.rows.split(",")],
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
