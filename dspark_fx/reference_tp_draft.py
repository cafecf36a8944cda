"""A reference tensor-parallel draft step: the same model unsharded, sharded with `torch.distributed.tensor.parallel`
(DTensor) and hand-sharded as serving engines write it; used by the TP tests and `examples/tp_draft.py`.

One forward is one draft step of `num_layers` layers. Per layer `l`:

    ctx K/V:  k, v = k_proj_l(ctx), v_proj_l(ctx);  k = RoPE(RMSNorm_l(k per head), positions)
              k_cache_l[cache_loc] = k;  v_cache_l[cache_loc] = v              (the context K/V write of every layer)
    block:    q, k, v = q/k/v_proj_l(hidden);  k normed and both roped at block_positions
              hidden += o_proj_l(attention(q, k, v))                          (the block attends to itself)
              hidden += down_proj_l(silu(gate_proj_l(hidden)) * up_proj_l(hidden))

With tensor parallelism over `world_size` ranks each rank holds `num_heads / world_size` query heads,
`num_kv_heads / world_size` K/V heads of every layer (and their caches, `[num_slots, num_kv_heads / world_size,
head_dim]`) and `intermediate / world_size` MLP columns: q/k/v and gate/up are column-parallel, o_proj and down_proj
row-parallel, each followed by a sum all-reduce, so every rank ends with the full `hidden`. Rank `r`'s caches hold
heads `[r * h, (r + 1) * h)` of the unsharded model's caches (`rank_heads`).

- `TPDraft(cfg)`: separate projections (`nn.Linear`); unsharded, or sharded in place by `parallelize(model, mesh)`
  (`ColwiseParallel` / `RowwiseParallel`, DTensor parameters; the row-parallel outputs are all-reduced by DTensor).
  `TPDraft(cfg, world_size)` sizes its caches for one rank's heads.
- `HandShardedDraft(cfg, rank, world_size, group)`: the rank's shards as plain tensors, laid out as engines do
  (one `qkv_proj` of rows `[q_r; k_r; v_r]`, one `gate_up_proj` of rows `[gate_r; up_r]`), and the all-reduces
  written with `torch.distributed._functional_collectives`. `load_(full)` copies the rank's rows of an unsharded
  `TPDraft` into it in place (how an engine updates weights: a compiled model sees it at the next call).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dspark_fx.reference_draft import apply_rope, rope_cos_sin_table

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


@dataclass(frozen=True)
class TPDraftConfig:
    num_layers: int = 2
    hidden: int = 32
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 8
    intermediate: int = 64
    num_slots: int = 32
    max_position: int = 64
    eps: float = 1e-6
    rope_theta: float = 1e4
    dtype: torch.dtype = torch.float32
    seed: int = 0

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate",
            "num_slots",
            "max_position",
        ):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"TPDraftConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"TPDraftConfig.num_heads = {self.num_heads} must be a multiple of num_kv_heads = {self.num_kv_heads}"
            )

    def check_world_size(self, world_size: int) -> None:
        """Raise ValueError unless `world_size` is a positive int over which the heads and MLP columns split evenly."""
        if type(world_size) is not int or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        for name in ("num_heads", "num_kv_heads", "intermediate"):
            if getattr(self, name) % world_size:
                raise ValueError(f"TPDraftConfig.{name} = {getattr(self, name)} does not split over {world_size} ranks")


def rank_heads(cfg: TPDraftConfig, rank: int, world_size: int) -> slice:
    """The K/V heads of the unsharded caches that rank `rank` of `world_size` holds."""
    cfg.check_world_size(world_size)
    if type(rank) is not int or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
    per_rank = cfg.num_kv_heads // world_size
    return slice(rank * per_rank, (rank + 1) * per_rank)


def output_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|: how the draft step's output is compared. The output is two layers
    deep, so low-precision rounding placed differently (any compiled code against eager: plain `torch.compile` too)
    moves its elements by a few units in the last place of its largest values; an elementwise tolerance would fail on
    the elements near zero. (The caches, one norm and RoPE deep, are compared elementwise.)"""
    return (actual.double() - expected.double()).abs().max().item() / expected.double().abs().max().item()


