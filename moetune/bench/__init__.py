"""``moetune bench``: Transformers v5 vs moetune, side by side (see README.md and benchmarks/README.md)."""

from moetune.bench.cli import main
from moetune.flops import training_flops_per_token as flops_per_token

__all__ = ["flops_per_token", "main"]
