"""FP8 e4m3 / UE8M0 scale math and the FlashMLA "V4" paged KV-cache byte layout (pure torch, any device).

This module is the single source of truth for the quantization and the byte layout; the CPU references of
`custom_ops.flashmla.writes` and of the DeepSeek-V4 compressor store build on it. Names and semantics are stable.

Layout of one token (584 payload bytes, two regions of its page), `page_bytes = flashmla_page_bytes(page_size)`:

| bytes (relative to the page)            | content                                                     |
|-----------------------------------------|-------------------------------------------------------------|
| `o*576 + [0, 448)`                      | 448 fp8 e4m3fn codes of the nope dims 0..447                |
| `o*576 + [448, 576)`                    | 64 bf16 (little endian) RoPE values, dims 448..511          |
| `page_size*576 + o*8 + [0, 7)`          | 7 UE8M0 exponents, one per 64-wide nope tile                |
| `page_size*576 + o*8 + 7`               | padding, never written                                      |
| `[page_size*584, page_bytes)`           | page tail padding (pages are padded to a multiple of 576)   |

with slot `loc`, `page = loc // page_size`, `o = loc % page_size`; the page is row `page` of the 2-D uint8 cache.
Valid slots are `[0, num_pages * page_size)`; a slot is compared with that capacity before it is turned into a
byte offset (int64), so no slot id can overflow into another page. Negative slots mean "skip this row".

Scale rule (UE8M0, exponent rounded UP): per tile `sraw = max(amax, 1e-4) / 448` (fp32), exponent byte
`e = biased_exponent(sraw) + (mantissa(sraw) != 0)`, so `2^(e-127) >= sraw`; codes are
`e4m3_rne_satfinite(y * 2^(127-e))`. Decoding: `code * 2^(e-127)` for the nope dims, bf16 for the rope dims.

Non-finite values (`finite_amax`, every quantizer of the package, CPU and CUDA alike): the amax leaves a NaN out and
counts an infinity as the largest finite fp32, so every scale is finite and no finite value changes sign (an
infinity's tile is scaled by about 2^120, its finite values coded as zeros); an infinity is coded as the largest code
of its sign (+-448 here) and a NaN as the positive e4m3 NaN (0x7F).
"""

import torch

from custom_ops.checks import check_index_range

HEAD_DIM = 512
NOPE_DIM = 448
ROPE_DIM = 64
TILE = 64
NUM_TILES = NOPE_DIM // TILE
VALUE_BYTES = 576
SCALE_BYTES = 8
TOKEN_BYTES = VALUE_BYTES + SCALE_BYTES
INDEXER_DIM = 128  # the indexer's K width (FlashMLA indexer quantization, DeepSeek-V4 indexer store)
FP8_MAX = 448.0
AMAX_FLOOR = 1e-4
MAX_PAGE_SIZE = 1 << 30

__all__ = [
    "AMAX_FLOOR",
    "FP8_MAX",
    "HEAD_DIM",
    "MAX_PAGE_SIZE",
    "NOPE_DIM",
    "NUM_TILES",
    "ROPE_DIM",
    "SCALE_BYTES",
    "TILE",
    "TOKEN_BYTES",
    "VALUE_BYTES",
    "dequantize_flashmla_cache",
    "finite_amax",
    "flashmla_page_bytes",
    "flashmla_slot_offsets",
    "quantize_e4m3",
    "quantize_tiles_ue8m0",
    "scatter_flashmla_rows",
    "ue8m0_exponent",
    "ue8m0_inverse_scale",
    "ue8m0_scale",
]


def _check_page_size(page_size: int) -> None:
    if isinstance(page_size, bool) or not isinstance(page_size, int):
        raise TypeError(f"page_size must be an int, got {type(page_size).__name__}")
    if page_size < 1 or page_size > MAX_PAGE_SIZE or page_size & (page_size - 1):
        raise ValueError(f"page_size must be a power of two in [1, 2**30], got {page_size}")


def flashmla_page_bytes(page_size: int) -> int:
    """Bytes per page of the V4 layout: `ceil(584 * page_size / 576) * 576` (256 -> 149,760; 64 -> 37,440)."""
    _check_page_size(page_size)
    return -(-TOKEN_BYTES * page_size // VALUE_BYTES) * VALUE_BYTES


def ue8m0_exponent(scale: torch.Tensor) -> torch.Tensor:
    """Biased UE8M0 exponent (int32) of positive fp32 `scale`, rounded up: `2^(e-127) >= scale`."""
    bits = scale.to(torch.float32).view(torch.int32)
    return ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)


def ue8m0_inverse_scale(exponent: torch.Tensor) -> torch.Tensor:
    """`2^(127-e)` as fp32 (exact reciprocal of the scale), for integer exponents 1..253."""
    return ((254 - exponent.to(torch.int32)) << 23).view(torch.float32)


def ue8m0_scale(exponent: torch.Tensor) -> torch.Tensor:
    """`2^(e-127)` as fp32, for integer exponents 1..254 (what FlashMLA reads as float8_e8m0fnu)."""
    return (exponent.to(torch.int32) << 23).view(torch.float32)


