"""DeepSeek-V4 fused RMSNorm / interleaved RoPE / FP8 ops and the FlashMLA V4 paged-cache writes.

Five ops in the `dspark` namespace, each with a schema, a fake impl, a CPU reference (the `*_reference` functions below,
vectorized torch, usable on any device) and a CUDA kernel (`csrc/flashmla/flashmla_writes.cu`, loaded on first use, see
`custom_ops._library`):

| op | mutates | what it does |
|---|---|---|
| `fused_k_norm_rope_flashmla` | `kvcache` | RMSNorm, RoPE, FP8/UE8M0 quant and the 584-byte V4 cache write |
| `fused_q_norm_rope` | `q_out` | weightless RMSNorm + RoPE of every head |
| `fused_norm_rope_inplace` | `kv` | RMSNorm + RoPE in place (the unfused building block) |
| `store_flashmla_cache` | `kvcache` | FP8/UE8M0 quant + V4 write of finished rows (the unfused store) |
| `fused_q_indexer_rope_hadamard_quant` | - | RoPE, Hadamard, per-row FP8 of the indexer query |

The argument tables are in the docstrings of the `*_reference` functions and in docs/ops.md.

Numerics shared by the CPU references and the CUDA kernels (they agree bit for bit except in rare rounding ties):
the RMSNorm factor and the Walsh-Hadamard transform of `custom_ops.layouts.norm` (fp64 sum of squares, every later
step a separately rounded fp32 operation), RoPE of `custom_ops.layouts.rope`, FP8 of `custom_ops.layouts.fp8`.

Input contract (docs/contract.md): structural checks raise on every device (CPU impl, fake impl, CUDA binding)
before anything is written. Index values: `positions` must lie in `[0, max_pos)` (no sentinel), `out_loc` in
`[0, num_pages * page_size)`, and a negative slot id skips the row. The CPU impls raise `ValueError` naming the
argument and the entry before the first write; the CUDA kernels skip a row whose index is out of range (no host
sync; in checking mode, `custom_ops.set_checks(True)`, the binding raises the CPU message instead). The `*_reference`
functions follow the kernels' skip rule, so they are the oracle for CUDA runs with out-of-range rows.
"""

import math

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_false, guard_or_true

from custom_ops._library import register_op
from custom_ops.checks import check_index_range, check_no_shared_memory, is_aligned, same_view
from custom_ops.layouts.fp8 import (
    FP8_MAX,
    HEAD_DIM,
    INDEXER_DIM,
    NOPE_DIM,
    ROPE_DIM,
    finite_amax,
    flashmla_page_bytes,
    quantize_e4m3,
    quantize_tiles_ue8m0,
    scatter_flashmla_rows,
)
from custom_ops.layouts.norm import rms_norm_factor, walsh_hadamard
from custom_ops.layouts.rope import apply_rope_interleaved, rope_table_rows

__all__ = [
    "INDEXER_DIM",
    "fused_k_norm_rope_flashmla_reference",
    "fused_norm_rope_inplace_reference",
    "fused_q_indexer_rope_hadamard_quant_reference",
    "fused_q_norm_rope_reference",
    "store_flashmla_cache_reference",
]

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)


# ---------------------------------------------------------------------------------------------- validation
#
# Structural checks (types, dtypes, shapes, strides, devices, alignment, scalars) run in the CPU impls and in the fake
# impls; csrc/flashmla/flashmla_writes.cu runs the same checks in the same order. The first tensor argument (`kv` or
# `q`) fixes the device; every other tensor is named when it is elsewhere.


def _tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise TypeError(f"{name} must have dtype in ({names}), got {str(t.dtype).removeprefix('torch.')}")


def _shape(name: str, t: torch.Tensor, expected: tuple[object, ...], what: str) -> None:
    ok = t.dim() == len(expected) and all(e is None or s == e for s, e in zip(t.shape, expected, strict=True))
    if not ok:
        raise ValueError(f"{name} must have shape {what}, got {tuple(t.shape)}")


