"""A tensor the lowered K/V write reads, written in place later in the same forward (`positions += 1` after the
writes, a weight or table updated after its use): AOT writes a mutated input back with a `copy_` at the end of the
graph, which may come before the caches' `copy_`s where the op takes their place; the op must read the value the
model read, so it moves before that write, or the writes are kept where it cannot move."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_models import HFStyleKVWriter
from torch.fx.experimental.proxy_tensor import make_fx

from dspark_fx import DsparkConfig
from dspark_fx.passes.kv_write import KV_WRITE
from dspark_fx.passes.manager import DsparkPassManager
from dspark_fx.report import KVKeptReason
from dspark_fx.testing import CaptureBackend, assert_close_for_dtype, op_counts

ALWAYS = DsparkConfig(kv_write_op="always")
OP = "dspark.multi_linear_kv_write"


class _UpdatesAfterWrites(HFStyleKVWriter):
    """`HFStyleKVWriter` that writes in place into one tensor its K/V writes read, after them (`what`)."""

    def __init__(self, what: str) -> None:
        super().__init__(write="index_put", hidden=32, layers=3)
        self.what = what

    def forward(self, x, positions, loc):
        super().forward(x, positions, loc)
        if self.what == "positions":
            positions.add_(1)  # the next step's positions
        elif self.what == "activation":
            x.mul_(0.5)
        elif self.what == "k_weight":
            self.layers[0].k_proj.weight.mul_(0.5)
        elif self.what == "v_bias":
            self.layers[2].v_proj.bias.add_(1.0)
        elif self.what == "norm_weight":
            self.layers[1].k_norm.weight.mul_(2.0)
        elif self.what == "inv_freq":
            self.inv_freq.mul_(0.5)
        else:
            loc.add_(1)


def _updated_after_writes(what: str, inner: str = "aot_eager", device: str = "cpu", config=ALWAYS) -> None:
    """Eager against compiled (`what` written in place after the K/V writes): every cache, parameter and input
    agrees, the writes became the op, and the op comes before every write into a tensor it reads."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = _UpdatesAfterWrites(what)
    for cache in eager.caches():
        cache.fill_(-7.0)  # the slots not written keep it, in both
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    eager = eager.to(device, dtype)
    model = copy.deepcopy(eager)
    capture = CaptureBackend(config, inner=inner)
    compiled = torch.compile(model, backend=capture)
    inputs = [torch.randn(5, 32), torch.tensor([40, 3, 17, 8, 29]), torch.tensor([3, 0, 19, 7, 11])]
    inputs = [t.to(device, dtype) if t.is_floating_point() else t.to(device) for t in inputs]
    mine = [t.clone() for t in inputs]
    with torch.no_grad():
        eager(*inputs)
        compiled(*mine)
    graph = capture.after[-1]
    assert op_counts(graph)[OP] == 1, str(capture.report)
    assert_close_for_dtype(list(model.buffers()) + mine, list(eager.buffers()) + inputs, dtype)
    assert_close_for_dtype(list(model.parameters()), list(eager.parameters()), dtype)
    nodes = list(graph.nodes)
    (op,) = [n for n in nodes if n.target is KV_WRITE]
    operands = {n for n in op.all_input_nodes if n.op == "placeholder"}
    updates = [n for n in nodes if n.target is torch.ops.aten.copy_.default and n.args[0] in operands]
    assert all(nodes.index(op) < nodes.index(u) for u in updates), graph
    # a bf16 inv_freq is not the op's operand (the op reads fp32 rows the graph builds from the cos/sin it computes)
    assert updates or (what == "inv_freq" and dtype != torch.float32), graph


WHAT = ["positions", "activation", "k_weight", "v_bias", "norm_weight", "inv_freq", "slots"]


@pytest.mark.parametrize("what", WHAT)
def test_an_operand_written_after_the_writes_is_read_before_the_change(what):
    _updated_after_writes(what)


@pytest.mark.slow
@pytest.mark.parametrize("what", ["positions", "k_weight"])
def test_an_operand_written_after_the_writes_through_inductor(what):
    _updated_after_writes(what, inner="inductor")


