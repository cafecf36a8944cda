"""dspark::multi_linear_kv_write on CPU: the op against an fp64 formula, untouched cache bytes, errors.

The fp64 formula (`fp64_kv`, `written_tokens`) is independent of `custom_ops.linear.multi_linear_kv_write`: einsum
projections, RMSNorm and a loop over the rotated pairs in float64, and a plain Python walk over `cache_loc` /
`commit_lens`. Covered: neox and GPT-J, partial and full rotary, no RoPE, per-layer tables, biases (mixed per
layer), per-layer eps, norm with / without weight / off, index dtypes, 1-D and `[B, W]` + `commit_lens` slots,
negative slots, K/V from one fused weight or from separate ones, strided and transposed `x` and weights, strided and
aliasing-but-disjoint caches, T = 0 / 1 / odd, one and several layers, fp32 / bf16 / fp16. Caches are poisoned
(random values and NaNs): written rows must be fully rewritten, every other byte of the cache buffers must stay.
Then the argument table (CPU and fake impl, nothing modified), the index-value errors, opcheck, torch.compile
(caches mutated in place, no copy) and parity with `dspark_fx.reference_draft.DraftKVWriter`.

The cases and the formula are in tests/multi_linear_cases.py (shared with `tests/test_multi_linear_kv_write_cuda.py`).
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch
from helpers import draft_inputs, small_config
from multi_linear_cases import (
    BAD,
    BAD_CASES,
    CACHE_LAYOUTS,
    CUDA_ONLY,
    CUDA_ONLY_CASES,
    Spec,
    bits,
    cache_bits,
    counted_from_the_end,
    fp64_kv,
    make_case,
    poison,
    run_and_check,
    written_masks,
    written_tokens,
)
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_map

import custom_ops  # noqa: F401  (registers torch.ops.dspark.*)
from custom_ops.linear.multi_linear_kv_write import multi_linear_kv_write_reference
from dspark_fx.reference_draft import DraftKVWriter
from dspark_fx.testing import reinplacing_misses

op = torch.ops.dspark.multi_linear_kv_write

# ---------------------------------------------------------------------------------------------- fp64 parity


CONFIGS = {
    "default": Spec(),
    "gptj": Spec(neox=False),
    "partial neox": Spec(rot=6),
    "partial gptj": Spec(rot=6, neox=False),
    "no rope": Spec(rot=None),
    "pairs table": Spec(table_form="pairs"),
    "pairs table, partial gptj": Spec(table_form="pairs", rot=6, neox=False, pos_dtype=torch.int32),
    "frequencies": Spec(table_form="frequencies"),
    "frequencies, partial gptj": Spec(table_form="frequencies", rot=10, neox=False, pos_dtype=torch.int32),
    "norm with fp32 weight": Spec(norm="fp32-weight", neox=False),
    "norm without weight": Spec(norm="no-weight"),
    "no norm": Spec(norm="off", neox=False),
    "no norm, no rope": Spec(norm="off", rot=None),
    "all biases": Spec(bias=(True,)),
    "no biases": Spec(bias=(False,), rot=8, neox=False),
    "separate weights": Spec(proj="separate", bias=(False, True)),
    "row offsets": Spec(proj="offset", bias=(True, True, False)),
    "int32 indices": Spec(pos_dtype=torch.int32, loc_dtype=torch.int32, neox=False),
    "int32 positions": Spec(pos_dtype=torch.int32, rot=10),
    "int32 slots": Spec(loc_dtype=torch.int32),
    "negative slots": Spec(negative=(0, 3, 6), neox=False),
    "int64 huge negative slot": Spec(tokens=9, negative=(0, 1, 2, 3, 8)),
    "all slots negative": Spec(negative=tuple(range(7))),
    "commit": Spec(tokens=12, window=4, commit=(2, 0, 7)),
    "commit int32, per row": Spec(tokens=16, window=4, commit=(4, 1, 3, -1), loc_dtype=torch.int32, neox=False),
    "commit + negative slots": Spec(tokens=12, window=3, commit=(3, 2, 9, 1), negative=(0, 4, 11), rot=6),
    "commit all zero": Spec(tokens=8, window=4, commit=(0,)),
    "commit width 1": Spec(tokens=5, window=1, commit=(1, 0)),
    "T = 0": Spec(tokens=0),
    "T = 0 commit": Spec(tokens=0, window=4),
    "T = 1": Spec(tokens=1, neox=False),
    "T = 1 commit": Spec(tokens=1, window=1, commit=(1,)),
    "odd T": Spec(tokens=13, slots=20),
    "one layer": Spec(layers=1, rot=4),
    "five layers": Spec(layers=5, bias=(True, False, False), neox=False, rot=12),
    "head_dim 64": Spec(heads=1, head_dim=64, hidden=24, rot=32, layers=2),
    "head_dim 128": Spec(heads=1, head_dim=128, hidden=16, rot=64, layers=2, neox=False),
    "odd head_dim": Spec(head_dim=15, rot=None),
    "K = 1": Spec(hidden=1),
    "strided x": Spec(x_layout="strided"),
    "transposed x": Spec(x_layout="transposed", neox=False),
    "offset x": Spec(x_layout="offset", proj="separate"),
    "row-strided weights": Spec(weight_layout="row-strided"),
    "transposed weights": Spec(weight_layout="transposed", proj="separate", neox=False),
    "transposed fused weight": Spec(weight_layout="transposed", rot=6),
    **{f"{layout} caches": Spec(cache_layout=layout, tokens=9) for layout in CACHE_LAYOUTS[1:]},
    "everything strided": Spec(
        tokens=15,
        window=5,
        commit=(5, 2, 0),
        negative=(1, 6),
        neox=False,
        rot=6,
        x_layout="strided",
        weight_layout="row-strided",
        cache_layout="interleaved",
        pos_dtype=torch.int32,
        loc_dtype=torch.int32,
        bias=(False, True, True),
        norm="fp32-weight",
    ),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_fp64_formula(name, dtype):
    run_and_check(make_case(replace(CONFIGS[name], dtype=dtype)))


def test_reference_is_the_registered_cpu_kernel():
    spec = CONFIGS["everything strided"]
    a, b = make_case(spec), make_case(spec)
    a.call()
    b.call(multi_linear_kv_write_reference)
    for x, y in zip(a.bases, b.bases, strict=True):
        assert torch.equal(bits(x), bits(y))


def test_every_written_row_and_nothing_else():
    """Sanity of the test itself: the masks cover exactly the rows of the written tokens, and a case writes some."""
    case = make_case(CONFIGS["commit + negative slots"])
    written = written_tokens(case.args)
    assert 0 < len(written) < case.spec.tokens
    masks = written_masks(case, written)
    per_slot = case.spec.kv * 2 * case.spec.layers
    assert sum(int(m.sum()) for m in masks) == len(written) * per_slot


def test_duplicate_slots_leave_one_tokens_row():
    """Two written tokens addressing one slot: the slot holds one of the two tokens' rows."""
    case = make_case(Spec(tokens=6, neox=False))
    case.args["cache_loc"][4] = case.args["cache_loc"][1]
    case.call()
    slot = int(case.args["cache_loc"][1])
    for i, (k64, v64) in enumerate(fp64_kv(case.args)):
        for cache, want in ((case.args["k_caches"][i], k64), (case.args["v_caches"][i], v64)):
            got = cache[slot].double()
            assert any(torch.allclose(got, want[t], rtol=1e-5, atol=1e-5) for t in (1, 4))


