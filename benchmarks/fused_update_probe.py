"""Time the experts' weight gradients followed by their AdamW update (torch's CUTLASS grouped GEMM,
then moetune's AdamW kernel) against moetune's Triton weight-gradient GEMM that applies the update
in its epilogue (``grouped_weight_grad(..., adamw=)``), for several launch settings, on one
Qwen3-30B-A3B layer: 128 experts x 256 rows (one GPU, row A) and 64 experts x 512 rows (one rank
of ep=2, row B), balanced and skewed routing. Checks each fused update against the unfused one.

    python benchmarks/fused_update_probe.py [--quick]

One JSON line per (GEMM, shape, routing, implementation, settings): microseconds
(triton.testing.do_bench, L2 flushed) and the bytes per second of the optimizer's traffic.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from grouped_gemm_probe import emit, routing  # noqa: E402

from moetune.kernels.adamw_update import AdamWUpdate  # noqa: E402
from moetune.kernels.grouped_gemm import grouped_weight_grad  # noqa: E402
from moetune.kernels.permute import permute_rows  # noqa: E402
from moetune.optim.adamw import _triton_step  # noqa: E402

_grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm

FUSED_CONFIGS = [  # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages); the epilogue holds 4 fp32 tiles in registers
    (128, 128, 64, 8, 3), (64, 128, 64, 8, 3), (128, 64, 64, 8, 3), (64, 64, 64, 4, 3),
    (64, 128, 64, 4, 3), (128, 128, 64, 8, 4), (64, 128, 32, 8, 4), (128, 128, 32, 8, 3),
]  # fmt: skip
SHAPES = {"1gpu_128x256": (128, 4096), "ep2_64x512": (64, 4096)}  # experts, tokens (top-8 each)


def updates(weight: torch.Tensor, lr: torch.Tensor, step: torch.Tensor) -> AdamWUpdate:
    exp_avg = torch.randn_like(weight) * 1e-3
    return AdamWUpdate(exp_avg, exp_avg.square() + 1e-6, lr, 0.9, 0.999, 1e-8, 0.0, step)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="the first two fused settings")
    args = parser.parse_args()
    configs = FUSED_CONFIGS[:2] if args.quick else FUSED_CONFIGS
    device, dtype = torch.device("cuda"), torch.bfloat16
    hidden, width, top_k = 2048, 768, 8
    lr = torch.tensor(1e-6, device=device)
    step = torch.tensor(5.0, device=device)
    for shape_name, (experts, tokens) in SHAPES.items():
        torch.manual_seed(0)
        n = tokens * top_k
        x = torch.randn(tokens, hidden, device=device, dtype=dtype)
        act = torch.randn(n, width, device=device, dtype=dtype)
        dy = torch.randn(n, hidden, device=device, dtype=dtype) * 1e-3
        dh = torch.randn(n, 2 * width, device=device, dtype=dtype) * 1e-3
        gate_up = torch.randn(experts, 2 * width, hidden, device=device, dtype=dtype) * 0.02  # [E, out, in]
        down = torch.randn(experts, hidden, width, device=device, dtype=dtype) * 0.02
        for kind in ("balanced", "skewed"):
            order, ends = routing(kind, tokens, experts, top_k, device)
            valid = ends[-1:]
            # name -> (weight, p, q, gather order): the gradient of weight [E, out, in] is p_rows^T @ q_rows
            cases = {"dw_down": (down, dy, act, None), "dw_gate_up (gathered x)": (gate_up, dh, x, order)}
            for name, (weight, p, q, gather) in cases.items():
                q_rows = q if gather is None else permute_rows(q, gather, top_k, num_valid=valid)
                update = updates(weight, lr, step)

                def unfused(weight=weight, p=p, q_rows=q_rows, update=update):
                    grad = _grouped_mm(p.t(), q_rows, offs=ends)
                    _triton_step(weight, grad, update.exp_avg, update.exp_avg_sq, lr=lr, beta1=0.9,
                                 beta2=0.999, eps=1e-8, weight_decay=0.0, step=step)  # fmt: skip

                def fused(config, weight=weight, p=p, q=q, gather=gather, update=update):
                    grouped_weight_grad(p, q, ends, out=weight, q_gather_order=gather, top_k=top_k,
                                        adamw=update, config=config)  # fmt: skip

                grad = _grouped_mm(p.t(), q_rows, offs=ends)
                optimizer_bytes = 14 * weight.numel()
                timings = {
                    "torch_dw": do_bench(lambda p=p, q_rows=q_rows: _grouped_mm(p.t(), q_rows, offs=ends), rep=200),
                    "adamw": do_bench(lambda weight=weight, grad=grad, update=update: _triton_step(
                        weight, grad, update.exp_avg, update.exp_avg_sq, lr=lr, beta1=0.9, beta2=0.999, eps=1e-8,
                        weight_decay=0.0, step=step), rep=200),  # fmt: skip
                    "torch_dw+adamw": do_bench(unfused, rep=200),
                }
                for impl, ms in timings.items():
                    emit(shape=shape_name, gemm=name, routing=kind, impl=impl, us=round(ms * 1e3, 1),
                         optimizer_tb_s=round(optimizer_bytes / ms / 1e9, 2) if impl == "adamw" else None)  # fmt: skip
                best = None
                for config in configs:
                    try:
                        err = check_fused(weight, p, q, gather, ends, top_k, lr, step, config)
                        ms = do_bench(lambda config=config: fused(config), rep=200)
                    except Exception as error:  # a setting that does not compile / fit: record and go on
                        emit(shape=shape_name, gemm=name, routing=kind, impl="fused", config=config,
                             error=repr(error)[:300])  # fmt: skip
                        continue
                    emit(shape=shape_name, gemm=name, routing=kind, impl="fused", config=config,
                         us=round(ms * 1e3, 1), epilogue_tb_s=round(12 * weight.numel() / ms / 1e9, 2),
                         rel_err=f"{err:.1e}")  # fmt: skip
                    best = min(best or (ms, config), (ms, config))
                if best:
                    base = timings["torch_dw+adamw"]
                    emit(shape=shape_name, gemm=name, routing=kind, best_fused=best[1], best_us=round(best[0] * 1e3, 1),
                         unfused_us=round(base * 1e3, 1), saved_us=round((base - best[0]) * 1e3, 1),
                         speedup=round(base / best[0], 3))  # fmt: skip


def check_fused(weight, p, q, gather, ends, top_k, lr, step, config) -> float:
    """Relative error of the fused update's parameter change against CUTLASS's gradient + moetune's AdamW."""
    update = updates(weight, lr, step)
    expected_weight, expected = weight.clone(), AdamWUpdate(update.exp_avg.clone(), update.exp_avg_sq.clone(),
                                                           lr, 0.9, 0.999, 1e-8, 0.0, step)  # fmt: skip
    q_rows = q if gather is None else permute_rows(q, gather, top_k, num_valid=ends[-1:])
    grad = _grouped_mm(p.t(), q_rows, offs=ends)
    _triton_step(expected_weight, grad, expected.exp_avg, expected.exp_avg_sq, lr=lr, beta1=0.9, beta2=0.999,
                 eps=1e-8, weight_decay=0.0, step=step)  # fmt: skip
    got_weight = weight.clone()
    grouped_weight_grad(p, q, ends, out=got_weight, q_gather_order=gather, top_k=top_k, adamw=update, config=config)
    # Compare the moments (the update itself is lr-sized, below the weight's bf16 resolution).
    err = (update.exp_avg.float() - expected.exp_avg.float()).norm() / expected.exp_avg.float().norm()
    if not err < 2e-2:
        raise AssertionError(f"fused update: first moment relative error {err:.3e} against the unfused update")
    return float(err)


if __name__ == "__main__":
    main()
