"""Values the fusion replaces (a column block of the fused GEMM output, a branch's `select` of a batched value, and
what ATen ops compute from them) have other strides than in eager. A consumer that is not an ATen op (a custom op
reading its input's memory as dense rows, the graph's outputs) must still get the eager layout."""

import pytest
import torch
import torch.nn.functional as F
from fuzz_models import dense_rows
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from dspark_fx import DsparkConfig
from dspark_fx.passes.graph_utils import op_name
from dspark_fx.passes.manager import DsparkPassManager
from dspark_fx.testing import CaptureBackend, assert_close_for_dtype


class _Branches(nn.Module):
    """Three projections of one input: the custom op reads a GEMM output (a column block after the fusion), a
    normed per-head value (a slice of the batched norm) and a value computed from the normed one by ATen ops."""

    def __init__(self, hidden: int = 32, heads: int = 2, head_dim: int = 8):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.lins = nn.ModuleList(nn.Linear(hidden, heads * head_dim, bias=False) for _ in range(3))
        self.norms = nn.ParameterList(nn.Parameter(torch.rand(head_dim) + 0.5) for _ in range(3))

    def forward(self, x):
        outs = []
        for lin, w in zip(self.lins, self.norms, strict=True):
            y = lin(x)
            k = y.view(-1, self.heads, self.head_dim)
            n = F.rms_norm(k, (self.head_dim,), w, 1e-6)
            outs += [dense_rows(y), dense_rows(n), dense_rows(n.relu())]
        return outs


@pytest.mark.parametrize("tokens", [5, 1])
def test_custom_op_reading_dense_memory_gets_eager_strides(tokens):
    torch._dynamo.reset()
    model = _Branches()
    capture = CaptureBackend()
    x = torch.randn(tokens, 32)
    with torch.no_grad():
        out = torch.compile(model, backend=capture, fullgraph=True)(x)
        capture.assert_fused(n_groups=1, n_branches=[3])
        assert capture.report.groups[0].classes, capture.report
        assert_close_for_dtype(out, model(x))


def test_returned_values_have_eager_strides():
    """A returned normed value is a `select` of the batched one: the caller (a `.view(-1)`) expects eager strides."""
    torch._dynamo.reset()
    lins = nn.ModuleList(nn.Linear(32, 16, bias=False) for _ in range(3))

    def fn(x):
        return [F.rms_norm(lin(x).view(-1, 2, 8), (8,), None, 1e-6) * 2 for lin in lins]

    x = torch.randn(5, 32)
    capture = CaptureBackend()
    with torch.no_grad():
        out = torch.compile(fn, backend=capture, fullgraph=True)(x)
        expected = fn(x)
    capture.assert_fused(n_groups=1, n_branches=[3])
    assert [o.stride() for o in out] == [e.stride() for e in expected]
    assert_close_for_dtype([o.view(-1) for o in out], [e.view(-1) for e in expected])


@torch.library.custom_op("dspark_layout_test::scale_", mutates_args=["x"])
def _scale_(x: torch.Tensor) -> None:
    """Multiply every element in place by its flat index plus one (an in-place op like vLLM's rotary_embedding)."""
    x.mul_(torch.arange(1, x.numel() + 1, dtype=x.dtype, device=x.device).view(x.shape))


@_scale_.register_fake
def _(x: torch.Tensor) -> None:
    return None


def _scaled_in_place(how: str):
    """Three projections of `x`, each scaled in place by `_scale_` (auto_functionalized_v2 after Dynamo, which
    rebuilds the view from its base at the eager storage offset): on the GEMM output's `[T, 2, 8]` view (at T = 1 a
    column block of the fused output has the eager strides but another offset), or on a flat view of its
    rotate_half (each a `select` of the batched cat: the eager strides, another offset)."""
    ws = [torch.randn(16, 32) for _ in range(3)]

    def fn(x):
        outs = []
        for w in ws:
            y = (x @ w.t()).view(-1, 2, 8)
            if how == "rotate_half":
                y = torch.cat([-y[..., 4:], y[..., :4]], -1)
                _scale_(y.view(-1))
            else:
                _scale_(y)
            outs.append(y)
        return outs

    return fn


