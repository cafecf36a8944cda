"""`benchmarks/_timing.graphed`: the cuBLAS workspace cache is emptied right before and right after the capture, so
that each timed graph gets a workspace of its own (docs/benchmarking.md, "CUDA graphs and the cuBLAS workspace").
The CUDA calls are replaced by recorders, so the order is checked on any machine."""

import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _timing


def test_graphed_empties_the_cublas_workspace_cache_around_the_capture(monkeypatch):
    events = []

    class Graph:
        def replay(self):
            events.append("replay")

    @contextlib.contextmanager
    def capture(graph):
        events.append("capture begins")
        yield
        events.append("capture ends")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: events.append("synchronize"))
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: events.append("clear"), raising=False)

    replay = _timing.graphed(lambda x: events.append(f"call {x}"), (7,))
    replay()

    assert events == [
        *["call 7"] * 3,
        "synchronize",
        "clear",
        "capture begins",
        "call 7",
        "capture ends",
        "clear",
        "replay",
    ]
