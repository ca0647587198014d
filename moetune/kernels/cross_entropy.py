"""Cross-entropy loss and its logits-gradient in one kernel, in place over a chunk of logits.

Used by ``moetune.layers.linear_cross_entropy`` for each chunk of LM-head logits: one program per
row reads the row twice (online max / sum-exp, then softmax) and overwrites it with
``(softmax - one_hot(target)) * valid / normalizer`` in the logits' own dtype, and writes the
row's loss. The PyTorch path upcasts the chunk and makes about ten passes over it.

The vocabulary-parallel loss (``moetune.distributed.vocab_parallel``) splits the same two passes
around an exchange between the ranks: ``cross_entropy_shard_stats`` (each row's log-sum-exp over
this rank's vocabulary shard, and the target's logit where the shard holds it), then, with the
whole vocabulary's log-sum-exp, ``cross_entropy_shard_grad_``.

Numerics match Transformers' loss: the bf16 logits are upcast and the softmax runs in fp32.

Shape legend: C rows in the chunk, V vocabulary.
"""

from __future__ import annotations

import torch

from moetune.kernels._triton_utils import HAS_TRITON, Impl, device_of, tl, triton, use_triton

# Launch settings measured on an H200 (benchmarks/probes/ce_probe.py, benchmarks/results/ce_probe_h200_1872cf9.jsonl;
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
    grad.mul_(torch.where(valid_C, 1 / normalizer, 0.0).to(acc_dtype).unsqueeze(1))  # no NaN when no row counts
    logits_CV.copy_(grad)
    return loss_C


