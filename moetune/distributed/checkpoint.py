"""Sharded checkpoints for resuming (torch.distributed.checkpoint): every rank writes and reads only
its own shards of the model and optimizer state, in parallel, and a run can resume on the same
mesh (DCP reshards to another world size / ep size as well, since it stores global offsets).

For a Hugging Face checkpoint (gathered, per-expert) use ``model.save_pretrained`` on every rank.
Reading unpickles nothing but DCP's own metadata records and plain values (``dcp_files.py``).
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from moetune.distributed.dcp_files import load_dcp, save_dcp


def save_distributed_checkpoint(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, path: str | os.PathLike, *, extra: dict | None = None
) -> None:
    """Write model (+ optimizer) shards to the folder ``path`` (every rank must call it)."""
    state = _state(model, optimizer)
    if extra:
        state["extra"] = dict(extra)
    save_dcp(state, path)


def load_distributed_checkpoint(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, path: str | os.PathLike, *, extra: dict | None = None
) -> None:
    """Read model (+ optimizer) shards written by ``save_distributed_checkpoint`` in place.

    The optimizer must have been created over the model's parameters (its state is materialised
    here if it has not stepped yet). ``extra`` (a dict of tensors / values saved with the
    checkpoint) is filled in place."""
    state = _state(model, optimizer)
    if extra is not None:
        state["extra"] = extra
    load_dcp(state, path)  # nothing unpickled but DCP's own metadata records and plain values
    options = StateDictOptions(strict=True)
    if optimizer is None:
        set_state_dict(model, (), model_state_dict=state["model"], optim_state_dict={}, options=options)
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    if optimizer is None:
        model_sd, _ = get_state_dict(model, ())
        return {"model": model_sd}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}
