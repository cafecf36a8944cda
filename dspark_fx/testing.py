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

import operator
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.fx as fx

from dspark_fx.backend import BACKEND_NAME, check_backend_args, make_backend
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
    "op_counts",
    "reinplacing_misses",
]

TOLERANCES = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def op_counts(graph: fx.Graph | fx.GraphModule) -> Counter[str]:
    """How often each op occurs, by name (`aten.mm`, `dspark.multi_linear`, `getitem`, ...)."""
    graph = graph.graph if isinstance(graph, fx.GraphModule) else graph
    return Counter(op_name(n) for n in graph.nodes if n.op == "call_function")


def assert_ops(graph: fx.Graph | fx.GraphModule, expected: dict[str, int]) -> None:
    """Assert exact op counts, e.g. `{"aten.mm": 0, "dspark.multi_linear": 1}`; names are `op_counts`'s (`namespace.op`
    of a registered op, no overload, or a Python callable's name such as `getitem`): any other name raises
    `ValueError`, so a misspelled op expected 0 times cannot pass unseen."""
    counts = op_counts(graph)
    unknown = [op for op in expected if not _is_op_name(op, counts)]
    if unknown:
        hints = [f"{ns}.{op}" for op in unknown for ns in _NAMESPACES if "." not in op and _registered(ns, op)]
        raise ValueError(
            f"assert_ops: {unknown} are not op names as op_counts writes them ('aten.mm', 'dspark.multi_linear', "
            "'getitem': a registered op's namespace.name without overload, or the name of a Python callable in the "
            "graph, of the operator module or of a higher-order op)" + (f"; did you mean {hints}?" if hints else "")
        )
    wrong = {op: (counts[op], n) for op, n in expected.items() if counts[op] != n}
    if wrong:
        lines = ", ".join(f"{op}: found {got}, expected {want}" for op, (got, want) in wrong.items())
        raise AssertionError(f"op counts differ: {lines}\n{graph}")


def assert_close_for_dtype(actual: Any, expected: Any, dtype: torch.dtype | None = None) -> None:
    """`torch.testing.assert_close` of two pytrees of one structure (the same dict keys, list lengths, ...) with the
    project's dtype tolerances (`TOLERANCES`: fp32 1e-5, fp16 5e-3, bf16 2e-2; any other dtype exactly)."""
    leaves_a, spec_a = torch.utils._pytree.tree_flatten(actual)
    leaves_e, spec_e = torch.utils._pytree.tree_flatten(expected)
    _check(spec_a == spec_e, f"the outputs' structure differs:\n{spec_a}\nexpected\n{spec_e}")
    for a, e in zip(leaves_a, leaves_e, strict=True):
        if isinstance(a, torch.Tensor) != isinstance(e, torch.Tensor):
            raise AssertionError(f"a {type(a).__name__} where a {type(e).__name__} is expected: {a!r} against {e!r}")
        if not isinstance(e, torch.Tensor):
            _check(a == e, f"{a!r} != {e!r}")
            continue
        tol = TOLERANCES.get(dtype or e.dtype, 0.0)
        torch.testing.assert_close(a, e, rtol=tol, atol=tol)


