"""The CE-gradient kernel (fused LM-head loss) and the AdamW kernel against their PyTorch
references, under Triton's CPU interpreter (run by test_interpret_mode.py)."""

from __future__ import annotations

import pytest
import torch

from moetune.kernels.cross_entropy import cross_entropy_grad_, cross_entropy_grad_reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_grad_kernel_in_interpreter(interpret, dtype):
    torch.manual_seed(0)
    logits = (torch.randn(5, 9000) * 3).to(dtype)  # several vocabulary blocks per row
    targets = torch.randint(0, 9000, (5,))
    targets[2] = -100
    normalizer = torch.tensor(4.0)
    kernel, reference = logits.clone(), logits.clone()
    loss = cross_entropy_grad_(kernel, targets, normalizer, impl="triton")
    expected = cross_entropy_grad_reference(reference, targets, normalizer, -100)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(loss, expected.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(kernel.float(), reference.float(), rtol=tol, atol=tol)
    assert torch.all(kernel[2] == 0)  # ignored row: no gradient


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocabulary_shard_kernels_in_interpreter(interpret, dtype):
    """The vocabulary-parallel loss's two passes (shard statistics, then the gradient with the whole
    vocabulary's log-sum-exp) equal their references, for targets inside and outside the shard."""
    from moetune.kernels.cross_entropy import (
        cross_entropy_shard_grad_,
        cross_entropy_shard_grad_reference,
        cross_entropy_shard_stats,
        cross_entropy_shard_stats_reference,
    )

    torch.manual_seed(0)
    logits = (torch.randn(6, 9000) * 3).to(dtype)
    targets = torch.tensor([5, 9000 + 5, 20_000, -1, 12_000, 8_999 + 9000])  # shard = columns [9000, 18000)
    stats = cross_entropy_shard_stats(logits, targets, 9000, impl="triton")
    expected = cross_entropy_shard_stats_reference(logits, targets, 9000)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(stats, expected.float(), rtol=tol, atol=tol)
    assert stats[1, 0] == 0 and stats[1, 3] == 0 and stats[1, 1] == logits[1, 5].float()
    lse = expected[0] + 1.5  # as if the other shards held more mass
    scale = torch.tensor([0.5, 0.25, 1.0, 0.0, 2.0, 1.0])
    kernel, reference = logits.clone(), logits.clone()
    cross_entropy_shard_grad_(kernel, targets, lse, scale, 9000, impl="triton")
    cross_entropy_shard_grad_reference(reference, targets, lse, scale, 9000)
    torch.testing.assert_close(kernel.float(), reference.float(), rtol=tol, atol=tol)
    assert torch.all(kernel[3] == 0)  # scale 0: an ignored row


def test_vocabulary_shards_combine_to_the_whole_loss():
    """Two shards' statistics, combined as the vocabulary-parallel loss combines them, give the loss
    and logits gradient of the whole vocabulary."""
    from moetune.kernels.cross_entropy import cross_entropy_shard_grad_, cross_entropy_shard_stats

    torch.manual_seed(1)
    logits = torch.randn(7, 50, dtype=torch.float64) * 2
    targets = torch.tensor([0, 24, 25, 49, -100, 3, 30])
    whole = logits.clone()
    loss = cross_entropy_grad_reference(whole, targets, torch.tensor(6.0, dtype=torch.float64), -100)
    safe = torch.where(targets == -100, -1, targets)
    shards = [logits[:, :25].clone(), logits[:, 25:].clone()]
    stats = torch.cat([cross_entropy_shard_stats(s, safe, start) for s, start in zip(shards, (0, 25))])
    lse = torch.logsumexp(stats[0::2], dim=0)
    valid = (safe >= 0).double()
    torch.testing.assert_close((lse - stats[1::2].sum(0)) * valid, loss)
    for shard, start in zip(shards, (0, 25)):
        cross_entropy_shard_grad_(shard, safe, lse, valid / 6.0, start)
    torch.testing.assert_close(torch.cat(shards, 1), whole)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scale_unless_one_kernel_in_interpreter(interpret, dtype):
    from moetune.kernels.cross_entropy import scale_unless_one_

    x = torch.randn(10_000).to(dtype)
    kept = x.clone()
    assert scale_unless_one_(x, torch.tensor(1.0), impl="triton") is x
    assert torch.equal(x, kept)
    scale_unless_one_(x, torch.tensor(0.3), impl="triton")
    torch.testing.assert_close(x.float(), (kept.float() * 0.3).to(dtype).float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adamw_kernel_in_interpreter(interpret, dtype):
    from moetune.optim.adamw import _triton_step

    torch.manual_seed(0)
    param, grad = torch.randn(10_000).to(dtype), torch.randn(10_000).to(dtype)
    exp_avg, exp_avg_sq = (torch.randn(10_000) * 0.1).to(dtype), (torch.rand(10_000) * 0.1).to(dtype)
    ref = [t.float().clone() for t in (param, grad, exp_avg, exp_avg_sq)]
    _triton_step(param, grad, exp_avg, exp_avg_sq, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, step=3)
    torch.optim._functional.adamw(
        [ref[0]], [ref[1]], [ref[2]], [ref[3]], [], [torch.tensor(2.0)], amsgrad=False, beta1=0.9, beta2=0.99,
        lr=1e-2, weight_decay=0.1, eps=1e-8, maximize=False,
    )  # fmt: skip  (the functional step increments 2 -> 3)
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    for got, want in zip((param, exp_avg, exp_avg_sq), (ref[0], ref[2], ref[3])):
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def test_adamw_kernel_scales_the_gradient_as_it_reads_it_in_interpreter(interpret):
    """``grad_scale`` (gradient clipping's coefficient) equals the step on the pre-scaled gradient."""
    from moetune.optim.adamw import _triton_step

    torch.manual_seed(0)
    tensors = [torch.randn(5_000), torch.randn(5_000), torch.randn(5_000) * 0.1, torch.rand(5_000) * 0.1]
    folded, prescaled = [t.clone() for t in tensors], [t.clone() for t in tensors]
    prescaled[1].mul_(0.37)
    settings = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=4)
    _triton_step(*folded, grad_scale=torch.tensor(0.37), **settings)
    _triton_step(*prescaled, **settings)
    for got, want in zip(folded[::2] + folded[3:], prescaled[::2] + prescaled[3:]):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert torch.equal(folded[1], tensors[1])  # the gradient itself is not written
    for bad in (float("nan"), float("inf")):  # a non-finite norm's coefficient: nothing is written
        kept = [t.clone() for t in folded]
        _triton_step(*folded, grad_scale=torch.tensor(bad), **settings)
        assert all(torch.equal(a, b) for a, b in zip(folded, kept))


def test_adamw_kernel_reads_lr_and_step_from_the_device_in_interpreter(interpret):
    """The capturable variant (lr and step as tensors, bias corrections in the kernel) equals the
    host-scalar one."""
    from moetune.optim.adamw import _triton_step

    torch.manual_seed(0)
    tensors = [torch.randn(5_000), torch.randn(5_000), torch.randn(5_000) * 0.1, torch.rand(5_000) * 0.1]
    host, device = [t.clone() for t in tensors], [t.clone() for t in tensors]
    settings = dict(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    _triton_step(*host, lr=3e-3, step=7, **settings)
    _triton_step(*device, lr=torch.tensor(3e-3), step=torch.tensor(7.0), **settings)
    for got, want in zip(device, host):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
