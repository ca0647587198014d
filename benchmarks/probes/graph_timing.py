"""Capture a callable in a CUDA graph for the probes that time what a graphed training step runs
(timing eager calls of small kernels measures Python launch overhead instead)."""

from __future__ import annotations

import torch


def capture(fn, *, warmup: int = 3) -> torch.cuda.CUDAGraph:
    """Run ``fn`` ``warmup`` times on a side stream (lazy initialisation, compilation), then capture it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph
