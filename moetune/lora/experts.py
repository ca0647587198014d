"""LoRA on grouped experts: one adapter per expert, folded into the 3-D weight on every read.

Shape legend: E experts held by the module, O output features, I input features, R rank.

For a weight W [E, O, I] (Transformers v5's layout: `gate_up_proj` [E, 2*inter, H], `down_proj`
[E, H, inter]) the adapters are A [E, R, I] and B [E, O, R], and the experts' forward sees
W_e + s * B_e @ A_e. (Layouts stored transposed, [E, I, O], flagged `is_transposed` by
Transformers, get the transposed delta.) The adapters are parameters of the experts module
itself (`experts.lora_A_gate_up_proj`); on an expert-parallel module (weights are DTensors
sharded on the expert dim) they are sharded the same way, so each rank holds the adapters of its
own experts and the delta is computed locally.

moetune's own experts (`GroupedExperts`) apply the adapters to the activations: the module's class
is swapped for a subclass whose `lora_adapters()` hands them to the experts' GEMMs, which add
s * (x A_e^T) B_e^T per expert group (two thin grouped GEMMs). The adapted weight is never formed,
and the frozen W gets no weight gradient: the full-size weight-gradient GEMM, a third of the
experts' FLOPs, is skipped.

Any other experts module (Transformers' own, on fallback models) gets the delta folded into the
weight without touching its forward: the subclass has a property per adapted weight, the mechanism
of `torch.nn.utils.parametrize`, but the Parameter stays in `_parameters` under its own name, so
`state_dict()` keys, FSDP2 (which swaps `_parameters` entries) and `named_parameters()` are those
of the plain model. The property adds the delta only while the module's own forward runs (the
subclass's forward sets a flag); anywhere else it is the plain Parameter. Cost: the adapted weight
is materialised once per forward (and kept for backward), like PEFT's ParamWrapper.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from moetune.lora.init import fold_delta, reset_adapter_
from moetune.moe.experts import ExpertAdapter

_SCALING = "lora_scaling"
_TARGETS = "_moetune_lora_targets"
_IS_LORA_CLASS = "_moetune_lora_class"
_IN_FORWARD = "_moetune_lora_in_forward"


def lora_a_name(param_name: str) -> str:
    return f"lora_A_{param_name}"


def lora_b_name(param_name: str) -> str:
    return f"lora_B_{param_name}"


def is_lora_experts(module: nn.Module) -> bool:
    return hasattr(module, _TARGETS)


def adapted_params(module: nn.Module) -> tuple[str, ...]:
    """Names of the adapted weights, in the module's parameter registration order."""
    return getattr(module, _TARGETS)


def is_transposed(module: nn.Module) -> bool:
    # Transformers marks experts stored [E, in, out] (GPT-OSS) with `is_transposed`; PEFT reads the same flag.
    return bool(getattr(module, "is_transposed", False))


def add_expert_adapters(
    module: nn.Module, param_names: tuple[str, ...], *, rank: int, scaling: float, dtype: torch.dtype
) -> None:
    """Give every expert of `module` an adapter on each of `param_names` (3-D weights).

    Expert-parallel weights (DTensors sharded on the expert dim) get adapters sharded the same way,
    so each rank holds the adapters of its own experts.
    """
    if is_lora_experts(module):
        raise ValueError(f"{type(module).__name__} already has LoRA adapters")
    transposed = is_transposed(module)
    for name in param_names:
        weight = module._parameters[name]
        if weight is None or weight.dim() != 3:
            raise TypeError(f"expert weight {name!r} must be a 3-D parameter [E, out, in]")
        num_experts = weight.shape[0]  # global E for a DTensor
        out_features, in_features = (weight.shape[2], weight.shape[1]) if transposed else weight.shape[1:]
        lora_A_ERI = torch.empty(num_experts, rank, in_features, device=weight.device, dtype=dtype)
        lora_B_EOR = torch.empty(num_experts, out_features, rank, device=weight.device, dtype=dtype)
        lora_A_ERI = nn.Parameter(_shard_like(lora_A_ERI, weight, name))
        lora_B_EOR = nn.Parameter(_shard_like(lora_B_EOR, weight, name))
        reset_adapter_(lora_A_ERI, lora_B_EOR)
        module.register_parameter(lora_a_name(name), lora_A_ERI)
        module.register_parameter(lora_b_name(name), lora_B_EOR)
    setattr(module, _SCALING, scaling)
    setattr(module, _TARGETS, tuple(param_names))
    module.__class__ = _lora_class(type(module), tuple(param_names))


