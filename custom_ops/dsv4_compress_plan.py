"""Planners for the DeepSeek-V4 KV compressor: decode and prefill/extend plans as device tensors.

Plans use the binary layouts of spec §4.1 (little-endian, stored as uint8 tensors):

| struct | bytes | fields |
|---|---|---|
| DecodePlan | 16 | `u32 seq_len, i32 write_loc, i32 read_page_0, i32 read_page_1` |
| CompressPlan | 16 | `u32 seq_len, u16 ragged_id, u16 buffer_len, i32 read_page_0, i32 read_page_1` |
| WritePlan | 8 | `u32 ragged_id, i32 write_loc` |

Invalid rows: DecodePlan `{0xFFFFFFFF, -1, -1, -1}`, CompressPlan `{0xFFFFFFFF, 0, 0, -1, -1}`, WritePlan
`{0xFFFFFFFF, -1}`. Every consumer skips them, so plans can be padded to sizes known from input shapes alone.

State addressing (`state_loc(rid, pos)`, a row of the flat state buffer; page = row // ratio):
- ring (per-request ring, the default when `req_to_token` is None): `rid * ring_size + pos % ring_size`.
  With `ring_size = window` (8 for c4, 128 for c128) this is the spec's "legacy" addressing.
- paged (SWA-page rings): `swa = full_to_state[req_to_token[rid, pos]]`,
  `(swa // swa_page_size) * ring_size + swa % ring_size`.

Plans are built with sync-free, fixed-shape torch ops (CompositeExplicitAutograd), so the same implementation
serves CPU and CUDA tensors and can be captured in a CUDA graph; once the CUDA library is loaded, every
planner runs as one kernel launch (`csrc/dsv4_compress_plan.cu`) that writes the same bytes.

Prefill plans are compact (valid rows first, in token order: batch-major, positions ascending) and padded with
invalid rows to `min(N, N // ratio + B)` compress rows (an upper bound on the number of windows that can close)
and `N` write rows, where `N = num_q_tokens` and `B = seq_lens.numel()`. Query tokens past `sum(extend_lens)`,
and requests with a negative `req_pool_indices` entry, produce no rows.

Online c128 plans (spec §7): one state slot per request (`slot = req_pool_indices[b]`). Decode:
`{seq_len, slot, slot, -1}`. Prefill: each request's extend range is split into chunk-aligned segments; a
segment that closes a 128-chunk gives a CompressPlan row in `plan_c`, the trailing partial segment one in
`plan_w`; both carry `(seq_len = last position + 1, ragged_id = last token, buffer_len = segment length,
read_page_0 = slot, read_page_1 = -1)`. Sizes: `min(N, N // 128 + B)` and `min(N, B)` rows.
"""

from __future__ import annotations

import torch

from custom_ops._library import LIB

INVALID_U32 = -1  # 0xFFFFFFFF stored in an int32 field
MAX_RAGGED = 65535  # ragged ids are u16 in CompressPlan
ONLINE_RATIO = 128

LIB.define(
    "dsv4_plan_decode(Tensor seq_lens, Tensor req_pool_indices, Tensor? req_to_token, "
    "Tensor? full_to_state, int ratio, int ring_size, int swa_page_size=0) -> Tensor"
)
LIB.define(
    "dsv4_plan_prefill(Tensor seq_lens, Tensor extend_lens, Tensor req_pool_indices, Tensor? req_to_token, "
    "Tensor? full_to_state, int ratio, int ring_size, int swa_page_size, SymInt num_q_tokens) -> (Tensor, Tensor)"
)
LIB.define("dsv4_plan_online_decode(Tensor seq_lens, Tensor req_pool_indices) -> Tensor")
LIB.define(
    "dsv4_plan_online_prefill(Tensor seq_lens, Tensor extend_lens, Tensor req_pool_indices, "
    "SymInt num_q_tokens) -> (Tensor, Tensor)"
)


def window_of(ratio: int) -> int:
    """Number of window slots of one compressed entry: 8 for c4 (overlap), 128 for c128."""
    return 2 * ratio if ratio == 4 else ratio


