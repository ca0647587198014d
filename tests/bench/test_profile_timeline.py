"""``benchmarks/profile_ep.py``'s timeline analysis on a synthetic chrome trace: the GPU runs that feed
it are scarce, so its arithmetic is checked here (an unsortable kernel list once failed a rank's
report after a full profiling run)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import load_benchmark_script


@pytest.fixture(scope="module")
def profile_ep():
    return load_benchmark_script("profile_ep")


def kernel(name, ts, dur, stream):
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_timeline_splits_busy_exposed_and_names_the_gaps(profile_ep, tmp_path):
    # One step (us): compute 0-100 on stream 7 and, at the same start, an update on stream 9; an
    # all-gather 90-140 on stream 7 (50 us, 40 of them with no compute kernel running), compute again
    # 140-240, and a 30 us all-reduce overlapped by it.
    events = [
        kernel("gemm_a", 0, 100, 7), kernel("_adamw_kernel", 0, 20, 9),
        kernel("ncclDevKernel_AllGather_RING_LL(args)", 90, 50, 7),
        kernel("gemm_b", 140, 100, 7), kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(args)", 150, 30, 11),
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5},
    ]  # fmt: skip
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))

    result = profile_ep.timeline(trace, steps=1)

    assert result["span_ms"] == pytest.approx(0.24)
    assert result["compute_busy_ms"] == pytest.approx(0.2)
    assert result["nccl_busy_ms"] == pytest.approx(0.08)
    assert result["nccl_exposed_ms"] == pytest.approx(0.04)
    assert result["nccl_by_kind"]["AllGather_RING_LL"] == {"calls": 1.0, "busy_ms": 0.05, "exposed_ms": 0.04, "alone_ms": 0.04}
    assert result["nccl_by_kind"]["AllReduce_Sum_bf16_RING_LL"]["exposed_ms"] == 0.0
    assert result["streams_by_kind"] == {
        "compute": {"7": 2}, "adamw": {"9": 1}, "AllGather_RING_LL": {"7": 1}, "AllReduce_Sum_bf16_RING_LL": {"11": 1}
    }
    [gap] = result["largest_gaps"]
    assert gap["us"] == 40 and gap["after"] == "gemm_a" and gap["before"] == "gemm_b"
    assert gap["collectives"] == ["AllGather_RING_LL 50us@-10"]
    assert gap["before_stream"] == 7 and gap["its_stream_idle_us"] == 0  # the all-gather ran on it until then


def test_peer_waits_split_collective_time_into_waiting_for_the_peer_and_transfer(profile_ep, tmp_path):
    # Two ranks on one clock (rank 1's trace counts from a base time 1 ms later). First all-gather:
    # rank 0 launches at 100, rank 1 at 160 (its compute ran longer): rank 0 waits 60 us, then both
    # transfer for 40. Second: both at 500, 30 us each. Rank 1's kernels are the same calls.
    rank0 = {"traceEvents": [kernel("ncclDevKernel_AllGather_RING_LL(a)", 100, 100, 7),
                             kernel("ncclDevKernel_AllGather_RING_LL(a)", 500, 30, 7), kernel("gemm", 0, 100, 7)]}
    rank1 = {"baseTimeNanoseconds": 1_000_000,
             "traceEvents": [kernel("ncclDevKernel_AllGather_RING_LL(a)", 160 - 1000, 40, 7),
                             kernel("ncclDevKernel_AllGather_RING_LL(a)", 500 - 1000, 30, 7)]}  # fmt: skip
    paths = []
    for rank, trace in enumerate([rank0, rank1]):
        paths.append(tmp_path / f"trace_rank{rank}.json")
        paths[-1].write_text(json.dumps(trace))

    waits = profile_ep.peer_waits(paths, steps=1)

    assert waits == {"AllGather_RING_LL": {"calls": 2.0, "peer_wait_ms_by_rank": [0.06, 0.0], "transfer_us_median": 35.0}}
