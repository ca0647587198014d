"""moetune's run-time switches for a built model (kept out of the config so saved checkpoints stay
plain Transformers checkpoints)."""

from __future__ import annotations

from torch import nn

from moetune.kernels import quack_grouped_gemm
from moetune.moe import ROUTERS, GroupedExperts
from moetune.options import check_experts_backend_name


def check_experts_backend(experts_backend: str) -> None:
    """A known backend whose kernels import here (quack is an optional package)."""
    check_experts_backend_name(experts_backend)
    if experts_backend == "quack":
        quack_grouped_gemm.require()


def set_moe_options(model: nn.Module, *, balanced_gate: bool | None = None, experts_backend: str | None = None) -> None:
    """Switch every MoE layer's router to the balanced benchmark gate and/or pick the experts kernel."""
    if experts_backend is not None:
        check_experts_backend(experts_backend)
    for module in model.modules():
        if balanced_gate is not None and isinstance(module, ROUTERS):
            module.balanced = balanced_gate
        if experts_backend is not None and isinstance(module, GroupedExperts):
            module.backend = experts_backend
