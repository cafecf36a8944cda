"""Public graph-diff test kit for dspark_fx and for projects testing their own post-grad passes.

capture = CaptureBackend()                                # dspark_fx passes, eager ATen execution
out = torch.compile(model, backend=capture)(*inputs)
capture.assert_fused(n_groups=1, n_branches=[5])
assert op_counts(capture.before[-1])["aten.mm"] == 5
assert op_counts(capture.after[-1])["dspark.multi_linear"] == 1
print(capture.graph_diff())
assert_close_for_dtype(out, model(*inputs))
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.fx as fx

from dspark_fx.backend import make_backend
from dspark_fx.config import DsparkConfig, as_config
from dspark_fx.passes.graph_utils import op_name
from dspark_fx.passes.manager import graph_diff
from dspark_fx.report import FusionReport

__all__ = [
    "TOLERANCES",
    "CaptureBackend",
    "assert_close_for_dtype",
    "assert_ops",
    "compile_counts",
    "graph_diff",
    "missed_reinplacing_bytes",
    "op_counts",
]

TOLERANCES = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def op_counts(graph: fx.Graph | fx.GraphModule) -> Counter[str]:
    """How often each op occurs, by name (`aten.mm`, `dspark.multi_linear`, `getitem`, ...)."""
    graph = graph.graph if isinstance(graph, fx.GraphModule) else graph
    return Counter(op_name(n) for n in graph.nodes if n.op == "call_function")


def assert_ops(graph: fx.Graph | fx.GraphModule, expected: dict[str, int]) -> None:
    """Assert exact op counts, e.g. `{"aten.mm": 0, "dspark.multi_linear": 1}`."""
    counts = op_counts(graph)
    wrong = {op: (counts[op], n) for op, n in expected.items() if counts[op] != n}
    if wrong:
        lines = ", ".join(f"{op}: found {got}, expected {want}" for op, (got, want) in wrong.items())
        raise AssertionError(f"op counts differ: {lines}\n{graph}")


def assert_close_for_dtype(actual: Any, expected: Any, dtype: torch.dtype | None = None) -> None:
    """`torch.testing.assert_close` with the project's dtype tolerances (fp32 1e-5, fp16 5e-3, bf16 2e-2)."""
    leaves_a = torch.utils._pytree.tree_leaves(actual)
    leaves_e = torch.utils._pytree.tree_leaves(expected)
    assert len(leaves_a) == len(leaves_e), f"{len(leaves_a)} outputs, expected {len(leaves_e)}"
    for a, e in zip(leaves_a, leaves_e, strict=True):
        if not isinstance(e, torch.Tensor):
            assert a == e
            continue
        tol = TOLERANCES.get(dtype or e.dtype, 0.0)
        torch.testing.assert_close(a, e, rtol=tol, atol=tol)


class CaptureBackend:
    """A torch.compile backend that runs the dspark_fx passes and records each graph before and after them.

    `inner="aot_eager"` (default) executes the rewritten ATen graph eagerly (fast CPU tests, no codegen);
    `inner="inductor"` compiles it for real, with Inductor's FX graph and AOTAutograd caches off for these compiles:
    a cache hit would skip the passes, and there would be nothing to record. Inductor's cache of compiled kernels
    stays on (it is keyed by a kernel's source, after the passes ran): a kernel another compile already built is
    loaded, not built again.
    """

    def __init__(self, config: DsparkConfig | Mapping[str, Any] | None = None, inner: str = "aot_eager") -> None:
        config = as_config(config, "CaptureBackend")
        self.before: list[fx.Graph] = []
        self.after: list[fx.Graph] = []
        self.reports: list[FusionReport] = []
        self._backend = make_backend(config, inner=inner, observer=self._observe)

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Callable[..., Any]:
        with (
            torch._inductor.config.patch(fx_graph_cache=False),
            torch._functorch.config.patch(enable_autograd_cache=False),
        ):
            return self._backend(gm, example_inputs, **kwargs)

    def _observe(self, before: fx.Graph, after: fx.Graph, report: FusionReport) -> None:
        self.before.append(before)
        self.after.append(after)
        self.reports.append(report)

    @property
    def report(self) -> FusionReport:
        merged = FusionReport()
        for report in self.reports:
            merged.merge(report)
        return merged

    def graph_diff(self, index: int = -1) -> str:
        """The diff of compile `index` (default: the last) before and after the passes."""
        if not self.before:
            raise RuntimeError("CaptureBackend.graph_diff: nothing was compiled with this backend yet")
        if not -len(self.before) <= index < len(self.before):
            raise IndexError(f"CaptureBackend.graph_diff: index {index}, but {len(self.before)} graph(s) compiled")
        return graph_diff(self.before[index], self.after[index])

    def assert_fused(self, n_groups: int, n_branches: list[int] | None = None) -> None:
        """Every graph compiled so far fused `n_groups` GEMM groups with `n_branches` GEMMs each."""
        assert self.reports, "nothing was compiled with this backend yet"
        for report in self.reports:
            assert report.n_groups == n_groups, f"expected {n_groups} fused group(s):\n{report}"
            if n_branches is not None:
                assert report.n_branches == n_branches, f"expected branches {n_branches}:\n{report}"


@contextmanager
def compile_counts() -> Iterator[Counter[str]]:
    """Counts Dynamo frame compilations inside the block: `counts["frames"]` (one per compiled graph)."""
    stats = torch._dynamo.utils.counters["stats"]
    start = stats["unique_graphs"]
    counts: Counter[str] = Counter()
    try:
        yield counts
    finally:
        counts["frames"] = stats["unique_graphs"] - start


def missed_reinplacing_bytes() -> int:
    """Inductor's count of mutated inputs it had to clone (`possibly_missed_reinplacing_opportunities`)."""
    return int(torch._dynamo.utils.counters["inductor"]["possibly_missed_reinplacing_opportunities"])
