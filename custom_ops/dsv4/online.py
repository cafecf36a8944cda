"""Online c128 DeepSeek-V4 KV compression: one running softmax state per request (docs/dsv4_compress.md).

State row (fp32 `[slots, 3D]`): `| m (running max of the score) | l (sum of exp(s - m)) | a (normalized
weighted average of kv) |`; a cleared row is `m = -inf, l = 0, a = 0`. Token update with
`s = sc + ape[pos % 128]`: a chunk starts fresh at `pos % 128 == 0` (`m = s, l = 1, a = kv`), otherwise
`m' = max(m, s)`, `l' = l e^(m-m') + e^(s-m')`, `a' = (a l e^(m-m') + kv e^(s-m')) / l'`. Two partial states
merge the same way. The result equals offline c128 up to fp32 rounding.

- Decode (plan `{seq_len, slot, slot, -1}`): load the state unless the token starts a chunk, update; at
  `pos % 128 == 127` the average is the output row and the state is **not** stored; otherwise the state is
  stored at `write_loc`.
- Prefill, two ordered passes over segments (`plan_online_prefill`): a segment's tokens reduce to
  (m, l, a) and, when the segment does not start its chunk, merge with the stored state (slot
  `read_page_1` if >= 0, else `read_page_0`). Pass 1 (`plan_c`, chunk-closing segments) writes `a` to the
  output; pass 2 (`plan_w`, trailing partial segments) stores the state at `read_page_0`. Pass 1 reads
  before pass 2 writes.

Outputs are fresh fp32 tensors (decode `[B, D]`, prefill `[C, D]` for `plan_c`); rows without an entry are zero.

Plan values (docs/contract.md): padding rows are DecodePlan rows with `write_loc < 0` and CompressPlan rows with
`seq_len == 0xFFFFFFFF` or `read_page_0 < 0` (the request's slot). Every other row must address slots inside
`state` and rows inside `kv_score`, and a segment must lie inside one 128-chunk; on CPU (and on CUDA in checking
mode) the first row that does not raises `ValueError` before anything is written, the CUDA kernels skip it.
"""

from __future__ import annotations

import torch

from custom_ops._library import register_op
from custom_ops.checks import check_no_shared_memory
from custom_ops.dsv4.common import (
    FLT_MAX,
    INPUT_DTYPES,
    CompressRows,
    FieldProblem,
    check_device,
    check_head_dim,
    check_matrix,
    check_plan,
    check_rows,
    raise_first,
    read_compress_plan,
    read_decode_plan,
)
from custom_ops.dsv4.plan import ONLINE_RATIO


def check_online_args(state, kv_score, ape) -> int:
    """Structural checks shared by the online ops; returns the head dim D."""
    d = check_head_dim(ape, ONLINE_RATIO)
    check_matrix("state", state, 3 * d, (torch.float32,))
    check_matrix("kv_score", kv_score, 2 * d, INPUT_DTYPES)
    if not state.is_contiguous():
        raise ValueError("state: expected a contiguous [slots, 3D] fp32 buffer")
    check_device("kv_score", kv_score, state.device)
    check_device("ape", ape, state.device)
    return d


def check_online_decode_args(state, kv_score, ape, plan) -> int:
    """Structural checks of `dsv4_online_compress_decode` (CPU and fake impls); returns D."""
    d = check_online_args(state, kv_score, ape)
    check_plan("plan", plan, 16, state.device)
    check_rows("plan", plan, kv_score.shape[0], "one per kv_score row")
    check_no_shared_memory("state", state, (("kv_score", kv_score), ("ape", ape), ("plan", plan)))
    return d


def check_online_prefill_args(state, kv_score, ape, plan_c, plan_w) -> int:
    """Structural checks of `dsv4_online_compress_prefill` (CPU and fake impls); returns D."""
    d = check_online_args(state, kv_score, ape)
    check_plan("plan_c", plan_c, 16, state.device)
    check_plan("plan_w", plan_w, 16, state.device)
    inputs = (("kv_score", kv_score), ("ape", ape), ("plan_c", plan_c), ("plan_w", plan_w))
    check_no_shared_memory("state", state, inputs)
    return d


def _slots_what(slots: int) -> str:
    return f"expected < {slots} (rows of state)"


def online_decode_plan_problems(plan: torch.Tensor, slots: int) -> list[FieldProblem]:
    """The non-padding rows that write, or (not starting a chunk) read, a slot outside the state."""
    p = read_decode_plan(plan)
    loads = p.valid & ((p.seq_len - 1) % ONLINE_RATIO != 0)
    outside = (p.read_page_0 < 0) | (p.read_page_0 >= slots)
    return [
        FieldProblem("plan", "write_loc", p.write_loc, p.valid & (p.write_loc >= slots), _slots_what(slots)),
        FieldProblem(
            "plan", "read_page_0", p.read_page_0, loads & outside, f"expected >= 0 and < {slots} (rows of state)"
        ),
    ]