@pytest.mark.cuda
@pytest.mark.parametrize("what", ["positions", "inv_freq", "k_weight"])
def test_an_operand_written_after_the_writes_on_cuda_with_auto(what):
    _updated_after_writes(what, inner="inductor", device="cuda", config=DsparkConfig())


def _pieces(table, pos, kc, heads=2, dim=16):
    """The op's neox rotation of `k` at `table[pos]` halves, as a function of the GEMM output."""
    rows = table[pos]
    cos, sin = rows[:, None, : dim // 2], rows[:, None, dim // 2 :]

    def rotate(k):
        k = k.view(-1, heads, dim)
        k1, k2 = k[..., : dim // 2], k[..., dim // 2 :]
        return torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], -1)

    return rotate


def _writes(x, ws, table, pos, loc, caches, between):
    """Two layers' K/V writes in the functional form AOT gives (`copy_(cache, index_put(cache, [loc], value))`),
    with `between(pos, x, caches)` run after the cos/sin rows are read and before the writes."""
    rotate = _pieces(table, pos, caches[0])
    x, out = between(pos, x, caches)
    for layer in range(2):
        k = rotate(x @ ws[2 * layer].t())
        v = (x @ ws[2 * layer + 1].t()).view(-1, 2, 16)
        kc, vc = caches[2 * layer], caches[2 * layer + 1]
        kc.copy_(torch.index_put(kc, [loc], k))
        vc.copy_(torch.index_put(vc, [loc], v))
    return out


def _advance_then_read_a_cache(pos, x, caches):
    pos.add_(1)
    return x, caches[0].sum()


def _advance_then_scale_the_activation(pos, x, caches):
    pos.add_(1)
    return x * 2.0, None


def _advance(pos, x, caches):
    pos.add_(1)
    return x, None


def _advanced_at(when: str):
    """Two layers' writes whose positions are advanced in place, through a view, `when`: "first" (both layers read
    the advanced positions), "between_layers" (layer 0 reads them before, layer 1 after) or "after_a_v_write"
    (layer 0's V is written first, then the positions advanced, then every K computed from them)."""

    def fn(x, ws, table, pos, loc, caches):
        if when == "after_a_v_write":
            caches[1].copy_(torch.index_put(caches[1], [loc], (x @ ws[1].t()).view(-1, 2, 16)))
        if when in ("first", "after_a_v_write"):
            pos.view(-1).add_(1)
        for layer in range(2):
            if when == "between_layers" and layer == 1:
                pos.view(-1).add_(1)
            k = _pieces(table, pos, None)(x @ ws[2 * layer].t())
            kc, vc = caches[2 * layer], caches[2 * layer + 1]
            kc.copy_(torch.index_put(kc, [loc], k))
            if when != "after_a_v_write" or layer:
                vc.copy_(torch.index_put(vc, [loc], (x @ ws[2 * layer + 1].t()).view(-1, 2, 16)))

    return fn


def _pass_on(between, body=None):
    """The pass run on the traced function `_writes(..., between)` (a graph whose positions are written in place in
    the middle, as a user pass running before the dspark pass may leave it), or on `body` with `_writes`'s
    arguments: (graph module, report, inputs, the function)."""
    torch.manual_seed(1)
    inputs = (
        torch.randn(4, 32),
        [torch.randn(32, 32) for _ in range(4)],
        torch.randn(64, 16),
        torch.tensor([5, 17, 40, 2]),
        torch.tensor([3, 9, 11, 20]),
        [torch.randn(24, 2, 16) for _ in range(4)],
    )

    def fn(x, ws, table, pos, loc, caches):
        return _writes(x, ws, table, pos, loc, caches, between)

    fn = body or fn
    gm = make_fx(fn, tracing_mode="fake")(*copy.deepcopy(inputs))
    manager = DsparkPassManager(DsparkConfig(kv_write_op="always", fuse_on_cpu=True))
    manager(gm.graph, is_inference=True)
    gm.graph.lint()
    gm.recompile()
    return gm, manager.reports[-1], inputs, fn


def _runs_as_the_function(gm, inputs, fn) -> tuple:
    """`gm` and `fn` on copies of `inputs`: the caches and positions agree; returns (gm's output, fn's)."""
    expected, got = copy.deepcopy(inputs), copy.deepcopy(inputs)
    out_expected, out_got = fn(*expected), gm(*got)
    assert_close_for_dtype(got[5] + [got[3]], expected[5] + [expected[3]])
    return out_got, out_expected


