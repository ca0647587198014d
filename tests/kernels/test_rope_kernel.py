"""RoPE: reference vs Transformers and a naive per-pair rotation, hand-written backward via
gradcheck, Triton kernel under the CPU interpreter, Triton vs reference on the GPU."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import apply_rotary_pos_emb

from moetune.kernels import apply_rope, apply_rope_reference
from moetune.kernels.rope import RoPEFunction
from kernel_test_utils import bf16_close, fp32_close, gpu, rope_tables


def naive_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (i, i + D/2) pair by its angle in float64: x [B, H, S, D], cos/sin [B, S, D]."""
    out = torch.empty(x.shape, dtype=torch.float64)
    half = x.shape[-1] // 2
    x, cos, sin = x.double(), cos.double()[:, None], sin.double()[:, None]
    for i in range(half):
        a, b = x[..., i], x[..., i + half]
        out[..., i] = a * cos[..., i] - b * sin[..., i]
        out[..., i + half] = b * cos[..., i + half] + a * sin[..., i + half]
    return out


def qk(batch, q_heads, k_heads, seq, dim, *, dtype=torch.float32, device="cpu"):
    """q, k as Qwen3 attention makes them: [B, S, H, D] projections transposed to [B, H, S, D] views."""
    q = torch.randn(batch, seq, q_heads, dim, dtype=dtype, device=device).transpose(1, 2)
    k = torch.randn(batch, seq, k_heads, dim, dtype=dtype, device=device).transpose(1, 2)
    return q, k


def test_torch_path_matches_naive_rotation_and_transformers_fp32():
    torch.manual_seed(0)
    q, k = qk(2, 4, 2, 5, 16)
    cos, sin = rope_tables(2, 5, 16)
    q_out, k_out = apply_rope(q, k, cos, sin, impl="torch")
    torch.testing.assert_close(q_out.double(), naive_rope(q, cos, sin), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k_out.double(), naive_rope(k, cos, sin), atol=1e-6, rtol=1e-6)
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(q_out, q_hf, atol=0, rtol=0)
    torch.testing.assert_close(k_out, k_hf, atol=0, rtol=0)


def test_half_width_tables_match_gpt_oss_rotation_fp32():
    """GPT-OSS's tables hold each frequency once ([B, S, D / 2]); Transformers' GPT-OSS rotation and
    the full-width tables cat((cos, cos)) give the same result, on both paths."""
    from transformers.models.gpt_oss.modeling_gpt_oss import apply_rotary_pos_emb as gpt_oss_rope

    torch.manual_seed(0)
    q, k = qk(2, 4, 2, 5, 16)
    cos, sin = rope_tables(2, 5, 16)
    half_cos, half_sin = cos[..., :8], sin[..., :8]  # rope_tables gives cat(freqs, freqs)
    q_hf, k_hf = gpt_oss_rope(q, k, half_cos, half_sin)
    q_out, k_out = apply_rope(q, k, half_cos, half_sin, impl="torch")
    torch.testing.assert_close(q_out, q_hf, atol=0, rtol=0)
    torch.testing.assert_close(k_out, k_hf, atol=0, rtol=0)
    q_full, k_full = apply_rope(q, k, cos, sin, impl="torch")
    torch.testing.assert_close(q_out, q_full, atol=0, rtol=0)
    torch.testing.assert_close(k_out, k_full, atol=0, rtol=0)


def test_rejects_bad_shapes():
    q, k = qk(1, 2, 1, 3, 8)
    cos, sin = rope_tables(1, 3, 8)
    with pytest.raises(ValueError, match="unsqueeze_dim"):
        apply_rope(q, k, cos, sin, unsqueeze_dim=0)
    with pytest.raises(ValueError, match="4-D q, k"):
        apply_rope(q[0], k, cos, sin)
    with pytest.raises(ValueError, match="disagree"):
        apply_rope(q, k[:, :, :2], cos, sin)
    with pytest.raises(ValueError, match="head_dim"):
        apply_rope(q[..., :7], k[..., :7], cos[..., :7], sin[..., :7])
    with pytest.raises(ValueError, match="head_dim / 2"):
        apply_rope(q, k, cos[..., :3], sin[..., :3])


def test_reference_gradcheck_float64():
    q, k = (t.double().requires_grad_() for t in qk(1, 2, 1, 3, 8))
    cos, sin = rope_tables(1, 3, 8, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda q, k: apply_rope_reference(q, k, cos, sin), (q, k))


def test_hand_written_backward_gradcheck_float64():
    """The Function's torch backend runs the kernel's formulas, including the backward
    (s1, s2) -> (-s2, -s1) swap, for cos/sin whose halves differ (more general than RoPE)."""
    torch.manual_seed(0)
    q, k = (t.double().requires_grad_() for t in qk(2, 3, 1, 4, 8))
    cos, sin = torch.randn(2, 4, 8, dtype=torch.float64), torch.randn(2, 4, 8, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda q, k: RoPEFunction.apply(q, k, cos, sin, "torch"), (q, k))


