"""The input contract of the DeepSeek-V4 compression ops on CUDA (docs/contract.md).

Without checking mode, a row whose index value is out of range is skipped without a host sync: the result equals
the CPU path's result for the same inputs with those rows neutralized (padding request ids, -1 slots, padding plan
rows), every other state row and cache byte is unchanged, eagerly and inside a captured CUDA graph. In checking
mode the CUDA bindings raise the CPU path's ValueError word for word."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from dsv4_cases import (
    STORE_FREQS,
    STORE_PAGE,
    assert_cache_bytes_close,
    audit_skipped_requests,
    corruption_case,
    plan_corruptions,
    planner_problem_stages,
    run_compress,
    store_case,
    storing_rows,
)

import custom_ops
from custom_ops import _build
from custom_ops.dsv4 import plan as cp
from custom_ops.dsv4.compressor import DSV4Compressor
from custom_ops.dsv4.store import cache_page_bytes, compress_norm_rope_store

pytestmark = pytest.mark.cuda
ops = torch.ops.dspark


@pytest.fixture(autouse=True, scope="module")
def _cuda_library():
    """Load the CUDA library up front so every op, the planners included, runs its CUDA binding."""
    _build.load()


def _cuda(values):
    return [v.cuda() if isinstance(v, torch.Tensor) else v for v in values]


def _error(fn, *args) -> str:
    """The first line of the ValueError `fn(*args)` raises."""
    with pytest.raises(ValueError) as info:
        fn(*args)
    return str(info.value).splitlines()[0]


def _same_error(fn, cpu_args, cuda_args) -> None:
    """CPU, and CUDA in checking mode, raise the same message."""
    want = _error(fn, *cpu_args)
    with custom_ops.checks():
        assert _error(fn, *cuda_args) == want


def _planner_calls(seq, ext, rid, r2t, f2s, n):
    """(op, args, CUDA-semantics reference builder) of every planner configuration."""
    for ratio, ring in ((4, 8), (128, 128)):
        for tables in ((None, None), (r2t, f2s)):
            swa = 256 if tables[0] is not None else 0
            decode = (seq, rid, *tables, ratio, ring, swa)
            yield ops.dsv4_plan_decode, decode, cp.decode_plan_unchecked
            prefill = (seq, ext, rid, *tables, ratio, ring, swa, n)
            yield ops.dsv4_plan_prefill, prefill, cp.prefill_plan_unchecked
    yield ops.dsv4_plan_online_decode, (seq, rid), cp.online_decode_plan_unchecked
    yield ops.dsv4_plan_online_prefill, (seq, ext, rid, n), cp.online_prefill_plan_unchecked


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_planners_skip_out_of_range_values_and_raise_the_cpu_error_when_checking(idx_dtype):
    for stage in planner_problem_stages():
        seq, ext, rid, r2t, f2s, n = stage
        if idx_dtype == torch.int32:  # values that do not fit int32 are an int64-only case
            seq, ext, rid = (t.clamp(-(2**31), 2**31 - 1).to(torch.int32) for t in (seq, ext, rid))
        for op, args, reference in _planner_calls(seq, ext, rid, r2t, f2s, n):
            want, problems = reference(*args)
            got = op(*_cuda(args))
            want, got = (want, got) if isinstance(want, tuple) else ((want,), (got,))
            for w, g in zip(want, got, strict=True):
                assert torch.equal(w, g.cpu()), op
            if problems.first() is not None:
                _same_error(op, args, _cuda(args))


@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize(("ratio", "online"), [(4, False), (128, False), (128, True)])
def test_compress_skips_out_of_range_plan_rows_and_raises_the_cpu_error_when_checking(ratio, online, decode):
    """Corrupted plan rows: CUDA leaves what the CPU path leaves for the plan with those rows neutralized (every
    other state row unchanged); checking mode raises the CPU message before writing anything."""
    g = torch.Generator().manual_seed(ratio + 2 * online + decode)
    state, kv, ape, plans = corruption_case(ratio, online, decode, g)
    for field, corrupt in plan_corruptions(ratio, online, decode, state, kv):
        bad, good = [p.clone() for p in plans], [p.clone() for p in plans]
        corrupt([p.view(torch.int32) for p in bad], [p.view(torch.int32) for p in good])
        want_state = state.clone()
        want = run_compress(online, decode, want_state, kv, ape, good, ratio)
        assert want.any(), f"{field}: no entry left to compare"
        got_state = state.cuda()
        got = run_compress(online, decode, got_state, kv.cuda(), ape.cuda(), _cuda(bad), ratio)
        exact = 1e-5 if online else 0.0
        torch.testing.assert_close(got_state.cpu(), want_state, atol=exact, rtol=exact, msg=field)
        torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4, msg=field)
        checked_state = state.cuda()

        def call(s, k, a, *p):
            return run_compress(online, decode, s, k, a, list(p), ratio)

        _same_error(call, (state.clone(), kv, ape, *bad), (checked_state, kv.cuda(), ape.cuda(), *_cuda(bad)))
        assert torch.equal(checked_state.cpu(), state), f"{field}: checking mode wrote before raising"


def _unwritten(cache: torch.Tensor, before: torch.Tensor, slots: torch.Tensor, d: int, fp4: bool) -> bool:
    """Bytes of `cache` outside the payload of `slots` equal those of `before`."""
    mask = torch.ones(cache.numel(), dtype=torch.bool)
    for loc in slots.tolist():
        mask &= _slot_mask(cache, loc, d, fp4)
    return torch.equal(cache.reshape(-1)[mask], before.reshape(-1)[mask])


@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize(("d", "fp4"), [(512, False), (128, False), (128, True)])
def test_store_skips_slots_past_the_cache_and_raises_the_cpu_error_when_checking(d, fp4, decode):
    """Slots at the cache's end, 2^40 and 2^62 + 5 (whose byte offset overflows int64): CUDA writes no byte for them;
    every other byte is what the CPU path writes with those slots set to -1."""
    kv, plan, w, out_loc, cache = store_case(d, fp4, decode)
    rows, source = storing_rows(plan, out_loc, decode)
    bad = out_loc.clone()
    bad[source[rows[torch.tensor([0, 1, -1])]]] = torch.tensor([cache.shape[0] * STORE_PAGE, 2**40, 2**62 + 5])
    neutral = bad.masked_fill(bad >= cache.shape[0] * STORE_PAGE, -1)
    want = cache.clone()
    compress_norm_rope_store(kv, plan, w, 1e-6, STORE_FREQS, neutral, want, STORE_PAGE, 4, decode, fp4)
    args = (kv, plan, w, 1e-6, STORE_FREQS, bad, cache.clone(), STORE_PAGE, 4, decode, fp4)
    got = cache.cuda()
    cuda_args = (*_cuda(args[:6]), got, *args[7:])
    compress_norm_rope_store(*cuda_args)
    got = got.cpu()
    written = neutral[source[rows]]
    assert _unwritten(got, cache, written[written >= 0], d, fp4), "bytes outside the stored slots changed"
    assert_cache_bytes_close(got, want)
    checked = cache.cuda()
    _same_error(compress_norm_rope_store, args, (*cuda_args[:6], checked, *args[7:]))
    assert torch.equal(checked.cpu(), cache)


@pytest.mark.parametrize(("ratio", "online"), [(4, False), (128, False), (128, True)])
def test_compressor_checks_requests_against_the_state_in_checking_mode(ratio, online):
    """Request 1 on a state for one request: CPU and checking mode raise naming req_pool_indices; by default CUDA
    skips the request (no sync) and the state is unchanged."""
    comp = DSV4Compressor(64, 128, ratio, online=online)
    x, seq, rid = torch.randn(ratio + 1, 64), torch.tensor([ratio + 1]), torch.tensor([1])
    want = _error(comp, x, comp.new_state(1), seq, rid, seq)
    comp.cuda()
    state = comp.new_state(1)
    x, seq, rid = x.cuda(), seq.cuda(), rid.cuda()
    with custom_ops.checks():
        assert _error(comp, x, state, seq, rid, seq) == want
    before = state.clone()
    comp(x, state, seq, rid, extend_lens=seq)
    assert torch.equal(state, before)


@pytest.mark.parametrize(
    ("ratio", "online", "d"), [(4, False, 512), (4, False, 128), (128, False, 512), (128, False, 128), (128, True, 512)]
)
def test_compressor_reports_requests_past_the_state_invalid_and_writes_nothing_for_them(ratio, online, d):
    """Request ids [0, 2, -1, 1] on a state for 2 requests through a prefill and decode steps, then the store: the
    rows of the request past the state and of the padding request are invalid with zero entries, and state, entries
    and cache equal the CPU compressor's without them (their slots keep the poison byte for byte). On the base code
    the CUDA rows of the request past the state were valid (c4: windows 0 and 2 with zero entries, window 1 from the
    input) and the store wrote them to its slots."""
    audit_skipped_requests(ratio, online, d, "cuda")


class StepParams(NamedTuple):
    """The fixed arguments of a decode step (plan, compress, store), on one device."""

    ratio: int
    online: bool
    ape: torch.Tensor
    weight: torch.Tensor
    freqs: torch.Tensor

    def to(self, device: str) -> StepParams:
        return self._replace(**{k: getattr(self, k).to(device) for k in ("ape", "weight", "freqs")})


def _decode_step(p: StepParams, inputs: dict, state: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    seq, rid, kv = inputs["seq"], inputs["rid"], inputs["kv"]
    if p.online:
        plan = ops.dsv4_plan_online_decode(seq, rid)
        out = ops.dsv4_online_compress_decode(state, kv, p.ape, plan)
    else:
        plan = ops.dsv4_plan_decode(seq, rid, None, None, p.ratio, 8 if p.ratio == 4 else 128, 0)
        out = ops.dsv4_compress_decode(state, kv, p.ape, plan, p.ratio)
    ops.dsv4_compress_norm_rope_store(
        out, plan, p.weight, 1e-6, p.freqs, inputs["out_loc"], cache, STORE_PAGE, p.ratio, True
    )
    return out


def _bad_values(t: int, bs: int, ratio: int, online: bool, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Request ids with one past the state, one whose ring would wrap int32 state rows and a padding row; slots with
    one at the cache's end and one whose byte offset overflows int64."""
    rid = torch.randperm(bs)
    wrap = 2**31 + 1 if online else 2**31 // (8 if ratio == 4 else 128) + 1
    rid[t % bs], rid[(t + 3) % bs], rid[(t + 5) % bs] = bs, wrap, -1
    out_loc = torch.randperm(slots)[:bs]
    out_loc[(t + 1) % bs], out_loc[(t + 2) % bs] = slots, 2**62 + 5
    return rid, out_loc


