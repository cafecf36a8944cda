"""The README demo: a random-weight DSpark draft context-KV writer compiled with `dspark_backend`.

Prints the explain report and the graph diff, checks parity with eager, and times eager vs compiled.
Runs on CPU (small dims by default) or CUDA (`--device cuda`, Qwen3-8B draft dims with `--full`).
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

import dspark_fx
from dspark_fx.reference_draft import DraftKVConfig, DraftKVWriter
from dspark_fx.testing import CaptureBackend, assert_close_for_dtype


def _time(fn, args, device: str, iters: int = 20) -> float:
    for _ in range(3):
        fn(*args)
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn(*args)
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--full", action="store_true", help="Qwen3-8B draft dims (hidden 4096, 32/8 heads)")
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    small = dict(hidden=1024, num_heads=16, num_kv_heads=4, num_slots=1024)
    cfg = DraftKVConfig(
        dtype=torch.bfloat16 if args.device == "cuda" else torch.float32, **({} if args.full else small)
    )
    eager = DraftKVWriter(cfg, args.device)
    model = copy.deepcopy(eager)
    ctx = torch.randn(args.tokens, cfg.hidden, device=args.device, dtype=cfg.dtype)
    positions = torch.randint(0, cfg.max_position, (args.tokens,), device=args.device)
    cache_loc = torch.randperm(cfg.num_slots, device=args.device)[: args.tokens]
    inputs = (ctx, positions, cache_loc)

    print(dspark_fx.explain(eager, *inputs))
    capture = CaptureBackend(inner="inductor")
    compiled = torch.compile(model, backend=capture)
    with torch.no_grad():
        eager(*inputs)
        compiled(*inputs)
        print("\n--- graph diff (post-grad ATen graph, before/after dspark_fx) ---")
        print(capture.graph_diff())
        for (k_e, v_e), (k_c, v_c) in zip(eager.caches(), model.caches(), strict=True):
            assert_close_for_dtype((k_c, v_c), (k_e, v_e), cfg.dtype)
        print(f"parity with eager: OK ({cfg.dtype}, {cfg.num_layers} layers, T={args.tokens})")
        eager_us = _time(eager, inputs, args.device)
        compiled_us = _time(compiled, inputs, args.device)
    print(f"eager {eager_us:.0f} µs/call, dspark_backend {compiled_us:.0f} µs/call ({eager_us / compiled_us:.2f}x)")


if __name__ == "__main__":
    main()
