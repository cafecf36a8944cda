"""Test fixtures shared by the fusion tests: small reference drafts and their inputs; `quick_first`, the quick
tier's share of a parametrized test; `LayoutKeepingMove`, device copies that keep strides and storage offsets."""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import pytest
import torch

from dspark_fx.reference_draft import DraftKVConfig, DraftKVWriter

SMALL = dict(num_layers=3, hidden=64, num_heads=4, num_kv_heads=2, head_dim=16, num_slots=128, max_position=512)


def small_config(**overrides) -> DraftKVConfig:
    return DraftKVConfig(**{**SMALL, "dtype": torch.float32, **overrides})


def draft_inputs(cfg: DraftKVConfig, tokens: int, device: str = "cpu", seed: int = 1) -> tuple:
    """Fresh random inputs for `DraftKVWriter(cfg)` with `tokens` rows (distinct slots, random positions).

    `write="commit"` rounds `tokens` up to whole verify windows of width 4 with random `commit_lens` in [0, 4];
    `write="slice"` passes a random first slot (a Python int) of a run of `tokens` slots.
    """
    gen = torch.Generator().manual_seed(seed)
    width = 4
    if cfg.write == "commit":
        tokens = -(-tokens // width) * width
    ctx = torch.randn(tokens, cfg.hidden, generator=gen).to(cfg.dtype)
    positions = torch.randint(0, cfg.max_position, (tokens,), generator=gen)
    slots = torch.randperm(cfg.num_slots, generator=gen)[:tokens]
    if cfg.write == "return":
        args = (ctx, positions)
    elif cfg.write == "cache_loc":
        args = (ctx, positions, slots)
    elif cfg.write == "slice":
        start = int(torch.randint(0, cfg.num_slots - tokens + 1, (), generator=gen))
        return (ctx.to(device), positions.to(device), start)
    else:
        batch = tokens // width
        args = (
            ctx,
            positions,
            slots.view(batch, width),
            torch.randint(0, width + 1, (batch,), generator=gen),
        )
    return tuple(a.to(device) for a in args)


def poison_caches(model: torch.nn.Module, seed: int = 7) -> None:
    """Fill every K/V cache of `model` (its `caches()`) with random values: slots a write does not address must
    keep them."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for k_cache, v_cache in model.caches():
            k_cache.copy_(torch.randn(k_cache.shape, generator=gen))
            v_cache.copy_(torch.randn(v_cache.shape, generator=gen))


def eager_and_compiled(
    cfg: DraftKVConfig, backend, tokens_list=(7,), device: str = "cpu", compile_kwargs=None, model_factory=None
):
    """Run the same draft eagerly and compiled on fresh inputs; returns [(eager_state, compiled_state), ...].

    With several token counts, the first call's tensors have their token dim marked dynamic: one symbolic graph
    serves every count (a static graph for the first and a symbolic one for the next would compile the same model
    twice; static graphs are the generator's and the `dynamic=False` tests')."""
    eager = (model_factory or DraftKVWriter)(cfg, device)
    compiled_module = copy.deepcopy(eager)
    compiled = torch.compile(compiled_module, backend=backend, **(compile_kwargs or {}))
    results = []
    with torch.no_grad():
        for i, tokens in enumerate(tokens_list):
            args = draft_inputs(cfg, tokens, device, seed=i + 1)
            if i == 0 and len(set(tokens_list)) > 1 and not any(isinstance(a, int) for a in args):
                mark_tokens_dynamic(args)  # (a first slot as an int recompiles when it changes: no gain there)
            out_e, out_c = eager(*args), compiled(*args)
            if cfg.write == "return":
                results.append((out_e, out_c))
            else:
                results.append(
                    (
                        [t.clone() for kv in eager.caches() for t in kv],
                        [t.clone() for kv in compiled_module.caches() for t in kv],
                    )
                )
    return results


def mark_tokens_dynamic(args: Iterable) -> None:
    """Mark dim 0 (the tokens, or the verify windows) of every tensor in `args` as maybe dynamic for Dynamo."""
    for t in args:
        if isinstance(t, torch.Tensor) and t.dim():
            torch._dynamo.maybe_mark_dynamic(t, 0)


def as_fake_cuda(graph: torch.fx.Graph, stride_of=None) -> None:
    """Make every tensor value of `graph`'s nodes a fake CUDA tensor of the same shape, dtype and strides (or
    `stride_of(node, value)`), so that a CPU-captured graph goes through the passes as it would on a GPU (no GPU
    needed)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._pytree import tree_map

    def on_cuda(node: torch.fx.Node, value):
        if not isinstance(value, torch.Tensor):
            return value
        stride = stride_of(node, value) if stride_of else value.stride()
        return torch.empty_strided(value.shape, stride, dtype=value.dtype, device="cuda")

    with FakeTensorMode():
        for node in graph.nodes:
            node.meta["val"] = tree_map(lambda v, node=node: on_cuda(node, v), node.meta.get("val"))


PARAM = type(pytest.param(None))


def quick_first(n: int, params: Iterable) -> list:
    """The values of a `parametrize` (`pytest.param`s, or plain values of one argument) with all but the first `n`
    marked `slow`: the quick tier (`-m "not slow"`) runs the first `n`, the full run every one."""
    out = []
    for i, p in enumerate(params):
        if i < n:
            out.append(p)
        elif isinstance(p, PARAM):
            out.append(pytest.param(*p.values, id=p.id, marks=(*p.marks, pytest.mark.slow)))
        else:
            out.append(pytest.param(p, marks=pytest.mark.slow))
    return out


class LayoutKeepingMove:
    """Copies tensors to `device` with their strides and storage offsets: each storage is copied once, whole, and
    every tensor becomes the same view of its storage's copy (views of one storage stay views of one copy, so
    aliasing, gaps and misalignment are as before). `Tensor.to` / `.cuda()` do not keep them: a view with gaps
    between its rows comes out contiguous, at offset 0 of a fresh allocation. Anything not a tensor passes through."""

    def __init__(self, device: str | torch.device) -> None:
        self.device = torch.device(device)
        self.copies: dict[int, torch.Tensor] = {}

    def __call__(self, t):
        if not isinstance(t, torch.Tensor):
            return t
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() == 0 or key not in self.copies:  # empty storages share the null data pointer
            whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            self.copies[key] = whole.to(self.device, copy=True)
        data = self.copies[key]
        usable = data.numel() - data.numel() % t.element_size()
        return data[:usable].view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())


@contextmanager
def dspark_log_messages(level: int = logging.INFO) -> Iterator[list[str]]:
    """The messages the `dspark_fx` logger emits at `level` or above inside the block (pytest's log capture is off
    in this suite)."""
    logger, messages = logging.getLogger("dspark_fx"), []

    class Records(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler, old_level = Records(level), logger.level
    logger.addHandler(handler)
    logger.setLevel(level)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
