"""moetune: fast, lean Mixture-of-Experts fine-tuning with the Transformers API.

    # from transformers import AutoModelForCausalLM
    from moetune import AutoModelForCausalLM
"""

from moetune.auto import AutoModelForCausalLM
from moetune.options import MoetuneOptions

__version__ = "0.1.0"
__all__ = ["AutoModelForCausalLM", "MoetuneOptions", "__version__"]
