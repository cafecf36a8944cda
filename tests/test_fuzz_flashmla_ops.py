"""Property-based fuzz of the five FlashMLA-write / norm-RoPE ops (hypothesis, derandomized: CI is deterministic).

Each example draws a batch size (0, 1, odd, ...), dtypes of the rows and of both index tensors, page size, spare
pages (the cache may have none), row strides of the input views, the table size, and per row a slot kind (valid,
negative, at the capacity, beyond it, huge) and a position kind (random, 0, max_pos - 1, negative, max_pos, huge);
valid slots are duplicate-free. Properties:

- CPU op: raises `ValueError` for the first out-of-range index (positions before slots) and then no byte of its
  output has changed; otherwise it equals the reference bit for bit.
- Reference (the kernels' skip rule): only the bytes addressed by the valid rows change (whole cache / whole
  buffer compared against an independently computed mask), and the written rows match the fp64 formulas.
- CUDA (marked): the kernel on the same inputs equals the reference (skipped rows leave everything else unchanged)
  and checking mode raises the CPU message.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from flashmla_cases import (
    EPS,
    MUTATED,
    REFERENCES,
    _assert_matches_reference,
    _bits,
    _check_bf16_close,
    _check_indexer_fp64,
    _check_nope_bytes,
    _fp64_k_rows,
    _fp64_norm_rope_rows,
    _fp64_q_rows,
    _slot_bytes,
    _tol,
    _written_mask,
)
from helpers import LayoutKeepingMove
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import custom_ops
from custom_ops.layouts.fp8 import flashmla_page_bytes
from custom_ops.layouts.rope import precompute_freqs

ops = torch.ops.dspark

OPS = (
    "fused_k_norm_rope_flashmla",
    "store_flashmla_cache",
    "fused_q_norm_rope",
    "fused_norm_rope_inplace",
    "fused_q_indexer_rope_hadamard_quant",
)
USES_SLOTS = {"fused_k_norm_rope_flashmla", "store_flashmla_cache"}
USES_POSITIONS = set(OPS) - {"store_flashmla_cache"}
BAD_SLOTS = ("capacity", "beyond", "huge")
BAD_POSITIONS = ("negative", "max_pos", "huge")
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)

CPU_SETTINGS = settings(
    max_examples=40, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)
CUDA_SETTINGS = settings(CPU_SETTINGS, max_examples=15)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    b: int
    heads: int
    dtype: torch.dtype
    pos_dtype: torch.dtype
    loc_dtype: torch.dtype
    page_size: int
    spare_pages: int
    row_stride: int  # elements between rows of the input (and of the in-place kv) buffer
    max_pos: int
    slot_kinds: tuple[str, ...]
    pos_kinds: tuple[str, ...]
    seed: int


@st.composite
def cases(draw, name: str) -> Case:
    b = draw(st.one_of(st.sampled_from([0, 1, 2, 3, 5]), st.integers(0, 40)))
    all_valid = draw(st.booleans())
    slot_kinds = ("valid", "valid", "valid", "negative") + (() if all_valid else BAD_SLOTS)
    pos_kinds = ("random", "random", "zero", "last") + (() if all_valid else BAD_POSITIONS)
    return Case(
        name=name,
        b=b,
        heads=draw(st.integers(1, 4)),
        dtype=draw(st.sampled_from(FLOAT_DTYPES)),
        pos_dtype=draw(st.sampled_from(INDEX_DTYPES)),
        loc_dtype=draw(st.sampled_from(INDEX_DTYPES)),
        page_size=draw(st.sampled_from([1, 2, 4, 64, 256])),
        spare_pages=draw(st.integers(0, 2)),
        row_stride=draw(st.sampled_from([512, 513, 520, 1536])),
        max_pos=draw(st.sampled_from([1, 7, 512])),
        slot_kinds=tuple(draw(st.lists(st.sampled_from(slot_kinds), min_size=b, max_size=b))),
        pos_kinds=tuple(draw(st.lists(st.sampled_from(pos_kinds), min_size=b, max_size=b))),
        seed=draw(st.integers(0, 2**16)),
    )


# ---------------------------------------------------------------------------------------------- inputs


def _index_max(dtype: torch.dtype) -> int:
    return torch.iinfo(dtype).max


def _slots(c: Case, g: torch.Generator) -> tuple[torch.Tensor, int]:
    """out_loc for the slot kinds (duplicate-free valid slots) and the number of pages of the cache."""
    n_valid = sum(k == "valid" for k in c.slot_kinds)
    num_pages = -(-n_valid // c.page_size) + c.spare_pages
    capacity = num_pages * c.page_size
    free = torch.randperm(capacity, generator=g).tolist()
    huge = 2**62 + (free[-1] if free else 0) if c.loc_dtype == torch.int64 else _index_max(torch.int32)
    value = {
        "negative": lambda: -int(torch.randint(1, 2**31, (), generator=g)),
        "capacity": lambda: capacity,
        "beyond": lambda: capacity + 1 + int(torch.randint(0, 1000, (), generator=g)),
        "huge": lambda: huge,
        "valid": lambda: free.pop(0),
    }
    return torch.tensor([value[k]() for k in c.slot_kinds], dtype=c.loc_dtype), num_pages


def _positions(c: Case, g: torch.Generator) -> torch.Tensor:
    value = {
        "random": lambda: int(torch.randint(0, c.max_pos, (), generator=g)),
        "zero": lambda: 0,
        "last": lambda: c.max_pos - 1,
        "negative": lambda: -int(torch.randint(1, 2 * c.max_pos + 2, (), generator=g)),
        "max_pos": lambda: c.max_pos,
        "huge": lambda: _index_max(c.pos_dtype),
    }
    return torch.tensor([value[k]() for k in c.pos_kinds], dtype=c.pos_dtype)


def _strided_rows(c: Case, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A (b, 512) view of a random (b, row_stride) buffer (the last 512 columns) and the buffer."""
    buf = torch.randn(c.b, c.row_stride, generator=g).to(c.dtype)
    return buf[:, c.row_stride - 512 :], buf


