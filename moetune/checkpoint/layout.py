"""Checkpoint layouts: how Hub tensor names map onto moetune's (Transformers v5's) parameters.

Hub checkpoints store experts one by one (``mlp.experts.3.gate_proj.weight`` [I, H]); Transformers
v5 and moetune hold them fused (``mlp.experts.gate_up_proj`` [E, 2I, H]). A ``Region`` says which
block of a fused parameter one Hub tensor fills, so loading can copy only the blocks a rank owns
(expert parallelism, FSDP shards) straight from the memory-mapped file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Region:
    """The block ``[offset, offset + shape)`` of parameter ``param`` that one checkpoint tensor fills."""

    param: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]


@dataclass(frozen=True)
class FusedExpertParam:
    """A 3-D expert parameter ``<prefix>.<name>`` [E, rows, cols] stored on the Hub per expert as
    ``<prefix>.<e>.<part>`` [rows_part, cols], parts stacked along the rows in the given order."""

    name: str
    parts: tuple[str, ...]


@dataclass(frozen=True)
class CheckpointLayout:
    """A model family's checkpoint layout: which parameters are fused expert tensors, and which
    checkpoint keys to ignore (e.g. stale rotary buffers)."""

    fused_experts: tuple[FusedExpertParam, ...] = ()
    experts_module: str = "mlp.experts"
    ignored_keys: tuple[str, ...] = (r".*rotary_emb\.inv_freq$",)
    fp8_block_scaled: bool = False
    """Weights may be stored in FP8 with 128 x 128 block scales (``<name>_scale_inv``); they are
    dequantized while loading (``moetune.checkpoint.fp8``)."""
    mxfp4_experts: bool = False
    """3-D expert weights may be stored MXFP4-quantized as ``<name>_blocks`` + ``<name>_scales``
    (GPT-OSS's Hub checkpoints); they are dequantized while loading (``moetune.checkpoint.mxfp4``)."""
    trailing_mtp_layers: bool = False
    """Hub files may store multi-token-prediction modules as the decoder layers after the last one
    (DeepSeek-V3 / Kimi-K2: ``model.layers.61`` of 61 layers). Tensors of layers numbered at or
    beyond the checkpoint's ``num_hidden_layers`` are then skipped, as Transformers skips them; a
    deeper model's real layer 61 still loads."""
    renamed_prefixes: tuple[tuple[str, str], ...] = ()
    """(Hub prefix, model prefix) pairs, the first that matches applies: Nemotron-H's Hub files say
    ``backbone.`` for ``model.``."""

    def canonical(self, key: str) -> str:
        """The checkpoint key under the model's names (prefix renames applied)."""
        for old, new in self.renamed_prefixes:
            if key.startswith(old):
                return new + key[len(old) :]
        return key

    def _per_expert_pattern(self) -> re.Pattern[str]:
        parts = "|".join(re.escape(p) for f in self.fused_experts for p in f.parts)
        return re.compile(rf"^(?P<prefix>.*\.{re.escape(self.experts_module)})\.(?P<expert>\d+)\.(?P<part>{parts})$")

    def is_ignored(self, key: str) -> bool:
        return any(re.match(p, k) for p in self.ignored_keys for k in {key, self.canonical(key)})

    def region(self, key: str, param_shapes: dict[str, tuple[int, ...]]) -> Region | None:
        """The block checkpoint tensor ``key`` must fill (its expected shape is ``region.shape``
        without the leading expert dim for per-expert tensors), or None if no parameter takes it."""
        key = self.canonical(key)
        if key in param_shapes:
            shape = param_shapes[key]
            return Region(key, (0,) * len(shape), shape)
        if not self.fused_experts:
            return None
        match = self._per_expert_pattern().match(key)
        if match is None:
            return None
        expert, part = int(match["expert"]), match["part"]
        for fused in self.fused_experts:
            param = f"{match['prefix']}.{fused.name}"
            if part not in fused.parts or param not in param_shapes:
                continue
            num_experts, rows, cols = param_shapes[param]
            if expert >= num_experts:
                return None
            part_rows = rows // len(fused.parts)
            return Region(param, (expert, fused.parts.index(part) * part_rows, 0), (1, part_rows, cols))
        return None

    def per_expert_target(self, key: str, param_shapes: dict[str, tuple[int, ...]]) -> tuple[str, int, str] | None:
        """(fused parameter, expert, part) of per-expert tensor ``key``, whatever the model's number of
        experts (``region`` is None beyond it); None for any other tensor."""
        match = self._per_expert_pattern().match(self.canonical(key)) if self.fused_experts else None
        if match is None:
            return None
        for fused in self.fused_experts:
            param = f"{match['prefix']}.{fused.name}"
            if match["part"] in fused.parts and param in param_shapes:
                return param, int(match["expert"]), match["part"]
        return None

    def hub_name(self, name: str) -> str:
        """The model's tensor name under the Hub's prefix (the reverse of ``canonical``'s prefix renames,
        ``model.`` -> ``backbone.`` for Nemotron-H), as Transformers writes its original format."""
        for old, new in self.renamed_prefixes:
            if old.endswith(".") and new.endswith(".") and name.startswith(new):
                return old + name[len(new) :]
        return name

    def per_expert_tensors(self, name: str, tensor):
        """Split fused parameter ``name`` into Hub per-expert tensors, under the Hub's names (``hub_name``);
        other tensors pass through under theirs."""
        for fused in self.fused_experts:
            suffix = f".{self.experts_module}.{fused.name}"
            if name.endswith(suffix):
                prefix = self.hub_name(name[: -len(fused.name) - 1])
                for expert in range(tensor.shape[0]):
                    for part, block in zip(fused.parts, tensor[expert].chunk(len(fused.parts), dim=0)):
                        yield f"{prefix}.{expert}.{part}", block.contiguous()
                return
        yield self.hub_name(name), tensor

    def hub_keys_for(self, name: str, shape: tuple[int, ...]) -> list[str]:
        """The per-expert Hub keys that together fill fused parameter ``name`` (for error messages)."""
        for fused in self.fused_experts:
            suffix = f".{self.experts_module}.{fused.name}"
            if name.endswith(suffix):
                prefix = name[: -len(fused.name) - 1]
                return [f"{prefix}.{e}.{part}" for e in range(shape[0]) for part in fused.parts]
        return [name]


SWIGLU_EXPERTS = CheckpointLayout(
    fused_experts=(
        FusedExpertParam("gate_up_proj", ("gate_proj.weight", "up_proj.weight")),
        FusedExpertParam("down_proj", ("down_proj.weight",)),
    ),
    fp8_block_scaled=True,  # Qwen3's "-FP8" and DeepSeek-V3 / Kimi-K2's Hub files
)
