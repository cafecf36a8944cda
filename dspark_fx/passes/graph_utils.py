"""Small FX helpers shared by the passes: fake-value propagation, node descriptions, view handling."""

from __future__ import annotations

import copy
import operator
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves, tree_map

aten = torch.ops.aten


def fake_mode_of(graph: fx.Graph) -> Any:
    vals = [n.meta.get("val") for n in graph.nodes if n.op == "placeholder"]
    return torch._guards.detect_fake_mode(vals)


def val_of(node: fx.Node) -> Any:
    return node.meta.get("val")


def tensor_val(node: Any) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def shape_key(node: fx.Node) -> str:
    """A guard-free description of a node's value (shape as text: comparing SymInts would add guards)."""
    val = val_of(node)
    if isinstance(val, torch.Tensor):
        return f"{val.dtype}{list(val.shape)}"
    if isinstance(val, (list, tuple)):
        return "(" + ",".join(f"{v.dtype}{list(v.shape)}" for v in val if isinstance(v, torch.Tensor)) + ")"
    return type(val).__name__


def call(graph: fx.Graph, target: Any, args: tuple, kwargs: dict | None = None) -> fx.Node:
    """Create a call_function node and give it a fake `meta["val"]` computed from its inputs' values."""
    node = graph.call_function(target, args, kwargs or {})
    propagate_val(graph, node)
    return node


def propagate_val(graph: fx.Graph, node: fx.Node) -> None:
    to_val = lambda a: val_of(a) if isinstance(a, fx.Node) else a
    args = tree_map(to_val, node.args)
    kwargs = tree_map(to_val, node.kwargs)
    if node.target is operator.getitem:
        node.meta["val"] = operator.getitem(*args)
        return
    with fake_mode_of(graph):
        node.meta["val"] = node.target(*args, **kwargs)


def gemm_activation(gemm: fx.Node) -> fx.Node:
    """The activation operand of an `mm(x, w)` or `addmm(bias, x, w)` node."""
    return gemm.args[1] if gemm.target is aten.addmm.default else gemm.args[0]


def op_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}"
    return getattr(target, "__name__", str(target))


def is_pure(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    target = node.target
    if target is operator.getitem or getattr(target, "__module__", None) == "_operator":
        return True  # getitem and symbolic-size arithmetic (floordiv, mul, ... on SymInts)
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded in target.tags:
        return False
    return not target._schema.is_mutable


_VIEWS = (aten.view.default, aten._unsafe_view.default)
_STORAGE_READERS = (aten.as_strided.default, aten.view.dtype)


def is_view(node: Any) -> bool:
    """Whether `node` is a view of its first argument: an op whose schema returns an alias of that input, which it
    does not write (`Tensor(a)`: view, slice, select, squeeze, t, diagonal, unfold, expand, split, alias, as_strided,
    ...; `reshape` too, which may be one), or an item of such an op's list (a piece of a `split` or `unbind`)."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or not node.args:
        return False
    if not isinstance(node.args[0], fx.Node):
        return False
    target = node.target
    if target is operator.getitem:
        return is_view(node.args[0])
    if target in _VIEWS or target is aten.reshape.default:  # `_unsafe_view` declares no alias, but is one
        return True
    if not isinstance(target, torch._ops.OpOverload) or not target._schema.returns or not target._schema.arguments:
        return False
    alias, first = target._schema.returns[0].alias_info, target._schema.arguments[0].alias_info
    if alias is None or alias.is_write or first is None:
        return False
    # the alias is of the first argument (a list's, `Tensor(a)[]`, names its set on the elements)
    return not alias.before_set or bool(alias.before_set & first.before_set)


def views_to_reshapes(nodes: list[fx.Node]) -> None:
    """`view`/`_unsafe_view` among `nodes` become `reshape`: the same values, without needing the strides the view
    was traced with (a column block of the fused GEMM output, or a branch slice of a batched value, has other
    strides, and a flattening view of it does not exist). Inductor lowers both alike; eager `reshape` copies
    only when it must."""
    for node in nodes:
        if node.target in _VIEWS:
            node.target = aten.reshape.default


def written_args(node: fx.Node) -> list[fx.Node]:
    """The nodes `node` passes as arguments its schema marks as written (`Tensor(a!)`: in-place and `.out` ops,
    `copy_` into an input, custom ops with `mutates_args`)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or not target._schema.is_mutable:
        return []
    written = []
    for i, argument in enumerate(target._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = node.args[i] if i < len(node.args) and not argument.kwarg_only else node.kwargs.get(argument.name)
        written += [v for v in tree_leaves(value) if isinstance(v, fx.Node)]
    return written


def storage_family(nodes: Any) -> set[fx.Node]:
    """The nodes that share storage with any of `nodes`: each one's base (through the view ops above it) and
    every view of those bases (and views of views)."""
    family: set[fx.Node] = set()
    stack = []
    for node in nodes:
        while is_view(node):
            node = node.args[0]
        stack.append(node)
    while stack:
        node = stack.pop()
        if node not in family:
            family.add(node)
            stack += [u for u in node.users if is_view(u) and u.args[0] is node]
    return family


def reads_storage_layout(node: fx.Node) -> bool:
    """Whether a value (or a view of it) is read by an op whose result depends on its strides or storage
    (`as_strided`, a dtype view); such a value cannot be replaced by a slice of another tensor."""
    for user in node.users:
        if user.target in _STORAGE_READERS:
            return True
        if is_view(user) and user.args[0] is node and reads_storage_layout(user):
            return True
    return False


def source_line(node: fx.Node) -> str | None:
    """`file:line: code` of the model line that made `node` (the last frame of its `stack_trace`), if recorded."""
    trace = node.meta.get("stack_trace")
    if not trace:
        return None
    lines = trace.rstrip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        text = lines[i].strip()
        if text.startswith("File "):
            parts = text.split('"')
            where = parts[1].rsplit("/", 1)[-1] if len(parts) > 2 else text
            line = text.split(", line ")[1].split(",")[0] if ", line " in text else "?"
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            return f"{where}:{line}: {code}"
    return None


def copy_graph(graph: fx.Graph) -> fx.Graph:
    """A copy of `graph` (its nodes' meta shared shallowly, as `node_copy` does)."""
    new = fx.Graph()
    output = new.graph_copy(graph, {})
    new.output(output).meta = copy.copy(graph.output_node().meta)
    return new


def restore_graph(graph: fx.Graph, snapshot: fx.Graph) -> None:
    """Make `graph` hold the nodes of `snapshot` (a `copy_graph` of it) again, in place: the object the caller
    (Inductor) holds stays the same; names, placeholder targets, node meta and the order of the nodes are the
    snapshot's. FX keeps an erased node's name taken; the names are released in its namespace (a private attribute:
    where a torch version lacks it, the restored nodes get suffixed names, which changes nothing that runs)."""
    for node in list(reversed(graph.nodes)):
        graph.erase_node(node)
    used_names = getattr(getattr(graph, "_graph_namespace", None), "_used_names", None)
    if isinstance(used_names, set):
        used_names.difference_update(node.name for node in snapshot.nodes)
    output = graph.graph_copy(snapshot, {})
    graph.output(output).meta = copy.copy(snapshot.output_node().meta)
