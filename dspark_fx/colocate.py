"""Opt-in (`DsparkConfig(colocate_weights=True)`): the weights of linears that share an activation moved, once, when
the backend compiles, into one allocation, back to back in graph order. `dspark::multi_linear` and
`dspark::multi_linear_kv_write` merge row ranges that lie back to back (docs/ops.md, "Adjacent weights"), so the
fused GEMM then runs as one GEMM over the stacked rows, as over a weight a user concatenated by hand.

The Dynamo graph the backend receives (unchanged by this step; the weights are graph inputs):

    linear(ctx, L_layers_0_k_proj_weight)   # [1024, 4096], an allocation of its own
    linear(ctx, L_layers_0_v_proj_weight)   # [1024, 4096], an allocation of its own
    linear(ctx, L_layers_1_k_proj_weight)   # ...

After it each of those parameters is a view of one [N * 1024, 4096] allocation, in that order
(`param.data = view`, the values copied once, the old allocations freed when nothing else holds them). Nothing is
copied per call and nothing can go stale: the parameters are the views, so what is written into them in place is
what the GEMM reads. A group moves only if every weight (and bias) is a plain tensor or `nn.Parameter` of the
device the pass fuses on, 2-D (1-D), contiguous, of one dtype and input width, with 16-byte rows, and the only
tensor on its storage, in memory torch allocated for this process: a weight that another tensor shares (a
`state_dict()` kept from before, a view, a weight of another group) or whose memory is shared or owned elsewhere
(`share_memory_()`, numpy, DLPack, a file mapping) would keep the old values there, so its group is left as it is,
and the report says why. The op
checks adjacency on every call from pointers and strides, so a parameter replaced later (`load_state_dict(...,
assign=True)`) is only read apart again, never wrong.

Not for a model that something captured into a CUDA graph before this compile: that graph keeps reading the old
allocations. Pickling a colocated model (`pickle`, `copy` of a module holding it) writes each view with the whole
allocation; `torch.save` / `torch.load` and `copy.deepcopy` keep one copy.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from dspark_fx.passes.names import module_root, readable_name

LINEARS = (torch._C._nn.linear, torch.nn.functional.linear)


@dataclass(frozen=True)
class ColocatedGroup:
    """One group of linears on an activation: its weights, whether they were moved, and why not."""

    activation: str
    weights: list[str]
    nbytes: int  # weight and bias bytes of the group
    movable: bool  # the group qualifies (module docstring)
    moved: bool  # and was moved (not under explain)
    reason: str = ""  # why the group is left as it is

    def __str__(self) -> str:
        what = f"{len(self.weights)} weights on {self.activation} ({self.nbytes / 2**20:.2f} MiB)"
        if self.moved:
            return f"{what} moved into one allocation: {', '.join(self.weights)}"
        if self.movable:
            return f"{what} would move into one allocation (explain moves nothing): {', '.join(self.weights)}"
        return f"{what} left as they are: {self.reason}"


@dataclass(frozen=True)
class WeightGroup:
    """Linears on one activation of a Dynamo graph: their weights and biases, the graph's real inputs (None where an
    operand is computed in the graph), in graph order."""

    activation: str
    names: list[str]  # the weights' parameter names
    weights: list[object]
    biases: list[object]


def find_weight_groups(gm: fx.GraphModule, example_inputs: Sequence[object], min_branches: int) -> list[WeightGroup]:
    """The groups of at least `min_branches` linears on one activation of `gm` (a Dynamo graph), with the tensors of
    `example_inputs` (`gm`'s real inputs, in placeholder order) they multiply by, in graph order."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        return []
    value_of = dict(zip(placeholders, example_inputs, strict=True))
    members_of: dict[object, list[tuple[object, object]]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in LINEARS or len(node.args) < 2:
            continue
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        members = members_of.setdefault(node.args[0], [])
        if all(node.args[1] is not weight for weight, _ in members):
            members.append((node.args[1], bias))
    groups = []
    root = module_root([p.name for p in placeholders])
    for activation, members in members_of.items():
        if len(members) < min_branches or not isinstance(activation, fx.Node):
            continue
        groups.append(
            WeightGroup(
                readable_name(activation.name, root),
                [readable_name(w.name, root) if isinstance(w, fx.Node) else str(w) for w, _ in members],
                [value_of.get(w) if isinstance(w, fx.Node) else None for w, _ in members],
                [value_of.get(b) if isinstance(b, fx.Node) else b for _, b in members],
            )
        )
    return groups


def colocate_weights(groups: list[WeightGroup], device_types: Sequence[str], move: bool = True) -> list[ColocatedGroup]:
    """Move each of `groups` (`find_weight_groups`) whose weights qualify (module docstring) into one allocation,
    the larger groups first. Returns one entry per group, in order, moved or not; `move=False` only judges. The
    backend moves after Inductor compiled the graph: AOTAutograd re-reads the inputs' storage offsets, which must be
    those Dynamo traced."""
    nbytes = [sum(t.nbytes for t in (*g.weights, *g.biases) if isinstance(t, torch.Tensor)) for g in groups]
    outcome: list[ColocatedGroup | None] = [None] * len(groups)
    taken: set[int] = set()  # tensors a group judged movable takes (under move=False nothing moves to show it)
    for i in sorted(range(len(groups)), key=lambda i: -nbytes[i]):  # a weight in two groups goes to the larger
        group = groups[i]
        reason = _reason_not_to_move(group.weights, group.biases, device_types)
        tensors = [t for t in (*group.weights, *group.biases) if isinstance(t, torch.Tensor)]
        if not reason and any(id(t) in taken for t in tensors):
            reason = "a weight or bias is also in a larger group, which takes it"
        if not reason:
            taken.update(id(t) for t in tensors)
            if move:
                _move(group.weights)
                if group.biases[0] is not None:
                    _move(group.biases)
        outcome[i] = ColocatedGroup(group.activation, group.names, nbytes[i], not reason, not reason and move, reason)
    return [g for g in outcome if g is not None]


def _reason_not_to_move(weights: list, biases: list, device_types: Sequence[str]) -> str:
    """Why the group's weights (and biases) stay where they are, or "" to move them."""
    if any(w is None for w in weights):
        return "a weight is not a graph input (computed in the graph or a constant)"
    if any(b is None for b in biases) and any(b is not None for b in biases):
        return "some linears have a bias and some do not"
    first = weights[0]
    for tensors, dim in ((weights, 2), ([b for b in biases if b is not None], 1)):
        for t in tensors:
            if type(t) not in (torch.Tensor, torch.nn.Parameter):
                return f"a weight or bias is a {type(t).__name__}, not a plain tensor or nn.Parameter"
            if t.device.type not in device_types:
                return f"the weights are on {t.device.type}, where the pass does not fuse GEMM groups"
            if t.dim() != dim or not t.is_contiguous() or t.dtype != first.dtype:
                return "the weights (biases) are not all contiguous 2-D (1-D) tensors of one dtype"
            if t.is_inference():
                return "a weight is an inference tensor (made under torch.inference_mode), whose storage is fixed"
    if any(w.shape[1] != first.shape[1] for w in weights):
        return "the weights have different input widths"
    if first.shape[1] * first.element_size() % 16:
        return "a weight row is not a multiple of 16 bytes"
    if _back_to_back(weights) and (biases[0] is None or _back_to_back(biases)):
        return "already back to back"
    if not all(_owns_storage(t) for t in (*weights, *biases) if t is not None):
        return "a weight or bias shares its storage with another tensor, which would keep the old values"
    if any(t._use_count() != 1 for t in (*weights, *biases) if t is not None):
        return (
            "a weight or bias is held by more than its Python object (a DLPack export, which would keep reading the "
            "old memory, or a live autograd graph)"
        )
    if any(_memory_held_outside(t) for t in (*weights, *biases) if t is not None):
        return (
            "a weight or bias lives in memory shared with another process or owned outside torch (share_memory_, "
            "numpy, DLPack, a file mapping), which would keep the old values"
        )
    return ""


def _owns_storage(t: torch.Tensor) -> bool:
    """Whether `t` spans its whole storage and no other tensor holds that storage. (A DLPack export holds `t`
    itself, not its storage: `_reason_not_to_move` tests its use count.)"""
    storage = t.untyped_storage()
    if t.storage_offset() != 0 or storage.nbytes() != t.nbytes:
        return False
    return torch._C._storage_Use_Count(storage._cdata) == _lone_use_count()


def _memory_held_outside(t: torch.Tensor) -> bool:
    """Whether `t`'s memory may be read or written outside this process's tensors: a storage torch did not allocate
    (not resizable: numpy, DLPack, `frombuffer`, mmap) or a CPU storage in shared memory (`share_memory_`; CUDA
    storages report shared always, so they are judged by the first test alone)."""
    storage = t.untyped_storage()
    return not storage.resizable() or (t.device.type == "cpu" and storage.is_shared())


@functools.cache
def _lone_use_count() -> int:
    """The use count `_owns_storage` reads for a tensor alone on its storage (the storage object it asks through
    holds one reference too)."""
    t = torch.empty(1)
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def _back_to_back(tensors: list[torch.Tensor]) -> bool:
    return all(
        b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
        and b.storage_offset() == a.storage_offset() + a.numel()
        for a, b in itertools.pairwise(tensors)
    )


def _move(tensors: list[torch.Tensor]) -> None:
    """Copy `tensors` (one dtype and trailing shape) into one new allocation and make each a view of its part. Made
    outside inference mode, should a caller be in it: parameters turned into inference tensors could not be updated
    in place (a weight reload) or used with autograd outside it."""
    rows = sum(t.shape[0] for t in tensors)
    first = tensors[0]
    start = 0
    with torch.inference_mode(False), torch.no_grad():
        stacked = torch.empty((rows, *first.shape[1:]), dtype=first.dtype, device=first.device)
        for t in tensors:
            part = stacked.narrow(0, start, t.shape[0])
            part.copy_(t)
            t.data = part
            start += t.shape[0]
