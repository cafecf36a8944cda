"""The two argument checks of every `dspark` op agree: the Python check (the CPU impl and the fake impl) and the C++
check of the CUDA binding raise the same error class naming the same argument, before anything is modified.

For every entry of tests/bad_argument_cases.py (valid CPU arguments of one op with one thing broken):
- CPU: the op on the CPU tensors raises the entry's error, `argument_named(message)` is the entry's argument, and no
  byte of any argument's storage changed;
- fake: the same under `FakeTensorMode` (the fake impl, what torch.compile traces);
- CUDA: the op with every tensor moved to the GPU (storages, offsets and strides kept, so aliasing and alignment
  stay as on CPU) raises the same class naming the same argument as on CPU, and no byte changed. Device-mismatch
  entries (a tensor on the meta device) run here only, with that tensor on the CPU.
Entries of a documented CUDA-only requirement (the table's `only="cuda"`: a layout the CUDA kernels need) must be
accepted on CPU and by the fake impl, and raise on CUDA. Then the table itself: at least 3 entries per public op of
the namespace, arguments that exist, valid base arguments that every op accepts.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from bad_argument_cases import (
    BAD_ARGUMENT_CASES,
    SKIPPED_VALUE_CASES,
    VALID_ARGS,
    BadCase,
    SkipCase,
    argument_named,
    dspark_ops,
    op_parameters,
)
from dsv4_cases import assert_cache_bytes_close
from helpers import LayoutKeepingMove
from torch._subclasses.fake_tensor import FakeTensorMode

import custom_ops
from custom_ops import _build  # the CUDA library loader, as in the other CUDA tests

# ---------------------------------------------------------------------------------------------- arguments


def _map(args: dict, fn) -> dict:
    """`args` with `fn` applied to every tensor (also inside list arguments)."""

    def one(v):
        if isinstance(v, torch.Tensor):
            return fn(v)
        if isinstance(v, (list, tuple)):
            return [one(x) for x in v]
        return v

    return {k: one(v) for k, v in args.items()}


def _tensors(args: dict) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    _map(args, found.append)
    return found


def _has_meta(args: dict) -> bool:
    """A device-mismatch entry: one tensor stands on the meta device for "another device"."""
    return any(t.device.type == "meta" for t in _tensors(args))


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """Every byte of `t`'s storage as a uint8 tensor on `t`'s device (a view, not a copy)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _span(t: torch.Tensor) -> int:
    """Elements of storage `t`'s layout reaches (from offset 0)."""
    if t.numel() == 0:
        return t.storage_offset()
    return t.storage_offset() + 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))