def check_online_decode_plan_values(plan: torch.Tensor, slots: int) -> None:
    """Raise `ValueError` for the first of `online_decode_plan_problems`."""
    raise_first(online_decode_plan_problems(plan, slots))


def segment_rows(plan: torch.Tensor) -> tuple[CompressRows, torch.Tensor]:
    """CompressPlan columns of online segments and the non-padding rows (valid seq_len, slot >= 0)."""
    c = read_compress_plan(plan)
    return c, c.valid & (c.read_page_0 >= 0)


def online_segment_problems(name: str, plan: torch.Tensor, slots: int, input_rows: int) -> list[FieldProblem]:
    """The non-padding segment rows that are not inside one 128-chunk or that address rows outside `kv_score` or
    slots outside the state."""
    c, valid = segment_rows(plan)
    hi = torch.minimum(c.seq_len, (c.seq_len - 1) % ONLINE_RATIO + 1)
    rows_what = f"expected < {input_rows} (rows of kv_score)"
    early = valid & (c.ragged_id + 1 < c.buffer_len)
    return [
        FieldProblem(
            name,
            "buffer_len",
            c.buffer_len,
            valid & ((c.buffer_len < 1) | (c.buffer_len > hi)),
            lambda i: (
                f"expected 1..{int(hi[i])} (a segment of the 128-chunk that ends at seq_len = {int(c.seq_len[i])})"
            ),
        ),
        FieldProblem(name, "ragged_id", c.ragged_id, valid & (c.ragged_id >= input_rows), rows_what),
        FieldProblem(
            name, "ragged_id", c.ragged_id, early, lambda i: f"expected >= {int(c.buffer_len[i]) - 1} (buffer_len - 1)"
        ),
        FieldProblem(name, "read_page_0", c.read_page_0, valid & (c.read_page_0 >= slots), _slots_what(slots)),
        FieldProblem(name, "read_page_1", c.read_page_1, valid & (c.read_page_1 >= slots), _slots_what(slots)),
    ]


def check_online_segment_values(name: str, plan: torch.Tensor, slots: int, input_rows: int) -> None:
    """Raise `ValueError` for the first of `online_segment_problems`."""
    raise_first(online_segment_problems(name, plan, slots, input_rows))


def online_compress_decode(
    state: torch.Tensor, kv_score: torch.Tensor, ape: torch.Tensor, plan: torch.Tensor
) -> torch.Tensor:
    """Online c128 decode step (one token per request).

    | arg | shape | dtype | mutated | notes |
    |---|---|---|---|---|
    | state | [slots, 3D] | fp32 | yes | running (m, l, a) per request |
    | kv_score | [B, 2D] | fp32/bf16 | no | `| kv | sc |` rows, unit inner stride |
    | ape | [128, D] | fp32 | no | D in {128, 512} |
    | plan | [B, 16] | uint8 | no | DecodePlan rows (`plan_online_decode`) |

    Returns fp32 `[B, D]`: the compressed entry where `seq_len % 128 == 0`, zero elsewhere.
    """
    return torch.ops.dspark.dsv4_online_compress_decode(state, kv_score, ape, plan)


def online_compress_prefill(
    state: torch.Tensor, kv_score: torch.Tensor, ape: torch.Tensor, plan_c: torch.Tensor, plan_w: torch.Tensor
) -> torch.Tensor:
    """Online c128 prefill/extend step: compress pass over `plan_c`, then state-write pass over `plan_w`.

    | arg | shape | dtype | mutated | notes |
    |---|---|---|---|---|
    | state | [slots, 3D] | fp32 | yes | running (m, l, a) per request |
    | kv_score | [N, 2D] | fp32/bf16 | no | ragged `| kv | sc |` rows, unit inner stride |
    | ape | [128, D] | fp32 | no | D in {128, 512} |
    | plan_c | [C, 16] | uint8 | no | chunk-closing segments (`plan_online_prefill`) |
    | plan_w | [Wr, 16] | uint8 | no | trailing partial segments (`plan_online_prefill`) |

    Returns fp32 `[C, D]`, row k for `plan_c[k]`.
    """
    return torch.ops.dspark.dsv4_online_compress_prefill(state, kv_score, ape, plan_c, plan_w)


def _merge(m1, l1, a1, m2, l2, a2):
    """Merge two partial softmax states; state 1 may be empty (m1 = -inf, l1 = 0)."""
    m = torch.maximum(m1, m2)
    w1 = l1 * torch.exp(m1 - m)
    w2 = l2 * torch.exp(m2 - m)
    total = w1 + w2
    return m, total, (a1 * w1 + a2 * w2) / total


