"""K/V cache writes lowered to `dspark::multi_linear_kv_write` (`DsparkConfig(kv_write_op="always")` forces it on
CPU, where the op is its fp32 reference): the op replaces the GEMMs, norms, RoPE and writes of every write variant of
the reference draft and of HF-style writers, matches eager, sees in-place weight updates and keeps one symbolic
graph; what it cannot prove equivalent keeps today's path, with the reason in the report. Fast: no Inductor codegen.
"""

import copy
import dataclasses
import importlib
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import as_fake_cuda, draft_inputs, eager_and_compiled, mark_tokens_dynamic, quick_first, small_config
from hf_models import HF_WRITES, HFLayer, HFStyleDraft, HFStyleKVWriter, rotate_half

from custom_ops.linear.multi_linear_kv_write import rotary_dim
from dspark_fx import DsparkConfig, explain
from dspark_fx.passes.kv_write import KV_WRITE
from dspark_fx.reference_draft import DraftKVLayer, DraftKVWriter
from dspark_fx.report import KVKeptReason
from dspark_fx.testing import (
    TOLERANCES,
    CaptureBackend,
    assert_close_for_dtype,
    compile_counts,
    op_counts,
    reinplacing_misses,
)

ALWAYS = DsparkConfig(kv_write_op="always")
prims = torch.ops.prims
OP = "dspark.multi_linear_kv_write"
GONE = (
    "aten.mm",
    "aten.addmm",
    "aten.index_put",
    "aten.scatter",
    "aten.slice_scatter",
    "aten.copy_",
    "aten.rsqrt",
    "dspark.multi_linear",
)

REFERENCE_VARIANTS = [
    dict(write="cache_loc"),
    dict(write="commit", qkv_bias=True),
    dict(write="slice"),
    dict(proj="qkv_split", write="cache_loc", rope_style="gptj", rotary_dim=8, norm="rms_norm"),
    dict(proj="qkv_split", write="slice", qkv_bias=True, rotary_dim=12),
    dict(proj="kv_separate", write="commit", rotary_dim=12, norm="rms_norm"),
    dict(proj="kv_separate", write="slice", qkv_bias=(True, False, True), rope_style="gptj"),
    dict(write="cache_loc", eps=(1e-6, 1e-5, 1e-6), rope_theta=(1e6, 1e4, 1e6)),
]


def _op_node(graph):
    (node,) = [n for n in graph.nodes if n.target is KV_WRITE]
    return node


def _assert_lowered(capture, layers: int, other_scatters: int = 0) -> None:
    """Every graph's writes of `layers` layers became the op; `other_scatters`: `slice_scatter`s of the graph that
    are not cache writes (a RoPE spelled with them)."""
    for report, before, after in zip(capture.reports, capture.before, capture.after, strict=True):
        (group,) = report.kv_writes
        assert len(group.layers) == layers, str(report)
        counts = op_counts(after)
        assert counts[OP] == 1 and not any(counts[op] for op in GONE), capture.graph_diff()
        writes = op_counts(before)
        scatters = writes["aten.index_put"] + writes["aten.slice_scatter"] + writes["aten.scatter"] - other_scatters
        assert writes["aten.copy_"] == 2 * layers and scatters == 2 * layers
        args = _op_node(after).args
        assert all(w.op == "placeholder" for w in args[1] + args[4]), "weights must be read in place"
        assert all(c.op == "placeholder" for c in args[12] + args[13])


@pytest.mark.parametrize("dtype", quick_first(1, [torch.float32, torch.bfloat16]), ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "options", quick_first(1, REFERENCE_VARIANTS), ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items())
)
def test_reference_draft_writes_become_one_op(options, dtype):
    torch._dynamo.reset()
    cfg = small_config(dtype=dtype, **options)
    capture = CaptureBackend(ALWAYS)
    for eager, compiled in eager_and_compiled(cfg, capture, tokens_list=(8, 13)):
        assert_close_for_dtype(compiled, eager, dtype)
    _assert_lowered(capture, cfg.num_layers)
    args = _op_node(capture.after[-1]).args
    assert args[8] == list(_eps(cfg)) and args[11] == (cfg.rope_style == "neox")
    tables = args[9]
    assert all(t.op == "placeholder" for t in tables), "table[positions] in the graph: the op reads the table"
    assert tables[0].meta["val"].shape[1] == cfg.rope_dim
    if cfg.write == "commit":
        assert args[15] is not None and args[14].meta["val"].dim() == 2


def _eps(cfg):
    eps = cfg.eps if isinstance(cfg.eps, tuple) else (cfg.eps,) * cfg.num_layers
    return [float(torch.tensor(e, dtype=torch.float32)) if cfg.norm == "rms_norm" else e for e in eps]


def _hf_run(model, dtype, config=ALWAYS, tokens_list=(6, 11), slots=64, dynamic=None):
    """Eager vs compiled caches of an HF-style writer; returns the capture."""
    torch._dynamo.reset()
    model = model.to(dtype)
    compiled_model = copy.deepcopy(model)
    capture = CaptureBackend(config)
    compiled = torch.compile(compiled_model, backend=capture, dynamic=dynamic)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for tokens in tokens_list:
            x = torch.randn(tokens, 64, generator=gen).to(dtype)
            positions = torch.randint(0, 4096, (tokens,), generator=gen)
            loc = torch.randperm(slots, generator=gen)[:tokens]
            if model.write == "slice":
                loc = int(torch.randint(0, slots - tokens + 1, (), generator=gen))
            if tokens == tokens_list[0] and len(tokens_list) > 1 and model.write != "slice":
                mark_tokens_dynamic((x, positions, loc))  # one symbolic graph for every count
            model(x, positions, loc)
            compiled(x, positions, loc)
            assert_close_for_dtype(compiled_model.caches(), model.caches(), dtype)
    return capture


@pytest.mark.parametrize("rotate", ["roll", "where", "slice_scatter"])
def test_rotate_half_spelled_with_roll_where_or_slice_scatter_becomes_one_op(rotate):
    """HF's RoPE with `rotate_half` by `torch.roll` and a sign, by `torch.where` over a mask of the element index, or
    by `slice_scatter` into a zero tensor: the same rotation, so the same op call as `cat`'s spelling."""
    capture = _hf_run(HFStyleKVWriter("index_put", rotate=rotate), torch.float32)
    _assert_lowered(capture, 4, other_scatters=2 * 4 if rotate == "slice_scatter" else 0)
    assert "neox RoPE on 16 of 16 dims, inverse frequencies inv_freq" in str(capture.report)


@pytest.mark.cuda
@pytest.mark.parametrize("rotate", ["roll", "where", "slice_scatter"])
def test_rotate_half_spellings_lower_on_cuda_with_auto(rotate):
    """On CUDA with the default `kv_write_op="auto"`, through Inductor codegen: each of those spellings becomes the
    op's CUDA kernel and leaves eager's caches (poisoned first: unwritten slots keep their values), bf16, one token
    and then one symbolic graph for 9 and 17."""
    _lowers_on_cuda_with_auto(HFStyleKVWriter("index_put", rotate=rotate))


@pytest.mark.cuda
@pytest.mark.parametrize("write", [w for w in HF_WRITES if w != "slice"])
def test_hf_write_forms_lower_on_cuda_with_auto(write):
    """Each slot-index write form (`index_copy_`, `cache[loc] = k`, `scatter_`) lowers to the op's CUDA kernel under
    Inductor codegen, as the rotate_half spellings above."""
    _lowers_on_cuda_with_auto(HFStyleKVWriter(write))


def _lowers_on_cuda_with_auto(eager: HFStyleKVWriter) -> None:
    torch._dynamo.reset()
    eager = eager.to(device="cuda", dtype=torch.bfloat16)
    for cache in eager.caches():
        cache.normal_()
    compiled_model = copy.deepcopy(eager)
    capture = CaptureBackend(DsparkConfig(), inner="inductor")
    compiled = torch.compile(compiled_model, backend=capture)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for tokens in (1, 9, 17):
            x = torch.randn(tokens, 64, generator=gen).to("cuda", torch.bfloat16)
            positions = torch.randint(0, 4096, (tokens,), generator=gen).cuda()
            loc = torch.randperm(64, generator=gen)[:tokens].cuda()
            eager(x, positions, loc)
            compiled(x, positions, loc)
            assert_close_for_dtype(compiled_model.caches(), eager.caches(), torch.bfloat16)
    assert [op_counts(graph)[OP] for graph in capture.after] == [1] * len(capture.after), str(capture.report)


