"""Time the fused q/k RMSNorm + RoPE kernels (moetune/kernels/qk_norm_rope.py) per launch setting
against the unfused chain (rms_norm on q, rms_norm on k, apply_rope) at Qwen3-30B-A3B's attention
shapes: 4096 positions, 32 q heads and 4 k heads of 128, bf16, q and k views of the projection
outputs, weight gradients on. Forward + backward captured in a CUDA graph and timed by replaying it
(the training step is graphed; timing eager calls measures Python launch overhead instead).

    python benchmarks/probes/qk_norm_rope_probe.py
"""

from __future__ import annotations

import importlib
import itertools
import json

import torch
from graph_timing import capture  # benchmarks/probes/graph_timing.py (the script's own folder is on sys.path)
from triton.testing import do_bench

from moetune.kernels import apply_rope, rms_norm

fused = importlib.import_module("moetune.kernels.qk_norm_rope")


def main() -> None:
    torch.manual_seed(0)
    seq, hq, hk, d = 4096, 32, 4, 128
    proj_q = torch.randn(1, seq, hq * d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    proj_k = torch.randn(1, seq, hk * d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    wq = torch.rand(d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    wk = torch.rand(d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    angles = torch.rand(1, seq, d // 2, device="cuda") * 6
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(torch.bfloat16) for f in (torch.cos, torch.sin))
    dq, dk = torch.randn(1, seq, hq, d, device="cuda", dtype=torch.bfloat16), torch.randn(1, seq, hk, d, device="cuda", dtype=torch.bfloat16)
    inputs = (proj_q, proj_k, wq, wk)

    def unfused():
        q, k = proj_q.view(1, seq, hq, d), proj_k.view(1, seq, hk, d)
        return apply_rope(rms_norm(q, wq, 1e-6), rms_norm(k, wk, 1e-6), cos, sin, unsqueeze_dim=2)

    def fused_call():
        return fused.qk_norm_rope(proj_q.view(1, seq, hq, d), proj_k.view(1, seq, hk, d), wq, wk, cos, sin, 1e-6)

    def step(fn):
        return lambda: torch.autograd.grad(fn(), inputs, (dq, dk))

    ref = [g.float() for g in step(unfused)()]
    print(json.dumps({"impl": "unfused", "graphed_fwd_bwd_us": round(graphed_us(step(unfused)), 1)}), flush=True)
    for fwd_warps, per_sm, bwd_warps in itertools.product((4, 8), (2, 4, 8), (4, 8, 16)):
        fused._FWD_NUM_WARPS, fused._BWD_PROGRAMS_PER_SM, fused._BWD_NUM_WARPS = fwd_warps, per_sm, bwd_warps
        got = [g.float() for g in step(fused_call)()]
        err = max(((a - b).norm() / b.norm()).item() for a, b in zip(got, ref))
        print(json.dumps({"fwd_warps": fwd_warps, "per_sm": per_sm, "bwd_warps": bwd_warps,
                          "graphed_fwd_bwd_us": round(graphed_us(step(fused_call)), 1),
                          "max_rel_err_vs_unfused": f"{err:.1e}"}), flush=True)  # fmt: skip


def graphed_us(fn) -> float:
    """Median replay time of ``fn`` captured in a CUDA graph."""
    return do_bench(capture(fn, warmup=2).replay, rep=100) * 1e3


if __name__ == "__main__":
    main()