class _DraftStep(nn.Module, abc.ABC):
    """The draft step both sharding forms run; subclasses say how they project and all-reduce."""

    cfg: TPDraftConfig
    layers: nn.ModuleList

    def _init_buffers(self, cfg: TPDraftConfig, kv_heads: int) -> None:
        self.register_buffer("cos_sin", rope_cos_sin_table(cfg.max_position, cfg.head_dim, cfg.rope_theta))
        for i in range(cfg.num_layers):
            shape = (cfg.num_slots, kv_heads, cfg.head_dim)
            self.register_buffer(f"k_cache_{i}", torch.zeros(shape, dtype=cfg.dtype))
            self.register_buffer(f"v_cache_{i}", torch.zeros(shape, dtype=cfg.dtype))

    def caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(getattr(self, f"k_cache_{i}"), getattr(self, f"v_cache_{i}")) for i in range(len(self.layers))]

    @abc.abstractmethod
    def project(self, layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`layer`'s q, k, v of `x` (this rank's heads)."""

    @abc.abstractmethod
    def gate_up(self, layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`layer`'s gate and up projections of `x` (this rank's MLP columns)."""

    @abc.abstractmethod
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of a row-parallel output."""

    def _k(self, layer: nn.Module, k: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        d = self.cfg.head_dim
        k = F.rms_norm(k.unflatten(-1, (-1, d)), (d,), layer.k_norm_weight, self.cfg.eps)
        return apply_rope(k, cos_sin, "neox")

    def forward(
        self,
        ctx: torch.Tensor,
        positions: torch.Tensor,
        cache_loc: torch.Tensor,
        hidden: torch.Tensor,
        block_positions: torch.Tensor,
    ) -> torch.Tensor:
        d = self.cfg.head_dim
        ctx_rope, block_rope = self.cos_sin[positions], self.cos_sin[block_positions]
        for layer, (k_cache, v_cache) in zip(self.layers, self.caches(), strict=True):
            _, k, v = self.project(layer, ctx)
            k_cache[cache_loc] = self._k(layer, k, ctx_rope)
            v_cache[cache_loc] = v.unflatten(-1, (-1, d))

            q, k, v = self.project(layer, hidden)
            q = apply_rope(q.unflatten(-1, (-1, d)), block_rope, "neox")
            k, v = self._k(layer, k, block_rope), v.unflatten(-1, (-1, d))
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            attn = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
            hidden = hidden + self.all_reduce(layer.o_proj(attn.transpose(0, 1).flatten(1)))
            gate, up = self.gate_up(layer, hidden)
            hidden = hidden + self.all_reduce(layer.down_proj(F.silu(gate) * up))
        return hidden


class DraftLayer(nn.Module):
    """One unsharded layer: separate projections (what `parallelize` shards) and the per-head k_norm weight."""

    def __init__(self, cfg: TPDraftConfig) -> None:
        super().__init__()
        q, kv, h, i = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden, cfg.intermediate
        shapes = dict(q_proj=(h, q), k_proj=(h, kv), v_proj=(h, kv), o_proj=(q, h))
        shapes.update(gate_proj=(h, i), up_proj=(h, i), down_proj=(i, h))
        for name, (fan_in, fan_out) in shapes.items():
            setattr(self, name, nn.Linear(fan_in, fan_out, bias=False, dtype=cfg.dtype))
        self.k_norm_weight = nn.Parameter(torch.ones(cfg.head_dim, dtype=cfg.dtype))


class TPDraft(_DraftStep):
    """The draft step with separate projections: unsharded, or sharded by `parallelize`. `world_size` sizes the
    caches for one rank's K/V heads (1: all heads, the unsharded model)."""

    def __init__(self, cfg: TPDraftConfig, world_size: int = 1, device: torch.device | str = "cpu") -> None:
        super().__init__()
        cfg.check_world_size(world_size)
        self.cfg = cfg
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self._init_buffers(cfg, cfg.num_kv_heads // world_size)
        self.reset_parameters(cfg.seed)
        self.to(device)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Random weights from `seed`: every rank that builds a `TPDraft` of one config gets the same model."""
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("k_norm_weight"):
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)

    def project(self, layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)

    def gate_up(self, layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return layer.gate_proj(x), layer.up_proj(x)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x  # unsharded, or a DTensor row-parallel linear that all-reduced its output already


def tp_plan(cfg: TPDraftConfig) -> dict[str, Any]:
    """The `parallelize_module` plan of a `TPDraft`: column-parallel q/k/v and gate/up, row-parallel o/down."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}
    for i in range(cfg.num_layers):
        plan.update({f"layers.{i}.{name}": ColwiseParallel() for name in COLUMN_PARALLEL})
        plan.update({f"layers.{i}.{name}": RowwiseParallel() for name in ROW_PARALLEL})
    return plan


def parallelize(model: TPDraft, mesh: Any) -> TPDraft:
    """Shard `model` (built with `world_size=mesh.size()`) over the 1-D device mesh `mesh`, in place."""
    from torch.distributed.tensor.parallel import parallelize_module

    num_kv_heads = model.caches()[0][0].shape[1] * mesh.size()
    if num_kv_heads != model.cfg.num_kv_heads:
        raise ValueError(f"parallelize: the model's caches are not sized for {mesh.size()} ranks (TPDraft world_size)")
    return parallelize_module(model, mesh, tp_plan(model.cfg))


class HandShardedLayer(nn.Module):
    """One layer's shards on one rank, as engines lay them out (fused qkv and gate/up rows of this rank)."""

    def __init__(self, cfg: TPDraftConfig, world_size: int) -> None:
        super().__init__()
        d, h = cfg.head_dim, cfg.hidden
        self.sizes = (cfg.num_heads // world_size * d, cfg.num_kv_heads // world_size * d)
        q, kv = self.sizes
        inter = cfg.intermediate // world_size
        self.qkv_proj = nn.Linear(h, q + 2 * kv, bias=False, dtype=cfg.dtype)
        self.o_proj = nn.Linear(q, h, bias=False, dtype=cfg.dtype)
        self.gate_up_proj = nn.Linear(h, 2 * inter, bias=False, dtype=cfg.dtype)
        self.down_proj = nn.Linear(inter, h, bias=False, dtype=cfg.dtype)
        self.k_norm_weight = nn.Parameter(torch.ones(d, dtype=cfg.dtype))


class HandShardedDraft(_DraftStep):
    """Rank `rank`'s shards of the draft step as plain tensors, all-reduced over `group` with the functional
    collectives (one sum all-reduce after o_proj and one after down_proj per layer)."""

    def __init__(
        self, cfg: TPDraftConfig, rank: int, world_size: int, group: Any, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__()
        cfg.check_world_size(world_size)
        self.cfg, self.rank, self.world_size, self.group = cfg, rank, world_size, group
        self.layers = nn.ModuleList(HandShardedLayer(cfg, world_size) for _ in range(cfg.num_layers))
        self._init_buffers(cfg, cfg.num_kv_heads // world_size)
        self.to(device)

    @torch.no_grad()
    def load_(self, full: TPDraft) -> None:
        """Copy this rank's rows (columns of o/down) of the unsharded `full` into the shards, in place."""
        r, n = self.rank, self.world_size
        for mine, theirs in zip(self.layers, full.layers, strict=True):
            rows = lambda linear: linear.weight.chunk(n, dim=0)[r]
            mine.qkv_proj.weight.copy_(torch.cat([rows(theirs.q_proj), rows(theirs.k_proj), rows(theirs.v_proj)]))
            mine.gate_up_proj.weight.copy_(torch.cat([rows(theirs.gate_proj), rows(theirs.up_proj)]))
            mine.o_proj.weight.copy_(theirs.o_proj.weight.chunk(n, dim=1)[r])
            mine.down_proj.weight.copy_(theirs.down_proj.weight.chunk(n, dim=1)[r])
            mine.k_norm_weight.copy_(theirs.k_norm_weight)
        self.cos_sin.copy_(full.cos_sin)

    def project(self, layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, kv = layer.sizes
        return layer.qkv_proj(x).split([q, kv, kv], dim=-1)

    def gate_up(self, layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return layer.gate_up_proj(x).chunk(2, dim=-1)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed import _functional_collectives as funcol

        return funcol.all_reduce(x, "sum", self.group)
