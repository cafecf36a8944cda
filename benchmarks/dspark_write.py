"""Draft context-KV write: eager, stacked, torch.compile (plain, hand-stacked), dspark_backend (+ RO) vs the floor.

    python benchmarks/dspark_write.py --out BENCH.md            # GPU: the three configs below, bf16, T 1..4096
    python benchmarks/dspark_write.py --small                   # GPU check: tiny dims, bf16, T in {1, 8}
    python benchmarks/dspark_write.py --device cpu --small      # CPU check: tiny dims, fp32, T in {1, 8}
    (--configs qwen3-8b hd64 and --tokens 8 64 pick a subset)
    python benchmarks/dspark_write.py --spellings reference sglang hf complex gptj_stack   # the same, per spelling,
    all spellings timed together, with a table of the spellings side by side
    python benchmarks/dspark_write.py --breakdown --configs qwen3-8b --tokens 8 64   # GPU: where the time goes
    (--breakdown dspark never: only those variants; with --spellings: per spelling)
    python benchmarks/dspark_write.py --tp 2 --configs qwen3-8b --variants compile hand dspark   # 2 GPUs: per rank
    python benchmarks/dspark_write.py --sync-each --rounds 10   # GPU: a CUDA error names the column that raised it

Configs: 5 layers, bf16, every layer's K/V written to its own caches at `cache_loc` (8192 slots; random distinct
slots, random positions), `DraftKVWriter` of `dspark_fx/reference_draft.py`:
  qwen3-8b   Qwen3-8B draft: hidden 4096, 32/8 heads x head_dim 128
  qwen3-4b   Qwen3-4B draft: hidden 2560, 32/8 heads x head_dim 128
  hd64       head_dim 64:    hidden 7168, 64/16 heads x head_dim 64
T in {1, 8, 64, 512, 4096}.

Spellings (`--spellings`, default `reference` only): the same draft written the ways models are written, from
`benchmarks/_spellings.py` (reference = `DraftKVWriter` as above; sglang, hf, hf_static, llama, complex, gptj_stack: see
that module);
one table per config and spelling, all columns measured on that spelling's module, every spelling's cells of a row
timed in one interleave; with the reference among several, a first table per config gives, per T and spelling,
dspark_backend ÷ the reference spelling's dspark_backend and dspark_backend (lowered, never lowered) ÷ torch.compile.

One table per config, one row per T. A time cell is µs per call and, in brackets, time ÷ the torch.compile cell
of the same row (below 1.00x: faster than torch.compile). Columns:
  floor µs           max(K/V weight bytes / copy bandwidth, GEMM FLOPs / GEMM rate), both measured in the same run
                     (which one binds in brackets); reading ctx and writing the caches are not counted
  one-launch read µs CUDA: the fastest reader of the K/V weight bytes, timed as the other cells (graph replay after
                     an L2 flush): a few shapes of one Triton kernel that only loads them and of the copy engine
                     (1-D bulk copies; sm_90) reading them (one buffer of that size), and cuBLAS multiplying 1, 8 or
                     16 tokens by them as one concatenated weight; what one launch that reads the weights measures
                     here (the reader is named below the table)
  one GEMM µs        CUDA: cuBLAS multiplying the row's T tokens by one concatenated copy of the K/V weights, alone
                     in a graph, timed as the other cells: the hand-stacked compile's GEMM without its norm, RoPE and
                     writes, so a write that must beat a ratio of the hand-stacked time below it must be faster
                     than the best library GEMM of the same matrices alone
  eager per-layer    `DraftKVWriter` as is: per layer one GEMM on its qkv weight's K/V rows, k_norm, RoPE, 2 writes
  stacked eager      sglang-style: the layers' K/V rows concatenated once (a weight copy), one GEMM, one batched
                     k_norm, one RoPE, per-layer writes
  torch.compile      torch.compile(model)
  hand-stacked torch.compile
                     the stacked eager module under plain torch.compile: what a user writes by hand for this path
  torch.compile RO   torch.compile(model, mode="reduce-overhead")
  dspark_backend     torch.compile(model, backend=dspark_fx.dspark_backend)
  dspark_backend, colocated weights
                     the same with DsparkConfig(colocate_weights=True): the layers' K/V weights moved into one
                     allocation when it compiles (each parameter a view of it), so the op's GEMM is one GEMM; below
                     the table, how many groups it moved and left (a spelling that slices its K/V rows out of a
                     fused qkv weight has nothing to move: its column is then the spread of two compiles)
  dspark_backend, never lowered
                     the same with DsparkConfig(kv_write_op="never"): the fused GEMM path a model gets where its K/V
                     writes do not lower (the fallback)
  dspark_backend RO  torch.compile(model, backend=dspark_fx.dspark_backend, mode="reduce-overhead"): torch.compile
                     passes `mode` on to a custom backend, and dspark_backend applies Inductor's options of that mode
                     (triton.cudagraphs=True), so Inductor wraps its output in CUDA graph trees as for plain RO
  dspark ÷ floor     the dspark_backend and dspark_backend RO times ÷ the floor
  dspark ÷ hand      the dspark_backend time ÷ the hand-stacked torch.compile time
  colocated ÷ hand   the same for dspark_backend with colocated weights
  dspark ÷ read      the dspark_backend time ÷ the one-launch read, in rows whose floor is the copy
  dspark path        the op the dspark passes lowered the layers' K/V to: multi_linear_kv_write (GEMM, k_norm, RoPE
                     and cache writes in one op) or multi_linear (one GEMM; norm, RoPE and writes left to Inductor),
                     read from a no-codegen (aot_eager) compile of the same model with the same passes and shapes;
                     below the table, the reason the passes gave for K/V writes they kept off multi_linear_kv_write

`--breakdown` (CUDA): per spelling, for torch.compile, hand-stacked torch.compile, dspark_backend and its never-lowered
fallback, the CUDA-graph replay time per T (as in the table), the kernels of that graph with their durations when it
is replayed after an L2 flush (as do_bench runs it; torch profiler), and the replay times of a graph of one trivial
kernel and of the one-launch read in the same harness: replay = kernels + that harness cost (the table's header gives
it too).

`--shard N`: one rank's shard of N-way tensor parallelism timed in this process (on one GPU): the tables of the
config with `num_heads / N` and `num_kv_heads / N` heads, labelled so (what each rank of `--tp N` times).

`--tp N` (tensor parallel): N ranks, one process per GPU (CPU: N processes), each timing its shard of the write:
with column-parallel K/V projections a rank holds `num_kv_heads / N` K/V heads of every layer (and their caches), so
its write is the config's write with `num_heads / N` and `num_kv_heads / N` heads; the context K/V write has no
collective. The ranks run every row at the same time (a barrier before each row; gloo carries only that and the
results). The report: rank 0's tables, then per config a table of each variant's time on every rank and their
maximum (a step waits for its slowest rank), dspark_backend's maximum ÷ those of torch.compile and of hand-stacked.

Timing: CUDA events around each call, after an L2 flush (as `triton.testing.do_bench` times), interleaved: per row
(one T), every cell of the config (every variant of every spelling) is prepared, then `--rounds` rounds (default
100; CPU 10) each time every cell once, in an order shuffled per round; a cell is its median. Slow drifts of
clocks and temperature so move every cell alike, and the spellings' tables are timed together. A control cell times
a second copy of the first spelling's model under plain torch.compile, compiled on its own: its ratio to the first
(column `control`) is what two compiles of the same code read in that row, weights, caches and graphs placed
elsewhere in memory. Eager per-layer, stacked eager, both torch.compile columns and dspark_backend are captured
per T in a manual `torch.cuda.CUDAGraph` and timed by replay (how engines run this path). The RO callables replay
their own CUDA graph trees, which cannot be captured inside another graph: they are timed as called after warm-up
calls, between CUDA events, so their times include the GPU work of copying ctx/positions/cache_loc into the graphs'
static inputs, and Dynamo's guards only where the host's work outlasts the GPU's queue (the calls are not
synchronized one by one);
one more call per T checks that it replays a CUDA graph (cells marked † where not).
Each compiled variant is compiled once per config with T marked dynamic, then called once at every T from the largest
down: each graph (one for T = 1, one for T > 1, and for dspark_backend on CUDA one above `max_fused_rows` rows) is
compiled, and its Inductor kernels tuned, at the largest T it serves, so two variants' graphs that hold the same ops
are compiled and tuned alike. Before timing, every variant's cache writes at T = 8, run as timed (graph replay, RO
call), are checked against eager per-layer (max |error| / max |eager| <= 2e-2 in bf16, 1e-5 in fp32); a variant that
disagrees is printed and its cells are marked ✗. `--device cpu` times wall clock without CUDA graphs and skips the
RO variants. `--variants compile dspark never` times only those columns (torch.compile always).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import functools
import gc
import os
import platform
import shlex
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import torch
from _spellings import SPELLINGS, SpellingModel, build_spelling
from _timing import copy_bandwidth, gemm_rate, graphed, interleaved_median_us, median_us

import dspark_fx
from dspark_fx.reference_draft import DraftKVConfig, apply_rope
from dspark_fx.report import FusionReport
from dspark_fx.testing import TOLERANCES, compile_counts, op_counts

_DIMS = dict(num_layers=5, num_slots=8192)
CONFIGS = {
    "qwen3-8b": ("Qwen3-8B draft", DraftKVConfig(hidden=4096, num_heads=32, num_kv_heads=8, head_dim=128, **_DIMS)),
    "qwen3-4b": ("Qwen3-4B draft", DraftKVConfig(hidden=2560, num_heads=32, num_kv_heads=8, head_dim=128, **_DIMS)),
    "hd64": ("head_dim 64", DraftKVConfig(hidden=7168, num_heads=64, num_kv_heads=16, head_dim=64, **_DIMS)),
}
_SMALL_DIMS = dict(num_layers=2, hidden=64, num_slots=64, max_position=64)
SMALL_CONFIGS = {
    "small-hd16": ("small, head_dim 16", DraftKVConfig(num_heads=4, num_kv_heads=2, head_dim=16, **_SMALL_DIMS)),
    "small-hd32": ("small, head_dim 32", DraftKVConfig(num_heads=2, num_kv_heads=1, head_dim=32, **_SMALL_DIMS)),
}
TOKENS = (1, 8, 64, 512, 4096)
SMALL_TOKENS = (1, 8)
PARITY_TOKENS = 8
RO_WARMUP_CALLS = 5  # warm-up, record, then replays: per T, since every new T records its own graph
BENCH = dict(warmup=10, rep=50)  # do_bench budgets in ms, per cell


class HandStacked(torch.nn.Module):
    """What a user writes by hand (sglang's stacked path): the layers' K/V weight rows concatenated once (a copy made
    here), one GEMM, one k_norm over `[T, layers * heads, head_dim]` with the layers' norm weights stacked (none where
    the layers have none), one RoPE, per-layer cache writes. Needs one eps and one RoPE table for all layers, and a
    bias and a k_norm on all layers or none."""

    def __init__(self, model: SpellingModel) -> None:
        super().__init__()
        cfg, params, tables = model.cfg, model.kv_params(), model.rope_tables()
        if len({p.eps for p in params}) != 1 or any(
            t is not tables[0] and not torch.equal(t, tables[0]) for t in tables
        ):
            raise ValueError("HandStacked: the layers must share eps and RoPE table")
        kv = cfg.kv_size
        rows = [
            (w[start : start + kv], None if b is None else b[start : start + kv])
            for p in params
            for w, start, b in p[:2]
        ]
        if len({b is None for _, b in rows}) != 1:
            raise ValueError("HandStacked: a bias on every layer or on none")
        self.model = model
        self.w_all = torch.cat([w for w, _ in rows]).detach().clone()
        self.b_all = None if rows[0][1] is None else torch.cat([b for _, b in rows]).detach().clone()
        if len({p.norm_weight is None for p in params}) != 1:
            raise ValueError("HandStacked: a k_norm on every layer or on none")
        norms = [p.norm_weight for p in params]
        self.norm_w = None if norms[0] is None else torch.stack([w.float() for w in norms]).detach()
        self.eps, self.table, self.style = params[0].eps, tables[0], model.cfg.rope_style

    def forward(self, ctx, positions, cache_loc):
        cfg = self.model.cfg
        n = cfg.num_layers
        kv = torch.nn.functional.linear(ctx, self.w_all, self.b_all).view(-1, n, 2, cfg.num_kv_heads, cfg.head_dim)
        k = kv[:, :, 0]
        if self.norm_w is not None:
            k = k.float()
            k = (k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_w[None, :, None]).to(ctx.dtype)
        k = apply_rope(k.flatten(1, 2), self.table[positions], self.style)
        k = k.view(-1, n, cfg.num_kv_heads, cfg.head_dim)
        for i, (k_cache, v_cache) in enumerate(self.model.caches()):
            k_cache[cache_loc] = k[:, i]
            v_cache[cache_loc] = kv[:, i, 1]


@dataclass(frozen=True)
class Variant:
    key: str  # its name for `--variants`
    name: str
    build: Callable[[SpellingModel], Callable]  # the callable under test, from the model copy it writes with
    reduce_overhead: bool = False  # runs its own CUDA graph trees: timed as called, CUDA only


VARIANTS = (
    Variant("eager", "eager per-layer", lambda model: model),
    Variant("stacked", "stacked eager", HandStacked),
    Variant("compile", "torch.compile", torch.compile),
    Variant("hand", "hand-stacked torch.compile", lambda model: torch.compile(HandStacked(model))),
    Variant(
        "compile_ro",
        "torch.compile RO",
        functools.partial(torch.compile, mode="reduce-overhead"),
        reduce_overhead=True,
    ),
    Variant("dspark", "dspark_backend", functools.partial(torch.compile, backend=dspark_fx.dspark_backend)),
    Variant(
        "colocated",
        "dspark_backend, colocated weights",
        functools.partial(torch.compile, backend=dspark_fx.make_backend({"colocate_weights": True})),
    ),
    Variant(
        "never",
        "dspark_backend, never lowered",
        functools.partial(torch.compile, backend=dspark_fx.make_backend({"kv_write_op": "never"})),
    ),
    Variant(
        "dspark_ro",
        "dspark_backend RO",
        functools.partial(torch.compile, backend=dspark_fx.dspark_backend, mode="reduce-overhead"),
        reduce_overhead=True,
    ),
)
BASELINE = "torch.compile"
CONTROL = Variant("control", "torch.compile, second copy", torch.compile)
FLOOR_RATIOS = ("dspark_backend", "dspark_backend RO")
READ_RATIO = "dspark_backend"
HAND_RATIO = ("dspark_backend", "hand-stacked torch.compile")
COLOCATED_RATIO = ("dspark_backend, colocated weights", "hand-stacked torch.compile")


@dataclass
class Entry:
    """One variant in one config: its model copy (whose caches it writes), its callable and what went wrong."""

    variant: Variant
    model: SpellingModel
    fn: Callable
    graphs: int = 0  # Dynamo graphs compiled
    parity: str = "not checked"  # at PARITY_TOKENS, run as timed (`check_parity`)
    calls_parity: str = ""  # the worst T of the first calls (`first_calls`)
    wrong: bool = False  # failed a parity check
    no_cuda_graph: bool = False  # an RO call ran without launching a CUDA graph
    error: str | None = None
    weight_groups: tuple[int, int] = (0, 0)  # colocate_weights in its first calls: groups moved, groups left


@dataclass
class Row:
    tokens: int
    floor_us: float
    floor_bound: str
    path: str
    times: dict[str, float | str] = field(default_factory=dict)  # µs, or why there is no time
    control: float = float("nan")  # a second torch.compile copy ÷ the first, timed in the same interleave
    gemm_us: float | None = None  # cuBLAS: the row's T tokens x one concatenated copy of the K/V weights (CUDA only)


@dataclass
class ConfigRun:
    label: str
    spelling: str
    cfg: DraftKVConfig
    rows: list[Row]
    entries: list[Entry]
    read_us: float | None  # the one-launch read of the K/V weight bytes (CUDA only)
    kept: list[str]  # why the dspark passes kept K/V writes off multi_linear_kv_write
    paths: dict[int, str]  # per T, the op the dspark passes lowered the K/V group to
    rounds: int  # interleaved timing rounds per row (--rounds)
    reader: str = ""  # the reader that measured read_us (CUDA only)


def make_entry(variant: Variant, base: SpellingModel) -> Entry:
    """`variant` built on a copy of `base` (the copy whose caches it writes)."""
    model = copy.deepcopy(base)
    return Entry(variant, model, variant.build(model))


def make_inputs(cfg: DraftKVConfig, tokens: int, device: str) -> tuple[torch.Tensor, ...]:
    """`(ctx [T, hidden], positions [T] int64, cache_loc [T] int64 distinct)`, T marked dynamic for Dynamo."""
    gen = torch.Generator().manual_seed(tokens)
    ctx = torch.randn(tokens, cfg.hidden, generator=gen).to(cfg.dtype)
    positions = torch.randint(0, cfg.max_position, (tokens,), generator=gen)
    cache_loc = torch.randperm(cfg.num_slots, generator=gen)[:tokens]
    inputs = tuple(t.to(device) for t in (ctx, positions, cache_loc))
    for t in inputs:
        torch._dynamo.maybe_mark_dynamic(t, 0)
    return inputs


def kv_weight_bytes(cfg: DraftKVConfig) -> int:
    return cfg.num_layers * 2 * cfg.kv_size * cfg.hidden * cfg.dtype.itemsize


def floor_us(cfg: DraftKVConfig, tokens: int, bandwidth: float, gemm_rate: float) -> tuple[float, str]:
    """The floor in µs and what binds it ("copy" or "GEMM")."""
    copy_us = 1e6 * kv_weight_bytes(cfg) / bandwidth
    gemm_us = 1e6 * 2 * tokens * cfg.num_layers * 2 * cfg.kv_size * cfg.hidden / gemm_rate
    return (copy_us, "copy") if copy_us >= gemm_us else (gemm_us, "GEMM")


def lowering(graph: torch.fx.Graph) -> str:
    """Which dspark op a post-pass graph carries the K/V projection in."""
    counts = op_counts(graph)
    for op in ("multi_linear_kv_write", "multi_linear"):
        if counts[f"dspark.{op}"]:
            return op
    return "unfused"


class PathProbe:
    """A torch.compile backend: the dspark passes without Inductor codegen (`make_backend(inner="aot_eager")`); each
    compiled graph, when it runs, adds the op its K/V projection was lowered to to `seen`, and the first reason the
    report gives for K/V writes it kept off `multi_linear_kv_write` (if any) to `kept`."""

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self.kept: set[str] = set()
        self._path = "unfused"
        self._kept: list[str] = []
        self._backend = dspark_fx.make_backend(inner="aot_eager", observer=self._observe)

    def _observe(self, _before: torch.fx.Graph, after: torch.fx.Graph, report: FusionReport) -> None:
        self._path = lowering(after)
        self._kept = [str(why) for why in report.kv_kept[:1]]

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list, **kwargs: object) -> Callable:
        self._path = "unfused"
        compiled = self._backend(gm, example_inputs, **kwargs)
        path, kept = self._path, self._kept

        @functools.wraps(compiled)  # keeps `_boxed_call` and the like
        def run(*args):
            self.seen.add(path)
            self.kept.update(kept)
            return compiled(*args)

        return run


def dspark_paths(base: SpellingModel, inputs: dict[int, tuple]) -> tuple[dict[int, str], list[str]]:
    """Per T, the op the dspark passes lowered the K/V group to, compiled as the timed models are (`first_calls`:
    the largest T first); and the reasons given for K/V writes kept off `multi_linear_kv_write` (the first write's,
    per graph)."""
    probe = PathProbe()
    model = torch.compile(copy.deepcopy(base), backend=probe)
    paths = {}
    with torch.no_grad():
        for tokens in sorted(inputs, reverse=True):
            probe.seen.clear()
            model(*inputs[tokens])
            paths[tokens] = "/".join(sorted(probe.seen)) or "?"
    return paths, sorted(probe.kept)


def launched_cuda_graph(call: Callable[[], object]) -> bool:
    """Whether one `call()` replayed a `torch.cuda.CUDAGraph`: Inductor's CUDA graph trees replay through that class,
    and every path on which they run a graph eagerly instead (skipped or falling back) replays none."""
    replays = 0
    replay = torch.cuda.CUDAGraph.replay

    def counting_replay(graph: torch.cuda.CUDAGraph) -> None:
        nonlocal replays
        replays += 1
        replay(graph)

    with mock.patch.object(torch.cuda.CUDAGraph, "replay", counting_replay):
        call()
    return replays > 0


def prepare(entry: Entry, inputs: tuple, device: str) -> Callable[[], object]:
    """The entry as timed, as a call without arguments: a manual CUDA-graph replay (after three warm-up calls), or
    on CPU and for RO the call itself after `RO_WARMUP_CALLS` warm-up calls."""
    with compile_counts() as counts:
        if device == "cuda" and not entry.variant.reduce_overhead:
            call = graphed(entry.fn, inputs)
        else:
            for _ in range(RO_WARMUP_CALLS):
                entry.fn(*inputs)
            call = functools.partial(entry.fn, *inputs)
    entry.graphs += counts["frames"]
    return call


def zero_caches(model: SpellingModel) -> None:
    for k_cache, v_cache in model.caches():
        k_cache.zero_()
        v_cache.zero_()


def all_caches(model: SpellingModel) -> list[torch.Tensor]:
    return [cache for layer in model.caches() for cache in layer]


def cache_error(model: SpellingModel, expected: list[torch.Tensor]) -> float:
    """max |cache - expected cache| / max |expected cache| over all K/V caches (`expected`: `all_caches` of the
    reference after the same call)."""
    pairs = [(ours.float(), ref.float()) for ours, ref in zip(all_caches(model), expected, strict=True)]
    return max((a - e).abs().max().item() for a, e in pairs) / max(e.abs().max().item() for _, e in pairs)


def check_parity(entries: list[Entry], reference: SpellingModel, inputs: tuple, device: str) -> None:
    """Every entry, run as timed, writes the caches that eager per-layer writes (within the dtype's tolerance)."""
    zero_caches(reference)
    reference(*inputs)
    expected = all_caches(reference)
    tolerance = TOLERANCES[reference.cfg.dtype]
    for entry in entries:
        if entry.error:
            continue
        start = time.perf_counter()
        try:
            call = prepare(entry, inputs, device)
            zero_caches(entry.model)
            call()
            if device == "cuda":
                torch.cuda.synchronize()
            error = cache_error(entry.model, expected)
        except Exception as exc:
            fail(entry, exc, f"T={inputs[0].shape[0]}")
            continue
        wrong = not error <= tolerance
        entry.wrong = entry.wrong or wrong
        entry.parity = f"max error / max |eager| {error:.1e}" + (f" > {tolerance:.0e}: WRONG" if wrong else "")
        seconds = time.perf_counter() - start
        print(f"  parity {entry.variant.name}: {entry.parity} ({seconds:.1f} s, {entry.graphs} graph(s))", flush=True)
        if wrong:
            print(f"  PARITY FAILURE: {entry.variant.name} disagrees with eager per-layer; cells marked ✗", flush=True)
        del call


def fail(entry: Entry, exc: Exception, where: str) -> None:
    entry.error = f"{type(exc).__name__} at {where}: {str(exc).splitlines()[0] if str(exc) else ''}"
    print(f"  ERROR {entry.variant.name}: {entry.error}", flush=True)
    traceback.print_exc()


def first_calls(entries: list[Entry], inputs: dict[int, tuple], reference: SpellingModel) -> None:
    """Call every compiled entry once at each T, from the largest T down: each Dynamo graph is compiled at the
    largest T it serves (its shape hint) and Inductor tunes its kernels' launch configurations at that first call,
    so graphs that hold the same ops, in two variants, are compiled and tuned alike. Each call's cache writes are
    checked against those of eager per-layer (`reference`) at the same T: every graph a variant compiled (T = 1,
    T > 1, above `max_fused_rows`) is checked, called directly (`check_parity` checks one T as timed)."""
    expected = {}
    for tokens in inputs:
        zero_caches(reference)
        reference(*inputs[tokens])
        expected[tokens] = [cache.clone() for cache in all_caches(reference)]
    tolerance = TOLERANCES[reference.cfg.dtype]
    for entry in entries:
        if "eager" in entry.variant.name:
            continue
        errors = {}
        try:
            moved, left = _weight_group_counts()
            with compile_counts() as counts:
                for tokens in sorted(inputs, reverse=True):
                    zero_caches(entry.model)
                    entry.fn(*inputs[tokens])
                    errors[tokens] = cache_error(entry.model, expected[tokens])
            entry.graphs += counts["frames"]
            now_moved, now_left = _weight_group_counts()
            entry.weight_groups = (now_moved - moved, now_left - left)
        except Exception as exc:
            fail(entry, exc, "first calls")
            continue
        worst = max(errors, key=errors.__getitem__)
        entry.wrong = not errors[worst] <= tolerance
        entry.calls_parity = f"max error / max |eager| {errors[worst]:.1e} (at T = {worst})" + (
            f" > {tolerance:.0e}: WRONG" if entry.wrong else ""
        )
        print(f"  parity {entry.variant.name} at every T, called directly: {entry.calls_parity}", flush=True)
        if entry.wrong:
            print(f"  PARITY FAILURE: {entry.variant.name} disagrees with eager per-layer; cells marked ✗", flush=True)


def _weight_group_counts() -> tuple[int, int]:
    """dspark_fx's counts so far of the weight groups that `colocate_weights` moved and left."""
    ours = torch._dynamo.utils.counters["dspark_fx"]
    return ours["weight_groups_colocated"], ours["weight_groups_left"]


def time_row(
    entries: list[Entry], control: Entry | None, inputs: tuple, device: str, rounds: int, sync_each: bool = False
) -> tuple[list[float | str], float]:
    """Per entry, µs per call at these inputs (or why there is none), all entries sampled together
    (`interleaved_median_us`; `sync_each`: a synchronize after every call, naming the entry a CUDA error comes from);
    and the control: `control` (a second copy compiled as the first BASELINE entry),
    timed in the same interleave, ÷ that entry's time (what two compiles of the same code read here; NaN without
    a baseline or a control)."""
    calls, timed = [], []
    for i, entry in enumerate(entries):
        if entry.error:
            continue
        try:
            calls.append(prepare(entry, inputs, device))
            timed.append(i)
        except Exception as exc:
            fail(entry, exc, f"T={inputs[0].shape[0]}")
    baseline = next((i for i in timed if entries[i].variant.name == BASELINE), None)
    if baseline is not None and control is not None and not control.error:
        try:
            calls.append(prepare(control, inputs, device))
        except Exception as exc:
            fail(control, exc, f"T={inputs[0].shape[0]}")
    with_control = len(calls) > len(timed)
    names = [entries[i].variant.name for i in timed] + ([control.variant.name] if with_control else [])
    medians = interleaved_median_us(calls, device, rounds, names if sync_each else ())
    times: list[float | str] = ["error"] * len(entries)
    for i, call, us in zip(timed, calls, medians, strict=False):  # the control's call and median come last
        times[i] = us
        entry = entries[i]
        if device == "cuda" and entry.variant.reduce_overhead and not launched_cuda_graph(call):
            entry.no_cuda_graph = True
            print(f"  {entry.variant.name} T={inputs[0].shape[0]}: ran without a CUDA graph launch", flush=True)
    return times, medians[-1] / medians[timed.index(baseline)] if with_control else float("nan")


def run_config(
    label: str,
    cfg: DraftKVConfig,
    spellings: list[str],
    tokens_list: tuple[int, ...],
    device: str,
    ceilings: tuple[float, float],
    variants: tuple[Variant, ...],
    rounds: int,
    before_row: Callable[[], object] = lambda: None,
    sync_each: bool = False,
) -> list[ConfigRun]:
    """One table per spelling; every row's cells of all spellings and variants are timed together, interleaved;
    `before_row()` runs before each row is timed (`--tp`: a barrier of the ranks); `sync_each`: see `time_row`."""
    print(f"{label}: {cfg}", flush=True)
    torch._dynamo.reset()
    inputs = {t: make_inputs(cfg, t, device) for t in sorted({PARITY_TOKENS, *tokens_list})}
    runs = []
    control = None  # a second torch.compile copy of the first spelling's model (time_row)
    with torch.no_grad():
        for spelling in spellings:
            base = build_spelling(spelling, cfg, device).requires_grad_(False)
            paths, kept = dspark_paths(base, inputs)
            print(f"  {spelling}: dspark path per T: {paths}; K/V writes kept: {kept}", flush=True)
            entries = [make_entry(v, base) for v in variants if device == "cuda" or not v.reduce_overhead]
            checked = entries
            if control is None:
                control = make_entry(CONTROL, base)
                checked = [*entries, control]
            first_calls(checked, inputs, base)
            check_parity(checked, base, inputs[PARITY_TOKENS], device)
            title = label if spelling == "reference" else f"{label}, {spelling} spelling"
            runs.append(ConfigRun(title, spelling, cfg, [], entries, None, kept, paths, rounds))
            del base
        for tokens in tokens_list:
            entries = [entry for run in runs for entry in run.entries]
            before_row()
            times, ratio = time_row(entries, control, inputs[tokens], device, rounds, sync_each)
            for run in runs:
                row = Row(tokens, *floor_us(cfg, tokens, *ceilings), run.paths[tokens], control=ratio)
                row.times = {variant.name: "n/a (cpu)" for variant in variants}
                row.times |= {entry.variant.name: times.pop(0) for entry in run.entries}
                run.rows.append(row)
                shown = {k: v if isinstance(v, str) else round(v, 1) for k, v in row.times.items()}
                print(f"  {run.spelling} T={tokens} µs: {shown}; control {ratio:.3f}", flush=True)
    for entry in [entry for run in runs for entry in run.entries] + ([control] if control else []):
        entry.fn = entry.model = None  # the models and their graphs go before the next config
    del inputs
    torch._dynamo.reset()
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        from _read_floor import cublas_read_us, one_launch_read

        read = one_launch_read(kv_weight_bytes(cfg), cfg.hidden, BENCH)
        print(f"  one-launch read of {kv_weight_bytes(cfg) / 1e6:.3g} MB: {read.us:.1f} µs ({read.reader})", flush=True)
        gemms = {t: cublas_read_us(kv_weight_bytes(cfg), cfg.hidden, t, BENCH) for t in tokens_list}
        print(f"  cuBLAS one GEMM µs per T: { {t: round(us, 1) for t, us in gemms.items()} }", flush=True)
        for run in runs:
            run.read_us, run.reader = read.us, read.reader
            for row in run.rows:
                row.gemm_us = gemms[row.tokens]
    return runs


def cell(times: dict[str, float | str], name: str, entry: Entry | None) -> str:
    value, baseline = times[name], times.get(BASELINE)
    if isinstance(value, str):
        return value
    text = f"{value:.1f}"
    if isinstance(baseline, float):
        text += f" ({value / baseline:.2f}x)"
    if entry is not None and entry.wrong:
        text += " ✗"
    if entry is not None and entry.no_cuda_graph:
        text += " †"
    return text


def _ratio(times: dict[str, float | str], name: str, by: str) -> str:
    value, base = times.get(name), times.get(by)
    return f"{value / base:.2f}x" if isinstance(value, float) and isinstance(base, float) else "—"


def config_table(run: ConfigRun, variants: tuple[Variant, ...]) -> list[str]:
    cfg = run.cfg
    names = [v.name for v in variants]
    entries = {e.variant.name: e for e in run.entries}
    columns = [
        "T",
        "floor µs",
        "one-launch read µs",
        "one GEMM µs",
        *names,
        *(f"{name} ÷ floor" for name in FLOOR_RATIOS),
        "dspark_backend ÷ hand-stacked",
        "colocated ÷ hand-stacked",
        f"{READ_RATIO} ÷ read",
        "control",
        "dspark path",
    ]
    lines = [
        f"### {run.label}: {cfg.num_layers} layers, hidden {cfg.hidden}, {cfg.num_heads}/{cfg.num_kv_heads} heads x "
        f"{cfg.head_dim}, {str(cfg.dtype).removeprefix('torch.')}, {cfg.num_slots} slots; K/V weights "
        f"{kv_weight_bytes(cfg) / 1e6:.3g} MB",
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
    ]
    for row in run.rows:
        cells = [cell(row.times, name, entries.get(name)) for name in names]
        ratios = [
            f"{row.times[n] / row.floor_us:.2f}x" if isinstance(row.times.get(n), float) else "—" for n in FLOOR_RATIOS
        ]
        ratios.append(_ratio(row.times, *HAND_RATIO))
        ratios.append(_ratio(row.times, *COLOCATED_RATIO))
        dspark = row.times.get(READ_RATIO)
        if run.read_us is None:
            read, by_read = "n/a (cpu)", "—"
        else:
            read = f"{run.read_us:.1f}"
            copy_bound = row.floor_bound == "copy"  # elsewhere the GEMM, not the read, bounds the write
            by_read = f"{dspark / run.read_us:.2f}x" if isinstance(dspark, float) and copy_bound else "—"
        floor = f"{row.floor_us:.1f} ({row.floor_bound})"
        gemm = "n/a (cpu)" if row.gemm_us is None else f"{row.gemm_us:.1f}"
        lines.append(
            f"| {row.tokens} | {floor} | {read} | {gemm} | "
            + " | ".join([*cells, *ratios, by_read, f"{row.control:.3f}x"])
            + f" | {row.path} |"
        )
    lines.append("")
    for entry in run.entries:
        compiled = f", {entry.graphs} graph(s) compiled" if "eager" not in entry.variant.name else ""
        at_every_t = f"; at every T, called directly: {entry.calls_parity}" if entry.calls_parity else ""
        lines.append(f"- {entry.variant.name}: parity at T={PARITY_TOKENS}: {entry.parity}{at_every_t}{compiled}")
        if entry.error:
            lines.append(f"  - error: {entry.error}")
        if entry.no_cuda_graph:
            lines.append("  - †: at least one call launched no CUDA graph (Inductor skipped them: see the log)")
        if any(entry.weight_groups):
            moved, left = entry.weight_groups
            lines.append(
                f"  - colocate_weights: {moved} group(s) of weights moved into one allocation, {left} left as they"
                " were (which and why: DSPARK_FX_LOG=info)"
            )
    lines += [f"- dspark path: K/V writes kept off multi_linear_kv_write: {why}" for why in run.kept]
    if run.reader:
        lines.append(f"- one-launch read: {run.reader}")
    return [*lines, ""]


def spellings_table(runs: list[ConfigRun]) -> list[str]:
    """Per T and spelling, from the rows timed together: dspark_backend ÷ the reference spelling's dspark_backend,
    and dspark_backend (lowered, and never lowered) ÷ the spelling's own torch.compile."""
    reference = next(run for run in runs if run.spelling == "reference")
    lines = [
        f"### {reference.label}: the spellings side by side (the same interleaved rows as the tables below)",
        "",
        "| T | spelling | dspark path | dspark_backend ÷ reference spelling's | dspark_backend ÷ torch.compile | "
        "never lowered ÷ torch.compile | control |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, ref_row in enumerate(reference.rows):
        for run in runs:
            row = run.rows[i]
            ours, ref = row.times.get("dspark_backend"), ref_row.times.get("dspark_backend")
            by_ref = f"{ours / ref:.2f}x" if isinstance(ours, float) and isinstance(ref, float) else "—"
            lines.append(
                f"| {row.tokens} | {run.spelling} | {row.path} | {by_ref} | "
                f"{_ratio(row.times, 'dspark_backend', BASELINE)} | "
                f"{_ratio(row.times, 'dspark_backend, never lowered', BASELINE)} | {row.control:.3f}x |"
            )
    return [*lines, ""]


def report(
    runs: list[list[ConfigRun]],
    variants: tuple[Variant, ...],
    device: str,
    ceilings: tuple[float, float],
    dtype: torch.dtype,
    harness_us: float | None,
) -> str:
    """The markdown report; `runs`: per config, its tables (one per spelling, timed together)."""
    bandwidth, rate = ceilings
    if device == "cuda":
        import triton

        where = f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}"
        timing = (
            "CUDA-graph replay (RO columns: as called, their own CUDA graph trees), after an L2 flush, between CUDA "
            f"events; per row, the medians of {runs[0][0].rounds} interleaved rounds over every cell of the row's "
            f"config (every spelling's); a graph of one trivial kernel replays in {harness_us:.1f} µs here"
        )
    else:
        where = f"CPU {platform.machine()}, torch {torch.__version__}"
        timing = f"wall clock, no CUDA graphs (RO columns n/a), medians of {runs[0][0].rounds} interleaved rounds"
    command = f"{Path(sys.executable).name} {shlex.join(sys.argv)}"
    lines = [
        "## Draft context-KV write (`benchmarks/dspark_write.py`)",
        "",
        f"{where}; {datetime.date.today().isoformat()}; command `{command}`. Measured copy bandwidth "
        f"{bandwidth / 1e12:.3g} TB/s (read + write), {str(dtype).removeprefix('torch.')} GEMM "
        f"{rate / 1e12:.3g} TFLOP/s. Times: {timing}.",
        "",
        "- Cells: µs per call (time ÷ torch.compile in the same row; below 1.00x is faster). eager per-layer, "
        "stacked eager, both torch.compile columns and dspark_backend: replay of a manual `torch.cuda.CUDAGraph` "
        "captured per T. "
        'RO (`mode="reduce-overhead"`): the compiled callable as called, replaying its own CUDA graph trees after '
        f"{RO_WARMUP_CALLS} warm-up calls per T, between CUDA events, so the time includes the copy of "
        "ctx/positions/cache_loc into the graphs' static inputs, and Dynamo's guards where the host's work outlasts "
        "the GPU's queue (calls not synchronized one by one).",
        "- eager per-layer: `DraftKVWriter` as is (per layer a GEMM, k_norm, RoPE, two writes). stacked eager: "
        "sglang-style, the layers' K/V weight rows concatenated once (a copy), one GEMM, one batched k_norm, one "
        "RoPE, per-layer writes; hand-stacked torch.compile: that module under plain torch.compile (`dspark_backend ÷ "
        "hand-stacked`: the dspark_backend time ÷ its time). dspark_backend RO: "
        '`torch.compile(model, backend=dspark_fx.dspark_backend, mode="reduce-overhead")`.',
        "- floor: max(K/V weight bytes / copy bandwidth, GEMM FLOPs / GEMM rate), the binding one in brackets; "
        "reading ctx and writing the caches are not counted. `÷ floor`: time ÷ floor. one-launch read (CUDA): the "
        "fastest reader of the K/V weight bytes, timed as the cells (graph replay after an L2 flush): a few shapes "
        "of one Triton kernel that only loads them and of the copy engine reading them (1-D bulk copies; sm_90), "
        "and cuBLAS multiplying 1, 8 or 16 tokens by them as one "
        "concatenated weight (the reader of each table is named below it); what one launch that reads the weights "
        "measures here; "
        "`÷ read`: dspark_backend ÷ that, in rows whose floor is the copy (elsewhere the GEMM bounds the write). "
        "one GEMM (CUDA): cuBLAS multiplying the row's T tokens by one concatenated copy of the K/V weights, alone "
        "in a graph, timed as the cells: the hand-stacked compile's GEMM without its norm, RoPE and writes.",
        "- dspark path: the op dspark_backend lowered the layers' K/V to (multi_linear_kv_write: GEMM, k_norm, RoPE "
        "and cache writes in one op; multi_linear: one GEMM, the rest by Inductor); below a table, the reason the "
        "passes gave for K/V writes they kept off multi_linear_kv_write. Tables of a spelling other than `reference` "
        "(`--spellings`) time that spelling's module of `benchmarks/_spellings.py` in every column.",
        "- Every compiled variant is compiled once per config with T marked dynamic, then called once at every T "
        "from the largest down, so each of its graphs (one for T = 1, one for T > 1, and for dspark_backend on "
        f"CUDA one above `max_fused_rows`) is compiled and tuned at the largest T it serves. Before timing, each "
        f"variant's cache writes at T = {PARITY_TOKENS}, run as timed, are checked against eager per-layer, and "
        "those of its first call at every T of the table, called directly. ✗: failed a check. †: an RO call that "
        "launched no CUDA graph. n/a (cpu): reduce-overhead needs CUDA graphs.",
        "- control: a second copy of the first table's model under plain torch.compile, compiled on its own and "
        "timed in the same interleave, ÷ the torch.compile cell: what two compiles of the same code, placed "
        "elsewhere in memory, read in this row.",
        "- With several spellings, a first table puts them side by side: per T, dspark_backend ÷ the reference "
        "spelling's dspark_backend, and dspark_backend, lowered and never lowered, ÷ that spelling's torch.compile.",
        "",
    ]
    for config_runs in runs:
        if len(config_runs) > 1 and any(run.spelling == "reference" for run in config_runs):
            lines += spellings_table(config_runs)
        for run in config_runs:
            lines += config_table(run, variants)
    return "\n".join(lines)


BREAKDOWN_KEYS = ("compile", "hand", "dspark", "never")  # the variants `--breakdown` can profile


def breakdown(
    label: str, cfg: DraftKVConfig, spelling: str, tokens_list: tuple[int, ...], keys: list[str]
) -> list[str]:
    """`--breakdown` lines of one config and spelling: per variant (BREAKDOWN_KEYS) and T, the replay time
    and the kernels of that graph after an L2 flush; and the harness cost. The models are built, checked and
    compiled as the table's are (`first_calls`, then the parity check), so they are the table's models; only the
    profiled variants are built (the parity check compares against the eager base model)."""
    from _read_floor import one_launch_read, trivial_replay_us
    from torch.profiler import ProfilerActivity, profile

    torch._dynamo.reset()
    base = build_spelling(spelling, cfg, "cuda").requires_grad_(False)
    inputs = {t: make_inputs(cfg, t, "cuda") for t in sorted({PARITY_TOKENS, *tokens_list})}
    entries = [make_entry(variant, base) for variant in VARIANTS if variant.key in keys]
    first_calls(entries, inputs, base)
    check_parity(entries, base, inputs[PARITY_TOKENS], "cuda")
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")  # as do_bench clears the L2 before each call
    trivial = trivial_replay_us(BENCH)
    read = one_launch_read(kv_weight_bytes(cfg), cfg.hidden, BENCH)
    lines = [
        f"{label}, {spelling} spelling: replay of a graph of one trivial kernel {trivial:.1f} µs; of the fastest "
        f"one-launch read of the {kv_weight_bytes(cfg) / 1e6:.3g} MB of K/V weights {read.us:.1f} µs ({read.reader})"
    ]
    for entry in [entry for entry in entries if not entry.error]:
        for tokens in tokens_list:
            replay = prepare(entry, inputs[tokens], "cuda")
            total = median_us(replay, "cuda", **BENCH)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    flush.zero_()
                    replay()
                torch.cuda.synchronize()
            kernels = [  # every kernel but the flush's (`zero_` of an int8 buffer: a fill of signed chars)
                f"{e.key[:70]} {e.device_time_total / e.count:.1f} µs x{e.count // 5}"
                for e in prof.key_averages()
                if e.device_type == torch.autograd.DeviceType.CUDA
                and e.count >= 5
                and "FillFunctor<signed char>" not in e.key
            ]
            lines.append(f"  {entry.variant.name} T={tokens}: replay {total:.1f} µs; kernels: " + "; ".join(kernels))
            print(lines[-1], flush=True)
    return lines


def run_configs(
    args: argparse.Namespace,
    variants: tuple[Variant, ...],
    dtype: torch.dtype,
    ways: int,
    suffix: str,
    before_row: Callable[[], object] = lambda: None,
) -> tuple[list[list[ConfigRun]], tuple[float, float], float | None]:
    """The copy and GEMM ceilings and (CUDA) the harness's cost of a trivial graph replay, then every config of
    `args.configs` timed (`run_config`), each sharded `ways` ways (`shard`; 1: whole), its label followed by `suffix`
    (if any); returns the configs' tables, the ceilings and the harness cost."""
    start = time.perf_counter()
    ceilings = copy_bandwidth(args.device), gemm_rate(args.device, dtype)
    harness_us = None
    if args.device == "cuda":
        from _read_floor import trivial_replay_us

        harness_us = trivial_replay_us(BENCH)
    configs = SMALL_CONFIGS if args.small else CONFIGS
    runs = []
    for key in args.configs:
        label, cfg = configs[key]
        label = f"{label}, {suffix}" if suffix else label
        cfg_run = shard(dataclasses.replace(cfg, dtype=dtype), ways)
        runs.append(
            run_config(
                label,
                cfg_run,
                args.spellings,
                args.tokens,
                args.device,
                ceilings,
                variants,
                args.rounds,
                before_row,
                args.sync_each,
            )
        )
        print(f"{label} done at {time.perf_counter() - start:.0f} s", flush=True)
    return runs, ceilings, harness_us


def emit(text: str, out: Path | None) -> None:
    """Print the report and write it to `out` (if given)."""
    print(text)
    if out:
        out.write_text(text + "\n")


def raise_recompile_limit() -> None:
    """Up to 6 compiled callables (the path probe's too) share a writer's `forward` cache: 2 graphs each."""
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    setattr(torch._dynamo.config, limit, 64)


def shard(cfg: DraftKVConfig, tp: int) -> DraftKVConfig:
    """One rank's K/V write under `tp`-way tensor parallelism (column-parallel K/V projections): the same write with
    `num_heads / tp` and `num_kv_heads / tp` heads."""
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // tp, num_kv_heads=cfg.num_kv_heads // tp)


@dataclass
class TPRun:
    """What a rank sends rank 0 of one config's (spelling's) table: its label, and per row T and the times."""

    label: str
    rows: list[tuple[int, dict[str, float | str]]]


def tp_table(
    label: str, cfg: DraftKVConfig, tp: int, per_rank: list[TPRun], variants: tuple[Variant, ...]
) -> list[str]:
    """Per T, each variant's time on every rank and their maximum; dspark_backend's maximum ÷ torch.compile's and
    ÷ hand-stacked's."""
    names = [v.name for v in variants]
    lines = [
        f"### {label}, tensor parallel {tp}: per rank {cfg.num_kv_heads // tp} of {cfg.num_kv_heads} K/V heads of "
        f"every layer ({kv_weight_bytes(shard(cfg, tp)) / 1e6:.3g} MB of K/V weights per rank)",
        "",
        "µs per call on each rank (rank 0 / rank 1 / ...), and in bold their maximum, which a step waits for.",
        "",
        "| T | " + " | ".join(names) + " | dspark_backend ÷ torch.compile | dspark_backend ÷ hand-stacked |",
        "|---|" + "---|" * (len(names) + 2),
    ]
    for i, (tokens, _) in enumerate(per_rank[0].rows):
        cells, worst = [], {}  # worst: per variant, the maximum over the ranks
        for name in names:
            values = [run.rows[i][1].get(name, "—") for run in per_rank]
            timed = [v for v in values if isinstance(v, float)]
            worst[name] = max(timed) if len(timed) == len(values) else "—"
            shown = " / ".join(f"{v:.1f}" if isinstance(v, float) else str(v) for v in values)
            cells.append(f"**{worst[name]:.1f}** ({shown})" if isinstance(worst[name], float) else shown)
        ratios = [_ratio(worst, "dspark_backend", BASELINE), _ratio(worst, *HAND_RATIO)]
        lines.append(f"| {tokens} | " + " | ".join([*cells, *ratios]) + " |")
    return [*lines, ""]


def tp_rank(rank: int, tp: int, store: str, args: argparse.Namespace, keys: tuple[str, ...]) -> None:
    """`--tp`: rank `rank` of `tp` (GPU `rank` on CUDA) times its shard of every chosen config with the variants of
    `keys`; rank 0 writes the report."""
    variants = tuple(variant for variant in VARIANTS if variant.key in keys)
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    raise_recompile_limit()
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=tp)
    try:
        configs = SMALL_CONFIGS if args.small else CONFIGS
        dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
        torch.manual_seed(rank)  # the global RNG only: weights and inputs take their own seeded generators
        runs, ceilings, harness_us = run_configs(
            args, variants, dtype, tp, f"rank {rank} of {tp}", before_row=torch.distributed.barrier
        )
        mine = [TPRun(run.label, [(row.tokens, row.times) for row in run.rows]) for config in runs for run in config]
        gathered: list[list[TPRun] | None] = [None] * tp
        torch.distributed.all_gather_object(gathered, mine)
        if rank == 0:
            text = report(runs, variants, args.device, ceilings, dtype, harness_us)
            tables = iter(zip(*gathered, strict=True))
            for key in args.configs:
                label, cfg = configs[key]
                for spelling in args.spellings:
                    title = label if spelling == "reference" else f"{label}, {spelling} spelling"
                    config = dataclasses.replace(cfg, dtype=dtype)
                    text += "\n" + "\n".join(tp_table(title, config, tp, list(next(tables)), variants))
            emit(text, args.out)
        # every rank done before any rank tears the group down (a gloo rank once aborted at exit, after all its
        # output, when its peer had already destroyed the group and gone)
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


