"""Stream a safetensors checkpoint into a model whose parameters may be sharded.

1. ``plan_checkpoint_load`` maps every checkpoint tensor to a block of a parameter using only the
   files' headers and the model's shapes (a model on the meta device is enough), and raises a
   ``ValueError`` naming the tensors that are missing, unexpected or mis-shaped, before anything
   is allocated.
2. ``load_checkpoint`` copies each block into the part of the parameter this process holds:
   plain tensors hold everything; DTensors (FSDP2 shards, expert-parallel shards) hold a
   sub-block, and only that sub-block is read from the memory-mapped file. Files are visited one
   at a time, so host memory holds at most one tensor beyond the model.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from math import prod

import torch
from safetensors import safe_open
from torch import nn

from moetune.checkpoint import fp8, mxfp4
from moetune.checkpoint.files import TensorInfo
from moetune.checkpoint.layout import CheckpointLayout, Region


@dataclass(frozen=True)
class LoadItem:
    key: str
    info: TensorInfo
    region: Region
    scales: tuple[str, TensorInfo] | None = None
    """Quantized weights: the key and file of the scales that go with ``key``."""
    kind: str = "plain"
    """``plain`` (copied), ``fp8`` (block-scaled FP8) or ``mxfp4`` (dequantized while copying)."""


def model_tensor_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Global shapes of the parameters and persistent buffers the checkpoint must fill (tied
    parameters appear once, under their first name)."""
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    persistent = {
        f"{mod_name}.{buf_name}" if mod_name else buf_name
        for mod_name, module in model.named_modules()
        for buf_name, _ in module.named_buffers(recurse=False)
        if buf_name not in module._non_persistent_buffers_set
    }
    shapes.update({name: tuple(b.shape) for name, b in model.named_buffers() if name in persistent})
    return shapes


def _tied_names(model: nn.Module) -> set[str]:
    unique = {name for name, _ in model.named_parameters()}
    return {name for name, _ in model.named_parameters(remove_duplicate=False)} - unique


# A decoder layer's index in a tensor name: "model.layers.12.mlp..." -> 12.
_LAYER_INDEX = re.compile(r"((?:^|\.)layers\.)(\d+)(\.)")


def _layer_index(name: str) -> int | None:
    match = _LAYER_INDEX.search(name)
    return int(match.group(2)) if match else None


def _with_layer_index(name: str, index: int) -> str:
    return _LAYER_INDEX.sub(rf"\g<1>{index}\g<3>", name, count=1)


def plan_checkpoint_load(
    model: nn.Module,
    tensors: dict[str, TensorInfo],
    layout: CheckpointLayout,
    *,
    unused: list[str] | None = None,
    num_checkpoint_layers: int | None = None,
) -> list[LoadItem]:
    """The blocks to copy; raises naming every missing, unexpected or mis-shaped tensor.

    ``unused``: when given, the tensors of decoder layers the model does not have (a caller that
    asked for fewer layers than the checkpoint holds, ``num_hidden_layers=N``, as Transformers
    allows) are listed there and left unread instead of being unexpected.

    ``num_checkpoint_layers``: the checkpoint's own ``num_hidden_layers`` (default: the model's);
    with ``layout.trailing_mtp_layers``, the layers numbered from there on are its
    multi-token-prediction modules and are skipped."""
    shapes = model_tensor_shapes(model)
    layer_indices = {i for i in map(_layer_index, shapes) if i is not None}
    num_layers = max(layer_indices) + 1 if layer_indices else None
    if num_checkpoint_layers is None:
        num_checkpoint_layers = num_layers
    tied = _tied_names(model)
    items: list[LoadItem] = []
    unexpected, misshaped, missing = [], [], []
    reported: set[str] = set()  # parameters a mis-shaped tensor or missing scales already account for
    covered: dict[str, int] = defaultdict(int)
    for key, info in tensors.items():
        if layout.is_ignored(key) or layout.canonical(key) in tied:
            continue
        if layout.trailing_mtp_layers and _is_mtp_layer(layout.canonical(key), num_checkpoint_layers):
            continue
        quantized = _mxfp4_param(layout, key, shapes)
        if quantized is not None:
            if key.endswith(mxfp4.BLOCKS_SUFFIX):
                item = _mxfp4_item(key, info, quantized, shapes[quantized], tensors, missing, misshaped)
                if item is None:
                    reported.add(quantized)
                else:
                    covered[quantized] += prod(shapes[quantized])
                    items.append(item)
            continue
        if layout.fp8_block_scaled and key.endswith(fp8.SCALE_SUFFIX) and key[: -len(fp8.SCALE_SUFFIX)] in tensors:
            continue  # read with its weight
        region = layout.region(key, shapes)
        if region is None:
            index = _layer_index(layout.canonical(key))
            beyond_the_model = unused is not None and num_layers is not None and index is not None and index >= num_layers
            (unused if beyond_the_model else unexpected).append(key)
            continue
        extra = 0 if region.param == layout.canonical(key) else 1  # per-expert tensors lack the leading expert dim
        if tuple(info.shape) != region.shape[extra:]:
            misshaped.append(f"{key} {list(info.shape)} (expected {list(region.shape[extra:])} for {region.param})")
            reported.add(region.param)
            continue
        item = LoadItem(key, info, region)
        if layout.fp8_block_scaled and info.dtype in fp8.FP8_DTYPES:
            item = _fp8_item(item, tensors, missing, misshaped)
            if item is None:
                reported.add(region.param)
                continue
        covered[region.param] += prod(region.shape)
        items.append(item)
    for name, shape in shapes.items():
        if covered[name] != prod(shape) and not any(m.startswith(name) for m in missing):
            absent = [k for k in layout.hub_keys_for(name, shape) if k not in tensors]
            # A parameter whose tensors are all there, one of them mis-shaped (or without its
            # scales), is reported as that alone, not also as missing.
            missing += absent or ([] if name in reported else [name])
    problems = []
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): {_listing(unexpected)}")
    if misshaped:
        problems.append(f"mis-shaped tensors ({len(misshaped)}): {_listing(misshaped)}")
    if problems:
        folder = next(iter(tensors.values())).file.parent if tensors else "?"
        raise ValueError(f"checkpoint {str(folder)!r} does not match {type(model).__name__}: " + "; ".join(problems))
    return items


