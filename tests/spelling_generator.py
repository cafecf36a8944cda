"""Seeded draft context-K/V writers: the same math as `dspark::multi_linear_kv_write`, spelled many ways.

`generate(seed)` draws a `Spec` (one value per axis of `AXES`, everything follows from the seed), `build(spec)` its
`GeneratedWriter`, `make_inputs(spec, tokens, seed)` the forward arguments and `expected(model, inputs)` the fp64
caches the forward must leave: `layer_kv` (the op's formula) from the model's own parameters, per layer, applied
to the model's current caches by the spec's write.

Per layer, all from the same `ctx [T, hidden]`: a K/V projection, a per-head RMSNorm of K (k_norm), RoPE of K at
`positions [T]`, and both written into the layer's caches `k_cache_{i}` / `v_cache_{i}` (buffers, random values:
slots not written must keep them). The axes:

| axis          | values                                                                                         |
|---------------|------------------------------------------------------------------------------------------------|
| `dtype`       | `fp32`, `bf16` (weights, activation, caches)                                                   |
| `proj`        | `separate` k/v linears; fused kv by `kv_split` / `kv_chunk` / `kv_slice`; fused qkv (Q unused) |
|               | by `qkv_split` / `qkv_slice`; `row_slice` `F.linear(ctx, W_qkv[a:b], b_qkv[a:b])`              |
| `bias`        | `bias`, `nobias`                                                                               |
| `layout`      | `thd` `[T, heads, D]`; `bhtd` HF `[1, heads, T, D]` (view, norm, transpose, RoPE, transpose back) |
| `norm`        | fp32 math, cast back: `llama` `w * x.to(dt)`, `sglang` `x.to(dt) * w`,                          |
|               | `float_w` `(x * w.float()).to(dt)`, `promote_w` `(x * w).to(dt)`, `div_sqrt` `x / sqrt(mean + eps)`, |
|               | `sum_div` `sum(x²) / D`,                                                                        |
|               | `gemma` `x * (1 + w)`, `no_weight`; `f_rms_norm`; `nn_rmsnorm`; `none`                          |
| `rope`        | `neox` `cat(x1 c - x2 s, x2 c + x1 s)`; `rotate_half` `x c + rotate_half(x) s` (duplicated c/s); |
|               | `gptj_stack` strided pairs, `stack(.., -1).flatten(-2)`; `gptj_complex` `view_as_complex(x) *`  |
|               | `freqs_cis[pos]`, `view_as_real`; `none`                                                       |
| `halves`      | how halves / pairs (and the `[cos | sin]` table halves) are taken: `chunk`, `split`, `unbind` of |
|               | a `[..., 2, half]` view (GPT-J pairs: `[..., half, 2]`), `slice` (GPT-J: strided)               |
| `rotary`      | `full`, `partial` (rotary dim D/2, the pass-through part concatenated)                          |
| `source`      | `table` (gathered rows of a `[P, R]` `[cos | sin]` table, complex `[P, R/2]` for `gptj_complex`) |
|               | or `computed` in the graph from an `inv_freq` buffer and positions (HF: `emb = cat(f, f)`)      |
| `gather`      | `index` `table[pos]`, `index_select`, `embedding` `F.embedding(pos, table)`                     |
| `table_dtype` | `fp32`, `model` (a real table stored in the model dtype)                                        |
| `storage`     | of the table / `inv_freq`: `buffer`, `parameter` (requires_grad False), `argument` (per call)   |
| `tables`      | `shared` by the layers, `per_layer` (one theta each)                                            |
| `cast_cs`     | `cast` cos/sin to the model dtype before the multiply, or `keep`                                |
| `rope_math`   | `fp32` (`k.float()` before the rotation, cast back after) or `model`                            |
| `write`       | `index` `cache[loc] = k` (one slot negative: counts from the end), `index_copy` (`index_copy_`), |
|               | `index_put` (`index_put_`, a negative slot too), `slice` `cache[start : start + T] = k`,        |
|               | `commit` `cache[loc] = where(keep, k, cache[loc])` of `loc2d [B, W]`, rows `j < lens[b]`        |
| `cache`       | `heads` `[S, heads, D]`, `flat` `[S, heads * D]`, `paged` `[S / 4, 4, heads, D]` written through |
|               | `cache.view(S, heads, D)`, `slot_dim` HF's static `[1, heads, S, D]` (`index` / `index_copy` only: |
|               | `cache[:, :, loc] = k`, `cache.index_copy_(2, loc, k)`), `stacked` the layers' `[S, heads, D]` |
|               | in one `[L, S, heads, D]` buffer for K and one for V, written as `k_cache[i][...] = k`          |
| `order`       | `after` (all layers computed, then written), `interleaved` (each layer written in turn)        |
| `index_dtype` | `int64`, `int32` (positions, slots, lens; `index_copy_` slots stay int64, as it requires)      |

Axes that do not apply to a combination (`halves` without RoPE, `gather` of a computed table, ...) are `NA`.
`forward(ctx, positions, where, rope=None)`: `where` is `cache_loc [T]`, the first slot (int) for `slice`, or
`(loc2d, lens)` for `commit`; `rope` the per-layer tables / `inv_freq` (a tuple) when `storage` is `argument`.

`NEAR_MISSES`: writers one change away from a spec that lowers, whose eager caches are not the op's formula for any
rope style (each an error a matcher by meaning must catch). `near_miss(name)` is its `Spec`; `expected` of it gives
the closest formula (that of the spec without the change).

    python tests/spelling_generator.py 17      # print the spec of seed 17
"""

