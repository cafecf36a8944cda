"""Compression ops: opcheck, strided inputs, argument errors, and in-place mutation under torch.compile."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from dsv4_cases import DECODE_BAD_STRUCTURE, call_op, compress_setup, decode_args
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

import custom_ops  # noqa: F401
from custom_ops.dsv4.compress import compress_decode, compress_prefill
from custom_ops.dsv4.plan import plan_decode, plan_online_decode, plan_online_prefill, plan_prefill
from dspark_fx.testing import reinplacing_misses

D = 128
ops = torch.ops.dspark


@pytest.mark.parametrize("ratio", [4, 128])
def test_opcheck_offline(ratio):
    state, ape, ring, g = compress_setup(ratio)
    seq = torch.tensor([ratio, 2 * ratio + 1, 3 * ratio])
    rid = torch.tensor([1, 0, 3])
    kv = torch.randn(3, state.shape[1], generator=g)
    plan = plan_decode(seq, rid, None, None, ratio, ring)
    torch.library.opcheck(ops.dsv4_compress_decode, (state.clone(), kv, ape, plan, ratio))
    ext = torch.tensor([ratio + 3, 5, 2 * ratio])
    kv = torch.randn(int(ext.sum()) + 2, state.shape[1], generator=g)
    plan_c, plan_w = plan_prefill(seq + ext, ext, rid, None, None, ratio, ring, 0, kv.shape[0])
    torch.library.opcheck(ops.dsv4_compress_prefill, (state.clone(), kv, ape, plan_c, plan_w, ratio))


def test_opcheck_online():
    g = torch.Generator().manual_seed(0)
    state = torch.randn(4, 3 * D, generator=g)
    state[:, D : 2 * D] = state[:, D : 2 * D].abs() + 1
    ape = torch.randn(128, D, generator=g)
    seq = torch.tensor([128, 200, 1])
    rid = torch.tensor([1, 0, 3])
    kv = torch.randn(3, 2 * D, generator=g)
    torch.library.opcheck(ops.dsv4_online_compress_decode, (state.clone(), kv, ape, plan_online_decode(seq, rid)))
    ext = torch.tensor([130, 60, 1])
    kv = torch.randn(int(ext.sum()), 2 * D, generator=g)
    plan_c, plan_w = plan_online_prefill(seq + ext, ext, rid, kv.shape[0])
    torch.library.opcheck(ops.dsv4_online_compress_prefill, (state.clone(), kv, ape, plan_c, plan_w))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_whole_windows_from_scratch_run_on_an_empty_state(device):
    """Offline c128 requests of whole windows from scratch (256 and 128 tokens) read and write no state row: the op
    runs on a state of 0 rows (the fake impl gives the same shape) and gives the entries it gives with a state."""
    g = torch.Generator().manual_seed(6)
    seq, rid = torch.tensor([256, 128]), torch.arange(2)
    kv = torch.randn(384, 2 * D, generator=g).to(device)
    ape = torch.randn(128, D, generator=g).to(device)
    plans = [p.to(device) for p in plan_prefill(seq, seq, rid, None, None, 128, 128, 0, 384)]
    want = ops.dsv4_compress_prefill(torch.randn(128, 2 * D, device=device), kv, ape, *plans, 128)
    empty = torch.zeros(0, 2 * D, device=device)
    got = ops.dsv4_compress_prefill(empty, kv, ape, *plans, 128)
    fake = call_op(ops.dsv4_compress_prefill, dict(enumerate((empty, kv, ape, *plans, 128))), fake=True)
    assert got.shape == want.shape == fake.shape
    assert torch.equal(got, want)


@pytest.mark.parametrize("ratio", [4, 128])
def test_strided_kv_score_matches_contiguous(ratio):
    state, ape, ring, g = compress_setup(ratio)
    seq = torch.tensor([2 * ratio + 1])
    ext = torch.tensor([ratio + 5])
    wide = torch.randn(int(ext.sum()), state.shape[1] + 64, generator=g)
    kv = wide[:, 32 : 32 + state.shape[1]]
    assert not kv.is_contiguous()
    plan_c, plan_w = plan_prefill(seq, ext, torch.tensor([2]), None, None, ratio, ring, 0, kv.shape[0])
    s1, s2 = state.clone(), state.clone()
    out1 = compress_prefill(s1, kv, ape, plan_c, plan_w, ratio)
    out2 = compress_prefill(s2, kv.contiguous(), ape, plan_c, plan_w, ratio)
    assert torch.equal(out1, out2) and torch.equal(s1, s2)


def test_writes_stay_inside_addressed_rows():
    state, ape, ring, g = compress_setup(4)
    before = state.clone()
    kv = torch.randn(2, state.shape[1], generator=g)
    plan = plan_decode(torch.tensor([5, 7]), torch.tensor([1, -1]), None, None, 4, ring)
    compress_decode(state, kv, ape, plan, 4)
    changed = (state != before).any(1).nonzero().squeeze(1).tolist()
    assert changed == [1 * 8 + 4]


@pytest.mark.parametrize("fake", [False, True])
@pytest.mark.parametrize("case", DECODE_BAD_STRUCTURE, ids=lambda c: c[0])
def test_decode_bad_inputs(case, fake):
    """The CPU impl and the fake impl share one check function: the fake used to accept a plan whose row count
    differs from kv_score's."""
    _, change, err, match = case
    args = decode_args()
    change(args)
    with pytest.raises(err, match=match):
        call_op(ops.dsv4_compress_decode, args, fake)


