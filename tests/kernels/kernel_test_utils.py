"""Helpers shared by the kernel tests (a uniquely named module, so no other conftest shadows it)."""

from __future__ import annotations

import pytest
import torch

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; run on the GPU machine")


def bf16_close(actual: torch.Tensor, exact: torch.Tensor, *, ulps: float = 4.0) -> None:
    """``actual`` (bf16 math) within a few bf16 roundings of ``exact`` (fp32 math on the same inputs).

    The bound is relative to each element plus a floor relative to the tensor's scale, because
    cancellations (the RMSNorm input grad) leave small elements with large relative error.
    """
    exact = exact.float()
    eps = torch.finfo(torch.bfloat16).eps
    torch.testing.assert_close(
        actual.float(), exact, rtol=ulps * eps, atol=ulps * eps * exact.abs().max().item() / 4 + 1e-6
    )


def fp32_close(actual: torch.Tensor, reference: torch.Tensor, *, atol: float = 1e-6, rtol: float = 1e-6) -> None:
    """fp32 kernel vs fp32 reference. On CPU (interpreter) within ``atol``/``rtol``; on a GPU,
    where the reference's own reductions and approximate rsqrt/exp differ, within 1e-5 of each
    element plus 1e-5 of the tensor's scale (long reductions such as the RMSNorm weight grad)."""
    if actual.is_cuda:
        scale = reference.abs().max().item()
        torch.testing.assert_close(actual, reference.to(actual.dtype), rtol=1e-5, atol=1e-5 * scale + 1e-7)
    else:
        torch.testing.assert_close(actual, reference.to(actual.dtype), atol=atol, rtol=rtol)


def rope_tables(batch: int, seq: int, dim: int, *, dtype=torch.float32, device="cpu", theta=1e6):
    """cos/sin [batch, seq, dim] as Qwen3's rotary embedding builds them: cat(freqs, freqs)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim)
    positions = torch.arange(seq, dtype=torch.float64, device=device)[None, :] + torch.arange(batch, device=device)[:, None]
    freqs = positions[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)
