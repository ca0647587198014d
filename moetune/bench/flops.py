"""The bench's FLOPs per token: ``moetune.flops`` (the brief's convention, counted from the model's
modules; for Qwen3-MoE exactly 3 x [sum over layers (2H(q + 2kv + q) + 2 S q + MLP) + 2 H V])."""

from __future__ import annotations

from typing import Any

from moetune.flops import training_flops_per_token


def flops_per_token(config: Any, *, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token of ``config``'s model at ``seq_len``."""
    return training_flops_per_token(config, seq_len=seq_len)