class CaptureBackend:
    """A torch.compile backend that runs the dspark_fx passes and records each graph before and after them.

    `inner="aot_eager"` (default) executes the rewritten ATen graph eagerly (fast CPU tests, no codegen);
    `inner="inductor"` compiles it for real, with Inductor's FX graph and AOTAutograd caches off for these compiles
    (a backward graph compiled at the first backward too): a cache hit would skip the passes, and there would be
    nothing to record. Inductor's cache of compiled kernels
    stays on (it is keyed by a kernel's source, after the passes ran): a kernel another compile already built is
    loaded, not built again. Its `compiler_name` is `DsparkBackend`'s (a registered backend: see there).
    """

    compiler_name = BACKEND_NAME

    def __init__(self, config: DsparkConfig | Mapping[str, Any] | None = None, inner: str = "aot_eager") -> None:
        config = as_config(config, "CaptureBackend")
        check_backend_args("CaptureBackend", inner, None)
        self.before: list[fx.Graph] = []
        self.after: list[fx.Graph] = []
        self.reports: list[FusionReport] = []
        self._backend = make_backend(config, inner=inner, observer=self._observe)
        self.__name__ = BACKEND_NAME

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Callable[..., Any]:
        # the FX graph cache off as an Inductor option: Inductor applies its options to the backward graph's compile
        # too, which AOTAutograd runs later, at the first backward, outside this call (`inner="aot_eager"` reads none)
        kwargs["options"] = {**(kwargs.get("options") or {}), "fx_graph_cache": False}
        with torch._functorch.config.patch(enable_autograd_cache=False):
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
        _check(bool(self.reports), "nothing was compiled with this backend yet")
        for report in self.reports:
            _check(report.n_groups == n_groups, f"expected {n_groups} fused group(s):\n{report}")
            if n_branches is not None:
                _check(report.n_branches == n_branches, f"expected branches {n_branches}:\n{report}")


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


@contextmanager
def reinplacing_misses() -> Iterator[Counter[str]]:
    """Counts, inside the block, the mutated inputs Inductor could not update in place and clones instead:
    `misses["tensors"]`, and `misses["bytes"]` of those with static shapes (what Inductor's reinplacing pass adds to
    `ReinplaceCounters`, which Dynamo clears at every frame, so they are summed here as they are added). The block
    runs with Inductor's caches off, so every graph is compiled and its reinplacing counted (a graph served from a
    cache runs no reinplacing pass and would count nothing)."""
    counters = torch._dynamo.utils.ReinplaceCounters
    originals = {name: counters.__dict__[name] for name in ("add_missed_opportunities", "add_missed_bytes")}
    misses: Counter[str] = Counter()

    def counting(name: str, key: str) -> Callable[[Any, int], None]:
        def add(trigger: Any, amount: int) -> None:
            misses[key] += amount
            originals[name].__get__(None, counters)(trigger, amount)

        return add

    counters.add_missed_opportunities = counting("add_missed_opportunities", "tensors")
    counters.add_missed_bytes = counting("add_missed_bytes", "bytes")
    misses.update(tensors=0, bytes=0)
    try:
        with torch._inductor.config.patch(force_disable_caches=True):
            yield misses
    finally:
        for name, original in originals.items():
            setattr(counters, name, original)


_NAMESPACES = ("aten", "prims", "dspark")


def _check(holds: bool, message: str) -> None:
    """An `AssertionError` with `message` unless `holds` (a bare `assert` would vanish under `python -O`)."""
    if not holds:
        raise AssertionError(message)


def _is_op_name(name: str, counts: Counter[str]) -> bool:
    """Whether `name` is a name `op_counts` can write: `namespace.op` of a registered op; or, bare, a callable's name
    that is in the graph, or else a function of the `operator` module or a higher-order op with no op of that name
    in aten, prims or dspark (a bare `mm` or `mul` is refused: `op_counts` writes `aten.mm`, `aten.mul`)."""
    if "." in name:
        namespace, _, op = name.partition(".")
        return _registered(namespace, op)
    if not name.isidentifier():
        return False
    if counts[name]:
        return True
    if any(_registered(namespace, name) for namespace in _NAMESPACES):
        return False  # `mul` is both operator.mul and aten.mul: which one is meant must be written out
    if callable(getattr(operator, name, None)):
        return True
    try:
        return isinstance(getattr(torch.ops.higher_order, name), torch._ops.HigherOrderOperator)
    except (AttributeError, RuntimeError):
        return False


def _registered(namespace: str, op: str) -> bool:
    try:
        return isinstance(getattr(getattr(torch.ops, namespace), op), torch._ops.OpOverloadPacket)
    except (AttributeError, RuntimeError):
        return False
