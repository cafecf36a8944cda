"""The draft K/V writers of `benchmarks/_spellings.py` (the same math spelled as sglang, HF (Qwen3 and Llama),
DeepSeek/Llama and GPT-J code is written) against the fp64 formula of `dspark::multi_linear_kv_write`; that the dspark
passes lower every one of them to the op (`kv_write_op="always"`, without Inductor codegen), whatever the spelling;
and that each compiles through Inductor codegen too.
"""

import copy
import dataclasses
import importlib
import sys
from pathlib import Path

import helpers
import pytest
import torch
from helpers import quick_first

from dspark_fx import DsparkConfig
from dspark_fx.reference_draft import DraftKVConfig
from dspark_fx.testing import CaptureBackend, assert_close_for_dtype, op_counts

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
spellings = importlib.import_module("_spellings")

OP = "dspark.multi_linear_kv_write"
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
CFG = DraftKVConfig(
    num_layers=3, hidden=64, num_heads=4, num_kv_heads=2, head_dim=16, num_slots=32, max_position=64, eps=1e-5
)


def _inputs(tokens: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random ctx, positions over the whole table (last row included), distinct slots."""
    gen = torch.Generator().manual_seed(seed)
    ctx = torch.randn(tokens, CFG.hidden, generator=gen).to(dtype)
    positions = torch.randint(0, CFG.max_position, (tokens,), generator=gen)
    positions[0] = CFG.max_position - 1
    return ctx, positions, torch.randperm(CFG.num_slots, generator=gen)[:tokens]


def _build(name: str, dtype: torch.dtype, **overrides) -> torch.nn.Module:
    """The spelling's writer, its caches poisoned with random values (slots not written must keep them)."""
    model = spellings.build_spelling(name, dataclasses.replace(CFG, dtype=dtype, **overrides))
    helpers.poison_caches(model)
    return model.requires_grad_(False)


def _caches(model: torch.nn.Module) -> list[torch.Tensor]:
    return [t.clone() for kv in model.caches() for t in kv]


@DTYPES
@pytest.mark.parametrize("qkv_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("name", spellings.SPELLINGS)
def test_eager_writes_the_ops_formula(name, qkv_bias, dtype):
    """Each spelling's eager caches equal the op's formula in fp64 with the spelling's rope style (to the dtype's
    tolerance), and not the formula with the other rope style: the fixtures compute what they claim."""
    model = _build(name, dtype, qkv_bias=qkv_bias)
    ctx, positions, cache_loc = _inputs(9, dtype, seed=1)
    expected = [t for kv in spellings.expected_caches(model, ctx, positions, cache_loc) for t in kv]
    with torch.no_grad():
        model(ctx, positions, cache_loc)
    assert_close_for_dtype([t.double() for t in _caches(model)], expected, dtype)
    swapped = "gptj" if spellings.is_neox(model) else "neox"
    model.cfg = dataclasses.replace(model.cfg, rope_style=swapped)
    wrong = [t for kv in spellings.expected_caches(model, ctx, positions, cache_loc) for t in kv]
    k_error = max((a.double() - e).abs().max().item() for a, e in zip(_caches(model)[::2], wrong[::2], strict=True))
    assert k_error > 0.1, f"{name}: the caches match the other rope style too ({k_error:.1e})"


@DTYPES
@pytest.mark.parametrize("name", quick_first(1, spellings.SPELLINGS))
def test_compiled_matches_eager_and_lowers(name, dtype):
    """`kv_write_op="always"`: the compiled writer leaves eager's caches, and every spelling becomes one
    `multi_linear_kv_write` of all layers per graph (a static and a symbolic token count; the static one above the
    16 rows the lowering evaluates, so views whose sizes are multiples of it are read right too)."""
    torch._dynamo.reset()
    eager = _build(name, dtype)
    compiled_model = copy.deepcopy(eager)
    capture = CaptureBackend(DsparkConfig(kv_write_op="always"))
    compiled = torch.compile(compiled_model, backend=capture)
    with torch.no_grad():
        for seed, tokens in enumerate((21, 12, 7)):
            inputs = _inputs(tokens, dtype, seed)
            eager(*inputs)
            compiled(*inputs)
            assert_close_for_dtype(_caches(compiled_model), _caches(eager), dtype)
    assert len(capture.reports) == 2, "a static and a symbolic T"
    lowered = [op_counts(graph)[OP] for graph in capture.after]
    assert lowered == [1] * len(capture.after), f"{name} is not lowered:\n{capture.report}"
    for report in capture.reports:
        (group,) = report.kv_writes
        assert len(group.layers) == CFG.num_layers and not report.kv_kept, str(report)


@pytest.mark.parametrize("name", spellings.SPELLINGS)
def test_hand_stacked_variant_writes_eagers_caches(name):
    """The write benchmark's hand-stacked baseline (the layers' K/V rows in one weight, one GEMM, one batched norm
    where the layers have one, one RoPE) leaves the spelling's eager caches, bf16: the baseline the lowered write is
    measured against computes the same write."""
    dspark_write = importlib.import_module("dspark_write")
    eager = _build(name, torch.bfloat16, qkv_bias=True)
    stacked_model = copy.deepcopy(eager)
    hand_stacked = dspark_write.HandStacked(stacked_model)
    inputs = _inputs(9, torch.bfloat16, seed=3)
    with torch.no_grad():
        eager(*inputs)
        hand_stacked(*inputs)
    assert_close_for_dtype(_caches(stacked_model), _caches(eager), torch.bfloat16)


def _matches_eager_through_codegen(eager: torch.nn.Module, kv_write_op: str) -> None:
    """`dspark_backend` with `kv_write_op` through real Inductor codegen, bf16, T = 1, a static T above the 16 rows
    the lowering evaluates, then a symbolic T: the compiled copy leaves eager's caches."""
    from dspark_fx import make_backend

    torch._dynamo.reset()
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, backend=make_backend({"kv_write_op": kv_write_op}))
    with torch.no_grad():
        for seed, tokens in enumerate((1, 21, 9)):
            inputs = _inputs(tokens, torch.bfloat16, seed)
            eager(*inputs)
            compiled(*inputs)
            assert_close_for_dtype(_caches(compiled_model), _caches(eager), torch.bfloat16)


@pytest.mark.slow
@pytest.mark.parametrize("name", spellings.SPELLINGS)
def test_every_spelling_compiles_through_inductor_codegen(name):
    """`dspark_backend` with `kv_write_op="always"` through real Inductor codegen (not `aot_eager`), bf16, T = 1 and
    T > 1: whichever path a spelling takes (the op, or the fused GEMM with batched norm/RoPE), the generated code runs
    and leaves eager's caches."""
    _matches_eager_through_codegen(_build(name, torch.bfloat16), "always")


@pytest.mark.slow
def test_never_lowered_batched_rope_leaves_in_the_cache_dtype():
    """Not lowered (`kv_write_op="never"`), the reference spelling's batched norm/RoPE ends in fp32 halves cast to
    bf16 for the cache writes: the pass emits the cast halves' `cat`, so the batched value the writes read is bf16
    (Inductor stores it once, instead of fp32 rows each write casts); the generated code leaves eager's caches."""
    torch._dynamo.reset()
    eager = _build("reference", torch.bfloat16)
    capture = CaptureBackend(DsparkConfig(kv_write_op="never"))
    with torch.no_grad():
        torch.compile(copy.deepcopy(eager), backend=capture)(*_inputs(7, torch.bfloat16, 0))
    graph = capture.after[0]
    writes = [n for n in graph.nodes if n.target is torch.ops.aten.index_put.default]
    assert writes and op_counts(graph)["dspark.multi_linear"] == 1, str(capture.report)
    read = set()
    for write in writes:
        value = write.args[2]
        while value.target is not torch.ops.aten.select.int:  # the per-branch views of the batched value
            value = value.args[0]
        read.add(value.args[0])

    def below_views(value):
        while value.target in (torch.ops.aten.clone.default, torch.ops.aten.view.default):
            value = value.args[0]
        return value

    sources = [below_views(v) for v in read]
    cats = [v for v in sources if v.target is torch.ops.aten.cat.default]
    assert cats, [v.format_node() for v in sources]  # K: the RoPE halves' cat (V: the GEMM block)
    assert all(v.meta["val"].dtype == torch.bfloat16 for v in cats), "the batched halves are cast before their cat"
    _matches_eager_through_codegen(eager, "never")


def _never_lowered(graph: torch.fx.Graph) -> tuple[torch.fx.Graph, object]:
    """The passes with `kv_write_op="never"` on a copy of a pre-pass graph: (the graph after, the report)."""
    from dspark_fx.passes.horizontal import fuse_kv_branches

    graph = copy.deepcopy(graph)
    return graph, fuse_kv_branches(graph, DsparkConfig(kv_write_op="never"), None)


@pytest.mark.usefixtures("builds_cuda_library")
@pytest.mark.parametrize("name", spellings.SPELLINGS)
def test_never_lowered_writes_keep_per_branch_norm_and_rope_on_cuda(name):
    """Not lowered, each spelling's K/V GEMMs still fuse into one `multi_linear`. On CPU the branches' norm/RoPE run
    batched; on CUDA (the same graph, its values fake CUDA tensors) each branch keeps its own ops, which Inductor
    fuses into the branch's cache write, and the report says why."""
    from dspark_fx.passes.batch_group import WRITTEN_PER_BRANCH

    torch._dynamo.reset()
    capture = CaptureBackend(DsparkConfig(kv_write_op="never"))
    with torch.no_grad():
        torch.compile(_build(name, torch.bfloat16), backend=capture)(*_inputs(7, torch.bfloat16, 0))
    before = capture.before[0]
    on_cpu, cpu_report = _never_lowered(before)
    helpers.as_fake_cuda(before)
    on_cuda, cuda_report = _never_lowered(before)
    for graph in (on_cpu, on_cuda):
        assert op_counts(graph)["dspark.multi_linear"] == 1 and not op_counts(graph)[OP]
    (cpu_group,), (cuda_group,) = cpu_report.groups, cuda_report.groups
    assert cpu_group.classes and not cuda_group.classes, f"CPU:\n{cpu_report}\nCUDA:\n{cuda_report}"
    assert {u.reason for u in cuda_group.unbatched} == {WRITTEN_PER_BRANCH}, str(cuda_report)
    assert len(cuda_group.unbatched) == len(cuda_group.branches)
    norms = [op_counts(g)["aten.rsqrt"] + op_counts(g)["aten._fused_rms_norm"] for g in (on_cpu, on_cuda)]
    has_norm = spellings.build_spelling(name, CFG).kv_params()[0].norm_weight is not None
    assert norms == ([1, CFG.num_layers] if has_norm else [0, 0]), norms


@pytest.mark.usefixtures("builds_cuda_library")
def test_batched_values_read_by_more_than_cache_writes_stay_batched_on_cuda():
    """On CUDA only classes whose values all leave into cache writes keep per-branch ops: normed projections that
    the model returns still run batched."""

    class TwoNormedProjections(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(64, 32, bias=False), torch.nn.Linear(64, 32, bias=False)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return tuple(torch.nn.functional.rms_norm(p(x).view(-1, 2, 16), (16,), eps=1e-6) for p in (self.a, self.b))

    torch._dynamo.reset()
    capture = CaptureBackend(DsparkConfig(kv_write_op="never"))
    with torch.no_grad():
        torch.compile(TwoNormedProjections().to(torch.bfloat16), backend=capture)(torch.randn(5, 64).bfloat16())
    before = capture.before[0]
    helpers.as_fake_cuda(before)
    _, report = _never_lowered(before)
    (group,) = report.groups
    assert len(group.classes) == 1 and not group.unbatched, str(report)


def _matches_eager_on_cuda(name: str, config: DsparkConfig) -> CaptureBackend:
    """The spelling on CUDA through real Inductor codegen with `config`, bf16, T = 1 and T > 1: the compiled copy
    leaves eager's caches. Returns the capture (graphs and reports)."""
    torch._dynamo.reset()
    eager = _build(name, torch.bfloat16).to("cuda")
    compiled_model = copy.deepcopy(eager)
    capture = CaptureBackend(config, inner="inductor")
    compiled = torch.compile(compiled_model, backend=capture)
    with torch.no_grad():
        for seed, tokens in enumerate((1, 9, 17)):
            inputs = [t.to("cuda") for t in _inputs(tokens, torch.bfloat16, seed)]
            eager(*inputs)
            compiled(*inputs)
            assert_close_for_dtype(_caches(compiled_model), _caches(eager), torch.bfloat16)
    return capture


@pytest.mark.cuda
@pytest.mark.parametrize("name", spellings.SPELLINGS)
def test_never_lowered_spellings_match_eager_through_codegen_on_cuda(name):
    """`kv_write_op="never"` on CUDA through real Inductor codegen: the fused GEMM with per-branch norm/RoPE leaves
    eager's caches, bf16, T = 1 and T > 1, and no branch runs batched."""
    from dspark_fx.passes.batch_group import WRITTEN_PER_BRANCH

    capture = _matches_eager_on_cuda(name, DsparkConfig(kv_write_op="never"))
    for report in capture.reports:
        (group,) = report.groups
        assert not group.classes and {u.reason for u in group.unbatched} == {WRITTEN_PER_BRANCH}, str(report)


@pytest.mark.cuda
@pytest.mark.parametrize("name", spellings.SPELLINGS)
def test_every_spelling_lowers_on_cuda_with_auto(name):
    """On CUDA, the default `kv_write_op="auto"` through real Inductor codegen: every spelling becomes one
    `multi_linear_kv_write` (the op's CUDA kernel) and leaves eager's caches, bf16, T = 1 and T > 1."""
    capture = _matches_eager_on_cuda(name, DsparkConfig())
    lowered = [op_counts(graph)[OP] for graph in capture.after]
    assert lowered == [1] * len(capture.after), f"{name} is not lowered on CUDA:\n{capture.report}"
