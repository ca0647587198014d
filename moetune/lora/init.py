"""Adapter initialisation (PEFT's default) and merging, shared by Linear and expert adapters."""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, distribute_tensor


@torch.no_grad()
def reset_adapter_(lora_A: torch.Tensor, lora_B: torch.Tensor) -> None:
    """A ~ U(-1/sqrt(in), 1/sqrt(in)), B = 0, so a fresh adapter changes nothing.

    That bound is nn.Linear's kaiming_uniform_(a=sqrt(5)) with fan_in = in_features, PEFT's
    default; for expert adapters A [E, R, in] it is the same per expert.
    """
    bound = 1.0 / math.sqrt(lora_A.shape[-1])
    if isinstance(lora_A, DTensor):
        # Draw the global tensor and scatter rank 0's: replicas agree whatever each rank's RNG state.
        full = torch.empty(lora_A.shape, dtype=lora_A.dtype, device=lora_A.device).uniform_(-bound, bound)
        lora_A.copy_(distribute_tensor(full, lora_A.device_mesh, lora_A.placements))
    else:
        lora_A.uniform_(-bound, bound)
    lora_B.zero_()


@torch.no_grad()
def fold_delta(weight: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``weight + delta`` computed in float32 and cast back to the weight's dtype (a new tensor).

    DTensors placed alike add their local shards and keep the weight's placements (torch 2.9's
    DTensor add labels the sum of two ``_StridedShard`` tensors plain ``Shard``: see
    ``moetune.lora.experts.expert_delta``)."""
    if isinstance(weight, DTensor) and isinstance(delta, DTensor) and _placed_alike(weight, delta):
        local = (weight.to_local().float() + delta.to_local()).to(weight.dtype).contiguous()
        return DTensor.from_local(
            local, weight.device_mesh, weight.placements, run_check=False, shape=weight.shape, stride=weight.stride()
        )
    return (weight.detach().float() + delta.to(weight.device)).to(weight.dtype)


def _placed_alike(a: DTensor, b: DTensor) -> bool:
    return a.device_mesh == b.device_mesh and a.placements == b.placements and a.shape == b.shape