def build(c: Case) -> tuple[dict, torch.Tensor, torch.Tensor | None]:
    """Arguments of op `c.name` (schema order), the bool mask of rows with valid indices, and the whole tensor
    whose bytes the op may touch (cache, the buffer q_out / kv are views of), poisoned; None for the indexer."""
    g = torch.Generator().manual_seed(c.seed)
    freqs = precompute_freqs(c.max_pos)
    positions = _positions(c, g)
    valid = torch.tensor([k not in BAD_POSITIONS for k in c.pos_kinds], dtype=torch.bool)
    if c.name in USES_SLOTS:
        out_loc, num_pages = _slots(c, g)
        cache = torch.randint(0, 256, (num_pages, flashmla_page_bytes(c.page_size)), generator=g, dtype=torch.uint8)
        kv, _ = _strided_rows(c, g)
        if c.name == "store_flashmla_cache":
            valid = torch.tensor([k not in BAD_SLOTS for k in c.slot_kinds], dtype=torch.bool)
            return dict(kv=kv, out_loc=out_loc, kvcache=cache, page_size=c.page_size), valid, cache
        valid &= torch.tensor([k not in BAD_SLOTS for k in c.slot_kinds], dtype=torch.bool)
        weight = (1 + 0.3 * torch.randn(512, generator=g)).to(c.dtype)
        args = dict(kv=kv, weight=weight, eps=EPS, freqs=freqs, positions=positions, out_loc=out_loc, kvcache=cache)
        return {**args, "page_size": c.page_size}, valid, cache
    if c.name == "fused_norm_rope_inplace":
        kv, buf = _strided_rows(c, g)
        weight = (1 + 0.3 * torch.randn(512, generator=g)).to(c.dtype)
        return dict(kv=kv, weight=weight, eps=EPS, freqs=freqs, positions=positions), valid, buf
    if c.name == "fused_q_norm_rope":
        q = torch.randn(c.b, c.heads, 512, generator=g).to(c.dtype)
        wide = torch.full((c.b, c.heads + 2, 512), float("nan"), dtype=c.dtype)  # q_out: a head slice
        return dict(q=q, q_out=wide[:, 1 : c.heads + 1], eps=EPS, freqs=freqs, positions=positions), valid, wide
    q = torch.randn(c.b, c.heads, 128, generator=g).to(c.dtype)
    weight = torch.randn(c.heads, c.b, generator=g).to(c.dtype).t()  # any strides
    return dict(q=q, weight=weight, weight_scale=0.0625, freqs=freqs, positions=positions), valid, None


