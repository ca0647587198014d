"""Activation checkpointing for moetune's (and Transformers') decoder layers: full or selective.

- ``full``: each decoder layer keeps only its input and recomputes everything in backward.
- ``selective``: the outputs of the expensive ops (dense and grouped GEMMs, attention) are kept,
  the cheap memory-bound ops (norms, RoPE, SwiGLU, permutation, routing softmax) are recomputed.
  That frees their activations for a small fraction of the recompute cost of ``full``.
  (TorchTitan's op-level selective checkpointing, through torch's
  ``create_selective_checkpoint_contexts``.)

Both go through Transformers' per-layer switch (``gradient_checkpointing_enable``), so parameter
names and user code stay unchanged, and routing is recomputed identically (same inputs).
"""

from __future__ import annotations


import torch
from torch import nn

MODES = ("none", "full", "selective")


def _saved_ops() -> set:
    """Ops whose outputs selective checkpointing keeps (those that exist in this torch build)."""
    names = [
        "mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "_scaled_mm", "_scaled_grouped_mm",  # FP8 too
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward",
    ]  # fmt: skip
    return {getattr(torch.ops.aten, name).default for name in names if hasattr(torch.ops.aten, name)}


def selective_checkpoint_context():
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint``: keep GEMM / attention outputs."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    saved = _saved_ops()

    def policy(_ctx, op, *_args, **_kwargs):
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def enable_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """Turn on ``mode`` (see ``MODES``) for every decoder layer of a Transformers-style model."""
    if mode not in MODES:
        raise ValueError(f"activation checkpointing mode must be one of {MODES}, got {mode!r}")
    if mode == "none":
        return
    kwargs = {"use_reentrant": False}
    if mode == "selective":
        kwargs["context_fn"] = selective_checkpoint_context
    # Transformers >= 5.2x renamed the switch (the old name is a deprecated alias).
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


__all__ = ["MODES", "enable_activation_checkpointing", "selective_checkpoint_context"]
