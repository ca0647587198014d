"""Packed rows' causal attention within documents: torch's varlen flash kernel against cuDNN's
ragged (THD) kernels.

The recipe packs 200-3,000-token samples into 4,096-token rows; each token attends to the earlier
tokens of its own document. ``moetune.layers.document_attention`` runs torch's variable-length
flash (FA2) kernel for that. The recipe's profile on an H200 (2026-12-01, 1b1f43d) put it at 8.3 ms a step
(Qwen3 shapes, 8 layers) where the bench's unpacked rows take cuDNN's kernels at ~460 TFLOP/s for
about twice the FLOPs. This probe asks whether cuDNN's ragged kernels
(``aten._cudnn_attention_forward`` / ``_cudnn_attention_backward`` with cumulative sequence
offsets, the op behind nested-tensor SDPA) take packed rows, and how fast, per architecture's
attention shape:

- correctness: both kernels' output and q / k / v gradients against an fp32 reference computed
  one document at a time, with the offsets padded by trailing empty documents (as a CUDA-graph
  step pads them) and without;
- speed: forward + backward, captured in a CUDA graph and replayed, plus cuDNN's and flash's dense
  causal kernels on the same unpacked rows (no document boundaries: twice the FLOPs or more).

    python benchmarks/probes/ragged_attention_probe.py [--rows 1] [--seq-len 4096] [--out FILE.jsonl]
"""

from __future__ import annotations

import argparse
import json
import random
import traceback

import torch
import torch.nn.functional as F
from graph_timing import capture  # benchmarks/probes/graph_timing.py (the script's own folder is on sys.path)
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from moetune.layers.document_attention import _varlen_kernel

# (name, query heads, key/value heads, query/key head dim, value head dim)
SHAPES = [
    ("qwen3-30b-a3b", 32, 4, 128, 128),
    ("gpt-oss-20b", 64, 8, 64, 64),
    ("moonlight-16b-a3b", 16, 16, 192, 128),
    ("moonlight-16b-a3b-vpad", 16, 16, 192, 192),
]


def document_lengths(rows: int, seq_len: int, rng: random.Random) -> list[int]:
    """Each row filled with 200-3,000-token documents, the last one cut to fit (the recipe's data)."""
    lengths = []
    for _ in range(rows):
        left = seq_len
        while left:
            n = min(left, rng.randint(200, 3000))
            lengths.append(n)
            left -= n
    return lengths


def offsets_of(lengths: list[int], pad_to: int | None, device) -> torch.Tensor:
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    if pad_to is not None:
        offsets += [offsets[-1]] * (pad_to - len(offsets))
    return torch.tensor(offsets, dtype=torch.int32, device=device)


class CudnnRagged(torch.autograd.Function):
    """cuDNN's ragged kernels on [T, H, D] packed tokens."""

    @staticmethod
    def forward(ctx, q, k, v, offsets, max_length: int, scale: float):
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._cudnn_attention_forward(
            q, k, v, None, offsets, offsets, max_length, max_length, True, 0.0, True, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, cum_q, cum_k, seed, offset)
        ctx.scale, ctx.max_q, ctx.max_k = scale, max_q, max_k
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, cum_q, cum_k, seed, offset = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._cudnn_attention_backward(
            grad_out.contiguous(), q, k, v, out, lse, seed, offset, None,
            cum_q, cum_k, ctx.max_q, ctx.max_k, 0.0, True, scale=ctx.scale)
        return dq, dk, dv, None, None, None


def cudnn_ragged(q, k, v, offsets, max_length, scale):
    return CudnnRagged.apply(q, k, v, offsets, max_length, scale)


def flash_varlen(q, k, v, offsets, max_length, scale):
    return _varlen_kernel()(q, k, v, offsets, max_length, scale)


def reference(q, k, v, lengths, scale):
    """fp32, one document at a time."""
    outs, start = [], 0
    groups = q.shape[1] // k.shape[1]
    for n in lengths:
        sl = slice(start, start + n)
        qd = q[sl].float().transpose(0, 1)
        kd = k[sl].float().repeat_interleave(groups, dim=1).transpose(0, 1)
        vd = v[sl].float().repeat_interleave(groups, dim=1).transpose(0, 1)
        with sdpa_kernel(SDPBackend.MATH):
            outs.append(F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale).transpose(0, 1))
        start += n
    return torch.cat(outs)


