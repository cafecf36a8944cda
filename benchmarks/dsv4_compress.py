"""Benchmark of the DeepSeek-V4 compression kernels (c4, c128, online c128) on one GPU.

Decode: batch sizes 1, 64, 128, 256, every request at a window boundary (each row compresses: the worst case, as
in the published numbers). Prefill: one request of 512, 4096 and 16384 new tokens from an empty state. Each op
call is timed inside a CUDA graph (warm-up, 20 calls per graph, median of 30 replays, CUDA events); decode calls
cycle through enough state buffers to read ~3x the L2 size per graph (a step runs once per layer, so its state is
not L2-resident in a model; `--l2 hot` times one buffer back to back instead). Next to it:
- the HBM floor: the bytes the call must move (model below) at `--hbm-tbps` (H200: 4.8 TB/s; the header also
  gives the read bandwidth a plain reduction achieves in the same run), and
- a plain-torch baseline of the same math in the same run (decode: gather the pages + softmax pooling;
  prefill: `compress_sequence`, the stateless whole-sequence version), reported as a speed-up ratio.
The planner (`dsv4_plan_*`, built once per batch and shared by all layers of a ratio) is timed separately.

Byte model per compressed row (ib / sb: input / state bytes per element, D = head dim): c4 decode
`4D*ib + 4D*sb + 16D*sb + 4D` (input, state write, 8 half-row slots, output); c128 decode
`2D*ib + 2D*sb + 256D*sb + 4D`; online decode `2D*ib + 12D + 4D`; prefill `N*(4D|2D)*ib` input plus the outputs.

    python benchmarks/dsv4_compress.py --out bench.md [--l2 hot]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

import custom_ops  # noqa: F401
from custom_ops import _build
from custom_ops.dsv4.compress import compress_decode, compress_prefill
from custom_ops.dsv4.compressor import compress_sequence
from custom_ops.dsv4.online import online_compress_decode, online_compress_prefill
from custom_ops.dsv4.plan import plan_decode, plan_online_decode, plan_online_prefill, plan_prefill

DECODE_BS = (1, 64, 128, 256)
PREFILL_TOKENS = (512, 4096, 16384)
CALLS_PER_GRAPH = 20


def time_us(fn: Callable[[], object] | list[Callable[[], object]], replays: int = 30) -> float:
    """Median µs of one call, measured over CUDA-graph replays of CALLS_PER_GRAPH calls that cycle through `fn`
    (a list: calls on different buffers, so that back-to-back calls do not find each other's data in L2)."""
    fns = fn if isinstance(fn, list) else [fn]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns * 2:
            f()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS_PER_GRAPH):
            fns[i % len(fns)]()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / CALLS_PER_GRAPH)
    return statistics.median(times)


