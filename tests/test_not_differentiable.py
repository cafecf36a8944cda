"""Ops without a derivative (every `dspark` op but `multi_linear`) refuse arguments that require grad while grad mode
is on, on every path: eagerly (where torch would otherwise differentiate the CPU reference's math, with a warning),
under torch.compile (where the gradient would silently be missing) and for written caches (where a gradient would
reach a row the op overwrote). Under `torch.no_grad()` they run as on detached arguments; under
`torch.inference_mode()` the check is not even reached."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from bad_argument_cases import VALID_ARGS, argument_named
from helpers import LayoutKeepingMove
from multi_linear_cases import bits

from custom_ops import _build
from custom_ops._library import NOT_DIFFERENTIABLE

ROOT = Path(__file__).resolve().parents[1]

ops = torch.ops.dspark
WITH_VALID_ARGS = sorted(op for op in VALID_ARGS if op != "multi_linear")


def _tensors(value: object) -> list[torch.Tensor]:
    """The tensors of an argument (a tensor or a list of them), of an op's outputs, or of a dict of arguments."""
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return [value] if isinstance(value, torch.Tensor) else []


def _differentiable_cases() -> list[tuple[str, str]]:
    return [
        (op, name)
        for op in WITH_VALID_ARGS
        for name, value in VALID_ARGS[op]().items()
        if any(t.is_floating_point() for t in _tensors(value))
    ]


def _map(value: object, fn) -> object:
    if isinstance(value, (list, tuple)):
        return type(value)(_map(v, fn) for v in value)
    return fn(value) if isinstance(value, torch.Tensor) else value


def _requiring_grad(value: object) -> object:
    """`value` (a tensor or a list of them) with every floating tensor a fresh leaf that requires grad."""
    return _map(value, lambda t: t.detach().clone().requires_grad_() if t.is_floating_point() else t)


def _snapshot(args: dict) -> list[torch.Tensor]:
    return [t.detach().clone() for t in _tensors(args)]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(bits(x), bits(y)) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(("op", "name"), _differentiable_cases(), ids=lambda v: str(v))
def test_an_argument_that_requires_grad_raises_naming_it_before_anything_is_written(op, name):
    args = VALID_ARGS[op]()
    args[name] = _requiring_grad(args[name])
    before = _snapshot(args)
    with pytest.raises(ValueError, match=f"^{op}: {name} requires grad, but dspark::{op} has no derivative") as info:
        getattr(ops, op)(**args)
    assert argument_named(str(info.value)) == name
    assert _same(_tensors(args), before)


@pytest.mark.parametrize("op", WITH_VALID_ARGS)
def test_under_no_grad_arguments_that_require_grad_run_as_detached(op):
    """The same values and written bytes as a call on detached copies; no output requires grad."""
    args, twin = VALID_ARGS[op](), VALID_ARGS[op]()
    args = {name: _requiring_grad(value) for name, value in args.items()}
    with torch.no_grad():
        got = getattr(ops, op)(**args)
    want = getattr(ops, op)(**twin)
    assert not any(t.requires_grad for t in _tensors(got))
    assert _same(_tensors(got), _tensors(want))
    assert _same(_tensors(args), _tensors(twin))


def test_inference_mode_skips_the_check():
    args = {name: _requiring_grad(value) for name, value in VALID_ARGS["fused_norm_rope_inplace"]().items()}
    with torch.inference_mode():
        ops.fused_norm_rope_inplace(**args)


def test_a_compiled_graph_raises_the_same_error():
    """Traced by AOTAutograd with grad mode on, the op is refused when the graph is compiled (a returned output and
    a written argument), where the gradient would otherwise be missing without a word."""
    op = "fused_q_indexer_rope_hadamard_quant"
    args = VALID_ARGS[op]()
    args["weight"] = _requiring_grad(args["weight"])

    def returned(**kw):
        return getattr(ops, op)(**kw)[1] * 2

    with pytest.raises(Exception, match=f"{op}: weight requires grad"):
        torch.compile(returned, backend="aot_eager", fullgraph=True)(**args)

    _assert_compiled_write_refused("cpu")


def _assert_compiled_write_refused(device: str) -> None:
    """A compiled graph that writes `fused_norm_rope_inplace` into a value that requires grad raises the op's
    error."""
    move = LayoutKeepingMove(device)
    args = {k: _map(v, move) for k, v in VALID_ARGS["fused_norm_rope_inplace"]().items()}
    kv = _requiring_grad(args.pop("kv"))

    def written(kv, **kw):
        x = kv * 1
        ops.fused_norm_rope_inplace(x, **kw)
        return x

    with pytest.raises(Exception, match="fused_norm_rope_inplace: kv requires grad"):
        torch.compile(written, backend="aot_eager", fullgraph=True)(kv, **args)


