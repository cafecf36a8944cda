"""Helpers shared by the benchmark scripts (not a benchmark itself: scripts/gpu_check.sh skips `_*.py`)."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence

import torch


def graphed(
    fn: Callable[..., object], args: tuple, check: Callable[[object], object] | None = None
) -> Callable[[], None]:
    """`fn(*args)` captured in a `torch.cuda.CUDAGraph` after three warm-up calls; returns the graph's replay.
    `check(output)`, if given, runs on what one replay computed (the output captured, refilled by the replay): what
    is timed is checked, not only a direct call.

    The cuBLAS workspace cache is emptied right before and right after the capture, so that the graph's GEMMs get a
    workspace of their own, in the graph's memory pool, that lives as long as the graph. Without that, graphs that
    several of these captures keep alive at once, next to reduce-overhead callables, can replay into a freed
    workspace: docs/benchmarking.md, "CUDA graphs and the cuBLAS workspace"."""
    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = fn(*args)
    torch._C._cuda_clearCublasWorkspaces()
    if check is not None:
        for leaf in torch.utils._pytree.tree_leaves(output):  # written by the replay, or the check sees NaN
            if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
                leaf.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(output)
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


def interleaved_median_us(
    calls: Sequence[Callable[[], object]], device: str, rounds: int, names: Sequence[str] = ()
) -> list[float]:
    """Median µs per call of each of `calls`, sampled interleaved so that they share the machine's state: every
    round times each call once, in an order shuffled per round (seeded; so no call always follows the same one),
    after one untimed round. On CUDA each call runs after an L2 flush (as do_bench does) between two CUDA events; on CPU
    the wall clock of each call. Slow drifts (clocks, temperature, other load) then move every call alike, so two
    calls that launch the same kernels read the same median. With `names` (one per call; CUDA), every call is followed
    by a synchronize, so that an asynchronous CUDA error (an illegal address in some kernel) is raised as a
    RuntimeError naming the call that launched it; the extra synchronizations make such a run's times unlike a
    normal run's."""
    order = random.Random(0)
    cuda = device == "cuda"
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda") if cuda else None
    samples = [[] for _ in calls]
    for r in range(rounds + 1):
        for i in order.sample(range(len(calls)), len(calls)):
            sample = _cuda_sample(calls[i], flush) if cuda else _cpu_sample(calls[i])
            if cuda and names:
                try:
                    torch.cuda.synchronize()
                except RuntimeError as exc:
                    raise RuntimeError(f"CUDA error in the call of {names[i]!r} (round {r}): {exc}") from exc
            if r:
                samples[i].append(sample)
        if cuda:
            torch.cuda.synchronize()
    if cuda:
        return [1e3 * statistics.median(start.elapsed_time(end) for start, end in s) for s in samples]
    return [1e6 * statistics.median(s) for s in samples]


def _cuda_sample(call: Callable[[], object], flush: torch.Tensor) -> tuple[torch.cuda.Event, torch.cuda.Event]:
    """`call()` after an L2 flush, between two recorded CUDA events (read them after a synchronize)."""
    flush.zero_()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    call()
    end.record()
    return start, end


def _cpu_sample(call: Callable[[], object]) -> float:
    """Seconds of wall clock of `call()`."""
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def copy_bandwidth(device: str) -> float:
    """Bytes/s read + written by a device-to-device copy of 2 GiB (64 MiB on CPU), `median_us` of the copy."""
    src = torch.empty((2 << 30) if device == "cuda" else (64 << 20), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / (1e-6 * median_us(lambda: dst.copy_(src), device))


def gemm_rate(device: str, dtype: torch.dtype) -> float:
    """FLOP/s of a square `dtype` GEMM, 8192^3 on CUDA (512^3 on CPU), `median_us` of the product."""
    n = 8192 if device == "cuda" else 512
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    return 2 * n**3 / (1e-6 * median_us(lambda: a @ b, device))
