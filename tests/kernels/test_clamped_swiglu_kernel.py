"""GPT-OSS's clamped SwiGLU: the reference against Transformers' GptOssExperts._apply_gate, the
kernels (forward and the interleaved gradient, the clamps' bounds included) against the reference
under the CPU interpreter and on the GPU."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

from kernel_test_utils import bf16_close, fp32_close, gpu
from moetune.kernels.clamped_swiglu import clamped_swiglu, clamped_swiglu_reference

ALPHA, LIMIT = 1.702, 7.0


def projection(rows: int, width: int, *, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """Values on both sides of the clamps, and some exactly at their bounds."""
    h = torch.randn(rows, 2 * width, dtype=torch.float32) * 6
    h.view(-1)[::7] = LIMIT
    h.view(-1)[3::11] = -LIMIT
    return h.to(dtype=dtype, device=device)


def test_reference_is_transformers_gpt_oss_activation():
    config = transformers.GptOssConfig(hidden_size=8, intermediate_size=6, num_local_experts=2, swiglu_limit=LIMIT)
    experts = GptOssExperts(config)
    h = projection(5, 6)
    torch.testing.assert_close(clamped_swiglu_reference(h, alpha=experts.alpha, limit=experts.limit), experts._apply_gate(h),
                               rtol=0, atol=0)  # fmt: skip


def _check(h: torch.Tensor, check, num_valid: torch.Tensor | None = None) -> None:
    valid = h.shape[0] if num_valid is None else int(num_valid)
    leaf, ref_leaf = h.clone().requires_grad_(), h.clone().requires_grad_()
    out = clamped_swiglu(leaf, alpha=ALPHA, limit=LIMIT, num_valid=num_valid, impl="triton")
    ref = clamped_swiglu_reference(ref_leaf.double(), alpha=ALPHA, limit=LIMIT)
    grad = torch.randn(out.shape, dtype=out.dtype, device=out.device)
    (got,) = torch.autograd.grad(out, leaf, grad)
    (want,) = torch.autograd.grad(ref, ref_leaf, grad.double())
    check(out[:valid], ref[:valid].to(out.dtype))
    check(got[:valid], want[:valid].to(got.dtype))


def test_kernels_match_the_reference_in_interpreter(interpret):
    """Several row blocks, a width that is not a power of two, the bounds' gradients."""
    torch.manual_seed(0)
    _check(projection(37, 45), fp32_close)


def test_kernels_skip_rows_past_num_valid_in_interpreter(interpret):
    torch.manual_seed(0)
    _check(projection(12, 16), fp32_close, num_valid=torch.tensor([9]))


def test_odd_width_is_refused():
    with pytest.raises(ValueError, match="interleaved gate / up pairs"):
        clamped_swiglu(torch.zeros(2, 5), alpha=ALPHA, limit=LIMIT)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernels_match_the_reference_on_gpu(dtype):
    """GPT-OSS-20B's expert width (2880) on 4096 rows."""
    torch.manual_seed(0)
    _check(projection(4096, 2880, dtype=dtype, device="cuda"), bf16_close if dtype == torch.bfloat16 else fp32_close)


def test_bound_gradient_convention_follows_torch():
    """torch 2.14 gives an input exactly at a scalar clamp bound gradient 0 (pytorch#184574); earlier
    versions gave 1. The kernel's backward takes the running torch's convention (its interpreter tests
    above put inputs exactly on both bounds)."""
    from moetune.kernels.clamped_swiglu import CLAMP_PASSES_GRADIENT_AT_BOUND

    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    assert CLAMP_PASSES_GRADIENT_AT_BOUND == ((major, minor) < (2, 14))
