"""Probe: CuTe-DSL kernel libraries against the kernels moetune runs, at row A's shapes.

- quack's grouped GEMM (``quack.gemm_interface.gemm`` with ``cu_seqlens_m`` / ``cu_seqlens_k``, and
  with ``A_idx``: the token gather inside the GEMM's loads) against ``torch._grouped_mm`` (CUTLASS)
  on the six expert GEMMs of one Qwen3-30B-A3B MoE layer's forward and backward;
- quack's ``gemm_act``: the first expert GEMM with SwiGLU in its epilogue, against torch's grouped
  GEMM + moetune's SwiGLU kernel;
- FlashAttention-4 (``flash_attn.cute.flash_attn_func``) against SDPA's cuDNN and flash backends on
  one layer's causal GQA attention, forward and forward + backward.

Both routings of the issue: the balanced gate (every expert gets T * K / E rows) and a skewed one
(expert shares drawn log-normal, sigma 0.5: heavier than the random-init router's). Each
measurement checks the library's output against torch's first, then times both (median of
``triton.testing.do_bench``, L2 flushed between repetitions). One JSON line per measurement on
stdout and in ``--out``; a library that is missing or fails is reported, not fatal.

    python benchmarks/kernel_library_probe.py --out results.jsonl
"""

from __future__ import annotations

import argparse
import json
import traceback

import torch
import torch.nn.functional as F

TOKENS, TOP_K, EXPERTS, HIDDEN, MOE_INTER = 4096, 8, 128, 2048, 768
HEADS, KV_HEADS, HEAD_DIM = 32, 4, 128


def expert_counts(routing: str, rows: int, experts: int, seed: int = 0) -> torch.Tensor:
    """Rows per expert summing to ``rows``: equal shares, or log-normal shares (sigma 0.5)."""
    if routing == "balanced":
        return torch.full((experts,), rows // experts, dtype=torch.int64)
    gen = torch.Generator().manual_seed(seed)
    share = torch.exp(0.5 * torch.randn(experts, generator=gen))
    counts = torch.floor(share / share.sum() * rows).long()
    counts[torch.argmax(counts)] += rows - int(counts.sum())
    return counts


def timed(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))


def rel_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))


