"""The graph-diff test kit (`dspark_fx.testing`) on its own edges."""

import subprocess
import sys

import pytest
import torch
from torch import nn

from dspark_fx.testing import CaptureBackend, assert_close_for_dtype, assert_ops, op_counts, reinplacing_misses


def test_graph_diff_before_any_compile_says_nothing_was_compiled():
    capture = CaptureBackend()
    with pytest.raises(RuntimeError, match="nothing was compiled with this backend yet"):
        capture.graph_diff()
    with pytest.raises(AssertionError, match="nothing was compiled"):
        capture.assert_fused(n_groups=0)


def test_graph_diff_names_the_compiles_there_are():
    torch._dynamo.reset()
    capture = CaptureBackend()
    lins = nn.ModuleList(nn.Linear(8, 8, bias=False) for _ in range(2))
    with torch.no_grad():
        torch.compile(lambda x: [lin(x) for lin in lins], backend=capture)(torch.randn(3, 8))
    assert capture.graph_diff() == capture.graph_diff(0)
    assert "dspark.multi_linear" in capture.graph_diff()
    with pytest.raises(IndexError, match="index 1, but 1 graph"):
        capture.graph_diff(1)


@torch.library.custom_op("dspark_kit_test::bump_", mutates_args=["x"])
def _bump_(x: torch.Tensor) -> None:
    x.add_(1)


@_bump_.register_fake
def _(x: torch.Tensor) -> None:
    return None


def test_reinplacing_misses_counts_an_input_inductor_clones():
    """A mutated graph input read again after the op must be cloned: counted (also when an identical graph was
    compiled before, the caches being off in the block); a plain in-place update of it is not."""

    def read_after(x):
        y = x * 1
        _bump_(x)
        return y + x

    def update(x):
        _bump_(x)

    for fn, want in ((read_after, 1), (update, 0), (read_after, 1)):
        torch._dynamo.reset()
        with reinplacing_misses() as misses:
            torch.compile(fn, backend="inductor")(torch.randn(8))
        assert misses["tensors"] == want, (fn.__name__, misses)


def test_assert_ops_rejects_names_op_counts_never_writes():
    graph = torch.fx.symbolic_trace(lambda x: torch.relu(x) + 1).graph
    assert_ops(graph, {"add": 1})
    assert op_counts(graph)["aten.mm"] == 0
    assert_ops(graph, {"aten.mm": 0})
    assert_ops(graph, {"getitem": 0, "cond": 0})  # a function of the operator module, a higher-order op
    for name in ("dspark.multi_linear.default", "dspark::multi_linear", "torch.ops.aten.mm", "aten.no_such_op"):
        with pytest.raises(ValueError, match="not op names as op_counts writes them"):
            assert_ops(graph, {name: 0})
    cases = [("mm", "aten.mm"), ("mul", "aten.mul"), ("multi_linear", "dspark.multi_linear"), ("aten_mm", None)]
    for name, hint in cases:
        with pytest.raises(ValueError, match="did you mean" if hint else "not op names") as raised:
            assert_ops(graph, {name: 0})  # bare: op_counts writes aten.mm, so {"mm": 0} would always hold
        assert hint is None or hint in str(raised.value)


def test_the_kits_checks_raise_under_python_dash_o():
    """Bare asserts vanish under `python -O`: the kit's checks must fail there too."""
    code = (
        "import torch\n"
        "from dspark_fx.testing import CaptureBackend, assert_close_for_dtype\n"
        "failed = 0\n"
        "for check in (lambda: CaptureBackend().assert_fused(1),\n"
        "              lambda: assert_close_for_dtype([torch.ones(1)], (torch.ones(1),)),\n"
        "              lambda: assert_close_for_dtype([1.0], [2.0])):\n"
        "    try:\n"
        "        check()\n"
        "    except AssertionError:\n"
        "        failed += 1\n"
        "print(failed)\n"
    )
    result = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "3", result.stderr


def test_assert_close_for_dtype_compares_the_structure():
    ones, zeros = torch.ones(2), torch.zeros(2)
    assert_close_for_dtype({"k": ones, "v": zeros}, {"k": ones, "v": zeros})
    for actual, expected in (
        ({"k": ones, "v": zeros}, {"v": ones, "k": zeros}),
        ({"x": ones}, {"y": ones}),
        (ones, 1.0),  # a tensor where a number is expected, and the other way round: no truth value of a tensor
        ([1.0], [ones]),
    ):
        with pytest.raises(AssertionError):
            assert_close_for_dtype(actual, expected)


class _ThreeBranches(nn.Module):
    def __init__(self):
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(16, 16, bias=False) for _ in range(3))

    def forward(self, x):
        return sum(lin(x).relu() for lin in self.lins)


@pytest.mark.slow  # Inductor codegen
def test_capture_backend_records_the_backward_compiled_at_the_first_backward_every_time(tmp_path, monkeypatch):
    """AOTAutograd compiles the backward graph at the first backward, after the backend call: with Inductor's FX
    graph cache on (a fresh cache directory), a second compile of the same model must still run the passes on both
    graphs and record them, not get the backward from the cache."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    for _ in range(2):
        torch._dynamo.reset()
        torch.manual_seed(0)
        capture = CaptureBackend({"fuse_on_cpu": True}, inner="inductor")
        with torch._inductor.config.patch(fx_graph_cache=True):
            torch.compile(_ThreeBranches(), backend=capture)(torch.randn(4, 16)).sum().backward()
        assert len(capture.before) == len(capture.reports) == 2
