"""What a model holds, read from moetune's own model built on the meta device (no memory, no weights).

Every parameter with its shape, whether it trains, and which of moetune's sharding rules it falls
under (``moetune/distributed/parallelize.py``): the 3-D weights of a grouped-experts module are
split over ``ep`` and FSDP2-sharded over the ranks that hold the same experts; everything else is
FSDP2-sharded over all ranks (or replicated). Each parameter also names its FSDP2 group, the unit
FSDP2 gathers at once (a decoder layer, a layer's experts, the input embedding, or the root: LM
head and final norm), which sizes the communication buffers.

Per decoder layer the shapes the activation and time models need (``LayerShape``): its mixer
(attention, latent attention or Mamba-2), its MLP (MoE or dense) and their widths.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import Any

import torch
from torch import nn

from moetune.distributed.parallelize import decoder_layers, moe_blocks
from moetune.flops import FlopsCounter
from moetune.moe import GroupedExperts, MoEBlock

ROOT_GROUP = "root"
EMBED_GROUP = "embed"


@dataclass(frozen=True)
class ParamInfo:
    name: str
    shape: tuple[int, ...]
    trainable: bool
    expert: bool
    """A weight of a grouped-experts module (split over ``ep`` on dim 0, then FSDP2 over the ranks
    that hold the same experts)."""
    group: str
    """FSDP2 group: ``layers.<i>``, ``layers.<i>.experts``, ``embed`` or ``root``."""
    dtype_bytes: int = 2
    """Bytes per element in the model dtype the inventory was built for (2: bf16; 4: fp32)."""

    @property
    def numel(self) -> int:
        return prod(self.shape)


@dataclass(frozen=True)
class AttentionShape:
    heads: int
    kv_heads: int
    qk_head_dim: int
    v_head_dim: int
    window: int | None
    qk_norm: bool
    """Per-head RMSNorm of q and k before RoPE (Qwen3): their inputs are kept for the backward."""
    latent: bool = False
    """DeepSeek-V3's multi-head latent attention (``q_lora_rank``, ``kv_lora_rank``)."""
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    rope_dim: int = 0


@dataclass(frozen=True)
class MambaShape:
    d_inner: int
    heads: int
    head_dim: int
    groups: int
    state: int
    chunk: int
    in_proj_width: int
    conv_width: int


@dataclass(frozen=True)
class MoEShape:
    num_experts: int
    top_k: int
    expert_in: int
    """Width of the rows the experts take (the hidden size, or Nemotron-H's latent size)."""
    intermediate: int
    gated: bool
    shared_intermediate: int
    """Width of the shared experts' MLP (0: none)."""
    latent: bool


@dataclass(frozen=True)
class DenseMLPShape:
    intermediate: int
    gated: bool


@dataclass(frozen=True)
class LayerShape:
    index: int
    hidden: int
    norms: int
    """RMSNorms over the hidden width (2 for attention + MLP blocks, 1 for Nemotron-H's blocks)."""
    attention: AttentionShape | None = None
    mamba: MambaShape | None = None
    moe: MoEShape | None = None
    mlp: DenseMLPShape | None = None
    dense_forward_flops: float = 0.0
    """Forward FLOPs per token of the layer's nn.Linear weights (routers excluded, as the brief counts)."""
    expert_forward_flops: float = 0.0
    """Forward FLOPs per token of the routed experts (top-k x 2 x one expert's weights)."""
    router_forward_flops: float = 0.0
    """Forward FLOPs per token of the router (fp32 on DeepSeek-V3 / Nemotron-H; not in the brief's count)."""

    @property
    def kind(self) -> str:
        mixer = "mamba" if self.mamba else ("mla" if self.attention and self.attention.latent else
                                            "attention" if self.attention else "")
        mlp = "moe" if self.moe else "mlp" if self.mlp else ""
        return "+".join(part for part in (mixer, mlp) if part)


