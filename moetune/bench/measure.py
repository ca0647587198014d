"""Timing and memory of training steps, and the matmul peak that MFU is measured against.

- Step time: CUDA events on GPU (no host sync inside the measured steps), ``perf_counter`` on CPU;
  warm-up steps first, then the median over the measured steps, with and without the optimizer step.
- Peak memory: ``torch.cuda.max_memory_allocated`` after a reset that follows warm-up. Steps
  replayed from a CUDA graph allocate nothing (the graph's pool was filled while capturing), so
  for them the reset comes before the capture step and the peak is that of the captured step.
- State memory: bytes of parameters + gradients + optimizer states counted from tensor sizes (the
  local shards under FSDP2 / expert parallelism); working memory = peak - state, i.e. activations,
  temporaries and communication buffers.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

GIB = 1024**3


@dataclass
class StepTimes:
    step_s: float
    """Median of forward + backward + optimizer step (+ zero_grad)."""
    fwd_bwd_s: float
    """Median of forward + backward alone."""
    optimizer_s: float
    """Median of the optimizer step alone."""
    all_step_s: list[float]
    losses: list[float]


class _Clock:
    """Marks on the GPU timeline (CUDA events) or on the host (perf_counter)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start, end) -> float:
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_steps(
    forward_backward: Callable[[], torch.Tensor],
    optimizer_step: Callable[[], None],
    *,
    device: torch.device,
    warmup: int,
    steps: int,
    peak_from_warmup_step: int | None = None,
) -> StepTimes:
    """Run ``warmup + steps`` training steps; peak-memory stats are reset after the warm-up, or
    before warm-up step ``peak_from_warmup_step`` (0-based; the capture step of a CUDA-graph run)."""
    if warmup < 0 or steps < 1:
        raise ValueError(f"need warmup >= 0 and steps >= 1, got warmup={warmup}, steps={steps}")
    for index in range(warmup):
        if index == peak_from_warmup_step:
            synchronize(device)
            reset_peak_memory(device)
        forward_backward()
        optimizer_step()
    synchronize(device)
    if peak_from_warmup_step is None:
        reset_peak_memory(device)
    clock = _Clock(device)
    marks, losses = [], []
    for _ in range(steps):
        start = clock.mark()
        loss = forward_backward()
        middle = clock.mark()
        optimizer_step()
        end = clock.mark()
        marks.append((start, middle, end))
        losses.append(loss.detach())
    synchronize(device)
    step = [clock.seconds(s, e) for s, _, e in marks]
    fwd_bwd = [clock.seconds(s, m) for s, m, _ in marks]
    optim = [clock.seconds(m, e) for _, m, e in marks]
    return StepTimes(
        step_s=statistics.median(step),
        fwd_bwd_s=statistics.median(fwd_bwd),
        optimizer_s=statistics.median(optim),
        all_step_s=step,
        losses=[float(x) for x in losses],
    )


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> tuple[int, int] | None:
    """(max allocated, max reserved) since the last reset; None off CUDA (no allocator statistics)."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients (one per trainable parameter, whether or not
    it is allocated right now) and optimizer states (whatever tensors the optimizer keeps)."""
    params = list(model.parameters())
    param_bytes = sum(_local_bytes(p) for p in params)
    grad_bytes = sum(_local_bytes(p) for p in params if p.requires_grad)
    optimizer_bytes = 0
    if optimizer is not None:
        for state in optimizer.state.values():
            optimizer_bytes += sum(_local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return {
        "params": param_bytes,
        "grads": grad_bytes,
        "optimizer": optimizer_bytes,
        "total": param_bytes + grad_bytes + optimizer_bytes,
    }


OPTIMIZERS = ("torch", "moetune", "moetune-in-backward")


def make_optimizer(
    model: torch.nn.Module, *, lr: float, device: torch.device, kind: str = "torch", capturable: bool = False
) -> torch.optim.Optimizer:
    """AdamW over the model's own (bf16) parameters, so its states are bf16 too (the published setting):
    ``torch`` = torch.optim.AdamW, fused on CUDA, foreach elsewhere; ``moetune`` = moetune.optim.AdamW
    (same update, one Triton kernel per tensor); ``moetune-in-backward`` = moetune.optim.AdamWInBackward.
    ``capturable``: step counters and learning rate on the device (CUDA-graph capture)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if kind not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {kind!r}")
    if capturable and kind == "moetune-in-backward":
        raise ValueError("the in-backward optimizer steps inside autograd hooks and cannot be captured in a CUDA graph")
    if kind != "torch":
        from moetune.optim import AdamW, AdamWInBackward

        if kind == "moetune":
            return AdamW(params, lr=lr, weight_decay=0.0, capturable=capturable)
        return AdamWInBackward(params, lr=lr, weight_decay=0.0)
    if device.type == "cuda":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=True, capturable=capturable)
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, foreach=True)


def matmul_peak_tflops(
    device: torch.device, *, size: int = 8192, warmup: int = 10, windows: int = 5, reps: int = 20
) -> float | None:
    """bf16 matmul peak of this GPU: the best of `windows` medians of `reps` size^3 matmuls (CUDA
    events per repetition). None off CUDA (MFU is then not reported).

    Best of several windows, not one median: on random operands an H100 runs at its power limit,
    and one 50-matmul median moved between 644 and 721 TFLOP/s from call to call on the same GPU
    (benchmarks/results/h100_20261205_5b44751/matmul_peak_probe.log); the best window is the
    steadier "what this GPU can do now", and a higher peak only makes the reported MFU lower."""
    if device.type != "cuda":
        return None
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    out = torch.empty(size, size, device=device, dtype=torch.bfloat16)
    for _ in range(warmup):
        torch.mm(a, b, out=out)
    best_ms = float("inf")
    for _ in range(windows):
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for start, end in zip(starts, ends):
            start.record()
            torch.mm(a, b, out=out)
            end.record()
        torch.cuda.synchronize(device)
        best_ms = min(best_ms, statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)))
    del a, b, out
    return 2.0 * size**3 / (best_ms * 1e-3) / 1e12
