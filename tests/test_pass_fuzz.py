"""Differential fuzz of the horizontal fusion: random multi-branch models (`fuzz_models.py`) compiled with the
pass against eager — outputs and cache buffers at T = 1, 5 and 9, and again after in-place weight updates.

    DSPARK_FUZZ_MODELS=1000 pytest tests/test_pass_fuzz.py    # more models (default 50, seeds 0..49)
    DSPARK_FUZZ_SEED=5000                                       # another seed range
    DSPARK_FUZZ_INNER=inductor                                  # Inductor codegen instead of eager ATen (slow)
    DSPARK_FUZZ_KIND_MODELS=100                                 # more models of each case kind (default 8)
    python tests/fuzz_models.py 17                              # the spec of a failing seed

The pass must never change a result, never fail a compile that would work without it, and never fall back for
a reason that hides a bug: a rule that crashed ("unexpected") or that emitted a value of the wrong shape (caught
by the rule check) fails here. The models must also exercise the fusion: most fuse a GEMM group, and the batched
classes cover the main op kinds. And the comparisons must check something: a compared tensor whose eager values all
stay near the tolerance would pass even if the compiled one were zero, so each must reach `SIGNAL` tolerances at one
step at least (only a tiny one, a relu of one value or a full sum, may stay near 0 by chance).

Case kinds (`fuzz_models.CASE_KINDS`) run the same models with something around them: a composed user post-grad
pass that makes pointwise ops write through `.out` ops into fresh buffers (buffers of one shape have the same
arguments and must never be merged), and a custom op that reads fused and batched values as dense memory (it must
get them in the eager strides).
"""

from __future__ import annotations

import copy
import functools
import os
from collections import Counter
from dataclasses import dataclass

import pytest
import torch
from fuzz_models import CASE_KINDS, cast_inputs, describe, make_case, make_cast_case, make_kind_case, update_weights
from helpers import quick_first
from torch import nn
from torch.utils._pytree import tree_leaves

from dspark_fx import DsparkConfig
from dspark_fx.passes.batching import RULE_CHECK
from dspark_fx.testing import TOLERANCES, CaptureBackend, assert_close_for_dtype, op_counts

N_MODELS = int(os.environ.get("DSPARK_FUZZ_MODELS", "50"))
FIRST_SEED = int(os.environ.get("DSPARK_FUZZ_SEED", "0"))
INNER = os.environ.get("DSPARK_FUZZ_INNER", "aot_eager")
SEEDS = range(FIRST_SEED, FIRST_SEED + N_MODELS)
STEPS = (1, 5, 9, "update", 5, 1)  # token counts; "update": in-place update of every parameter
SIGNAL = 10  # in tolerances: the largest |eager value| each compared tensor must reach, at one step at least
TINY = 4  # elements: a tensor this small may stay near 0 by chance; the case as a whole must still reach SIGNAL


@dataclass(frozen=True)
class Outcome:
    groups: int
    batched_ops: tuple[str, ...]  # one entry per batched op, over all classes and graphs
    reasons: tuple[str, ...]  # why branches (or some of the ops of a class) kept their own ops
    kind_ops: int = 0  # ops of the case kind in the compiled graphs (ops written through `.out`, dense reads)


@functools.cache
def run_case(seed: int, kind: str = "plain") -> Outcome:
    """Compile the model of `seed` (as case kind `kind`, `fuzz_models.CASE_KINDS`) with the pass and compare it
    with eager at every step; raise on a mismatch."""
    case, user_pass = (make_case(seed), None) if kind == "plain" else make_kind_case(seed, kind)
    eager, model = case.model, copy.deepcopy(case.model)
    torch._dynamo.reset()
    capture = CaptureBackend(inner=INNER)
    compiled = torch.compile(model, backend=capture, fullgraph=True)
    signal: dict[str, tuple[float, int]] = {}  # compared tensor -> (largest |eager value| in tolerances, size)
    patch = torch._inductor.config.patch(emulate_precision_casts=True, post_grad_custom_post_pass=user_pass)
    with torch.no_grad(), patch:  # emulate_precision_casts: Inductor rounds like eager
        for step, tokens in enumerate(STEPS):
            if tokens == "update":
                update_weights(eager, seed)
                update_weights(model, seed)
                continue
            inputs = case.inputs(tokens, seed=step)
            actual, expected = compiled(*inputs), eager(*inputs)
            try:
                assert_close_for_dtype(actual, expected)
                assert_close_for_dtype(model.caches(), eager.caches())
            except AssertionError as err:
                raise AssertionError(f"step {step} (T={tokens}): {err}\n{describe(case.spec)}") from None
            _record_signal(signal, tokens, expected, eager)
    low = {name: peak for name, (peak, _) in signal.items() if peak < SIGNAL}
    if len(low) == len(signal) or any(signal[name][1] > TINY for name in low):
        low = {name: f"{peak:.3g}" for name, peak in low.items()}
        raise AssertionError(
            f"the comparisons check almost nothing: largest |eager value| in tolerances {low}, under {SIGNAL} "
            f"(only tensors of up to {TINY} elements may be, not all of them)\n{describe(case.spec)}"
        )
    report = capture.report
    return Outcome(
        groups=report.n_groups,
        batched_ops=tuple(op for g in report.groups for c in g.classes for op in c.ops),
        reasons=tuple(u.reason for g in report.groups for u in g.unbatched)
        + tuple(why for g in report.groups for c in g.classes for why in c.kept),
        kind_ops=user_pass.rewritten
        if user_pass
        else sum(op_counts(g)["dspark_fuzz.dense_rows"] for g in capture.before),
    )


