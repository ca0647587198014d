"""The seeds' plans (``moetune plan``), as text and JSON, in one process (the planner reads configs only;
CPU is enough):

    python benchmarks/plan_seeds.py --out benchmarks/results/plan_20261207

- 8x H100 80GB at the published setting (seq 4096, micro-batch 1): Qwen3-30B-A3B and Nemotron 3 Nano,
  the fastest plan that fits, and the fastest within NeMo AutoModel's published peaks (48.1 and 42.5 GiB);
- 64-256 H100s: DeepSeek-V3 and Kimi-K2 (full fine-tuning, and LoRA where full does not fit at 64),
  Qwen3-235B-A22B and GPT-OSS-120B at 64;
- Nemotron 3 Ultra 550B-A55B on 128 H100s with ep=64 (its config from the fields listed in
  moetune/assets/configs/README.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moetune.plan import PlanRequest, format_plan, make_plan, plan_to_dict
from moetune.plan.memory import GIB

H100 = dict(gpu="h100", gpus_per_node=8, seq_len=4096, micro_batch=1)
SEEDS = {
    "qwen3-30b-a3b_8xh100": dict(model="qwen3_30b_a3b", nodes=1),
    "qwen3-30b-a3b_8xh100_within_48.1gib": dict(model="qwen3_30b_a3b", nodes=1, gpu_memory_gib=48.1),
    "nemotron-3-nano_8xh100": dict(model="nemotron_3_nano_30b_a3b", nodes=1),
    "nemotron-3-nano_8xh100_within_42.5gib": dict(model="nemotron_3_nano_30b_a3b", nodes=1, gpu_memory_gib=42.5),
    **{f"{name}_{8 * nodes}xh100": dict(model=model, nodes=nodes)
       for nodes in (8, 16, 32) for name, model in (("deepseek-v3", "deepseek_v3"), ("kimi-k2", "kimi_k2"))},
    "deepseek-v3_64xh100_lora16": dict(model="deepseek_v3", nodes=8, lora_rank=16),
    "kimi-k2_64xh100_lora16": dict(model="kimi_k2", nodes=8, lora_rank=16),
    "qwen3-235b-a22b_64xh100": dict(model="qwen3_235b_a22b", nodes=8),
    "gpt-oss-120b_64xh100": dict(model="gpt_oss_120b", nodes=8),
    "nemotron-3-ultra-550b_128xh100_ep64": dict(model="nemotron_3_ultra_550b_a55b", nodes=16, ep=64),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = ["| plan | GPUs | fits | ep | dense / dispatch | recompute | graph | peak GiB | total GiB | tokens/s/GPU | step s |",
               "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, fields in SEEDS.items():
        plan = make_plan(PlanRequest(**{**H100, **fields}))
        (out / f"{name}.txt").write_text(format_plan(plan) + "\n")
        (out / f"{name}.json").write_text(json.dumps(plan_to_dict(plan), indent=2) + "\n")
        best, s = plan.best, plan.best.setting
        summary.append(
            f"| {name} | {plan.request.world} | {'yes' if best.fits else 'NO'} | {s.ep} | {s.dense_parallel} / {s.ep_dispatch} | "
            f"{s.recompute} | {'on' if s.cuda_graph else 'off'} | {best.memory.peak / GIB:.1f} | {best.memory.total / GIB:.1f} | "
            f"{best.time.tokens_per_s:,.0f} | {best.time.step:.2f} |")
        print(summary[-1], flush=True)
    (out / "summary.md").write_text("\n".join(summary) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