def _device(name: str, t: torch.Tensor, anchor: str, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} must be on {device} like {anchor}, got {t.device}")


def _inner_contiguous(name: str, t: torch.Tensor) -> None:
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a unit stride in its last dim, got strides {tuple(t.stride())}")


def _aligned16(name: str, t: torch.Tensor) -> None:
    """The kernels read `freqs` and write `kvcache` with 16-byte accesses (`is_aligned`: CPU, fake and CUDA agree)."""
    if not is_aligned(t, 16):
        raise ValueError(f"{name} must be 16-byte aligned, got a storage offset of {t.storage_offset()} elements")


def _rows_disjoint(name: str, t: torch.Tensor) -> None:
    """The kernels write the (..., D) rows of `t` in parallel: no two rows may share memory. Sufficient test: in
    order of increasing stride, every batch dim steps past the whole block spanned by the dims before it. A size not
    known at compile time (a data-dependent row count) is taken as nonzero and > 1; the real impl checks it again."""
    if guard_or_false(t.numel() == 0):
        return
    span = t.shape[-1]
    for stride, size in sorted((t.stride(d), t.shape[d]) for d in range(t.dim() - 1) if guard_or_true(t.shape[d] > 1)):
        if stride < span:
            raise ValueError(
                f"{name} must not overlap itself (its rows are written in parallel), got shape {tuple(t.shape)} "
                f"and strides {tuple(t.stride())}"
            )
        span += (size - 1) * stride


def _check_eps(eps: object) -> None:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be finite and >= 0, got {eps}")


def _check_weight_scale(weight_scale: object) -> None:
    if isinstance(weight_scale, bool) or not isinstance(weight_scale, (int, float)):
        raise TypeError(f"weight_scale must be a float, got {type(weight_scale).__name__}")
    if not math.isfinite(weight_scale):
        raise ValueError(f"weight_scale must be finite, got {weight_scale}")


def _check_index(name: str, t: object, n: int, anchor: str, device: torch.device) -> None:
    t = _tensor(name, t)
    _dtype(name, t, _INDEX_DTYPES)
    _shape(name, t, (n,), f"({n},)")
    _device(name, t, anchor, device)


def _check_table(freqs: object, positions: object, n: int, anchor: str, device: torch.device) -> None:
    freqs = _tensor("freqs", freqs)
    _dtype("freqs", freqs, (torch.float32,))
    _shape("freqs", freqs, (None, ROPE_DIM), f"(max_pos, {ROPE_DIM})")
    if not freqs.is_contiguous():
        raise ValueError("freqs must be contiguous")
    _device("freqs", freqs, anchor, device)
    _aligned16("freqs", freqs)
    _check_index("positions", positions, n, anchor, device)


def _check_rows(name: str, kv: object, dim: int) -> torch.Tensor:
    kv = _tensor(name, kv)
    _dtype(name, kv, _FLOAT_DTYPES)
    _shape(name, kv, (None, dim), f"(B, {dim})")
    _inner_contiguous(name, kv)
    return kv


def _check_weight(weight: object, kv: torch.Tensor) -> None:
    weight = _tensor("weight", weight)
    _dtype("weight", weight, (kv.dtype,))
    _shape("weight", weight, (HEAD_DIM,), f"({HEAD_DIM},)")
    _inner_contiguous("weight", weight)
    _device("weight", weight, "kv", kv.device)


def _check_cache(out_loc: object, kvcache: object, page_size: object, kv: torch.Tensor) -> None:
    _check_index("out_loc", out_loc, kv.shape[0], "kv", kv.device)
    page_bytes = flashmla_page_bytes(page_size)
    kvcache = _tensor("kvcache", kvcache)
    _dtype("kvcache", kvcache, (torch.uint8,))
    _shape("kvcache", kvcache, (None, page_bytes), f"(num_pages, {page_bytes}) for page_size={page_size}")
    if kvcache.stride(1) != 1 or (kvcache.shape[0] > 1 and kvcache.stride(0) != page_bytes):
        raise ValueError(
            f"kvcache must have strides ({page_bytes}, 1) (row stride == page bytes), got {tuple(kvcache.stride())}"
        )
    _device("kvcache", kvcache, "kv", kv.device)
    _aligned16("kvcache", kvcache)


