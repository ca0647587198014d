"""Transformers' SiLU-gated MLP (``down_proj(act(gate_proj(x)) * up_proj(x))``: DeepSeek-V3's
shared experts and dense layers, Qwen3-MoE's dense layers) with the activation as one kernel.

Same parameter names and shapes as Transformers' ``*MLP`` classes, so checkpoints load unchanged.
Transformers runs ``silu`` and the product as separate elementwise kernels each way (~5 passes over
the [tokens, intermediate] activations); ``moetune.kernels.swiglu_split`` does each direction in one.
"""

from __future__ import annotations

import torch
from torch import nn

from moetune.kernels import swiglu_split


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu_split(self.gate_proj(x), self.up_proj(x)))


def gated_mlp(config, hf_mlp_cls: type[nn.Module], intermediate_size: int | None = None) -> nn.Module:
    """``GatedMLP`` where the config's activation is SiLU (the kernel's), else Transformers' class."""
    size = intermediate_size if intermediate_size is not None else config.intermediate_size
    if getattr(config, "hidden_act", None) not in ("silu", "swish"):
        return hf_mlp_cls(config, intermediate_size=size)
    return GatedMLP(config.hidden_size, size)
