"""The input contract (docs/contract.md) of the five FlashMLA-write / norm-RoPE ops.

CPU: structural errors from the CPU impl and the fake impl alike; out-of-range slots and positions raise a
`ValueError` naming the argument and the entry before anything is written; negative slots skip the row. The
`*_reference` functions follow the CUDA kernels' skip rule and are the oracle of the CUDA tests here: a row whose
index is out of range writes nothing (eagerly and in a CUDA-graph replay), huge slot ids never wrap into another
page, and checking mode (`custom_ops.checks()`) raises the CPU path's message word for word.
"""

import re

import pytest
import torch
from flashmla_cases import (
    ALL_OPS,
    EPS,
    HEADS,
    HUGE,
    K_OPS,
    MAX_POS,
    MUTATED,
    PAGE_SIZE,
    QUANTIZING_OPS,
    REFERENCES,
    ROPE_OPS,
    _assert_cache_acceptance,
    _assert_matches_reference,
    _bits,
    _break_rows,
    _effective_slots,
    _gen,
    _inputs,
    _reference_result,
    _unused_slot,
    _written_mask,
    assert_same_non_finite_coding,
    plant_non_finite,
    structural_cases,
)
from helpers import LayoutKeepingMove
from torch._subclasses.fake_tensor import FakeTensorMode

import custom_ops
from custom_ops.flashmla import writes as fw
from custom_ops.layouts.fp8 import dequantize_flashmla_cache, flashmla_page_bytes

ops = torch.ops.dspark


def _call(name, args):
    return getattr(ops, name)(*args.values())


def _snapshot(name, args):
    return _bits(args[MUTATED[name]]) if name in MUTATED else None


def _assert_unchanged(name, args, snapshot):
    if name in MUTATED:
        assert torch.equal(_bits(args[MUTATED[name]]), snapshot)


def _slot_message(i, value, num_pages, page_size):
    cap = num_pages * page_size
    return (
        f"out_loc[{i}] = {value} is out of range: slot ids must be < num_pages * page_size = "
        f"{num_pages} * {page_size} = {cap}; a negative id skips the row"
    )


def _position_message(i, value, max_pos=MAX_POS):
    return f"positions[{i}] = {value} is out of range: positions must be in [0, {max_pos}), the rows of freqs"


# ---------------------------------------------------------------------------------------------- CPU: slots


@pytest.mark.parametrize("name", K_OPS)
def test_huge_slot_raises_before_any_write(name):
    args = _inputs(name)
    target = _unused_slot(args)
    args["out_loc"][5] = HUGE + target
    before = _snapshot(name, args)
    with pytest.raises(ValueError, match=re.escape(_slot_message(5, HUGE + target, args["kvcache"].shape[0], 2))):
        _call(name, args)
    _assert_unchanged(name, args, before)


@pytest.mark.parametrize("name", K_OPS)
@pytest.mark.parametrize("loc_dtype", [torch.int32, torch.int64])
def test_slot_beyond_capacity_raises_before_any_write(name, loc_dtype):
    args = _inputs(name)
    capacity = args["kvcache"].shape[0] * PAGE_SIZE
    args["out_loc"][6] = capacity
    args["out_loc"][7] = capacity + 100
    args["out_loc"] = args["out_loc"].to(loc_dtype)
    before = _snapshot(name, args)
    with pytest.raises(ValueError, match=re.escape(_slot_message(6, capacity, args["kvcache"].shape[0], 2))):
        _call(name, args)
    _assert_unchanged(name, args, before)


@pytest.mark.parametrize("name", K_OPS)
def test_zero_page_cache(name):
    args = _inputs(name)
    args["kvcache"] = args["kvcache"][:0]
    first = int((args["out_loc"] >= 0).nonzero()[0])
    message = _slot_message(first, int(args["out_loc"][first]), 0, PAGE_SIZE)
    with pytest.raises(ValueError, match=re.escape(message)):
        _call(name, args)
    args["out_loc"] = -1 - args["out_loc"].abs()
    _call(name, args)  # every row skipped: a no-op


@pytest.mark.parametrize("name", K_OPS)
def test_negative_slots_are_skipped_not_errors(name):
    args = _inputs(name)
    args["out_loc"][:] = torch.tensor([-1, -2, -(2**40), -(2**63)] * 2)
    before = _snapshot(name, args)
    _call(name, args)
    _assert_unchanged(name, args, before)


# ---------------------------------------------------------------------------------------------- CPU: positions


