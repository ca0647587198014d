"""``metrics.profile_start`` / ``metrics.profile_steps``: torch.profiler over a few training steps.

Why: the recipe's tokens/s is the number users see, and it trails the bench's bare step by a
quarter to a third on every architecture (benchmarks/README.md); what takes the difference
(kernels, GPU idle time while the host collates, clips or reads the loss) is only visible in a
profile of the recipe's own loop. Each rank writes, under ``output_dir/profile``:

- ``trace_rank{r}.json``: the Chrome / Perfetto trace of the profiled steps;
- ``ops_rank{r}.txt``: the operators and kernels by self time on the device (CPU time on CPU);
- ``summary_rank{r}.json``: the steps' wall time, the device's busy time in them and the top kernels.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from moetune.utils.timeline import interval_union, total


class StepProfiler:
    """Profiles steps ``start .. start + count - 1`` (1-based, as logged); ``start = 0``: off.
    Call ``begin(step)`` before step ``step`` runs and ``end(step)`` after it."""

    def __init__(self, *, start: int, count: int, out_dir: Path, rank: int, device: torch.device) -> None:
        self.start, self.last = start, start + count - 1
        self.out_dir, self.rank, self.device = out_dir / "profile", rank, device
        self._profiler: torch.profiler.profile | None = None
        self._wall_start = 0.0

    def begin(self, step: int) -> None:
        if self.start <= 0 or step != self.start:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize(self.device)
        self._profiler = torch.profiler.profile(activities=activities)
        self._profiler.__enter__()
        self._wall_start = time.perf_counter()

    def end(self, step: int) -> None:
        if self._profiler is None or step != self.last:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        wall_ms = (time.perf_counter() - self._wall_start) * 1e3
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        self._write(profiler, wall_ms, steps=self.last - self.start + 1)

    def close(self) -> None:
        """Stop a profile the loop left early (an interrupt): nothing is written for it."""
        if self._profiler is not None:
            self._profiler.__exit__(None, None, None)
            self._profiler = None

    def _write(self, profiler: torch.profiler.profile, wall_ms: float, *, steps: int) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(self.out_dir / f"trace_rank{self.rank}.json"))
        on_device = self.device.type == "cuda"
        averages = profiler.key_averages()
        sort_by = "self_device_time_total" if on_device else "self_cpu_time_total"
        (self.out_dir / f"ops_rank{self.rank}.txt").write_text(averages.table(sort_by=sort_by, row_limit=60))
        kernels = [e for e in profiler.events() if on_device and e.device_type == torch.autograd.DeviceType.CUDA]
        busy_ms = total(interval_union([(e.time_range.start, e.time_range.end) for e in kernels])) / 1e3  # us -> ms
        top = sorted(averages, key=lambda a: getattr(a, sort_by), reverse=True)[:15]
        summary = {
            "steps": steps, "wall_ms_per_step": wall_ms / steps,
            "device_busy_ms_per_step": busy_ms / steps if on_device else None,
            "top": [{"name": a.key[:120], "ms_per_step": getattr(a, sort_by) / 1e3 / steps, "calls": a.count} for a in top],
        }
        (self.out_dir / f"summary_rank{self.rank}.json").write_text(json.dumps(summary, indent=1))

