"""Time the experts' six grouped GEMMs of one Qwen3-30B-A3B layer: torch's ``_grouped_mm``
(CUTLASS, plus moetune's gather kernel where the rows are permuted) against moetune's Triton
kernels (moetune/kernels/grouped_gemm.py, the gather fused into the loads) for several launch
settings, with balanced and skewed routing; checks every Triton result against torch's.

    python benchmarks/probes/grouped_gemm_probe.py [--quick]

One JSON line per (GEMM, routing, implementation, settings): microseconds (triton.testing.do_bench,
L2 flushed) and TFLOP/s over the real rows.
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

from moetune.kernels.grouped_gemm import grouped_rows_mm, grouped_weight_grad
from moetune.kernels.permute import permute_rows

_grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm

ROWS_CONFIGS = [
    (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (64, 128, 64, 4, 4),
    (128, 64, 64, 4, 4), (128, 256, 64, 8, 4), (64, 256, 64, 4, 3), (128, 128, 128, 8, 3),
]  # fmt: skip
WEIGHT_GRAD_CONFIGS = [
    (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (128, 128, 128, 8, 3),
    (128, 256, 32, 8, 4), (64, 256, 64, 4, 3), (256, 128, 64, 8, 3), (64, 128, 64, 4, 4),
]  # fmt: skip


def routing(kind: str, tokens: int, experts: int, top_k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(order [T*K] sorting the routed slots by expert, group ends [E] int32)."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    if kind == "balanced":
        chosen = (torch.arange(tokens * top_k) % experts).view(tokens, top_k)
    else:  # skewed like a random-init router: per-expert bias plus per-token noise
        logits = torch.randn(tokens, experts, generator=generator) + 0.7 * torch.randn(experts, generator=generator)
        chosen = logits.topk(top_k, dim=-1).indices
    chosen = chosen.reshape(-1).to(device)
    order = torch.argsort(chosen, stable=True).to(torch.int32)
    ends = torch.cumsum(torch.bincount(chosen, minlength=experts), 0).to(torch.int32)
    return order, ends


def emit(**record) -> None:
    print(json.dumps(record), flush=True)


def check(name: str, got: torch.Tensor, ref: torch.Tensor) -> float:
    err = ((got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()
    if not err < 1e-2:
        raise AssertionError(f"{name}: relative error {err:.3e} against torch")
    return err


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="the first two settings of each kernel")
    args = parser.parse_args()
    rows_configs = ROWS_CONFIGS[:2] if args.quick else ROWS_CONFIGS
    wgrad_configs = WEIGHT_GRAD_CONFIGS[:2] if args.quick else WEIGHT_GRAD_CONFIGS
    device, dtype = torch.device("cuda"), torch.bfloat16
    tokens, top_k, experts, hidden, width = 4096, 8, 128, 2048, 768
    torch.manual_seed(0)
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    gate_up = torch.randn(experts, 2 * width, hidden, device=device, dtype=dtype) * 0.02  # [E, out, in]
    down = torch.randn(experts, hidden, width, device=device, dtype=dtype) * 0.02
    n = tokens * top_k
    act = torch.randn(n, width, device=device, dtype=dtype)
    dy = torch.randn(n, hidden, device=device, dtype=dtype)
    dh = torch.randn(n, 2 * width, device=device, dtype=dtype)
    for kind in ("balanced", "skewed"):
        order, ends = routing(kind, tokens, experts, top_k, device)
        counts = torch.diff(ends, prepend=ends.new_zeros(1))
        emit(routing=kind, max_rows=int(counts.max()), min_rows=int(counts.min()))
        valid = ends[-1:]
        # name -> (flops, torch callable, triton callable taking a config)
        gemms = {
            "fwd_gate_up (gather + x @ W)": (
                2 * n * hidden * 2 * width,
                lambda: _grouped_mm(permute_rows(x, order, top_k, num_valid=valid), gate_up.transpose(-2, -1), offs=ends),
                lambda c: grouped_rows_mm(x, gate_up.transpose(-2, -1), ends, gather_order=order, top_k=top_k, config=c),
            ),
            "fwd_down (act @ W)": (
                2 * n * width * hidden,
                lambda: _grouped_mm(act, down.transpose(-2, -1), offs=ends),
                lambda c: grouped_rows_mm(act, down.transpose(-2, -1), ends, config=c),
            ),
            "dx_down (dy @ W)": (
                2 * n * hidden * width,
                lambda: _grouped_mm(dy, down, offs=ends),
                lambda c: grouped_rows_mm(dy, down, ends, config=c),
            ),
            "dx_gate_up (dh @ W)": (
                2 * n * 2 * width * hidden,
                lambda: _grouped_mm(dh, gate_up, offs=ends),
                lambda c: grouped_rows_mm(dh, gate_up, ends, config=c),
            ),
        }
        wgrads = {
            "dw_down (dy^T @ act)": (
                2 * n * hidden * width,
                lambda: _grouped_mm(dy.t(), act, offs=ends),
                lambda c: grouped_weight_grad(dy, act, ends, config=c),
            ),
            "dw_gate_up (dh^T @ gather(x))": (
                2 * n * 2 * width * hidden,
                lambda: _grouped_mm(dh.t(), permute_rows(x, order, top_k, num_valid=valid), offs=ends),
                lambda c: grouped_weight_grad(dh, x, ends, q_gather_order=order, top_k=top_k, config=c),
            ),
        }
        for table, configs in ((gemms, rows_configs), (wgrads, wgrad_configs)):
            for name, (flops, torch_fn, triton_fn) in table.items():
                ref = torch_fn()
                us = do_bench(torch_fn, rep=200) * 1e3
                emit(gemm=name, routing=kind, impl="torch", us=round(us, 1), tflops=round(flops / us / 1e6, 1))
                best = None
                for config in configs:
                    try:
                        got = triton_fn(config)
                        rows = int(ends[-1])
                        err = check(name, got[:rows] if got.dim() == 2 else got, ref[:rows] if ref.dim() == 2 else ref)
                        us_t = do_bench(lambda: triton_fn(config), rep=200) * 1e3
                    except Exception as error:  # a setting that does not compile / fit: record and go on
                        emit(gemm=name, routing=kind, impl="triton", config=config, error=repr(error)[:300])
                        continue
                    emit(gemm=name, routing=kind, impl="triton", config=config, us=round(us_t, 1),
                         tflops=round(flops / us_t / 1e6, 1), rel_err=f"{err:.1e}")  # fmt: skip
                    best = min(best or (us_t, config), (us_t, config))
                if best:
                    emit(gemm=name, routing=kind, best_triton=best[1], best_us=round(best[0], 1),
                         torch_us=round(us, 1), speedup=round(us / best[0], 3))  # fmt: skip


if __name__ == "__main__":
    main()