def _is_mtp_layer(name: str, num_checkpoint_layers: int | None) -> bool:
    index = _layer_index(name)
    return index is not None and num_checkpoint_layers is not None and index >= num_checkpoint_layers


def unused_parameter_names(keys: list[str], model: nn.Module, layout: CheckpointLayout) -> set[str]:
    """The model-level names (Transformers' loading report: ``...experts.gate_up_proj``, not the
    per-expert tensors) of checkpoint tensors that ``plan_checkpoint_load`` left unread: each is
    mapped through a layer the model has, then given back its own layer index."""
    shapes = model_tensor_shapes(model)
    present = sorted({i for i in map(_layer_index, shapes) if i is not None})
    names = set()
    for key in keys:
        index, name = _layer_index(layout.canonical(key)), layout.canonical(key)
        for stand_in in present:
            region = layout.region(_with_layer_index(key, stand_in), shapes)
            if region is not None:
                name = _with_layer_index(region.param, index)
                break
        names.add(name)
    return names


def _mxfp4_param(layout: CheckpointLayout, key: str, shapes: dict[str, tuple[int, ...]]) -> str | None:
    """The 3-D parameter that MXFP4 tensor ``key`` (blocks or scales) stores, if it is one."""
    if not layout.mxfp4_experts:
        return None
    name = layout.canonical(key)
    for suffix in (mxfp4.BLOCKS_SUFFIX, mxfp4.SCALES_SUFFIX):
        if name.endswith(suffix) and len(shapes.get(name[: -len(suffix)], ())) == 3:
            return name[: -len(suffix)]
    return None


def _mxfp4_item(key, info, param, shape, tensors, missing, misshaped) -> LoadItem | None:
    scales_key = key[: -len(mxfp4.BLOCKS_SUFFIX)] + mxfp4.SCALES_SUFFIX
    if scales_key not in tensors:
        missing.append(scales_key)
        return None
    expected_blocks, expected_scales = mxfp4.quantized_shapes(shape)
    for name, got, want in ((key, info.shape, expected_blocks), (scales_key, tensors[scales_key].shape, expected_scales)):
        if tuple(got) != want:
            misshaped.append(f"{name} {list(got)} (expected {list(want)} for MXFP4 {param} {list(shape)})")
            return None
    return LoadItem(key, info, Region(param, (0,) * len(shape), shape), scales=(scales_key, tensors[scales_key]), kind="mxfp4")


def _fp8_item(item: LoadItem, tensors, missing, misshaped) -> LoadItem | None:
    scales_key = item.key + fp8.SCALE_SUFFIX
    scales = tensors.get(scales_key)
    if scales is None:
        missing.append(scales_key)
        return None
    if len(item.info.shape) != 2:
        misshaped.append(f"{item.key} {list(item.info.shape)} (FP8 with block scales must be a 2-D weight)")
        return None
    if tuple(scales.shape) != fp8.scale_shape(item.info.shape):
        misshaped.append(f"{scales_key} {list(scales.shape)} (expected {list(fp8.scale_shape(item.info.shape))})")
        return None
    return LoadItem(item.key, item.info, item.region, scales=(scales_key, scales), kind="fp8")


