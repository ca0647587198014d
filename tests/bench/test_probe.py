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
        side="moetune", common_args=[], start=1024, step=1024, maximum=8192, search="bisect", timeout=1,
        log=lambda _: None,
    )
    assert result["longest"] is None and result["stopped_by"] == "error" and len(result["attempts"]) == 1


def test_time_budget_stops_launching_children(monkeypatch):
    monkeypatch.setattr(probe, "try_length", lambda **kw: {"seq_len": kw["seq_len"], "status": "ok", "step_s": 0.1})
    result = probe.probe_side(
        side="hf", common_args=[], start=1024, step=1024, maximum=1 << 20, search="linear", timeout=1,
        deadline=0.0, log=lambda _: None,
    )
    assert result == {"longest": None, "first_failure": None, "stopped_by": "time budget", "attempts": []}


def test_child_reports_oom_with_its_exit_code(monkeypatch, capsys):
    import json

    import torch

    from moetune.bench import cli

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(cli, "build_side", out_of_memory)
    code = cli.main(["--probe-child", "hf", "--config", "tiny", "--seq-len", "64", "--device", "cpu"])
    assert code == probe.EXIT_OOM
    [line] = [l for l in capsys.readouterr().out.splitlines() if l.startswith(probe.RESULT_PREFIX)]
    report = json.loads(line[len(probe.RESULT_PREFIX):])
    assert report["status"] == "oom" and report["side"] == "hf"


def test_child_trains_one_step(capsys):
    import json

    from moetune.bench import cli

    code = cli.main(
        ["--probe-child", "moetune", "--config", "tiny", "--layers", "2", "--seq-len", "64", "--device", "cpu"]
    )
    assert code == 0
    [line] = [l for l in capsys.readouterr().out.splitlines() if l.startswith(probe.RESULT_PREFIX)]
    report = json.loads(line[len(probe.RESULT_PREFIX):])
    assert report["status"] == "ok" and report["step_s"] > 0 and report["activation_checkpointing"] is True
