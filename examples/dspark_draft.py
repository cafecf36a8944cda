"""The README demo: a random-weight DSpark draft context-KV writer compiled with `dspark_backend`.

Prints what the pass does to the draft (the `explain()` report and the pass counters of the real compile), checks
the compiled draft's caches against eager, and times eager against `torch.compile(model, backend=dspark_backend)`
(`--baseline`: also plain `torch.compile`, Inductor without dspark_fx). `--diff` prints the post-grad graph diff
(long: every rewritten node). Runs on CPU (small dims by default) or CUDA (`--device cuda`, Qwen3-8B draft dims
with `--full`).
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


def _pass_summary() -> str:
    """What the pass did in the compile above, from `counters["dspark_fx"]`."""
    counts = torch._dynamo.utils.counters["dspark_fx"]
    if counts["pass_runs"]:
        return (
            f"dspark_backend compile: {counts['groups_fused']} fused group(s) of {counts['branches_fused']} GEMMs, "
            f"{counts['branches_batched']} branches with batched norm/RoPE, {counts['rejected']} GEMM(s) left alone"
        )
    if counts["graphs_from_cache"]:
        return "dspark_backend compile: served from Inductor's cache (this pass compiled it in an earlier run)"
    return "dspark_backend compile: the pass did not run"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--full", action="store_true", help="Qwen3-8B draft dims (hidden 4096, 32/8 heads)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--diff", action="store_true", help="also print the post-grad graph diff (long)")
    parser.add_argument("--baseline", action="store_true", help="also time plain torch.compile (no dspark_fx)")
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

    # On CPU the pass fuses only when asked (there its op is its reference, slower than Inductor's GEMMs): the demo
    # asks, to show the rewrite.
    config = {"fuse_on_cpu": True} if args.device == "cpu" else None
    with torch.no_grad():  # as the draft runs below
        print(dspark_fx.explain(eager, *inputs, config=config))
    torch._dynamo.utils.counters["dspark_fx"].clear()
    compiled = torch.compile(model, backend=dspark_fx.make_backend(config))
    with torch.no_grad():
        eager(*inputs)
        compiled(*inputs)
        print(_pass_summary())
        for (k_e, v_e), (k_c, v_c) in zip(eager.caches(), model.caches(), strict=True):
            assert_close_for_dtype((k_c, v_c), (k_e, v_e), cfg.dtype)
        print(f"parity with eager: OK ({cfg.dtype}, {cfg.num_layers} layers, T={args.tokens})")
        if args.diff:
            capture = CaptureBackend(config, inner="inductor")
            torch.compile(copy.deepcopy(eager), backend=capture)(*inputs)
            print("\n--- graph diff (post-grad ATen graph, before/after dspark_fx) ---")
            print(capture.graph_diff())
        timings = {"eager": _time(eager, inputs, args.device)}
        label = "torch.compile(backend=dspark_backend" + (", fuse_on_cpu)" if config else ")")
        timings[label] = _time(compiled, inputs, args.device)
        if args.baseline:
            plain = torch.compile(copy.deepcopy(eager))
            timings["torch.compile (Inductor, no dspark_fx)"] = _time(plain, inputs, args.device)
    print(f"timings on {args.device}, T={args.tokens}:")
    for name, us in timings.items():
        print(f"  {name:52s} {us:8.0f} µs/call  ({timings['eager'] / us:.2f}x eager)")


if __name__ == "__main__":
    main()
