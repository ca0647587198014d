"""Parameters shared between modules (a tied LM head and input embedding)."""

from __future__ import annotations

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
