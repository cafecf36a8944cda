"""`explain(model, *args, **kwargs)`: what the dspark_fx passes fuse in a model, and why they leave the rest.

The model is compiled once, in isolation, with a backend of its own (AOTAutograd, no Inductor codegen): Dynamo
traces a fresh copy of the code object it starts from (the module's `forward`, or the function), so its caches
and automatic-dynamic state for every other compiled model, even one of the same class, stay as they were, and
Dynamo is never reset. (A graph break inside a function the entry calls makes Dynamo compile that function's own
frames too: those get entries for explain's backend, as with any other backend, and keep them.)
"""

from __future__ import annotations

import collections
import copy
import types
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from dspark_fx.backend import DsparkBackend
from dspark_fx.config import DsparkConfig, as_config
from dspark_fx.report import FusionReport


def explain(
    model: torch.nn.Module | Callable[..., Any],
    /,
    *example_args: Any,
    config: DsparkConfig | Mapping[str, Any] | None = None,
    **example_kwargs: Any,
) -> FusionReport:
    """Trace `model(*example_args, **example_kwargs)` once and return the merged fusion report of its graphs.

    `model` is an `nn.Module` (or what `torch.compile` made of one) or a function (a keyword input cannot be called
    `config`). It runs under the caller's grad mode, as a compile there would: with grad enabled and parameters
    that require grad, AOTAutograd makes a training graph, which writes no cache in the graph (the report says
    why nothing is lowered). Afterwards the module's parameters and buffers (persistent or not: a KV cache), its
    attributes (none added), the tensors in them and in the inputs (lists, tuples, dicts and the attributes of plain
    objects there, `__slots__` too), what those lists, dicts and objects hold (an element, key or attribute tracing
    rebinds: an HF cache layer's concatenated keys, a step counter), the random number generators, Dynamo's recorded
    sizes and `counters["dspark_fx"]` are as they were (tensors a function reaches otherwise, e.g. globals, are not
    restored). A module compiled in place or by `torch.compile`, or a function made by `torch.compile`, is explained
    as the module or function, with this `config`. A model with uninitialized lazy parameters is refused
    (`ValueError`): tracing would initialize them. With `colocate_weights` on, the report says which weight groups a
    compile would move (`colocated`), and none is moved."""
    config = as_config(config, "explain")
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):  # torch.compile(module): explain the module
        model = model._orig_mod
    model = getattr(model, "_torchdynamo_orig_callable", model)  # torch.compile(function): explain the function
    if not callable(model):
        raise TypeError(f"explain: model must be an nn.Module or a function, got {type(model).__name__}")
    reports: list[FusionReport] = []
    backend = DsparkBackend(
        config, inner="aot_eager", observer=lambda _before, _after, report: reports.append(report), move_weights=False
    )
    # automatic_dynamic_shapes=False: do not read the sizes other compiles of the same code recorded; and what
    # Dynamo records of this trace's sizes (keyed by the code's file, line and name, which the fresh code shares) is
    # put back as it was
    with (
        _restored(model, (example_args, example_kwargs)),
        torch.random.fork_rng(_current_cuda_devices(), device_type="cuda"),  # dropout and the like draw numbers
        _recorded_sizes_kept(),
        _fresh_code(model) as entry,
        torch._dynamo.config.patch(automatic_dynamic_shapes=False),
    ):
        torch.compile(entry, backend=backend, fullgraph=False)(*example_args, **example_kwargs)
    report = FusionReport()
    for part in reports:
        report.merge(part)
    return report


@contextmanager
def _recorded_sizes_kept() -> Iterator[None]:
    """Dynamo's record of the sizes each code saw (`torch._dynamo.pgo`, what makes a second size compile a dynamic
    graph), as it was before."""
    from torch._dynamo import pgo

    state, init = pgo._CODE_STATE, pgo._INIT_CODE_STATE
    saved = copy.deepcopy(dict(state)) if state is not None else {}
    try:
        yield
    finally:
        if state is not None:
            state.clear()
            state.update(saved)
        pgo._CODE_STATE, pgo._INIT_CODE_STATE = state, init


def _current_cuda_devices() -> list[int]:
    return [torch.cuda.current_device()] if torch.cuda.is_initialized() else []


