"""The user-facing compressor object, the stateless whole-sequence function and the example script."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch._inductor.config as inductor_config
from dsv4_cases import gt_compress

import custom_ops  # noqa: F401
from custom_ops.dsv4.compressor import DSV4Compressor, PagedAddressing, compress_sequence, kernel_ape
from custom_ops.dsv4.store import cache_page_bytes
from custom_ops.layouts.fp8 import dequantize_flashmla_cache
from custom_ops.layouts.rope import precompute_freqs


@pytest.mark.parametrize(("ratio", "d", "length"), [(4, 512, 37), (4, 128, 3), (128, 128, 300), (128, 512, 256)])
def test_compress_sequence_matches_fp64(ratio, d, length):
    g = torch.Generator().manual_seed(length)
    kvs = torch.randn(length, (4 if ratio == 4 else 2) * d, generator=g)
    ape = torch.randn(8 if ratio == 4 else 128, d, generator=g)
    torch.testing.assert_close(
        compress_sequence(kvs, ape, ratio).double(), gt_compress(kvs, ape, ratio), atol=1e-5, rtol=1e-5
    )


def test_kernel_ape_layout():
    ape = torch.arange(4 * 6, dtype=torch.float32).view(4, 6)  # checkpoint [ratio, 2D] with D = 3
    k = kernel_ape(ape, 4)
    assert torch.equal(k[:4], ape[:, :3]) and torch.equal(k[4:], ape[:, 3:])
    assert torch.equal(kernel_ape(ape, 128), ape)


@pytest.mark.parametrize(
    ("ratio", "online", "state_dtype"),
    [(4, False, torch.float32), (128, False, torch.bfloat16), (128, True, torch.float32)],
)
def test_compressor_split_equals_whole_sequence(ratio, online, state_dtype):
    g = torch.Generator().manual_seed(ratio)
    comp = DSV4Compressor(64, 128, ratio, online=online, state_dtype=state_dtype)
    comp.reset_parameters(g)
    x = torch.randn(2 * ratio + 7, 64, generator=g)
    state = comp.new_state(3)
    rid = torch.tensor([1])
    got = {}
    cur = 0
    for n in [ratio - 1, 2, ratio + 1, 1, 1, 1, 2]:
        if n == 1:
            out = comp(x[cur : cur + 1], state, torch.tensor([cur + 1]), rid)
        else:
            out = comp(x[cur : cur + n], state, torch.tensor([cur + n]), rid, extend_lens=torch.tensor([n]))
        cur += n
        for row in out.valid.nonzero().squeeze(1).tolist():
            assert int(out.request[row]) == 0
            got[int(out.window[row])] = out.entries[row]
        assert torch.equal(out.entries[~out.valid], torch.zeros_like(out.entries[~out.valid]))
    want = compress_sequence(comp.kv_score(x), comp.kernel_ape(), ratio)
    assert sorted(got) == list(range(want.shape[0]))
    tol = 3e-2 if state_dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(torch.stack([got[n] for n in sorted(got)]), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("last_call", ["decode", "extend"])
def test_c128_window_needs_only_its_own_tokens_mapped(last_call):
    """Paged c128: a token of an earlier chunk unmapped after its entry was made (an evicted SWA page) does not stop
    the next window, which reads only its own 128 tokens (its plan rows carry read_page_0 = -1)."""
    torch.manual_seed(0)
    comp = DSV4Compressor(16, 128, 128)
    kv = torch.randn(256, 256)
    want = compress_sequence(kv, comp.kernel_ape(), 128)[1]
    req_to_token, full_to_state = torch.arange(512)[None].clone(), torch.arange(512)
    addressing = PagedAddressing(req_to_token, full_to_state, 256)
    state = comp.new_state(num_rows=2 * 128)
    first = 255 if last_call == "decode" else 200
    comp.compress_scores(kv[:first], state, torch.tensor([first]), torch.tensor([0]), torch.tensor([first]), addressing)
    full_to_state[127] = -1  # the previous chunk's last token: window 1 is rows 128..255
    extend = None if last_call == "decode" else torch.tensor([256 - first])
    out = comp.compress_scores(kv[first:], state, torch.tensor([256]), torch.tensor([0]), extend, addressing)
    assert out.valid.tolist() == [True] and out.window.tolist() == [1]
    torch.testing.assert_close(out.entries[0], want)
    # and `store` writes that entry as it writes one whose plan row has the page mapped (the decode store took a
    # row's read_page_0 = -1 for padding and wrote nothing)
    mapped = out.plan.clone()
    assert mapped.view(torch.int32)[0, 2] == -1
    mapped.view(torch.int32)[0, 2] = 0
    caches = []
    for plan in (out.plan, mapped):
        cache = torch.zeros(2, cache_page_bytes(128, 64), dtype=torch.uint8)
        comp.store(out._replace(plan=plan), precompute_freqs(512), torch.arange(out.tokens) + 3, cache, 64)
        caches.append(cache)
    assert caches[0].any() and torch.equal(caches[0], caches[1])


@pytest.mark.parametrize("one_at_a_time", ["decode", "extend"])
def test_c4_window_after_an_unmapped_page_reads_the_states_its_tokens_wrote(one_at_a_time):
    """Paged c4: the first SWA page unmapped (evicted) after a 256-token prefill, then tokens 256..263 one at a time.
    Window 64 (tokens 256..259, overlap 252..255) makes no entry; window 65 (overlap 256..259, all mapped) is the
    whole sequence's. Decode rows whose overlap token was unmapped were not planned at all, so tokens 256..259 wrote
    no state and window 65 was computed from rows never written (3.0 off), where extend-of-1 was right."""
    torch.manual_seed(0)
    comp = DSV4Compressor(16, 128, 4)
    kv = torch.randn(264, 4 * 128)
    want = compress_sequence(kv, comp.kernel_ape(), 4)
    req_to_token, full_to_state = torch.arange(512)[None].clone(), torch.arange(512)
    addressing = PagedAddressing(req_to_token, full_to_state, 256)
    state = comp.new_state(num_rows=2 * 8)
    comp.compress_scores(kv[:256], state, torch.tensor([256]), torch.tensor([0]), torch.tensor([256]), addressing)
    full_to_state[:256] = -1
    made = {}
    for pos in range(256, 264):
        extend = None if one_at_a_time == "decode" else torch.tensor([1])
        seq = torch.tensor([pos + 1])
        out = comp.compress_scores(kv[pos : pos + 1], state, seq, torch.tensor([0]), extend, addressing)
        made.update({int(w): e for w, e, v in zip(out.window, out.entries, out.valid, strict=True) if v})
    assert sorted(made) == [65]
    torch.testing.assert_close(made[65], want[65])


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
@pytest.mark.parametrize(("ratio", "online"), [(4, False), (128, True)], ids=["c4_ring", "c128_online"])
def test_ring_and_online_addressing_compile_with_fullgraph(ratio, online, backend):
    """The request-id check read the ids while tracing (a data-dependent guard under fullgraph=True); compiled, the
    graph checks them when it runs: the same entries as eager, and an id past the state raises naming it."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    comp = DSV4Compressor(16, 128, ratio, online=online)
    kv = torch.randn(ratio + 1, comp.wkv_gate.shape[0])
    seq = torch.tensor([ratio + 1])

    def step(kv, state, seq, rid):
        return comp.compress_scores(kv, state, seq, rid, seq).entries

    compiled = torch.compile(step, backend=backend, fullgraph=True)
    states = [comp.new_state(2), comp.new_state(2)]
    torch.testing.assert_close(
        compiled(kv, states[0], seq, torch.tensor([1])), step(kv, states[1], seq, torch.tensor([1]))
    )
    torch.testing.assert_close(states[0], states[1])
    with pytest.raises(RuntimeError, match="req_pool_indices"):
        compiled(kv, comp.new_state(2), seq, torch.tensor([2]))


