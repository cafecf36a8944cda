"""dspark::multi_linear at decode sizes: the op's default dispatch, per-weight cuBLAS, cuBLAS on a concatenated copy.

Groups (bf16, no bias): the fused draft KV group 5 x [2048, 4096], q/k/v [4096 | 1024 | 1024, 4096], gate/up
2 x [12288, 4096], single [4096, 4096], [1024, 4096], [4096, 12288] (K = 12288) and [12288, 4096]; M (tokens) in
{1, 8, 16, 64, 128, 512}. Each weight is its own tensor with a gap after it, as in a model (weights that lie back to
back in memory would be merged into one row range by the op). Every variant is captured in a CUDA graph that calls
it once on each of several copies of the group's weights (enough copies for 3x the L2, so the L2 never serves the
weights) and replayed; the time per call is the median replay time (`triton.testing.do_bench`) over the number of
copies. "% copy" is (weights + x + out bytes) / time over a large device-to-device copy measured in the same run
(bytes read + written); the floor is the larger of those bytes at that rate and the GEMM's FLOPs at the bf16 GEMM
rate measured in the same run, the binding one in brackets (from 512 tokens the FLOPs bind: there "% copy" is not
headroom). Every output is checked against cuBLAS on the concatenated copy first.

Columns: op (the default dispatch; "path" names what it ran), kernel (`_multi_linear_variant` with the default tile,
M <= 64), streaming kernel (`_multi_linear_variant` with `STREAM_VARIANT`, M <= 16, sm_90), cuBLAS batched
(`_multi_linear_cublas(..., batched=True)`, the op's cuBLAS path: row ranges cut into row blocks of one height in one
`cublasGemmBatchedEx`, or ranges of one shape batched whole, and a single range of >= 4096 rows at M <= 64 as a
strided batched GEMM of row blocks), cuBLAS per weight (one `mm` per weight), cuBLAS
concat (one `mm` on a concatenated copy: a bound, not an option, since it needs a second copy of the weights), and
read (the fastest of `_read_floor`'s read kernels, loads or the copy engine, reading each copy's concatenated weight,
timed the same way: a kernel that only reads the weight bytes the op reads, in one launch per call; per group, as it
does not depend on M; its "% copy" of those bytes alone). "op vs X": X's time ÷ the op's (below 1.00x the op is
slower); "op vs fastest reader" against the faster of read and cuBLAS concat, the fastest reader of the group's
weights measured: what a group's "% copy" can reach in this harness.

    python benchmarks/multi_linear.py --out multi_linear.md           # the table (about a minute)
    python benchmarks/multi_linear.py --sweep --out sweep.md          # every kernel variant x split, M <= 64
    python benchmarks/multi_linear.py --placement --out placement.md  # where the weights lie, M >= 512

`--sweep` times every compiled kernel variant (`custom_ops.linear.multi_linear.kernel_variants()`) with every
cluster split (0 = the automatic one) on every group and M in {1, 8, 16, 32, 64} through
`dspark::_multi_linear_variant`, refuses to time a variant whose output differs from cuBLAS (prints the error
instead), and prints the best variant per shape, then the best variant per token tile summed over the groups (what
`default_variant` should pick).

`--placement` times the op on ten K/V weights of [1024, 4096] (five layers' separate k_proj/v_proj) placed three ways,
at M in {512, 1024, 2048, 4096}: each weight apart (ten row ranges), adjacent in pairs (k and v of a layer back to
back: five ranges of 2048 rows once merged) and all adjacent (views of one buffer: one range of 10240 rows). Next to
the op: one GEMM per merged range on each placement (`_multi_linear_cublas(..., batched=False)`: what the op ran above
512 tokens before it batched there, so the GEMMs followed where the allocator put the weights), one `bmm` of the ten
weights stacked (a copy; cuBLAS's strided batched GEMM) and cuBLAS concat.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from _read_floor import back_to_back_read_us
from _timing import copy_bandwidth, gemm_rate
from triton.testing import do_bench

import custom_ops  # noqa: F401  (registers torch.ops.dspark.*)
from custom_ops.linear.multi_linear import (
    STREAM_VARIANT,
    KernelVariant,
    cublas_batches,
    kernel_variants,
    multi_linear_reference,
    uses_kernel,
    uses_stream,
)

GROUPS: dict[str, list[tuple[int, int]]] = {
    "kv 5x[2048,4096]": [(2048, 4096)] * 5,
    "qkv [4096|1024|1024,4096]": [(4096, 4096), (1024, 4096), (1024, 4096)],
    "gate/up 2x[12288,4096]": [(12288, 4096)] * 2,
    "[4096,4096]": [(4096, 4096)],
    "[1024,4096]": [(1024, 4096)],
    "[4096,12288]": [(4096, 12288)],
    "[12288,4096]": [(12288, 4096)],
}
TOKENS = (1, 8, 16, 64, 128, 512)
SWEEP_TOKENS = (1, 8, 16, 32, 64)
SWEEP_SPLITS = (0, 1, 2, 4, 8)
PLACEMENT_TOKENS = (512, 1024, 2048, 4096)
PLACEMENT_SHAPE = (10, 1024, 4096)  # weights, rows each, K
PLACEMENTS = ("apart", "pairs", "adjacent")
DTYPE = torch.bfloat16
MAX_REL_ERROR = 1e-2

op = torch.ops.dspark.multi_linear
variant_op = torch.ops.dspark._multi_linear_variant
cublas_op = torch.ops.dspark._multi_linear_cublas
MAX_KERNEL_TOKENS = 64


@dataclass
class Group:
    """Copies of one group's weights (separate tensors, like a model's parameters) and their concatenations."""

    name: str
    rows: list[int]
    k: int
    copies: list[list[torch.Tensor]]
    concatenated: list[torch.Tensor]

    @classmethod
    def make(
        cls,
        name: str,
        shapes: list[tuple[int, int]],
        l2_bytes: int,
        weights: Callable[[], list[torch.Tensor]] | None = None,
    ) -> Group:
        """Enough copies of the weights of `shapes` for 3x the L2, each made by `weights` (default: every weight
        apart, `separate_weight`)."""
        k = shapes[0][1]
        weight_bytes = sum(r * k for r, _ in shapes) * DTYPE.itemsize
        n = max(2, math.ceil(3 * l2_bytes / weight_bytes))
        weights = weights or (lambda: [separate_weight(r, k) for r, _ in shapes])
        copies = [weights() for _ in range(n)]
        return cls(name, [r for r, _ in shapes], k, copies, [torch.cat(ws) for ws in copies])

    def args(self, x: torch.Tensor, i: int) -> tuple:
        n = len(self.rows)
        return x, self.copies[i], [0] * n, self.rows, [None] * n

    def bytes_moved(self, tokens: int) -> int:
        return (sum(self.rows) * self.k + tokens * self.k + tokens * sum(self.rows)) * DTYPE.itemsize


def separate_weight(rows: int, k: int) -> torch.Tensor:
    """A random [rows, k] weight followed by a 4 KiB gap, so no other weight starts where it ends."""
    storage = torch.randn(rows * k + 2048, device="cuda", dtype=DTYPE)
    return storage[: rows * k].view(rows, k)


def placed_weights(placement: str, count: int, rows: int, k: int) -> list[torch.Tensor]:
    """`count` random [rows, k] weights: each followed by a gap ("apart"), back to back in pairs with a gap after each
    pair ("pairs"), or all back to back in one buffer ("adjacent")."""
    per_buffer = {"apart": 1, "pairs": 2, "adjacent": count}[placement]
    weights = []
    for _ in range(count // per_buffer):
        weights += separate_weight(per_buffer * rows, k).split(rows)
    return weights


def us_per_call(
    call: Callable[[int], torch.Tensor], copies: int, warmup: int, rep: int, ref: torch.Tensor | None = None
) -> float:
    """Median µs per call of a CUDA graph that runs `call(i)` for every weight copy i once. With `ref` (the result
    for copy 0), one replay's result for copy 0 is checked against it first: `ValueError` if it is wrong."""
    for i in range(copies):
        call(i)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        first = call(0)
        for i in range(1, copies):
            call(i)
    if ref is not None:
        first.fill_(float("nan"))  # written by the replay or reported wrong
        graph.replay()
        torch.cuda.synchronize()
        if (err := rel_error(first, ref)) > MAX_REL_ERROR:
            raise ValueError(f"the replay computes another result (rel err {err:.2e})")
    return 1e3 * do_bench(graph.replay, warmup=warmup, rep=rep, return_mode="median") / copies


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    err = ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()
    return err if math.isfinite(err) and not torch.isnan(out).any() else math.inf


