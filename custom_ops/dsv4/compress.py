"""Offline DeepSeek-V4 KV compression (c4 with overlap, c128): decode and prefill/extend ops.

Each compressed entry is a per-channel softmax-gated pooling over a window of raw projection rows
(docs/dsv4_compress.md): `out[d] = sum_j softmax_j(sc[j, d] + ape[j, d]) * kv[j, d]`, fp32 math.

- c4: window of 8 slots, `ape` `[8, D]`, rows `| kv_ov | kv_fr | sc_ov | sc_fr |` (4D wide). Slots 0..3 are
  the previous 4 tokens' overlap halves (masked with kv = 0, score = -FLT_MAX for the first window, i.e.
  `seq_len <= 4`), slots 4..7 the current 4 tokens' fresh halves.
- c128: window of 128 slots, `ape` `[128, D]`, rows `| kv | sc |` (2D wide).

The state is a flat buffer of raw rows, `[rows, last_dim]` (rows a multiple of ratio; page p = rows
`[p*ratio, (p+1)*ratio)`), fp32 or bf16; reads convert to fp32. Row order: **decode writes the new token's row
first and then compresses, reading every window slot from the state; prefill compresses first (slots
`j < buffer_len` from the state, the rest from the ragged input) and then writes the rows of `plan_w`** (the
writes may overwrite rows the compression reads).

Outputs are fresh fp32 `[plan rows, D]` tensors; rows that produce no entry (invalid plan rows, decode rows
whose `seq_len % ratio != 0`, c4 decode rows whose `read_page_0` is -1: an unmapped overlap token; they still write
the state) are zero. Decode row b pairs with request b; prefill row k with `plan_c[k]`.

Plan values (docs/contract.md): a plan row is padding when it has the invalid pattern (DecodePlan: `write_loc <
0`; CompressPlan: `seq_len == 0xFFFFFFFF`; WritePlan: `ragged_id == 0xFFFFFFFF` or `write_loc < 0`). Every
other row must address rows inside `state` and `kv_score` (`check_decode_plan_values`,
`check_prefill_plan_values`): on CPU (and on CUDA in checking mode) a row that does not raises `ValueError`
(`"plan[i].write_loc = v is out of range: ..."`) before anything is written; the CUDA kernels skip such a row
(decode: no write if `write_loc` is out of range, no entry if a read page is).
"""

from __future__ import annotations

import torch

from custom_ops._library import register_op
from custom_ops.checks import check_no_shared_memory
from custom_ops.dsv4.common import (
    FLT_MAX,
    INPUT_DTYPES,
    STATE_DTYPES,
    FieldProblem,
    check_device,
    check_head_dim,
    check_matrix,
    check_plan,
    check_ratio,
    check_rows,
    decode_emits,
    page_range,
    raise_first,
    read_compress_plan,
    read_decode_plan,
    read_write_plan,
    window_of,
)


def check_compress_args(state, kv_score, ape, ratio: int) -> int:
    """Structural checks shared by the decode and prefill ops; returns the head dim D."""
    check_ratio(ratio)
    d = check_head_dim(ape, window_of(ratio))
    width = (4 if ratio == 4 else 2) * d
    check_matrix("state", state, width, STATE_DTYPES)
    check_matrix("kv_score", kv_score, width, INPUT_DTYPES)
    if state.shape[0] % ratio or not state.is_contiguous():
        raise ValueError(
            f"state: expected a contiguous buffer with a multiple of {ratio} rows, got {tuple(state.shape)}"
        )
    check_device("kv_score", kv_score, state.device)
    check_device("ape", ape, state.device)
    return d


def check_decode_args(state, kv_score, ape, plan, ratio: int) -> int:
    """Structural checks of `dsv4_compress_decode` (CPU and fake impls); returns D."""
    d = check_compress_args(state, kv_score, ape, ratio)
    check_plan("plan", plan, 16, state.device)
    check_rows("plan", plan, kv_score.shape[0], "one per kv_score row")
    check_no_shared_memory("state", state, (("kv_score", kv_score), ("ape", ape), ("plan", plan)))
    return d


