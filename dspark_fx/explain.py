"""`explain(model, *example_inputs)`: what the dspark_fx passes fuse in a model, and why they leave the rest."""

from __future__ import annotations

from typing import Any

import torch

from dspark_fx.backend import make_backend
from dspark_fx.config import DsparkConfig, as_config
from dspark_fx.report import FusionReport


def explain(model: torch.nn.Module, *example_inputs: Any, config: DsparkConfig | None = None) -> FusionReport:
    """Trace `model` once (no Inductor codegen, model state unchanged) and return the merged fusion report."""
    config = as_config(config, "explain")
    reports: list[FusionReport] = []
    backend = make_backend(config, inner="aot_eager", observer=lambda _before, _after, report: reports.append(report))
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            torch.compile(model, backend=backend, fullgraph=False)(*example_inputs)
    finally:
        model.load_state_dict(snapshot)
        torch._dynamo.reset()
    report = FusionReport()
    for part in reports:
        report.merge(part)
    return report
