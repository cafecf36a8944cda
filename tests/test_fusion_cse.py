"""The common-subexpression elimination the fusion runs first (`passes/normalize.py`) merges only nodes that
compute the same value and that nothing tells apart: never buffers someone writes into, never values read from
storage that is written, never two values the graph returns, and never arguments of different types."""

import torch
import torch.fx as fx
from torch import nn

from dspark_fx.passes.normalize import eliminate_common_subexpressions
from dspark_fx.testing import CaptureBackend, assert_close_for_dtype, op_counts

aten = torch.ops.aten


def write_through_out_ops(graph: fx.Graph) -> None:
    """A user post-grad pass: every `sin`/`cos` writes its result into an `empty` buffer through its `.out` op."""
    for node in list(graph.nodes):
        if node.target not in (aten.sin.default, aten.cos.default):
            continue
        val = node.meta["val"]
        with graph.inserting_before(node):
            buffer = graph.call_function(
                aten.empty.memory_format, ([*val.shape],), {"dtype": val.dtype, "device": val.device}
            )
            out = graph.call_function(node.target.overloadpacket.out, (node.args[0],), {"out": buffer})
        out.meta["val"] = val
        node.replace_all_uses_with(out)
        graph.erase_node(node)


def _compile_with_user_pass(fn, user_pass, *args):
    torch._dynamo.reset()
    capture = CaptureBackend()
    with torch._inductor.config.patch(post_grad_custom_post_pass=user_pass), torch.no_grad():
        return capture, torch.compile(fn, backend=capture, fullgraph=True)(*args)


def test_buffers_written_through_out_ops_stay_apart():
    """Two `empty` buffers of one shape, one written by `sin.out` and one by `cos.out`: merged, sin would be cos."""
    lins = nn.ModuleList(nn.Linear(8, 8, bias=False) for _ in range(2))

    def fn(x):
        y = x * 2
        sin, cos = y.sin(), y.cos()
        return sin + lins[0](x), cos * lins[1](x)

    x = torch.randn(5, 8)
    capture, out = _compile_with_user_pass(fn, write_through_out_ops, x)
    with torch.no_grad():
        assert_close_for_dtype(out, fn(x))
    assert op_counts(capture.after[-1])["aten.empty"] == 2, capture.graph_diff()


def test_values_read_from_written_storage_stay_apart():
    """`exp(buffer)` before and after `sin.out` writes the buffer are different values."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    buffer = graph.call_function(aten.zeros.default, ([4],), {"dtype": torch.float32})
    before = graph.call_function(aten.exp.default, (buffer,))
    written = graph.call_function(aten.sin.out, (x,), {"out": buffer})
    after = graph.call_function(aten.exp.default, (buffer,))
    graph.output((before, written, after))
    assert eliminate_common_subexpressions(graph) == 0
    gm = fx.GraphModule(nn.Module(), graph)
    x_val = torch.randn(4)
    first, _, second = gm(x_val)
    torch.testing.assert_close(first, torch.ones(4))
    torch.testing.assert_close(second, x_val.sin().exp())


def test_bool_and_int_arguments_are_not_merged():
    """`m + True` is bool (True + True is True), `m + 1` is int64 (2): equal as Python keys, different results."""

    def fn(x):
        m = x > 0
        return m + True, m + 1, x * True, x * 1.0, x.new_full((3,), -0.0), x.new_full((3,), 0.0)

    x = torch.randn(3).abs() + 0.5
    _, out = _compile_with_user_pass(fn, None, x)
    expected = fn(x)
    for got, want in zip(out, expected, strict=True):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want)
    assert torch.signbit(out[4]).all() and not torch.signbit(out[5]).any()


def test_two_returned_values_stay_two_tensors():
    """Eager returns two tensors; merged, the compiled model would return one twice (writing one changes both)."""
    lins = nn.ModuleList(nn.Linear(8, 8, bias=False) for _ in range(2))

    def fn(x):
        return x + 1, x + 1, lins[0](x), lins[1](x)

    capture, out = _compile_with_user_pass(fn, None, torch.randn(4, 8))
    capture.assert_fused(n_groups=1)
    assert out[0].data_ptr() != out[1].data_ptr()
    out[0].add_(1)
    torch.testing.assert_close(out[1], out[0] - 1)


def test_pure_duplicates_are_still_merged():
    graph = fx.Graph()
    x = graph.placeholder("x")
    a = graph.call_function(aten.unsqueeze.default, (x, 1))
    b = graph.call_function(aten.unsqueeze.default, (x, 1))
    graph.output((graph.call_function(aten.mul.Tensor, (a, b)),))
    assert eliminate_common_subexpressions(graph) == 1