@pytest.mark.parametrize("fake", [False, True])
def test_online_decode_fake_checks_plan_rows(fake):
    state = torch.zeros(2, 3 * D)
    plan = plan_online_decode(torch.tensor([1, 2]), torch.tensor([0, 1]))
    args = {"state": state, "kv_score": torch.zeros(3, 2 * D), "ape": torch.zeros(128, D), "plan": plan}
    with pytest.raises(ValueError, match=r"plan: expected 3 rows \(one per kv_score row\), got 2"):
        call_op(ops.dsv4_online_compress_decode, args, fake)


def _ring_step(ratio: int, decode: bool, rid: int, rings: int = 1):
    """Plans of request `rid` (one step of ratio + 1 tokens, or a decode closing a window) on a state of `rings`."""
    g = torch.Generator().manual_seed(ratio)
    ring = 8 if ratio == 4 else 128
    width = (4 if ratio == 4 else 2) * D
    state = torch.randn(rings * ring, width, generator=g)
    ape = torch.randn(8 if ratio == 4 else 128, D, generator=g)
    rids = torch.tensor([rid])
    if decode:
        plans = (plan_decode(torch.tensor([2 * ratio]), rids, None, None, ratio, ring),)
        return state, torch.randn(1, width, generator=g), ape, plans
    seq = torch.tensor([2 * ratio + 1])
    plans = plan_prefill(seq, torch.tensor([ratio + 1]), rids, None, None, ratio, ring, 0, ratio + 1)
    return state, torch.randn(ratio + 1, width, generator=g), ape, plans


@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("ratio", [4, 128])
def test_cpu_compress_rejects_plan_rows_outside_the_state(ratio, decode):
    """A plan for request 1 on a state that holds one request used to leave the state unchanged without an error.
    CPU raises naming the plan field before anything is written."""
    state, kv, ape, plans = _ring_step(ratio, decode, rid=1)
    before = state.clone()
    op = ops.dsv4_compress_decode if decode else ops.dsv4_compress_prefill
    field = "plan" if decode else "plan_[cw]"
    with pytest.raises(ValueError, match=rf"{field}\[0\]\.(write_loc|read_page_[01]) = \d+ is out of range: expected"):
        op(state, kv, ape, *plans, ratio)
    assert torch.equal(state, before)
    state, kv, ape, plans = _ring_step(ratio, decode, rid=1, rings=2)
    op(state, kv, ape, *plans, ratio)  # the same plan on a state with room for request 1
    assert not torch.equal(state, torch.cat([before, before]))


