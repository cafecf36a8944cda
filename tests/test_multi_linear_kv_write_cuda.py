"""dspark::multi_linear_kv_write on CUDA against the CPU reference (the op on CPU): Qwen3-8B-like and head_dim-64
shapes, T in {1, 7, 8, 16, 17, 64, 65, 200, 512, 513}, both RoPE styles, partial rotary, biases, commit masks,
negative slots, strided and aliasing-but-disjoint caches; the heads kernel each rule names; every byte outside the
written rows unchanged; out-of-range slots and positions skipped (checking mode: the CPU message, nothing written);
CUDA-graph capture and replay with new inputs and an in-place weight update; opcheck; the argument errors of the CPU
table and the CUDA-only rules, before any write.

Inputs come from `make_case` of tests/multi_linear_cases.py: a spec built on CPU and on CUDA holds the same
values, so the CPU op on the CPU case is the oracle of the CUDA op on the CUDA case.
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch
from multi_linear_cases import (
    BAD,
    BAD_CASES,
    CUDA_ONLY_CASES,
    Case,
    Spec,
    bits,
    cache_bits,
    counted_from_the_end,
    fp64_kv,
    make_case,
    written_masks,
    written_tokens,
)

import custom_ops
from custom_ops import _build

pytestmark = pytest.mark.cuda

op = torch.ops.dspark.multi_linear_kv_write

QWEN3_8B = Spec(  # 5 draft layers of Qwen3-8B: hidden 4096, 32 query / 8 KV heads of 128, fused qkv weights
    hidden=4096,
    layers=5,
    heads=8,
    head_dim=128,
    q_heads=32,
    slots=1100,
    dtype=torch.bfloat16,
    rot=128,
    bias=(False,),
    table_rows=4096,
)
HEAD_DIM_64 = Spec(
    hidden=1024,
    layers=3,
    heads=4,
    head_dim=64,
    q_heads=16,
    slots=700,
    dtype=torch.bfloat16,
    rot=32,
    neox=False,
    bias=(True, False, True),
    weight_layout="row-strided",
)
# 513: odd and above 512, a GEMM tile tail in every batched K/V GEMM of dspark::multi_linear. The GEMM path's heads
# kernel is the warp-per-unit form at 17 to 65 tokens (their units fit an H100 or H200 at once) and the ring of
# persistent warps at 512 and 513.
TOKENS = (1, 7, 8, 16, 17, 64, 65, 200, 512, 513)
# Fused up to here on sm_90 (kFusedMaxTokens of csrc/linear/multi_linear_kv_write.cu), beyond the GEMM path.
FUSED_MAX_TOKENS = 16
# a [T / W, W] split of each T
WINDOW = {0: 1, 1: 1, 7: 7, 8: 4, 16: 4, 17: 17, 64: 8, 65: 13, 200: 8, 512: 16, 513: 19}


@pytest.fixture(autouse=True, scope="module")
def _cuda_library():
    _build.load()


def pair(spec: Spec, fresh_weights: bool = False) -> tuple[Case, Case]:
    """The same inputs on CPU (the oracle) and on CUDA."""
    return make_case(spec, "cpu", fresh_weights), make_case(spec, "cuda", fresh_weights)


def tolerance(tokens: int, head_dim: int = 128) -> tuple[float, float]:
    """(rtol, atol relative to the largest value) of a written row: one rounding on the fused path (up to
    FUSED_MAX_TOKENS tokens, heads of 64 or 128), two on the GEMM path; RoPE mixes each element with its partner, so
    the GEMM path's extra rounding of the partner shows up in absolute terms, up to 2^-8 of the largest value rather
    than of the element."""
    fused = tokens <= FUSED_MAX_TOKENS and head_dim in (64, 128)
    return (2**-7, 1e-3) if fused else (2**-6, 2**-8)


def assert_matches_reference(got: Case, want: Case, before: list[torch.Tensor]) -> None:
    """`got` (the CUDA case after the op) against `want` (the CPU case after the op): every byte outside the written
    rows as `before` the op (rows of skipped, masked and negative-slot tokens, the slots a wrapped negative index
    would hit, the padding of strided caches), written rows within bf16/fp16 rounding of the reference: one
    rounding on the fused path (up to FUSED_MAX_TOKENS tokens), two on the GEMM path, whose projections are rounded
    to the input dtype before the norm and RoPE (as in a per-layer module)."""
    rounding, atol = tolerance(want.args["x"].shape[0], want.args["head_dim"])
    written = written_tokens(want.args)
    for base, mask, old in zip(got.bases, written_masks(want, written), before, strict=True):
        assert torch.equal(bits(base)[~mask], old[~mask]), "the kernel changed a byte outside the written rows"
    slots = torch.tensor([s for _, s in written], dtype=torch.long)
    for kind in ("k_caches", "v_caches"):
        for g, w in zip(got.args[kind], want.args[kind], strict=True):
            g, w = g.cpu()[slots].double(), w[slots].double()
            assert not g.isnan().any(), f"a written {kind} row still holds poison"
            if w.numel():
                scale = w.abs().max().item()
                torch.testing.assert_close(g, w, rtol=rounding, atol=atol * scale)
                assert ((g - w).norm() / w.norm()).item() < rounding / 2


def run_pair(spec: Spec) -> tuple[Case, Case]:
    cpu, cuda = pair(spec)
    before = [bits(b) for b in cuda.bases]
    cpu.call()
    cuda.call()
    torch.cuda.synchronize()
    assert_matches_reference(cuda, cpu, before)
    return cpu, cuda


def _negatives(tokens: int) -> tuple[int, ...]:
    return tuple(t for t in range(tokens) if t % 5 == 2)


def _variant(base: Spec, tokens: int, mode: str, style: str) -> Spec:
    """`mode`: "1-D" (negative slots) or "commit" ([T / W, W] slots, commit lengths 0, W, partial and > W, and
    negative slots); `style`: "neox" or "gptj" (GPT-J with partial rotary)."""
    spec = replace(base, tokens=tokens, negative=_negatives(tokens), seed=tokens)
    if mode == "commit":
        w = WINDOW[tokens]
        spec = replace(spec, window=w, commit=(w, 0, max(w - 3, 1), w + 5, 1))
    if style == "gptj":
        spec = replace(spec, neox=False, rot=base.head_dim // 2)
    return spec


@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("mode", ["1-D", "commit"])
@pytest.mark.parametrize("tokens", TOKENS)
def test_qwen3_8b_shapes(tokens, mode, style):
    run_pair(_variant(QWEN3_8B, tokens, mode, style))


@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("mode", ["1-D", "commit"])
@pytest.mark.parametrize("tokens", TOKENS)
def test_head_dim_64(tokens, mode, style):
    run_pair(_variant(HEAD_DIM_64, tokens, mode, style))


HEADS_KERNELS = ("kv_write_heads_kernel<", "kv_write_heads_unit_kernel<", "kv_write_heads_common_kernel<")


COMPILED, GENERAL, RING = HEADS_KERNELS[2], HEADS_KERNELS[1], HEADS_KERNELS[0]


@pytest.mark.parametrize(
    ("tokens", "style", "overrides", "kernel"),
    [
        (17, "neox", {}, COMPILED),
        (1024, "neox", {}, COMPILED),
        (17, "neox", {"table_form": "frequencies"}, COMPILED),
        (17, "gptj", {"table_form": "pairs", "rot": 128}, COMPILED),
        (17, "gptj", {"rot": 128}, COMPILED),
        (17, "neox", {"norm": "off"}, COMPILED),
        (17, "gptj", {}, GENERAL),
        (17, "neox", {"norm": "fp32-weight"}, GENERAL),
        (1024, "gptj", {}, RING),
    ],
    ids=[
        "neox",
        "neox-1024",
        "frequencies",
        "gptj-pairs",
        "gptj-halves",
        "no-norm",
        "partial",
        "fp32-norm",
        "partial-1024",
    ],
)
def test_the_heads_kernel_the_rule_names_runs(tokens, style, overrides, kernel):
    """The GEMM path's heads kernel (Qwen3-8B draft dims): the one compiled for the call's form (RoPE over the whole
    head: neox from a halves table or inverse frequencies, GPT-J from a pairs or halves table; norm weights of x's
    dtype, or no norm) at any T; else the general warp-per-unit kernel while the units fit the GPU at once (17
    tokens: 340 units), here for partial rotary or fp32 norm weights, and the ring kernel beyond (1024 tokens: 10240
    units, more warps than 426 SMs hold). The result matches the reference."""
    cpu, cuda = pair(replace(_variant(QWEN3_8B, tokens, "1-D", style), **overrides))
    before = [bits(b) for b in cuda.bases]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        cuda.call()
        torch.cuda.synchronize()
    names = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    assert [k for k in HEADS_KERNELS if any(k in n for n in names)] == [kernel], sorted(names)
    cpu.call()
    assert_matches_reference(cuda, cpu, before)


@pytest.mark.parametrize("tokens", sorted({16, FUSED_MAX_TOKENS, FUSED_MAX_TOKENS + 1}))
def test_qwen3_8b_against_fp64(tokens):
    """One case per path also against the fp64 formula directly (the oracle's own check, at the real shapes)."""
    rtol, atol = tolerance(tokens)
    _, cuda = run_pair(_variant(QWEN3_8B, tokens, "commit", "neox"))
    written = written_tokens(cuda.args)
    tokens = [t for t, _ in written]
    slots = torch.tensor([s for _, s in written], dtype=torch.long)
    for i, (k64, v64) in enumerate(fp64_kv(cuda.args)):
        for cache, want in ((cuda.args["k_caches"][i], k64), (cuda.args["v_caches"][i], v64)):
            got = cache.cpu()[slots].double()
            torch.testing.assert_close(got, want[tokens], rtol=rtol, atol=atol * want.abs().max().item())


@pytest.mark.parametrize("tokens", [FUSED_MAX_TOKENS + 1, 512])
def test_gemm_path_reads_a_misaligned_activation(tokens):
    """x contiguous but 2 bytes past a 16-byte boundary on the GEMM path (T > FUSED_MAX_TOKENS), where
    dspark::multi_linear puts the 5 layers' K/V row ranges in one batched cuBLAS GEMM. cuBLAS reads that GEMM's
    pointers from device memory, cannot check them and assumes them aligned: before, it got x's pointer as it was (a
    standalone batched GEMM of this kind, bf16, T = 16, K = 4096, returned success and a max error of 4.48 on the
    H200); now x is copied."""
    spec = replace(_variant(QWEN3_8B, tokens, "1-D", "neox"), x_layout="misaligned")
    _, cuda = run_pair(spec)
    assert cuda.args["x"].data_ptr() % 16 == 2


LAYOUTS = {
    "padded caches": dict(cache_layout="padded"),
    "heads-major caches": dict(cache_layout="heads-major"),
    "interleaved K/V caches": dict(cache_layout="interleaved"),
    "stacked caches": dict(cache_layout="stacked"),
    "separate weights with biases": dict(proj="separate", bias=(True, False)),
    "row offsets": dict(proj="offset", bias=(True,)),
    "row-strided x": dict(x_layout="row-strided"),
    "misaligned x": dict(x_layout="misaligned"),
    "fp16": dict(dtype=torch.float16),
    "fp16, fp32 norm weights, int32 indices": dict(
        dtype=torch.float16, norm="fp32-weight", pos_dtype=torch.int32, loc_dtype=torch.int32
    ),
    "norm without weight": dict(norm="no-weight"),
    "no norm": dict(norm="off"),
    "no norm, full rotary": dict(norm="off", rot=64),
    "no rope": dict(rot=None),
    "pairs tables (a complex table's real view)": dict(table_form="pairs"),
    "inverse frequencies, int32 positions": dict(table_form="frequencies", pos_dtype=torch.int32),
    "one layer": dict(layers=1),
    "head_dim 256": dict(heads=2, head_dim=256, rot=64),
    "head_dim 256, full rotary": dict(heads=2, head_dim=256, rot=256),
    "head_dim 8": dict(heads=4, head_dim=8, rot=8),
}


@pytest.mark.parametrize("tokens", [8, 40, 65])  # the fused kernel, then the GEMM path
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layouts_and_options(name, tokens):
    base = replace(HEAD_DIM_64, **LAYOUTS[name])
    run_pair(_variant(base, tokens, "commit" if tokens == 8 else "1-D", "neox"))


@pytest.mark.parametrize("window", [0, 4])
def test_no_tokens(window):
    """T = 0: nothing launched, nothing written."""
    run_pair(replace(HEAD_DIM_64, tokens=0, window=window))


def test_all_tokens_skipped():
    spec = replace(HEAD_DIM_64, tokens=16, negative=tuple(range(8)), window=4, commit=(4, 4, 0, -1))
    cpu, _ = run_pair(spec)
    assert not written_tokens(cpu.args)


# ---------------------------------------------------------------------------------------------- index values


def _skip_tokens(case: Case, tokens: list[int]) -> None:
    """Make `tokens` skipped in `case` by giving them a negative slot (what the kernel must do with a bad index)."""
    flat = case.args["cache_loc"].view(-1)
    flat[tokens] = -1


def _break(case: Case) -> list[int]:
    """Out-of-range entries (slot S, a huge slot, positions -1 and past the shorter table); returns their tokens."""
    s, rows = case.spec.slots, case.spec.table_rows
    flat = case.args["cache_loc"].view(-1)
    flat[1] = s
    flat[3] = 2**31 - 1 if flat.dtype == torch.int32 else 2**62 + 5
    case.args["positions"][4] = -1
    case.args["positions"][6] = rows
    return [1, 3, 4, 6]


@pytest.mark.parametrize("loc_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_out_of_range_tokens_are_skipped(graph, loc_dtype):
    """Without checking mode the kernel skips a token whose slot is >= S or whose position is outside a table: the
    result equals the reference run with those tokens' slots made negative (eagerly and in a CUDA-graph replay)."""
    spec = replace(HEAD_DIM_64, tokens=12, pos_dtype=loc_dtype, loc_dtype=loc_dtype, negative=(9,))
    cpu, cuda = pair(spec)
    bad = _break(cuda)
    _skip_tokens(cpu, bad)
    before = [bits(b) for b in cuda.bases]
    if graph:
        initial = [b.clone() for b in cuda.bases]
        cuda.call()  # warm-up outside the capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            cuda.call()
        for b, old in zip(cuda.bases, initial, strict=True):
            b.copy_(old)
        g.replay()
    else:
        cuda.call()
    torch.cuda.synchronize()
    cpu.call()
    assert_matches_reference(cuda, cpu, before)


@pytest.mark.parametrize("tokens", [8, 40])
def test_wrap_negative_counts_from_the_end(tokens):
    """wrap_negative on the fused path (8 tokens) and the GEMM path (40): slots `l - S` and positions `p - P` write the
    same bytes as `l` and `p`; below `-S` / `-P` a token is skipped (without checking mode), in every layer."""
    spec = replace(QWEN3_8B if tokens <= FUSED_MAX_TOKENS else HEAD_DIM_64, tokens=tokens, seed=tokens)
    _, plain = pair(spec)
    wrapped = counted_from_the_end(plain)
    plain.call()
    wrapped.call()
    torch.cuda.synchronize()
    for a, b in zip(plain.bases, wrapped.bases, strict=True):
        assert torch.equal(bits(a), bits(b))
    cpu, cuda = pair(spec)
    cuda = counted_from_the_end(cuda)
    cuda.args["cache_loc"].view(-1)[1] = -spec.slots - 1
    cuda.args["positions"][3] = -spec.table_rows - 1
    _skip_tokens(cpu, [1, 3])
    before = [bits(b) for b in cuda.bases]
    cpu.call()
    cuda.call()
    torch.cuda.synchronize()
    assert_matches_reference(cuda, cpu, before)


@pytest.mark.parametrize("what", ["k_norm_weights", "cos_sin_caches"])
def test_cuda_layout_error_in_a_later_launch_raises_before_any_write(what):
    """34 layers take two launches (32 layers each); a bad layout in layer 33 raises before the first launch."""
    _, cuda = pair(Spec(layers=34, tokens=5, head_dim=16, heads=2, dtype=torch.bfloat16, hidden=64))
    if what == "k_norm_weights":
        w = cuda.args["k_norm_weights"][33]
        cuda.args["k_norm_weights"][33] = torch.stack([w, w], dim=1)[:, 0]
    else:
        t = cuda.args["cos_sin_caches"][33]
        cuda.args["cos_sin_caches"][33] = torch.stack([t, t], dim=2)[:, :, 0]
    before = cache_bits(cuda.args)
    with pytest.raises(ValueError, match=re.escape(f"multi_linear_kv_write: {what}[33] must")):
        cuda.call()
    assert all(torch.equal(a, b) for a, b in zip(cache_bits(cuda.args), before, strict=True))


def _value_cases():
    """(id, spec, change(case)) with one out-of-range entry each."""
    s, rows = HEAD_DIM_64.slots, HEAD_DIM_64.table_rows

    def set_entry(key, index, value):
        def change(case):
            case.args[key].view(-1)[index] = value

        return change

    return [
        ("slot = S", HEAD_DIM_64, set_entry("cache_loc", 2, s)),
        ("int32 slot", replace(HEAD_DIM_64, loc_dtype=torch.int32), set_entry("cache_loc", 5, 2**31 - 1)),
        ("huge slot", HEAD_DIM_64, set_entry("cache_loc", 0, 2**62)),
        ("masked [B, W] slot", replace(HEAD_DIM_64, window=4, commit=(1, 0)), set_entry("cache_loc", 6, s + 3)),
        ("position -1", HEAD_DIM_64, set_entry("positions", 3, -1)),
        ("position past the shorter table", HEAD_DIM_64, set_entry("positions", 1, rows)),
        ("int32 position", replace(HEAD_DIM_64, pos_dtype=torch.int32), set_entry("positions", 7, 2**31 - 1)),
        ("wrapped slot below -S", HEAD_DIM_64, wrap_and(set_entry("cache_loc", 4, -s - 1))),
        ("wrapped position below -P", HEAD_DIM_64, wrap_and(set_entry("positions", 2, -rows - 1))),
    ]


def wrap_and(change):
    """`change` with `wrap_negative=True`."""

    def wrapped(case):
        case.args["wrap_negative"] = True
        change(case)

    return wrapped


@pytest.mark.parametrize("case", _value_cases(), ids=[c[0] for c in _value_cases()])
def test_checking_mode_raises_the_cpu_message(case):
    _, spec, change = case
    spec = replace(spec, tokens=8)
    cpu, cuda = pair(spec)
    change(cpu)
    change(cuda)
    with pytest.raises(ValueError) as on_cpu:
        cpu.call()
    before = cache_bits(cuda.args)
    with custom_ops.checks(), pytest.raises(ValueError) as on_cuda:
        cuda.call()
    assert str(on_cuda.value).splitlines()[0] == str(on_cpu.value).splitlines()[0]
    assert all(torch.equal(a, b) for a, b in zip(cache_bits(cuda.args), before, strict=True))
    assert not custom_ops.checks_enabled()
    cuda.call()  # checks off again: the token is skipped
    torch.cuda.synchronize()


def test_checking_mode_is_skipped_during_capture():
    """A host sync is not allowed while capturing: with checks on, the captured op skips the bad tokens."""
    spec = replace(HEAD_DIM_64, tokens=12)
    cpu, cuda = pair(spec)
    bad = _break(cuda)
    _skip_tokens(cpu, bad)
    cuda.call()  # warm-up (raises nothing: checks are off)
    initial = [b.clone() for b in cuda.bases]
    g = torch.cuda.CUDAGraph()
    with custom_ops.checks(), torch.cuda.graph(g):
        cuda.call()
    for b, old in zip(cuda.bases, initial, strict=True):
        b.copy_(old)
    before = [bits(b) for b in cuda.bases]
    g.replay()
    torch.cuda.synchronize()
    cpu.call()
    assert_matches_reference(cuda, cpu, before)


# ---------------------------------------------------------------------------------------------- CUDA graphs


@pytest.mark.parametrize(
    "spec",
    [
        _variant(QWEN3_8B, 8, "commit", "neox"),
        _variant(HEAD_DIM_64, 7, "1-D", "gptj"),
        replace(_variant(QWEN3_8B, 40, "1-D", "gptj"), seed=40),  # the GEMM path with its batched GEMM
        _variant(HEAD_DIM_64, 513, "commit", "neox"),  # the GEMM path with a GEMM per layer
    ],
)
def test_cuda_graph_replays_new_inputs_and_weight_updates(spec):
    """Captured once; before each replay new x, positions, slots and commit lengths are copied into the captured
    tensors and the caches are re-poisoned; on the last replay a weight was updated in place (after the capture).
    Each replay equals the CPU reference of the same inputs."""
    cpu, cuda = pair(spec, fresh_weights=True)
    cuda.call()  # warm-up outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        cuda.call()
    torch.cuda.synchronize()
    dynamic = ("x", "positions", "cache_loc", "commit_lens")
    for step in range(3):
        new = make_case(replace(spec, seed=100 + step))  # new inputs and poison, the captured weights
        for key in dynamic:
            if new.args[key] is not None:
                cpu.args[key] = new.args[key]
                cuda.args[key].copy_(new.args[key])
        for c, d, n in zip(cpu.bases, cuda.bases, new.bases, strict=True):
            c.copy_(n)
            d.copy_(n)
        if step == 2:
            with torch.no_grad():
                for weights in (cpu.args["k_weights"], cuda.args["k_weights"]):
                    weights[0].mul_(-0.5)
                for biases in (cpu.args["v_biases"], cuda.args["v_biases"]):
                    if biases[-1] is not None:
                        biases[-1].add_(1.0)
        before = [bits(b) for b in cuda.bases]
        g.replay()
        torch.cuda.synchronize()
        cpu.call()
        assert_matches_reference(cuda, cpu, before)


# ---------------------------------------------------------------------------------------------- opcheck, errors


@pytest.mark.parametrize(
    "spec",
    [
        replace(HEAD_DIM_64, tokens=9, negative=(2,)),
        replace(HEAD_DIM_64, tokens=8, window=4, commit=(3, 9), bias=(False,), norm="no-weight", neox=False),
        replace(HEAD_DIM_64, tokens=5, cache_layout="interleaved", norm="off", rot=None, layers=1),
    ],
    ids=["1-D", "commit, no biases or norm weights", "interleaved, no norm or rope"],
)
def test_opcheck(spec):
    torch.library.opcheck(op, tuple(make_case(spec, "cuda").args.values()))


def _first_name(start: str) -> str:
    """The argument a table entry's message starts with (`k_caches\\[0\\]` of `k_caches\\[0\\] must not ...`)."""
    return start.split(" ")[0]


@pytest.mark.parametrize("case", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_arguments_raise_before_any_write(case):
    """The CPU table on CUDA (bf16): the same error class, the op's prefix and the argument's name first in the
    message; no cache changed."""
    _, change, error, start = case
    base = make_case(replace(BAD, dtype=torch.bfloat16), "cuda")
    args = {**base.args, **change(base.args)}
    before = cache_bits(args)
    with pytest.raises(error) as info:
        op(*args.values())
    torch.cuda.synchronize()
    message = str(info.value).splitlines()[0]
    assert re.match(rf"multi_linear_kv_write: {_first_name(start)}", message), message
    assert all(torch.equal(a, b) for a, b in zip(cache_bits(args), before, strict=True))


@pytest.mark.parametrize("case", CUDA_ONLY_CASES, ids=[c[0] for c in CUDA_ONLY_CASES])
def test_cuda_only_rules(case):
    """What only the kernel needs: bf16/fp16 x, K % 8 == 0, head_dim % 8 == 0 and <= 256, caches with unit inner
    stride and 16-byte aligned head rows, contiguous norm weights, tables with unit inner stride. The CPU op accepts
    these inputs; the CUDA op raises, naming the argument, before anything is written."""
    _, spec, change, error, name = case
    cpu = make_case(spec)
    if change is not None:
        cpu.args.update(change(cpu.args))
    cpu.call()
    cuda = make_case(spec, "cuda")
    if change is not None:
        cuda.args.update(change(cuda.args))
    before = cache_bits(cuda.args)
    with pytest.raises(error) as info:
        cuda.call()
    torch.cuda.synchronize()
    message = str(info.value).splitlines()[0]
    assert message.startswith("multi_linear_kv_write: ") and re.search(rf"(?<![\w\[]){name}(?![\w])", message), message
    assert all(torch.equal(a, b) for a, b in zip(cache_bits(cuda.args), before, strict=True))


def test_registered_from_cpp_after_first_use():
    run_pair(replace(HEAD_DIM_64, tokens=3))
    assert _build.is_loaded()
    assert torch._C._dispatch_has_kernel_for_dispatch_key("dspark::multi_linear_kv_write", "CUDA")
