"""Which eager work before a capture breaks the CUDA-graph capture of the expert-parallel step?

    torchrun --nproc-per-node 2 benchmarks/probes/ep_capture_probe.py --before none full_tensor clip sgd ref all

For each variant (one process group, one model each): two eager training steps of a tiny
Qwen3-MoE with ``ep_dispatch="allgather"``, ``dense_parallel="replicate"`` that also do the named
extra work, then ``CUDAGraphTrainStep`` (one eager warm-up, capture, two replays). Prints one
``RESULT`` line per variant: PASS, or FAIL with the error. Found while checking ep_parity.py, whose
capture failed after its eager parity steps ("operation would make the legacy stream depend on a
capturing blocking stream") but not before them.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
import moetune  # noqa: E402
from moetune.distributed import clip_grad_norm_  # noqa: E402
from moetune.optim import AdamW  # noqa: E402
from moetune.training import CUDAGraphTrainStep  # noqa: E402

VARIANTS = ("none", "full_tensor", "clip", "sgd", "ref", "all")


def tiny_config() -> transformers.Qwen3MoeConfig:
    return transformers.Qwen3MoeConfig(
        vocab_size=8192, hidden_size=512, intermediate_size=1536, moe_intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_experts=32, num_experts_per_tok=4,
        output_router_logits=False, tie_word_embeddings=False,
    )  # fmt: skip


def batch(step: int, rank: int, device) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    ids = torch.randint(0, 8192, (2, 512), generator=gen).to(device)
    return {"input_ids": ids, "labels": ids}


def probe(variant: str, rank: int, device) -> str:
    torch.manual_seed(0)
    model = moetune.AutoModelForCausalLM.from_config(
        tiny_config(), dtype=torch.bfloat16, ep_size=dist.get_world_size(), ep_dispatch="allgather",
        dense_parallel="replicate",
    ).train()  # fmt: skip
    extra = {variant} if variant != "all" else set(VARIANTS)
    sgd = torch.optim.SGD(model.parameters(), lr=1e-3, foreach=False)
    ref = transformers.Qwen3MoeForCausalLM(tiny_config()).to(device, torch.bfloat16) if "ref" in extra else None
    for step in range(2):
        model(**batch(step, rank, device)).loss.backward()
        if "full_tensor" in extra:
            for param in model.parameters():
                grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
                assert torch.isfinite(grad).all()
        if "clip" in extra:
            clip_grad_norm_(model, 1.0)
        if "sgd" in extra:
            sgd.step()
        if ref is not None:
            ref(**batch(step, rank, device)).loss.backward()
        model.zero_grad(set_to_none=True)
    del ref, sgd
    optimizer = AdamW(model.parameters(), lr=1e-5, capturable=True)
    step = CUDAGraphTrainStep(model, optimizer, warmup_steps=1)
    try:
        losses = [step(**batch(10, rank, device)).item() for _ in range(4)]
    except Exception as error:  # noqa: BLE001 -- report and go on to the next variant
        return f"FAIL {type(error).__name__}: {str(error).splitlines()[0][:160]}"
    return f"PASS losses {[round(x, 4) for x in losses]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    args = parser.parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    for variant in args.before:
        result = probe(variant, rank, device)
        if rank == 0:
            print(f"RESULT ep_capture_probe before={variant}: {result}", flush=True)
        if result.startswith("FAIL"):
            break  # a failed capture leaves the CUDA context unusable for the next variant
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
