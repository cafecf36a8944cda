"""A one-launch read of a given number of bytes (the fastest of a few kernel shapes), timed as the benchmarks time
a write: a CUDA-graph replay after an L2 flush, the replay's own cost included.

Not a benchmark itself (scripts/gpu_check.sh skips `_*.py`); CUDA only (Triton, imported here and nowhere on CPU).
A write that reads B bytes of weights in one launch pays what one launch that only reads them pays, and more.
"""

from __future__ import annotations

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


def one_launch_read_us(n_bytes: int, bench: dict[str, int]) -> float:
    """Median µs of the fastest of SHAPES reading `n_bytes` (rounded up to 16) of one random buffer, each launch
    captured alone in a CUDA graph and timed by replay with `median_us(**bench)`."""
    words = -(-n_bytes // 16) * 4
    src = torch.randint(-(2**31), 2**31 - 1, (words,), dtype=torch.int32, device="cuda")
    total = src.long().sum().item() % 2**32
    best = float("inf")
    for block, steps, warps in SHAPES:
        programs = triton.cdiv(words, block * steps)
        out = torch.empty(programs, dtype=torch.int32, device="cuda")

        def launch(block=block, steps=steps, warps=warps, programs=programs, out=out):
            _read_words[(programs,)](src, out, words, BLOCK=block, STEPS=steps, num_warps=warps)

        replay = graphed(launch, ())
        best = min(best, median_us(replay, "cuda", **bench))
        if out.long().sum().item() % 2**32 != total:  # every word was read
            raise AssertionError(f"the read kernel of shape {(block, steps, warps)} missed words")
    return best


def trivial_replay_us(bench: dict[str, int]) -> float:
    """Median µs of the replay of a graph of one trivial kernel (a one-element add): the harness's own cost."""
    counter = torch.zeros(1, device="cuda")
    return median_us(graphed(counter.add_, (1,)), "cuda", **bench)
