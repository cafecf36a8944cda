"""`DsparkPassManager`: the Inductor post-grad custom pass that runs the dspark_fx passes in order.

It is a `CustomGraphPass`, so Inductor's FX graph cache stays on: `uuid()` hashes every source file of
`dspark_fx/passes/` and of the ops it emits whose code decides what it emits (`custom_ops/linear/*.py`: schemas and
fake implementations; `custom_ops/checks.py`, `_library.py`: the checks a fake call runs, whose refusal keeps writes
on their path; `_inductor_offsets.py`: the lowering those fake calls register, which decides the offsets Inductor's
code passes to the ops), as read when this module was imported (so with the code this process runs, should the files
change on disk later), the config, the settings the passes read (the fp32 matmul precision, whether the CUDA library
and the op's CUDA kernel can run), and the uuids of the user passes it was composed with. User passes that already
sat in `post_grad_custom_post_pass` (one pass, or a list or tuple of them, as Inductor accepts) run first, in order;
a plain callable there has no uuid, so the manager then reports none either (caching off, as Inductor requires).
Where Inductor has inference-aware passes (`CustomInferenceAwareGraphPass`, torch 2.13) the manager is one, and
hands `is_inference` on to such user passes.
"""

from __future__ import annotations

import difflib
import hashlib
import logging
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch.fx as fx
from torch._inductor import config as inductor_config
from torch._inductor import custom_graph_pass
from torch._inductor.custom_graph_pass import CustomGraphPass

import custom_ops._build
import custom_ops.linear.multi_linear
import custom_ops.linear.multi_linear_kv_write
from dspark_fx.colocate import ColocatedGroup
from dspark_fx.config import DsparkConfig, as_config
from dspark_fx.passes.graph_utils import copy_graph
from dspark_fx.passes.horizontal import fuse_kv_branches
from dspark_fx.passes.kv_write import has_cuda_kernel
from dspark_fx.passes.outer_products import multiply_outer_products, rounds_fp32_matmul_inputs
from dspark_fx.report import FusionReport, count

log = logging.getLogger("dspark_fx")  # DSPARK_FX_LOG=info|debug sets it up (dspark_fx/__init__.py)
KEPT_REPORTS = 64

Observer = Callable[[fx.Graph, fx.Graph, FusionReport], None]
UserPasses = Callable[[fx.Graph], None] | list[Callable[[fx.Graph], None]] | tuple[Callable[[fx.Graph], None], ...]
# torch 2.13 calls a pass of this class with `is_inference=`; torch 2.11 has no such class
_INFERENCE_AWARE = getattr(custom_graph_pass, "CustomInferenceAwareGraphPass", None)


def source_files() -> tuple[str, ...]:
    """The files whose code decides what the passes emit (module docstring)."""
    ops = Path(custom_ops.__file__).parent
    files = [
        *Path(__file__).parent.glob("*.py"),
        *(ops / "linear").glob("*.py"),
        ops / "checks.py",
        ops / "_library.py",
        ops / "_inductor_offsets.py",
    ]
    return tuple(sorted(str(p) for p in files))


def _digest(paths: tuple[str, ...]) -> bytes:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.encode())
        digest.update(Path(path).read_bytes())
    return digest.digest()


_SOURCES = _digest(source_files())  # every module of source_files() is imported by now (the imports above)


class DsparkPassManager(_INFERENCE_AWARE or CustomGraphPass):
    def __init__(
        self,
        config: DsparkConfig | Mapping[str, Any] | None = None,
        user_pass: UserPasses | None = None,
        observer: Observer | None = None,
    ) -> None:
        self.config = as_config(config, "DsparkPassManager")
        self.user_passes = _user_passes(user_pass)
        self.observer = observer
        self.input_names: list[str] | None = None
        self.colocated: list[ColocatedGroup] = []  # the backend's colocate_weights step, for the report
        # the last compiles' reports: a manager installed for plain torch.compile lives as long as the process
        self.reports: deque[FusionReport] = deque(maxlen=KEPT_REPORTS)
        self.runs = 0  # graphs the pass ran on (the reports keep the last KEPT_REPORTS)

    def __call__(self, graph: fx.Graph, is_inference: bool | None = None) -> None:
        for user_pass in self.user_passes:
            if _INFERENCE_AWARE is not None and isinstance(user_pass, _INFERENCE_AWARE):
                if is_inference is None:
                    raise TypeError(f"{user_pass!r} is an inference-aware pass: call the manager with is_inference=")
                user_pass(graph, is_inference=is_inference)
            else:
                user_pass(graph)
        self.runs += 1
        before = copy_graph(graph) if (self.observer or log.isEnabledFor(logging.DEBUG)) else None
        report = FusionReport()
        outer_products = multiply_outer_products(graph) if self.config.outer_products else []
        if self.config.horizontal_fusion:
            report = fuse_kv_branches(graph, self.config, self.input_names, is_inference)
        report.outer_products = outer_products
        if not self.reports:  # a training compile runs the pass twice (forward, backward): report the groups once
            report.colocated = self.colocated
        self.reports.append(report)
        count(report)
        if report.groups or report.kv_writes or report.kv_kept or report.outer_products:
            log.info("%s", report)
        elif report.rejected:
            log.info("dspark_fx: nothing fused; %d GEMM(s) rejected: %s", len(report.rejected), report.rejected)
        if before is not None:
            log.debug("dspark_fx graph diff:\n%s", graph_diff(before, graph))
            if self.observer is not None:
                self.observer(before, copy_graph(graph), report)

    def uuid(self) -> bytes | None:
        if inductor_config.freezing:
            # the frozen weights' rewrite adds constants to the graph module, which Inductor's cache would store by
            # value under a key that hashes frozen parameters by shape: a model of the same shapes would get them
            return None
        extra = self.config.to_json()
        # what the pass emits for CUDA tensors depends on whether the dspark CUDA library and the op's CUDA kernel can
        # run in this process; the outer-product rewrite on whether an fp32 matmul rounds its inputs
        extra += f"cuda library: {not custom_ops._build.cuda_library_problem()}, kernel: {has_cuda_kernel()}"
        extra += f"fp32 matmul rounds: cpu {rounds_fp32_matmul_inputs('cpu')}, cuda {rounds_fp32_matmul_inputs('cuda')}"
        for user_pass in self.user_passes:
            user_uuid = user_pass.uuid() if isinstance(user_pass, CustomGraphPass) else None
            if user_uuid is None:
                return None
            extra += repr(user_uuid)
        return hashlib.sha256(_SOURCES + extra.encode()).digest()


def _user_passes(user_pass: UserPasses | None) -> tuple[Callable[..., None], ...]:
    """The passes of a post-grad slot, in order: None, one pass, or a list or tuple of passes; a `DsparkPassManager`
    among them (one installed before, say by running README's install lines twice) is replaced by the user passes it
    composes: the new manager takes its place, with its own config, instead of the pass running twice."""
    slot = tuple(user_pass) if isinstance(user_pass, (list, tuple)) else (user_pass,)
    passes: tuple[Any, ...] = ()
    for p in slot:
        passes += p.user_passes if isinstance(p, DsparkPassManager) else (p,) if p is not None else ()
    for p in passes:
        if not callable(p):
            raise TypeError(f"post_grad_custom_post_pass: expected a pass (a callable), got {type(p).__name__}")
    return passes


def graph_diff(before: fx.Graph, after: fx.Graph) -> str:
    """A unified diff of the two printed graphs."""
    return "".join(
        difflib.unified_diff(
            str(before).splitlines(keepends=True), str(after).splitlines(keepends=True), "before", "after"
        )
    )
