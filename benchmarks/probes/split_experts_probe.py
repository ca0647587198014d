"""What splitting one expert-parallel MoE layer's experts into the own tokens' and the peers' calls
costs on one GPU (the reverted ``ep_dispatch="allgather_overlap"``, commit 741ab05, against
``"allgather"``), with no communication, and how much a kernel that holds some SMs beside the experts
(an NCCL collective overlapping them) slows them.

    python benchmarks/probes/split_experts_probe.py [--out FILE]

Qwen3-30B-A3B layer at ep=2: 64 local experts of 128, hidden 2048, width 768, top-8, 4096 tokens per
rank (8192 gathered), bf16, forward + backward of the experts and the combine, median of CUDA-graph
replay timings. One JSON line per case.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton
import triton.language as tl

from moetune.kernels.permute import combine_rows
from moetune.moe import GroupedExperts
from moetune.moe.dispatch import sort_ids

HIDDEN, WIDTH, EXPERTS, TOP_K, TOKENS = 2048, 768, 128, 8, 4096


@triton.jit
def _hold_sms(flag_ptr, cycles: tl.constexpr):
    # Each program spins for ``cycles`` clock ticks, holding an SM slot like a waiting NCCL CTA.
    start = tl.extra.cuda.globaltimer()
    while tl.extra.cuda.globaltimer() - start < cycles:
        tl.store(flag_ptr + tl.program_id(0), 1)


def local_sort(experts_XK: torch.Tensor, num_local: int):
    key = torch.where(experts_XK < num_local, experts_XK, num_local).reshape(-1)
    order, counts = sort_ids(key, num_local + 1)
    return order, counts[:num_local], counts[:num_local].sum().reshape(1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--profile", action="store_true", help="also print each case's kernels (ms per replay)")
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    num_local = EXPERTS // 2
    experts = GroupedExperts(num_experts=num_local, hidden_size=HIDDEN, intermediate_size=WIDTH).to(device, torch.bfloat16)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x_GH = torch.randn(2 * TOKENS, HIDDEN, device=device, dtype=torch.bfloat16, requires_grad=True)
    logits = torch.randn(2 * TOKENS, EXPERTS, device=device) + torch.randn(EXPERTS, device=device)  # skewed, like real routing
    weights_GK, experts_GK = torch.softmax(logits, -1).topk(TOP_K, -1)
    weights_GK = weights_GK.requires_grad_()
    flag = torch.zeros(1024, device=device, dtype=torch.int32)
    side = torch.cuda.Stream()

    def one_call(backward: bool = True):
        order, counts, valid = local_sort(experts_GK, num_local)
        y = experts(x_GH, counts, gather_order=order, gather_top_k=TOP_K)
        out = combine_rows(y, weights_GK.detach(), order, num_valid=valid, out_dtype=torch.float32)
        if backward:  # the combine's backward is a gather of the same size either way
            y.backward(grads[y.shape])
        return out

    def split(backward: bool = True):
        # The two calls of the reverted ep_dispatch="allgather_overlap" (commit 741ab05, reverted):
        # this rank's own tokens, then the peers' (the own block's copies marked as padding). That
        # dispatcher interleaved the own call's two projections around the peers' call; the kernels
        # are the same either way.
        order_o, counts_o, valid_o = local_sort(experts_GK[:TOKENS], num_local)
        y_o = experts(x_GH[:TOKENS], counts_o, gather_order=order_o, gather_top_k=TOP_K)
        peers_ids = experts_GK.clone()
        peers_ids[:TOKENS] = EXPERTS
        order_p, counts_p, valid_p = local_sort(peers_ids, num_local)
        y_p = experts(x_GH, counts_p, gather_order=order_p, gather_top_k=TOP_K)
        out_p = combine_rows(y_p, weights_GK.detach(), order_p, num_valid=valid_p, out_dtype=torch.float32)
        out_o = combine_rows(y_o, weights_GK[:TOKENS].detach(), order_o, num_valid=valid_o, out_dtype=torch.float32)
        if backward:
            torch.autograd.backward([y_o, y_p], [grads[y_o.shape], grads[y_p.shape]])
        return out_o, out_p

    grads = {
        shape: torch.randn(shape, device=device, dtype=torch.bfloat16)
        for shape in (torch.Size([2 * TOKENS * TOP_K, HIDDEN]), torch.Size([TOKENS * TOP_K, HIDDEN]))
    }

    def timed(fn, *, hold_programs: int = 0, hold_us: float = 0.0, every: int = 0):
        """Median replay time of ``fn`` (and the SM holders beside it) captured in a CUDA graph: the
        real step is graphed, so launch costs must not count."""

        def body():
            x_GH.grad = weights_GK.grad = None
            for p in experts.parameters():
                p.grad = None
            if hold_programs:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(every):  # holders queued back to back beside the experts
                        _hold_sms[(hold_programs,)](flag, cycles=int(hold_us * 1000))
            fn()
            if hold_programs:
                torch.cuda.current_stream().wait_stream(side)

        warm = torch.cuda.Stream()
        warm.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(warm):
            for _ in range(3):
                body()
        torch.cuda.current_stream().wait_stream(warm)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
        if args.profile and not hold_programs:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    graph.replay()
                torch.cuda.synchronize()
            kernels: dict[str, float] = {}
            for event in prof.events():
                if event.device_type.name == "CUDA":
                    kernels[event.name[:90]] = kernels.get(event.name[:90], 0.0) + event.device_time / 5 / 1e3
            for name, ms in sorted(kernels.items(), key=lambda kv: -kv[1])[:14]:
                print(f"    {ms:7.3f} ms  {name}", flush=True)
        times = []
        for i in range(args.iters + 3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            if i >= 3:
                times.append(start.elapsed_time(end))
        return statistics.median(times)

    cases = [("one_call", one_call, 0, 0.0, 0), ("split", split, 0, 0.0, 0),
             ("one_call_forward", lambda: one_call(False), 0, 0.0, 0), ("split_forward", lambda: split(False), 0, 0.0, 0)]
    for programs in (1, 16):
        cases += [("one_call_forward", lambda: one_call(False), programs, 100.0, 2),
                  ("split_forward", lambda: split(False), programs, 100.0, 2)]  # fmt: skip
    out = open(args.out, "a") if args.out else None
    for name, fn, programs, hold_us, every in cases:
        print(f"== {name} holders={programs}", flush=True)
        ms = timed(fn, hold_programs=programs, hold_us=hold_us, every=every)
        record = {"case": name, "ms_fwd_bwd": round(ms, 3), "sm_holder_programs": programs, "holder_us": hold_us,
                  "holders": every, "gpu": torch.cuda.get_device_name()}  # fmt: skip
        print(json.dumps(record), flush=True)
        if out:
            out.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