@pytest.mark.parametrize("name", ROPE_OPS)
@pytest.mark.parametrize("value", [-1, -MAX_POS, MAX_POS, 2**31 - 1])
@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64])
def test_out_of_range_position_raises_before_any_write(name, value, pos_dtype):
    args = _inputs(name)
    args["positions"][4] = value
    args["positions"][6] = -5
    args["positions"] = args["positions"].to(pos_dtype)
    before = _snapshot(name, args)
    with pytest.raises(ValueError, match=re.escape(_position_message(4, value))):
        _call(name, args)
    _assert_unchanged(name, args, before)


@pytest.mark.parametrize("name", ROPE_OPS)
def test_empty_rope_table(name):
    args = _inputs(name)
    args["freqs"] = args["freqs"][:0]
    with pytest.raises(ValueError, match=re.escape(_position_message(0, int(args["positions"][0]), 0))):
        _call(name, args)
    empty = _inputs(name, b=0)
    empty["freqs"] = empty["freqs"][:0]
    _call(name, empty)


# ---------------------------------------------------------------------------------------------- CPU: references


def _subset(name, args, rows):
    """The arguments restricted to `rows` (the mutated tensor is shared, not copied)."""
    out = dict(args)
    for key in ("kv", "q", "positions", "out_loc"):
        if key in out and not (name == "fused_norm_rope_inplace" and key == "kv"):
            out[key] = out[key][rows]
    if name == "fused_q_indexer_rope_hadamard_quant":
        out["weight"] = out["weight"][rows]
    if name == "fused_q_norm_rope":
        out["q_out"] = out["q_out"][rows]
    return out


@pytest.mark.parametrize("name", ALL_OPS)
def test_references_skip_out_of_range_rows(name):
    """The references (the CUDA oracle) write exactly what the valid rows alone write; skipped rows leave nothing
    (kvcache, q_out, kv) or zero codes and weights (indexer)."""
    args = _inputs(name)
    valid = _break_rows(name, args)
    rows = valid.nonzero().squeeze(1)
    want = _inputs(name)
    _break_rows(name, want)
    if name == "fused_norm_rope_inplace":
        kept = want["kv"][rows].clone()
        fw.fused_norm_rope_inplace_reference(kept, want["weight"], EPS, want["freqs"], want["positions"][rows])
        want["kv"][rows] = kept
    elif name == "fused_q_norm_rope":
        sub = torch.full_like(want["q_out"][rows], float("nan"))
        fw.fused_q_norm_rope_reference(want["q"][rows], sub, EPS, want["freqs"], want["positions"][rows])
        want["q_out"][rows] = sub
    elif name in K_OPS:
        REFERENCES[name](*_subset(name, want, rows).values())
    got = REFERENCES[name](*args.values())
    if name in MUTATED:
        assert torch.equal(_bits(args[MUTATED[name]]), _bits(want[MUTATED[name]]))
        return
    sub_q, sub_w = REFERENCES[name](*_subset(name, want, rows).values())
    assert torch.equal(_bits(got[0][rows]), _bits(sub_q)) and torch.equal(got[1][rows], sub_w)
    assert not _bits(got[0][~valid]).any() and not got[1][~valid].any()


@pytest.mark.parametrize("slot", [-1, -(2**40), 2 * 4, 2**62])
def test_dequantize_rejects_out_of_range_slots(slot):
    """A negative slot used to decode bytes from the end of the cache (negative indexing), a large one raised an
    IndexError about a byte offset."""
    cache = torch.randint(0, 256, (4, flashmla_page_bytes(2)), dtype=torch.uint8, generator=_gen(9))
    message = f"slots[1] = {slot} is out of range: slots must be in [0, 8) of this cache"
    with pytest.raises(ValueError, match=re.escape(message)):
        dequantize_flashmla_cache(cache, 2, torch.tensor([0, slot]))


@pytest.mark.parametrize(
    ("slots", "error", "says"),
    [
        (torch.tensor([1.9]), TypeError, "slots must be an int32 or int64 tensor, got torch.float32"),
        (torch.tensor([True]), TypeError, "slots must be an int32 or int64 tensor, got torch.bool"),
        ([1], TypeError, "slots must be an int32 or int64 tensor, got list"),
        (torch.tensor([[0, 1]]), ValueError, "slots must have shape (N,), got (1, 2)"),
    ],
    ids=["float", "bool", "list", "2-D"],
)
def test_dequantize_names_slots_of_another_type_or_shape(slots, error, says):
    """A float or bool slot tensor decoded slot 1 (`.long()`), a 2-D one failed inside a reshape."""
    cache = torch.randint(0, 256, (4, flashmla_page_bytes(2)), dtype=torch.uint8, generator=_gen(9))
    with pytest.raises(error, match=re.escape(says)):
        dequantize_flashmla_cache(cache, 2, slots)