@pytest.mark.parametrize(
    ("how", "tokens", "inner"),
    [
        ("gemm_view", 1, "aot_eager"),
        ("rotate_half", 5, "aot_eager"),
        pytest.param("gemm_view", 1, "inductor", marks=pytest.mark.slow),
        pytest.param("rotate_half", 5, "inductor", marks=pytest.mark.slow),
    ],
)
def test_an_in_place_op_on_a_fused_value_writes_its_own_elements(how, tokens, inner):
    """Each branch's base was a slice / select of the fused buffer with the eager strides, so no copy was made, and
    auto_functionalized_v2 rebuilt the view at the eager offset: every branch scaled the first branch's elements."""
    torch._dynamo.reset()
    fn = _scaled_in_place(how)
    x = torch.randn(tokens, 32)
    capture = CaptureBackend({"fuse_on_cpu": True}, inner=inner)
    with torch.no_grad():
        out = torch.compile(fn, backend=capture, fullgraph=True)(x)
        expected = fn(x)
    capture.assert_fused(n_groups=1, n_branches=[3])
    assert_close_for_dtype(out, expected)


def test_returned_views_of_a_returned_value_still_share_its_memory():
    """`ya` is copied into its eager strides; `ya[2]` and `ya[:, 4:]` stayed views of the fused output, so a caller
    writing `ya` in place no longer saw it through them (eager: they share memory); views by ops the pass did not
    know as views (`diagonal`, `unfold`, `squeeze()`) too."""
    torch._dynamo.reset()
    wa, wb = torch.randn(16, 32), torch.randn(16, 32)

    def fn(x):
        ya, yb = x @ wa.t(), x @ wb.t()
        return ya, ya[2], ya[:, 4:], yb, ya, ya.diagonal(), ya.unfold(1, 4, 4), ya.squeeze(), ya.t()

    x = torch.randn(6, 32)
    capture = CaptureBackend({"fuse_on_cpu": True})
    with torch.no_grad():
        out = torch.compile(fn, backend=capture, fullgraph=True)(x)
        expected = fn(x)
    capture.assert_fused(n_groups=1, n_branches=[2])
    assert_close_for_dtype(out, expected)
    assert [o.stride() for o in out] == [e.stride() for e in expected]
    out[0].add_(100.0)
    expected[0].add_(100.0)
    assert_close_for_dtype(out, expected)


def _row_parallel_after_fused_gemms(x, wa, wb, wo):
    """Two GEMMs on `x` (they fuse), a gather by a tensor constant (which the layout check cannot re-run on fake
    values: the strides below it are unknown), a row-parallel GEMM and its all-reduce."""
    c10d = torch.ops._c10d_functional
    y = x @ wa.t() + x @ wb.t()
    y = y[:, torch.tensor([1, 0, 3, 2] * 4)]
    return c10d.wait_tensor(c10d.all_reduce(y @ wo.t(), "sum", "0"))


def test_a_collective_is_waited_on_itself_never_on_a_copy():
    """A copy of an all-reduce's output placed before its `wait_tensor` read the buffer before the collective had
    written it (ranks got part of the sum); the layout step may copy after the wait, never between."""
    args = (torch.randn(8, 32), torch.randn(16, 32), torch.randn(16, 32), torch.randn(32, 16))
    gm = make_fx(_row_parallel_after_fused_gemms, tracing_mode="fake")(*args)
    manager = DsparkPassManager(DsparkConfig(fuse_on_cpu=True))
    manager(gm.graph, is_inference=True)
    assert manager.reports[-1].groups, "the two GEMMs on x must fuse for this test to mean anything"
    (wait,) = [n for n in gm.graph.nodes if op_name(n) == "_c10d_functional.wait_tensor"]
    assert op_name(wait.args[0]) == "_c10d_functional.all_reduce", gm.graph
    (reduce,) = wait.args[0].all_input_nodes
    assert op_name(reduce) in ("aten.mm", "aten.clone"), gm.graph
