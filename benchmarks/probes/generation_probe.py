"""Greedy generation on an expert-parallel, FSDP2-sharded model, with and without
``moetune.distributed.gathered_for_inference`` (the recipe's held-out evaluation): seconds per
generated token, and whether the tokens agree. Run under torchrun on 2 GPUs:

    torchrun --nproc-per-node 2 benchmarks/probes/generation_probe.py --layers 8 --new-tokens 32

Qwen3-30B-A3B layer shapes (random init, bf16), ep = world, the non-expert parameters FSDP2-sharded.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import transformers

import moetune
from moetune.bench.models import load_config
from moetune.distributed import gathered_for_inference


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="qwen3_30b_a3b", help="a shipped bench config (tiny: a CPU smoke test)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=64)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    _, config = load_config(args.config, layers=args.layers)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if cuda else torch.float32
    model = moetune.AutoModelForCausalLM.from_config(config, dtype=dtype, ep_size=dist.get_world_size()).eval()
    ids = torch.randint(0, config.vocab_size, (args.batch, args.prompt), generator=torch.Generator().manual_seed(1))
    ids = ids.to(next(model.parameters()).device)
    settings = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    results = {}
    for label in ("per_forward", "gathered", "per_forward", "gathered"):  # alternating; the first pair warms up
        sync()
        start = time.perf_counter()
        with torch.no_grad():
            if label == "gathered":
                with gathered_for_inference(model) as gathered:
                    assert gathered
                    out = model.generate(ids, **settings)
            else:
                out = model.generate(ids, **settings)
        sync()
        results[label] = {"s_per_token": (time.perf_counter() - start) / args.new_tokens, "tokens": out.tolist()}
    if rank == 0:
        same = results["gathered"]["tokens"] == results["per_forward"]["tokens"]
        print("RESULT generation_probe " + json.dumps({
            "layers": args.layers, "batch": args.batch, "prompt": args.prompt, "new_tokens": args.new_tokens,
            "ranks": dist.get_world_size(), "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__, "transformers": transformers.__version__,
            "commit": os.environ.get("MOETUNE_COMMIT", "unknown"),
            "ms_per_token_per_forward_gather": 1e3 * results["per_forward"]["s_per_token"],
            "ms_per_token_gathered_once": 1e3 * results["gathered"]["s_per_token"], "same_tokens": same,
        }), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
