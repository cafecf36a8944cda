"""Build, cache and load the CUDA kernels of `custom_ops`: every `.cu` / `.cpp` under `custom_ops/csrc/` (all
subfolders) in one library.

Where the sources are: `csrc/common/` (error formatting, the range-check switch, the refusal of arguments that require
grad, programmatic dependent launch, the device primitives shared by the FlashMLA and DeepSeek-V4 kernels),
`csrc/flashmla/`, `csrc/dsv4/` and `csrc/linear/`, one folder per op family, like the Python packages
`custom_ops.flashmla`, `custom_ops.dsv4` and `custom_ops.linear`. Every `#include` of this project names its header
relative to `csrc/` (`#include "common/error_format.h"`); the build passes `-I csrc`.
Source basenames are unique across the folders (the extension builder names object files by basename).

This module is the implementation; `custom_ops/build.py` is the `python -m custom_ops.build` command on top of it.
They are two modules because a module run with `-m` executes as a second copy (`__main__`) beside the one the op
modules imported, with its own lock and loaded-library state; the command stays a thin separate module instead.

How a CUDA call gets here: every op but the DeepSeek-V4 planners has a first-use entry under
`CompositeExplicitAutograd` (`custom_ops._library.register_op`) that calls `load()` and re-dispatches; once loaded, the
library's kernels under the `CUDA` key take precedence. `import custom_ops` loads an already built library at once
(`load_prebuilt`). Why this design, and what it gives `torch.compile` and CUDA graphs: the docstring of
`custom_ops/_library.py`.

Build: `torch.utils.cpp_extension.load` with ninja, `-O3`, SASS for sm_90a plus compute_80 PTX (JIT-compiled by
the driver on other GPUs), into `$DSPARK_OPS_CACHE_DIR` (default `~/.cache/dspark_fx/ops`) under a directory
named by a hash of the sources, the flags and the torch/CUDA versions. CPU references never need any of this.
"""

import functools
import hashlib
import logging
import os
import sys
import threading
import time
from pathlib import Path

import torch

from custom_ops import checks

__all__ = [
    "CUDA_FLAGS",
    "BuildError",
    "build_key",
    "cuda_library_problem",
    "is_loaded",
    "library_path",
    "load",
    "load_prebuilt",
    "source_files",
]

log = logging.getLogger("custom_ops")

CSRC = Path(__file__).resolve().parent / "csrc"
CXX_FLAGS = ["-O3"]
LD_FLAGS = ["-lcublas"]  # dspark::multi_linear's batched GEMM (the handle and workspace are torch's)
CUDA_FLAGS = [
    "-O3",
    "-gencode=arch=compute_90a,code=sm_90a",
    "-gencode=arch=compute_80,code=compute_80",
    "-lineinfo",
]

# What the start line of a build says it takes: 71 s on an H200 machine's 16 cores (ninja compiles the sources in
# parallel, so fewer cores take longer).
BUILD_TIME = "about a minute on 16 cores, longer on fewer"
AHEAD_OF_TIME = "; `python -m custom_ops.build` builds them ahead of time"

_lock = threading.Lock()
_loaded: Path | None = None


class BuildError(RuntimeError):
    """The CUDA kernels cannot be built or loaded here (no CUDA torch, no nvcc, no ninja, compile error)."""


def _csrc_files() -> list[Path]:
    """Every file under csrc/, in every subfolder, in a stable order."""
    return sorted((p for p in CSRC.rglob("*") if p.is_file()), key=lambda p: p.relative_to(CSRC).as_posix())


def source_files() -> list[Path]:
    """The translation units of the library: every `.cu` / `.cpp` under csrc/ (recursive). Their basenames must be
    unique, since the extension builder names each object file after its source's basename."""
    sources = [p for p in _csrc_files() if p.suffix in (".cu", ".cpp")]
    seen: dict[str, Path] = {}
    for p in sources:
        other = seen.setdefault(p.stem, p)
        if other is not p:
            raise BuildError(f"two CUDA sources share the object name {p.stem!r}: {other} and {p}; rename one")
    return sources


