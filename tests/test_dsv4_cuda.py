"""CUDA kernels of the DeepSeek-V4 compressor: CUDA == CPU reference (and the fp64 ground truth) on the reference
scenarios of docs/dsv4_compress.md ("Reference formula and scenarios") in both addressing modes, online c128,
bf16 state, the store op, a compiled step without clones, and decode steps captured in a CUDA graph and replayed
300 times."""

from __future__ import annotations

import random

import pytest
import torch
from dsv4_cases import (
    STORE_FREQS,
    STORE_PAGE,
    Session,
    assert_cache_bytes_close,
    assert_same_store_coding,
    make_inputs,
    plant_non_finite_rows,
    store_case,
)

import custom_ops  # noqa: F401
from custom_ops import _build
from custom_ops.dsv4.compress import compress_decode
from custom_ops.dsv4.online import online_compress_decode
from custom_ops.dsv4.plan import plan_decode, plan_online_decode, plan_online_prefill, plan_prefill
from custom_ops.dsv4.store import cache_page_bytes, compress_norm_rope_store
from custom_ops.layouts.rope import precompute_freqs
from dspark_fx.testing import reinplacing_misses

pytestmark = pytest.mark.cuda

D = 512
TOL = 1e-4


@pytest.fixture(autouse=True, scope="module")
def _cuda_library():
    """Load the CUDA library up front so every op, the planners included, runs its CUDA kernel."""
    _build.load()


def _twins(kvs, ape, ratio, mode="ring", online=False, state_dtype=torch.float32):
    kw = {"online": online, "state_dtype": state_dtype}
    return Session(kvs, ape, ratio, mode, device="cuda", **kw), Session(kvs, ape, ratio, mode, **kw)


def _run(calls, twins, atol=TOL):
    gpu, cpu = twins
    for kind, arg in calls:
        for s in twins:
            if kind == "extend":
                s.extend(arg, pad=2)
            else:
                s.decode(arg)
    gpu.check(atol=atol, rtol=atol)
    assert gpu.entries.keys() == cpu.entries.keys()
    for key, row in gpu.entries.items():
        torch.testing.assert_close(row, cpu.entries[key], atol=1e-5, rtol=1e-5)
    exact = 1e-5 if gpu.online else 0.0  # offline states hold copied rows: bit-exact
    torch.testing.assert_close(gpu.state.cpu(), cpu.state, atol=exact, rtol=exact, equal_nan=True)


def _scenarios(ratio):
    r = ratio
    if r == 4:
        yield from (("prefill", [[("extend", [n])] for n in (4, 8, 32, 256, 1024)]),)
        yield ("prefill_then_decode", [[("extend", [p])] + [("decode", None)] * 4 for p in (4, 256)])
        yield ("prefill_then_extend", [[("extend", [p]), ("extend", [4])] for p in (256, 512, 768)])
        yield ("multibatch", [[("extend", list(lens))] for lens in ((8, 8), (256, 256), (260, 260), (1023, 1023))])
    else:
        yield ("prefill", [[("extend", [n])] for n in (128, 256, 512)])
        yield (
            "prefill_then_decode",
            [([("extend", [p])] if p else []) + [("decode", None)] * 128 for p in (0, 128, 256)],
        )
        yield ("prefill_then_extend", [[("extend", [p]), ("extend", [128])] for p in (128, 256)])
        yield ("multibatch", [[("extend", list(lens))] for lens in ((128, 128), (256, 256), (384, 384))])


def _lengths(calls):
    bs = max(len(a) for k, a in calls if k == "extend") if any(k == "extend" for k, _ in calls) else 1
    total = [0] * bs
    for kind, arg in calls:
        for b in range(bs):
            total[b] += arg[b] if kind == "extend" else 1
    return total


