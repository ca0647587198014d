"""Time the experts' weight update inside the backward, per weight of one Qwen3-30B-A3B layer:
torch's weight-gradient grouped GEMM (CUTLASS) followed by moetune's AdamW kernel (today's
overlapped update) against moetune's fused GEMM + AdamW kernel
(moetune/kernels/grouped_weight_update.py) for several launch settings; with the gate/up weight's
input rows permuted beforehand or gathered inside the kernel. Shapes: one GPU's 128 experts (row A)
and one rank's 64 experts at ep=2 (row B), each over 32,768 routed rows, skewed and balanced.

    python benchmarks/grouped_update_probe.py [--quick]

One JSON line per (shape, routing, weight, implementation, settings): microseconds
(triton.testing.do_bench, L2 flushed) and the bytes-per-element-equivalent bandwidth; the fused
result is checked against the unfused step once (bf16 rounding apart).
"""

from __future__ import annotations

import argparse
import json

import torch
from grouped_gemm_probe import routing
from triton.testing import do_bench

from moetune.kernels.grouped_weight_update import grouped_weight_adamw_
from moetune.kernels.permute import permute_rows
from moetune.optim.adamw import _triton_step

_grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm

CONFIGS = [
    (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 64, 64, 4, 3), (64, 128, 64, 4, 3),
    (128, 256, 64, 8, 3), (128, 128, 32, 8, 4), (256, 128, 64, 8, 3), (64, 64, 64, 4, 4),
]  # fmt: skip
HYPER = dict(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def emit(**record) -> None:
    print(json.dumps(record), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="the first three settings")
    args = parser.parse_args()
    configs = CONFIGS[:3] if args.quick else CONFIGS
    device, dtype = torch.device("cuda"), torch.bfloat16
    hidden, width, top_k, rows = 2048, 768, 8, 32768
    lr, step = torch.tensor(1e-5, device=device), torch.tensor(3.0, device=device)
    for shape, experts, tokens in (("rowA_128experts", 128, rows // top_k), ("rowB_64experts_ep2", 64, rows // top_k)):
        torch.manual_seed(0)
        x = torch.randn(tokens, hidden, device=device, dtype=dtype)
        dh = torch.randn(rows, 2 * width, device=device, dtype=dtype)
        act = torch.randn(rows, width, device=device, dtype=dtype)
        dy = torch.randn(rows, hidden, device=device, dtype=dtype)
        for kind in ("skewed", "balanced"):
            order, ends = routing(kind, tokens, experts, top_k, device)
            counts = torch.diff(ends, prepend=ends.new_zeros(1))
            emit(shape=shape, routing=kind, experts=experts, rows=rows, max_rows=int(counts.max()), min_rows=int(counts.min()))
            x_rows = permute_rows(x, order, top_k, num_valid=ends[-1:])
            # (weight, p, q, gather order of q or None): gradient of the [E, M, C] weight = p^T q per expert
            weights = (
                ("gate_up [E, 2I, H]", dh, x_rows, None),
                ("gate_up, rows gathered in-kernel", dh, x, order),
                ("down [E, H, I]", dy, act, None),
            )
            for name, p, q, gather in weights:
                m, c = p.shape[1], q.shape[1]
                param = torch.randn(experts, m, c, device=device, dtype=dtype) * 0.02
                exp_avg, exp_avg_sq = torch.zeros_like(param), torch.zeros_like(param) + 1e-4
                elements = param.numel()
                flops = 2 * rows * m * c

                def unfused():
                    q_rows = q if gather is None else permute_rows(q, gather, top_k, num_valid=ends[-1:])
                    grad = _grouped_mm(p.t(), q_rows, offs=ends)
                    _triton_step(param, grad, exp_avg, exp_avg_sq, lr=lr, step=step, **HYPER)

                gather_kwargs = dict(q_gather_order=gather, top_k=top_k) if gather is not None else {}
                us = do_bench(unfused) * 1e3
                emit(shape=shape, routing=kind, weight=name, impl="torch wgrad + adamw kernel", us=round(us, 1),
                     tflops=round(flops / us / 1e6, 1), elements=elements)  # fmt: skip
                # correctness once: fused vs unfused from the same state
                start = [t.clone() for t in (param, exp_avg, exp_avg_sq)]
                unfused()
                want = [t.clone() for t in (param, exp_avg, exp_avg_sq)]
                for t, s in zip((param, exp_avg, exp_avg_sq), start):
                    t.copy_(s)
                grouped_weight_adamw_(param, exp_avg, exp_avg_sq, p, q, ends, lr=lr, step=step, **HYPER, **gather_kwargs)
                err = max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip((param, exp_avg, exp_avg_sq), want))
                best = None
                for config in configs:
                    try:
                        us = do_bench(lambda: grouped_weight_adamw_(param, exp_avg, exp_avg_sq, p, q, ends, lr=lr, step=step,
                                                                    config=config, **HYPER, **gather_kwargs)) * 1e3  # fmt: skip
                    except Exception as error:  # noqa: BLE001 (a setting that does not fit: report it, go on)
                        emit(shape=shape, routing=kind, weight=name, impl="fused", config=config, error=str(error)[:200])
                        continue
                    emit(shape=shape, routing=kind, weight=name, impl="fused", config=config, us=round(us, 1),
                         tflops=round(flops / us / 1e6, 1), state_tb_s=round(12 * elements / us / 1e6, 2),
                         rel_err_vs_unfused=f"{err:.1e}")  # fmt: skip
                    best = us if best is None else min(best, us)
                emit(shape=shape, routing=kind, weight=name, best_fused_us=round(best, 1) if best else None)


if __name__ == "__main__":
    main()
