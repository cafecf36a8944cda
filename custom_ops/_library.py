"""The `dspark` op namespace and `register_op`, the one way every op of `custom_ops` is registered.

An op module states, per op, its schema, its reference implementation and its fake impl in one call:

    register_op(
        "store_flashmla_cache(Tensor kv, Tensor out_loc, Tensor(a!) kvcache, int page_size) -> ()",
        reference=_store_cpu,
        fake=_check_store,
    )

`register_op` defines the schema (aliasing annotations such as `Tensor(a!)` are how mutated arguments are
declared), registers the reference under its dispatch key, the fake impl, and the CUDA entry described below.

How a call reaches an implementation, and why:

* CPU tensors run the reference, registered under the `CPU` key: plain torch, with every structural and value
  check of the op.
* Fake and meta tensors (`torch.compile`, `opcheck`) run the fake impl: the same structural checks, then empty
  outputs of the right shapes (first making sure Inductor keeps the storage offsets of written views:
  `_inductor_offsets`). `torch.compile(fullgraph=True)` needs nothing else (the op is opaque to Dynamo);
  Inductor's generated code calls `torch.ops.dspark.*`, i.e. the paths below.
* CUDA tensors run the C++ launchers that the CUDA library registers with `TORCH_LIBRARY_IMPL(dspark, CUDA, m)`
  under the `CUDA` key. Until that library is loaded, the dispatcher finds no `CUDA` kernel and falls back to a
  small Python *entry* registered under `CompositeExplicitAutograd`: it builds (first time only) and loads the
  library (`custom_ops._build`), then re-dispatches the call. A backend-key kernel takes precedence over
  `CompositeExplicitAutograd`, so from then on every CUDA call goes straight to C++: no Python on the hot path,
  no "overriding a kernel" warning (the keys differ), and nothing for the user to call. `import custom_ops` also
  loads an already built library directly (`_build.load_prebuilt`), so after `python -m custom_ops.build` even the
  first call is a plain C++ dispatch. The launchers use the current CUDA stream, do no host syncs and no
  allocations besides op outputs, so they are CUDA-graph capturable (warm up once before capturing so the
  build/load happens outside the capture).
* The DeepSeek-V4 planners register their reference under `CompositeExplicitAutograd` instead
  (`reference_key="CompositeExplicitAutograd"`): sync-free, fixed-shape torch ops that serve CPU and CUDA tensors
  alike. Such an op gets no entry (the reference holds that key); its reference serves CUDA tensors until the
  library is loaded, and the `CUDA` kernel takes precedence after.
* The CUDA-only debug ops (`_multi_linear_variant`, `_multi_linear_cublas`) register a CPU "reference" that only
  raises `NotImplementedError` saying so, and no fake impl; an op without a reference would get just the schema
  and the entry.

Alternatives rejected: a pybind module called from a Python CUDA impl (Python overhead on every eager call and
on every call from Inductor's wrapper); eager build at import (a minute of nvcc for users who never touch CUDA,
and `import custom_ops` would fail on machines without a toolkit).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from custom_ops._inductor_offsets import ensure_storage_offset_lowering

__all__ = ["LIB", "NOT_DIFFERENTIABLE", "REFERENCE_KEYS", "register_op"]

LIB = torch.library.Library("dspark", "DEF")
REFERENCE_KEYS = ("CPU", "CompositeExplicitAutograd")
NOT_DIFFERENTIABLE: list[str] = []  # the ops registered without a derivative (csrc/common/not_differentiable.cpp)

# After LIB: importing `_build` loads an already built CUDA library, whose kernels register into this namespace.
from custom_ops import _build  # noqa: E402


def register_op(
    schema: str,
    *,
    reference: Callable[..., object] | None = None,
    fake: Callable[..., object] | None = None,
    reference_key: str = "CPU",
    backward: Callable[..., object] | None = None,
    setup_context: Callable[..., object] | None = None,
) -> str:
    """Register `dspark::<schema>` and return the op's name.

    - `schema`: the op's schema without the namespace, e.g. `"op(Tensor x, Tensor(a!) out) -> ()"`;
    - `reference`: the implementation registered under `reference_key` (None: the op has none, CUDA only);
    - `fake`: the fake impl for fake and meta tensors (None: the op cannot be traced);
    - `reference_key`: `"CPU"` (the default; the op also gets the CUDA entry) or `"CompositeExplicitAutograd"`
      (a reference that serves every device; no entry);
    - `backward`, `setup_context`: the op's derivative on every device (`torch.library.register_autograd`; None:
      the op has no derivative, and a tensor argument that requires grad raises while grad mode is on:
      `_not_differentiable`).
    """
    if reference_key not in REFERENCE_KEYS:
        raise ValueError(f"reference_key: expected one of {REFERENCE_KEYS}, got {reference_key!r}")
    name = schema.split("(", 1)[0].strip()
    LIB.define(schema)
    if reference is not None:
        LIB.impl(name, reference, reference_key)
    if fake is not None:
        torch.library.register_fake(f"dspark::{name}", _tracing(fake), lib=LIB)
    if reference_key != "CompositeExplicitAutograd":
        LIB.impl(name, _cuda_entry(name), "CompositeExplicitAutograd")
    if backward is not None:
        torch.library.register_autograd(f"dspark::{name}", backward, setup_context=setup_context, lib=LIB)
    else:
        LIB.impl(name, _not_differentiable(name), "Autograd", with_keyset=True)
        NOT_DIFFERENTIABLE.append(name)
    return name


def _tracing(fake: Callable[..., object]) -> Callable[..., object]:
    """`fake`, first making sure Inductor will keep the storage offsets of the views the op writes
    (`custom_ops._inductor_offsets`): a fake impl runs whenever a graph with the op is traced."""

    @functools.wraps(fake)
    def traced(*args: object, **kwargs: object) -> object:
        ensure_storage_offset_lowering()
        return fake(*args, **kwargs)

    return traced


def _not_differentiable(name: str) -> Callable[..., object]:
    """The `Autograd` kernel of an op without a derivative: with grad mode on, a tensor argument that requires grad
    raises `ValueError` naming it (eagerly, and on fake tensors when AOTAutograd traces a compiled graph), instead of
    a gradient that torch would derive from the CPU reference's math, drop in a compiled graph, or route through a
    cache row the op overwrote. Otherwise it bumps the version counters of the arguments the schema marks written
    (`(a!)`: nothing else would, the kernels write memory directly, so autograd sees a saved tensor change) and
    dispatches below autograd. Under `torch.inference_mode()` the dispatcher skips this kernel. The CUDA library
    registers the same rule in C++ directly under `AutogradCUDA` (csrc/common/not_differentiable.cpp), which takes
    precedence for CUDA tensors once it is loaded, so eager CUDA calls run no Python here."""
    op = getattr(torch.ops.dspark, name).default
    arguments = op._schema.arguments
    every = [(i, a.name) for i, a in enumerate(arguments)]
    written = [(i, a.name) for i, a in enumerate(arguments) if a.alias_info is not None and a.alias_info.is_write]

    def argument(args: tuple, kwargs: dict, index: int, arg_name: str) -> list[torch.Tensor]:
        value = args[index] if index < len(args) else kwargs.get(arg_name)
        values = value if isinstance(value, (list, tuple)) else (value,)
        return [t for t in values if isinstance(t, torch.Tensor)]

    below_autograd = torch._C._after_autograd_keyset
    is_grad_enabled = torch.is_grad_enabled

    def kernel(keyset: torch._C.DispatchKeySet, *args: object, **kwargs: object) -> object:
        if is_grad_enabled():
            for index, arg_name in every:
                if any(t.requires_grad for t in argument(args, kwargs, index, arg_name)):
                    raise ValueError(
                        f"{name}: {arg_name} requires grad, but dspark::{name} has no derivative: call it under "
                        f"torch.no_grad() or torch.inference_mode(), or pass {arg_name}.detach()"
                    )
        for index, arg_name in written:
            for t in argument(args, kwargs, index, arg_name):
                if not t.is_inference():  # an inference tensor has no version counter
                    torch.autograd.graph.increment_version(t)
        # no argument requires grad (or grad mode is off), so nothing below records a graph: no guard needed
        return op.redispatch(keyset & below_autograd, *args, **kwargs)

    return kernel


def _cuda_entry(name: str) -> Callable[..., object]:
    """The first-use entry of `dspark::<name>` for devices without a direct kernel (see the module docstring)."""
    qualname = f"dspark::{name}"

    def entry(*args: object, **kwargs: object) -> object:
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        # The first non-CPU tensor picks the backend (a CPU tensor mixed into a CUDA call reaches the binding, whose
        # device check names it).
        device = next((t.device for t in tensors if t.device.type != "cpu"), tensors[0].device)
        if device.type != "cuda":
            raise NotImplementedError(f"{qualname} has CPU and CUDA kernels only, got a tensor on {device}")
        _build.load()
        if not torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CUDA"):
            raise _build.BuildError(
                f"the dspark CUDA library {_build.library_path()} registered no CUDA kernel for {qualname}"
            )
        op: Callable[..., object] = getattr(torch.ops.dspark, name).default
        return op(*args, **kwargs)

    return entry