@dataclass(frozen=True)
class Inventory:
    name: str
    config: Any
    params: tuple[ParamInfo, ...]
    layers: tuple[LayerShape, ...]
    buffer_bytes: int
    """Buffers (RoPE tables, routers' score-correction biases): every rank holds them whole."""
    hidden: int
    vocab: int
    tied_embeddings: bool
    num_experts: int
    top_k: int
    flops: FlopsCounter = field(repr=False, compare=False)
    lora_rank: int = 0
    memo: dict = field(default_factory=dict, repr=False, compare=False)
    """Results of the planner's per-layout sums, kept with the inventory they were computed from."""

    def memoized(self, key: tuple, compute):
        """``compute()``, computed once per ``key`` for this inventory."""
        if key not in self.memo:
            self.memo[key] = compute()
        return self.memo[key]

    @property
    def total_params(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def trainable_params(self) -> int:
        return sum(p.numel for p in self.params if p.trainable)

    def group_params(self) -> dict[str, list[ParamInfo]]:
        groups: dict[str, list[ParamInfo]] = {}
        for param in self.params:
            groups.setdefault(param.group, []).append(param)
        return groups


def meta_training_model(config: Any, *, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """``config``'s model as ``moetune.AutoModelForCausalLM.from_config(config, dtype=dtype)`` builds it
    (moetune's class for its architectures, fp32 where the family keeps it: DeepSeek-V3's and
    Nemotron-H's routers), on the meta device."""
    from moetune.auto import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def build_inventory(name: str, config: Any, *, lora: Any = None, dtype: torch.dtype = torch.bfloat16) -> Inventory:
    """The inventory of ``config``'s moetune model (built on the meta device), with ``lora`` (a
    ``moetune.lora.LoraSettings``) applied as moetune applies it (base weights frozen), in ``dtype``."""
    model = meta_training_model(config, dtype=dtype)
    if lora is not None:
        from moetune.lora import apply_lora

        apply_lora(model, lora)
    flops = FlopsCounter(model)
    groups = _fsdp_groups(model)
    expert_ids = {id(p) for block in moe_blocks(model) for p in block.experts.parameters()}
    params = tuple(
        ParamInfo(name=n, shape=tuple(p.shape), trainable=p.requires_grad, expert=id(p) in expert_ids,
                  group=_group_of(n, groups), dtype_bytes=p.element_size())
        for n, p in model.named_parameters()
    )
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    embedding = model.get_input_embeddings()
    head = model.get_output_embeddings()
    counts = {b.num_experts for b in moe_blocks(model)}
    return Inventory(
        name=name, config=config, params=params, layers=tuple(_layer_shapes(model, config)),
        buffer_bytes=buffers, hidden=config.hidden_size, vocab=embedding.weight.shape[0],
        tied_embeddings=head is not None and head.weight is embedding.weight,
        num_experts=counts.pop() if counts else 0, top_k=int(getattr(config, "num_experts_per_tok", 0) or 0),
        flops=flops, lora_rank=0 if lora is None else lora.rank,
    )


def _fsdp_groups(model: nn.Module) -> dict[str, str]:
    """Module name prefix -> FSDP2 group, as ``apply_fsdp`` wraps them (longest prefix wins)."""
    names = {id(m): n for n, m in model.named_modules()}
    groups: dict[str, str] = {}
    for layer in decoder_layers(model):
        groups[names[id(layer)]] = f"layers.{names[id(layer)].rsplit('.', 1)[-1]}"
    for block in moe_blocks(model):
        prefix = names[id(block.experts)]
        layer_group = next(g for p, g in groups.items() if prefix.startswith(p + "."))
        groups[prefix] = f"{layer_group}.experts"
    embedding = model.get_input_embeddings()
    groups[names[id(embedding)]] = EMBED_GROUP
    return groups


def _group_of(param_name: str, groups: dict[str, str]) -> str:
    best = ""
    for prefix in groups:
        if param_name.startswith(prefix + ".") and len(prefix) > len(best):
            best = prefix
    return groups[best] if best else ROOT_GROUP


def _linear_flops(module: nn.Module) -> tuple[float, float]:
    """(forward FLOPs per token of a module's nn.Linear weights without routers, of its routers)."""
    dense = router = 0.0
    for name, sub in module.named_modules():
        if isinstance(sub, nn.Linear):
            flops = 2.0 * sub.in_features * sub.out_features
            if name.rsplit(".", 1)[-1] in ("gate", "router"):
                router += flops
            else:
                dense += flops
        elif getattr(sub, "weight", None) is not None and type(sub).__name__.endswith("Router"):
            router += 2.0 * sub.weight.numel()
    return dense, router


def _layer_shapes(model: nn.Module, config: Any) -> list[LayerShape]:
    shapes = []
    for index, layer in enumerate(decoder_layers(model)):
        attention = mamba = moe = mlp = None
        norms = 0
        for name, module in layer.named_children():
            if name.endswith("norm"):
                norms += 1
        for module in layer.modules():
            if isinstance(module, MoEBlock):
                moe = _moe_shape(module, config)
            elif _is_attention(module) and attention is None:
                attention = _attention_shape(module, config)
            elif "Mamba" in type(module).__name__ and hasattr(module, "ssm_state_size") and mamba is None:
                mamba = _mamba_shape(module)
        if moe is None:
            mlp = _dense_mlp_shape(layer)
        dense, router = _linear_flops(layer)
        experts = 0.0
        if moe is not None:
            block = next(m for m in layer.modules() if isinstance(m, MoEBlock))
            per_expert = sum(p[0].numel() for n, p in block.experts.named_parameters() if p.dim() == 3 and "lora" not in n)
            experts = moe.top_k * 2.0 * per_expert
        shapes.append(LayerShape(index=index, hidden=config.hidden_size, norms=norms, attention=attention,
                                 mamba=mamba, moe=moe, mlp=mlp, dense_forward_flops=dense,
                                 expert_forward_flops=experts, router_forward_flops=router))
    return shapes


def _is_attention(module: nn.Module) -> bool:
    return type(module).__name__.endswith("Attention") and hasattr(module, "o_proj")


def _attention_shape(module: nn.Module, config: Any) -> AttentionShape:
    heads = config.num_attention_heads
    if hasattr(module, "kv_b_proj"):  # multi-head latent attention
        return AttentionShape(
            heads=heads, kv_heads=heads, qk_head_dim=module.qk_head_dim, v_head_dim=module.v_head_dim, window=None,
            qk_norm=False, latent=True, q_lora_rank=module.q_lora_rank or 0, kv_lora_rank=module.kv_lora_rank,
            rope_dim=module.qk_rope_head_dim,
        )
    head_dim = getattr(module, "head_dim", None) or config.hidden_size // heads
    kv_heads = module.k_proj.out_features // head_dim
    window = getattr(module, "sliding_window", None) or None
    return AttentionShape(heads=heads, kv_heads=kv_heads, qk_head_dim=head_dim, v_head_dim=head_dim, window=window,
                          qk_norm=hasattr(module, "q_norm"))


def _mamba_shape(module: nn.Module) -> MambaShape:
    return MambaShape(
        d_inner=module.intermediate_size, heads=module.num_heads, head_dim=module.head_dim, groups=module.n_groups,
        state=module.ssm_state_size, chunk=module.chunk_size, in_proj_width=module.in_proj.out_features,
        conv_width=module.conv_dim,
    )


def _moe_shape(block: MoEBlock, config: Any) -> MoEShape:
    experts: GroupedExperts = block.experts
    shared = getattr(block, "shared_experts", None)
    shared_width = 0
    if shared is not None:
        linears = [m for m in shared.modules() if isinstance(m, nn.Linear)]
        # The down projection maps the shared width back to the hidden size.
        shared_width = max(m.in_features for m in linears if m.out_features == config.hidden_size)
    return MoEShape(
        num_experts=block.num_experts, top_k=int(config.num_experts_per_tok), expert_in=experts.hidden_size,
        intermediate=experts.intermediate_size, gated=experts.gated, shared_intermediate=shared_width,
        latent=hasattr(block, "fc1_latent_proj"),
    )


def _dense_mlp_shape(layer: nn.Module) -> DenseMLPShape | None:
    for module in layer.modules():
        down = getattr(module, "down_proj", None)
        if isinstance(down, nn.Linear) and not isinstance(module, MoEBlock):
            return DenseMLPShape(intermediate=down.in_features, gated=hasattr(module, "gate_proj") or
                                 hasattr(module, "gate_up_proj"))
    return None
