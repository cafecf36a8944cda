"""`dspark_fx.explain()`: compiles the inspected model in isolation (no Dynamo reset, no recompile of anything
compiled before), accepts functions and keyword inputs, names weights in every line, runs under the caller's grad
mode (as the compile would) and restores state."""

import copy
import re
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from helpers import draft_inputs, mark_tokens_dynamic, small_config
from hf_models import HFStyleDraft, HFStyleKVWriter
from torch import nn
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.testing import CompileCounter

from dspark_fx import explain
from dspark_fx.reference_draft import DraftKVWriter
from dspark_fx.report import KVKeptReason
from dspark_fx.testing import CaptureBackend, compile_counts, op_counts

counters = torch._dynamo.utils.counters
ATEN_NODE = re.compile(r"(add)?mm(_\d+)?|primals_\d+|arg\d+_\d+")


@pytest.mark.slow
def test_explain_does_not_recompile_models_compiled_before():
    """Model A (compiled) and model B (explained) share their forward code: explaining B must leave A's compiled
    code, and Dynamo's cache entries on that forward, as they were."""
    torch._dynamo.reset()
    cfg = small_config()
    model_a, model_b = DraftKVWriter(cfg), DraftKVWriter(cfg)
    counter = CompileCounter()
    compiled_a = torch.compile(model_a, backend=counter)
    args = draft_inputs(cfg, 6)
    with torch.no_grad():
        compiled_a(*args)
    entries = len(_debug_get_cache_entry_list(DraftKVWriter.forward.__code__))
    assert counter.frame_count == 1
    for tokens in (6, 9):
        report = explain(model_b, *draft_inputs(cfg, tokens))
        assert report.n_branches == [cfg.num_layers]
    with compile_counts() as counts, torch.no_grad():
        compiled_a(*args)
    assert counter.frame_count == 1 and counts["frames"] == 0, "explain() made a compiled model recompile"
    assert len(_debug_get_cache_entry_list(DraftKVWriter.forward.__code__)) == entries
    report = explain(compiled_a, *args)  # the compiled model itself
    assert report.n_branches == [cfg.num_layers]
    with torch.no_grad():
        compiled_a(*args)
    assert counter.frame_count == 1


draft_lins = nn.ModuleList(nn.Linear(16, 16, bias=False) for _ in range(3))
dequant_weight = torch.randn(16, 16)


def _draft_function(x, *, scale, cache):
    cache.add_(1.0)  # a mutated input: explain() restores it
    return [lin(x) * scale for lin in draft_lins], F.linear(x, dequant_weight * 2)


def test_explain_accepts_a_function_and_keyword_inputs():
    x, cache = torch.randn(4, 16), torch.zeros(3)
    report = explain(_draft_function, x, scale=2.0, cache=cache)
    assert report.n_branches == [3]
    assert report.groups[0].branches == [f"draft_lins.{i}.weight[0:16]" for i in range(3)]
    assert [r.node for r in report.rejected] == ["dequant_weight"]
    assert torch.equal(cache, torch.zeros(3)), "explain() must leave its inputs as they were"


class _KeywordModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x, *, scale=1.0):
        self.calls += 1
        return [lin(x) * scale for lin in self.lins]


def test_explain_accepts_module_keyword_inputs_and_restores_state():
    torch._dynamo.reset()
    model = _KeywordModule()
    report = explain(model, torch.randn(4, 16), scale=3.0)
    assert report.groups[0].branches == ["lins.0.weight[0:16] + bias", "lins.1.weight[0:16] + bias"]
    assert model.calls.item() == 0 and "forward" not in vars(model)
    assert explain(model.forward, torch.randn(4, 16), scale=3.0).n_branches == [2]
    with pytest.raises(TypeError, match=r"explain: model must be an nn\.Module or a function"):
        explain(3, torch.randn(4, 16))


