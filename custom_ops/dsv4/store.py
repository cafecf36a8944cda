"""`compress_norm_rope_store`: RMSNorm -> RoPE -> FP8 store of compressed entries (docs/dsv4_compress.md).

Row i of `kv` (the output of a compress op) pairs with plan row i:
- prefill plans (CompressPlan): rows with `seq_len == 0xFFFFFFFF` are skipped; slot `out_loc[ragged_id]`;
- decode plans (DecodePlan): rows with `seq_len % ratio != 0`, `write_loc < 0` or `read_page_0 < 0` (padding)
  are skipped; slot `out_loc[i]`.
Slots `< 0` are skipped. The entry's RoPE position is `seq_len - ratio` (the first position of its window).
Rows with `seq_len < ratio` store nothing.

Index values (docs/contract.md): every `out_loc` entry must be `< pages * page_size` (a slot of `kvcache`), a
stored prefill row's `ragged_id` must be `< len(out_loc)`, and a stored row's RoPE position must be a row of
`freqs`. On CPU (and on CUDA in checking mode) the first violation raises `ValueError` before any byte is
written; the CUDA kernel skips the row (its slot is compared with the cache size before it is turned into a
byte offset, so a huge slot id can never land in another page). Lengths (structure, every device): a decode
`out_loc` has one entry per plan row, a prefill `out_loc` one per query token, so at least one per plan row (a
prefill plan has at most one row per query token); whether it covers every `ragged_id` is a value check.

Per entry (fp32): `y = x * nf * w` (RMSNorm, the numerics of `custom_ops.layouts.norm`), interleaved RoPE of
the last 64 dims with row `seq_len - ratio` of `freqs`, then by head dim:
- D = 512, FlashMLA V4 cache (`custom_ops.layouts.fp8`): the nope dims are rounded to bf16 and back, then
  quantized in 7 tiles of 64 with UE8M0 (rounded-up) scales; the RoPE dims are stored as bf16. 584 B/token.
- D = 128, indexer cache: 128-point Walsh-Hadamard transform times 1/sqrt(128), then
  - FP8 (default): e4m3 with one plain fp32 scale per token, `scale = max(amax, 1e-4) / 448`,
    `q = e4m3(y / scale)`. Page of `132 * page_size` bytes: codes at `off * 128`, scales at
    `128 * page_size + off * 4`;
  - FP4 (`fp4=True`): e2m1 codes with one UE8M0 exponent per 32 values (`custom_ops.layouts.fp4`). Page of
    `68 * page_size` bytes: codes at `off * 64`, exponents at `64 * page_size + off * 4`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from custom_ops._library import register_op
from custom_ops.checks import check_index_range, check_no_shared_memory, is_aligned
from custom_ops.dsv4.common import (
    check_device,
    check_index,
    check_plan,
    check_plan_field,
    check_ratio,
    check_rows,
    check_tensor,
    decode_emits,
    read_compress_plan,
    read_decode_plan,
)
from custom_ops.layouts.fp4 import quantize_groups_e2m1
from custom_ops.layouts.fp8 import (
    FP8_MAX,
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
from custom_ops.layouts.rope import apply_rope_interleaved

INDEXER_SCALE_BYTES = 4  # per token: one fp32 scale (FP8) or 4 UE8M0 exponents (FP4)


def indexer_page_bytes(page_size: int, fp4: bool = False) -> int:
    """Bytes per page of the indexer cache: per token 128 FP8 codes + an fp32 scale, or 64 bytes of FP4 codes +
    4 UE8M0 exponents."""
    return ((INDEXER_DIM // 2 if fp4 else INDEXER_DIM) + INDEXER_SCALE_BYTES) * page_size


def cache_page_bytes(head_dim: int, page_size: int, fp4: bool = False) -> int:
    """Row width of the cache `compress_norm_rope_store` writes for `head_dim` (512: FlashMLA, 128: indexer)."""
    if head_dim == 512:
        if fp4:
            raise ValueError("fp4: only the indexer cache (head_dim 128) has an FP4 layout")
        return flashmla_page_bytes(page_size)
    return indexer_page_bytes(page_size, fp4)


def compress_norm_rope_store(
    kv: torch.Tensor,
    plan: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    freqs: torch.Tensor,
    out_loc: torch.Tensor,
    kvcache: torch.Tensor,
    page_size: int,
    ratio: int,
    decode: bool,
    fp4: bool = False,
) -> None:
    """Normalize, rotate, quantize and store compressed entries into a paged FP8 (or FP4 indexer) cache.

    | arg | shape | dtype | mutated | notes |
    |---|---|---|---|---|
    | kv | [R, D] | fp32 | no | entries of a compress op; D = 512 (FlashMLA) or 128 (indexer) |
    | plan | [R, 16] | uint8 | no | the plan the entries came from (DecodePlan if `decode`, else CompressPlan) |
    | norm_weight | [D] | fp32 | no | RMSNorm weight |
    | eps | float | | | RMSNorm epsilon |
    | freqs | [max_pos, 64] | fp32 | no | interleaved cos/sin table (`custom_ops.layouts.rope.precompute_freqs`) |
    | out_loc | [N >= R] (prefill), [R] (decode) | int32/int64 | no | slot per query token / request; < 0 skips |
    | kvcache | [pages, page_bytes] | uint8 | yes | `cache_page_bytes(D, page_size, fp4)` bytes per row |
    | page_size | int | | | power of two |
    | ratio | int | | | 4 or 128 |
    | decode | bool | | | plan layout |
    | fp4 | bool | | | indexer only (D = 128): FP4 e2m1 codes with UE8M0 group scales instead of FP8 |
    """
    torch.ops.dspark.dsv4_compress_norm_rope_store(
        kv, plan, norm_weight, eps, freqs, out_loc, kvcache, page_size, ratio, decode, fp4
    )


def check_store_args(
    kv, plan, norm_weight, eps, freqs, out_loc, kvcache, page_size: int, ratio: int, decode: bool, fp4: bool
) -> int:
    """Structural checks of `dsv4_compress_norm_rope_store` (CPU and fake impls); returns the head dim D."""
    check_ratio(ratio)
    check_tensor("kv", kv, (torch.float32,))
    if kv.dim() != 2 or kv.shape[1] not in (INDEXER_DIM, 512):
        raise ValueError(f"kv: expected shape [rows, 128 or 512], got {tuple(kv.shape)}")
    if not kv.is_contiguous():
        raise ValueError("kv: expected a contiguous tensor")
    d = kv.shape[1]
    if fp4 and d != INDEXER_DIM:
        raise ValueError(f"fp4: only the indexer store (kv of width {INDEXER_DIM}) has an FP4 layout, got width {d}")
    dev = kv.device
    check_plan("plan", plan, 16, dev)
    check_rows("plan", plan, kv.shape[0], "one per kv row")
    check_tensor("norm_weight", norm_weight, (torch.float32,))
    if tuple(norm_weight.shape) != (d,) or not norm_weight.is_contiguous():
        raise ValueError(f"norm_weight: expected a contiguous [{d}] tensor, got shape {tuple(norm_weight.shape)}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps: expected a finite float >= 0, got {eps}")
    check_tensor("freqs", freqs, (torch.float32,))
    if freqs.dim() != 2 or freqs.shape[1] != ROPE_DIM or not freqs.is_contiguous():
        raise ValueError(f"freqs: expected a contiguous fp32 [max_pos, {ROPE_DIM}] table, got {tuple(freqs.shape)}")
    check_index("out_loc", out_loc, 1)
    if decode and out_loc.shape[0] != kv.shape[0]:
        raise ValueError(f"out_loc: expected {kv.shape[0]} entries (one per plan row), got {out_loc.shape[0]}")
    if not decode and out_loc.shape[0] < kv.shape[0]:
        raise ValueError(
            f"out_loc: expected at least {kv.shape[0]} entries (one per query token; a prefill plan has at most one "
            f"row per query token), got {out_loc.shape[0]}"
        )
    if isinstance(page_size, bool) or page_size < 1 or page_size & (page_size - 1):
        raise ValueError(f"page_size: expected a power of two, got {page_size}")
    width = cache_page_bytes(d, page_size, fp4)
    check_tensor("kvcache", kvcache, (torch.uint8,))
    if kvcache.dim() != 2 or kvcache.shape[1] != width or not kvcache.is_contiguous():
        raise ValueError(f"kvcache: expected a contiguous uint8 [pages, {width}] tensor, got {tuple(kvcache.shape)}")
    for name, t in (("norm_weight", norm_weight), ("freqs", freqs), ("out_loc", out_loc), ("kvcache", kvcache)):
        check_device(name, t, dev)
    for name, t in (("kv", kv), ("norm_weight", norm_weight), ("freqs", freqs)):
        if not is_aligned(t, 16):
            raise ValueError(f"{name}: expected a 16-byte aligned tensor")
    if not is_aligned(kvcache, 4):
        raise ValueError("kvcache: expected a 4-byte aligned tensor")
    inputs = (("kv", kv), ("plan", plan), ("norm_weight", norm_weight), ("freqs", freqs), ("out_loc", out_loc))
    check_no_shared_memory("kvcache", kvcache, inputs)
    return d


class StoredRows(NamedTuple):
    """Plan rows that hold an entry to store (`valid`), the `out_loc` index of each row and its seq_len."""

    valid: torch.Tensor
    source: torch.Tensor
    seq_len: torch.Tensor


def stored_rows(plan: torch.Tensor, ratio: int, decode: bool) -> StoredRows:
    if decode:
        p = read_decode_plan(plan)
        valid = decode_emits(p, ratio)
        source = torch.arange(plan.shape[0], device=plan.device)
    else:
        p = read_compress_plan(plan)
        valid, source = p.valid, p.ragged_id
    return StoredRows(valid & (p.seq_len >= ratio), source, p.seq_len)


def row_slots(rows: StoredRows, out_loc: torch.Tensor) -> torch.Tensor:
    """The `out_loc` entry of every plan row (int64; -1 where the row has none)."""
    if out_loc.shape[0] == 0:
        return torch.full_like(rows.source, -1)
    return out_loc.long()[rows.source.clamp(0, out_loc.shape[0] - 1)]


def check_store_values(
    plan: torch.Tensor, out_loc: torch.Tensor, max_pos: int, pages: int, page_size: int, ratio: int, decode: bool
) -> None:
    """Raise `ValueError` for the first `out_loc` entry outside the cache, then for the first plan row with an entry
    whose `out_loc` index does not exist, then for the first row that stores (slot >= 0) at a RoPE position that is
    not a row of `freqs`."""
    slots = pages * page_size
    check_index_range("out_loc", out_loc, slots, f"expected < {slots} ({pages} pages of {page_size} slots in kvcache)")
    rows = stored_rows(plan, ratio, decode)
    entries = out_loc.shape[0]
    check_plan_field(
        "plan",
        "ragged_id",
        rows.source,
        rows.valid & (rows.source >= entries),
        f"expected < {entries} (entries of out_loc)",
    )
    stores = rows.valid & (row_slots(rows, out_loc) >= 0)
    check_plan_field(
        "plan",
        "seq_len",
        rows.seq_len,
        stores & (rows.seq_len - ratio >= max_pos),
        f"expected <= {max_pos - 1 + ratio} (the RoPE position seq_len - {ratio} must be a row of freqs)",
    )


def _scatter_indexer(kvcache: torch.Tensor, page_size: int, loc: torch.Tensor, codes: torch.Tensor, scales):
    """Write each token's code bytes at `off * C` and its 4 scale bytes at `C * page_size + off * 4` of its page."""
    flat = kvcache.view(-1)
    codes, scales = codes.view(torch.uint8), scales.contiguous().view(torch.uint8)
    code_bytes = codes.shape[1]
    page, off = loc // page_size, loc % page_size
    base = page * (code_bytes + INDEXER_SCALE_BYTES) * page_size
    value = base[:, None] + off[:, None] * code_bytes + torch.arange(code_bytes, device=loc.device)
    scale_at = base[:, None] + code_bytes * page_size + off[:, None] * INDEXER_SCALE_BYTES
    flat[value.reshape(-1)] = codes.reshape(-1)
    flat[(scale_at + torch.arange(INDEXER_SCALE_BYTES, device=loc.device)).reshape(-1)] = scales.reshape(-1)


