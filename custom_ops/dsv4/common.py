"""Shared helpers of the DeepSeek-V4 compressor ops: the compression ratios, plan field readers and argument checks.

The ratios (`WINDOWS`, `RATIOS`, `window_of`, `check_ratio`) are defined here once for Python; the CUDA side has
them once in `csrc/dsv4/dsv4_ratio.h` (`is_ratio`, `window_of`) and `csrc/dsv4/dsv4_checks.h` (`check_ratio`), and
tests/test_layout_constants.py checks that the two agree.

The readers turn the uint8 plan bytes (layouts in `custom_ops.dsv4.plan` and docs/dsv4_compress.md) into int64
columns with a validity mask; they are used by the CPU references, the store op and the tests.

The checks follow docs/contract.md. Structural checks (`check_*` of shapes, dtypes, devices) run in the CPU
impls and in the fake impls alike, so an op called directly and an op traced by `torch.compile` reject the same
inputs. Value checks of plan bytes (`check_plan_field`) run where index values are validated (CPU, and CUDA in
checking mode); the CUDA bindings raise the same messages (`csrc/dsv4/dsv4_checks.h`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch

from custom_ops.checks import is_aligned

FLT_MAX = torch.finfo(torch.float32).max
HEAD_DIMS = (128, 512)
STATE_DTYPES = (torch.float32, torch.bfloat16)
INPUT_DTYPES = (torch.float32, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
INT32_MAX = 2**31 - 1
U32_INVALID = 0xFFFFFFFF  # seq_len / ragged_id of an invalid plan row
WINDOWS = {4: 8, 128: 128}  # compression ratio -> window slots of one entry (c4 windows overlap the previous 4 rows)
RATIOS = tuple(WINDOWS)  # the valid ratios: c4 and c128


class DecodeRows(NamedTuple):
    """DecodePlan columns (int64); `valid` marks rows with a non-negative write_loc."""

    seq_len: torch.Tensor
    write_loc: torch.Tensor
    read_page_0: torch.Tensor
    read_page_1: torch.Tensor
    valid: torch.Tensor


class CompressRows(NamedTuple):
    """CompressPlan columns (int64); `valid` marks rows whose seq_len is not 0xFFFFFFFF."""

    seq_len: torch.Tensor
    ragged_id: torch.Tensor
    buffer_len: torch.Tensor
    read_page_0: torch.Tensor
    read_page_1: torch.Tensor
    valid: torch.Tensor


class WriteRows(NamedTuple):
    """WritePlan columns (int64, ragged_id read as u32); `valid` marks rows whose ragged_id is not 0xFFFFFFFF and
    whose write_loc is not negative (a negative state row skips the row)."""

    ragged_id: torch.Tensor
    write_loc: torch.Tensor
    valid: torch.Tensor


def _words(plan: torch.Tensor, width: int) -> torch.Tensor:
    return plan.contiguous().view(torch.int32).reshape(-1, width // 4).long()


def read_decode_plan(plan: torch.Tensor) -> DecodeRows:
    w = _words(plan, 16)
    seq = w[:, 0] & 0xFFFFFFFF
    return DecodeRows(seq, w[:, 1], w[:, 2], w[:, 3], w[:, 1] >= 0)


def decode_emits(p: DecodeRows, ratio: int) -> torch.Tensor:
    """The DecodePlan rows that make an entry (the compress op) and store it (the store): they close a window
    (`seq_len % ratio == 0`) and, for c4, the page of the window's overlap half is mapped (`read_page_0 >= 0`; -1:
    unmapped, the row only writes its state). c128 never reads `read_page_0` (-1 where unmapped)."""
    emit = p.valid & (p.seq_len % ratio == 0)
    return emit & (p.read_page_0 >= 0) if ratio == 4 else emit


def read_compress_plan(plan: torch.Tensor) -> CompressRows:
    w = _words(plan, 16)
    seq = w[:, 0] & 0xFFFFFFFF
    return CompressRows(seq, w[:, 1] & 0xFFFF, (w[:, 1] >> 16) & 0xFFFF, w[:, 2], w[:, 3], seq != U32_INVALID)


def read_write_plan(plan: torch.Tensor) -> WriteRows:
    w = _words(plan, 8)
    ragged = w[:, 0] & 0xFFFFFFFF
    return WriteRows(ragged, w[:, 1], (ragged != U32_INVALID) & (w[:, 1] >= 0))


def check_tensor(name: str, t: object, dtypes: tuple[torch.dtype, ...]) -> None:
    """`t` is a tensor of one of `dtypes` (TypeError otherwise)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name}: expected {names}, got {t.dtype}")


