"""Planners for the DeepSeek-V4 KV compressor: decode and prefill/extend plans as device tensors.

Plans use these binary layouts (little-endian, stored as uint8 tensors; docs/dsv4_compress.md):

| struct | bytes | fields |
|---|---|---|
| DecodePlan | 16 | `u32 seq_len, i32 write_loc, i32 read_page_0, i32 read_page_1` |
| CompressPlan | 16 | `u32 seq_len, u16 ragged_id, u16 buffer_len, i32 read_page_0, i32 read_page_1` |
| WritePlan | 8 | `u32 ragged_id, i32 write_loc` |

Invalid rows: DecodePlan `{0xFFFFFFFF, -1, -1, -1}`, CompressPlan `{0xFFFFFFFF, 0, 0, -1, -1}`, WritePlan
`{0xFFFFFFFF, -1}`. Every consumer skips them, so plans can be padded to sizes known from input shapes alone.

State addressing (`state_loc(rid, pos)`, a row of the flat state buffer; page = row // ratio):
- ring (per-request ring, the default when `req_to_token` is None): `rid * ring_size + pos % ring_size`.
  With `ring_size = window` (8 for c4, 128 for c128) this is the legacy per-request layout.
- paged (SWA-page rings): `swa = full_to_state[req_to_token[rid, pos]]`,
  `(swa // swa_page_size) * ring_size + swa % ring_size`; a negative table entry means "unmapped": the row
  that needs it is skipped.

Plans are built with sync-free, fixed-shape torch ops (CompositeExplicitAutograd), so the same implementation
serves CPU and CUDA tensors and can be captured in a CUDA graph; once the CUDA library is loaded, every
planner runs as one kernel launch (`csrc/dsv4/dsv4_compress_plan.cu`) that writes the same bytes.

Prefill plans are compact (valid rows first, in token order: batch-major, positions ascending) and padded with
invalid rows to `min(N, N // ratio + B)` compress rows (an upper bound on the number of windows that can close)
and `N` write rows, where `N = num_q_tokens` and `B = seq_lens.numel()`. Query tokens past `sum(extend_lens)`,
and requests with a negative `req_pool_indices` entry, produce no rows.

Online c128 plans: one state slot per request (`slot = req_pool_indices[b]`). Decode: `{seq_len, slot, slot,
-1}`. Prefill: each request's extend range is split into chunk-aligned segments; a segment that closes a
128-chunk gives a CompressPlan row in `plan_c`, the trailing partial segment one in `plan_w`; both carry
`(seq_len = last position + 1, ragged_id = last token, buffer_len = segment length, read_page_0 = slot,
read_page_1 = -1)`. Sizes: `min(N, N // 128 + B)` and `min(N, B)` rows.

Argument checks (docs/contract.md). Structure (`check_*_args`, shared by the implementations and the fake
impls): raises on every device. Index values: every plan field is an int32 / u32 / u16, so a value that would
not fit (or that addresses past `req_to_token` / `full_to_state`) never reaches a plan; the row that needs it
is invalid instead. On CPU (and on CUDA in checking mode) the first such value raises `ValueError`
(`"<arg>[<i>] = <v> is out of range: <what>"`); the problems are ranked (`ERR_*`): the lowest rank wins, then
the lowest (flat) index. The CUDA planner kernels report the same (rank, index) in checking mode.
- `extend_lens[b]` must lie in `0..N`, and `sum(extend_lens)` must not exceed N (every request);
- for each request with `req_pool_indices[b] >= 0` (decode: and `seq_lens[b] > 0`): `seq_lens[b] >=
  extend_lens[b]` (prefill), `seq_lens[b] <= 2^31 - 1` (paged: `<=` the columns of `req_to_token`), and
  `req_pool_indices[b] < 2^31 // ring_size` (ring: rows of a ring must be int32), `< req_to_token.shape[0]`
  (paged) or `< 2^31` (online);
- paged lookups: `req_to_token` entries `< full_to_state.shape[0]`, `full_to_state` entries whose state row
  fits int32. Negative entries of either table are unmapped (the row is skipped, no error).
A request that fails one of the request checks produces no rows (on CUDA: the rest of the batch is planned as
usual; a negative extend length counts as 0 for the ragged offsets).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from custom_ops._library import register_op
from custom_ops.checks import must_check_values
from custom_ops.dsv4.common import INT32_MAX, check_index, check_ratio, window_of

INVALID_U32 = -1  # 0xFFFFFFFF stored in an int32 field
MAX_RAGGED = 65535  # ragged ids are u16 in CompressPlan
ONLINE_RATIO = 128
STATE_ROWS = 2**31  # state rows and slots are int32 plan fields

# Ranks of the value problems a planner finds (csrc/dsv4/dsv4_compress_plan_kernels.cuh uses the same numbers).
ERR_EXTEND_RANGE = 0
ERR_EXTEND_SUM = 1
ERR_SEQ_BELOW_EXTEND = 2
ERR_SEQ_MAX = 3
ERR_REQUEST = 4
ERR_REQ_TO_TOKEN = 5
ERR_FULL_TO_STATE = 6


def compress_rows_bound(num_q_tokens: int | torch.SymInt, batch: int | torch.SymInt, ratio: int):
    """Rows of a padded prefill compress plan: an upper bound on the windows closed by `num_q_tokens` tokens."""
    return torch.sym_min(num_q_tokens, num_q_tokens // ratio + batch)


# ------------------------------------------------------------------------------------------------ structure


def _check_batch(seq_lens: torch.Tensor, **others: torch.Tensor) -> None:
    """`seq_lens` and every other per-request tensor: 1-D int32/int64 with B entries, on seq_lens' device."""
    check_index("seq_lens", seq_lens, 1)
    for name, t in others.items():
        check_index(name, t, 1, seq_lens.device)
        if t.shape[0] != seq_lens.shape[0]:
            raise ValueError(f"{name}: expected {seq_lens.shape[0]} entries (one per seq_lens entry), got {t.shape[0]}")


