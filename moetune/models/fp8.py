"""Turning FP8 training on for a built model: its linear layers and grouped experts, in place.

Parameters, their names, dtypes and module paths stay as they are (bf16 master weights, the same
state dict, ``save_pretrained`` writes the same checkpoint); only the GEMMs change:

- every ``nn.Linear`` of the decoder (attention, dense MLPs, shared experts, Mamba-2 projections,
  latent projections) becomes an ``Fp8Linear`` (``moetune.fp8.linear``), except the LM head (the
  loss stays in the weights' precision);
- every ``GroupedExperts`` gets ``fp8`` set: both grouped GEMMs in FP8;
- routers (moetune's own modules, not ``nn.Linear``), norms, attention's softmax, activations and
  the loss are untouched.

A layer is converted only if its widths are multiples of 16 (what FP8 tensor-core GEMMs need); the
others stay in their dtype, and ``fp8_layers`` lists which are FP8.
"""

from __future__ import annotations

from torch import nn

from moetune.fp8.linear import ALIGN, Fp8Linear, linear_fits
from moetune.fp8.settings import Fp8Settings
from moetune.moe import GroupedExperts


def experts_fit(experts: GroupedExperts) -> bool:
    return experts.hidden_size % ALIGN == 0 and experts.intermediate_size % ALIGN == 0


def enable_fp8(model: nn.Module, settings: Fp8Settings | None) -> nn.Module:
    """Switch ``model``'s decoder linears and experts to FP8 (``settings=None``: back to their dtype).
    Call before sharding it (``moetune.distributed.parallelize``), as ``from_pretrained(fp8=...)`` does."""
    head = _output_embeddings(model)
    for module in model.modules():
        if module is head:
            continue
        if isinstance(module, GroupedExperts):
            module.fp8 = settings if settings is not None and experts_fit(module) else None
        elif type(module) is nn.Linear and settings is not None and linear_fits(module):
            module.__class__ = Fp8Linear
            module.fp8 = settings
        elif type(module) is Fp8Linear:
            if settings is None:
                module.__class__ = nn.Linear
                del module.fp8
            else:
                module.fp8 = settings
    return model


def fp8_layers(model: nn.Module) -> list[str]:
    """Names of the modules whose GEMMs run in FP8."""
    return [
        name for name, module in model.named_modules()
        if isinstance(module, Fp8Linear) or (isinstance(module, GroupedExperts) and module.fp8 is not None)
    ]  # fmt: skip


def _output_embeddings(model: nn.Module) -> nn.Module | None:
    get = getattr(model, "get_output_embeddings", None)
    return get() if callable(get) else None
