"""Generated spellings of the draft context-K/V write (`tests/spelling_generator.py`) against the KV-write lowering.

Positives: every seed's writer leaves the fp64 formula of `dspark::multi_linear_kv_write` in eager; compiled with
`kv_write_op="always"` its writes of all layers become one op and the caches stay eager's for T > 1, also after an
in-place update of a K weight; every 4th seed (those seeds draw every value of every axis) is compiled with
`dynamic=True` and run at T = 1 too (a graph of its own), the others with static shapes. Every 5th seed goes through
Inductor codegen, the others through `aot_eager`. Near misses: one
change away from a positive and not the op's formula, they must keep today's path (with a reason in the report) and
eager's caches.

`DSPARK_SPELLINGS=N` sets the number of seeds (default 200), `DSPARK_SPELLINGS_T1_EVERY=k` compiles dynamic shapes
and T = 1 on every k-th seed (default 4: a dynamic graph and the T = 1 graph take about three times a static
graph's compile; 1 does it for every model).
"""

import copy
import dataclasses
import os
from collections import Counter

import pytest
import spelling_generator as gen
import torch
from helpers import quick_first
from torch.utils._pytree import tree_map

from dspark_fx import DsparkConfig
from dspark_fx.testing import CaptureBackend, assert_close_for_dtype, op_counts

OP = "dspark.multi_linear_kv_write"
N = int(os.environ.get("DSPARK_SPELLINGS", 200))
SEEDS = [pytest.param(seed, id=gen.generate(seed).id) for seed in range(N)]
INDUCTOR_SEEDS = SEEDS[::5]
AOT_EAGER_SEEDS = [p for p in SEEDS if p not in INDUCTOR_SEEDS]
ONE_TOKEN_SEEDS = range(0, N, int(os.environ.get("DSPARK_SPELLINGS_T1_EVERY", 4)))  # compiled at T = 1 too
NEAR_MISSES = pytest.mark.parametrize("name", gen.NEAR_MISSES)
TOKENS = (6, 1, 4)  # T > 1 (commit: [2, 3] slots), T = 1, another T > 1 for the call after the weight update
STATIC_TOKENS = (6, 6)  # static shapes: the same T before and after the weight update


def _max_error(model: gen.GeneratedWriter, caches: list[torch.Tensor], index: slice = slice(None)) -> float:
    return max((a.double() - e).abs().max().item() for a, e in zip(model.caches()[index], caches[index], strict=True))


def _eager(model: gen.GeneratedWriter, inputs: tuple) -> None:
    with torch.no_grad():
        model(*inputs)


def _compiled_matches_eager(
    spec: gen.Spec, backend, update_weights: bool, device: str = "cpu", one_token: bool = True
) -> None:
    """Compile a copy of the writer, run both at each T and compare the caches (poisoned: slots not written must
    keep their random values); before the last call, update a K weight in place in both (the compiled model must
    see it). With `one_token`: `dynamic=True` at T = `TOKENS` (T = 1 a graph of its own); without: static shapes,
    T = 6 twice (one graph, compiled in about half the time of a dynamic one)."""
    eager = gen.build(spec).to(device)
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend=backend, dynamic=one_token)
    with torch._dynamo.config.patch(specialize_float=True):  # eps a constant, not a graph input, under dynamic=True
        _run_steps(spec, eager, model, compiled, update_weights, TOKENS if one_token else STATIC_TOKENS)


def _run_steps(spec: gen.Spec, eager, model, compiled, update_weights: bool, tokens_per_call: tuple) -> None:
    for step, tokens in enumerate(tokens_per_call):
        if step == len(tokens_per_call) - 1 and update_weights:
            with torch.no_grad():
                for m in (eager, model):
                    w, rows = m.layers[-1].k_weight()
                    if spec.seed % 2:
                        w.data[rows].mul_(-1.5)
                    else:
                        w.copy_(torch.flip(w, dims=(0,)))
        inputs = tree_map(
            lambda t: t.to(model.caches()[0].device) if isinstance(t, torch.Tensor) else t,
            gen.make_inputs(spec, tokens, seed=100 * spec.seed + step),
        )
        _eager(eager, inputs)
        with torch.no_grad():
            compiled(*inputs)
        try:
            assert_close_for_dtype(model.caches(), eager.caches(), spec.torch_dtype)
        except AssertionError as e:
            raise AssertionError(f"{spec.id}, T = {tokens}, call {step}: compiled caches differ from eager\n{e}") from e