def _check_k(kv, weight, eps, freqs, positions, out_loc, kvcache, page_size) -> None:
    kv = _check_rows("kv", kv, HEAD_DIM)
    _check_weight(weight, kv)
    _check_eps(eps)
    _check_table(freqs, positions, kv.shape[0], "kv", kv.device)
    _check_cache(out_loc, kvcache, page_size, kv)
    inputs = (("kv", kv), ("weight", weight), ("freqs", freqs), ("positions", positions), ("out_loc", out_loc))
    check_no_shared_memory("kvcache", kvcache, inputs)


def _check_q(q, q_out, eps, freqs, positions) -> None:
    q = _tensor("q", q)
    _dtype("q", q, _FLOAT_DTYPES)
    _shape("q", q, (None, None, HEAD_DIM), f"(B, H, {HEAD_DIM})")
    _inner_contiguous("q", q)
    q_out = _tensor("q_out", q_out)
    _dtype("q_out", q_out, (q.dtype,))
    _shape("q_out", q_out, tuple(q.shape), f"{tuple(q.shape)} like q")
    _inner_contiguous("q_out", q_out)
    _rows_disjoint("q_out", q_out)
    _device("q_out", q_out, "q", q.device)
    _check_eps(eps)
    _check_table(freqs, positions, q.shape[0], "q", q.device)
    if not same_view(q_out, q):  # in place (q_out is q) is fine: each row is read whole before it is written
        check_no_shared_memory("q_out", q_out, (("q", q),))
    check_no_shared_memory("q_out", q_out, (("freqs", freqs), ("positions", positions)))


def _check_inplace(kv, weight, eps, freqs, positions) -> None:
    kv = _check_rows("kv", kv, HEAD_DIM)
    _rows_disjoint("kv", kv)
    _check_weight(weight, kv)
    _check_eps(eps)
    _check_table(freqs, positions, kv.shape[0], "kv", kv.device)
    check_no_shared_memory("kv", kv, (("weight", weight), ("freqs", freqs), ("positions", positions)))


def _check_store(kv, out_loc, kvcache, page_size) -> None:
    kv = _check_rows("kv", kv, HEAD_DIM)
    _check_cache(out_loc, kvcache, page_size, kv)
    check_no_shared_memory("kvcache", kvcache, (("kv", kv), ("out_loc", out_loc)))


def _check_indexer(q, weight, weight_scale, freqs, positions) -> None:
    q = _tensor("q", q)
    _dtype("q", q, _FLOAT_DTYPES)
    _shape("q", q, (None, None, INDEXER_DIM), f"(B, H, {INDEXER_DIM})")
    _inner_contiguous("q", q)
    weight = _tensor("weight", weight)
    _dtype("weight", weight, (q.dtype,))
    _shape("weight", weight, tuple(q.shape[:2]), f"{tuple(q.shape[:2])} (B, H) like q")
    _device("weight", weight, "q", q.device)
    _check_weight_scale(weight_scale)
    _check_table(freqs, positions, q.shape[0], "q", q.device)


# Index values (docs/contract.md): the CPU impls raise for an out-of-range entry before any write; the CUDA kernels
# skip such rows, and raise the same message in checking mode (csrc/flashmla/flashmla_writes.cu words it identically).


def _position_range(max_pos: int) -> tuple[int, str]:
    """Exclusive upper bound of `positions` and the text of the error for an entry outside `[0, max_pos)`."""
    return max_pos, f"positions must be in [0, {max_pos}), the rows of freqs"


