"""Fused kernels (Triton on CUDA) with plain PyTorch references; see README.md.

Every public function takes ``impl="auto" | "triton" | "torch"``; ``"auto"`` runs Triton on CUDA
tensors when Triton is installed and the reference otherwise.
"""

from moetune.kernels._triton_utils import HAS_TRITON
from moetune.kernels.permute import moe_combine, moe_combine_reference, moe_permute, moe_permute_reference
from moetune.kernels.rms_norm import RMSNorm, rms_norm, rms_norm_reference
from moetune.kernels.rope import apply_rope, apply_rope_reference
from moetune.kernels.swiglu import swiglu, swiglu_reference, swiglu_split, swiglu_split_reference

__all__ = [
    "HAS_TRITON",
    "RMSNorm",
    "apply_rope",
    "apply_rope_reference",
    "moe_combine",
    "moe_combine_reference",
    "moe_permute",
    "moe_permute_reference",
    "rms_norm",
    "rms_norm_reference",
    "swiglu",
    "swiglu_reference",
    "swiglu_split",
    "swiglu_split_reference",
]
