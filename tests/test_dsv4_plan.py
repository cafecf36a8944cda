"""Compressor planners: binary layouts, addressing, padding, sync-freedom, opcheck and argument errors."""

from __future__ import annotations

import re
import struct

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import custom_ops  # noqa: F401
from custom_ops.dsv4 import plan as cp
from custom_ops.dsv4.common import read_compress_plan, read_write_plan
from custom_ops.dsv4.plan import (
    plan_decode,
    plan_online_decode,
    plan_online_prefill,
    plan_prefill,
)


def _paged(rows: int, ctx: int, seed: int = 0):
    """A req_to_token table and a full -> SWA map that shuffles 256-token pages."""
    req_to_token = torch.arange(rows * ctx, dtype=torch.int32).view(rows, ctx)
    perm = torch.randperm(rows * ctx // 256, generator=torch.Generator().manual_seed(seed))
    full = torch.arange(rows * ctx)
    return req_to_token, perm[full // 256] * 256 + full % 256


def _swa_loc(req_to_token, full_to_state, rid, pos, ring):
    swa = int(full_to_state[int(req_to_token[rid, pos])])
    return (swa // 256) * ring + swa % ring


def test_decode_plan_bytes_ring_addressing():
    plan = plan_decode(torch.tensor([12, 3, 0]), torch.tensor([2, 1, 5]), None, None, 4, 8)
    assert plan.dtype == torch.uint8 and plan.shape == (3, 16)
    rows = [struct.unpack("<Iiii", bytes(plan[i].tolist())) for i in range(3)]
    # rid 2, pos 11: loc 2*8 + 3 = 19; pos0 = 7: loc 23 -> page 5; read_page_1 = 19 // 4 = 4
    assert rows[0] == (12, 19, 5, 4)
    assert rows[1] == (3, 10, 2, 2)
    assert rows[2] == (0xFFFFFFFF, -1, -1, -1)  # seq_len 0: padded row


@pytest.mark.parametrize("ratio", [4, 128])
def test_decode_plan_paged_addressing(ratio):
    ring = 8 if ratio == 4 else 128
    r2t, f2s = _paged(4, 1024)
    seq = torch.tensor([257, 1000, 4, 512], dtype=torch.int32)
    rid = torch.tensor([3, 0, 2, -1], dtype=torch.int32)
    p = plan_decode(seq, rid, r2t, f2s, ratio, ring, 256).view(torch.int32)
    for b in range(3):
        pos1 = int(seq[b]) - 1
        loc = _swa_loc(r2t, f2s, int(rid[b]), pos1, ring)
        loc0 = _swa_loc(r2t, f2s, int(rid[b]), max(pos1 - ratio, 0), ring)
        assert p[b].tolist() == [int(seq[b]), loc, loc0 // ratio, loc // ratio]
    assert p[3].tolist() == [-1, -1, -1, -1]


def test_prefill_plan_bytes_and_order():
    # request 0: prefix 2, extend 8 (events at pos 3, 7); request 1: prefix 0, extend 8 (pos 3, 7)
    plan_c, plan_w = plan_prefill(
        torch.tensor([10, 8]), torch.tensor([8, 8]), torch.tensor([0, 1]), None, None, 4, 8, 0, 18
    )
    assert plan_c.shape == (min(18, 18 // 4 + 2), 16) and plan_w.shape == (18, 8)
    rows = [struct.unpack("<IHHii", bytes(plan_c[i].tolist())) for i in range(plan_c.shape[0])]
    assert rows[:4] == [(4, 1, 6, 0, 0), (8, 5, 2, 0, 1), (4, 11, 4, 2, 2), (8, 15, 0, -1, 1)]
    assert rows[4:] == [(0xFFFFFFFF, 0, 0, -1, -1)] * 2
    w = [struct.unpack("<Ii", bytes(plan_w[i].tolist())) for i in range(18)]
    assert w[:10] == [(2, 4), (3, 5), (4, 6), (5, 7), (6, 0), (7, 1), (12, 12), (13, 13), (14, 14), (15, 15)]
    assert w[10:] == [(0xFFFFFFFF, -1)] * 8  # includes the two ragged padding rows 16, 17


@pytest.mark.parametrize("j_first", [0, 1, 5, 127])
def test_c128_prefill_plan_reads_pages_when_buffered(j_first):
    """buffer_len = 128 - min(j + 1, 128); the read pages are written for c128 too, not only for c4."""
    prefix = 128 - 1 - j_first
    r2t, f2s = _paged(2, 1024, seed=3)
    plan_c, _ = plan_prefill(
        torch.tensor([prefix + 200]), torch.tensor([200]), torch.tensor([1]), r2t, f2s, 128, 128, 256, 200
    )
    c = read_compress_plan(plan_c)
    assert int(c.ragged_id[0]) == j_first and int(c.buffer_len[0]) == 128 - (j_first + 1)
    if j_first < 127:
        loc = _swa_loc(r2t, f2s, 1, 127, 128)
        assert int(c.read_page_1[0]) == loc // 128
        assert int(c.read_page_0[0]) == _swa_loc(r2t, f2s, 1, 0, 128) // 128
    else:
        assert (int(c.read_page_0[0]), int(c.read_page_1[0])) == (-1, 0)


def test_c4_paged_write_plan_keeps_swa_page_tails():
    r2t, f2s = _paged(1, 1024)
    _, plan_w = plan_prefill(torch.tensor([1024]), torch.tensor([1024]), torch.tensor([0]), r2t, f2s, 4, 8, 256, 1024)
    w = plan_w.view(torch.int32)
    ragged = set(w[:, 0][w[:, 0] >= 0].tolist())
    tails = {p for p in range(1024) if p % 256 >= 252}
    assert ragged == tails | set(range(1020, 1024))
    for rg, loc in w[w[:, 0] >= 0].tolist():
        assert loc == _swa_loc(r2t, f2s, 0, rg, 8)


def test_online_plans():
    seq = torch.tensor([300, 128, 5])
    ext = torch.tensor([200, 128, 1])
    plan_c, plan_w = plan_online_prefill(seq, ext, torch.tensor([4, 6, 7]), 329)
    assert plan_c.shape == (329 // 128 + 3, 16) and plan_w.shape == (3, 16)
    c = [struct.unpack("<IHHii", bytes(plan_c[i].tolist())) for i in range(4)]
    # request 0: positions 100..299 -> [100, 128) closes, [128, 256) closes, [256, 300) trails
    assert c == [(128, 27, 28, 4, -1), (256, 155, 128, 4, -1), (128, 327, 128, 6, -1), (0xFFFFFFFF, 0, 0, -1, -1)]
    w = [struct.unpack("<IHHii", bytes(plan_w[i].tolist())) for i in range(3)]
    assert w == [(300, 199, 44, 4, -1), (5, 328, 1, 7, -1), (0xFFFFFFFF, 0, 0, -1, -1)]
    d = plan_online_decode(torch.tensor([129, 0]), torch.tensor([3, 1])).view(torch.int32)
    assert d.tolist() == [[129, 3, 3, -1], [-1, -1, -1, -1]]


@pytest.mark.parametrize("online", [False, True])
def test_planner_implementations_are_sync_free(online):
    """The planner bodies run on fake tensors: no .item(), no data-dependent shapes (CUDA-graph safe)."""
    with FakeTensorMode():
        seq = torch.empty(5, dtype=torch.int64)
        ext = torch.empty(5, dtype=torch.int32)
        rid = torch.empty(5, dtype=torch.int64)
        r2t = torch.empty(8, 1024, dtype=torch.int32)
        f2s = torch.empty(8192, dtype=torch.int64)
        if online:
            pc, pw = cp._plan_online_prefill_impl(seq, ext, rid, 300)
            pd = cp._plan_online_decode_impl(seq, rid)
        else:
            pc, pw = cp._plan_prefill_impl(seq, ext, rid, r2t, f2s, 4, 8, 256, 300)
            pd = cp._plan_decode_impl(seq, rid, r2t, f2s, 4, 8, 256)
    assert pd.shape == (5, 16) and pc.shape[1] == 16 and pc.shape[0] == min(300, 300 // (128 if online else 4) + 5)
    assert pw.shape == ((5, 16) if online else (300, 8))


def test_empty_batch_and_zero_tokens():
    z = torch.zeros(0, dtype=torch.int64)
    pc, pw = plan_prefill(z, z, z, None, None, 4, 8, 0, 0)
    assert pc.shape == (0, 16) and pw.shape == (0, 8)
    pc, pw = plan_prefill(z, z, z, None, None, 128, 128, 0, 7)
    assert (pc.view(torch.int32)[:, 0] == -1).all() and (pw.view(torch.int32)[:, 0] == -1).all()
    assert plan_decode(z, z, None, None, 4, 8).shape == (0, 16)


@pytest.mark.parametrize("online", [False, True])
def test_prefill_planners_compile_with_a_data_dependent_token_count(online):
    """`num_q_tokens` read from a tensor inside a compiled graph (an unbacked SymInt): the range check becomes a
    runtime assert, not a guard that fails the compile; the plans equal eager's."""
    ops = torch.ops.dspark
    seq, ext, rid = torch.tensor([5, 8, 12, 9]), torch.tensor([2, 3, 1, 4]), torch.arange(4)

    def plans(s, e, r):
        n = e.sum().item()
        if online:
            return ops.dsv4_plan_online_prefill(s, e, r, n)
        return ops.dsv4_plan_prefill(s, e, r, None, None, 4, 8, 0, n)

    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        compiled = torch.compile(plans, backend="aot_eager", fullgraph=True)(seq, ext, rid)
    assert all(torch.equal(a, b) for a, b in zip(compiled, plans(seq, ext, rid), strict=True))


def test_opcheck_planners():
    r2t, f2s = _paged(3, 512)
    seq = torch.tensor([300, 9, 129])
    ext = torch.tensor([44, 9, 2])
    rid = torch.tensor([2, 0, 1])
    ops = torch.ops.dspark
    torch.library.opcheck(ops.dsv4_plan_decode, (seq, rid, r2t, f2s, 4, 8, 256))
    torch.library.opcheck(ops.dsv4_plan_decode, (seq, rid, None, None, 128, 128, 0))
    torch.library.opcheck(ops.dsv4_plan_prefill, (seq, ext, rid, r2t, f2s, 4, 8, 256, 60))
    torch.library.opcheck(ops.dsv4_plan_prefill, (seq, ext, rid, None, None, 128, 256, 0, 55))
    torch.library.opcheck(ops.dsv4_plan_online_decode, (seq, rid))
    torch.library.opcheck(ops.dsv4_plan_online_prefill, (seq, ext, rid, 55))


PREFILL_ARGS = {
    "seq_lens": torch.tensor([5]),
    "extend_lens": torch.tensor([5]),
    "req_pool_indices": torch.tensor([0]),
    "req_to_token": None,
    "full_to_state": None,
    "ratio": 4,
    "ring_size": 8,
    "swa_page_size": 0,
    "num_q_tokens": 5,
}

BAD_STRUCTURE = [
    ({"ratio": 3}, ValueError, "ratio"),
    ({"ratio": 8}, ValueError, "ratio"),
    ({"ring_size": 4}, ValueError, "ring_size"),
    ({"ring_size": 6}, ValueError, "ring_size"),
    ({"ring_size": 2**32}, ValueError, "ring_size"),
    ({"seq_lens": torch.tensor([1.0])}, TypeError, "seq_lens"),
    ({"seq_lens": torch.tensor([[5]])}, ValueError, "seq_lens"),
    ({"req_pool_indices": torch.tensor([0, 1])}, ValueError, "req_pool_indices"),
    ({"req_pool_indices": torch.tensor([0.0])}, TypeError, "req_pool_indices"),
    ({"req_to_token": torch.zeros(2, 8, dtype=torch.int32)}, ValueError, "full_to_state"),
    ({"full_to_state": torch.zeros(8, dtype=torch.int64)}, ValueError, "full_to_state"),
    (
        {"req_to_token": torch.zeros(2, 8, dtype=torch.int32), "full_to_state": torch.zeros(8)},
        TypeError,
        "full_to_state",
    ),
    (
        {"req_to_token": torch.zeros(8, dtype=torch.int32), "full_to_state": torch.zeros(8, dtype=torch.int64)},
        ValueError,
        "req_to_token",
    ),
    (
        {"req_to_token": torch.zeros(2, 8, dtype=torch.int32), "full_to_state": torch.zeros(8, dtype=torch.int64)},
        ValueError,
        "swa_page_size",
    ),
    (
        {
            "req_to_token": torch.zeros(2, 8, dtype=torch.int32),
            "full_to_state": torch.zeros(8, dtype=torch.int64),
            "swa_page_size": 12,
        },
        ValueError,
        "swa_page_size",
    ),
    ({"num_q_tokens": 65536}, ValueError, "num_q_tokens"),
    ({"num_q_tokens": -1}, ValueError, "num_q_tokens"),
    ({"extend_lens": torch.tensor([1, 2])}, ValueError, "extend_lens"),
    ({"extend_lens": torch.tensor([1.0])}, TypeError, "extend_lens"),
]


def _call(op, args, fake: bool):
    """Call `op` on real tensors, or (fake) on fake copies: the fake impl, which torch.compile runs."""
    if not fake:
        return op(*args)
    with FakeTensorMode() as mode:
        return op(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])


@pytest.mark.parametrize("fake", [False, True])
@pytest.mark.parametrize(("kwargs", "err", "match"), BAD_STRUCTURE)
def test_prefill_planner_op_checks_structure(kwargs, err, match, fake):
    """The registered op (and its fake impl, which torch.compile runs) rejects bad arguments, not just a wrapper."""
    args = {**PREFILL_ARGS, **kwargs}
    with pytest.raises(err, match=match):
        _call(torch.ops.dspark.dsv4_plan_prefill, args.values(), fake)


@pytest.mark.parametrize("fake", [False, True])
@pytest.mark.parametrize(
    ("kwargs", "err", "match"), [c for c in BAD_STRUCTURE if "extend_lens" not in c[0] and "num_q_tokens" not in c[0]]
)
def test_decode_planner_op_checks_structure(kwargs, err, match, fake):
    args = {**PREFILL_ARGS, **kwargs}
    del args["extend_lens"], args["num_q_tokens"]
    with pytest.raises(err, match=match):
        _call(torch.ops.dspark.dsv4_plan_decode, args.values(), fake)


@pytest.mark.parametrize("fake", [False, True])
@pytest.mark.parametrize(
    ("kwargs", "err", "match"),
    [c for c in BAD_STRUCTURE if set(c[0]) <= {"seq_lens", "extend_lens", "req_pool_indices", "num_q_tokens"}],
)
def test_online_planner_ops_check_structure(kwargs, err, match, fake):
    a = {**PREFILL_ARGS, **kwargs}
    ops = torch.ops.dspark
    with pytest.raises(err, match=match):
        _call(
            ops.dsv4_plan_online_prefill,
            (a["seq_lens"], a["extend_lens"], a["req_pool_indices"], a["num_q_tokens"]),
            fake,
        )
        _call(ops.dsv4_plan_online_decode, (a["seq_lens"], a["req_pool_indices"]), fake)


def test_paged_plan_bad_swa_page_size():
    r2t, f2s = _paged(1, 256)
    with pytest.raises(ValueError, match="swa_page_size"):
        plan_decode(torch.tensor([5]), torch.tensor([0]), r2t, f2s, 128, 128, 200)


def test_paged_plans_skip_unmapped_slots():
    """Negative table entries are unmapped: the row that needs one is invalid, never an error."""
    r2t, f2s = _paged(2, 256)
    f2s[5] = -1  # an unmapped SWA slot
    r2t[1, 7] = -1  # an unmapped token
    p = plan_decode(torch.tensor([6, 8, 9]), torch.tensor([0, 1, 1]), r2t, f2s, 4, 8, 256).view(torch.int32)
    assert p[0].tolist() == [-1, -1, -1, -1] and p[1].tolist() == [-1, -1, -1, -1]
    assert p[2, 0] == 9 and p[2, 1] >= 0


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda seq, rid, r2t, f2s: seq.fill_(300), r"seq_lens\[0\] = 300 is out of range: expected <= 256"),
        (lambda seq, rid, r2t, f2s: rid.fill_(2), r"req_pool_indices\[0\] = 2 is out of range: expected < 2 \(rows"),
        (
            lambda seq, rid, r2t, f2s: r2t[1, 3].fill_(512),
            r"req_to_token\[1, 3\] = 512 is out of range: expected < 512",
        ),
        (lambda seq, rid, r2t, f2s: f2s[r2t[1, 3]].fill_(2**40), r"full_to_state\[259\] = 1099511627776 is out"),
    ],
)
def test_paged_plans_reject_out_of_range_values(change, match):
    """CPU: a position past the page table, a request id past its rows and table entries past the next table (or
    whose state row does not fit int32) raise ValueError naming the argument and the entry."""
    r2t, f2s = _paged(2, 256)
    seq, rid = torch.tensor([4]), torch.tensor([1])
    change(seq, rid, r2t, f2s)
    with pytest.raises(ValueError, match=match):
        plan_decode(seq, rid, r2t, f2s, 4, 8, 256)
    with pytest.raises(ValueError, match=match):
        plan_prefill(seq, torch.tensor([4]), rid, r2t, f2s, 4, 8, 256, 4)


WRAPPING_REQUESTS = [(4, 2**29 + 1), (128, 2**25 + 1)]  # rid * ring_size + pos wraps in int32


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(("ratio", "rid"), WRAPPING_REQUESTS)
def test_planners_reject_request_ids_whose_state_rows_wrap(ratio, rid, idx_dtype):
    """A request id whose ring lies past 2^31 state rows used to wrap into another request's rows (c4: row 10 of
    request 1, c128: row 132). CPU raises naming req_pool_indices; the CUDA semantics mark the rows invalid."""
    ring = 8 if ratio == 4 else 128
    seq = torch.tensor([ratio + 2, ratio], dtype=idx_dtype)
    rids = torch.tensor([0, rid], dtype=idx_dtype)
    match = rf"req_pool_indices\[1\] = {rid} is out of range: expected < {2**31 // ring} "
    with pytest.raises(ValueError, match=match):
        plan_decode(seq, rids, None, None, ratio, ring)
    with pytest.raises(ValueError, match=match):
        plan_prefill(seq, seq.clone(), rids, None, None, ratio, ring, 0, int(seq.sum()))
    plan, _ = cp.decode_plan_unchecked(seq, rids, None, None, ratio, ring)
    assert plan.view(torch.int32)[1].tolist() == [-1, -1, -1, -1]
    (plan_c, plan_w), _ = cp.prefill_plan_unchecked(seq, seq.clone(), rids, None, None, ratio, ring, 0, int(seq.sum()))
    w = read_write_plan(plan_w)
    assert (w.ragged_id[w.valid] < ratio + 2).all() and (w.write_loc[w.valid] < ring).all()
    assert (read_compress_plan(plan_c).ragged_id[read_compress_plan(plan_c).valid] < ratio + 2).all()


def test_online_planners_reject_slots_past_int32():
    """Online slot 2^32 + 1 used to be narrowed to slot 1."""
    seq, rids = torch.tensor([3, 5]), torch.tensor([0, 2**32 + 1])
    with pytest.raises(ValueError, match=r"req_pool_indices\[1\] = 4294967297 is out of range: expected < 2147483648"):
        plan_online_decode(seq, rids)
    with pytest.raises(ValueError, match=r"req_pool_indices\[1\] = 4294967297"):
        plan_online_prefill(seq, seq.clone(), rids, 8)
    plan, _ = cp.online_decode_plan_unchecked(seq, rids)
    assert plan.view(torch.int32)[1].tolist() == [-1, -1, -1, -1]
    (_, plan_w), _ = cp.online_prefill_plan_unchecked(seq, seq.clone(), rids, 8)
    assert read_compress_plan(plan_w).read_page_0[read_compress_plan(plan_w).valid].tolist() == [0]


@pytest.mark.parametrize("online", [False, True])
@pytest.mark.parametrize(
    ("seq", "ext", "n", "match"),
    [
        ([8, 4], [8, 4], 5, r"extend_lens\[0\] = 8 is out of range: expected 0..5 \(num_q_tokens\)"),
        ([8, 4], [4, 4], 5, r"extend_lens\[1\] = 4 is out of range: sum\(extend_lens\[:2\]\) = 8 exceeds num_q"),
        ([8, 3], [4, 4], 8, r"seq_lens\[1\] = 3 is out of range: expected >= extend_lens\[1\] = 4"),
        ([8, 4], [-1, 4], 8, r"extend_lens\[0\] = -1 is out of range"),
    ],
)
def test_prefill_planners_reject_inconsistent_extends(seq, ext, n, match, online):
    """`x` with 5 rows and extend_lens [8, 4] used to plan valid=[True, False, False]; seq_lens < extend_lens was
    accepted. CPU raises; the CUDA semantics skip every row of the affected request and keep the others."""
    seq, ext, rids = torch.tensor(seq), torch.tensor(ext), torch.tensor([0, 1])
    with pytest.raises(ValueError, match=match):
        if online:
            plan_online_prefill(seq, ext, rids, n)
        else:
            plan_prefill(seq, ext, rids, None, None, 4, 8, 0, n)
    if online:
        (plan_c, plan_w), problems = cp.online_prefill_plan_unchecked(seq, ext, rids, n)
    else:
        (plan_c, plan_w), problems = cp.prefill_plan_unchecked(seq, ext, rids, None, None, 4, 8, 0, n)
    assert re.match(match, problems.first().message())
    bad = int(problems.first().index[0])
    ends = torch.cumsum(ext.clamp(0, n + 1), 0)
    affected = {b for b in range(2) if b == bad or bool(ends[b] > n) or bool(ext[b] < 0) or bool(seq[b] < ext[b])}
    ragged = read_compress_plan(plan_c).ragged_id[read_compress_plan(plan_c).valid].tolist()
    if not online:
        w = read_write_plan(plan_w)
        ragged += w.ragged_id[w.valid].tolist()
    else:
        ragged += read_compress_plan(plan_w).ragged_id[read_compress_plan(plan_w).valid].tolist()
    owners = {int(torch.searchsorted(ends, torch.tensor(r), right=True)) for r in ragged}
    assert owners == set(range(2)) - affected
