"""moetune: fast, lean Mixture-of-Experts fine-tuning with the Transformers API.

    # from transformers import AutoModelForCausalLM
    from moetune import AutoModelForCausalLM

    # and Transformers' Trainer / TRL's SFTTrainer with moetune's optimizer (and expert parallelism):
    from moetune import Trainer, SFTTrainer
"""

from moetune.auto import AutoModelForCausalLM
from moetune.options import MoetuneOptions

__version__ = "0.1.0"
__all__ = ["AutoModelForCausalLM", "MoetuneOptions", "SFTTrainer", "Trainer", "__version__"]


def __getattr__(name: str):
    # Imported on first use: Transformers' Trainer pulls in accelerate, which plain model use does not need.
    if name == "Trainer":
        from moetune.integrations.trainer import Trainer

        return Trainer
    if name == "SFTTrainer":  # TRL's, imported on first use (an optional package)
        from moetune.integrations.trainer import sft_trainer_class

        return sft_trainer_class()
    raise AttributeError(f"module 'moetune' has no attribute {name!r}")