@pytest.mark.parametrize("dtype", quick_first(1, [torch.float32, torch.bfloat16]), ids=["fp32", "bf16"])
@pytest.mark.parametrize("write", quick_first(1, HF_WRITES))
def test_hf_style_writers_become_one_op(write, dtype):
    """HF cos/sin [T, head_dim] computed per call from `inv_freq` and the positions (duplicated halves, model
    dtype): the op gets the `inv_freq` buffer and the positions themselves (its frequencies form)."""
    capture = _hf_run(HFStyleKVWriter(write), dtype)
    _assert_lowered(capture, 4)
    args = _op_node(capture.after[-1]).args
    (table,) = set(args[9])
    if dtype == torch.bfloat16:  # the module's .to(bf16) made inv_freq bf16: cast to fp32 for the op
        assert table.target is prims.convert_element_type.default
        table = table.args[0]
    assert table.op == "placeholder"
    assert tuple(table.meta["val"].shape) == (8,), "inv_freq [R/2]"
    assert args[10].op == "placeholder" and args[10].meta["val"].dtype == torch.int64, "the positions input"
    assert "inverse frequencies inv_freq (cos/sin computed in the op) at positions" in str(capture.report)


class _RowPaddedLinear(torch.nn.Module):
    """`linear` as Inductor's `pad_mm` rewrites it on CUDA at a static token count off the alignment: zero rows
    appended to the activation up to the next multiple of 8, the product sliced back to the rows it had."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.linear = linear

    def forward(self, x):
        pad = 8 - x.shape[0] % 8
        return torch.addmm(self.linear.bias, F.pad(x, (0, 0, 0, pad)), self.linear.weight.t())[:-pad]


def _row_padded_writer() -> HFStyleKVWriter:
    model = HFStyleKVWriter("index_put")
    for layer in model.layers:
        layer.k_proj, layer.v_proj = _RowPaddedLinear(layer.k_proj), _RowPaddedLinear(layer.v_proj)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("kv_write_op", ["always", "never"])
def test_row_padded_projections_through_inductor_codegen(kv_write_op):
    """Real Inductor codegen of what `row_padding` leaves: the writes lowered to the op ("always"), or the K/V GEMMs
    fused into one `multi_linear` on the unpadded activation with Inductor's norm/RoPE/writes ("never"); both
    match eager."""
    torch._dynamo.reset()
    eager = _row_padded_writer()
    model = copy.deepcopy(eager)
    capture = CaptureBackend(DsparkConfig(kv_write_op=kv_write_op), inner="inductor")
    compiled = torch.compile(model, backend=capture, dynamic=False)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        x = torch.randn(6, 64, generator=gen)
        positions = torch.randint(0, 4096, (6,), generator=gen)
        loc = torch.randperm(64, generator=gen)[:6]
        eager(x, positions, loc)
        compiled(x, positions, loc)
    assert_close_for_dtype(model.caches(), eager.caches(), torch.float32)
    (report,) = capture.reports
    after = op_counts(capture.after[0])
    assert after["aten.constant_pad_nd"] == 0, capture.graph_diff()
    if kv_write_op == "always":
        assert len(report.kv_writes) == 1 and after[OP] == 1
    else:
        assert not report.kv_writes and after["dspark.multi_linear"] == 1


@pytest.mark.parametrize("tokens", quick_first(1, [6, 13]))
def test_row_padded_projections_lower_like_plain_ones(tokens):
    """Projections on a row-padded activation (what `pad_mm` makes of them) lower to the one op as plain ones do:
    the padding is undone first (`row_padding`), so no write is kept for a value taller than its rows."""
    capture = _hf_run(_row_padded_writer(), torch.float32, tokens_list=(tokens,))
    _assert_lowered(capture, 4)
    assert all(op_counts(before)["aten.constant_pad_nd"] == 8 for before in capture.before), "the padding was traced"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_eps_attribute_made_a_graph_input_keeps_todays_path_and_names_it(dtype):
    """Under `dynamic=True` Dynamo makes the norm's float attribute `eps` a graph input, a value that may change
    without a recompile: the writes keep today's path with eager's caches, and the reason names that input by its
    name in the model, also in a bf16 model, where the graph casts it to fp32 first."""
    capture = _hf_run(HFStyleKVWriter("index_put"), dtype, dynamic=True)
    kept = capture.report.kv_kept
    assert kept and not capture.report.kv_writes
    for why in kept:
        assert why.reason is KVKeptReason.NORM and "the norm's eps is not a constant" in why.detail, why
        assert re.fullmatch(r"the graph input layers\.\d\.k_norm_eps", why.source), why


@pytest.mark.slow
def test_hf_angles_at_shifted_positions_get_rows_built_in_the_graph():
    """Angles at `positions + 3`: no tensor holds the op's positions, so the op gets the model's cos/sin as `[T, R]`
    fp32 rows built in the graph, read at arange(T)."""
    capture = _hf_run(HFStyleKVWriter("index_put", position_offset=3), torch.bfloat16)
    _assert_lowered(capture, 4)
    args = _op_node(capture.after[-1]).args
    (table,) = set(args[9])
    assert table.op != "placeholder" and table.meta["val"].dtype == torch.float32
    assert table.meta["val"].shape[1] == 16
    assert args[10].target is prims.iota.default  # positions = arange(T)
    assert "built in the graph from the model's per-token cos/sin" in str(capture.report)


@pytest.mark.parametrize(
    "options",
    quick_first(
        1,
        [
            pytest.param(dict(norm=None), id="no-norm"),
            pytest.param(dict(norm="plain"), id="weightless-norm"),
            pytest.param(dict(rotary_dim=8), id="partial-rotary"),
            pytest.param(dict(norm="plain", rotary_dim=8, eps=1e-5), id="weightless-partial-eps"),
        ],
    ),
)
def test_hf_style_norm_and_rope_variants_map_onto_op_arguments(options):
    capture = _hf_run(HFStyleKVWriter("index_copy", **options), torch.float32)
    _assert_lowered(capture, 4)
    args = _op_node(capture.after[-1]).args
    norm = options.get("norm", "weight")
    assert args[7] == [None] * 4 if norm != "weight" else all(w is not None for w in args[7])
    assert args[8] == ([] if norm is None else [options.get("eps", 1e-6)] * 4)
    assert rotary_dim(args[9][0].meta["val"]) == options.get("rotary_dim", 16)


def test_writes_without_norm_or_rope_lower_too():
    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lins = torch.nn.ModuleList(torch.nn.Linear(32, 16, bias=False) for _ in range(4))
            for i in range(4):
                self.register_buffer(f"c{i}", torch.zeros(20, 2, 8))

        def forward(self, x, loc):
            for i, lin in enumerate(self.lins):
                getattr(self, f"c{i}")[loc] = lin(x).view(-1, 2, 8)

    capture = _five_tokens_eager_vs_compiled(Plain())
    args = _op_node(capture.after[-1]).args
    assert args[8] == [] and args[9] == [] and op_counts(capture.after[-1])[OP] == 1


def test_negative_slots_wrap_as_in_eager():
    """`cache[-1] = k` writes the last slot in eager; the op skips negative slots, so the lowering wraps them."""
    torch._dynamo.reset()
    cfg = small_config()
    eager = DraftKVWriter(cfg)
    model = copy.deepcopy(eager)
    capture = CaptureBackend(ALWAYS)
    compiled = torch.compile(model, backend=capture)
    ctx, positions, _ = draft_inputs(cfg, 5)
    loc = torch.tensor([-1, 3, -cfg.num_slots, 7, 126])
    with torch.no_grad():
        eager(ctx, positions, loc)
        compiled(ctx, positions, loc)
    assert op_counts(capture.after[-1])[OP] == 1
    assert model.k_cache_0[-1].abs().sum() > 0 and model.k_cache_0[0].abs().sum() > 0
    assert_close_for_dtype([t for kv in model.caches() for t in kv], [t for kv in eager.caches() for t in kv])


def test_in_place_weight_updates_after_compile_are_seen():
    torch._dynamo.reset()
    cfg = small_config(qkv_bias=True, write="commit")
    eager = DraftKVWriter(cfg)
    model = copy.deepcopy(eager)
    capture = CaptureBackend(ALWAYS)
    compiled = torch.compile(model, backend=capture)
    with torch.no_grad():
        for step in range(3):
            args = draft_inputs(cfg, 12, seed=step)
            eager(*args)
            compiled(*args)
            assert_close_for_dtype(
                [t for kv in model.caches() for t in kv], [t for kv in eager.caches() for t in kv], cfg.dtype
            )
            for m in (eager, model):
                m.layers[1].qkv_proj.weight.mul_(-1.5)
                m.layers[2].qkv_proj.bias.add_(0.25)
                m.layers[0].k_norm_weight.mul_(2.0)
                m.cos_sin_0.mul_(0.5)
    assert len(capture.reports) == 1, "an in-place update must not recompile"
    _assert_lowered(capture, cfg.num_layers)


def test_token_counts_share_one_symbolic_graph():
    torch._dynamo.reset()
    cfg = small_config(write="cache_loc")
    eager = DraftKVWriter(cfg)
    model = copy.deepcopy(eager)
    capture = CaptureBackend(ALWAYS)
    compiled = torch.compile(model, backend=capture)
    with compile_counts() as counts, torch.no_grad():
        for tokens in (1, 5, 9, 13, 40):
            args = draft_inputs(cfg, tokens, seed=tokens)
            eager(*args)
            compiled(*args)
            assert_close_for_dtype([t for kv in model.caches() for t in kv], [t for kv in eager.caches() for t in kv])
    assert counts["frames"] <= 2, f"compiled {counts['frames']} graphs for 5 token counts"
    _assert_lowered(capture, cfg.num_layers)
    for graph in capture.after:  # no host sync: nothing reads a tensor value back
        assert not {"aten.item", "aten._local_scalar_dense", "aten.nonzero"} & set(op_counts(graph))


# ---- today's path, with the reason ---------------------------------------------------------------------------------


def test_auto_on_cpu_leaves_the_graph_exactly_as_today_and_says_why():
    """The default ("auto") lowers only where the op's CUDA kernel runs: on CPU the graph is the one of "never"."""
    graphs = {}
    for mode in ("auto", "never"):
        torch._dynamo.reset()
        capture = CaptureBackend(DsparkConfig(kv_write_op=mode))
        eager_and_compiled(small_config(write="commit", dtype=torch.bfloat16), capture)
        graphs[mode] = str(capture.after[-1])
        assert OP not in graphs[mode] and not capture.report.kv_writes
        if mode == "auto":
            (why,) = map(str, capture.report.kv_kept)
            assert "kv_write_op='auto'" in why and "cpu" in why
            assert "KV writes kept on the multi_linear path" in str(capture.report)
        else:
            assert not capture.report.kv_kept
    assert graphs["auto"] == graphs["never"]


