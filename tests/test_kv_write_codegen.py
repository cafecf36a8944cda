"""Real Inductor codegen (CPU) of graphs whose K/V writes the lowering replaced (`kv_write_op="always"`): every
node the pass emits must be one Inductor lowers on the post-grad graph, where it runs. One model per kind of
emitted node: the op with `table[positions]` tables, the `[T, R]` fp32 rows it builds from per-token cos/sin
(slice, cat, cast) read at `arange(T)`, the slice write's `start + arange(T)` (a static and a symbolic start), the
commit write's flattened `loc2d`, and a symbolic T read with `sym_size`. Each compile costs seconds: few, small
models.
"""

import copy

import pytest
import torch
from gptj_models import GPTJStackWriter
from helpers import draft_inputs, small_config
from hf_models import HFStyleKVWriter

from dspark_fx import DsparkConfig
from dspark_fx.passes.kv_write import KV_WRITE
from dspark_fx.reference_draft import DraftKVWriter
from dspark_fx.testing import CaptureBackend, assert_close_for_dtype, op_counts

pytestmark = pytest.mark.slow

ALWAYS = DsparkConfig(kv_write_op="always")
OP = "dspark.multi_linear_kv_write"
prims = torch.ops.prims


def _op_args(graph):
    (node,) = [n for n in graph.nodes if n.target is KV_WRITE]
    return node.args


def _compile_and_compare(model, dtype, inputs, update=None) -> CaptureBackend:
    """Run `model` eagerly and Inductor-compiled on each of `inputs`, comparing the caches after each call (and
    applying `update`, an in-place change of weights, to both after it); every compile must lower the writes."""
    torch._dynamo.reset()
    compiled_model = copy.deepcopy(model)
    capture = CaptureBackend(ALWAYS, inner="inductor")
    compiled = torch.compile(compiled_model, backend=capture)
    with torch.no_grad():
        for args in inputs:
            model(*args)
            compiled(*args)
            assert_close_for_dtype(compiled_model.caches(), model.caches(), dtype)
            if update is not None:
                update(model)
                update(compiled_model)
    assert capture.reports, "nothing was compiled"
    for report, after in zip(capture.reports, capture.after, strict=True):
        assert len(report.kv_writes) == 1, str(report)
        counts = op_counts(after)
        assert counts[OP] == 1 and counts["aten.index_put"] + counts["aten.slice_scatter"] == 0, str(report)
    return capture


def _gptj_inputs(tokens_list, dtype, slots=64, max_pos=512):
    gen = torch.Generator().manual_seed(7)
    return [
        (
            torch.randn(t, 64, generator=gen).to(dtype),
            torch.randint(0, max_pos, (t,), generator=gen),
            torch.randperm(slots, generator=gen)[:t],
        )
        for t in tokens_list
    ]


def _update_gptj(model: GPTJStackWriter) -> None:
    projs = model.kv_proj if model.fused_kv else model.k_proj
    projs[1].weight.mul_(-1.5)
    model.k_norm[0].mul_(2.0)
    model.table.mul_(0.5)


@pytest.mark.parametrize(
    "dtype, fused_kv", [(torch.float32, False), (torch.bfloat16, True)], ids=["fp32-k_v_linears", "bf16-kv_split"]
)
def test_gptj_stack_flatten_rope_draft_compiles_and_matches_eager(dtype, fused_kv):
    """GPT-J RoPE on strided pairs put back with stack/flatten, cos/sin from `table[pos].chunk(2, -1)`: the op reads
    the fp32 `[cos | sin]` table itself at the positions. One token (a static graph), then several (one symbolic
    graph); in-place weight and table updates are seen."""
    torch.manual_seed(0)
    model = GPTJStackWriter(dtype, fused_kv=fused_kv)
    capture = _compile_and_compare(model, dtype, _gptj_inputs((1, 5, 9), dtype), _update_gptj)
    assert len(capture.reports) == 2, "T=1, then one symbolic graph: an in-place update must not recompile"
    assert "GPT-J RoPE on 16 of 16 dims, tables table at positions" in str(capture.report)


def test_hf_inverse_frequencies_compile_and_match_eager():
    """HF `emb = cat(freqs, freqs)` cos/sin from `inv_freq` (bf16): the op gets `inv_freq` and the positions and
    computes cos/sin itself (fp32, where eager rounds them to bf16: within bf16's tolerance)."""
    torch.manual_seed(0)
    model = HFStyleKVWriter("index_put", layers=3).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    inputs = [
        (torch.randn(t, 64, generator=gen).to(torch.bfloat16), torch.randint(0, 4096, (t,), generator=gen), loc)
        for t, loc in ((6, torch.arange(6)), (11, torch.randperm(64, generator=gen)[:11]))
    ]
    capture = _compile_and_compare(model, torch.bfloat16, inputs)
    assert "inverse frequencies inv_freq (cos/sin computed in the op) at positions" in str(capture.report)


