"""Hugging Face checkpoints in and out: per-expert (Hub) and fused (Transformers v5) layouts,
safetensors only, streamed, shard-aware. See README.md."""

from moetune.checkpoint.files import TensorInfo, list_checkpoint_tensors, rename_checkpoint_tensors
from moetune.checkpoint.layout import SWIGLU_EXPERTS, CheckpointLayout, FusedExpertParam, Region
from moetune.checkpoint.loader import LoadItem, load_checkpoint, local_block, plan_checkpoint_load, unused_parameter_names
from moetune.checkpoint.writer import parse_size, save_hf_checkpoint

__all__ = [
    "SWIGLU_EXPERTS",
    "CheckpointLayout",
    "FusedExpertParam",
    "LoadItem",
    "Region",
    "TensorInfo",
    "list_checkpoint_tensors",
    "load_checkpoint",
    "local_block",
    "parse_size",
    "plan_checkpoint_load",
    "rename_checkpoint_tensors",
    "save_hf_checkpoint",
    "unused_parameter_names",
]
