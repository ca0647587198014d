"""Fused q/k RMSNorm + RoPE: reference vs Transformers' modules, hand-written backward via
gradcheck, Triton kernels under the CPU interpreter against the unfused kernels (rms_norm +
apply_rope) and the reference, and the same on the GPU at Qwen3-30B-A3B shapes."""

from __future__ import annotations

import importlib

import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm, apply_rotary_pos_emb

from moetune.kernels import apply_rope, apply_rope_reference, rms_norm, rms_norm_reference
from moetune.kernels.qk_norm_rope import QKNormRoPEFunction, qk_norm_rope, qk_norm_rope_reference
from kernel_test_utils import bf16_close, fp32_close, gpu, rope_tables

qk_norm_rope_module = importlib.import_module("moetune.kernels.qk_norm_rope")

EPS = 1e-6


def projected_qk(batch, seq, q_heads, k_heads, dim, *, dtype=torch.float32, device="cpu"):
    """q [B, S, Hq, D], k [B, S, Hk, D] as views of one wider projection output (strided in S)."""
    proj = torch.randn(batch, seq, (q_heads + 2 * k_heads) * dim, dtype=dtype, device=device) * 2
    q = proj[..., : q_heads * dim].view(batch, seq, q_heads, dim)
    k = proj[..., q_heads * dim : (q_heads + k_heads) * dim].view(batch, seq, k_heads, dim)
    return q, k


def norm_weights(dim, *, dtype=torch.float32, device="cpu"):
    """q_norm and k_norm weights (parameters: they require grad)."""
    return tuple((torch.rand(dim, device=device) + 0.5).to(dtype).requires_grad_() for _ in range(2))


def unfused_kernels(q, k, q_weight, k_weight, cos, sin, eps=EPS):
    """What the attention ran before: two rms_norm launches and one apply_rope launch."""
    q_norm = rms_norm(q, q_weight, eps, impl="triton")
    k_norm = rms_norm(k, k_weight, eps, impl="triton")
    return apply_rope(q_norm, k_norm, cos, sin, unsqueeze_dim=2, impl="triton")


def forward_backward(fn, q, k, q_weight, k_weight, dq_out, dk_out):
    """(q_out, k_out, dq, dk, dq_weight, dk_weight) of ``fn``; weights without grad give None."""
    inputs = [t.detach().requires_grad_(t.requires_grad) for t in (q, k, q_weight, k_weight)]
    inputs[0].requires_grad_()
    inputs[1].requires_grad_()
    q_out, k_out = fn(*inputs)
    wanted = [t for t in inputs if t.requires_grad]
    grads = iter(torch.autograd.grad((q_out, k_out), wanted, (dq_out, dk_out)))
    return [q_out.detach(), k_out.detach(), *(next(grads) if t.requires_grad else None for t in inputs)]


# ----- CPU: reference and the torch twin of the kernels' math -----


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_transformers_norms_then_rope(dtype):
    torch.manual_seed(0)
    q, k = projected_qk(2, 5, 4, 2, 16, dtype=dtype)
    cos, sin = rope_tables(1, 5, 16, dtype=dtype)
    q_norm_hf, k_norm_hf = Qwen3MoeRMSNorm(16, eps=EPS).to(dtype), Qwen3MoeRMSNorm(16, eps=EPS).to(dtype)
    with torch.no_grad():
        q_norm_hf.weight.copy_(torch.rand(16) + 0.5)
        k_norm_hf.weight.copy_(torch.rand(16) + 0.5)
    q_out, k_out = qk_norm_rope_reference(q, k, q_norm_hf.weight, k_norm_hf.weight, cos, sin, EPS)
    q_hf, k_hf = apply_rotary_pos_emb(q_norm_hf(q), k_norm_hf(k), cos, sin, unsqueeze_dim=2)
    torch.testing.assert_close(q_out, q_hf, atol=0, rtol=0)
    torch.testing.assert_close(k_out, k_hf, atol=0, rtol=0)
    q_norm, k_norm = rms_norm_reference(q, q_norm_hf.weight, EPS), rms_norm_reference(k, k_norm_hf.weight, EPS)
    composed = apply_rope_reference(q_norm, k_norm, cos, sin, unsqueeze_dim=2)
    torch.testing.assert_close((q_out, k_out), composed, atol=0, rtol=0)