def compress_rows_bound(num_q_tokens: int | torch.SymInt, batch: int | torch.SymInt, ratio: int):
    """Rows of a padded prefill compress plan: an upper bound on the windows closed by `num_q_tokens` tokens."""
    return torch.sym_min(num_q_tokens, num_q_tokens // ratio + batch)


def _check_ratio(ratio: int) -> None:
    if ratio not in (4, 128):
        raise ValueError(f"ratio: expected 4 or 128, got {ratio}")


def _check_index(name: str, t: torch.Tensor, ndim: int = 1) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name}: expected int32 or int64, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim}-D, got shape {tuple(t.shape)}")


def _check_addressing(
    batch: int,
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor | None,
    full_to_state: torch.Tensor | None,
    ratio: int,
    ring_size: int,
    swa_page_size: int,
) -> None:
    _check_ratio(ratio)
    _check_index("req_pool_indices", req_pool_indices)
    if req_pool_indices.shape[0] != batch:
        raise ValueError(
            f"req_pool_indices: expected {batch} entries (one per seq_lens entry), got {req_pool_indices.shape[0]}"
        )
    if ring_size < window_of(ratio) or ring_size % ratio:
        raise ValueError(f"ring_size: expected a multiple of {ratio} that is >= {window_of(ratio)}, got {ring_size}")
    if (req_to_token is None) != (full_to_state is None):
        raise ValueError("req_to_token/full_to_state: pass both (paged addressing) or neither (ring addressing)")
    if req_to_token is not None:
        _check_index("req_to_token", req_to_token, 2)
        _check_index("full_to_state", full_to_state)
        if swa_page_size <= 0 or swa_page_size % ring_size:
            raise ValueError(
                f"swa_page_size: expected a positive multiple of ring_size={ring_size}, got {swa_page_size}"
            )


