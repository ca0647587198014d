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
