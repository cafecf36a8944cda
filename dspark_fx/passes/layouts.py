"""Give the consumers that read memory the strides they had in eager, after the fusion changed them.

The fusion replaces values by views with other strides: a GEMM output by a column block of the fused output
(`slice(y, 1, a, b)`: row stride N * width), a branch's value by a `select` of the batched one, and the ATen ops
after them compute with those strides (TensorIterator keeps the input's layout) while their `meta["val"]` still
shows the eager strides. ATen ops give the same values for any strides (`as_strided` and dtype views excepted:
such values never fuse, `graph_utils.reads_storage_layout`). Other consumers may not: a custom op whose kernel
reads `data_ptr()` as dense rows, a higher-order op wrapping one (`auto_functionalized_v2` rebuilds a view of its
bases at the eager storage offset: for those the offset must be eager's too), and the graph's outputs (the caller
may `.view` them or hand them to such a kernel; a returned view of another returned value is taken again from that
value's copy, so the two still share memory, as in eager). Inductor restores eager strides for these itself;
AOTAutograd without Inductor (`inner="aot_eager"`, `explain()`, `CaptureBackend`) does not, so the pass does:

    custom(relu(select(n, 0, 1)))   ->   custom(permute(clone(permute(relu(select(n, 0, 1)), p), contiguous), p⁻¹))

(`p` the eager dim order; `clone(x, contiguous)` alone where eager was contiguous). Only where the strides now
differ (the new nodes' `meta["val"]`, and the ATen ops after them run on fake values) and the eager value was
dense (a non-dense eager value cannot be recreated by a copy and is left as is); a written argument is never
replaced by a copy, nor a collective's output before its `wait_tensor` (the copy would read the buffer before the
collective has written it). ATen consumers, the fast path, are left alone.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from dspark_fx.passes.graph_utils import aten, call, fake_mode_of, is_view, written_args

_STRIDE_AGNOSTIC = ("aten", "prims")  # namespaces whose ops compute values, whatever the input strides
_COLLECTIVES = "_c10d_functional"


def reads_memory(node: fx.Node) -> bool:
    """Whether a consumer may depend on its inputs' strides: the graph's outputs, custom ops, higher-order ops; not
    a collective's `wait_tensor`, which reads nothing (it waits for the collective that writes its argument)."""
    if node.op == "output":
        return True
    if node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.namespace not in _STRIDE_AGNOSTIC and not _is_wait(target)
    return target is not operator.getitem and getattr(target, "__module__", None) != "_operator"


def _collective(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload) and target.namespace == _COLLECTIVES


def _is_wait(target: Any) -> bool:
    return _collective(target) and target.__name__.startswith("wait_tensor")


def _in_flight(node: fx.Node) -> bool:
    """A collective's output before its `wait_tensor`: a copy of it would read the buffer before the collective
    has written it."""
    return _collective(node.target) and not _is_wait(node.target)


class EagerLayouts:
    """The graph as traced (before the pass): each node's value, inputs and target, and for every consumer that
    reads memory, the values of its arguments. `restore(graph)` afterwards gives those consumers the eager
    strides."""

    def __init__(self, graph: fx.Graph) -> None:
        self.vals = {n: n.meta.get("val") for n in graph.nodes}
        self.signatures = {n: (n.target, tuple(n.all_input_nodes)) for n in graph.nodes}
        self.consumers = {
            n: [_val(a) for a in tree_flatten((n.args, n.kwargs))[0]] for n in graph.nodes if reads_memory(n)
        }

    def restore(self, graph: fx.Graph) -> None:
        """Copy each argument of a memory-reading consumer whose strides changed into its eager layout."""
        nodes = list(graph.nodes)
        changed = self._changed(nodes)
        runtime: dict[fx.Node, Any] | None = None
        order_of = {n: i for i, n in enumerate(nodes)}
        for consumer in nodes:
            eager = self.consumers.get(consumer)
            flat, spec = tree_flatten((consumer.args, consumer.kwargs))
            if eager is None or len(eager) != len(flat) or not changed.intersection(consumer.all_input_nodes):
                continue
            written = set(written_args(consumer))
            offset_read = _offset_readers(consumer)
            outputs = {a for a in flat if isinstance(a, fx.Node)} if consumer.op == "output" else set()
            moved: dict[fx.Node, fx.Node] = {}  # an argument and what takes its place
            positions = sorted(
                range(len(flat)), key=lambda i: order_of.get(flat[i], -1) if isinstance(flat[i], fx.Node) else -1
            )  # views after their bases
            for pos in positions:
                arg = flat[pos]
                if not isinstance(arg, fx.Node) or arg not in changed or arg in written or _in_flight(arg):
                    continue
                if arg in moved:
                    flat[pos] = moved[arg]
                    continue
                base = _viewed_output(arg, outputs)
                if base is not None:  # a returned view of another returned value: it stays that value's view
                    if base in moved:
                        with graph.inserting_before(consumer):
                            flat[pos] = moved[arg] = _view_again(graph, arg, base, moved[base])
                    continue
                runtime = runtime if runtime is not None else _runtime_values(graph, nodes, changed, self.vals)
                order = _dense_order(eager[pos])
                now = runtime.get(arg)
                if order is not None and not (
                    _same_strides(eager[pos], now) and (arg not in offset_read or _same_offset(eager[pos], now))
                ):
                    with graph.inserting_before(consumer):
                        flat[pos] = moved[arg] = _copy_to_order(graph, arg, order)
            consumer.args, consumer.kwargs = tree_unflatten(flat, spec)

    def _changed(self, nodes: list[fx.Node]) -> set[fx.Node]:
        """The nodes whose runtime strides may differ from their eager ones: new nodes, and nodes with a new
        target or input, or an input that changed."""
        changed: set[fx.Node] = set()
        for node in nodes:
            inputs = tuple(node.all_input_nodes)
            if node not in self.vals or self.signatures[node] != (node.target, inputs) or changed.intersection(inputs):
                changed.add(node)
        return changed


