"""The experts' weight-gradient GEMM with AdamW's update in its epilogue: the gradient is never written.

``grouped_weight_adamw_(param, exp_avg, exp_avg_sq, p, q, offsets_E, ...)`` applies one AdamW step
to an [E, M, C] expert weight whose gradient is ``grad[e] = p[rows_e]^T @ q[rows_e]`` (rows_e =
``offsets[e-1]:offsets[e]``, the rows routed to expert e; ``q``'s rows may be gathered as in
``grouped_weight_grad``). Each program computes one fp32 tile of the gradient, then reads that tile
of the weight and of both moments, updates them and writes them back.

Why: when the parameters are updated inside the backward (``CUDAGraphTrainStep(overlap_optimizer=
True)``), an expert weight's gradient exists only to be read once by AdamW. Unfused, the GEMM writes
it (2 bytes per bf16 element) and the optimizer reads it back (2) beside the 12 bytes of weight
and moments it must read and write: a quarter of the bytes of the experts' largest memory-bound
pass, plus a launch and a gradient buffer per weight. The fused update also uses the fp32
gradient as accumulated, where the unfused one rounds it to the weight's dtype first.

The AdamW math is ``moetune.kernels.adamw_math``'s, shared with the optimizer's own kernel; the
torch reference below computes the same step from a materialised fp32 gradient.
"""

from __future__ import annotations

import math

import torch

from moetune.kernels._triton_utils import HAS_TRITON, Impl, device_of, tl, triton, use_triton
from moetune.kernels.adamw_math import launch_scalars
from moetune.kernels.grouped_gemm import grouped_weight_grad_reference

if HAS_TRITON:
    from moetune.kernels.adamw_math import adamw_scalars, adamw_update
    from moetune.kernels.grouped_gemm import weight_grad_tile

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); benchmarks/grouped_update_probe.py times others.
UPDATE_CONFIG = (128, 128, 64, 8, 3)


def grouped_weight_adamw_reference(
    param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
    p: torch.Tensor, q: torch.Tensor, offsets_E: torch.Tensor, *,
    lr, step, beta1: float, beta2: float, eps: float, weight_decay: float,
    q_gather_order: torch.Tensor | None = None, top_k: int = 1,
) -> None:  # fmt: skip
    """The same step with the gradient materialised in fp32 (or wider; one host read of the group ends)."""
    compute = torch.promote_types(param.dtype, torch.float32)
    grad = grouped_weight_grad_reference(p.to(compute), q.to(compute), offsets_E, q_gather_order=q_gather_order, top_k=top_k)
    lr, step = float(lr), float(step)
    bias_correction1, bias_correction2_sqrt = 1.0 - beta1**step, math.sqrt(1.0 - beta2**step)
    weight, avg, avg_sq = param.to(compute), exp_avg.to(compute), exp_avg_sq.to(compute)
    weight.mul_(1.0 - lr * weight_decay)
    avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
    avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    weight.addcdiv_(avg, avg_sq.sqrt().div_(bias_correction2_sqrt).add_(eps), value=-lr / bias_correction1)
    param.copy_(weight)
    exp_avg.copy_(avg)
    exp_avg_sq.copy_(avg_sq)


