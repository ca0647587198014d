"""Shared helpers for the Triton kernels: optional import, dispatch rule, launch sizes.

Triton is an optional dependency (the ``gpu`` extra). Every kernel file imports ``triton`` and
``tl`` from here and defines its kernels under ``if HAS_TRITON:`` so that the package imports,
and the pure-PyTorch references run, on machines without Triton.
"""

from __future__ import annotations

import contextlib
from typing import Literal

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only installs: every public function falls back to its torch reference
    triton = None
    tl = None
    HAS_TRITON = False

Impl = Literal["auto", "triton", "torch"]
_IMPLS = ("auto", "triton", "torch")


def use_triton(impl: Impl, *tensors: torch.Tensor) -> bool:
    """Whether a public function should launch its Triton kernel.

    ``"auto"`` picks Triton when it is importable and every tensor is on a CUDA device,
    ``"torch"`` always takes the reference, ``"triton"`` always takes the kernel (a CPU tensor
    then only works under ``TRITON_INTERPRET=1``, which the tests use).
    """
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    if impl == "torch":
        return False
    if impl == "triton":
        if not HAS_TRITON:
            raise RuntimeError("impl='triton' was requested but triton is not installed")
        return True
    return HAS_TRITON and all(t.is_cuda for t in tensors)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def warps_for(num_elements: int) -> int:
    """num_warps for a program that holds ``num_elements`` values per tensor in registers.

    About 8-16 fp32 values per thread keeps Hopper's register file from spilling.
    """
    if num_elements >= 8192:
        return 16
    if num_elements >= 2048:
        return 8
    if num_elements >= 512:
        return 4
    return 2 if num_elements >= 128 else 1


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a host-side property query, no sync); 4 on CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # CPU tensors only reach a kernel under the interpreter: keep its grid tiny


def device_of(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Make ``t``'s GPU current for a launch (Triton launches on the current device and stream)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def unit_stride_rows(t: torch.Tensor) -> torch.Tensor:
    """[..., C] -> [R, C] with unit column stride; a view whenever the layout allows it."""
    t2d = t.reshape(-1, t.shape[-1])
    return t2d if t2d.stride(-1) == 1 else t2d.contiguous()


def rows_grid(num_rows: int, num_cols: int, *, max_block_n: int = 1024) -> tuple[tuple[int, int], dict]:
    """Grid and launch sizes of an elementwise row kernel: up to ``max_block_n`` columns per program
    (short rows: several rows per program). Rows go on grid axis 0 (up to 2**31 - 1); axis 1 is
    limited to 65535 column blocks."""
    block_n = min(next_pow2(num_cols), max_block_n)
    block_m = max(1, max_block_n // block_n)
    grid = (triton.cdiv(num_rows, block_m), triton.cdiv(num_cols, block_n))
    return grid, {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": warps_for(block_m * block_n)}


def valid_rows_arg(num_valid: torch.Tensor | None, like: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A kernel's (pointer, HAS_VALID) pair for an optional count of valid rows (a device tensor):
    a dummy pointer when every row is valid."""
    if num_valid is None:
        return like, False
    return num_valid.reshape(1).to(like.device), True
