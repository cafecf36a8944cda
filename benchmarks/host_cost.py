"""Host time per eager call of `dspark::multi_linear_kv_write`: what the binding's argument checks and launch setup
cost the CPU on every call, at N = 5 and N = 32 layers (Qwen3-8B draft dims by default, T = 1).

    python3 benchmarks/host_cost.py                  # CUDA when there is one (bf16), else CPU
    python3 benchmarks/host_cost.py --device cpu --small

Per N: `host µs`, the wall time of `--calls` calls in a row divided by their number, taken before the synchronize
that ends them (on CUDA the calls only enqueue kernels: at a few launches per call the launch queue does not fill,
so this is the host's time per call); `device µs`, the median time of one call alone after an L2 flush, between
CUDA events (`triton.testing.do_bench`; CUDA only): cold weights and the launch included, so above the per-call GPU
time of calls back to back; `wall µs`, the loop's time per call including that synchronize (calls back to back).
On CPU the op is its fp32 reference, so host time is the whole computation there. The median of `--repeats` loops
is reported.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from _timing import median_us

import custom_ops  # noqa: F401  (registers torch.ops.dspark.*)
from dspark_fx.reference_draft import rope_cos_sin_table


def make_call(layers: int, hidden: int, kv_heads: int, head_dim: int, tokens: int, device: str, dtype: torch.dtype):
    """A zero-argument eager call of the op on `layers` layers of separate K/V weights, k_norm and RoPE."""
    kv = kv_heads * head_dim
    gen = torch.Generator().manual_seed(layers)
    make = lambda *shape: (torch.randn(*shape, generator=gen) / shape[-1] ** 0.5).to(device, dtype)
    k_weights = [make(kv, hidden) for _ in range(layers)]
    v_weights = [make(kv, hidden) for _ in range(layers)]
    norms = [(1 + torch.rand(head_dim, generator=gen)).to(device, dtype) for _ in range(layers)]
    table = rope_cos_sin_table(4096, head_dim, 1e6).to(device)
    slots = 64
    k_caches = [torch.zeros(slots, kv_heads, head_dim, device=device, dtype=dtype) for _ in range(layers)]
    v_caches = [torch.zeros(slots, kv_heads, head_dim, device=device, dtype=dtype) for _ in range(layers)]
    x = make(tokens, hidden)
    positions = torch.arange(100, 100 + tokens, device=device)
    cache_loc = torch.arange(tokens, device=device)

    def call() -> None:
        torch.ops.dspark.multi_linear_kv_write(
            x,
            k_weights=k_weights,
            k_row_starts=[0] * layers,
            k_biases=[None] * layers,
            v_weights=v_weights,
            v_row_starts=[0] * layers,
            v_biases=[None] * layers,
            k_norm_weights=norms,
            k_norm_eps=[1e-6] * layers,
            cos_sin_caches=[table] * layers,
            positions=positions,
            is_neox=True,
            k_caches=k_caches,
            v_caches=v_caches,
            cache_loc=cache_loc,
            commit_lens=None,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
        )

    return call


def host_us(call, device: str, calls: int, repeats: int) -> tuple[float, float]:
    """Median over `repeats` loops of `calls` calls: µs per call before the closing synchronize, and after it."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(10):
        call()
    sync()
    host, wall = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        enqueued = time.perf_counter()
        sync()
        done = time.perf_counter()
        host.append((enqueued - start) / calls * 1e6)
        wall.append((done - start) / calls * 1e6)
    return statistics.median(host), statistics.median(wall)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, nargs="+", default=[5, 32])
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--calls", type=int, default=100, help="calls per timed loop (default 100)")
    parser.add_argument("--repeats", type=int, default=20, help="timed loops; the median is reported (default 20)")
    parser.add_argument("--out", type=Path, help="also write the table here")
    parser.add_argument("--small", action="store_true", help="smoke run: hidden 64, 2 x 16 heads, 5 loops of 5")
    args = parser.parse_args()
    hidden, kv_heads, head_dim = 4096, 8, 128
    if args.small:
        hidden, kv_heads, head_dim, args.calls, args.repeats = 64, 2, 16, 5, 5
    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    lines = [
        f"Host time per eager call of dspark::multi_linear_kv_write: hidden {hidden}, {kv_heads} x {head_dim} K/V "
        f"heads per layer, T = {args.tokens}, {args.device}, {dtype}, torch {torch.__version__}; median of "
        f"{args.repeats} loops of {args.calls} calls",
        "",
        "| layers | host µs | device µs (one cold call) | wall µs |",
        "|---|---:|---:|---:|",
    ]
    print("\n".join(lines), flush=True)
    for layers in args.layers:
        call = make_call(layers, hidden, kv_heads, head_dim, args.tokens, args.device, dtype)
        host, wall = host_us(call, args.device, args.calls, args.repeats)
        device = f"{median_us(call, 'cuda'):.1f}" if cuda else "—"
        lines.append(f"| {layers} | {host:.1f} | {device} | {wall:.1f} |")
        print(lines[-1], flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