# ---------------------------------------------------------------------------------------------- CPU: structure


@pytest.mark.parametrize("case", structural_cases(), ids=lambda c: c[0])
def test_structural_errors_cpu_and_fake(case):
    _, name, change, exc, match = case
    args = _inputs(name)
    args.update(change(args))
    before = _snapshot(name, args)
    with pytest.raises(exc, match=match):
        _call(name, args)
    _assert_unchanged(name, args, before)
    with FakeTensorMode() as mode:
        fake = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
        with pytest.raises(exc, match=match):
            _call(name, fake)


def test_valid_layouts_still_accepted():
    """The overlap and alignment rules reject only overlapping rows and misaligned data, not strided layouts."""
    args = _inputs("fused_q_norm_rope")
    wide = torch.full((8, HEADS, 1024), float("nan"), dtype=torch.bfloat16)
    args["q_out"] = wide[:, :, 512:]  # disjoint rows with a gap: strides (3072, 1024, 1)
    _call("fused_q_norm_rope", args)
    interleaved = torch.empty(HEADS, 8, 512, dtype=torch.bfloat16).transpose(0, 1)  # strides (512, 4096, 1)
    args["q_out"] = interleaved
    _call("fused_q_norm_rope", args)
    args = _inputs("fused_q_norm_rope")  # in place: q_out is q (each row is read whole before it is written)
    expected = args["q_out"]
    _call("fused_q_norm_rope", args)
    args["q_out"] = args["q"]
    _call("fused_q_norm_rope", args)
    assert torch.equal(args["q"], expected)
    args = _inputs("fused_q_norm_rope", b=1)  # in place, the size-1 dim's stride another: the same elements
    args["q_out"] = args["q"].as_strided(args["q"].shape, (12345, *args["q"].stride()[1:]))
    _call("fused_q_norm_rope", args)
    args = _inputs("fused_k_norm_rope_flashmla")
    args["kvcache"] = args["kvcache"][1:]  # a view of a larger cache, starting at a page boundary
    args["out_loc"] = torch.randperm(args["kvcache"].shape[0] * PAGE_SIZE)[:8]
    _call("fused_k_norm_rope_flashmla", args)


@pytest.mark.parametrize(
    ("name", "arg", "message"),
    [
        ("fused_k_norm_rope_flashmla", "kvcache", "kvcache must be on cpu like kv, got meta"),
        ("fused_k_norm_rope_flashmla", "kv", "weight must be on meta like kv, got cpu"),
        ("fused_k_norm_rope_flashmla", "out_loc", "out_loc must be on cpu like kv, got meta"),
        ("fused_q_norm_rope", "q", "q_out must be on meta like q, got cpu"),
        ("fused_q_norm_rope", "positions", "positions must be on cpu like q, got meta"),
        ("fused_norm_rope_inplace", "freqs", "freqs must be on cpu like kv, got meta"),
        ("store_flashmla_cache", "kv", "out_loc must be on meta like kv, got cpu"),
        ("fused_q_indexer_rope_hadamard_quant", "weight", "weight must be on cpu like q, got meta"),
    ],
)
def test_device_mismatch_names_the_argument_and_the_anchor(name, arg, message):
    """The first tensor argument fixes the device; the message names the mismatching argument and that anchor."""
    args = _inputs(name)
    args[arg] = args[arg].to("meta")
    with pytest.raises(ValueError, match=re.escape(message)):
        _call(name, args)


def test_fake_impl_does_not_read_index_values():
    """Under torch.compile the fake impl sees no data: out-of-range values are not an error there."""
    args = _inputs("fused_k_norm_rope_flashmla")
    args["positions"][0] = -1
    args["out_loc"][1] = HUGE
    with FakeTensorMode() as mode:
        _call(
            "fused_k_norm_rope_flashmla",
            {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in args.items()},
        )


# ---------------------------------------------------------------------------------------------- CUDA