def _slot_range(num_pages: int, page_size: int) -> tuple[int, str]:
    """Exclusive upper bound of `out_loc` (the cache's capacity) and the text of the error for a slot beyond it."""
    capacity = num_pages * page_size
    return capacity, (
        f"slot ids must be < num_pages * page_size = {num_pages} * {page_size} = {capacity}; "
        "a negative id skips the row"
    )


def _check_positions(freqs: torch.Tensor, positions: torch.Tensor) -> None:
    check_index_range("positions", positions, *_position_range(freqs.shape[0]), negative_skips=False)


def _check_slots(out_loc: torch.Tensor, kvcache: torch.Tensor, page_size: int) -> None:
    check_index_range("out_loc", out_loc, *_slot_range(kvcache.shape[0], page_size))


# ---------------------------------------------------------------------------------------------- references


def fused_k_norm_rope_flashmla_reference(
    kv: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    freqs: torch.Tensor,
    positions: torch.Tensor,
    out_loc: torch.Tensor,
    kvcache: torch.Tensor,
    page_size: int,
) -> None:
    """RMSNorm + RoPE + FP8/UE8M0 quantization of K rows, written into the FlashMLA V4 paged cache.

    | arg | shape | dtype | mutated | notes |
    |---|---|---|---|---|
    | `kv` | (B, 512) | bf16/fp16/fp32 | no | last-dim stride 1, any row stride |
    | `weight` | (512,) | as `kv` | no | RMSNorm gamma |
    | `eps` | float | | | |
    | `freqs` | (max_pos, 64) | fp32 | no | contiguous, `precompute_freqs` |
    | `positions` | (B,) | int32/int64 | no | table row per token, in `[0, max_pos)` |
    | `out_loc` | (B,) | int32/int64 | no | slot id in `[0, num_pages * page_size)`; `< 0` skips the row |
    | `kvcache` | (num_pages, page_bytes) | uint8 | **yes** | strides (page_bytes, 1); shares no byte with an input |
    | `page_size` | int | | | power of two |

    Math: `y = x*nf*w` kept in fp32; rope `bf16(rot(y[448:]))`; nope `y[:448]` in 7 tiles with UE8M0 scales.
    A row whose position or slot is out of range writes nothing (the CUDA kernel's rule).
    """
    x = kv.float()
    y = x * rms_norm_factor(x, eps) * weight.float()
    table, valid = rope_table_rows(freqs, positions)
    rope = apply_rope_interleaved(y[:, NOPE_DIM:], table).to(torch.bfloat16)
    codes, exponents = quantize_tiles_ue8m0(y[:, :NOPE_DIM])
    scatter_flashmla_rows(kvcache, page_size, torch.where(valid, out_loc, -1), codes, rope, exponents)


def fused_q_norm_rope_reference(
    q: torch.Tensor, q_out: torch.Tensor, eps: float, freqs: torch.Tensor, positions: torch.Tensor
) -> None:
    """Weightless RMSNorm of every (token, head) row, then RoPE of its last 64 dims, written to `q_out`.

    | arg | shape | dtype | mutated | notes |
    |---|---|---|---|---|
    | `q` | (B, H, 512) | bf16/fp16/fp32 | no | last-dim stride 1 |
    | `q_out` | (B, H, 512) | as `q` | **yes** | last-dim stride 1 (e.g. a head slice of a wider buffer) |
    | `eps` | float | | | |
    | `freqs` | (max_pos, 64) | fp32 | no | |
    | `positions` | (B,) | int32/int64 | no | |

    Rounding: `y = DType(x*nf)`; nope = y; rope = `DType(rot(fp32(y[448:])))` (double rounding on purpose).
    The `q_out` rows of a token whose position is out of range are left as they are (the CUDA kernel's rule).
    """
    x = q.float()
    y = (x * rms_norm_factor(x, eps)).to(q.dtype)
    table, valid = rope_table_rows(freqs, positions)
    rope = apply_rope_interleaved(y[..., NOPE_DIM:].float(), table[:, None, :])
    rows = torch.cat([y[..., :NOPE_DIM], rope.to(q.dtype)], dim=-1)
    q_out.copy_(torch.where(valid[:, None, None], rows, q_out))


