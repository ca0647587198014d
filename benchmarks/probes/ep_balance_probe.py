"""How unevenly expert parallelism splits the routed rows over the ranks, layer by layer, with the
benchmark's real routing (a random-init router on random tokens), and what a load-balanced expert
placement (``moetune.distributed.placement``, the bench's ``--moetune-rebalance-experts``) would leave.

With the all-gather dispatcher every rank runs its experts on the routed copies of all ranks' tokens
and each MoE layer ends in a reduce-scatter, so each layer runs at the pace of the rank with the most
rows. This counts them for the contiguous placement (rank r holds experts [r*L, (r+1)*L)) and for a
balanced one (experts sorted by load, each to the rank with the fewest rows that has room: the
longest-processing-time rule with equal expert counts per rank).

    python benchmarks/probes/ep_balance_probe.py --layers 4 --ep 2 --out ep_balance_cpu.jsonl

CPU is enough (fp32, no gradients): 4 Qwen3-30B-A3B layers need ~11 GB.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import transformers

from moetune.bench.models import load_config
from moetune.distributed.placement import balanced_expert_order, rows_per_rank


def balanced_partition(loads: list[int], ranks: int) -> list[int]:
    """Rows per rank under moetune's load-balanced placement (``balanced_expert_order``)."""
    loads_E = torch.tensor(loads)
    return rows_per_rank(loads_E[balanced_expert_order(loads_E, ranks)], ranks).tolist()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    _, config = load_config("qwen3_30b_a3b", layers=args.layers)
    with torch.device(args.device):
        model = transformers.Qwen3MoeForCausalLM(config).eval()
    generator = torch.Generator(args.device).manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (args.ep, args.seq_len), device=args.device, generator=generator)
    counts: dict[int, torch.Tensor] = {}

    def count(layer: int):
        def hook(_module, _inputs, output):
            logits = output[0] if isinstance(output, tuple) else output
            chosen = torch.topk(logits.reshape(-1, logits.shape[-1]).float().softmax(-1), config.num_experts_per_tok, -1).indices
            counts[layer] = torch.bincount(chosen.reshape(-1), minlength=config.num_experts).cpu()
        return hook

    for index, layer in enumerate(model.model.layers):
        layer.mlp.gate.register_forward_hook(count(index))
    start = time.perf_counter()
    with torch.no_grad():
        model(input_ids=ids)  # every rank's tokens: the all-gather dispatcher sees them all
    rows = []
    for layer, loads in sorted(counts.items()):
        per_expert = loads.tolist()
        local = len(per_expert) // args.ep
        contiguous = [sum(per_expert[r * local:(r + 1) * local]) for r in range(args.ep)]
        balanced = balanced_partition(per_expert, args.ep)
        mean = sum(per_expert) / args.ep
        rows.append({"layer": layer, "ep": args.ep, "tokens_per_rank": args.seq_len, "max_expert_rows": max(per_expert),
                     "mean_expert_rows": sum(per_expert) / len(per_expert), "contiguous_rows_per_rank": contiguous,
                     "contiguous_max_over_mean": round(max(contiguous) / mean, 4), "balanced_rows_per_rank": balanced,
                     "balanced_max_over_mean": round(max(balanced) / mean, 4)})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    print(f"{len(rows)} layers in {time.perf_counter() - start:.0f} s on {args.device}")
    if args.out is not None:
        with args.out.open("a") as f:
            for row in rows:
                f.write(json.dumps({**row, "device": args.device, "torch": torch.__version__}) + "\n")


if __name__ == "__main__":
    main()