def build_key() -> str:
    """Hash of every file under csrc/ (recursive, with its path relative to csrc/), the flags and the torch / CUDA
    versions (names the cache directory)."""
    h = hashlib.sha256()
    for p in _csrc_files():
        h.update(p.relative_to(CSRC).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    h.update(repr((CXX_FLAGS, CUDA_FLAGS, LD_FLAGS, torch.__version__, torch.version.cuda)).encode())
    return h.hexdigest()[:16]


def _name() -> str:
    return f"dspark_ops_{build_key()}"


def _build_dir() -> Path:
    root = os.environ.get("DSPARK_OPS_CACHE_DIR") or Path.home() / ".cache" / "dspark_fx" / "ops"
    return Path(root) / _name()


def library_path() -> Path:
    """Where the built library for the current sources and torch lives (it may not exist yet)."""
    return _build_dir() / f"{_name()}.so"


def is_loaded() -> bool:
    return _loaded is not None


def _toolchain_problem() -> str:
    """What `load` lacks to build the library here ("" if nothing)."""
    from torch.utils import cpp_extension

    if torch.version.cuda is None:
        return f"torch {torch.__version__} has no CUDA support"
    if cpp_extension.CUDA_HOME is None:
        return "nvcc not found (set CUDA_HOME or put the CUDA toolkit's bin/ on PATH)"
    if not cpp_extension.is_ninja_available():
        return "ninja not found (`pip install ninja` or the system package)"
    return ""


def _require_toolchain() -> None:
    problem = _toolchain_problem()
    if problem:
        raise BuildError(
            f"{problem}: the dspark CUDA kernels cannot be built (the CPU references of torch.ops.dspark.* work "
            "without them)"
        )


@functools.cache
def cuda_library_problem() -> str:
    """Why the dspark CUDA kernels cannot run in this process, "" if they can: the library is loaded (an already
    built one loads at import), or a CUDA device is present and `load` can build it (CUDA torch, nvcc, ninja).

    The dspark_fx passes ask before they emit a dspark op for CUDA tensors, so that a graph they rewrite never
    stops at its first call with `BuildError`. Probed once per process (the ninja probe starts a subprocess); a
    build that then fails in the compiler still raises `BuildError` at the first call."""
    if _loaded is not None:
        return ""
    problem = _toolchain_problem()
    if not problem and not torch.cuda.is_available():
        problem = "torch finds no CUDA device"
    return f"the dspark CUDA library is not built and cannot be built here: {problem}" if problem else ""


def _say(line: str) -> None:
    print(f"custom_ops: {line}", file=sys.stderr, flush=True)


def load(verbose: bool = False, ahead_of_time: bool = False) -> Path:
    """Build the CUDA library if needed and load it into the process (idempotent, thread-safe).

    A build says so on stderr: one line before it starts (what it builds, about how long that takes and, unless
    `ahead_of_time` (the `python -m custom_ops.build` command), that the command builds it ahead of time), one
    line when it is done, with the library's path. Loading a library already built says nothing."""
    global _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        _require_toolchain()
        from torch.utils import cpp_extension

        build_dir, path = _build_dir(), library_path()
        build_dir.mkdir(parents=True, exist_ok=True)
        sources = source_files()
        building = not path.is_file()
        if building:
            when, hint = ("", "") if ahead_of_time else (" on first use", AHEAD_OF_TIME)
            _say(f"building the dspark CUDA kernels{when} ({len(sources)} sources, {BUILD_TIME}) in {build_dir}{hint}")
        start = time.monotonic()
        try:
            cpp_extension.load(
                name=path.stem,
                sources=[str(p) for p in sources],
                # copies: cpp_extension appends torch's own flags to these lists, which would change build_key()
                extra_cflags=list(CXX_FLAGS),
                extra_cuda_cflags=list(CUDA_FLAGS),
                extra_ldflags=list(LD_FLAGS),
                extra_include_paths=[str(CSRC)],
                build_directory=str(build_dir),
                is_python_module=False,
                verbose=verbose,
            )
        except (RuntimeError, OSError) as e:
            raise BuildError(f"building the dspark CUDA ops in {build_dir} failed: {e}") from e
        if building:
            _say(f"built the dspark CUDA kernels in {time.monotonic() - start:.0f} s: {path}")
        _loaded = path
        checks.attach_native(_loaded)
        return _loaded


def load_prebuilt() -> bool:
    """Load the library if it is already built for the current sources and torch; never builds. Used at import."""
    global _loaded
    if torch.version.cuda is None:
        return False
    with _lock:
        if _loaded is not None:
            return True
        path = library_path()
        if not path.is_file():
            return False
        try:
            torch.ops.load_library(str(path))
        except OSError as e:
            log.warning("could not load the prebuilt dspark CUDA ops %s (%s); rebuilding on first use", path, e)
            return False
        _loaded = path
        checks.attach_native(path)
        return True


load_prebuilt()