@pytest.mark.slow
def test_compiled_kv_score_rounds_wide_inputs_only_with_emulated_casts():
    """What docs/dsv4_compress.md says of `kv_score` under Inductor: bf16 hidden states give eager's scores; fp32
    ones are not rounded to the weight dtype (Inductor computes the round trip in fp32), on torch 2.13 unless
    `emulate_precision_casts` is on."""
    comp = DSV4Compressor(64, head_dim=128, ratio=4)
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(2))

    def compiled_error(x: torch.Tensor) -> float:
        torch._dynamo.reset()
        return (torch.compile(comp.kv_score, fullgraph=True)(x) - comp.kv_score(x)).abs().max().item()

    assert compiled_error(x.bfloat16()) == 0.0
    assert compiled_error(x) > 1e-4  # the round trip dropped: if Inductor keeps it one day, the docs say too much
    if torch.__version__ >= "2.13":
        with inductor_config.patch(emulate_precision_casts=True):
            assert compiled_error(x) == 0.0


def test_compressor_rejects_bad_configs():
    with pytest.raises(ValueError, match="ratio"):
        DSV4Compressor(64, 128, 8)
    with pytest.raises(ValueError, match="online"):
        DSV4Compressor(64, 128, 4, online=True)
    with pytest.raises(ValueError, match="online"):
        DSV4Compressor(64, 128, 128, online=True, state_dtype=torch.bfloat16)