def _five_tokens_eager_vs_compiled(model: torch.nn.Module) -> CaptureBackend:
    """`model(x, loc)` for 5 tokens, eagerly and compiled on a copy (always lowering); the caches agree. Returns the
    capture."""
    torch._dynamo.reset()
    compiled_model = copy.deepcopy(model)
    capture = CaptureBackend(ALWAYS)
    with torch.no_grad():
        x, loc = torch.randn(5, 32), torch.tensor([3, 0, 19, 7, 11])
        model(x, loc)
        torch.compile(compiled_model, backend=capture)(x, loc)
    assert_close_for_dtype(list(compiled_model.buffers()), list(model.buffers()))
    return capture


def _layers_per_op(capture) -> list[list[int]]:
    """Per compiled graph, the layers of each op the writes were lowered to (the per-layer fallback: layers the op
    writes alike in one op each, where the layers differ)."""
    counts = []
    for graph, report in zip(capture.after, capture.reports, strict=True):
        assert op_counts(graph)[OP] == len(report.kv_writes), str(report)
        counts.append([len(w.layers) for w in report.kv_writes])
    return counts


def _kept(capture) -> str:
    assert not capture.report.kv_writes and all(op_counts(g)[OP] == 0 for g in capture.after)
    assert all(r.n_groups == 1 for r in capture.reports), "the horizontal fusion still fuses the GEMMs"
    return "\n".join(map(str, capture.report.kv_kept))


class _ScatterWriter(HFStyleKVWriter):
    """`HFStyleKVWriter` writing with `scatter_` in the form `how` (see the test)."""

    def __init__(self, how):
        super().__init__("scatter", slots=24)
        self.how = how

    def forward(self, x, positions, loc):
        for (k, v), i in zip(HFStyleDraft.forward(self, x, positions), range(len(self.layers)), strict=True):
            for cache, value in ((getattr(self, f"k_cache_{i}"), k), (getattr(self, f"v_cache_{i}"), v)):
                tokens, heads, dim = value.shape
                if self.how == "int32-slots, unsqueezed":
                    cache.scatter_(0, loc.long()[:, None, None].expand(tokens, heads, dim), value)
                elif self.how == "flat rows":
                    index = loc.view(tokens, 1).expand(tokens, heads * dim)
                    cache.view(-1, heads * dim).scatter_(0, index, value.reshape(tokens, heads * dim))
                elif self.how == "first head only":
                    cache.scatter_(0, loc.view(-1, 1, 1).expand(tokens, 1, dim), value)
                elif self.how == "fewer index rows than tokens":
                    cache.scatter_(0, loc[1:].view(-1, 1, 1).expand(tokens - 1, heads, dim), value)
                elif self.how == "slots broadcast along the heads":  # index[i, j, :] = loc[j] (T == heads)
                    cache.scatter_(0, loc.view(-1, 1).expand(tokens, heads, dim), value)
                elif self.how == "slots broadcast along the head dim":  # index[i, j, m] = loc[m] (T == head_dim)
                    cache.scatter_(0, loc.expand(tokens, heads, dim), value)
                elif self.how == "along the heads dim":
                    cache.scatter_(1, loc.remainder(heads).view(-1, 1, 1).expand(tokens, heads, dim), value)
                else:  # an index of its own for every element
                    index = (loc.view(-1, 1, 1) + torch.arange(heads * dim).view(1, heads, dim)) % cache.shape[0]
                    cache.scatter_(0, index, value)


@pytest.mark.parametrize("how", ["int32-slots, unsqueezed", "flat rows"])
def test_scatter_of_whole_rows_is_a_slot_write(how):
    """`cache.scatter_(0, loc.view(-1, 1, 1).expand_as(k), k)` writes row i of k to row loc[i]: `cache[loc] = k`,
    whatever the view of the slot index or of the cache."""
    capture = _hf_run(_ScatterWriter(how), torch.float32, slots=24)
    if how == "flat rows":  # the op writes an [S, heads, head_dim] view of each [S, heads * head_dim] cache
        assert [len(r.kv_writes[0].layers) for r in capture.reports] == [4] * len(capture.reports)
        assert all(op_counts(g)[OP] == 1 and not op_counts(g)["aten.scatter"] for g in capture.after)
    else:
        _assert_lowered(capture, 4)


@pytest.mark.parametrize(
    ("how", "tokens"),
    [
        ("first head only", 6),
        ("fewer index rows than tokens", 6),
        ("along the heads dim", 6),
        ("an index per element", 6),
        ("slots broadcast along the heads", 2),
        ("slots broadcast along the head dim", 16),
    ],
)
def test_scatter_of_part_of_a_row_or_elementwise_keeps_todays_path(how, tokens):
    """A scatter that writes part of each row, reads part of the value, runs along another dim, scatters each
    element to a slot of its own or has the slots broadcast along a later dim (`expand` lines a lower-rank index up
    with the last dims; the token count equal to that dim's size) is no slot write: it keeps its own ops (the caches
    still equal eager's)."""
    capture = _hf_run(_ScatterWriter(how), torch.float32, tokens_list=(tokens,), slots=24)
    assert "aten.scatter into k_cache_0 [24, 2, 16]: the op writes rows at one slot per token" in _kept(capture)


def test_scatter_with_a_negative_slot_raises_in_eager_and_counts_from_the_end_when_lowered():
    """Documented: eager's `scatter_` raises on a negative index; the lowered write counts it from the end, as
    `cache[loc] = k` does."""
    model = _ScatterWriter("int32-slots, unsqueezed")
    x, positions, loc = torch.randn(3, 64), torch.arange(3), torch.tensor([4, -1, 7], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="out of bounds"), torch.no_grad():
        model(x, positions, loc)
    reference = HFStyleKVWriter("index_put", slots=24)
    reference.load_state_dict(model.state_dict())
    torch._dynamo.reset()
    capture = CaptureBackend(ALWAYS)
    with torch.no_grad():
        reference(x, positions, loc)
        torch.compile(model, backend=capture)(x, positions, loc)
    assert len(capture.report.kv_writes) == 1
    assert_close_for_dtype(model.caches(), reference.caches())


class _WritesAndReturnsK(DraftKVWriter):
    """Writes the caches and also returns layer 0's K (read by something else than the write)."""

    def forward(self, ctx, positions, cache_loc=None, commit_lens=None):
        super().forward(ctx, positions, cache_loc, commit_lens)
        return self.layers[0](ctx, self.cos_sin_0[positions])[0] * 2


def test_k_also_read_elsewhere_keeps_todays_path():
    torch._dynamo.reset()
    capture = CaptureBackend(ALWAYS)
    cfg = small_config()
    for eager, compiled in eager_and_compiled(cfg, capture, model_factory=_WritesAndReturnsK):
        assert_close_for_dtype(compiled, eager)
    assert "also read by" in _kept(capture) and "the op returns nothing" in _kept(capture)


def _gptj_layer_1(cfg, device):
    model = DraftKVWriter(cfg, device)
    model.layers[1].cfg = dataclasses.replace(cfg, rope_style="gptj")
    return model


