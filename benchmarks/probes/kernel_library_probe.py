"""Probe: CuTe-DSL kernel libraries against the kernels moetune runs, at row A's shapes.

- quack's grouped GEMM (``quack.gemm_interface.gemm`` with ``cu_seqlens_m`` / ``cu_seqlens_k``, and
  with ``A_idx``: the token gather inside the GEMM's loads) against ``torch._grouped_mm`` (CUTLASS)
  on the six expert GEMMs of one Qwen3-30B-A3B MoE layer's forward and backward;
- quack's fused gated chain (``gemm_act`` forward, ``gemm_dgated`` backward, ``concat_layout`` for
  moetune's [gate; up] weights) against quack's plain grouped GEMMs + moetune's SwiGLU kernels;
- FlashAttention-4 (``flash_attn.cute.flash_attn_func``) against SDPA's cuDNN and flash backends on
  one layer's causal GQA attention, forward and forward + backward.

Both routings of the issue: the balanced gate (every expert gets T * K / E rows) and a skewed one
(expert shares drawn log-normal, sigma 0.5: heavier than the random-init router's). Each
measurement checks the library's output against torch's first, then times both (median of
``triton.testing.do_bench``, L2 flushed between repetitions). One JSON line per measurement on
stdout and in ``--out``; a library that is missing or fails is reported, not fatal.

    python benchmarks/probes/kernel_library_probe.py --out results.jsonl
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


def gated_chain_cases(counts: torch.Tensor, device: str):
    """(name, moetune_fn, quack_fn, compare) of the SwiGLU experts' gated chain, operands as moetune
    holds them (weights [E, out, in], ``gate_up_proj`` halves [gate; up]). moetune's path is quack's
    plain grouped GEMMs + moetune's SwiGLU kernels (the ``quack`` experts backend); quack's fused one
    keeps the pre-activation with gate and up columns interleaved (its gated epilogues pair adjacent
    columns) and reads the [gate; up] weights through ``concat_layout``:

    - forward: gate_up GEMM on the gathered rows + SwiGLU, against ``gemm_act`` (SwiGLU in the epilogue);
    - backward of the down projection: its data-gradient GEMM + SwiGLU's backward, against
      ``gemm_dgated`` (the activation's gradient in the epilogue, which also recomputes the activation
      the down projection's weight gradient needs, so the forward need not keep it);
    - the gate_up data gradient from the interleaved pre-activation gradient (``concat_layout`` B);
    - the gate_up weight gradient written back in the [gate; up] layout (``concat_layout`` out).
    ``compare(moetune_out, quack_out)`` maps both to the same layout for the relative difference."""
    from quack.gemm_interface import gemm, gemm_act, gemm_dgated

    from moetune.kernels.swiglu import _bwd_triton, swiglu

    gen = torch.Generator(device=device).manual_seed(0)
    n = int(counts.sum())
    bf16 = dict(device=device, dtype=torch.bfloat16)
    x_TH = torch.randn(TOKENS, HIDDEN, generator=gen, **bf16)
    order_N = torch.randperm(n, generator=gen, device=device)
    idx = (order_N // TOP_K).to(torch.int32)
    in_proj = torch.randn(EXPERTS, 2 * MOE_INTER, HIDDEN, generator=gen, **bf16) * HIDDEN**-0.5
    down_proj = torch.randn(EXPERTS, HIDDEN, MOE_INTER, generator=gen, **bf16) * MOE_INTER**-0.5
    dy_NH = torch.randn(n, HIDDEN, generator=gen, **bf16)
    cu = F.pad(torch.cumsum(counts.to(device), 0, dtype=torch.int32), (1, 0))
    w1 = in_proj.transpose(-2, -1)
    interleave = lambda t: t.unflatten(-1, (2, MOE_INTER)).transpose(-2, -1).flatten(-2)  # noqa: E731
    h_NX = gemm(x_TH, w1, cu_seqlens_m=cu, A_idx=idx)  # [gate | up]
    h_inter = interleave(h_NX)
    dh_NX = torch.empty_like(h_NX)
    x_NH = x_TH[idx.long()]

    def swiglu_backward():
        da_NI = gemm(dy_NH, down_proj, cu_seqlens_m=cu)
        gate, up = h_NX.chunk(2, dim=-1)
        dg, du = dh_NX.chunk(2, dim=-1)
        _bwd_triton(da_NI, gate, up, dg, du)
        return dh_NX

    dh_inter = interleave(swiglu_backward()).contiguous()
    same = lambda a, b: (a, b)  # noqa: E731
    return [
        (
            "fwd gate_up + swiglu (gathered rows)",
            lambda: swiglu(gemm(x_TH, w1, cu_seqlens_m=cu, A_idx=idx)),
            lambda: gemm_act(x_TH, w1, activation="swiglu", cu_seqlens_m=cu, A_idx=idx, concat_layout=("B",))[1],
            same,
        ),
        (
            "bwd down dgrad + swiglu backward",
            swiglu_backward,
            lambda: gemm_dgated(dy_NH, down_proj, h_inter, activation="swiglu", cu_seqlens_m=cu)[0],
            lambda a, b: (interleave(a), b),
        ),
        (
            "dgrad gate_up from the interleaved gradient",
            lambda: gemm(dh_NX, in_proj, cu_seqlens_m=cu),
            lambda: gemm(dh_inter, in_proj, cu_seqlens_m=cu, concat_layout=("B",)),
            same,
        ),
        (
            "wgrad gate_up [gate; up] from the interleaved gradient",
            lambda: gemm(dh_NX.t(), x_NH, cu_seqlens_k=cu),
            lambda: gemm(dh_inter.t(), x_NH, cu_seqlens_k=cu, concat_layout=("out",)),
            same,
        ),
    ]


def probe_fused_swiglu(routing: str, device: str, emit) -> None:
    """Each link of quack's fused gated chain (``gated_chain_cases``) against the quack experts
    backend's current path: the relative difference, then both timed."""
    counts = expert_counts(routing, TOKENS * TOP_K, EXPERTS)
    try:
        cases = gated_chain_cases(counts, device)
    except Exception as err:
        emit({"probe": "fused_swiglu", "routing": routing, "error": f"{err!r}"[:500]})
        traceback.print_exc()
        return
    for name, moetune_fn, quack_fn, compare in cases:
        row = {"probe": "fused_swiglu", "routing": routing, "gemm": name}
        try:
            row["rel_diff"] = rel_diff(*reversed(compare(moetune_fn().clone(), quack_fn())))
            row["moetune_ms"], row["quack_ms"] = timed(moetune_fn), timed(quack_fn)
            row["speedup"] = row["moetune_ms"] / row["quack_ms"]
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