class _Quantized(nn.Module):
    """Two fusable GEMMs, a dequantized one, and a lone one (rejected with skinny linears off)."""

    def __init__(self):
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(16, 16, bias=False) for _ in range(2))
        self.register_buffer("w_int8", torch.randint(-127, 128, (16, 16), dtype=torch.int8))
        self.register_buffer("w_scale", torch.rand(16) / 127)
        self.bias = nn.Parameter(torch.randn(16))
        self.lone = nn.Linear(16, 16)

    def forward(self, x, x2):
        dequantized = F.linear(x, self.w_int8.to(x.dtype) * self.w_scale[:, None], self.bias)
        return [lin(x) for lin in self.lins], dequantized, self.lone(x2)


def test_every_report_line_names_weights_not_aten_nodes():
    counters.clear()
    report = explain(_Quantized(), torch.randn(4, 16), torch.randn(4, 16), config={"skinny_linears": False})
    nodes = [r.node for r in report.rejected]
    assert nodes == ["w_int8, w_scale", "lone.weight[0:16] + bias"], report
    assert not any(ATEN_NODE.fullmatch(part) for node in nodes for part in node.split(", ")), report
    assert "addmm" not in str(report) and "mm_" not in str(report)
    assert not counters["dspark_fx"], "explain() must leave the counters as they were"


def test_explain_runs_under_the_callers_grad_mode_and_says_why_nothing_is_lowered():
    """With grad enabled the compile makes a training graph, which returns the new cache values instead of writing
    them: nothing to lower. explain() must say what the compile does, and both must give the reason."""
    cfg = small_config()
    model = DraftKVWriter(cfg)
    args = draft_inputs(cfg, 6)
    config = {"kv_write_op": "always"}
    with torch.no_grad():
        assert len(explain(model, *args, config=config).kv_writes) == 1
    report = explain(model, *args, config=config)
    assert not report.kv_writes and report.n_branches == [cfg.num_layers], report
    (why,) = map(str, report.kv_kept)
    assert "training graph" in why and "k_cache_0" in why and "torch.no_grad()" in why, why
    torch._dynamo.reset()
    capture = CaptureBackend(config)
    torch.compile(copy.deepcopy(model), backend=capture)(*args)
    assert capture.report.kv_kept == report.kv_kept and not capture.report.kv_writes


class _ReturnsUpdatedCaches(nn.Module):
    """Two projections whose caches (passed in) are updated out of place: `cache.index_put((loc,), k)` returned."""

    def __init__(self):
        super().__init__()
        self.k_proj = nn.ModuleList(nn.Linear(8, 8, bias=False) for _ in range(2))

    def forward(self, x, loc, caches):
        return [c.index_put((loc,), p(x)) for c, p in zip(caches, self.k_proj, strict=True)]


def test_caches_updated_out_of_place_are_not_called_a_training_graph():
    """Under no_grad the graph returns the updated caches because the model does (an out-of-place index_put), not
    because AOTAutograd writes them after a training graph: the RETURNED reason, naming both caches and saying how
    to write them in place. With grad enabled and only the input requiring grad (no parameter), a training graph,
    said as such."""
    model = _ReturnsUpdatedCaches()
    x, loc = torch.randn(2, 8), torch.tensor([0, 3])
    caches = [torch.randn(4, 8) for _ in range(2)]
    config = {"fuse_on_cpu": True}
    with torch.no_grad():
        (why,) = explain(model, x, loc, caches, config=config).kv_kept
    assert why.reason is KVKeptReason.RETURNED, why
    assert why.detail.startswith("writes to caches_0, caches_1: the graph returns their new values"), why
    assert "out of place" in why.detail and "training" not in why.detail, why
    model.requires_grad_(False)
    (why,) = explain(model, x.requires_grad_(), loc, caches, config=config).kv_kept
    assert why.reason is KVKeptReason.TRAINING_GRAPH, why
    assert "a parameter or an input requires grad" in why.detail, why


class _CachesPassedIn(HFStyleKVWriter):
    """The caches passed in (layer i's K `caches[2 * i]`, its V `caches[2 * i + 1]`); returns the sum of the K."""

    def forward(self, x, positions, loc, *caches):
        total = x.new_zeros(())
        for i, (k, v) in enumerate(HFStyleDraft.forward(self, x, positions)):
            caches[2 * i][loc] = k
            caches[2 * i + 1][loc] = v
            total = total + k.sum()
        return total