def _shard_like(adapter: torch.Tensor, weight: torch.Tensor, name: str) -> torch.Tensor:
    """`adapter` (global, [E, ...]) placed like `weight` when that is a DTensor (expert parallelism)."""
    if not isinstance(weight, DTensor):
        return adapter
    if not all(p.is_replicate() or (p.is_shard() and p.dim == 0) for p in weight.placements):
        raise NotImplementedError(
            f"LoRA on expert weight {name!r} placed {weight.placements}: only sharding on the expert dim "
            "(expert parallelism) or replication is supported; apply_lora before FSDP2 / tensor parallelism"
        )
    return distribute_tensor(adapter, weight.device_mesh, weight.placements)


def expert_delta(module: nn.Module, param_name: str) -> torch.Tensor:
    """s * B_e @ A_e for every expert, float32, in the stored layout of the weight.

    Adapters sharded only on the expert dim (expert parallelism, FSDP2 over the experts' replicas)
    hold whole experts on each rank: the delta is computed on the local experts and wrapped with the
    adapters' placements. (DTensor's bmm would do the same work, but torch 2.9 labels its output
    plain ``Shard(0)`` where FSDP2 made the input ``_StridedShard(0)``: folded into the weight, the
    experts of two ranks trade places.)"""
    lora_A_ERI = module._parameters[lora_a_name(param_name)].detach()
    lora_B_EOR = module._parameters[lora_b_name(param_name)].detach()
    scaling, transposed = getattr(module, _SCALING), is_transposed(module)
    if _whole_experts_per_rank(lora_A_ERI, lora_B_EOR):
        local_EOI = scaling * torch.bmm(lora_B_EOR.to_local().float(), lora_A_ERI.to_local().float())
        shape = (lora_A_ERI.shape[0], lora_B_EOR.shape[1], lora_A_ERI.shape[2])
        if transposed:
            local_EOI, shape = local_EOI.transpose(1, 2), (shape[0], shape[2], shape[1])
        return DTensor.from_local(
            local_EOI, lora_A_ERI.device_mesh, lora_A_ERI.placements, run_check=False, shape=torch.Size(shape),
            stride=_strides(shape, transposed),
        )  # fmt: skip
    delta_EOI = scaling * torch.bmm(lora_B_EOR.float(), lora_A_ERI.float())
    return delta_EOI.transpose(1, 2) if transposed else delta_EOI


def _whole_experts_per_rank(lora_A_ERI: torch.Tensor, lora_B_EOR: torch.Tensor) -> bool:
    """Both adapters DTensors on one mesh, placed alike, each mesh dim replicating or sharding experts."""
    if not (isinstance(lora_A_ERI, DTensor) and isinstance(lora_B_EOR, DTensor)):
        return False
    placements = lora_A_ERI.placements
    return (
        lora_B_EOR.device_mesh == lora_A_ERI.device_mesh
        and lora_B_EOR.placements == placements
        and all(p.is_replicate() or (isinstance(p, Shard) and p.dim == 0) for p in placements)
    )


def _strides(shape: tuple[int, int, int], transposed: bool) -> tuple[int, int, int]:
    """Strides of a contiguous [E, O, I] tensor, or of the [E, I, O] transpose of one."""
    _, second, third = shape
    return (second * third, 1, second) if transposed else (second * third, third, 1)


