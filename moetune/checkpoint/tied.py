"""Tied parameters (the LM head and the input embedding) against what a checkpoint holds, as
Transformers' ``from_pretrained`` resolves them.

A model built with ``tie_word_embeddings=True`` shares one tensor between the two. Transformers ties
symmetrically while loading:
- the checkpoint holds both, with different values: the config is wrong for these files, so it keeps
  them apart (with a warning), each loaded from its own tensor;
- it holds both with equal values (``.bin`` files store a tied tensor twice): tied.
Transformers also fills the shared tensor from the head when the files hold only the head; moetune's
loader reports the embedding as missing there instead (an error, before any weight is read).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from moetune.checkpoint.layout import CheckpointLayout
from moetune.utils.tied import share, tied_pairs, untie


def untie_where_both_are_held(model: nn.Module, tensors: dict, layout: CheckpointLayout) -> list[tuple[str, str]]:
    """Before loading (the model on any device, meta included): untie each pair the checkpoint holds
    both halves of. Returns the untied pairs, for ``retie_equal``."""
    held = {layout.canonical(key) for key in tensors}
    untied = []
    for target, source in tied_pairs(model).items():
        if target in held and source in held:
            untie(model, target)
            _forget_tie(model, target)
            untied.append((target, source))
    return untied


def retie_equal(model: nn.Module, untied: list[tuple[str, str]], source_name: str) -> None:
    """After loading: tie again the pairs whose two tensors came out equal; warn, as Transformers does,
    about those that differ (they stay apart)."""
    for target, source in untied:
        if _equal(model.get_parameter(target), model.get_parameter(source)):
            share(model, target, source)
            continue
        warnings.warn(
            f"the config of {source_name} ties {target} to {source} (tie_word_embeddings=True), but the checkpoint "
            "holds both with different values, so they were loaded apart and are not tied (as Transformers does); "
            "set tie_word_embeddings=False in the config to silence this",
            stacklevel=3,
        )


def _forget_tie(model: nn.Module, target: str) -> None:
    """Transformers' record of the ties (``all_tied_weights_keys``), which ``tie_weights`` re-applies."""
    keys = getattr(model, "all_tied_weights_keys", None)
    if isinstance(keys, dict):
        keys.pop(target, None)


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    full = [t.full_tensor() if hasattr(t, "full_tensor") else t for t in (a, b)]  # DTensors: whole tensors
    return full[0].shape == full[1].shape and bool(torch.equal(full[0], full[1]))
