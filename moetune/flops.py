"""Training FLOPs per token by the brief's convention (Megatron / NeMo), counted from a model's
modules so that every architecture gets the same rules:

    3 x [ sum of 2 x (weights a token passes through) + causal attention scores and values ]

- every ``nn.Linear`` (or Transformers' ``Conv1D``, GPT-2's) except routers: 2 x in x out (attention projections, dense and shared MLPs,
  latent projections, Mamba-2's in / out projections, the LM head);
- stacked experts (a module holding 3-D weights [E, ...]): top-k x 2 x one expert's weights;
- attention: QK^T and AV over the keys a causal query sees on average (S / 2, or about the window
  for sliding-window layers): 2 x keys x heads x (qk_dim + v_dim);
- Mamba-2 mixers: their projections as linears, plus the SSM scan as Megatron / NeMo count it for
  hybrid models (7 x d_inner x state FLOPs per token for forward + backward together);
- routers, embeddings, norms and convolutions are left out; backward = 2 x forward.

For Qwen3-MoE this is exactly 3 x [sum over layers (2H(q + 2kv + q) + 2 S q + MLP) + 2 H V].
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D  # GPT-2's linear layer, weight [in, out]

_ROUTER_NAMES = ("gate", "router")


def training_flops_per_token(model_or_config: nn.Module | Any, *, seq_len: int, frozen_weights: bool = False) -> float:
    """Forward + backward FLOPs per token at sequence length ``seq_len`` (a config is built on the
    meta device first: no memory). ``frozen_weights``: LoRA's count, see ``FlopsCounter.per_token``."""
    return FlopsCounter(model_or_config).per_token(seq_len, frozen_weights=frozen_weights)


class FlopsCounter:
    """The model's modules read once; then FLOPs for any sequence length or set of documents."""

    def __init__(self, model_or_config: nn.Module | Any) -> None:
        model = model_or_config if isinstance(model_or_config, nn.Module) else meta_model(model_or_config)
        self.config = model.config
        top_k = getattr(self.config, "num_experts_per_tok", 1) or 1
        self.weights_forward = 0.0
        # Attention FLOPs per key a token sees, summed per window (None: full causal attention), so
        # that a step's many documents cost a few products each, not a walk over every layer.
        self.attention_per_key: dict[int | None, float] = defaultdict(float)
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] not in _ROUTER_NAMES:
                self.weights_forward += 2 * module.in_features * module.out_features
            elif isinstance(module, Conv1D):
                self.weights_forward += 2 * module.nx * module.nf
            # Convolutions' 3-D kernels (Mamba-2's conv1d) are not stacked experts: left out, as above.
            is_conv = isinstance(module, nn.modules.conv._ConvNd)
            stacked = [p for n, p in module.named_parameters(recurse=False) if p.dim() == 3 and "lora" not in n]
            if stacked and not is_conv:
                self.weights_forward += top_k * 2 * sum(p[0].numel() for p in stacked)
            if _is_attention(module):
                window, per_key = _attention_per_key(module, self.config)
                self.attention_per_key[window] += per_key
            if _is_ssm_mixer(module):  # counted as forward (x 3 below), so 7 / 3 of d_inner x state
                self.weights_forward += 7 / 3 * module.intermediate_size * module.ssm_state_size

    def per_token(self, seq_len: int, *, frozen_weights: bool = False) -> float:
        """``frozen_weights``: the count for LoRA fine-tuning, where the weights get no gradient: the
        weights' forward and input gradient (2 x forward) and attention's forward and backward (3 x);
        the adapters' own FLOPs (rank / width of a weight's) are left out."""
        attention = sum(per_key * _keys_seen(window, seq_len) for window, per_key in self.attention_per_key.items())
        return (2.0 if frozen_weights else 3.0) * self.weights_forward + 3.0 * attention

    def of_documents(self, lengths: list[int], *, frozen_weights: bool = False) -> float:
        """Training FLOPs of packed documents whose tokens attend only within their own document
        (each document counted at its own length, as the varlen attention kernels compute it);
        ``frozen_weights`` as in ``per_token`` (LoRA)."""
        return sum(n * self.per_token(n, frozen_weights=frozen_weights) for n in lengths if n > 0)


def meta_model(config: Any) -> nn.Module:
    """``config``'s causal LM (moetune's class where it has one) on the meta device."""
    import transformers

    from moetune.models import family_for

    family = family_for(config)
    with torch.device("meta"):
        if family is not None:
            return family.causal_lm._from_config(config, attn_implementation=family.default_attention)
        return transformers.AutoModelForCausalLM.from_config(config)


def _is_ssm_mixer(module: nn.Module) -> bool:
    return "Mamba" in type(module).__name__ and hasattr(module, "ssm_state_size") and hasattr(module, "intermediate_size")


def _is_attention(module: nn.Module) -> bool:
    if not type(module).__name__.endswith("Attention"):
        return False
    # o_proj: Llama-style; c_proj / out_proj / dense: GPT-2, OPT, GPT-J, GPT-NeoX, Phi
    return hasattr(module, "o_proj") or (
        hasattr(module, "head_dim") and any(hasattr(module, n) for n in ("c_proj", "out_proj", "dense")))


def _attention_per_key(module: nn.Module, config: Any) -> tuple[int | None, float]:
    """(sliding window or None, QK^T and AV FLOPs per key a query sees)."""
    qk_dim = getattr(module, "qk_head_dim", None) or module.head_dim  # MLA: nope + rope dims
    v_dim = getattr(module, "v_head_dim", None) or module.head_dim
    return _sliding_window(module, config), 2 * config.num_attention_heads * (qk_dim + v_dim)


def _sliding_window(module: nn.Module, config: Any) -> int | None:
    """The layer's own window where its module holds one (GPT-OSS, Qwen3); else the config's per-layer
    kinds; else the config's window for every layer (Mistral, Mixtral pass ``config.sliding_window``
    to every layer's attention)."""
    if hasattr(module, "sliding_window"):
        return module.sliding_window or None
    layer_types = getattr(config, "layer_types", None)
    layer_idx = getattr(module, "layer_idx", None)
    if isinstance(layer_types, list) and layer_idx is not None and layer_idx < len(layer_types):
        return (getattr(config, "sliding_window", None) or None) if layer_types[layer_idx] == "sliding_attention" else None
    return getattr(config, "sliding_window", None) or None


def _keys_seen(window: int | None, seq_len: int) -> float:
    """Keys a causal query sees on average over a sequence of ``seq_len``."""
    if window and window < seq_len:  # token i sees min(i, window) keys
        return window - window * (window - 1) / (2 * seq_len)
    return seq_len / 2