def test_rope_style_differing_across_layers_lowers_each_style_apart():
    torch._dynamo.reset()
    capture = CaptureBackend(ALWAYS)
    for eager, compiled in eager_and_compiled(small_config(), capture, model_factory=_gptj_layer_1):
        assert_close_for_dtype(compiled, eager)
    assert all(sorted(c) == [1, 2] for c in _layers_per_op(capture)), str(capture.report)
    assert {w.rope.split(" ")[0] for w in capture.report.kv_writes} == {"neox", "GPT-J"}


class _HalfTableLayer(DraftKVLayer):
    """Rotates by the first half of the table row only: a RoPE of half the width of the other layers'."""

    def forward(self, ctx, cos_sin):
        return super().forward(ctx, cos_sin[:, : cos_sin.shape[1] // 2])


def _half_table_layer_1(cfg, device):
    model = DraftKVWriter(cfg, device)
    model.layers[1].__class__ = _HalfTableLayer
    return model


def test_rope_tables_of_different_widths_lower_each_width_apart():
    torch._dynamo.reset()
    capture = CaptureBackend(ALWAYS)
    for eager, compiled in eager_and_compiled(small_config(), capture, model_factory=_half_table_layer_1):
        assert_close_for_dtype(compiled, eager)
    assert all(sorted(c) == [1, 2] for c in _layers_per_op(capture)), str(capture.report)
    assert {w.rope.split(" of ")[0] for w in capture.report.kv_writes} == {"neox RoPE on 16", "neox RoPE on 8"}


def test_head_layouts_differing_across_layers_lower_each_layout_apart():
    class TwoLayouts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lins = torch.nn.ModuleList(torch.nn.Linear(32, 16, bias=False) for _ in range(4))
            for i in range(4):
                self.register_buffer(f"c{i}", torch.zeros(20, *((2, 8) if i < 2 else (4, 4))))

        def forward(self, x, loc):
            for i, lin in enumerate(self.lins):
                cache = getattr(self, f"c{i}")
                cache[loc] = lin(x).view(-1, *cache.shape[1:])

    capture = _five_tokens_eager_vs_compiled(TwoLayouts())
    assert _layers_per_op(capture) == [[1, 1]], str(capture.report)


@pytest.mark.slow
def test_norm_on_some_layers_only_lowers_the_normed_and_the_others_apart():
    model = HFStyleKVWriter("index_put")
    model.layers[2].k_norm = None
    capture = _hf_run(model, torch.float32)
    assert all(sorted(c) == [1, 3] for c in _layers_per_op(capture)), str(capture.report)
    assert sorted(w.norm.startswith("k_norm") for w in capture.report.kv_writes) == [False, True]


class _VOnlyLayer(HFStyleKVWriter):
    """Layer 0 writes only its V (its K is computed and dropped)."""

    def forward(self, x, positions, loc):
        for i, (k, v) in enumerate(HFStyleKVWriter.__mro__[1].forward(self, x, positions)):
            if i:
                getattr(self, f"k_cache_{i}")[loc] = k
            getattr(self, f"v_cache_{i}")[loc] = v


@pytest.mark.slow
def test_v_only_layer_lowers_the_others_and_keeps_its_write():
    """Three K/V pairs lower; layer 0's V, with no K to pair with, stays as it was, with a reason naming its cache."""
    capture = _hf_run(_VOnlyLayer("index_put"), torch.float32)
    assert all(c == [3] for c in _layers_per_op(capture)), str(capture.report)
    kept = capture.report.kv_kept
    assert kept and all(k.reason is KVKeptReason.LAYERS_DIFFER and k.cache == "v_cache_0" for k in kept), kept


class _UnequalHalves(HFStyleKVWriter):
    """cos/sin whose two halves differ (`cat(f, 2f)`): not the op's rotation, must not be lowered."""

    def forward(self, x, positions, loc):
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, 2 * freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for i, layer in enumerate(self.layers):
            k, v = layer(x, cos, sin)
            getattr(self, f"k_cache_{i}")[loc] = k
            getattr(self, f"v_cache_{i}")[loc] = v


@pytest.mark.slow
def test_cos_sin_halves_not_provably_equal_keep_todays_path():
    capture = _hf_run(_UnequalHalves("index_put"), torch.float32)
    assert "elements (0, 8) do not take the same cos factor" in _kept(capture)


def _first_rows_rotated(how):
    """A layer whose K is rotated in its first 3 token rows only (`how`: a `where` over `arange(T)`, a
    `slice_scatter` of the rotated rows, or a `cat` of slices): rows past those the evaluation reads differ."""

    def forward(self, x, cos, sin):
        shape = (x.shape[0], self.kv_heads, self.head_dim)
        k = self.k_norm(self.k_proj(x).view(shape))
        if how == "where":
            k = torch.where((torch.arange(k.shape[0]) < 3)[:, None, None], _hf_rope(k, cos, sin), k)
        elif how == "slice_scatter":
            k = torch.slice_scatter(k, _hf_rope(k, cos, sin)[:3], 0, 0, 3)
        else:
            k = torch.cat((_hf_rope(k, cos, sin)[:3], k[3:]))
        return k, self.v_proj(x).view(shape)

    return type(f"_FirstRows_{how}", (HFLayer,), {"forward": forward})


class _PositionsFromFirst(HFStyleKVWriter):
    """Positions computed in the graph from the first one, `positions[0] + arange(T)` (a select of row 0 and the
    token index): the same for every row at any T."""

    def forward(self, x, positions, loc):
        return super().forward(x, positions[0] + torch.arange(x.shape[0]), loc)


@pytest.mark.parametrize("tokens", [(6, 11), (20,)], ids=["symbolic-T", "static-T"])
def test_positions_from_the_first_row_and_arange_lower(tokens):
    """Row 0 of the token dim is row 0 at any T, and `arange(T)` reaches the op as a positions tensor the graph
    computes: the writes lower and match eager, in a static graph above the evaluated rows too."""
    capture = _hf_run(_PositionsFromFirst("index_put"), torch.float32, tokens_list=tokens)
    _assert_lowered(capture, 4)


@pytest.mark.parametrize("tokens", [(6, 11), (20,)], ids=["symbolic-T", "static-T"])
@pytest.mark.parametrize("how", ["where", "slice_scatter", "cat"])
def test_k_computed_apart_by_token_row_is_never_lowered(how, tokens):
    """A K that treats token rows apart (only the first 3 rotated) must not become the op, which treats every row
    alike: the evaluation sees the first rows only, so it refuses any op that tells rows apart (a mask, a slice or
    a scatter over the token dim, the token index itself) and the writes keep today's path with eager's caches."""
    capture = _hf_run(_hf_writer_with(_first_rows_rotated(how)), torch.float32, tokens_list=tokens)
    kept = capture.report.kv_kept
    assert kept and not capture.report.kv_writes, str(capture.report)
    assert all(why.reason is KVKeptReason.UNEVALUABLE for why in kept), kept


def _scaled_by_token_count(how):
    """A layer whose K is scaled by a number computed from the token count T with tensor ops or from T's size
    (the same for every row, but not the same at every T): the evaluation's T is not the call's."""

    def forward(self, x, cos, sin):
        k, v = HFLayer.forward(self, x, cos, sin)
        tokens = k.shape[0]
        if how == "sum":
            scale = 1 + (torch.ones(tokens, 1).sum(0) > 8)
        elif how == "matmul":
            scale = 1 + (torch.ones(1, tokens) @ torch.ones(tokens, 1) > 8)
        else:
            scale = (tokens - 2) * (tokens - 3) + 1
        return k * scale, v

    return type(f"_CountScaled_{how}", (HFLayer,), {"forward": forward})


@pytest.mark.parametrize("tokens", [(6, 11), (20,)], ids=["symbolic-T", "static-T"])
@pytest.mark.parametrize("how", ["sum", "matmul", "size"])
def test_k_scaled_by_the_token_count_is_never_lowered(how, tokens):
    """K scaled by a function of T (a sum or matmul over `ones(T)`, or T's size in arithmetic): the evaluation
    holds T at a few rows, so it refuses a sum over the token dim and a number computed from T, and the writes keep
    today's path with eager's caches."""
    capture = _hf_run(_hf_writer_with(_scaled_by_token_count(how)), torch.float32, tokens_list=tokens)
    assert capture.report.kv_kept and not capture.report.kv_writes, str(capture.report)


def _hf_writer_with(layer_class, **layer_attrs):
    """`HFStyleKVWriter("index_put")` whose layers run `layer_class.forward`, each with `layer_attrs` set (values
    copied per layer)."""
    model = HFStyleKVWriter("index_put")
    for layer in model.layers:
        layer.__class__ = layer_class
        for name, value in layer_attrs.items():
            setattr(layer, name, copy.deepcopy(value))
    return model


def _hf_rope(k, cos, sin):
    return k * cos[:, None, :] + rotate_half(k) * sin[:, None, :]


class _NormalizeLayer(HFLayer):
    """k_norm as `F.normalize(k) * w * sqrt(d)`: an L2 norm (`x / max(|x|, eps)`), not the op's RMSNorm."""

    def forward(self, x, cos, sin):
        shape = (x.shape[0], self.kv_heads, self.head_dim)
        k = F.normalize(self.k_proj(x).view(shape), dim=-1) * self.k_norm.weight * self.head_dim**0.5
        return _hf_rope(k, cos, sin), self.v_proj(x).view(shape)


class _PerHeadWeightLayer(HFLayer):
    """RMSNorm with a `[kv_heads, head_dim]` weight: one weight per head, where the op takes one per layer."""

    def forward(self, x, cos, sin):
        shape = (x.shape[0], self.kv_heads, self.head_dim)
        k = self.k_proj(x).view(shape)
        k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6) * self.head_weight
        return _hf_rope(k, cos, sin), self.v_proj(x).view(shape)


class _ScaledAfterRopeLayer(HFLayer):
    """K halved after its norm and RoPE: a scale the op does not apply."""

    def forward(self, x, cos, sin):
        k, v = super().forward(x, cos, sin)
        return k * 0.5, v


class _TensorEpsLayer(HFLayer):
    """RMSNorm whose eps is a 0-d tensor buffer (`eps_t`), not a Python float."""

    def forward(self, x, cos, sin):
        shape = (x.shape[0], self.kv_heads, self.head_dim)
        k = self.k_proj(x).view(shape)
        k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + self.eps_t) * self.k_norm.weight
        return _hf_rope(k, cos, sin), self.v_proj(x).view(shape)


