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
    """``weight + delta`` computed in float32 and cast back to the weight's dtype (a new tensor)."""
    return (weight.detach().float() + delta.to(weight.device)).to(weight.dtype)
