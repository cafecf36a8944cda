"""`compress_norm_rope_store`: RMSNorm -> RoPE -> FP8 store of compressed entries (spec §6).

Row i of `kv` (the output of a compress op) pairs with plan row i:
- prefill plans (CompressPlan): rows with `seq_len == 0xFFFFFFFF` are skipped; slot `out_loc[ragged_id]`;
- decode plans (DecodePlan): rows with `seq_len % ratio != 0`, `write_loc < 0` or `read_page_0 < 0` (padding)
  are skipped; slot `out_loc[i]`.
Slots `< 0` are skipped. The entry's RoPE position is `seq_len - ratio` (the first position of its window).

Per entry (fp32): `y = x * nf * w` (RMSNorm, the numerics of `custom_ops.flashmla_writes`), interleaved RoPE of
the last 64 dims with row `seq_len - ratio` of `freqs`, then by head dim:
- D = 512, FlashMLA V4 cache (`custom_ops.fp8_layout`): the nope dims are rounded to bf16 and back, then
  quantized in 7 tiles of 64 with UE8M0 (rounded-up) scales; the RoPE dims are stored as bf16. 584 B/token.
- D = 128, indexer cache: 128-point Walsh-Hadamard transform times 1/sqrt(128), then
  - FP8 (default): e4m3 with one plain fp32 scale per token, `scale = max(amax, 1e-4) / 448`,
    `q = e4m3(y / scale)`. Page of `132 * page_size` bytes: codes at `off * 128`, scales at
    `128 * page_size + off * 4`;
  - FP4 (`fp4=True`): e2m1 codes with one UE8M0 exponent per 32 values (`custom_ops.fp4_layout`). Page of
    `68 * page_size` bytes: codes at `off * 64`, exponents at `64 * page_size + off * 4`.
"""

from __future__ import annotations

import torch

from custom_ops import _build
from custom_ops._library import LIB
from custom_ops.dsv4_compress_common import (
    check_device,
    check_matrix,
    check_plan,
    read_compress_plan,
    read_decode_plan,
)
from custom_ops.flashmla_writes import rms_norm_factor, walsh_hadamard
from custom_ops.fp4_layout import quantize_groups_e2m1
from custom_ops.fp8_layout import (
    AMAX_FLOOR,
    FP8_MAX,
    NOPE_DIM,
    ROPE_DIM,
    flashmla_page_bytes,
    quantize_e4m3,
    quantize_tiles_ue8m0,
    scatter_flashmla_rows,
)
from custom_ops.rope import apply_rope_interleaved

INDEXER_DIM = 128
INDEXER_SCALE_BYTES = 4  # per token: one fp32 scale (FP8) or 4 UE8M0 exponents (FP4)

