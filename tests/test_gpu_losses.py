"""GPU: the fused LM-head loss (Triton CE-gradient kernel) against materialised fp32 logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moetune.layers import linear_cross_entropy
from tests.conftest import rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton kernel)"),
]


@pytest.mark.parametrize("num_items", [None, 3000])
def test_linear_cross_entropy_bf16_qwen3_vocab(num_items):
    torch.manual_seed(0)
    h = (torch.randn(4096, 2048, device="cuda") * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(151936, 2048, device="cuda") * 0.02).bfloat16().requires_grad_()
    targets = torch.randint(0, 151936, (4096,), device="cuda")
    targets[:100] = -100
    loss = linear_cross_entropy(h, w, targets, num_items_in_batch=num_items)
    loss.backward()
    h32, w32 = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    logits = (h.detach() @ w.detach().t()).float()  # Transformers: bf16 logits, fp32 loss
    logits.requires_grad_()
    reduction = "mean" if num_items is None else "sum"
    ref = F.cross_entropy(logits, targets, ignore_index=-100, reduction=reduction)
    ref = ref if num_items is None else ref / num_items
    ref.backward()
    grad_h = logits.grad @ w32
    grad_w = logits.grad.t() @ h32
    assert rel_err(loss, ref) < 1e-4
    assert rel_err(h.grad, grad_h) < 1e-2
    assert rel_err(w.grad, grad_w) < 1e-2
