"""The graph-diff test kit (`dspark_fx.testing`) on its own edges."""

import pytest
import torch
from torch import nn

from dspark_fx.testing import CaptureBackend


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
