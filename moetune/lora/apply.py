"""apply_lora / merge_lora / lora_state_dict: adapters on a plain model, no wrapper classes.

After `apply_lora` the model is the same object with the same module paths and base parameter
names; the adapters are extra parameters whose names start with `lora_` and are the only ones
with `requires_grad=True`, so any optimizer, `Trainer` or FSDP wrapping works unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from functools import partial

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from moetune.lora.experts import (
    adapted_params,
    add_expert_adapters,
    expert_delta,
    is_lora_experts,
    lora_a_name,
    lora_b_name,
    merge_expert_adapters,
    remove_expert_adapters,
)
from moetune.lora.init import fold_delta, reset_adapter_
from moetune.lora.linear import (
    LORA_A,
    LORA_B,
    add_linear_adapter,
    is_lora_linear,
    linear_delta,
    merge_linear_adapter,
    remove_linear_adapter,
)
from moetune.lora.settings import LoraSettings

# 3-D expert weights in Transformers v5 naming (gated experts, ungated experts such as Nemotron-H's).
EXPERT_WEIGHT_NAMES = ("gate_up_proj", "up_proj", "down_proj")
# Set on the model by apply_lora; read by export_peft_adapter.
SETTINGS_ATTR = "moetune_lora_settings"


def _matches(name: str, suffix: str) -> bool:
    return name == suffix or name.endswith("." + suffix)


def find_linear_targets(model: nn.Module, target_modules: list[str]) -> dict[str, nn.Module]:
    """Modules whose dotted name ends with one of `target_modules` (PEFT's suffix rule)."""
    found = {
        name: module
        for name, module in model.named_modules()
        if name and any(_matches(name, suffix) for suffix in target_modules)
    }
    for suffix in target_modules:
        if not any(_matches(name, suffix) for name in found):
            raise ValueError(f"LoraSettings.target_modules: no module name ends with {suffix!r}")
    get_output_embeddings = getattr(model, "get_output_embeddings", None)
    lm_head = get_output_embeddings() if callable(get_output_embeddings) else None
    for name, module in found.items():
        if lm_head is not None and module is lm_head:
            # moetune's fused LM-head loss reads lm_head.weight directly, so a forward hook would
            # change generation but not the training loss.
            raise ValueError(f"LoraSettings.target_modules: {name} is the LM head, which LoRA does not support")
        if not isinstance(module, nn.Linear):
            raise TypeError(
                f"LoraSettings.target_modules: {name} is a {type(module).__name__}, not nn.Linear "
                "(grouped experts are adapted with target_experts=True)"
            )
    return found


def find_expert_targets(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Modules holding 3-D expert weights -> those weights' names, in registration order.

    Registration order matters: PEFT nests one wrapper per targeted parameter in this order, and
    the exported key names follow the nesting (see peft_format.py).
    """
    found: dict[str, tuple[str, ...]] = {}
    for name, module in model.named_modules():
        names = tuple(
            pname
            for pname, param in module.named_parameters(recurse=False)
            if pname in EXPERT_WEIGHT_NAMES and param.dim() == 3
        )
        if names:
            found[name] = names
    return found


def apply_lora(model: nn.Module, settings: LoraSettings) -> nn.Module:
    """Freeze every base parameter and add adapters; returns `model` (modified in place)."""
    if getattr(model, SETTINGS_ATTR, None) is not None:
        raise ValueError("apply_lora: the model already has LoRA adapters (merge_lora first)")
    if any(isinstance(module, FSDPModule) for module in model.modules()):
        # FSDP2 only manages parameters that exist when fully_shard runs.
        raise ValueError("apply_lora: the model is already wrapped by FSDP2; apply LoRA before fully_shard")
    linear_targets = find_linear_targets(model, settings.target_modules) if settings.target_modules else {}
    expert_targets = find_expert_targets(model) if settings.target_experts else {}
    if settings.target_experts and not expert_targets:
        raise ValueError("LoraSettings.target_experts is True but the model has no grouped expert weights")
    for param in model.parameters():
        param.requires_grad_(False)
    common = {"rank": settings.rank, "scaling": settings.scaling, "dtype": settings.torch_dtype}
    for module in linear_targets.values():
        add_linear_adapter(module, dropout=settings.dropout, **common)
    for name, param_names in expert_targets.items():
        add_expert_adapters(model.get_submodule(name), param_names, **common)
    setattr(model, SETTINGS_ATTR, settings)
    return model


def reset_lora_parameters(model: nn.Module) -> None:
    """Re-initialise every adapter (A uniform, B zero): for a model that `apply_lora` saw on the meta
    device and that was materialised afterwards (`to_empty` leaves the adapters uninitialised)."""
    for module in model.modules():
        if is_lora_linear(module):
            reset_adapter_(getattr(module, LORA_A), getattr(module, LORA_B))
        elif is_lora_experts(module):
            for name in adapted_params(module):
                reset_adapter_(module._parameters[lora_a_name(name)], module._parameters[lora_b_name(name)])


def is_lora_param_name(name: str) -> bool:
    return name.rpartition(".")[2].startswith("lora_")


def lora_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    return ((name, p) for name, p in model.named_parameters() if is_lora_param_name(name))


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters only, under moetune's names (`...q_proj.lora_A`, `...experts.lora_B_down_proj`)."""
    return {name: p.detach() for name, p in lora_parameters(model)}


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight and remove it; all parameters become trainable again.

    The result is a plain model: `model.save_pretrained(dir)` writes a full checkpoint that plain
    Transformers loads.
    """
    return _drop_adapters(model, merge=True, caller="merge_lora")


def merged_state_dict(model: nn.Module) -> Mapping[str, torch.Tensor]:
    """``model``'s state dict with every adapter folded into its base weight and the adapters left
    out, without changing the model: what ``merge_lora(model).state_dict()`` would hold. Works where
    ``merge_lora`` cannot remove adapters (modules that FSDP2 wrapped after ``apply_lora``, e.g. the
    experts under expert parallelism over fewer ranks than the world); sharded weights stay DTensors,
    which ``save_pretrained(..., state_dict=...)`` gathers one by one (every rank calls it). A
    read-only mapping that folds each adapted weight when it is read, so a streaming save holds one
    merged tensor at a time, not a second copy of every adapted weight."""
    if getattr(model, SETTINGS_ATTR, None) is None:
        raise ValueError("merged_state_dict: the model has no LoRA adapters (apply_lora first)")
    folds: dict[str, Callable[[], torch.Tensor]] = {}
    for prefix, module in model.named_modules():
        if is_lora_linear(module):
            folds[_join(prefix, "weight")] = partial(_fold_linear, module)
        elif is_lora_experts(module):
            for name in adapted_params(module):
                folds[_join(prefix, name)] = partial(_fold_experts, module, name)
    state = {name: tensor for name, tensor in model.state_dict().items() if not is_lora_param_name(name)}
    missing = sorted(set(folds) - set(state))
    assert not missing, f"merged_state_dict: adapted weights missing from the state dict: {missing[:3]}"
    return _FoldedStateDict(state, folds)


class _FoldedStateDict(Mapping):
    def __init__(self, state: dict[str, torch.Tensor], folds: dict[str, Callable[[], torch.Tensor]]) -> None:
        self._state, self._folds = state, folds

    def __getitem__(self, name: str) -> torch.Tensor:
        fold = self._folds.get(name)
        return self._state[name] if fold is None else fold()

    def __iter__(self) -> Iterator[str]:
        return iter(self._state)

    def __len__(self) -> int:
        return len(self._state)


def _fold_linear(module: nn.Module) -> torch.Tensor:
    return fold_delta(module.weight, linear_delta(module))


def _fold_experts(module: nn.Module, name: str) -> torch.Tensor:
    return fold_delta(module._parameters[name], expert_delta(module, name))


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def remove_lora(model: nn.Module) -> nn.Module:
    """Remove every adapter without merging it (the base model again, all parameters trainable)."""
    return _drop_adapters(model, merge=False, caller="remove_lora")


def _drop_adapters(model: nn.Module, *, merge: bool, caller: str) -> nn.Module:
    if getattr(model, SETTINGS_ATTR, None) is None:
        raise ValueError(f"{caller}: the model has no LoRA adapters (apply_lora first)")
    for module in list(model.modules()):
        if is_lora_linear(module):
            (merge_linear_adapter if merge else remove_linear_adapter)(module)
        elif is_lora_experts(module):
            (merge_expert_adapters if merge else remove_expert_adapters)(module)
    for param in model.parameters():
        param.requires_grad_(True)
    delattr(model, SETTINGS_ATTR)
    return model
