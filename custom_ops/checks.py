"""Value-range checks of the `dspark` ops: always on CPU, opt-in on CUDA (they need a host sync there); and
`is_aligned`, the alignment test the families' structural checks share.

The contract (docs/contract.md): structural checks (types, dtypes, shapes, strides, devices, scalar arguments)
always raise before anything is modified, on every device. Index *values* (slots, positions, request ids) are
checked differently by device, because reading them on CUDA costs a host sync and breaks CUDA-graph capture:

- CPU: an out-of-range entry raises `ValueError` (`"<arg>[<i>] = <v> is out of range: <valid range>"`) before
  any write;
- CUDA: rows whose index is out of range are skipped by the kernels (nothing written, nothing read through a
  wrapped index);
- CUDA with checks on (`set_checks(True)`, `with checks():` or `DSPARK_CHECKS=1` in the environment): the CUDA
  bindings validate the same ranges with a host sync before launching and raise the CPU path's error. Checks are
  skipped while the current stream is capturing a CUDA graph (a sync is not allowed there) and for fake tensors.

The flag lives in two places, Python (`checks_enabled`, for the CPU-side wrappers) and the loaded CUDA library
(`dspark_set_checks`, read by every binding); `set_checks` keeps them equal, and `_build` pushes the flag into
the library when it loads it.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

__all__ = ["check_index_range", "checks", "checks_enabled", "is_aligned", "must_check_values", "set_checks"]

_enabled = os.environ.get("DSPARK_CHECKS", "0").strip().lower() not in ("", "0", "false", "off", "no")
_native: ctypes.CDLL | None = None


def checks_enabled() -> bool:
    """Whether CUDA calls validate index ranges (with a host sync). CPU calls always do."""
    return _enabled


def set_checks(enabled: bool) -> None:
    """Turn the CUDA range checks on or off for the whole process (the CPU path always checks)."""
    global _enabled
    if not isinstance(enabled, bool):
        raise TypeError(f"set_checks: enabled must be a bool, got {type(enabled).__name__}")
    _enabled = enabled
    if _native is not None:
        _native.dspark_set_checks(ctypes.c_bool(enabled))


@contextmanager
def checks(enabled: bool = True) -> Iterator[None]:
    """`with custom_ops.checks():` runs its body with the CUDA range checks on, then restores the old setting."""
    old = _enabled
    set_checks(enabled)
    try:
        yield
    finally:
        set_checks(old)


def attach_native(library: Path) -> None:
    """Called by `_build` once the CUDA library is loaded: hand it the current flag."""
    global _native
    _native = ctypes.CDLL(str(library))
    _native.dspark_set_checks.argtypes = [ctypes.c_bool]
    _native.dspark_set_checks(ctypes.c_bool(_enabled))


def must_check_values(t: torch.Tensor) -> bool:
    """Whether a Python impl must validate index values of `t`: real CPU tensors always, CUDA tensors in checking
    mode outside graph capture, never fake or meta tensors."""
    if isinstance(t, torch._subclasses.FakeTensor) or t.device.type == "meta":
        return False
    if t.device.type == "cpu":
        return True
    return _enabled and not (t.device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def check_index_range(
    name: str, index: torch.Tensor, hi: int, what: str, *, negative_skips: bool = True, wrap: bool = False
) -> None:
    """Raise `ValueError` for the first entry of `index` outside `[0, hi)` (negative entries are allowed when
    `negative_skips`: they mean "skip this row"; with `wrap` the range is `[-hi, hi)`, a negative entry counting from
    the end as in Python indexing). `what` describes the valid range for the message.

    The CUDA bindings raise the same message (`csrc/common/range_checks.h`). The caller decides whether to check
    (`must_check_values`)."""
    values = index.long()
    low = -hi if wrap else None if negative_skips else 0
    bad = values >= hi if low is None else (values < low) | (values >= hi)
    if bool(bad.any()):
        where = bad.nonzero()[0].tolist()
        label = ", ".join(str(i) for i in where)
        raise ValueError(f"{name}[{label}] = {int(values[tuple(where)])} is out of range: {what}")


def is_aligned(t: torch.Tensor, alignment: int) -> bool:
    """Whether `t`'s first element is `alignment`-byte aligned, judged from its storage offset (torch's allocators
    align every storage to at least 16 bytes, and a fake tensor has no address): the CUDA bindings check the
    address itself, which agrees for every tensor torch allocated, so CPU, fake and CUDA raise alike."""
    return t.storage_offset() * t.element_size() % alignment == 0