def test_a_training_graph_names_the_caches_it_returns_not_the_gradients_of_the_backward():
    """Caches passed in that require grad, at a token count marked dynamic (sizes saved for the backward, so
    AOTAutograd compiles it with the forward and the pass runs on both): the backward returns the caches' gradients,
    each an `index_put` into the gradient of the cache the forward returns (`tangents_<i>`), which is no cache write.
    One TRAINING_GRAPH reason, naming the caches the forward returns; eager's loss, caches and gradients."""
    torch._dynamo.reset()
    model = _CachesPassedIn("index_put")
    x, positions, loc = torch.randn(6, 64), torch.arange(6), torch.randperm(64)[:6]
    leaves = [torch.randn(64, 2, 16, requires_grad=True) for _ in range(2 * len(model.layers))]
    mark_tokens_dynamic((x, positions, loc))
    report = explain(model, x, positions, loc, *(leaf.clone() for leaf in leaves))
    (why,) = report.kv_kept
    assert why.reason is KVKeptReason.TRAINING_GRAPH, str(report)
    assert why.detail.startswith(f"writes to {', '.join(f'caches_{i}' for i in range(8))}: the graph returns"), why
    assert "tangents" not in str(report), str(report)
    capture = CaptureBackend()
    compiled = torch.compile(copy.deepcopy(model), backend=capture)
    results = []
    for run in (model, compiled):
        caches = [leaf.clone() for leaf in leaves]
        loss = run(x, positions, loc, *caches) + sum(c.sum() for c in caches)  # the caches read after the call
        loss.backward()
        grads = [leaf.grad for leaf in leaves] + [p.grad for p in run.parameters()]
        results.append([loss, *(c.detach() for c in caches), *grads])
        for leaf in leaves:
            leaf.grad = None
    torch.testing.assert_close(results[1], results[0])
    assert capture.report.kv_kept == report.kv_kept, str(capture.report)


class _StatefulDraft(nn.Module):
    """A draft step that writes a non-persistent KV cache buffer, counts its calls in a Python attribute and
    rebinds a buffer."""

    def __init__(self):
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(16, 16, bias=False) for _ in range(3))
        self.register_buffer("kv_cache", torch.randn(8, 16), persistent=False)
        self.register_buffer("last", torch.randn(16))
        self.steps = 0

    def forward(self, x, loc):
        self.steps += 1
        outs = [lin(x) for lin in self.lins]
        self.kv_cache[loc] = outs[0]
        self.last = outs[1][-1]
        return outs


def test_explain_restores_non_persistent_buffers_and_attributes():
    model = _StatefulDraft()
    cache, last = model.kv_cache.clone(), model.last
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            assert explain(model, torch.randn(4, 16), torch.tensor([1, 5, 2, 7])).n_branches == [3]
        assert torch.equal(model.kv_cache, cache), "explain() left the non-persistent cache written"
        assert model.last is last and model.steps == 0 and "last" in model._buffers
        assert model.kv_cache.grad_fn is None and not model.kv_cache.requires_grad


def test_explain_writes_back_only_what_tracing_wrote():
    """Tensors the model does not write stay untouched, version counters included: a backward pending over the
    weights still runs, broadcast inputs and weights made under inference mode are accepted; the caches the model
    writes and the counters are put back."""
    cfg = small_config(write="return")
    model = DraftKVWriter(cfg)
    ctx, positions = draft_inputs(cfg, 5)
    loss = model(ctx, positions)[0][0].sum()
    versions = [p._version for p in model.parameters()]
    assert explain(model, ctx[:1].expand_as(ctx), positions[:1].expand(5)).n_branches
    assert [p._version for p in model.parameters()] == versions
    loss.backward()

    with torch.inference_mode():
        frozen = DraftKVWriter(cfg)
    with torch.no_grad():
        assert explain(frozen, ctx, positions).n_branches

    writer = DraftKVWriter(small_config(write="cache_loc"))
    caches = [c.clone() for kv in writer.caches() for c in kv]
    counters.clear()
    with torch.no_grad():
        explain(writer, *draft_inputs(writer.cfg, 5), config={"fuse_on_cpu": True})
    assert all(torch.equal(a, b) for a, b in zip(caches, [c for kv in writer.caches() for c in kv], strict=True))
    assert not counters["dspark_fx"]