if HAS_TRITON:

    @triton.jit
    def _grouped_weight_adamw_kernel(
        p_ptr, q_ptr, order_ptr, offsets_ptr, param_ptr, exp_avg_ptr, exp_avg_sq_ptr,
        M, num_cols, top_k,
        stride_pn, stride_pm, stride_qn, stride_qc, stride_we, stride_wm, stride_wc,
        beta1, beta2, eps, weight_decay,
        lr, bias_correction1, bias_correction2_sqrt, lr_ptr, step_ptr, log2_beta1, log2_beta2,
        GATHER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        LR_ON_DEVICE: tl.constexpr, STEP_ON_DEVICE: tl.constexpr,
    ):  # fmt: skip
        grad, group, ms, cols, m_mask, col_mask = weight_grad_tile(
            p_ptr, q_ptr, order_ptr, offsets_ptr, M, num_cols, top_k, stride_pn, stride_pm, stride_qn, stride_qc,
            GATHER, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        lr, bias_correction1, bias_correction2_sqrt = adamw_scalars(
            lr, bias_correction1, bias_correction2_sqrt, lr_ptr, step_ptr, log2_beta1, log2_beta2,
            LR_ON_DEVICE, STEP_ON_DEVICE,
        )  # fmt: skip
        offsets = (group.to(tl.int64) * stride_we + ms.to(tl.int64)[:, None] * stride_wm
                   + cols.to(tl.int64)[None, :] * stride_wc)  # fmt: skip
        mask = m_mask[:, None] & col_mask[None, :]
        param = tl.load(param_ptr + offsets, mask=mask).to(tl.float32)
        exp_avg = tl.load(exp_avg_ptr + offsets, mask=mask).to(tl.float32)
        exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=mask).to(tl.float32)
        param, exp_avg, exp_avg_sq = adamw_update(
            param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2_sqrt
        )
        tl.store(param_ptr + offsets, param.to(param_ptr.dtype.element_ty), mask=mask)
        tl.store(exp_avg_ptr + offsets, exp_avg.to(exp_avg_ptr.dtype.element_ty), mask=mask)
        tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq.to(exp_avg_sq_ptr.dtype.element_ty), mask=mask)


def grouped_weight_adamw_(
    param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
    p: torch.Tensor, q: torch.Tensor, offsets_E: torch.Tensor, *,
    lr: float | torch.Tensor, step: int | torch.Tensor, beta1: float, beta2: float, eps: float, weight_decay: float,
    q_gather_order: torch.Tensor | None = None, top_k: int = 1, impl: Impl = "auto",
    config: tuple[int, int, int, int, int] | None = None,
) -> None:  # fmt: skip
    """AdamW step, in place, of ``param`` [E, M, C] (any strides; the moments share them) whose
    gradient is ``p[rows_e]^T @ q_rows[rows_e]`` per expert e (``q_rows = q[q_gather_order // top_k]``
    with a gather). ``lr`` and ``step`` (the count including this step) are host numbers or 0-d fp32
    device tensors, as for ``moetune.optim.AdamW``'s kernel. An expert without rows gets a zero
    gradient (its weight still decays and its moments still move), as in the unfused step."""
    num_experts = offsets_E.numel()
    shape = (num_experts, p.shape[1], q.shape[1])
    if tuple(param.shape) != shape:
        raise ValueError(f"grouped_weight_adamw_: param must be {shape} for p {tuple(p.shape)} and q {tuple(q.shape)}, got {tuple(param.shape)}")  # fmt: skip
    for name, state in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if state.shape != param.shape or state.stride() != param.stride():
            raise ValueError(
                f"grouped_weight_adamw_: {name} must have the parameter's shape and strides "
                f"{tuple(param.shape)} / {param.stride()}, got {tuple(state.shape)} / {state.stride()}"
            )
    hyper = dict(lr=lr, step=step, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    if not use_triton(impl, param, p, q):
        grouped_weight_adamw_reference(param, exp_avg, exp_avg_sq, p, q, offsets_E, q_gather_order=q_gather_order, top_k=top_k, **hyper)  # fmt: skip
        return
    if param.numel() == 0:
        return
    block_m, block_n, block_k, num_warps, num_stages = config or UPDATE_CONFIG
    grid = (num_experts * triton.cdiv(shape[1], block_m) * triton.cdiv(shape[2], block_n),)
    with device_of(param):
        _grouped_weight_adamw_kernel[grid](
            p, q, q_gather_order if q_gather_order is not None else offsets_E, offsets_E, param, exp_avg, exp_avg_sq,
            shape[1], shape[2], top_k,
            p.stride(0), p.stride(1), q.stride(0), q.stride(1), param.stride(0), param.stride(1), param.stride(2),
            beta1, beta2, eps, weight_decay, **launch_scalars(lr, step, beta1, beta2, dummy=param),
            GATHER=q_gather_order is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