def expected_error(c: Case, args: dict) -> str | None:
    """Start of the CPU error: the first out-of-range position, else the first out-of-range slot."""
    for key, kinds, bad in (("positions", c.pos_kinds, BAD_POSITIONS), ("out_loc", c.slot_kinds, BAD_SLOTS)):
        if key in args:
            rows = [i for i, k in enumerate(kinds) if k in bad]
            if rows:
                return f"{key}[{rows[0]}] = {int(args[key][rows[0]])} is out of range: "
    return None


def _call(name: str, args: dict):
    return getattr(ops, name)(*args.values())


def _changeable(c: Case, valid: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """Bool mask of the elements of the q_out / kv buffer `whole` that the rows with valid positions may write."""
    mask = torch.zeros(whole.shape, dtype=torch.bool)
    if c.name == "fused_q_norm_rope":
        mask[valid, 1 : c.heads + 1] = True
    else:
        mask[valid, c.row_stride - 512 :] = True
    return mask


def _check_written_rows(c: Case, inputs: dict, outputs: dict, valid: torch.Tensor, result) -> None:
    """Rows written by the reference (`outputs`, from pristine `inputs`) against the fp64 formulas; the bytes
    of a slot are addressed independently of the library."""
    written = valid & (inputs["out_loc"] >= 0) if "out_loc" in inputs else valid  # negative slots: skipped
    rows = written.nonzero().squeeze(1)
    if c.name == "fused_q_indexer_rope_hadamard_quant":
        q_fp8, w_out = result
        assert not _bits(q_fp8[~valid]).any() and not w_out[~valid].any()
        if rows.numel():
            sub = [inputs[k][rows] for k in ("q", "weight")]
            _check_indexer_fp64(q_fp8[rows], w_out[rows], *sub, 0.0625, inputs["freqs"], inputs["positions"][rows])
        return
    positions = inputs["positions"][rows] if "positions" in inputs else None
    if c.name in ("fused_q_norm_rope", "fused_norm_rope_inplace"):
        if c.name == "fused_q_norm_rope":
            got, want = outputs["q_out"][rows], _fp64_q_rows(inputs["q"][rows], EPS, inputs["freqs"], positions)
        else:
            want = _fp64_norm_rope_rows(inputs["kv"][rows], inputs["weight"], EPS, inputs["freqs"], positions)
            got = outputs["kv"][rows]
        torch.testing.assert_close(got.double(), want, rtol=2 * _tol(c.dtype), atol=4 * _tol(c.dtype))
        return
    if rows.numel() == 0:
        return
    values, scales = _slot_bytes(outputs["kvcache"], c.page_size, inputs["out_loc"][rows])
    kv = inputs["kv"][rows]
    if c.name == "store_flashmla_cache":
        assert torch.equal(values[:, 448:], kv[:, 448:].to(torch.bfloat16).contiguous().view(torch.uint8))
        _check_nope_bytes(values, scales, kv[:, :448].double())
        return
    nope64, rope64, terms64 = _fp64_k_rows(kv, inputs["weight"], EPS, inputs["freqs"], positions)
    _check_nope_bytes(values, scales, nope64)
    _check_bf16_close(values[:, 448:].contiguous().view(torch.bfloat16), rope64, terms64)


def _check_untouched(c: Case, args: dict, valid: torch.Tensor, whole: torch.Tensor, before: torch.Tensor) -> None:
    """Every element of the output buffer outside what the valid rows address is unchanged."""
    if c.name in USES_SLOTS:
        keep = torch.where(valid, args["out_loc"], -1)
        mask = _written_mask(whole, c.page_size, keep)
    else:
        mask = _changeable(c, valid, whole)
    assert torch.equal(_bits(whole)[~mask], before[~mask])


def _reference_run(c: Case) -> tuple[dict, torch.Tensor, torch.Tensor | None, object]:
    """The reference (skip rule) on fresh inputs of `c`: (arguments after the call, valid rows, whole, result)."""
    args, valid, whole = build(c)
    before = _bits(whole) if whole is not None else None
    result = REFERENCES[c.name](*args.values())
    if whole is not None:
        _check_untouched(c, args, valid, whole, before)
    return args, valid, whole, result


@pytest.mark.parametrize("name", OPS)
@CPU_SETTINGS
@given(data=st.data())
def test_fuzz_cpu_op_and_reference(name, data):
    c = data.draw(cases(name))
    ref_args, valid, ref_whole, ref_result = _reference_run(c)
    inputs, _, _ = build(c)
    _check_written_rows(c, inputs, ref_args, valid, ref_result)

    args, _, whole = build(c)
    before = _bits(whole) if whole is not None else None
    error = expected_error(c, args)
    if error is not None:
        with pytest.raises(ValueError) as raised:
            _call(name, args)
        assert str(raised.value).startswith(error)
        if whole is not None:
            assert torch.equal(_bits(whole), before)
        return
    result = _call(name, args)
    if whole is not None:
        assert torch.equal(_bits(whole), _bits(ref_whole))
    else:
        assert torch.equal(_bits(result[0]), _bits(ref_result[0])) and torch.equal(result[1], ref_result[1])


# ---------------------------------------------------------------------------------------------- CUDA


def _to_cuda(args: dict, whole: torch.Tensor | None) -> tuple[dict, torch.Tensor | None]:
    """CUDA copies with the same strides and storage offsets (views of one storage stay views of one copy)."""
    move = LayoutKeepingMove("cuda")
    return {k: move(v) for k, v in args.items()}, move(whole)


@pytest.mark.cuda
@pytest.mark.parametrize("name", OPS)
@CUDA_SETTINGS
@given(data=st.data())
def test_fuzz_cuda_matches_reference(name, data):
    """The kernel skips out-of-range rows (no checking mode) and otherwise matches the reference; checking mode
    raises the CPU message."""
    c = data.draw(cases(name))
    ref_args, valid, _, ref_result = _reference_run(c)
    args, _, whole = build(c)
    before = whole.clone() if whole is not None else None
    dev, dev_whole = _to_cuda(args, whole)
    result = _call(name, dev)
    torch.cuda.synchronize()
    if whole is None:
        got = tuple(t.cpu() for t in result)
        _assert_matches_reference(name, got, ref_result, None, valid, args)
    else:
        got_whole = dev_whole.cpu()
        _check_untouched(c, args, valid, got_whole, _bits(before))
        key = MUTATED[name]
        view = got_whole.as_strided(args[key].shape, args[key].stride(), args[key].storage_offset())
        _assert_matches_reference(name, view, ref_args[key], args[key].clone(), valid, args)

    error = expected_error(c, args)
    if error is not None:
        cpu_args, _, cpu_whole = build(c)
        dev, _ = _to_cuda(cpu_args, cpu_whole)
        with pytest.raises(ValueError) as cpu:
            _call(name, cpu_args)
        with custom_ops.checks(), pytest.raises(ValueError) as gpu:
            _call(name, dev)
        assert str(gpu.value) == str(cpu.value)