class _TwoNormedBranches(nn.Module):
    """Two linears on one input, each RMS-normed, then scaled by its own weight (`add_weight`: branch 1 adds it)."""

    def __init__(self, add_weight: bool = False):
        super().__init__()
        self.a, self.b = nn.Linear(64, 256, bias=False), nn.Linear(64, 256, bias=False)
        self.wa, self.wb = nn.Parameter(torch.randn(256)), nn.Parameter(torch.randn(256))
        self.add_weight = add_weight

    def forward(self, x):
        ya, yb = self.a(x), self.b(x)
        ya = ya * torch.rsqrt(ya.pow(2).mean(-1, keepdim=True) + 1e-6) * self.wa
        yb = yb * torch.rsqrt(yb.pow(2).mean(-1, keepdim=True) + 1e-6)
        return ya, yb + self.wb if self.add_weight else yb * self.wb


@pytest.mark.parametrize(
    ("limit", "add_weight", "kept"),
    [
        (1 << 16, False, None),
        (100, False, "a per-branch input of 256 elements, above max_leaf_numel (100), is not stacked"),
        (1 << 16, True, "branch 1 computes another op here"),
    ],
)
def test_explain_says_which_shared_op_stays_per_branch_and_why(limit, add_weight, kept):
    with torch.no_grad():
        report = explain(
            _TwoNormedBranches(add_weight), torch.randn(8, 64), config={"max_leaf_numel": limit, "fuse_on_cpu": True}
        )
    (cls,) = report.groups[0].classes
    assert cls.branches == [0, 1], report
    if kept is None:
        assert cls.ops[-2:] == ["aten.mul", "aten.mul"] and not cls.kept, report
    else:
        assert cls.ops[-1] == "aten.mul" and len(cls.ops) == 5, report
        (line,) = cls.kept
        assert line.startswith("aten.") and line.endswith(kept), report
        assert f"kept per branch from {line}" in str(report)


class _ResidualAdded(nn.Module):
    """Three projections of `x`, each plus a residual (`kind="residual"`) or a shift computed in the graph."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.lins = nn.ModuleList(nn.Linear(32, 16, bias=False) for _ in range(3))
        self.shifts = nn.ParameterList(nn.Parameter(torch.randn(16)) for _ in range(3))

    def forward(self, x, residual):
        if self.kind == "residual":
            return [lin(x) + residual for lin in self.lins]
        return [lin(x) + shift * 2 for lin, shift in zip(self.lins, self.shifts, strict=True)]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["residual", "computed-shift"])
def test_a_term_added_to_each_projection_fuses_under_inductor_as_explain_says(kind):
    """Inductor's own post-grad passes fold `mm + add` into `addmm` before the pass runs (explain's graph keeps the
    add): the term is no bias of the weight's rows, and the pass makes it `mm + add` again, so the real compile
    fuses the group as explain() reports it, with eager's results."""
    torch._dynamo.reset()
    model = _ResidualAdded(kind)
    x, residual = torch.randn(5, 32), torch.randn(5, 16)
    capture = CaptureBackend(inner="inductor")
    with torch.no_grad():
        expected = model(x, residual)
        report = explain(model, x, residual)
        got = torch.compile(model, backend=capture)(x, residual)
    torch.testing.assert_close(got, expected)
    assert report.n_branches == [3] and capture.report.n_branches == [3], str(capture.report)
    assert not capture.report.rejected


class _Projections(nn.Module):
    def __init__(self):
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(32, 16, bias=False) for _ in range(3))

    def forward(self, x):
        return [lin(x) for lin in self.lins]


def _symbolic(graph: torch.fx.GraphModule) -> bool:
    values = [n.meta.get("example_value") for n in graph.graph.nodes if n.op == "placeholder"]
    return any(isinstance(d, torch.SymInt) for v in values for d in getattr(v, "shape", ()))


