"""Hypothesis fuzz of the DeepSeek-V4 compression ops against the stateless whole-sequence reference.

Scenarios run through `DSV4Compressor.compress_scores` and `.store`, which call every op of the family (the four
planners, the four compress ops and the store). A scenario is a batch of 0..3 requests whose ids are spread over a
state with room for more (ring or paged addressing, or online c128), pushed through random prefill / extend /
decode steps (some prefills stop one token before a window ends, so that a decode step closes it; two explicit c128
examples always do) with padded requests (`req_pool_indices` -1) and padded ragged rows, and stored into a paged FP8 /
FP4 cache at random slots (some -1). Some steps first try one out-of-range value: a request id past the state or
one whose ring would wrap int32 state rows, extends past the ragged rows, a seq_len below its extend, a page-table
entry or seq_len past `req_to_token`, a slot past the cache.

CPU: the bad try raises ValueError naming the argument and modifies nothing; after every step each entry equals
`compress_sequence` of its request's whole sequence (every complete window exactly once over the scenario), only
state rows owned by the step's requests changed, and the cache holds what `check_store` (tests/dsv4_cases.py) expects
(bytes outside the stored slots unchanged). CUDA: the same scenarios with the bad values left in (skipped on the
device) equal the CPU path with them neutralized (padding request, unmapped table entry, slot -1).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from dsv4_cases import FREQS, assert_cache_bytes_close, check_store
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

import custom_ops
from custom_ops.dsv4.common import read_compress_plan
from custom_ops.dsv4.compressor import CompressOutput, DSV4Compressor, PagedAddressing, compress_sequence
from custom_ops.dsv4.store import cache_page_bytes

pytestmark = pytest.mark.slow  # hypothesis scenarios through every op of the family

SLOTS = 1024  # cache slots (pages * page_size)
BAD_PREFILL = ("rid_capacity", "rid_wrap", "ext_sum", "seq_short", "table", "slot", "huge_slot")
BAD_DECODE = ("rid_capacity", "rid_wrap", "table", "slot", "huge_slot")
ON_CUDA = ("rid_wrap", "seq_short", "table", "slot", "huge_slot")  # CPU equivalent: the value neutralized


@dataclass(frozen=True)
class Step:
    decode: bool
    bad: str | None  # the out-of-range value tried first
    short: bool = False  # prefill: each request stops one token before its current or next window ends


@dataclass(frozen=True)
class Scenario:
    """Structure chosen by hypothesis; lengths, splits and data come from `seed` (`Driver`)."""

    ratio: int
    online: bool
    paged: bool
    d: int
    idx_dtype: torch.dtype
    page_size: int
    fp4: bool
    swa_page: int
    steps: tuple[Step, ...]
    seed: int


@st.composite
def scenarios(draw, bad: tuple[str, ...] = BAD_PREFILL) -> Scenario:
    ratio = draw(st.sampled_from([4, 128]))
    online = ratio == 128 and draw(st.booleans())
    d = draw(st.sampled_from([128, 512]))
    steps = []
    for _ in range(draw(st.integers(2, 6))):
        decode = draw(st.booleans())
        kinds = [k for k in (BAD_DECODE if decode else BAD_PREFILL) if k in bad]
        bad_kind = draw(st.none() | st.sampled_from(kinds)) if kinds else None
        steps.append(Step(decode, bad_kind, not decode and draw(st.booleans())))
    return Scenario(
        ratio=ratio,
        online=online,
        paged=not online and draw(st.booleans()),
        d=d,
        idx_dtype=draw(st.sampled_from([torch.int64, torch.int32])),
        page_size=draw(st.sampled_from([16, 4, 2, 1])),
        fp4=d == 128 and draw(st.booleans()),
        swa_page=draw(st.sampled_from([256, 512])),
        steps=tuple(steps),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@dataclass
class Call:
    """The arguments of one step: compress_scores(kv, state, seq, rid, ext, addressing), store(..., out_loc)."""

    kv: torch.Tensor
    seq: torch.Tensor
    rid: torch.Tensor
    ext: torch.Tensor | None
    out_loc: torch.Tensor
    counts: list[int]  # tokens each real request gets
    table: tuple[int, int, int] | None = None  # paged: (row, column, value) of req_to_token to set for the call

    def on(self, device: str) -> Call:
        move = {k: getattr(self, k).to(device) for k in ("kv", "seq", "rid", "out_loc")}
        return Call(**{**self.__dict__, **move, "ext": None if self.ext is None else self.ext.to(device)})


class Driver:
    """One scenario on one device: the compressor, its state and cache, and every entry produced so far."""

    def __init__(self, sc: Scenario, device: str) -> None:
        g = torch.Generator().manual_seed(sc.seed)
        self.sc, self.device, self.g, self.rng = sc, device, g, random.Random(sc.seed)
        comp = DSV4Compressor(16, sc.d, sc.ratio, online=sc.online)
        comp.reset_parameters(g)
        with torch.no_grad():
            comp.norm_weight.copy_(torch.rand(sc.d, generator=g) + 0.5)
        self.comp = comp.to(device)
        rng, r = self.rng, sc.ratio
        self.batch = 0 if rng.random() < 0.08 else rng.choice([1, 2, 2, 3, 3])  # empty batches: a few per run
        self.capacity = self.batch + 2
        lengths = [rng.choice([0, 1]) if rng.random() < 0.15 else rng.randint(r, 3 * r + 9) for _ in range(self.batch)]
        width = (4 if r == 4 else 2) * sc.d
        self.kvs = [torch.randn(n, width, generator=g) for n in lengths]
        self.rids = torch.randperm(self.capacity, generator=g)[: self.batch]
        self.cur = [0] * self.batch
        self.addressing = None
        if sc.paged:
            self._paged(g)
        else:
            self.state = comp.new_state(self.capacity)
        pages = SLOTS // sc.page_size
        shape = (pages, cache_page_bytes(sc.d, sc.page_size, sc.fp4))
        self.cache = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).to(device)
        self.entries: dict[tuple[int, int], torch.Tensor] = {}

    def _paged(self, g: torch.Generator) -> None:
        """Identity req_to_token of `capacity` rows, SWA pages shuffled in full_to_state; owner of each SWA page."""
        swa = self.sc.swa_page
        self.ctx = swa * (max((len(k) for k in self.kvs), default=0) // swa + 1)
        pages = self.capacity * self.ctx // swa
        req_to_token = (torch.arange(self.capacity)[:, None] * self.ctx + torch.arange(self.ctx)).to(torch.int32)
        perm = torch.randperm(pages, generator=g)
        full = torch.arange(self.capacity * self.ctx)
        full_to_state = perm[full // swa] * swa + full % swa
        self.owner = torch.empty(pages, dtype=torch.int64)
        self.owner[perm] = torch.arange(pages) // (self.ctx // swa)
        self.addressing = PagedAddressing(req_to_token.to(self.device), full_to_state.to(self.device), swa)
        self.state = self.comp.new_state(num_rows=pages * self.comp.window)

    # ------------------------------------------------------------------------------------------ building steps

    def call(self, step: Step) -> Call:
        """The valid arguments of `step` (random splits and padding), on the CPU."""
        sc, g, rng, r = self.sc, self.g, self.rng, self.sc.ratio
        left = [len(k) - c for k, c in zip(self.kvs, self.cur, strict=True)]
        if step.decode:
            counts = [int(x > 0 and rng.random() < 0.8) for x in left]
        elif step.short:  # up to the last token but one of this window or the next
            counts = [min(x, r - 1 - c % r + r * rng.randint(0, 1)) for x, c in zip(left, self.cur, strict=True)]
        else:
            counts = [min(x, rng.choice([0, 1, rng.randint(1, r + 3), rng.randint(1, 2 * r + 9), x])) for x in left]
        rows = [k[c : c + n] for k, c, n in zip(self.kvs, self.cur, counts, strict=True)]
        seq = [c + n for c, n in zip(self.cur, counts, strict=True)]
        rid = self.rids.tolist()
        ext = list(counts)
        width = (4 if r == 4 else 2) * sc.d
        if step.decode:  # inactive requests are padded rows; one input row per request
            seq = [s if n else 0 for s, n in zip(seq, counts, strict=True)]
            rid = [r if n else -1 for r, n in zip(rid, counts, strict=True)]
            rows = [r if n else torch.randn(1, width, generator=g) for r, n in zip(rows, counts, strict=True)]
        for _ in range(rng.randint(0, 2)):  # padded requests
            n = 1 if step.decode else rng.randint(0, 2)
            ext.append(n)
            seq.append(n + rng.randint(0, 5))
            rid.append(-1)
            rows.append(torch.randn(n, width, generator=g))
        rows.append(torch.randn(0 if step.decode else rng.randint(0, 2), width, generator=g))  # padded ragged rows
        kv = torch.cat(rows)
        out_loc = torch.randperm(SLOTS, generator=g)[: kv.shape[0]]
        out_loc[torch.rand(kv.shape[0], generator=g) < 0.2] = -1
        idx = self.sc.idx_dtype
        return Call(
            kv,
            torch.tensor(seq, dtype=idx),
            torch.tensor(rid, dtype=idx),
            None if step.decode else torch.tensor(ext, dtype=idx),
            out_loc.to(idx),
            counts,
        )

    def corrupt(self, call: Call, kind: str) -> tuple[Call, str] | None:
        """`call` with one out-of-range value of `kind`, and the argument the CPU error names; None if the step has
        no place for it."""
        sc = self.sc
        active = [b for b, n in enumerate(call.counts) if n > 0]
        big = torch.iinfo(sc.idx_dtype).max
        if kind in ("slot", "huge_slot"):
            if call.out_loc.numel() == 0:
                return None
            out_loc = call.out_loc.clone()
            out_loc[0] = SLOTS if kind == "slot" else min(2**62 + 5, big)
            return Call(**{**call.__dict__, "out_loc": out_loc}), "out_loc"
        if not active:
            return None
        b = active[0]
        seq, rid = call.seq.clone(), call.rid.clone()
        if kind == "rid_capacity":
            rid[b] = self.capacity
        elif kind == "rid_wrap":
            rid[b] = min(2**31 + 1 if sc.online else 2**31 // self.comp.window + 1, big)
        elif kind == "seq_short":
            seq[b] = call.ext[b] - 1
            return Call(**{**call.__dict__, "seq": seq}), "seq_lens"
        elif kind == "ext_sum":
            return Call(**{**call.__dict__, "kv": call.kv[: int(call.ext.sum()) - 1]}), "extend_lens"
        elif not sc.paged:
            return None
        elif call.ext is None:  # decode: the new token's page-table entry past full_to_state
            bad = (int(self.rids[b]), int(call.seq[b]) - 1, self.addressing.full_to_state.shape[0])
            return Call(**{**call.__dict__, "table": bad}), "req_to_token"
        else:  # prefill: a seq_len past the page table's columns
            seq[b] = max(self.ctx + 1, int(call.ext[b]))
            return Call(**{**call.__dict__, "seq": seq}), "seq_lens"
        return Call(**{**call.__dict__, "rid": rid}), "req_pool_indices"

    def neutral(self, call: Call, kind: str) -> Call:
        """The CPU equivalent of what CUDA does with the bad `call`: the affected request padded, the table entry
        unmapped, the slot -1."""
        if kind in ("slot", "huge_slot"):
            out_loc = call.out_loc.clone()
            out_loc[0] = -1
            return Call(**{**call.__dict__, "out_loc": out_loc})
        if call.table is not None:
            return Call(**{**call.__dict__, "table": (*call.table[:2], -1)})
        rid = call.rid.clone()
        rid[next(b for b, n in enumerate(call.counts) if n > 0)] = -1
        return Call(**{**call.__dict__, "rid": rid})

    # ------------------------------------------------------------------------------------------ running steps

    def compress(self, call: Call) -> CompressOutput:
        c = call.on(self.device)
        table = self.addressing.req_to_token if call.table is not None else None
        if table is not None:
            row, col, value = call.table
            saved = int(table[row, col])
            table[row, col] = value
        try:
            return self.comp.compress_scores(c.kv, self.state, c.seq, c.rid, c.ext, self.addressing)
        finally:
            if table is not None:
                table[row, col] = saved

    def store(self, out: CompressOutput, call: Call) -> None:
        freqs = FREQS.to(self.device)
        self.comp.store(out, freqs, call.out_loc.to(self.device), self.cache, self.sc.page_size, self.sc.fp4)

    def advance(self, call: Call) -> None:
        self.cur = [c + n for c, n in zip(self.cur, call.counts, strict=True)]


def _try_bad(drv: Driver, call: Call, kind: str) -> None:
    """CPU: the bad call raises ValueError naming the argument, and modifies neither the state nor the cache."""
    bad = drv.corrupt(call, kind)
    if bad is None:
        return
    bad_call, name = bad
    event(f"bad value: {kind}")
    state, cache = drv.state.clone(), drv.cache.clone()
    with pytest.raises(ValueError, match=rf"^{name}\["):
        if kind in ("slot", "huge_slot"):
            drv.store(drv.compress(call), bad_call)
        else:
            drv.compress(bad_call)
    if kind in ("slot", "huge_slot"):  # the compression itself was valid: undo it to replay the step
        drv.state.copy_(state)
    assert torch.equal(drv.state, state) and torch.equal(drv.cache, cache), f"{kind}: modified before raising"


def _owners(drv: Driver, rows: torch.Tensor) -> torch.Tensor:
    """The request id owning each state row."""
    if drv.sc.online:
        return rows
    if drv.sc.paged:
        return drv.owner[rows // drv.comp.window]
    return rows // drv.comp.window


def _check_step(drv: Driver, call: Call, out: CompressOutput, state: torch.Tensor, cache: torch.Tensor) -> None:
    """Entries equal the whole-sequence reference; only the step's requests' state rows and stored slots changed."""
    sc = drv.sc
    valid = out.valid.nonzero().squeeze(1)
    ape = drv.comp.kernel_ape()
    for row in valid.tolist():
        b, n = int(out.request[row]), int(out.window[row])
        assert b < drv.batch, "a padded request produced an entry"
        key = (b, n)
        assert key not in drv.entries, f"window {key} produced twice"
        want = compress_sequence(drv.kvs[b][: (n + 1) * sc.ratio], ape, sc.ratio)[n]
        torch.testing.assert_close(out.entries[row], want, atol=1e-5, rtol=1e-5, msg=f"window {key}")
        drv.entries[key] = out.entries[row]
    changed = (drv.state != state).any(1).nonzero().squeeze(1)
    stepped = {int(r) for r, n in zip(drv.rids, call.counts, strict=True) if n > 0}
    assert set(_owners(drv, changed).tolist()) <= stepped, "state rows of other requests changed"
    loc = call.out_loc.long()
    slots = loc if out.decode else loc[read_compress_plan(out.plan).ragged_id.clamp(max=max(loc.numel() - 1, 0))]
    stored = valid[slots[valid] >= 0]
    if stored.numel() == 0:
        assert torch.equal(drv.cache, cache), "the cache changed although no entry was stored"
        return
    weight = drv.comp.norm_weight.detach()
    pos = out.window[stored] * sc.ratio
    check_store(out.entries[stored], weight, pos, slots[stored], drv.cache, cache, sc.page_size, sc.fp4)


def _run_cpu(sc: Scenario) -> None:
    drv = Driver(sc, "cpu")
    for step in sc.steps:
        call = drv.call(step)
        if step.bad is not None:
            _try_bad(drv, call, step.bad)
        state, cache = drv.state.clone(), drv.cache.clone()
        out = drv.compress(call)
        drv.store(out, call)
        _check_step(drv, call, out, state, cache)
        drv.advance(call)
    event(f"c{sc.ratio}{' online' if sc.online else ''}{' paged' if sc.paged else ''} d={sc.d}")
    event(f"batch {drv.batch}, entries: {min(len(drv.entries), 10)}{'+' if len(drv.entries) >= 10 else ''}")
    ape = drv.comp.kernel_ape()
    for b, kvs in enumerate(drv.kvs):
        windows = drv.cur[b] // sc.ratio
        assert {n for (r, n) in drv.entries if r == b} == set(range(windows)), f"request {b}: windows missing"
        assert windows == compress_sequence(kvs[: drv.cur[b]], ape, sc.ratio).shape[0]


# c128 scenarios (offline paged, online) whose decode steps close windows, whatever examples hypothesis draws
C128_DECODE_CLOSES = [
    Scenario(
        ratio=128,
        online=online,
        paged=not online,
        d=512,
        idx_dtype=torch.int32,
        page_size=16,
        fp4=False,
        swa_page=256,
        steps=(Step(False, None, short=True), Step(True, None)) * 2,
        seed=11,  # 3 requests of 366, 225 and 390 tokens; the decode steps close 4 windows
    )
    for online in (False, True)
]


FUZZ = settings(
    max_examples=80,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@FUZZ
@given(scenarios())
@example(C128_DECODE_CLOSES[0])
@example(C128_DECODE_CLOSES[1])
def test_fuzz_ops_against_the_whole_sequence(sc: Scenario) -> None:
    _run_cpu(sc)


@pytest.mark.cuda
@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(scenarios(bad=ON_CUDA))
@example(C128_DECODE_CLOSES[0])
@example(C128_DECODE_CLOSES[1])
def test_fuzz_cuda_equals_cpu_with_out_of_range_values_skipped(sc: Scenario) -> None:
    """CUDA with the bad values left in (no checking mode: skipped on the device) == CPU with them neutralized."""
    with custom_ops.checks(False):
        cpu, gpu = Driver(sc, "cpu"), Driver(sc, "cuda")
        for step in sc.steps:
            call = cpu.call(step)
            gpu.call(step)  # keeps the two drivers' random streams in step
            bad = gpu.corrupt(call, step.bad) if step.bad is not None else None
            gpu_call = bad[0] if bad is not None else call
            cpu_call = cpu.neutral(gpu_call, step.bad) if bad is not None else call
            out_cpu, out_gpu = cpu.compress(cpu_call), gpu.compress(gpu_call)
            cpu.store(out_cpu, cpu_call)
            gpu.store(out_gpu, gpu_call)
            torch.testing.assert_close(out_gpu.entries.cpu(), out_cpu.entries, atol=1e-4, rtol=1e-4)
            assert torch.equal(out_gpu.valid.cpu(), out_cpu.valid)
            exact = 1e-5 if sc.online else 0.0
            torch.testing.assert_close(gpu.state.cpu(), cpu.state, atol=exact, rtol=exact)
            assert_cache_bytes_close(gpu.cache, cpu.cache)
            cpu.advance(call)
            gpu.advance(call)