def _check_addressing(
    seq_lens: torch.Tensor,
    req_to_token: torch.Tensor | None,
    full_to_state: torch.Tensor | None,
    ratio: int,
    ring_size: int,
    swa_page_size: int,
) -> None:
    check_ratio(ratio)
    window = window_of(ratio)
    if not window <= ring_size <= INT32_MAX or ring_size % ratio:
        raise ValueError(f"ring_size: expected a multiple of {ratio} in {window}..{INT32_MAX}, got {ring_size}")
    if (req_to_token is None) != (full_to_state is None):
        raise ValueError("req_to_token/full_to_state: pass both (paged addressing) or neither (ring addressing)")
    if req_to_token is None:
        return
    check_index("req_to_token", req_to_token, 2, seq_lens.device)
    check_index("full_to_state", full_to_state, 1, seq_lens.device)
    if not 0 < swa_page_size <= INT32_MAX or swa_page_size % ring_size:
        raise ValueError(
            f"swa_page_size: expected a positive multiple of ring_size={ring_size} up to {INT32_MAX}, "
            f"got {swa_page_size}"
        )


def _check_tokens(num_q_tokens: int | torch.SymInt) -> None:
    """`torch._check_with`: also for a data-dependent `num_q_tokens` in a compiled graph (a runtime assert there)."""
    for in_range in (num_q_tokens >= 0, num_q_tokens <= MAX_RAGGED):
        torch._check_with(
            ValueError,
            in_range,
            lambda: f"num_q_tokens: expected 0..{MAX_RAGGED} (16-bit ragged ids), got {num_q_tokens}",
        )


def check_plan_decode_args(
    seq_lens: torch.Tensor,
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor | None,
    full_to_state: torch.Tensor | None,
    ratio: int,
    ring_size: int,
    swa_page_size: int = 0,
) -> None:
    """Structural checks of `dsv4_plan_decode` (types, shapes, devices, scalar arguments)."""
    _check_batch(seq_lens, req_pool_indices=req_pool_indices)
    _check_addressing(seq_lens, req_to_token, full_to_state, ratio, ring_size, swa_page_size)


def check_plan_prefill_args(
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor | None,
    full_to_state: torch.Tensor | None,
    ratio: int,
    ring_size: int,
    swa_page_size: int,
    num_q_tokens: int | torch.SymInt,
) -> None:
    """Structural checks of `dsv4_plan_prefill`."""
    _check_batch(seq_lens, extend_lens=extend_lens, req_pool_indices=req_pool_indices)
    _check_addressing(seq_lens, req_to_token, full_to_state, ratio, ring_size, swa_page_size)
    _check_tokens(num_q_tokens)