@pytest.mark.parametrize("mode", ["ring", "paged"])
@pytest.mark.parametrize("ratio", [4, 128])
def test_spec_scenarios_cuda_equals_cpu(ratio, mode):
    for name, cases in _scenarios(ratio):
        for i, calls in enumerate(cases):
            kvs, ape = make_inputs(ratio, D, _lengths(calls), seed=i)
            try:
                _run(calls, _twins(kvs, ape, ratio, mode))
            except AssertionError as e:
                raise AssertionError(f"scenario {name}[{i}]: {e}") from e


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["ring", "paged"])
@pytest.mark.parametrize("ratio", [4, 128])
@pytest.mark.parametrize("d", [128, 512])
def test_random_splits_cuda_equals_cpu(d, ratio, mode, state_dtype):
    rng = random.Random(ratio + d)
    lengths = [rng.randint(2 * ratio, 4 * ratio + 7) for _ in range(3)]
    kvs, ape = make_inputs(ratio, d, lengths, seed=1, bf16_exact=state_dtype == torch.bfloat16)
    gpu, cpu = _twins(kvs, ape, ratio, mode, state_dtype=state_dtype)
    while cpu.cur != lengths:
        left = [n - c for n, c in zip(lengths, cpu.cur, strict=True)]
        if rng.random() < 0.4:
            active = [x > 0 and rng.random() < 0.75 for x in left]
            gpu.decode(active)
            cpu.decode(active)
        else:
            lens = [min(x, rng.choice([0, 1, rng.randint(1, ratio + 3), rng.randint(1, 2 * ratio + 9)])) for x in left]
            gpu.extend(lens, pad=1)
            cpu.extend(lens, pad=1)
    gpu.check(atol=TOL, rtol=TOL)
    for key, row in gpu.entries.items():
        torch.testing.assert_close(row, cpu.entries[key], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gpu.state.cpu(), cpu.state, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("seed", [0, 1])
def test_online_cuda_equals_cpu(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(256, 600) for _ in range(4)]
    kvs, ape = make_inputs(128, D, lengths, seed=seed)
    gpu, cpu = _twins(kvs, ape, 128, online=True)
    while cpu.cur != lengths:
        left = [n - c for n, c in zip(lengths, cpu.cur, strict=True)]
        if rng.random() < 0.3:
            active = [x > 0 and rng.random() < 0.8 for x in left]
            gpu.decode(active)
            cpu.decode(active)
        else:
            lens = [min(x, rng.choice([0, 1, rng.randint(1, 140), rng.randint(1, 300)])) for x in left]
            gpu.extend(lens)
            cpu.extend(lens)
    gpu.check(atol=TOL, rtol=TOL)
    for key, row in gpu.entries.items():
        torch.testing.assert_close(row, cpu.entries[key], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gpu.state.cpu(), cpu.state, atol=1e-5, rtol=1e-5, equal_nan=True)


@pytest.mark.parametrize("online_", [False, True])
@pytest.mark.parametrize("ratio", [4, 128])
def test_planners_cuda_equal_cpu(ratio, online_):
    g = torch.Generator().manual_seed(ratio)
    seq = torch.randint(1, 900, (9,), generator=g)
    seq[5] = 0  # padded row
    ext = torch.minimum(seq, torch.randint(0, 300, (9,), generator=g))
    rid = torch.randperm(12, generator=g)[:9]
    rid[3] = -1
    r2t = torch.arange(12 * 1024, dtype=torch.int32).view(12, 1024)
    f2s = torch.randperm(12 * 4, generator=g)[torch.arange(12 * 1024) // 256] * 256 + torch.arange(12 * 1024) % 256
    n = int(ext.sum()) + 3
    if online_:
        calls = [(plan_online_prefill, (seq, ext, rid, n)), (plan_online_decode, (seq, rid))]
    else:
        calls = [
            (plan_prefill, (seq, ext, rid, r2t, f2s, ratio, 8 if ratio == 4 else 128, 256, n)),
            (plan_prefill, (seq, ext, rid, None, None, ratio, 8 if ratio == 4 else 128, 0, n)),
            (plan_decode, (seq, rid, r2t, f2s, ratio, 8 if ratio == 4 else 128, 256)),
        ]
    for fn, args in calls:
        want = fn(*args)
        got = fn(*[a.cuda() if isinstance(a, torch.Tensor) else a for a in args])
        want, got = (want, got) if isinstance(want, tuple) else ((want,), (got,))
        for w, h in zip(want, got, strict=True):
            assert torch.equal(w, h.cpu())


FREQS = precompute_freqs(8192, 64, 160000.0, original_seq_len=65536, factor=16.0)


@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize(("d", "fp4"), [(512, False), (128, False), (128, True)])
def test_store_cuda_equals_cpu(d, fp4, decode):
    g = torch.Generator().manual_seed(d)
    ratio = 4
    if decode:
        seq = torch.randint(1, 2000, (64,), generator=g) * 4 // torch.randint(1, 3, (64,), generator=g)
        plan = plan_decode(seq, torch.arange(64), None, None, ratio, 8)
        out_loc = torch.randperm(300, generator=g)[:64] - 20  # some negative
    else:
        seq = torch.tensor([900, 333, 64])
        ext = torch.tensor([500, 333, 60])
        plan, _ = plan_prefill(seq, ext, torch.arange(3), None, None, ratio, 8, 0, int(ext.sum()))
        out_loc = torch.randperm(1000, generator=g)[: int(ext.sum())] - 30
    kv = torch.randn(plan.shape[0], d, generator=g) * 4
    w = torch.rand(d, generator=g) + 0.5
    page_size = 64
    shape = (1024 // page_size, cache_page_bytes(d, page_size, fp4))
    cache = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    want = cache.clone()
    compress_norm_rope_store(kv, plan, w, 1e-6, FREQS, out_loc, want, page_size, ratio, decode, fp4)
    got = cache.cuda()
    compress_norm_rope_store(
        kv.cuda(), plan.cuda(), w.cuda(), 1e-6, FREQS.cuda(), out_loc.cuda(), got, page_size, ratio, decode, fp4
    )
    assert_cache_bytes_close(got, want)


@pytest.mark.parametrize("ratio", [4, 128])
def test_decode_store_of_rows_whose_read_page_0_is_unmapped(ratio):
    """Decode rows that close a window with read_page_0 = -1 (a paged c128 window whose previous token was evicted):
    c128 never reads that page and stores them, c4 does not (its compress op makes no entry there); CUDA writes what
    the CPU writes, and for c128 those rows' slots change."""
    g = torch.Generator().manual_seed(ratio)
    seq = torch.arange(1, 33) * ratio
    plan = plan_decode(seq, torch.arange(32), None, None, ratio, 8 if ratio == 4 else 128)
    plan.view(torch.int32)[::2, 2] = -1
    out_loc = torch.randperm(500, generator=g)[:32]
    kv = torch.randn(32, 128, generator=g) * 4
    w = torch.rand(128, generator=g) + 0.5
    cache = torch.randint(0, 256, (1024 // 64, cache_page_bytes(128, 64, False)), dtype=torch.uint8, generator=g)
    want = cache.clone()
    compress_norm_rope_store(kv, plan, w, 1e-6, FREQS, out_loc, want, 64, ratio, True, False)
    codes = [(int(s) // 64, slice(int(s) % 64 * 128, int(s) % 64 * 128 + 128)) for s in out_loc[::2]]
    written = [not torch.equal(want[page, at], cache[page, at]) for page, at in codes]
    assert all(written) if ratio == 128 else not any(written)
    got = cache.cuda()
    compress_norm_rope_store(
        kv.cuda(), plan.cuda(), w.cuda(), 1e-6, FREQS.cuda(), out_loc.cuda(), got, 64, ratio, True, False
    )
    assert_cache_bytes_close(got, want)


@pytest.mark.parametrize(("d", "fp4"), [(512, False), (128, False), (128, True)])
def test_store_cuda_codes_non_finite_rows_as_cpu(d, fp4):
    """Rows with a NaN or an infinity (tests/dsv4_cases.py, plant_non_finite_rows): the kernel writes the CPU path's
    scale bytes and codes the same values, NaN where the CPU path has NaN."""
    kv, plan, w, out_loc, cache = store_case(d, fp4, False)
    slots = plant_non_finite_rows(kv, plan, out_loc, False)
    want = cache.clone()
    compress_norm_rope_store(kv, plan, w, 1e-6, STORE_FREQS, out_loc, want, STORE_PAGE, 4, False, fp4)
    got = cache.cuda()
    compress_norm_rope_store(
        kv.cuda(), plan.cuda(), w.cuda(), 1e-6, STORE_FREQS.cuda(), out_loc.cuda(), got, STORE_PAGE, 4, False, fp4
    )
    assert_same_store_coding(got.cpu(), want, slots, d, fp4, ties=4)


@pytest.mark.parametrize(
    ("ratio", "online_", "d"), [(4, False, 512), (4, False, 128), (128, False, 512), (128, True, 512)]
)
def test_decode_cuda_graph_replay(ratio, online_, d):
    """A decode step (plan + compress [+ store]) captured once, replayed 300 steps == the same steps run eagerly."""
    torch.manual_seed(0)
    bs = 16
    width = 3 * d if online_ else (4 if ratio == 4 else 2) * d
    in_width = (4 if ratio == 4 else 2) * d
    ring = 1 if online_ else (8 if ratio == 4 else 128)
    ape = torch.randn(8 if ratio == 4 else 128, d, device="cuda")
    w = torch.rand(d, device="cuda") + 0.5
    freqs = FREQS.cuda()
    page_size = 64
    state_g = torch.randn(bs * ring + ring, width, device="cuda")
    if online_:
        state_g[:, d : 2 * d] = state_g[:, d : 2 * d].abs() + 1
    state_e = state_g.clone()
    cache_g = torch.zeros(2048 // page_size, cache_page_bytes(d, page_size), dtype=torch.uint8, device="cuda")
    cache_e = cache_g.clone()
    rid = torch.randperm(bs + 1, device="cuda")[:bs]
    seq = torch.randint(200, 400, (bs,), device="cuda")
    kv = torch.randn(bs, in_width, device="cuda")
    out_loc = torch.arange(bs, device="cuda") + 1

    def step(state, cache):
        if online_:
            plan = plan_online_decode(seq, rid)
            out = online_compress_decode(state, kv, ape, plan)
        else:
            plan = plan_decode(seq, rid, None, None, ratio, ring)
            out = compress_decode(state, kv, ape, plan, ratio)
        compress_norm_rope_store(out, plan, w, 1e-6, freqs, out_loc, cache, page_size, ratio, True)
        return out

    warm = state_g.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step(warm, cache_g.clone())  # builds / loads the kernels outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static = step(state_g, cache_g)
    for t in range(300):
        kv.copy_(torch.randn(bs, in_width, device="cuda"))
        seq.add_(1)
        out_loc.copy_(torch.randperm(2048, device="cuda")[:bs] - 1)  # distinct slots, some -1
        graph.replay()
        eager = step(state_e, cache_e)
        assert torch.equal(out_static, eager), f"step {t}"
    assert torch.equal(state_g, state_e) and torch.equal(cache_g, cache_e)


def test_compiled_prefill_on_cuda_mutates_in_place():
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    counters.clear()
    ops = torch.ops.dspark
    ape = torch.randn(8, D, device="cuda")
    state = torch.zeros(4 * 8, 4 * D, device="cuda")
    cache = torch.zeros(4, cache_page_bytes(D, 64), dtype=torch.uint8, device="cuda")
    freqs = FREQS.cuda()
    w = torch.ones(D, device="cuda")

    def prefill(state, cache, kv, seq, ext, rid, out_loc):
        plan_c, plan_w = ops.dsv4_plan_prefill(seq, ext, rid, None, None, 4, 8, 0, kv.shape[0])
        out = ops.dsv4_compress_prefill(state, kv, ape, plan_c, plan_w, 4)
        ops.dsv4_compress_norm_rope_store(out, plan_c, w, 1e-6, freqs, out_loc, cache, 64, 4, False)
        return out

    seq = torch.tensor([37, 12], device="cuda")
    rid = torch.tensor([0, 2], device="cuda")
    kv = torch.randn(49, 4 * D, device="cuda")
    out_loc = torch.arange(49, device="cuda")
    se, ce = state.clone(), cache.clone()
    eager = prefill(se, ce, kv, seq, seq, rid, out_loc)
    with reinplacing_misses() as misses:
        out, code = run_and_get_code(torch.compile(prefill, fullgraph=True), state, cache, kv, seq, seq, rid, out_loc)
    assert torch.equal(out, eager) and torch.equal(state, se) and torch.equal(cache, ce)
    assert "clone" not in "\n".join(code)
    assert misses["tensors"] == 0


def test_example_runs_on_cuda():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "dsv4_compress.py"
    spec = importlib.util.spec_from_file_location("dsv4_compress_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for ratio, online_, paged in [(4, False, False), (4, False, True), (128, False, True), (128, True, False)]:
        assert module.run(ratio, online_, paged, "cuda", hidden=256, head_dim=512) < 1e-4


@pytest.mark.parametrize("ratio", [4, 128])
def test_paged_long_random_split_cuda_equals_cpu(ratio):
    rng = random.Random(7 + ratio)
    lengths = [rng.randint(520, 900) for _ in range(3)]
    kvs, ape = make_inputs(ratio, D, lengths, seed=3)
    gpu, cpu = _twins(kvs, ape, ratio, "paged")
    while cpu.cur != lengths:
        left = [n - c for n, c in zip(lengths, cpu.cur, strict=True)]
        if rng.random() < 0.5:
            for _ in range(rng.randint(1, 9)):
                active = [n > c for n, c in zip(lengths, cpu.cur, strict=True)]
                gpu.decode(active)
                cpu.decode(active)
        else:
            lens = [min(x, rng.randint(0, 300)) for x in left]
            gpu.extend(lens)
            cpu.extend(lens)
    gpu.check(atol=TOL, rtol=TOL)
    for key, row in gpu.entries.items():
        torch.testing.assert_close(row, cpu.entries[key], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gpu.state.cpu(), cpu.state, atol=0, rtol=0, equal_nan=True)


def test_opcheck_cuda():
    ops = torch.ops.dspark
    g = torch.Generator().manual_seed(0)
    seq = torch.tensor([8, 200, 129], device="cuda")
    ext = torch.tensor([8, 100, 1], device="cuda")
    rid = torch.tensor([1, 0, 2], device="cuda")
    n = int(ext.sum())
    for ratio in (4, 128):
        width = (4 if ratio == 4 else 2) * D
        ring = 8 if ratio == 4 else 128
        state = torch.randn(3 * ring, width, generator=g).cuda()
        ape = torch.randn(8 if ratio == 4 else 128, D, generator=g).cuda()
        plan = ops.dsv4_plan_decode(seq, rid, None, None, ratio, ring)
        torch.library.opcheck(ops.dsv4_plan_decode, (seq, rid, None, None, ratio, ring))
        kv1 = torch.randn(3, width, generator=g).cuda()
        torch.library.opcheck(ops.dsv4_compress_decode, (state.clone(), kv1, ape, plan, ratio))
        plan_c, plan_w = ops.dsv4_plan_prefill(seq, ext, rid, None, None, ratio, ring, 0, n)
        kv = torch.randn(n, width, generator=g).cuda()
        torch.library.opcheck(ops.dsv4_compress_prefill, (state.clone(), kv, ape, plan_c, plan_w, ratio))
        cache = torch.zeros(8, cache_page_bytes(D, 64), dtype=torch.uint8, device="cuda")
        out = ops.dsv4_compress_prefill(state.clone(), kv, ape, plan_c, plan_w, ratio)
        args = (
            out,
            plan_c,
            torch.ones(D, device="cuda"),
            1e-6,
            FREQS.cuda(),
            torch.arange(n, device="cuda"),
            cache,
            64,
        )
        torch.library.opcheck(ops.dsv4_compress_norm_rope_store, (*args, ratio, False))
    ostate = torch.randn(3, 3 * D, generator=g).cuda()
    ostate[:, D : 2 * D] = ostate[:, D : 2 * D].abs() + 1
    ape = torch.randn(128, D, generator=g).cuda()
    torch.library.opcheck(ops.dsv4_plan_online_decode, (seq, rid))
    kv1 = torch.randn(3, 2 * D, generator=g).cuda()
    plan = ops.dsv4_plan_online_decode(seq, rid)
    torch.library.opcheck(ops.dsv4_online_compress_decode, (ostate.clone(), kv1, ape, plan))
    plan_c, plan_w = ops.dsv4_plan_online_prefill(seq, ext, rid, n)
    kv = torch.randn(n, 2 * D, generator=g).cuda()
    torch.library.opcheck(ops.dsv4_online_compress_prefill, (ostate.clone(), kv, ape, plan_c, plan_w))