def op_call(group: Group, x: torch.Tensor) -> Callable[[int], torch.Tensor]:
    return lambda i: op(*group.args(x, i))


def per_weight_call(group: Group, x: torch.Tensor) -> Callable[[int], torch.Tensor]:
    return lambda i: multi_linear_reference(*group.args(x, i))


def concat_call(group: Group, x: torch.Tensor) -> Callable[[int], torch.Tensor]:
    return lambda i: torch.mm(x, group.concatenated[i].t())


def variant_call(group: Group, x: torch.Tensor, variant: KernelVariant, split: int) -> Callable[[int], torch.Tensor]:
    return lambda i: variant_op(*group.args(x, i), variant.index, split)


def kernel_call(group: Group, x: torch.Tensor) -> Callable[[int], torch.Tensor] | None:
    return (lambda i: variant_op(*group.args(x, i), -1, 0)) if x.shape[0] <= MAX_KERNEL_TOKENS else None


def stream_call(group: Group, x: torch.Tensor) -> Callable[[int], torch.Tensor] | None:
    """The streaming kernel forced (up to 16 tokens, on a GPU that runs the sm_90a code)."""
    if x.shape[0] > 16 or torch.cuda.get_device_capability(x.device) != (9, 0):
        return None
    return lambda i: variant_op(*group.args(x, i), STREAM_VARIANT, 0)


