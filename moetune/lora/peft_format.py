"""PEFT's serialized LoRA format: key names and tensor layouts, both directions.

Shape legend: E experts, R rank, O / I out / in features of the adapted weight.

- Linear `X`: `base_model.model.X.lora_A.weight` = A [R, I], `...lora_B.weight` = B [O, R], as is.
- Expert weight `P` of module `M` (PEFT's ParamWrapper, `target_parameters`): one nn.Linear pair
  per weight, lora_A.weight [E*R, I] with row e*R + r and lora_B.weight [O, R*E] with column
  r*E + e (ParamWrapper.get_delta_weight: A.reshape(E, R, I), B.reshape(O, R, E)). PEFT nests one
  wrapper per targeted weight in the module's parameter order, the first innermost, so the k-th of
  n weights is under `M.` + `base_layer.` * (n - 1 - k): for Qwen3-MoE
  `mlp.experts.base_layer.lora_A.weight` is gate_up_proj's and `mlp.experts.lora_A.weight` is
  down_proj's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from moetune.lora.experts import adapted_params, is_lora_experts, lora_a_name, lora_b_name
from moetune.lora.linear import LORA_A, LORA_B, is_lora_linear

PREFIX = "base_model.model."


@dataclass(frozen=True)
class PeftEntry:
    """One adapter tensor: its PEFT key, the moetune parameter and how the layouts differ."""

    key: str
    param: nn.Parameter
    layout: Literal["same", "expert_A", "expert_B"]


def peft_entries(model: nn.Module) -> list[PeftEntry]:
    entries = []
    for name, module in model.named_modules():
        prefix = f"{PREFIX}{name}." if name else PREFIX
        if is_lora_linear(module):
            entries.append(PeftEntry(prefix + "lora_A.weight", getattr(module, LORA_A), "same"))
            entries.append(PeftEntry(prefix + "lora_B.weight", getattr(module, LORA_B), "same"))
        elif is_lora_experts(module):
            params = adapted_params(module)
            for index, pname in enumerate(params):
                key = prefix + "base_layer." * (len(params) - 1 - index)
                entries.append(PeftEntry(key + "lora_A.weight", module._parameters[lora_a_name(pname)], "expert_A"))
                entries.append(PeftEntry(key + "lora_B.weight", module._parameters[lora_b_name(pname)], "expert_B"))
    return entries


def to_peft(entry: PeftEntry) -> torch.Tensor:
    """The full (gathered) adapter in PEFT's layout, contiguous, on CPU."""
    value = entry.param.detach()
    # Expert-parallel adapters are DTensors: gather every expert (a collective: call on all ranks).
    value = value.full_tensor() if isinstance(value, DTensor) else value
    if entry.layout == "expert_A":  # [E, R, I] -> [E*R, I]
        value = value.reshape(-1, value.shape[-1])
    elif entry.layout == "expert_B":  # [E, O, R] -> [O, R, E] -> [O, R*E]
        value = value.permute(1, 2, 0).reshape(value.shape[1], -1)
    return value.to("cpu").contiguous()


@torch.no_grad()
def load_from_peft(entry: PeftEntry, value: torch.Tensor) -> None:
    """Copy a PEFT-layout tensor into the adapter parameter (its shard, for a DTensor)."""
    param = entry.param
    if entry.layout == "expert_A":  # [E*R, I] -> [E, R, I]
        value = value.reshape(param.shape)
    elif entry.layout == "expert_B":  # [O, R*E] -> [O, R, E] -> [E, O, R]
        num_experts, out_features, rank = param.shape
        value = value.reshape(out_features, rank, num_experts).permute(2, 0, 1)
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(f"PEFT tensor {entry.key}: shape {tuple(value.shape)} does not fit {tuple(param.shape)}")
    value = value.to(device=param.device, dtype=param.dtype)
    if isinstance(param, DTensor):
        value = distribute_tensor(value, param.device_mesh, param.placements)
    param.copy_(value)