@pytest.mark.parametrize("seed", SEEDS)
def test_eager_writes_the_ops_formula(seed):
    """The generated writer's eager caches are `layer_kv`'s formula in fp64 (to the dtype's tolerance), T > 1 and
    T = 1, and, with RoPE, not the formula of the other rope style: the generator writes what it claims."""
    spec = gen.generate(seed)
    model = gen.build(spec)
    for tokens in (6, 1):
        inputs = gen.make_inputs(spec, tokens, seed)
        want = gen.expected(model, inputs)
        other = gen.expected(model, inputs, is_neox=not spec.is_neox)
        _eager(model, inputs)
        assert_close_for_dtype([c.double() for c in model.caches()], want, spec.torch_dtype)
        if spec.rope != "none":
            error = _max_error(model, other, slice(0, None, 2))
            assert error > 0.1, f"{spec.id}: the K caches match the other rope style too ({error:.1e})"


@pytest.mark.parametrize("seed", quick_first(2, AOT_EAGER_SEEDS))
def test_compiled_lowers_and_matches_eager(seed):
    """`kv_write_op="always"`, `aot_eager`: parity with eager at T > 1 (T = 1 and dynamic shapes too on every 4th
    seed) and after an in-place K weight update; then every compiled graph holds one `multi_linear_kv_write` of all
    layers (the report's reasons otherwise)."""
    torch._dynamo.reset()
    spec = gen.generate(seed)
    capture = CaptureBackend(DsparkConfig(kv_write_op="always"))
    _compiled_matches_eager(spec, capture, update_weights=True, one_token=seed in ONE_TOKEN_SEEDS)
    _assert_lowered(spec, capture)


@pytest.mark.slow
@pytest.mark.parametrize("seed", INDUCTOR_SEEDS)
def test_inductor_codegen_lowers_and_matches_eager(seed):
    """The same through real Inductor codegen (`kv_write_op="always"`, the op's CPU reference as an extern kernel):
    the generated code leaves eager's caches at T > 1 (T = 1 and dynamic shapes too on every 4th seed) and after an
    in-place K weight update, and every graph Inductor compiled holds one `multi_linear_kv_write` of all layers."""
    torch._dynamo.reset()
    spec = gen.generate(seed)
    capture = CaptureBackend(DsparkConfig(kv_write_op="always"), inner="inductor")
    _compiled_matches_eager(spec, capture, update_weights=True, one_token=seed in ONE_TOKEN_SEEDS)
    _assert_lowered(spec, capture)


CUDA_SEEDS = [p for p in SEEDS if gen.generate(p.values[0]).dtype == "bf16"][:24]


@pytest.mark.cuda
@pytest.mark.parametrize("seed", CUDA_SEEDS)
def test_cuda_auto_lowers_through_inductor_and_matches_eager(seed):
    """On CUDA the default `kv_write_op="auto"` lowers the bf16 positives through real Inductor codegen (the op's
    CUDA kernel), with eager's caches at T > 1, T = 1 and after an in-place K weight update."""
    torch._dynamo.reset()
    spec = gen.generate(seed)
    capture = CaptureBackend(DsparkConfig(), inner="inductor")
    _compiled_matches_eager(spec, capture, update_weights=True, device="cuda")
    _assert_lowered(spec, capture)


def _assert_lowered(spec: gen.Spec, capture: CaptureBackend) -> None:
    """Every graph `capture` compiled holds one `multi_linear_kv_write` of all of `spec`'s layers."""
    assert capture.reports, f"{spec.id}: nothing compiled"
    lowered = [op_counts(graph)[OP] for graph in capture.after]
    kept = "\n".join(f"  {why}" for report in capture.reports for why in report.kv_kept)
    assert lowered == [1] * len(capture.after), f"{spec.id}: not lowered ({OP} per graph: {lowered}); kept:\n{kept}"
    for report in capture.reports:
        assert [len(group.layers) for group in report.kv_writes] == [spec.layers], f"{spec.id}:\n{report}"


