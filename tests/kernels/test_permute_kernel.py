"""MoE permute / combine: reference vs a naive per-token loop, hand-written backward via
gradcheck, Triton kernels under the CPU interpreter, Triton vs reference on the GPU."""

from __future__ import annotations

import pytest
import torch

from moetune.kernels import moe_combine, moe_combine_reference, moe_permute, moe_permute_reference
from moetune.kernels.permute import MoECombineFunction, MoEPermuteFunction, inverse_order
from kernel_test_utils import bf16_close, fp32_close, gpu


def routing(num_tokens: int, top_k: int, num_experts: int, *, device="cpu"):
    """Distinct experts per token, the slots sorted by expert (stable) as the dispatcher does."""
    experts_TK = torch.rand(num_tokens, num_experts, device=device).argsort(dim=-1)[:, :top_k]
    order_N = torch.argsort(experts_TK.reshape(-1), stable=True)
    weights_TK = torch.rand(num_tokens, top_k, device=device).softmax(dim=-1)
    return order_N, weights_TK


def naive_combine(y_NH, weights_TK, order_N):
    num_tokens, top_k = weights_TK.shape
    out = torch.zeros(num_tokens, y_NH.shape[1], dtype=torch.float64)
    for n, slot in enumerate(order_N.tolist()):
        out[slot // top_k] += weights_TK.reshape(-1)[slot].double() * y_NH[n].double()
    return out


def test_torch_paths_match_naive_loops_fp32():
    torch.manual_seed(0)
    order_N, weights_TK = routing(6, 3, 5)
    x_TH = torch.randn(6, 16)
    x_NH = moe_permute(x_TH, order_N, 3, impl="torch")
    for n, slot in enumerate(order_N.tolist()):
        assert torch.equal(x_NH[n], x_TH[slot // 3])
    y_NH = torch.randn(18, 16)
    out = moe_combine(y_NH, weights_TK, order_N, impl="torch")
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), naive_combine(y_NH, weights_TK, order_N), atol=1e-6, rtol=1e-6)


def test_inverse_order():
    order_N = torch.randperm(24)
    assert torch.equal(order_N[inverse_order(order_N)], torch.arange(24))


def test_rejects_bad_order():
    x_TH = torch.randn(4, 8)
    with pytest.raises(ValueError, match="permutation"):
        moe_permute(x_TH, torch.arange(6), 2)
    with pytest.raises(TypeError, match="int32 or int64"):
        moe_combine(torch.randn(8, 8), torch.rand(4, 2), torch.arange(8).float())


def test_reference_gradcheck_float64():
    torch.manual_seed(0)
    order_N, weights_TK = routing(4, 2, 3)
    weights_TK = weights_TK.double().requires_grad_()
    x_TH = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    y_NH = torch.randn(8, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: moe_permute_reference(x, order_N, 2), (x_TH,))
    assert torch.autograd.gradcheck(lambda y, w: moe_combine_reference(y, w, order_N), (y_NH, weights_TK))


def test_hand_written_backward_gradcheck_float64():
    """The Functions' torch backend runs the kernels' formulas (gather-sum, weighted gather + dot)."""
    torch.manual_seed(0)
    order_N, weights_TK = routing(4, 2, 3)
    weights_TK = weights_TK.double().requires_grad_()
    x_TH = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    y_NH = torch.randn(8, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: MoEPermuteFunction.apply(x, order_N, 2, "torch"), (x_TH,))
    assert torch.autograd.gradcheck(lambda y, w: MoECombineFunction.apply(y, w, order_N, "torch"), (y_NH, weights_TK))


def _check_triton_vs_reference(num_tokens, top_k, num_experts, hidden, dtype, device="cpu"):
    order_N, weights_TK = routing(num_tokens, top_k, num_experts, device=device)
    x_TH = torch.randn(num_tokens, hidden, dtype=dtype, device=device, requires_grad=True)
    x_NH = moe_permute(x_TH, order_N, top_k, impl="triton")
    torch.testing.assert_close(x_NH, moe_permute_reference(x_TH.detach(), order_N, top_k), atol=0, rtol=0)
    d_NH = torch.randn_like(x_NH)
    (dx,) = torch.autograd.grad(x_NH, (x_TH,), d_NH)
    (dx_exact,) = torch.autograd.grad(moe_permute_reference(x_TH.float(), order_N, top_k), (x_TH,), d_NH.float())

    y_NH = torch.randn(num_tokens * top_k, hidden, dtype=dtype, device=device, requires_grad=True)
    w = weights_TK.detach().requires_grad_()
    out = moe_combine(y_NH, w, order_N, impl="triton")
    d_out = torch.randn_like(out)
    dy, dw = torch.autograd.grad(out, (y_NH, w), d_out)
    y32 = y_NH.detach().float().requires_grad_()
    w32 = w.detach().requires_grad_()
    out_exact = moe_combine_reference(y32, w32, order_N)
    dy_exact, dw_exact = torch.autograd.grad(out_exact, (y32, w32), d_out.float())
    assert out.dtype == dtype and dy.dtype == dtype and dw.dtype == w.dtype and dx.dtype == dtype
    for got, exact in ((dx, dx_exact), (out, out_exact), (dy, dy_exact), (dw, dw_exact)):
        if dtype == torch.float32 or got is dw:
            fp32_close(got.float(), exact.float(), atol=1e-5, rtol=1e-5)
        else:
            bf16_close(got, exact)


@pytest.mark.parametrize(
    "num_tokens, top_k, num_experts, hidden, dtype",
    [
        (5, 3, 4, 37, torch.float32),  # odd hidden: masked block
        (3, 2, 4, 3000, torch.float32),  # hidden > one block: column loop / two column blocks
        (6, 4, 8, 64, torch.bfloat16),
    ],
)
def test_triton_kernels_in_interpreter(interpret, num_tokens, top_k, num_experts, hidden, dtype):
    torch.manual_seed(0)
    _check_triton_vs_reference(num_tokens, top_k, num_experts, hidden, dtype)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_matches_reference_on_gpu(dtype):
    torch.manual_seed(0)
    _check_triton_vs_reference(4096, 8, 128, 2048, dtype, device="cuda")


@pytest.mark.gpu
@gpu
def test_auto_uses_triton_on_gpu_without_host_sync():
    order_N, weights_TK = routing(256, 8, 128, device="cuda")
    weights_TK.requires_grad_()
    x_TH = torch.randn(256, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    moe_combine(moe_permute(x_TH, order_N, 8), weights_TK, order_N).sum().backward()  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = moe_combine(moe_permute(x_TH, order_N, 8), weights_TK, order_N)
        assert "MoECombineFunction" in type(out.grad_fn).__name__
        torch.autograd.grad(out, (x_TH, weights_TK), torch.ones_like(out))
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _check_num_valid(num_tokens, top_k, hidden, dtype, impl):
    """Sorted rows >= num_valid are padding: NaN upstream gradients there never reach x."""
    order_N, _ = routing(num_tokens, top_k, 4)
    num_valid = num_tokens * top_k - 3
    x_TH = torch.randn(num_tokens, hidden, dtype=dtype, requires_grad=True)
    count = torch.tensor([num_valid], dtype=torch.int32)
    x_NH = moe_permute(x_TH, order_N, top_k, num_valid=count, impl=impl)
    assert torch.equal(x_NH, x_TH.detach()[order_N // top_k])
    d_NH = torch.randn_like(x_NH)
    d_NH[num_valid:] = float("nan")
    (dx,) = torch.autograd.grad(x_NH, (x_TH,), d_NH)
    exact = torch.zeros(num_tokens, hidden).index_add_(0, order_N[:num_valid] // top_k, d_NH[:num_valid].float())
    assert dx.dtype == dtype and torch.isfinite(dx).all()
    if dtype == torch.float32:
        fp32_close(dx, exact, atol=1e-5, rtol=1e-5)
    else:
        bf16_close(dx, exact)


def test_num_valid_masks_padding_gradient_torch():
    torch.manual_seed(0)
    _check_num_valid(5, 3, 16, torch.float32, "torch")
    with pytest.raises(ValueError, match="num_valid must hold one count"):
        moe_permute(torch.randn(2, 4), torch.arange(4), 2, num_valid=torch.tensor([1, 2]))


def test_num_valid_backward_gradcheck_float64():
    torch.manual_seed(0)
    order_N, _ = routing(4, 2, 3)
    x_TH = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    count = torch.tensor([5])
    assert torch.autograd.gradcheck(lambda x: MoEPermuteFunction.apply(x, order_N, 2, "torch", count)[:5], (x_TH,))


@pytest.mark.parametrize(
    "num_tokens, top_k, hidden, dtype",
    [(5, 3, 37, torch.float32), (3, 2, 3000, torch.float32), (6, 4, 64, torch.bfloat16)],
)
def test_num_valid_kernel_in_interpreter(interpret, num_tokens, top_k, hidden, dtype):
    torch.manual_seed(0)
    _check_num_valid(num_tokens, top_k, hidden, dtype, "triton")


def test_gathered_grouped_mm_kernels_in_interpreter(interpret):
    """The experts' gathered first GEMM with the Triton gather and masked gather-sum (CPU _grouped_mm)
    equals its torch twin; padding rows' NaN gradients reach neither x nor the weight."""
    from moetune.moe.experts import GatheredGroupedMM

    torch.manual_seed(0)
    num_tokens, top_k, hidden, width = 6, 2, 16, 8
    order_N, _ = routing(num_tokens, top_k, 4)
    offsets_E = torch.tensor([3, 3, 7, 9], dtype=torch.int32)  # 9 of 12 rows valid, one empty expert
    w_EXH = torch.randn(4, width, hidden, requires_grad=True)
    x_TH = torch.randn(num_tokens, hidden, requires_grad=True)
    d_NX = torch.randn(num_tokens * top_k, width)
    d_NX[9:] = float("nan")
    results = []
    for impl in ("triton", "torch"):
        h_NX = GatheredGroupedMM.apply(x_TH, w_EXH.transpose(-2, -1), order_N, offsets_E, top_k, impl)
        results.append((h_NX[:9], *torch.autograd.grad(h_NX, (x_TH, w_EXH), d_NX)))
    for got, expected in zip(*results):
        assert torch.isfinite(got).all()
        fp32_close(got, expected, atol=1e-5, rtol=1e-5)


def _combine_with_padding(impl: str, dtype: torch.dtype):
    """moe_combine with num_valid over rows whose tail holds NaN; returns (out, dy, dw) and the
    expected values computed from the valid rows only (padding slots' weights zeroed)."""
    torch.manual_seed(3)
    num_tokens, top_k, hidden, num_valid = 6, 3, 40, 11
    order_N, weights_TK = routing(num_tokens, top_k, 5)
    y_NH = torch.randn(num_tokens * top_k, hidden).to(dtype)
    y_NH[num_valid:] = float("nan")
    y_NH.requires_grad_()
    weights_TK = weights_TK.requires_grad_()
    dout = torch.randn(num_tokens, hidden).to(dtype)
    out = moe_combine(y_NH, weights_TK, order_N, num_valid=torch.tensor([num_valid]), impl=impl)
    dy, dw = torch.autograd.grad(out, (y_NH, weights_TK), dout)
    valid_slot = torch.zeros(num_tokens * top_k, dtype=torch.bool)
    valid_slot[order_N[:num_valid]] = True
    clean_y = torch.where(torch.arange(num_tokens * top_k)[:, None] < num_valid, y_NH.detach(), 0).requires_grad_()
    masked_w = (weights_TK.detach() * valid_slot.view(num_tokens, top_k)).requires_grad_()
    expected = moe_combine_reference(clean_y, masked_w, order_N)
    expected_dy, expected_dw = torch.autograd.grad(expected, (clean_y, masked_w), dout)
    expected_dw = expected_dw * valid_slot.view(num_tokens, top_k)
    return (out, dy[:num_valid], dw), (expected, expected_dy[:num_valid], expected_dw)


def test_combine_num_valid_skips_padding_rows_torch():
    got, expected = _combine_with_padding("torch", torch.float32)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


def test_combine_num_valid_skips_padding_rows_in_interpreter(interpret):
    got, expected = _combine_with_padding("triton", torch.float32)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


def _scaled_combine_backward(impl: str):
    """combine_rows_backward with a rows' gradient scale (the all-gather dispatcher's 1 / ep) and a
    bf16 output gradient: the rows' gradient is the unscaled one times the scale, the weights'
    gradient is unchanged."""
    from moetune.kernels.permute import combine_rows_backward

    torch.manual_seed(5)
    num_tokens, top_k, hidden = 7, 2, 48
    order_N, weights_TK = routing(num_tokens, top_k, 4)
    y_NH = torch.randn(num_tokens * top_k, hidden)
    dout = torch.randn(num_tokens, hidden).to(torch.bfloat16)
    dy_scaled, dw_scaled = combine_rows_backward(dout, y_NH, weights_TK, order_N, rows_grad_scale=0.25, impl=impl)
    dy, dw = combine_rows_backward(dout.float(), y_NH, weights_TK, order_N, impl=impl)
    torch.testing.assert_close(dy_scaled, dy * 0.25)
    torch.testing.assert_close(dw_scaled, dw)
    assert dy.dtype == y_NH.dtype


def test_combine_backward_scales_the_rows_gradient_torch():
    _scaled_combine_backward("torch")


def test_combine_backward_scales_the_rows_gradient_in_interpreter(interpret):
    _scaled_combine_backward("triton")
