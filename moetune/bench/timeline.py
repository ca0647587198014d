"""Where a profiled stretch of GPU work spent its time: the span from the first kernel's start to the
last one's end, the time some kernel ran (busy), the idle rest and which kernels waited for it, and
the kernels by total GPU time. Read from ``torch.profiler`` events (``prof.events()``); shared by
``benchmarks/profile_step.py`` and the user-script harness (``benchmarks/user_scripts``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def gpu_kernels(events: Iterable[Any]) -> list[tuple[float, float, str]]:
    """(start, end, name) of every GPU kernel or copy among the profiler's events, in microseconds, by start."""
    return sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in events
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
    )


def gpu_timeline(events: Iterable[Any], top: int = 15) -> dict[str, Any]:
    """Span, busy and idle milliseconds of the kernels in ``events``, and the idle time before each
    kernel name (the kernel that waited), the ``top`` largest."""
    kernels = gpu_kernels(events)
    if not kernels:
        return {}
    busy, idle_before = 0.0, {}
    cur_start, cur_end, _ = kernels[0]
    for start, end, name in kernels[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            key = name[:60]
            idle_before[key] = idle_before.get(key, 0.0) + (start - cur_end) / 1e3
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    span = max(end for _, end, _ in kernels) - kernels[0][0]
    worst = sorted(idle_before.items(), key=lambda kv: -kv[1])[:top]
    return {
        "timeline_span_ms": span / 1e3,
        "timeline_busy_ms": busy / 1e3,
        "timeline_idle_ms": (span - busy) / 1e3,
        "timeline_idle_ms_before": {name: round(ms, 3) for name, ms in worst},
    }


def top_kernels(events: Iterable[Any], top: int = 25) -> list[dict[str, Any]]:
    """The ``top`` kernel names by total GPU time: milliseconds, launches, and the share of all kernels' time."""
    totals: dict[str, list[float]] = {}
    for start, end, name in gpu_kernels(events):
        entry = totals.setdefault(name, [0.0, 0])
        entry[0] += (end - start) / 1e3
        entry[1] += 1
    everything = sum(ms for ms, _ in totals.values()) or 1.0
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"kernel": name[:120], "ms": round(ms, 3), "launches": int(n), "share": round(ms / everything, 4)}
            for name, (ms, n) in ranked]  # fmt: skip