def check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got {t.device}")


def check_index(name: str, t: object, ndim: int, device: torch.device | None = None) -> None:
    """An int32 / int64 index tensor with `ndim` dims (on `device` if given)."""
    check_tensor(name, t, INDEX_DTYPES)
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim}-D, got shape {tuple(t.shape)}")
    if device is not None:
        check_device(name, t, device)


def check_plan(name: str, plan: object, width: int, device: torch.device) -> None:
    check_tensor(name, plan, (torch.uint8,))
    if plan.dim() != 2 or plan.shape[1] != width or not plan.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous [rows, {width}] uint8 tensor, got shape {tuple(plan.shape)}")
    if not is_aligned(plan, width):
        raise ValueError(f"{name}: expected a {width}-byte aligned plan")
    check_device(name, plan, device)


def check_rows(name: str, plan: torch.Tensor, rows: int, what: str) -> None:
    """`plan` has exactly `rows` rows (`what` says why)."""
    if plan.shape[0] != rows:
        raise ValueError(f"{name}: expected {rows} rows ({what}), got {plan.shape[0]}")


def check_matrix(name: str, t: object, cols: int, dtypes: tuple[torch.dtype, ...]) -> None:
    """A 2-D tensor with `cols` columns, unit inner stride and one of `dtypes`."""
    check_tensor(name, t, dtypes)
    if t.dim() != 2 or t.shape[1] != cols:
        raise ValueError(f"{name}: expected shape [rows, {cols}], got {tuple(t.shape)}")
    if cols > 1 and t.stride(1) != 1:
        raise ValueError(f"{name}: expected unit stride in the last dim, got strides {t.stride()}")


def check_head_dim(ape: object, rows: int) -> int:
    """Validate `ape` (contiguous, 16-byte aligned [rows, D] fp32, D in HEAD_DIMS) and return D."""
    check_tensor("ape", ape, (torch.float32,))
    if ape.dim() != 2 or ape.shape[0] != rows or ape.shape[1] not in HEAD_DIMS:
        raise ValueError(f"ape: expected shape [{rows}, D] with D in {HEAD_DIMS}, got {tuple(ape.shape)}")
    if not ape.is_contiguous() or not is_aligned(ape, 16):
        raise ValueError("ape: expected a contiguous, 16-byte aligned tensor")
    return ape.shape[1]


def check_ratio(ratio: int) -> None:
    """`ratio` is one of `RATIOS` (`ValueError: ratio: expected 4 or 128, got <ratio>` otherwise)."""
    if ratio not in RATIOS:
        raise ValueError(f"ratio: expected {' or '.join(map(str, RATIOS))}, got {ratio!r}")


def window_of(ratio: int) -> int:
    """Number of window slots of one compressed entry of a valid `ratio`: 8 for c4 (overlap), 128 for c128."""
    return WINDOWS[ratio]


def check_plan_field(
    plan_name: str, field: str, values: torch.Tensor, bad: torch.Tensor, what: str | Callable[[int], str]
) -> None:
    """Raise `ValueError("<plan>[<i>].<field> = <v> is out of range: <what>")` for the first row `i` where `bad`
    is set (`what` may depend on the row). A CUDA kernel skips such a row instead."""
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        text = what(i) if callable(what) else what
        raise ValueError(f"{plan_name}[{i}].{field} = {int(values[i])} is out of range: {text}")


class FieldProblem(NamedTuple):
    """The rows of plan `plan` whose `field` (`values`) is out of range (`bad`), and what is valid (`what`, may
    depend on the row). The CPU paths raise the first one (`raise_first`); a CUDA kernel skips those rows."""

    plan: str
    field: str
    values: torch.Tensor
    bad: torch.Tensor
    what: str | Callable[[int], str]


def raise_first(problems: Iterable[FieldProblem]) -> None:
    """Raise `check_plan_field`'s `ValueError` for the first problem (in order) that has a bad row."""
    for p in problems:
        check_plan_field(*p)


def skipped_rows(problems: Iterable[FieldProblem], plan: str, rows: int, device: torch.device) -> torch.Tensor:
    """Bool `[rows]`: the rows of `plan` with any problem, i.e. the rows the CUDA kernels skip (no host sync)."""
    skipped = torch.zeros(rows, dtype=torch.bool, device=device)
    for p in problems:
        if p.plan == plan:
            skipped |= p.bad
    return skipped


def page_range(pages: int) -> str:
    """The valid range of a page field, as the messages state it."""
    return f"expected >= 0 and < {pages} (pages of state)"