def rel(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def inputs(total, heads, kv_heads, dqk, dv, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda h, d: torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()  # noqa: E731
    q, k, v = mk(heads, dqk), mk(kv_heads, dqk), mk(kv_heads, dv)
    grad = torch.randn(total, heads, dv, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, k, v, grad


def check(fn, q, k, v, grad, offsets, max_length, lengths, scale) -> dict:
    out = fn(q, k, v, offsets, max_length, scale)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = reference(qf, kf, vf, lengths, scale)
    rq, rk, rv = torch.autograd.grad(ref, (qf, kf, vf), grad.float())
    return {"out": rel(out, ref), "dq": rel(dq, rq), "dk": rel(dk, rk), "dv": rel(dv, rv)}


def graphed_us(step) -> float:
    return do_bench(capture(step, warmup=2).replay, rep=100) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--out", default="ragged_attention_probe.jsonl")
    args = parser.parse_args()
    rows_out = [{"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "gpu": torch.cuda.get_device_name(),
                 "rows": args.rows, "seq_len": args.seq_len}]
    lengths = document_lengths(args.rows, args.seq_len, random.Random(0))
    total = args.rows * args.seq_len
    causal_flops_docs = sum(n * n / 2 for n in lengths)
    for name, heads, kv_heads, dqk, dv in SHAPES:
        q, k, v, grad = inputs(total, heads, kv_heads, dqk, dv)
        scale = dqk**-0.5
        row = {"shape": name, "heads": heads, "kv_heads": kv_heads, "dqk": dqk, "dv": dv, "documents": len(lengths)}
        flops = 2 * causal_flops_docs * heads * (dqk + dv) * 3.5  # forward 2 GEMMs, backward ~2.5x
        dense_flops = 2 * args.rows * args.seq_len**2 / 2 * heads * (dqk + dv) * 3.5
        max_length = max(lengths)
        variants = {"cudnn_ragged": cudnn_ragged}
        if dqk == dv:
            variants["flash_varlen"] = flash_varlen
        try:  # what the forward op returns for packed rows (shapes), apart from any backward error
            outs = torch.ops.aten._cudnn_attention_forward(q.detach(), k.detach(), v.detach(), None,
                                                           offsets_of(lengths, None, "cuda"), offsets_of(lengths, None, "cuda"),
                                                           max_length, max_length, True, 0.0, True, False, scale=scale)
            row["cudnn_forward_returns"] = [list(t.shape) if isinstance(t, torch.Tensor) else t for t in outs]
        except Exception as error:  # noqa: BLE001
            row["cudnn_forward_error"] = f"{type(error).__name__}: {str(error)[:300]}"
        for label, fn in variants.items():
            for pad in (None, len(lengths) + 1 + 16):
                key = f"{label}{'_padded' if pad else ''}"
                offsets = offsets_of(lengths, pad, "cuda")
                try:
                    row[key + "_rel"] = check(fn, q, k, v, grad, offsets, max_length, lengths, scale)
                    for bound, tag in ((max_length, ""), (args.seq_len, "_maxS")):
                        def step(fn=fn, offsets=offsets, bound=bound):
                            out = fn(q, k, v, offsets, bound, scale)
                            torch.autograd.grad(out, (q, k, v), grad)
                        us = graphed_us(step)
                        row[key + tag + "_us"] = round(us, 1)
                        row[key + tag + "_tflops"] = round(flops / us / 1e6, 1)
                except Exception as error:  # noqa: BLE001 - a probe reports what each kernel does
                    row[key + "_error"] = f"{type(error).__name__}: {str(error)[:300]}"
                    row[key + "_where"] = traceback.format_exc()[-700:]
        # dense causal on unpacked rows (no document boundaries), both SDPA backends
        qb, kb, vb = (t.detach().view(args.rows, args.seq_len, t.shape[1], t.shape[2]).transpose(1, 2).requires_grad_()
                      for t in (q, k, v))
        gb = grad.view(args.rows, args.seq_len, heads, dv).transpose(1, 2)
        for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
            key = f"dense_{backend.name.lower()}"
            try:
                def dense_step(backend=backend):
                    with sdpa_kernel(backend):
                        out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale,
                                                             enable_gqa=heads != kv_heads)
                    torch.autograd.grad(out, (qb, kb, vb), gb)
                us = graphed_us(dense_step)
                row[key + "_us"] = round(us, 1)
                row[key + "_tflops"] = round(dense_flops / us / 1e6, 1)
            except Exception as error:  # noqa: BLE001
                row[key + "_error"] = f"{type(error).__name__}: {str(error)[:300]}"
        rows_out.append(row)
        print(json.dumps(row), flush=True)
    with open(args.out, "w") as handle:
        for row in rows_out:
            handle.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
