"""Helpers shared by the benchmark scripts (not a benchmark itself: scripts/gpu_check.sh skips `_*.py`)."""

from __future__ import annotations

import statistics
import time
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


def median_us(fn: Callable[[], object], device: str, warmup: int = 25, rep: int = 100) -> float:
    """Median µs per call: `triton.testing.do_bench(fn, warmup, rep)` (ms budgets) on CUDA; on CPU the wall clock
    of 20 calls after 3 warm-up calls (for smoke runs: no CUDA graph, no L2 flush)."""
    if device == "cuda":
        from triton.testing import do_bench

        return 1e3 * do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    for _ in range(3):
        fn()
    times = []
    for _ in range(20):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)
