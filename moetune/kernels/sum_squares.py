"""The sum of squares of many tensors in fp32 (the squared global gradient norm of clipping).

``sum_of_squares(tensors)`` returns one fp32 scalar on the tensors' device, read once in their own
dtype. On CUDA each large tensor (>= ``LARGE`` elements) gets one persistent launch: a few
programs per SM stride over it and each writes its fp32 partial sum into one shared buffer, which
is summed at the end (no atomics: the same bits every run); the small rest go through
``torch._foreach_norm``.

Why: ``torch._foreach_norm`` cuts every tensor into 64K-element chunks of a few hundred blocks per
launch; on an H200 it read a Qwen3-30B-A3B 8-layer model's bf16 gradients (11 GB) at ~2.5 TB/s
(4.5 ms of the recipe's 75 ms step, the recipe's profile of 2026-12-01 at 1b1f43d), and clipping must finish it
before any update starts. ``benchmarks/probes/sum_squares_probe.py`` times both.
"""

from __future__ import annotations

import torch

from moetune.kernels._triton_utils import HAS_TRITON, Impl, device_of, num_sms, tl, triton, use_triton

LARGE = 1 << 20  # elements; smaller tensors are cheaper in foreach's batched launches
BLOCK = 4096
PROGRAMS_PER_SM = 8
NUM_WARPS = 8


def sum_of_squares_reference(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Per-tensor fp32 norms (``torch._foreach_norm``, no fp32 copies), squared and summed."""
    if not tensors:
        return torch.zeros((), dtype=torch.float32)
    return torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32)).square().sum()


if HAS_TRITON:

    @triton.jit
    def _sum_squares_kernel(x_ptr, numel, partials_ptr, BLOCK: tl.constexpr):
        # Grid-stride: program p reads blocks p, p + P, p + 2P, ... of x (int64 offsets: an expert
        # tensor can pass 2^31 elements).
        pid = tl.program_id(0)
        step = tl.num_programs(0).to(tl.int64) * BLOCK
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        offsets = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        for _ in range(tl.cdiv(numel - pid.to(tl.int64) * BLOCK, step)):
            x = tl.load(x_ptr + offsets, mask=offsets < numel, other=0.0).to(tl.float32)
            acc += x * x
            offsets += step
        tl.store(partials_ptr + pid, tl.sum(acc, axis=0))


def _programs(numel: int, device: torch.device) -> int:
    return max(1, min(triton.cdiv(numel, BLOCK), PROGRAMS_PER_SM * num_sms(device)))


def sum_of_squares(tensors: list[torch.Tensor], *, impl: Impl = "auto") -> torch.Tensor:
    """Sum over ``tensors`` (one device) of their squared elements, as an fp32 scalar; no host sync."""
    if not tensors:
        return torch.zeros((), dtype=torch.float32)
    if not use_triton(impl, *tensors):
        return sum_of_squares_reference(tensors)
    threshold = 0 if impl == "triton" else LARGE  # impl="triton": every tensor through the kernel
    large = [t for t in tensors if t.numel() >= threshold]
    small = [t for t in tensors if t.numel() < threshold]
    device = tensors[0].device
    counts = [_programs(t.numel(), device) for t in large]
    partials = torch.empty(sum(counts), dtype=torch.float32, device=device)
    start = 0
    with device_of(tensors[0]):
        for t, count in zip(large, counts):
            if t.numel():
                flat = t if t.is_contiguous() else t.contiguous()
                _sum_squares_kernel[(count,)](flat, t.numel(), partials[start:], BLOCK=BLOCK, num_warps=NUM_WARPS)
            else:
                partials[start:start + count].zero_()
            start += count
    total = partials.sum()
    return total + sum_of_squares_reference(small).to(device) if small else total