def test_norms_the_op_does_not_compute_are_reported_as_the_norm():
    """An L2 norm (`F.normalize`), a norm weight per head, K scaled after its RoPE and an eps held in a tensor keep
    today's path with eager's caches, and each is reported as the norm it is, not as a RoPE or a table the op cannot
    read."""
    per_head = torch.nn.Parameter(torch.rand(2, 16) + 0.5)
    cases = {
        "normalize": (_hf_writer_with(_NormalizeLayer), "heads 0 and 1 is scaled by different values read from"),
        "per-head weight": (
            _hf_writer_with(_PerHeadWeightLayer, head_weight=per_head),
            "heads 0 and 1 is scaled by different values read from a graph input",
        ),
        "scaled after RoPE": (_hf_writer_with(_ScaledAfterRopeLayer), "K is scaled by 0.5 besides its norm"),
        "tensor eps": (
            _hf_writer_with(_TensorEpsLayer, eps_t=torch.tensor(1e-6)),
            "the norm's eps is not a constant but read from a tensor",
        ),
    }
    sources = {"normalize": "F.normalize", "per-head weight": "head_weight", "tensor eps": "eps_t"}
    for name, (model, detail) in cases.items():
        kept = _hf_run(model, torch.float32).report.kv_kept
        assert kept, name
        for why in kept:
            assert why.reason is KVKeptReason.NORM and detail in why.detail, (name, str(why))
            assert sources.get(name, "") in (why.source or ""), (name, str(why))


class _VNormedLayer(HFLayer):
    """V normed (RMSNorm without weight) as well as K."""

    def forward(self, x, cos, sin):
        k, v = super().forward(x, cos, sin)
        return k, v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)


class _PermBufferLayer(HFLayer):
    """rotate_half as `k[..., perm] * sign` with `perm` a buffer: an index the graph reads from a tensor."""

    def forward(self, x, cos, sin):
        shape = (x.shape[0], self.kv_heads, self.head_dim)
        k = self.k_norm(self.k_proj(x).view(shape))
        half = self.head_dim // 2
        sign = torch.cat((-torch.ones(half), torch.ones(half)))
        return k * cos[:, None, :] + k[..., self.perm] * sign * sin[:, None, :], self.v_proj(x).view(shape)


class _RotationMatrixLayer(HFLayer):
    """rotate_half as `k @ rot`, `rot` a `[head_dim, head_dim]` signed permutation buffer: a product per head."""

    def forward(self, x, cos, sin):
        shape = (x.shape[0], self.kv_heads, self.head_dim)
        k = self.k_norm(self.k_proj(x).view(shape))
        return k * cos[:, None, :] + (k @ self.rot) * sin[:, None, :], self.v_proj(x).view(shape)


def _rotate_half_matrix(head_dim: int) -> torch.Tensor:
    """`rot` with `k @ rot == rotate_half(k)`."""
    half, rot = head_dim // 2, torch.zeros(head_dim, head_dim)
    for i in range(half):
        rot[i + half, i] = -1.0
        rot[i, i + half] = 1.0
    return rot


class _KWrittenTwice(HFStyleKVWriter):
    """Each layer's K also written into a second cache (`d_cache_i`)."""

    def __init__(self):
        super().__init__("index_put")
        for i in range(len(self.layers)):
            self.register_buffer(f"d_cache_{i}", torch.randn(64, 2, 16))

    def caches(self):
        return [*super().caches(), *(getattr(self, f"d_cache_{i}") for i in range(len(self.layers)))]

    def forward(self, x, positions, loc):
        for i, (k, v) in enumerate(HFStyleDraft.forward(self, x, positions)):
            getattr(self, f"k_cache_{i}")[loc] = k
            getattr(self, f"v_cache_{i}")[loc] = v
            getattr(self, f"d_cache_{i}")[loc] = k


def test_writes_that_do_not_pair_into_k_and_v_say_why():
    """A V with a norm, a K written into two caches, a rotation through an index read from a buffer and one written
    as a product by a matrix (`k @ rot`) keep today's path with eager's caches, each with its own reason (not "the
    layers differ", not "a term without a projection element" alone, not "not a [T, heads, head_dim] value")."""
    perm = torch.cat((torch.arange(8, 16), torch.arange(8)))
    cases = {
        "V normed": (_hf_writer_with(_VNormedLayer), KVKeptReason.NORM, "4 cache writes are normed but not rotated"),
        "K twice": (_KWrittenTwice(), KVKeptReason.VALUE_SHARED, "is written into 2 caches (k_cache_0, d_cache_0)"),
        "perm buffer": (
            _hf_writer_with(_PermBufferLayer, perm=perm),
            KVKeptReason.UNEVALUABLE,
            "(aten.index), a value the pass does not follow",
        ),
        "rotation matrix": (
            _hf_writer_with(_RotationMatrixLayer, rot=_rotate_half_matrix(16)),
            KVKeptReason.UNEVALUABLE,
            "(aten.mm), a product per head of a value that already reads the projection",
        ),
    }
    for name, (model, reason, detail) in cases.items():
        kept = _hf_run(model, torch.float32).report.kv_kept
        assert kept and all(why.reason is reason and detail in why.detail for why in kept), (name, kept)


class _OneHeadRotatedLayer(HFLayer):
    """RoPE on head 0 only: the other heads' K normed, not rotated."""

    def forward(self, x, cos, sin):
        shape = (x.shape[0], self.kv_heads, self.head_dim)
        k = self.k_norm(self.k_proj(x).view(shape))
        rotated = _hf_rope(k[:, :1], cos, sin)
        return torch.cat((rotated, k[:, 1:]), dim=1), self.v_proj(x).view(shape)


def test_a_rope_of_some_heads_only_is_reported_as_the_rope():
    """Head 0 rotated and head 1 not: the heads differ in the elements they mix, not in a scale, so the writes keep
    today's path with eager's caches and the report says the rotation (not the norm weight both heads read)."""
    kept = _hf_run(_hf_writer_with(_OneHeadRotatedLayer), torch.float32).report.kv_kept
    assert kept, "lowered"
    for why in kept:
        assert why.reason is KVKeptReason.ROPE, str(why)
        assert "element 0 of head 0 mixes elements [0, 8] of its head, of head 1 elements [0]" in why.detail, str(why)


class _LayerNormLayer(HFLayer):
    """k_norm an `nn.LayerNorm` (`ln`): the head's mean subtracted and a bias added, not the op's RMSNorm."""

    def forward(self, x, cos, sin):
        shape = (x.shape[0], self.kv_heads, self.head_dim)
        return _hf_rope(self.ln(self.k_proj(x).view(shape)), cos, sin), self.v_proj(x).view(shape)


def test_a_layer_norm_as_k_norm_is_reported_as_the_norm():
    """`nn.LayerNorm` as k_norm (`native_layer_norm`, an op the evaluation does not look into): the writes keep
    today's path with eager's caches, and the report names the norm (NORM), not a value the pass cannot follow."""
    kept = _hf_run(_hf_writer_with(_LayerNormLayer, ln=torch.nn.LayerNorm(16)), torch.float32).report.kv_kept
    assert kept, "lowered"
    for why in kept:
        assert why.reason is KVKeptReason.NORM, str(why)
        assert "the norm subtracts the mean of the normed elements before it scales them (a LayerNorm" in why.detail
        assert "self.ln(" in (why.source or ""), str(why)


