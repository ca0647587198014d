"""AdamW and the warm-up + cosine learning-rate schedule.

The schedule is a pure function of the step, set on the optimizer before each step: nothing
to save, and a resumed run gets exactly the same learning rates.
"""

from __future__ import annotations

import math

import torch

from moetune.distributed.replicate import mixes_plain_and_dtensors
from moetune.recipe.config import OptimConfig


def build_optimizer(params: list[torch.nn.Parameter], config: OptimConfig, *,
                    device: torch.device, capturable: bool = False) -> torch.optim.Optimizer:
    """AdamW over trainable params: moetune's kernel on CUDA (and for replicated + expert-parallel
    parameters anywhere), torch's fused kernel on CPU. ``capturable`` (CUDA): step counts and the
    learning rate on the device, for a step replayed from CUDA graphs."""
    if not params:
        raise ValueError("no trainable parameters (with lora.enabled, check lora.targets)")
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]  # norms and biases: decay would only shrink them
    groups = [{"params": decay, "weight_decay": config.weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    if device.type == "cuda" or mixes_plain_and_dtensors(params):
        # The same update as torch's fused AdamW, one Triton kernel per tensor: about twice its
        # bandwidth on large expert tensors (benchmarks/README.md). It also steps each tensor on its
        # own, which replicated parameters next to expert-parallel DTensors need
        # (distributed.dense_parallel "replicate"): torch's fused / foreach kernels cannot mix them.
        from moetune.optim import AdamW

        return AdamW(groups, lr=lr_at(0, config, total_steps=1), betas=tuple(config.betas), eps=config.eps,
                     capturable=capturable and device.type == "cuda")
    return torch.optim.AdamW(groups, lr=lr_at(0, config, total_steps=1), betas=tuple(config.betas),
                             eps=config.eps, fused=device.type == "cpu")


def lr_at(step: int, config: OptimConfig, *, total_steps: int) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warm-up to ``lr``, then cosine
    decay to ``lr * min_lr_ratio`` at ``total_steps``."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    decay_steps = max(1, total_steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.lr * (config.min_lr_ratio + (1.0 - config.min_lr_ratio) * cosine)