def test_explain_leaves_the_sizes_dynamo_recorded_as_they_were():
    """Dynamo records the sizes each code saw by its file, line and name (which explain's fresh code shares): after
    explain() at 7 tokens, another instance's first compile at 5 is still static, its second size dynamic."""
    torch._dynamo.reset()
    with torch.no_grad():
        explain(_Projections(), torch.randn(7, 32))
        graphs = []
        compiled = torch.compile(_Projections(), backend=lambda gm, _inputs: graphs.append(gm) or gm.forward)
        compiled(torch.randn(5, 32))
        compiled(torch.randn(6, 32))
    assert [_symbolic(g) for g in graphs] == [False, True]


def test_explain_reports_a_module_compiled_in_place_without_calling_its_compiled_code():
    """`module.compile(...)` routes calls to the compiled code: explain() traces the module itself (the report has
    the group), runs nothing through that code, and leaves it in place."""
    torch._dynamo.reset()
    model = _Projections()
    counter = CompileCounter()
    model.compile(backend=counter)
    x = torch.randn(5, 32)
    with torch.no_grad():
        model(x)
        report = explain(model, x)
        assert report.n_branches == [3] and counter.frame_count == 1
        model(x)
    assert counter.frame_count == 1 and model._compiled_call_impl is not None


class _KVHolder:
    """A cache object holding per-layer objects holding their tensors, as HF's caches do."""

    class Layer:
        def __init__(self):
            self.keys = torch.zeros(8, 16)

    def __init__(self):
        self.layers = [self.Layer() for _ in range(2)]
        self.owner = self  # a cycle

    @property
    def keys(self):
        return [layer.keys for layer in self.layers]


class _WritesEverywhere(nn.Module):
    def __init__(self):
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(32, 16, bias=False) for _ in range(2))
        self.plain = torch.zeros(8, 16)  # a tensor attribute, not a buffer
        self.listed = [torch.zeros(8, 16) for _ in range(2)]
        self.held = _KVHolder()

    def forward(self, x, loc, passed):
        ks = [lin(x) for lin in self.lins]
        self.plain[loc] = ks[0]
        for cache, k in zip([*self.listed, *self.held.keys, *passed.keys], ks * 3, strict=True):
            cache[loc] = k
        self.seen_tokens = x.shape[0]
        return [F.dropout(k, 0.5, training=True) for k in ks]


def test_explain_restores_tensors_in_attributes_and_objects_removes_new_attributes_and_keeps_the_rng():
    model, passed, x = _WritesEverywhere(), _KVHolder(), torch.randn(5, 32)
    torch.manual_seed(3)
    expected = torch.rand(3)
    torch.manual_seed(3)
    with torch.no_grad():
        explain(model, x, torch.arange(5), passed)
    assert torch.equal(torch.rand(3), expected)
    tensors = [model.plain, *model.listed, *model.held.keys, *passed.keys]
    assert all(not t.any() for t in tensors) and not hasattr(model, "seen_tokens")


class _GrowingLayer:
    """An HF-style cache layer: `update` concatenates into a new tensor and rebinds it."""

    def __init__(self):
        self.keys = torch.zeros(0, 16)

    def update(self, k):
        self.keys = torch.cat([self.keys, k])
        return self.keys


@dataclass(slots=True)
class _SlottedKV:
    k: torch.Tensor
    steps: int = 0


class _RebindsEverything(nn.Module):
    """Rebinds what its attributes and inputs hold: list elements, dict values, cache layers' tensors, slots, a
    counter; none of it is a tensor written in place."""

    def __init__(self):
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(32, 16, bias=False) for _ in range(2))
        self.listed = [torch.zeros(8, 16) for _ in range(2)]
        self.table = {"tokens": torch.zeros((), dtype=torch.long)}

    def forward(self, x, loc, layers, slotted, extra):
        ks = [lin(x) for lin in self.lins]
        for i, k in enumerate(ks):
            self.listed[i] = self.listed[i].index_put((loc,), k)
            layers[i].update(k)
        self.table["tokens"] = self.table["tokens"] + x.shape[0]
        slotted.k = slotted.k + ks[0].sum()
        slotted.steps += 1
        extra.append(ks[1])
        extra[0] = extra[0] + 1
        return ks


