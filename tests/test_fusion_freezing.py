"""GEMM fusion under Inductor freezing (`torch._inductor.config.freezing = True`): the weights are frozen
`get_attr` constants, transposed (`[K, N]`) and, with Inductor's concat-linear pattern, concatenated; the fusion
reads them in the `[N, K]` layout without per-call copies and matches eager."""

import copy
import operator
import re

import pytest
import torch
import torch.fx as fx
from helpers import draft_inputs, small_config
from torch._inductor.utils import run_and_get_code
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from dspark_fx import make_backend
from dspark_fx.passes import horizontal
from dspark_fx.passes.frozen import expose_frozen_weights
from dspark_fx.passes.gemm_branches import match_gemm
from dspark_fx.reference_draft import DraftKVWriter
from dspark_fx.testing import CaptureBackend, assert_close_for_dtype, op_counts

aten = torch.ops.aten

# CPU stand-in for CUDA: on CPU, freezing would replace the GEMMs by mkldnn-packed linears (`cpp.weight_prepack`),
# and concatenates GEMM weights only with `cpp.enable_concat_linear` (on CUDA it always does)
FREEZING = {"freezing": True, "cpp.weight_prepack": False}


def _frozen_gemm_module(weight_t: torch.Tensor, bias: torch.Tensor | None, split: list[int] | None) -> fx.GraphModule:
    """A graph as freezing leaves it: `mm(x, c)` / `addmm(b, x, c)` on constants, optionally a column split."""
    root = torch.nn.Module()
    root.register_buffer("_frozen_param0", weight_t)
    graph = fx.Graph()
    x = graph.placeholder("x")
    c = graph.get_attr("_frozen_param0")
    if bias is None:
        y = graph.call_function(aten.mm.default, (x, c))
    else:
        root.register_buffer("_frozen_param1", bias)
        y = graph.call_function(aten.addmm.default, (graph.get_attr("_frozen_param1"), x, c))
    if split is None:
        graph.output((y,))
    else:
        pieces = graph.call_function(aten.split_with_sizes.default, (y, split, 1))
        graph.output(tuple(graph.call_function(operator.getitem, (pieces, i)) for i in range(len(split))))
    return fx.GraphModule(root, graph)


def _propagate(gm: fx.GraphModule, x: torch.Tensor) -> None:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    FakeTensorProp(gm, mode).propagate(mode.from_tensor(x))