def _val(arg: Any) -> Any:
    return arg.meta.get("val") if isinstance(arg, fx.Node) else None


def _runtime_values(
    graph: fx.Graph, nodes: list[fx.Node], changed: set[fx.Node], eager: dict[fx.Node, Any]
) -> dict[fx.Node, Any]:
    """The values the nodes hold when the rewritten graph runs: a new node's `meta["val"]` (the pass computed
    it), an old node's own where nothing above it changed, else its op run again on fake values (None where
    that is not possible: unknown)."""
    values: dict[fx.Node, Any] = {}
    fake_mode = fake_mode_of(graph)
    for node in nodes:
        if node not in changed or node not in eager:
            values[node] = node.meta.get("val")
        else:
            values[node] = _rerun(node, values, fake_mode)
    return values


def _rerun(node: fx.Node, values: dict[fx.Node, Any], fake_mode: Any) -> Any:
    target = node.target
    if target is not operator.getitem and not isinstance(target, torch._ops.OpOverload):
        return None
    if isinstance(target, torch._ops.OpOverload) and (
        target._schema.is_mutable or torch.Tag.dynamic_output_shape in target.tags
    ):
        return None
    if any(values.get(i) is None for i in node.all_input_nodes):
        return None
    args, kwargs = tree_map(lambda a: values[a] if isinstance(a, fx.Node) else a, (node.args, node.kwargs))
    try:
        with fake_mode:
            return target(*args, **kwargs)
    except Exception:  # an op that cannot run on these fake values: its strides are unknown
        return None


def _known(cond: Any) -> bool:
    return bool(cond) if isinstance(cond, bool) else statically_known_true(cond)


def _dense_order(val: Any) -> list[int] | None:
    """The dims of a dense, non-overlapping tensor value from outermost to innermost in memory (dims of size 1
    first), or None when it is not one (or that cannot be told without guards)."""
    if not isinstance(val, torch.Tensor) or val.layout != torch.strided:
        return None
    shape, stride = val.shape, val.stride()
    ones = [d for d in range(val.dim()) if _known(shape[d] == 1)]
    order: list[int] = []
    for d in (d for d in range(val.dim()) if d not in ones):  # insertion sort by stride, largest first
        pos = len(order)
        while pos > 0 and not _known(stride[order[pos - 1]] >= stride[d]):
            if not _known(stride[order[pos - 1]] < stride[d]):
                return None
            pos -= 1
        order.insert(pos, d)
    expected = 1
    for d in reversed(order):
        if not _known(stride[d] == expected):
            return None
        expected = expected * shape[d]
    return list(range(val.dim())) if order == sorted(order) else ones + order


def _same_strides(eager: torch.Tensor, now: Any) -> bool:
    if not isinstance(now, torch.Tensor) or now.dim() != eager.dim():
        return False
    return all(_known(eager.shape[d] == 1) or _known(eager.stride(d) == now.stride(d)) for d in range(eager.dim()))


def _offset_readers(consumer: fx.Node) -> set[fx.Node]:
    """The arguments whose storage offset `consumer` reads: the bases of an `auto_functionalized_v2`, which rebuilds
    each mutated view from its base at the eager offset (`as_strided`); every other op reads a tensor from its first
    element, wherever that lies."""
    if consumer.target is not torch.ops.higher_order.auto_functionalized_v2:
        return set()
    return {b for b in consumer.kwargs.get("_all_bases", ()) if isinstance(b, fx.Node)}


def _same_offset(eager: torch.Tensor, now: torch.Tensor) -> bool:
    return _known(eager.storage_offset() == now.storage_offset())


def _viewed_output(node: fx.Node, outputs: set[fx.Node]) -> fx.Node | None:
    """The nearest returned value `node` is a view of (through view ops), if any: in eager the two share storage,
    and a caller that writes one in place sees it through the other."""
    while is_view(node):
        node = node.args[0]
        if node in outputs:
            return node
    return None


def _view_again(graph: fx.Graph, view: fx.Node, base: fx.Node, new_base: fx.Node) -> fx.Node:
    """`view`'s chain of view ops from `base`, applied to `new_base`."""
    chain = []
    while view is not base:
        chain.append(view)
        view = view.args[0]
    node = new_base
    for step in reversed(chain):
        node = call(graph, step.target, (node, *step.args[1:]), dict(step.kwargs))
    return node


def _copy_to_order(graph: fx.Graph, node: fx.Node, order: list[int]) -> fx.Node:
    """A dense copy of `node` whose dims lie in memory in `order` (outermost first)."""
    if order == sorted(order):
        return call(graph, aten.clone.default, (node,), {"memory_format": torch.contiguous_format})
    permuted = call(graph, aten.permute.default, (node, order))
    dense = call(graph, aten.clone.default, (permuted,), {"memory_format": torch.contiguous_format})
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return call(graph, aten.permute.default, (dense, inverse))