from __future__ import annotations

import dataclasses
import random
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from custom_ops.linear.multi_linear_kv_write import layer_kv
from dspark_fx.reference_draft import rope_cos_sin_table

NA = "NA"
NORMS = (
    "llama", "sglang", "float_w", "promote_w", "div_sqrt", "sum_div", "gemma", "no_weight", "f_rms_norm", "nn_rmsnorm",
    "none",
)  # fmt: skip
AXES: dict[str, tuple[str, ...]] = {
    "dtype": ("fp32", "bf16"),
    "proj": ("separate", "kv_split", "kv_chunk", "kv_slice", "qkv_split", "qkv_slice", "row_slice"),
    "bias": ("bias", "nobias"),
    "layout": ("thd", "bhtd"),
    "norm": NORMS,
    "rope": ("neox", "rotate_half", "gptj_stack", "gptj_complex", "none"),
    "halves": ("chunk", "split", "unbind", "slice"),
    "rotary": ("full", "partial"),
    "source": ("table", "computed"),
    "gather": ("index", "index_select", "embedding"),
    "table_dtype": ("fp32", "model"),
    "storage": ("buffer", "parameter", "argument"),
    "tables": ("shared", "per_layer"),
    "cast_cs": ("cast", "keep"),
    "rope_math": ("fp32", "model"),
    "write": ("index", "index_copy", "index_put", "slice", "commit"),
    "cache": ("heads", "flat", "paged", "slot_dim", "stacked"),
    "order": ("after", "interleaved"),
    "index_dtype": ("int64", "int32"),
}
NEAR_MISSES = (
    "swap_sin_cos",  # cat(x1 c - x2 s, x2 s + x1 c): sin and cos swapped in the second half
    "sign_flip",  # cat(x1 c - x2 s, x2 c - x1 s)
    "heads_pairs",  # halves by chunk over the heads dim (pairs of head 0 and head 1), full-width duplicated c/s
    "neox_pairs_gptj_out",  # pairs (j, j + half) rotated, put back interleaved (stack/flatten)
    "norm_over_heads",  # the RMSNorm mean over the heads dim instead of head_dim
    "eps_outside",  # x / (sqrt(mean) + eps) with an eps that matters
    "row_offset",  # rotate_half with cos/sin = cat(table[pos] half, table[pos + 1] half)
    "per_layer_width",  # layer 0 rotates D/2, the others all of D (one op rotates its layers alike: two ops)
)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
INDEX_DTYPES = {"int64": torch.int64, "int32": torch.int32}
NUM_SLOTS, MAX_POSITION, NEAR_MISS_EPS = 32, 64, 0.1
PAGE = 4  # slots of a page of a `paged` cache
_ROPE_AXES = ("halves", "rotary", "source", "gather", "table_dtype", "storage", "tables", "cast_cs", "rope_math")


