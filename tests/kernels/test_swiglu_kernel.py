"""SwiGLU: reference vs naive formula and Transformers' chunk convention, hand-written backward
via gradcheck, Triton kernels under the CPU interpreter, Triton vs reference on the GPU."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.activations import ACT2FN

from moetune.kernels import swiglu, swiglu_reference, swiglu_split
from moetune.kernels.swiglu import SwiGLUFunction, SwiGLUSplitFunction
from kernel_test_utils import bf16_close, fp32_close, gpu


def naive_swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """Element by element in float64: g / (1 + e^-g) * u with g, u the two halves."""
    half = gate_up.shape[-1] // 2
    flat = gate_up.double().reshape(-1, 2 * half).tolist()
    out = [[g / (1 + math.exp(-g)) * u for g, u in zip(row[:half], row[half:])] for row in flat]
    return torch.tensor(out, dtype=torch.float64).reshape(*gate_up.shape[:-1], half)


@pytest.mark.parametrize("shape", [(7, 2 * 24), (2, 3, 2 * 5)])
def test_torch_path_matches_naive_formula_fp32(shape):
    torch.manual_seed(0)
    gate_up = torch.randn(shape) * 3
    y = swiglu(gate_up, impl="torch")
    assert y.dtype == torch.float32 and y.shape == (*shape[:-1], shape[-1] // 2)
    torch.testing.assert_close(y.double(), naive_swiglu(gate_up), atol=1e-6, rtol=1e-6)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(swiglu_split(gate, up, impl="torch"), y, atol=0, rtol=0)


def test_matches_transformers_chunk_convention():
    torch.manual_seed(0)
    gate_up = torch.randn(4, 2 * 16)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(swiglu(gate_up), ACT2FN["silu"](gate) * up, atol=1e-6, rtol=1e-6)


def test_rejects_bad_input():
    with pytest.raises(ValueError, match="even"):
        swiglu(torch.randn(3, 7))
    with pytest.raises(ValueError, match="must match"):
        swiglu_split(torch.randn(3, 4), torch.randn(3, 5))


def test_reference_gradcheck_float64():
    gate_up = torch.randn(3, 2, 2 * 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(swiglu_reference, (gate_up,))


def test_hand_written_backward_gradcheck_float64():
    """The Functions' torch backend runs the same formulas as the Triton kernels."""
    torch.manual_seed(0)
    gate_up = torch.randn(3, 2, 2 * 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: SwiGLUFunction.apply(t, "torch"), (gate_up,))
    gate = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    up = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda g, u: SwiGLUSplitFunction.apply(g, u, "torch"), (gate, up))


def _check_triton_vs_reference(gate_up, dy):
    gate_up = gate_up.detach().requires_grad_()
    y = swiglu(gate_up, impl="triton")
    (d_gate_up,) = torch.autograd.grad(y, (gate_up,), dy)
    exact_in = gate_up.detach().float().requires_grad_()
    y_ref = swiglu_reference(exact_in)
    (d_ref,) = torch.autograd.grad(y_ref, (exact_in,), dy.float())
    assert y.dtype == gate_up.dtype and d_gate_up.dtype == gate_up.dtype and d_gate_up.shape == gate_up.shape
    if gate_up.dtype == torch.float32:
        fp32_close(y, y_ref, atol=1e-6, rtol=1e-6)
        fp32_close(d_gate_up, d_ref, atol=1e-6, rtol=1e-6)
    else:
        bf16_close(y, y_ref)
        bf16_close(d_gate_up, d_ref)
    # The split entry point runs the same kernels on two tensors.
    gate, up = (t.detach().requires_grad_() for t in gate_up.detach().chunk(2, dim=-1))
    y_split = swiglu_split(gate, up, impl="triton")
    torch.testing.assert_close(y_split, y, atol=0, rtol=0)
    d_gate, d_up = torch.autograd.grad(y_split, (gate, up), dy)
    torch.testing.assert_close(torch.cat((d_gate, d_up), dim=-1), d_gate_up, atol=0, rtol=0)


@pytest.mark.parametrize(
    "shape, dtype",
    [
        ((5, 2 * 37), torch.float32),  # odd width: column mask, several rows per program
        ((3, 2, 2 * 1500), torch.float32),  # wider than one block: two column blocks per row
        ((6, 2 * 64), torch.bfloat16),
    ],
)
def test_triton_kernel_in_interpreter(interpret, shape, dtype):
    torch.manual_seed(0)
    gate_up = torch.randn(shape, dtype=dtype) * 3
    dy = torch.randn(*shape[:-1], shape[-1] // 2, dtype=dtype)
    _check_triton_vs_reference(gate_up, dy)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(32768, 2 * 768), (4096, 2 * 6144), (1, 4096, 2 * 768)])
def test_triton_matches_reference_on_gpu(dtype, shape):
    torch.manual_seed(0)
    gate_up = torch.randn(shape, device="cuda", dtype=dtype) * 3
    dy = torch.randn(*shape[:-1], shape[-1] // 2, device="cuda", dtype=dtype)
    _check_triton_vs_reference(gate_up, dy)


@pytest.mark.gpu
@gpu
def test_auto_uses_triton_on_gpu_without_host_sync():
    gate_up = torch.randn(512, 2 * 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    swiglu(gate_up).sum().backward()  # compile outside the sync check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = swiglu(gate_up)
        assert "SwiGLUFunction" in type(y.grad_fn).__name__
        torch.autograd.grad(y, (gate_up,), torch.ones_like(y))
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_swiglu_num_valid_skips_padding_rows_in_interpreter(interpret):
    """Rows from ``num_valid`` on are padding: the valid rows and their gradients equal the
    reference's; the padding rows are not computed (their inputs hold NaN and nothing leaks)."""
    torch.manual_seed(0)
    gate_up = torch.randn(7, 2 * 24)
    gate_up[5:] = float("nan")
    gate_up.requires_grad_()
    dy = torch.randn(7, 24)
    out = swiglu(gate_up, num_valid=torch.tensor([5]), impl="triton")
    (grad,) = torch.autograd.grad(out, gate_up, dy)
    valid = gate_up.detach()[:5].clone().requires_grad_()
    expected = swiglu_reference(valid)
    (expected_grad,) = torch.autograd.grad(expected, valid, dy[:5])
    torch.testing.assert_close(out[:5], expected)
    torch.testing.assert_close(grad[:5], expected_grad)
