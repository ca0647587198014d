"""LoRA settings: the typed schema a recipe's YAML fills in."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_ADAPTER_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoraSettings:
    """Which weights get a low-rank adapter and how big it is (delta W = alpha / rank * B @ A)."""

    rank: int = 16
    """Rank r of every adapter: A is [r, in], B is [out, r] (per expert for grouped experts)."""

    alpha: float = 32.0
    """Scale numerator: the adapter's output is multiplied by alpha / rank (PEFT's `lora_alpha`)."""

    dropout: float = 0.0
    """Dropout on the adapter's input, for `target_modules` only. Expert adapters are folded into the
    expert weights, where input dropout cannot be applied (PEFT refuses it there too)."""

    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Name suffixes of `nn.Linear` modules to adapt (`q_proj` matches `model.layers.3.self_attn.q_proj`)."""

    target_experts: bool = True
    """Adapt the grouped experts' 3-D weights (`gate_up_proj` / `up_proj` and `down_proj`), one
    adapter per expert."""

    adapter_dtype: str = "float32"
    """dtype of the adapter parameters (float32, bfloat16 or float16); float32 keeps the small
    adapters and their optimizer states precise under bf16 base weights, as PEFT does by default."""

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"LoraSettings.rank must be a positive int, got {self.rank!r}")
        if not self.alpha > 0:
            raise ValueError(f"LoraSettings.alpha must be > 0, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoraSettings.dropout must be in [0, 1), got {self.dropout!r}")
        if isinstance(self.target_modules, str) or not all(isinstance(t, str) and t for t in self.target_modules):
            raise ValueError(
                f"LoraSettings.target_modules must be a list of non-empty name suffixes, got {self.target_modules!r}"
            )
        self.target_modules = list(self.target_modules)
        if not self.target_modules and not self.target_experts:
            raise ValueError("LoraSettings.target_modules is empty and target_experts is False: nothing to adapt")
        if self.adapter_dtype not in _ADAPTER_DTYPES:
            raise ValueError(
                f"LoraSettings.adapter_dtype must be one of {sorted(_ADAPTER_DTYPES)}, got {self.adapter_dtype!r}"
            )

    @property
    def scaling(self) -> float:
        """The factor applied to B @ A (PEFT's `lora_alpha / r`, without rsLoRA)."""
        return self.alpha / self.rank

    @property
    def torch_dtype(self) -> torch.dtype:
        return _ADAPTER_DTYPES[self.adapter_dtype]
