"""GPT-OSS's attention with sinks: moetune's cuDNN and flash paths against SDPA without sinks.

GPT-OSS-20B's profile on an H200 (2026-12-01, commit 83e5786) had torch's
flash (FA2) backward at ~217 TFLOP/s on its full-attention layers (64 query heads, 8 key / value
heads of 64, 4096 positions): 1.58 ms a layer. This probe's first run (2026-12-01, 066b771)
put SDPA's cuDNN kernels at 1,284 us forward + backward against flash's 2,031, and cuDNN's
log-sum-exp equal to flash's, so ``moetune.layers.sink_attention`` now takes cuDNN for full
attention where it runs. This probe times, forward + backward replayed from a CUDA graph, in the
model's layouts:

- ``sink_attention`` as the model runs it (cuDNN where it runs), with the flash path forced, and
  with the sliding window of 128 (always the flash path);
- SDPA's flash and cuDNN backends on the same q, k, v (no sinks), causal, GQA;

and prints what ``aten._scaled_dot_product_cudnn_attention`` returns (the log-sum-exp's shape,
dtype and its agreement with the flash kernel's).

    python benchmarks/probes/sink_attention_probe.py [--seq-len 4096] [--out FILE.jsonl]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from graph_timing import capture  # benchmarks/probes/graph_timing.py (the script's own folder is on sys.path)
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import moetune.layers.sink_attention as sink_module
from moetune.layers.sink_attention import sink_attention

HEADS, KV_HEADS, DIM = 64, 8, 64


def graphed_us(fn) -> float:
    return do_bench(capture(fn, warmup=2).replay, rep=100) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--out", default="sink_attention_probe.jsonl")
    args = parser.parse_args()
    seq = args.seq_len
    torch.manual_seed(0)
    # the model's layouts: projections [B, S, heads, D] viewed as [B, heads, S, D]
    q = torch.randn(1, seq, HEADS, DIM, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    k = torch.randn(1, seq, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    v = torch.randn(1, seq, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    sinks = torch.zeros(HEADS, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad_out = torch.randn(1, seq, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    flops = 4 * seq * seq * HEADS * DIM / 2 * 3.5  # causal; the backward ~2.5x the forward
    rows = [{"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "gpu": torch.cuda.get_device_name(),
             "seq_len": seq, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": DIM,
             "cudnn_attention_applies": sink_module.cudnn_attention_applies(q)}]  # fmt: skip

    def sinks_step(window=None):
        out = sink_attention(q, k, v, sinks, scaling=DIM**-0.5, sliding_window=window)
        return torch.autograd.grad(out, (q, k, v, sinks), grad_out)

    def sdpa_step():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)
        return torch.autograd.grad(out, (q, k, v), grad_out)

    def emit(variant, fn, flop=flops):
        us = graphed_us(fn)
        rows.append({"variant": variant, "fwd_bwd_us": round(us, 1), "tflops": round(flop / us / 1e6, 1)})

    emit("sink_attention (default: cuDNN + sinks where it runs)", sinks_step)
    takes_cudnn = sink_module.cudnn_attention_applies
    sink_module.cudnn_attention_applies = lambda q: False
    emit("sink_attention (flash varlen + sinks)", sinks_step)
    sink_module.cudnn_attention_applies = takes_cudnn
    emit("sink_attention, sliding window 128 (flash varlen + sinks)", lambda: sinks_step(128),
         flop=4 * seq * 128 * HEADS * DIM * 3.5)  # fmt: skip
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel([backend]):
                us = graphed_us(sdpa_step)
            rows.append({"variant": f"sdpa {name} (no sinks)", "fwd_bwd_us": round(us, 1), "tflops": round(flops / us / 1e6, 1)})
        except RuntimeError as error:
            rows.append({"variant": f"sdpa {name} (no sinks)", "error": str(error).splitlines()[0][:200]})
    try:  # the cuDNN op's log-sum-exp, against the flash kernel's, on the same causal attention
        k_full, v_full = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
        cudnn = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k_full, v_full, None, True, 0.0, True, False,
                                                                   scale=DIM**-0.5)  # fmt: skip
        flash = torch.ops.aten._scaled_dot_product_flash_attention(q, k_full, v_full, 0.0, True, False, scale=DIM**-0.5)
        lse_cudnn, lse_flash = cudnn[1], flash[1]
        rows.append({"cudnn_outputs": len(cudnn), "cudnn_lse_shape": list(lse_cudnn.shape), "cudnn_lse_dtype": str(lse_cudnn.dtype),
                     "flash_lse_shape": list(lse_flash.shape),
                     "lse_max_abs_diff": (lse_cudnn.reshape(lse_flash.shape).float() - lse_flash.float()).abs().max().item(),
                     "out_max_abs_diff": (cudnn[0].float() - flash[0].float()).abs().max().item()})  # fmt: skip
    except (RuntimeError, TypeError) as error:
        rows.append({"cudnn_op": "error", "error": str(error).splitlines()[0][:300]})
    with open(args.out, "a") as out:
        for row in rows:
            print(json.dumps(row), flush=True)
            out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