def check_prefill_args(state, kv_score, ape, plan_c, plan_w, ratio: int) -> int:
    """Structural checks of `dsv4_compress_prefill` (CPU and fake impls); returns D."""
    d = check_compress_args(state, kv_score, ape, ratio)
    check_plan("plan_c", plan_c, 16, state.device)
    check_plan("plan_w", plan_w, 8, state.device)
    inputs = (("kv_score", kv_score), ("ape", ape), ("plan_c", plan_c), ("plan_w", plan_w))
    check_no_shared_memory("state", state, inputs)
    return d


def _read_pages(read_page_0: torch.Tensor, read_page_1: torch.Tensor, ratio: int):
    """The page fields a window reads: c4 both (overlap and fresh half), c128 read_page_1."""
    return (
        [("read_page_1", read_page_1), ("read_page_0", read_page_0)] if ratio == 4 else [("read_page_1", read_page_1)]
    )


def _outside(page: torch.Tensor, pages: int) -> torch.Tensor:
    return (page < 0) | (page >= pages)


def decode_plan_problems(plan: torch.Tensor, state_rows: int, ratio: int) -> list[FieldProblem]:
    """The non-padding DecodePlan rows that write outside the state or, when they close a window, read a page
    outside the state or are not the last row of their page (in the order the CPU path reports them)."""
    p = read_decode_plan(plan)
    pages = state_rows // ratio
    big = p.valid & (p.write_loc >= state_rows)
    problems = [FieldProblem("plan", "write_loc", p.write_loc, big, f"expected < {state_rows} (rows of state)")]
    emit = decode_emits(p, ratio)
    for field, page in _read_pages(p.read_page_0, p.read_page_1, ratio):
        problems.append(FieldProblem("plan", field, page, emit & _outside(page, pages), page_range(pages)))
    last = p.read_page_1 * ratio + ratio - 1
    problems.append(
        FieldProblem(
            "plan",
            "write_loc",
            p.write_loc,
            emit & (p.write_loc != last),
            lambda i: f"expected read_page_1 * {ratio} + {ratio - 1} = {int(last[i])} (the window's last row)",
        )
    )
    return problems


def prefill_plan_problems(
    plan_c: torch.Tensor, plan_w: torch.Tensor, state_rows: int, input_rows: int, ratio: int
) -> list[FieldProblem]:
    """The non-padding plan rows that read or write outside `state` / `kv_score` (in the CPU path's order)."""
    c = read_compress_plan(plan_c)
    window = window_of(ratio)
    rows_what = f"expected < {input_rows} (rows of kv_score)"
    first = window - 1 - c.buffer_len
    problems = [
        FieldProblem("plan_c", "ragged_id", c.ragged_id, c.valid & (c.ragged_id >= input_rows), rows_what),
        FieldProblem(
            "plan_c",
            "buffer_len",
            c.buffer_len,
            c.valid & (c.buffer_len > window),
            f"expected <= {window} (window slots)",
        ),
        FieldProblem(
            "plan_c",
            "ragged_id",
            c.ragged_id,
            c.valid & (c.ragged_id < first),
            lambda i: f"expected >= {int(first[i])} (window - 1 - buffer_len: the window's first input row)",
        ),
    ]
    buffered = c.valid & (c.buffer_len > 0)
    pages = state_rows // ratio
    for field, page in _read_pages(c.read_page_0, c.read_page_1, ratio):
        problems.append(FieldProblem("plan_c", field, page, buffered & _outside(page, pages), page_range(pages)))
    w = read_write_plan(plan_w)
    big = w.valid & (w.write_loc >= state_rows)
    return [
        *problems,
        FieldProblem("plan_w", "ragged_id", w.ragged_id, w.valid & (w.ragged_id >= input_rows), rows_what),
        FieldProblem("plan_w", "write_loc", w.write_loc, big, f"expected < {state_rows} (rows of state)"),
    ]


def check_decode_plan_values(plan: torch.Tensor, state_rows: int, ratio: int) -> None:
    """Raise `ValueError` for the first of `decode_plan_problems`."""
    raise_first(decode_plan_problems(plan, state_rows, ratio))