def _run_cuda(name, args, graph, checks_in_capture=False):
    """Run the op on CUDA copies of `args`, eagerly or as the replay of a captured CUDA graph (the mutated tensor
    reset to its initial contents before the replay; checking mode on during the capture if `checks_in_capture`).
    Returns the result on CPU."""
    move = LayoutKeepingMove("cuda")
    dev = {k: move(v) for k, v in args.items()}
    for k, v in args.items():
        if isinstance(v, torch.Tensor):
            assert dev[k].stride() == v.stride() and dev[k].storage_offset() == v.storage_offset(), k
    mutated = dev.get(MUTATED.get(name))
    initial = mutated.clone() if mutated is not None else None
    if not graph:
        out = _call(name, dev)
    else:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            _call(name, dev)  # warm-up: builds / loads the library outside the capture
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with custom_ops.checks(checks_in_capture), torch.cuda.graph(g):
            out = _call(name, dev)
        if mutated is not None:
            mutated.copy_(initial)
        g.replay()
    torch.cuda.synchronize()
    if mutated is not None:
        return mutated.cpu()
    return tuple(t.cpu() for t in out)


@pytest.mark.cuda
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("name", ALL_OPS)
def test_cuda_out_of_range_rows_skipped(name, graph):
    """Negative / too large positions, slots at or beyond the capacity and a huge slot that would wrap onto an
    unused slot: every such row is skipped, every other byte of the output is as the reference leaves it."""
    args = _inputs(name, b=64, seed=3)
    valid = _break_rows(name, args)
    before = args[MUTATED[name]].clone() if name in MUTATED else None
    want = _reference_result(name, args)
    got = _run_cuda(name, args, graph)
    _assert_matches_reference(name, got, want, before, valid, args)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", QUANTIZING_OPS)
def test_cuda_quantizers_code_non_finite_values_as_the_reference(name, dtype):
    """NaN and infinities in a row (tests/flashmla_cases.py, plant_non_finite): the kernel writes the reference's
    exponent bytes and codes the same values (an infinity does not make its tile's scale infinite or negative, a
    NaN is skipped by the amax on both sides)."""
    args = _inputs(name, b=8, seed=16)
    for key in ("kv", "q", "weight"):
        if key in args:
            args[key] = args[key].to(dtype)
    rows = plant_non_finite(args)
    want = _reference_result(name, args)
    got = _run_cuda(name, args, graph=False)
    assert_same_non_finite_coding(name, got, want, args, rows)


@pytest.mark.cuda
@pytest.mark.parametrize("name", K_OPS)
@pytest.mark.parametrize("huge", [HUGE, 2**63 - 1, 2**62 + 2**40])
def test_cuda_overflow_slot_skipped(name, huge):
    args = _inputs(name, b=16, seed=4)
    target = _unused_slot(args)
    args["out_loc"][3] = huge + target
    valid = torch.ones(16, dtype=torch.bool)
    valid[3] = False
    before = args["kvcache"].clone()
    got = _run_cuda(name, args, graph=False)
    _assert_cache_acceptance(got, _reference_result(name, args), before, PAGE_SIZE, _effective_slots(args, valid))
    mask = _written_mask(got, PAGE_SIZE, torch.tensor([target]))
    assert torch.equal(got[mask], before[mask])


@pytest.mark.cuda
@pytest.mark.parametrize("name", K_OPS)
def test_cuda_zero_page_cache_is_a_no_op(name):
    args = _inputs(name, b=8)
    args["kvcache"] = args["kvcache"][:0]
    assert _run_cuda(name, args, graph=False).numel() == 0


def _set_entries(key, entries, dtype=None):
    """change(args): a copy of index tensor `key` with {row: value} `entries` (a callable value gets the args)."""

    def change(args):
        t = args[key].clone()
        for row, value in entries.items():
            t[row] = value(args) if callable(value) else value
        return {key: t if dtype is None else t.to(dtype)}

    return change


def _capacity(args):
    return args["kvcache"].shape[0] * args["page_size"]


def _value_error_cases():
    """(id, op, change(args)): inputs with an out-of-range index; CPU raises, CUDA checking mode must match."""
    cases = []
    for name in K_OPS:
        cases += [
            (f"{name} slot = capacity", name, _set_entries("out_loc", {2: _capacity, 4: -1})),
            (f"{name} huge slot", name, _set_entries("out_loc", {0: -1, 1: HUGE + 1})),
            (f"{name} int32 slot", name, _set_entries("out_loc", {6: 2**31 - 1}, torch.int32)),
            (f"{name} zero pages", name, lambda a: {"kvcache": a["kvcache"][:0]}),
        ]
    for name in ROPE_OPS:
        cases += [
            (f"{name} negative position", name, _set_entries("positions", {1: -1})),
            (f"{name} position = max_pos", name, _set_entries("positions", {0: MAX_POS - 1, 2: MAX_POS, 3: -1})),
            (f"{name} int32 position", name, _set_entries("positions", {5: -7}, torch.int32)),
        ]
    return cases