def gemm_cases(counts: torch.Tensor, device: str):
    """(name, flops, torch_fn, quack_fn) of one MoE layer's six expert GEMMs plus the gathered forward,
    operands laid out as moetune holds them (weights [E, out, in])."""
    from quack.gemm_interface import gemm

    gen = torch.Generator(device=device).manual_seed(0)
    n = int(counts.sum())
    bf16 = dict(device=device, dtype=torch.bfloat16)
    x_TH = torch.randn(TOKENS, HIDDEN, generator=gen, **bf16)
    order_N = torch.randperm(n, generator=gen, device=device)
    x_NH = x_TH[order_N // TOP_K]
    in_proj = torch.randn(EXPERTS, 2 * MOE_INTER, HIDDEN, generator=gen, **bf16) * HIDDEN**-0.5
    down_proj = torch.randn(EXPERTS, HIDDEN, MOE_INTER, generator=gen, **bf16) * MOE_INTER**-0.5
    a_NI = torch.randn(n, MOE_INTER, generator=gen, **bf16)
    dh_NX = torch.randn(n, 2 * MOE_INTER, generator=gen, **bf16)
    dy_NH = torch.randn(n, HIDDEN, generator=gen, **bf16)
    offs = torch.cumsum(counts.to(device), 0, dtype=torch.int32)
    cu = F.pad(offs, (1, 0))
    gmm = torch._grouped_mm
    w1, w2 = in_proj.transpose(-2, -1), down_proj.transpose(-2, -1)  # [E, in, out] views
    flops = lambda m, k, n_: 2.0 * m * k * n_  # noqa: E731
    return [
        ("fwd gate_up", flops(n, HIDDEN, 2 * MOE_INTER), lambda: gmm(x_NH, w1, offs=offs), lambda: gemm(x_NH, w1, cu_seqlens_m=cu)),
        (
            "fwd gate_up, gathered rows",
            flops(n, HIDDEN, 2 * MOE_INTER),
            lambda: gmm(x_TH[order_N // TOP_K], w1, offs=offs),
            lambda: gemm(x_TH, w1, cu_seqlens_m=cu, A_idx=(order_N // TOP_K).to(torch.int32)),
        ),
        ("fwd down", flops(n, MOE_INTER, HIDDEN), lambda: gmm(a_NI, w2, offs=offs), lambda: gemm(a_NI, w2, cu_seqlens_m=cu)),
        ("dgrad gate_up", flops(n, 2 * MOE_INTER, HIDDEN), lambda: gmm(dh_NX, in_proj, offs=offs), lambda: gemm(dh_NX, in_proj, cu_seqlens_m=cu)),
        ("dgrad down", flops(n, HIDDEN, MOE_INTER), lambda: gmm(dy_NH, down_proj, offs=offs), lambda: gemm(dy_NH, down_proj, cu_seqlens_m=cu)),
        (
            "wgrad gate_up [E, out, in]",
            flops(n, HIDDEN, 2 * MOE_INTER),
            lambda: gmm(dh_NX.t(), x_NH, offs=offs),
            lambda: gemm(dh_NX.t(), x_NH, cu_seqlens_k=cu),
        ),
        (
            "wgrad down [E, out, in]",
            flops(n, HIDDEN, MOE_INTER),
            lambda: gmm(dy_NH.t(), a_NI, offs=offs),
            lambda: gemm(dy_NH.t(), a_NI, cu_seqlens_k=cu),
        ),
    ]


def probe_gemms(routing: str, device: str, emit) -> None:
    counts = expert_counts(routing, TOKENS * TOP_K, EXPERTS)
    base = {"probe": "grouped_gemm", "routing": routing, "rows_min": int(counts.min()), "rows_max": int(counts.max())}
    try:
        cases = gemm_cases(counts, device)
    except Exception as err:  # quack missing or its import failing: say so, keep probing
        emit({**base, "error": f"quack: {err!r}"})
        return
    for name, flops, torch_fn, quack_fn in cases:
        row = {**base, "gemm": name}
        want = torch_fn()
        row["torch_ms"] = timed(torch_fn)
        row["torch_tflops"] = flops / row["torch_ms"] / 1e9
        try:
            row["quack_rel_diff"] = rel_diff(quack_fn(), want)
            row["quack_ms"] = timed(quack_fn)
            row["quack_tflops"] = flops / row["quack_ms"] / 1e9
            row["speedup"] = row["torch_ms"] / row["quack_ms"]
        except Exception as err:
            row["error"] = f"{err!r}"[:500]
            traceback.print_exc()
        emit(row)


def attention_flops(seq: int, *, backward: bool) -> float:
    causal_half = 0.5
    forward = 4.0 * seq * seq * HEADS * HEAD_DIM * causal_half
    return forward * (3.5 if backward else 1.0)  # backward = 2.5x forward (5 GEMMs against 2)


def probe_fused_swiglu(routing: str, device: str, emit) -> None:
    """The experts' first GEMM with SwiGLU in its epilogue (quack's ``gemm_act``, gathered rows,
    [gate; up] halves as moetune stores them) against moetune's path: torch's grouped GEMM on the
    gathered rows, then moetune's SwiGLU kernel (both keep the pre-activation for the backward)."""
    from moetune.kernels.swiglu import swiglu

    counts = expert_counts(routing, TOKENS * TOP_K, EXPERTS)
    row = {"probe": "fused_swiglu", "routing": routing, "gemm": "fwd gate_up + swiglu, gathered rows"}
    try:
        from quack.gemm_interface import gemm_act

        gen = torch.Generator(device=device).manual_seed(0)
        n = int(counts.sum())
        x_TH = torch.randn(TOKENS, HIDDEN, generator=gen, device=device, dtype=torch.bfloat16)
        order_N = torch.randperm(n, generator=gen, device=device)
        w1 = (torch.randn(EXPERTS, 2 * MOE_INTER, HIDDEN, generator=gen, device=device, dtype=torch.bfloat16) * HIDDEN**-0.5).transpose(-2, -1)
        offs = torch.cumsum(counts.to(device), 0, dtype=torch.int32)
        cu, idx = F.pad(offs, (1, 0)), (order_N // TOP_K).to(torch.int32)

        def moetune_path():
            return swiglu(torch._grouped_mm(x_TH[order_N // TOP_K], w1, offs=offs))

        def quack_path():
            return gemm_act(x_TH, w1, activation="swiglu", cu_seqlens_m=cu, A_idx=idx, concat_layout=("B",))[1]

        row["rel_diff"] = rel_diff(quack_path(), moetune_path())
        row["torch_ms"], row["quack_ms"] = timed(moetune_path), timed(quack_path)
        row["speedup"] = row["torch_ms"] / row["quack_ms"]
    except Exception as err:
        row["error"] = f"{err!r}"[:500]
        traceback.print_exc()
    emit(row)


def probe_attention(seq: int, device: str, emit) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator(device=device).manual_seed(0)
    bf16 = dict(device=device, dtype=torch.bfloat16)
    q = torch.randn(1, seq, HEADS, HEAD_DIM, generator=gen, **bf16).requires_grad_()
    k = torch.randn(1, seq, KV_HEADS, HEAD_DIM, generator=gen, **bf16).requires_grad_()
    v = torch.randn(1, seq, KV_HEADS, HEAD_DIM, generator=gen, **bf16).requires_grad_()
    grad = torch.randn(1, seq, HEADS, HEAD_DIM, generator=gen, **bf16)

    def sdpa(backend):
        def run():
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
                )
            return out.transpose(1, 2)

        return run

    def flash4():
        from flash_attn.cute import flash_attn_func

        out = flash_attn_func(q, k, v, causal=True)
        return out[0] if isinstance(out, tuple) else out

    def with_backward(fn):
        def run():
            q.grad = k.grad = v.grad = None
            fn().backward(grad)

        return run

    reference = sdpa(SDPBackend.CUDNN_ATTENTION)().float()
    for name, fn in (
        ("sdpa cudnn", sdpa(SDPBackend.CUDNN_ATTENTION)),
        ("sdpa flash", sdpa(SDPBackend.FLASH_ATTENTION)),
        ("flash-attn-4", flash4),
    ):
        row = {"probe": "attention", "seq": seq, "kernel": name}
        try:
            row["rel_diff_vs_cudnn"] = rel_diff(fn(), reference)
            row["fwd_ms"] = timed(fn)
            row["fwd_tflops"] = attention_flops(seq, backward=False) / row["fwd_ms"] / 1e9
            row["fwd_bwd_ms"] = timed(with_backward(fn))
            row["fwd_bwd_tflops"] = attention_flops(seq, backward=True) / row["fwd_bwd_ms"] / 1e9
        except Exception as err:
            row["error"] = f"{err!r}"[:500]
            traceback.print_exc()
        emit(row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="append JSON lines here too")
    parser.add_argument("--seq", type=int, nargs="+", default=[4096])
    parser.add_argument("--parts", nargs="+", default=["gemm", "swiglu", "attention"], choices=["gemm", "swiglu", "attention"])
    args = parser.parse_args()
    device = "cuda"
    versions = {"probe": "versions", "torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    for module in ("quack", "flash_attn", "cutlass", "triton"):
        try:
            versions[module] = getattr(__import__(module), "__version__", "present")
        except Exception as err:
            versions[module] = f"missing: {err!r}"[:200]

    def emit(row: dict) -> None:
        line = json.dumps(row)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")

    emit(versions)
    for routing in ("balanced", "skewed"):
        if "gemm" in args.parts:
            probe_gemms(routing, device, emit)
        if "swiglu" in args.parts:
            probe_fused_swiglu(routing, device, emit)
    for seq in args.seq if "attention" in args.parts else ():
        probe_attention(seq, device, emit)


if __name__ == "__main__":
    main()