def check_prefill_plan_values(
    plan_c: torch.Tensor, plan_w: torch.Tensor, state_rows: int, input_rows: int, ratio: int
) -> None:
    """Raise `ValueError` for the first of `prefill_plan_problems`."""
    raise_first(prefill_plan_problems(plan_c, plan_w, state_rows, input_rows, ratio))


def compress_decode(
    state: torch.Tensor, kv_score: torch.Tensor, ape: torch.Tensor, plan: torch.Tensor, ratio: int
) -> torch.Tensor:
    """Decode step: write each request's new row to the state, then compress where `seq_len % ratio == 0`.

    | arg | shape | dtype | mutated | notes |
    |---|---|---|---|---|
    | state | [rows, W] | fp32/bf16 | yes | raw rows; W = 4D (c4) or 2D (c128); rows % ratio == 0 |
    | kv_score | [N, W] | fp32/bf16 | no | projection rows (row stride free, unit inner stride) |
    | ape | [window, D] | fp32 | no | window = 8 (c4) or 128 (c128); D in {128, 512} |
    | plan | [B, 16] | uint8 | no | DecodePlan rows (`plan_decode`), B == N |
    | ratio | int | | | 4 or 128 |

    Returns fp32 `[B, D]`.
    """
    return torch.ops.dspark.dsv4_compress_decode(state, kv_score, ape, plan, ratio)


def compress_prefill(
    state: torch.Tensor,
    kv_score: torch.Tensor,
    ape: torch.Tensor,
    plan_c: torch.Tensor,
    plan_w: torch.Tensor,
    ratio: int,
) -> torch.Tensor:
    """Prefill/extend step: compress every `plan_c` row, then write the `plan_w` rows to the state.

    | arg | shape | dtype | mutated | notes |
    |---|---|---|---|---|
    | state | [rows, W] | fp32/bf16 | yes | raw rows; W = 4D (c4) or 2D (c128); rows % ratio == 0 |
    | kv_score | [N, W] | fp32/bf16 | no | projection rows (row stride free, unit inner stride) |
    | ape | [window, D] | fp32 | no | window = 8 (c4) or 128 (c128); D in {128, 512} |
    | plan_c | [C, 16] | uint8 | no | CompressPlan rows (`plan_prefill`) |
    | plan_w | [Wr, 8] | uint8 | no | WritePlan rows (`plan_prefill`) |
    | ratio | int | | | 4 or 128 |

    Returns fp32 `[C, D]`, row k for `plan_c[k]`.
    """
    return torch.ops.dspark.dsv4_compress_prefill(state, kv_score, ape, plan_c, plan_w, ratio)


