"""What the horizontal fusion did to one graph, and why it left things alone: the `explain()` report."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ClassReport:
    branches: list[int]  # indices into GroupReport.branches
    ops: list[str]  # the op names batched, in order
    kept: list[str] = field(default_factory=list)  # ops the class shares but that stay per branch, and why


@dataclass(frozen=True)
class UnbatchedBranch:
    branch: int  # index into GroupReport.branches
    reason: str  # why its ops stayed its own


@dataclass
class GroupReport:
    activation: str
    branches: list[str]  # one description per fused GEMM: weight[rows]
    weight_bytes: int  # weight (+ bias) bytes the fused GEMM reads per call
    classes: list[ClassReport] = field(default_factory=list)
    unbatched: list[UnbatchedBranch] = field(default_factory=list)


# Why a GEMM was not fused, by the start of the reason text (gemm_branches.match_gemm, horizontal): the key of
# `Rejection.kind` and of the `rejected_<kind>` counters. Checked in order; a reason matching none is "other".
REJECTION_KINDS = (
    ("bias", "bias"),
    ("weight is a slice of", "weight_not_parameter"),
    ("weight slice", "weight_slice"),
    ("weight is computed by", "weight_computed"),
    ("weight operand is", "weight_not_transposed"),
    ("weight has no rows", "weight_empty"),
    ("weight dtype", "dtype_mismatch"),
    ("activation dtype", "dtype_unsupported"),
    ("addmm with alpha/beta", "alpha_beta"),
    ("output is read through", "storage_layout"),
    ("operands carry no tensor metadata", "no_metadata"),
    ("fewer than min_branches", "below_min_branches"),  # "N fusable GEMM(s) on x, fewer than min_branches"
    ("rows above max_fused_rows", "above_max_fused_rows"),
)


@dataclass
class KVWriteReport:
    """One group of cache writes lowered to `dspark::multi_linear_kv_write`."""

    activation: str
    layers: list[str]  # per layer: K rows -> cache, V rows -> cache
    write: str  # how the slots are addressed
    norm: str
    rope: str


class KVKeptReason(enum.Enum):
    """Why cache writes stayed on the multi_linear path instead of `dspark::multi_linear_kv_write`."""

    NOT_A_PROJECTION = "the written value is not computed from GEMM column blocks of the activation"
    WRITE_FORM = "the cache write is not a form the op takes"
    ROUNDING_CAST = "a cast rounds where the op does not"
    NORM = "the k_norm is not the op's RMSNorm"
    ROPE = "the rotation is not the op's RoPE"
    TABLES = "the cos/sin values cannot be given to the op"
    LAYOUT = "a cache or written value has a shape the op does not write"
    SLOTS = "the slots are not one per token"
    LAYERS_DIFFER = "the layers differ where the op treats them alike"
    VALUE_SHARED = "a value the write computes is also read elsewhere"
    CACHE_READ_AFTER = "a cache is read after the writes"
    VIEW_READ = "a cache the op would write through a view is also read in the graph"
    OPERAND_WRITTEN = "a tensor the op reads is written in place before the cache writes"
    DEVICE = "the op's CUDA kernel cannot run on these operands"
    OP_REFUSES = "the op's checks refuse the operands"
    SELF_CHECK = "the numeric self-check disagrees"
    UNEVALUABLE = "the pass cannot follow the computation"
    TRAINING_GRAPH = "the cache writes happen after the graph (a training graph)"
    RETURNED = "the caches are updated out of place: the graph returns new values and writes no cache"
    NO_TOKENS = "the graph is for no tokens: the cache writes write nothing"


@dataclass(frozen=True)
class KVKept:
    """Cache writes on one activation kept on the multi_linear path: the reason, the details, the write it is
    about (if one), the graph node that stopped it and the model's source line of that node (if recorded)."""

    activation: str  # "" for writes of the whole graph
    reason: KVKeptReason
    detail: str
    cache: str | None = None
    node: str | None = None
    source: str | None = None

    def __str__(self) -> str:
        write = f"write to {self.cache}: " if self.cache else ""
        at = f" [{self.node}: {self.source}]" if self.source else ""
        where = f"{self.activation}: " if self.activation else ""
        return f"{where}{write}{self.detail}{at}"


@dataclass
class Rejection:
    node: str  # the GEMM, by the parameters its weight operand is computed from
    reason: str

    @property
    def kind(self) -> str:
        """A short stable key for the reason (`REJECTION_KINDS`), for counters and tests."""
        for text, kind in REJECTION_KINDS:
            if self.reason.startswith(text) or (kind == "below_min_branches" and text in self.reason):
                return kind
        return "other"


