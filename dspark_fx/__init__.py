"""dspark_fx: torch.compile passes for speculative-decoding drafts (see README.md).

`import dspark_fx` stays light (no Dynamo, AOTAutograd or Inductor import): the backend imports them when it
first compiles, and `DsparkPassManager`/`graph_diff` load the passes on first access.
"""

import importlib
import logging
import os

from custom_ops._torch_range import warn_if_untested_torch
from dspark_fx.backend import DsparkBackend, dspark_backend, make_backend
from dspark_fx.config import DsparkConfig
from dspark_fx.explain import explain
from dspark_fx.report import FusionReport

warn_if_untested_torch()

if os.environ.get("DSPARK_FX_LOG", "").lower() in ("debug", "info"):
    logging.getLogger("dspark_fx").setLevel(os.environ["DSPARK_FX_LOG"].upper())
    logging.getLogger("dspark_fx").addHandler(logging.StreamHandler())

_LAZY = {"DsparkPassManager": "dspark_fx.passes.manager", "graph_diff": "dspark_fx.passes.manager"}

__all__ = [
    "DsparkBackend",
    "DsparkConfig",
    "DsparkPassManager",
    "FusionReport",
    "dspark_backend",
    "explain",
    "graph_diff",
    "make_backend",
]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
