"""Online c128 (running softmax state) against the fp64 ground truth and against offline c128."""

from __future__ import annotations

import random

import pytest
import torch
from dsv4_cases import Session, make_inputs

D = 512


@pytest.mark.parametrize("seq", [128, 256, 512, 300])
def test_online_prefill_no_context(seq):
    kvs, ape = make_inputs(128, D, [seq], seed=seq)
    s = Session(kvs, ape, 128, online=True)
    s.extend([seq])
    s.check()


@pytest.mark.parametrize("prefix", [0, 128, 200])
def test_online_prefill_then_decode(prefix):
    kvs, ape = make_inputs(128, D, [prefix + 130], seed=prefix)
    s = Session(kvs, ape, 128, online=True)
    if prefix:
        s.extend([prefix])
    for _ in range(130):
        s.decode()
    s.check()


def test_online_multibatch_unaligned_extends():
    kvs, ape = make_inputs(128, D, [600, 600, 600], seed=9)
    s = Session(kvs, ape, 128, online=True)
    s.extend([1, 127, 129], pad=2)
    s.extend([130, 1, 126])
    s.decode([True, False, True])
    s.extend([255, 300, 0])
    s.check()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_online_equals_offline_on_a_random_split(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(256, 520) for _ in range(3)]
    kvs, ape = make_inputs(128, 128, lengths, seed=seed)
    online = Session(kvs, ape, 128, online=True)
    offline = Session(kvs, ape, 128, "paged")
    while online.cur != lengths:
        left = [n - c for n, c in zip(lengths, online.cur, strict=True)]
        if rng.random() < 0.3:
            active = [x > 0 and rng.random() < 0.8 for x in left]
            online.decode(active)
            offline.decode(active)
        else:
            lens = [min(x, rng.choice([0, 1, rng.randint(1, 140), rng.randint(1, 300)])) for x in left]
            online.extend(lens)
            offline.extend(lens)
    online.check()
    assert online.entries.keys() == offline.entries.keys()
    for key, row in online.entries.items():
        torch.testing.assert_close(row, offline.entries[key], atol=1e-5, rtol=1e-5)


def test_online_state_holds_the_running_softmax():
    kvs, ape = make_inputs(128, 128, [140], seed=1)
    s = Session(kvs, ape, 128, online=True)
    s.extend([140])
    slot = int(s.rids[0])
    m, total, a = s.state[slot].double().split(128)
    sc = kvs[0][128:140, 128:].double() + ape[:12].double()
    ref_m = sc.max(0).values
    e = torch.exp(sc - ref_m)
    torch.testing.assert_close(m, ref_m, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(total, e.sum(0), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a, (e * kvs[0][128:140, :128].double()).sum(0) / e.sum(0), atol=1e-5, rtol=1e-5)