def _state_loc(
    rid: torch.Tensor,
    pos: torch.Tensor,
    ok: torch.Tensor,
    req_to_token: torch.Tensor | None,
    full_to_state: torch.Tensor | None,
    ring_size: int,
    swa_page_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """State row of (rid, pos) as int64, and the updated validity mask (positions outside `req_to_token` and
    unmapped SWA slots are invalid).

    Entries where `ok` is False are clamped to safe indices and must be ignored by the caller.
    """
    if req_to_token is None:
        return rid * ring_size + pos % ring_size, ok
    ok = ok & (rid < req_to_token.shape[0]) & (pos < req_to_token.shape[1])
    r = torch.where(ok, rid, 0).clamp(0, req_to_token.shape[0] - 1)
    p = torch.where(ok, pos, 0).clamp(0, req_to_token.shape[1] - 1)
    full = req_to_token[r, p].long()
    full_ok = (full >= 0) & (full < full_to_state.shape[0])
    swa = full_to_state[full.clamp(0, full_to_state.shape[0] - 1)].long()
    ok = ok & full_ok & (swa >= 0)
    return (swa // swa_page_size) * ring_size + swa % ring_size, ok


def _pack_rows(fields: list[torch.Tensor], valid: torch.Tensor, invalid: list[int]) -> torch.Tensor:
    """Stack int64 fields into int32 rows; rows where `valid` is False get the `invalid` pattern."""
    return torch.stack([torch.where(valid, f, v).to(torch.int32) for f, v in zip(fields, invalid, strict=True)], 1)


def _compact(rows: torch.Tensor, valid: torch.Tensor, out_rows, invalid: list[int]) -> torch.Tensor:
    """Move valid rows to the front (stable), pad with invalid rows to `out_rows`; returns uint8 bytes."""
    n = rows.shape[0]
    dest = torch.where(valid, torch.cumsum(valid.to(torch.int64), 0) - 1, n)
    dest = torch.where(dest < out_rows, dest, n)
    out = torch.stack([torch.full((n + 1,), v, dtype=torch.int32, device=rows.device) for v in invalid], 1)
    out.index_copy_(0, dest, rows)
    return out[:out_rows].contiguous().view(torch.uint8)


def _ragged_tokens(seq_lens: torch.Tensor, extend_lens: torch.Tensor, num_q_tokens: int):
    """Per query token t < num_q_tokens: batch id, offset j in its extend, position, and validity."""
    seq = seq_lens.long()
    ext = extend_lens.long()
    batch = seq.shape[0]
    ends = torch.cumsum(ext, 0)
    t = torch.arange(num_q_tokens, device=seq.device)
    b = torch.searchsorted(ends, t, right=True)
    valid = b < batch
    bc = b.clamp(max=max(batch - 1, 0))
    j = t - (ends[bc] - ext[bc]) if batch else t
    pos = seq[bc] - ext[bc] + j if batch else t
    return t, bc, j, pos, valid


def plan_decode(
    seq_lens: torch.Tensor,
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor | None,
    full_to_state: torch.Tensor | None,
    ratio: int,
    ring_size: int,
    swa_page_size: int = 0,
) -> torch.Tensor:
    """Decode plan, one DecodePlan row per request (uint8 `[B, 16]`).

    | arg | shape | dtype | notes |
    |---|---|---|---|
    | seq_lens | [B] | int32/int64 | length including the new token; <= 0 marks a padded row |
    | req_pool_indices | [B] | int32/int64 | request id; negative marks a padded row |
    | req_to_token | [R, max_ctx] or None | int32/int64 | paged addressing: token slot of (rid, pos) |
    | full_to_state | [T] or None | int32/int64 | paged addressing: full slot -> SWA slot |
    | ratio | int | | 4 or 128 |
    | ring_size | int | | state rows per ring (>= 8 for c4, >= 128 for c128) |
    | swa_page_size | int | | SWA page size, paged addressing only |

    Row: `write_loc = state_loc(pos1)`, `read_page_0 = state_loc(max(pos1 - ratio, 0)) // ratio`,
    `read_page_1 = write_loc // ratio`, with `pos1 = seq_len - 1`.
    """
    _check_index("seq_lens", seq_lens)
    _check_addressing(seq_lens.shape[0], req_pool_indices, req_to_token, full_to_state, ratio, ring_size, swa_page_size)
    return torch.ops.dspark.dsv4_plan_decode(
        seq_lens, req_pool_indices, req_to_token, full_to_state, ratio, ring_size, swa_page_size
    )


def plan_prefill(
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor | None,
    full_to_state: torch.Tensor | None,
    ratio: int,
    ring_size: int,
    swa_page_size: int,
    num_q_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill/extend plans: compress rows (uint8 `[min(N, N//ratio + B), 16]`) and write rows (`[N, 8]`).

    | arg | shape | dtype | notes |
    |---|---|---|---|
    | seq_lens | [B] | int32/int64 | length after this extend |
    | extend_lens | [B] | int32/int64 | new tokens; request b's are ragged rows `sum(extend_lens[:b]) + j` |
    | req_pool_indices | [B] | int32/int64 | request id; negative: the request's tokens produce no rows |
    | req_to_token, full_to_state | | | as in `plan_decode` (None, None: ring addressing) |
    | ratio, ring_size, swa_page_size | int | | as in `plan_decode` |
    | num_q_tokens | int | | N, rows of the ragged input (<= 65535) |

    Compress row for every token with `(pos + 1) % ratio == 0`: `buffer_len = window - min(j + 1, window)`
    leading window slots come from the state; read pages as in decode when `buffer_len > 0`, otherwise
    `(-1, b)`. Write row for every token that later calls need: `pos >= (seq_len // ratio) * ratio - (4 if c4)`,
    plus, for c4 with paged addressing, the last 4 tokens of every SWA page.
    """
    _check_index("seq_lens", seq_lens)
    _check_index("extend_lens", extend_lens)
    if extend_lens.shape != seq_lens.shape:
        raise ValueError(f"extend_lens: expected shape {tuple(seq_lens.shape)}, got {tuple(extend_lens.shape)}")
    _check_addressing(seq_lens.shape[0], req_pool_indices, req_to_token, full_to_state, ratio, ring_size, swa_page_size)
    _check_tokens(num_q_tokens)
    return torch.ops.dspark.dsv4_plan_prefill(
        seq_lens,
        extend_lens,
        req_pool_indices,
        req_to_token,
        full_to_state,
        ratio,
        ring_size,
        swa_page_size,
        num_q_tokens,
    )


def _check_tokens(num_q_tokens: int) -> None:
    if not 0 <= num_q_tokens <= MAX_RAGGED:
        raise ValueError(f"num_q_tokens: expected 0..{MAX_RAGGED} (16-bit ragged ids), got {num_q_tokens}")


def plan_online_decode(seq_lens: torch.Tensor, req_pool_indices: torch.Tensor) -> torch.Tensor:
    """Online c128 decode plan (uint8 `[B, 16]`): `{seq_len, slot, slot, -1}` with `slot = req_pool_indices[b]`."""
    _check_index("seq_lens", seq_lens)
    _check_index("req_pool_indices", req_pool_indices)
    if req_pool_indices.shape != seq_lens.shape:
        raise ValueError(
            f"req_pool_indices: expected shape {tuple(seq_lens.shape)}, got {tuple(req_pool_indices.shape)}"
        )
    return torch.ops.dspark.dsv4_plan_online_decode(seq_lens, req_pool_indices)


def plan_online_prefill(
    seq_lens: torch.Tensor, extend_lens: torch.Tensor, req_pool_indices: torch.Tensor, num_q_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Online c128 prefill plans: chunk-closing segments (`[min(N, N//128 + B), 16]`) and trailing
    partial segments (`[min(N, B), 16]`), both CompressPlan rows (see the module docstring)."""
    _check_index("seq_lens", seq_lens)
    _check_index("extend_lens", extend_lens)
    _check_index("req_pool_indices", req_pool_indices)
    for name, t in (("extend_lens", extend_lens), ("req_pool_indices", req_pool_indices)):
        if t.shape != seq_lens.shape:
            raise ValueError(f"{name}: expected shape {tuple(seq_lens.shape)}, got {tuple(t.shape)}")
    _check_tokens(num_q_tokens)
    return torch.ops.dspark.dsv4_plan_online_prefill(seq_lens, extend_lens, req_pool_indices, num_q_tokens)


DECODE_INVALID = [INVALID_U32, -1, -1, -1]
COMPRESS_INVALID = [INVALID_U32, 0, -1, -1]
WRITE_INVALID = [INVALID_U32, -1]


@torch.library.impl(LIB, "dsv4_plan_decode", "CompositeExplicitAutograd")
def _plan_decode_impl(seq_lens, req_pool_indices, req_to_token, full_to_state, ratio, ring_size, swa_page_size=0):
    seq = seq_lens.long()
    rid = req_pool_indices.long()
    ok = (seq > 0) & (rid >= 0)
    pos1 = seq - 1
    pos0 = (pos1 - ratio).clamp(min=0)
    write_loc, ok = _state_loc(rid, pos1, ok, req_to_token, full_to_state, ring_size, swa_page_size)
    loc0, ok = _state_loc(rid, pos0, ok, req_to_token, full_to_state, ring_size, swa_page_size)
    rows = _pack_rows([seq, write_loc, loc0 // ratio, write_loc // ratio], ok, DECODE_INVALID)
    return rows.contiguous().view(torch.uint8)


@torch.library.impl(LIB, "dsv4_plan_prefill", "CompositeExplicitAutograd")
def _plan_prefill_impl(
    seq_lens,
    extend_lens,
    req_pool_indices,
    req_to_token,
    full_to_state,
    ratio,
    ring_size,
    swa_page_size,
    num_q_tokens,
):
    batch = seq_lens.shape[0]
    window = window_of(ratio)
    t, b, j, pos, valid = _ragged_tokens(seq_lens, extend_lens, num_q_tokens)
    rid = req_pool_indices.long()[b] if batch else b
    valid = valid & (rid >= 0) & (pos >= 0)

    event = valid & ((pos + 1) % ratio == 0)
    buffer_len = (window - (j + 1)).clamp(min=0)
    use_buf = buffer_len > 0
    loc1, ok1 = _state_loc(rid, pos, event & use_buf, req_to_token, full_to_state, ring_size, swa_page_size)
    loc0, ok1 = _state_loc(rid, (pos - ratio).clamp(min=0), ok1, req_to_token, full_to_state, ring_size, swa_page_size)
    event = event & (ok1 | ~use_buf)
    rp0 = torch.where(use_buf, loc0 // ratio, -1)
    rp1 = torch.where(use_buf, loc1 // ratio, b)
    c_rows = _pack_rows([pos + 1, t | (buffer_len << 16), rp0, rp1], event, COMPRESS_INVALID)
    plan_c = _compact(c_rows, event, compress_rows_bound(num_q_tokens, batch, ratio), COMPRESS_INVALID)

    seq = seq_lens.long()[b] if batch else pos
    first_w = (seq // ratio) * ratio - (ratio if ratio == 4 else 0)
    keep = pos >= first_w
    if ratio == 4 and req_to_token is not None:
        keep = keep | (pos % swa_page_size >= swa_page_size - ratio)
    write = valid & keep
    write_loc, write = _state_loc(rid, pos, write, req_to_token, full_to_state, ring_size, swa_page_size)
    w_rows = _pack_rows([t, write_loc], write, WRITE_INVALID)
    return plan_c, _compact(w_rows, write, num_q_tokens, WRITE_INVALID)


@torch.library.impl(LIB, "dsv4_plan_online_decode", "CompositeExplicitAutograd")
def _plan_online_decode_impl(seq_lens, req_pool_indices):
    seq = seq_lens.long()
    slot = req_pool_indices.long()
    ok = (seq > 0) & (slot >= 0)
    rows = _pack_rows([seq, slot, slot, torch.full_like(slot, -1)], ok, DECODE_INVALID)
    return rows.contiguous().view(torch.uint8)


@torch.library.impl(LIB, "dsv4_plan_online_prefill", "CompositeExplicitAutograd")
def _plan_online_prefill_impl(seq_lens, extend_lens, req_pool_indices, num_q_tokens):
    batch = seq_lens.shape[0]
    t, b, j, pos, valid = _ragged_tokens(seq_lens, extend_lens, num_q_tokens)
    slot = req_pool_indices.long()[b] if batch else b
    seq = seq_lens.long()[b] if batch else pos
    valid = valid & (slot >= 0) & (pos >= 0)
    seg_len = torch.minimum(j, pos % ONLINE_RATIO) + 1
    closes = valid & ((pos + 1) % ONLINE_RATIO == 0)
    trailing = valid & (pos == seq - 1) & ~closes
    rows = [pos + 1, t | (seg_len << 16), slot, torch.full_like(slot, -1)]
    plan_c = _compact(
        _pack_rows(rows, closes, COMPRESS_INVALID),
        closes,
        compress_rows_bound(num_q_tokens, batch, ONLINE_RATIO),
        COMPRESS_INVALID,
    )
    plan_w = _compact(
        _pack_rows(rows, trailing, COMPRESS_INVALID),
        trailing,
        torch.sym_min(num_q_tokens, batch),
        COMPRESS_INVALID,
    )
    return plan_c, plan_w


@torch.library.register_fake("dspark::dsv4_plan_decode")
def _plan_decode_fake(seq_lens, req_pool_indices, req_to_token, full_to_state, ratio, ring_size, swa_page_size=0):
    return seq_lens.new_empty((seq_lens.shape[0], 16), dtype=torch.uint8)


@torch.library.register_fake("dspark::dsv4_plan_prefill")
def _plan_prefill_fake(
    seq_lens,
    extend_lens,
    req_pool_indices,
    req_to_token,
    full_to_state,
    ratio,
    ring_size,
    swa_page_size,
    num_q_tokens,
):
    rows_c = compress_rows_bound(num_q_tokens, seq_lens.shape[0], ratio)
    return (
        seq_lens.new_empty((rows_c, 16), dtype=torch.uint8),
        seq_lens.new_empty((num_q_tokens, 8), dtype=torch.uint8),
    )


@torch.library.register_fake("dspark::dsv4_plan_online_decode")
def _plan_online_decode_fake(seq_lens, req_pool_indices):
    return seq_lens.new_empty((seq_lens.shape[0], 16), dtype=torch.uint8)


@torch.library.register_fake("dspark::dsv4_plan_online_prefill")
def _plan_online_prefill_fake(seq_lens, extend_lens, req_pool_indices, num_q_tokens):
    batch = seq_lens.shape[0]
    return (
        seq_lens.new_empty((compress_rows_bound(num_q_tokens, batch, ONLINE_RATIO), 16), dtype=torch.uint8),
        seq_lens.new_empty((torch.sym_min(num_q_tokens, batch), 16), dtype=torch.uint8),
    )
