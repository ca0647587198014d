"""RMSNorm: reference vs naive formula and Transformers, hand-written backward via gradcheck,
Triton kernels under the CPU interpreter, and Triton vs reference on the GPU."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

from moetune.kernels import RMSNorm, rms_norm, rms_norm_reference
from moetune.kernels.rms_norm import RMSNormFunction
from kernel_test_utils import bf16_close, fp32_close, gpu


def naive_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Row by row in float64: y = w * x / sqrt(mean(x^2) + eps)."""
    x64 = x.double().reshape(-1, x.shape[-1])
    rows = [w_row for w_row in (r / (r.pow(2).sum() / r.numel() + eps).sqrt() for r in x64)]
    return (weight.double() * torch.stack(rows)).reshape(x.shape)


@pytest.mark.parametrize("shape", [(7, 64), (2, 3, 4, 16), (5, 1000)])
def test_torch_path_matches_naive_formula_fp32(shape):
    torch.manual_seed(0)
    x = torch.randn(shape) * 3
    w = torch.rand(shape[-1]) + 0.5
    y = rms_norm(x, w, 1e-6, impl="torch")
    assert y.dtype == torch.float32 and y.shape == x.shape
    torch.testing.assert_close(y.double(), naive_rms_norm(x, w, 1e-6), atol=1e-6, rtol=1e-6)


def test_auto_on_cpu_is_the_reference_and_matches_transformers():
    torch.manual_seed(0)
    hf = Qwen3MoeRMSNorm(48, eps=1e-5)
    ours = RMSNorm(48, eps=1e-5)
    with torch.no_grad():
        hf.weight.copy_(torch.rand(48) + 0.5)
        ours.load_state_dict(hf.state_dict())
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 5, 48, dtype=dtype)
        torch.testing.assert_close(ours.to(dtype)(x), hf.to(dtype)(x), atol=0, rtol=0)
    assert list(ours.state_dict()) == ["weight"]
    assert repr(ours) == "RMSNorm((48,), eps=1e-05)"


def test_gpt_oss_semantics_match_transformers_exactly():
    """``round_before_weight=False``: GptOssRMSNorm's weight multiplied in fp32, one rounding, the
    output in x's dtype (also with an fp32 weight on bf16 activations), gradients included."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm

    torch.manual_seed(0)
    hf = GptOssRMSNorm(48, eps=1e-5)
    ours = RMSNorm(48, eps=1e-5, round_before_weight=False)
    with torch.no_grad():
        hf.weight.copy_(torch.rand(48) + 0.5)
        ours.load_state_dict(hf.state_dict())
    for dtype, weight_dtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)):
        x = torch.randn(3, 5, 48, dtype=dtype)
        torch.testing.assert_close(ours.to(weight_dtype)(x), hf.to(weight_dtype)(x), atol=0, rtol=0)
    x = torch.randn(2, 3, 12, dtype=torch.float64, requires_grad=True)
    w = (torch.rand(12, dtype=torch.float64) + 0.5).requires_grad_()
    assert torch.autograd.gradcheck(lambda x, w: RMSNormFunction.apply(x, w, 1e-6, "torch", False), (x, w))


def test_weight_dtype_promotes_like_transformers():
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    assert rms_norm(x, torch.ones(32), impl="torch").dtype == torch.float32
    assert rms_norm(x, torch.ones(32, dtype=torch.bfloat16), impl="torch").dtype == torch.bfloat16


def test_rejects_mismatched_weight():
    with pytest.raises(ValueError, match="weight must have shape"):
        rms_norm(torch.randn(4, 32), torch.ones(16))
    with pytest.raises(ValueError, match="impl must be one of"):
        rms_norm(torch.randn(4, 32), torch.ones(32), impl="cuda")


def test_reference_gradcheck_float64():
    torch.manual_seed(0)
    x = torch.randn(3, 4, 10, dtype=torch.float64, requires_grad=True)
    w = torch.rand(10, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: rms_norm_reference(x, w, 1e-6), (x, w))


@pytest.mark.parametrize("weight_grad", [True, False])
def test_hand_written_backward_gradcheck_float64(weight_grad):
    """The Function's torch backend runs the same formulas as the Triton kernels."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 12, dtype=torch.float64, requires_grad=True)
    w = (torch.rand(12, dtype=torch.float64) + 0.5).requires_grad_(weight_grad)
    assert torch.autograd.gradcheck(lambda x, w: RMSNormFunction.apply(x, w, 1e-6, "torch"), (x, w))