def test_a_graph_of_zero_tokens_says_it_writes_nothing():
    """An empty activation (T = 0, a graph of its own: Dynamo specializes size 0) writes no cache row, and no
    element shows what the writes compute: they keep today's path, eager's (untouched) caches, and the report says
    the graph has no tokens, not that the values are no projection. The next call, with tokens, lowers."""
    capture = _hf_run(HFStyleKVWriter("index_put"), torch.float32, tokens_list=(0, 6))
    empty, full = capture.reports
    assert not empty.kv_writes and len(full.kv_writes) == 1 and not full.kv_kept, str(capture.report)
    assert len(empty.kv_kept) == 8, str(empty)
    for why in empty.kv_kept:
        assert why.reason is KVKeptReason.NO_TOKENS, str(why)
        assert why.detail.startswith("the activation has 0 rows (no tokens): the writes write nothing"), str(why)


class _CachedTables(HFStyleKVWriter):
    """Old HF Llama / GPT-NeoX: `cos_cached` and `sin_cached` buffers `[max_pos, head_dim]` (`cat(freqs, freqs)`)
    read at the positions, or (`as_inputs`) the rows passed in as HF passes `position_embeddings` to its layers."""

    def __init__(self, as_inputs: bool = False):
        super().__init__("index_put")
        self.as_inputs = as_inputs
        freqs = torch.outer(torch.arange(4096).float(), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos())
        self.register_buffer("sin_cached", emb.sin())

    def forward(self, x, positions, loc):
        if not self.as_inputs:
            return self.write_rows(x, self.cos_cached[positions], self.sin_cached[positions], loc)
        return _write_with_rows(self, x, self.cos_cached[positions], self.sin_cached[positions], loc)

    def write_rows(self, x, cos, sin, loc):
        for i, layer in enumerate(self.layers):
            k, v = layer(x, cos, sin)
            getattr(self, f"k_cache_{i}")[loc] = k
            getattr(self, f"v_cache_{i}")[loc] = v


@torch.compiler.disable(recursive=False)
def _write_with_rows(model, x, cos, sin, loc):
    """The rows gathered outside the compiled region, then the writes compiled with them as graph inputs."""
    return model.write_rows(x, cos, sin, loc)


@pytest.mark.parametrize("as_inputs", [False, True], ids=["tables", "rows-as-inputs"])
def test_cos_sin_whose_halves_are_only_equal_in_value_say_so(as_inputs):
    """cos/sin `[.., head_dim]` values read as they are (two buffers read at the positions, or rows passed in):
    their halves are equal only in value, which the graph does not show, so the writes keep today's path with
    eager's caches, and the report says that (TABLES), not that the rotation is not a RoPE."""
    capture = _hf_run(_CachedTables(as_inputs), torch.float32)
    kept = capture.report.kv_kept
    assert kept and not capture.report.kv_writes
    for why in kept:
        assert why.reason is KVKeptReason.TABLES, str(why)
        assert "elements 0 and 8 of a head take their cos from elements 0 and 8 of one value" in why.detail, str(why)
        assert "nothing in the graph shows that its two halves hold the same numbers" in why.detail, str(why)


class _OneRowForAllTokens(torch.nn.Module):
    """sglang-style `[P, R]` `[cos | sin]` table read at `positions // 64`, but every token rotated by the first
    token's row (`table[index][0]`), the writes `cache[loc] = k`."""

    def __init__(self, layers=2, hidden=32, heads=2, head_dim=8):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.k = torch.nn.ModuleList(torch.nn.Linear(hidden, heads * head_dim, bias=False) for _ in range(layers))
        self.v = torch.nn.ModuleList(torch.nn.Linear(hidden, heads * head_dim, bias=False) for _ in range(layers))
        inv_freq = 10000.0 ** -(torch.arange(0, head_dim, 2).float() / head_dim)
        angles = torch.arange(64).float()[:, None] * inv_freq
        self.register_buffer("table", torch.cat([angles.cos(), angles.sin()], -1))
        for i in range(layers):
            self.register_buffer(f"k_cache_{i}", torch.randn(16, heads, head_dim))
            self.register_buffer(f"v_cache_{i}", torch.randn(16, heads, head_dim))

    def forward(self, x, positions, loc):
        cos, sin = self.table[positions // 64][0].chunk(2, -1)
        half = self.head_dim // 2
        for i, (k_proj, v_proj) in enumerate(zip(self.k, self.v, strict=True)):
            k = k_proj(x).view(x.shape[0], self.heads, self.head_dim)
            k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6)
            a, b = k[..., :half], k[..., half:]
            getattr(self, f"k_cache_{i}")[loc] = torch.cat([a * cos - b * sin, b * cos + a * sin], -1)
            getattr(self, f"v_cache_{i}")[loc] = v_proj(x).view(x.shape[0], self.heads, self.head_dim)


def test_one_table_row_for_every_token_is_not_read_per_token():
    """`table[index][0]` gives every token the first token's row: the op, which reads row `index[t]` for token t,
    would rotate the others by their own rows (the numeric self-check draws small positions, whose `// 64` is 0 for
    every token, so the proof itself must see it). Kept, with eager's caches."""
    torch._dynamo.reset()
    model = _OneRowForAllTokens()
    compiled_model = copy.deepcopy(model)
    capture = CaptureBackend(ALWAYS)
    x, positions, loc = torch.randn(4, 32), torch.tensor([0, 64, 128, 192]), torch.tensor([0, 5, 9, 14])
    with torch.no_grad():
        model(x, positions, loc)
        torch.compile(compiled_model, backend=capture)(x, positions, loc)
    assert_close_for_dtype(list(compiled_model.buffers()), list(model.buffers()))
    assert not capture.report.kv_writes and capture.report.kv_kept, str(capture.report)


class _RoundedAngles(HFStyleDraft):
    """HF's cos/sin of angles rounded to the model dtype first (`(positions.float() * inv_freq).to(x.dtype)`)."""

    def forward(self, x, positions):
        angles = (positions[:, None].float() * self.inv_freq[None, :]).to(x.dtype)
        cos, sin = angles.cos(), angles.sin()
        return [layer(x, torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)) for layer in self.layers]


class _AnglesInModelDtype(HFStyleKVWriter, _RoundedAngles):
    pass


def test_cos_sin_of_angles_rounded_to_the_model_dtype_are_read_as_the_graph_computes_them():
    """A bf16 angle is off by up to |angle| / 256 radians (positions up to 4096): cos/sin of it are not the op's
    cos/sin of the fp32 angle (the proof used to leave that rounding out, as it does for values). The op reads the
    graph's own cos/sin rows instead, and the caches equal eager's to bf16 rounding."""
    capture = _hf_run(_AnglesInModelDtype("index_put"), torch.bfloat16)
    _assert_lowered(capture, 4)
    assert "rows built in the graph from the model's per-token cos/sin" in str(capture.report)


def test_explain_reports_the_lowering():
    cfg = small_config(write="commit")
    model = DraftKVWriter(cfg)
    before = model.k_cache_0.clone()
    with torch.no_grad():  # an inference graph, which writes the caches itself
        text = str(explain(model, *draft_inputs(cfg, 8), config=ALWAYS))
    assert "KV writes of 3 layer(s) on ctx -> one multi_linear_kv_write" in text
    assert (
        "layer 0: K layers.0.qkv_proj.weight[64:96] -> k_cache_0, V layers.0.qkv_proj.weight[96:128] -> v_cache_0"
        in text
    )
    assert "commit_lens" in text and "tables cos_sin_0 at positions" in text
    assert torch.equal(model.k_cache_0, before)
    with torch.no_grad():
        text = str(explain(model, *draft_inputs(cfg, 8)))
    assert "kv_write_op='auto' lowers only where the op's CUDA kernel runs: the tensors are on cpu" in text