@pytest.mark.cuda
@pytest.mark.parametrize("case", _value_error_cases(), ids=lambda c: c[0])
def test_cuda_checking_mode_raises_the_cpu_message(case):
    _, name, change = case
    args = _inputs(name, b=8, seed=5)
    args.update(change(args))
    with pytest.raises(ValueError) as cpu:
        _call(name, args)
    move = LayoutKeepingMove("cuda")
    dev = {k: move(v) for k, v in args.items()}
    before = _snapshot(name, dev)
    with custom_ops.checks(), pytest.raises(ValueError) as gpu:
        _call(name, dev)
    assert str(gpu.value) == str(cpu.value)
    _assert_unchanged(name, dev, before)
    assert not custom_ops.checks_enabled()
    _call(name, dev)  # checks off again: the kernel skips the row
    torch.cuda.synchronize()


@pytest.mark.cuda
def test_cuda_checking_mode_is_skipped_during_graph_capture():
    """A sync is not allowed while capturing: with checks on, the captured op skips the bad row instead."""
    name = "fused_k_norm_rope_flashmla"
    args = _inputs(name, b=16, seed=6)
    valid = _break_rows(name, args)
    before = args["kvcache"].clone()
    want = _reference_result(name, args)
    got = _run_cuda(name, args, graph=True, checks_in_capture=True)
    _assert_matches_reference(name, got, want, before, valid, args)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ALL_OPS)
def test_cuda_strided_index_tensors(name):
    """positions / out_loc may be strided views (e.g. a column of a (B, 2) tensor); the kernels honour the stride."""
    args = _inputs(name, b=40, seed=7)
    for key in ("positions", "out_loc"):
        if key in args:
            junk = torch.full_like(args[key], 2**30)
            args[key] = torch.stack([args[key], junk], 1)[:, 0]
            assert args[key].stride(0) == 2
    valid = torch.ones(40, dtype=torch.bool)
    before = args[MUTATED[name]].clone() if name in MUTATED else None
    got = _run_cuda(name, args, graph=False)
    _assert_matches_reference(name, got, _reference_result(name, args), before, valid, args)


@pytest.mark.cuda
def test_cuda_q_norm_rope_in_place_equals_out_of_place():
    args = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in _inputs("fused_q_norm_rope").items()}
    expected = args["q_out"]
    _call("fused_q_norm_rope", args)
    args["q_out"] = args["q"]
    _call("fused_q_norm_rope", args)
    assert torch.equal(args["q"], expected)


@pytest.mark.cuda
@pytest.mark.parametrize("case", structural_cases(), ids=lambda c: c[0])
def test_cuda_structural_errors_match_cpu(case):
    _, name, change, exc, match = case
    args = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in _inputs(name).items()}
    args.update(change(args))
    before = _snapshot(name, args)
    with pytest.raises(exc, match=match):
        _call(name, args)
    _assert_unchanged(name, args, before)


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("name", "arg", "message"),
    [
        ("fused_k_norm_rope_flashmla", "kvcache", "kvcache must be on cuda:0 like kv, got cpu"),
        ("fused_k_norm_rope_flashmla", "kv", "weight must be on cpu like kv, got cuda:0"),
        ("fused_q_norm_rope", "positions", "positions must be on cuda:0 like q, got cpu"),
        ("store_flashmla_cache", "out_loc", "out_loc must be on cuda:0 like kv, got cpu"),
        ("fused_q_indexer_rope_hadamard_quant", "freqs", "freqs must be on cuda:0 like q, got cpu"),
    ],
)
def test_cuda_device_mismatch_names_the_argument_and_the_anchor(name, arg, message):
    args = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in _inputs(name).items()}
    args[arg] = args[arg].cpu()
    with pytest.raises(ValueError, match=re.escape(message)):
        _call(name, args)


@pytest.mark.cuda
def test_cuda_too_many_rows_raises_instead_of_wrapping_the_grid():
    """Broadcast rows can exceed one grid (2**31 - 1 blocks of 8 rows); the block count must not wrap."""
    rows = 8 * 2**32 + 8  # 2**32 + 1 blocks: a 32-bit grid size would wrap to 1
    kv = torch.zeros(1, 512, device="cuda").expand(rows, 512)
    out_loc = torch.full((1,), -1, device="cuda").expand(rows)
    cache = torch.zeros(1, flashmla_page_bytes(2), dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match="too many rows for one launch"):
        ops.store_flashmla_cache(kv, out_loc, cache, 2)
