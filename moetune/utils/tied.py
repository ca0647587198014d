"""Parameters shared between modules (a tied LM head and input embedding)."""

from __future__ import annotations

import torch
from torch import nn


def tied_pairs(model: nn.Module) -> dict[str, str]:
    """Each parameter name that shares its tensor with an earlier one -> that earlier name."""
    first: dict[int, str] = {}
    pairs: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            pairs[name] = first[id(param)]
        else:
            first[id(param)] = name
    return pairs


def share(model: nn.Module, target: str, source: str) -> None:
    """Make parameter ``target`` the same tensor as parameter ``source``."""
    module_name, _, attr = target.rpartition(".")
    setattr(model.get_submodule(module_name), attr, model.get_parameter(source))


def untie(model: nn.Module, target: str) -> None:
    """Give parameter ``target`` a tensor of its own (same shape, dtype, device and ``requires_grad``,
    uninitialised)."""
    module_name, _, attr = target.rpartition(".")
    module = model.get_submodule(module_name)
    shared = getattr(module, attr)
    setattr(module, attr, nn.Parameter(torch.empty_like(shared), requires_grad=shared.requires_grad))
