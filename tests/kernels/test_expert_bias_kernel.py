"""Per-expert biases on sorted rows: the forward and the segment-sum bias gradient against
autograd's index_select / index_add, under the CPU interpreter and on the GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernel_test_utils import fp32_close, gpu
from moetune.kernels.expert_bias import add_expert_bias, segment_sum


def sorted_rows(counts: list[int], padding: int, width: int, *, dtype=torch.float32, device="cpu"):
    offsets = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
    rows = torch.arange(sum(counts) + padding, device=device, dtype=torch.int32)
    expert = torch.searchsorted(offsets, rows, right=True)
    h = torch.randn(rows.shape[0], width, dtype=dtype, device=device)
    return h, offsets, expert


def autograd_reference(h, bias, expert):
    """What the experts did before: index_select of a zero-padded bias (backward: index_add)."""
    return h + F.pad(bias, (0, 0, 0, 1)).index_select(0, expert)


def _fp32_sums_close(got, want):  # fp32 sums of up to 40 rows against float64 ones
    fp32_close(got, want, atol=1e-5, rtol=1e-5)


def _check(impl, *, counts, padding, width, dtype=torch.float32, device="cpu", close=_fp32_sums_close):
    torch.manual_seed(0)
    h, offsets, expert = sorted_rows(counts, padding, width, dtype=dtype, device=device)
    bias = torch.randn(len(counts), width, dtype=dtype, device=device)
    leaves = [h.clone().requires_grad_(), bias.clone().requires_grad_()]
    ref_leaves = [h.clone().requires_grad_(), bias.clone().requires_grad_()]
    out = add_expert_bias(*leaves, expert, offsets, impl=impl)
    ref = autograd_reference(ref_leaves[0].double(), ref_leaves[1].double(), expert)
    close(out, ref.to(dtype))
    grad = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, leaves, grad), torch.autograd.grad(ref, ref_leaves, grad.double())):
        close(got, want.to(dtype))


def test_reference_path_equals_autograd_index_select():
    """Empty experts, padding rows (they reach no bias), several column blocks."""
    _check("torch", counts=[3, 0, 5, 1], padding=2, width=300)


def test_segment_sum_kernel_in_interpreter(interpret):
    _check("triton", counts=[3, 0, 40, 1], padding=2, width=300)


def test_segment_sum_of_nothing():
    assert segment_sum(torch.zeros(0, 4), torch.zeros(0, dtype=torch.int32), dtype=torch.float32).shape == (0, 4)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_segment_sum_kernel_on_gpu(dtype):
    """GPT-OSS-20B's shapes: 32 experts, 16,384 routed rows (uneven), 5760 wide; bf16 sums
    accumulate in fp32 (the index_add they replace rounded every add to bf16)."""
    torch.manual_seed(0)
    counts = torch.distributions.Dirichlet(torch.ones(32)).sample().mul(16_384).floor().long().tolist()

    def close(got, want):
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                                   atol=1e-2 if dtype == torch.bfloat16 else 1e-4)  # fmt: skip

    _check("triton", counts=counts, padding=64, width=5760, dtype=dtype, device="cuda", close=close)


def test_grouped_experts_with_biases_equal_the_per_expert_loop_in_interpreter(interpret):
    """GPT-OSS-style experts (biases on both projections) through the grouped path (the Triton
    row GEMMs, as on CUDA, and the biases' segment sums), against the per-expert loop of
    nn.Linear-style matmuls: output and the gradients of the input, weights and biases; padding
    rows past the routed ones reach no gradient."""
    from moetune.moe.experts import run_experts

    torch.manual_seed(0)
    counts, hidden, inter = torch.tensor([3, 0, 5, 2]), 8, 6
    x = torch.randn(int(counts.sum()) + 2, hidden)  # 2 padding rows
    weights = [torch.randn(4, inter, hidden) * 0.3, torch.randn(4, hidden, inter) * 0.3, torch.randn(4, inter),
               torch.randn(4, hidden)]  # fmt: skip
    results = []
    for backend in ("triton", "auto"):  # "auto" on CPU: the per-expert loop
        leaves = [t.clone().requires_grad_() for t in (x, *weights)]
        out = run_experts(leaves[0], counts, leaves[1], leaves[2], activate=lambda h, *_: torch.tanh(h), backend=backend,
                          in_bias=leaves[3], down_bias=leaves[4])[: int(counts.sum())]  # fmt: skip
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        results.append([out, *torch.autograd.grad(out, leaves, grad)])
    for got, want in zip(*results):
        _fp32_sums_close(got, want)
