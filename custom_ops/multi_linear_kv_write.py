"""`dspark::multi_linear_kv_write` — N layers' context K/V from one activation, normed, rotated and written to caches.

What a DSpark/DFlash draft does for every layer from the same `ctx` hidden states, as one op:

    k_i = x @ Wk_i[k_row_starts[i] : +kv]ᵀ (+ bk_i)      [T, kv_heads, head_dim]   (kv = kv_heads * head_dim)
    v_i = x @ Wv_i[v_row_starts[i] : +kv]ᵀ (+ bv_i)
    k_i = RMSNorm(k_i per head, k_norm_weights[i], k_norm_eps[i])          if k_norm_eps is not empty
    k_i = RoPE(k_i, cos_sin_caches[i][positions], is_neox)                 if cos_sin_caches is not empty
    k_caches[i][loc[t]] = k_i[t];  v_caches[i][loc[t]] = v_i[t]             for every written token t

All math is fp32 from the inputs (GEMM accumulation, norm, rotation); K and V are rounded once, when stored.

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
| `cos_sin_caches` | N x `[P_i, R]`, or empty   | fp32           |     | `[cos, sin]` halves per row; empty: no RoPE   |
| `positions`      | `[T]`                      | int32/int64    |     | row of `cos_sin_caches[i]` for token t        |
| `is_neox`        | `bool`                     |                |     | pairs `(d, d + R/2)` (True) or `(2d, 2d + 1)` |
| `k_caches`       | N x `[S, heads, head_dim]` | as `x`         | yes | K cache of layer i (any strides)              |
| `v_caches`       | N x `[S, heads, head_dim]` | as `x`         | yes | V cache of layer i (any strides)              |
| `cache_loc`      | `[T]`, or `[B, W]` (B*W=T) | int32/int64    |     | slot of token t (`[B, W]`: row-major)         |
| `commit_lens`    | `[B]` or None              | int32/int64    |     | `[B, W]` slots: write `j < commit_lens[b]`    |
| `num_kv_heads`   | `int`                      |                |     | heads per layer                               |
| `head_dim`       | `int`                      |                |     | elements per head                             |
| returns          | nothing                    |                |     |                                               |

RoPE rotates the first `R` elements of each head (`R` even, `0 < R <= head_dim`, the same for every layer; the rest
pass through); with `(c, s) = (cos_sin[p, j], cos_sin[p, R/2 + j])` a pair `(a, b)` becomes `(a c - b s, b c + a s)`,
pair j being `(j, j + R/2)` (neox) or `(2j, 2j + 1)` (GPT-J).

Index values (the contract of every dspark op, docs/contract.md): a negative `cache_loc` entry skips the token (its
K and V are not written); an entry `>= S` or a position outside `[0, P_i)` raises `ValueError` on CPU (and on CUDA
with `custom_ops.set_checks(True)`), before any cache is modified; on CUDA without checks such a token is skipped.
Two tokens addressing one slot leave either token's row (unspecified which).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from custom_ops._library import LIB
from custom_ops.checks import check_index_range, must_check_values

__all__ = ["multi_linear_kv_write_reference"]

LIB.define(
    "multi_linear_kv_write(Tensor x, Tensor[] k_weights, int[] k_row_starts, Tensor?[] k_biases, "
    "Tensor[] v_weights, int[] v_row_starts, Tensor?[] v_biases, Tensor?[] k_norm_weights, float[] k_norm_eps, "
    "Tensor[] cos_sin_caches, Tensor positions, bool is_neox, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, "
    "Tensor cache_loc, Tensor? commit_lens, int num_kv_heads, int head_dim) -> ()"
)

_OP = "multi_linear_kv_write"
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_INDEX = (torch.int32, torch.int64)


def _fail(message: str) -> ValueError:
    return ValueError(f"{_OP}: {message}")


def _check_list_lengths(n: int, **lists: Sequence[object]) -> None:
    for name, values in lists.items():
        if len(values) != n:
            raise _fail(f"{name} must hold one entry per layer ({n}, the length of k_weights), got {len(values)}")


def _check_projection(x: torch.Tensor, kind: str, weights, starts, biases, kv: int) -> None:
    for i, (w, start, b) in enumerate(zip(weights, starts, biases, strict=True)):
        name = f"{kind}_weights[{i}]"
        if w.dim() != 2 or w.shape[1] != x.shape[1]:
            raise _fail(f"{name} must be [R, {x.shape[1]}] (x is {tuple(x.shape)}), got {tuple(w.shape)}")
        if w.dtype != x.dtype:
            raise TypeError(f"{_OP}: {name} dtype {w.dtype} differs from x dtype {x.dtype}")
        if w.device != x.device:
            raise _fail(f"{name} is on {w.device}, x is on {x.device}")
        if start < 0 or start + kv > w.shape[0]:
            raise _fail(
                f"{kind}_row_starts[{i}] = {start}: rows [{start}, {start + kv}) of {name} are out of range "
                f"(it has {w.shape[0]} rows, a layer uses num_kv_heads * head_dim = {kv})"
            )
        if b is not None and (b.shape != (w.shape[0],) or b.dtype != x.dtype or b.device != x.device):
            raise _fail(
                f"{kind}_biases[{i}] must be [{w.shape[0]}] {x.dtype} on {x.device}, "
                f"got {tuple(b.shape)} {b.dtype} on {b.device}"
            )


def _check_norm(x: torch.Tensor, weights, eps: Sequence[float], head_dim: int) -> None:
    for i, e in enumerate(eps):
        if not e >= 0.0:
            raise _fail(f"k_norm_eps[{i}] must be >= 0, got {e}")
    for i, w in enumerate(weights):
        if w is None:
            continue
        if w.shape != (head_dim,) or w.dtype not in (x.dtype, torch.float32) or w.device != x.device:
            raise _fail(
                f"k_norm_weights[{i}] must be [{head_dim}] {x.dtype} or torch.float32 on {x.device}, "
                f"got {tuple(w.shape)} {w.dtype} on {w.device}"
            )


def _check_rope(x: torch.Tensor, caches: Sequence[torch.Tensor], positions: torch.Tensor, head_dim: int) -> None:
    tokens = x.shape[0]
    if positions.dim() != 1 or positions.shape[0] != tokens or positions.dtype not in _INDEX:
        raise _fail(f"positions must be [{tokens}] int32 or int64, got {tuple(positions.shape)} {positions.dtype}")
    if positions.device != x.device:
        raise _fail(f"positions is on {positions.device}, x is on {x.device}")
    for i, c in enumerate(caches):
        if c.dim() != 2 or c.dtype != torch.float32 or c.device != x.device:
            raise _fail(
                f"cos_sin_caches[{i}] must be a 2-D float32 tensor on {x.device}, got {tuple(c.shape)} "
                f"{c.dtype} on {c.device}"
            )
        rot = c.shape[1]
        if rot % 2 or not 0 < rot <= head_dim or rot != caches[0].shape[1]:
            raise _fail(
                f"cos_sin_caches[{i}] has {rot} columns: the rotary dim must be even, in (0, head_dim = {head_dim}] "
                f"and the same for every layer ({caches[0].shape[1]} for layer 0)"
            )


def _check_caches(x: torch.Tensor, k_caches, v_caches, num_kv_heads: int, head_dim: int) -> None:
    shape = tuple(k_caches[0].shape) if k_caches else ()
    seen: dict[int, str] = {}
    for kind, caches in (("k", k_caches), ("v", v_caches)):
        for i, c in enumerate(caches):
            name = f"{kind}_caches[{i}]"
            if c.dim() != 3 or tuple(c.shape[1:]) != (num_kv_heads, head_dim) or tuple(c.shape) != shape:
                raise _fail(
                    f"{name} must be [S, {num_kv_heads}, {head_dim}] with the slots of k_caches[0] {shape}, "
                    f"got {tuple(c.shape)}"
                )
            if c.dtype != x.dtype:
                raise TypeError(f"{_OP}: {name} dtype {c.dtype} differs from x dtype {x.dtype}")
            if c.device != x.device:
                raise _fail(f"{name} is on {c.device}, x is on {x.device}")
            if c.numel() and c.data_ptr() in seen:
                raise _fail(f"{name} is the same memory as {seen[c.data_ptr()]}: every cache must be distinct")
            seen[c.data_ptr()] = name


def _check_locations(x: torch.Tensor, cache_loc: torch.Tensor, commit_lens: torch.Tensor | None) -> None:
    tokens = x.shape[0]
    if cache_loc.dtype not in _INDEX or cache_loc.device != x.device:
        raise _fail(f"cache_loc must be int32 or int64 on {x.device}, got {cache_loc.dtype} on {cache_loc.device}")
    if cache_loc.dim() == 1:
        if cache_loc.shape[0] != tokens:
            raise _fail(f"cache_loc must be [{tokens}] (one slot per token of x), got {tuple(cache_loc.shape)}")
        if commit_lens is not None:
            raise _fail("commit_lens needs a 2-D cache_loc [B, W]; got a 1-D cache_loc")
        return
    if cache_loc.dim() != 2 or cache_loc.numel() != tokens:
        raise _fail(f"cache_loc must be [{tokens}] or [B, W] with B * W = {tokens}, got {tuple(cache_loc.shape)}")
    if commit_lens is None:
        raise _fail("a 2-D cache_loc [B, W] needs commit_lens [B]")
    if commit_lens.shape != cache_loc.shape[:1] or commit_lens.dtype not in _INDEX or commit_lens.device != x.device:
        raise _fail(
            f"commit_lens must be [{cache_loc.shape[0]}] int32 or int64 on {x.device}, "
            f"got {tuple(commit_lens.shape)} {commit_lens.dtype} on {commit_lens.device}"
        )


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
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor],
    cache_loc: torch.Tensor,
    commit_lens: torch.Tensor | None,
    num_kv_heads: int,
    head_dim: int,
) -> None:
    """Every structural rule of the op (shapes, dtypes, devices, lengths), raised before anything is written."""
    if x.dim() != 2 or x.dtype not in _FLOATS:
        raise _fail(f"x must be a 2-D [T, K] bfloat16, float16 or float32 tensor, got {tuple(x.shape)} {x.dtype}")
    n = len(k_weights)
    if n == 0:
        raise _fail("k_weights must hold at least one tensor (one per layer)")
    if num_kv_heads < 1 or head_dim < 1:
        raise _fail(f"num_kv_heads and head_dim must be >= 1, got {num_kv_heads} and {head_dim}")
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


def _check_values(
    cos_sin_caches: Sequence[torch.Tensor],
    positions: torch.Tensor,
    k_caches: Sequence[torch.Tensor],
    cache_loc: torch.Tensor,
) -> None:
    """The index-value rules (CPU always, CUDA in checking mode): slots below S, positions inside every table."""
    if not must_check_values(cache_loc):
        return
    slots = k_caches[0].shape[0]
    check_index_range("cache_loc", cache_loc, slots, f"cache slots are [0, {slots}) (negative entries skip the token)")
    if cos_sin_caches:
        rows = min(c.shape[0] for c in cos_sin_caches)
        check_index_range("positions", positions, rows, f"cos_sin_caches have rows [0, {rows})", negative_skips=False)


def _written_tokens(cache_loc: torch.Tensor, commit_lens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(token indices, slots) of the tokens that are written: non-negative slot, inside the commit length."""
    loc = cache_loc.long()
    keep = loc >= 0
    if commit_lens is not None:
        width = cache_loc.shape[1]
        keep = keep & (torch.arange(width, device=loc.device)[None, :] < commit_lens.long()[:, None])
    tokens = keep.reshape(-1).nonzero().reshape(-1)
    return tokens, loc.reshape(-1)[tokens]


