"""``from_config`` under expert parallelism / FSDP2: Transformers' ``_init_weights`` run on sharded
(DTensor) parameters, each shard drawn as its part of the full tensor.

Why: on CUDA meshes DTensor's own random ops give every shard its slice of one draw (torch's
offset-based RNG tracker), but on other meshes (CPU / gloo) each rank draws its local shard from its
own generator: with the same seed on every rank (``transformers.set_seed``, the Trainer's default) the
shards repeat one another (experts 4-7 copies of 0-3, the second half of every FSDP2-sharded matrix
its first). And ``init.copy_`` of a plain tensor into a DTensor (Nemotron-H's ``A_log``, ``dt_bias``)
raises "mixed torch.Tensor and DTensor" on every device.

Inside ``sharded_init_functions()`` Transformers' init functions (``transformers.initialization``,
which its ``guard_torch_init_functions`` also installs as ``torch.nn.init``'s during
``initialize_weights``) draw a DTensor off CUDA on a full-size plain tensor and keep this rank's
shard (peak memory: one parameter at full size); ``copy_`` of a plain tensor into a DTensor copies
its shard. The result is what one process draws with the same seed, in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

try:  # Transformers >= 5.0: the init functions its models call
    from transformers import initialization as hf_init
except ImportError:  # pragma: no cover
    hf_init = None


def copy_full_into(param: DTensor, full: torch.Tensor) -> None:
    """Write this rank's shard of the full-size ``full`` into ``param`` (no communication)."""
    local = param.to_local()
    full = full.to(device=local.device, dtype=local.dtype)
    shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
    local.copy_(shard)


def _drawn_in_full(draw: Callable) -> Callable:
    def init(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if not isinstance(tensor, DTensor) or tensor.to_local().is_cuda:
            return draw(tensor, *args, **kwargs)  # plain tensors; CUDA DTensors draw their slice themselves
        full = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.to_local().device)
        draw(full, *args, **kwargs)
        copy_full_into(tensor, full)
        return tensor

    return init


def _copy_into_shards(copy: Callable) -> Callable:
    def init_copy(tensor: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        if isinstance(tensor, DTensor) and not isinstance(other, DTensor):
            if not getattr(tensor, "_is_hf_initialized", False):  # the guard of Transformers' copy_
                with torch.no_grad():
                    copy_full_into(tensor, other.expand(tensor.shape))
            return tensor
        return copy(tensor, other)

    return init_copy


@contextmanager
def sharded_init_functions() -> Iterator[None]:
    """Transformers' init functions made DTensor-aware while inside (see the module docstring)."""
    if hf_init is None:  # pragma: no cover
        yield
        return
    draws = dict(hf_init.TORCH_INIT_FUNCTIONS)
    copy = hf_init.copy_
    hf_init.TORCH_INIT_FUNCTIONS.update({name: _drawn_in_full(draw) for name, draw in draws.items()})
    hf_init.copy_ = _copy_into_shards(copy)
    try:
        yield
    finally:
        hf_init.TORCH_INIT_FUNCTIONS.update(draws)
        hf_init.copy_ = copy