@pytest.mark.slow
def test_draft_step_context_kv_read_by_attention_keeps_todays_path():
    """The DFlash-like draft of benchmarks/draft_step.py, its context K/V also written to per-layer caches: the
    attention reads them too, so the op (which returns nothing) cannot replace them."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    draft_step = importlib.import_module("draft_step")

    class CachingLayer(draft_step.DraftLayer):
        def __init__(self, cfg):
            super().__init__(cfg)
            shape = (64, cfg.num_kv_heads, cfg.head_dim)
            self.register_buffer("k_cache", torch.zeros(shape))
            self.register_buffer("v_cache", torch.zeros(shape))

        def attention(self, x, target_hidden, ctx_rope, block_rope):
            k, v = self.key_value(target_hidden, *ctx_rope)
            slots = torch.arange(k.shape[0], device=k.device)
            self.k_cache.index_copy_(0, slots, k)
            self.v_cache.index_copy_(0, slots, v)
            return super().attention(x, target_hidden, ctx_rope, block_rope)

    torch._dynamo.reset()
    cfg = draft_step.SMALL
    model = draft_step.build_draft(cfg, "cpu", torch.float32)
    for i, layer in enumerate(model.layers):
        cached = CachingLayer(cfg)
        cached.load_state_dict(layer.state_dict(), strict=False)
        model.layers[i] = cached
    compiled_model = copy.deepcopy(model)
    capture = CaptureBackend(ALWAYS)
    inputs = draft_step.draft_inputs(cfg, 9, "cpu", torch.float32)
    with torch.no_grad():
        assert_close_for_dtype(torch.compile(compiled_model, backend=capture)(*inputs), model(*inputs))
    assert_close_for_dtype([b for _, b in compiled_model.named_buffers()], [b for _, b in model.named_buffers()])
    (report,) = capture.reports
    assert not report.kv_writes and op_counts(capture.after[-1])[OP] == 0
    (why,) = map(str, report.kv_kept)
    assert why.startswith("target_hidden:") and "also read by" in why


@pytest.mark.slow
def test_inductor_runs_the_op_in_place():
    """Real Inductor codegen: the op mutates the cache buffers in place (no clone, no missed reinplacing), the
    symbolic graph serves new token counts, and an in-place weight update is seen."""
    torch._dynamo.reset()
    cfg = small_config(dtype=torch.bfloat16)
    eager = DraftKVWriter(cfg)
    model = copy.deepcopy(eager)
    capture = CaptureBackend(ALWAYS, inner="inductor")
    compiled = torch.compile(model, backend=capture)
    with torch.no_grad(), reinplacing_misses() as misses:
        for tokens in (8, 13, 21):
            args = draft_inputs(cfg, tokens, seed=tokens)
            eager(*args)
            compiled(*args)
            assert_close_for_dtype(model.caches(), eager.caches(), cfg.dtype)
            for m in (eager, model):
                m.layers[1].qkv_proj.weight.mul_(-1.0)
    assert misses["tensors"] == 0
    assert len(capture.reports) == 2 and all(len(r.kv_writes) == 1 for r in capture.reports)


@pytest.mark.slow
def test_one_token_broadcast_to_several_slots_keeps_eager_semantics():
    """`cache[loc] = k` with one token and several slots writes that token everywhere in eager; the lowered graph
    assumes one slot per token (a guard), so such a call compiles a graph that keeps today's path."""
    torch._dynamo.reset()
    cfg = small_config()
    eager = DraftKVWriter(cfg)
    model = copy.deepcopy(eager)
    capture = CaptureBackend(ALWAYS)
    compiled = torch.compile(model, backend=capture)
    with torch.no_grad():
        for tokens, slots in ((6, 6), (9, 9), (1, 3)):
            ctx, positions, _ = draft_inputs(cfg, tokens, seed=tokens)
            loc = torch.randperm(cfg.num_slots)[:slots]
            eager(ctx, positions, loc)
            compiled(ctx, positions, loc)
            assert_close_for_dtype([t for kv in model.caches() for t in kv], [t for kv in eager.caches() for t in kv])
    assert [len(r.kv_writes) for r in capture.reports] == [1, 1, 0], [r.kv_kept for r in capture.reports]
    kept = str(capture.reports[-1].kv_kept[0])
    assert "written with a [T, heads, head_dim] or [T, heads * head_dim] value" in kept  # a [heads, head_dim] value


@pytest.mark.parametrize(
    ("x", "head_dim", "cache", "why"),
    [
        ((4, 64, "cuda", torch.bfloat16), 16, ((32, 2, 16), None), ""),
        ((4, 64, "cpu", torch.bfloat16), 16, ((32, 2, 16), None), "the tensors are on cpu"),
        ((4, 64, "cuda", torch.float32), 16, ((32, 2, 16), None), "must be bfloat16 or float16 on CUDA"),
        ((4, 60, "cuda", torch.float16), 16, ((32, 2, 16), None), "K = 60"),
        ((4, 64, "cuda", torch.float16), 12, ((32, 2, 12), None), "on CUDA, got 12"),
        ((4, 64, "cuda", torch.float16), 512, ((32, 1, 512), None), "on CUDA, got 512"),
        ((4, 64, "cuda", torch.bfloat16), 16, ((32, 2, 16), (32, 1, 64)), "unit inner stride"),
        ((4, 64, "cuda", torch.bfloat16), 16, ((32, 2, 16), (40, 20, 1)), "16-byte aligned"),
    ],
)
def test_auto_lowers_only_where_the_cuda_kernel_runs(monkeypatch, x, head_dim, cache, why):
    """The "auto" rule on fake CUDA tensors (no GPU needed)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dspark_fx.passes import kv_write

    monkeypatch.setattr(kv_write, "has_cuda_kernel", lambda: True)
    *shape, device, dtype = x
    with FakeTensorMode():
        x_val = torch.empty(shape, device=device, dtype=dtype)
        size, stride = cache
        c = torch.empty(size, device=device, dtype=dtype)
        if stride is not None:
            c = torch.empty_strided(size, stride, device=device, dtype=dtype)
        got = kv_write.kernel_mismatch(x_val, head_dim, [c])
    assert (why in got) if why else got == "", got
    monkeypatch.setattr(kv_write, "has_cuda_kernel", lambda: False)
    if device == "cuda":
        assert "no CUDA kernel" in kv_write.kernel_mismatch(x_val, head_dim, [c])


# ---- casts, the op's checks and the numeric self-check -------------------------------------------------------------


class _CastWriter(HFStyleKVWriter):
    """`HFStyleKVWriter` ("index_put") with `cast` applied at `where` (one place or a tuple of them): to K after the
    heads view ("heads", before the norm), to the K value written ("k") or to V ("v"); the activation is
    `x * scale`."""

    def __init__(self, cast, where, scale=1.0):
        super().__init__("index_put")
        self.cast, self.where, self.scale = cast, (where,) if isinstance(where, str) else where, scale

    def _at(self, where, t):
        return self.cast(t) if where in self.where else t

    def forward(self, x, positions, loc):
        x = x * self.scale
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for i, layer in enumerate(self.layers):
            shape = (x.shape[0], layer.kv_heads, layer.head_dim)
            k = layer.k_norm(self._at("heads", layer.k_proj(x).view(shape)))
            k = k * cos[:, None, :] + rotate_half(k) * sin[:, None, :]
            getattr(self, f"k_cache_{i}")[loc] = self._at("k", k)
            getattr(self, f"v_cache_{i}")[loc] = self._at("v", layer.v_proj(x).view(shape))


def _round_trip(*dtypes):
    def cast(t):
        out = t
        for dtype in dtypes:
            out = out.to(dtype)
        return out.to(t.dtype)

    return cast


def _cast_run(model, dtype):
    """Eager vs compiled (always lowering) caches of a `_CastWriter`, non-finite values included; returns the
    capture and the eager caches."""
    torch._dynamo.reset()
    model = model.to(dtype)
    compiled_model = copy.deepcopy(model)
    capture = CaptureBackend(ALWAYS)
    compiled = torch.compile(compiled_model, backend=capture)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for tokens in (6, 11):
            x = torch.randn(tokens, 64, generator=gen).to(dtype)
            positions = torch.randint(0, 4096, (tokens,), generator=gen)
            loc = torch.randperm(64, generator=gen)[:tokens]
            model(x, positions, loc)
            compiled(x, positions, loc)
            tol = TOLERANCES[dtype]
            for got, want in zip(compiled_model.caches(), model.caches(), strict=True):
                torch.testing.assert_close(got, want, rtol=tol, atol=tol, equal_nan=True)
    return capture, model.caches()


@pytest.mark.slow
@pytest.mark.parametrize("where", ["k", "heads", "v"])
def test_fp8_fake_quantized_branch_keeps_todays_path(where):
    """`k.to(float8_e4m3fn).to(bfloat16)` rounds K to fp8 in eager; the op would not: not lowered, the cast named."""
    capture, _ = _cast_run(_CastWriter(_round_trip(torch.float8_e4m3fn), where), torch.bfloat16)
    why = _kept(capture)
    assert "casts torch.bfloat16 to torch.float8_e4m3fn, a rounding the op does not make" in why, why


@pytest.mark.slow
@pytest.mark.parametrize("where", ["heads", "v"])
def test_fp16_round_trip_that_overflows_keeps_eagers_non_finite_values(where):
    """bf16 -> fp16 -> bf16 of values beyond fp16's range gives inf (and NaN after the norm) in eager; the op
    computes in fp32 and would write finite values: not lowered, and the caches hold what eager holds."""
    capture, caches = _cast_run(_CastWriter(_round_trip(torch.float16), where, scale=1e6), torch.bfloat16)
    assert any(not c.isfinite().all() for c in caches), "the case must overflow fp16 in eager"
    assert "casts torch.bfloat16 to torch.float16" in _kept(capture)


class _SquaresInModelDtype(torch.nn.Module):
    """HF's RMSNorm without its fp32 upcast: the squares and their mean in the model dtype."""

    def __init__(self, norm):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.eps

    def forward(self, k):
        return self.weight * (k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + self.eps))


