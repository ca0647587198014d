"""A model built on the meta device, allocated on a real one.

Shared by ``moetune.auto`` (one device) and ``moetune.distributed.parallelize`` (after sharding),
so it sits below both.
"""

from __future__ import annotations

import torch

from moetune.utils.tied import share, tied_pairs


def materialize(model: torch.nn.Module, device: torch.device | str) -> None:
    """Allocate a meta-device model on ``device`` (uninitialised) and recompute its non-persistent
    buffers (RoPE frequencies), which no checkpoint stores."""
    ties = tied_pairs(model)
    model.to_empty(device=device)
    rebuild_non_persistent_buffers(model, device)
    # to_empty gives each module its own tensor, untying lm_head: the ties the model had, again (not
    # tie_weights(), which would re-tie from the config what loading untied on purpose).
    for target, source in ties.items():
        share(model, target, source)


@torch.no_grad()
def rebuild_non_persistent_buffers(model: torch.nn.Module, device: torch.device | str) -> None:
    """Recompute every non-persistent buffer by building its module afresh on ``device`` (only
    rotary embeddings have them in the models moetune builds)."""
    for name, module in model.named_modules():
        if not module._non_persistent_buffers_set:
            continue
        if not (type(module).__name__.endswith("RotaryEmbedding") and hasattr(module, "config")):
            raise AssertionError(f"don't know how to rebuild non-persistent buffers of {name} ({type(module).__name__})")
        with torch.device(device):
            fresh = type(module)(config=module.config)
        for buffer_name in module._non_persistent_buffers_set:
            getattr(module, buffer_name).copy_(getattr(fresh, buffer_name))