def test_hand_written_backward_matches_autograd_bf16():
    torch.manual_seed(0)
    x = torch.randn(6, 40, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.rand(40) + 0.5).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(6, 40, dtype=torch.bfloat16)
    got = torch.autograd.grad(RMSNormFunction.apply(x, w, 1e-6, "torch"), (x, w), dy)
    xf, wf = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    exact = torch.autograd.grad(rms_norm_reference(xf, wf, 1e-6), (xf, wf), dy.float())
    for g, e in zip(got, exact):
        bf16_close(g, e)


def _check_triton_vs_reference(x, w, dy, *, eps=1e-6, round_before_weight=True):
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_()
    y = rms_norm(x, w, eps, round_before_weight=round_before_weight, impl="triton")
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    xf = x.detach().float().requires_grad_()
    wf = w.detach().float().requires_grad_()
    y_ref = rms_norm_reference(xf, wf, eps, round_before_weight=round_before_weight)
    dx_ref, dw_ref = torch.autograd.grad(y_ref, (xf, wf), dy.float())
    assert y.dtype == (torch.promote_types(x.dtype, w.dtype) if round_before_weight else x.dtype) and y.shape == x.shape
    assert dx.dtype == x.dtype and dw.dtype == w.dtype
    if x.dtype == torch.float32:
        fp32_close(y, y_ref, atol=1e-6, rtol=1e-6)
        fp32_close(dx, dx_ref, atol=1e-5, rtol=1e-5)
        fp32_close(dw, dw_ref, atol=1e-4, rtol=1e-5)
    else:
        for got, exact in ((y, y_ref), (dx, dx_ref), (dw, dw_ref)):
            bf16_close(got, exact)


@pytest.mark.parametrize(
    "shape, dtype",
    [
        ((5, 37), torch.float32),  # odd width: column mask
        ((40, 1024), torch.float32),  # more row tiles than backward programs: persistent loop
        ((2, 3, 4, 16), torch.float32),  # q/k-norm layout, several rows per program
        ((6, 64), torch.bfloat16),
    ],
)
@pytest.mark.parametrize("round_before_weight", [True, False], ids=["qwen3", "gpt_oss"])
def test_triton_kernel_in_interpreter(interpret, shape, dtype, round_before_weight):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype) * 2
    w = (torch.rand(shape[-1]) + 0.5).to(dtype)
    dy = torch.randn(shape, dtype=dtype)
    _check_triton_vs_reference(x, w, dy, round_before_weight=round_before_weight)


def test_triton_kernel_in_interpreter_strided_view_and_no_weight_grad(interpret):
    torch.manual_seed(0)
    x = torch.randn(2, 8, 3, 16).transpose(1, 2)  # [B, heads, S, D] view: rows are not one stride apart
    w = torch.rand(16) + 0.5
    y = rms_norm(x, w, 1e-6, impl="triton")
    torch.testing.assert_close(y, rms_norm_reference(x, w, 1e-6), atol=1e-6, rtol=1e-6)
    xg = x.detach().requires_grad_()
    (dx,) = torch.autograd.grad(rms_norm(xg, w, 1e-6, impl="triton").sum(), (xg,))
    xr = x.detach().requires_grad_()
    (dx_ref,) = torch.autograd.grad(rms_norm_reference(xr, w, 1e-6).sum(), (xr,))
    torch.testing.assert_close(dx, dx_ref, atol=1e-6, rtol=1e-6)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "shape, view", [((4096, 2048), None), ((1, 4096, 32, 128), None), ((1, 4096, 32, 128), "transpose"), ((8, 8192), None)]
)
@pytest.mark.parametrize("round_before_weight", [True, False], ids=["qwen3", "gpt_oss"])
def test_triton_matches_reference_on_gpu(dtype, shape, view, round_before_weight):
    torch.manual_seed(0)
    x = torch.randn(shape, device="cuda", dtype=dtype) * 2
    if view == "transpose":  # Qwen3's q_norm(...).transpose(1, 2) layout, normed after the transpose
        x = x.transpose(1, 2)
    w = (torch.rand(shape[-1], device="cuda") + 0.5).to(dtype)
    dy = torch.randn(x.shape, device="cuda", dtype=dtype)
    _check_triton_vs_reference(x, w, dy, round_before_weight=round_before_weight)


@pytest.mark.gpu
@gpu
def test_auto_uses_triton_on_gpu_without_host_sync():
    x = torch.randn(256, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    rms_norm(x, w).sum().backward()  # compile outside the sync check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = rms_norm(x, w)
        assert y.grad_fn is not None and "RMSNormFunction" in type(y.grad_fn).__name__
        torch.autograd.grad(y, (x, w), torch.ones_like(y))
    finally:
        torch.cuda.set_sync_debug_mode("default")
