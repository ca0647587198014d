"""Optimizers: a fused-kernel AdamW with torch.optim.AdamW's semantics."""

from moetune.optim.adamw import AdamW, AdamWInBackward

__all__ = ["AdamW", "AdamWInBackward"]