@dataclass(frozen=True)
class Spec:
    seed: int
    layers: int
    hidden: int
    heads: int
    head_dim: int
    eps: tuple[float, ...]
    theta: tuple[float, ...]
    dtype: str
    proj: str
    bias: str
    layout: str
    norm: str
    rope: str
    halves: str
    rotary: str
    source: str
    gather: str
    table_dtype: str
    storage: str
    tables: str
    cast_cs: str
    rope_math: str
    write: str
    cache: str
    order: str
    index_dtype: str
    near_miss: str = "none"

    @property
    def id(self) -> str:
        values = [getattr(self, axis) for axis in AXES]
        head = f"s{self.seed}-L{self.layers}-K{self.hidden}-{self.heads}x{self.head_dim}"
        tail = [] if self.near_miss == "none" else [f"NEAR_MISS_{self.near_miss}"]
        return "-".join([head, *(v for v in values if v != NA), *tail])

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def rot(self) -> int:
        return self.head_dim if self.rotary in ("full", NA) else self.head_dim // 2

    @property
    def kv(self) -> int:
        return self.heads * self.head_dim

    @property
    def q(self) -> int:
        return 2 * self.kv

    @property
    def is_neox(self) -> bool:
        return self.rope in ("neox", "rotate_half")

    @property
    def table_rows(self) -> int:
        return MAX_POSITION + 1 if self.near_miss == "row_offset" else MAX_POSITION


def generate(seed: int) -> Spec:
    """One combination of the axes' values, drawn from `seed` (uniformly per axis; inapplicable axes `NA`)."""
    rng = random.Random(seed)
    draw = {axis: rng.choice(values) for axis, values in AXES.items()}
    layers = rng.choice((2, 3))
    if draw["rope"] == "none":
        draw.update(dict.fromkeys(_ROPE_AXES, NA))
    if draw["rope"] == "gptj_complex":
        draw.update(halves=NA, table_dtype=NA, cast_cs=NA, rope_math=NA)
    if draw["source"] == "computed":
        draw.update(gather=NA, table_dtype=NA)
    if draw["cache"] == "slot_dim" and draw["write"] not in ("index", "index_copy"):
        draw["write"] = rng.choice(("index", "index_copy"))
    theta = (1e4,) * layers if draw["tables"] != "per_layer" else tuple(10.0 ** (4 + i) for i in range(layers))
    return Spec(
        seed=seed,
        layers=layers,
        hidden=rng.choice((32, 48, 64)),
        heads=rng.choice((1, 2, 3)),
        head_dim=rng.choice((8, 16)),
        eps=tuple(rng.choice((1e-6, 1e-5)) for _ in range(layers)),
        theta=theta,
        **draw,
    )


_NEAR_MISS_BASE = Spec(
    seed=0, layers=2, hidden=32, heads=2, head_dim=16, eps=(1e-6, 1e-6), theta=(1e4, 1e4), dtype="fp32",
    proj="separate", bias="nobias", layout="thd", norm="llama", rope="neox", halves="chunk", rotary="full",
    source="table", gather="index", table_dtype="fp32", storage="buffer", tables="shared", cast_cs="keep",
    rope_math="fp32", write="index", cache="heads", order="after", index_dtype="int64",
)  # fmt: skip


def near_miss(name: str) -> Spec:
    """The near miss `name` of `NEAR_MISSES` on a base that lowers (`near_miss="none"` of it is a positive)."""
    if name not in NEAR_MISSES:
        raise ValueError(f"near_miss: name must be one of {NEAR_MISSES}, got {name!r}")
    base = _NEAR_MISS_BASE
    if name in ("heads_pairs", "row_offset"):
        base = dataclasses.replace(base, rope="rotate_half")
    if name == "eps_outside":
        base = dataclasses.replace(base, eps=(NEAR_MISS_EPS,) * base.layers)
    if name == "per_layer_width":
        base = dataclasses.replace(base, tables="per_layer")
    return dataclasses.replace(base, near_miss=name)


# ---- spelled pieces ---------------------------------------------------------------------------------------------


def _halves(x: torch.Tensor, how: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The two halves `(x[..., :h], x[..., h:])` of the last dim."""
    half = x.shape[-1] // 2
    if how == "chunk":
        return x.chunk(2, -1)
    if how == "split":
        return x.split(half, -1)
    if how == "unbind":
        return x.unflatten(-1, (2, half)).unbind(-2)
    return x[..., :half], x[..., half:]


def _pairs(x: torch.Tensor, how: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The GPT-J pairs `(x[..., 0::2], x[..., 1::2])`."""
    if how == "slice":
        return x[..., 0::2], x[..., 1::2]
    pairs = x.unflatten(-1, (-1, 2))
    if how == "unbind":
        return pairs.unbind(-1)
    a, b = pairs.chunk(2, -1) if how == "chunk" else pairs.split(1, -1)
    return a.squeeze(-1), b.squeeze(-1)


def _rotate_half(x: torch.Tensor, how: str) -> torch.Tensor:
    x1, x2 = _halves(x, how)
    return torch.cat((-x2, x1), dim=-1)


def _gather(table: torch.Tensor, positions: torch.Tensor, how: str) -> torch.Tensor:
    if how == "index":
        return table[positions]
    if how == "index_select":
        return table.index_select(0, positions)
    return F.embedding(positions, table)


def _inv_freq(rot: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.int64).float() / rot))