def _record_signal(signal: dict[str, tuple[float, int]], tokens: int, outputs: object, eager: nn.Module) -> None:
    """Fold one step's eager outputs and caches into `signal`: outputs by token count and position (which outputs
    there are depends on T), caches by name."""
    named = [(f"output {i} at T={tokens}", t) for i, t in enumerate(tree_leaves(outputs))]
    named += [(name, t) for name, t in eager.named_buffers() if "cache" in name]
    for name, t in named:
        peak = t.abs().max().item() / TOLERANCES[t.dtype] if t.numel() else 0.0
        old_peak, old_size = signal.get(name, (0.0, 0))
        signal[name] = max(old_peak, peak), max(old_size, t.numel())


@pytest.mark.parametrize("seed", quick_first(2, SEEDS))
def test_compiled_model_matches_eager(seed):
    outcome = run_case(seed)
    bugs = [why for why in outcome.reasons if "unexpected" in why or RULE_CHECK in why]
    assert not bugs, f"seed {seed}: a batching rule failed: {bugs}\n{describe(make_case(seed).spec)}"


@pytest.mark.slow
def test_fuzz_exercises_the_fusion():
    if len(SEEDS) < 50:
        pytest.skip("coverage is asserted over at least 50 models")
    outcomes = [run_case(seed) for seed in SEEDS]
    fused = sum(o.groups > 0 for o in outcomes)
    batched = sum(bool(o.batched_ops) for o in outcomes)
    assert fused >= 0.7 * len(outcomes), f"only {fused}/{len(outcomes)} models fused a GEMM group"
    assert batched >= 0.6 * len(outcomes), f"only {batched}/{len(outcomes)} models batched a class"
    ops = Counter(op for o in outcomes for op in o.batched_ops)
    kinds = (
        "aten.mul", "aten.rsqrt", "aten.mean", "aten.sum", "aten.var", "aten.view", "aten.permute", "aten.expand",
        "aten.cat", "aten.where", "aten.index", "getitem",
    )  # fmt: skip
    missing = [op for op in kinds if not ops[op]]
    assert not missing, f"no model batched {missing}; batched: {dict(ops)}"


# ---- KV writes through casts -----------------------------------------------------------------------------------------

CAST_SEEDS = range(FIRST_SEED, FIRST_SEED + max(8, N_MODELS // 4))
ROUNDING = ("fp8", "fp16", "bf16")  # casts that round where the op would not: never lowered


@pytest.mark.parametrize("seed", quick_first(1, CAST_SEEDS))
def test_kv_writes_through_casts_match_eager(seed):
    """A fake quantization or a dtype round trip in the K/V branch, with the lowering forced on CPU
    (`kv_write_op="always"`): the caches match eager (NaN and inf where eager has them), lowered or not, and a
    rounding cast is never lowered."""
    eager = make_cast_case(seed)
    spec, model = eager.spec, copy.deepcopy(eager)
    torch._dynamo.reset()
    capture = CaptureBackend(DsparkConfig(kv_write_op="always"), inner=INNER)
    compiled = torch.compile(model, backend=capture, fullgraph=True)
    tol = TOLERANCES[spec.dtype]
    with torch.no_grad():
        for step, tokens in enumerate((1, 5, 9)):
            inputs = cast_inputs(spec, tokens, step)
            eager(*inputs)
            compiled(*inputs)
            for got, want in zip(model.caches(), eager.caches(), strict=True):
                torch.testing.assert_close(got, want, rtol=tol, atol=tol, equal_nan=True, msg=lambda m: f"{spec}: {m}")
    report = capture.report
    assert not any("unexpected" in str(why) for why in report.kv_kept), report.kv_kept
    if spec.kind in ROUNDING:
        assert not report.kv_writes, f"{spec}: a rounding cast was lowered\n{report}"


# Case kinds (`fuzz_models.CASE_KINDS`): the models of the first KIND_MODELS seeds with a composed user pass that
# writes through `.out` ops into fresh buffers, or with a custom op reading branch values as dense memory.
KIND_MODELS = int(os.environ.get("DSPARK_FUZZ_KIND_MODELS", "8"))
KIND_SEEDS = range(FIRST_SEED, FIRST_SEED + KIND_MODELS)


@pytest.mark.parametrize("seed", quick_first(1, KIND_SEEDS))
@pytest.mark.parametrize("kind", CASE_KINDS)
def test_case_kind_matches_eager(kind, seed):
    outcome = run_case(seed, kind)
    bugs = [why for why in outcome.reasons if "unexpected" in why or RULE_CHECK in why]
    assert not bugs, f"seed {seed} ({kind}): a batching rule failed: {bugs}\n{describe(make_case(seed).spec)}"


@pytest.mark.slow
@pytest.mark.parametrize("kind", CASE_KINDS)
def test_case_kind_exercises_the_fusion(kind):
    """Most cases of a kind fuse a GEMM group and have the kind's ops in their graphs."""
    outcomes = [run_case(seed, kind) for seed in KIND_SEEDS]
    both = sum(o.groups > 0 and o.kind_ops > 0 for o in outcomes)
    assert both >= 0.5 * len(outcomes), f"{kind}: only {both}/{len(outcomes)} cases fused with the kind's ops"
