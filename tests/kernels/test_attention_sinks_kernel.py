"""Attention sinks folded into an attention kernel's output: the derivation (a kernel's own
backward, fed the log-sum-exp over keys and sink and the sink output, plus the sinks' gradient,
equals autograd through Transformers' eager sink attention), and the one-pass kernels against the
reference under the CPU interpreter, in the layouts the flash and cuDNN kernels return."""

from __future__ import annotations

import pytest
import torch

from kernel_test_utils import fp32_close, gpu
from moetune.kernels.attention_sinks import sink_grad, sink_grad_reference, sink_scale, sink_scale_reference
from moetune.layers.sink_attention import _eager_sink_attention

B, S, H, K, D, SCALE = 2, 7, 6, 2, 8, 0.3


def _plain_attention(q_BHSD, k_BKSD, v_BKSD):
    """Causal attention without sinks in float64: output [B, S, H, D] and log-sum-exp [B, H, S]."""
    k, v = (t.repeat_interleave(H // K, dim=1) for t in (k_BKSD, v_BKSD))
    scores = (q_BHSD @ k.transpose(-1, -2)) * SCALE
    scores = scores.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf"))
    lse = scores.logsumexp(-1)
    return (torch.exp(scores - lse[..., None]) @ v).transpose(1, 2), lse


def _kernel_backward(grad_BSHD, q_BHSD, k_BKSD, v_BKSD, out_BSHD, lse_BHS):
    """A flash kernel's backward from its saved output and log-sum-exp (what torch's kernels do)."""
    k, v = (t.repeat_interleave(H // K, dim=1) for t in (k_BKSD, v_BKSD))
    grad, out = grad_BSHD.transpose(1, 2), out_BSHD.transpose(1, 2)
    scores = (q_BHSD @ k.transpose(-1, -2)) * SCALE
    probs = torch.exp(scores - lse_BHS[..., None]).tril()
    dp = grad @ v.transpose(-1, -2)
    ds = probs * (dp - (grad * out).sum(-1, keepdim=True))
    dk, dv = (ds.transpose(-1, -2) @ q_BHSD) * SCALE, probs.transpose(-1, -2) @ grad
    fold = lambda t: t.view(B, K, H // K, S, D).sum(2)  # noqa: E731
    return (ds @ k) * SCALE, fold(dk), fold(dv)


def test_kernel_backward_with_the_sink_log_sum_exp_is_the_sink_attention_gradient():
    torch.manual_seed(0)
    q, k, v = torch.randn(B, H, S, D).double(), torch.randn(B, K, S, D).double(), torch.randn(B, K, S, D).double()
    sinks = torch.randn(H).double()
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    want = _eager_sink_attention(*leaves, scaling=SCALE)
    grad = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, leaves, grad)

    out, lse = _plain_attention(q, k, v)
    lse_all = torch.empty_like(lse)  # over the keys and the sink
    out_sink = sink_scale_reference(out, lse, sinks, lse_all)
    torch.testing.assert_close(out_sink, want)
    got_grads = (*_kernel_backward(grad, q, k, v, out_sink, lse_all), sink_grad_reference(grad, out_sink, lse_all, sinks))
    for name, got, expected in zip(("q", "k", "v", "sinks"), got_grads, want_grads):
        torch.testing.assert_close(got, expected, msg=name)


def _kernel_layouts(rows: int, heads: int, dim: int, *, flash: bool, dtype, device="cpu"):
    """(out [1 or 2, S, H, D] view, lse [.., H, S] view) as the flash kernels ([T, H, D] rows, an
    [H, T + padding] log-sum-exp) or cuDNN ([B, H, S, 1] statistics; its output here in
    [B, H, S, D] memory, the strided case) return them."""
    if flash:
        out = torch.randn(rows, heads, dim, device=device).to(dtype)[None]
        lse = (torch.randn(heads, rows + 5, device=device) * 3)[:, :rows][None]
        return out, lse
    batch, seq = 2, rows // 2
    out = torch.randn(batch, heads, seq, dim, device=device).to(dtype).transpose(1, 2)  # strided: any layout
    lse = (torch.randn(batch, heads, seq, 1, device=device) * 3)[..., 0]
    return out, lse


def _check_kernels(*, rows, heads, dim, flash, dtype=torch.float32, device="cpu", impl="triton", close=fp32_close):
    torch.manual_seed(0)
    out, lse = _kernel_layouts(rows, heads, dim, flash=flash, dtype=dtype, device=device)
    sinks = torch.randn(heads, device=device)
    lse_all, want_lse_all = torch.full_like(lse, float("nan")), torch.empty_like(lse)
    want = sink_scale_reference(out, lse, sinks, want_lse_all)
    got = sink_scale(out, lse, sinks, lse_all, impl=impl)
    close(got.float(), want.float())
    fp32_close(lse_all, want_lse_all)
    grad = torch.randn(got.shape, device=device).to(dtype)
    close(sink_grad(grad, got, lse_all, sinks, impl=impl), sink_grad_reference(grad, got, lse_all, sinks))


@pytest.mark.parametrize("flash", [True, False], ids=["flash", "cudnn"])
def test_sink_kernels_in_interpreter(interpret, flash):
    """Heads not a power of two, two head blocks (80 heads of 64), rows not a multiple of the
    gradient's 16 rows per program."""
    _check_kernels(rows=38, heads=5, dim=12, flash=flash)
    _check_kernels(rows=18, heads=80, dim=64, flash=flash)


def test_sink_kernels_reject_mismatched_shapes():
    out, lse = _kernel_layouts(10, 4, 8, flash=False, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"lse \(B, H, S\)"):
        sink_scale(out, lse.transpose(1, 2), torch.zeros(4), lse)
    with pytest.raises(ValueError, match="sinks"):
        sink_grad(out, out, lse, torch.zeros(3))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("flash", [True, False], ids=["flash", "cudnn"])
def test_sink_kernels_on_gpu(flash):
    """GPT-OSS-20B's heads (64 of 64) in bf16 and fp32."""
    _check_kernels(rows=4096, heads=64, dim=64, flash=flash, device="cuda")
    bf16 = lambda got, want: torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)  # noqa: E731
    _check_kernels(rows=4096, heads=64, dim=64, flash=flash, dtype=torch.bfloat16, device="cuda", close=bf16)
