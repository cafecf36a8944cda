"""A one-launch read of a given number of bytes, timed as the benchmarks time a write: a CUDA-graph replay after an
L2 flush, the replay's own cost included. The readers: a few shapes of one Triton kernel that only loads the bytes,
the copy engine (1-D bulk copies into shared memory by a few CTAs, `bulk_read.cu`; sm_90 only) and cuBLAS
multiplying 1, 8 or 16 tokens by the bytes as one concatenated bf16 weight (what a hand-stacked model's GEMM reads);
the fastest counts.

Also the same read kernels over copies of the bytes back to back in one graph (`back_to_back_read_us`): what a
kernel that only reads a GEMM's weights takes among other kernels, as `multi_linear.py` times the GEMMs and as a
draft step runs them.

Not a benchmark itself (scripts/gpu_check.sh skips `_*.py`); CUDA only (Triton, imported here and nowhere on CPU;
nvcc builds the copy-engine read on first use, in a few seconds).
A write that reads B bytes of weights in one launch pays what one launch that only reads them pays, and more.
"""

from __future__ import annotations

import ctypes
import functools
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from _timing import graphed, median_us

# A read kernel's launch and the tensor of partial sums it writes (`words_read` checks them).
ReadLaunch = tuple[Callable[[], None], torch.Tensor]

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
    """The fastest of the read kernels (`kernel_read`) and cuBLAS on one concatenated weight at each of
    CUBLAS_TOKENS (`cublas_read_us`) reading `n_bytes`, as weight rows of `k` bf16 elements for cuBLAS."""
    best = kernel_read(n_bytes, bench)
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


# (bytes per copy, CTAs per SM or, negative, CTAs in all): the copy engine's shapes, the fastest counts. One warp per
# CTA; copies of a few KB let 80 CTAs read at the full rate on the H200 (BENCHMARKS.md, "Copy-engine experiment").
BULK_SHAPES = ((4096, -80), (4096, 1), (16384, 1), (16384, 2))


@functools.cache
def _bulk_library() -> ctypes.CDLL:
    """benchmarks/bulk_read.cu built (nvcc, sm_90a) into a shared library of this process, loaded."""
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    source = Path(__file__).with_name("bulk_read.cu")
    target = Path(tempfile.mkdtemp(prefix="dspark_bulk_read_")) / "bulk_read.so"
    command = [nvcc, "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-cudart", "shared"]
    csrc = Path(__file__).resolve().parents[1] / "custom_ops" / "csrc"  # common/bulk_copy.cuh
    command += ["-gencode=arch=compute_90a,code=sm_90a", f"-I{csrc}", str(source), "-o", str(target)]
    built = subprocess.run(command, capture_output=True, text=True)
    if built.returncode != 0:
        raise RuntimeError(f"nvcc could not build {source}:\n{built.stderr[-2000:]}")
    library = ctypes.CDLL(str(target))
    library.dspark_bulk_read.restype = ctypes.c_int
    library.dspark_bulk_read.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
    ]
    return library


def bulk_ctas(shape: tuple[int, int]) -> int:
    """The CTAs of a copy-engine read of `shape` (one of BULK_SHAPES) on the current GPU."""
    per_sm = shape[1]
    return -per_sm if per_sm < 0 else per_sm * torch.cuda.get_device_properties().multi_processor_count


def bulk_launch(src: torch.Tensor, shape: tuple[int, int]) -> ReadLaunch:
    """A launch of the copy-engine read of `shape` (one of BULK_SHAPES) over the int32 words of `src` (contiguous)
    on the current stream, and the tensor of per-lane sums it writes (`words_read` checks them)."""
    copy_bytes, ctas = shape[0], bulk_ctas(shape)
    out = torch.empty(32 * ctas, dtype=torch.int32, device=src.device)
    library = _bulk_library()

    def launch() -> None:
        stream = torch.cuda.current_stream(src.device).cuda_stream
        error = library.dspark_bulk_read(src.data_ptr(), src.numel() * 4, ctas, copy_bytes, out.data_ptr(), stream)
        if error != 0:
            raise RuntimeError(f"dspark_bulk_read {shape}: CUDA error {error}")

    return launch, out


def read_launch(src: torch.Tensor, shape: tuple[int, int, int]) -> ReadLaunch:
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
    """Whether the sums `out` of a read launch over `src` (`read_launch`, `bulk_launch`) add up to the sum of every
    word of `src`."""
    return out.long().sum().item() % 2**32 == src.long().sum().item() % 2**32


def readers() -> list[tuple[str, Callable[[torch.Tensor], ReadLaunch]]]:
    """Every read kernel of this GPU, named: each shape of the Triton load kernel (`read_launch`) and, on sm_90, of
    the copy engine (`bulk_launch`); each makes a launch over a contiguous int32 tensor and its sums tensor."""
    found = [(f"Triton load kernel {shape}", functools.partial(read_launch, shape=shape)) for shape in SHAPES]
    if torch.cuda.get_device_capability() == (9, 0):
        found += [
            (
                f"copy engine, 1-D bulk copies of {shape[0]} B, {bulk_ctas(shape)} CTAs",
                functools.partial(bulk_launch, shape=shape),
            )
            for shape in BULK_SHAPES
        ]
    return found


def kernel_read(n_bytes: int, bench: dict[str, int]) -> Read:
    """Median µs of the fastest of `readers()` reading `n_bytes` (rounded up to 16) of one random buffer, each launch
    captured alone in a CUDA graph and timed by replay with `median_us(**bench)`; each checked to read every word."""
    src = _random_words(n_bytes)
    best = Read(float("inf"), "none")
    for name, make in readers():
        launch, out = make(src)
        us = median_us(graphed(launch, ()), "cuda", **bench)
        if not words_read(src, out):
            raise AssertionError(f"the {name} missed words")
        if us < best.us:
            best = Read(us, name)
    return best


def back_to_back_read_us(sources: list[torch.Tensor], warmup: int = 25, rep: int = 100) -> float:
    """Median µs per source of the fastest of `readers()` reading each of `sources` once, back to back in one CUDA
    graph (`median_us` of its replay ÷ the number of sources): what a kernel that only reads a GEMM's weights takes in
    a stream of kernels, without a replay's own cost. `sources`: contiguous copies of the same size whose bytes add up
    to more than the L2 (`read_sources`), so that none is read from it; each reader is checked to read every word."""
    words = [src.view(torch.int32) for src in sources]
    best = float("inf")
    for name, make in readers():
        launches = [make(src) for src in words]
        for launch, _ in launches:  # compiles or opts in the kernel before the capture
            launch()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for launch, _ in launches:
                launch()
        best = min(best, median_us(graph.replay, "cuda", warmup, rep) / len(sources))
        if not all(words_read(src, out) for src, (_, out) in zip(words, launches, strict=True)):
            raise AssertionError(f"the {name} missed words")
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
