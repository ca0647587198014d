"""moetune's training step in bf16 and in FP8, side by side on one model in one process.

For each shipped config: the moetune model is built once (``moetune bench``'s builder: same init,
same real routing, bf16 parameters and AdamW states), timed in bf16, then switched in place to each
FP8 setting (``moetune.models.fp8.enable_fp8``: the same weights and module objects) and timed again;
optionally one profiled step per setting gives the per-kernel breakdown.

    python benchmarks/fp8_step_bench.py --configs qwen3_30b_a3b:8 gpt_oss_20b:4 --out results.jsonl \
        --settings bf16 rowwise:auto blockwise:auto --profile-config qwen3_30b_a3b

Each line of ``--out`` is one (config, setting, eager or graphed) result; the table at the end gives
the FP8 / bf16 step ratios. See docs/fp8.md.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from moetune.bench.env import commit, gpu_name, setup, versions
from moetune.bench.models import build_side, load_config
from moetune.bench.run import Row, run_rows
from moetune.flops import training_flops_per_token
from moetune.fp8 import Fp8Settings
from moetune.fp8.settings import DEFAULT_WEIGHT_GRAD
from moetune.models.fp8 import enable_fp8, fp8_layers


def _settings(name: str) -> Fp8Settings | None:
    """``bf16``, or ``recipe[:backend[:weight_grad]]`` (``rowwise:auto:fp8``: FP8 weight gradients; without
    the third part, the library's default, bf16 weight gradients)."""
    if name == "bf16":
        return None
    recipe, backend, weight_grad = (name.split(":") + ["", ""])[:3]
    return Fp8Settings(recipe, backend or "auto", weight_grad or DEFAULT_WEIGHT_GRAD)


def _profile(bench, ids: torch.Tensor, path: Path, label: str) -> None:
    """One forward + backward under torch's profiler: the CUDA kernels by total time."""
    from torch.profiler import ProfilerActivity, profile

    bench.loss(ids).backward()  # warm (compilation, autotuning)
    bench.model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        bench.loss(ids).backward()
        torch.cuda.synchronize()
    bench.model.zero_grad(set_to_none=True)
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=90)
    with path.open("a") as f:
        f.write(f"\n===== {label}: one forward + backward =====\n{table}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["qwen3_30b_a3b:8"], help="shipped config:layers")
    parser.add_argument("--settings", nargs="+", default=["bf16", "rowwise:auto", "blockwise:auto"])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=1,
                        help="sequences per step: more tokens per expert and per optimizer step (docs/fp8.md, the ceiling)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--graphed", nargs="*", default=[], help="configs also timed with CUDA-graph steps")
    parser.add_argument("--profile-config", nargs="*", default=[], help="configs to profile one step of, per setting")
    parser.add_argument("--out", default="fp8_step_bench.jsonl")
    args = parser.parse_args()
    env = setup("auto")
    out, profile_path = Path(args.out), Path(args.out).with_suffix(".profile.txt")
    header = {"gpu": gpu_name(env.device), "commit": commit(), "versions": versions(), "date": time.strftime("%Y-%m-%d"),
              "seq_len": args.seq_len, "micro_batch": args.micro_batch, "warmup": args.warmup, "steps": args.steps, "routing": "real",
              "optimizer": "torch.optim.AdamW(fused=True), bf16 parameters and states"}  # fmt: skip
    print(json.dumps(header), flush=True)
    summary = []
    for item in args.configs:
        name, _, layers = item.partition(":")
        model_name, config = load_config(name, layers=int(layers) if layers else None)
        started = time.perf_counter()
        bench = build_side("moetune", config, device=env.device, dtype=torch.bfloat16, seed=0)
        print(f"[{model_name} {config.num_hidden_layers}l] built in {time.perf_counter() - started:.1f} s", flush=True)
        flops = training_flops_per_token(config, seq_len=args.seq_len)
        row = Row("real", args.micro_batch, args.seq_len, False)
        base = {}
        for setting in args.settings:
            settings = _settings(setting)
            enable_fp8(bench.model, settings)
            for graphed in [False] + ([True] if name in args.graphed else []):
                torch.cuda.empty_cache()
                [result] = run_rows(bench, [row], env=env, flops_per_token={args.seq_len: flops}, peak_tflops=None,
                                    warmup=args.warmup, steps=args.steps, seed=0, lr=1e-5,
                                    moetune_optimizer="moetune" if graphed else "torch", moetune_cuda_graph=graphed)  # fmt: skip
                record = {"model": model_name, "layers": config.num_hidden_layers, "micro_batch": args.micro_batch, "setting": setting,
                          "graphed": graphed, "fp8_modules": len(fp8_layers(bench.model)), **result.to_json()}  # fmt: skip
                key = (model_name, graphed)
                if setting == "bf16" and not result.error:
                    base[key] = result
                elif key in base and not result.error:
                    record["speedup_vs_bf16"] = base[key].step_s / result.step_s
                    if result.peak_gib and base[key].peak_gib:
                        record["peak_vs_bf16"] = result.peak_gib / base[key].peak_gib
                with out.open("a") as f:
                    f.write(json.dumps(record) + "\n")
                line = (f"{model_name:>24} {config.num_hidden_layers:>2}l mb{args.micro_batch} {setting:>16} {'graphed' if graphed else 'eager':>7}: "
                        + (result.error or f"step {1e3 * result.step_s:7.1f} ms, {result.tokens_per_s_per_gpu:8,.0f} tok/s, "
                           f"peak {result.peak_gib or 0:5.1f} GiB, loss {result.losses[-1]:.3f}"
                           + (f", x{record['speedup_vs_bf16']:.3f} vs bf16" if "speedup_vs_bf16" in record else "")))  # fmt: skip
                print(line, flush=True)
                summary.append(line)
            if name in args.profile_config:
                ids = torch.randint(0, config.vocab_size, (args.micro_batch, args.seq_len), device=env.device)
                try:
                    _profile(bench, ids, profile_path, f"{model_name} {config.num_hidden_layers}l {setting}")
                except Exception as error:  # noqa: BLE001 -- the timings above matter more
                    print(f"profile failed: {error}", flush=True)
        del bench
        torch.cuda.empty_cache()
    print("\n".join(["", "summary:", *summary]), flush=True)


if __name__ == "__main__":
    main()