def _check_triton_vs_reference(q, k, cos, sin, dq, dk, *, unsqueeze_dim=1):
    q = q.detach().requires_grad_()
    k = k.detach().requires_grad_()
    q_out, k_out = apply_rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim, impl="triton")
    grads = torch.autograd.grad((q_out, k_out), (q, k), (dq, dk))
    q32, k32 = (t.detach().float().requires_grad_() for t in (q, k))
    if cos.shape[-1] != q.shape[-1]:  # half-width tables: the reference takes cat(freqs, freqs)
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    ref = apply_rope_reference(q32, k32, cos.float(), sin.float(), unsqueeze_dim=unsqueeze_dim)
    ref_grads = torch.autograd.grad(ref, (q32, k32), (dq.float(), dk.float()))
    assert q_out.stride() == q.stride() and k_out.stride() == k.stride()  # keeps the layout, as torch does
    assert grads[0].dtype == q.dtype and grads[1].dtype == k.dtype
    for got, exact in zip((q_out, k_out, *grads), (*ref, *ref_grads)):
        if q.dtype == torch.float32:
            fp32_close(got, exact, atol=1e-6, rtol=1e-6)
        else:
            bf16_close(got, exact)


@pytest.mark.parametrize(
    "batch, q_heads, k_heads, seq, dim, dtype",
    [
        (2, 5, 2, 7, 16, torch.float32),
        (1, 40, 3, 3, 128, torch.float32),  # more heads than one block (32 x 64): head loop
        (1, 3, 1, 2, 12, torch.float32),  # D/2 = 6: masked half
        (2, 4, 2, 5, 32, torch.bfloat16),
    ],
)
def test_triton_kernel_in_interpreter(interpret, batch, q_heads, k_heads, seq, dim, dtype):
    torch.manual_seed(0)
    q, k = qk(batch, q_heads, k_heads, seq, dim, dtype=dtype)
    cos, sin = rope_tables(batch, seq, dim, dtype=dtype)
    dq, dk = torch.randn(q.shape, dtype=dtype), torch.randn(k.shape, dtype=dtype)
    _check_triton_vs_reference(q, k, cos, sin, dq, dk)


def test_triton_kernel_in_interpreter_bshd_layout_and_batch1_tables(interpret):
    torch.manual_seed(0)
    q = torch.randn(2, 5, 4, 8)  # [B, S, H, D], unsqueeze_dim=2
    k = torch.randn(2, 5, 2, 8)
    cos, sin = rope_tables(1, 5, 8)  # batch-1 tables broadcast over the batch
    _check_triton_vs_reference(q, k, cos, sin, torch.randn(q.shape), torch.randn(k.shape), unsqueeze_dim=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_in_interpreter_half_width_tables(interpret, dtype):
    """[B, S, D / 2] tables (GPT-OSS): the kernel reads both halves' factors from the one half."""
    torch.manual_seed(0)
    q, k = qk(2, 4, 2, 5, 16, dtype=dtype)
    cos, sin = rope_tables(1, 5, 16, dtype=dtype)
    dq, dk = torch.randn(q.shape, dtype=dtype), torch.randn(k.shape, dtype=dtype)
    _check_triton_vs_reference(q, k, cos[..., :8], sin[..., :8], dq, dk)


@pytest.mark.gpu
@gpu
def test_triton_half_width_tables_on_gpu():
    torch.manual_seed(0)
    q, k = qk(1, 64, 8, 4096, 64, dtype=torch.bfloat16, device="cuda")  # GPT-OSS-20B's heads
    cos, sin = rope_tables(1, 4096, 64, dtype=torch.bfloat16, device="cuda")  # GPT-OSS casts its tables to x's dtype
    dq = torch.randn(q.shape, dtype=torch.bfloat16, device="cuda")
    dk = torch.randn(k.shape, dtype=torch.bfloat16, device="cuda")
    _check_triton_vs_reference(q, k, cos[..., :32], sin[..., :32], dq, dk)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batch, seq", [(1, 4096), (2, 1024)])
def test_triton_matches_reference_on_gpu(dtype, batch, seq):
    torch.manual_seed(0)
    q, k = qk(batch, 32, 4, seq, 128, dtype=dtype, device="cuda")
    cos, sin = rope_tables(1, seq, 128, dtype=dtype, device="cuda")
    cos, sin = cos.expand(batch, -1, -1), sin.expand(batch, -1, -1)
    dq = torch.randn(q.shape, dtype=dtype, device="cuda")
    dk = torch.randn(k.shape, dtype=dtype, device="cuda")
    _check_triton_vs_reference(q, k, cos, sin, dq, dk)


@pytest.mark.gpu
@gpu
def test_auto_uses_triton_on_gpu_without_host_sync():
    q, k = (t.requires_grad_() for t in qk(1, 32, 4, 256, 128, dtype=torch.bfloat16, device="cuda"))
    cos, sin = rope_tables(1, 256, 128, dtype=torch.bfloat16, device="cuda")
    q_out, k_out = apply_rope(q, k, cos, sin)
    (q_out.sum() + k_out.sum()).backward()  # compile outside the sync check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        q_out, k_out = apply_rope(q, k, cos, sin)
        assert "RoPEFunction" in type(q_out.grad_fn).__name__
        torch.autograd.grad((q_out, k_out), (q, k), (torch.ones_like(q_out), torch.ones_like(k_out)))
    finally:
        torch.cuda.set_sync_debug_mode("default")
