"""moetune's experts path for models that stay on Transformers' classes.

Transformers v5 lets an experts module pick its forward by name
(``experts_implementation=...``). Registering "moetune" there gives every fallback MoE model whose
experts moetune's path represents exactly (fused ``[gate; up]`` weights [E, 2I, H] and down weights
[E, H, I], no biases, no post-expert norm) moetune's fused permutation and grouped GEMMs. Between the
two GEMMs runs the experts' own gating: ``act(gate) * up`` (the fused SwiGLU kernel for SiLU), or
the class's ``_apply_gate`` where it defines one (clamped SwiGLU of Step-3.7 / DeepSeek-V4 /
HY-V4, soft-capped SwiGLU of Inkling-2, ...). Experts in any other layout (transposed or
interleaved weights, biases, ungated, post-expert norm: GPT-OSS, Aria, Ergo, Muse-Spark, ...) run
Transformers' default forward (grouped_mm) unchanged. "moetune" is chosen on CUDA by default, and
anywhere when the caller passes ``experts_backend`` (which it then runs: e.g. ``"quack"``).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from moetune.moe.dispatch import permute, unpermute
from moetune.moe.experts import gated_activation, run_experts
from moetune.moe.routing import Routing

IMPLEMENTATION_NAME = "moetune"
BACKEND_ATTRIBUTE = "moetune_experts_backend"
"""Set on a fallback model's experts modules by ``set_fallback_experts_backend`` (not saved: a module
attribute, not a config field); read by ``moetune_experts_forward``."""


def _has_moetune_layout(experts: nn.Module) -> bool:
    """The layout moetune's experts path computes exactly; the gating itself may be the class's own."""
    return (
        getattr(experts, "has_gate", True)
        and not getattr(experts, "has_bias", False)
        and not getattr(experts, "is_transposed", False)
        and getattr(experts, "is_concatenated", True)
        and not getattr(experts, "has_post_expert_norm", False)
        and not getattr(experts, "_is_expert_parallel", False)
        and hasattr(experts, "gate_up_proj")
    )


@functools.cache
def _own_gate(experts_class: type):
    """The experts class's ``_apply_gate`` when it overrides Transformers' default ``act(gate) * up``
    (clamps, soft caps, an activation taking gate and up), else None. Per class, once: the
    experts forward runs every layer of every step."""
    import transformers.integrations.moe as hf_moe

    apply_gate = getattr(experts_class, "_apply_gate", None)
    default = getattr(hf_moe, "_default_apply_gate", None)
    return None if apply_gate is None or apply_gate is default else apply_gate


def _gate_activation(experts: nn.Module):
    """``activate(h_NX, num_valid=None)`` for ``run_experts``: the class's own gating, else
    act(gate) * up (SiLU through the fused SwiGLU kernel)."""
    own_gate = _own_gate(type(experts))
    if own_gate is not None:
        return lambda h, num_valid=None: own_gate(experts, h)
    act = experts.act_fn
    is_silu = isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation" or act is F.silu
    return lambda h, num_valid=None: gated_activation(h, act, swiglu_kernel=is_silu, num_valid=num_valid)


def moetune_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    if not _has_moetune_layout(self):  # Transformers' default experts forward, unchanged
        from transformers.integrations.moe import grouped_mm_experts_forward

        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    routing = Routing(logits_TE=None, weights_TK=top_k_weights, experts_TK=top_k_index)
    x_NH, counts_E, state = permute(hidden_states, routing, num_experts=self.num_experts)
    y_NH = run_experts(
        x_NH,
        counts_E,
        self.gate_up_proj,
        self.down_proj,
        activate=_gate_activation(self),
        backend=getattr(self, BACKEND_ATTRIBUTE, "auto"),
    )
    return unpermute(y_NH, state).to(hidden_states.dtype)


def register_moetune_experts() -> None:
    """Add "moetune" to Transformers' experts implementations (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if IMPLEMENTATION_NAME not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION_NAME, moetune_experts_forward)


def set_fallback_experts_backend(model: nn.Module, backend: str) -> None:
    """Run every experts module of a fallback model (built with ``experts_implementation="moetune"``)
    on ``backend`` (``moetune.moe.experts.EXPERTS_BACKENDS``). Raises if none has the layout
    moetune's path takes (the others run Transformers' grouped_mm forward, where a backend would be
    silently ignored)."""
    # has_gate: set by Transformers' experts decorator (other modules may have a gate_up_proj too)
    plain = [m for m in model.modules() if hasattr(m, "has_gate") and _has_moetune_layout(m)]
    if not plain:
        raise ValueError(
            f"experts_backend={backend!r}: {type(model).__name__}'s experts are not in the layout moetune's experts path "
            "takes (fused [gate; up] weights [E, 2I, H], no biases, no post-expert norm), so they run Transformers' "
            "default forward"
        )
    for module in plain:
        setattr(module, BACKEND_ATTRIBUTE, backend)