def test_example_script_runs():
    path = Path(__file__).resolve().parents[1] / "examples" / "dsv4_compress.py"
    spec = importlib.util.spec_from_file_location("dsv4_compress_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for ratio, online, paged in [(4, False, True), (128, True, False)]:
        assert module.run(ratio, online, paged, "cpu", hidden=64, head_dim=128) < 1e-5


def test_compressor_store_writes_normed_roped_entries():
    g = torch.Generator().manual_seed(5)
    comp = DSV4Compressor(64, 512, 4)
    comp.reset_parameters(g)
    with torch.no_grad():
        comp.norm_weight.copy_(torch.rand(512, generator=g) + 0.5)
    x = torch.randn(13, 64, generator=g)
    state = comp.new_state(1)
    freqs = precompute_freqs(64, 64, 160000.0, original_seq_len=65536, factor=16.0)
    cache = torch.zeros(2, cache_page_bytes(512, 8), dtype=torch.uint8)
    out_loc = torch.arange(13) + 2
    out = comp(x[:12], state, torch.tensor([12]), torch.tensor([0]), extend_lens=torch.tensor([12]))
    comp.store(out, freqs, out_loc[:12], cache, 8)
    out = comp(x[12:], state, torch.tensor([13]), torch.tensor([0]))
    comp.store(out, freqs, out_loc[12:], cache, 8)  # no window closes at 13: nothing stored
    entries = compress_sequence(comp.kv_score(x), comp.kernel_ape(), 4).double()
    y = entries / torch.sqrt(entries.square().mean(1, keepdim=True) + 1e-6) * comp.norm_weight.double()
    t = freqs[torch.tensor([0, 4, 8])].double()
    re, im = y[:, 448::2], y[:, 449::2]
    y[:, 448::2], y[:, 449::2] = re * t[:, 0::2] - im * t[:, 1::2], re * t[:, 1::2] + im * t[:, 0::2]
    got = dequantize_flashmla_cache(cache, 8, out_loc[torch.tensor([3, 7, 11])]).double()
    torch.testing.assert_close(got, y, atol=0.15, rtol=0.07)
    untouched = dequantize_flashmla_cache(cache, 8, torch.tensor([2, 4, 14]))
    assert not untouched.any()


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(("ratio", "online"), [(4, False), (128, False), (128, True)])
def test_compressor_rejects_requests_outside_the_state(ratio, online, idx_dtype):
    """`new_state(num_requests=1)` with `req_pool_indices=[1]`: prefill used to raise nothing and leave the state
    unchanged, and the next decode differed from the whole sequence. CPU raises naming req_pool_indices."""
    g = torch.Generator().manual_seed(ratio)
    comp = DSV4Compressor(64, 128, ratio, online=online)
    comp.reset_parameters(g)
    state = comp.new_state(1)
    before = state.clone()
    n = ratio + 3
    x = torch.randn(n + 1, 64, generator=g)
    seq, rid = torch.tensor([n], dtype=idx_dtype), torch.tensor([1], dtype=idx_dtype)
    match = r"req_pool_indices\[0\] = 1 is out of range: expected < 1 \(requests of state"
    with pytest.raises(ValueError, match=match):
        comp(x[:n], state, seq, rid, extend_lens=seq.clone())
    with pytest.raises(ValueError, match=match):
        comp(x[n:], state, seq + 1, rid)
    assert torch.equal(state, before)
    rid.zero_()
    comp(x[:n], state, seq, rid, extend_lens=seq.clone())
    out = comp(x[n:], state, seq + 1, rid)
    want = compress_sequence(comp.kv_score(x), comp.kernel_ape(), ratio)
    got = out.entries[out.valid] if out.valid.any() else want[:0]
    torch.testing.assert_close(got, want[want.shape[0] - got.shape[0] :], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"head_dim": 256}, r"head_dim: expected one of \(128, 512\) .* got 256"),
        ({"head_dim": 64, "ratio": 128}, r"head_dim: expected one of \(128, 512\)"),
        ({"ratio": 8}, r"ratio: expected 4 or 128, got 8"),
        ({"state_dtype": torch.float16}, r"state_dtype: expected one of"),
        ({"online": True}, r"online: needs ratio 128"),
    ],
)
def test_compressor_rejects_invalid_arguments_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DSV4Compressor(256, **kwargs)


