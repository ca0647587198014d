"""``moetune bench``: Transformers v5 vs moetune, side by side (see README.md and benchmarks/README.md)."""

from moetune.bench.cli import main
from moetune.bench.flops import flops_per_token

__all__ = ["flops_per_token", "main"]
