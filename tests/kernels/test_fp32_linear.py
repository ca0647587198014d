"""fp32 logits from bf16 rows and an fp32 weight on bf16 tensor cores (the DeepSeek-V3 / Nemotron-H
router's GEMM) against ``F.linear(x.float(), w.float())``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernel_test_utils import gpu
from moetune.kernels.fp32_linear import fp32_linear, split_bf16


def test_three_bf16_parts_sum_to_the_fp32_tensor_exactly():
    t = torch.randn(64, 96, dtype=torch.float64).float() * torch.logspace(-20, 20, 96)
    parts = split_bf16(t, 3)
    assert parts.dtype == torch.bfloat16 and parts.shape == (3, *t.shape)
    assert torch.equal((parts[2].float() + parts[1].float()) + parts[0].float(), t)
    two = split_bf16(t, 2)
    assert ((two.float().sum(0) - t).abs() <= t.abs() * 2.0**-16).all()


def _case(device, tokens=96, hidden=256, experts=24, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(device=device, dtype=torch.bfloat16)
    w = (torch.randn(experts, hidden, generator=gen) * hidden**-0.5).to(device)
    grad = torch.randn(tokens, experts, generator=gen).to(device)
    return x, w, grad


def _run(x, w, grad, impl):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = fp32_linear(x, w, impl=impl)
    out.backward(grad)
    return out, x.grad, w.grad


def _check_against_fp32(device):
    """As close to the exact (float64) values as the fp32 linear is: both sum fp32 products, in
    different orders."""
    x, w, grad = _case(device)
    out, dx, dw = _run(x, w, grad, "split")
    ref_out, ref_dx, ref_dw = _run(x, w, grad, "torch")
    assert out.dtype == dw.dtype == torch.float32 and dx.dtype == torch.bfloat16
    exact_out, exact_dw = x.double() @ w.double().t(), grad.double().t() @ x.double()
    for got, ref, exact in ((out, ref_out, exact_out), (dw, ref_dw, exact_dw)):
        error, ref_error = ((t.double() - exact).abs().max().item() for t in (got, ref))
        assert error <= max(2 * ref_error, 1e-7 * exact.abs().max().item()), (error, ref_error)
    # dx: the same fp32 sum to ~2^-16 of the products' size before both round it to bf16 (at most
    # one bf16 step apart, or a few units of 2^-16 where the products cancel to almost nothing).
    scale = (grad.abs() @ w.abs()).max().item()
    torch.testing.assert_close(dx.float(), ref_dx.float(), rtol=2.0**-7, atol=2.0**-15 * scale)
    assert (dx == ref_dx).float().mean() > 0.95


def test_split_path_equals_the_fp32_linear_cpu():
    _check_against_fp32(torch.device("cpu"))


def test_auto_keeps_fp32_rows_and_cpu_on_the_plain_linear_and_split_refuses_them():
    x, w, _ = _case("cpu")
    assert torch.equal(fp32_linear(x, w), F.linear(x.float(), w))  # CPU: the plain fp32 linear
    with pytest.raises(ValueError, match="impl='split' takes 2-D bf16 rows and an fp32 weight"):
        fp32_linear(x.float(), w, impl="split")
    with pytest.raises(ValueError, match="impl must be"):
        fp32_linear(x, w, impl="tf32")


@pytest.mark.gpu
@gpu
def test_split_path_equals_the_fp32_linear_cuda():
    _check_against_fp32(torch.device("cuda"))
