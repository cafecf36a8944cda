"""dspark_fx: torch.compile passes for speculative-decoding drafts (see README.md)."""

from dspark_fx.backend import dspark_backend, make_backend
from dspark_fx.config import DsparkConfig
from dspark_fx.explain import explain
from dspark_fx.passes.manager import DsparkPassManager, graph_diff
from dspark_fx.report import FusionReport

__all__ = [
    "DsparkConfig",
    "DsparkPassManager",
    "FusionReport",
    "dspark_backend",
    "explain",
    "graph_diff",
    "make_backend",
]