@pytest.mark.parametrize("checking", [False, True])
@pytest.mark.parametrize(
    ("ratio", "online", "d"), [(4, False, 512), (4, False, 128), (128, False, 512), (128, True, 512)]
)
def test_decode_graph_replays_skip_out_of_range_requests_and_slots(ratio, online, d, checking):
    """A captured decode step replayed with request ids past the state (one past its end, one that would wrap int32
    state rows) and slots past the cache (up to 2^62 + 5): replays equal eager runs; eager runs equal the CPU path
    with those values neutralized (padding request, slot -1), and no byte of another slot changes. A request past
    the state produces a zero entry, which the store writes to that request's own slot (if in range). Checking mode
    is skipped inside the capture (no sync), so capturing works with it on."""
    bs, pages = 8, 8
    g = torch.Generator().manual_seed(ratio + d + online)
    ring = 1 if online else (8 if ratio == 4 else 128)
    width = 3 * d if online else (4 if ratio == 4 else 2) * d
    state = torch.randn(bs * ring, width, generator=g)
    if online:
        state[:, d : 2 * d] = state[:, d : 2 * d].abs() + 1
    params = StepParams(
        ratio, online, torch.randn(8 if ratio == 4 else 128, d, generator=g), torch.rand(d) + 0.5, STORE_FREQS
    )
    cuda_params = params.to("cuda")
    cache = torch.randint(0, 256, (pages, cache_page_bytes(d, STORE_PAGE)), dtype=torch.uint8, generator=g)
    inputs = {
        "seq": torch.full((bs,), 4 * ratio - 1, device="cuda"),
        "rid": torch.arange(bs, device="cuda"),
        "kv": torch.randn(bs, (4 if ratio == 4 else 2) * d, device="cuda"),
        "out_loc": torch.arange(bs, device="cuda"),
    }
    state_g, cache_g = state.cuda(), cache.cuda()
    state_e, cache_e = state_g.clone(), cache_g.clone()
    with custom_ops.checks(checking):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            _decode_step(cuda_params, inputs, state_g.clone(), cache_g.clone())  # loads the kernels before capture
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out_static = _decode_step(cuda_params, inputs, state_g, cache_g)
    slots = pages * STORE_PAGE
    for t in range(2 * ratio if ratio == 4 else 12):
        rid, out_loc = _bad_values(t, bs, ratio, online, slots)
        inputs["rid"].copy_(rid)
        inputs["out_loc"].copy_(out_loc)
        inputs["seq"].add_(1)
        inputs["kv"].copy_(torch.randn(inputs["kv"].shape, generator=g))
        want_state, want_cache = state_e.cpu(), cache_e.cpu()
        before_cache = want_cache.clone()
        graph.replay()
        eager = _decode_step(cuda_params, inputs, state_e, cache_e)
        assert torch.equal(out_static, eager), f"step {t}"
        neutral = {k: v.cpu() for k, v in inputs.items()}
        outside = neutral["rid"] >= bs
        neutral["rid"] = neutral["rid"].masked_fill(outside, -1)
        neutral["out_loc"] = neutral["out_loc"].masked_fill(neutral["out_loc"] >= slots, -1)
        want = _decode_step(params, neutral, want_state, want_cache)
        exact = 1e-5 if online else 0.0
        torch.testing.assert_close(state_e.cpu(), want_state, atol=exact, rtol=exact, msg=f"step {t}")
        torch.testing.assert_close(eager.cpu(), want, atol=1e-4, rtol=1e-4, msg=f"step {t}")
        own = neutral["out_loc"][outside]  # slots of the requests past the state: their zero entries
        written = neutral["out_loc"][neutral["out_loc"] >= 0]
        got_cache = cache_e.cpu()
        assert _unwritten(got_cache, before_cache, written, d, False), f"step {t}: bytes of other slots changed"
        keep = torch.ones(got_cache.numel(), dtype=torch.bool)
        for loc in own[own >= 0].tolist():  # the zero entries' bytes
            keep &= _slot_mask(got_cache, loc, d)
        assert_cache_bytes_close(got_cache.reshape(-1)[keep], want_cache.reshape(-1)[keep], f"step {t}: ")
    assert torch.equal(state_g, state_e) and torch.equal(cache_g, cache_e)


def _slot_mask(cache: torch.Tensor, loc: int, d: int, fp4: bool = False) -> torch.Tensor:
    """False on the payload bytes of slot `loc` (page size STORE_PAGE), True elsewhere."""
    mask = torch.ones(cache.numel(), dtype=torch.bool)
    codes, scale, scale_width = (576, 7, 8) if d == 512 else (64 if fp4 else 128, 4, 4)
    base = (loc // STORE_PAGE) * cache.shape[1]
    off = loc % STORE_PAGE
    mask[base + off * codes : base + (off + 1) * codes] = False
    at = base + codes * STORE_PAGE + off * scale_width
    mask[at : at + scale] = False
    return mask