def _plain_object(value: Any) -> bool:
    """An object whose attributes explain() looks into: not a tensor, module, class, function or Python module,
    with a `__dict__` or `__slots__` (a `@dataclass(slots=True)` cache)."""
    opaque = (torch.Tensor, torch.nn.Module, type, types.ModuleType, types.FunctionType, types.MethodType)
    if isinstance(value, opaque):
        return False
    return isinstance(getattr(value, "__dict__", None), dict) or bool(_slot_names(value))


def _slot_names(value: Any) -> list[str]:
    names = []
    for cls in type(value).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        names += [slots] if isinstance(slots, str) else [n for n in slots if n not in ("__dict__", "__weakref__")]
    return names


def _object_state(value: Any) -> dict[str, Any]:
    """The attributes a plain object has: its `__dict__` and its slots that are set."""
    state = dict(vars(value)) if isinstance(getattr(value, "__dict__", None), dict) else {}
    for name in _slot_names(value):
        if hasattr(value, name):
            state[name] = getattr(value, name)
    return state


def _reachable(values: Any, depth: int = 4) -> tuple[list[torch.Tensor], list[tuple[Any, Any]]]:
    """The tensors among `values` and every list, dict and plain object there, each with a shallow copy of what it
    holds (what tracing can rebind: an element, a key, an attribute; HF's cache layers concatenate into new
    tensors, a step counter goes up). Tuples, lists, deques and dicts are looked into, and the attributes of plain
    objects down to `depth` objects deep (a cache object holding per-layer objects holding tensors, as HF's caches
    do); modules are left to their parameters and buffers, classes, functions and Python modules are not looked
    into."""
    tensors: list[torch.Tensor] = []
    containers: list[tuple[Any, Any]] = []
    seen: set[int] = set()
    stack = [(values, depth)]
    while stack:
        value, left = stack.pop()
        if isinstance(value, torch.Tensor):
            tensors.append(value)
            continue
        if isinstance(value, (str, bytes, int, float, bool)) or value is None or id(value) in seen:
            continue
        if isinstance(value, (tuple, collections.deque)):
            stack += [(v, left) for v in value]
        elif isinstance(value, list):
            seen.add(id(value))
            containers.append((value, list(value)))
            stack += [(v, left) for v in value]
        elif isinstance(value, dict):
            seen.add(id(value))
            containers.append((value, dict(value)))
            stack += [(v, left) for v in value.values()]
        elif left > 0 and _plain_object(value):
            seen.add(id(value))
            state = _object_state(value)
            containers.append((value, state))
            stack += [(v, left - 1) for v in state.values()]
    return tensors, containers


def _put_back_container(container: Any, saved: Any) -> None:
    """Make `container` hold what `saved` (from `_reachable`) says it held, keeping the object."""
    if isinstance(container, list):
        if len(container) != len(saved) or any(a is not b for a, b in zip(container, saved, strict=False)):
            container[:] = saved
    elif isinstance(container, dict):
        _refill(container, saved)
    else:
        slots = _slot_names(container)
        if isinstance(getattr(container, "__dict__", None), dict):
            _refill(vars(container), {k: v for k, v in saved.items() if k not in slots})
        for name in slots:
            if name in saved:
                setattr(container, name, saved[name])
            elif hasattr(container, name):
                delattr(container, name)


def _fresh_function(func: types.FunctionType) -> types.FunctionType:
    """`func` with a copy of its code object: Dynamo keeps its cache entries on the code object."""
    fresh = types.FunctionType(
        func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__, func.__closure__
    )
    fresh.__kwdefaults__ = func.__kwdefaults__
    fresh.__dict__.update(func.__dict__)
    return fresh


@contextmanager
def _fresh_code(model: Any) -> Iterator[Any]:
    """What to compile: the module with its `forward` (for the duration) or the function on fresh code."""
    if isinstance(model, torch.nn.Module):
        func = getattr(model.forward, "__func__", None)
        if not isinstance(func, types.FunctionType):
            yield model
            return
        had_own = "forward" in vars(model)
        own = vars(model).get("forward")
        compiled_call = getattr(model, "_compiled_call_impl", None)  # nn.Module.compile(): calls go to that
        model.forward = types.MethodType(_fresh_function(func), model)
        model._compiled_call_impl = None
        try:
            yield model
        finally:
            model._compiled_call_impl = compiled_call
            if had_own:
                model.forward = own
            else:
                del model.forward
    elif isinstance(model, types.FunctionType):
        yield _fresh_function(model)
    elif isinstance(model, types.MethodType) and isinstance(model.__func__, types.FunctionType):
        yield types.MethodType(_fresh_function(model.__func__), model.__self__)
    else:
        yield model


