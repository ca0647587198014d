"""Time DeepSeek-V3's latent attention at Moonlight-16B-A3B's shapes (4096 positions, 16 heads,
query / key heads of 192, value heads of 128, bf16), forward + backward captured in a CUDA graph.

1. The attention kernel alone, per SDPA backend: the values zero-padded to 192 (what moetune runs
   where torch's flash kernels apply) or left at 128 (cuDNN takes unequal widths on Hopper with
   cuDNN >= 9.10; the efficient kernel takes them anywhere), on q / k / v as the strided views of
   the projections that the model passes.
2. The whole attention module (projections, norms, RoPE, concatenations, attention, output
   projection): Transformers' against moetune's, and moetune's with the values padded as for the
   flash kernels (--profile: the kernels of each).

    python benchmarks/probes/mla_attention_probe.py [--out results.jsonl] [--modules-only] [--profile]
"""

from __future__ import annotations

import argparse
import contextlib
import json

import torch
import torch.nn.functional as F
from graph_timing import capture  # benchmarks/probes/graph_timing.py (the script's own folder is on sys.path)
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

SEQ, HEADS, QK, V = 4096, 16, 192, 128


def graphed_us(fn) -> float:
    return do_bench(capture(fn, warmup=2).replay, rep=100) * 1e3


def kernel_variants(out) -> None:
    torch.manual_seed(0)
    q = torch.randn(1, SEQ, HEADS, QK, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, SEQ, HEADS, QK, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, SEQ, HEADS, V, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad_out = torch.randn(1, HEADS, SEQ, V, device="cuda", dtype=torch.bfloat16)

    def attention(padded: bool):
        value = v.transpose(1, 2)
        if padded:
            value = F.pad(value, (0, QK - V))
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), value, is_causal=True)
        return o[..., :V]

    def step(padded: bool):
        return lambda: torch.autograd.grad(attention(padded), (q, k, v), grad_out)

    with sdpa_kernel([SDPBackend.MATH]):  # fp32-accumulating reference on the same inputs
        reference = [g.float() for g in step(False)()]
    flops = 4 * SEQ * SEQ * HEADS * (QK + V) / 2 * 3.5  # causal; backward ~2.5x the forward
    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION, "auto": None}  # fmt: skip
    for name, backend in backends.items():
        for padded in (True, False):
            row = {"part": "kernel", "backend": name, "values": QK if padded else V}
            context = sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext()
            try:
                with context:
                    got = [g.float() for g in step(padded)()]
                    us = graphed_us(step(padded))
                row["fwd_bwd_us"] = round(us, 1)
                row["tflops_unpadded_flops"] = round(flops / us / 1e6, 1)
                row["max_rel_err_vs_math"] = f"{max(((a - b).norm() / b.norm()).item() for a, b in zip(got, reference)):.1e}"
            except RuntimeError as error:
                row["error"] = str(error).splitlines()[0][:200]
            print(json.dumps(row), flush=True)
            out.write(json.dumps(row) + "\n")


def module_variants(out, *, profile: bool) -> None:
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    from moetune.bench.models import load_config
    from moetune.models.deepseek_v3 import model as ours

    _, config = load_config("moonlight_16b_a3b", layers=1)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        reference = hf.DeepseekV3Attention(config, layer_idx=0).to(torch.bfloat16)
        moetune_attention = ours.DeepseekV3Attention(config, layer_idx=0).to(torch.bfloat16)
        rotary = hf.DeepseekV3RotaryEmbedding(config)
    moetune_attention.load_state_dict(reference.state_dict())
    x = torch.randn(1, SEQ, config.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    position_embeddings = rotary(x, torch.arange(SEQ, device="cuda")[None])
    grad_out = torch.randn_like(x)
    causal_mask = None  # Transformers' SDPA path: is_causal when no mask is given

    def step(module):
        params = [x, *module.parameters()]
        return lambda: torch.autograd.grad(module(x, position_embeddings, causal_mask)[0], params, grad_out)

    base = [g.float() for g in step(reference)()]
    # moetune_padded: the values padded to 192 as for the flash kernels (what it ran before)
    for name, module in (("transformers", reference), ("moetune", moetune_attention), ("moetune_padded", moetune_attention)):
        row = {"part": "module", "variant": name}
        original = ours.cudnn_attention_applies
        if name == "moetune_padded":
            ours.cudnn_attention_applies = lambda q: False
        try:
            got = [g.float() for g in step(module)()]
            row["fwd_bwd_us"] = round(graphed_us(step(module)), 1)
            row["max_rel_err_vs_transformers"] = f"{max(((a - b).norm() / b.norm()).item() for a, b in zip(got, base)):.1e}"
            if profile and name != "moetune_padded":
                print(f"==== {name}: kernels of one forward + backward ====", flush=True)
                print(kernel_table(step(module)), flush=True)
        except RuntimeError as error:
            row["error"] = str(error).splitlines()[0][:200]
        finally:
            ours.cudnn_attention_applies = original
        print(json.dumps(row), flush=True)
        out.write(json.dumps(row) + "\n")


def kernel_table(fn) -> str:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=100)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="mla_attention_probe.jsonl")
    parser.add_argument("--profile", action="store_true", help="print the kernels of each module's step")
    parser.add_argument("--modules-only", action="store_true")
    args = parser.parse_args()
    print(json.dumps({"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
                      "gpu": torch.cuda.get_device_name()}), flush=True)  # fmt: skip
    with open(args.out, "a") as out:
        if not args.modules_only:
            kernel_variants(out)
        module_variants(out, profile=args.profile)


if __name__ == "__main__":
    main()
