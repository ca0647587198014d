"""AdamW's per-element update as Triton device functions, shared by the optimizer's kernel
(``moetune/optim/adamw.py``) and the experts' weight-gradient GEMM that updates in its epilogue
(``grouped_weight_update.py``), so both compute exactly ``torch.optim.AdamW``'s step.

The update is torch's: decoupled weight decay, bias-corrected moments, eps after the square root,
in fp32, moments stored in their tensors' dtype. The learning rate and the step count are host
numbers (bias corrections computed on the host) or 0-d fp32 device tensors read by the kernel (for
CUDA-graph capture); ``launch_scalars`` turns either into a kernel's arguments.
"""

from __future__ import annotations

import math

import torch

from moetune.kernels._triton_utils import HAS_TRITON, tl, triton

if HAS_TRITON:

    @triton.jit
    def adamw_scalars(
        lr, bias_correction1, bias_correction2_sqrt, lr_ptr, step_ptr, log2_beta1, log2_beta2,
        LR_ON_DEVICE: tl.constexpr, STEP_ON_DEVICE: tl.constexpr,
    ):  # fmt: skip
        """(lr, bias_correction1, sqrt(bias_correction2)), read from the device where they live there."""
        if LR_ON_DEVICE:
            lr = tl.load(lr_ptr).to(tl.float32)
        if STEP_ON_DEVICE:  # beta**step as exp2(step * log2(beta)): fp32, like torch's capturable AdamW
            step = tl.load(step_ptr).to(tl.float32)
            bias_correction1 = 1.0 - tl.exp2(step * log2_beta1)
            bias_correction2_sqrt = tl.sqrt(1.0 - tl.exp2(step * log2_beta2))
        return lr, bias_correction1, bias_correction2_sqrt

    @triton.jit
    def adamw_update(
        param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2_sqrt
    ):
        """One AdamW step on fp32 values: (param, exp_avg, exp_avg_sq) after it."""
        param = param * (1.0 - lr * weight_decay)
        exp_avg = beta1 * exp_avg + (1.0 - beta1) * grad
        exp_avg_sq = beta2 * exp_avg_sq + (1.0 - beta2) * grad * grad
        denom = tl.sqrt(exp_avg_sq) / bias_correction2_sqrt + eps
        param = param - (lr / bias_correction1) * exp_avg / denom
        return param, exp_avg, exp_avg_sq


def launch_scalars(lr: float | torch.Tensor, step: int | torch.Tensor, beta1: float, beta2: float, dummy: torch.Tensor) -> dict:
    """Keyword arguments of ``adamw_scalars`` (and its constexprs) for a launch: ``lr`` and ``step``
    as host numbers, or 0-d fp32 device tensors the kernel reads (``dummy`` fills the unused pointers)."""
    lr_on_device, step_on_device = isinstance(lr, torch.Tensor), isinstance(step, torch.Tensor)
    return dict(
        lr=0.0 if lr_on_device else float(lr),
        bias_correction1=1.0 if step_on_device else 1.0 - beta1**step,
        bias_correction2_sqrt=1.0 if step_on_device else math.sqrt(1.0 - beta2**step),
        lr_ptr=lr if lr_on_device else dummy,
        step_ptr=step if step_on_device else dummy,
        log2_beta1=_log2(beta1),
        log2_beta2=_log2(beta2),
        LR_ON_DEVICE=lr_on_device,
        STEP_ON_DEVICE=step_on_device,
    )


def _log2(beta: float) -> float:
    return math.log2(beta) if beta > 0 else -math.inf