def _module_of(model: Any) -> torch.nn.Module | None:
    if isinstance(model, torch.nn.Module):
        return model
    owner = getattr(model, "__self__", None)  # a bound method of a module (`explain(model.forward, ...)`)
    return owner if isinstance(owner, torch.nn.Module) else None


@contextmanager
def _restored(model: Any, inputs: Any) -> Iterator[None]:
    """Put back what tracing `model` changes: the contents of its module's parameters and buffers and of the input
    tensors (by identity, in place, only those tracing wrote: an untouched tensor keeps its version counter, so a
    pending backward still works, and broadcast inputs or inference tensors are not written; a tensor written with
    values that require grad is made the leaf it was), the module attributes it rebinds, and the dspark_fx
    counters. Every tensor is put back even if one cannot be (the first error is raised afterwards)."""
    from torch._dynamo.utils import counters

    counts = dict(counters["dspark_fx"])
    module = _module_of(model)
    tensors, containers = _reachable(inputs)
    attributes = []
    if module is not None:  # every module's attributes: its parameters, buffers, tensor attributes, cache objects
        attributes = [(m, dict(vars(m)), dict(m._parameters), dict(m._buffers)) for m in module.modules()]
        held = [v for _, attrs, _, _ in attributes for k, v in attrs.items() if k not in _MODULE_TABLES]
        held_tensors, held_containers = _reachable([v for v in held if not isinstance(v, torch.nn.Module)])
        tensors += held_tensors + [t for _, _, p, b in attributes for t in (*p.values(), *b.values())]
        containers += held_containers
    _refuse_lazy(tensors)
    unique = {id(t): t for t in tensors if isinstance(t, torch.Tensor)}
    saved = [(t, t.detach().clone(), _version(t), t.requires_grad, t.grad_fn is None) for t in unique.values()]
    try:
        yield
    finally:
        errors = []
        try:
            for m, attrs, params, buffers in attributes:
                vars(m).clear()  # and without the attributes tracing added
                vars(m).update(attrs)
                _refill(m._parameters, params)
                _refill(m._buffers, buffers)
            for container, held in containers:
                _put_back_container(container, held)
            for tensor, copy, version, requires_grad, leaf in saved:
                try:
                    _put_back(tensor, copy, version, requires_grad, leaf)
                except RuntimeError as error:
                    errors.append(error)
        finally:
            counters["dspark_fx"].clear()
            counters["dspark_fx"].update(counts)
        if errors:
            raise errors[0]


# a module's own tables, put back by `_restored` itself (`_refill`) or never rebound by a trace
_MODULE_TABLES = ("_parameters", "_buffers", "_modules")


def _refuse_lazy(tensors: list[torch.Tensor]) -> None:
    """A lazy module's uninitialized parameter has no values to save, and tracing would initialize it (and change the
    module's class), which could not be undone: refused before anything runs."""
    if any(torch.nn.parameter.is_lazy(t) for t in tensors):
        raise ValueError(
            "explain: the model has uninitialized lazy parameters (a LazyLinear or the like): call the model once "
            "(or initialize them) before explain(), so that tracing does not initialize them"
        )


def _version(tensor: torch.Tensor) -> int | None:
    """The version counter of `tensor` (None for an inference tensor, which has none)."""
    return None if tensor.is_inference() else tensor._version


def _put_back(tensor: torch.Tensor, copy: torch.Tensor, version: int | None, requires_grad: bool, leaf: bool) -> None:
    """Write `copy` back into `tensor` if tracing wrote it: its version moved (an inference tensor: its contents
    differ, written back in inference mode)."""
    if version is None:
        if not torch.equal(tensor, copy):
            with torch.inference_mode():
                tensor.copy_(copy)
        return
    if tensor._version == version:
        return
    with torch.no_grad():
        # a leaf written with values that require grad got a grad_fn: it is made a leaf again
        if leaf and tensor.grad_fn is not None and not tensor._is_view():
            tensor.detach_()
            tensor.requires_grad_(requires_grad)
        tensor.copy_(copy)


def _refill(current: dict, saved: dict) -> None:
    """Make `current` hold `saved`'s entries again, keeping the dict object (guards may hold it)."""
    if current.keys() != saved.keys() or any(current[k] is not v for k, v in saved.items()):
        current.clear()
        current.update(saved)
