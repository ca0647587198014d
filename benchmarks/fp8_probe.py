"""FP8 kernels at Qwen3-30B-A3B's shapes, piece by piece, against the bf16 GEMMs they replace.

One MoE layer's experts (4096 tokens, top-8 real routing from random router logits, hidden 2048,
width 768, 128 experts) and one attention-sized dense linear (4096 x 2048 -> 4096): forward +
backward in bf16 and in each FP8 setting, then each FP8 piece alone (quantisers, the three GEMMs).
Median of ``triton.testing.do_bench``; one JSON line per measurement in ``--out``.

    python benchmarks/fp8_probe.py --out fp8_probe.jsonl
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton

from moetune.fp8 import Fp8Settings, fp8_linear
from moetune.fp8.functions import quantize_weight
from moetune.fp8.gemm import rows_mm, weight_grad
from moetune.kernels.fp8_quantize import column_layout, quantize_columns, quantize_rows
from moetune.moe.experts import gated_activation, run_experts

TOKENS, TOP_K, HIDDEN, WIDTH, EXPERTS = 4096, 8, 2048, 768, 128
SETTINGS = ("rowwise:auto", "rowwise:triton", "blockwise:auto")


def _ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="fp8_probe.jsonl")
    args = parser.parse_args()
    torch.manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    logits = torch.randn(TOKENS, EXPERTS, device=dev)
    experts_TK = logits.topk(TOP_K, dim=-1).indices
    order_N = experts_TK.flatten().argsort(stable=True)
    counts_E = torch.bincount(experts_TK.flatten(), minlength=EXPERTS)
    offsets_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
    x = torch.randn(TOKENS, HIDDEN, device=dev, dtype=bf16, requires_grad=True)
    w_in = (torch.randn(EXPERTS, 2 * WIDTH, HIDDEN, device=dev) * 0.02).to(bf16).requires_grad_()
    w_down = (torch.randn(EXPERTS, HIDDEN, WIDTH, device=dev) * 0.02).to(bf16).requires_grad_()
    dy = torch.randn(TOKENS * TOP_K, HIDDEN, device=dev, dtype=bf16)
    activate = lambda h, num_valid=None: gated_activation(h, F.silu, swiglu_kernel=True, num_valid=num_valid)
    flops = 3 * 2 * TOKENS * TOP_K * HIDDEN * 3 * WIDTH
    results = []

    def record(what: str, setting: str, ms: float, flop: float | None = None) -> None:
        entry = {"what": what, "setting": setting, "ms": round(ms, 4)}
        if flop:
            entry["tflops"] = round(flop / ms / 1e9, 1)
        results.append(entry)
        print(json.dumps(entry), flush=True)

    def experts(fp8):
        def step():
            y = run_experts(x, counts_E, w_in, w_down, activate=activate, gather_order=order_N, gather_top_k=TOP_K, fp8=fp8)
            y.backward(dy)
        return step

    record("experts fwd+bwd", "bf16", _ms(experts(None)), flops)
    w_dense = (torch.randn(4096, HIDDEN, device=dev) * 0.02).to(bf16).requires_grad_()
    dy_dense = torch.randn(TOKENS, 4096, device=dev, dtype=bf16)
    dense_flops = 3 * 2 * TOKENS * HIDDEN * 4096
    record("dense 4096x2048->4096 fwd+bwd", "bf16", _ms(lambda: F.linear(x, w_dense).backward(dy_dense)), dense_flops)
    for name in SETTINGS:
        recipe, _, backend = name.partition(":")
        settings = Fp8Settings(recipe, backend)
        try:
            record("experts fwd+bwd", name, _ms(experts(settings)), flops)
            record("dense 4096x2048->4096 fwd+bwd", name,
                   _ms(lambda s=settings: fp8_linear(x, w_dense, None, settings=s).backward(dy_dense)), dense_flops)  # fmt: skip
            _pieces(name, settings, x.detach(), w_in.detach(), dy[:, : 2 * WIDTH].contiguous(), order_N, offsets_E, record)
        except Exception as error:  # noqa: BLE001 -- the other settings still measure
            print(json.dumps({"setting": name, "error": f"{type(error).__name__}: {error}"[:500]}), flush=True)
    with open(args.out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in results)


def _pieces(name, settings, x, w, dy, order_N, offsets_E, record) -> None:
    """The first expert GEMM's pieces alone: its quantisers and its three GEMMs."""
    rows = x[torch.div(order_N, TOP_K, rounding_mode="floor")]
    gemm_flops = 2 * TOKENS * TOP_K * HIDDEN * 2 * WIDTH
    record("quantize x rows [4096, 2048]", name, _ms(lambda: quantize_rows(x, block=settings.block)))
    record("quantize w_in [128, 1536, 2048]", name, _ms(lambda: quantize_weight(w, settings)))
    record("quantize w_in^T (dgrad layout)", name, _ms(lambda: quantize_weight(w.transpose(-2, -1), settings)))
    record("quantize dy rows [32768, 1536]", name, _ms(lambda: quantize_rows(dy, block=settings.block)))
    record("quantize columns [32768, 2048] per expert", name, _ms(lambda: quantize_columns(rows, offsets_E, block=settings.block)))
    x_q, x_s = quantize_rows(rows, block=settings.block)
    w_q, w_s = quantize_weight(w, settings)
    record("gemm forward", name, _ms(lambda: rows_mm(x_q, x_s, w_q, w_s, offsets_E, settings=settings,
                                                     out_dtype=torch.bfloat16, fast_accum=not settings.blockwise)), gemm_flops)  # fmt: skip
    dy_q, dy_s = quantize_rows(dy, block=settings.block)
    wt_q, wt_s = quantize_weight(w.transpose(-2, -1), settings)
    record("gemm input gradient", name, _ms(lambda: rows_mm(dy_q, dy_s, wt_q, wt_s, offsets_E, settings=settings,
                                                            out_dtype=torch.bfloat16)), gemm_flops)  # fmt: skip
    p_q, p_s, padded = quantize_columns(dy, offsets_E, block=settings.block)
    q_q, q_s, _ = quantize_columns(rows, offsets_E, block=settings.block)
    starts = column_layout(offsets_E)[1]
    record("gemm weight gradient", name, _ms(lambda: weight_grad(p_q, p_s, q_q, q_s, padded, starts, num_rows=rows.shape[0],
                                                                 dense=False, settings=settings, out_dtype=torch.bfloat16)),
           gemm_flops)  # fmt: skip
    if name == SETTINGS[0]:  # the bf16 GEMMs these replace
        grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm
        record("gemm forward", "bf16", _ms(lambda: grouped_mm(rows, w.transpose(-2, -1), offs=offsets_E)), gemm_flops)
        record("gemm input gradient", "bf16", _ms(lambda: grouped_mm(dy, w, offs=offsets_E)), gemm_flops)
        record("gemm weight gradient", "bf16", _ms(lambda: grouped_mm(dy.t(), rows, offs=offsets_E)), gemm_flops)


if __name__ == "__main__":
    main()