@pytest.mark.parametrize("decode", [True, False])
def test_cpu_online_compress_rejects_slots_outside_the_state(decode):
    g = torch.Generator().manual_seed(3)
    state = torch.randn(2, 3 * D, generator=g)
    state[:, D : 2 * D] = state[:, D : 2 * D].abs() + 1
    ape = torch.randn(128, D, generator=g)
    seq, rid = torch.tensor([130]), torch.tensor([2])
    before = state.clone()
    if decode:
        with pytest.raises(
            ValueError, match=r"plan\[0\]\.write_loc = 2 is out of range: expected < 2 \(rows of state\)"
        ):
            ops.dsv4_online_compress_decode(state, torch.randn(1, 2 * D), ape, plan_online_decode(seq, rid))
    else:
        plan_c, plan_w = plan_online_prefill(seq, torch.tensor([2]), rid, 2)
        with pytest.raises(ValueError, match=r"plan_w\[0\]\.read_page_0 = 2 is out of range: expected < 2"):
            ops.dsv4_online_compress_prefill(state, torch.randn(2, 2 * D), ape, plan_c, plan_w)
    assert torch.equal(state, before)


def test_online_rejects_bf16_state():
    state = torch.zeros(2, 3 * D, dtype=torch.bfloat16)
    plan = plan_online_decode(torch.tensor([1]), torch.tensor([0]))
    with pytest.raises(TypeError, match="state"):
        ops.dsv4_online_compress_decode(state, torch.zeros(1, 2 * D), torch.zeros(128, D), plan)


def _no_clone(code: list[str], misses: Counter) -> None:
    text = "\n".join(code)
    assert "clone" not in text, "the compiled code copies a mutated buffer"
    assert misses["tensors"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("online", [False, True])
def test_compiled_steps_mutate_state_in_place(online):
    torch._dynamo.reset()
    counters.clear()
    g = torch.Generator().manual_seed(0)
    ape = torch.randn(128, D, generator=g)
    if online:
        state = torch.zeros(4, 3 * D)

        def prefill(state, kv, seq, ext, rid):
            plan_c, plan_w = ops.dsv4_plan_online_prefill(seq, ext, rid, kv.shape[0])
            return ops.dsv4_online_compress_prefill(state, kv, ape, plan_c, plan_w)

        def decode(state, kv, seq, rid):
            return ops.dsv4_online_compress_decode(state, kv, ape, ops.dsv4_plan_online_decode(seq, rid))
    else:
        state = torch.zeros(4 * 128, 2 * D)

        def prefill(state, kv, seq, ext, rid):
            plan_c, plan_w = ops.dsv4_plan_prefill(seq, ext, rid, None, None, 128, 128, 0, kv.shape[0])
            return ops.dsv4_compress_prefill(state, kv, ape, plan_c, plan_w, 128)

        def decode(state, kv, seq, rid):
            return ops.dsv4_compress_decode(state, kv, ape, ops.dsv4_plan_decode(seq, rid, None, None, 128, 128), 128)

    seq = torch.tensor([200, 127])
    ext = seq.clone()
    rid = torch.tensor([0, 2])
    kv = torch.randn(int(ext.sum()), 2 * D, generator=g)
    eager_state = state.clone()
    eager = prefill(eager_state, kv, seq, ext, rid)
    with reinplacing_misses() as misses:
        out, code = run_and_get_code(torch.compile(prefill, fullgraph=True), state, kv, seq, ext, rid)
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(state, eager_state, equal_nan=True)
    _no_clone(code, misses)

    kv1 = torch.randn(2, 2 * D, generator=g)
    eager = decode(eager_state, kv1, seq + 1, rid)
    with reinplacing_misses() as misses:
        out, code = run_and_get_code(torch.compile(decode, fullgraph=True), state, kv1, seq + 1, rid)
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(state, eager_state, equal_nan=True)
    assert out[1].abs().sum() > 0  # request 1 closed its first window
    _no_clone(code, misses)
