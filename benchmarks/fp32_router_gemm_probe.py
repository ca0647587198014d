"""The DeepSeek-V3 / Nemotron-H router's fp32 GEMM: plain fp32 (SIMT) against moetune's split-bf16
tensor-core path (``moetune.kernels.fp32_linear``), forward and forward + backward, at the routers of
Moonlight-16B-A3B, Nemotron 3 Nano, DeepSeek-V3 and Kimi-K2 (4096 tokens), with the error of each
against float64. One JSON line per shape and path.

    PYTHONPATH=$PWD python benchmarks/fp32_router_gemm_probe.py
"""

from __future__ import annotations

import json

import torch
from triton.testing import do_bench

from moetune.kernels.fp32_linear import fp32_linear

SHAPES = {  # experts, hidden
    "moonlight_16b_a3b": (64, 2048),
    "nemotron_3_nano_30b_a3b": (128, 2688),
    "deepseek_v3": (256, 7168),
    "kimi_k2": (384, 7168),
}


def main(tokens: int = 4096) -> None:
    torch.manual_seed(0)
    for name, (experts, hidden) in SHAPES.items():
        x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16).requires_grad_()
        w = (torch.randn(experts, hidden, device="cuda") * hidden**-0.5).requires_grad_()
        grad = torch.randn(tokens, experts, device="cuda")
        exact = x.detach().double() @ w.detach().double().t()
        for impl in ("torch", "split"):
            def fwd_bwd():
                x.grad = w.grad = None
                fp32_linear(x, w, impl=impl).backward(grad)

            with torch.no_grad():
                out = fp32_linear(x, w, impl=impl)
            print(json.dumps({
                "model": name, "tokens": tokens, "experts": experts, "hidden": hidden, "impl": impl,
                "fwd_us": round(do_bench(lambda: fp32_linear(x.detach(), w.detach(), impl=impl), rep=200) * 1e3, 1),
                "fwd_bwd_us": round(do_bench(fwd_bwd, rep=200) * 1e3, 1),
                "max_abs_error_vs_fp64": (out.double() - exact).abs().max().item(),
                "tf32": torch.backends.cuda.matmul.allow_tf32,
            }), flush=True)


if __name__ == "__main__":
    main()