def rope_constants(spec: Spec) -> list[torch.Tensor]:
    """One per table (`shared`: one; `per_layer`: one per layer): the `[P, R]` `[cos | sin]` table, the complex
    `[P, R/2]` `freqs_cis`, or the `[R/2]` `inv_freq` (`source="computed"`)."""
    if spec.rope == "none":
        return []
    thetas = spec.theta[:1] if spec.tables == "shared" else spec.theta
    out = []
    for j, theta in enumerate(thetas):
        rot = spec.head_dim // 2 if spec.near_miss == "per_layer_width" and j == 0 else spec.rot
        if spec.source == "computed":
            out.append(_inv_freq(rot, theta))
        elif spec.rope == "gptj_complex":
            angles = torch.outer(torch.arange(spec.table_rows, dtype=torch.float32), _inv_freq(rot, theta))
            out.append(torch.polar(torch.ones_like(angles), angles))
        else:
            table = rope_cos_sin_table(spec.table_rows, rot, theta)
            out.append(table if spec.table_dtype == "fp32" else table.to(spec.torch_dtype))
    return out


def _norm_weight_init(spec: Spec, gen: torch.Generator) -> torch.Tensor:
    w = 0.5 * torch.randn(spec.head_dim, generator=gen)
    return (w if spec.norm == "gemma" else 1.0 + w).to(spec.torch_dtype)