NEAR_MISS_BASES = {dataclasses.replace(gen.near_miss(name), near_miss="none"): name for name in gen.NEAR_MISSES}


@pytest.mark.parametrize("name", quick_first(1, sorted(NEAR_MISS_BASES.values())))
def test_near_miss_base_lowers(name):
    """The specs the near misses change (each distinct one once, named by a near miss of it) are positives: they
    lower, with eager's caches. So a near miss kept on today's path is kept for its change."""
    torch._dynamo.reset()
    spec = dataclasses.replace(gen.near_miss(name), near_miss="none")
    capture = CaptureBackend(DsparkConfig(kv_write_op="always"))
    _compiled_matches_eager(spec, capture, update_weights=False)
    _assert_lowered(spec, capture)


@NEAR_MISSES
def test_near_miss_is_not_the_ops_formula(name):
    """A near miss's eager caches differ from the closest formula of the op (the spec without the change, whose
    writer does leave that formula): the change matters, so lowering it would be a wrong answer."""
    spec = gen.near_miss(name)
    base = gen.build(dataclasses.replace(spec, near_miss="none"))
    model = gen.build(spec)
    inputs = gen.make_inputs(spec, 6, seed=5)
    for m in (base, model):
        want = gen.expected(m, inputs)
        _eager(m, inputs)
        if m is base:
            assert_close_for_dtype([c.double() for c in m.caches()], want, spec.torch_dtype)
    error = _max_error(model, want, slice(0, None, 2))
    assert error > 0.1, f"{spec.id}: eager is the op's formula after all ({error:.1e})"
    if name == "neox_pairs_gptj_out":
        error = _max_error(model, gen.expected(model, inputs, is_neox=False), slice(0, None, 2))
        assert error > 0.1, f"{spec.id}: eager is the GPT-J formula ({error:.1e})"


@pytest.mark.parametrize("name", quick_first(2, gen.NEAR_MISSES))
def test_near_miss_is_not_lowered(name):
    """A near miss compiled with `kv_write_op="always"` keeps today's path (no op, a reason in the report) and
    eager's caches; `per_layer_width`, whose layer 0 alone is unlike the others, lowers in two ops, layer 0 apart
    (the per-layer fallback)."""
    torch._dynamo.reset()
    spec = gen.near_miss(name)
    capture = CaptureBackend(DsparkConfig(kv_write_op="always"))
    _compiled_matches_eager(spec, capture, update_weights=False)
    assert capture.reports, f"{spec.id}: nothing compiled"
    for graph, report in zip(capture.after, capture.reports, strict=True):
        if name == "per_layer_width":
            layers = sorted(len(w.layers) for w in report.kv_writes)
            assert op_counts(graph)[OP] == 2 and layers == [1, spec.layers - 1], f"{spec.id}\n{report}"
            continue
        assert op_counts(graph)[OP] == 0 and not report.kv_writes, f"{spec.id}: lowered\n{report}"
        assert report.kv_kept, f"{spec.id}: kept without a reason\n{report}"


def test_generator_covers_every_choice():
    """Over the seeds run here, and over those compiled at T = 1 and those through Inductor too, every value of every
    axis occurs (the generator combines them all), the same seed gives the same spec, and the ids are distinct."""
    specs = [gen.generate(seed) for seed in range(N)]
    assert specs == [gen.generate(seed) for seed in range(N)]
    assert len({s.id for s in specs}) == N
    inductor = [p.values[0] for p in INDUCTOR_SEEDS]
    for name, seeds in (("all", range(N)), ("T = 1", ONE_TOKEN_SEEDS), ("Inductor", inductor)):
        seen = {axis: Counter(getattr(specs[seed], axis) for seed in seeds) for axis in gen.AXES}
        missing = {axis: sorted(set(values) - set(seen[axis])) for axis, values in gen.AXES.items()}
        assert not any(missing.values()), f"values never drawn in the {len(seeds)} seeds ({name}): {missing}"
    for size in ("layers", "heads", "head_dim", "hidden"):
        assert len({getattr(s, size) for s in specs}) > 1, size
