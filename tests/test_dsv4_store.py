"""compress_norm_rope_store: FlashMLA (D = 512) and indexer (D = 128) FP8 / FP4 stores against an fp64 formula."""

from __future__ import annotations

import pytest
import torch
from dsv4_cases import EPS, FREQS, call_op, check_store

import custom_ops  # noqa: F401
from custom_ops.dsv4.plan import plan_decode, plan_prefill
from custom_ops.dsv4.store import cache_page_bytes, compress_norm_rope_store


@pytest.mark.parametrize(("d", "fp4"), [(512, False), (128, False), (128, True)])
@pytest.mark.parametrize("ratio", [4, 128])
def test_prefill_store(d, fp4, ratio):
    g = torch.Generator().manual_seed(d + ratio)
    seq = torch.tensor([3 * ratio + 1, 2 * ratio])
    ext = torch.tensor([2 * ratio + 3, 2 * ratio])
    n = int(ext.sum())
    plan_c, _ = plan_prefill(seq, ext, torch.tensor([0, 1]), None, None, ratio, 2 * ratio if ratio == 4 else 128, 0, n)
    kv = torch.randn(plan_c.shape[0], d, generator=g) * 3
    w = torch.rand(d, generator=g) + 0.5
    page_size = 16
    out_loc = torch.randperm(1024, generator=g)[:n] + 1
    out_loc[int(plan_c.view(torch.int32)[1, 1]) & 0xFFFF] = -1  # the second entry's slot: skipped
    shape = (1040 // page_size, cache_page_bytes(d, page_size, fp4))
    cache = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    before = cache.clone()
    compress_norm_rope_store(kv, plan_c, w, EPS, FREQS, out_loc, cache, page_size, ratio, decode=False, fp4=fp4)
    c = plan_c.view(torch.int32)
    valid = (c[:, 0] != -1).nonzero().squeeze(1)
    ragged = c[valid, 1] & 0xFFFF
    keep = out_loc[ragged] >= 0
    rows, slots = valid[keep], out_loc[ragged[keep]]
    assert valid.numel() == 5 and rows.numel() == 4  # 3 + 2 windows closed, one slot negative
    check_store(kv[rows], w, c[rows, 0].long() - ratio, slots, cache, before, page_size, fp4)


@pytest.mark.parametrize(("d", "fp4"), [(512, False), (128, False), (128, True)])
def test_decode_store_skips_rows_without_entries(d, fp4):
    g = torch.Generator().manual_seed(d)
    ratio = 4
    seq = torch.tensor([8, 9, 12, 16, 0], dtype=torch.int32)
    rid = torch.tensor([0, 1, 2, 3, -1], dtype=torch.int32)
    plan = plan_decode(seq, rid, None, None, ratio, 8)
    kv = torch.randn(5, d, generator=g)
    w = torch.rand(d, generator=g) + 0.5
    out_loc = torch.tensor([3, 5, -1, 6, 7], dtype=torch.int32)
    cache = torch.randint(0, 256, (4, cache_page_bytes(d, 2, fp4)), dtype=torch.uint8, generator=g)
    before = cache.clone()
    compress_norm_rope_store(kv, plan, w, EPS, FREQS, out_loc, cache, 2, ratio, decode=True, fp4=fp4)
    rows = torch.tensor([0, 3])  # row 1: 9 % 4 != 0; row 2: slot -1; row 4: padded
    check_store(kv[rows], w, seq[rows].long() - ratio, out_loc[rows].long(), cache, before, 2, fp4)


@pytest.mark.parametrize(("d", "fp4"), [(512, False), (128, True)])
def test_opcheck_store(d, fp4):
    g = torch.Generator().manual_seed(0)
    plan = plan_decode(torch.tensor([8, 128]), torch.tensor([0, 1]), None, None, 4, 8)
    cache = torch.zeros(4, cache_page_bytes(d, 2, fp4), dtype=torch.uint8)
    args = (
        torch.randn(2, d, generator=g),
        plan,
        torch.ones(d),
        EPS,
        FREQS,
        torch.tensor([1, 4]),
        cache,
        2,
        4,
        True,
        fp4,
    )
    torch.library.opcheck(torch.ops.dspark.dsv4_compress_norm_rope_store, args)


def _store_args(d: int = 512, fp4: bool = False) -> dict:
    """Decode-store arguments: rows 0 and 1 close windows at positions 4 and 0 (slots 0 and 1 of 4 pages of 2)."""
    return {
        "kv": torch.randn(2, d, generator=torch.Generator().manual_seed(d)),
        "plan": plan_decode(torch.tensor([8, 4]), torch.tensor([0, 1]), None, None, 4, 8),
        "norm_weight": torch.ones(d),
        "eps": EPS,
        "freqs": FREQS,
        "out_loc": torch.tensor([0, 1]),
        "kvcache": torch.randint(0, 256, (4, cache_page_bytes(d, 2, fp4)), dtype=torch.uint8),
        "page_size": 2,
        "ratio": 4,
        "decode": True,
        "fp4": fp4,
    }


STORE_BAD_STRUCTURE = [
    (lambda a: a.update(kv=torch.zeros(2, 256)), ValueError, "kv"),
    (lambda a: a.update(kv=torch.zeros(2, 512, dtype=torch.float64)), TypeError, "kv"),
    (lambda a: a.update(kv=torch.zeros(512, 2).t()), ValueError, "kv"),
    (lambda a: a.update(norm_weight=torch.ones(128)), ValueError, "norm_weight"),
    (lambda a: a.update(norm_weight=torch.ones(512, dtype=torch.float64)), TypeError, "norm_weight"),
    (lambda a: a.update(norm_weight=torch.ones(1024)[::2]), ValueError, "norm_weight"),
    (lambda a: a.update(freqs=FREQS[:, :32].contiguous()), ValueError, "freqs"),
    (lambda a: a.update(freqs=FREQS.double()), TypeError, "freqs"),
    (lambda a: a.update(out_loc=torch.zeros(2)), TypeError, "out_loc"),
    (lambda a: a.update(out_loc=torch.tensor([0])), ValueError, "out_loc"),
    (lambda a: a.update(out_loc=torch.tensor([[0, 1]])), ValueError, "out_loc"),
    (lambda a: a.update(kvcache=torch.zeros(4, 100, dtype=torch.uint8)), ValueError, "kvcache"),
    (lambda a: a.update(kvcache=a["kvcache"].view(torch.int8)), TypeError, "kvcache"),
    (lambda a: a.update(page_size=3), ValueError, "page_size"),
    (lambda a: a.update(ratio=2), ValueError, "ratio"),
    (lambda a: a.update(fp4=True), ValueError, "fp4"),
    (lambda a: a.update(eps=-10.0), ValueError, "eps"),
    (lambda a: a.update(eps=float("nan")), ValueError, "eps"),
    (lambda a: a.update(eps=float("inf")), ValueError, "eps"),
    (lambda a: a.update(plan=a["plan"][:1]), ValueError, "plan"),
]


@pytest.mark.parametrize("fake", [False, True])
@pytest.mark.parametrize(("change", "err", "match"), STORE_BAD_STRUCTURE)
def test_store_bad_inputs(change, err, match, fake):
    """The CPU and fake impls share one check function; eps = -10 used to store NaN and a decode out_loc shorter
    than the plan used to drop entries silently."""
    args = _store_args()
    change(args)
    before = args["kvcache"].clone()
    with pytest.raises(err, match=match):
        call_op(torch.ops.dspark.dsv4_compress_norm_rope_store, args, fake)
    assert torch.equal(args["kvcache"], before)


@pytest.mark.parametrize(("d", "fp4"), [(512, False), (128, False), (128, True)])
@pytest.mark.parametrize("slot", [8, 2**31, 2**40, 2**62 + 5])
def test_store_rejects_slots_past_the_cache(d, fp4, slot):
    """A huge int64 slot used to overflow the byte offset and land in another page. CPU: ValueError naming out_loc,
    nothing written."""
    args = _store_args(d, fp4)
    args["out_loc"] = torch.tensor([0, slot])
    before = args["kvcache"].clone()
    with pytest.raises(ValueError, match=rf"out_loc\[1\] = {slot} is out of range: expected < 8 \(4 pages of 2 slots"):
        compress_norm_rope_store(**args)
    assert torch.equal(args["kvcache"], before)


def test_store_rejects_ragged_ids_past_out_loc_and_positions_past_freqs():
    """Prefill rows read `out_loc[ragged_id]`: an out_loc shorter than the ragged rows used to drop entries; a RoPE
    position past `freqs` raised IndexError."""
    seq, ext = torch.tensor([12]), torch.tensor([12])
    plan_c, _ = plan_prefill(seq, ext, torch.tensor([0]), None, None, 4, 8, 0, 12)
    args = {**_store_args(), "kv": torch.randn(plan_c.shape[0], 512), "plan": plan_c, "decode": False}
    args["out_loc"] = torch.arange(10) % 8
    with pytest.raises(
        ValueError, match=r"plan\[2\]\.ragged_id = 11 is out of range: expected < 10 \(entries of out_loc\)"
    ):
        compress_norm_rope_store(**args)
    args["out_loc"], args["freqs"] = torch.arange(12) % 8, FREQS[:7].contiguous()
    with pytest.raises(
        ValueError, match=r"plan\[2\]\.seq_len = 12 is out of range: expected <= 10 \(the RoPE position"
    ):
        compress_norm_rope_store(**args)
    args["out_loc"][11] = -1  # the row that needs position 8 does not store: no error
    compress_norm_rope_store(**args)


@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize(("d", "fp4"), [(512, False), (128, False), (128, True)])
def test_store_with_no_stored_rows(d, fp4, decode):
    """A step that closes no window (3 of 4 c4 decode steps) stores nothing; the FP8 indexer store used to raise
    `view Float as Byte`."""
    args = _store_args(d, fp4)
    if decode:
        args["plan"] = plan_decode(torch.tensor([9, 7]), torch.tensor([0, 1]), None, None, 4, 8)
    else:
        args["plan"], _ = plan_prefill(torch.tensor([3]), torch.tensor([2]), torch.tensor([0]), None, None, 4, 8, 0, 2)
        args["kv"] = torch.randn(args["plan"].shape[0], d)
        args["decode"] = False
    before = args["kvcache"].clone()
    compress_norm_rope_store(**args)
    assert torch.equal(args["kvcache"], before)
