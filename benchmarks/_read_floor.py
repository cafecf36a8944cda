"""A one-launch read of a given number of bytes, timed as the benchmarks time a write: a CUDA-graph replay after an
L2 flush, the replay's own cost included. The readers: a few shapes of one Triton kernel that only loads the bytes,
and cuBLAS multiplying 1, 8 or 16 tokens by the bytes as one concatenated bf16 weight (what a hand-stacked model's
GEMM reads); the fastest counts.

Also the same load kernel over copies of the bytes back to back in one graph (`back_to_back_read_us`): what a
kernel that only reads a GEMM's weights takes among other kernels, as `multi_linear.py` times the GEMMs and as a
draft step runs them.

Not a benchmark itself (scripts/gpu_check.sh skips `_*.py`); CUDA only (Triton, imported here and nowhere on CPU).
A write that reads B bytes of weights in one launch pays what one launch that only reads them pays, and more.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from _timing import graphed, median_us

# (words per block step, steps per program, warps): a few shapes, the fastest counts; 16-byte loads throughout.
SHAPES = ((2048, 8, 8), (4096, 4, 8), (4096, 16, 8), (1024, 16, 4))


@triton.jit
def _read_words(src, out, words, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    """Program p sums (int32, wrapping) the words [p, p + 1) * BLOCK * STEPS of `src` into out[p]."""
    program = tl.program_id(0)
    first = program.to(tl.int64) * (BLOCK * STEPS)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for step in range(STEPS):
        offsets = first + step * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(src + offsets, mask=offsets < words, other=0)
    tl.store(out + program, tl.sum(acc, axis=0))


class Read(NamedTuple):
    us: float  # median µs of the fastest reader
    reader: str  # which one


# Token counts at which cuBLAS multiplies the concatenated weight; cuBLAS picks a different kernel for each.
CUBLAS_TOKENS = (1, 8, 16)


def one_launch_read(n_bytes: int, k: int, bench: dict[str, int]) -> Read:
    """The fastest of the Triton shapes (`triton_read_us`) and cuBLAS on one concatenated weight at each of
    CUBLAS_TOKENS (`cublas_read_us`) reading `n_bytes`, as weight rows of `k` bf16 elements for cuBLAS."""
    best = Read(triton_read_us(n_bytes, bench), "Triton load kernel")
    for tokens in CUBLAS_TOKENS:
        us = cublas_read_us(n_bytes, k, tokens, bench)
        if us < best.us:
            best = Read(us, f"cuBLAS, {tokens} token{'s' if tokens > 1 else ''} x the concatenated weight")
    return best


def cublas_read_us(n_bytes: int, k: int, tokens: int, bench: dict[str, int]) -> float:
    """Median µs of `torch.mm` of `tokens` bf16 rows [tokens, k] by a random bf16 weight of n_bytes / (2 k) rows
    (transposed view, as `F.linear` reads it), captured alone in a CUDA graph and timed by replay with
    `median_us(**bench)`."""
    rows = n_bytes // (2 * k)
    weight = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(tokens, k, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(tokens, rows, dtype=torch.bfloat16, device="cuda")
    replay = graphed(lambda: torch.mm(x, weight.t(), out=out), ())
    us = median_us(replay, "cuda", **bench)
    torch.testing.assert_close(out.float(), (x.float() @ weight.float().t()), rtol=2e-2, atol=2e-2 * k**0.5)
    return us


def read_launch(src: torch.Tensor, shape: tuple[int, int, int]) -> tuple[Callable[[], None], torch.Tensor]:
    """A launch of the load kernel of `shape` (one of SHAPES) over the int32 words of `src` (contiguous), and the
    tensor of per-program sums it writes (`words_read` checks them)."""
    block, steps, warps = shape
    words = src.numel()
    programs = triton.cdiv(words, block * steps)
    out = torch.empty(programs, dtype=torch.int32, device=src.device)

    def launch() -> None:
        _read_words[(programs,)](src, out, words, BLOCK=block, STEPS=steps, num_warps=warps)

    return launch, out


def words_read(src: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the sums `out` of a `read_launch` over `src` add up to the sum of every word of `src`."""
    return out.long().sum().item() % 2**32 == src.long().sum().item() % 2**32


def triton_read_us(n_bytes: int, bench: dict[str, int]) -> float:
    """Median µs of the fastest of SHAPES reading `n_bytes` (rounded up to 16) of one random buffer, each launch
    captured alone in a CUDA graph and timed by replay with `median_us(**bench)`."""
    src = _random_words(n_bytes)
    best = float("inf")
    for shape in SHAPES:
        launch, out = read_launch(src, shape)
        best = min(best, median_us(graphed(launch, ()), "cuda", **bench))
        if not words_read(src, out):
            raise AssertionError(f"the read kernel of shape {shape} missed words")
    return best


def back_to_back_read_us(sources: list[torch.Tensor], warmup: int = 25, rep: int = 100) -> float:
    """Median µs per source of the fastest of SHAPES reading each of `sources` once, back to back in one CUDA graph
    (`median_us` of its replay ÷ the number of sources): what a kernel that only reads a GEMM's weights takes in a
    stream of kernels, without a replay's own cost. `sources`: contiguous copies of the same size whose bytes add up
    to more than the L2 (`read_sources`), so that none is read from it; each shape is checked to read every word."""
    words = [src.view(torch.int32) for src in sources]
    best = float("inf")
    for shape in SHAPES:
        launches = [read_launch(src, shape) for src in words]
        for launch, _ in launches:  # compiles the shape before the capture
            launch()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for launch, _ in launches:
                launch()
        best = min(best, median_us(graph.replay, "cuda", warmup, rep) / len(sources))
        if not all(words_read(src, out) for src, (_, out) in zip(words, launches, strict=True)):
            raise AssertionError(f"the read kernel of shape {shape} missed words")
    return best


def read_sources(n_bytes: int) -> list[torch.Tensor]:
    """Random copies of `n_bytes` (rounded up to 16), enough of them (at least 2) for 3x the device's L2."""
    l2_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    copies = max(2, -(-3 * l2_bytes // n_bytes))
    return [_random_words(n_bytes) for _ in range(copies)]


def _random_words(n_bytes: int) -> torch.Tensor:
    """Random int32 words on the GPU filling `n_bytes` rounded up to 16."""
    return torch.randint(-(2**31), 2**31 - 1, (-(-n_bytes // 16) * 4,), dtype=torch.int32, device="cuda")


def trivial_replay_us(bench: dict[str, int]) -> float:
    """Median µs of the replay of a graph of one trivial kernel (a one-element add): the harness's own cost."""
    counter = torch.zeros(1, device="cuda")
    return median_us(graphed(counter.add_, (1,)), "cuda", **bench)
