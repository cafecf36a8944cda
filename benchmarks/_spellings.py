"""Draft context-K/V writers spelled the ways models are written, and the fp64 caches they must all produce.

Every writer has `forward(ctx [T, hidden], positions [T], cache_loc [T])`: each layer projects the same `ctx` to K
and V, K goes through the layer's k_norm (RMSNorm per head; `llama` has none) and RoPE at `positions`, and both are
written to the layer's caches `k_cache_{i}` / `v_cache_{i}` `[num_slots, num_kv_heads, head_dim]` at `cache_loc`. The
math is the same in every spelling (that of `dspark::multi_linear_kv_write` with the spelling's rope style); the code
is not:

- `reference`: `DraftKVWriter` of `dspark_fx/reference_draft.py` as its config says, `write="cache_loc"`.
- `sglang` (sglang-native): one `kv_proj` linear + `split`; RMSNorm `forward_native` over `k.reshape(-1, head_dim)`
  (fp32, cast back, then `* weight`); RoPE from an fp32 `cos_sin_cache` by `index_select`, `chunk` halves (neox) in
  fp32, on the key and a dummy query.
- `hf` (HF transformers): `k_proj` / `v_proj`, the `[1, heads, T, head_dim]` layout; Qwen3-style RMSNorm
  (`weight * x.to(dtype)`); cos/sin computed per call as HF does (the angles by `inv_freq @ position_ids`, cast to
  the model dtype), `rotate_half` (neox).
- `hf_static`: `hf` writing HF's static cache: per layer `[1, heads, num_slots, head_dim]` buffers, written along
  the slot dim (`cache.index_copy_(2, cache_loc, k)`); `caches()` gives their `[num_slots, heads, head_dim]` views.
- `llama` (HF transformers' Llama: an EAGLE-style draft): `hf` without a k_norm, K only rotated.
- `complex` (DeepSeek / Llama reference): `wk` / `wv`, `F.rms_norm`; a complex64 `freqs_cis` table, rotation by a
  complex multiply on `view_as_complex` pairs (GPT-J pairs).
- `gptj_stack`: one `qkv_proj` linear + `split` (Q unused); hand-written fp32 norm, `* weight` in fp32; cos/sin by
  `table[pos].chunk(2, -1)`, pairs by strided slices, `stack(..., -1).flatten(-2)` (GPT-J pairs).

`build_spelling(name, cfg, device)` takes a `DraftKVConfig` (layers, hidden, heads, head_dim, dtype, qkv_bias, eps,
rope_theta, max_position, num_slots, seed); the non-reference spellings use one eps / theta / bias for all layers,
rotate all of `head_dim` and set the rope style themselves. Every writer gives `caches()`, `kv_params()` (per layer
the K/V weight rows, biases, norm weight (None without a k_norm) and eps) and `rope_tables()` (per layer the
`[max_position, head_dim]` `[cos | sin]` fp32 table of its theta), which `expected_caches` and the benchmarks'
hand-stacked variant read.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from custom_ops.linear.multi_linear_kv_write import layer_kv
from dspark_fx.reference_draft import DraftKVConfig, DraftKVWriter, rope_cos_sin_table

SPELLINGS = ("reference", "sglang", "hf", "hf_static", "llama", "complex", "gptj_stack")
ROPE_STYLE = {
    "sglang": "neox",
    "hf": "neox",
    "hf_static": "neox",
    "llama": "neox",
    "complex": "gptj",
    "gptj_stack": "gptj",
}

Rows = tuple[torch.Tensor, int, torch.Tensor | None]  # (weight, first row, bias or None), as `layer_kv` takes them


class LayerKV(NamedTuple):
    k_rows: Rows
    v_rows: Rows
    norm_weight: torch.Tensor | None  # None: the layer has no k_norm
    eps: float


class ReferenceSpelling(DraftKVWriter):
    """`DraftKVWriter` itself (this repo's own spelling), with the accessors of the other spellings."""

    def kv_params(self) -> list[LayerKV]:
        cfg, kv = self.cfg, self.cfg.kv_size
        params = []
        for layer in self.layers:
            if cfg.proj == "kv_separate":
                k_rows = (layer.k_proj.weight, 0, layer.k_proj.bias)
                v_rows = (layer.v_proj.weight, 0, layer.v_proj.bias)
            else:
                w, b = layer.qkv_proj.weight, layer.qkv_proj.bias
                k_rows, v_rows = (w, cfg.q_size, b), (w, cfg.q_size + kv, b)
            params.append(LayerKV(k_rows, v_rows, layer.k_norm_weight, layer.eps))
        return params

    def rope_tables(self) -> list[torch.Tensor]:
        return [getattr(self, f"cos_sin_{j}") for j in self.table_of_layer]


class _SpellingWriter(nn.Module):
    """What the non-reference spellings share: config checks, random weights, caches, the cache write."""

    layers: nn.ModuleList

    def __init__(self, cfg: DraftKVConfig) -> None:
        super().__init__()
        for name in ("qkv_bias", "eps", "rope_theta"):
            if isinstance(getattr(cfg, name), tuple):
                raise ValueError(f"{type(self).__name__}: DraftKVConfig.{name} must be one value for all layers")
        if cfg.rope_dim != cfg.head_dim:
            raise ValueError(f"{type(self).__name__}: rotary_dim must be head_dim ({cfg.head_dim}), got {cfg.rope_dim}")
        self.cfg = cfg

    def _finish(self, device: torch.device | str) -> None:
        cfg = self.cfg
        for i in range(cfg.num_layers):
            shape = self._cache_shape()
            self.register_buffer(f"k_cache_{i}", torch.zeros(shape, dtype=cfg.dtype), persistent=False)
            self.register_buffer(f"v_cache_{i}", torch.zeros(shape, dtype=cfg.dtype), persistent=False)
        self._reset_parameters(cfg.seed)
        self.to(device)

    @torch.no_grad()
    def _reset_parameters(self, seed: int) -> None:
        """Random weights, distinct per layer; norm weights around 1 (as `DraftKVWriter.reset_parameters`)."""
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            scale = 1.0 / self.cfg.hidden**0.5 if p.dim() == 2 else 0.5
            offset = 1.0 if "norm" in name else 0.0
            p.copy_(offset + scale * torch.randn(p.shape, generator=gen, dtype=torch.float32))

    def _cache_shape(self) -> tuple[int, ...]:
        return (self.cfg.num_slots, self.cfg.num_kv_heads, self.cfg.head_dim)

    def caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(getattr(self, f"k_cache_{i}"), getattr(self, f"v_cache_{i}")) for i in range(self.cfg.num_layers)]

    def rope_tables(self) -> list[torch.Tensor]:
        table = rope_cos_sin_table(self.cfg.max_position, self.cfg.head_dim, self.cfg.rope_theta)
        return [table.to(self.k_cache_0.device)] * self.cfg.num_layers

    def layer_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        raise NotImplementedError

    def forward(self, ctx: torch.Tensor, positions: torch.Tensor, cache_loc: torch.Tensor) -> None:
        for (k, v), (k_cache, v_cache) in zip(self.layer_kv(ctx, positions), self.caches(), strict=True):
            k_cache[cache_loc] = k
            v_cache[cache_loc] = v


