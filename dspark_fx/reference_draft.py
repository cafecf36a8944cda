"""The reference DSpark/DFlash draft context-KV writer: one definition used by tests, examples and benchmarks.

Per draft layer `l`, from the shared `ctx` hidden states (the path README.md describes as `kv_proj → k_norm → rope`):

    kv_l = ctx @ W_kv_l^T (+ b_l)                 one GEMM per layer
    k_l  = RMSNorm_l(k_l per head)                fp32 math, one cast back
    k_l  = RoPE(k_l, positions)                   neox or GPT-J pairs, on the first `rotary_dim` dims
    cache write of k_l, v_l                       or return them

The options cover the ways real drafts write this path, so the fusion pass is tested on all of them:

| option        | values                                                                                    |
|---------------|-------------------------------------------------------------------------------------------|
| `proj`        | `"qkv_slice"` fused qkv weight row-sliced to K/V; `"qkv_split"` fused qkv GEMM then split; |
|               | `"kv_separate"` separate `k_proj`/`v_proj` linears                                         |
| `norm`        | `"manual"` hand-written fp32 RMSNorm; `"rms_norm"` `F.rms_norm`                             |
| `rope_style`  | `"neox"` (halves) or `"gptj"` (interleaved pairs); `rotary_dim < head_dim` is partial RoPE  |
| `write`       | `"cache_loc"` `forward(ctx, positions, cache_loc)`; `"commit"`                              |
|               | `forward(ctx, positions, cache_loc_2d [B, W], commit_lens [B])` writes rows `j < commit_lens[b]`; |
|               | `"slice"` `forward(ctx, positions, cache_start: int)` writes `cache[start : start + T] = k`;  |
|               | `"return"` `forward(ctx, positions) -> ((k_0, v_0), ...)`                                   |
| `qkv_bias`, `eps`, `rope_theta` | one value for all layers or a tuple with one value per layer            |

Caches are registered buffers `k_cache_{l}` / `v_cache_{l}` of shape `[num_slots, num_kv_heads, head_dim]`; the
cos/sin tables (`[max_position, rotary_dim]` fp32, `[cos | sin]` halves) are buffers shared by the layers that
use the same `rope_theta`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

PROJ_FORMS = ("qkv_slice", "qkv_split", "kv_separate")
NORM_FORMS = ("manual", "rms_norm")
ROPE_STYLES = ("neox", "gptj")
WRITE_MODES = ("cache_loc", "commit", "slice", "return")


def _per_layer(value: object, num_layers: int, name: str) -> tuple:
    if isinstance(value, tuple):
        if len(value) != num_layers:
            raise ValueError(f"{name}: expected {num_layers} per-layer values, got {len(value)}")
        return value
    return (value,) * num_layers


@dataclass(frozen=True)
class DraftKVConfig:
    num_layers: int = 5
    hidden: int = 4096
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    dtype: torch.dtype = torch.bfloat16
    qkv_bias: bool | tuple[bool, ...] = False
    eps: float | tuple[float, ...] = 1e-6
    rope_theta: float | tuple[float, ...] = 1e6
    rope_style: str = "neox"
    rotary_dim: int | None = None
    max_position: int = 4096
    proj: str = "qkv_slice"
    norm: str = "manual"
    write: str = "cache_loc"
    num_slots: int = 4096
    seed: int = field(default=0, compare=False)

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("proj", self.proj, PROJ_FORMS),
            ("norm", self.norm, NORM_FORMS),
            ("rope_style", self.rope_style, ROPE_STYLES),
            ("write", self.write, WRITE_MODES),
        ):
            if value not in allowed:
                raise ValueError(f"DraftKVConfig.{name} must be one of {allowed}, got {value!r}")
        if self.rotary_dim is not None and not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise ValueError(f"DraftKVConfig.rotary_dim must be even and in (0, head_dim], got {self.rotary_dim}")
        for name in ("qkv_bias", "eps", "rope_theta"):
            _per_layer(getattr(self, name), self.num_layers, f"DraftKVConfig.{name}")

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim


def rope_cos_sin_table(max_position: int, rotary_dim: int, theta: float) -> torch.Tensor:
    """`[max_position, rotary_dim]` fp32 table, row `p` = `[cos(p·f_0..) | sin(p·f_0..)]`, `f_i = θ^(-2i/R)`."""
    inv_freq = theta ** -(torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angles = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


def apply_rope(k: torch.Tensor, cos_sin: torch.Tensor, style: str) -> torch.Tensor:
    """Rotate the first `R = cos_sin.shape[-1]` dims of `k [T, heads, D]` in fp32; `cos_sin` is `[T, R]`."""
    rot = cos_sin.shape[-1]
    cos, sin = cos_sin[:, None, : rot // 2], cos_sin[:, None, rot // 2 :]
    x = k.float()
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    if style == "neox":
        x1, x2 = x_rot[..., : rot // 2], x_rot[..., rot // 2 :]
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
        rotated = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    return torch.cat([rotated, x_pass], dim=-1).to(k.dtype)


class DraftKVLayer(nn.Module):
    """One layer's K/V projection, k_norm and RoPE (its attention is not needed for the context write)."""

    def __init__(self, cfg: DraftKVConfig, bias: bool, eps: float) -> None:
        super().__init__()
        self.cfg, self.eps = cfg, eps
        if cfg.proj == "kv_separate":
            self.k_proj = nn.Linear(cfg.hidden, cfg.kv_size, bias=bias, dtype=cfg.dtype)
            self.v_proj = nn.Linear(cfg.hidden, cfg.kv_size, bias=bias, dtype=cfg.dtype)
        else:
            self.qkv_proj = nn.Linear(cfg.hidden, cfg.q_size + 2 * cfg.kv_size, bias=bias, dtype=cfg.dtype)
        self.k_norm_weight = nn.Parameter(torch.ones(cfg.head_dim, dtype=cfg.dtype))

    def project(self, ctx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        if cfg.proj == "kv_separate":
            return self.k_proj(ctx), self.v_proj(ctx)
        if cfg.proj == "qkv_split":
            _, k, v = self.qkv_proj(ctx).split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            return k, v
        rows = slice(cfg.q_size, cfg.q_size + 2 * cfg.kv_size)
        bias = None if self.qkv_proj.bias is None else self.qkv_proj.bias[rows]
        k, v = F.linear(ctx, self.qkv_proj.weight[rows], bias).split([cfg.kv_size, cfg.kv_size], dim=-1)
        return k, v

    def k_norm(self, k: torch.Tensor) -> torch.Tensor:
        if self.cfg.norm == "rms_norm":
            return F.rms_norm(k, (k.shape[-1],), self.k_norm_weight, self.eps)
        x = k.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * self.k_norm_weight.float()).to(k.dtype)

    def forward(self, ctx: torch.Tensor, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        k, v = self.project(ctx)
        k = self.k_norm(k.reshape(-1, cfg.num_kv_heads, cfg.head_dim))
        k = apply_rope(k, cos_sin, cfg.rope_style)
        return k, v.reshape(-1, cfg.num_kv_heads, cfg.head_dim)


class DraftKVWriter(nn.Module):
    """All draft layers' context K/V from one `ctx`; see the module docstring for the options."""

    def __init__(self, cfg: DraftKVConfig, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.cfg = cfg
        n = cfg.num_layers
        biases = _per_layer(cfg.qkv_bias, n, "qkv_bias")
        epss = _per_layer(cfg.eps, n, "eps")
        thetas = _per_layer(cfg.rope_theta, n, "rope_theta")
        self.layers = nn.ModuleList(DraftKVLayer(cfg, biases[i], epss[i]) for i in range(n))
        self.table_of_layer = [sorted(set(thetas)).index(t) for t in thetas]
        for j, theta in enumerate(sorted(set(thetas))):
            self.register_buffer(f"cos_sin_{j}", rope_cos_sin_table(cfg.max_position, cfg.rope_dim, theta))
        if cfg.write != "return":
            for i in range(n):
                shape = (cfg.num_slots, cfg.num_kv_heads, cfg.head_dim)
                self.register_buffer(f"k_cache_{i}", torch.zeros(shape, dtype=cfg.dtype))
                self.register_buffer(f"v_cache_{i}", torch.zeros(shape, dtype=cfg.dtype))
        self.reset_parameters(cfg.seed)
        self.to(device)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Fresh random weights (distinct per layer, so a wrong layer order or slice fails the parity tests)."""
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            scale = 1.0 / self.cfg.hidden**0.5 if p.dim() == 2 else 0.5
            offset = 1.0 if name.endswith("k_norm_weight") else 0.0
            p.copy_(offset + scale * torch.randn(p.shape, generator=gen, dtype=torch.float32))

    def caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(getattr(self, f"k_cache_{i}"), getattr(self, f"v_cache_{i}")) for i in range(len(self.layers))]

    def forward(
        self,
        ctx: torch.Tensor,
        positions: torch.Tensor,
        cache_loc: torch.Tensor | int | None = None,
        commit_lens: torch.Tensor | None = None,
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], ...] | None:
        tables = [getattr(self, f"cos_sin_{j}")[positions] for j in range(len(set(self.table_of_layer)))]
        kvs = [layer(ctx, tables[t]) for layer, t in zip(self.layers, self.table_of_layer, strict=True)]
        if self.cfg.write == "return":
            return tuple(kvs)
        if cache_loc is None:
            raise ValueError(f"DraftKVWriter(write={self.cfg.write!r}) needs cache_loc")
        if self.cfg.write == "commit":
            if commit_lens is None:
                raise ValueError("DraftKVWriter(write='commit') needs commit_lens [B]")
            width = cache_loc.shape[1]
            keep = torch.arange(width, device=ctx.device)[None, :] < commit_lens[:, None]
            keep = keep.reshape(-1, 1, 1)
            cache_loc = cache_loc.reshape(-1)
        if self.cfg.write == "slice":  # cache_loc is the first slot of a contiguous run
            cache_loc = slice(cache_loc, cache_loc + ctx.shape[0])
        for (k, v), (k_cache, v_cache) in zip(kvs, self.caches(), strict=True):
            if self.cfg.write == "commit":
                k = torch.where(keep, k, k_cache[cache_loc])
                v = torch.where(keep, v, v_cache[cache_loc])
            k_cache[cache_loc] = k
            v_cache[cache_loc] = v
        return None