def finite_amax(x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    """`max(amax(|x|), 1e-4)` over `dim` (fp32), the amax every quantizer scales by: a NaN counts as 0 and an
    infinity as the largest finite fp32 (the kernels' `fmaxf` reduction, then `clamp_amax`)."""
    return x.to(torch.float32).abs().nan_to_num(nan=0.0).amax(dim, keepdim=keepdim).clamp(min=AMAX_FLOOR)


def quantize_e4m3(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn, round to nearest even, saturating to +-448 (infinities too); a NaN of either sign
    becomes the positive NaN code 0x7F, as the CUDA conversion writes it."""
    x = x.to(torch.float32)
    return torch.where(x.isnan(), x.abs(), x.clamp(-FP8_MAX, FP8_MAX)).to(torch.float8_e4m3fn)


def quantize_tiles_ue8m0(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `y` (N, 448) fp32 in 7 tiles of 64 with UE8M0 scales.

    Returns `(codes, exponents)`: uint8 (N, 448) e4m3fn bit patterns and uint8 (N, 7) biased exponents.
    """
    n = y.shape[0]
    tiles = y.to(torch.float32).reshape(n, NUM_TILES, TILE)
    exponent = ue8m0_exponent(finite_amax(tiles, -1) / FP8_MAX)
    codes = quantize_e4m3(tiles * ue8m0_inverse_scale(exponent)[..., None])
    return codes.view(torch.uint8).reshape(n, NOPE_DIM), exponent.to(torch.uint8)


def flashmla_slot_offsets(slots: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat byte offsets (int64) of the value slot and of the scale slot of each slot id.

    Every slot must lie in `[0, num_pages * page_size)` of the cache it addresses (mask others first, as
    `scatter_flashmla_rows` does): a larger id gives an offset outside the cache or, past 2**63, a wrapped one."""
    page_bytes = flashmla_page_bytes(page_size)
    slots = slots.to(torch.int64)
    page = torch.div(slots, page_size, rounding_mode="floor")
    offset = slots - page * page_size
    page_base = page * page_bytes
    return page_base + offset * VALUE_BYTES, page_base + page_size * VALUE_BYTES + offset * SCALE_BYTES


def scatter_flashmla_rows(
    kvcache: torch.Tensor,
    page_size: int,
    out_loc: torch.Tensor,
    codes: torch.Tensor,
    rope_bf16: torch.Tensor,
    exponents: torch.Tensor,
) -> None:
    """Write N tokens into `kvcache` (num_pages, page_bytes) uint8 in place; a row whose slot is outside
    `[0, num_pages * page_size)` (negative: the skip sentinel; too large: out of range) is skipped.

    `codes` uint8 (N, 448), `rope_bf16` bf16 (N, 64), `exponents` uint8 (N, 7). Exactly 583 bytes per written token
    change; nothing else does. The slot is compared with the capacity before any offset is computed, so a huge slot
    id cannot wrap into another page. No host sync: skipped rows are routed to the never-written scale padding byte
    of slot 0 (they write back the byte that is already there), so the index set has a static shape. This is the
    CUDA kernels' skip rule; the ops' CPU paths raise for out-of-range slots before calling it.
    """
    n = out_loc.shape[0]
    if n == 0 or kvcache.numel() == 0:
        return
    flat = kvcache.view(-1)
    slots = out_loc.to(torch.int64)
    keep = (slots >= 0) & (slots < kvcache.shape[0] * page_size)
    value_base, scale_base = flashmla_slot_offsets(torch.where(keep, slots, 0), page_size)
    dummy = page_size * VALUE_BYTES + SCALE_BYTES - 1
    payload = torch.cat([codes, rope_bf16.contiguous().view(torch.uint8), exponents], dim=1)
    dev = out_loc.device
    index = torch.cat(
        [
            value_base[:, None] + torch.arange(VALUE_BYTES, device=dev),
            scale_base[:, None] + torch.arange(NUM_TILES, device=dev),
        ],
        dim=1,
    )
    index = torch.where(keep[:, None], index, dummy)
    payload = torch.where(keep[:, None], payload, flat[dummy])
    flat.index_put_((index.reshape(-1),), payload.reshape(-1))


def dequantize_flashmla_cache(kvcache: torch.Tensor, page_size: int, slots: torch.Tensor) -> torch.Tensor:
    """Decode the tokens at `slots` (N,) int32 / int64 of a V4 cache to fp32 (N, 512): nope codes times
    `2^(e-127)`, rope as the stored bf16 values. Every slot must lie in `[0, num_pages * page_size)` (`ValueError`
    otherwise; a debugging helper, so it reads the slots on the host)."""
    if kvcache.dtype != torch.uint8 or kvcache.dim() != 2:
        raise TypeError(f"kvcache must be a 2-D uint8 tensor, got {kvcache.dtype} with {kvcache.dim()} dims")
    if kvcache.shape[1] != flashmla_page_bytes(page_size):
        raise ValueError(
            f"kvcache rows must be {flashmla_page_bytes(page_size)} bytes for page_size={page_size}, "
            f"got {kvcache.shape[1]}"
        )
    if not isinstance(slots, torch.Tensor) or slots.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"slots must be an int32 or int64 tensor, got {getattr(slots, 'dtype', type(slots).__name__)}")
    if slots.dim() != 1:
        raise ValueError(f"slots must have shape (N,), got {tuple(slots.shape)}")
    capacity = kvcache.shape[0] * page_size
    check_index_range("slots", slots, capacity, f"slots must be in [0, {capacity}) of this cache", negative_skips=False)
    flat = kvcache.reshape(-1)
    value_base, scale_base = flashmla_slot_offsets(slots, page_size)
    dev = kvcache.device
    values = flat[value_base[:, None] + torch.arange(VALUE_BYTES, device=dev)]
    exponents = flat[scale_base[:, None] + torch.arange(NUM_TILES, device=dev)]
    n = values.shape[0]
    nope = values[:, :NOPE_DIM].view(torch.float8_e4m3fn).float().reshape(n, NUM_TILES, TILE)
    nope = (nope * ue8m0_scale(exponents)[..., None]).reshape(n, NOPE_DIM)
    rope = values[:, NOPE_DIM:].contiguous().view(torch.bfloat16).float()
    return torch.cat([nope, rope], dim=1)