def test_auto_on_cpu_runs_the_reference():
    torch.manual_seed(0)
    q, k = projected_qk(2, 3, 4, 2, 8)
    q_weight, k_weight = norm_weights(8)
    cos, sin = rope_tables(2, 3, 8)
    q_out, k_out = qk_norm_rope(q, k, q_weight, k_weight, cos, sin, EPS)
    assert q_out.grad_fn is not None and "QKNormRoPE" not in type(q_out.grad_fn).__name__
    reference = qk_norm_rope_reference(q, k, q_weight, k_weight, cos, sin, EPS)
    torch.testing.assert_close((q_out, k_out), reference, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_twin_forward_matches_reference(dtype):
    """The twin rounds where the kernels round (norm output, then the rotation in fp32 once):
    exact in fp32, within bf16 roundings of the fp32 reference in bf16."""
    torch.manual_seed(0)
    q, k = projected_qk(2, 5, 3, 1, 12, dtype=dtype)
    q_weight, k_weight = norm_weights(12, dtype=dtype)
    cos, sin = rope_tables(1, 5, 12, dtype=dtype)
    q_out, k_out = QKNormRoPEFunction.apply(q, k, q_weight, k_weight, cos, sin, EPS, "torch")
    assert q_out.dtype == k_out.dtype == dtype and q_out.is_contiguous() and k_out.is_contiguous()
    exact = qk_norm_rope_reference(*(t.float() for t in (q, k, q_weight, k_weight, cos, sin)), EPS)
    for got, want in zip((q_out, k_out), exact):
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        else:
            bf16_close(got, want)


def test_rejects_bad_shapes_naming_the_tensor():
    q, k = projected_qk(2, 3, 4, 2, 8)
    q_weight, k_weight = norm_weights(8)
    cos, sin = rope_tables(1, 3, 8)
    with pytest.raises(ValueError, match=r"^q must be \[B, S, Hq, D\]"):
        qk_norm_rope(q[0], k, q_weight, k_weight, cos, sin)
    with pytest.raises(ValueError, match="head_dim .* must be even"):
        qk_norm_rope(q[..., :7], k[..., :7], q_weight[:7], k_weight[:7], cos[..., :7], sin[..., :7])
    with pytest.raises(ValueError, match=r"^k must be \[B, S, Hk, D\]"):
        qk_norm_rope(q, k[:, :2], q_weight, k_weight, cos, sin)
    with pytest.raises(ValueError, match=r"^q_weight must have shape \(8,\)"):
        qk_norm_rope(q, k, q_weight[:4], k_weight, cos, sin)
    with pytest.raises(ValueError, match=r"^k_weight must have shape \(8,\)"):
        qk_norm_rope(q, k, q_weight, k_weight[None], cos, sin)
    with pytest.raises(ValueError, match=r"^cos must be \[B or 1, S, D\]"):
        qk_norm_rope(q, k, q_weight, k_weight, cos.expand(3, -1, -1), sin)
    with pytest.raises(ValueError, match=r"^sin must be \[B or 1, S, D\]"):
        qk_norm_rope(q, k, q_weight, k_weight, cos, sin[:, :2])
    with pytest.raises(ValueError, match="impl must be one of"):
        qk_norm_rope(q, k, q_weight, k_weight, cos, sin, impl="cuda")


@pytest.mark.parametrize("weight_grad", [True, False])
def test_hand_written_backward_gradcheck_float64(weight_grad):
    """The Function's torch backend runs the kernels' formulas (transposed rotation, then RMSNorm's
    backward); cos/sin with differing halves, batch-1 tables, strided q/k views, Hq != Hk."""
    torch.manual_seed(0)
    q, k = projected_qk(2, 3, 3, 2, 8, dtype=torch.float64)
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    q_weight, k_weight = (w.requires_grad_(weight_grad) for w in norm_weights(8, dtype=torch.float64))
    cos, sin = torch.randn(1, 3, 8, dtype=torch.float64), torch.randn(1, 3, 8, dtype=torch.float64)
    inputs = (q, k, q_weight, k_weight) if weight_grad else (q, k)

    def fused(q, k, q_weight=q_weight, k_weight=k_weight):
        return QKNormRoPEFunction.apply(q, k, q_weight, k_weight, cos, sin, EPS, "torch")

    assert torch.autograd.gradcheck(fused, inputs)
    # ... and it is the reference's gradient, not just a consistent one.
    dq_out, dk_out = torch.randn(2, 3, 3, 8, dtype=torch.float64), torch.randn(2, 3, 2, 8, dtype=torch.float64)
    got = torch.autograd.grad(fused(*inputs), inputs, (dq_out, dk_out))
    want = torch.autograd.grad(qk_norm_rope_reference(q, k, q_weight, k_weight, cos, sin, EPS), inputs, (dq_out, dk_out))
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


# ----- Triton kernels in the interpreter (CPU tensors, TRITON_INTERPRET=1) -----


def _check_against_unfused_and_reference(q, k, q_weight, k_weight, cos, sin, dq_out, dk_out):
    fused = forward_backward(
        lambda *t: qk_norm_rope(*t, cos, sin, EPS, impl="triton"), q, k, q_weight, k_weight, dq_out, dk_out
    )
    unfused = forward_backward(
        lambda *t: unfused_kernels(*t, cos, sin), q, k, q_weight, k_weight, dq_out, dk_out
    )
    exact = forward_backward(
        lambda *t: qk_norm_rope_reference(*(x.float() for x in t), cos.float(), sin.float(), EPS),
        q, k, q_weight, k_weight, dq_out.float(), dk_out.float(),
    )  # fmt: skip
    names = ("q_out", "k_out", "dq", "dk", "dq_weight", "dk_weight")
    for name, got, kernels, want in zip(names, fused, unfused, exact):
        if got is None:
            assert kernels is None and want is None, name
            continue
        assert got.dtype == kernels.dtype and got.shape == kernels.shape, name
        if q.dtype == torch.float32:
            # rstd's fp32 sum runs over two halves here, over the whole row in rms_norm; the weight
            # grads sum their rows in another order.
            atol, rtol = {"q_out": (1e-6, 1e-6), "k_out": (1e-6, 1e-6), "dq": (1e-5, 1e-5), "dk": (1e-5, 1e-5)}.get(
                name, (1e-4, 1e-5)  # weight grads: sums over all rows
            )
            fp32_close(got, kernels, atol=atol, rtol=rtol)
            fp32_close(got, want, atol=atol, rtol=rtol)
        else:
            # The fused kernels round where the unfused ones do (x_hat, norm output, RoPE grad) and
            # the fp32 sum-order differences vanish in those roundings: bit for bit on these
            # inputs, so a missing or extra rounding shows.
            torch.testing.assert_close(got, kernels, atol=0, rtol=0)
            bf16_close(got, want, ulps=8)
    assert fused[0].is_contiguous() and fused[1].is_contiguous()
    return fused


@pytest.mark.parametrize(
    "batch, seq, q_heads, k_heads, dim, table_batch, dtype",
    [
        (2, 5, 4, 2, 8, 1, torch.float32),  # batch-1 tables broadcast over B = 2
        (2, 3, 3, 1, 12, 2, torch.float32),  # D/2 = 6: masked halves; Hq, Hk not powers of two; tables per batch
        (2, 5, 4, 2, 8, 1, torch.bfloat16),
    ],
)
def test_qk_norm_rope_interpreter_matches_unfused_kernels(interpret, batch, seq, q_heads, k_heads, dim, table_batch, dtype):
    torch.manual_seed(0)
    q, k = projected_qk(batch, seq, q_heads, k_heads, dim, dtype=dtype)
    q_weight, k_weight = norm_weights(dim, dtype=dtype)
    cos, sin = rope_tables(table_batch, seq, dim, dtype=dtype)
    dq_out = torch.randn(batch, seq, q_heads, dim, dtype=dtype)
    dk_out = torch.randn(batch, seq, k_heads, dim, dtype=dtype)
    fused = _check_against_unfused_and_reference(q, k, q_weight, k_weight, cos, sin, dq_out, dk_out)
    assert all(t is not None for t in fused)  # both weight grads were computed and compared


@pytest.mark.parametrize("frozen", ["q_weight", "k_weight"])
def test_qk_norm_rope_interpreter_head_loop_persistent_loop_and_one_weight_grad(interpret, monkeypatch, frozen):
    """A tiny tile makes the kernels loop over head blocks, one backward program per SM (4 on CPU)
    makes the persistent programs loop over positions with a ragged last round, and a weight
    without grad drops its partials while the other keeps them."""
    monkeypatch.setattr(qk_norm_rope_module, "_TILE", 8)  # 2 heads per block at D = 8
    monkeypatch.setattr(qk_norm_rope_module, "_BWD_PROGRAMS_PER_SM", 1)
    torch.manual_seed(0)
    q, k = projected_qk(2, 5, 5, 3, 8)  # 10 positions over 4 programs: rounds of 4, 4, 2
    q_weight, k_weight = norm_weights(8)
    {"q_weight": q_weight, "k_weight": k_weight}[frozen].requires_grad_(False)
    cos, sin = rope_tables(1, 5, 8)
    out = _check_against_unfused_and_reference(
        q, k, q_weight, k_weight, cos, sin, torch.randn(2, 5, 5, 8), torch.randn(2, 5, 3, 8)
    )
    assert (out[4] is None, out[5] is None) == (frozen == "q_weight", frozen == "k_weight")


def test_qk_norm_rope_interpreter_weights_promote_the_norm_dtype(interpret):
    """bf16 q/k with fp32 weights: the norm's output (and so the result) is fp32, as in the
    unfused chain, and the backward rounds the RoPE grad to fp32, not bf16."""
    torch.manual_seed(0)
    q, k = projected_qk(1, 4, 2, 1, 8, dtype=torch.bfloat16)
    q_weight, k_weight = norm_weights(8)
    cos, sin = rope_tables(1, 4, 8, dtype=torch.bfloat16)
    dq_out, dk_out = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 1, 8)
    fused = forward_backward(
        lambda *t: qk_norm_rope(*t, cos, sin, EPS, impl="triton"), q, k, q_weight, k_weight, dq_out, dk_out
    )
    unfused = forward_backward(lambda *t: unfused_kernels(*t, cos, sin), q, k, q_weight, k_weight, dq_out, dk_out)
    assert fused[0].dtype == fused[1].dtype == torch.float32
    assert fused[2].dtype == fused[3].dtype == torch.bfloat16 and fused[4].dtype == fused[5].dtype == torch.float32
    for got, kernels in zip(fused, unfused):
        assert got.dtype == kernels.dtype
        torch.testing.assert_close(got.float(), kernels.float(), atol=1e-5, rtol=1e-5)


