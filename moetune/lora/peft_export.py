"""Export moetune adapters as a PEFT LoRA adapter for the plain Transformers v5 model.

Writes `adapter_config.json` + `adapter_model.safetensors` as `peft` writes them, so
`PeftModel.from_pretrained(transformers_model, out_dir)` loads them; key names and layouts are in
peft_format.py. Scaling is lora_alpha / r on both sides (no rsLoRA).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from moetune.lora.apply import SETTINGS_ATTR
from moetune.lora.experts import adapted_params, is_lora_experts
from moetune.lora.peft_format import peft_entries, to_peft
from moetune.lora.settings import LoraSettings

if TYPE_CHECKING:
    from peft import LoraConfig


def peft_adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters under PEFT's serialized names and layouts (contiguous, on CPU)."""
    return {entry.key: to_peft(entry) for entry in peft_entries(model)}


def peft_target_parameters(model: nn.Module) -> list[str]:
    """PEFT `target_parameters` for the adapted expert weights (`experts.gate_up_proj`, ...);
    PEFT matches them as dotted suffixes of parameter names."""
    targets = []
    for name, module in model.named_modules():
        if is_lora_experts(module):
            leaf = name.rpartition(".")[2]
            targets += [f"{leaf}.{pname}" for pname in adapted_params(module) if f"{leaf}.{pname}" not in targets]
    return targets


def _peft_lora_config(model: nn.Module, settings: LoraSettings, base_model_name_or_path: str | None) -> LoraConfig:
    try:
        from peft import LoraConfig
    except ImportError as err:  # peft is an optional dependency (extras "recipe" / "test")
        raise ImportError("export_peft_adapter needs the `peft` package: pip install peft") from err
    target_parameters = peft_target_parameters(model)
    return LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        # PEFT's expert wrapper refuses dropout != 0; dropout does nothing at inference anyway.
        lora_dropout=0.0 if target_parameters else settings.dropout,
        target_modules=list(settings.target_modules),
        target_parameters=target_parameters or None,
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model_name_or_path,
        inference_mode=True,
    )


def _check_peft_keeps_targets(model: nn.Module, config: LoraConfig) -> None:
    """PEFT on Transformers v5 rewrites v4 expert names in target_modules (`gate_proj`, `up_proj`,
    `down_proj`, `w1`..`w3`, `gate`) into expert target_parameters for MoE model types whose
    checkpoints it converts (Qwen3-MoE, DeepSeek-V3, Mixtral, ...). An adapter on a dense MLP or a
    shared expert with such a name would then load onto the wrong weight: refuse to export it."""
    try:
        from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
    except ImportError:  # older peft (Transformers v4 era) does not rewrite
        return
    probe = copy.deepcopy(config)
    convert_peft_config_for_transformers(probe, model=model, conversions=None)
    rewritten = set(config.target_modules) - set(probe.target_modules)
    if rewritten:
        raise ValueError(
            f"LoraSettings.target_modules {sorted(rewritten)}: peft re-targets these names to the grouped "
            f"experts of a {model.config.model_type} model when loading, so a PEFT adapter cannot carry them; "
            "merge them (merge_lora) or adapt only attention modules"
        )


def export_peft_adapter(model: nn.Module, out_dir: str | Path, *, base_model_name_or_path: str | None = None) -> Path:
    """Write the adapters of `model` (after `apply_lora`) as a PEFT adapter directory; returns it.

    `base_model_name_or_path` is recorded in adapter_config.json (PEFT's field of that name) so
    `AutoPeftModelForCausalLM.from_pretrained(out_dir)` knows which base model to load. With expert
    parallelism call it on every rank (the experts' adapters are gathered); rank 0 writes.
    """
    settings = getattr(model, SETTINGS_ATTR, None)
    if settings is None:
        raise ValueError("export_peft_adapter: the model has no LoRA adapters (apply_lora first)")
    config = _peft_lora_config(model, settings, base_model_name_or_path)
    if hasattr(getattr(model, "config", None), "model_type"):
        _check_peft_keeps_targets(model, config)
    tensors = peft_adapter_state_dict(model)
    out = Path(out_dir)
    if dist.is_initialized() and dist.get_rank() != 0:
        return out
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out))
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out
