"""``gathered_for_inference(model)``: generation and evaluation on an FSDP2-sharded model with its
parameters gathered once for the whole block instead of once per forward.

Why: generation runs one forward per new token, and FSDP2 all-gathers each group's parameters
before its forward and frees them after, so a 256-token completion gathers the model 256 times.
With expert parallelism at ep == world FSDP2 holds only the non-expert parameters (0.93B for
Qwen3-30B-A3B: 1.9 GB in bf16 once gathered), so keeping them gathered costs little.

How: every FSDP2 module is unsharded, told not to reshard after its forward, and the root's
reshard after inference forwards (parallelize.py) is held off; on exit each module gets its own
setting back and is resharded (the sharded parameters are the module's again, as an optimizer
expects). When the gathered parameters would not fit in half of some rank's free device memory,
nothing changes (each forward gathers, as before). The decision is taken by all ranks together,
since the gathers are collectives.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

KEEP_GATHERED_ATTR = "_moetune_keep_gathered"
"""Set on the root while gathered: its reshard-after-inference hook then leaves it gathered."""
RESHARD_ATTR = "_moetune_reshard_after_forward"
"""Each FSDP2 module's own reshard_after_forward, recorded by ``apply_fsdp`` (True if absent)."""


class NoGradForInferenceMode:
    """Mixed into an FSDP2 root by ``run_inference_mode_as_no_grad``: a call under
    ``torch.inference_mode`` runs as ``torch.no_grad`` (same outputs, plain tensors).

    Why: FSDP2 allocates the gathered parameters' buffers in the mode of the call that first gathers
    them and reuses them afterwards; gathered under inference mode they are inference tensors, and the
    next forward outside it (a training step, a ``no_grad`` evaluation) fails writing into them
    ("Inplace update to inference tensor outside InferenceMode"; upstream, pytorch/pytorch#197327). The
    root's pre-forward hook gathers before ``forward`` runs, so the mode is switched around the call.
    """

    def __call__(self, *args, **kwargs):
        if torch.is_inference_mode_enabled():
            with torch.inference_mode(False), torch.no_grad():
                return super().__call__(*args, **kwargs)
        return super().__call__(*args, **kwargs)


def run_inference_mode_as_no_grad(model: nn.Module) -> None:
    """Give ``model`` (an FSDP2 root) ``NoGradForInferenceMode``'s ``__call__``; its class keeps its
    name (``config.architectures`` and logs read it)."""
    cls = type(model)
    model.__class__ = type(cls.__name__, (NoGradForInferenceMode, cls), {"__module__": cls.__module__})


@contextlib.contextmanager
def gathered_for_inference(model: nn.Module, *, max_fraction: float = 0.5) -> Iterator[bool]:
    """Keep ``model``'s FSDP2 parameters gathered inside the block (every rank must enter it); yields
    whether it did. A model without FSDP2 modules is left as it is."""
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules or not _fits_everywhere(modules, max_fraction):
        yield False
        return
    with torch.inference_mode(False):  # see NoGradForInferenceMode: no inference-tensor buffers
        for module in modules:
            module.unshard()
            module.set_reshard_after_forward(False, recurse=False)
    setattr(model, KEEP_GATHERED_ATTR, True)
    try:
        yield True
    finally:
        setattr(model, KEEP_GATHERED_ATTR, False)
        for module in modules:
            module.set_reshard_after_forward(getattr(module, RESHARD_ATTR, True), recurse=False)
            module.reshard()


def gathered_bytes(modules: list[FSDPModule]) -> int:
    """Bytes the FSDP2 parameters of ``modules`` take once gathered, beyond their shards."""
    total = 0
    try:  # FSDP2's internals (torch 2.9-2.13); where they differ, count as not fitting
        for module in modules:
            group = getattr(module._get_fsdp_state(), "_fsdp_param_group", None)
            for fsdp_param in getattr(group, "fsdp_params", None) or ():
                sharded = fsdp_param.sharded_param
                dtype = getattr(fsdp_param, "param_dtype", None) or sharded.dtype
                local = sharded.to_local() if hasattr(sharded, "to_local") else sharded
                total += sharded.numel() * dtype.itemsize - local.numel() * local.element_size()
    except AttributeError:
        return 1 << 62
    return total


def _fits_everywhere(modules: list[FSDPModule], max_fraction: float) -> bool:
    needed = gathered_bytes(modules)
    device = next(iter(modules[0].parameters())).device
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:  # the host's free memory (POSIX); where unknown, assume it fits
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            free = float("inf")
    fits = torch.tensor([1 if needed <= max_fraction * free else 0], device=device)
    if dist.is_initialized():
        dist.all_reduce(fits, op=dist.ReduceOp.MIN)
    return bool(fits.item())
