"""Offline c4 / c128 compression (CPU reference) against the fp64 whole-sequence ground truth.

Covers the reference scenarios of docs/dsv4_compress.md ("Reference formula and scenarios") in both addressing
modes, unaligned prefixes, padding, bf16 state and a randomized split of sequences into prefill + extends +
decodes.
"""

from __future__ import annotations

import random

import pytest
import torch
from dsv4_cases import Session, make_inputs

from custom_ops.dsv4.common import read_write_plan
from custom_ops.dsv4.plan import plan_prefill

D = 512
MODES = ["ring", "paged"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seq", [4, 8, 32, 256, 1024])
def test_c4_prefill_no_context(mode, seq):
    kvs, ape = make_inputs(4, D, [seq], seed=seq)
    s = Session(kvs, ape, 4, mode)
    s.extend([seq])
    s.check()
    assert len(s.entries) == seq // 4


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("prefix", [4, 256])
def test_c4_prefill_then_decode(mode, prefix):
    kvs, ape = make_inputs(4, D, [prefix + 4], seed=prefix)
    s = Session(kvs, ape, 4, mode)
    s.extend([prefix])
    for _ in range(4):
        s.decode()
    s.check()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("prefix", [256, 512, 768])
def test_c4_prefill_then_extend(mode, prefix):
    kvs, ape = make_inputs(4, D, [prefix + 4], seed=prefix)
    s = Session(kvs, ape, 4, mode)
    s.extend([prefix])
    n_before = len(s.entries)
    s.extend([4])
    assert len(s.entries) == n_before + 1
    s.check()


def test_c4_paged_buffer_keeps_the_tail_of_every_swa_page():
    kvs, ape = make_inputs(4, D, [1024], seed=7)
    s = Session(kvs, ape, 4, "paged")
    s.extend([1024])
    req_to_token, full_to_state = s.paged
    rid = int(s.rids[0])
    for page in range(4):
        for pos in range(page * 256 + 252, page * 256 + 256):
            swa = int(full_to_state[int(req_to_token[rid, pos])])
            loc = (swa // 256) * 8 + swa % 8
            torch.testing.assert_close(s.state[loc], kvs[0][pos], atol=0, rtol=0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("lens", [(8, 8), (256, 256), (260, 260), (1023, 1023), (5, 1023, 0, 12)])
def test_c4_prefill_multibatch(mode, lens):
    kvs, ape = make_inputs(4, D, list(lens), seed=sum(lens))
    s = Session(kvs, ape, 4, mode)
    s.extend(list(lens), pad=3)
    s.check()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seq", [128, 256, 512])
def test_c128_prefill_no_context(mode, seq):
    kvs, ape = make_inputs(128, D, [seq], seed=seq)
    s = Session(kvs, ape, 128, mode)
    s.extend([seq])
    s.check()
    assert len(s.entries) == seq // 128


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("prefix", [0, 128, 256])
def test_c128_prefill_then_decode(mode, prefix):
    kvs, ape = make_inputs(128, D, [prefix + 128], seed=prefix)
    s = Session(kvs, ape, 128, mode)
    if prefix:
        s.extend([prefix])
    for _ in range(128):
        s.decode()
    s.check()
    assert len(s.entries) == prefix // 128 + 1


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("prefix", [128, 256])
def test_c128_prefill_then_extend(mode, prefix):
    kvs, ape = make_inputs(128, D, [prefix + 128], seed=prefix)
    s = Session(kvs, ape, 128, mode)
    s.extend([prefix])
    s.extend([128])
    s.check()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("lens", [(128, 128), (256, 256), (384, 384), (130, 0, 383)])
def test_c128_prefill_multibatch(mode, lens):
    kvs, ape = make_inputs(128, D, list(lens), seed=sum(lens))
    s = Session(kvs, ape, 128, mode)
    s.extend(list(lens), pad=5)
    s.check()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("ratio", [4, 128])
def test_unaligned_prefixes(mode, ratio):
    """Extends that start and end inside windows: buffer_len = window - min(j + 1, window)."""
    r = ratio
    kvs, ape = make_inputs(ratio, 128, [4 * r + 8] * 3, seed=ratio)
    s = Session(kvs, ape, ratio, mode)
    s.extend([1, r - 1, r + 1])
    s.extend([r + 2, 2, r - 3])
    s.extend([1, r, 3])
    s.decode()
    s.extend([max(0, 2 * r + 1 - c) for c in s.cur])
    s.extend([r + 4] * 3)
    s.check()


@pytest.mark.parametrize("ratio", [4, 128])
def test_bf16_state_exact_inputs(ratio):
    """bf16 state with bf16-representable inputs: the state round trip is exact, so fp32 tolerance holds."""
    r = ratio
    kvs, ape = make_inputs(ratio, 128, [3 * r + 3, 3 * r], seed=3, bf16_exact=True)
    s = Session(kvs, ape, ratio, "paged", state_dtype=torch.bfloat16)
    s.extend([r + 3, r - 1])
    s.decode()
    s.extend([r + 1, r - 2])
    for _ in range(r - 2):
        s.decode()
    s.check()


@pytest.mark.parametrize("ratio", [4, 128])
def test_bf16_state_rounds_stored_rows(ratio):
    r = ratio
    kvs, ape = make_inputs(ratio, 128, [2 * r + 2], seed=4)
    s = Session(kvs, ape, ratio, "ring", state_dtype=torch.bfloat16)
    s.extend([r + 1])
    for _ in range(r + 1):
        s.decode()
    s.check(atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("ratio", [4, 128])
def test_decode_with_padded_rows(ratio, idx_dtype):
    r = ratio
    kvs, ape = make_inputs(ratio, 128, [2 * r + 1, 2 * r + 1], seed=5)
    s = Session(kvs, ape, ratio, "paged")
    s.extend([r - 1, 1], idx_dtype=idx_dtype)
    for step in range(r + 2):
        s.decode([True, step % 3 != 1], idx_dtype=idx_dtype)
    s.check()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("ratio", [4, 128])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_split_equals_whole_sequence(mode, ratio, seed):
    rng = random.Random(seed * 10 + ratio)
    bs = 3
    lengths = [rng.randint(2 * ratio, 4 * ratio + 7) for _ in range(bs)]
    kvs, ape = make_inputs(ratio, 128, lengths, seed=seed)
    s = Session(kvs, ape, ratio, mode, seed=seed)
    while s.cur != lengths:
        left = [n - c for n, c in zip(lengths, s.cur, strict=True)]
        if rng.random() < 0.4:
            s.decode([x > 0 and rng.random() < 0.75 for x in left])
        else:
            choices = [0, 1, rng.randint(1, ratio + 3), rng.randint(1, 2 * ratio + 9)]
            s.extend([min(x, rng.choice(choices)) for x in left], pad=rng.randint(0, 2))
    s.check()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("ratio", [4, 128])
def test_prefill_writes_only_the_rows_later_calls_need(mode, ratio):
    seq = torch.tensor([2 * ratio + 3, ratio, 5])
    ext = seq - torch.tensor([ratio - 1, 0, 1])
    rid = torch.tensor([0, 1, 2])
    if mode == "paged":
        req_to_token = torch.arange(3 * 1024, dtype=torch.int32).view(3, 1024)
        full_to_state = torch.arange(3 * 1024)
    else:
        req_to_token = full_to_state = None
    _, plan_w = plan_prefill(
        seq, ext, rid, req_to_token, full_to_state, ratio, 8 if ratio == 4 else 128, 256, int(ext.sum())
    )
    w = read_write_plan(plan_w)
    starts = torch.cumsum(ext, 0) - ext
    written = set()
    for ragged in w.ragged_id[w.valid].tolist():
        b = int(torch.searchsorted(starts, torch.tensor(ragged), right=True)) - 1
        written.add((b, int(seq[b] - ext[b]) + ragged - int(starts[b])))
    expected = set()
    for b in range(3):
        first = (int(seq[b]) // ratio) * ratio - (ratio if ratio == 4 else 0)
        expected |= {(b, p) for p in range(int(seq[b] - ext[b]), int(seq[b])) if p >= first}
    assert written == expected


@pytest.mark.parametrize("seed", [0, 1])
def test_c4_paged_random_split_across_swa_pages(seed):
    """Splits that start, end and decode across 256-token SWA pages (each page has its own state ring)."""
    rng = random.Random(100 + seed)
    lengths = [rng.randint(520, 700) for _ in range(2)]
    kvs, ape = make_inputs(4, 128, lengths, seed=seed)
    s = Session(kvs, ape, 4, "paged", seed=seed)
    while s.cur != lengths:
        left = [n - c for n, c in zip(lengths, s.cur, strict=True)]
        if rng.random() < 0.5:
            for _ in range(rng.randint(1, 9)):
                s.decode([x > 0 for x in (n - c for n, c in zip(lengths, s.cur, strict=True))])
        else:
            s.extend([min(x, rng.randint(0, 300)) for x in left])
    s.check()