def _constants(gm: fx.GraphModule) -> dict[str, torch.Tensor]:
    return {n.target: getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"}


def test_transposed_view_constant_becomes_its_rows_without_a_copy():
    weight = torch.randn(24, 16)  # [N, K] parameter; freezing folds permute(weight) into a [K, N] view
    gm = _frozen_gemm_module(weight.t(), None, None)
    x = torch.randn(5, 16)
    _propagate(gm, x)
    expose_frozen_weights(gm.graph).settle(gm.graph)
    gm.recompile()
    (gemm,) = [n for n in gm.graph.nodes if n.target is aten.mm.default]
    branch = match_gemm(gemm)
    assert not isinstance(branch, str) and branch is not None, branch
    assert branch.weight.op == "get_attr" and (branch.row_start, branch.row_count) == (0, 24)
    rows = getattr(gm, branch.weight.target)
    assert rows.shape == (24, 16) and rows.stride() == (16, 1)
    assert rows.data_ptr() == weight.data_ptr()  # a view of the frozen weight, not a copy
    assert list(_constants(gm)) == [branch.weight.target]  # the [K, N] constant is gone
    torch.testing.assert_close(gm(x)[0], x @ weight.t())


@pytest.mark.parametrize("with_bias", [False, True])
def test_concatenated_constant_is_split_back_into_one_gemm_per_piece(with_bias):
    weights = [torch.randn(n, 16) for n in (8, 12, 8)]
    biases = [torch.randn(n) for n in (8, 12, 8)]
    cat_t = torch.cat([w.t() for w in weights], 1)  # what freezing's concat-linear folds to: [K, sum N] contiguous
    bias = torch.cat(biases) if with_bias else None
    gm = _frozen_gemm_module(cat_t, bias, [8, 12, 8])
    x = torch.randn(5, 16)
    _propagate(gm, x)
    expose_frozen_weights(gm.graph).settle(gm.graph)
    gm.graph.lint()
    gm.recompile()
    counts = op_counts(gm)
    gemm_op = "aten.addmm" if with_bias else "aten.mm"
    assert counts[gemm_op] == 3 and counts["aten.split_with_sizes"] == 0, gm.graph
    branches = [match_gemm(n) for n in gm.graph.nodes if n.target in (aten.mm.default, aten.addmm.default)]
    assert [(b.row_start, b.row_count) for b in branches] == [(0, 8), (8, 12), (20, 8)]
    assert len({b.weight for b in branches}) == 1
    rows = getattr(gm, branches[0].weight.target)
    assert rows.shape == (28, 16) and rows.stride() == (16, 1)
    assert "_frozen_param0" not in _constants(gm) and not hasattr(gm, "_frozen_param0")  # no second copy kept
    expected = [x @ w.t() + (b if with_bias else 0) for w, b in zip(weights, biases, strict=True)]
    for got, want in zip(gm(x), expected, strict=True):
        torch.testing.assert_close(got, want)


def _frozen_compile(cfg, concat_linear: bool, tokens=(7, 1), kv_write_op="never") -> tuple[CaptureBackend, str]:
    """Compile a draft with freezing, run it on `tokens` rows and check its caches against eager; the capture and
    the code Inductor generated for the first call."""
    torch._dynamo.reset()
    eager = DraftKVWriter(cfg)
    model = copy.deepcopy(eager)
    capture = CaptureBackend({"kv_write_op": kv_write_op}, inner="inductor")
    with torch.no_grad(), torch._inductor.config.patch({**FREEZING, "cpp.enable_concat_linear": concat_linear}):
        compiled = torch.compile(model, backend=capture)
        codes = []
        for seed, t in enumerate(tokens):
            args = draft_inputs(cfg, t, seed=seed + 1)
            eager(*args)
            codes += run_and_get_code(compiled, *args)[1]
            assert_close_for_dtype([c for kv in model.caches() for c in kv], [c for kv in eager.caches() for c in kv])
    return capture, codes[0]


@pytest.mark.slow
@pytest.mark.parametrize("concat_linear", [False, True], ids=["transposed_views", "concatenated"])
def test_frozen_draft_fuses_with_inductor_and_matches_eager(concat_linear):
    cfg = small_config(num_layers=5, qkv_bias=True, dtype=torch.bfloat16)
    capture, code = _frozen_compile(cfg, concat_linear)
    (weights,) = re.findall(r"dspark\.multi_linear\.default\(\w+, \[([^]]*)\]", code)
    assert all(w.strip().startswith("_frozen_param") for w in weights.split(",")), weights  # no per-call copy
    capture.assert_fused(n_groups=1, n_branches=[5])
    for report, after in zip(capture.reports, capture.after, strict=True):
        assert report.groups[0].unbatched == [], report
        counts = op_counts(after)
        assert counts["dspark.multi_linear"] == 1 and counts["aten.mm"] + counts["aten.addmm"] == 0, after
        (fused,) = [n for n in after.nodes if n.target is torch.ops.dspark.multi_linear.default]
        assert all(w.op == "get_attr" for w in fused.args[1]), fused.args[1]  # the frozen weights, read as is


@pytest.mark.slow
@pytest.mark.parametrize("concat_linear", [False, True], ids=["transposed_views", "concatenated"])
def test_frozen_draft_lowers_its_kv_writes_reading_the_frozen_constants(concat_linear):
    """Under freezing the KV writes lower too: the op reads the frozen weights, norm weights and table (get_attr
    constants) in place; real Inductor codegen, caches equal to eager at T = 7 and T = 1."""
    cfg = small_config(num_layers=3, qkv_bias=True, dtype=torch.bfloat16)
    capture, code = _frozen_compile(cfg, concat_linear, kv_write_op="always")
    assert "dspark.multi_linear_kv_write" in code
    for report, after in zip(capture.reports, capture.after, strict=True):
        (group,) = report.kv_writes
        assert len(group.layers) == 3 and not report.kv_kept, report
        (op,) = [n for n in after.nodes if n.target is torch.ops.dspark.multi_linear_kv_write.default]
        constants = [*op.args[1], *op.args[4], *op.args[7], *op.args[9]]
        assert all(c.op == "get_attr" for c in constants), constants


@pytest.mark.slow
@pytest.mark.parametrize("config", [{"min_branches": 10}, None], ids=["fewer-than-min-branches", "cpu-default"])
def test_frozen_graph_the_pass_leaves_as_it_came_compiles(config, monkeypatch):
    """Where nothing fuses, the pass restores the graph as it came: the `[K, N]` constants its frozen-weight rewrite
    had replaced are read again, so they must still be there (the compile failed in Inductor's lint before)."""
    if config is None:  # GEMM groups do not fuse on CPU by default
        monkeypatch.setattr(horizontal, "GROUP_GEMM_DEVICES", ("cuda",))
        config = {}
    torch._dynamo.reset()
    cfg = small_config(num_layers=3)
    eager = DraftKVWriter(cfg)
    model = copy.deepcopy(eager)
    capture = CaptureBackend({**config, "kv_write_op": "never"}, inner="inductor")
    with torch.no_grad(), torch._inductor.config.patch(FREEZING):
        args = draft_inputs(cfg, 7, seed=1)
        eager(*args)
        torch.compile(model, backend=capture)(*args)
    assert_close_for_dtype([c for kv in model.caches() for c in kv], [c for kv in eager.caches() for c in kv])
    assert not capture.report.groups


@pytest.mark.slow
def test_a_second_frozen_model_of_the_same_shapes_computes_with_its_own_weights(tmp_path, monkeypatch):
    """Inductor's cache keys frozen parameters by their shapes; the pass's rewrite adds constants to the graph
    module, which a cache entry would hold by value. So the pass opts out of the cache under freezing (`uuid()` is
    None) and a second model of the same shapes, other weights, is compiled for itself."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    for seed in (0, 1):
        torch._dynamo.reset()
        cfg = small_config(num_layers=3, seed=seed)
        eager = DraftKVWriter(cfg)
        model = copy.deepcopy(eager)
        patch = {**FREEZING, "fx_graph_cache": True, "force_disable_caches": False}
        with torch.no_grad(), torch._inductor.config.patch(patch):
            args = draft_inputs(cfg, 7, seed=1)
            eager(*args)
            torch.compile(model, backend=make_backend({"kv_write_op": "never"}))(*args)
        assert_close_for_dtype([c for kv in model.caches() for c in kv], [c for kv in eager.caches() for c in kv])