def batched_call(group: Group, x: torch.Tensor) -> Callable[[int], torch.Tensor]:
    return lambda i: cublas_op(*group.args(x, i), True)


def per_range_call(group: Group, x: torch.Tensor) -> Callable[[int], torch.Tensor]:
    return lambda i: cublas_op(*group.args(x, i), False)


METHODS = {
    "op": op_call,
    "kernel": kernel_call,
    "streaming kernel": stream_call,
    "cuBLAS batched": batched_call,
    "cuBLAS per weight": per_weight_call,
    "cuBLAS concat": concat_call,
}


def cublas_path(rows: list[int]) -> str:
    """What the op's cuBLAS path runs for separate weights of these row counts."""
    return "cuBLAS batched" if cublas_batches(rows) else "cuBLAS"


def main_table(groups: list[Group], bandwidth: float, rate: float) -> str:
    names = list(METHODS)
    lines = [
        "| group | M | path | floor µs | " + " | ".join(f"{n} µs (% copy)" for n in names) + " | read µs (% copy) |"
        " op vs per weight | op vs concat | op vs fastest reader |",
        "|---|---:|---|---:|" + "---:|" * (len(names) + 4),
    ]
    for group in groups:
        read = back_to_back_read_us(group.concatenated)  # per copy, each read once per replay, as the GEMMs
        for tokens in TOKENS:
            x = torch.randn(tokens, group.k, device="cuda", dtype=DTYPE)
            ref = torch.mm(x, group.concatenated[0].t())
            floor = group.bytes_moved(tokens) / bandwidth * 1e6
            flops_us = 2 * tokens * group.k * sum(group.rows) / rate * 1e6
            floor_cell = f"{max(floor, flops_us):.1f} ({'GEMM' if flops_us > floor else 'copy'})"
            times, cells = {}, []
            for name, make_call in METHODS.items():
                call = make_call(group, x)
                if call is None:
                    cells.append("-")
                    continue
                err = rel_error(call(0), ref)
                if err > MAX_REL_ERROR:
                    cells.append(f"WRONG (rel err {err:.2e})")
                    continue
                try:
                    times[name] = us_per_call(call, len(group.copies), warmup=25, rep=100, ref=ref)
                except ValueError as replayed:
                    cells.append(f"WRONG ({replayed})")
                    continue
                cells.append(f"{times[name]:.1f} ({100 * floor / times[name]:.0f}%)")
            cells.append(f"{read:.1f} ({100 * group.bytes_moved(0) / bandwidth * 1e6 / read:.0f}%)")  # weights only
            times["fastest reader"] = min(read, times.get("cuBLAS concat", read))
            ratios = [
                f"{times[base] / times['op']:.2f}x" if {"op", base} <= times.keys() else "-"
                for base in ("cuBLAS per weight", "cuBLAS concat", "fastest reader")
            ]
            if uses_stream(tokens, group.rows):
                path = "streaming kernel"
            else:
                path = "kernel" if uses_kernel(tokens, group.rows) else cublas_path(group.rows)
            row = f"| {group.name} | {tokens} | {path} | {floor_cell} | " + " | ".join(cells + ratios) + " |"
            print(row, flush=True)
            lines.append(row)
    return "\n".join(lines)


