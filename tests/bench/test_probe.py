"""The longest-sequence search (child processes faked)."""

from __future__ import annotations

import pytest

from moetune.bench import probe


@pytest.mark.parametrize("search", ["linear", "bisect"])
@pytest.mark.parametrize("limit", [1000, 5000, 9216, 40000])
def test_search_finds_the_longest_multiple_of_step(monkeypatch, search, limit):
    tried = []

    def fake(*, side, seq_len, common_args, timeout):
        tried.append(seq_len)
        return {"seq_len": seq_len, "status": "ok" if seq_len <= limit else "oom", "step_s": 0.1}

    monkeypatch.setattr(probe, "try_length", fake)
    result = probe.probe_side(
        side="hf", common_args=[], start=2048, step=1024, maximum=1 << 20, search=search, timeout=1, log=lambda _: None
    )
    expected = limit // 1024 * 1024 or None
    if search == "linear" and limit < 2048:  # linear never goes below --probe-start
        assert result["longest"] is None and result["first_failure"] == 2048
        return
    assert result["longest"] == expected
    assert result["first_failure"] == (expected or 0) + 1024
    if search == "linear":
        assert tried[-1] == result["first_failure"] and tried == sorted(tried)


def test_stops_on_errors_that_are_not_oom(monkeypatch):
    monkeypatch.setattr(probe, "try_length", lambda **kw: {"seq_len": kw["seq_len"], "status": "error"})
    result = probe.probe_side(
        side="moetune", common_args=[], start=1024, step=1024, maximum=8192, search="bisect", timeout=1, log=lambda _: None
    )
    assert result["longest"] is None and result["stopped_by"] == "error" and len(result["attempts"]) == 1


def test_time_budget_stops_launching_children(monkeypatch):
    monkeypatch.setattr(probe, "try_length", lambda **kw: {"seq_len": kw["seq_len"], "status": "ok", "step_s": 0.1})
    result = probe.probe_side(
        side="hf", common_args=[], start=1024, step=1024, maximum=1 << 20, search="linear", timeout=1,
        deadline=0.0, log=lambda _: None,
    )
    assert result == {"longest": None, "first_failure": None, "stopped_by": "time budget", "attempts": []}