def test_in_place_weight_update_is_seen():
    case = make_case(Spec(proj="separate", bias=(False,), rot=None, norm="off"), fresh_weights=True)
    case.call()
    slot = int(case.args["cache_loc"][0])
    before = case.args["v_caches"][1][slot].clone()
    with torch.no_grad():
        case.args["v_weights"][1].mul_(-2)
    case.call()
    torch.testing.assert_close(case.args["v_caches"][1][slot], -2 * before, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------- DraftKVWriter


def _draft_args(model: DraftKVWriter, positions, cache_loc, commit_lens, ctx) -> dict:
    """The op's arguments that reproduce `model` (its weights, tables and caches, read in place)."""
    cfg = model.cfg
    kw, ks, kb, vw, vs, vb = [], [], [], [], [], []
    for layer in model.layers:
        if cfg.proj == "kv_separate":
            kw.append(layer.k_proj.weight), ks.append(0), kb.append(layer.k_proj.bias)
            vw.append(layer.v_proj.weight), vs.append(0), vb.append(layer.v_proj.bias)
        else:
            w, b = layer.qkv_proj.weight, layer.qkv_proj.bias
            kw.append(w), ks.append(cfg.q_size), kb.append(b)
            vw.append(w), vs.append(cfg.q_size + cfg.kv_size), vb.append(b)
    caches = model.caches()
    return dict(
        x=ctx,
        k_weights=kw,
        k_row_starts=ks,
        k_biases=kb,
        v_weights=vw,
        v_row_starts=vs,
        v_biases=vb,
        k_norm_weights=[layer.k_norm_weight for layer in model.layers],
        k_norm_eps=[layer.eps for layer in model.layers],
        cos_sin_caches=[getattr(model, f"cos_sin_{j}") for j in model.table_of_layer],
        positions=positions,
        is_neox=cfg.rope_style == "neox",
        k_caches=[k for k, _ in caches],
        v_caches=[v for _, v in caches],
        cache_loc=cache_loc,
        commit_lens=commit_lens,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
    )


@pytest.mark.parametrize(
    "options",
    [
        dict(write="cache_loc"),
        dict(write="cache_loc", rope_style="gptj", rotary_dim=8, proj="kv_separate", qkv_bias=True),
        dict(write="commit", qkv_bias=(True, False, True), eps=(1e-6, 1e-2, 0.5), rope_theta=(1e4, 1e6, 1e4)),
        dict(write="commit", rope_style="gptj", rotary_dim=6, norm="rms_norm", proj="qkv_split", qkv_bias=True),
    ],
    ids=["cache_loc", "cache_loc gptj partial separate", "commit per-layer", "commit gptj partial qkv_split"],
)
def test_reference_matches_the_draft_model(options):
    """The op (fp32) writes what `DraftKVWriter` (fp32) writes, for both of its cache-writing modes."""
    cfg = small_config(**options)
    model = DraftKVWriter(cfg)
    gen = torch.Generator().manual_seed(5)
    for k_cache, v_cache in model.caches():
        k_cache.copy_(poison(k_cache.shape, k_cache.dtype, gen))
        v_cache.copy_(poison(v_cache.shape, v_cache.dtype, gen))
    inputs = draft_inputs(cfg, 11, seed=3)
    ctx, positions, cache_loc = inputs[:3]
    commit_lens = inputs[3] if cfg.write == "commit" else None
    expected = [t.clone() for kv in model.caches() for t in kv]
    with torch.no_grad():
        model(*inputs)
    want = [t.clone() for kv in model.caches() for t in kv]
    for cache, old in zip([t for kv in model.caches() for t in kv], expected, strict=True):
        cache.copy_(old)
    with torch.no_grad():
        op(*_draft_args(model, positions, cache_loc, commit_lens, ctx).values())
    got = [t for kv in model.caches() for t in kv]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, equal_nan=True)
        assert torch.equal(g.isnan(), w.isnan())


