"""The safetensors files of a checkpoint folder: which tensor is in which file, with shapes, read
from the headers only (nothing is loaded). Pickle files are never opened."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    shape: tuple[int, ...]
    dtype: str


def list_checkpoint_tensors(folder: str | os.PathLike) -> dict[str, TensorInfo]:
    """Map every tensor name in the folder's safetensors checkpoint (single file or sharded with an
    index) to its file, shape and dtype."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder {str(folder)!r} does not exist")
    index_path = folder / INDEX_NAME
    if index_path.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as error:
            raise ValueError(f"{index_path} is not a valid safetensors index (needs a 'weight_map'): {error}") from None
        files = sorted({folder / name for name in weight_map.values()})
    elif (folder / SINGLE_NAME).is_file():
        files = [folder / SINGLE_NAME]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt*")]
        hint = f" (found {pickles}: moetune reads safetensors only and never unpickles weights)" if pickles else ""
        raise FileNotFoundError(f"no *.safetensors weights in {str(folder)!r}{hint}")
    tensors: dict[str, TensorInfo] = {}
    for path in files:
        if not path.is_file():
            raise FileNotFoundError(f"{index_path} lists {path.name!r}, which does not exist in {str(folder)!r}")
        with safe_open(path, framework="pt") as handle:
            for key in handle.keys():
                view = handle.get_slice(key)
                if key in tensors:
                    raise ValueError(f"tensor {key!r} appears in both {tensors[key].file.name} and {path.name}")
                tensors[key] = TensorInfo(path, tuple(view.get_shape()), view.get_dtype())
    return tensors