def placement_table(l2_bytes: int, bandwidth: float) -> str:
    """`--placement`: per M, the op and one GEMM per merged range on the same ten weights placed apart, in pairs and
    adjacent (`placed_weights`), one bmm of them stacked, and cuBLAS on the concatenated copy; µs per call (time ÷
    the op's time on the weights apart)."""
    count, rows, k = PLACEMENT_SHAPE
    groups = {
        p: Group.make(p, [(rows, k)] * count, l2_bytes, lambda p=p: placed_weights(p, count, rows, k))
        for p in PLACEMENTS
    }
    stacked = [torch.stack(ws) for ws in groups["apart"].copies]  # [count, rows, k]
    names = [
        *(f"{how}, weights {p.replace('pairs', 'in pairs')}" for how in ("op", "GEMM per range") for p in PLACEMENTS),
        "bmm, stacked copy",
        "cuBLAS concat",
    ]
    references = [*PLACEMENTS, *PLACEMENTS, "apart", "apart"]  # the group whose concatenated copy checks each column
    lines = [
        f"{count} weights of [{rows}, {k}]: µs per call (÷ op, weights apart)",
        "",
        "| M | floor µs | " + " | ".join(names) + " |",
        "|---:|---:|" + "---:|" * len(names),
    ]
    for tokens in PLACEMENT_TOKENS:
        x = torch.randn(tokens, k, device="cuda", dtype=DTYPE)
        apart = groups["apart"]
        floor = apart.bytes_moved(tokens) / bandwidth * 1e6
        calls = [op_call(groups[p], x) for p in PLACEMENTS] + [per_range_call(groups[p], x) for p in PLACEMENTS]
        calls += [lambda i, x=x: torch.matmul(x, stacked[i].transpose(1, 2)), concat_call(apart, x)]
        times = []
        for name, call, reference in zip(names, calls, references, strict=True):
            out = call(0)
            if out.dim() == 3:  # bmm: [count, tokens, rows] -> [tokens, count * rows]
                out = out.transpose(0, 1).reshape(tokens, count * rows)
            ref = torch.mm(x, groups[reference].concatenated[0].t())
            err = rel_error(out, ref)
            if err > MAX_REL_ERROR:
                raise AssertionError(f"--placement {name}, M = {tokens}: relative error {err:.2e}")
            times.append(us_per_call(call, len(apart.copies), warmup=25, rep=100))
        cells = [f"{t:.1f} ({t / times[0]:.2f}x)" for t in times]
        lines.append(f"| {tokens} | {floor:.1f} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


@dataclass
class SweepShape:
    """Every correct (variant, split) of one (group, M) with its µs, and the rows it adds to the full table."""

    times: dict[tuple[KernelVariant, int], float]
    rows: list[str]


def sweep_shape(group: Group, tokens: int, bandwidth: float) -> SweepShape:
    x = torch.randn(tokens, group.k, device="cuda", dtype=DTYPE)
    ref = torch.mm(x, group.concatenated[0].t())
    floor = group.bytes_moved(tokens) / bandwidth * 1e6
    shape = SweepShape({}, [])
    for v in kernel_variants():
        for split in SWEEP_SPLITS:
            call = variant_call(group, x, v, split)
            err = rel_error(call(0), ref)
            if err > MAX_REL_ERROR:
                print(f"WRONG {group.name} M={tokens} {v} split {split}: rel err {err:.3e}", flush=True)
                shape.rows.append(f"| {group.name} | {tokens} | {v} | {split} | WRONG (rel err {err:.2e}) | |")
                continue
            us = us_per_call(call, len(group.copies), warmup=5, rep=25)
            shape.times[(v, split)] = us
            shape.rows.append(f"| {group.name} | {tokens} | {v} | {split} | {us:.2f} | {100 * floor / us:.0f}% |")
    return shape


def sweep(groups: list[Group], bandwidth: float) -> str:
    all_rows = ["| group | M | variant | split | µs | % copy |", "|---|---:|---|---:|---:|---:|"]
    best_rows = [
        "| group | M | best variant | split | µs | % copy | op default µs | cuBLAS concat µs |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    per_tile: dict[tuple[int, KernelVariant, int], float] = {}
    for group in groups:
        for tokens in SWEEP_TOKENS:
            shape = sweep_shape(group, tokens, bandwidth)
            all_rows += shape.rows
            x = torch.randn(tokens, group.k, device="cuda", dtype=DTYPE)
            default_us = us_per_call(op_call(group, x), len(group.copies), warmup=5, rep=25)
            concat_us = us_per_call(concat_call(group, x), len(group.copies), warmup=5, rep=25)
            floor = group.bytes_moved(tokens) / bandwidth * 1e6
            if shape.times:
                (v, split), us = min(shape.times.items(), key=lambda item: item[1])
                best = f"{v} | {split} | {us:.2f} | {100 * floor / us:.0f}%"
            else:
                best = "none correct | | |"
            row = f"| {group.name} | {tokens} | {best} | {default_us:.2f} | {concat_us:.2f} |"
            print(row, flush=True)
            best_rows.append(row)
            for (v, split), us in shape.times.items():
                key = (8 * ((tokens + 7) // 8), v, split)
                per_tile[key] = per_tile.get(key, 0.0) + us
    tile_rows = ["| M (rounded up to 8) | best variant over all groups | split | Σ µs |", "|---:|---|---:|---:|"]
    for tile in sorted({t for t, _, _ in per_tile}):
        candidates = {(v, s): us for (t, v, s), us in per_tile.items() if t == tile}
        (v, split), total = min(candidates.items(), key=lambda item: item[1])
        tile_rows.append(f"| {tile} | {v} | {split} | {total:.1f} |")
    return "\n\n".join(["\n".join(best_rows), "\n".join(tile_rows), "All variants:\n\n" + "\n".join(all_rows)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the markdown tables here")
    parser.add_argument("--sweep", action="store_true", help="time every kernel variant and split (M <= 64)")
    parser.add_argument("--placement", action="store_true", help="the op on weights placed apart or adjacent")
    args = parser.parse_args()
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    bandwidth = copy_bandwidth("cuda")
    groups = [] if args.placement else [Group.make(name, s, props.L2_cache_size) for name, s in GROUPS.items()]
    header = (
        f"GPU {props.name}, torch {torch.__version__}; copy rate {bandwidth / 1e12:.2f} TB/s (read + write); "
        f"bf16; CUDA-graph replay over L2-cold weight copies"
    )
    print(header, flush=True)
    with torch.no_grad():
        if args.placement:
            body = placement_table(props.L2_cache_size, bandwidth)
        else:
            body = sweep(groups, bandwidth) if args.sweep else main_table(groups, bandwidth, gemm_rate("cuda", DTYPE))
    text = header + "\n\n" + body + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