def run_tp(args: argparse.Namespace, variants: tuple[Variant, ...]) -> None:
    """`--tp N`: N rank processes (`tp_rank`), spawned; their rendezvous is a file in a fresh temporary folder."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        store = os.path.join(folder, "rendezvous")
        keys = tuple(variant.key for variant in variants)  # the variants' builders do not pickle
        mp.start_processes(tp_rank, args=(args.tp, store, args, keys), nprocs=args.tp, start_method="spawn")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--small", action="store_true", help="tiny dims (2 layers, hidden 64), T in {1, 8}")
    parser.add_argument("--configs", nargs="+", help="config keys to run (default: all of the chosen set)")
    parser.add_argument("--tokens", type=int, nargs="+", help="T values (default: 1 8 64 512 4096; --small: 1 8)")
    parser.add_argument(
        "--spellings",
        nargs="+",
        choices=SPELLINGS,
        default=["reference"],
        help="draft spellings of benchmarks/_spellings.py, one table per config and spelling (default: reference)",
    )
    parser.add_argument("--out", type=Path, help="write the markdown report here")
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=[variant.key for variant in VARIANTS],
        help=f"the columns to time (default: all; {BASELINE}, the baseline, always)",
    )
    parser.add_argument(
        "--rounds", type=int, help="interleaved timing rounds per row; a cell is the median (default: 100, CPU 10)"
    )
    parser.add_argument(
        "--sync-each",
        action="store_true",
        help="synchronize after every timed call, so that a CUDA error names the column whose call raised it (the "
        "times are then not comparable with a normal run's)",
    )
    parser.add_argument(
        "--tp",
        type=int,
        help="tensor parallel: N ranks, each timing its shard of the write on its own GPU, all at once (1: one rank)",
    )
    parser.add_argument(
        "--shard",
        type=int,
        help="time one rank's shard of N-way tensor parallelism (1/N of the K/V heads) here, on one GPU",
    )
    parser.add_argument(
        "--breakdown",
        nargs="*",
        choices=BREAKDOWN_KEYS,
        help=f"CUDA: where the replay time goes, per kernel, for these variants (none named: all of {BREAKDOWN_KEYS})",
    )
    args = parser.parse_args()
    if args.breakdown is not None and args.device != "cuda":
        parser.error("--breakdown profiles CUDA kernels: it needs --device cuda")
    chosen = set(args.variants or [variant.key for variant in VARIANTS])
    variants = tuple(variant for variant in VARIANTS if variant.key in chosen or variant.name == BASELINE)
    rounds = args.rounds or (100 if args.device == "cuda" else 10)
    if rounds < 1:
        parser.error("--rounds must be at least 1")
    configs = SMALL_CONFIGS if args.small else CONFIGS
    keys = args.configs or list(configs)
    unknown = set(keys) - set(configs)
    if unknown:
        parser.error(f"unknown configs {sorted(unknown)}; choose from {list(configs)}")
    tokens_list = tuple(args.tokens or (SMALL_TOKENS if args.small else TOKENS))
    slots = min(configs[key][1].num_slots for key in keys)
    if not all(0 < t <= slots for t in tokens_list):
        parser.error(f"every T must be in [1, {slots}] (distinct cache slots per token)")
    for flag, ways in (("--tp", args.tp), ("--shard", args.shard)):
        if ways is not None and ways < 1:
            parser.error(f"{flag} must be at least 1")
        uneven = [key for key in keys if ways and configs[key][1].num_kv_heads % ways]
        if uneven:
            parser.error(f"{flag} {ways}: the K/V heads of {uneven} do not split {ways} ways")
    if args.tp is not None and (args.shard or args.breakdown is not None):
        parser.error("--tp runs one process per rank: it takes neither --shard nor --breakdown")
    if args.shard and args.breakdown is not None:
        parser.error("--breakdown profiles the unsharded configs: it does not take --shard")
    args.configs, args.tokens, args.rounds = keys, tokens_list, rounds
    if args.tp is not None:
        gpus = torch.cuda.device_count() if args.device == "cuda" else args.tp
        if gpus < args.tp:
            parser.error(f"--tp {args.tp} needs {args.tp} GPUs (one per rank); this machine has {gpus}")
        run_tp(args, variants)
        return
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    raise_recompile_limit()
    torch.manual_seed(0)
    if args.breakdown is not None:
        with torch.no_grad():
            text = "\n".join(
                line
                for key in keys
                for spelling in args.spellings
                for line in breakdown(
                    configs[key][0],
                    dataclasses.replace(configs[key][1], dtype=dtype),
                    spelling,
                    tokens_list,
                    args.breakdown or list(BREAKDOWN_KEYS),
                )
            )
        emit(text, args.out)
        return
    suffix = f"one rank's shard of {args.shard}" if args.shard else ""
    runs, ceilings, harness_us = run_configs(args, variants, dtype, args.shard or 1, suffix)
    emit(report(runs, variants, args.device, ceilings, dtype, harness_us), args.out)


if __name__ == "__main__":
    main()