def cross_entropy_shard_stats_reference(logits_CV: torch.Tensor, targets_C: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """[2, C] fp32: each row's log-sum-exp over this vocabulary shard, and its target's logit where
    the target falls in the shard (0 elsewhere)."""
    logits = logits_CV.to(torch.promote_types(logits_CV.dtype, torch.float32))
    local_C = targets_C - vocab_start
    inside_C = (local_C >= 0) & (local_C < logits.shape[1])
    target_logit_C = logits.gather(1, local_C.clamp(0, logits.shape[1] - 1).unsqueeze(1)).squeeze(1)
    return torch.stack([torch.logsumexp(logits, dim=-1), target_logit_C * inside_C])


def cross_entropy_shard_grad_reference(
    logits_CV: torch.Tensor, targets_C: torch.Tensor, lse_C: torch.Tensor, scale_C: torch.Tensor, vocab_start: int
) -> None:
    """Overwrite ``logits_CV`` with ``(softmax - one_hot(target)) * scale`` over this shard, the
    softmax taken with the whole vocabulary's ``lse_C``."""
    acc_dtype = torch.promote_types(logits_CV.dtype, torch.float32)
    grad = logits_CV.to(acc_dtype).sub_(lse_C.to(acc_dtype).unsqueeze(1)).exp_()
    local_C = targets_C - vocab_start
    inside_C = (local_C >= 0) & (local_C < grad.shape[1])
    grad.scatter_add_(1, local_C.clamp(0, grad.shape[1] - 1).unsqueeze(1), -inside_C.to(acc_dtype).unsqueeze(1))
    logits_CV.copy_(grad.mul_(scale_C.to(acc_dtype).unsqueeze(1)))


if HAS_TRITON:

    @triton.jit
    def _row_logsumexp(base, num_cols, BLOCK_V: tl.constexpr):
        """Online max and sum of exp of one row, in fp32."""
        running_max = float("-inf")
        running_sum = 0.0
        for start in range(0, num_cols, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            x = tl.load(base + cols, mask=cols < num_cols, other=float("-inf")).to(tl.float32)
            block_max = tl.max(x, axis=0)
            new_max = tl.maximum(running_max, block_max)
            running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
            running_max = new_max
        return running_max + tl.log(running_sum)

    @triton.jit
    def _overwrite_row_with_grad(base, num_cols, lse, target_col, scale, BLOCK_V: tl.constexpr):
        """Row <- (exp(x - lse) - [col == target_col]) * scale, in the row's dtype."""
        for start in range(0, num_cols, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            mask = cols < num_cols
            x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
            grad = tl.exp(x - lse) - tl.where(cols == target_col, 1.0, 0.0)
            tl.store(base + cols, (grad * scale).to(base.dtype.element_ty), mask=mask)

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
        lse = _row_logsumexp(base, num_cols, BLOCK_V)  # pass 1
        safe_target = tl.where(valid, target, 0)
        target_logit = tl.load(base + safe_target).to(tl.float32)
        tl.store(loss_ptr + row, tl.where(valid, lse - target_logit, 0.0))
        # Ignored rows get no gradient, also when no row counts (0 / 0 would make it NaN).
        scale = tl.where(valid, 1.0 / tl.load(normalizer_ptr).to(tl.float32), 0.0)
        # Pass 2 overwrites the row in place, the target's logit included: every warp reads that
        # logit before any warp may write it (warps run pass 2 without meeting otherwise).
        tl.debug_barrier()
        _overwrite_row_with_grad(base, num_cols, lse, safe_target, scale, BLOCK_V)  # pass 2

    @triton.jit
    def _cross_entropy_shard_stats_kernel(
        logits_ptr, targets_ptr, stats_ptr, num_rows, num_cols, stride_row, vocab_start, BLOCK_V: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride_row
        local = tl.load(targets_ptr + row) - vocab_start
        inside = (local >= 0) & (local < num_cols)
        tl.store(stats_ptr + row, _row_logsumexp(base, num_cols, BLOCK_V))
        target_logit = tl.load(base + tl.where(inside, local, 0)).to(tl.float32)
        tl.store(stats_ptr + num_rows + row, tl.where(inside, target_logit, 0.0))

    @triton.jit
    def _cross_entropy_shard_grad_kernel(
        logits_ptr, targets_ptr, lse_ptr, scale_ptr, num_cols, stride_row, vocab_start, BLOCK_V: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        local = tl.load(targets_ptr + row) - vocab_start  # outside [0, num_cols): no one-hot column here
        lse = tl.load(lse_ptr + row)
        scale = tl.load(scale_ptr + row).to(tl.float32)
        _overwrite_row_with_grad(logits_ptr + row * stride_row, num_cols, lse, local, scale, BLOCK_V)

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


def cross_entropy_shard_stats(
    logits_CV: torch.Tensor, targets_C: torch.Tensor, vocab_start: int, *, impl: Impl = "auto"
) -> torch.Tensor:
    """For a vocabulary-parallel loss (``moetune.distributed.vocab_parallel``): [2, C] fp32, each
    row's log-sum-exp over this shard of the logits (columns ``vocab_start`` onwards of the whole
    vocabulary) and its target's logit where the target falls in the shard, 0 elsewhere."""
    if not use_triton(impl, logits_CV, targets_C):
        return cross_entropy_shard_stats_reference(logits_CV, targets_C, vocab_start)
    assert logits_CV.stride(1) == 1, "logits rows must be contiguous"
    num_rows, num_cols = logits_CV.shape
    stats = torch.empty(2, num_rows, dtype=torch.float32, device=logits_CV.device)
    with device_of(logits_CV):
        _cross_entropy_shard_stats_kernel[(num_rows,)](
            logits_CV, targets_C, stats, num_rows, num_cols, logits_CV.stride(0), vocab_start,
            BLOCK_V=_BLOCK_V, num_warps=_NUM_WARPS,
        )  # fmt: skip
    return stats


def cross_entropy_shard_grad_(
    logits_CV: torch.Tensor,
    targets_C: torch.Tensor,
    lse_C: torch.Tensor,
    scale_C: torch.Tensor,
    vocab_start: int,
    *,
    impl: Impl = "auto",
) -> None:
    """Overwrite this shard's ``logits_CV`` with d(loss)/d(logits) = ``(softmax - one_hot(target)) *
    scale_C`` per row, the softmax normalised by the whole vocabulary's log-sum-exp ``lse_C``."""
    if not use_triton(impl, logits_CV, targets_C):
        cross_entropy_shard_grad_reference(logits_CV, targets_C, lse_C, scale_C, vocab_start)
        return
    assert logits_CV.stride(1) == 1, "logits rows must be contiguous"
    num_rows, num_cols = logits_CV.shape
    with device_of(logits_CV):
        _cross_entropy_shard_grad_kernel[(num_rows,)](
            logits_CV, targets_C, lse_C.float().contiguous(), scale_C.contiguous(), num_cols, logits_CV.stride(0),
            vocab_start, BLOCK_V=_BLOCK_V, num_warps=_NUM_WARPS,
        )  # fmt: skip


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
