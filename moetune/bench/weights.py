"""The benchmark's weights: every parameter drawn from a generator seeded by (seed, name).

Both sides of a benchmark have the same parameter names and shapes, so ``init_weights`` gives them
identical weights without a copy, sharded or not; the LoRA adapters (``moetune.bench.lora``) are
drawn the same way. Used by ``moetune.bench.models`` and ``moetune.bench.lora``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

INIT_STD = 0.02


def _param_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _draw(seed: int, name: str, shape: torch.Size, device: torch.device) -> torch.Tensor:
    generator = torch.Generator(device=device).manual_seed(_param_seed(seed, name))
    return torch.empty(shape, dtype=torch.float32, device=device).normal_(0.0, INIT_STD, generator=generator)


def _is_norm_weight(name: str, param: torch.Tensor) -> bool:
    module = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
    return param.dim() == 1 and "norm" in module


@torch.no_grad()
def init_weights(model: nn.Module, *, seed: int, round_to: torch.dtype | None = None,
                 parameters: Iterable[tuple[str, nn.Parameter]] | None = None) -> None:
    """Deterministic init: for each parameter in sorted name order, normal(0, 0.02) from a generator
    seeded by (seed, name) (norm weights ones, other 1-D parameters zeros).

    Values are drawn in fp32 on the parameter's device, optionally rounded through ``round_to``
    (an fp32 reference built with ``round_to=torch.bfloat16`` holds exactly the bf16 model's
    weights), then cast to the parameter's dtype. Sharded (DTensor) parameters receive their
    local block of the full tensor, so sharded and unsharded models get the same weights.
    ``parameters``: (name, parameter) pairs to draw instead of all of ``model``'s (e.g. LoRA adapters
    added after the weights).
    """
    for name, param in sorted(model.named_parameters() if parameters is None else parameters, key=lambda np: np[0]):
        local = param.to_local() if hasattr(param, "to_local") else param
        device = local.device
        if _is_norm_weight(name, param):
            full = torch.ones(param.shape, dtype=torch.float32, device=device)
        elif param.dim() == 1:
            full = torch.zeros(param.shape, dtype=torch.float32, device=device)
        else:
            full = _draw(seed, name, param.shape, device)
        if round_to is not None:
            full = full.to(round_to).float()
        full = full.to(param.dtype)
        if local is param:
            param.copy_(full)
        else:
            local.copy_(_local_block(full, param))
        del full


@torch.no_grad()
def sharded_weights_match(model: nn.Module, *, seed: int) -> bool:
    """Whether every sharded (DTensor) parameter gathers back to exactly what ``init_weights`` drew
    (a check of ``_local_block`` on placements such as FSDP2-over-EP's ``_StridedShard``)."""
    for name, param in sorted(model.named_parameters()):
        if not hasattr(param, "full_tensor") or _is_norm_weight(name, param) or param.dim() == 1:
            continue
        full = _draw(seed, name, param.shape, param.to_local().device)
        if not torch.equal(param.full_tensor(), full.to(param.dtype)):
            return False
    return True


def _local_block(full: torch.Tensor, param: Any) -> torch.Tensor:
    """This rank's block of a DTensor parameter, cut locally from the full tensor (every rank drew
    the same values, so no communication is needed)."""
    from torch.distributed.tensor import distribute_tensor

    try:
        sharded = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    except TypeError:  # torch without src_data_rank: scatter from rank 0 (same values anyway)
        sharded = distribute_tensor(full, param.device_mesh, param.placements)
    return sharded.to_local()
