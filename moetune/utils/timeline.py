"""Time intervals of a profiled GPU timeline (kernels on several streams overlap)."""

from __future__ import annotations


def interval_union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The [start, end) intervals merged: sorted, disjoint."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def total(intervals: list[tuple[float, float]]) -> float:
    """Summed length of (disjoint) intervals."""
    return sum(end - start for start, end in intervals)
