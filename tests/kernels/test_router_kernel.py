"""Fused softmax top-k routing (moetune/kernels/router.py): the kernels under the CPU interpreter
against Transformers' torch ops (weights, chosen experts, gradient of the logits; normalised or not;
a non-power-of-two expert count; ties go to the lower index), and bf16 on the GPU."""

from __future__ import annotations

import pytest
import torch

from moetune.kernels.router import softmax_topk, softmax_topk_reference
from kernel_test_utils import gpu


def _grads(logits, top_k, normalize, impl):
    logits = logits.detach().clone().requires_grad_()
    weights, experts = softmax_topk(logits, top_k, normalize=normalize, impl=impl)
    probe = torch.linspace(-1.0, 2.0, weights.numel(), device=weights.device).view_as(weights).to(weights.dtype)
    (grad,) = torch.autograd.grad((weights * probe).sum(), [logits])
    return weights, experts, grad


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("num_experts, top_k", [(16, 4), (12, 3)], ids=["pow2", "non_pow2"])  # E and K
def test_softmax_topk_kernel_interpreter(interpret, normalize, num_experts, top_k):
    torch.manual_seed(0)
    logits = torch.randn(37, num_experts) * 2  # several programs, a partial last one
    got = _grads(logits, top_k, normalize, "triton")
    expected = _grads(logits, top_k, normalize, "torch")
    assert torch.equal(got[1], expected[1])  # same experts, same (descending) order
    torch.testing.assert_close(got[0], expected[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got[2], expected[2], atol=1e-6, rtol=1e-6)


def test_ties_go_to_the_lower_expert_interpreter(interpret):
    logits = torch.tensor([[0.5, 2.0, 2.0, 1.0, 2.0, -1.0, 0.0, 0.3]])
    _, experts = softmax_topk(logits, 2, normalize=True, impl="triton")
    assert experts.tolist() == [[1, 2]]


def test_rejects_bad_shapes():
    with pytest.raises(ValueError, match="top_k"):
        softmax_topk(torch.randn(4, 8), 9, normalize=True)
    with pytest.raises(ValueError, match=r"\[T, E\]"):
        softmax_topk(torch.randn(2, 4, 8), 2, normalize=True)


def test_reference_is_transformers_routing():
    torch.manual_seed(0)
    logits = torch.randn(10, 8, dtype=torch.bfloat16)
    weights, experts = softmax_topk_reference(logits, 3, True)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, idx = torch.topk(probs, 3, dim=-1)
    assert torch.equal(experts, idx)
    assert torch.equal(weights, (top / top.sum(-1, keepdim=True)).to(torch.bfloat16))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("normalize", [True, False])
def test_softmax_topk_kernel_bf16_cuda(normalize):
    """Qwen3-30B-A3B's router shape: 4096 tokens, 128 experts, top-8."""
    torch.manual_seed(0)
    logits = (torch.randn(4096, 128, device="cuda") * 0.5).to(torch.bfloat16)
    got = _grads(logits, 8, normalize, "triton")
    expected = _grads(logits, 8, normalize, "torch")
    # torch.topk on CUDA also breaks ties at the k-th place by the lower index: the same experts for
    # every token (benchmarks/results/router_probe_h200_8e06b27.jsonl: ~6% of tokens have such a tie).
    # Equal probabilities inside the top k may come in another order (torch sorts them unstably).
    assert torch.equal(got[1].sort(-1).values, expected[1].sort(-1).values)
    # Compare where the order agrees too: the probe weights each slot differently.
    same_order = (got[1] == expected[1]).all(-1)
    assert same_order.float().mean() > 0.5
    torch.testing.assert_close(got[0][same_order].float(), expected[0][same_order].float(), atol=1e-2, rtol=1e-2)
    grad, ref = got[2][same_order].float(), expected[2][same_order].float()
    assert (grad - ref).norm() / ref.norm() < 1e-2