def fused_norm_rope_inplace_reference(
    kv: torch.Tensor, weight: torch.Tensor, eps: float, freqs: torch.Tensor, positions: torch.Tensor
) -> None:
    """RMSNorm (with weight) + RoPE of the last 64 dims, in place: the first step of the unfused K path.

    | arg | shape | dtype | mutated | notes |
    |---|---|---|---|---|
    | `kv` | (B, 512) | bf16/fp16/fp32 | **yes** | last-dim stride 1 |
    | `weight` | (512,) | as `kv` | no | |
    | `eps` | float | | | |
    | `freqs` | (max_pos, 64) | fp32 | no | |
    | `positions` | (B,) | int32/int64 | no | |

    Rounding: `y = DType(x*nf*w)`; rope = `DType(rot(fp32(y[448:])))`.
    A row whose position is out of range is left unchanged (the CUDA kernel's rule).
    """
    x = kv.float()
    y = (x * rms_norm_factor(x, eps) * weight.float()).to(kv.dtype)
    table, valid = rope_table_rows(freqs, positions)
    rope = apply_rope_interleaved(y[:, NOPE_DIM:].float(), table)
    kv.copy_(torch.where(valid[:, None], torch.cat([y[:, :NOPE_DIM], rope.to(kv.dtype)], dim=-1), kv))


def store_flashmla_cache_reference(
    kv: torch.Tensor, out_loc: torch.Tensor, kvcache: torch.Tensor, page_size: int
) -> None:
    """FP8/UE8M0 quantization + V4 write of rows that are already normed and roped (the unfused store).

    | arg | shape | dtype | mutated | notes |
    |---|---|---|---|---|
    | `kv` | (B, 512) | bf16/fp16/fp32 | no | last-dim stride 1 |
    | `out_loc` | (B,) | int32/int64 | no | slot id in `[0, num_pages * page_size)`; `< 0` skips the row |
    | `kvcache` | (num_pages, page_bytes) | uint8 | **yes** | strides (page_bytes, 1); shares no byte with an input |
    | `page_size` | int | | | power of two |

    A row whose slot is out of range writes nothing (the CUDA kernel's rule).
    """
    codes, exponents = quantize_tiles_ue8m0(kv[:, :NOPE_DIM].float())
    scatter_flashmla_rows(kvcache, page_size, out_loc, codes, kv[:, NOPE_DIM:].to(torch.bfloat16), exponents)


