"""``Fp8Linear``: an ``nn.Linear`` whose forward runs in FP8, with the same parameters.

``moetune.models.fp8.enable_fp8`` swaps the class of a built ``nn.Linear`` for this one (same
module object, parameters, hooks and state-dict keys), so LoRA hooks, PEFT's wrappers and FSDP2
(applied afterwards) see an ``nn.Linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moetune.fp8.functions import fp8_linear
from moetune.fp8.settings import Fp8Settings
from moetune.utils.autocast import cuda_autocast_dtype

ALIGN = 16
"""FP8 tensor-core GEMMs need widths that are multiples of 16 (16 bytes of e4m3)."""


class Fp8Linear(nn.Linear):
    """``fp8`` holds the settings."""

    fp8: Fp8Settings

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        compute_dtype = cuda_autocast_dtype(input)
        if compute_dtype is not None:
            # What autocast does to F.linear: the activations in its dtype (fp32 master weights are
            # quantised straight from fp32; their gradient comes back in fp32).
            input = input.to(compute_dtype)
        elif input.dtype != self.weight.dtype:
            return F.linear(input, self.weight, self.bias)  # mixed dtypes without autocast: torch's error
        bias = self.bias if self.bias is None or compute_dtype is None else self.bias.to(compute_dtype)
        return fp8_linear(input, self.weight, bias, settings=self.fp8)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8={self.fp8.recipe}"


def linear_fits(module: nn.Linear) -> bool:
    """Whether a linear layer's widths suit FP8 GEMMs."""
    return module.in_features % ALIGN == 0 and module.out_features % ALIGN == 0
