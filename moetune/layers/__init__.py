"""Shared model building blocks (besides the MoE layer in moetune.moe)."""

from moetune.layers.linear_cross_entropy import (
    IGNORE_INDEX,
    linear_cross_entropy,
    lm_head_cross_entropy,
    shift_labels_for_causal_lm,
)

__all__ = ["IGNORE_INDEX", "linear_cross_entropy", "lm_head_cross_entropy", "shift_labels_for_causal_lm"]