# ----- GPU -----


def _qwen3_inputs(dtype, *, batch=1, seq=4096, q_heads=32, k_heads=4, dim=128):
    q = torch.randn(batch, seq, q_heads * dim, device="cuda", dtype=dtype).view(batch, seq, q_heads, dim)
    k = torch.randn(batch, seq, k_heads * dim, device="cuda", dtype=dtype).view(batch, seq, k_heads, dim)
    q_weight, k_weight = norm_weights(dim, dtype=dtype, device="cuda")
    cos, sin = rope_tables(1, seq, dim, dtype=dtype, device="cuda")
    return q, k, q_weight, k_weight, cos, sin


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_matches_unfused_kernels_on_gpu(dtype):
    torch.manual_seed(0)
    q, k, q_weight, k_weight, cos, sin = _qwen3_inputs(dtype)
    dq_out, dk_out = torch.randn(q.shape, device="cuda", dtype=dtype), torch.randn(k.shape, device="cuda", dtype=dtype)
    fused = forward_backward(
        lambda *t: qk_norm_rope(*t, cos, sin, EPS, impl="triton"), q, k, q_weight, k_weight, dq_out, dk_out
    )
    unfused = forward_backward(lambda *t: unfused_kernels(*t, cos, sin), q, k, q_weight, k_weight, dq_out, dk_out)
    for got, kernels in zip(fused, unfused):
        assert got.dtype == kernels.dtype and got.shape == kernels.shape
        if dtype == torch.float32:
            fp32_close(got, kernels)
        else:
            bf16_close(got, kernels, ulps=2)


@pytest.mark.gpu
@gpu
def test_auto_uses_triton_on_gpu_without_host_sync():
    q, k, q_weight, k_weight, cos, sin = _qwen3_inputs(torch.bfloat16)
    q, k = q.requires_grad_(), k.requires_grad_()
    q_out, k_out = qk_norm_rope(q, k, q_weight, k_weight, cos, sin, EPS)
    (q_out.float().sum() + k_out.float().sum()).backward()  # compile outside the sync check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        q_out, k_out = qk_norm_rope(q, k, q_weight, k_weight, cos, sin, EPS)
        assert "QKNormRoPEFunction" in type(q_out.grad_fn).__name__
        torch.autograd.grad(
            (q_out, k_out), (q, k, q_weight, k_weight), (torch.ones_like(q_out), torch.ones_like(k_out))
        )
    finally:
        torch.cuda.set_sync_debug_mode("default")