def test_rotate_half_by_roll_compiles_and_matches_eager():
    """`rotate_half` by `torch.roll` and a sign (an `index` by `(iota + shift) % D` in the post-grad graph): lowered,
    the op runs through Inductor codegen and matches eager at a static and then a symbolic token count."""
    torch.manual_seed(0)
    model = HFStyleKVWriter("index_put", layers=3, rotate="roll")
    gen = torch.Generator().manual_seed(5)
    inputs = [
        (torch.randn(t, 64, generator=gen), torch.randint(0, 4096, (t,), generator=gen), torch.randperm(64)[:t])
        for t in (6, 11)
    ]
    capture = _compile_and_compare(model, torch.float32, inputs)
    assert "neox RoPE on 16 of 16 dims, inverse frequencies inv_freq" in str(capture.report)


def test_hf_cos_sin_rows_and_slice_write_compile_and_match_eager():
    """HF `emb = cat(freqs, freqs)` cos/sin (bf16) at shifted positions: rows sliced, concatenated and cast to fp32
    in the graph; the slice write `cache[a:a + T] = k` gets `a + arange(T)`, with `a` static in the first graph,
    symbolic after."""
    torch.manual_seed(0)
    model = HFStyleKVWriter("slice", layers=3, position_offset=2).to(torch.bfloat16)
    for cache in model.caches():
        cache.normal_()
    gen = torch.Generator().manual_seed(3)
    inputs = [
        (torch.randn(t, 64, generator=gen).to(torch.bfloat16), torch.randint(0, 4096, (t,), generator=gen), start)
        for t, start in ((6, 3), (11, 40), (7, 57))
    ]
    capture = _compile_and_compare(model, torch.bfloat16, inputs)
    assert "built in the graph from the model's per-token cos/sin" in str(capture.report)
    tables = _op_args(capture.after[-1])[9]
    assert all(t.target is prims.convert_element_type.default for t in tables), "bf16 rows cast to fp32"
    starts = [n.kwargs["start"] for g in capture.after for n in g.nodes if n.target is prims.iota.default]
    assert 3 in starts and any(isinstance(s, torch.fx.Node) for s in starts), starts


class _PlainCommitWriter(torch.nn.Module):
    """K/V without norm or RoPE, committed as the reference draft does: rows `j < lens[b]` of `loc2d [B, W]`."""

    def __init__(self, layers=3, hidden=64, slots=64):
        super().__init__()
        self.k_proj = torch.nn.ModuleList(torch.nn.Linear(hidden, 32) for _ in range(layers))
        self.v_proj = torch.nn.ModuleList(torch.nn.Linear(hidden, 32) for _ in range(layers))
        for i in range(layers):
            self.register_buffer(f"k_cache_{i}", torch.randn(slots, 2, 16))
            self.register_buffer(f"v_cache_{i}", torch.randn(slots, 2, 16))

    def caches(self):
        return [getattr(self, f"{kv}_cache_{i}") for i in range(len(self.k_proj)) for kv in "kv"]

    def forward(self, ctx, loc2d, lens):
        keep = (torch.arange(loc2d.shape[1])[None, :] < lens[:, None]).reshape(-1, 1, 1)
        loc = loc2d.reshape(-1)
        for i in range(len(self.k_proj)):
            for cache, proj in (
                (getattr(self, f"k_cache_{i}"), self.k_proj[i]),
                (getattr(self, f"v_cache_{i}"), self.v_proj[i]),
            ):
                cache[loc] = torch.where(keep, proj(ctx).view(-1, 2, 16), cache[loc])


def test_commit_writes_compile_and_match_eager():
    """The commit form `where(arange(W) < lens[:, None], k, cache[loc2d])`, with RoPE (the reference draft: the
    op reads the table at the positions) and without (the op's positions are `loc2d` flattened)."""
    cfg = small_config(dtype=torch.bfloat16, write="commit", qkv_bias=True)
    capture = _compile_and_compare(DraftKVWriter(cfg), cfg.dtype, [draft_inputs(cfg, t, seed=t) for t in (8, 20)])
    assert all(_op_args(after)[15] is not None for after in capture.after), "commit_lens"
    gen = torch.Generator().manual_seed(5)
    inputs = [
        (
            torch.randn(4 * b, 64, generator=gen),
            torch.randperm(64, generator=gen)[: 4 * b].view(b, 4),
            torch.randint(0, 5, (b,), generator=gen),
        )
        for b in (2, 5)
    ]
    capture = _compile_and_compare(_PlainCommitWriter(), torch.float32, inputs)
    assert all(_op_args(after)[10].target is torch.ops.aten.reshape.default for after in capture.after)
