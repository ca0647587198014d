"""Stream a safetensors checkpoint into a model whose parameters may be sharded.

1. ``plan_checkpoint_load`` maps every checkpoint tensor to a block of a parameter using only the
   files' headers and the model's shapes (a model on the meta device is enough), and raises a
   ``ValueError`` naming the tensors that are missing, unexpected or mis-shaped, before anything
   is allocated. With ``mismatched`` (``from_pretrained(..., ignore_mismatched_sizes=True)``) the
   parameters whose checkpoint shape differs are listed there instead and left unread.
2. ``load_checkpoint`` copies each block into the part of the parameter this process holds:
   plain tensors hold everything; DTensors (FSDP2 shards, expert-parallel shards) hold a
   sub-block, and only that sub-block is read from the memory-mapped file. Files are visited one
   at a time, so host memory holds at most one tensor beyond the model. A ``TensorReader`` may
   read the files whole instead of memory-mapping them (``disable_mmap``), or read an in-memory
   state dict.
3. ``initialize_afresh`` gives the parameters left unread (mismatched ones) the model's own
   initialisation, as Transformers does.
"""

from __future__ import annotations

import re
from collections import OrderedDict, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from math import prod
from pathlib import Path

import torch
from safetensors import SafetensorError
from torch import nn

from moetune.checkpoint import fp8, mxfp4
from moetune.checkpoint.files import TensorInfo, open_safetensors
from moetune.utils.file_errors import unreadable_safetensors
from moetune.utils.tied import tied_pairs
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
    mismatched: list[tuple[str, torch.Size, torch.Size]] | None = None,
    report: dict[str, set[str]] | None = None,
) -> list[LoadItem]:
    """The blocks to copy; raises naming every missing, unexpected or mis-shaped tensor.

    ``unused``: when given, the tensors of decoder layers the model does not have (a caller that
    asked for fewer layers than the checkpoint holds, ``num_hidden_layers=N``, as Transformers
    allows) are listed there and left unread instead of being unexpected.

    ``num_checkpoint_layers``: the checkpoint's own ``num_hidden_layers`` (default: the model's);
    with ``layout.trailing_mtp_layers``, the layers numbered from there on are its
    multi-token-prediction modules and are skipped.

    ``mismatched``: when given, a parameter whose checkpoint shape differs from the model's (a
    resized vocabulary, other expert sizes, another number of experts) is not an error: it is listed
    there as Transformers' ``mismatched_keys`` lists it, ``(name, checkpoint shape, model shape)``
    (per-expert tensors as the fused shape they stack to), and none of its tensors is read.

    ``report``: when given, missing and unexpected tensors are not an error either: the parameters
    (and persistent buffers) the checkpoint does not fill completely go to ``report["missing"]``
    (none of their tensors is read) and the checkpoint keys no parameter takes to
    ``report["unexpected"]``, as Transformers' loading report lists them."""
    shapes = model_tensor_shapes(model)
    layer_indices = {i for i in map(_layer_index, shapes) if i is not None}
    num_layers = max(layer_indices) + 1 if layer_indices else None
    if num_checkpoint_layers is None:
        num_checkpoint_layers = num_layers
    tied = set(tied_pairs(model))  # the later names of shared tensors: filled through the first
    items: list[LoadItem] = []
    unexpected, misshaped, missing = [], [], []
    reported: set[str] = set()  # parameters a mis-shaped tensor or missing scales already account for
    quantized_reported: set[str] = set()  # MXFP4 parameters among them: their blocks and scales are all they have
    covered: dict[str, int] = defaultdict(int)
    ignore_sizes = mismatched is not None
    misfits: dict[str, tuple[int, ...] | None] = {}  # ignore_sizes: parameter -> checkpoint shape (None: stacked experts)
    expert_shapes: dict[str, dict[int, dict[str, tuple[int, ...]]]] = defaultdict(lambda: defaultdict(dict))
    for key, info in tensors.items():
        if layout.is_ignored(key) or layout.canonical(key) in tied:
            continue
        if layout.trailing_mtp_layers and _is_mtp_layer(layout.canonical(key), num_checkpoint_layers):
            continue
        target = layout.per_expert_target(key, shapes) if ignore_sizes else None
        if target is not None:
            expert_shapes[target[0]][target[1]][target[2]] = tuple(info.shape)
        quantized = _mxfp4_param(layout, key, shapes)
        if quantized is not None:
            if ignore_sizes and key.endswith(mxfp4.BLOCKS_SUFFIX) and tuple(info.shape) != mxfp4.quantized_shapes(shapes[quantized])[0]:
                experts, fan_out, groups, _ = info.shape  # blocks [E, out, in / 32, 16] store [E, in, out]
                misfits[quantized] = (experts, groups * mxfp4.GROUP, fan_out)
            elif key.endswith(mxfp4.BLOCKS_SUFFIX):
                item = _mxfp4_item(key, info, quantized, shapes[quantized], tensors, missing, misshaped)
                if item is None:
                    reported.add(quantized)
                    quantized_reported.add(quantized)
                else:
                    covered[quantized] += prod(shapes[quantized])
                    items.append(item)
            continue
        if layout.fp8_block_scaled and key.endswith(fp8.SCALE_SUFFIX) and key[: -len(fp8.SCALE_SUFFIX)] in tensors:
            continue  # read with its weight
        region = layout.region(key, shapes)
        if region is None and target is not None:  # an expert beyond the model's number of experts
            misfits[target[0]] = None
            continue
        if region is None:
            index = _layer_index(layout.canonical(key))
            beyond_the_model = unused is not None and num_layers is not None and index is not None and index >= num_layers
            (unused if beyond_the_model else unexpected).append(key)
            continue
        extra = 0 if region.param == layout.canonical(key) else 1  # per-expert tensors lack the leading expert dim
        if tuple(info.shape) != region.shape[extra:] and ignore_sizes:
            misfits[region.param] = None if extra else tuple(info.shape)
            continue
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
    if ignore_sizes:
        for param, by_expert in expert_shapes.items():
            if param not in misfits and _stacked_shape(layout, param, by_expert) != shapes[param]:
                misfits[param] = None  # another number of experts
        items = [item for item in items if item.region.param not in misfits]
        for param, checkpoint_shape in sorted(misfits.items()):
            if checkpoint_shape is None:
                checkpoint_shape = _stacked_shape(layout, param, expert_shapes[param])
            mismatched.append((param, torch.Size(checkpoint_shape), torch.Size(shapes[param])))
    unfilled = {name for name, shape in shapes.items() if name not in misfits and covered[name] != prod(shape)}
    if report is not None:  # a missing tensor's parameter, not a quantized tensor's missing scales, is reported
        report["missing"], report["unexpected"] = unfilled - reported, set(unexpected)
        items = [item for item in items if item.region.param not in report["missing"]]
        unexpected = []
    for name, shape in shapes.items():
        if name in misfits or name in quantized_reported or report is not None:
            continue
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
        problems.append(
            f"mis-shaped tensors ({len(misshaped)}): {_listing(misshaped)} (from_pretrained(..., "
            "ignore_mismatched_sizes=True) initialises such parameters afresh instead)"
        )
    if problems:
        raise ValueError(f"checkpoint {_source_name(tensors)!r} does not match {type(model).__name__}: " + "; ".join(problems))
    return items