def _store_cpu(kv, plan, norm_weight, eps, freqs, out_loc, kvcache, page_size, ratio, decode, fp4=False):
    d = check_store_args(kv, plan, norm_weight, eps, freqs, out_loc, kvcache, page_size, ratio, decode, fp4)
    check_store_values(plan, out_loc, freqs.shape[0], kvcache.shape[0], page_size, ratio, decode)
    plan_rows = stored_rows(plan, ratio, decode)
    loc = row_slots(plan_rows, out_loc)
    rows = (plan_rows.valid & (loc >= 0)).nonzero().squeeze(1)
    if rows.numel() == 0:
        return
    loc, pos = loc[rows], plan_rows.seq_len[rows] - ratio
    x = kv[rows]
    y = x * rms_norm_factor(x, eps) * norm_weight
    rope = apply_rope_interleaved(y[:, d - ROPE_DIM :], freqs[pos])
    if d == 512:
        codes, exponents = quantize_tiles_ue8m0(y[:, :NOPE_DIM].bfloat16().float())
        scatter_flashmla_rows(kvcache, page_size, loc, codes, rope.bfloat16(), exponents)
        return
    y = walsh_hadamard(torch.cat([y[:, : d - ROPE_DIM], rope], 1)) * INDEXER_DIM**-0.5
    if fp4:
        _scatter_indexer(kvcache, page_size, loc, *quantize_groups_e2m1(y))
        return
    scale = finite_amax(y, 1, keepdim=True) / FP8_MAX
    _scatter_indexer(kvcache, page_size, loc, quantize_e4m3(y / scale), scale)


def _store_fake(kv, plan, norm_weight, eps, freqs, out_loc, kvcache, page_size, ratio, decode, fp4=False):
    check_store_args(kv, plan, norm_weight, eps, freqs, out_loc, kvcache, page_size, ratio, decode, fp4)


register_op(
    "dsv4_compress_norm_rope_store(Tensor kv, Tensor plan, Tensor norm_weight, float eps, Tensor freqs, "
    "Tensor out_loc, Tensor(a!) kvcache, int page_size, int ratio, bool decode, bool fp4=False) -> ()",
    reference=_store_cpu,
    fake=_store_fake,
)
