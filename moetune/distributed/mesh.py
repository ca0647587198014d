"""The device mesh of expert parallelism + FSDP2, and the checks that run before anything is allocated.

One 2-D mesh over all ``world`` ranks, ``ep`` innermost (consecutive ranks hold different experts,
so on GPU the all-to-all stays inside a node):

    dims  ("dp_shard_mod_ep", "ep")      sizes (world // ep, ep)

- ``ep``: ranks that hold different experts; the token all-to-all runs over this dimension.
- ``dp_shard_mod_ep``: ranks that hold the same experts; FSDP2 shards those experts over it.
- ``dp_shard`` (flattened from both, size ``world``): FSDP2 shards every other parameter over it.

Expert parallelism borrows its ranks from data parallelism: every rank still trains on its own
micro-batch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIM_NAMES = ("dp_shard_mod_ep", "ep")
FLAT_DIM_NAME = "dp_shard"


def is_sharded_by_moetune(model: torch.nn.Module) -> bool:
    """Whether moetune sharded ``model`` itself (loaded with ``ep_size`` / ``device_mesh``): it then
    reduces its own gradients, and every rank takes part in gathering its tensors (saving, export)."""
    return getattr(model, "parallel_mesh", None) is not None


@dataclass(frozen=True)
class ParallelMesh:
    """The mesh and the sub-meshes each kind of parameter is sharded over."""

    mesh: DeviceMesh
    """2-D, dims ``MESH_DIM_NAMES``."""
    world: DeviceMesh
    """1-D over all ranks (``dp_shard``): FSDP2 mesh of attention, norms, embeddings, LM head, dense MLPs."""

    @property
    def ep(self) -> DeviceMesh:
        return self.mesh["ep"]

    @property
    def dp_shard_mod_ep(self) -> DeviceMesh:
        return self.mesh["dp_shard_mod_ep"]

    @property
    def ep_size(self) -> int:
        return self.ep.size()

    @property
    def world_size(self) -> int:
        return self.mesh.size()

    @property
    def device_type(self) -> str:
        return self.mesh.device_type


def require_process_group() -> int:
    """The world size; a ValueError if torch.distributed is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "ep_size / device_mesh need torch.distributed: launch with torchrun (or srun + torchrun on Slurm) and "
            "call torch.distributed.init_process_group() before from_pretrained / from_config"
        )
    return dist.get_world_size()


def rank_device() -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` when CUDA is available (the node's GPU, never the
    global rank's: on several nodes they differ; without LOCAL_RANK, the global rank modulo the
    node's GPUs), else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local = os.environ.get("LOCAL_RANK")
    if local is not None:
        return torch.device("cuda", int(local))
    if dist.is_available() and dist.is_initialized():
        return torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def check_backend(device: torch.device) -> None:
    """CUDA needs NCCL (gloo's GPU all-to-all is neither fast nor complete); CPU needs gloo."""
    backend = str(dist.get_backend()).lower()
    if device.type == "cuda" and "nccl" not in backend:
        raise ValueError(
            f"expert parallelism on CUDA needs the NCCL backend, but the process group uses {backend!r}: "
            "call torch.distributed.init_process_group('nccl') (or leave the backend unset under torchrun)"
        )
    if device.type == "cpu" and "gloo" not in backend:
        raise ValueError(f"expert parallelism on the CPU needs the gloo backend, but the process group uses {backend!r}")


def check_ep_size(ep_size: int, *, world_size: int, num_experts: int) -> None:
    if not isinstance(ep_size, int) or isinstance(ep_size, bool) or ep_size < 1:
        raise ValueError(f"ep_size must be a positive int, got {ep_size!r}")
    if world_size % ep_size:
        raise ValueError(f"ep_size={ep_size} must divide the world size {world_size} (expert parallelism borrows data-parallel ranks)")
    if num_experts % ep_size:
        raise ValueError(f"ep_size={ep_size} must divide the number of experts {num_experts} (each rank holds num_experts / ep_size)")


def build_mesh(
    *, ep_size: int | None, device_mesh: DeviceMesh | None, num_experts: int, device: torch.device
) -> ParallelMesh:
    """Validate (ep_size, device_mesh) against the world and the model, and build the meshes."""
    world_size = require_process_group()
    check_backend(device)
    if device_mesh is not None:
        mesh = _check_user_mesh(device_mesh, world_size=world_size, device=device)
        mesh_ep = mesh["ep"].size()
        if ep_size not in (None, mesh_ep):
            raise ValueError(f"ep_size={ep_size} disagrees with the device_mesh's 'ep' dimension of size {mesh_ep}")
        ep_size = mesh_ep
    ep_size = 1 if ep_size is None else ep_size
    if ep_size > 1 and num_experts == 0:
        raise ValueError("ep_size > 1 needs a mixture-of-experts model, but this model has no MoE layers")
    check_ep_size(ep_size, world_size=world_size, num_experts=num_experts or ep_size)
    if device_mesh is None:
        mesh = init_device_mesh(device.type, (world_size // ep_size, ep_size), mesh_dim_names=MESH_DIM_NAMES)
    return ParallelMesh(mesh=mesh, world=_flat(mesh))


def _flat(mesh: DeviceMesh) -> DeviceMesh:
    try:
        return mesh[FLAT_DIM_NAME]
    except (KeyError, RuntimeError, ValueError):
        return mesh[MESH_DIM_NAMES]._flatten(FLAT_DIM_NAME)


def _check_user_mesh(mesh: object, *, world_size: int, device: torch.device) -> DeviceMesh:
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"device_mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
    expected = (
        f"a 2-D mesh with mesh_dim_names={MESH_DIM_NAMES} and sizes (world_size // ep, ep) covering all "
        f"{world_size} ranks, e.g. init_device_mesh({device.type!r}, ({world_size // min(2, world_size)}, "
        f"{min(2, world_size)}), mesh_dim_names={MESH_DIM_NAMES}) for ep={min(2, world_size)}"
    )
    if tuple(mesh.mesh_dim_names or ()) != MESH_DIM_NAMES:
        raise ValueError(f"device_mesh has dims {mesh.mesh_dim_names} of sizes {tuple(mesh.mesh.shape)}; expected {expected}")
    if mesh.size() != world_size or sorted(mesh.mesh.flatten().tolist()) != list(range(world_size)):
        raise ValueError(
            f"device_mesh covers {mesh.size()} ranks of sizes {tuple(mesh.mesh.shape)}, the world has {world_size}; expected {expected}"
        )
    if mesh.device_type != device.type:
        raise ValueError(f"device_mesh is a {mesh.device_type!r} mesh but this rank computes on {device.type!r}")
    return mesh