class _Layer(nn.Module):
    """One layer's projection weights and k_norm weight."""

    def __init__(self, spec: Spec, eps: float, gen: torch.Generator) -> None:
        super().__init__()
        self.spec, self.eps = spec, eps
        dtype, bias, kv = spec.torch_dtype, spec.bias == "bias", spec.kv
        if spec.proj == "separate":
            self.k_proj = nn.Linear(spec.hidden, kv, bias=bias, dtype=dtype)
            self.v_proj = nn.Linear(spec.hidden, kv, bias=bias, dtype=dtype)
        elif spec.proj.startswith("kv_"):
            self.kv_proj = nn.Linear(spec.hidden, 2 * kv, bias=bias, dtype=dtype)
        else:
            self.qkv_proj = nn.Linear(spec.hidden, spec.q + 2 * kv, bias=bias, dtype=dtype)
        with torch.no_grad():
            for p in self.parameters():
                scale = spec.hidden**-0.5 if p.dim() == 2 else 0.5
                p.copy_(scale * torch.randn(p.shape, generator=gen))
        if spec.norm == "nn_rmsnorm":
            self.k_norm = nn.RMSNorm(spec.head_dim, eps=eps, dtype=dtype)
            with torch.no_grad():
                self.k_norm.weight.copy_(_norm_weight_init(spec, gen))
        elif spec.norm not in ("none", "no_weight"):
            self.k_norm_weight = nn.Parameter(_norm_weight_init(spec, gen))

    def project(self, ctx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        spec, kv, q = self.spec, self.spec.kv, self.spec.q
        if spec.proj == "separate":
            return self.k_proj(ctx), self.v_proj(ctx)
        if spec.proj == "row_slice":
            w, b = self.qkv_proj.weight, self.qkv_proj.bias
            kb, vb = (None, None) if b is None else (b[q : q + kv], b[q + kv :])
            return F.linear(ctx, w[q : q + kv], kb), F.linear(ctx, w[q + kv :], vb)
        if spec.proj == "kv_split":
            k, v = self.kv_proj(ctx).split([kv, kv], dim=-1)
            return k, v
        if spec.proj == "kv_chunk":
            k, v = self.kv_proj(ctx).chunk(2, dim=-1)
            return k, v
        if spec.proj == "kv_slice":
            kv_out = self.kv_proj(ctx)
            return kv_out[:, :kv], kv_out[:, kv:]
        qkv = self.qkv_proj(ctx)
        if spec.proj == "qkv_split":
            _, k, v = qkv.split([q, kv, kv], dim=-1)
            return k, v
        return qkv[..., q : q + kv], qkv[..., q + kv :]

    def kv_rows(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """`(weight, first row, bias)` of K and of V, as `layer_kv` takes them."""
        spec, kv, q = self.spec, self.spec.kv, self.spec.q
        if spec.proj == "separate":
            return (self.k_proj.weight, 0, self.k_proj.bias), (self.v_proj.weight, 0, self.v_proj.bias)
        lin = self.kv_proj if spec.proj.startswith("kv_") else self.qkv_proj
        start = 0 if spec.proj.startswith("kv_") else q
        return (lin.weight, start, lin.bias), (lin.weight, start + kv, lin.bias)

    def k_weight(self) -> tuple[torch.Tensor, slice]:
        """The parameter holding this layer's K rows, and those rows."""
        (w, start, _), _ = self.kv_rows()
        return w, slice(start, start + self.spec.kv)

    def norm_params(self) -> tuple[torch.Tensor | None, float] | None:
        """`(weight, eps)` of the op's formula (Gemma: `1 + w`), None without a norm."""
        norm = self.spec.norm
        if norm == "none":
            return None
        if norm == "no_weight":
            return None, self.eps
        if norm == "nn_rmsnorm":
            return self.k_norm.weight, self.k_norm.eps
        w = self.k_norm_weight
        return (1.0 + w.double() if norm == "gemma" else w), self.eps

    def k_norm_fn(self, k: torch.Tensor) -> torch.Tensor:
        """RMSNorm of `k [..., D]` (model dtype) over its last dim, spelled as `spec.norm` says."""
        norm, dtype, eps = self.spec.norm, k.dtype, self.eps
        if norm == "none":
            return k
        if norm == "f_rms_norm":
            return F.rms_norm(k, (k.shape[-1],), self.k_norm_weight, eps)
        if norm == "nn_rmsnorm":
            return self.k_norm(k)
        x = k.float()
        if norm == "div_sqrt":
            return (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * self.k_norm_weight.float()).to(dtype)
        if norm == "sum_div":
            x = x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) / x.shape[-1] + eps)
            return (x * self.k_norm_weight.float()).to(dtype)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        if norm == "llama":
            return self.k_norm_weight * x.to(dtype)
        if norm == "sglang":
            return x.to(dtype) * self.k_norm_weight
        if norm == "float_w":
            return (x * self.k_norm_weight.float()).to(dtype)
        if norm == "promote_w":
            return (x * self.k_norm_weight).to(dtype)
        if norm == "gemma":
            return (x * (1.0 + self.k_norm_weight.float())).to(dtype)
        return x.to(dtype)  # no_weight


