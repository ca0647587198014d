"""Final export in the Hugging Face layout: the full model, or a PEFT adapter plus a merged model."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from moetune.distributed.mesh import is_sharded_by_moetune
from moetune.recipe.distributed_setup import Runtime, barrier


def export_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out_dir: Path, *,
                 runtime: Runtime, state_dict: dict[str, torch.Tensor] | None = None) -> Path:
    """``save_pretrained`` of the whole model (gathered from all ranks under FSDP2) and tokenizer:
    a folder that ``transformers.AutoModelForCausalLM.from_pretrained`` loads. ``state_dict`` (a
    model sharded by moetune only): what to write instead of the model's own (merged adapters)."""
    if is_sharded_by_moetune(model):
        # Sharded by moetune: its save_pretrained gathers parameter by parameter on every rank.
        model.save_pretrained(out_dir, is_main_process=runtime.is_main, state_dict=state_dict)
        if runtime.is_main:
            tokenizer.save_pretrained(out_dir)
        barrier(runtime)
        return out_dir
    state_dict = None
    if runtime.distributed:
        # Collective: every rank takes part, rank 0 receives the full tensors on the CPU.
        state_dict = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if runtime.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out_dir, state_dict=state_dict)
        tokenizer.save_pretrained(out_dir)
    barrier(runtime)
    return out_dir


def export_lora(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, output_dir: Path, *,
                base_model_name_or_path: str, merged: bool, runtime: Runtime) -> dict[str, Path]:
    """The adapters as a PEFT adapter (``adapter/``), and optionally the merged model (``final/``)."""
    from moetune.lora import export_peft_adapter, merge_lora, merged_state_dict

    # Collective under expert parallelism / FSDP2: every rank gathers its adapter shards, rank 0 writes.
    paths = {"adapter": export_peft_adapter(model, output_dir / "adapter",
                                            base_model_name_or_path=base_model_name_or_path)}
    if runtime.is_main:
        tokenizer.save_pretrained(output_dir / "adapter")
    barrier(runtime)
    if merged and is_sharded_by_moetune(model):
        # Sharded by moetune (expert parallelism): the adapters folded into a state dict of DTensors
        # that save_pretrained gathers; the model itself stays as it is (FSDP2 may wrap the experts).
        paths["merged"] = export_model(model, tokenizer, output_dir / "final", runtime=runtime,
                                       state_dict=merged_state_dict(model))
    elif merged:
        with torch.no_grad():
            merged_model = merge_lora(model)
        paths["merged"] = export_model(merged_model, tokenizer, output_dir / "final", runtime=runtime)
    return paths