def merge_expert_adapters(module: nn.Module) -> None:
    """Fold every expert's delta into its weight (float32, then cast back) and remove the adapters."""
    with torch.no_grad():
        for name in adapted_params(module):
            weight = module._parameters[name]
            weight.copy_(fold_delta(weight, expert_delta(module, name)))
    remove_expert_adapters(module)


def remove_expert_adapters(module: nn.Module) -> None:
    lora_class = type(module)
    if not lora_class.__dict__.get(_IS_LORA_CLASS, False):
        # e.g. fully_shard swapped in its own subclass after apply_lora; undoing ours would drop that.
        raise NotImplementedError(
            f"cannot remove LoRA from a {lora_class.__name__}: the module was wrapped after apply_lora; "
            "merge or remove adapters before wrapping (or on an unwrapped copy)"
        )
    for name in adapted_params(module):
        del module._parameters[lora_a_name(name)]
        del module._parameters[lora_b_name(name)]
    module.__class__ = lora_class.__bases__[0]
    for attr in (_TARGETS, _SCALING, _IN_FORWARD):
        module.__dict__.pop(attr, None)


def _adapted_weight(module: nn.Module, name: str) -> torch.Tensor:
    weight = module._parameters[name]
    if not module.__dict__.get(_IN_FORWARD, False):
        # Outside the experts' forward the attribute is the plain Parameter, as PEFT's ParamWrapper
        # does: FSDP2 (reset_sharded_param), initialisers and user code read it via getattr and
        # must get the Parameter itself, not W + delta.
        return weight
    lora_A_ERI = module._parameters[lora_a_name(name)].to(weight.dtype)
    lora_B_EOR = module._parameters[lora_b_name(name)].to(weight.dtype)
    scaling = getattr(module, _SCALING)
    if is_transposed(module):
        # [E, I, O] storage: W_e + s * A_e^T @ B_e^T.
        return torch.baddbmm(weight, lora_A_ERI.transpose(1, 2), lora_B_EOR.transpose(1, 2), alpha=scaling)
    # One fused W + s * B @ A (no separate delta tensor the size of all experts).
    return torch.baddbmm(weight, lora_B_EOR, lora_A_ERI, alpha=scaling)


def _lora_adapters(module: nn.Module) -> tuple[ExpertAdapter | None, ...]:
    """What ``GroupedExperts.lora_adapters`` returns for an adapted module: per projection, its adapter."""
    scaling = getattr(module, _SCALING)
    return tuple(
        ExpertAdapter(module._parameters[lora_a_name(name)], module._parameters[lora_b_name(name)], scaling)
        if name in adapted_params(module) else None
        for name in module.weight_names
    )  # fmt: skip


# Cached so every adapted module of one class shares one subclass (one torch.compile guard, not one per layer).
@functools.cache
def _lora_class(base: type[nn.Module], param_names: tuple[str, ...]) -> type[nn.Module]:
    namespace: dict[str, object] = {_IS_LORA_CLASS: True}
    if hasattr(base, "lora_adapters"):
        # moetune's experts take the adapters themselves (on the activations); the weights stay plain.
        namespace["lora_adapters"] = _lora_adapters
        return type(f"Lora{base.__name__}", (base,), namespace)
    namespace.update({
        name: property(functools.partial(_adapted_weight, name=name), doc=f"{name} with its LoRA delta")
        for name in param_names
    })  # fmt: skip

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        previous = self.__dict__.get(_IN_FORWARD, False)
        self.__dict__[_IN_FORWARD] = True
        try:
            return base.forward(self, *args, **kwargs)
        finally:
            self.__dict__[_IN_FORWARD] = previous

    namespace["forward"] = forward
    return type(f"Lora{base.__name__}", (base,), namespace)
