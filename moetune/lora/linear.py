"""LoRA on an `nn.Linear`: y = x W^T + b + s * (dropout(x) A^T) B^T.

The adapter lives on the Linear itself (`q_proj.lora_A` [r, in], `q_proj.lora_B` [out, r]) and is
added by a forward hook, so the base parameter keeps its name (`q_proj.weight`) and its module
path: state dicts, FSDP wrapping and user code that reads `q_proj.weight` see the plain model.
Computing the low-rank path on activations (not W + s B A) avoids the full-size weight gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from moetune.lora.init import fold_delta, reset_adapter_

# Attribute names set on an adapted Linear; `lora_` is the prefix that marks adapter parameters.
LORA_A = "lora_A"
LORA_B = "lora_B"
_SCALING = "lora_scaling"
_DROPOUT = "lora_dropout"
_HOOK = "_moetune_lora_hook"


def is_lora_linear(module: nn.Module) -> bool:
    return hasattr(module, _HOOK)


def add_linear_adapter(
    module: nn.Linear, *, rank: int, scaling: float, dropout: float, dtype: torch.dtype
) -> None:
    """Attach a rank-`rank` adapter to `module` (B starts at zero, so the output is unchanged)."""
    if is_lora_linear(module):
        raise ValueError(f"{module!r} already has a LoRA adapter")
    if isinstance(module.weight, DTensor):
        # Plain adapters next to a sharded weight would be neither sharded nor gradient-synchronised.
        raise NotImplementedError("LoRA on a sharded (DTensor) Linear: apply_lora before FSDP2 / tensor parallelism")
    out_features, in_features = module.weight.shape
    device = module.weight.device
    lora_A_RI = nn.Parameter(torch.empty(rank, in_features, device=device, dtype=dtype))
    lora_B_OR = nn.Parameter(torch.empty(out_features, rank, device=device, dtype=dtype))
    reset_adapter_(lora_A_RI, lora_B_OR)
    module.register_parameter(LORA_A, lora_A_RI)
    module.register_parameter(LORA_B, lora_B_OR)
    setattr(module, _SCALING, scaling)
    # Identity when dropout is 0 so the hook has one code path and no RNG use; a new module starts
    # in training mode, so follow the Linear's mode (apply_lora may be called after model.eval()).
    setattr(module, _DROPOUT, (nn.Dropout(dropout) if dropout > 0 else nn.Identity()).train(module.training))
    setattr(module, _HOOK, module.register_forward_hook(_lora_linear_hook, with_kwargs=True))


def _lora_linear_hook(module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> torch.Tensor:
    x = args[0] if args else kwargs["input"]
    # Compute in the activations' dtype (casting the small adapters, not x): the backward then saves
    # the x the base matmul already keeps instead of an fp32 copy per adapted Linear. Gradients still
    # reach the adapters in their own (fp32) dtype through the casts.
    lora_A = getattr(module, LORA_A).to(x.dtype)
    # The scaling goes on B (an [out, r] op in B's dtype) instead of on the [tokens, out] product, and
    # the GEMM's epilogue adds the base output (addmm, one rounding): the adapter costs two GEMMs and
    # no elementwise pass over the [tokens, out] output, forward or backward.
    lora_B, scaling = getattr(module, LORA_B), getattr(module, _SCALING)
    lora_B = (lora_B if scaling == 1 else lora_B * scaling).to(x.dtype)
    h = F.linear(getattr(module, _DROPOUT)(x), lora_A)
    out_2d = torch.addmm(output.reshape(-1, output.shape[-1]), h.reshape(-1, h.shape[-1]), lora_B.t())
    return out_2d.view(output.shape)


def linear_delta(module: nn.Module) -> torch.Tensor:
    """s * B @ A in float32, shaped like `module.weight` [out, in]."""
    lora_A, lora_B = getattr(module, LORA_A), getattr(module, LORA_B)
    return getattr(module, _SCALING) * (lora_B.detach().float() @ lora_A.detach().float())


def merge_linear_adapter(module: nn.Module) -> None:
    """Fold s * B @ A into `weight` (in float32, then cast back) and remove the adapter."""
    with torch.no_grad():
        module.weight.copy_(fold_delta(module.weight, linear_delta(module)))
    remove_linear_adapter(module)


def remove_linear_adapter(module: nn.Module) -> None:
    getattr(module, _HOOK).remove()
    for name in (_HOOK, _SCALING):
        delattr(module, name)
    for name in (LORA_A, LORA_B, _DROPOUT):
        delattr(module, name)
