"""Worker of the merged-LoRA export under expert parallelism, run in spawned gloo processes by
tests/distributed/test_expert_parallel.py (2 and 4 ranks)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import distribute_tensor

from tests.distributed.helpers import read_safetensors


def merged_lora_export(rank: int, world_size: int, folder: str, out: str, *, ep: int, **options) -> None:
    """``merged_state_dict`` of a LoRA model sharded by expert parallelism (+ FSDP2 or replicated
    dense parameters) and saved with ``save_pretrained(state_dict=...)`` equals one process's
    ``merge_lora`` + save, also where FSDP2 wraps the experts (ep < world), which ``merge_lora``
    itself cannot undo; the sharded model keeps its adapters."""
    import moetune
    from moetune.lora import LoraSettings, apply_lora, lora_parameters, merge_lora, merged_state_dict

    settings = LoraSettings(rank=2)
    model = moetune.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, ep_size=ep, lora=settings, **options)
    ref = apply_lora(moetune.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), settings)
    generator = torch.Generator().manual_seed(5)  # the same adapters on every rank and in the reference
    ref_params = dict(ref.named_parameters())
    with torch.no_grad():
        for name, param in lora_parameters(model):
            full = torch.randn(param.shape, generator=generator) * 0.1
            ref_params[name].copy_(full)
            param.copy_(distribute_tensor(full, param.device_mesh, param.placements) if hasattr(param, "to_local") else full)
    where = Path(out) / f"merged_ep{ep}_{world_size}_{options.get('dense_parallel', 'fsdp')}"
    model.save_pretrained(where / "ep", is_main_process=rank == 0, state_dict=merged_state_dict(model))
    assert any(True for _ in lora_parameters(model)), "merged_state_dict removed the adapters"
    dist.barrier()
    if rank == 0:
        merge_lora(ref).save_pretrained(where / "single")
        got, expected = read_safetensors(where / "ep"), read_safetensors(where / "single")
        assert got.keys() == expected.keys(), sorted(got.keys() ^ expected.keys())[:5]
        for key, value in expected.items():
            torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-6, msg=f"merged export: {key}")
    dist.barrier()