def _listing(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(sorted(names)[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def local_block(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The locally held part of a (possibly DTensor) parameter and its offset in the global tensor."""
    if hasattr(tensor, "to_local") and hasattr(tensor, "placements"):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        return tensor.to_local(), tuple(offset)
    return tensor, (0,) * tensor.dim()


@torch.no_grad()
def load_checkpoint(model: nn.Module, items: list[LoadItem]) -> None:
    targets = dict(model.named_parameters())
    targets.update(dict(model.named_buffers()))
    by_file: dict[str, list[LoadItem]] = defaultdict(list)
    for item in items:
        by_file[str(item.info.file)].append(item)
    for path, file_items in by_file.items():
        with safe_open(path, framework="pt") as handle:
            for item in file_items:
                local, local_offset = local_block(targets[item.region.param])
                {"plain": _copy_block, "fp8": _copy_block, "mxfp4": _copy_mxfp4}[item.kind](handle, item, local, local_offset)


def _overlap(
    region: Region, local: torch.Tensor, local_offset: tuple[int, ...], source_dims: int
) -> tuple[tuple[slice, ...], tuple[slice, ...]] | None:
    """(slices of ``local``, slices of the source tensor) where ``region`` meets the block this
    process holds, or None if it holds none of it. The source may lack the region's leading
    size-1 dims (a per-expert tensor has no expert dim): those slices are dropped."""
    dest_slices, src_slices = [], []
    for start, size, l_start, l_size in zip(region.offset, region.shape, local_offset, local.shape):
        lo, hi = max(start, l_start), min(start + size, l_start + l_size)
        if lo >= hi:
            return None
        dest_slices.append(slice(lo - l_start, hi - l_start))
        src_slices.append(slice(lo - start, hi - start))
    return tuple(dest_slices), tuple(src_slices[len(region.shape) - source_dims :])


@torch.no_grad()
def load_per_expert_tensors(
    model: nn.Module, state_dict: dict[str, torch.Tensor], layout: CheckpointLayout
) -> tuple[dict[str, torch.Tensor], set[str]] | None:
    """Copy the Hub per-expert tensors of an in-memory state dict (``experts.3.gate_proj.weight``,
    what ``save_pretrained`` writes) into the blocks of their fused parameters (the block each
    process holds, for DTensors). Returns the state dict without them and the fused parameters they
    filled completely, or None when it holds no per-expert tensor. A partial set (one shard of a
    sharded checkpoint) fills its blocks; the parameter is not in the set."""
    if not layout.fused_experts:
        return None
    pattern = layout._per_expert_pattern()
    if not any(pattern.match(layout.canonical(key)) for key in state_dict):
        return None
    shapes = model_tensor_shapes(model)
    targets = dict(model.named_parameters())
    rest: dict[str, torch.Tensor] = {}
    blocks_seen: dict[str, set[tuple[int, ...]]] = defaultdict(set)
    for key, tensor in state_dict.items():
        region = layout.region(key, shapes) if pattern.match(layout.canonical(key)) else None
        if region is None or region.param not in targets or tuple(tensor.shape) != region.shape[1:]:
            rest[key] = tensor  # not a per-expert tensor this model takes: torch reports it
            continue
        local, local_offset = local_block(targets[region.param])
        slices = _overlap(region, local, local_offset, tensor.dim())
        if slices is not None:
            local[slices[0]].copy_(tensor[slices[1]].reshape(local[slices[0]].shape))
        blocks_seen[region.param].add(region.offset)
    filled = set()
    for fused in layout.fused_experts:
        for param, offsets in blocks_seen.items():
            if param.endswith(f".{fused.name}") and len(offsets) == shapes[param][0] * len(fused.parts):
                filled.add(param)
    return rest, filled


def _copy_block(handle, item: LoadItem, local: torch.Tensor, local_offset: tuple[int, ...]) -> None:
    slices = _overlap(item.region, local, local_offset, len(item.info.shape))
    if slices is None:
        return  # this process holds none of the block
    dest_slices, src = slices
    block = handle.get_slice(item.info.name)[src]
    if item.kind == "fp8":
        _, scales_info = item.scales
        scale_rows, scale_cols = fp8.scale_rows_cols(*src)
        with safe_open(str(scales_info.file), framework="pt") as scales_handle:
            scales = scales_handle.get_slice(scales_info.name)[scale_rows, scale_cols]
        block = fp8.dequantize(block, scales, *src, dtype=local.dtype)
    local[dest_slices].copy_(block.reshape(local[dest_slices].shape))


def _copy_mxfp4(handle, item: LoadItem, local: torch.Tensor, local_offset: tuple[int, ...]) -> None:
    """Dequantize the experts (and output columns) this process holds of an MXFP4 parameter
    [E, in, out]; the files store [E, out, in / 32 groups]."""
    (e0, i0, o0), (e1, i1, o1) = local_offset, tuple(o + n for o, n in zip(local_offset, local.shape))
    blocks = handle.get_slice(item.info.name)[e0:e1, o0:o1]
    _, scales_info = item.scales
    with safe_open(str(scales_info.file), framework="pt") as scales_handle:
        scales = scales_handle.get_slice(scales_info.name)[e0:e1, o0:o1]
    local.copy_(mxfp4.dequantize(blocks, scales, local.dtype)[:, i0:i1, :])
