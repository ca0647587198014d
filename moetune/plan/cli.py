"""``moetune plan``: the command line of the planner."""

from __future__ import annotations

import argparse
import json
import sys

from moetune.plan.report import format_plan, plan_to_dict
from moetune.plan.search import make_plan
from moetune.plan.setting import PRECISIONS, RECOMPUTE, ROUTING, PlanRequest


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="moetune plan",
        description="Size a fine-tuning run before it starts: the settings to use (ep_size, dense_parallel, "
                    "activation checkpointing, micro-batch, gradient accumulation), memory per GPU by part and the "
                    "predicted step time, or what would make it fit. Reads only the model's config.json.",
    )
    p.add_argument("model", help="a shipped config name (qwen3_30b_a3b, deepseek_v3, kimi_k2, ...: moetune/assets/configs), "
                                 "a config.json, or a Hub-layout folder")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpu", default="h100", help="h100, h200 (calibrated GPU types) or cpu (memory only)")
    p.add_argument("--gpu-memory", type=float, default=None, metavar="GIB",
                   help="memory of one GPU in GiB (default: the GPU type's, 79.2 for an H100 80GB, 139.8 for an H200)")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (packed row)")
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per GPU and micro-batch (default: the planner picks)")
    p.add_argument("--global-batch", type=int, default=None,
                   help="sequences per optimizer step over all GPUs (gives the gradient accumulation)")
    p.add_argument("--lora-rank", type=int, default=0, help="LoRA of this rank on attention and experts (0: full fine-tuning)")
    p.add_argument("--fp8", action="store_true", help="FP8 GEMMs (priced from measured H100 steps: slower than bf16 at 4k tokens a step, level at 16k)")
    p.add_argument("--recompute", choices=RECOMPUTE, default="auto", help="activation checkpointing (auto: the planner picks)")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel size (default: the planner picks)")
    p.add_argument("--dense-parallel", choices=("fsdp", "replicate"), default=None)
    p.add_argument("--precision", choices=PRECISIONS, default="bf16",
                   help="bf16 parameters and AdamW states (training.precision bf16), or fp32_master (bf16_autocast)")
    p.add_argument("--routing", choices=ROUTING, default="real", help="expert GEMM rates of real or balanced routing")
    p.add_argument("--layers", type=int, default=None, help="plan the model cut to its first N layers")
    p.add_argument("--no-cuda-graph", action="store_true", help="eager steps only")
    p.add_argument("--alternatives", type=int, default=3, help="how many other fitting settings to list")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def request_from_args(args: argparse.Namespace) -> PlanRequest:
    return PlanRequest(
        model=args.model, gpus_per_node=args.gpus_per_node, nodes=args.nodes, gpu=args.gpu,
        gpu_memory_gib=args.gpu_memory, seq_len=args.seq_len, micro_batch=args.micro_batch,
        global_batch=args.global_batch, lora_rank=args.lora_rank, fp8=args.fp8, recompute=args.recompute, ep=args.ep,
        dense_parallel=args.dense_parallel, precision=args.precision, routing=args.routing, layers=args.layers,
        cuda_graph=False if args.no_cuda_graph else None,
    )


def main(argv: list[str]) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        plan = make_plan(request_from_args(args))
    except ValueError as error:
        print(f"moetune plan: error: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan_to_dict(plan, alternatives=args.alternatives), indent=2))
    else:
        print(format_plan(plan, alternatives=args.alternatives))
    return 0 if plan.fits else 1