def rope_rotate(k: torch.Tensor, cos_sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """Rotate the first `R = cos_sin.shape[-1]` elements of every head of fp32 `k [T, heads, D]` by `cos_sin [T, R]`."""
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
        k_caches,
        v_caches,
        cache_loc,
        commit_lens,
        num_kv_heads,
        head_dim,
    )
    _check_values(cos_sin_caches, positions, k_caches, cache_loc)
    tokens, slots = _written_tokens(cache_loc, commit_lens)
    kv = num_kv_heads * head_dim
    xs = x[tokens].float()
    for i in range(len(k_weights)):

        def project(w: torch.Tensor, start: int, b: torch.Tensor | None) -> torch.Tensor:
            out = xs @ w[start : start + kv].float().t()
            if b is not None:
                out = out + b[start : start + kv].float()
            return out.reshape(-1, num_kv_heads, head_dim)

        k = project(k_weights[i], k_row_starts[i], k_biases[i])
        v = project(v_weights[i], v_row_starts[i], v_biases[i])
        if k_norm_eps:
            k = k * torch.rsqrt(k.square().mean(-1, keepdim=True) + k_norm_eps[i])
            if k_norm_weights[i] is not None:
                k = k * k_norm_weights[i].float()
        if cos_sin_caches:
            k = rope_rotate(k, cos_sin_caches[i][positions[tokens].long()], is_neox)
        k_caches[i][slots] = k.to(k_caches[i].dtype)
        v_caches[i][slots] = v.to(v_caches[i].dtype)


@torch.library.register_fake(f"dspark::{_OP}")
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
) -> None:
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
        k_caches,
        v_caches,
        cache_loc,
        commit_lens,
        num_kv_heads,
        head_dim,
    )


LIB.impl(_OP, multi_linear_kv_write_reference, "CPU")