def _moved(args: dict, device: str) -> dict:
    """`args` on `device`: each storage copied once (views of one storage stay views of one storage, with their
    offsets and strides, so overlaps, aliasing and misalignment are as before); a meta tensor becomes a zero CPU
    tensor of its layout (the "other device" of a device-mismatch entry)."""
    keeping_layout = LayoutKeepingMove(device)

    def move(t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "meta":
            return torch.zeros(_span(t), dtype=t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())
        return keeping_layout(t)

    return _map(args, move)


def _snapshot(args: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tensor, a CPU copy of its storage's bytes) for every storage the arguments hold."""
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for t in _tensors(args):
        if t.device.type != "meta" and t.untyped_storage().nbytes():
            seen.setdefault(t.untyped_storage().data_ptr(), (t, _storage_bytes(t).cpu().clone()))
    return list(seen.values())


def _assert_unchanged(snapshot: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for t, before in snapshot:
        after = _storage_bytes(t).cpu()
        assert torch.equal(after, before), f"the storage of a {tuple(t.shape)} {t.dtype} argument changed"


def _call(op: str, args: dict):
    return getattr(torch.ops.dspark, op)(**args)


def _raised(op: str, args: dict) -> tuple[type[Exception], str, str] | None:
    """(error class, argument named, message) of the TypeError / ValueError the call raises; None if it returns."""
    try:
        _call(op, args)
    except (TypeError, ValueError) as e:
        message = str(e).splitlines()[0] if str(e) else ""
        return (TypeError if isinstance(e, TypeError) else ValueError), argument_named(message), message
    return None


# ---------------------------------------------------------------------------------------------- parameters


def _params(side: str) -> list:
    return [
        pytest.param(case, id=case.id)
        for case in BAD_ARGUMENT_CASES
        if side == "cuda" or not _has_meta(case.make_args())
    ]


# ---------------------------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("case", _params("cpu"))
def test_python_check_on_cpu(case: BadCase):
    args = case.make_args()
    if case.only == "cuda":
        _call(case.op, args)  # a CUDA kernel requirement: the CPU impl computes the call
        return
    before = _snapshot(args)
    with pytest.raises(case.error) as info:
        _call(case.op, args)
    message = str(info.value).splitlines()[0]
    assert argument_named(message) == case.arg, message
    _assert_unchanged(before)


@pytest.mark.parametrize("case", _params("fake"))
def test_python_check_on_fake_tensors(case: BadCase):
    args = case.make_args()
    with FakeTensorMode() as mode:
        fake = _map(args, mode.from_tensor)
        if case.only == "cuda":
            _call(case.op, fake)  # a CUDA kernel requirement: the fake impl (torch.compile's view) accepts it
            return
        with pytest.raises(case.error) as info:
            _call(case.op, fake)
    message = str(info.value).splitlines()[0]
    assert argument_named(message) == case.arg, message


# ---------------------------------------------------------------------------------------------- CUDA


@pytest.fixture
def cuda_library():
    """Load the CUDA library first, so every op (the planners included) runs its C++ binding."""
    _build.load()


@pytest.mark.cuda
@pytest.mark.parametrize("case", _params("cuda"))
def test_cpp_check_agrees_with_python(case: BadCase, cuda_library):
    args = case.make_args()
    cuda_args = _moved(args, "cuda")
    want = (case.error, case.arg)
    if not _has_meta(args) and case.only != "cuda":
        cpu = _raised(case.op, args)
        assert cpu is not None and cpu[:2] == want, f"CPU: {cpu}"
    before = _snapshot(cuda_args)
    got = _raised(case.op, cuda_args)
    torch.cuda.synchronize()
    assert got is not None and got[:2] == want, f"CUDA: {got}"
    _assert_unchanged(before)


# ---------------------------------------------------------------------------------------------- value-level errors
#
# `SKIPPED_VALUE_CASES`: CPU raises / CUDA skips and reports invalid. The CPU impl raises the ValueError before
# anything is modified; the fake impl cannot see values and accepts the call; CUDA (no host sync) gives, on the bad
# arguments, what the CPU impl gives on the neutral ones (the affected rows as padding: invalid planner rows, zero
# compress rows, no store bytes) and leaves every byte the neutral call leaves alone byte-identical; CUDA in checking
# mode raises the CPU message word for word.


def _value_params() -> list:
    return [pytest.param(case, id=case.id) for case in SKIPPED_VALUE_CASES]


@pytest.mark.parametrize("case", _value_params())
def test_value_errors_raise_on_cpu_before_any_write(case: SkipCase):
    args = case.make_args()
    before = _snapshot(args)
    with pytest.raises(ValueError) as info:
        _call(case.op, args)
    message = str(info.value).splitlines()[0]
    assert argument_named(message) == case.arg, message
    assert "is out of range" in message, message
    _assert_unchanged(before)
    _call(case.op, case.make_neutral())  # the neutral call is valid


@pytest.mark.parametrize("case", _value_params())
def test_value_errors_pass_the_fake_impl(case: SkipCase):
    args = case.make_args()
    with FakeTensorMode() as mode:
        _call(case.op, _map(args, mode.from_tensor))


def _results(out) -> list[torch.Tensor]:
    if out is None:
        return []
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _assert_same_result(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if got.dtype == torch.uint8 and what == "kvcache":
        assert_cache_bytes_close(got, want, f"{what}: ")
    elif got.dtype == torch.uint8 or not got.is_floating_point():
        assert torch.equal(got.cpu(), want), what
    else:
        torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4, msg=what)


@pytest.mark.cuda
@pytest.mark.parametrize("case", _value_params())
def test_cuda_skips_value_errors_and_reports_the_rows_invalid(case: SkipCase, cuda_library):
    args = case.make_args()
    want_args = case.make_neutral()
    untouched = {k: v.clone() for k, v in want_args.items() if isinstance(v, torch.Tensor)}
    want = _results(_call(case.op, want_args))
    with custom_ops.checks(False):
        cuda_args = _moved(args, "cuda")
        got = _results(_call(case.op, cuda_args))
    torch.cuda.synchronize()
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        _assert_same_result(g, w, f"output {i}")
    for name, before in untouched.items():
        after = want_args[name]
        if torch.equal(after, before):
            assert torch.equal(cuda_args[name].cpu(), args[name]), f"{name}: changed, the neutral call leaves it"
            continue
        _assert_same_result(cuda_args[name], after, name)
        same = (after == before) if after.is_floating_point() else after.view(torch.uint8) == before.view(torch.uint8)
        kept = cuda_args[name].cpu()[same]
        assert torch.equal(kept, args[name][same]), f"{name}: a skipped row's bytes changed"
    cpu_error = _raised(case.op, case.make_args())
    checked = _moved(case.make_args(), "cuda")
    before = _snapshot(checked)
    with custom_ops.checks():
        assert _raised(case.op, checked) == cpu_error
    _assert_unchanged(before)


def test_value_table_covers_every_dsv4_op():
    ops = {case.op for case in SKIPPED_VALUE_CASES}
    assert {op for op in dspark_ops() if op.startswith("dsv4_")} == ops
    ids = Counter(case.id for case in SKIPPED_VALUE_CASES)
    assert [i for i, n in ids.items() if n > 1] == []


# ---------------------------------------------------------------------------------------------- the harness


def _answer(op: str, args: dict) -> tuple[str, str]:
    """The exception class and the argument its message names, or ("", "") if the call returns."""
    try:
        _call(op, args)
    except Exception as e:
        return type(e).__name__, argument_named(str(e))
    return "", ""


def _storage_groups(args: dict) -> list[list[int]]:
    """Which tensors of `args` (by position in `_tensors`) share a storage."""
    groups: dict[int, list[int]] = {}
    for i, t in enumerate(_tensors(args)):
        groups.setdefault(t.untyped_storage().data_ptr() if t.untyped_storage().nbytes() else -1 - i, []).append(i)
    return sorted(groups.values())


@pytest.mark.parametrize("case", [c for c in BAD_ARGUMENT_CASES if not _has_meta(c.make_args())], ids=lambda c: c.id)
def test_moved_arguments_keep_layouts_aliasing_and_errors(case: BadCase):
    """What the CUDA test relies on, checked on CPU: `_moved(args, "cpu")` gives fresh storages with the same
    layouts, bytes and aliasing, and the op gives the same answer for them (one-sided rules included)."""
    args = case.make_args()
    copy = _moved(args, "cpu")
    for t, c in zip(_tensors(args), _tensors(copy), strict=True):
        assert (c.shape, c.stride(), c.storage_offset(), c.dtype) == (t.shape, t.stride(), t.storage_offset(), t.dtype)
        assert c.untyped_storage().data_ptr() != t.untyped_storage().data_ptr() or t.untyped_storage().nbytes() == 0
        assert torch.equal(_storage_bytes(c)[: t.untyped_storage().nbytes()], _storage_bytes(t))
    assert _storage_groups(copy) == _storage_groups(args)
    assert _answer(case.op, copy) == _answer(case.op, args)


def test_snapshot_sees_a_changed_byte():
    args = VALID_ARGS["store_flashmla_cache"]()
    before = _snapshot(args)
    _assert_unchanged(before)
    args["kvcache"].view(-1)[-1] ^= 1
    with pytest.raises(AssertionError, match="changed"):
        _assert_unchanged(before)


# ---------------------------------------------------------------------------------------------- the table


def test_every_op_has_at_least_three_cases():
    counts = Counter(case.op for case in BAD_ARGUMENT_CASES)
    assert {op: counts[op] for op in dspark_ops() if counts[op] < 3} == {}
    assert set(counts) <= set(dspark_ops())


def test_cases_name_arguments_of_their_op():
    ids = Counter(case.id for case in BAD_ARGUMENT_CASES)
    assert [i for i, n in ids.items() if n > 1] == []
    for case in BAD_ARGUMENT_CASES:
        params = op_parameters(case.op)
        assert case.arg.split("[")[0] in params, case.id
        assert set(case.make_args()) <= set(params), case.id
        assert case.error in (TypeError, ValueError), case.id
        assert case.only in (None, "cuda") and bool(case.reason) == (case.only is not None), case.id


def test_argument_named():
    assert argument_named("kv must have shape (B, 512), got (8, 256)") == "kv"
    assert argument_named("ratio: expected 4 or 128, got 8\nmore") == "ratio"
    assert argument_named("req_to_token/full_to_state: pass both (paged addressing) or neither") == "req_to_token"
    assert argument_named("multi_linear: row_starts[1] = 0: rows [0, 17) of weights[1] are out of range") == (
        "row_starts[1]"
    )
    assert argument_named("multi_linear_kv_write: k_row_starts[1] = -1: rows [-1, 31) of k_weights[1]") == (
        "k_row_starts[1]"
    )
    assert argument_named("something else entirely") == ""


@pytest.mark.parametrize("op", dspark_ops())
def test_valid_base_arguments_are_accepted(op):
    """The entries break one thing of `VALID_ARGS[op]()`: those arguments pass both Python checks."""
    args = VALID_ARGS[op]()
    with FakeTensorMode() as mode:
        _call(op, _map(args, mode.from_tensor))
    _call(op, args)
