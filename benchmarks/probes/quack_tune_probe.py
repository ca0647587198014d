"""What quack's tuning costs per routed-row count, and what moetune's reuse of one tuned config per
row bucket gives up, at Qwen3-30B-A3B's expert shapes (128 experts, H 2048, I 768, top-8).

For each GEMM of one expert projection (rows forward, input gradient, weight gradient) and each
row count: quack's own call, which tunes that exact shape (first-call seconds, then the repeat
call's milliseconds), against launches with the config quack tuned at ``--anchor`` rows (what
``quack_grouped_gemm.TunedConfigs`` does within a bucket): their first call (no tuning) and repeat.

    python benchmarks/probes/quack_tune_probe.py --rows 2048,4096,6000,12288,32768 --anchor 8192 --out results.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from moetune.kernels import quack_grouped_gemm as quack

EXPERTS, HIDDEN, INTERMEDIATE = 128, 2048, 768


def _timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _gemms(rows: int) -> dict:
    """The three GEMMs of the gate_up projection at ``rows`` routed rows, as (A, B, out, varlen)."""
    device = torch.device("cuda")
    a = torch.randn(rows, HIDDEN, device=device, dtype=torch.bfloat16)
    w = torch.randn(EXPERTS, HIDDEN, 2 * INTERMEDIATE, device=device, dtype=torch.bfloat16) * 0.02
    grad = torch.randn(rows, 2 * INTERMEDIATE, device=device, dtype=torch.bfloat16)
    counts = torch.full((EXPERTS,), rows // EXPERTS, device=device)
    counts[: rows % EXPERTS] += 1
    cu = F.pad(counts.cumsum(0).to(torch.int32), (1, 0))
    empty = torch.empty
    return {
        "row_forward": (a, w, empty(rows, 2 * INTERMEDIATE, device=device, dtype=a.dtype), {"cu_seqlens_m": cu}),
        "row_input_grad": (grad, w.transpose(1, 2), empty(rows, HIDDEN, device=device, dtype=a.dtype), {"cu_seqlens_m": cu}),
        "weight_grad": (a.t(), grad, empty(EXPERTS, HIDDEN, 2 * INTERMEDIATE, device=device, dtype=a.dtype), {"cu_seqlens_k": cu}),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="2048,4096,6000,12288,32768", help="comma list of routed-row counts")
    parser.add_argument("--anchor", type=int, default=8192, help="row count whose tuned configs the others reuse")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    tuner = quack.require().gemm_tuned
    anchor = {}
    for name, (a, b, out, varlen) in _gemms(args.anchor).items():
        start = time.perf_counter()
        anchor[name] = tuner(a, b, out, **varlen)[0]
        print(json.dumps({"anchor_rows": args.anchor, "gemm": name, "tune_s": round(time.perf_counter() - start, 3), "config": str(anchor[name])}), flush=True)
    probes = []
    for rows in (int(r) for r in args.rows.split(",")):
        for name, (a, b, out, varlen) in _gemms(rows).items():
            reuse = lambda: tuner.fn(a, b, out, config=anchor[name], **varlen)  # noqa: E731
            exact = lambda: tuner(a, b, out, **varlen)  # noqa: E731
            result = {"rows": rows, "gemm": name, "reuse_first_s": round(_timed(reuse), 4)}
            result["reuse_repeat_ms"] = round(min(_timed(reuse) for _ in range(5)) * 1e3, 4)
            result["exact_first_s"] = round(_timed(exact), 3)
            result["exact_repeat_ms"] = round(min(_timed(exact) for _ in range(5)) * 1e3, 4)
            result["exact_config"] = str(tuner(a, b, out, **varlen)[0])
            result["reuse_over_exact"] = round(result["reuse_repeat_ms"] / result["exact_repeat_ms"], 3)
            print(json.dumps(result), flush=True)
            probes.append(result)
    if args.out:
        results = {
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "anchor_rows": args.anchor,
            "anchor_configs": {k: str(v) for k, v in anchor.items()},
            "shapes": {"experts": EXPERTS, "hidden": HIDDEN, "intermediate": INTERMEDIATE}, "probes": probes,
        }  # fmt: skip
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
