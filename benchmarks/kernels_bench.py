"""Fused kernels vs their PyTorch references on Qwen3-30B-A3B shapes (one H200, bf16).

``run_kernel_bench()`` checks each Triton kernel against its reference first, then times both
with ``triton.testing.do_bench`` (median), forward alone and forward + backward, and returns one
dict per (kernel, mode). Run directly to print a table and write a JSON file:

    python benchmarks/kernels_bench.py [--out benchmarks/results/kernels_h200_YYYYMMDD.json]

Shape legend: T tokens (seq 4096 x micro-batch 1), H hidden 2048, K top-8, E 128 experts,
I expert width 768, 32 q / 4 kv heads of 128.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moetune.kernels import (
    apply_rope,
    moe_combine,
    moe_permute,
    rms_norm,
    swiglu,
)

T, H, K, E, I_MOE = 4096, 2048, 8, 128, 768
Q_HEADS, KV_HEADS, HEAD_DIM = 32, 4, 128


@dataclass
class Case:
    name: str
    shape: str
    inputs: Callable[[], tuple]  # fresh inputs (leaf tensors that need grad)
    run: Callable[..., tuple | torch.Tensor]  # run(*inputs, impl=...) -> output(s)
    fwd_bytes: int  # bytes a perfect forward reads + writes


def _routing(device):
    experts_TK = torch.rand(T, E, device=device).argsort(dim=-1)[:, :K]
    order_N = torch.argsort(experts_TK.reshape(-1), stable=True)
    weights_TK = torch.rand(T, K, device=device).softmax(dim=-1)
    return order_N, weights_TK


def _cases(device: str, dtype: torch.dtype) -> list[Case]:
    size = torch.finfo(dtype).bits // 8
    order_N, weights_TK = _routing(device)
    positions = torch.arange(T, device=device, dtype=torch.float32)[:, None]
    inv_freq = 1.0 / 1e6 ** (torch.arange(0, HEAD_DIM, 2, device=device, dtype=torch.float32) / HEAD_DIM)
    emb = torch.cat((positions * inv_freq, positions * inv_freq), dim=-1)[None]
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)

    def leaf(*shape, scale=1.0):
        return (torch.randn(*shape, device=device, dtype=dtype) * scale).requires_grad_()

    def qk():  # Qwen3: [B, S, heads, D] projections viewed as [B, heads, S, D]
        q = torch.randn(1, T, Q_HEADS, HEAD_DIM, device=device, dtype=dtype).transpose(1, 2).requires_grad_()
        k = torch.randn(1, T, KV_HEADS, HEAD_DIM, device=device, dtype=dtype).transpose(1, 2).requires_grad_()
        return q, k

    return [
        Case("rms_norm", f"x[{T},{H}]", lambda: (leaf(T, H), torch.ones(H, device=device, dtype=dtype, requires_grad=True)),
             lambda x, w, impl: rms_norm(x, w, 1e-6, impl=impl), 2 * T * H * size),
        Case("rms_norm (q_norm)", f"q[1,{T},{Q_HEADS},{HEAD_DIM}]",
             lambda: (leaf(1, T, Q_HEADS, HEAD_DIM), torch.ones(HEAD_DIM, device=device, dtype=dtype, requires_grad=True)),
             lambda x, w, impl: rms_norm(x, w, 1e-6, impl=impl), 2 * T * Q_HEADS * HEAD_DIM * size),
        Case("swiglu", f"gate_up[{T * K},{2 * I_MOE}]", lambda: (leaf(T * K, 2 * I_MOE),),
             lambda x, impl: swiglu(x, impl=impl), 3 * T * K * I_MOE * size),
        Case("apply_rope", f"q[1,{Q_HEADS},{T},{HEAD_DIM}] k[1,{KV_HEADS},{T},{HEAD_DIM}]", qk,
             lambda q, k, impl: apply_rope(q, k, cos, sin, impl=impl), 2 * T * (Q_HEADS + KV_HEADS) * HEAD_DIM * size),
        Case("moe_permute", f"x[{T},{H}] -> [{T * K},{H}]", lambda: (leaf(T, H),),
             lambda x, impl: moe_permute(x, order_N, K, impl=impl), (T + T * K) * H * size),
        Case("moe_combine", f"y[{T * K},{H}] -> [{T},{H}]",
             lambda: (leaf(T * K, H), weights_TK.clone().requires_grad_()),
             lambda y, w, impl: moe_combine(y, w, order_N, impl=impl), (T * K + T) * H * size),
    ]  # fmt: skip


def _outputs(out) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


def _max_rel_error(case: Case) -> float:
    """Largest |triton - reference| / max|reference| over the outputs and the input grads."""
    inputs = case.inputs()
    upstream = [torch.randn_like(o) for o in _outputs(case.run(*inputs, impl="torch"))]
    results = {}
    for impl in ("triton", "torch"):
        outs = _outputs(case.run(*inputs, impl=impl))
        results[impl] = (*outs, *torch.autograd.grad(outs, inputs, upstream))
    return max(
        ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()
        for a, b in zip(results["triton"], results["torch"])
    )


def _time(case: Case, impl: str, backward: bool) -> float:
    from triton.testing import do_bench

    inputs = case.inputs()
    grads_out = [torch.ones_like(o) for o in _outputs(case.run(*inputs, impl=impl))]

    def fwd():
        return case.run(*inputs, impl=impl)

    def fwd_bwd():
        torch.autograd.grad(_outputs(case.run(*inputs, impl=impl)), inputs, grads_out)

    with torch.set_grad_enabled(backward):
        return do_bench(fwd_bwd if backward else fwd, warmup=25, rep=100, return_mode="median")


def run_kernel_bench(*, device: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """Time every Triton kernel against its torch reference; one row per (kernel, fwd / fwd+bwd)."""
    if not torch.cuda.is_available():
        raise RuntimeError("run_kernel_bench needs a CUDA GPU")
    import triton

    torch.manual_seed(0)
    rows = []
    for case in _cases(device, dtype):
        error = _max_rel_error(case)
        for mode, backward in (("fwd", False), ("fwd+bwd", True)):
            triton_ms = _time(case, "triton", backward)
            torch_ms = _time(case, "torch", backward)
            row = {
                "kernel": case.name,
                "shape": case.shape,
                "dtype": str(dtype).removeprefix("torch."),
                "mode": mode,
                "triton_ms": round(triton_ms, 4),
                "torch_ms": round(torch_ms, 4),
                "speedup": round(torch_ms / triton_ms, 2),
                "max_rel_err_vs_torch": error,  # relative to the tensor's largest value
                "correct": error < 2e-2,  # a few bf16 roundings
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "triton": triton.__version__,
            }
            if not backward:  # achieved bandwidth of the forward kernel(s)
                row["triton_fwd_GBps"] = round(case.fwd_bytes / triton_ms / 1e6, 1)
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSON file for the rows (default: print only)")
    args = parser.parse_args()
    rows = run_kernel_bench()
    header = f"{'kernel':<20}{'mode':<9}{'triton ms':>10}{'torch ms':>10}{'speedup':>9}{'GB/s':>8}  max rel err"
    print(header)
    for r in rows:
        print(f"{r['kernel']:<20}{r['mode']:<9}{r['triton_ms']:>10.4f}{r['torch_ms']:>10.4f}{r['speedup']:>9.2f}"
              f"{r.get('triton_fwd_GBps', ''):>8}  {r['max_rel_err_vs_torch']:.3g}")  # fmt: skip
    if args.out:
        meta = {"date": time.strftime("%Y-%m-%d"), "host": platform.node(), "shapes": dict(T=T, H=H, K=K, E=E, I=I_MOE)}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