def _source_name(tensors: dict[str, TensorInfo]) -> str:
    file = next(iter(tensors.values())).file if tensors else None
    return "state_dict" if tensors and file is None else str(file.parent) if file is not None else "?"


def _stacked_shape(layout: CheckpointLayout, param: str, by_expert: dict[int, dict[str, tuple[int, ...]]]) -> tuple[int, ...]:
    """The shape per-expert tensors stack to (Transformers' merge): [experts, rows of the parts, cols]."""
    parts = next(f.parts for f in layout.fused_experts if param.endswith(f".{f.name}"))
    if not by_expert:
        return ()
    first = by_expert[min(by_expert)]
    present = [first[part] for part in parts if part in first]
    return (len(by_expert), sum(shape[0] for shape in present), present[0][1])


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


class _Tensors:
    """``safe_open``'s ``get_slice`` over tensors in memory (slicing a tensor reads like a file's slice)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def get_slice(self, name: str) -> torch.Tensor:
        return self.tensors[name]


class TensorReader:
    """Where ``load_checkpoint`` reads: safetensors files, memory-mapped (``safe_open``: only the
    blocks a process holds are read) or, with ``mmap=False`` (Transformers' ``disable_mmap=True``,
    for filesystems where memory-mapping misbehaves), each file read whole into memory with plain
    reads, a few files at a time; tensors with no file come from ``state_dict``."""

    def __init__(self, state_dict: dict[str, torch.Tensor] | None = None, *, mmap: bool = True, files_in_memory: int = 2):
        self.state_dict, self.mmap, self.files_in_memory = state_dict, mmap, files_in_memory
        self._whole: OrderedDict[str, _Tensors] = OrderedDict()

    @contextmanager
    def open(self, file: Path | None) -> Iterator:
        if file is None:
            if self.state_dict is None:
                raise ValueError("a tensor of an in-memory state dict, but the reader was given no state_dict")
            yield _Tensors(self.state_dict)
        elif self.mmap:
            with open_safetensors(file) as handle:
                yield handle
        else:
            yield self._read_whole(str(file))

    def _read_whole(self, path: str) -> _Tensors:
        if path in self._whole:
            self._whole.move_to_end(path)
            return self._whole[path]
        while len(self._whole) >= self.files_in_memory:  # a weight's file and its scales' (FP8 / MXFP4)
            self._whole.popitem(last=False)
        from safetensors.torch import load

        with open(path, "rb") as file:
            try:
                self._whole[path] = _Tensors(load(file.read()))
            except SafetensorError as err:
                raise ValueError(unreadable_safetensors(Path(path), err)) from None
        return self._whole[path]


@torch.no_grad()
def load_checkpoint(model: nn.Module, items: list[LoadItem], reader: TensorReader | None = None) -> None:
    reader = reader or TensorReader()
    targets = dict(model.named_parameters())
    targets.update(dict(model.named_buffers()))
    by_file: dict[Path | None, list[LoadItem]] = defaultdict(list)
    for item in items:
        by_file[item.info.file].append(item)
    for path, file_items in by_file.items():
        with reader.open(path) as handle:
            for item in file_items:
                local, local_offset = local_block(targets[item.region.param])
                copy = {"plain": _copy_block, "fp8": _copy_block, "mxfp4": _copy_mxfp4}[item.kind]
                copy(handle, item, local, local_offset, reader)


@torch.no_grad()
def initialize_afresh(model: nn.Module, names: set[str]) -> None:
    """Initialise parameters ``names`` (left unread: their checkpoint shapes differ) the way
    Transformers initialises missing and mismatched keys: every other tensor is flagged
    ``_is_hf_initialized`` and ``model.initialize_weights()`` runs the model's ``_init_weights``,
    whose init functions skip flagged tensors. Sharded (DTensor) parameters are drawn as their part
    of one full draw (``moetune.distributed.sharded_init``). The flags are removed afterwards, so the
    model is flagged as any other moetune model is (not at all)."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    sharded = any(hasattr(tensor, "to_local") for _, tensor in tensors)
    for name, tensor in tensors:
        tensor._is_hf_initialized = name not in names
    context = nullcontext()
    if sharded:
        from moetune.distributed.sharded_init import sharded_init_functions

        context = sharded_init_functions()
    try:
        with context:
            model.initialize_weights()
    finally:
        for owner in [*model.modules(), *(tensor for _, tensor in tensors)]:
            if "_is_hf_initialized" in vars(owner):
                del owner._is_hf_initialized


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