# ---------------------------------------------------------------------------------------------- argument errors


def _fake_args(args: dict, mode: FakeTensorMode) -> dict:
    def conv(v):
        if isinstance(v, torch.Tensor):
            return mode.from_tensor(v)
        if isinstance(v, list):
            return [conv(t) for t in v]
        return v

    return {k: conv(v) for k, v in args.items()}


def expect_error(args: dict, error: type, start: str) -> str:
    """Call the op, expect `error` whose message is the op's prefix then `start` (a regex); no cache changed."""
    before = cache_bits(args)
    with pytest.raises(error) as info:
        op(*args.values())
    message = str(info.value).splitlines()[0]
    assert re.match(rf"multi_linear_kv_write: {start}", message), message
    after = cache_bits(args)
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True)), "a cache changed before the error"
    return message


@pytest.mark.parametrize("case", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_arguments_raise_before_any_write(case):
    """Each structural error: its class, a message naming the argument first, no cache changed; the fake impl
    (torch.compile) raises the same message."""
    _, change, error, start = case
    base = make_case(BAD)
    args = {**base.args, **change(base.args)}
    message = expect_error(args, error, start)
    with FakeTensorMode() as mode, pytest.raises(error) as fake:
        op(*_fake_args(args, mode).values())
    assert str(fake.value).splitlines()[0] == message


def test_disjoint_views_of_one_buffer_are_accepted():
    """Caches may be views of one buffer when no element is shared, also under the fake impl; any shared element
    is an error (the table above)."""
    for layout in ("interleaved", "stacked", "heads-major"):
        case = make_case(replace(BAD, cache_layout=layout))
        run_and_check(case)
        with FakeTensorMode() as mode:
            op(*_fake_args(case.args, mode).values())
    case = make_case(BAD)
    halves = torch.zeros(BAD.slots, BAD.heads, 2, BAD.head_dim)  # K and V heads side by side inside a slot
    case.args["k_caches"][0], case.args["v_caches"][0] = halves[:, :, 0], halves[:, :, 1]
    case.call()
    assert halves.abs().sum() > 0


def test_compiles_with_a_data_dependent_token_count():
    """The token count read from a tensor inside a compiled graph (an unbacked SymInt): the fake impl's overlap checks
    do not guard on it, and the caches are written as eagerly."""
    case, twin = make_case(BAD), make_case(BAD)

    def write(args: dict, count: torch.Tensor) -> None:
        n = count.item()
        torch._check(n >= 0)
        torch._check(n <= BAD.tokens)
        op(
            *{
                **args,
                "x": args["x"][:n],
                "positions": args["positions"][:n],
                "cache_loc": args["cache_loc"][:n],
            }.values()
        )

    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        torch.compile(write, backend="aot_eager", fullgraph=True)(case.args, torch.tensor(BAD.tokens - 1))
    write(twin.args, torch.tensor(BAD.tokens - 1))
    written, expected = (a.args["k_caches"] + a.args["v_caches"] for a in (case, twin))
    for got, want in zip(written, expected, strict=True):
        assert torch.equal(bits(got), bits(want))


def test_caches_that_require_grad_or_are_inference_tensors_are_written():
    """A cache that requires grad (under no_grad: with grad mode on the op refuses it, test_not_differentiable.py)
    and an inference tensor among normal caches are written like the others (the CUDA kernel writes any cache), not
    after the layers before them were written."""
    case, twin = make_case(BAD), make_case(BAD)
    caches = case.args["k_caches"]
    caches[1] = caches[1].clone().requires_grad_()
    with torch.inference_mode():
        case.args["v_caches"][1] = case.args["v_caches"][1].clone()
    with torch.no_grad():
        case.call()
    twin.call()
    written, expected = (a.args["k_caches"] + a.args["v_caches"] for a in (case, twin))
    for got, want in zip(written, expected, strict=True):
        assert torch.equal(bits(got.detach()), bits(want))


def test_inputs_of_other_element_sizes_beside_a_cache_are_accepted():
    """An int64 cache_loc right after a cache in one byte buffer: their storage offsets count elements of different
    sizes, and the element ranges meet where the bytes do not; the call succeeds, also under the fake impl."""
    case = make_case(BAD)
    cache, loc = case.args["k_caches"][0], case.args["cache_loc"]
    size = cache.numel() * cache.element_size()
    buf = torch.zeros(size + 8 * loc.numel(), dtype=torch.uint8)
    shared_cache = buf[:size].view(cache.dtype).view(cache.shape)
    shared_loc = buf[size:].view(torch.int64).view(loc.shape)
    shared_cache.copy_(cache)
    shared_loc.copy_(loc)
    assert shared_loc.storage_offset() < shared_cache.storage_offset() + shared_cache.numel()
    case.args["k_caches"][0], case.args["cache_loc"] = shared_cache, shared_loc
    with FakeTensorMode() as mode:
        op(*_fake_args(case.args, mode).values())
    case.call()
    twin = make_case(BAD)
    twin.call()
    assert torch.equal(shared_loc, twin.args["cache_loc"])
    written, expected = (a.args["k_caches"] + a.args["v_caches"] for a in (case, twin))
    for got, want in zip(written, expected, strict=True):
        assert torch.equal(bits(got), bits(want))


# ---------------------------------------------------------------------------------------------- index values


def _slot_message(index: str, value: int, slots: int) -> str:
    return (
        f"cache_loc[{index}] = {value} is out of range: cache slots are [0, {slots}) (negative entries skip the token)"
    )


def _position_message(index: int, value: int, rows: int) -> str:
    return (
        f"positions[{index}] = {value} is out of range: positions must be in [0, {rows}), a row of every "
        "cos_sin_caches table"
    )


def _set(key: str, entries: dict, dtype=None):
    def change(args):
        t = args[key].clone()
        for index, value in entries.items():
            t[index] = value
        return {key: t if dtype is None else t.to(dtype)}

    return change


S = BAD.slots
ROWS = BAD.table_rows  # layer 1's table has 5 more rows: positions must fit layer 0's
VALUE_CASES = [
    ("slot = S", BAD, _set("cache_loc", {3: S}), _slot_message("3", S, S)),
    ("slot after a negative", BAD, _set("cache_loc", {0: -1, 4: S + 7}), _slot_message("4", S + 7, S)),
    ("int32 slot", BAD, _set("cache_loc", {2: 2**31 - 1}, torch.int32), _slot_message("2", 2**31 - 1, S)),
    ("huge int64 slot", BAD, _set("cache_loc", {5: 2**62}), _slot_message("5", 2**62, S)),
    (
        "masked [B, W] slot",
        replace(BAD, window=3, commit=(1, 0)),
        _set("cache_loc", {(1, 2): S}),
        _slot_message("1, 2", S, S),
    ),
    (
        "slot of a negative-slot token's neighbour",
        replace(BAD, negative=(1,)),
        _set("cache_loc", {0: S}),
        _slot_message("0", S, S),
    ),
    ("position -1", BAD, _set("positions", {1: -1}), _position_message(1, -1, ROWS)),
    (
        "position = rows of the shorter table",
        BAD,
        _set("positions", {0: ROWS - 1, 3: ROWS}),
        _position_message(3, ROWS, ROWS),
    ),
    ("int32 position", BAD, _set("positions", {4: 2**31 - 1}, torch.int32), _position_message(4, 2**31 - 1, ROWS)),
    (
        "position of a skipped token",
        replace(BAD, negative=(2,)),
        _set("positions", {2: ROWS + 100}),
        _position_message(2, ROWS + 100, ROWS),
    ),
    (
        "slot before position",
        BAD,
        lambda a: {**_set("positions", {0: -5})(a), **_set("cache_loc", {5: S})(a)},
        _slot_message("5", S, S),
    ),
]


@pytest.mark.parametrize("case", VALUE_CASES, ids=[c[0] for c in VALUE_CASES])
def test_out_of_range_index_raises_before_any_write(case):
    _, spec, change, message = case
    base = make_case(spec)
    base.args.update(change(base.args))
    before = [bits(b) for b in base.bases]
    with pytest.raises(ValueError, match=re.escape(message)):
        base.call()
    assert all(torch.equal(bits(b), old) for b, old in zip(base.bases, before, strict=True))


@pytest.mark.parametrize(
    "spec",
    [
        Spec(),
        Spec(loc_dtype=torch.int32, pos_dtype=torch.int32, neox=False),
        Spec(rot=None),
        Spec(tokens=12, window=4, commit=(2, 0, 7)),
    ],
    ids=["default", "int32", "no rope", "commit"],
)
def test_wrap_negative_indexes_like_python(spec):
    """Slots in [-S, 0) and positions in [-P, 0) count from the end: the same cache bytes as their non-negative
    equivalents (and the fake impl accepts the flag)."""
    case = make_case(spec)
    wrapped = counted_from_the_end(case)
    assert (wrapped.args["cache_loc"] < -1).any()
    case.call()
    wrapped.call()
    for plain, other in zip(case.bases, wrapped.bases, strict=True):
        assert torch.equal(bits(plain), bits(other))
    with FakeTensorMode() as mode:
        op(**_fake_args(wrapped.args, mode))


@pytest.mark.parametrize("what", ["slot", "position"])
def test_wrap_negative_still_raises_below_minus_the_size(what):
    case = make_case(Spec(negative=()))
    args = counted_from_the_end(case).args
    before = cache_bits(args)
    if what == "slot":
        slots = args["k_caches"][0].shape[0]
        args["cache_loc"][2] = -slots - 1
        message = f"cache_loc[2] = {-slots - 1} is out of range: cache slots are [-{slots}, {slots})"
    else:
        rows = min(t.shape[0] for t in args["cos_sin_caches"])
        args["positions"][0] = -rows - 1
        message = f"positions[0] = {-rows - 1} is out of range: positions must be in [-{rows}, {rows})"
    with pytest.raises(ValueError, match=re.escape(message)):
        op(**args)
    assert all(torch.equal(a, b) for a, b in zip(cache_bits(args), before, strict=True))


def test_zero_slot_caches():
    case = make_case(replace(BAD, slots=0, tokens=0))
    case.call()
    case = make_case(BAD)
    for key in ("k_caches", "v_caches"):
        case.args[key] = [c[:0] for c in case.args[key]]
    with pytest.raises(ValueError, match=re.escape(_slot_message("0", int(case.args["cache_loc"][0]), 0))):
        case.call()
    case.args["cache_loc"] = -1 - case.args["cache_loc"]
    case.call()  # every token skipped


def test_positions_unchecked_without_rope():
    """Without RoPE the positions index nothing: any value is fine."""
    case = make_case(replace(BAD, rot=None))
    case.args["positions"][:] = torch.tensor([-1, 2**40, 0, -(2**62), 7, 5])
    run_and_check(case)


def test_frequency_positions_are_angles():
    """With an `[R/2]` inverse-frequency table a position is an angle, not a row: negative and huge ones are
    rotated by their own angle, never wrapped or refused, `wrap_negative` or not."""
    for wrap in (False, True):
        case = make_case(replace(BAD, table_form="frequencies"))
        case.args["positions"][:] = torch.tensor([-1, 70_000, 0, -300, 7, 5])
        case.args["wrap_negative"] = wrap
        run_and_check(case)


def test_fake_impl_reads_no_index_values():
    case = make_case(BAD)
    case.args["cache_loc"][0] = 2**62
    case.args["positions"][1] = -1
    with FakeTensorMode() as mode:
        op(*_fake_args(case.args, mode).values())


def _on_fake_cuda(args: dict) -> dict:
    """`args` as fake CUDA tensors (under an active FakeTensorMode; no GPU needed): same shapes, strides, storage
    offsets and storage sharing (the caches of one buffer stay views of one fake buffer)."""
    buffers = {}

    def convert(t):
        if not isinstance(t, torch.Tensor):
            return t
        key = (StorageWeakRef(t.untyped_storage()), t.dtype)
        if key not in buffers:
            buffers[key] = torch.empty(t.untyped_storage().nbytes() // t.element_size(), dtype=t.dtype, device="cuda")
        return buffers[key].as_strided(t.shape, t.stride(), t.storage_offset())

    return tree_map(convert, args)


@pytest.mark.parametrize("case", CUDA_ONLY_CASES, ids=[c[0] for c in CUDA_ONLY_CASES])
def test_fake_impl_on_cuda_raises_the_bindings_layout_errors(case):
    """On CUDA tensors the fake impl runs the CUDA binding's layout rules too (`_check_cuda_layout`), so a compiled
    graph (and `dspark_fx`, which emits the op through its fake impl) refuses at compile time what the binding would
    refuse at run time."""
    _, spec, change, error, name = case
    cpu = make_case(spec)
    if change is not None:
        cpu.args.update(change(cpu.args))
    with FakeTensorMode():
        args = _on_fake_cuda(cpu.args)
        with pytest.raises(error) as info:
            op(*args.values())
    message = str(info.value).splitlines()[0]
    assert message.startswith("multi_linear_kv_write: ") and re.search(rf"(?<![\w\[]){name}(?![\w])", message), message
    assert "on CUDA" in message


def test_fake_impl_on_cuda_accepts_what_the_binding_runs():
    with FakeTensorMode():
        op(*_on_fake_cuda(make_case(CUDA_ONLY).args).values())


# ---------------------------------------------------------------------------------------------- opcheck, compile


OPCHECK = {
    "1-D slots, biases, norm weights": Spec(tokens=5, layers=2),
    "[B, W] slots, no biases or norm weights": Spec(
        tokens=6, layers=2, window=3, commit=(2, 3), bias=(False,), norm="no-weight", neox=False, rot=6
    ),
    "no norm, no rope, negative slots": Spec(tokens=4, layers=1, norm="off", rot=None, negative=(1,)),
    "stacked caches, T = 0": Spec(tokens=0, layers=2, cache_layout="stacked"),
}


@pytest.mark.parametrize("name", list(OPCHECK))
def test_opcheck(name):
    case = make_case(OPCHECK[name])
    torch.library.opcheck(op, tuple(case.args.values()))


def test_symbolic_tokens_under_compile():
    """The fake impl with a symbolic T (aot_eager, dynamic shapes): one graph serves several token counts and writes
    what the eager op writes."""
    spec = Spec(tokens=12, layers=2, window=4, commit=(2, 5, 0), negative=(1,))  # sizes unlike any other dim
    first = make_case(spec)
    static = {k: v for k, v in first.args.items() if k not in ("x", "positions", "cache_loc", "commit_lens")}

    def write(x, positions, cache_loc, commit_lens, *bases):
        k_caches, v_caches = first.views(list(bases))
        args = dict(first.args, x=x, positions=positions, cache_loc=cache_loc, commit_lens=commit_lens)
        op(*dict(args, k_caches=k_caches, v_caches=v_caches).values())

    torch._dynamo.reset()
    compiled = torch.compile(write, backend="aot_eager", dynamic=True, fullgraph=True)
    for i, tokens in enumerate((12, 20, 28)):
        got, want = (make_case(replace(spec, tokens=tokens, seed=tokens)) for _ in range(2))
        for case in (got, want):
            case.args.update({k: v for k, v in static.items() if k not in ("k_caches", "v_caches")})
        with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
            compiled(got.args["x"], got.args["positions"], got.args["cache_loc"], got.args["commit_lens"], *got.bases)
        want.call()
        for a, b in zip(got.bases, want.bases, strict=True):
            assert torch.equal(bits(a), bits(b))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["separate", "stacked"])
def test_compile_fullgraph_writes_caches_in_place(layout):
    """Inductor calls the op on the caches themselves: no clone or copy of a cache in the generated code, nothing
    reported as a missed re-inplacing, and the caches hold what the eager op writes. `stacked`: the caches are views
    of one buffer taken inside the compiled function."""
    spec = Spec(tokens=8, layers=2, window=4, commit=(3, 4), negative=(2,), cache_layout=layout)
    eager, compiled_case = make_case(spec), make_case(spec)
    eager.call()
    args = compiled_case.args

    def step(x, positions, cache_loc, commit_lens, *bases):
        k_caches, v_caches = compiled_case.views(list(bases))
        a = dict(args, x=x, positions=positions, cache_loc=cache_loc, commit_lens=commit_lens)
        op(*dict(a, k_caches=k_caches, v_caches=v_caches).values())

    torch._dynamo.reset()
    counters.clear()
    # no cache (reinplacing_misses turns them off): an entry compiled for caches that alias each other would clone them
    with reinplacing_misses() as misses:
        _, code = run_and_get_code(
            torch.compile(step, fullgraph=True),
            args["x"],
            args["positions"],
            args["cache_loc"],
            args["commit_lens"],
            *compiled_case.bases,
        )
    src = "\n".join(code)
    assert "torch.ops.dspark.multi_linear_kv_write.default(" in src
    assert "clone" not in src and "copy_" not in src
    assert misses["tensors"] == 0
    for a, b in zip(compiled_case.bases, eager.bases, strict=True):
        assert torch.equal(bits(a), bits(b))


def test_cuda_calls_reach_the_library_entry():
    """CUDA calls go through the build-on-first-use entry (custom_ops._library) to the C++ binding."""
    assert torch._C._dispatch_has_kernel_for_dispatch_key("dspark::multi_linear_kv_write", "CompositeExplicitAutograd")
    assert torch._C._dispatch_has_kernel_for_dispatch_key("dspark::multi_linear_kv_write", "CPU")