def test_a_write_under_no_grad_still_invalidates_a_saved_tensor():
    """The written argument's version counter is bumped, so a backward through a tensor saved before the write
    raises torch's in-place error instead of using the new values."""
    args = VALID_ARGS["fused_norm_rope_inplace"]()
    base = args["kv"].detach().clone().requires_grad_()
    kv = base * 2
    saved = kv.sin()  # saves kv
    with torch.no_grad():
        ops.fused_norm_rope_inplace(**{**args, "kv": kv})
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.sum().backward()


@pytest.mark.parametrize("op", WITH_VALID_ARGS)
def test_every_written_argument_gets_its_version_bumped(op):
    """On meta tensors (no reference runs, so nothing else bumps them; the CUDA kernels are alike: they write memory
    directly) each argument the schema marks written gets a new version, the others keep theirs."""
    args = {k: _map(v, lambda t: t.to("meta")) for k, v in VALID_ARGS[op]().items()}
    schema = getattr(ops, op).default._schema
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    before = {name: [t._version for t in _tensors(v)] for name, v in args.items()}
    with torch.no_grad():
        getattr(ops, op)(**args)
    for name, value in args.items():
        after = [t._version for t in _tensors(value)]
        assert all((a > b) == (name in written) for a, b in zip(after, before[name], strict=True)), (name, after)


def test_multi_linear_stays_differentiable():
    args = VALID_ARGS["multi_linear"]()
    x = _requiring_grad(args["x"])
    out = ops.multi_linear(**{**args, "x": x})
    out.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


# ---------------------------------------------------------------------------------------------- CUDA


def test_the_cuda_library_refuses_grad_for_exactly_the_ops_without_a_derivative():
    """csrc/common/not_differentiable.cpp lists the ops it registers its AutogradCUDA kernel for: every op
    `register_op` registered without a derivative, and not `multi_linear` (whose derivative it would hide)."""
    source = (ROOT / "custom_ops" / "csrc" / "common" / "not_differentiable.cpp").read_text()
    listed = re.search(r"kNotDifferentiable\[\] = \{(.*?)\};", source, re.S).group(1)
    names = sorted(re.findall(r'"(\w+)"', listed))
    every = sorted(n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("dspark::"))
    assert names == sorted(NOT_DIFFERENTIABLE) == [n for n in every if n != "multi_linear"]


@pytest.fixture
def cuda_library():
    _build.load()


@pytest.mark.cuda
@pytest.mark.parametrize(("op", "name"), _differentiable_cases(), ids=lambda v: str(v))
def test_on_cuda_the_cpp_kernel_raises_the_same_error(op, name, cuda_library):
    assert "not_differentiable.cpp" in next(
        line for line in torch._C._dispatch_dump(f"dspark::{op}").splitlines() if line.startswith("AutogradCUDA")
    )
    move = LayoutKeepingMove("cuda")
    args = {k: _map(v, move) for k, v in VALID_ARGS[op]().items()}
    args[name] = _requiring_grad(args[name])
    before = _snapshot(args)
    with pytest.raises(ValueError, match=f"^{op}: {name} requires grad, but dspark::{op} has no derivative"):
        getattr(ops, op)(**args)
    torch.cuda.synchronize()
    assert _same(_tensors(args), before)


@pytest.mark.cuda
def test_on_cuda_no_grad_writes_and_bumps_the_version(cuda_library):
    move = LayoutKeepingMove("cuda")
    args = {k: _map(v, move) for k, v in VALID_ARGS["fused_norm_rope_inplace"]().items()}
    twin = {k: _map(v, move) for k, v in VALID_ARGS["fused_norm_rope_inplace"]().items()}
    base = args["kv"].detach().clone().requires_grad_()
    kv = base * 1
    saved = kv.sin()
    with torch.no_grad():
        ops.fused_norm_rope_inplace(**{**args, "kv": kv})
    ops.fused_norm_rope_inplace(**twin)
    assert torch.equal(bits(kv), bits(twin["kv"]))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.sum().backward()


@pytest.mark.cuda
def test_on_cuda_a_compiled_graph_raises(cuda_library):
    _assert_compiled_write_refused("cuda")