LIB.define(
    "dsv4_compress_norm_rope_store(Tensor kv, Tensor plan, Tensor norm_weight, float eps, Tensor freqs, "
    "Tensor out_loc, Tensor(a!) kvcache, int page_size, int ratio, bool decode, bool fp4=False) -> ()"
)


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
    | freqs | [max_pos, 64] | fp32 | no | interleaved cos/sin table (`custom_ops.rope.precompute_freqs`) |
    | out_loc | [N] (prefill) or [R] (decode) | int32/int64 | no | cache slot per query token / request; < 0 skips |
    | kvcache | [pages, page_bytes] | uint8 | yes | `cache_page_bytes(D, page_size, fp4)` bytes per row |
    | page_size | int | | | power of two |
    | ratio | int | | | 4 or 128 |
    | decode | bool | | | plan layout |
    | fp4 | bool | | | indexer only (D = 128): FP4 e2m1 codes with UE8M0 group scales instead of FP8 |
    """
    torch.ops.dspark.dsv4_compress_norm_rope_store(
        kv, plan, norm_weight, eps, freqs, out_loc, kvcache, page_size, ratio, decode, fp4
    )


def _check(kv, plan, norm_weight, freqs, out_loc, kvcache, page_size, ratio, fp4) -> int:
    if ratio not in (4, 128):
        raise ValueError(f"ratio: expected 4 or 128, got {ratio}")
    if not isinstance(kv, torch.Tensor) or kv.dim() != 2 or kv.shape[1] not in (INDEXER_DIM, 512):
        raise ValueError(f"kv: expected shape [rows, 128 or 512], got {tuple(getattr(kv, 'shape', ()))}")
    d = kv.shape[1]
    if fp4 and d != INDEXER_DIM:
        raise ValueError(f"fp4: only the indexer store (kv of width {INDEXER_DIM}) has an FP4 layout, got width {d}")
    check_matrix("kv", kv, d, (torch.float32,))
    dev = kv.device
    check_plan("plan", plan, 16, dev)
    if plan.shape[0] != kv.shape[0]:
        raise ValueError(f"plan: expected {kv.shape[0]} rows (one per kv row), got {plan.shape[0]}")
    if norm_weight.dtype != torch.float32 or tuple(norm_weight.shape) != (d,):
        raise ValueError(f"norm_weight: expected fp32 [{d}], got {norm_weight.dtype} {tuple(norm_weight.shape)}")
    if freqs.dtype != torch.float32 or freqs.dim() != 2 or freqs.shape[1] != ROPE_DIM or not freqs.is_contiguous():
        raise ValueError(f"freqs: expected a contiguous fp32 [max_pos, {ROPE_DIM}] table, got {tuple(freqs.shape)}")
    if out_loc.dtype not in (torch.int32, torch.int64) or out_loc.dim() != 1:
        raise TypeError(f"out_loc: expected a 1-D int32/int64 tensor, got {out_loc.dtype} {tuple(out_loc.shape)}")
    if isinstance(page_size, bool) or page_size < 1 or page_size & (page_size - 1):
        raise ValueError(f"page_size: expected a power of two, got {page_size}")
    width = cache_page_bytes(d, page_size, fp4)
    if kvcache.dtype != torch.uint8 or kvcache.dim() != 2 or kvcache.shape[1] != width:
        raise ValueError(f"kvcache: expected uint8 [pages, {width}], got {kvcache.dtype} {tuple(kvcache.shape)}")
    if not kvcache.is_contiguous():
        raise ValueError("kvcache: expected a contiguous tensor")
    for name, t in (("norm_weight", norm_weight), ("freqs", freqs), ("out_loc", out_loc), ("kvcache", kvcache)):
        check_device(name, t, dev)
    return d


def _rows_to_store(plan, out_loc, ratio: int, decode: bool):
    """Indices of the rows to store, their slots and RoPE positions (CPU: data-dependent shapes are fine)."""
    if decode:
        p = read_decode_plan(plan)
        ok = p.valid & (p.seq_len % ratio == 0) & (p.read_page_0 >= 0) & (p.seq_len >= ratio)
        ok = ok & (torch.arange(plan.shape[0], device=plan.device) < out_loc.shape[0])
        src = torch.arange(plan.shape[0], device=plan.device)
    else:
        p = read_compress_plan(plan)
        ok = p.valid & (p.ragged_id < out_loc.shape[0]) & (p.seq_len >= ratio)
        src = p.ragged_id
    loc = out_loc.long()[src.clamp(0, max(out_loc.shape[0] - 1, 0))] if out_loc.numel() else src
    ok = ok & (loc >= 0)
    rows = ok.nonzero().squeeze(1)
    return rows, loc[rows], p.seq_len[rows] - ratio


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


@torch.library.impl(LIB, "dsv4_compress_norm_rope_store", "CPU")
def _store_cpu(kv, plan, norm_weight, eps, freqs, out_loc, kvcache, page_size, ratio, decode, fp4=False):
    d = _check(kv, plan, norm_weight, freqs, out_loc, kvcache, page_size, ratio, fp4)
    rows, loc, pos = _rows_to_store(plan, out_loc, ratio, decode)
    x = kv[rows].float()
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
    scale = y.abs().amax(1, keepdim=True).clamp(min=AMAX_FLOOR) / FP8_MAX
    _scatter_indexer(kvcache, page_size, loc, quantize_e4m3(y / scale), scale)


@torch.library.register_fake("dspark::dsv4_compress_norm_rope_store")
def _store_fake(kv, plan, norm_weight, eps, freqs, out_loc, kvcache, page_size, ratio, decode, fp4=False):
    _check(kv, plan, norm_weight, freqs, out_loc, kvcache, page_size, ratio, fp4)


_build.register_cuda_entry(LIB, "dsv4_compress_norm_rope_store")