class GeneratedWriter(nn.Module):
    """The writer of a `Spec` (see the module docstring)."""

    def __init__(self, spec: Spec) -> None:
        super().__init__()
        self.spec = spec
        gen = torch.Generator().manual_seed(1000 + spec.seed)
        self.layers = nn.ModuleList(_Layer(spec, spec.eps[i], gen) for i in range(spec.layers))
        self.rotary_dims = [spec.rot] * spec.layers
        if spec.near_miss == "per_layer_width":
            self.rotary_dims[0] = spec.head_dim // 2
        for j, const in enumerate(rope_constants(spec)):
            if spec.storage == "buffer":
                self.register_buffer(f"rope_{j}", const, persistent=False)
            elif spec.storage == "parameter":
                self.register_parameter(f"rope_{j}", nn.Parameter(const, requires_grad=False))
        shape = {
            "heads": (NUM_SLOTS, spec.heads, spec.head_dim),
            "stacked": (NUM_SLOTS, spec.heads, spec.head_dim),
            "flat": (NUM_SLOTS, spec.kv),
            "paged": (NUM_SLOTS // PAGE, PAGE, spec.heads, spec.head_dim),
            "slot_dim": (1, spec.heads, NUM_SLOTS, spec.head_dim),
        }[spec.cache]
        caches = {
            (i, kind): torch.randn(shape, generator=gen).to(spec.torch_dtype)
            for i in range(spec.layers)
            for kind in "kv"
        }
        if spec.cache == "stacked":
            for kind in "kv":
                stacked = torch.stack([caches[i, kind] for i in range(spec.layers)])
                self.register_buffer(f"{kind}_cache", stacked, persistent=False)
        else:
            for (i, kind), cache in caches.items():
                self.register_buffer(f"{kind}_cache_{i}", cache, persistent=False)

    def caches(self) -> list[torch.Tensor]:
        """`[k_cache_0, v_cache_0, k_cache_1, ...]` (`stacked`: the layers' views of the two buffers)."""
        if self.spec.cache == "stacked":
            return [getattr(self, f"{kind}_cache")[i] for i in range(self.spec.layers) for kind in "kv"]
        return [getattr(self, f"{kind}_cache_{i}") for i in range(self.spec.layers) for kind in "kv"]

    def table_of_layer(self, i: int) -> int:
        return 0 if self.spec.tables == "shared" else i

    def rope_consts(self, rope: tuple[torch.Tensor, ...] | None) -> list[torch.Tensor]:
        """The tables / `inv_freq` this call uses: the model's, or the per-call ones."""
        if self.spec.rope == "none":
            return []
        if self.spec.storage == "argument":
            if rope is None:
                raise ValueError(f"GeneratedWriter({self.spec.id}): forward needs the per-call rope tensors")
            return list(rope)
        return [getattr(self, f"rope_{j}") for j in range(len(self.spec.theta) if self.spec.tables != "shared" else 1)]

    # -- RoPE --

    def _cos_sin(self, const: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """What the rotation reads per token: `(cos, sin)` `[T, R/2]` (`[T, R]` duplicated for `rotate_half`), or the
        complex `[T, R/2]` `freqs_cis` rows."""
        spec = self.spec
        if spec.source == "computed":
            freqs = positions[:, None].float() * const[None, :]
            if spec.rope == "gptj_complex":
                return (torch.polar(torch.ones_like(freqs), freqs),)
            if spec.rope == "rotate_half":
                freqs = torch.cat((freqs, freqs), dim=-1)
            cos, sin = freqs.cos(), freqs.sin()
        else:
            rows = _gather(const, positions, spec.gather)
            if spec.rope == "gptj_complex":
                return (rows,)
            cos, sin = _halves(rows, spec.halves)
            if spec.near_miss == "row_offset":
                _, next_sin = _halves(_gather(const, positions + 1, spec.gather), spec.halves)
                cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, next_sin), dim=-1)
            elif spec.rope == "rotate_half" or spec.near_miss == "heads_pairs":
                cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        if spec.cast_cs == "cast":
            cos, sin = cos.to(dtype), sin.to(dtype)
        return cos, sin

    def _rotate(self, x: torch.Tensor, cs: tuple[torch.Tensor, ...], rot: int) -> torch.Tensor:
        """`x [..., D]` rotated on its first `rot` dims; `cs` broadcast against `x[..., :rot]` (or its halves)."""
        spec, dtype = self.spec, x.dtype
        if spec.rope_math == "fp32":
            x = x.float()
        full = rot == x.shape[-1]
        x_rot, x_pass = (x, None) if full else (x[..., :rot], x[..., rot:])
        if spec.rope == "gptj_complex":
            xc = torch.view_as_complex(x_rot.float().reshape(*x_rot.shape[:-1], -1, 2))
            out = torch.view_as_real(xc * cs[0]).flatten(-2).type_as(x)
        else:
            out = self._rotate_real(x_rot, *cs)
        if x_pass is not None:
            out = torch.cat((out, x_pass), dim=-1)
        return out.to(dtype)

    def _rotate_real(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        spec, miss = self.spec, self.spec.near_miss
        if spec.rope == "rotate_half" and miss != "heads_pairs":
            return x * cos + _rotate_half(x, spec.halves) * sin
        if spec.rope == "gptj_stack":
            x1, x2 = _pairs(x, spec.halves)
            return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).flatten(-2)
        dim = -2 if miss == "heads_pairs" else -1  # heads_pairs: [T, heads, D] halves over the heads dim
        x1, x2 = x.chunk(2, dim=dim) if miss == "heads_pairs" else _halves(x, spec.halves)
        if miss == "swap_sin_cos":
            return torch.cat((x1 * cos - x2 * sin, x2 * sin + x1 * cos), dim=-1)
        if miss == "sign_flip":
            return torch.cat((x1 * cos - x2 * sin, x2 * cos - x1 * sin), dim=-1)
        if miss == "neox_pairs_gptj_out":
            return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).flatten(-2)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=dim)

    # -- K and V of a layer --

    def _k_norm(self, layer: _Layer, k: torch.Tensor) -> torch.Tensor:
        miss = self.spec.near_miss
        if miss == "norm_over_heads":
            x = k.float()
            x = x * torch.rsqrt(x.pow(2).mean(-2, keepdim=True) + layer.eps)
            return layer.k_norm_weight * x.to(k.dtype)
        if miss == "eps_outside":
            x = k.float()
            x = x / (torch.sqrt(x.pow(2).mean(-1, keepdim=True)) + layer.eps)
            return layer.k_norm_weight * x.to(k.dtype)
        return layer.k_norm_fn(k)

    def _layer_kv(
        self, i: int, ctx: torch.Tensor, cs: list[tuple[torch.Tensor, ...]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `i`'s `[T, heads, D]` K (normed, rotated) and V."""
        spec, layer, tokens = self.spec, self.layers[i], ctx.shape[0]
        k, v = layer.project(ctx)
        if spec.layout == "thd":
            k = self._k_norm(layer, k.view(tokens, spec.heads, spec.head_dim))
            if cs:
                k = self._rotate(k, tuple(t[:, None] for t in cs[self.table_of_layer(i)]), self.rotary_dims[i])
            return k, v.view(tokens, spec.heads, spec.head_dim)
        hidden_shape = (1, tokens, -1, spec.head_dim)
        k = self._k_norm(layer, k.view(hidden_shape)).transpose(1, 2)
        if cs:
            k = self._rotate(k, tuple(t[None, None] for t in cs[self.table_of_layer(i)]), self.rotary_dims[i])
        v = v.view(hidden_shape).transpose(1, 2)
        shape = (tokens, spec.heads, spec.head_dim)
        return k.transpose(1, 2).reshape(shape), v.transpose(1, 2).reshape(shape)

    # -- writes --

    def _write(self, cache: torch.Tensor, value: torch.Tensor, where: Any, keep: torch.Tensor | None) -> None:
        write = self.spec.write
        if self.spec.cache == "slot_dim":
            if write == "index":
                cache[:, :, where] = value.transpose(0, 1)
            else:
                cache.index_copy_(2, where, value.transpose(0, 1)[None])
            return
        if self.spec.cache == "flat":
            value = value.flatten(-2)
        elif self.spec.cache == "paged":
            cache = cache.view(NUM_SLOTS, self.spec.heads, self.spec.head_dim)
        if write == "index":
            cache[where] = value
        elif write == "index_copy":
            cache.index_copy_(0, where, value)
        elif write == "index_put":
            cache.index_put_((where,), value)
        elif write == "slice":
            cache[where : where + value.shape[0]] = value
        else:
            loc = where[0].reshape(-1)
            keep = keep if self.spec.cache != "flat" else keep.view(-1, 1)
            cache[loc] = torch.where(keep, value, cache[loc])

    def forward(
        self, ctx: torch.Tensor, positions: torch.Tensor, where: Any, rope: tuple[torch.Tensor, ...] | None = None
    ) -> None:
        cs = [self._cos_sin(c, positions, ctx.dtype) for c in self.rope_consts(rope)]
        keep = None
        if self.spec.write == "commit":
            loc2d, lens = where
            keep = (torch.arange(loc2d.shape[1], device=ctx.device)[None, :] < lens[:, None]).reshape(-1, 1, 1)
        caches = self.caches()
        if self.spec.order == "interleaved":
            for i in range(self.spec.layers):
                k, v = self._layer_kv(i, ctx, cs)
                self._write(caches[2 * i], k, where, keep)
                self._write(caches[2 * i + 1], v, where, keep)
            return
        kvs = [self._layer_kv(i, ctx, cs) for i in range(self.spec.layers)]
        for i, (k, v) in enumerate(kvs):
            self._write(caches[2 * i], k, where, keep)
            self._write(caches[2 * i + 1], v, where, keep)


def build(spec: Spec) -> GeneratedWriter:
    """The writer of `spec` (CPU, random weights and caches from the seed)."""
    return GeneratedWriter(spec)


# ---- inputs and the expected caches -------------------------------------------------------------------------------


def make_inputs(spec: Spec, tokens: int, seed: int) -> tuple[Any, ...]:
    """`(ctx, positions, where, rope)`: random ctx, positions over the whole table (the last row first), distinct
    slots (`index` / `index_put`: the last one negative, counting from the end), a start >= 2 for `slice` (0 and 1
    would specialize under `dynamic=True`), `[B, W]` slots with lens from 0 to W for `commit` (B = 2 for even T)."""
    gen = torch.Generator().manual_seed(seed)
    index = INDEX_DTYPES[spec.index_dtype]
    ctx = torch.randn(tokens, spec.hidden, generator=gen).to(spec.torch_dtype)
    positions = torch.randint(0, MAX_POSITION, (tokens,), generator=gen)
    positions[0] = MAX_POSITION - 1
    slots = torch.randperm(NUM_SLOTS, generator=gen)[:tokens]
    if spec.write == "slice":
        where: Any = int(torch.randint(2, NUM_SLOTS - tokens + 1, (), generator=gen))
    elif spec.write == "commit":
        rows = 2 if tokens % 2 == 0 else 1
        width = tokens // rows
        lens = torch.randint(0, width + 1, (rows,), generator=gen)
        lens[0] = max(width - 1, 1)
        where = (slots.view(rows, width).to(index), lens.to(index))
    elif spec.write == "index_copy":
        where = slots
    else:
        slots[-1] -= NUM_SLOTS
        where = slots.to(index)
    rope = tuple(rope_constants(spec)) if spec.storage == "argument" else None
    return ctx, positions.to(index), where, rope


def op_tables(model: GeneratedWriter, rope: tuple[torch.Tensor, ...] | None) -> list[torch.Tensor]:
    """Per layer, the `[P, R]` `[cos | sin]` fp32 table of the op's layout that this call's rotation reads."""
    spec = model.spec
    consts = model.rope_consts(rope)
    if spec.near_miss == "per_layer_width":  # the closest formula: every layer rotated over the spec's width
        consts = rope_constants(dataclasses.replace(spec, near_miss="none"))
    tables = []
    for const in consts:
        if spec.source == "computed":
            angles = torch.arange(spec.table_rows, dtype=torch.float32)[:, None] * const[None, :].float()
            tables.append(torch.cat((angles.cos(), angles.sin()), dim=-1))
        elif spec.rope == "gptj_complex":
            tables.append(torch.cat((const.real, const.imag), dim=-1).float())
        else:
            tables.append(const.float())
    return [tables[model.table_of_layer(i)] for i in range(spec.layers)] if tables else []


@torch.no_grad()
def expected(model: GeneratedWriter, inputs: tuple[Any, ...], is_neox: bool | None = None) -> list[torch.Tensor]:
    """The fp64 caches (`[k_cache_0, v_cache_0, ...]`) `model(*inputs)` must leave, from its current caches and
    weights: `layer_kv` with the spec's rope style (or `is_neox`), written as the spec writes. For a near miss:
    the closest formula (the spec without its change)."""
    spec = model.spec
    ctx, positions, where, rope = inputs
    tables = op_tables(model, rope)
    caches = [c.double().clone() for c in model.caches()]
    neox = spec.is_neox if is_neox is None else is_neox
    for i, layer in enumerate(model.layers):
        k_rows, v_rows = layer.kv_rows()
        cos_sin = tables[i].double()[positions.long()] if tables else None
        kv = layer_kv(ctx.double(), k_rows, v_rows, layer.norm_params(), cos_sin, neox, spec.heads, spec.head_dim)
        for cache, value in zip(caches[2 * i : 2 * i + 2], kv, strict=True):
            rows = _slot_rows(spec, cache)
            _apply_write(spec, rows, value.reshape(value.shape[0], *rows.shape[1:]), where)
    return caches


def _slot_rows(spec: Spec, cache: torch.Tensor) -> torch.Tensor:
    """`cache` as `[S, heads, D]` (`[S, heads * D]` for `flat`) rows: a view, so writes to it write the cache."""
    if spec.cache == "paged":
        return cache.view(NUM_SLOTS, spec.heads, spec.head_dim)
    if spec.cache == "slot_dim":
        return cache[0].transpose(0, 1)
    return cache


def _apply_write(spec: Spec, cache: torch.Tensor, value: torch.Tensor, where: Any) -> None:
    if spec.write == "slice":
        cache[where : where + value.shape[0]] = value
    elif spec.write == "commit":
        loc2d, lens = where
        keep = (torch.arange(loc2d.shape[1])[None, :] < lens[:, None]).reshape(-1)
        cache[loc2d.reshape(-1)[keep].long()] = value[keep]
    else:
        cache[where.long()] = value


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(generate(int(arg)))
