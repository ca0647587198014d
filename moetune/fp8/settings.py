"""The ``fp8=`` option: which scaling recipe, which kernels, and whether this machine can run them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

FP8_RECIPES = ("rowwise", "blockwise")
"""``rowwise``: one scale per row of each GEMM operand along the contraction dimension (per token for
activations and gradients, per output / input channel for weights). ``blockwise``: DeepSeek-V3's
1 x 128 slices for activations and gradients, 128 x 128 tiles for weights."""
FP8_BACKENDS = ("auto", "triton", "reference")
"""``auto``: torch's FP8 GEMMs where torch has them (cuBLAS ``_scaled_mm`` for dense layers, CUTLASS
``_scaled_grouped_mm`` for rowwise experts on sm90), moetune's Triton GEMMs elsewhere (blockwise
experts); ``triton``: moetune's Triton GEMMs everywhere; ``reference``: the plain-PyTorch reference
(dequantised operands multiplied in fp32) on any device, CPU included (tests, numerics checks)."""
FP8_WEIGHT_GRADS = ("bf16", "fp8")
"""The weight gradients' GEMM: ``bf16`` (the default: the operands as the forward received them, bf16
with fp32 accumulation, as TorchAO's ``rowwise_with_gw_hp``), or ``fp8`` (the recipe's quantisation
along the tokens, as DeepSeek-V3 trained). The weight gradient is the GEMM the most starved of tokens
per expert: 2.6x faster in bf16 than in FP8 at Qwen3-30B-A3B's shapes on an H100, and its gradients carry
no quantisation error. On source text it decided the loss: 1,200 steps ended +0.14% from bf16 with
``bf16``, +4.96% with ``fp8`` (three seeds each, docs/fp8.md)."""
DEFAULT_WEIGHT_GRAD = "bf16"
MIN_CAPABILITY = (8, 9)
"""FP8 tensor cores: Ada (sm89), Hopper (sm90) and newer."""


@dataclass(frozen=True)
class Fp8Settings:
    recipe: str
    """One of ``FP8_RECIPES``."""
    backend: str = "auto"
    """One of ``FP8_BACKENDS``."""
    weight_grad: str = DEFAULT_WEIGHT_GRAD
    """One of ``FP8_WEIGHT_GRADS``."""

    def __post_init__(self) -> None:
        if self.recipe not in FP8_RECIPES:
            raise ValueError(f"fp8 must be None or one of {FP8_RECIPES}, got {self.recipe!r}")
        if self.backend not in FP8_BACKENDS:
            raise ValueError(f"fp8_backend must be one of {FP8_BACKENDS}, got {self.backend!r}")
        if self.weight_grad not in FP8_WEIGHT_GRADS:
            raise ValueError(f"fp8_weight_grad must be one of {FP8_WEIGHT_GRADS}, got {self.weight_grad!r}")

    @property
    def blockwise(self) -> bool:
        return self.recipe == "blockwise"

    @property
    def block(self) -> int | None:
        """The activations' and gradients' slice width: None (a whole row) or 128."""
        from moetune.kernels.fp8_quantize import BLOCK

        return BLOCK if self.blockwise else None

    @property
    def impl(self) -> str:
        """The quantisation kernels' ``impl``: the torch reference for ``reference``, else Triton on CUDA."""
        return "torch" if self.backend == "reference" else "auto"


def fp8_settings(fp8: Any, fp8_backend: Any = "auto", fp8_weight_grad: Any = DEFAULT_WEIGHT_GRAD) -> Fp8Settings | None:
    """The settings for ``from_pretrained(..., fp8=..., fp8_backend=..., fp8_weight_grad=...)``; None for
    ``fp8=None``."""
    if fp8 is None:
        for name, value, default in (("fp8_backend", fp8_backend, "auto"), ("fp8_weight_grad", fp8_weight_grad, DEFAULT_WEIGHT_GRAD)):
            if value != default:
                raise ValueError(f"{name}={value!r} needs fp8='rowwise' or 'blockwise' (fp8 is None)")
        return None
    if not isinstance(fp8, str):
        raise TypeError(f"fp8 must be None or one of {FP8_RECIPES} (a string), got {type(fp8).__name__}")
    return Fp8Settings(recipe=fp8, backend=fp8_backend, weight_grad=fp8_weight_grad)


def fp8_hardware_problem(device: torch.device | None = None) -> str | None:
    """Why the FP8 kernels cannot run here (None when they can): no CUDA GPU, a GPU older than sm89,
    or no Triton (the quantisation kernels)."""
    from moetune.kernels._triton_utils import HAS_TRITON

    if device is not None and device.type != "cuda":
        return f"the tensors are on {device.type}, and moetune's FP8 kernels run on CUDA GPUs"
    if not torch.cuda.is_available():
        return "no CUDA GPU is available"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return f"{name} (sm{capability[0]}{capability[1]}) has no FP8 tensor cores (sm89+: Ada, Hopper, Blackwell)"
    if not HAS_TRITON:
        return "Triton is not installed (moetune's FP8 quantisation kernels need it: pip install moetune[gpu])"
    return None


def check_fp8_hardware(settings: Fp8Settings | None, device: torch.device | None = None) -> None:
    """A ValueError, before any FP8 work, when ``settings`` asks for kernels this machine lacks."""
    if settings is None or settings.backend == "reference":
        return
    problem = fp8_hardware_problem(device)
    if problem is not None:
        raise ValueError(
            f"fp8={settings.recipe!r} (fp8_backend={settings.backend!r}) needs a GPU with FP8 tensor cores, but "
            f"{problem}. Train in bf16 (fp8=None) here, or pass fp8_backend='reference' to run the plain-PyTorch "
            "reference of the FP8 numerics (any device, CPU included; slow, for tests)."
        )
