"""GPT-OSS's full-attention layers: is cuDNN's attention worth taking over from the flash kernel?

GPT-OSS-20B's profile (benchmarks/results/session15/profile_gptoss_6l_83e5786.txt) has torch's
flash (FA2) backward at ~217 TFLOP/s on its full-attention layers (64 query heads, 8 key / value
heads of 64, 4096 positions): 1.58 ms a layer. moetune's sink attention
(``moetune.layers.sink_attention``) needs the kernel's log-sum-exp; cuDNN's SDPA op returns one
too. This probe times, forward + backward replayed from a CUDA graph:

- ``sink_attention`` as the model runs it (flash, variable-length entry, the sinks applied);
- SDPA's flash and cuDNN backends on the same q, k, v (no sinks), causal, GQA;

and prints what ``aten._scaled_dot_product_cudnn_attention`` returns (the log-sum-exp's shape,
dtype and its agreement with the flash kernel's), so that a cuDNN path for the sinks can be built
on facts.

    python benchmarks/sink_attention_probe.py [--seq-len 4096] [--out FILE.jsonl]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from graph_timing import capture  # benchmarks/graph_timing.py (the script's own folder is on sys.path)
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

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
    q = torch.randn(1, HEADS, seq, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, KV_HEADS, seq, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, KV_HEADS, seq, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    sinks = torch.zeros(HEADS, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad_out = torch.randn(1, seq, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    flops = 4 * seq * seq * HEADS * DIM / 2 * 3.5  # causal; the backward ~2.5x the forward
    rows = [{"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "gpu": torch.cuda.get_device_name(),
             "seq_len": seq, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": DIM}]  # fmt: skip

    def sinks_step():
        out = sink_attention(q, k, v, sinks, scaling=DIM**-0.5)
        return torch.autograd.grad(out, (q, k, v, sinks), grad_out)

    def sdpa_step():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)
        return torch.autograd.grad(out, (q, k, v), grad_out)

    us = graphed_us(sinks_step)
    rows.append({"variant": "sink_attention (flash varlen + sinks)", "fwd_bwd_us": round(us, 1),
                 "tflops": round(flops / us / 1e6, 1)})  # fmt: skip
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