# sglang-native style ----------------------------------------------------------------------------------------------


class SglRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.variance_epsilon = eps

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        orig_dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(dim=-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        return x.to(orig_dtype) * self.weight

    forward = forward_native


class SglRotaryEmbedding(nn.Module):
    """Neox RoPE over `[T, heads * head_size]` query and key, from an fp32 `cos_sin_cache [max_pos, rotary_dim]`."""

    def __init__(self, head_size: int, max_position: int, base: float) -> None:
        super().__init__()
        self.head_size = head_size
        inv_freq = 1.0 / (base ** (torch.arange(0, head_size, 2, dtype=torch.float32) / head_size))
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1), persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.view(shape[0], -1, self.head_size).float()
        x1, x2 = torch.chunk(x, 2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.reshape(shape)

    def forward_native(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos_sin = self.cos_sin_cache.index_select(0, positions)
        cos, sin = cos_sin.chunk(2, dim=-1)
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        query_out = self._rotate(query, cos, sin).to(query.dtype)
        key_out = self._rotate(key, cos, sin).to(key.dtype)
        return query_out, key_out

    forward = forward_native


class SglLayer(nn.Module):
    def __init__(self, cfg: DraftKVConfig) -> None:
        super().__init__()
        self.kv_size, self.head_dim = cfg.kv_size, cfg.head_dim
        self.kv_proj = nn.Linear(cfg.hidden, 2 * cfg.kv_size, bias=cfg.qkv_bias, dtype=cfg.dtype)
        self.k_norm = SglRMSNorm(cfg.head_dim, cfg.eps, cfg.dtype)
        self.rotary_emb = SglRotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope_theta)

    def forward(self, ctx: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.kv_proj(ctx).split([self.kv_size, self.kv_size], dim=-1)
        k = self.k_norm(k.reshape(-1, self.head_dim)).view(-1, self.kv_size)
        dummy_q = torch.empty_like(k)
        _, k = self.rotary_emb(positions, dummy_q, k)
        heads = self.kv_size // self.head_dim
        return k.view(-1, heads, self.head_dim), v.view(-1, heads, self.head_dim)


class SglangSpelling(_SpellingWriter):
    def __init__(self, cfg: DraftKVConfig, device: torch.device | str = "cpu") -> None:
        super().__init__(cfg)
        self.layers = nn.ModuleList(SglLayer(cfg) for _ in range(cfg.num_layers))
        self._finish(device)

    def kv_params(self) -> list[LayerKV]:
        kv = self.cfg.kv_size
        return [
            LayerKV(
                (layer.kv_proj.weight, 0, layer.kv_proj.bias),
                (layer.kv_proj.weight, kv, layer.kv_proj.bias),
                layer.k_norm.weight,
                layer.k_norm.variance_epsilon,
            )
            for layer in self.layers
        ]

    def layer_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [layer(ctx, positions) for layer in self.layers]


# HF transformers style --------------------------------------------------------------------------------------------


class Qwen3StyleRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class HFRotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, base: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

        self.attention_scaling = 1.0

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin `[B, T, head_dim]` of `position_ids [B, T]`: the angles as the outer product `inv_freq @ pos`."""
        inv_freq_expanded = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        position_ids_expanded = position_ids[:, None, :].float()
        freqs = (inv_freq_expanded.float() @ position_ids_expanded.float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1) -> torch.Tensor:
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (k * cos) + (rotate_half(k) * sin)


class HFLayer(nn.Module):
    """Qwen3's attention as far as K/V go; `k_norm=False`: Llama's (no k_norm)."""

    def __init__(self, cfg: DraftKVConfig, k_norm: bool = True) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.k_proj = nn.Linear(cfg.hidden, cfg.kv_size, bias=cfg.qkv_bias, dtype=cfg.dtype)
        self.v_proj = nn.Linear(cfg.hidden, cfg.kv_size, bias=cfg.qkv_bias, dtype=cfg.dtype)
        self.k_norm = Qwen3StyleRMSNorm(cfg.head_dim, cfg.eps, cfg.dtype) if k_norm else None

    def forward(
        self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = hidden_states.shape[0]
        hidden_shape = (1, tokens, -1, self.head_dim)
        key_states = self.k_proj(hidden_states).view(hidden_shape)
        if self.k_norm is not None:
            key_states = self.k_norm(key_states)
        key_states = key_states.transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        key_states = apply_rotary_pos_emb(key_states, cos, sin)
        heads = key_states.shape[1]
        return (
            key_states.transpose(1, 2).reshape(tokens, heads, self.head_dim),
            value_states.transpose(1, 2).reshape(tokens, heads, self.head_dim),
        )


class HFSpelling(_SpellingWriter):
    k_norm = True  # whether the layers have a k_norm

    def __init__(self, cfg: DraftKVConfig, device: torch.device | str = "cpu") -> None:
        super().__init__(cfg)
        self.layers = nn.ModuleList(HFLayer(cfg, self.k_norm) for _ in range(cfg.num_layers))
        self.rotary_emb = HFRotaryEmbedding(cfg.head_dim, cfg.rope_theta)
        self._finish(device)

    def kv_params(self) -> list[LayerKV]:
        return [
            LayerKV(
                (layer.k_proj.weight, 0, layer.k_proj.bias),
                (layer.v_proj.weight, 0, layer.v_proj.bias),
                None if layer.k_norm is None else layer.k_norm.weight,
                self.cfg.eps,
            )
            for layer in self.layers
        ]

    def layer_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        position_embeddings = self.rotary_emb(ctx, positions[None])  # [1, T, head_dim] each, batch of one
        return [layer(ctx, position_embeddings) for layer in self.layers]


class HFStaticCacheSpelling(HFSpelling):
    """`hf` writing HF's static cache: `[1, heads, num_slots, head_dim]` per layer, along the slot dim."""

    def _cache_shape(self) -> tuple[int, ...]:
        return (1, self.cfg.num_kv_heads, self.cfg.num_slots, self.cfg.head_dim)

    def caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The `[num_slots, heads, head_dim]` views of the buffers."""
        return [(k[0].transpose(0, 1), v[0].transpose(0, 1)) for k, v in super().caches()]

    def forward(self, ctx: torch.Tensor, positions: torch.Tensor, cache_loc: torch.Tensor) -> None:
        for i, (k, v) in enumerate(self.layer_kv(ctx, positions)):
            for kind, value in (("k", k), ("v", v)):
                getattr(self, f"{kind}_cache_{i}").index_copy_(2, cache_loc, value.transpose(0, 1)[None])


class LlamaSpelling(HFSpelling):
    """HF transformers' Llama attention as far as K/V go (an EAGLE-style draft): no k_norm, K only rotated."""

    k_norm = False


# DeepSeek / Llama reference style (complex rotation) --------------------------------------------------------------


def precompute_freqs_cis(dim: int, end: int, theta: float) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    t = torch.arange(end, device=freqs.device, dtype=torch.float32)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)  # complex64


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """`x [T, heads, D]` rotated by `freqs_cis [T, D/2]`, pairs `(2j, 2j + 1)` as complex numbers."""
    x_ = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(x_ * freqs_cis[:, None, :]).flatten(-2).type_as(x)


class ComplexLayer(nn.Module):
    def __init__(self, cfg: DraftKVConfig) -> None:
        super().__init__()
        self.n_kv_heads, self.head_dim, self.norm_eps = cfg.num_kv_heads, cfg.head_dim, cfg.eps
        self.wk = nn.Linear(cfg.hidden, cfg.kv_size, bias=cfg.qkv_bias, dtype=cfg.dtype)
        self.wv = nn.Linear(cfg.hidden, cfg.kv_size, bias=cfg.qkv_bias, dtype=cfg.dtype)
        self.k_norm = nn.Module()
        self.k_norm.weight = nn.Parameter(torch.ones(cfg.head_dim, dtype=cfg.dtype))

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seqlen = x.shape[0]
        xk = self.wk(x).view(seqlen, self.n_kv_heads, self.head_dim)
        xv = self.wv(x).view(seqlen, self.n_kv_heads, self.head_dim)
        xk = F.rms_norm(xk, (self.head_dim,), self.k_norm.weight, self.norm_eps)
        return apply_rotary_emb(xk, freqs_cis), xv


class ComplexSpelling(_SpellingWriter):
    def __init__(self, cfg: DraftKVConfig, device: torch.device | str = "cpu") -> None:
        super().__init__(cfg)
        self.layers = nn.ModuleList(ComplexLayer(cfg) for _ in range(cfg.num_layers))
        freqs_cis = precompute_freqs_cis(cfg.head_dim, cfg.max_position, cfg.rope_theta)
        self.register_buffer("freqs_cis", freqs_cis, persistent=False)
        self._finish(device)

    def kv_params(self) -> list[LayerKV]:
        return [
            LayerKV(
                (layer.wk.weight, 0, layer.wk.bias),
                (layer.wv.weight, 0, layer.wv.bias),
                layer.k_norm.weight,
                layer.norm_eps,
            )
            for layer in self.layers
        ]

    def layer_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        freqs_cis = self.freqs_cis[positions]
        return [layer(ctx, freqs_cis) for layer in self.layers]


# GPT-J pairs by strided slices and stack --------------------------------------------------------------------------


class GptjStackLayer(nn.Module):
    def __init__(self, cfg: DraftKVConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.qkv_proj = nn.Linear(cfg.hidden, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias, dtype=cfg.dtype)
        self.k_norm_weight = nn.Parameter(torch.ones(cfg.head_dim, dtype=cfg.dtype))

    def forward(self, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        _, k, v = self.qkv_proj(ctx).split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        k = k.unflatten(-1, (cfg.num_kv_heads, cfg.head_dim)).float()
        k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + cfg.eps) * self.k_norm_weight.float()
        k1, k2 = k[..., ::2], k[..., 1::2]
        k = torch.stack((k1 * cos - k2 * sin, k2 * cos + k1 * sin), -1).flatten(-2)
        return k.to(ctx.dtype), v.unflatten(-1, (cfg.num_kv_heads, cfg.head_dim))


class GptjStackSpelling(_SpellingWriter):
    def __init__(self, cfg: DraftKVConfig, device: torch.device | str = "cpu") -> None:
        super().__init__(cfg)
        self.layers = nn.ModuleList(GptjStackLayer(cfg) for _ in range(cfg.num_layers))
        self.register_buffer(
            "table", rope_cos_sin_table(cfg.max_position, cfg.head_dim, cfg.rope_theta), persistent=False
        )
        self._finish(device)

    def kv_params(self) -> list[LayerKV]:
        q, kv = self.cfg.q_size, self.cfg.kv_size
        return [
            LayerKV(
                (layer.qkv_proj.weight, q, layer.qkv_proj.bias),
                (layer.qkv_proj.weight, q + kv, layer.qkv_proj.bias),
                layer.k_norm_weight,
                self.cfg.eps,
            )
            for layer in self.layers
        ]

    def layer_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        cos, sin = self.table[positions].chunk(2, -1)
        cos, sin = cos[:, None, :], sin[:, None, :]
        return [layer(ctx, cos, sin) for layer in self.layers]


# building and the expected caches ---------------------------------------------------------------------------------

SpellingModel = ReferenceSpelling | SglangSpelling | HFSpelling | ComplexSpelling | GptjStackSpelling
_CLASSES = {
    "sglang": SglangSpelling,
    "hf": HFSpelling,
    "hf_static": HFStaticCacheSpelling,
    "llama": LlamaSpelling,
    "complex": ComplexSpelling,
    "gptj_stack": GptjStackSpelling,
}


def build_spelling(name: str, cfg: DraftKVConfig, device: torch.device | str = "cpu") -> SpellingModel:
    """The writer of spelling `name` for `cfg` (its `write` is `"cache_loc"`; non-reference: its own rope style)."""
    if name not in SPELLINGS:
        raise ValueError(f"build_spelling: name must be one of {SPELLINGS}, got {name!r}")
    if name == "reference":
        return ReferenceSpelling(dataclasses.replace(cfg, write="cache_loc"), device)
    return _CLASSES[name](dataclasses.replace(cfg, write="cache_loc", rope_style=ROPE_STYLE[name]), device)


def is_neox(model: SpellingModel) -> bool:
    return model.cfg.rope_style == "neox"


@torch.no_grad()
def expected_caches(
    model: SpellingModel, ctx: torch.Tensor, positions: torch.Tensor, cache_loc: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The fp64 caches `model(ctx, positions, cache_loc)` must leave, from its current caches and weights: the
    formula of `dspark::multi_linear_kv_write` (`layer_kv`) with the model's rope style, computed in float64."""
    cfg = model.cfg
    xs = ctx.double()
    out = []
    for params, table, (k_cache, v_cache) in zip(model.kv_params(), model.rope_tables(), model.caches(), strict=True):
        k, v = layer_kv(
            xs,
            params.k_rows,
            params.v_rows,
            None if params.norm_weight is None else (params.norm_weight, params.eps),
            table.double()[positions],
            is_neox(model),
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        k_expected, v_expected = k_cache.double().clone(), v_cache.double().clone()
        k_expected[cache_loc] = k
        v_expected[cache_loc] = v
        out.append((k_expected, v_expected))
    return out