def test_compressor_rejects_an_invalid_hidden_size():
    for hidden in (0, -4, 2.5):
        with pytest.raises(ValueError, match="hidden_size: expected a positive int"):
            DSV4Compressor(hidden)


@pytest.mark.parametrize("head_dim", [128, 512])
@pytest.mark.parametrize(("ratio", "online"), [(4, False), (128, False), (128, True)])
def test_every_valid_combination_constructs_and_runs(head_dim, ratio, online):
    comp = DSV4Compressor(64, head_dim=head_dim, ratio=ratio, online=online, dtype=torch.float32)
    state = comp.new_state(2)
    out = comp(torch.randn(8, 64), state, torch.tensor([4, 4]), torch.tensor([0, 1]), extend_lens=torch.tensor([4, 4]))
    assert out.entries.shape[1] == head_dim


@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("extra", [-3, 1])
def test_compressor_store_checks_the_out_loc_length_before_writing(decode, extra):
    """One c4 request of 8 tokens (windows at tokens 3 and 7), then one decode step: `out_loc` needs one entry per
    query token (per request in decode). A short one used to pass on CUDA, dropping window 1 (its ragged id 7 past
    the 5 entries); now it is a shape check on every device, before the cache is touched."""
    comp = DSV4Compressor(64, 512, 4)
    state = comp.new_state(1)
    x = torch.randn(8, 64)
    out = comp(x, state, torch.tensor([8]), torch.tensor([0]), extend_lens=torch.tensor([8]))
    if decode:
        out = comp(torch.randn(1, 64), state, torch.tensor([9]), torch.tensor([0]))
    freqs = precompute_freqs(64, 64, 160000.0)
    cache = torch.randint(0, 256, (4, cache_page_bytes(512, 16)), dtype=torch.uint8)
    before = cache.clone()
    tokens = 1 if decode else 8
    out_loc = torch.arange(max(tokens + extra, 0))
    with pytest.raises(ValueError, match=rf"^out_loc: expected {tokens} entries \(one per "):
        comp.store(out, freqs, out_loc, cache, 16)
    assert torch.equal(cache, before)
