"""``moetune.bench.timeline``: busy and idle GPU time, and the kernels by GPU time, from profiler events
(synthetic ones here: the CPU has no GPU kernels)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moetune.bench.timeline import gpu_timeline, top_kernels

CUDA, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU


def event(name, start, end, device=CUDA):
    return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end))


def test_busy_idle_and_the_kernels_that_waited():
    # us: gemm 0-1000 and a copy overlapping it 500-1200 (one busy stretch of 1200), idle 800, norm
    # 2000-2500, idle 500, gemm 3000-4000; a host event and an empty kernel are not kernels.
    events = [event("gemm", 0, 1000), event("copy", 500, 1200), event("norm", 2000, 2500), event("gemm", 3000, 4000),
              event("aten::mm", 0, 5000, CPU), event("empty", 4100, 4100)]  # fmt: skip
    timeline = gpu_timeline(events)
    assert timeline["timeline_span_ms"] == pytest.approx(4.0)
    assert timeline["timeline_busy_ms"] == pytest.approx(2.7)
    assert timeline["timeline_idle_ms"] == pytest.approx(1.3)
    assert timeline["timeline_idle_ms_before"] == {"norm": 0.8, "gemm": 0.5}
    kernels = top_kernels(events, top=2)
    assert kernels[0] == {"kernel": "gemm", "ms": 2.0, "launches": 2, "share": pytest.approx(2.0 / 3.2, abs=1e-4)}
    assert [k["kernel"] for k in kernels] == ["gemm", "copy"]


def test_no_kernels_no_figures():
    assert gpu_timeline([event("aten::mm", 0, 10, CPU)]) == {} and top_kernels([]) == []
