"""AdamW's elementwise update, shared by the optimizer's kernel and the expert weight-gradient GEMM
that applies it in its epilogue (``grouped_weight_grad(..., adamw=)``).

The update is ``torch.optim.AdamW``'s (decoupled weight decay, bias-corrected moments, eps added
after the square root), computed in fp32 from the gradient as stored in the parameter's dtype, with
the moments stored back in their own dtype: what torch's ``fused=True`` does for bf16 parameters.
Bias corrections come from a host step count, or (CUDA-graph capture) from a 0-d fp32 device step
as ``1 - exp2(step * log2(beta))``, as torch's capturable AdamW computes them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from moetune.kernels._triton_utils import HAS_TRITON, tl, triton


@dataclass(frozen=True)
class AdamWUpdate:
    """One parameter's AdamW step, minus the parameter and its gradient: the moments (same shape
    and strides as the parameter) and the hyper-parameters. ``lr`` and ``step`` are Python numbers
    or 0-d fp32 device tensors (read by the kernel: capturable); ``step`` already counts this update."""

    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    lr: float | torch.Tensor
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int | torch.Tensor

    def viewed_as(self, view: torch.Tensor, base: torch.Tensor) -> AdamWUpdate:
        """The moments seen through the view ``view`` takes of ``base`` (e.g. a transposed weight)."""
        for name, moment in (("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)):
            if moment.shape != base.shape or moment.stride() != base.stride():
                raise ValueError(
                    f"AdamWUpdate: {name} must have the parameter's shape and strides, got {tuple(moment.shape)} "
                    f"{moment.stride()} for {tuple(base.shape)} {base.stride()}"
                )
        offset = view.storage_offset() - base.storage_offset()

        def same_view(moment: torch.Tensor) -> torch.Tensor:
            return moment.as_strided(view.shape, view.stride(), moment.storage_offset() + offset)

        return replace(self, exp_avg=same_view(self.exp_avg), exp_avg_sq=same_view(self.exp_avg_sq))

    def kernel_args(self, dummy: torch.Tensor) -> tuple[tuple, dict]:
        """(positional scalars and pointers, constexprs) in the order ``adamw_math``'s callers take:
        lr, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2_sqrt, lr_ptr, step_ptr,
        log2_beta1, log2_beta2; LR_ON_DEVICE, STEP_ON_DEVICE."""
        lr_on_device, step_on_device = isinstance(self.lr, torch.Tensor), isinstance(self.step, torch.Tensor)
        bias_correction1 = 1.0 if step_on_device else 1.0 - self.beta1**self.step
        bias_correction2_sqrt = 1.0 if step_on_device else math.sqrt(1.0 - self.beta2**self.step)
        args = (
            0.0 if lr_on_device else float(self.lr), self.beta1, self.beta2, self.eps, self.weight_decay,
            bias_correction1, bias_correction2_sqrt,
            self.lr if lr_on_device else dummy, self.step if step_on_device else dummy,
            _log2(self.beta1), _log2(self.beta2),
        )  # fmt: skip
        return args, {"LR_ON_DEVICE": lr_on_device, "STEP_ON_DEVICE": step_on_device}


def adamw_update_reference(param: torch.Tensor, grad: torch.Tensor, update: AdamWUpdate) -> None:
    """The update in PyTorch, in place, with the kernel's arithmetic (fp32, moments stored in their dtype)."""
    if isinstance(update.step, torch.Tensor):
        step = update.step.to(torch.float32)
        bias_correction1 = 1.0 - torch.exp2(step * _log2(update.beta1))
        bias_correction2_sqrt = torch.sqrt(1.0 - torch.exp2(step * _log2(update.beta2)))
    else:
        bias_correction1 = 1.0 - update.beta1**update.step
        bias_correction2_sqrt = math.sqrt(1.0 - update.beta2**update.step)
    lr = update.lr.to(torch.float32) if isinstance(update.lr, torch.Tensor) else update.lr
    grad = grad.to(param.dtype).float()  # the gradient as the parameter's dtype stores it
    exp_avg = update.exp_avg.float() * update.beta1 + (1.0 - update.beta1) * grad
    exp_avg_sq = update.exp_avg_sq.float() * update.beta2 + (1.0 - update.beta2) * grad * grad
    new = param.float() * (1.0 - lr * update.weight_decay)
    new = new - (lr / bias_correction1) * exp_avg / (exp_avg_sq.sqrt() / bias_correction2_sqrt + update.eps)
    param.copy_(new)
    update.exp_avg.copy_(exp_avg)
    update.exp_avg_sq.copy_(exp_avg_sq)


def _log2(beta: float) -> float:
    return math.log2(beta) if beta > 0 else -math.inf


if HAS_TRITON:

    @triton.jit
    def adamw_math(
        param, grad, exp_avg, exp_avg_sq,
        lr, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2_sqrt,
        lr_ptr, step_ptr, log2_beta1, log2_beta2,
        LR_ON_DEVICE: tl.constexpr, STEP_ON_DEVICE: tl.constexpr,
    ):  # fmt: skip
        """(param, exp_avg, exp_avg_sq) after the update, fp32 blocks in and out."""
        if LR_ON_DEVICE:
            lr = tl.load(lr_ptr).to(tl.float32)
        if STEP_ON_DEVICE:  # beta**step as exp2(step * log2(beta)): fp32, like torch's capturable AdamW
            step = tl.load(step_ptr).to(tl.float32)
            bias_correction1 = 1.0 - tl.exp2(step * log2_beta1)
            bias_correction2_sqrt = tl.sqrt(1.0 - tl.exp2(step * log2_beta2))
        param = param * (1.0 - lr * weight_decay)
        exp_avg = beta1 * exp_avg + (1.0 - beta1) * grad
        exp_avg_sq = beta2 * exp_avg_sq + (1.0 - beta2) * grad * grad
        denom = tl.sqrt(exp_avg_sq) / bias_correction2_sqrt + eps
        param = param - (lr / bias_correction1) * exp_avg / denom
        return param, exp_avg, exp_avg_sq
