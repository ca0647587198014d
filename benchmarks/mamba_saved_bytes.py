"""What one Nemotron-H Mamba-2 block keeps for its backward, tensor by tensor, next to the planner's count.

    python benchmarks/mamba_saved_bytes.py --seq-len 2048            # CPU, about a minute
    python benchmarks/mamba_saved_bytes.py --seq-len 2048 --eager    # without torch.compile
    python benchmarks/mamba_saved_bytes.py --seq-len 2048 --frozen   # weights frozen, as under LoRA

Builds one Mamba-2 block of Nemotron 3 Nano (moetune/assets/configs) in bf16, runs its training
forward under ``torch.autograd.graph.saved_tensors_hooks`` and sums the distinct storages it saves
(the parameters and the block's input excluded). By default the convolution, the chunked scan and the
gated norm run through ``torch.compile``, as they do on CUDA; on CPU Inductor may keep other
intermediates than on a GPU, so the count approximates the GPU's (``plan_validation.py`` measures the
GPU's total). Prints bytes per token, the largest tensors, and what ``moetune.plan.activations`` counts
for the same block (its ``none`` activations without the block's input).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import moetune.layers.mamba2 as mamba2
import moetune.models.nemotron_h.model as nemotron_h
from moetune.plan.activations import layer_activations
from moetune.plan.inventory import LayerShape, _mamba_shape

CONFIG = Path(__file__).resolve().parent.parent / "moetune/assets/configs/nemotron_3_nano_30b_a3b.json"


def compile_as_on_cuda() -> None:
    """The convolution, the scan and the gated norm compiled on any device (CUDA's default)."""
    mamba2._causal_conv1d = torch.compile(mamba2._causal_conv1d, dynamic=False, fullgraph=True)
    mamba2._chunked_scan = torch.compile(mamba2._chunked_scan, dynamic=False, fullgraph=True)
    compiled_norms = {}

    def gated_rms_norm(norm, y, gate):
        forward = compiled_norms.setdefault(type(norm), torch.compile(type(norm).forward, dynamic=False, fullgraph=True))
        return forward(norm, y, gate)

    nemotron_h.gated_rms_norm = gated_rms_norm


def saved_storages(block: torch.nn.Module, seq_len: int, hidden: int) -> dict[int, tuple[tuple[int, ...], torch.dtype, int]]:
    """data_ptr -> (shape, dtype, storage bytes) of every storage the forward saves for the backward."""
    x = torch.randn(1, seq_len, hidden, dtype=torch.bfloat16, requires_grad=True)
    saved: dict[int, tuple[tuple[int, ...], torch.dtype, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        saved.setdefault(storage.data_ptr(), (tuple(t.shape), t.dtype, storage.nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, position_ids=torch.arange(seq_len)[None])
    excluded = {p.untyped_storage().data_ptr() for p in block.parameters()} | {x.untyped_storage().data_ptr()}
    return {ptr: entry for ptr, entry in saved.items() if ptr not in excluded}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--eager", action="store_true", help="without torch.compile (CPU's default path)")
    parser.add_argument("--frozen", action="store_true", help="the block's weights frozen (LoRA's base)")
    parser.add_argument("--top", type=int, default=12, help="largest tensors to list")
    args = parser.parse_args(argv)
    from transformers.models.nemotron_h.configuration_nemotron_h import NemotronHConfig

    fields = json.loads(CONFIG.read_text())
    fields.update(num_hidden_layers=1, hybrid_override_pattern="M")
    fields.pop("layers_block_type", None)
    config = NemotronHConfig(**fields)
    if not args.eager:
        compile_as_on_cuda()
    torch.manual_seed(0)
    block = nemotron_h.NemotronHBlock(config, 0).to(torch.bfloat16).requires_grad_(not args.frozen)
    saved = saved_storages(block, args.seq_len, config.hidden_size)
    total = sum(nbytes for _, _, nbytes in saved.values()) / args.seq_len
    layer = LayerShape(index=0, hidden=config.hidden_size, norms=1, mamba=_mamba_shape(block.mixer))
    acts = layer_activations(layer, act_bytes=2, lora_rank=1 if args.frozen else 0, seq_len=args.seq_len)
    planned = acts.none - layer.norms * layer.hidden * 2  # without the block's input, which the count leaves out
    mode = ("eager" if args.eager else "compiled") + (", frozen" if args.frozen else "")
    print(f"Mamba-2 block, {args.seq_len} tokens, {mode}: saves {total:,.0f} B/token; the planner counts {planned:,.0f} B/token")
    for shape_, dtype, nbytes in sorted(saved.values(), key=lambda entry: -entry[2])[: args.top]:
        print(f"  {nbytes / args.seq_len:10,.0f} B/token  {list(shape_)} {str(dtype).removeprefix('torch.')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