def l2_copies(nbytes: int, cold_l2: bool) -> int:
    """Buffers to cycle through so that CALLS_PER_GRAPH consecutive calls read about 3x the L2 size (cold_l2), or
    one buffer that back-to-back calls find in L2."""
    if not cold_l2:
        return 1
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    return max(1, min(CALLS_PER_GRAPH, -(-3 * l2 // nbytes)))


def measured_read_tbps() -> float:
    """Read bandwidth of a plain reduction over 1 GiB of fp32 (an achievable floor next to the nominal one)."""
    buf = torch.rand(2**28, device="cuda")
    out = torch.empty((), device="cuda")
    us = time_us(lambda: torch.sum(buf, 0, out=out))
    return buf.numel() * 4 / (us * 1e-6) / 1e12


def state_bytes_per_request(kind: str, d: int, sb: int) -> int:
    if kind == "online":
        return 3 * d * 4
    return 8 * 4 * d * sb if kind == "c4" else 128 * 2 * d * sb


def torch_decode_baseline(state: torch.Tensor, ape: torch.Tensor, plan: torch.Tensor, ratio: int, d: int):
    """Plain torch: gather the window pages of every request and pool (no state write)."""
    p = plan.view(torch.int32).long()
    if ratio == 128:
        rows = state.view(-1, 128, 2 * d)[p[:, 3]].float()
        return (torch.softmax(rows[..., d:] + ape, 1) * rows[..., :d]).sum(1)
    pages = state.view(-1, 4, 4 * d)
    prev, cur = pages[p[:, 2]].float(), pages[p[:, 3]].float()
    kv = torch.cat([prev[..., :d], cur[..., d : 2 * d]], 1)
    sc = torch.cat([prev[..., 2 * d : 3 * d], cur[..., 3 * d :]], 1) + ape
    return (torch.softmax(sc, 1) * kv).sum(1)


def bench_decode(kind: str, bs: int, d: int, state_dtype: torch.dtype, hbm: float, cold_l2: bool) -> dict:
    """Every row closes a window. With `cold_l2` calls cycle through state/input buffers: a decode step runs once
    per layer, so the state it reads is not in L2 (timing one buffer back to back reads c4's 13 MB from L2)."""
    ratio = 4 if kind == "c4" else 128
    width = (4 if ratio == 4 else 2) * d
    sb = torch.finfo(state_dtype).bits // 8
    dev = "cuda"
    ape = torch.randn(8 if ratio == 4 else 128, d, device=dev)
    rid = torch.randperm(bs, device=dev)
    seq = torch.full((bs,), 8 * ratio, device=dev)  # every row closes a window
    if kind == "online":
        copies = l2_copies(bs * 3 * d * 4, cold_l2)
        kvs = [torch.randn(bs, width, device=dev) for _ in range(copies)]
        states = []
        for _ in range(copies):
            state = torch.randn(bs, 3 * d, device=dev)
            state[:, d : 2 * d] = state[:, d : 2 * d].abs() + 1
            states.append(state)
        plan = plan_online_decode(seq, rid)
        ops = [lambda s=s, kv=kv: online_compress_decode(s, kv, ape, plan) for s, kv in zip(states, kvs, strict=True)]
        plan_us = time_us(lambda: plan_online_decode(seq, rid))
        row_bytes = 2 * d * 4 + 12 * d + 4 * d
        base_us = None
    else:
        ring = 8 if ratio == 4 else 128
        copies = l2_copies(bs * ring * width * sb, cold_l2)
        kvs = [torch.randn(bs, width, device=dev) for _ in range(copies)]
        states = [torch.randn(bs * ring, width, device=dev).to(state_dtype) for _ in range(copies)]
        plan = plan_decode(seq, rid, None, None, ratio, ring)
        ops = [lambda s=s, kv=kv: compress_decode(s, kv, ape, plan, ratio) for s, kv in zip(states, kvs, strict=True)]
        plan_us = time_us(lambda: plan_decode(seq, rid, None, None, ratio, ring))
        slots = 16 * d if ratio == 4 else 256 * d
        row_bytes = width * 4 + width * sb + slots * sb + 4 * d
        base_us = time_us([lambda s=s: torch_decode_baseline(s, ape, plan, ratio, d) for s in states])
    us = time_us(ops)
    return _row(kind, "decode", f"bs={bs}", state_dtype, us, bs * row_bytes, base_us, plan_us, d, sb, hbm)


def bench_prefill(kind: str, n: int, d: int, state_dtype: torch.dtype, hbm: float) -> dict:
    ratio = 4 if kind == "c4" else 128
    width = (4 if ratio == 4 else 2) * d
    sb = torch.finfo(state_dtype).bits // 8
    dev = "cuda"
    ape = torch.randn(8 if ratio == 4 else 128, d, device=dev)
    kv = torch.randn(n, width, device=dev)
    seq = torch.tensor([n], device=dev)
    rid = torch.tensor([0], device=dev)
    if kind == "online":
        state = torch.zeros(1, 3 * d, device=dev)
        plan_c, plan_w = plan_online_prefill(seq, seq, rid, n)
        op = lambda: online_compress_prefill(state, kv, ape, plan_c, plan_w)
        plan_us = time_us(lambda: plan_online_prefill(seq, seq, rid, n))
    else:
        ring = 8 if ratio == 4 else 128
        state = torch.zeros(ring, width, device=dev, dtype=state_dtype)
        plan_c, plan_w = plan_prefill(seq, seq, rid, None, None, ratio, ring, 0, n)
        op = lambda: compress_prefill(state, kv, ape, plan_c, plan_w, ratio)
        plan_us = time_us(lambda: plan_prefill(seq, seq, rid, None, None, ratio, ring, 0, n))
    base_us = time_us(lambda: compress_sequence(kv, ape, ratio))
    us = time_us(op)
    nbytes = n * width * 4 + plan_c.shape[0] * d * 4
    return _row(kind, "prefill", f"N={n}", state_dtype, us, nbytes, base_us, plan_us, d, sb, hbm)


def _row(kind, mode, size, state_dtype, us, nbytes, base_us, plan_us, d, sb, hbm) -> dict:
    return {
        "op": kind,
        "mode": mode,
        "size": size,
        "state": str(state_dtype).removeprefix("torch."),
        "us": us,
        "GB/s": nbytes / (us * 1e-6) / 1e9,
        "floor_us": nbytes / hbm * 1e6,
        "x_floor": us / (nbytes / hbm * 1e6),
        "torch_us": base_us,
        "speedup": base_us / us if base_us else None,
        "plan_us": plan_us,
        "state_B/req": state_bytes_per_request(kind, d, sb),
    }


def to_markdown(rows: list[dict]) -> str:
    keys = list(rows[0])
    fmt = lambda v: "-" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write the markdown table to this path")
    parser.add_argument("--head-dim", type=int, default=512, choices=[128, 512])
    parser.add_argument("--hbm-tbps", type=float, default=4.8, help="HBM bandwidth for the floor (H200: 4.8)")
    parser.add_argument(
        "--l2", choices=["cold", "hot"], default="cold", help="decode: cycle buffers past the L2 (cold) or not (hot)"
    )
    args = parser.parse_args()
    _build.load()  # CUDA kernels for every op, planners included, before anything is timed
    torch.manual_seed(0)
    d = args.head_dim
    hbm = args.hbm_tbps * 1e12
    rows = []
    for kind in ("c4", "c128", "online"):
        dtypes = (torch.float32,) if kind == "online" else (torch.float32, torch.bfloat16)
        for dt in dtypes:
            rows += [bench_decode(kind, bs, d, dt, hbm, args.l2 == "cold") for bs in DECODE_BS]
            rows += [bench_prefill(kind, n, d, dt, hbm) for n in PREFILL_TOKENS]
    table = to_markdown(rows)
    header = (
        f"DSV4 compression on {torch.cuda.get_device_name()} (torch {torch.__version__}), head_dim {d}; "
        f"µs per call in a CUDA graph, decode L2 {args.l2}; floor at {args.hbm_tbps} TB/s (measured read bandwidth "
        f"of a plain reduction: {measured_read_tbps():.2f} TB/s); published B200 decode bs=256: c4 2.27 µs, "
        "c128 23.8 µs (fp32).\n\n"
    )
    print(header + table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(header + table)


if __name__ == "__main__":
    main()