def test_the_op_moves_before_a_write_into_its_positions_in_the_middle_of_the_graph():
    gm, report, inputs, fn = _pass_on(_advance)
    assert op_counts(gm.graph)[OP] == 1, str(report)
    _runs_as_the_function(gm, inputs, fn)


@pytest.mark.parametrize(
    ("between", "says"),
    [
        (_advance_then_read_a_cache, "uses a cache between that write and the cache writes"),
        (_advance_then_scale_the_activation, "computed after that write"),
    ],
    ids=["cache_read_in_between", "activation_computed_after"],
)
def test_writes_whose_op_cannot_move_before_a_write_into_its_operand_are_kept(between, says):
    gm, report, inputs, fn = _pass_on(between)
    assert op_counts(gm.graph)[OP] == 0
    (kept,) = report.kv_kept
    assert kept.reason is KVKeptReason.OPERAND_WRITTEN and says in kept.detail, str(kept)
    assert "is written in place by" in kept.detail
    out_got, out_expected = _runs_as_the_function(gm, inputs, fn)
    if out_expected is not None:
        assert_close_for_dtype(out_got, out_expected)


def test_a_write_the_model_read_after_stays_before_the_op():
    """`positions` advanced before the K/V computation reads them: the op stays after that write (it reads what the
    model read), where moving it before the write would rotate at the old positions."""
    gm, report, inputs, fn = _pass_on(None, _advanced_at("first"))
    assert op_counts(gm.graph)[OP] == 1, str(report)
    _runs_as_the_function(gm, inputs, fn)


@pytest.mark.parametrize(
    ("when", "says"),
    [
        ("between_layers", "read by the K/V computation before and after add_"),
        ("after_a_v_write", "after the first cache write and read by the K/V computation after that"),
    ],
)
def test_an_operand_written_where_the_op_cannot_read_what_the_model_read_keeps_the_writes(when, says):
    """Layer 0 reads the positions before the advance and layer 1 after it; or the advance comes after layer 0's V
    write (the op's place) and every read after it."""
    gm, report, inputs, fn = _pass_on(None, _advanced_at(when))
    assert op_counts(gm.graph)[OP] == 0
    (kept,) = report.kv_kept
    assert kept.reason is KVKeptReason.OPERAND_WRITTEN and says in kept.detail, str(kept)
    _runs_as_the_function(gm, inputs, fn)


class _SqueezedPositions(torch.nn.Module):
    """HF-style `position_ids [1, T]` read through `squeeze()` (`aten.squeeze.default`) by a RoPE on the model's own
    table, advanced in place after the K/V writes."""

    def __init__(self) -> None:
        super().__init__()
        self.ws = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(32, 32)) for _ in range(4)])
        self.register_buffer("table", torch.randn(64, 16))
        for i in range(4):
            self.register_buffer(f"cache_{i}", torch.full((24, 2, 16), -7.0))

    def forward(self, position_ids, x, loc):
        rotate = _pieces(self.table, position_ids.squeeze(), None)
        for layer in range(2):
            getattr(self, f"cache_{2 * layer}")[loc] = rotate(x @ self.ws[2 * layer].t())
            getattr(self, f"cache_{2 * layer + 1}")[loc] = (x @ self.ws[2 * layer + 1].t()).view(-1, 2, 16)
        position_ids.add_(1)


def test_positions_read_through_a_squeeze_and_advanced_after_the_writes():
    """`squeeze()` was not known as a view, so the op read the advanced positions (caches 57 off)."""
    torch._dynamo.reset()
    eager = _SqueezedPositions()
    model = copy.deepcopy(eager)
    capture = CaptureBackend(ALWAYS)
    inputs = [torch.tensor([[5, 17, 40, 2]]), torch.randn(4, 32), torch.tensor([3, 9, 11, 20])]
    mine = [t.clone() for t in inputs]
    with torch.no_grad():
        eager(*inputs)
        torch.compile(model, backend=capture)(*mine)
    assert op_counts(capture.after[-1])[OP] == 1, str(capture.report)
    assert_close_for_dtype(list(model.buffers()) + mine, list(eager.buffers()) + inputs)
