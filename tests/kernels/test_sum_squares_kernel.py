"""Sum of squares of many tensors (the squared gradient norm of clipping): the Triton kernel under the
CPU interpreter and on the GPU against a float64 reference, and the clipping paths that use it."""

from __future__ import annotations

import pytest
import torch

from moetune.kernels.sum_squares import sum_of_squares, sum_of_squares_reference
from kernel_test_utils import gpu


def exact(tensors):
    return sum(t.double().square().sum() for t in tensors)


def mixed_tensors(dtype, device="cpu"):
    torch.manual_seed(0)
    base = torch.randn(300, 70, dtype=dtype, device=device)
    return [
        torch.randn(5000, dtype=dtype, device=device),  # several blocks: the grid-stride loop
        torch.randn(17, dtype=dtype, device=device),  # one masked block
        base.t(),  # not contiguous
        torch.empty(0, dtype=dtype, device=device),
        torch.randn(3, 4, 5, dtype=dtype, device=device) * 100,
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_in_interpreter_matches_float64(interpret, dtype):
    tensors = mixed_tensors(dtype)
    got = sum_of_squares(tensors, impl="triton")
    assert got.dtype == torch.float32 and got.dim() == 0
    torch.testing.assert_close(got.double(), exact(tensors), rtol=1e-5, atol=0)


def test_reference_and_auto_on_cpu_match_float64():
    tensors = mixed_tensors(torch.float32)
    for got in (sum_of_squares_reference(tensors), sum_of_squares(tensors)):
        torch.testing.assert_close(got.double(), exact(tensors), rtol=1e-5, atol=0)
    assert float(sum_of_squares([])) == 0.0


def test_many_programs_write_disjoint_partials_in_interpreter(interpret, monkeypatch):
    """Several large tensors: each launch owns its slice of the partial sums."""
    import moetune.kernels.sum_squares as module

    monkeypatch.setattr(module, "BLOCK", 64)
    tensors = [torch.randn(1000 + 37 * i) for i in range(4)]
    torch.testing.assert_close(sum_of_squares(tensors, impl="triton").double(), exact(tensors), rtol=1e-5, atol=0)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_on_gpu_matches_float64_and_is_capturable(dtype):
    tensors = [*mixed_tensors(dtype, "cuda"), torch.randn(3 << 20, dtype=dtype, device="cuda"),
               torch.randn(64, 1536, 2048, dtype=dtype, device="cuda")[:, :, :1024]]  # large, strided
    got = sum_of_squares(tensors)
    torch.testing.assert_close(got.double(), exact(tensors), rtol=1e-5, atol=0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = sum_of_squares(tensors)
    for t in tensors:
        t.mul_(2)
    graph.replay()
    torch.testing.assert_close(captured.double(), 4 * exact([t / 2 for t in tensors]), rtol=1e-5, atol=0)


@pytest.mark.gpu
@gpu
def test_clip_grad_norm_on_gpu_uses_the_kernel_and_matches_torch():
    from moetune.distributed import clip_grad_norm_

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, device="cuda", dtype=torch.bfloat16)) for n in (4 << 20, 100, 2 << 20)]
    for p in params:
        p.grad = torch.randn_like(p)
    exact_norm = exact([p.grad for p in params]).sqrt()
    got = clip_grad_norm_(params, float("inf"))
    assert got.dtype == torch.float32  # torch's foreach norm of bf16 gradients comes back in bf16
    torch.testing.assert_close(got.double(), exact_norm, rtol=1e-5, atol=0)
    torch_norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
    torch.testing.assert_close(torch_norm.double(), exact_norm, rtol=1e-2, atol=0)
