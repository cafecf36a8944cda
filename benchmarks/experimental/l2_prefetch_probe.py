"""Probe, not in the op: can the next GEMM's weights be brought into L2 while the small kernels between two GEMMs
(norms, RoPE, attention) leave HBM idle?

Each graph (CUDA-graph replay after do_bench's L2 flush, median) is a spin kernel of `window` µs (0: a launch only)
standing for those kernels, then `x @ W.T` (x [16, 4096] bf16). Before the spin, a Triton kernel asks L2 for all of
W: one `prefetch.global.L2` per 128-byte line, or one `cp.async.bulk.prefetch.L2` per 4 KB or 64 KB; in the stream,
or on a second stream forked before the spin and joined before the GEMM. Times are ÷ the graph without a prefetch;
"GEMM" is a graph's time less that of the same graph without its GEMM (what the GEMM adds after that prefetch).

    python benchmarks/experimental/l2_prefetch_probe.py   # GPU only (Triton)"""

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _timing import graphed


@triton.jit
def prefetch_l2(ptr, lines, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    addrs = ptr + offs * 64  # 64 bf16 = 128 bytes per line
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [addrs], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def bulk_prefetch_l2(ptr, chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    addrs = ptr + offs * (CHUNK // 2)  # bf16 elements per chunk
    tl.inline_asm_elementwise(
        f"cp.async.bulk.prefetch.L2.global [$1], {CHUNK}; mov.u32 $0, 0;",
        "=r,l",
        [addrs],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


def prefetch(w: torch.Tensor, chunk: int) -> None:
    """Ask L2 for all of `w`: `prefetch.global.L2` per 128-byte line (chunk 0), else one bulk prefetch per `chunk`
    bytes (`w`'s bytes a multiple of 128 x chunk here)."""
    if chunk == 0:
        prefetch_l2[(w.numel() // 64 // 1024,)](w, w.numel() // 64, BLOCK=1024)
    else:
        chunks = w.numel() * 2 // chunk
        bulk_prefetch_l2[(chunks // 128,)](w, chunks, CHUNK=chunk, BLOCK=128)


def step(
    x: torch.Tensor, w: torch.Tensor, spin: int, chunk: int | None, side: torch.cuda.Stream | None, gemm: bool = True
):
    """The spin (the window), then x @ w.T (unless not `gemm`); with a prefetch of `w` (chunk not None) issued before
    the spin, in the stream or (side) on a second stream forked before the spin and joined before the GEMM."""

    def run() -> None:
        main = torch.cuda.current_stream()
        if chunk is not None and side is not None:
            side.wait_stream(main)
            with torch.cuda.stream(side):
                prefetch(w, chunk)
        elif chunk is not None:
            prefetch(w, chunk)
        torch.cuda._sleep(spin)
        if chunk is not None and side is not None:
            main.wait_stream(side)
        if gemm:
            torch.mm(x, w.t())

    return run


def replay_us(run) -> float:
    return 1e3 * do_bench(graphed(run, ()), warmup=25, rep=200, return_mode="median")


def main() -> None:
    cycles_per_us = torch.cuda.get_device_properties(0).clock_rate / 1e3  # kHz -> cycles per µs
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    side = torch.cuda.Stream()
    ways = [("in stream", 0, False), ("in stream", 4096, False), ("side stream", 0, True)]
    ways += [("side stream", 4096, True), ("side stream", 65536, True)]
    for rows in (4096, 6144):
        w = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
        for window in (0, 5, 10, 20):
            spin = int(window * cycles_per_us)
            plain = replay_us(step(x, w, spin, None, None))
            plain_gemm = plain - replay_us(step(x, w, spin, None, None, gemm=False))
            cells = []
            for where, chunk, on_side in ways:
                stream = side if on_side else None
                us = replay_us(step(x, w, spin, chunk, stream))
                gemm_us = us - replay_us(step(x, w, spin, chunk, stream, gemm=False))
                what = "lines" if chunk == 0 else f"{chunk // 1024} KB bulk"
                cells.append(f"{where}, {what}: {us:.1f} ({us / plain:.3f}x; GEMM {gemm_us:.1f})")
            print(
                f"W [{rows}, 4096], window {window} us: none {plain:.1f} (GEMM {plain_gemm:.1f}); " + "; ".join(cells),
                flush=True,
            )


if __name__ == "__main__":
    sys.exit(main())