def check_plan_online_decode_args(seq_lens: torch.Tensor, req_pool_indices: torch.Tensor) -> None:
    """Structural checks of `dsv4_plan_online_decode`."""
    _check_batch(seq_lens, req_pool_indices=req_pool_indices)


def check_plan_online_prefill_args(
    seq_lens: torch.Tensor, extend_lens: torch.Tensor, req_pool_indices: torch.Tensor, num_q_tokens
) -> None:
    """Structural checks of `dsv4_plan_online_prefill`."""
    _check_batch(seq_lens, extend_lens=extend_lens, req_pool_indices=req_pool_indices)
    _check_tokens(num_q_tokens)


# ------------------------------------------------------------------------------------------------ values


class PlanProblem(NamedTuple):
    """The first out-of-range index value a planner found: rank (`ERR_*`), argument, flat and full index."""

    rank: int
    name: str
    flat: int
    index: tuple[int, ...]
    value: int
    what: str

    def message(self) -> str:
        label = ", ".join(str(i) for i in self.index)
        return f"{self.name}[{label}] = {self.value} is out of range: {self.what}"


class Problems:
    """Out-of-range index values found while planning, as device masks (no host sync until `first()`)."""

    def __init__(self) -> None:
        self._found: list[tuple[int, str, torch.Tensor, torch.Tensor, torch.Tensor, Callable[[int], str]]] = []

    def add(
        self,
        rank: int,
        name: str,
        table: torch.Tensor,
        flat: torch.Tensor,
        bad: torch.Tensor,
        what: Callable[[int], str],
    ) -> None:
        """Entries `flat[bad]` (flat indices into `table`) are out of range; `what(flat)` says what is valid."""
        self._found.append((rank, name, table, flat, bad, what))

    def first(self) -> PlanProblem | None:
        """The problem of the lowest rank with the lowest flat index (syncs), or None."""
        best = None
        for rank, name, table, flat, bad, what in self._found:
            if not bool(bad.any()):
                continue
            i = int(flat[bad].min())
            if best is None or (rank, i) < best[:2]:
                best = (rank, i, name, table, what)
        if best is None:
            return None
        rank, i, name, table, what = best
        index = tuple(int(k) for k in torch.unravel_index(torch.tensor(i), tuple(table.shape)))
        return PlanProblem(rank, name, i, index, int(table.reshape(-1)[i]), what(i))

    def raise_if_checking(self, like: torch.Tensor) -> None:
        """CPU (and CUDA in checking mode): raise the first problem as `ValueError`."""
        if must_check_values(like):
            problem = self.first()
            if problem is not None:
                raise ValueError(problem.message())


class _Addressing(NamedTuple):
    req_to_token: torch.Tensor | None
    full_to_state: torch.Tensor | None
    ratio: int
    ring: int
    swa_page: int


def _seq_limit(addr: _Addressing | None) -> tuple[int, str]:
    """Largest valid seq_len and how the messages state it."""
    if addr is not None and addr.req_to_token is not None and addr.req_to_token.shape[1] <= INT32_MAX:
        cols = addr.req_to_token.shape[1]
        return cols, f"expected <= {cols} (columns of req_to_token)"
    return INT32_MAX, f"expected <= {INT32_MAX} (int32 positions)"


def _request_limit(addr: _Addressing | None) -> tuple[int, str]:
    """Exclusive bound of a request id and how the messages state it (addr None: online, slot = request id)."""
    if addr is None:
        return STATE_ROWS, f"expected < {STATE_ROWS} (int32 state slots)"
    if addr.req_to_token is not None:
        rows = addr.req_to_token.shape[0]
        return rows, f"expected < {rows} (rows of req_to_token)"
    hi = STATE_ROWS // addr.ring
    return hi, f"expected < {hi} (a ring of {addr.ring} rows per request, int32 state rows)"


