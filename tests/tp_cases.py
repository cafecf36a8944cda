"""What each rank of the tensor-parallel tests runs (`test_tensor_parallel.py` spawns the ranks; gloo, CPU).

`check_rank` compiles one rank's draft step of each sharding kind with the dspark passes (`kv_write_op="always"`:
the K/V writes lower to the op's CPU reference), checks in the rank what only the graphs show (one graph, the
collectives in their order, the caches against the same heads of the unsharded draft before and after in-place
weight updates), and writes what the pass did (counters, report) to `<out>/rank<r>.json` for the test to check.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dspark_fx import DsparkConfig, explain
from dspark_fx.passes import horizontal
from dspark_fx.passes.graph_utils import op_name
from dspark_fx.reference_tp_draft import HandShardedDraft, TPDraft, TPDraftConfig, parallelize, rank_heads
from dspark_fx.testing import CaptureBackend, assert_close_for_dtype, compile_counts

CFG = TPDraftConfig()
KINDS = ("dtensor", "hand")
COLLECTIVES = "_c10d_functional."
PRELOAD = [
    "dspark_fx.testing",
    "dspark_fx.reference_tp_draft",
    "torch.distributed.tensor.parallel",
    "torch.distributed._functional_collectives",
    "torch._dynamo.convert_frame",
    "torch._functorch.aot_autograd",
    "torch._inductor.decomposition",
]


def spawn(world_size: int, out: Path, kinds: tuple[str, ...], explain_too: bool) -> dict[int, dict[str, Any]]:
    """Run `check_rank` on `world_size` gloo ranks; returns each rank's summary (rank -> kind -> facts)."""
    # the ranks fork from one server process that imported torch, its compiler and dspark_fx once (this module is
    # not on the server's path: it imports what this module imports)
    multiprocessing.set_forkserver_preload(PRELOAD)
    args = (world_size, str(out), kinds, explain_too)
    mp.start_processes(_entry, args=args, nprocs=world_size, start_method="forkserver")
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)}


def _entry(rank: int, world_size: int, out: str, kinds: tuple[str, ...], explain_too: bool) -> None:
    torch.set_num_threads(1)
    horizontal.LONE_GEMM_DEVICES = ("cuda", "cpu")  # as on CUDA: the row-parallel GEMMs routed next to the all-reduces
    timeout = datetime.timedelta(seconds=120)
    # the rendezvous is a file in `out`: no port picked here that another test process could take first
    store = f"file://{Path(out) / 'rendezvous'}"
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world_size, timeout=timeout)
    try:
        summary = {kind: check_rank(rank, world_size, kind, explain_too) for kind in kinds}
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(summary))
    finally:
        dist.destroy_process_group()


def draft_inputs(cfg: TPDraftConfig, step: int, tokens: int = 5, block: int = 4) -> tuple[torch.Tensor, ...]:
    """The same inputs on every rank (seeded): ctx, positions, cache_loc, block hidden, block positions."""
    gen = torch.Generator().manual_seed(100 + step)
    return (
        torch.randn(tokens, cfg.hidden, generator=gen).to(cfg.dtype),
        torch.randint(0, cfg.max_position, (tokens,), generator=gen),
        torch.randperm(cfg.num_slots, generator=gen)[:tokens],
        torch.randn(block, cfg.hidden, generator=gen).to(cfg.dtype),
        torch.randint(0, cfg.max_position, (block,), generator=gen),
    )


def sharded(kind: str, full: TPDraft, rank: int, world_size: int) -> TPDraft | HandShardedDraft:
    """This rank's draft of `kind`, with `full`'s weights."""
    if kind == "dtensor":
        from torch.distributed.device_mesh import init_device_mesh

        return parallelize(TPDraft(full.cfg, world_size), init_device_mesh("cpu", (world_size,)))
    model = HandShardedDraft(full.cfg, rank, world_size, dist.group.WORLD)
    model.load_(full)
    return model


@torch.no_grad()
def update_weights(kind: str, full: TPDraft, model: TPDraft | HandShardedDraft) -> None:
    """Change weights in place after compiling: a column-parallel K projection, a row-parallel o_proj and a k_norm
    weight (replicated), in the unsharded draft and, the same way, in the rank's shards."""
    for m in (full, model) if kind == "dtensor" else (full,):
        m.layers[1].k_proj.weight.mul_(-1.5)
        m.layers[0].o_proj.weight.mul_(0.5)
        m.layers[0].k_norm_weight.add_(0.25)
    if kind == "hand":
        model.load_(full)


def collectives(graph: torch.fx.Graph) -> list[tuple[str, str, list[Any]]]:
    """The graph's collectives in order: op, node name and the arguments that are not nodes (op, group)."""
    return [
        (op_name(n), n.name, [a for a in n.args if not isinstance(a, torch.fx.Node)])
        for n in graph.nodes
        if n.op == "call_function" and op_name(n).startswith(COLLECTIVES)
    ]


def check_rank(rank: int, world_size: int, kind: str, explain_too: bool) -> dict[str, Any]:
    counters = torch._dynamo.utils.counters
    torch._dynamo.reset()
    counters.clear()
    full = TPDraft(CFG)
    model = sharded(kind, full, rank, world_size)
    heads = rank_heads(CFG, rank, world_size)
    facts: dict[str, Any] = {}
    if explain_too:
        with torch.no_grad():
            report = explain(model, *draft_inputs(CFG, 0))
        facts["explain"] = {
            "groups": {g.activation: g.branches for g in report.groups},
            "batched": {g.activation: [c.branches for c in g.classes] for g in report.groups},
            "kv_kept": [k.reason.name for k in report.kv_kept],
            "text": str(report),
        }
        written = sum(int(torch.count_nonzero(t)) for kv in model.caches() for t in kv)
        assert written == 0, "explain() must leave the caches as they were"
    capture = CaptureBackend(DsparkConfig(kv_write_op="always"))
    compiled = torch.compile(model, backend=capture, fullgraph=True)
    with compile_counts() as frames, torch.no_grad():
        for step in range(2):
            inputs = draft_inputs(CFG, step)
            out, expected = compiled(*inputs), full(*inputs)
            assert_close_for_dtype(out, expected, CFG.dtype)
            for i, ((k, v), (k_full, v_full)) in enumerate(zip(model.caches(), full.caches(), strict=True)):
                assert torch.count_nonzero(k), f"rank {rank}: layer {i}'s K cache was not written"
                assert_close_for_dtype((k, v), (k_full[:, heads], v_full[:, heads]), CFG.dtype)
            if step == 0:
                update_weights(kind, full, model)
    (before,), (after,) = capture.before, capture.after
    assert collectives(after) == collectives(before), f"rank {rank}: the pass moved or changed a collective"
    return {
        **facts,
        "counters": dict(counters["dspark_fx"]),
        "frames": frames["frames"],
        "graph_breaks": sum(counters["graph_break"].values()),
        "collectives": [c[0] for c in collectives(after)],
        "gemms_left": sum(op_name(n) in ("aten.mm", "aten.addmm") for n in after.nodes if n.op == "call_function"),
        "kv_writes": [w.layers for w in capture.report.kv_writes],
        "groups": [g.branches for g in capture.report.groups],
        "routed": capture.report.routed,
        "report": str(capture.report),
    }
