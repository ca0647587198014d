"""The fine-tuning recipe behind ``moetune finetune`` (see README.md in this folder).

    from moetune.recipe import finetune, load_config
    result = finetune(load_config(yaml_path="examples/default.yaml", overrides=["--optim.lr", "1e-3"]))
"""

from moetune.recipe.config import JobConfig
from moetune.recipe.config_loading import load_config
from moetune.recipe.train import FinetuneResult, finetune

__all__ = ["FinetuneResult", "JobConfig", "finetune", "load_config"]
