"""Readable names for report lines: a placeholder by its Dynamo input name (`layers.0.k_proj.weight`), a GEMM by
the parameters its weight operand is computed from. The passes name nodes through a `Namer`; they never print
FX node names where a parameter path is known."""

from __future__ import annotations

import re

import torch.fx as fx

from dspark_fx.passes.graph_utils import aten, op_name


class Namer:
    """Readable names for report lines: placeholders get the Dynamo input names (parameter paths) if known."""

    def __init__(self, graph: fx.Graph, input_names: list[str] | None) -> None:
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        self.names = {}
        root = module_root(input_names or [])
        if input_names and len(input_names) == len(placeholders):
            self.names = {p: readable_name(name, root) for p, name in zip(placeholders, input_names, strict=True)}
        elif input_names:  # a backward graph: the forward's inputs it reads are `primals_<i>`, i counted from 1
            for p in placeholders:
                prefix, _, number = p.name.rpartition("_")
                if prefix == "primals" and number.isdigit() and 1 <= int(number) <= len(input_names):
                    self.names[p] = readable_name(input_names[int(number) - 1], root)

    def of(self, node: fx.Node) -> str:
        return self.names.get(node, node.name)

    def weight_of(self, gemm: fx.Node) -> str:
        """A GEMM by the inputs (parameters, buffers) its weight operand is computed from; a weight computed by
        another GEMM names that GEMM by its own weight (`aten.mm(layers.0.k_proj.weight)`)."""
        weight = gemm.args[2] if gemm.target is aten.addmm.default else gemm.args[1]
        found, stack, seen = [], [weight], set()
        while stack:
            node = stack.pop()
            if not isinstance(node, fx.Node) or node in seen:
                continue
            seen.add(node)
            if node.op in ("placeholder", "get_attr"):
                found.append(self.of(node) if node.op == "placeholder" else str(node.target))
            elif node.target in (aten.mm.default, aten.addmm.default):
                found.append(f"{op_name(node)}({self.weight_of(node)})")
            else:
                stack += reversed(node.all_input_nodes)
        return ", ".join(found) if found else gemm.name


# a Dynamo input name of a module's parameter or buffer: `L_<local>_modules_...`, `l_<local>_parameters_...`
_MODULE_TABLES = ("modules_", "parameters_", "buffers_")
_MODULE_INPUT = re.compile(rf"^[Ll]_(\w+?)_(?:{'|'.join(_MODULE_TABLES)})")


def module_root(input_names: list[str]) -> str | None:
    """The one local variable a graph's parameters and buffers are reached from (`self`, or whatever a module's
    `forward` calls its first argument); None if there are none or several (then each keeps its local's name)."""
    roots = {m.group(1) for name in input_names if (m := _MODULE_INPUT.match(name))}
    return roots.pop() if len(roots) == 1 else None


def readable_name(name: str, root: str | None = None) -> str:
    """A Dynamo input name as the parameter path it stands for (`L_self_modules_k_parameters_weight_` -> `k.weight`;
    with `root` (`module_root`), `L_mod_modules_k_parameters_weight_` -> `k.weight` for `root == "mod"` too)."""
    name = next((name[2:] for p in ("L_", "l_", "G_", "g_") if name.startswith(p)), name)
    if root and name.startswith(f"{root}_") and name[len(root) + 1 :].startswith(_MODULE_TABLES):
        name = name[len(root) + 1 :]
    name = name.removeprefix("self_")
    for part in ("_modules_", "_parameters_", "_buffers_"):
        name = name.replace(part, ".")
    for part in (*_MODULE_TABLES, "self."):
        name = name.removeprefix(part)
    return name.rstrip("_")
