"""Load a PEFT LoRA adapter (written by `peft` or by export_peft_adapter) into a moetune model.

The inverse of peft_export.py: adapter_config.json becomes LoraSettings, `apply_lora` creates the
adapters, and every tensor of adapter_model.safetensors is copied in (PEFT layouts in
peft_format.py). Only what moetune's LoRA expresses is accepted; anything else is a ValueError
naming the config field, never a silently different model.
"""

from __future__ import annotations

from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from moetune.utils.file_errors import unreadable_safetensors

from moetune.lora.apply import apply_lora, find_expert_targets, remove_lora
from moetune.lora.peft_format import load_from_peft, peft_entries
from moetune.lora.settings import LoraSettings
from moetune.utils.json_files import read_json

# Config fields moetune's LoRA has no equivalent for: each must be unset / false / empty.
_UNSUPPORTED_FIELDS = (
    "use_rslora", "use_dora", "lora_bias", "fan_in_fan_out", "rank_pattern", "alpha_pattern",
    "layers_to_transform", "layers_pattern", "modules_to_save", "exclude_modules", "trainable_token_indices",
)


def settings_from_peft_config(config: dict) -> LoraSettings:
    """LoraSettings equivalent to a PEFT adapter_config.json (a dict), or a ValueError."""
    if config.get("peft_type") != "LORA":
        raise ValueError(f"adapter_config.json: peft_type must be 'LORA', got {config.get('peft_type')!r}")
    for field in _UNSUPPORTED_FIELDS:
        if config.get(field):
            raise ValueError(f"adapter_config.json: {field}={config[field]!r} is not supported by moetune's LoRA")
    target_modules = config.get("target_modules") or []
    if isinstance(target_modules, str):
        raise ValueError(
            f"adapter_config.json: target_modules={target_modules!r} (a regex or 'all-linear') is not supported; "
            "list the module names"
        )
    return LoraSettings(
        rank=config["r"],
        alpha=config["lora_alpha"],
        dropout=config.get("lora_dropout", 0.0),
        target_modules=sorted(target_modules),
        target_experts=bool(config.get("target_parameters")),
    )


def _check_target_parameters(model: nn.Module, wanted: list[str]) -> None:
    # moetune adapts all expert weights or none; PEFT may target a subset (e.g. only down_proj).
    present = sorted({f"{name.rpartition('.')[2]}.{p}" for name, ps in find_expert_targets(model).items() for p in ps})

    def matches(a: str, b: str) -> bool:
        return a == b or a.endswith("." + b) or b.endswith("." + a)

    unmatched = [t for t in present if not any(matches(t, w) for w in wanted)]
    unknown = [w for w in wanted if not any(matches(t, w) for t in present)]
    if unmatched or unknown:
        raise ValueError(
            f"adapter_config.json: target_parameters={wanted} must name every grouped-expert weight of the model "
            f"({present}); moetune adapts all of them or none"
        )


def load_peft_adapter(model: nn.Module, adapter_dir: str | Path) -> nn.Module:
    """Add the adapters stored in `adapter_dir` to `model` (which must have none); returns `model`."""
    folder = Path(adapter_dir)
    config = read_json(folder / "adapter_config.json")
    settings = settings_from_peft_config(config)
    if settings.target_experts:
        _check_target_parameters(model, list(config["target_parameters"]))
    weights = folder / "adapter_model.safetensors"
    try:
        tensors = load_file(str(weights))
    except SafetensorError as err:
        raise ValueError(unreadable_safetensors(weights, err)) from None
    apply_lora(model, settings)
    entries = {entry.key: entry for entry in peft_entries(model)}
    missing, unexpected = sorted(set(entries) - set(tensors)), sorted(set(tensors) - set(entries))
    if missing or unexpected:
        remove_lora(model)  # leave the model as it came
        raise ValueError(
            f"{folder / 'adapter_model.safetensors'} does not match the adapters of adapter_config.json: "
            f"missing {missing[:4]}{'...' if len(missing) > 4 else ''}, "
            f"unexpected {unexpected[:4]}{'...' if len(unexpected) > 4 else ''}"
        )
    for key, entry in entries.items():
        load_from_peft(entry, tensors[key])
    return model