def _pool(kv: torch.Tensor, sc: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """Per-channel softmax pooling over the window axis: kv, sc `[E, window, D]` fp32 -> `[E, D]`."""
    weights = torch.softmax(sc + ape, dim=1)
    return (weights * kv).sum(1)


def _gather_rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`t[index]`, or zeros of that shape when `t` has no rows (a plan that reads no row of an empty state still
    gathers the placeholder rows `_window` masks out)."""
    if t.shape[0] == 0:
        return t.new_zeros((*index.shape, *t.shape[1:]))
    return t[index]


def _window(
    state: torch.Tensor,
    kv_score: torch.Tensor,
    ratio: int,
    d: int,
    last: torch.Tensor,
    buffer_len: torch.Tensor,
    rp0: torch.Tensor,
    rp1: torch.Tensor,
    seq_len: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather the (kv, score) window `[E, window, D]` fp32 of E entries.

    Slot i comes from the state if `i < buffer_len` (c4: row i of page rp0 for i < 4, row i - 4 of page rp1
    otherwise; c128: row i of page rp1), else from input row `last - window + 1 + i`.
    """
    window = window_of(ratio)
    i = torch.arange(window, device=state.device)
    if ratio == 4:
        page = torch.where(i < 4, rp0[:, None], rp1[:, None])
        srow = page * 4 + i % 4
        kv_cols = torch.where(i < 4, 0, d)
        sc_cols = torch.where(i < 4, 2 * d, 3 * d)
    else:
        srow = rp1[:, None] * ratio + i
        kv_cols = torch.zeros_like(i)
        sc_cols = torch.full_like(i, d)
    irow = last[:, None] - window + 1 + i
    from_state = i < buffer_len[:, None]
    srow = torch.where(from_state, srow, 0).clamp(0, max(state.shape[0] - 1, 0))
    irow = torch.where(from_state, 0, irow).clamp(0, max(kv_score.shape[0] - 1, 0))
    rows = torch.where(from_state[..., None], _gather_rows(state, srow).float(), _gather_rows(kv_score, irow).float())
    cols = torch.arange(d, device=state.device)
    kv = rows.gather(2, (kv_cols[:, None] + cols).expand(rows.shape[0], window, d))
    sc = rows.gather(2, (sc_cols[:, None] + cols).expand(rows.shape[0], window, d))
    if ratio == 4:
        masked = (seq_len <= 4)[:, None] & (i < 4)
        kv = kv.masked_fill(masked[..., None], 0.0)
        sc = sc.masked_fill(masked[..., None], -FLT_MAX)
    return kv, sc


def _compress_decode_cpu(state, kv_score, ape, plan, ratio):
    d = check_decode_args(state, kv_score, ape, plan, ratio)
    check_decode_plan_values(plan, state.shape[0], ratio)
    p = read_decode_plan(plan)
    out = kv_score.new_zeros((plan.shape[0], d), dtype=torch.float32)
    active = p.valid.nonzero().squeeze(1)
    state[p.write_loc[active]] = kv_score[active].to(state.dtype)
    # the new row is the window's last slot: the last row of page read_page_1
    emit = decode_emits(p, ratio).nonzero().squeeze(1)
    window = window_of(ratio)
    kv, sc = _window(
        state,
        kv_score,
        ratio,
        d,
        emit,
        torch.full_like(emit, window),
        p.read_page_0[emit],
        p.read_page_1[emit],
        p.seq_len[emit],
    )
    out[emit] = _pool(kv, sc, ape)
    return out


def _compress_prefill_cpu(state, kv_score, ape, plan_c, plan_w, ratio):
    d = check_prefill_args(state, kv_score, ape, plan_c, plan_w, ratio)
    check_prefill_plan_values(plan_c, plan_w, state.shape[0], kv_score.shape[0], ratio)
    c = read_compress_plan(plan_c)
    out = kv_score.new_zeros((plan_c.shape[0], d), dtype=torch.float32)
    emit = c.valid.nonzero().squeeze(1)
    kv, sc = _window(
        state,
        kv_score,
        ratio,
        d,
        c.ragged_id[emit],
        c.buffer_len[emit],
        c.read_page_0[emit],
        c.read_page_1[emit],
        c.seq_len[emit],
    )
    out[emit] = _pool(kv, sc, ape)
    w = read_write_plan(plan_w)
    keep = w.valid.nonzero().squeeze(1)
    state[w.write_loc[keep]] = kv_score[w.ragged_id[keep]].to(state.dtype)
    return out


def _compress_decode_fake(state, kv_score, ape, plan, ratio):
    d = check_decode_args(state, kv_score, ape, plan, ratio)
    return kv_score.new_empty((plan.shape[0], d), dtype=torch.float32)


def _compress_prefill_fake(state, kv_score, ape, plan_c, plan_w, ratio):
    d = check_prefill_args(state, kv_score, ape, plan_c, plan_w, ratio)
    return kv_score.new_empty((plan_c.shape[0], d), dtype=torch.float32)


register_op(
    "dsv4_compress_decode(Tensor(a!) state, Tensor kv_score, Tensor ape, Tensor plan, int ratio) -> Tensor",
    reference=_compress_decode_cpu,
    fake=_compress_decode_fake,
)
register_op(
    "dsv4_compress_prefill(Tensor(a!) state, Tensor kv_score, Tensor ape, Tensor plan_c, Tensor plan_w, "
    "int ratio) -> Tensor",
    reference=_compress_prefill_cpu,
    fake=_compress_prefill_fake,
)
