"""`DsparkPassManager`: the Inductor post-grad custom pass that runs the dspark_fx passes in order.

It is a `CustomGraphPass`, so Inductor's FX graph cache stays on: `uuid()` hashes every source file of
`dspark_fx/passes/` and the op schema files it emits (`custom_ops/multi_linear.py`, `multi_linear_kv_write.py`),
the config, and the uuid of a user pass it was composed with. A user pass that already sat in
`post_grad_custom_post_pass` runs first; a plain callable there has no uuid, so the manager then reports none
either (caching off, as Inductor requires).
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

import custom_ops.multi_linear
import custom_ops.multi_linear_kv_write
from dspark_fx.config import DsparkConfig
from dspark_fx.passes.horizontal import fuse_kv_branches
from dspark_fx.report import FusionReport

log = logging.getLogger("dspark_fx")
if os.environ.get("DSPARK_FX_LOG", "").lower() in ("debug", "info"):
    log.setLevel(os.environ["DSPARK_FX_LOG"].upper())
    log.addHandler(logging.StreamHandler())

Observer = Callable[[fx.Graph, fx.Graph, FusionReport], None]


def source_files() -> tuple[str, ...]:
    passes = sorted(str(p) for p in Path(__file__).parent.glob("*.py"))
    return (*passes, custom_ops.multi_linear.__file__, custom_ops.multi_linear_kv_write.__file__)


class DsparkPassManager(CustomGraphPass):
    def __init__(
        self,
        config: DsparkConfig | None = None,
        user_pass: Callable[[fx.Graph], None] | None = None,
        observer: Observer | None = None,
    ) -> None:
        self.config = config or DsparkConfig()
        self.user_pass = user_pass
        self.observer = observer
        self.input_names: list[str] | None = None
        self.reports: list[FusionReport] = []

    def __call__(self, graph: fx.Graph) -> None:
        if self.user_pass is not None:
            self.user_pass(graph)
        before = _copy(graph) if (self.observer or log.isEnabledFor(logging.DEBUG)) else None
        report = FusionReport()
        if self.config.horizontal_fusion:
            report = fuse_kv_branches(graph, self.config, self.input_names)
        self.reports.append(report)
        if report.groups or report.kv_writes:
            log.info("%s", report)
        elif report.rejected:
            log.info("dspark_fx: nothing fused; %d GEMM(s) rejected: %s", len(report.rejected), report.rejected)
        if before is not None:
            log.debug("dspark_fx graph diff:\n%s", graph_diff(before, graph))
            if self.observer is not None:
                self.observer(before, _copy(graph), report)

    def uuid(self) -> bytes | None:
        extra = self.config.to_json()
        if self.user_pass is not None:
            user_uuid = self.user_pass.uuid() if isinstance(self.user_pass, CustomGraphPass) else None
            if user_uuid is None:
                return None
            extra += repr(user_uuid)
        return get_hash_for_files(source_files(), extra)


def _copy(graph: fx.Graph) -> fx.Graph:
    new = fx.Graph()
    output = new.graph_copy(graph, {})
    new.output(output)
    return new


def graph_diff(before: fx.Graph, after: fx.Graph) -> str:
    """A unified diff of the two printed graphs."""
    return "".join(
        difflib.unified_diff(
            str(before).splitlines(keepends=True), str(after).splitlines(keepends=True), "before", "after"
        )
    )
