"""A draft K/V writer with GPT-J RoPE written as people write it, independently of `dspark_fx.reference_draft`.

Per layer: K and V from one shared activation `ctx` (separate `k_proj`/`v_proj` linears, or one `kv_proj` and a
split), a per-head RMSNorm of K over head_dim, GPT-J RoPE on strided pairs (`x[..., 0::2]`, `x[..., 1::2]`, rotated
and put back with `torch.stack((o1, o2), -1).flatten(-2)`) with cos/sin from `table[positions].chunk(2, -1)` of an
fp32 `[512, head_dim]` buffer of `[cos | sin]` halves (fp32 in a bf16 model too, cast to the model dtype after the
gather), and `cache[loc] = k` into per-layer caches (V unrotated).
"""

from __future__ import annotations

import torch
from torch import nn


def gptj_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., 0::2], x[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    return torch.stack((o1, o2), -1).flatten(-2)


class GPTJStackWriter(nn.Module):
    def __init__(self, dtype=torch.float32, fused_kv=False, layers=3, hidden=64, kv_heads=2, head_dim=16, slots=64):
        super().__init__()
        max_pos, eps = 512, 1e-6
        self.kv_heads, self.head_dim, self.eps, self.fused_kv = kv_heads, head_dim, eps, fused_kv
        width = kv_heads * head_dim
        if fused_kv:
            self.kv_proj = nn.ModuleList(nn.Linear(hidden, 2 * width, bias=False, dtype=dtype) for _ in range(layers))
        else:
            self.k_proj = nn.ModuleList(nn.Linear(hidden, width, bias=False, dtype=dtype) for _ in range(layers))
            self.v_proj = nn.ModuleList(nn.Linear(hidden, width, bias=False, dtype=dtype) for _ in range(layers))
        self.k_norm = nn.ParameterList(nn.Parameter(torch.rand(head_dim).to(dtype) + 0.5) for _ in range(layers))
        inv_freq = 10000.0 ** -(torch.arange(0, head_dim, 2).float() / head_dim)
        freqs = torch.arange(max_pos).float()[:, None] * inv_freq[None, :]
        self.register_buffer("table", torch.cat((freqs.cos(), freqs.sin()), -1))
        for i in range(layers):
            self.register_buffer(f"k_cache_{i}", torch.randn(slots, kv_heads, head_dim, dtype=dtype))
            self.register_buffer(f"v_cache_{i}", torch.randn(slots, kv_heads, head_dim, dtype=dtype))
        self.layers = layers

    def caches(self) -> list[torch.Tensor]:
        return [getattr(self, f"{kv}_cache_{i}") for i in range(self.layers) for kv in "kv"]

    def _kv(self, i: int, ctx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused_kv:
            return self.kv_proj[i](ctx).split(self.kv_heads * self.head_dim, -1)
        return self.k_proj[i](ctx), self.v_proj[i](ctx)

    def forward(self, ctx: torch.Tensor, positions: torch.Tensor, loc: torch.Tensor) -> None:
        shape = (ctx.shape[0], self.kv_heads, self.head_dim)
        cos, sin = self.table[positions].chunk(2, -1)
        cos, sin = cos[:, None, :].to(ctx.dtype), sin[:, None, :].to(ctx.dtype)
        for i in range(self.layers):
            k, v = self._kv(i, ctx)
            k = k.view(shape)
            k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + self.eps) * self.k_norm[i]
            getattr(self, f"k_cache_{i}")[loc] = gptj_rotate(k, cos, sin)
            getattr(self, f"v_cache_{i}")[loc] = v.view(shape)
