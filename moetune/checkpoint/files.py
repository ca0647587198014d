"""The safetensors files of a checkpoint folder: which tensor is in which file, with shapes, read
from the headers only (nothing is loaded). Pickle files are never opened. An in-memory state dict
(``from_pretrained(None, config=..., state_dict=...)``) is described the same way, with no file."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from moetune.utils.file_errors import unreadable_safetensors
from moetune.utils.json_files import read_json

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


@dataclass(frozen=True)
class TensorInfo:
    file: Path | None
    """The safetensors file holding the tensor; None for a tensor of an in-memory state dict."""
    shape: tuple[int, ...]
    dtype: str
    name: str
    """The tensor's name inside ``file`` (what is read), which a ``key_mapping`` may have renamed."""


def with_variant(name: str, variant: str | None) -> str:
    """Transformers' variant naming: ``model.safetensors`` -> ``model.<variant>.safetensors``,
    ``model.safetensors.index.json`` -> ``model.safetensors.index.<variant>.json``."""
    if variant is None:
        return name
    if not isinstance(variant, str) or not variant or "/" in variant or os.sep in variant:
        raise ValueError(f"variant must be a non-empty name without path separators, got {variant!r}")
    stem, extension = name.rsplit(".", 1)
    return f"{stem}.{variant}.{extension}"


def shard_name(index: int, num_shards: int, variant: str | None = None) -> str:
    """The name of shard ``index`` (from 0) of a sharded save, as Transformers writes it:
    ``model-00001-of-00003.safetensors``, ``model.<variant>-00001-of-00003.safetensors``."""
    stem = with_variant(SINGLE_NAME, variant).removesuffix(".safetensors")
    return f"{stem}-{index + 1:05d}-of-{num_shards:05d}.safetensors"


def is_weight_file_of(name: str, variant: str | None) -> bool:
    """Whether file ``name`` is one that a save of ``variant`` writes (the single file, a shard, or
    the index); other variants' files and unrelated ``model*.safetensors`` are not."""
    stem = re.escape(with_variant(SINGLE_NAME, variant).removesuffix(".safetensors"))
    shard_or_single = rf"{stem}(-\d{{5}}-of-\d{{5}})?\.safetensors"
    return name == with_variant(INDEX_NAME, variant) or re.fullmatch(shard_or_single, name) is not None


def list_checkpoint_tensors(folder: str | os.PathLike, *, variant: str | None = None) -> dict[str, TensorInfo]:
    """Map every tensor name in the folder's safetensors checkpoint (single file or sharded with an
    index) to its file, shape and dtype. With ``variant``, only that variant's files are read
    (``model.<variant>.safetensors`` or ``model.safetensors.index.<variant>.json``)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder {str(folder)!r} does not exist")
    index_path, single_path = folder / with_variant(INDEX_NAME, variant), folder / with_variant(SINGLE_NAME, variant)
    if variant is not None and not index_path.is_file() and not single_path.is_file():
        raise FileNotFoundError(
            f"no {single_path.name} or {index_path.name} in {str(folder)!r} (the files of variant={variant!r})"
        )
    if index_path.is_file():
        index = read_json(index_path)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index_path} is not a valid safetensors index (needs a 'weight_map' object)")
        files = sorted({folder / name for name in weight_map.values()})
    elif single_path.is_file():
        files = [single_path]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt*")]
        hint = f" (found {pickles}: moetune reads safetensors only and never unpickles weights)" if pickles else ""
        raise FileNotFoundError(f"no *.safetensors weights in {str(folder)!r}{hint}")
    tensors: dict[str, TensorInfo] = {}
    for number, path in enumerate(files, start=1):
        if not path.is_file():
            raise FileNotFoundError(f"{index_path} lists {path.name!r}, which does not exist in {str(folder)!r}")
        shard = f"shard {number} of {len(files)} listed in {index_path.name}" if index_path.is_file() else ""
        with open_safetensors(path, shard=shard) as handle:
            for key in handle.keys():
                view = handle.get_slice(key)
                if key in tensors:
                    raise ValueError(f"tensor {key!r} appears in both {tensors[key].file.name} and {path.name}")
                tensors[key] = TensorInfo(path, tuple(view.get_shape()), view.get_dtype(), key)
    return tensors


@contextmanager
def open_safetensors(path: Path, *, shard: str = "") -> Iterator[Any]:
    """``safe_open(path)``; a file safetensors cannot open raises a ValueError naming it (and its
    ``shard`` description) and, for a truncated file, its size against the size its header describes."""
    try:
        handle = safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as err:
        raise ValueError(unreadable_safetensors(path, err, shard=shard)) from None
    with handle:
        yield handle


# torch dtype -> the safetensors header's name for it (what ``safe_open``'s ``get_dtype`` reports).
_SAFETENSORS_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2", "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
}  # fmt: skip


def state_dict_tensors(state_dict: dict) -> dict[str, TensorInfo]:
    """``list_checkpoint_tensors`` for an in-memory state dict of plain tensors (``TensorInfo.file``
    None): what ``plan_checkpoint_load`` checks and ``load_checkpoint`` reads."""
    if not isinstance(state_dict, dict):
        raise TypeError(f"state_dict must be a dict of tensor name -> torch.Tensor, got {type(state_dict).__name__}")
    import torch

    tensors: dict[str, TensorInfo] = {}
    for key, tensor in state_dict.items():
        if not isinstance(key, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError(f"state_dict must map tensor names to torch.Tensors; {key!r} holds {type(tensor).__name__}")
        if hasattr(tensor, "full_tensor") or tensor.is_meta:
            raise ValueError(
                f"state_dict[{key!r}] is a {'meta' if tensor.is_meta else 'sharded (DTensor)'} tensor; pass plain "
                "tensors holding the values (DTensor.full_tensor())"
            )
        dtype = str(tensor.dtype).removeprefix("torch.")
        tensors[key] = TensorInfo(None, tuple(tensor.shape), _SAFETENSORS_DTYPES.get(dtype, dtype), key)
    return tensors


def rename_checkpoint_tensors(tensors: dict[str, TensorInfo], key_mapping: dict[str, str]) -> dict[str, TensorInfo]:
    """``from_pretrained(key_mapping=...)`` as Transformers (>= 5) applies it: every (regex pattern,
    replacement) pair, in order, replaces the first match in each checkpoint name; a pattern that
    ends in a letter or digit matches up to the end of a name only (``norm`` is not ``norm_f``).
    The tensors are still read under their stored names (``TensorInfo.name``)."""
    if not isinstance(key_mapping, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in key_mapping.items()):
        raise TypeError(f"key_mapping must be a dict of regex pattern -> replacement strings, got {key_mapping!r}")
    compiled = []
    for pattern, replacement in key_mapping.items():
        try:
            compiled.append((re.compile(pattern + (r"(?!\w)" if re.search(r"[a-zA-Z0-9]$", pattern) else "")), replacement))
        except re.error as error:
            raise ValueError(f"key_mapping pattern {pattern!r} is not a valid regular expression: {error}") from None
    renamed: dict[str, TensorInfo] = {}
    for key, info in tensors.items():
        new_key = key
        for regex, replacement in compiled:
            new_key = regex.sub(replacement, new_key, count=1)
        if new_key in renamed:
            raise ValueError(
                f"key_mapping maps both {renamed[new_key].name!r} and {key!r} of the checkpoint to {new_key!r}"
            )
        renamed[new_key] = info  # still read as info.name
    return renamed
