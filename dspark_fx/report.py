"""What the horizontal fusion did to one graph, and why it left things alone: the `explain()` report."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ClassReport:
    branches: list[int]  # indices into GroupReport.branches
    ops: list[str]  # the op names batched, in order
    kept: list[str] = field(default_factory=list)  # ops the class shares but that stay per branch, and why


@dataclass
class GroupReport:
    activation: str
    branches: list[str]  # one description per fused GEMM: weight[rows]
    weight_bytes: int  # weight (+ bias) bytes the fused GEMM reads per call
    classes: list[ClassReport] = field(default_factory=list)
    unbatched: list[tuple[int, str]] = field(default_factory=list)  # (branch, why its ops stayed its own)


@dataclass
class KVWriteReport:
    """One group of cache writes lowered to `dspark::multi_linear_kv_write`."""

    activation: str
    layers: list[str]  # per layer: K rows -> cache, V rows -> cache
    write: str  # how the slots are addressed
    norm: str
    rope: str


@dataclass
class Rejection:
    node: str
    reason: str


@dataclass
class FusionReport:
    groups: list[GroupReport] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)
    routed: list[str] = field(default_factory=list)  # lone GEMMs routed through multi_linear (skinny linears)
    kv_writes: list[KVWriteReport] = field(default_factory=list)  # cache writes lowered to multi_linear_kv_write
    kv_kept: list[str] = field(default_factory=list)  # cache writes of projections left on today's path, and why

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
            for bi, why in group.unbatched:
                lines.append(f"    branch {bi} keeps its own ops: {why}")
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
        if self.rejected:
            lines.append("  not fused:")
            lines += [f"    {r.node}: {r.reason}" for r in self.rejected]
        return "\n".join(lines)
