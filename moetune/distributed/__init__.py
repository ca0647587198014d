"""Expert parallelism + FSDP2 on one device mesh; see README.md."""

from moetune.distributed.allgather_dispatcher import AllGatherExpertParallelDispatcher
from moetune.distributed.checkpoint import load_distributed_checkpoint, save_distributed_checkpoint
from moetune.distributed.dispatcher import CapacityExpertParallelDispatcher, ExpertParallelDispatcher, all_to_all
from moetune.distributed.grad_norm import clip_before_update, clip_grad_norm_, scales_gradients, total_grad_norm
from moetune.distributed.inference import gathered_for_inference
from moetune.distributed.mesh import FLAT_DIM_NAME, MESH_DIM_NAMES, ParallelMesh, build_mesh, is_sharded_by_moetune
from moetune.distributed.parallelize import ParallelConfig, parallelize, parallelize_for_options
from moetune.distributed.pipelined_dispatcher import PipelinedExpertParallelDispatcher
from moetune.distributed.replicate import ReplicatedGradientSync

__all__ = [
    "AllGatherExpertParallelDispatcher",
    "CapacityExpertParallelDispatcher",
    "FLAT_DIM_NAME",
    "MESH_DIM_NAMES",
    "ExpertParallelDispatcher",
    "ParallelConfig",
    "ParallelMesh",
    "PipelinedExpertParallelDispatcher",
    "ReplicatedGradientSync",
    "all_to_all",
    "build_mesh",
    "clip_before_update",
    "clip_grad_norm_",
    "gathered_for_inference",
    "is_sharded_by_moetune",
    "load_distributed_checkpoint",
    "parallelize",
    "parallelize_for_options",
    "save_distributed_checkpoint",
    "scales_gradients",
    "total_grad_norm",
]
