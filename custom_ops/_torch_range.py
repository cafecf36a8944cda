"""The torch versions this project is tested with, and a warning on import when the installed torch is outside.

Tested: torch 2.13 (CPU, the test suite) and 2.11 (CPU and CUDA 13.0, the GPU checks); `pyproject.toml` declares
the same range as a dependency. Outside it, `import custom_ops` / `import dspark_fx` warn once and carry on.
"""

from __future__ import annotations

import re
import warnings

import torch

TESTED_TORCH = ">=2.11,<2.14"
_LOW, _HIGH = (2, 11), (2, 14)  # [low, high) on the release (major, minor): a 2.14 pre-release is outside
_warned = False


def untested_torch(version: str) -> str | None:
    """Why `version` is outside the tested range, or None when it is inside."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match and _LOW <= (int(match[1]), int(match[2])) < _HIGH:
        return None
    return f"torch {version} is outside the range this project is tested with (torch{TESTED_TORCH})"


def warn_if_untested_torch() -> None:
    """Warn (once per process) when the installed torch is outside `TESTED_TORCH`."""
    global _warned
    why = untested_torch(str(torch.__version__))
    if why is not None and not _warned:
        _warned = True
        warnings.warn(f"dspark-fx: {why}; it may work, but nothing here was checked with it", stacklevel=3)
