"""One rank of a large run, simulated in this process: torch's fake process group (every collective
returns at once, nothing is sent) with moetune's real mesh and ``parallelize`` applied to a model
on the meta device. What a rank holds then comes from the DTensors FSDP2 and expert parallelism made.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from moetune.checkpoint.files import TensorInfo
from moetune.checkpoint.loader import local_block, model_tensor_shapes
from moetune.distributed.mesh import MESH_DIM_NAMES, ParallelMesh, _flat
from moetune.distributed.parallelize import ParallelConfig, parallelize
from moetune.plan.inventory import meta_training_model
from moetune.plan.sharding import Layout


@contextlib.contextmanager
def fake_world(rank: int, world: int) -> Iterator[None]:
    """This process is ``rank`` of ``world`` for torch.distributed (the fake backend) until exit."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    assert not dist.is_initialized(), "a process group is already initialised in this process"
    # DTensor caches sharding propagation by mesh, and meshes of equal shape compare equal whatever
    # the rank: a result cached while simulating another rank would bring that rank's mesh along.
    _clear_sharding_prop_cache()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
        _clear_sharding_prop_cache()


def parallelized_model(config, layout: Layout, *, lora=None, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """``config``'s moetune model on the meta device, sharded by the real ``parallelize`` for this
    process's rank (call inside ``fake_world``)."""
    model = meta_training_model(config, dtype=dtype)
    mesh = init_device_mesh("cpu", (layout.world // layout.ep, layout.ep), mesh_dim_names=MESH_DIM_NAMES)
    parallel_mesh = ParallelMesh(mesh=mesh, world=_flat(mesh))
    parallelize(model, parallel_mesh, ParallelConfig(dense_parallel=layout.dense_parallel, lora=lora,
                                                     vocab_parallel=layout.vocab_parallel))
    return model


def held_blocks(model: nn.Module) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Parameter name -> (offset, shape) of the block this rank holds, from the DTensors."""
    blocks = {}
    for name, param in model.named_parameters():
        local, offset = local_block(param)
        blocks[name] = (tuple(offset), tuple(local.shape))
    return blocks


def fsdp_allocated(model: nn.Module) -> dict[str, int]:
    """Parameter name -> elements FSDP2 allocated for this rank's (padded) shard, for the parameters
    it manages."""
    from torch.distributed.fsdp import FSDPModule

    names = {id(p): n for n, p in model.named_parameters()}
    allocated = {}
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        if group is None:
            continue
        for fsdp_param in group.fsdp_params:
            allocated[names[id(fsdp_param.sharded_param)]] = fsdp_param._sharded_param_data.numel()
    return allocated


def hub_tensors(config, layout_of_checkpoint) -> dict[str, TensorInfo]:
    """The tensors a Hub checkpoint of ``config`` holds (per-expert where the family stores experts
    one by one), as ``moetune.checkpoint.files`` lists them from the headers, without any file."""
    model = meta_training_model(config)
    file = Path("model.safetensors")
    tensors = {}
    for name, shape in model_tensor_shapes(model).items():
        for key, tensor in layout_of_checkpoint.per_expert_tensors(name, torch.empty(shape, device="meta")):
            tensors[key] = TensorInfo(file=file, shape=tuple(tensor.shape), dtype="BF16", name=key)
    return tensors


def read_elements(model: nn.Module, items) -> dict[str, int]:
    """Parameter name -> elements this rank reads from the checkpoint for it (``load_checkpoint``'s
    overlap of each block with what the rank holds)."""
    from moetune.checkpoint.loader import _overlap

    targets = {**dict(model.named_parameters()), **dict(model.named_buffers())}  # as load_checkpoint's
    blocks = {name: local_block(tensor) for name, tensor in targets.items()}  # (DTensor offsets are slow to compute)
    counts: dict[str, int] = {}
    for item in items:
        local, offset = blocks[item.region.param]
        slices = _overlap(item.region, local, offset, len(item.info.shape))
        if slices is None:
            continue
        counts[item.region.param] = counts.get(item.region.param, 0) + local[slices[0]].numel()
    return counts


def comparable(offset: tuple[int, ...], shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offset, shape) with the offset of an empty block dropped (where it points means nothing)."""
    return (offset if all(shape) else (), shape)
