"""The longest-sequence probe: each side, in a fresh process per sequence length (so one OOM never
poisons the next try), trains one full step (forward, backward, optimizer) at micro-batch 1 with
no attention mask; the longest length that succeeds is reported, in steps of ``step`` tokens.

``linear`` tries start, start + step, ... and stops at the first OOM. ``bisect`` (the default)
doubles until the first OOM, then bisects between the last success and the first failure on
multiples of ``step``: the same answer when memory grows with length, in ~log2 as many processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

RESULT_PREFIX = "PROBE_RESULT "
EXIT_OOM = 3


def child_command(*, side: str, seq_len: int, common_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "moetune.bench", "--probe-child", side, "--seq-len", str(seq_len), *common_args]


def try_length(*, side: str, seq_len: int, common_args: list[str], timeout: float) -> dict[str, Any]:
    """Run one child; its status is 'ok', 'oom', 'timeout' or 'error'."""
    command = child_command(side=side, seq_len=seq_len, common_args=common_args)
    # A fresh process: one rank, and moetune importable even when it is not installed (repo checkout).
    repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    python_path = os.pathsep.join(p for p in (repo_root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "WORLD_SIZE": "1", "PYTHONPATH": python_path}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"seq_len": seq_len, "status": "timeout"}
    result: dict[str, Any] = {"seq_len": seq_len}
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            result.update(json.loads(line[len(RESULT_PREFIX) :]))
    if done.returncode == 0 and result.get("status") == "ok":
        return result
    result["status"] = "oom" if done.returncode == EXIT_OOM else "error"
    if result["status"] == "error":
        result["output_tail"] = (done.stdout + done.stderr)[-3000:]
    return result


def probe_side(
    *,
    side: str,
    common_args: list[str],
    start: int,
    step: int,
    maximum: int,
    search: str,
    timeout: float,
    deadline: float | None = None,
    log=print,
) -> dict[str, Any]:
    """``deadline`` (time.monotonic()): no new length is tried after it; the bracket found so far is
    reported with ``stopped_by: 'time budget'``."""
    if start < step or start % step or step < 1:
        raise ValueError(f"--probe-start ({start}) must be a positive multiple of --probe-step ({step})")
    attempts: list[dict[str, Any]] = []

    def attempt(seq_len: int) -> str:
        if deadline is not None and time.monotonic() > deadline:
            return "time budget"
        result = try_length(side=side, seq_len=seq_len, common_args=common_args, timeout=timeout)
        attempts.append(result)
        extra = ""
        if result["status"] == "ok":
            peak = result.get("peak_gib")
            extra = f", step {result['step_s']:.2f} s" + ("" if peak is None else f", peak {peak:.1f} GiB")
        log(f"[probe] {side} seq {seq_len}: {result['status']}{extra}")
        return result["status"]

    longest, first_failure, failure = None, None, None
    seq_len = start
    while seq_len <= maximum:  # linear steps, or doubling in bisect mode
        status = attempt(seq_len)
        if status != "ok":
            if status == "time budget":
                failure = status
            else:
                first_failure, failure = seq_len, status
            break
        longest = seq_len
        seq_len = seq_len + step if search == "linear" else seq_len * 2
    if search == "bisect" and failure == "oom":
        low, high = longest or 0, first_failure
        while high - low > step:
            middle = (low + high) // 2 // step * step
            status = attempt(middle)
            if status == "ok":
                low, longest = middle, middle
            elif status == "oom":
                high, first_failure = middle, middle
            else:
                failure = status
                break
    return {
        "longest": longest,
        "first_failure": first_failure,
        "stopped_by": failure or f"reached --probe-max {maximum}",
        "attempts": attempts,
    }
