"""Cross-entropy loss and its logits-gradient in one kernel, in place over a chunk of logits.

Used by ``moetune.layers.linear_cross_entropy`` for each chunk of LM-head logits: one program per
row reads the row twice (online max / sum-exp, then softmax) and overwrites it with
``(softmax - one_hot(target)) * valid / normalizer`` in the logits' own dtype, and writes the
row's loss. The PyTorch path upcasts the chunk and makes about ten passes over it.

Numerics match Transformers' loss: the bf16 logits are upcast and the softmax runs in fp32.

Shape legend: C rows in the chunk, V vocabulary.
"""

from __future__ import annotations

import torch

from moetune.kernels._triton_utils import HAS_TRITON, Impl, device_of, tl, triton, use_triton

# Launch settings measured on an H200 (benchmarks/ce_probe.py, benchmarks/results/ce_probe_h200_1872cf9.jsonl;
# one 1766 x 151,936 bf16 chunk): 8 warps and 8192-column blocks 443.5 us, 16 / 4096 496.2 us. A
# persistent grid of 1-4 programs per SM (hoping pass 2 would re-read rows from L2) was slower: 445-1132 us.
_BLOCK_V = 8192
_NUM_WARPS = 8


def cross_entropy_grad_reference(
    logits_CV: torch.Tensor, targets_C: torch.Tensor, normalizer: torch.Tensor, ignore_index: int
) -> torch.Tensor:
    """Per-row losses (in ``acc`` precision); ``logits_CV`` is overwritten with the scaled gradient."""
    acc_dtype = torch.promote_types(logits_CV.dtype, torch.float32)
    logits = logits_CV.to(acc_dtype)
    valid_C = targets_C != ignore_index
    safe_targets_C = targets_C.masked_fill(~valid_C, 0)
    lse_C = torch.logsumexp(logits, dim=-1)
    target_logit_C = logits.gather(1, safe_targets_C.unsqueeze(1)).squeeze(1)
    loss_C = (lse_C - target_logit_C) * valid_C
    grad = logits.sub_(lse_C.unsqueeze(1)).exp_()
    grad.scatter_add_(1, safe_targets_C.unsqueeze(1), torch.full_like(lse_C, -1.0).unsqueeze(1))
    grad.mul_((valid_C.to(acc_dtype) / normalizer).unsqueeze(1))
    logits_CV.copy_(grad)
    return loss_C


if HAS_TRITON:

    @triton.jit
    def _cross_entropy_grad_kernel(
        logits_ptr, targets_ptr, loss_ptr, normalizer_ptr,
        num_cols, stride_row, ignore_index,
        BLOCK_V: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride_row
        target = tl.load(targets_ptr + row)
        valid = target != ignore_index
        # Pass 1: online max and sum of exp in fp32.
        running_max = float("-inf")
        running_sum = 0.0
        for start in range(0, num_cols, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            x = tl.load(base + cols, mask=cols < num_cols, other=float("-inf")).to(tl.float32)
            block_max = tl.max(x, axis=0)
            new_max = tl.maximum(running_max, block_max)
            running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
            running_max = new_max
        lse = running_max + tl.log(running_sum)
        safe_target = tl.where(valid, target, 0)
        target_logit = tl.load(base + safe_target).to(tl.float32)
        tl.store(loss_ptr + row, tl.where(valid, lse - target_logit, 0.0))
        scale = tl.where(valid, 1.0, 0.0) / tl.load(normalizer_ptr).to(tl.float32)
        # Pass 2: overwrite with (softmax - one_hot) * scale.
        for start in range(0, num_cols, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            mask = cols < num_cols
            x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
            grad = tl.exp(x - lse) - tl.where(cols == safe_target, 1.0, 0.0)
            tl.store(base + cols, (grad * scale).to(logits_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _scale_unless_one_kernel(x_ptr, scale_ptr, num_elements, BLOCK: tl.constexpr):
        scale = tl.load(scale_ptr).to(tl.float32)
        if scale != 1.0:
            offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            mask = offsets < num_elements
            x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
            tl.store(x_ptr + offsets, (x * scale).to(x_ptr.dtype.element_ty), mask=mask)


def cross_entropy_grad_(
    logits_CV: torch.Tensor,
    targets_C: torch.Tensor,
    normalizer: torch.Tensor,
    *,
    ignore_index: int = -100,
    impl: Impl = "auto",
) -> torch.Tensor:
    """Return per-row losses (fp32, 0 on ignored rows) and overwrite ``logits_CV`` with
    d(sum of losses / normalizer)/d(logits)."""
    if not use_triton(impl, logits_CV, targets_C):
        return cross_entropy_grad_reference(logits_CV, targets_C, normalizer, ignore_index)
    assert logits_CV.stride(1) == 1, "logits rows must be contiguous"
    num_rows, num_cols = logits_CV.shape
    loss_C = torch.empty(num_rows, dtype=torch.float32, device=logits_CV.device)
    normalizer = normalizer.to(device=logits_CV.device, dtype=torch.float32).reshape(1)
    with device_of(logits_CV):
        _cross_entropy_grad_kernel[(num_rows,)](
            logits_CV, targets_C, loss_C, normalizer,
            num_cols, logits_CV.stride(0), ignore_index,
            BLOCK_V=_BLOCK_V, num_warps=_NUM_WARPS,
        )  # fmt: skip
    return loss_C


_SCALE_BLOCK = 4096


def scale_unless_one_(x: torch.Tensor, scale: torch.Tensor, *, impl: Impl = "auto") -> torch.Tensor:
    """``x *= scale`` in place, reading nothing but the scalar when it is 1 (on CUDA).

    The fused LM-head loss computes the head's gradient (vocab x hidden: 622 MB for Qwen3 in bf16)
    in its forward and scales it by the loss's incoming gradient in backward, which is 1 for a
    plain ``loss.backward()`` (aux loss added or not); the scale lives on the device, so the check
    is in the kernel (no host sync) and costs one launch instead of a read and write of the tensor.
    """
    if not use_triton(impl, x, scale):
        return x.mul_(scale.to(x.dtype))
    assert x.is_contiguous(), "scale_unless_one_ needs a contiguous tensor"
    scale = scale.to(device=x.device).reshape(1)
    with device_of(x):
        _scale_unless_one_kernel[(triton.cdiv(x.numel(), _SCALE_BLOCK),)](
            x, scale, x.numel(), BLOCK=_SCALE_BLOCK, num_warps=8
        )
    return x
