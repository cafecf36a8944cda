"""Helpers shared by the benchmark scripts (not a benchmark itself: scripts/gpu_check.sh skips `_*.py`)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def graphed(fn: Callable[..., object], args: tuple) -> Callable[[], None]:
    """`fn(*args)` captured in a `torch.cuda.CUDAGraph` after three warm-up calls; returns the graph's replay."""
    for _ in range(3):
        fn(*args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(*args)
    return graph.replay