def _copy_block(handle, item: LoadItem, local: torch.Tensor, local_offset: tuple[int, ...], reader: TensorReader) -> None:
    slices = _overlap(item.region, local, local_offset, len(item.info.shape))
    if slices is None:
        return  # this process holds none of the block
    dest_slices, src = slices
    block = handle.get_slice(item.info.name)[src]
    if item.kind == "fp8":
        _, scales_info = item.scales
        scale_rows, scale_cols = fp8.scale_rows_cols(*src)
        with reader.open(scales_info.file) as scales_handle:
            scales = scales_handle.get_slice(scales_info.name)[scale_rows, scale_cols]
        block = fp8.dequantize(block, scales, *src, dtype=local.dtype)
    local[dest_slices].copy_(block.reshape(local[dest_slices].shape))


def _copy_mxfp4(handle, item: LoadItem, local: torch.Tensor, local_offset: tuple[int, ...], reader: TensorReader) -> None:
    """Dequantize the experts (and output columns) this process holds of an MXFP4 parameter
    [E, in, out]; the files store [E, out, in / 32 groups]."""
    (e0, i0, o0), (e1, i1, o1) = local_offset, tuple(o + n for o, n in zip(local_offset, local.shape))
    blocks = handle.get_slice(item.info.name)[e0:e1, o0:o1]
    _, scales_info = item.scales
    with reader.open(scales_info.file) as scales_handle:
        scales = scales_handle.get_slice(scales_info.name)[e0:e1, o0:o1]
    local.copy_(mxfp4.dequantize(blocks, scales, local.dtype)[:, i0:i1, :])
