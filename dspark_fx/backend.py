"""`dspark_backend` and `make_backend`: Inductor with the dspark_fx passes in its post-grad custom-pass slot.

    compiled = torch.compile(model, backend=dspark_backend)                      # Inductor + dspark_fx
    compiled = torch.compile(model, backend=dspark_backend, mode="reduce-overhead")
    compiled = torch.compile(model, backend=make_backend(DsparkConfig(batch_regions=False)))
    compiled = torch.compile(model, backend=make_backend(inner="aot_eager"))    # passes, no codegen (debug)

Users of plain `torch.compile(model)` can install the manager themselves:
`torch._inductor.config.post_grad_custom_post_pass = DsparkPassManager()`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func
from torch._inductor.compile_fx import compile_fx
from torch._inductor.decomposition import select_decomp_table

from dspark_fx.config import DsparkConfig
from dspark_fx.passes.manager import DsparkPassManager, Observer

INNER_MODES = ("inductor", "aot_eager")


def make_backend(
    config: DsparkConfig | None = None, *, inner: str = "inductor", observer: Observer | None = None
) -> Callable[..., Any]:
    """A torch.compile backend running the dspark_fx passes; `inner="aot_eager"` skips Inductor codegen."""
    if inner not in INNER_MODES:
        raise ValueError(f"make_backend: inner must be one of {INNER_MODES}, got {inner!r}")
    config = config or DsparkConfig()

    def backend(
        gm: fx.GraphModule,
        example_inputs: Sequence[Any],
        mode: str | None = None,
        options: dict[str, Any] | None = None,
    ) -> Callable[..., Any]:
        options = dict(options or {})
        user_pass = options.pop("post_grad_custom_post_pass", torch._inductor.config.post_grad_custom_post_pass)
        manager = DsparkPassManager(config, user_pass=user_pass, observer=observer)
        manager.input_names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        backend.managers.append(manager)
        if inner == "aot_eager":
            return _aot_eager(gm, example_inputs, manager)
        patches = dict(torch._inductor.list_mode_options(mode)) if mode else {}
        patches.update(options)
        patches["post_grad_custom_post_pass"] = manager
        return compile_fx(gm, example_inputs, config_patches=patches)

    backend.managers = []
    return backend


def _aot_eager(gm: fx.GraphModule, example_inputs: Sequence[Any], manager: DsparkPassManager):
    def forward_compiler(fw: fx.GraphModule, _inputs: Sequence[Any]):
        manager(fw.graph)
        fw.recompile()
        return make_boxed_func(fw.forward)

    return aot_module_simplified(
        gm,
        list(example_inputs),
        fw_compiler=forward_compiler,
        decompositions=select_decomp_table(),
        keep_inference_input_mutations=True,
    )


def dspark_backend(
    gm: fx.GraphModule, example_inputs: Sequence[Any], mode: str | None = None, options: dict[str, Any] | None = None
) -> Callable[..., Any]:
    """The default backend: `torch.compile(model, backend=dspark_backend)` (accepts `mode=`/`options=`)."""
    return _DEFAULT(gm, example_inputs, mode=mode, options=options)


_DEFAULT = make_backend()