def fused_q_indexer_rope_hadamard_quant_reference(
    q: torch.Tensor, weight: torch.Tensor, weight_scale: float, freqs: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Indexer query: RoPE of dims 64..127, 128-point Hadamard / sqrt(128), per-row FP8 with an fp32 scale.

    | arg | shape | dtype | mutated | notes |
    |---|---|---|---|---|
    | `q` | (B, H, 128) | bf16/fp16/fp32 | no | last-dim stride 1 |
    | `weight` | (B, H) | as `q` | no | any strides |
    | `weight_scale` | float | | | e.g. `128**-0.5 * H**-0.5` |
    | `freqs` | (max_pos, 64) | fp32 | no | |
    | `positions` | (B,) | int32/int64 | no | |
    | returns `q_fp8` | (B, H, 128) | float8_e4m3fn | new | `e4m3(y * r)`, `r = fp32(1 / scale)` |
    | returns `weights_out` | (B, H, 1) | fp32 | new | `weight * weight_scale * scale` |

    `scale = max(amax(|y|), 1e-4) / 448` (plain fp32, not a power of two); the codes are of the product `y * r`, not
    of `y / scale`, which can differ by one code where `y / scale` lies within an fp32 step of a rounding boundary. A
    token whose position is out of range gets zero codes and a zero weight in every head (the CUDA kernel's rule): it
    contributes nothing.
    """
    x = q.float()
    table, valid = rope_table_rows(freqs, positions)
    rope = apply_rope_interleaved(x[..., ROPE_DIM:], table[:, None, :])
    y = walsh_hadamard(torch.cat([x[..., :ROPE_DIM], rope], dim=-1)) * INDEXER_DIM**-0.5
    scale = finite_amax(y, -1, keepdim=True) / FP8_MAX
    codes = quantize_e4m3(y * torch.reciprocal(scale)).view(torch.uint8)
    q_fp8 = torch.where(valid[:, None, None], codes, 0).view(torch.float8_e4m3fn)
    weights_out = torch.where(valid[:, None, None], (weight.float() * weight_scale)[..., None] * scale, 0.0)
    return q_fp8, weights_out.contiguous()  # contiguous whatever `weight`'s strides, as the fake and CUDA allocate it


# ---------------------------------------------------------------------------------------------- registration


def _k_cpu(kv, weight, eps, freqs, positions, out_loc, kvcache, page_size) -> None:
    _check_k(kv, weight, eps, freqs, positions, out_loc, kvcache, page_size)
    _check_positions(freqs, positions)
    _check_slots(out_loc, kvcache, page_size)
    fused_k_norm_rope_flashmla_reference(kv, weight, eps, freqs, positions, out_loc, kvcache, page_size)


def _q_cpu(q, q_out, eps, freqs, positions) -> None:
    _check_q(q, q_out, eps, freqs, positions)
    _check_positions(freqs, positions)
    fused_q_norm_rope_reference(q, q_out, eps, freqs, positions)


def _inplace_cpu(kv, weight, eps, freqs, positions) -> None:
    _check_inplace(kv, weight, eps, freqs, positions)
    _check_positions(freqs, positions)
    fused_norm_rope_inplace_reference(kv, weight, eps, freqs, positions)


def _store_cpu(kv, out_loc, kvcache, page_size) -> None:
    _check_store(kv, out_loc, kvcache, page_size)
    _check_slots(out_loc, kvcache, page_size)
    store_flashmla_cache_reference(kv, out_loc, kvcache, page_size)


def _indexer_cpu(q, weight, weight_scale, freqs, positions) -> tuple[torch.Tensor, torch.Tensor]:
    _check_indexer(q, weight, weight_scale, freqs, positions)
    _check_positions(freqs, positions)
    return fused_q_indexer_rope_hadamard_quant_reference(q, weight, weight_scale, freqs, positions)


def _indexer_fake(q, weight, weight_scale, freqs, positions) -> tuple[torch.Tensor, torch.Tensor]:
    _check_indexer(q, weight, weight_scale, freqs, positions)
    b, h, _ = q.shape
    return q.new_empty((b, h, INDEXER_DIM), dtype=torch.float8_e4m3fn), q.new_empty((b, h, 1), dtype=torch.float32)


register_op(
    "fused_k_norm_rope_flashmla(Tensor kv, Tensor weight, float eps, Tensor freqs, Tensor positions, "
    "Tensor out_loc, Tensor(a!) kvcache, int page_size) -> ()",
    reference=_k_cpu,
    fake=_check_k,
)
register_op(
    "fused_q_norm_rope(Tensor q, Tensor(a!) q_out, float eps, Tensor freqs, Tensor positions) -> ()",
    reference=_q_cpu,
    fake=_check_q,
)
register_op(
    "fused_norm_rope_inplace(Tensor(a!) kv, Tensor weight, float eps, Tensor freqs, Tensor positions) -> ()",
    reference=_inplace_cpu,
    fake=_check_inplace,
)
register_op(
    "store_flashmla_cache(Tensor kv, Tensor out_loc, Tensor(a!) kvcache, int page_size) -> ()",
    reference=_store_cpu,
    fake=_check_store,
)
register_op(
    "fused_q_indexer_rope_hadamard_quant(Tensor q, Tensor weight, float weight_scale, Tensor freqs, "
    "Tensor positions) -> (Tensor, Tensor)",
    reference=_indexer_cpu,
    fake=_indexer_fake,
)