def _split(rows: torch.Tensor, d: int):
    return rows[:, :d], rows[:, d : 2 * d], rows[:, 2 * d :]


def _online_decode_cpu(state, kv_score, ape, plan):
    d = check_online_decode_args(state, kv_score, ape, plan)
    check_online_decode_plan_values(plan, state.shape[0])
    p = read_decode_plan(plan)
    out = kv_score.new_zeros((plan.shape[0], d), dtype=torch.float32)
    off = (p.seq_len - 1) % ONLINE_RATIO
    b = p.valid.nonzero().squeeze(1)
    kv = kv_score[b].float()
    s = kv[:, d:] + ape[off[b]]
    fresh = (off[b] == 0)[:, None]
    old = state[torch.where(fresh[:, 0], 0, p.read_page_0[b])]
    m1, l1, a1 = _split(old, d)
    m1 = m1.masked_fill(fresh, -torch.inf)
    l1 = l1.masked_fill(fresh, 0.0)
    a1 = a1.masked_fill(fresh, 0.0)
    m, total, a = _merge(m1, l1, a1, s, torch.ones_like(s), kv[:, :d])
    closes = off[b] == ONLINE_RATIO - 1
    out[b[closes]] = a[closes]
    keep = ~closes
    state[p.write_loc[b[keep]]] = torch.cat([m, total, a], 1)[keep]
    return out


def _segments(state, kv_score, ape, plan: torch.Tensor, d: int):
    """Reduce each non-padding segment (merged with its stored partial state) to (rows, slots, m, l, a)."""
    c, valid = segment_rows(plan)
    seg = c.buffer_len
    chunk_off = (c.seq_len - seg) % ONLINE_RATIO
    load = torch.where(c.read_page_1 >= 0, c.read_page_1, c.read_page_0)
    k = valid.nonzero().squeeze(1)
    i = torch.arange(ONLINE_RATIO, device=state.device)
    inside = i < seg[k, None]
    tok = torch.where(inside, c.ragged_id[k, None] - seg[k, None] + 1 + i, 0)
    x = kv_score[tok].float()
    slot = (chunk_off[k, None] + i).clamp(max=ONLINE_RATIO - 1)
    s = (x[..., d:] + ape[slot]).masked_fill(~inside[..., None], -FLT_MAX)
    m = s.amax(1)
    e = torch.exp(s - m[:, None])
    total = e.sum(1)
    a = (e * x[..., :d]).sum(1) / total
    fresh = (chunk_off[k] == 0)[:, None]
    old = state[torch.where(fresh[:, 0], 0, load[k])]
    m1, l1, a1 = _split(old, d)
    m1 = m1.masked_fill(fresh, -torch.inf)
    l1 = l1.masked_fill(fresh, 0.0)
    a1 = a1.masked_fill(fresh, 0.0)
    return k, c.read_page_0[k], *_merge(m1, l1, a1, m, total, a)


def _online_prefill_cpu(state, kv_score, ape, plan_c, plan_w):
    d = check_online_prefill_args(state, kv_score, ape, plan_c, plan_w)
    for name, plan in (("plan_c", plan_c), ("plan_w", plan_w)):
        check_online_segment_values(name, plan, state.shape[0], kv_score.shape[0])
    out = kv_score.new_zeros((plan_c.shape[0], d), dtype=torch.float32)
    k, _, _, _, a = _segments(state, kv_score, ape, plan_c, d)
    out[k] = a
    _, dest, m, total, a = _segments(state, kv_score, ape, plan_w, d)
    state[dest] = torch.cat([m, total, a], 1)
    return out


def _online_decode_fake(state, kv_score, ape, plan):
    d = check_online_decode_args(state, kv_score, ape, plan)
    return kv_score.new_empty((plan.shape[0], d), dtype=torch.float32)


def _online_prefill_fake(state, kv_score, ape, plan_c, plan_w):
    d = check_online_prefill_args(state, kv_score, ape, plan_c, plan_w)
    return kv_score.new_empty((plan_c.shape[0], d), dtype=torch.float32)


register_op(
    "dsv4_online_compress_decode(Tensor(a!) state, Tensor kv_score, Tensor ape, Tensor plan) -> Tensor",
    reference=_online_decode_cpu,
    fake=_online_decode_fake,
)
register_op(
    "dsv4_online_compress_prefill(Tensor(a!) state, Tensor kv_score, Tensor ape, Tensor plan_c, "
    "Tensor plan_w) -> Tensor",
    reference=_online_prefill_cpu,
    fake=_online_prefill_fake,
)
