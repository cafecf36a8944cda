"""Building a kernel emulation: torch-free kernel headers and a driver compiled with g++ against a host shim of the
CUDA built-ins (tests/multi_linear_emulation_shim.py, tests/dsv4_emulation_shim.py) into a shared library loaded
with ctypes.

A library is built once per input hash (compiler, flags, shim, driver and the headers of the include folders) into
a folder of `cache` (the `emulation_cache` fixture: pytest's cache folder, shared by the xdist workers), under a file
lock: concurrent workers wait for the one that builds, later runs load the library already there."""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
from filelock import FileLock

CSRC = Path(__file__).resolve().parents[1] / "custom_ops" / "csrc"
HEADERS = (".h", ".cuh", ".hpp")


def _key(cmd: Sequence[str], shim: Mapping[str, str], driver: str, include: Sequence[Path]) -> str:
    """Hash of what the library is built from: the compiler and its options, the shim's headers, the driver and
    every header under the include folders (with its path)."""
    h = hashlib.sha256(repr((list(cmd), sorted(shim.items()), driver)).encode())
    for folder in include:
        for p in sorted(p for p in folder.rglob("*") if p.suffix in HEADERS):
            h.update(str(p).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def compile_emulation(
    cache: Path, shim: Mapping[str, str], driver: str, name: str, flags: Sequence[str] = ()
) -> ctypes.CDLL:
    """Compile the shim's headers and `driver` (with `flags`, kernel headers from custom_ops/csrc) into lib<name>.so
    in a folder of `cache` named by their hash, unless it is already there, and load it; skip without a C++20
    compiler with <barrier> and _Float16."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("needs a C++20 compiler")
    # -fno-gnu-unique: the emulation libraries of the suite define the same inline names (threadIdx, gridDim, ...)
    # with other types; as GNU unique symbols they would be bound across libraries, whatever ctypes' RTLD_LOCAL says
    options = ["-std=c++20", "-O1", "-shared", "-fPIC", "-fno-gnu-unique", f"-I{CSRC}", *flags]
    include = [CSRC, *(Path(f[2:]) for f in flags if f.startswith("-I"))]
    root = cache / f"{name}-{_key([cxx, *options], shim, driver, include)}"
    lib = root / f"lib{name}.so"
    with FileLock(cache / f"{name}.lock"):
        if not lib.is_file():
            for old in cache.glob(f"{name}-*"):  # libraries of other sources: no run loads them again
                shutil.rmtree(old)
            root.mkdir()
            for header, text in shim.items():
                (root / header).write_text(text)
            (root / "driver.cpp").write_text(driver)
            built = root / f"lib{name}.so.partial"
            res = subprocess.run(
                [cxx, f"-I{root}", *options, str(root / "driver.cpp"), "-o", str(built), "-lpthread"],
                capture_output=True,
                text=True,
            )
            if res.returncode != 0 and re.search(r"barrier.*No such file|_Float16", res.stderr):
                pytest.skip("needs a C++20 standard library with <barrier> and _Float16")
            assert res.returncode == 0, res.stderr[-4000:]
            os.replace(built, lib)
    return ctypes.CDLL(str(lib))
