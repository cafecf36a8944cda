"""The pass configuration: frozen, and hashed into the pass manager's `uuid()` (FX graph cache key)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

_FIELD_TYPES = {"bool": (bool,), "int": (int,)}

KV_WRITE_MODES = ("auto", "always", "never")


@dataclass(frozen=True)
class DsparkConfig:
    """Settings of the dspark_fx passes.

    `horizontal_fusion`: fuse GEMMs that share an activation into one `dspark::multi_linear`.
    `batch_regions`: also batch the identical per-branch ops after the GEMM (norm, RoPE, views).
    `min_branches`: smallest group of GEMMs worth fusing (the K/V-write lowering is not limited by it: one layer's
    write lowers too, its norm/RoPE/write in one op).
    `max_leaf_numel`: largest per-branch tensor (e.g. a norm weight) that may be stacked per call.
    `skinny_linears`: also route a GEMM that has no partner on its activation (a draft's o_proj, down_proj, fc)
    through `dspark::multi_linear` with one weight, on CUDA only. There the op takes its small-T kernel where that
    beats cuBLAS (up to 8 tokens for single weights, measured on an H200 for [4096, 4096], [1024, 4096],
    [4096, 12288], see BENCHMARKS.md) and cuBLAS otherwise. On other devices a lone GEMM stays Inductor's: the op's
    reference is slower there (BENCHMARKS.md, "Lone linears").
    `max_fused_rows`: on CUDA, the most rows (tokens) at which GEMMs sharing an activation fuse into one
    `multi_linear`; above, the per-layer GEMMs stay (measured faster from about 1024 tokens on an H200, likely as
    each output can still be in L2 when its norm/RoPE/write reads it; BENCHMARKS.md). The KV-write lowering is not
    limited (faster at every measured T). A symbolic row count is guarded: a dynamic-shape model compiles at most
    one graph per side of the limit, the second when a call first crosses it.
    `kv_write_op`: lower N layers' K/V cache writes from one activation (projection, k_norm, RoPE, write) to one
    `dspark::multi_linear_kv_write` (`passes/kv_write.py`). "auto": where the op's CUDA kernel runs (CUDA tensors,
    bf16/fp16, K % 8 == 0, head_dim % 8 == 0 and <= 256, caches with unit inner stride and 16-byte aligned rows);
    "always": wherever the graph computes the op's formula (on CPU the op is its fp32 reference: for tests); "never":
    off. The op computes in fp32 and rounds K at most twice (docs/ops.md, "Numerics"), so a lowered model matches
    eager to the dtype's tolerance, not bit for bit. It is a step of the horizontal fusion (`horizontal_fusion=False`
    turns it off too).
    `fuse_on_cpu`: fuse GEMM groups on CPU tensors too. Off by default: on CPU `dspark::multi_linear` is its
    reference (one GEMM per weight into the output's column blocks, opaque to Inductor), and a draft step measured
    4-18 % slower than under plain torch.compile (BENCHMARKS.md, "On the CPU the pass made the draft step slower"),
    so by default the pass leaves a CPU graph's GEMMs as they are (`explain()` says so for each). On, the CPU graph
    fuses as a CUDA one would: to look at the rewrite on a CPU, and for tests.
    `colocate_weights`: when the backend compiles a graph, move the weights of the linears that share an activation
    (on the devices where groups fuse) into one allocation each, back to back in graph order, each parameter becoming
    a view of it (`dspark_fx/colocate.py`): the fused GEMM then runs as one GEMM, as over a hand-concatenated
    weight. Off by default because it changes where the model's parameters live: a weight that shares its storage
    with another tensor is left where it is (so nothing can keep stale values), but a CUDA graph captured before
    the compile would keep reading the old allocations. `explain()` reports what it would move and moves nothing.
    `outer_products`: compute a matmul that sums over one element (an outer product, such as HF's RoPE angles
    `inv_freq @ position_ids`) as a broadcast multiply, the same values, which Inductor fuses into its readers
    (`passes/outer_products.py`; on CUDA Inductor otherwise keeps a GEMM whose output its RoPE kernels read
    transposed: BENCHMARKS.md, "HF RoPE angles").
    """

    horizontal_fusion: bool = True
    batch_regions: bool = True
    min_branches: int = 2
    max_leaf_numel: int = 1 << 16
    skinny_linears: bool = True
    max_fused_rows: int = 512
    kv_write_op: str = "auto"
    outer_products: bool = True
    fuse_on_cpu: bool = False
    colocate_weights: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            types = _FIELD_TYPES.get(str(f.type))
            if types and (not isinstance(value, types) or (f.type == "int" and isinstance(value, bool))):
                raise TypeError(f"DsparkConfig.{f.name} must be {f.type}, got {type(value).__name__} {value!r}")
        if self.min_branches < 2:
            raise ValueError(f"DsparkConfig.min_branches must be >= 2, got {self.min_branches}")
        if self.max_leaf_numel < 1:
            raise ValueError(f"DsparkConfig.max_leaf_numel must be >= 1, got {self.max_leaf_numel}")
        if self.max_fused_rows < 1:
            raise ValueError(f"DsparkConfig.max_fused_rows must be >= 1, got {self.max_fused_rows}")

        if self.kv_write_op not in KV_WRITE_MODES:
            raise ValueError(f"DsparkConfig.kv_write_op must be one of {KV_WRITE_MODES}, got {self.kv_write_op!r}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def as_config(config: DsparkConfig | Mapping[str, Any] | None, where: str) -> DsparkConfig:
    """`config` as a `DsparkConfig`: None gives the defaults, a dict of fields is checked and converted.

    Raises, naming `where` (the call that received it), TypeError for another type and ValueError for a key
    that is not a field, so a wrong config fails where it is passed, not at the first compile."""
    if config is None:
        return DsparkConfig()
    if isinstance(config, DsparkConfig):
        return config
    if isinstance(config, Mapping):
        names = [f.name for f in fields(DsparkConfig)]
        unknown = sorted(str(k) for k in config if k not in names)
        if unknown:
            raise ValueError(f"{where}: config has unknown field(s) {unknown}; DsparkConfig fields are {names}")
        try:
            return DsparkConfig(**config)
        except (TypeError, ValueError) as err:
            raise type(err)(f"{where}: config: {err}") from None
    raise TypeError(
        f"{where}: config must be a DsparkConfig, a dict of its fields or None, got {type(config).__name__}"
    )
