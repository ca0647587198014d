"""One Mamba-2 mixer of Nemotron 3 Nano (hidden 2688, 64 heads x 64, state 128, 8 groups, chunk 128),
bf16, forward + backward: Transformers' torch path against moetune's (``moetune.layers.mamba2``),
compiled (its default on CUDA) and eager.

Prints and appends to --out (JSON lines) per side: median ms of forward + backward (eager), peak
memory above the inputs and weights, and the relative error of the output and the input gradient
against the fp32 reference (Transformers' mixer in fp32). moetune's side is also timed replayed
from a CUDA graph. With ``--frozen`` moetune's mixer is timed twice more, as LoRA trains it: with
every weight frozen (``moetune_frozen``), and with only the scan's own weights frozen (the
convolution, ``A_log``, ``D``, ``dt_bias``, the gated norm; ``moetune_frozen_scan``) while
``in_proj`` / ``out_proj`` keep their weight gradients. ``moetune`` minus ``moetune_frozen_scan`` is
what frozen weights save in the scan itself (the planner's ``mamba_weight_grad_us_per_token``; the
projections' weight gradients are dense GEMMs, which it prices apart).

    python benchmarks/probes/mamba2_probe.py --seq-len 4096 --out mamba2_probe.jsonl
    python benchmarks/probes/mamba2_probe.py --seq-len 4096 16384 --frozen --sides moetune --out mamba2_probe.jsonl
"""

from __future__ import annotations

import argparse
import functools
import os
import json
import statistics
import time

import torch
from transformers.models.nemotron_h import modeling_nemotron_h as hf

from moetune.bench.env import commit, gpu_name, utc_now, versions
from moetune.models.nemotron_h.model import NemotronHMamba2Mixer


PROJECTIONS = ("in_proj.", "out_proj.")
SIDES = ("transformers", "moetune", "moetune_eager")
FROZEN_SIDES = ("moetune_frozen", "moetune_frozen_scan")


def build(dtype: torch.dtype, moetune_forward: bool, frozen: str | None = None) -> torch.nn.Module:
    config = hf.NemotronHConfig(hidden_size=2688, mamba_num_heads=64, mamba_head_dim=64, ssm_state_size=128,
                                n_groups=8, chunk_size=128, hybrid_override_pattern="M", layer_norm_epsilon=1e-5)
    torch.manual_seed(0)
    mixer = hf.NemotronHMamba2Mixer(config, layer_idx=0)
    for name, param in mixer.named_parameters():
        if param.dim() > 1:
            torch.nn.init.normal_(param, std=0.02)
    if moetune_forward:
        mixer.__class__ = NemotronHMamba2Mixer
    for name, param in mixer.named_parameters():
        # "all": LoRA's frozen mixer; "scan": only the scan's own weights (the projections keep theirs)
        if frozen == "all" or (frozen == "scan" and not name.startswith(PROJECTIONS)):
            param.requires_grad_(False)
    return mixer.to(device="cuda", dtype=dtype).train()


def forward_backward(mixer: torch.nn.Module, x: torch.Tensor, probe: torch.Tensor) -> torch.Tensor:
    x.grad = None
    mixer.zero_grad(set_to_none=False)
    out = mixer(x)
    out.backward(probe)
    return out.detach()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def time_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, nargs="+", default=[4096])
    parser.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated subset of {','.join(SIDES)}")
    parser.add_argument("--frozen", action="store_true", help=f"also time {' and '.join(FROZEN_SIDES)} (LoRA's frozen mixer)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default=None)
    parser.add_argument("--profile", action="store_true", help="print moetune's top kernels of one forward + backward (each moetune side but the eager one)")
    args = parser.parse_args()

    records = []
    for seq_len in args.seq_len:
        x32 = torch.randn(1, seq_len, 2688, device="cuda")
        probe = torch.randn(1, seq_len, 2688, device="cuda")
        reference = build(torch.float32, moetune_forward=False)
        x_ref = x32.clone().requires_grad_()
        out_ref = reference(x_ref)
        out_ref.backward(probe)
        sides = [side for side in args.sides.split(",") if side] + (list(FROZEN_SIDES) if args.frozen else [])
        for side in sides:
            # moetune's scan runs compiled on CUDA; "moetune_eager" is the same code without torch.compile
            os.environ["MOETUNE_MAMBA2_COMPILE"] = "0" if side == "moetune_eager" else "1"
            frozen = {"moetune_frozen": "all", "moetune_frozen_scan": "scan"}.get(side)
            mixer = build(torch.bfloat16, moetune_forward=side != "transformers", frozen=frozen)
            x = x32.bfloat16().requires_grad_()
            step = functools.partial(forward_backward, mixer, x, probe.bfloat16())
            out = step()
            record = {"side": side, "seq_len": seq_len, "out_rel_err": rel(out, out_ref), "dx_rel_err": rel(x.grad, x_ref.grad)}
            out = None  # frees the autograd graph, whose AccumulateGrad nodes would tie a capture to this stream
            side_stream = torch.cuda.Stream()
            side_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side_stream):  # warm-up as torch.cuda.graph wants it
                step()
            torch.cuda.current_stream().wait_stream(side_stream)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step()
            record["peak_extra_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
            record["eager_ms"] = time_ms(step, args.repeats)
            if side in ("moetune", *FROZEN_SIDES) and args.profile:
                print(f"== {side}, seq {seq_len}: moetune's top kernels of one forward + backward", flush=True)
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    step()
                    torch.cuda.synchronize()
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30), flush=True)
            if side != "transformers":
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    step()
                record["graphed_ms"] = time_ms(graph.replay, args.repeats)
            record.update(gpu=gpu_name(x.device), date=utc_now().isoformat(), **versions(), **commit())
            print(json.dumps(record), flush=True)
            records.append(record)
            mixer = x = step = None
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)


if __name__ == "__main__":
    main()
