"""Autocast's dtype for a tensor's CUDA device, for code that runs ops autocast does not cast
(torch's grouped GEMM, the flash kernels called through ``torch.ops.aten``) and casts itself."""

from __future__ import annotations

import torch


def cuda_autocast_dtype(t: torch.Tensor) -> torch.dtype | None:
    """Autocast's dtype where autocast is on for ``t``'s CUDA device, else None."""
    if t.is_cuda and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return None
