"""Write a model as a Hugging Face checkpoint that plain Transformers loads.

Streaming: parameters are gathered one at a time (``DTensor.full_tensor()`` for FSDP2 / expert-
parallel shards; every rank must call this, in the same order), moved to the host by the main
process and flushed to a shard file when it reaches ``max_shard_size``. Files are written into a
temporary folder first and moved into place at the end, so an interrupted save never leaves a
half-written checkpoint where a good one was.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from moetune.checkpoint.files import INDEX_NAME, SINGLE_NAME, is_weight_file_of, shard_name, with_variant
from moetune.checkpoint.layout import CheckpointLayout
from moetune.utils.tied import tied_pairs

_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    text = size.strip().upper()
    for unit in sorted(_UNITS, key=len, reverse=True):
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * _UNITS[unit])
    raise ValueError(f"max_shard_size {size!r} is not a size like '5GB' or '500MiB'")


def full_tensors(model: nn.Module, state_dict: dict[str, torch.Tensor] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for every entry of the state dict, gathering sharded ones."""
    tensors = state_dict if state_dict is not None else model.state_dict()
    # Tied parameters (lm_head = embed_tokens) are written once, as Transformers does.
    tied = tied_pairs(model)
    for name, tensor in tensors.items():
        if name in tied:
            continue
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        yield name, tensor


def save_hf_checkpoint(
    model: nn.Module,
    save_directory: str | os.PathLike,
    *,
    layout: CheckpointLayout,
    per_expert: bool = True,
    max_shard_size: int | str = "50GB",
    is_main_process: bool = True,
    state_dict: dict[str, torch.Tensor] | None = None,
    variant: str | None = None,
) -> None:
    """Write safetensors shards (+ index), config.json and generation_config.json; with ``variant``
    the weight files are Transformers' variant names (``model.<variant>.safetensors``, ...)."""
    limit = parse_size(max_shard_size)
    with_variant(SINGLE_NAME, variant)  # a bad variant fails before any gathering
    target = Path(save_directory)
    staging = None
    if is_main_process:
        target.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".moetune-save-", dir=target))
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    written: list[Path] = []
    try:
        for name, tensor in full_tensors(model, state_dict):
            if not is_main_process:
                continue
            pieces = layout.per_expert_tensors(name, tensor) if per_expert else [(name, tensor)]
            for key, piece in pieces:
                nbytes = piece.numel() * piece.element_size()
                if shards[-1] and shard_bytes + nbytes > limit:
                    written.append(_flush(shards[-1], staging, len(written)))
                    shards.append({})
                    shard_bytes = 0
                shards[-1][key] = piece.detach().to("cpu", copy=True).contiguous()
                shard_bytes += nbytes
        if not is_main_process:
            return
        if shards[-1]:
            written.append(_flush(shards[-1], staging, len(written)))
        _finalize(model, target, staging, written, variant=variant)
    finally:
        if staging is not None and staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def _flush(shard: dict[str, torch.Tensor], staging: Path, index: int) -> Path:
    path = staging / f"shard-{index:05d}.safetensors"
    save_file(shard, str(path), metadata={"format": "pt"})
    shard.clear()
    return path


def _finalize(model: nn.Module, target: Path, staging: Path, written: list[Path], *, variant: str | None) -> None:
    from safetensors import safe_open

    if len(written) == 1:
        names = [with_variant(SINGLE_NAME, variant)]
    else:
        names = [shard_name(i, len(written), variant) for i in range(len(written))]
    index_name = with_variant(INDEX_NAME, variant)
    weight_map, total = {}, 0
    for path, name in zip(written, names):
        with safe_open(path, framework="pt") as handle:
            for key in handle.keys():
                weight_map[key] = name
                view = handle.get_slice(key)
                total += math.prod(view.get_shape()) * _dtype_bytes(view.get_dtype())
        path.rename(staging / name)
    if len(written) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (staging / index_name).write_text(json.dumps(index, indent=2) + "\n")
    config = model.config
    config.architectures = [_model_class(model).__name__]
    # The dtype the weights are written in (the model may have been cast since it was loaded), so
    # that dtype=None / "auto" loads them back in it, as Transformers records it.
    config.dtype = getattr(model, "dtype", None) or config.dtype
    config.save_pretrained(staging)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None and getattr(model, "can_generate", lambda: False)():
        generation_config.save_pretrained(staging)
    # Remove the weights of an earlier save of this variant that the new one does not overwrite (a
    # single file left beside a new index, shards of a longer save), then move in. Other variants'
    # files and any other *.safetensors in the folder are the caller's and stay.
    for old in target.iterdir():
        if old.is_file() and is_weight_file_of(old.name, variant) and old.name not in names:
            old.unlink()
    for path in staging.iterdir():
        os.replace(path, target / path.name)


def _model_class(model: nn.Module) -> type:
    """The model's own class: FSDP2 swaps in a subclass named ``FSDP<name>`` with bases (FSDPModule, cls),
    which may be subclassed again under the same name (``moetune.distributed.inference``); the first
    module class in the MRO not so named is the model's."""
    return next(c for c in type(model).__mro__ if issubclass(c, nn.Module) and not c.__name__.startswith("FSDP"))


def _dtype_bytes(dtype: str) -> int:
    return {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I16": 2, "U8": 1, "I8": 1, "BOOL": 1}.get(dtype, 1)
