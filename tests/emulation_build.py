"""Building a kernel emulation: torch-free kernel headers and a driver compiled with g++ against a host shim of the
CUDA built-ins (tests/multi_linear_emulation_shim.py, tests/dsv4_emulation_shim.py) into a shared library loaded
with ctypes."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[1] / "custom_ops" / "csrc"


def compile_emulation(
    root: Path, shim: Mapping[str, str], driver: str, name: str, flags: Sequence[str] = ()
) -> ctypes.CDLL:
    """Write the shim's headers and `driver` into `root`, compile them (with `flags`, kernel headers from
    custom_ops/csrc) into lib<name>.so and load it; skip without a C++20 compiler with <barrier> and _Float16."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("needs a C++20 compiler")
    for header, text in shim.items():
        (root / header).write_text(text)
    (root / "driver.cpp").write_text(driver)
    lib = root / f"lib{name}.so"
    # -fno-gnu-unique: the emulation libraries of the suite define the same inline names (threadIdx, gridDim, ...)
    # with other types; as GNU unique symbols they would be bound across libraries, whatever ctypes' RTLD_LOCAL says
    cmd = [cxx, "-std=c++20", "-O1", "-shared", "-fPIC", "-fno-gnu-unique", f"-I{root}", f"-I{CSRC}", *flags]
    res = subprocess.run([*cmd, str(root / "driver.cpp"), "-o", str(lib), "-lpthread"], capture_output=True, text=True)
    if res.returncode != 0 and re.search(r"barrier.*No such file|_Float16", res.stderr):
        pytest.skip("needs a C++20 standard library with <barrier> and _Float16")
    assert res.returncode == 0, res.stderr[-4000:]
    return ctypes.CDLL(str(lib))
