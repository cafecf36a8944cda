"""HF-style draft models, written independently of `dspark_fx.reference_draft`.

`HFStyleDraft` differs from the reference on purpose: separate biased `k_proj`/`v_proj` (addmm), the norm weight
multiplied *after* the cast back to the model dtype (HF RMSNorm), `rotate_half` RoPE, and cos/sin computed in the
graph from positions and an `inv_freq` buffer. `HFStyleKVWriter` writes those K/V into per-layer caches the ways
HF-style code does (`index_copy_` as HF's static cache, `cache[loc] = k`, `cache[start:end] = k`).
"""

from __future__ import annotations

import torch
from torch import nn


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class HFRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6, weight=True):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(dim) + 0.5) if weight else None
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x.to(dtype) if self.weight is None else self.weight * x.to(dtype)


class HFLayer(nn.Module):
    """`norm`: "weight" (HF RMSNorm), "plain" (without weight) or None (no k_norm); `rotary_dim < head_dim` rotates
    the first dims only (`k_rot, k_pass` as in partial-rotary HF models); `rotate`: how `rotate_half` is spelled (a
    key of `ROTATE_HALF`)."""

    def __init__(self, hidden, kv_heads, head_dim, norm="weight", eps=1e-6, rotary_dim=None, rotate="cat"):
        super().__init__()
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.rotate = ROTATE_HALF[rotate]
        self.rotary_dim = rotary_dim or head_dim
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=True)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=True)
        self.k_norm = HFRMSNorm(head_dim, eps, weight=norm == "weight") if norm else None

    def forward(self, x, cos, sin):
        shape = (x.shape[0], self.kv_heads, self.head_dim)
        k = self.k_proj(x).view(shape)
        if self.k_norm is not None:
            k = self.k_norm(k)
        k_rot, k_pass = k[..., : self.rotary_dim], k[..., self.rotary_dim :]
        k_rot = k_rot * cos[:, None, :] + self.rotate(k_rot) * sin[:, None, :]
        return torch.cat((k_rot, k_pass), dim=-1), self.v_proj(x).view(shape)


def rotate_half_by_roll(x):
    """`rotate_half` as `roll` by half the width with the first half negated (Dynamo decomposes `roll` into an
    `index` by `(iota + shift) % width`)."""
    half = x.shape[-1] // 2
    ones = torch.ones(half, dtype=x.dtype, device=x.device)
    sign = torch.cat((-ones, ones))
    return torch.roll(x, half, dims=-1) * sign


def rotate_half_by_where(x):
    """`rotate_half` chosen element-wise from two rolls by a mask of the element index."""
    half = x.shape[-1] // 2
    first = torch.arange(x.shape[-1], device=x.device) < half
    return torch.where(first, -torch.roll(x, -half, dims=-1), torch.roll(x, half, dims=-1))


def rotate_half_by_slice_scatter(x):
    """`rotate_half` written into a zero tensor's halves with `slice_scatter`."""
    half, width = x.shape[-1] // 2, x.shape[-1]
    out = torch.slice_scatter(torch.zeros_like(x), -x[..., half:], dim=-1, start=0, end=half)
    return torch.slice_scatter(out, x[..., :half], dim=-1, start=half, end=width)


ROTATE_HALF = {
    "cat": rotate_half,
    "roll": rotate_half_by_roll,
    "where": rotate_half_by_where,
    "slice_scatter": rotate_half_by_slice_scatter,
}


class HFStyleDraft(nn.Module):
    """`position_offset`: the angles are taken at `positions + position_offset` (0: at the positions)."""

    def __init__(
        self, layers=4, hidden=64, kv_heads=2, head_dim=16, theta=10000.0, rotary_dim=None, position_offset=0, **options
    ):
        super().__init__()
        rotary_dim = rotary_dim or head_dim
        self.position_offset = position_offset
        self.layers = nn.ModuleList(
            HFLayer(hidden, kv_heads, head_dim, rotary_dim=rotary_dim, **options) for _ in range(layers)
        )
        self.register_buffer("inv_freq", theta ** -(torch.arange(0, rotary_dim, 2).float() / rotary_dim))

    def forward(self, x, positions):
        if self.position_offset:
            positions = positions + self.position_offset
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        return [layer(x, cos, sin) for layer in self.layers]


HF_WRITES = ("index_copy", "index_put", "scatter", "slice")


class HFStyleKVWriter(HFStyleDraft):
    """`HFStyleDraft` whose K/V go into per-layer `[slots, kv_heads, head_dim]` caches (buffers `k_cache_i`,
    `v_cache_i`): `forward(x, positions, loc)` with `loc` a `[T]` slot tensor (`index_copy`: `cache.index_copy_(0,
    loc, k)`, `index_put`: `cache[loc] = k`, `scatter`: `cache.scatter_(0, loc.view(-1, 1, 1).expand_as(k), k)`) or
    the first slot, an int (`slice`: `cache[loc : loc + T] = k`)."""

    def __init__(self, write="index_copy", slots=64, layers=4, kv_heads=2, head_dim=16, **options):
        super().__init__(layers=layers, kv_heads=kv_heads, head_dim=head_dim, **options)
        self.write = write
        for i in range(layers):
            self.register_buffer(f"k_cache_{i}", torch.zeros(slots, kv_heads, head_dim))
            self.register_buffer(f"v_cache_{i}", torch.zeros(slots, kv_heads, head_dim))

    def caches(self):
        return [getattr(self, f"{kind}_cache_{i}") for i in range(len(self.layers)) for kind in "kv"]

    def forward(self, x, positions, loc):
        for (k, v), i in zip(super().forward(x, positions), range(len(self.layers)), strict=True):
            for cache, value in ((getattr(self, f"k_cache_{i}"), k), (getattr(self, f"v_cache_{i}"), v)):
                if self.write == "index_copy":
                    cache.index_copy_(0, loc, value)
                elif self.write == "index_put":
                    cache[loc] = value
                elif self.write == "scatter":
                    cache.scatter_(0, loc.view(-1, 1, 1).expand_as(value), value)
                else:
                    cache[loc : loc + x.shape[0]] = value
