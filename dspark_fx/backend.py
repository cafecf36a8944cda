"""`dspark_backend` and `make_backend`: Inductor with the dspark_fx passes in its post-grad custom-pass slot.

    compiled = torch.compile(model, backend=dspark_backend)                      # Inductor + dspark_fx
    compiled = torch.compile(model, backend=dspark_backend, mode="reduce-overhead")
    compiled = torch.compile(model, backend=make_backend(DsparkConfig(batch_regions=False)))
    compiled = torch.compile(model, backend=make_backend({"min_branches": 3}))  # a dict of DsparkConfig fields
    compiled = torch.compile(model, backend=make_backend(inner="aot_eager"))    # passes, no codegen (debug)

A backend (`DsparkBackend`) holds only its settings: every compiled graph gets its own `DsparkPassManager`, which
lives as long as that compile needs it, so a process that compiles for days keeps nothing per compile here. To see
what the passes did, pass `observer=` (called with the graph before, after and the report of each compile),
use `dspark_fx.explain()` or `dspark_fx.testing.CaptureBackend`.

Users of plain `torch.compile(model)` can install the manager themselves:
`torch._inductor.config.post_grad_custom_post_pass = DsparkPassManager()`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from dspark_fx.config import DsparkConfig, as_config

if TYPE_CHECKING:
    import torch.fx as fx

    from dspark_fx.passes.manager import DsparkPassManager, Observer

INNER_MODES = ("inductor", "aot_eager")
BACKEND_NAME = "dspark"
log = logging.getLogger("dspark_fx")


_SETTINGS = frozenset({"config", "inner", "observer", "move_weights"})


class DsparkBackend:
    """A torch.compile backend running the dspark_fx passes; `inner="aot_eager"` skips Inductor codegen.

    Accepts `mode=`/`options=` as `torch.compile` passes them (to Inductor; with `inner="aot_eager"` there is no
    Inductor to take them, and only `options["post_grad_custom_post_pass"]` is used). A post-grad pass already
    installed in `torch._inductor.config.post_grad_custom_post_pass` (or given in `options`) is composed: it runs
    first; a `DsparkPassManager` installed there is left out (this backend's own manager takes its place).
    `move_weights=False`: with `colocate_weights` on, judge and report the weight groups but move nothing
    (`explain`). The settings are read-only: a graph compiled before a change would keep the old decisions.

    Its first compile registers `dspark_backend` in Dynamo's registry as `"dspark"` (unless the installed package's
    entry point did, for `torch.compile(..., backend="dspark")`), the `compiler_name` (and
    `__name__`, which `torch.compile(..., mode=...)` reads) of every instance: at the end of a compile Dynamo drops
    its weak references to the model's real tensors only for registered backends, and a tensor with such a
    reference cannot be swapped (`torch.utils.swap_tensors`), so `module.to(dtype)` of DTensor parameters (which
    swaps them) raised after a compile with an unregistered backend."""

    compiler_name = BACKEND_NAME
    config: DsparkConfig
    inner: str
    observer: Observer | None
    move_weights: bool

    def __init__(
        self,
        config: DsparkConfig | Mapping[str, Any] | None = None,
        *,
        inner: str = "inductor",
        observer: Observer | None = None,
        move_weights: bool = True,
    ) -> None:
        check_backend_args("DsparkBackend", inner, observer)
        for name, value in (
            ("config", as_config(config, "DsparkBackend")),
            ("inner", inner),
            ("observer", observer),
            ("move_weights", move_weights),
        ):
            object.__setattr__(self, name, value)
        self.__name__ = BACKEND_NAME

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _SETTINGS:
            raise AttributeError(
                f"DsparkBackend.{name} cannot be changed: graphs already compiled keep the decisions of the settings "
                f"they were compiled with, so one model would run a mix of both; make a new backend with "
                f"make_backend(...) and compile the model again with it"
            )
        super().__setattr__(name, value)

    def __repr__(self) -> str:
        return f"DsparkBackend({self.config}, inner={self.inner!r})"

    def __call__(
        self,
        gm: fx.GraphModule,
        example_inputs: Sequence[Any],
        mode: str | None = None,
        options: dict[str, Any] | None = None,
    ) -> Callable[..., Any]:
        from dspark_fx.passes.manager import DsparkPassManager

        _register_name()
        options = dict(options or {})
        user_pass = options.pop("post_grad_custom_post_pass", torch._inductor.config.post_grad_custom_post_pass)
        manager = DsparkPassManager(self.config, user_pass=user_pass, observer=self.observer)
        manager.input_names = _input_names(gm, example_inputs)
        groups = []
        if self.config.colocate_weights:
            from dspark_fx.colocate import find_weight_groups

            groups = find_weight_groups(gm, example_inputs, self.config.min_branches)
            manager.colocated[:] = _colocate(groups, self.config, move=False)
        if self.inner == "aot_eager":
            compiled = _aot_eager(gm, example_inputs, manager)
        else:
            compiled = _inductor(gm, example_inputs, manager, mode, options)
        if groups and self.move_weights:
            # in place: the reports (and what an observer kept of them) hold this list
            manager.colocated[:] = _colocate(groups, self.config, move=True)
        return compiled


def _input_names(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> list[str]:
    """Dynamo's input names, one per input of the graph AOTAutograd makes: that graph takes a tensor subclass (a
    DTensor parameter of a tensor-parallel model) as its inner values (`__tensor_flatten__`, recursively, in order).
    A subclass holding one inner tensor (a DTensor's local shard) gives it its own name; other inner values are
    named `name.attr` (a DTensor's device mesh, where torch passes it to the graph)."""
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    return [flat for name, value in zip(placeholders, example_inputs, strict=False) for flat in _flat(name, value)]


def _flat(name: str, value: Any) -> list[str]:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(value):
        return [name]
    attrs, _ = value.__tensor_flatten__()
    tensors = [attr for attr in attrs if isinstance(getattr(value, attr), torch.Tensor)]
    names = []
    for attr in attrs:
        names += _flat(name if tensors == [attr] else f"{name}.{attr}", getattr(value, attr))
    return names


def _colocate(groups: list[Any], config: DsparkConfig, move: bool) -> list[Any]:
    """`DsparkConfig.colocate_weights`: judge the graph's groups of linears (`find_weight_groups`) and, with `move`,
    move the weights of those that qualify, logging and counting what moved and what was left."""
    from torch._dynamo.utils import counters

    from dspark_fx.colocate import colocate_weights
    from dspark_fx.passes.horizontal import group_gemm_devices

    outcome = colocate_weights(groups, group_gemm_devices(config), move=move)
    if not move:
        return outcome
    for group in outcome:
        log.info("dspark_fx: colocate_weights: %s", group)
        counters["dspark_fx"]["weight_groups_colocated" if group.moved else "weight_groups_left"] += 1
    return outcome


@functools.cache
def _register_name() -> None:
    """`dspark_backend` in Dynamo's registry as `BACKEND_NAME`, unless a backend of that name is there already
    (`DsparkBackend` says why)."""
    from torch._dynamo.backends.registry import lookup_backend, register_backend
    from torch._dynamo.exc import InvalidBackend

    try:
        lookup_backend(BACKEND_NAME)
    except InvalidBackend:
        register_backend(compiler_fn=dspark_backend, name=BACKEND_NAME)


def make_backend(
    config: DsparkConfig | Mapping[str, Any] | None = None,
    *,
    inner: str = "inductor",
    observer: Observer | None = None,
) -> DsparkBackend:
    """A torch.compile backend running the dspark_fx passes (see `DsparkBackend`). `config` is a `DsparkConfig`,
    a dict of its fields or None (the defaults); a wrong one raises here, not at the first compile."""
    check_backend_args("make_backend", inner, observer)
    return DsparkBackend(as_config(config, "make_backend"), inner=inner, observer=observer)


def check_backend_args(caller: str, inner: object, observer: object) -> None:
    """The backend arguments besides the config, each error naming `caller` (the function the user called)."""
    if inner not in INNER_MODES:
        raise ValueError(f"{caller}: inner must be one of {INNER_MODES}, got {inner!r}")
    if observer is not None and not callable(observer):
        raise TypeError(f"{caller}: observer must be callable or None, got {type(observer).__name__}")


def _inductor(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    manager: DsparkPassManager,
    mode: str | None,
    options: dict[str, Any],
) -> Callable[..., Any]:
    from torch._dynamo.utils import counters
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    patches = dict(torch._inductor.list_mode_options(mode)) if mode else {}
    patches.update(options)
    patches["post_grad_custom_post_pass"] = manager
    inner_calls = 0

    def inner_compile(graph: fx.GraphModule, inputs: Sequence[Any], **kwargs: Any) -> Any:
        """Inductor's compile of one graph (a forward, or a backward at the first backward), noting a graph that
        its FX graph cache served without running the pass."""
        nonlocal inner_calls
        inner_calls += 1
        runs, hits = manager.runs, _cache_hits(counters)
        compiled = compile_fx_inner(graph, inputs, **kwargs)
        if manager.runs == runs:
            _log_pass_not_run(graph, manager, _new_hits(counters, hits))
        return compiled

    hits = _cache_hits(counters)
    compiled = compile_fx(gm, example_inputs, config_patches=patches, inner_compile=inner_compile)
    if not inner_calls and not manager.runs:  # the AOTAutograd cache served every graph of it
        _log_pass_not_run(gm, manager, _new_hits(counters, hits))
    return compiled


def _new_hits(counters: Any, before: dict[str, int]) -> list[str]:
    return [cache for cache, n in _cache_hits(counters).items() if n > before[cache]]


def _cache_hits(counters: Any) -> dict[str, int]:
    return {
        "FX graph cache": counters["inductor"]["fxgraph_cache_hit"],
        "AOTAutograd cache": counters["aot_autograd"]["autograd_cache_hit"],
    }


def _log_pass_not_run(gm: fx.GraphModule, manager: DsparkPassManager, caches: list[str]) -> None:
    """A cache hit skips the post-grad passes; say so, so that every compile of the backend leaves a log line (and
    count it: one per graph from the FX graph cache, one per Dynamo graph from the AOTAutograd cache)."""
    from torch._dynamo.utils import counters

    compile_id = torch._guards.CompileContext.current_compile_id()
    graph = f"graph {compile_id} ({len(gm.graph.nodes)} nodes)"
    if not caches:
        log.info("dspark_fx: the pass did not run for %s (and Inductor counted no cache hit)", graph)
        return
    counters["dspark_fx"]["graphs_from_cache"] += 1
    uuid = manager.uuid()
    log.info(
        "dspark_fx: %s: cache hit (%s): Inductor reuses a graph compiled earlier by this same pass (pass uuid %s, "
        "part of the cache key), so the pass did not run now and there is no report or diff for it "
        "(dspark_fx.explain() or dspark_fx.testing.CaptureBackend show them)",
        graph,
        " and ".join(caches),
        uuid.hex()[:16] if isinstance(uuid, bytes) else uuid,
    )


def _aot_eager(gm: fx.GraphModule, example_inputs: Sequence[Any], manager: DsparkPassManager) -> Callable[..., Any]:
    from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func
    from torch._inductor.decomposition import select_decomp_table

    def compiler(fw: fx.GraphModule, _inputs: Sequence[Any], is_inference: bool):
        manager(fw.graph, is_inference=is_inference)
        fw.recompile()
        return make_boxed_func(fw.forward)

    return aot_module_simplified(
        gm,
        list(example_inputs),
        fw_compiler=functools.partial(compiler, is_inference=False),
        inference_compiler=functools.partial(compiler, is_inference=True),
        decompositions=select_decomp_table(),
        keep_inference_input_mutations=True,
    )


def dspark_backend(
    gm: fx.GraphModule, example_inputs: Sequence[Any], mode: str | None = None, options: dict[str, Any] | None = None
) -> Callable[..., Any]:
    """The default backend: `torch.compile(model, backend=dspark_backend)` (accepts `mode=`/`options=`)."""
    return _DEFAULT(gm, example_inputs, mode=mode, options=options)


_DEFAULT = DsparkBackend()