@pytest.mark.parametrize(
    ("dtype", "scale", "lowered"), [(torch.float16, 1000.0, False), (torch.bfloat16, 1000.0, True)]
)
def test_a_norm_squaring_in_float16_keeps_eagers_values(dtype, scale, lowered):
    """K of a few hundred: squared in float16 (above 256) it overflows, the norm's rsqrt gives 0 and eager writes
    zeros where the op (fp32 squares) would write finite values: not lowered in fp16, the node named; bf16 (fp32's
    range) lowers. Either way the caches hold what eager holds."""
    model = _CastWriter(lambda t: t, (), scale=scale)
    for layer in model.layers:
        layer.k_norm = _SquaresInModelDtype(layer.k_norm)
    for cache in model.caches():
        cache.normal_(generator=torch.Generator().manual_seed(cache.numel()))  # no row of zeros but written ones
    capture, caches = _cast_run(model, dtype)
    if lowered:
        _assert_lowered(capture, 4)
    else:
        assert any((c == 0).all(-1).any() for c in caches[::2]), "the case must overflow the fp16 norm in eager"
        why = _kept(capture)
        assert "computes the norm's squares of the projection in torch.float16" in why, why


@pytest.mark.slow
def test_narrowing_round_trip_in_an_fp32_model_keeps_todays_path():
    """fp32 -> bf16 -> fp32 in an fp32 model rounds to bf16 (not the model dtype): not lowered."""
    capture, _ = _cast_run(_CastWriter(_round_trip(torch.bfloat16), "heads"), torch.float32)
    assert "casts torch.float32 to torch.bfloat16" in _kept(capture)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("dtype", "cast"),
    [
        pytest.param(torch.bfloat16, _round_trip(torch.float32), id="bf16-fp32"),  # rounds nothing
        pytest.param(torch.bfloat16, _round_trip(torch.float32, torch.float64), id="bf16-fp32-fp64"),
        pytest.param(torch.float16, _round_trip(torch.float32), id="fp16-fp32"),
        pytest.param(torch.float32, _round_trip(torch.float64), id="fp32-fp64"),
    ],
)
def test_widening_casts_still_lower(dtype, cast):
    """A cast that rounds nothing, at every place of the branch at once (K after the heads view, the K written and
    V): lowered. (Each place alone keeps today's path for a rounding cast: the fp8 test above.)"""
    capture, _ = _cast_run(_CastWriter(cast, ("k", "heads", "v")), dtype)
    _assert_lowered(capture, 4)


def test_numeric_self_check_refuses_a_wrong_eps(monkeypatch):
    """A proof that reads a wrong eps (only the fp64 self-check can tell): not lowered, eager results."""
    from dspark_fx.passes import kv_write

    read_written = kv_write.read_written

    def wrong_eps(*args):
        written = read_written(*args)
        if written.norm is None:
            return written
        return dataclasses.replace(written, norm=dataclasses.replace(written.norm, eps=written.norm.eps * 10))

    monkeypatch.setattr(kv_write, "read_written", wrong_eps)
    torch._dynamo.reset()
    capture = CaptureBackend(ALWAYS)
    for eager, compiled in eager_and_compiled(small_config(norm="rms_norm"), capture):
        assert_close_for_dtype(compiled, eager)
    why = _kept(capture)
    assert "the numeric self-check refuses it: on random fp64 inputs layer 0's K" in why, why
    assert "differs from the op's formula" in why


@pytest.mark.slow
def test_numeric_self_check_refuses_a_wrong_rope_style(monkeypatch):
    from dspark_fx.passes import kv_write

    read_written = kv_write.read_written

    def flipped(*args):
        written = read_written(*args)
        if written.rope is None:
            return written
        return dataclasses.replace(written, rope=dataclasses.replace(written.rope, neox=not written.rope.neox))

    monkeypatch.setattr(kv_write, "read_written", flipped)
    capture = _hf_run(HFStyleKVWriter("index_put"), torch.float32)
    assert "the numeric self-check refuses it" in _kept(capture)


def test_emitted_op_gets_its_value_from_the_fake_impl(monkeypatch):
    """The op node's `meta["val"]` comes from running the op's fake impl (its checks) on the operands' fake values
    (`None`: the op returns nothing)."""
    from custom_ops.linear import multi_linear_kv_write as op_module

    checked = []
    check_args = op_module._check_args

    def spy(*args, **kwargs):
        checked.append(args[0])
        return check_args(*args, **kwargs)

    monkeypatch.setattr(op_module, "_check_args", spy)
    capture = _hf_run(HFStyleKVWriter("index_copy"), torch.float32, tokens_list=(6,))
    node = _op_node(capture.after[-1])
    assert "val" in node.meta and node.meta["val"] is None
    assert any(x is node.args[0].meta["val"] for x in checked), "the fake impl did not run on the node's operands"


def test_operands_the_op_refuses_keep_todays_path():
    """A negative k_norm eps is fine for eager `rsqrt(mean + eps)` but not for the op (its checks raise): the fake
    impl refuses it at compile time, so the graph keeps today's path instead of raising at run time."""
    capture = _hf_run(HFStyleKVWriter("index_put", eps=-1e-7), torch.float32)
    why = _kept(capture)
    assert "the op's fake impl refuses the operands: multi_linear_kv_write: k_norm_eps[0] must be finite" in why, why


@pytest.mark.usefixtures("builds_cuda_library")
@pytest.mark.parametrize("norm_stride", [1, 2], ids=["contiguous", "strided"])
def test_cuda_binding_rules_are_checked_at_compile_time(monkeypatch, norm_stride):
    """The graph of a CPU compile, its values made fake CUDA tensors (no GPU needed): a k_norm weight with stride 2,
    which the CUDA binding refuses, keeps today's path with the binding's reason; a contiguous one lowers."""
    from dspark_fx.passes import kv_write
    from dspark_fx.passes.horizontal import fuse_kv_branches

    monkeypatch.setattr(kv_write, "has_cuda_kernel", lambda: True)
    torch._dynamo.reset()
    capture = CaptureBackend(DsparkConfig(kv_write_op="never"))
    eager_and_compiled(small_config(dtype=torch.bfloat16, norm="rms_norm"), capture)
    graph = capture.before[-1]
    head_dim = small_config().head_dim

    def norm_strided(node, v):
        is_norm_weight = node.op == "placeholder" and tuple(v.shape) == (head_dim,)
        return (norm_stride,) if is_norm_weight else v.stride()

    as_fake_cuda(graph, norm_strided)
    report = fuse_kv_branches(graph, ALWAYS, None)
    if norm_stride == 1:
        assert len(report.kv_writes) == 1, str(report)
    else:
        assert not report.kv_writes
        (why,) = map(str, report.kv_kept)
        assert "the op's fake impl refuses the operands" in why and "must be contiguous on CUDA" in why, why


@pytest.mark.parametrize("tokens", [24, 32, 64], ids=["T24", "T32-kv-width", "T64-hidden"])
@pytest.mark.parametrize(
    "options", quick_first(1, REFERENCE_VARIANTS[:4]), ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items())
)
def test_static_token_counts_lower_and_are_checked_at_a_few_tokens(monkeypatch, options, tokens):
    """A static T (a first compile, `dynamic=False`) lowers like a symbolic one, and its numeric self-check evaluates
    3 tokens, not T (T = 4096 would take seconds and gigabytes in fp64), also where T equals another size of the
    graph (the K/V width 32, the hidden size 64)."""
    from dspark_fx.passes import kv_write_check

    checked_rows = []
    run = kv_write_check._Evaluation.run

    def spy(self, values):
        env = run(self, values)
        checked_rows.append(env[self.activation].shape[0])
        return env

    monkeypatch.setattr(kv_write_check._Evaluation, "run", spy)
    torch._dynamo.reset()
    cfg = small_config(**options)
    capture = CaptureBackend(ALWAYS)
    for eager, compiled in eager_and_compiled(cfg, capture, tokens_list=(tokens,), compile_kwargs={"dynamic": False}):
        assert_close_for_dtype(compiled, eager, cfg.dtype)
    _assert_lowered(capture, cfg.num_layers)
    assert checked_rows == [kv_write_check.CHECK_TOKENS], checked_rows
