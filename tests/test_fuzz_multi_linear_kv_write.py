"""Property-based fuzz of dspark::multi_linear_kv_write on CPU (hypothesis, derandomized: CI is deterministic).

Each example draws a whole `Spec` of tests/multi_linear_cases.py at once, where the fixed cases of
tests/test_multi_linear_kv_write.py vary one or two fields: token count (1 to 33, `[B, W]` slots with a commit
pattern whose rows may commit nothing), layers, heads, head_dim (2 to 128), hidden, free slots, dtype, rotary dim
(none, partial or full) and style, the three table forms, norm with an x-typed or fp32 weight / without weight / off,
per-layer biases, fused / separate / offset weights, weight, `x` and cache layouts, index dtypes and negative slots.
Properties: written rows match the independent fp64 formula (`fp64_kv`), every other byte of the cache buffers keeps
its poison; and without negative slots, the same case with some slots and positions counted from the end
(`wrap_negative=True`) writes the same bytes.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from multi_linear_cases import CACHE_LAYOUTS, Spec, bits, counted_from_the_end, make_case, run_and_check

pytestmark = pytest.mark.slow  # the hypothesis fuzz runs in the full suite

FUZZ = settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def specs(draw) -> Spec:
    window = draw(st.sampled_from([0, 0, 1, 2, 3]))
    tokens = draw(st.sampled_from([1, 2, 3, 5, 7, 16, 33]))
    if window:
        tokens = max(window, tokens - tokens % window)
    head_dim = draw(st.sampled_from([2, 4, 6, 8, 16, 24, 32, 64, 128]))
    return Spec(
        tokens=tokens,
        hidden=draw(st.sampled_from([8, 24, 40, 64])),
        layers=draw(st.sampled_from([1, 2, 3, 5])),
        heads=draw(st.integers(1, 3)),
        head_dim=head_dim,
        slots=tokens + draw(st.sampled_from([0, 1, 4, 20])),
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])),
        rot=draw(st.one_of(st.none(), st.integers(1, head_dim // 2).map(lambda half: 2 * half))),
        neox=draw(st.booleans()),
        norm=draw(st.sampled_from(["weight", "fp32-weight", "no-weight", "off"])),
        bias=tuple(draw(st.lists(st.booleans(), min_size=1, max_size=3))),
        proj=draw(st.sampled_from(["fused", "separate", "offset"])),
        q_heads=draw(st.sampled_from([0, 1, 3])),
        weight_layout=draw(st.sampled_from(["contiguous", "row-strided", "transposed"])),
        x_layout=draw(st.sampled_from(["contiguous", "strided", "transposed", "offset", "row-strided", "misaligned"])),
        cache_layout=draw(st.sampled_from(CACHE_LAYOUTS)),
        pos_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        loc_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        window=window,
        commit=tuple(draw(st.lists(st.integers(0, max(window, 1)), min_size=1, max_size=3))),
        negative=tuple(draw(st.lists(st.integers(0, tokens - 1), max_size=2, unique=True))),
        table_rows=draw(st.sampled_from([33, 64, 200])),
        table_form=draw(st.sampled_from(["halves", "pairs", "frequencies"])),
        seed=draw(st.integers(0, 2**16)),
        weight_seed=draw(st.integers(0, 6)),
    )


@FUZZ
@given(spec=specs(), wrap=st.booleans())
def test_fuzz_cpu_op_against_the_fp64_formula(spec: Spec, wrap: bool) -> None:
    case = make_case(spec)
    wrapped = counted_from_the_end(case) if wrap and not spec.negative else None  # copies the pristine caches
    run_and_check(case)
    if wrapped is not None:
        wrapped.call()
        for plain, other in zip(case.bases, wrapped.bases, strict=True):
            assert torch.equal(bits(plain), bits(other)), "slots or positions counted from the end wrote other bytes"
