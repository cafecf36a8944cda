"""`dspark::multi_linear_kv_write` — N layers' context K/V from one activation, normed, rotated and written to caches.

What a DSpark/DFlash draft does for every layer from the same `ctx` hidden states, as one op:

    k_i = x @ Wk_i[k_row_starts[i] : +kv]ᵀ (+ bk_i)      [T, kv_heads, head_dim]   (kv = kv_heads * head_dim)
    v_i = x @ Wv_i[v_row_starts[i] : +kv]ᵀ (+ bv_i)
    k_i = RMSNorm(k_i per head, k_norm_weights[i], k_norm_eps[i])          if k_norm_eps is not empty
    k_i = RoPE(k_i, cos_sin_caches[i][positions], is_neox)                 if cos_sin_caches is not empty
    k_caches[i][loc[t]] = k_i[t];  v_caches[i][loc[t]] = v_i[t]             for every written token t

All math is fp32 from the inputs (GEMM accumulation, norm, rotation); V is rounded once, when stored, and K once on
CPU and on CUDA's fused path (T <= 16), twice on CUDA's GEMM path (docs/ops.md, "Numerics").

| arg              | shape / type               | dtype          | mut | meaning                                       |
|------------------|----------------------------|----------------|-----|-----------------------------------------------|
| `x`              | `[T, K]`                   | bf16/fp16/f32  |     | shared activation (any strides)               |
| `k_weights`      | N x `[R_i, K]`             | as `x`         |     | full weights, `[out, in]` layout              |
| `k_row_starts`   | N x `int`                  |                |     | first K row of layer i (`kv` rows used)       |
| `k_biases`       | N x `[R_i]` or None        | as `x`         |     | bias of `k_weights[i]` (same rows)            |
| `v_weights`      | N x `[R_i, K]`             | as `x`         |     | as `k_weights`, for V (may be the same)       |
| `v_row_starts`   | N x `int`                  |                |     | first V row of layer i                        |
| `v_biases`       | N x `[R_i]` or None        | as `x`         |     | bias of `v_weights[i]`                        |
| `k_norm_weights` | N x `[head_dim]` or None   | as `x` or fp32 |     | RMSNorm weight of layer i (None: no weight)   |
| `k_norm_eps`     | N x `float`, or empty      |                |     | RMSNorm eps of layer i; empty: no norm        |
| `cos_sin_caches` | N tables (below), or empty | fp32           |     | cos/sin per position; empty: no RoPE          |
| `positions`      | `[T]`                      | int32/int64    |     | position of token t                           |
| `is_neox`        | `bool`                     |                |     | pairs `(d, d + R/2)` (True) or `(2d, 2d + 1)` |
| `k_caches`       | N x `[S, heads, head_dim]` | as `x`         | yes | K cache of layer i (any strides)              |
| `v_caches`       | N x `[S, heads, head_dim]` | as `x`         | yes | V cache of layer i (any strides)              |
| `cache_loc`      | `[T]`, or `[B, W]` (B*W=T) | int32/int64    |     | slot of token t (`[B, W]`: row-major)         |
| `commit_lens`    | `[B]` or None              | int32/int64    |     | `[B, W]` slots: write `j < commit_lens[b]`    |
| `num_kv_heads`   | `int`                      |                |     | heads per layer                               |
| `head_dim`       | `int`                      |                |     | elements per head                             |
| `wrap_negative`  | `bool` (default False)     |                |     | negative index values count from the end      |
| returns          | nothing                    |                |     |                                               |

RoPE rotates the first `R` elements of each head (`R` even, `0 < R <= head_dim`, the same for every layer; the rest
pass through): with the factors `(c_j, s_j)` of token t's position `p`, pair j becomes `(a c_j - b s_j, b c_j + a s_j)`,
pair j being elements `(j, j + R/2)` (neox) or `(2j, 2j + 1)` (GPT-J), `j < R/2`. The tables give the factors, in
one of three forms (every layer's table the same form, `rope_rows` turns any of them into `[cos | sin]` rows):

| form        | table              | `(c_j, s_j)` at position `p`                   | what a model holds             |
|-------------|--------------------|------------------------------------------------|--------------------------------|
| halves      | `[P, R]` fp32      | `(t[p, j], t[p, R/2 + j])`                     | a cos/sin-halves cache         |
| pairs       | `[P, R/2, 2]` fp32 | `(t[p, j, 0], t[p, j, 1])`                     | `view_as_real` of `freqs_cis`  |
| frequencies | `[R/2]` fp32       | `(cos(float(p) * t[j]), sin(float(p) * t[j]))` | `inv_freq` (cos/sin per call)  |

The frequencies form computes the angle as an fp32 product (what `positions.float() * inv_freq` computes) and its
cos/sin in fp32; a model that casts cos/sin to its dtype before the multiply rounds them there, the op does not (a
difference within the dtype's rounding of the result). Its positions are angles, not rows: any value is valid and
none is wrapped or range-checked. RMSNorm is `k * rsqrt(mean(k²) + eps) (* weight)` over
the `head_dim` elements of a head.

Structural rules (`_check_args`: the CPU impl and the fake run it, the CUDA binding mirrors it), all raised before
anything is written, `TypeError` for a wrong dtype and `ValueError` for anything else, each message starting with
`multi_linear_kv_write: ` and naming the argument: the list lengths (one entry per layer; `k_norm_eps` and
`cos_sin_caches` may be empty), shapes, dtypes and devices of the table (one RoPE table form for all layers);
`k_row_starts[i]` / `v_row_starts[i]` select `kv` rows inside the weight; `k_norm_eps` finite and `>= 0`;
`k_norm_weights` all None when `k_norm_eps` is empty; every cache the same `[S, num_kv_heads, head_dim]`; no cache
overlaps itself (e.g. a broadcast view), another cache or any input (views of one buffer are fine when their bytes are
disjoint, whatever their dtypes: the layers of a stacked `[N, S, heads, head_dim]` buffer, the K and V halves of an
interleaved `[S, 2, heads, head_dim]` one); `cache_loc` 1-D without `commit_lens` or 2-D with it. Checked on storages,
offsets and strides, never data pointers, so the fake impl raises the same errors under `torch.compile`. The CUDA
binding adds what its kernel needs: bf16/fp16 `x`, `K % 8 == 0`, `head_dim % 8 == 0` and `<= 256`, caches with unit
inner stride and 16-byte aligned `head_dim` rows (address and slot / head strides multiples of 16 bytes), contiguous
`k_norm_weights`, `cos_sin_caches` whose per-position factors are contiguous (unit inner stride; pairs: `[R/2, 2]` rows
laid out as `R` consecutive floats), fewer than 2^31 (token, layer, K or V, head) units per launch; anything else raises
`TypeError` (dtype) or `ValueError` there, naming the argument. `_check_cuda_layout` states these rules in Python and
the fake impl runs it on CUDA tensors, so a compiled graph that would raise in the binding raises at compile time
instead (the address is judged from the storage offset, `custom_ops.checks.is_aligned`).

Index values (the contract of every dspark op, docs/contract.md): a negative `cache_loc` entry skips the token (its
K and V are not written); an entry `>= S`, or a position outside `[0, min_i P_i)` (a row of every halves or pairs
table), raises
`ValueError` on CPU (and on CUDA with `custom_ops.set_checks(True)`) before any cache is modified; on CUDA without
checks such a token is skipped. With `wrap_negative=True` the values index as in Python (what eager `cache[loc] = k`
and `table[positions]` do, so a compiled graph needs no extra kernel to wrap them): an entry `l` in `[-S, 0)`
addresses slot `S + l` and a position `p` in `[-P, 0)` row `P + p` (`P = min_i P_i`); entries below `-S` / `-P` are
out of range like those `>= S` / `>= P`. Every entry is checked, those of skipped tokens too (a masked `[B, W]`
entry, a token with a negative slot): slots first, then positions (when `cos_sin_caches` is not empty).
`commit_lens` values are not index values: `<= 0` writes none of the row's tokens, `>= W` all of them. Two written
tokens addressing one slot leave either token's row (unspecified which).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from custom_ops._library import register_op
from custom_ops.checks import check_index_range, is_aligned, must_check_values, overlaps_itself, share_memory
from custom_ops.linear.multi_linear import FLOAT_DTYPES

__all__ = ["layer_kv", "multi_linear_kv_write_reference", "rope_rows", "rotary_dim", "table_form"]

_OP = "multi_linear_kv_write"
_INDEX = (torch.int32, torch.int64)
_MAX_LAYERS_PER_LAUNCH = 32  # kMaxLayers of the CUDA kernels: layers per launch


def _fail(message: str) -> ValueError:
    return ValueError(f"{_OP}: {message}")


def _wrong_type(message: str) -> TypeError:
    return TypeError(f"{_OP}: {message}")


def _check_list_lengths(n: int, **lists: Sequence[object]) -> None:
    for name, values in lists.items():
        if len(values) != n:
            raise _fail(f"{name} must hold one entry per layer ({n}, the length of k_weights), got {len(values)}")


def _check_device(name: str, t: torch.Tensor, x: torch.Tensor) -> None:
    if t.device != x.device:
        raise _fail(f"{name} is on {t.device}, x is on {x.device}")


def _check_projection(x: torch.Tensor, kind: str, weights, starts, biases, kv: int) -> None:
    for i, (w, start, b) in enumerate(zip(weights, starts, biases, strict=True)):
        name = f"{kind}_weights[{i}]"
        if w.dim() != 2 or w.shape[1] != x.shape[1]:
            raise _fail(f"{name} must be [R, {x.shape[1]}] (x is {tuple(x.shape)}), got {tuple(w.shape)}")
        if w.dtype != x.dtype:
            raise _wrong_type(f"{name} dtype {w.dtype} differs from x dtype {x.dtype}")
        _check_device(name, w, x)
        if start < 0 or start + kv > w.shape[0]:
            raise _fail(
                f"{kind}_row_starts[{i}] = {start}: rows [{start}, {start + kv}) of {name} are out of range "
                f"(it has {w.shape[0]} rows, a layer uses num_kv_heads * head_dim = {kv})"
            )
        if b is None:
            continue
        bias = f"{kind}_biases[{i}]"
        if b.shape != (w.shape[0],):
            raise _fail(f"{bias} must be [{w.shape[0]}] (one entry per row of {name}), got {tuple(b.shape)}")
        if b.dtype != x.dtype:
            raise _wrong_type(f"{bias} dtype {b.dtype} differs from x dtype {x.dtype}")
        _check_device(bias, b, x)


def _check_norm(x: torch.Tensor, weights, eps: Sequence[float], head_dim: int) -> None:
    for i, e in enumerate(eps):
        if not (math.isfinite(e) and e >= 0.0):
            raise _fail(f"k_norm_eps[{i}] must be finite and >= 0, got {e}")
    for i, w in enumerate(weights):
        if w is None:
            continue
        name = f"k_norm_weights[{i}]"
        if not eps:
            raise _fail(f"{name} is given but k_norm_eps is empty (no norm): pass None, or one eps per layer")
        if w.shape != (head_dim,):
            raise _fail(f"{name} must be [{head_dim}] (head_dim), got {tuple(w.shape)}")
        if w.dtype not in (x.dtype, torch.float32):
            raise _wrong_type(f"{name} dtype {w.dtype} must be x's ({x.dtype}) or torch.float32")
        _check_device(name, w, x)


TABLE_FORMS = {2: "halves", 3: "pairs", 1: "frequencies"}  # a table's dim -> its RoPE form
_TABLE_SHAPES = {"halves": "[P, R]", "pairs": "[P, R/2, 2]", "frequencies": "[R/2]"}


def table_form(table: torch.Tensor) -> str | None:
    """The RoPE form of one `cos_sin_caches` entry ("halves", "pairs", "frequencies"), None if it has none."""
    form = TABLE_FORMS.get(table.dim())
    return None if form == "pairs" and table.shape[2] != 2 else form


def rotary_dim(table: torch.Tensor) -> int:
    """`R`, the rotated elements of a head, of a table of any form."""
    return table.shape[1] if table.dim() == 2 else 2 * table.shape[-2 if table.dim() == 3 else 0]


def rope_rows(table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The `[t, R]` `[cos | sin]` rows of `positions [t]` (already wrapped) in `table`'s dtype, whatever its form."""
    form = table_form(table)
    if form == "halves":
        return table[positions.long()]
    if form == "pairs":
        pairs = table[positions.long()]
        return torch.cat([pairs[..., 0], pairs[..., 1]], dim=-1)
    angles = positions.to(torch.float32)[:, None].to(table.dtype) * table[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def _check_rope(x: torch.Tensor, caches: Sequence[torch.Tensor], positions: torch.Tensor, head_dim: int) -> None:
    tokens = x.shape[0]
    if positions.dim() != 1 or positions.shape[0] != tokens:
        raise _fail(f"positions must be [{tokens}] (one per token of x), got {tuple(positions.shape)}")
    if positions.dtype not in _INDEX:
        raise _wrong_type(f"positions must be int32 or int64, got {positions.dtype}")
    _check_device("positions", positions, x)
    for i, c in enumerate(caches):
        name = f"cos_sin_caches[{i}]"
        form = table_form(c)
        if form is None:
            raise _fail(
                f"{name} must be [P, R] (cos | sin halves), [P, R/2, 2] (cos, sin pairs) or [R/2] (inverse "
                f"frequencies), got {tuple(c.shape)}"
            )
        first = table_form(caches[0])
        if form != first:
            raise _fail(
                f"{name} is a {_TABLE_SHAPES[form]} table ({form}), layer 0's a {_TABLE_SHAPES[first]} table "
                f"({first}): every layer's table must have the same form"
            )
        if c.dtype != torch.float32:
            raise _wrong_type(f"{name} must be torch.float32, got {c.dtype}")
        _check_device(name, c, x)
        rot = rotary_dim(c)
        if rot % 2 or not 0 < rot <= head_dim or rot != rotary_dim(caches[0]):
            raise _fail(
                f"{name} {tuple(c.shape)} rotates {rot} elements: the rotary dim must be even, in (0, head_dim = "
                f"{head_dim}] and the same for every layer ({rotary_dim(caches[0])} for layer 0)"
            )


def _named_caches(k_caches, v_caches) -> list[tuple[str, torch.Tensor]]:
    return [
        (f"{kind}_caches[{i}]", c) for kind, caches in (("k", k_caches), ("v", v_caches)) for i, c in enumerate(caches)
    ]


def _check_caches(x: torch.Tensor, k_caches, v_caches, num_kv_heads: int, head_dim: int) -> None:
    shape = tuple(k_caches[0].shape)
    for name, c in _named_caches(k_caches, v_caches):
        if c.dim() != 3 or tuple(c.shape[1:]) != (num_kv_heads, head_dim) or tuple(c.shape) != shape:
            raise _fail(
                f"{name} must be [S, {num_kv_heads}, {head_dim}] with the slots of k_caches[0] {shape}, "
                f"got {tuple(c.shape)}"
            )
        if c.dtype != x.dtype:
            raise _wrong_type(f"{name} dtype {c.dtype} differs from x dtype {x.dtype}")
        _check_device(name, c, x)
        if c.numel() and overlaps_itself(c):
            raise _fail(
                f"{name} must not overlap itself (its rows are written independently), got strides {tuple(c.stride())}"
            )


def _check_locations(x: torch.Tensor, cache_loc: torch.Tensor, commit_lens: torch.Tensor | None) -> None:
    tokens = x.shape[0]
    if cache_loc.dtype not in _INDEX:
        raise _wrong_type(f"cache_loc must be int32 or int64, got {cache_loc.dtype}")
    _check_device("cache_loc", cache_loc, x)
    if cache_loc.dim() == 1:
        if cache_loc.shape[0] != tokens:
            raise _fail(f"cache_loc must be [{tokens}] (one slot per token of x), got {tuple(cache_loc.shape)}")
        if commit_lens is not None:
            raise _fail("commit_lens needs a 2-D cache_loc [B, W]; got a 1-D cache_loc")
        return
    if cache_loc.dim() != 2 or cache_loc.numel() != tokens:
        raise _fail(f"cache_loc must be [{tokens}] or [B, W] with B * W = {tokens}, got {tuple(cache_loc.shape)}")
    if commit_lens is None:
        raise _fail("commit_lens [B] must be given with a 2-D cache_loc [B, W]")
    if commit_lens.shape != cache_loc.shape[:1]:
        raise _fail(
            f"commit_lens must be [{cache_loc.shape[0]}] (one per row of cache_loc), got {tuple(commit_lens.shape)}"
        )
    if commit_lens.dtype not in _INDEX:
        raise _wrong_type(f"commit_lens must be int32 or int64, got {commit_lens.dtype}")
    _check_device("commit_lens", commit_lens, x)


def _check_aliasing(caches: list[tuple[str, torch.Tensor]], inputs: list[tuple[str, torch.Tensor | None]]) -> None:
    """No cache may share memory with another cache or with any input: the op reads every input and writes every
    cache in one pass, so an overlap would make the result depend on the order of the writes."""
    for j, (name, c) in enumerate(caches):
        for other, t in [*caches[:j], *inputs]:
            if t is not None and share_memory(c, t):
                raise _fail(f"{name} shares memory with {other}: the caches must not overlap each other or any input")


def _check_args(
    x: torch.Tensor,
    k_weights: Sequence[torch.Tensor],
    k_row_starts: Sequence[int],
    k_biases: Sequence[torch.Tensor | None],
    v_weights: Sequence[torch.Tensor],
    v_row_starts: Sequence[int],
    v_biases: Sequence[torch.Tensor | None],
    k_norm_weights: Sequence[torch.Tensor | None],
    k_norm_eps: Sequence[float],
    cos_sin_caches: Sequence[torch.Tensor],
    positions: torch.Tensor,
    is_neox: bool,
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor],
    cache_loc: torch.Tensor,
    commit_lens: torch.Tensor | None,
    num_kv_heads: int,
    head_dim: int,
    wrap_negative: bool = False,
) -> None:
    """Every structural rule of the op (shapes, dtypes, devices, lengths), raised before anything is written. Takes
    the op's arguments (`is_neox` and `wrap_negative` have no rule beyond their schema type)."""
    if x.dim() != 2:
        raise _fail(f"x must be 2-D [T, K], got {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise _wrong_type(f"x must be bfloat16, float16 or float32, got {x.dtype}")
    n = len(k_weights)
    if n == 0:
        raise _fail("k_weights must hold at least one tensor (one per layer)")
    if num_kv_heads < 1:
        raise _fail(f"num_kv_heads must be >= 1, got {num_kv_heads}")
    if head_dim < 1:
        raise _fail(f"head_dim must be >= 1, got {head_dim}")
    _check_list_lengths(
        n,
        k_row_starts=k_row_starts,
        k_biases=k_biases,
        v_weights=v_weights,
        v_row_starts=v_row_starts,
        v_biases=v_biases,
        k_norm_weights=k_norm_weights,
        k_caches=k_caches,
        v_caches=v_caches,
    )
    for name, values in (("k_norm_eps", k_norm_eps), ("cos_sin_caches", cos_sin_caches)):
        if len(values) not in (0, n):
            raise _fail(f"{name} must be empty or hold one entry per layer ({n}), got {len(values)}")
    kv = num_kv_heads * head_dim
    _check_projection(x, "k", k_weights, k_row_starts, k_biases, kv)
    _check_projection(x, "v", v_weights, v_row_starts, v_biases, kv)
    _check_norm(x, k_norm_weights, k_norm_eps, head_dim)
    _check_rope(x, cos_sin_caches, positions, head_dim)
    _check_caches(x, k_caches, v_caches, num_kv_heads, head_dim)
    _check_locations(x, cache_loc, commit_lens)
    inputs = [
        ("x", x),
        *((f"{kind}_weights[{i}]", w) for kind, ws in (("k", k_weights), ("v", v_weights)) for i, w in enumerate(ws)),
        *((f"{kind}_biases[{i}]", b) for kind, bs in (("k", k_biases), ("v", v_biases)) for i, b in enumerate(bs)),
        *((f"k_norm_weights[{i}]", w) for i, w in enumerate(k_norm_weights)),
        *((f"cos_sin_caches[{i}]", c) for i, c in enumerate(cos_sin_caches)),
        ("positions", positions),
        ("cache_loc", cache_loc),
        ("commit_lens", commit_lens),
    ]
    _check_aliasing(_named_caches(k_caches, v_caches), inputs)


def _position_rows(cos_sin_caches: Sequence[torch.Tensor]) -> int | None:
    """Rows of the shortest table: the positions every layer can read; None where positions are not rows (no RoPE,
    or inverse frequencies)."""
    if not cos_sin_caches or table_form(cos_sin_caches[0]) == "frequencies":
        return None
    return min(c.shape[0] for c in cos_sin_caches)


def _check_values(
    cos_sin_caches: Sequence[torch.Tensor],
    positions: torch.Tensor,
    k_caches: Sequence[torch.Tensor],
    cache_loc: torch.Tensor,
    wrap_negative: bool,
) -> None:
    """The index-value rules (CPU always, CUDA in checking mode): every slot below S, every position a row of every
    table (skipped tokens included; not for inverse frequencies), slots first; with `wrap_negative` down to -S and
    -P."""
    if not must_check_values(cache_loc):
        return
    slots = k_caches[0].shape[0]
    if wrap_negative:
        what = f"cache slots are [-{slots}, {slots}) (a negative entry l addresses slot {slots} + l)"
    else:
        what = f"cache slots are [0, {slots}) (negative entries skip the token)"
    check_index_range("cache_loc", cache_loc, slots, what, wrap=wrap_negative)
    rows = _position_rows(cos_sin_caches)
    if rows is not None:
        low = -rows if wrap_negative else 0
        what = f"positions must be in [{low}, {rows}), a row of every cos_sin_caches table"
        check_index_range("positions", positions, rows, what, negative_skips=False, wrap=wrap_negative)


def _wrapped(index: torch.Tensor, size: int) -> torch.Tensor:
    """`index` with entries in `[-size, 0)` moved to `size + index` (Python indexing); others unchanged."""
    index = index.long()
    return torch.where((index < 0) & (index >= -size), index + size, index)


def _written_tokens(cache_loc: torch.Tensor, commit_lens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(token indices, slots) of the tokens that are written: non-negative slot, inside the commit length."""
    loc = cache_loc.long()
    keep = loc >= 0
    if commit_lens is not None:
        width = cache_loc.shape[1]
        keep = keep & (torch.arange(width, device=loc.device)[None, :] < commit_lens.long()[:, None])
    tokens = keep.reshape(-1).nonzero().reshape(-1)
    return tokens, loc.reshape(-1)[tokens]


def _project(xs: torch.Tensor, w: torch.Tensor, start: int, b: torch.Tensor | None, kv: int) -> torch.Tensor:
    """`xs [t, K] @ w[start : start + kv]ᵀ (+ b[start : start + kv])` in `xs`'s dtype."""
    out = xs @ w[start : start + kv].to(xs.dtype).t()
    return out if b is None else out + b[start : start + kv].to(xs.dtype)


def rms_norm_heads(k: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm of every head of `k [t, heads, D]` over its D elements, times `weight [D]` if given, in `k`'s dtype."""
    k = k * torch.rsqrt(k.square().mean(-1, keepdim=True) + eps)
    return k if weight is None else k * weight.to(k.dtype)


def rope_rotate(k: torch.Tensor, cos_sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """Rotate the first `R = cos_sin.shape[-1]` elements of every head of `k [T, heads, D]` by `cos_sin [T, R]`."""
    rot = cos_sin.shape[-1]
    cos, sin = cos_sin[:, None, : rot // 2], cos_sin[:, None, rot // 2 :]
    if is_neox:
        a, b = k[..., : rot // 2], k[..., rot // 2 : rot]
    else:
        a, b = k[..., 0:rot:2], k[..., 1:rot:2]
    ra, rb = a * cos - b * sin, b * cos + a * sin
    rotated = torch.cat([ra, rb], dim=-1) if is_neox else torch.stack([ra, rb], dim=-1).flatten(-2)
    return torch.cat([rotated, k[..., rot:]], dim=-1)


def multi_linear_kv_write_reference(
    x: torch.Tensor,
    k_weights: Sequence[torch.Tensor],
    k_row_starts: Sequence[int],
    k_biases: Sequence[torch.Tensor | None],
    v_weights: Sequence[torch.Tensor],
    v_row_starts: Sequence[int],
    v_biases: Sequence[torch.Tensor | None],
    k_norm_weights: Sequence[torch.Tensor | None],
    k_norm_eps: Sequence[float],
    cos_sin_caches: Sequence[torch.Tensor],
    positions: torch.Tensor,
    is_neox: bool,
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor],
    cache_loc: torch.Tensor,
    commit_lens: torch.Tensor | None,
    num_kv_heads: int,
    head_dim: int,
    wrap_negative: bool = False,
) -> None:
    """The op in plain torch, fp32 math (the CPU implementation and the single source of truth for the kernels)."""
    _check_args(
        x,
        k_weights,
        k_row_starts,
        k_biases,
        v_weights,
        v_row_starts,
        v_biases,
        k_norm_weights,
        k_norm_eps,
        cos_sin_caches,
        positions,
        is_neox,
        k_caches,
        v_caches,
        cache_loc,
        commit_lens,
        num_kv_heads,
        head_dim,
    )
    _check_values(cos_sin_caches, positions, k_caches, cache_loc, wrap_negative)
    rows = _position_rows(cos_sin_caches)
    if wrap_negative:
        cache_loc = _wrapped(cache_loc, k_caches[0].shape[0])
        if rows is not None:
            positions = _wrapped(positions, rows)
    tokens, slots = _written_tokens(cache_loc, commit_lens)
    xs = x[tokens].float()
    pos = positions[tokens]
    # nothing is returned, so inference mode lets every cache be written in place as the CUDA kernel writes it: one
    # that requires grad, an inference tensor among normal ones (no layer written before a later one raises)
    with torch.inference_mode():
        for i in range(len(k_weights)):
            k, v = layer_kv(
                xs,
                (k_weights[i], k_row_starts[i], k_biases[i]),
                (v_weights[i], v_row_starts[i], v_biases[i]),
                (k_norm_weights[i], k_norm_eps[i]) if k_norm_eps else None,
                rope_rows(cos_sin_caches[i], pos) if cos_sin_caches else None,
                is_neox,
                num_kv_heads,
                head_dim,
            )
            k_caches[i][slots] = k.to(k_caches[i].dtype)
            v_caches[i][slots] = v.to(v_caches[i].dtype)


def layer_kv(
    xs: torch.Tensor,
    k_rows: tuple[torch.Tensor, int, torch.Tensor | None],
    v_rows: tuple[torch.Tensor, int, torch.Tensor | None],
    norm: tuple[torch.Tensor | None, float] | None,
    cos_sin: torch.Tensor | None,
    is_neox: bool,
    num_kv_heads: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's `[t, heads, head_dim]` K and V of the rows `xs [t, K]`, unrounded, computed in `xs`'s dtype (fp32
    in the op; `dspark_fx` checks a lowering in fp64): `*_rows` = (weight, first row, bias or None), `norm` =
    (weight or None, eps) or None, `cos_sin` = the `[t, R]` table rows of the tokens or None."""
    kv = num_kv_heads * head_dim
    k = _project(xs, *k_rows, kv).view(-1, num_kv_heads, head_dim)
    v = _project(xs, *v_rows, kv).view(-1, num_kv_heads, head_dim)
    if norm is not None:
        k = rms_norm_heads(k, *norm)
    if cos_sin is not None:
        k = rope_rotate(k, cos_sin.to(xs.dtype), is_neox)
    return k, v


def check_cuda_operands(x: torch.Tensor, head_dim: int, caches: Sequence[tuple[str, torch.Tensor]]) -> None:
    """The CUDA binding's rules on the activation, `head_dim` and the named caches (the same messages): bf16/fp16,
    K a positive multiple of 8, head_dim a multiple of 8 up to 256, caches with unit inner stride and 16-byte aligned
    rows (a cache's address judged from its storage offset). The pass's "auto" rule asks this too."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise _wrong_type(f"x must be bfloat16 or float16 on CUDA, got {x.dtype}")
    if x.shape[1] % 8 != 0 or x.shape[1] <= 0:
        raise _fail(f"x must have K > 0 and a multiple of 8 on CUDA, got K = {x.shape[1]}")
    if head_dim % 8 != 0 or head_dim > 256:
        raise _fail(f"head_dim must be a multiple of 8 and at most 256 on CUDA, got {head_dim}")
    for name, c in caches:
        esize = c.element_size()
        if c.stride(-1) != 1 or not is_aligned(c, 16) or any((s * esize) % 16 for s in c.stride()[:-1]):
            strides = tuple(c.stride())
            raise _fail(f"{name} must have a unit inner stride and 16-byte aligned rows on CUDA, got strides {strides}")


def _check_cuda_layout(
    x: torch.Tensor,
    k_weights: Sequence[torch.Tensor],
    k_norm_weights: Sequence[torch.Tensor | None],
    cos_sin_caches: Sequence[torch.Tensor],
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor],
    num_kv_heads: int,
    head_dim: int,
) -> None:
    """What the CUDA binding needs beyond `_check_args` (`check_cuda_layout` and the unit-count check of
    csrc/linear/multi_linear_kv_write.cu, the same messages)."""
    check_cuda_operands(x, head_dim, _named_caches(k_caches, v_caches))
    for i, w in enumerate(k_norm_weights):
        if w is not None and w.stride(0) != 1 and w.shape[0] > 1:
            raise _fail(f"k_norm_weights[{i}] must be contiguous on CUDA")
    for i, t in enumerate(cos_sin_caches):
        if not _factors_contiguous(t):
            raise _fail(
                f"cos_sin_caches[{i}] must have a unit inner stride on CUDA (a [P, R/2, 2] table: each row's R "
                f"factors consecutive), got strides {tuple(t.stride())}"
            )
    if x.shape[0] * 2 * min(len(k_weights), _MAX_LAYERS_PER_LAUNCH) * num_kv_heads >= 2**31:
        raise _fail(f"x has too many tokens for one call ({x.shape[0]}): split it")


def _factors_contiguous(t: torch.Tensor) -> bool:
    """Whether the factors of one position are consecutive floats (what the CUDA kernels read)."""
    if t.dim() == 3:
        return (t.stride(2) == 1 or t.shape[2] <= 1) and (t.stride(1) == 2 or t.shape[1] <= 1)
    return t.stride(-1) == 1 or t.shape[-1] <= 1


def _multi_linear_kv_write_fake(
    x: torch.Tensor,
    k_weights: Sequence[torch.Tensor],
    k_row_starts: Sequence[int],
    k_biases: Sequence[torch.Tensor | None],
    v_weights: Sequence[torch.Tensor],
    v_row_starts: Sequence[int],
    v_biases: Sequence[torch.Tensor | None],
    k_norm_weights: Sequence[torch.Tensor | None],
    k_norm_eps: Sequence[float],
    cos_sin_caches: Sequence[torch.Tensor],
    positions: torch.Tensor,
    is_neox: bool,
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor],
    cache_loc: torch.Tensor,
    commit_lens: torch.Tensor | None,
    num_kv_heads: int,
    head_dim: int,
    wrap_negative: bool = False,
) -> None:
    """Checks only (`_check_args`, and `_check_cuda_layout` on CUDA): the op returns nothing and its caches keep
    their shapes."""
    _check_args(
        x,
        k_weights,
        k_row_starts,
        k_biases,
        v_weights,
        v_row_starts,
        v_biases,
        k_norm_weights,
        k_norm_eps,
        cos_sin_caches,
        positions,
        is_neox,
        k_caches,
        v_caches,
        cache_loc,
        commit_lens,
        num_kv_heads,
        head_dim,
    )
    if x.device.type == "cuda":
        _check_cuda_layout(x, k_weights, k_norm_weights, cos_sin_caches, k_caches, v_caches, num_kv_heads, head_dim)


register_op(
    "multi_linear_kv_write(Tensor x, Tensor[] k_weights, int[] k_row_starts, Tensor?[] k_biases, "
    "Tensor[] v_weights, int[] v_row_starts, Tensor?[] v_biases, Tensor?[] k_norm_weights, float[] k_norm_eps, "
    "Tensor[] cos_sin_caches, Tensor positions, bool is_neox, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, "
    "Tensor cache_loc, Tensor? commit_lens, int num_kv_heads, int head_dim, bool wrap_negative=False) -> ()",
    reference=multi_linear_kv_write_reference,
    fake=_multi_linear_kv_write_fake,
)