def _check_requests(
    problems: Problems,
    seq_lens: torch.Tensor,
    req_pool_indices: torch.Tensor,
    active: torch.Tensor,
    addr: _Addressing | None,
) -> torch.Tensor:
    """seq_lens and req_pool_indices of the active requests; returns the requests that pass."""
    seq, rid = seq_lens.long(), req_pool_indices.long()
    index = torch.arange(seq.shape[0], device=seq.device)
    seq_max, seq_what = _seq_limit(addr)
    long_seq = active & (seq > seq_max)
    problems.add(ERR_SEQ_MAX, "seq_lens", seq_lens, index, long_seq, lambda _: seq_what)
    rid_hi, rid_what = _request_limit(addr)
    bad_rid = active & (rid >= rid_hi)
    problems.add(ERR_REQUEST, "req_pool_indices", req_pool_indices, index, bad_rid, lambda _: rid_what)
    return active & ~long_seq & ~bad_rid


def _check_extends(
    problems: Problems,
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    req_pool_indices: torch.Tensor,
    num_q_tokens,
    addr: _Addressing | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Request checks of a prefill: returns (requests that plan rows, inclusive ends of the ragged ranges,
    extend lengths used for the ragged offsets: clamped to 0..N + 1)."""
    seq, ext, rid = seq_lens.long(), extend_lens.long(), req_pool_indices.long()
    n = num_q_tokens
    index = torch.arange(seq.shape[0], device=seq.device)
    bad_ext = (ext < 0) | (ext > n)
    problems.add(
        ERR_EXTEND_RANGE, "extend_lens", extend_lens, index, bad_ext, lambda _: f"expected 0..{n} (num_q_tokens)"
    )
    ext_used = ext.clamp(0, n + 1)
    ends = torch.cumsum(ext_used, 0)
    past = ends > n
    problems.add(
        ERR_EXTEND_SUM,
        "extend_lens",
        extend_lens,
        index,
        past,
        lambda b: f"sum(extend_lens[:{b + 1}]) = {int(ends[b])} exceeds num_q_tokens = {n}",
    )
    active = rid >= 0
    short = active & (seq < ext)
    problems.add(
        ERR_SEQ_BELOW_EXTEND,
        "seq_lens",
        seq_lens,
        index,
        short,
        lambda b: f"expected >= extend_lens[{b}] = {int(ext[b])}",
    )
    ok = _check_requests(problems, seq_lens, req_pool_indices, active & ~short, addr)
    return ok & ~bad_ext & ~past, ends, ext_used


def _state_loc(
    problems: Problems, rid: torch.Tensor, pos: torch.Tensor, ok: torch.Tensor, addr: _Addressing
) -> tuple[torch.Tensor, torch.Tensor]:
    """State row of (rid, pos) as int64, and the updated validity mask. `rid` and `pos` must be in range (request
    checks) where `ok`; unmapped (negative) table entries make the row invalid, out-of-range ones are problems.

    Entries where `ok` is False hold safe values and must be ignored by the caller.
    """
    rid = torch.where(ok, rid, 0)
    pos = torch.where(ok, pos, 0)
    if addr.req_to_token is None:
        return rid * addr.ring + pos % addr.ring, ok
    r2t, f2s = addr.req_to_token, addr.full_to_state
    if r2t.numel() == 0:
        return torch.zeros_like(rid), ok & False
    full = r2t[rid, pos].long()
    bad_full = ok & (full >= f2s.shape[0])
    what_full = f"expected < {f2s.shape[0]} (entries of full_to_state; negative entries are unmapped)"
    problems.add(ERR_REQ_TO_TOKEN, "req_to_token", r2t, rid * r2t.shape[1] + pos, bad_full, lambda _: what_full)
    ok = ok & (full >= 0) & ~bad_full
    full = torch.where(ok, full, 0)
    swa = f2s[full].long() if f2s.numel() else torch.zeros_like(full)
    swa_hi = (STATE_ROWS // addr.ring) * addr.swa_page
    bad_swa = ok & (swa >= swa_hi)
    what_swa = f"expected < {swa_hi} (state rows must fit in int32; negative entries are unmapped)"
    problems.add(ERR_FULL_TO_STATE, "full_to_state", f2s, full, bad_swa, lambda _: what_swa)
    ok = ok & (swa >= 0) & ~bad_swa
    swa = torch.where(ok, swa, 0)
    return (swa // addr.swa_page) * addr.ring + swa % addr.ring, ok


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


class _Tokens(NamedTuple):
    """Per query token t < num_q_tokens: its request b, offset j in the extend, position, and whether it belongs
    to a request that plans rows."""

    t: torch.Tensor
    b: torch.Tensor
    j: torch.Tensor
    pos: torch.Tensor
    valid: torch.Tensor


def _ragged_tokens(seq_lens, ok, ends, ext, num_q_tokens) -> _Tokens:
    seq = seq_lens.long()
    batch = seq.shape[0]
    t = torch.arange(num_q_tokens, device=seq.device)
    if batch == 0:
        return _Tokens(t, t, t, t, torch.zeros_like(t, dtype=torch.bool))
    b = torch.searchsorted(ends, t, right=True)
    bc = b.clamp(max=batch - 1)
    j = t - (ends[bc] - ext[bc])
    return _Tokens(t, bc, j, seq[bc] - ext[bc] + j, (b < batch) & ok[bc])


DECODE_INVALID = [INVALID_U32, -1, -1, -1]
COMPRESS_INVALID = [INVALID_U32, 0, -1, -1]
WRITE_INVALID = [INVALID_U32, -1]


def decode_plan_unchecked(
    seq_lens, req_pool_indices, req_to_token, full_to_state, ratio, ring_size, swa_page_size=0
) -> tuple[torch.Tensor, Problems]:
    """The decode plan with the CUDA semantics (rows with out-of-range values are invalid) and the problems."""
    addr = _Addressing(req_to_token, full_to_state, ratio, ring_size, swa_page_size)
    problems = Problems()
    seq = seq_lens.long()
    rid = req_pool_indices.long()
    ok = _check_requests(problems, seq_lens, req_pool_indices, (seq > 0) & (rid >= 0), addr)
    pos1 = seq - 1
    pos0 = (pos1 - ratio).clamp(min=0)
    write_loc, ok = _state_loc(problems, rid, pos1, ok, addr)
    loc0, ok0 = _state_loc(problems, rid, pos0, ok, addr)
    # -1 where unmapped: c128 never reads it; a c4 row that closes a window then makes no entry (its overlap half is
    # gone), and every c4 row still writes its token's state (the next window's overlap half)
    read_page_0 = torch.where(ok0, loc0 // ratio, -1)
    rows = _pack_rows([seq, write_loc, read_page_0, write_loc // ratio], ok, DECODE_INVALID)
    return rows.contiguous().view(torch.uint8), problems


def prefill_plan_unchecked(
    seq_lens,
    extend_lens,
    req_pool_indices,
    req_to_token,
    full_to_state,
    ratio,
    ring_size,
    swa_page_size,
    num_q_tokens,
) -> tuple[tuple[torch.Tensor, torch.Tensor], Problems]:
    """The prefill plans with the CUDA semantics and the problems (see `decode_plan_unchecked`)."""
    addr = _Addressing(req_to_token, full_to_state, ratio, ring_size, swa_page_size)
    problems = Problems()
    batch = seq_lens.shape[0]
    window = window_of(ratio)
    ok, ends, ext = _check_extends(problems, seq_lens, extend_lens, req_pool_indices, num_q_tokens, addr)
    t, b, j, pos, valid = _ragged_tokens(seq_lens, ok, ends, ext, num_q_tokens)
    rid = req_pool_indices.long()[b] if batch else b

    event = valid & ((pos + 1) % ratio == 0)
    buffer_len = (window - (j + 1)).clamp(min=0)
    use_buf = buffer_len > 0
    loc1, ok1 = _state_loc(problems, rid, pos, event & use_buf, addr)
    loc0, ok0 = _state_loc(problems, rid, (pos - ratio).clamp(min=0), ok1, addr)
    if ratio == 4:  # as in the decode plan: only c4 reads read_page_0
        ok1 = ok0
    event = event & (ok1 | ~use_buf)
    rp0 = torch.where(use_buf & ok0, loc0 // ratio, -1)
    rp1 = torch.where(use_buf, loc1 // ratio, b)
    c_rows = _pack_rows([pos + 1, t | (buffer_len << 16), rp0, rp1], event, COMPRESS_INVALID)
    plan_c = _compact(c_rows, event, compress_rows_bound(num_q_tokens, batch, ratio), COMPRESS_INVALID)

    seq = seq_lens.long()[b] if batch else pos
    first_w = (seq // ratio) * ratio - (ratio if ratio == 4 else 0)
    keep = pos >= first_w
    if ratio == 4 and req_to_token is not None:
        keep = keep | (pos % swa_page_size >= swa_page_size - ratio)
    write_loc, write = _state_loc(problems, rid, pos, valid & keep, addr)
    w_rows = _pack_rows([t, write_loc], write, WRITE_INVALID)
    return (plan_c, _compact(w_rows, write, num_q_tokens, WRITE_INVALID)), problems


def online_decode_plan_unchecked(seq_lens, req_pool_indices) -> tuple[torch.Tensor, Problems]:
    """The online decode plan with the CUDA semantics and the problems (see `decode_plan_unchecked`)."""
    problems = Problems()
    seq = seq_lens.long()
    slot = req_pool_indices.long()
    ok = _check_requests(problems, seq_lens, req_pool_indices, (seq > 0) & (slot >= 0), None)
    rows = _pack_rows([seq, slot, slot, torch.full_like(slot, -1)], ok, DECODE_INVALID)
    return rows.contiguous().view(torch.uint8), problems


def online_prefill_plan_unchecked(
    seq_lens, extend_lens, req_pool_indices, num_q_tokens
) -> tuple[tuple[torch.Tensor, torch.Tensor], Problems]:
    """The online prefill plans with the CUDA semantics and the problems (see `decode_plan_unchecked`)."""
    problems = Problems()
    batch = seq_lens.shape[0]
    ok, ends, ext = _check_extends(problems, seq_lens, extend_lens, req_pool_indices, num_q_tokens, None)
    t, b, j, pos, valid = _ragged_tokens(seq_lens, ok, ends, ext, num_q_tokens)
    slot = req_pool_indices.long()[b] if batch else b
    seq = seq_lens.long()[b] if batch else pos
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
    return (plan_c, plan_w), problems


# ------------------------------------------------------------------------------------------------ ops


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
    `read_page_1 = write_loc // ratio`, with `pos1 = seq_len - 1`. Value checks: see the module docstring.
    """
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
    | seq_lens | [B] | int32/int64 | length after this extend (>= extend_lens) |
    | extend_lens | [B] | int32/int64 | new tokens; request b's are ragged rows `sum(extend_lens[:b]) + j` |
    | req_pool_indices | [B] | int32/int64 | request id; negative: the request's tokens produce no rows |
    | req_to_token, full_to_state | | | as in `plan_decode` (None, None: ring addressing) |
    | ratio, ring_size, swa_page_size | int | | as in `plan_decode` |
    | num_q_tokens | int | | N, rows of the ragged input (<= 65535, >= sum(extend_lens)) |

    Compress row for every token with `(pos + 1) % ratio == 0`: `buffer_len = window - min(j + 1, window)`
    leading window slots come from the state; read pages as in decode when `buffer_len > 0`, otherwise
    `(-1, b)`. Write row for every token that later calls need: `pos >= (seq_len // ratio) * ratio - (4 if c4)`,
    plus, for c4 with paged addressing, the last 4 tokens of every SWA page. Value checks: see the module docstring.
    """
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


def plan_online_decode(seq_lens: torch.Tensor, req_pool_indices: torch.Tensor) -> torch.Tensor:
    """Online c128 decode plan (uint8 `[B, 16]`): `{seq_len, slot, slot, -1}` with `slot = req_pool_indices[b]`."""
    return torch.ops.dspark.dsv4_plan_online_decode(seq_lens, req_pool_indices)


def plan_online_prefill(
    seq_lens: torch.Tensor, extend_lens: torch.Tensor, req_pool_indices: torch.Tensor, num_q_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Online c128 prefill plans: chunk-closing segments (`[min(N, N//128 + B), 16]`) and trailing
    partial segments (`[min(N, B), 16]`), both CompressPlan rows (see the module docstring)."""
    return torch.ops.dspark.dsv4_plan_online_prefill(seq_lens, extend_lens, req_pool_indices, num_q_tokens)


def _plan_decode_impl(seq_lens, req_pool_indices, req_to_token, full_to_state, ratio, ring_size, swa_page_size=0):
    check_plan_decode_args(seq_lens, req_pool_indices, req_to_token, full_to_state, ratio, ring_size, swa_page_size)
    plan, problems = decode_plan_unchecked(
        seq_lens, req_pool_indices, req_to_token, full_to_state, ratio, ring_size, swa_page_size
    )
    problems.raise_if_checking(seq_lens)
    return plan


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
    args = (seq_lens, extend_lens, req_pool_indices, req_to_token, full_to_state, ratio, ring_size, swa_page_size)
    check_plan_prefill_args(*args, num_q_tokens)
    plans, problems = prefill_plan_unchecked(*args, num_q_tokens)
    problems.raise_if_checking(seq_lens)
    return plans


def _plan_online_decode_impl(seq_lens, req_pool_indices):
    check_plan_online_decode_args(seq_lens, req_pool_indices)
    plan, problems = online_decode_plan_unchecked(seq_lens, req_pool_indices)
    problems.raise_if_checking(seq_lens)
    return plan


def _plan_online_prefill_impl(seq_lens, extend_lens, req_pool_indices, num_q_tokens):
    check_plan_online_prefill_args(seq_lens, extend_lens, req_pool_indices, num_q_tokens)
    plans, problems = online_prefill_plan_unchecked(seq_lens, extend_lens, req_pool_indices, num_q_tokens)
    problems.raise_if_checking(seq_lens)
    return plans


def _plan_decode_fake(seq_lens, req_pool_indices, req_to_token, full_to_state, ratio, ring_size, swa_page_size=0):
    check_plan_decode_args(seq_lens, req_pool_indices, req_to_token, full_to_state, ratio, ring_size, swa_page_size)
    return seq_lens.new_empty((seq_lens.shape[0], 16), dtype=torch.uint8)


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
    check_plan_prefill_args(
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
    rows_c = compress_rows_bound(num_q_tokens, seq_lens.shape[0], ratio)
    return (
        seq_lens.new_empty((rows_c, 16), dtype=torch.uint8),
        seq_lens.new_empty((num_q_tokens, 8), dtype=torch.uint8),
    )


def _plan_online_decode_fake(seq_lens, req_pool_indices):
    check_plan_online_decode_args(seq_lens, req_pool_indices)
    return seq_lens.new_empty((seq_lens.shape[0], 16), dtype=torch.uint8)


def _plan_online_prefill_fake(seq_lens, extend_lens, req_pool_indices, num_q_tokens):
    check_plan_online_prefill_args(seq_lens, extend_lens, req_pool_indices, num_q_tokens)
    batch = seq_lens.shape[0]
    return (
        seq_lens.new_empty((compress_rows_bound(num_q_tokens, batch, ONLINE_RATIO), 16), dtype=torch.uint8),
        seq_lens.new_empty((torch.sym_min(num_q_tokens, batch), 16), dtype=torch.uint8),
    )


# The planners' references are sync-free fixed-shape torch ops that serve CPU and CUDA tensors alike, so they sit
# under CompositeExplicitAutograd (no first-use entry); the CUDA library's planner kernels take precedence once loaded.
register_op(
    "dsv4_plan_decode(Tensor seq_lens, Tensor req_pool_indices, Tensor? req_to_token, "
    "Tensor? full_to_state, int ratio, int ring_size, int swa_page_size=0) -> Tensor",
    reference=_plan_decode_impl,
    fake=_plan_decode_fake,
    reference_key="CompositeExplicitAutograd",
)
register_op(
    "dsv4_plan_prefill(Tensor seq_lens, Tensor extend_lens, Tensor req_pool_indices, Tensor? req_to_token, "
    "Tensor? full_to_state, int ratio, int ring_size, int swa_page_size, SymInt num_q_tokens) -> (Tensor, Tensor)",
    reference=_plan_prefill_impl,
    fake=_plan_prefill_fake,
    reference_key="CompositeExplicitAutograd",
)
register_op(
    "dsv4_plan_online_decode(Tensor seq_lens, Tensor req_pool_indices) -> Tensor",
    reference=_plan_online_decode_impl,
    fake=_plan_online_decode_fake,
    reference_key="CompositeExplicitAutograd",
)
register_op(
    "dsv4_plan_online_prefill(Tensor seq_lens, Tensor extend_lens, Tensor req_pool_indices, "
    "SymInt num_q_tokens) -> (Tensor, Tensor)",
    reference=_plan_online_prefill_impl,
    fake=_plan_online_prefill_fake,
    reference_key="CompositeExplicitAutograd",
)