def test_explain_puts_back_what_lists_dicts_and_objects_held():
    """What tracing rebinds (not writes) is put back: module list and dict attributes, HF-style cache layers that
    concatenate, a `@dataclass(slots=True)` input's fields, an input list (an element replaced, one appended)."""
    model = _RebindsEverything()
    layers, slotted, first = [_GrowingLayer() for _ in range(2)], _SlottedKV(torch.zeros(3)), torch.zeros(2)
    extra = [first]
    held = ([*model.listed], model.table["tokens"], [layer.keys for layer in layers], slotted.k)
    with torch.no_grad():
        explain(model, torch.randn(5, 32), torch.arange(5), layers, slotted, extra)
    assert all(a is b for a, b in zip(model.listed, held[0], strict=True)) and model.table["tokens"] is held[1]
    assert all(layer.keys is k for layer, k in zip(layers, held[2], strict=True))
    assert slotted.k is held[3] and slotted.steps == 0
    assert len(extra) == 1 and extra[0] is first and not first.any()


def test_explain_refuses_uninitialized_lazy_modules_and_explains_a_compiled_function():
    lazy = nn.Sequential(nn.LazyLinear(16), nn.ReLU())
    with pytest.raises(ValueError, match="uninitialized lazy parameters"):
        explain(lazy, torch.randn(2, 8))
    assert torch.nn.parameter.is_lazy(lazy[0].weight)
    lins = nn.ModuleList(nn.Linear(8, 8, bias=False) for _ in range(2))

    def project(x):
        return [lin(x) for lin in lins]

    compiled = torch.compile(project, backend="aot_eager")
    with torch.no_grad():
        compiled(torch.randn(3, 8))
        assert explain(compiled, torch.randn(3, 8), config={"fuse_on_cpu": True}).n_branches == [2]


class _NotCalledSelf(nn.Module):
    def __init__(self):
        super().__init__()
        self.k = nn.ModuleList(nn.Linear(8, 8, bias=False) for _ in range(2))

    def forward(mod, x):  # a forward whose first argument is not called self
        return [k(x) for k in mod.k]


def test_weights_are_named_by_their_parameter_names_whatever_forward_calls_self():
    with torch.no_grad():
        report = explain(_NotCalledSelf(), torch.randn(3, 8), config={"fuse_on_cpu": True})
    assert "branch 0: k.0.weight[0:8]" in str(report) and "mod." not in str(report), str(report)


class _WriterWithAHead(HFStyleKVWriter):
    """K/V writes that lower, and a lone linear whose bias is computed (`addmm(b * 2, x, W^T)`)."""

    def __init__(self):
        super().__init__("index_put")
        self.head = nn.Linear(64, 10)

    def forward(self, x, positions, loc):
        super().forward(x, positions, loc)
        return F.linear(x, self.head.weight, self.head.bias * 2)


def test_an_added_term_whose_gemm_fuses_into_nothing_stays_in_its_addmm():
    """The pass makes `addmm(t, x, W^T)` `mm + add` so that the GEMM can fuse; where it does not (a lone GEMM here,
    while the K/V writes lower), it is one `addmm` again: no extra kernel, no second rounding."""
    torch._dynamo.reset()
    model = _WriterWithAHead()
    capture = CaptureBackend({"kv_write_op": "always"})
    x, positions, loc = torch.randn(6, 64), torch.arange(6), torch.randperm(64)[:6]
    with torch.no_grad():
        expected = copy.deepcopy(model)(x, positions, loc)
        got = torch.compile(model, backend=capture)(x, positions, loc)
    torch.testing.assert_close(got, expected)
    assert capture.report.kv_writes and not capture.report.groups, str(capture.report)
    counts = op_counts(capture.after[-1])
    assert counts["aten.addmm"] == 1 and counts["aten.mm"] == 0, capture.graph_diff()
