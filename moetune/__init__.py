"""moetune: fast, lean Mixture-of-Experts fine-tuning with the Transformers API.

    # from transformers import AutoModelForCausalLM
    from moetune import AutoModelForCausalLM

    # and, for expert-parallel models under torchrun, Transformers' Trainer:
    from moetune import Trainer
"""

from moetune.auto import AutoModelForCausalLM
from moetune.options import MoetuneOptions

__version__ = "0.1.0"
__all__ = ["AutoModelForCausalLM", "MoetuneOptions", "Trainer", "__version__"]


def __getattr__(name: str):
    # Imported on first use: Transformers' Trainer pulls in accelerate, which plain model use does not need.
    if name == "Trainer":
        from moetune.integrations.trainer import Trainer

        return Trainer
    raise AttributeError(f"module 'moetune' has no attribute {name!r}")
