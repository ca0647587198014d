"""One folder per model family (model + checkpoint layout); see README.md."""

from moetune.models.options import set_moe_options
from moetune.models.registry import FAMILIES, ModelFamily, family_for, family_of_class

__all__ = ["FAMILIES", "ModelFamily", "family_for", "family_of_class", "set_moe_options"]
