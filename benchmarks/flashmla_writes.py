"""Fused DeepSeek-V4 K write vs the unfused baseline vs the torch reference, on one CUDA GPU.

    python benchmarks/flashmla_writes.py [--out PATH] [--batches 1 16 256 4096 65536] [--page-sizes 256 64]

Variants (bf16 `kv` is the strided slice `qkv_a[:, 1024:]`, row stride 1536, as in the model):
- `fused`: `dspark::fused_k_norm_rope_flashmla` (one kernel);
- `unfused`: `kv.contiguous()` + `dspark::fused_norm_rope_inplace` + `dspark::store_flashmla_cache` (the older path);
- `torch`: `fused_k_norm_rope_flashmla_reference` (vectorized torch, what a plain-PyTorch port would run).

Columns: launches = CUDA kernels per call (torch.profiler); eager µs = median per call of back-to-back eager calls
(includes host dispatch); graph µs = median per call replaying a CUDA graph of the calls (GPU time only);
GB/s = the fused op's irreducible traffic (kv rows, table rows, positions, slots read; 583 B/token written) divided
by the graph time, so every variant is measured against the same useful work; % floor = that bandwidth over the
measured HBM floor (a large device-to-device copy, read + write); speedup = unfused graph time / variant graph time.
Timings use CUDA events after a warm-up; slots are a random permutation of the pool, positions are distinct.
"""

import argparse
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

import custom_ops  # noqa: F401  (registers torch.ops.dspark.*)
from custom_ops.flashmla.writes import fused_k_norm_rope_flashmla_reference
from custom_ops.layouts.fp8 import flashmla_page_bytes
from custom_ops.layouts.rope import precompute_freqs

Q_LORA_RANK = 1024
MAX_POS = 65536
EPS = 1e-6
REPS = 7


def make_inputs(b: int, page_size: int) -> dict[str, torch.Tensor]:
    qkv_a = torch.randn(b, Q_LORA_RANK + 512, device="cuda", dtype=torch.bfloat16)
    num_pages = b // page_size + 2
    return {
        "kv": qkv_a[:, Q_LORA_RANK:],
        "weight": (1 + 0.1 * torch.randn(512, device="cuda")).to(torch.bfloat16),
        "freqs": precompute_freqs(MAX_POS, device="cuda"),
        "positions": torch.randperm(MAX_POS, device="cuda")[:b],
        "out_loc": torch.randperm(num_pages * page_size, device="cuda")[:b].to(torch.int32),
        "kvcache": torch.zeros(num_pages, flashmla_page_bytes(page_size), device="cuda", dtype=torch.uint8),
    }


def useful_bytes(b: int) -> int:
    per_token = 512 * 2 + 64 * 4 + 8 + 4 + 583
    return b * per_token + 512 * 2


def variants(x: dict[str, torch.Tensor], page_size: int) -> dict[str, Callable[[], None]]:
    ops = torch.ops.dspark
    kv, w, freqs, pos, loc, cache = (x[k] for k in ("kv", "weight", "freqs", "positions", "out_loc", "kvcache"))

    def fused() -> None:
        ops.fused_k_norm_rope_flashmla(kv, w, EPS, freqs, pos, loc, cache, page_size)

    def unfused() -> None:
        normed = kv.contiguous()
        ops.fused_norm_rope_inplace(normed, w, EPS, freqs, pos)
        ops.store_flashmla_cache(normed, loc, cache, page_size)

    def reference() -> None:
        fused_k_norm_rope_flashmla_reference(kv, w, EPS, freqs, pos, loc, cache, page_size)

    return {"fused": fused, "unfused": unfused, "torch": reference}


def _elapsed_ms(run: Callable[[], None]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _calls_per_rep(fn: Callable[[], None]) -> int:
    for _ in range(3):
        fn()
    est_ms = _elapsed_ms(lambda: [fn() for _ in range(5)]) / 5
    return max(5, min(500, int(3.0 / max(est_ms, 1e-3))))


def time_eager_us(fn: Callable[[], None]) -> float:
    n = _calls_per_rep(fn)
    return statistics.median(_elapsed_ms(lambda: [fn() for _ in range(n)]) / n for _ in range(REPS)) * 1e3


def time_graph_us(fn: Callable[[], None]) -> float | None:
    n = _calls_per_rep(fn)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(n):
                fn()
    except RuntimeError:
        return None
    graph.replay()
    return statistics.median(_elapsed_ms(graph.replay) / n for _ in range(REPS)) * 1e3


def count_launches(fn: Callable[[], None]) -> int:
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def hbm_floor_gbs(nbytes: int = 2 << 30) -> float:
    src = torch.empty(nbytes, device="cuda", dtype=torch.uint8)
    dst = torch.empty_like(src)
    ms = statistics.median(_elapsed_ms(lambda: dst.copy_(src)) for _ in range(REPS + 3))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def run(batches: list[int], page_sizes: list[int]) -> str:
    floor = hbm_floor_gbs()
    lines = [
        f"Device: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}; "
        f"HBM floor (device-to-device copy, read + write): {floor:.0f} GB/s",
        "",
        "| B | page | variant | launches | eager µs | graph µs | GB/s | % floor | speedup vs unfused |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for page_size in page_sizes:
        for b in batches:
            x = make_inputs(b, page_size)
            results = {}
            for name, fn in variants(x, page_size).items():
                results[name] = (count_launches(fn), time_eager_us(fn), time_graph_us(fn))
            base = results["unfused"][2] or results["unfused"][1]
            for name, (launches, eager, graph) in results.items():
                t = graph or eager
                gbs = useful_bytes(b) / (t * 1e-6) / 1e9
                graph_s = f"{graph:.2f}" if graph is not None else "n/a"
                lines.append(
                    f"| {b} | {page_size} | {name} | {launches} | {eager:.2f} | {graph_s} | {gbs:.0f} | "
                    f"{100 * gbs / floor:.0f}% | {base / t:.2f}x |"
                )
            del x
            torch.cuda.empty_cache()
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="also write the markdown table to this file")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 256, 4096, 65536])
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[256, 64])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    torch.manual_seed(0)
    table = run(args.batches, args.page_sizes)
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table)


if __name__ == "__main__":
    main()
