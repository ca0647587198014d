"""FP8 (e4m3) training of the linear layers and grouped experts, opt-in: ``fp8="rowwise" | "blockwise"``.

See README.md in this folder for the recipes, the kernels each backend runs and the measurements;
``moetune.models.fp8.enable_fp8`` turns it on for a built model.
"""

from moetune.fp8.functions import fp8_grouped_linear, fp8_linear
from moetune.fp8.linear import Fp8Linear
from moetune.fp8.settings import FP8_BACKENDS, FP8_RECIPES, Fp8Settings, check_fp8_hardware, fp8_settings

__all__ = [
    "FP8_BACKENDS",
    "FP8_RECIPES",
    "Fp8Linear",
    "Fp8Settings",
    "check_fp8_hardware",
    "fp8_grouped_linear",
    "fp8_linear",
    "fp8_settings",
]