@dataclass
class FusionReport:
    groups: list[GroupReport] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)
    routed: list[str] = field(default_factory=list)  # lone GEMMs routed through multi_linear (skinny linears)
    kv_writes: list[KVWriteReport] = field(default_factory=list)  # cache writes lowered to multi_linear_kv_write
    kv_kept: list[KVKept] = field(default_factory=list)  # cache writes of projections left on today's path, and why
    outer_products: list[str] = field(default_factory=list)  # one-element-wide matmuls computed as multiplies
    # DsparkConfig.colocate_weights: the groups of linears on one activation whose weights moved (or would, under
    # explain) into one allocation, and those left as they are (dspark_fx.colocate.ColocatedGroup)
    colocated: list[Any] = field(default_factory=list)

    @property
    def n_groups(self) -> int:
        return len(self.groups)

    @property
    def n_branches(self) -> list[int]:
        return [len(g.branches) for g in self.groups]

    def merge(self, other: FusionReport) -> None:
        self.groups += other.groups
        self.rejected += other.rejected
        self.routed += other.routed
        self.kv_writes += other.kv_writes
        self.kv_kept += other.kv_kept
        self.outer_products += other.outer_products
        self.colocated += other.colocated

    def __str__(self) -> str:
        lines = [f"dspark_fx horizontal fusion: {self.n_groups} fused GEMM group(s)"]
        for gi, group in enumerate(self.groups):
            lines.append(
                f"  group {gi}: {len(group.branches)} GEMMs on {group.activation} -> one multi_linear "
                f"({group.weight_bytes / 2**20:.2f} MiB of weights read per call, no copies)"
            )
            for bi, desc in enumerate(group.branches):
                lines.append(f"    branch {bi}: {desc}")
            for cls in group.classes:
                ops = ", ".join(cls.ops)
                lines.append(f"    batched branches {cls.branches}: {len(cls.ops)} ops each -> one set [{ops}]")
                lines += [f"      kept per branch from {why}" for why in cls.kept]
            for u in group.unbatched:
                lines.append(f"    branch {u.branch} keeps its own ops: {u.reason}")
        for kv in self.kv_writes:
            lines.append(
                f"  KV writes of {len(kv.layers)} layer(s) on {kv.activation} -> one multi_linear_kv_write "
                f"(projection, {kv.norm}, {kv.rope}; {kv.write})"
            )
            lines += [f"    layer {i}: {desc}" for i, desc in enumerate(kv.layers)]
        if self.kv_kept:
            lines.append("  KV writes kept on the multi_linear path (not lowered to multi_linear_kv_write):")
            lines += [f"    {why}" for why in self.kv_kept]
        if self.routed:
            lines.append("  lone GEMMs routed through multi_linear (small-T kernel on CUDA where it beats cuBLAS):")
            lines += [f"    {r}" for r in self.routed]
        if self.outer_products:
            lines.append("  outer products (matmuls over one element) computed as broadcast multiplies:")
            lines += [f"    {p}" for p in self.outer_products]
        if self.colocated:
            lines.append("  weights of linears on one activation (colocate_weights):")
            lines += [f"    {group}" for group in self.colocated]
        if self.rejected:
            lines.append("  not fused:")
            lines += [f"    {r.node}: {r.reason}" for r in self.rejected]
        return "\n".join(lines)


def count(report: FusionReport) -> None:
    """Add one pass run to `torch._dynamo.utils.counters["dspark_fx"]` (keys: README.md)."""
    from torch._dynamo.utils import counters

    group = counters["dspark_fx"]
    group["pass_runs"] += 1
    group["groups_fused"] += report.n_groups
    group["branches_fused"] += sum(report.n_branches)
    group["branches_batched"] += sum(len(c.branches) for g in report.groups for c in g.classes)
    group["lone_gemms_routed"] += len(report.routed)
    group["kv_writes_lowered"] += len(report.kv_writes)
    group["kv_writes_kept"] += len(report.kv_kept)
    group["outer_products_multiplied"] += len(report.outer_products)
    for kept in report.kv_kept:
        group[f"kv_kept_{kept.reason.name.lower()}"] += 1
    for rejection in report.rejected:
        group["rejected"] += 1
        group[f"rejected_{rejection.kind}"] += 1
