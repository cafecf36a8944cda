"""What each rank of the tensor-parallel tests runs (`test_tensor_parallel.py` spawns the ranks: gloo on CPU, or
NCCL with rank r on GPU r).

`check_rank` (gloo) compiles one rank's draft step of each sharding kind with the dspark passes
(`kv_write_op="always"`: the K/V writes lower to the op's CPU reference), checks in the rank what only the graphs
show (one graph, the collectives in their order, the caches against the same heads of the unsharded draft before and
after in-place weight updates), and writes what the pass did (counters, report) to `<out>/rank<r>.json` for the test
to check. `check_rank_nccl` does the same on CUDA, bf16, with `dspark_backend` as users compile (Inductor codegen,
`kv_write_op="auto"`: the CUDA kernel), first called eagerly, then captured in a `torch.cuda.CUDAGraph` and replayed.
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
from dspark_fx.reference_tp_draft import (
    HandShardedDraft,
    TPDraft,
    TPDraftConfig,
    output_error,
    parallelize,
    rank_heads,
)
from dspark_fx.testing import TOLERANCES, CaptureBackend, assert_close_for_dtype, compile_counts

CFG = TPDraftConfig()
# on CUDA: bf16, dims the op's CUDA kernel takes (K a multiple of 8, head_dim 16), 4 K/V heads (2 per rank at 2 ranks)
NCCL_CFG = TPDraftConfig(
    hidden=64, num_heads=8, num_kv_heads=4, head_dim=16, intermediate=128, num_slots=64, dtype=torch.bfloat16
)
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


def spawn(
    world_size: int, out: Path, kinds: tuple[str, ...], explain_too: bool, backend: str = "gloo"
) -> dict[int, dict[str, Any]]:
    """Run `check_rank` on `world_size` gloo ranks, or `check_rank_nccl` on `world_size` NCCL ranks (`backend`);
    returns each rank's summary (rank -> kind -> facts)."""
    # gloo: the ranks fork from one server process that imported torch, its compiler and dspark_fx once (this module
    # is not on the server's path: it imports what this module imports); NCCL: fresh processes, since a process
    # forked from one that initialized CUDA cannot use it
    multiprocessing.set_forkserver_preload(PRELOAD)
    args = (world_size, str(out), kinds, explain_too, backend)
    start = "spawn" if backend == "nccl" else "forkserver"
    mp.start_processes(_entry, args=args, nprocs=world_size, start_method=start)
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)}


def _entry(rank: int, world_size: int, out: str, kinds: tuple[str, ...], explain_too: bool, backend: str) -> None:
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=120)
    # the rendezvous is a file in `out`: no port picked here that another test process could take first
    store = f"file://{Path(out) / 'rendezvous'}"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    else:  # as on CUDA: GEMM groups fused, the row-parallel GEMMs routed next to the all-reduces
        horizontal.GROUP_GEMM_DEVICES = horizontal.LONE_GEMM_DEVICES = ("cuda", "cpu")
    dist.init_process_group(backend, init_method=store, rank=rank, world_size=world_size, timeout=timeout)
    try:
        if backend == "nccl":
            summary = {kind: check_rank_nccl(rank, world_size, kind) for kind in kinds}
        else:
            summary = {kind: check_rank(rank, world_size, kind, explain_too) for kind in kinds}
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(summary))
        # Every rank done before any rank tears the group down: on the 2-core machine, under load, a gloo rank once
        # aborted at exit after all its output ("terminate called without an active exception") while its peer had
        # already destroyed the group and gone.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def draft_inputs(
    cfg: TPDraftConfig, step: int, tokens: int = 5, block: int = 4, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, ...]:
    """The same inputs on every rank (seeded): ctx, positions, cache_loc, block hidden, block positions."""
    gen = torch.Generator().manual_seed(100 + step)
    inputs = (
        torch.randn(tokens, cfg.hidden, generator=gen).to(cfg.dtype),
        torch.randint(0, cfg.max_position, (tokens,), generator=gen),
        torch.randperm(cfg.num_slots, generator=gen)[:tokens],
        torch.randn(block, cfg.hidden, generator=gen).to(cfg.dtype),
        torch.randint(0, cfg.max_position, (block,), generator=gen),
    )
    return tuple(t.to(device) for t in inputs)


def sharded(
    kind: str, full: TPDraft, rank: int, world_size: int, device: torch.device | str = "cpu"
) -> TPDraft | HandShardedDraft:
    """This rank's draft of `kind` on `device`, with `full`'s weights."""
    if kind == "dtensor":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(torch.device(device).type, (world_size,))
        return parallelize(TPDraft(full.cfg, world_size, device), mesh)
    model = HandShardedDraft(full.cfg, rank, world_size, dist.group.WORLD, device)
    model.load_(full)
    return model


@torch.no_grad()
def update_weights(kind: str, full: TPDraft, model: TPDraft | HandShardedDraft) -> None:
    """Change weights in place after compiling: column-parallel K and V projections, a row-parallel o_proj and a
    k_norm weight and the RoPE table (replicated), in the unsharded draft and, the same way, in the rank's shards."""
    for m in (full, model) if kind == "dtensor" else (full,):
        m.layers[1].k_proj.weight.mul_(-1.5)
        m.layers[0].v_proj.weight.mul_(2.0)
        m.layers[0].o_proj.weight.mul_(0.5)
        m.layers[0].k_norm_weight.add_(0.25)
        m.cos_sin.neg_()  # the RoPE table, a buffer
    if kind == "hand":
        model.load_(full)


def assert_rank_caches(
    model: TPDraft | HandShardedDraft, full: TPDraft, heads: slice, dtype: torch.dtype, who: str
) -> None:
    """Every layer's K cache of the rank was written, and its K/V caches are the unsharded draft's heads `heads`."""
    for i, ((k, v), (k_full, v_full)) in enumerate(zip(model.caches(), full.caches(), strict=True)):
        assert torch.count_nonzero(k), f"{who}: layer {i}'s K cache was not written"
        assert_close_for_dtype((k, v), (k_full[:, heads], v_full[:, heads]), dtype)


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
        # one graph for every token count: T marked dynamic at the first call (DTensor's sharding rules guard on
        # T >= the world size, so a T below it would compile a second graph: torch's, not the pass's)
        for step, tokens in enumerate((5, 9, 4)):
            inputs = draft_inputs(CFG, step, tokens)
            if step == 0:
                for t in inputs[:3]:
                    torch._dynamo.mark_dynamic(t, 0)
            out, expected = compiled(*inputs), full(*inputs)
            assert_close_for_dtype(out, expected, CFG.dtype)
            assert_rank_caches(model, full, heads, CFG.dtype, f"rank {rank}")
            if step == 0:
                update_weights(kind, full, model)
    return {**facts, **compiled_facts(rank, capture, frames["frames"])}


def compiled_facts(rank: int, capture: CaptureBackend, frames: int) -> dict[str, Any]:
    """What the rank's one compile did (`frames` Dynamo graphs): the pass's counters and report, graph breaks, the
    collectives after the pass (asserted here to be those before it, in order), GEMMs left and the groups."""
    counters = torch._dynamo.utils.counters
    (before,), (after,) = capture.before, capture.after
    assert collectives(after) == collectives(before), f"rank {rank}: the pass moved or changed a collective"
    waits = [n for n in after.nodes if op_name(n) == "_c10d_functional.wait_tensor"]
    assert all(op_name(w.args[0]).startswith(COLLECTIVES) for w in waits), f"rank {rank}: a wait on a copy"
    return {
        "counters": dict(counters["dspark_fx"]),
        "frames": frames,
        "graph_breaks": sum(counters["graph_break"].values()),
        "collectives": [c[0] for c in collectives(after)],
        "gemms_left": sum(op_name(n) in ("aten.mm", "aten.addmm") for n in after.nodes if n.op == "call_function"),
        "kv_writes": [w.layers for w in capture.report.kv_writes],
        "groups": [g.branches for g in capture.report.groups],
        "routed": capture.report.routed,
        "report": str(capture.report),
    }


def check_rank_nccl(rank: int, world_size: int, kind: str) -> dict[str, Any]:
    """One NCCL rank on GPU `rank`: the draft step of `kind` compiled with the dspark passes as `dspark_backend`
    runs them (Inductor codegen, `kv_write_op="auto"`), called eagerly twice with an in-place weight update between
    the calls, then captured in a `torch.cuda.CUDAGraph` (after warm-up calls on a side stream) and replayed twice,
    the weights updated in place again before the second replay; after every call the output and the rank's caches
    are those of the unsharded draft (eager, the same GPU) run on the same inputs, which must also see every update.
    Returns what the pass did and what the graphs hold, as `check_rank` does."""
    counters = torch._dynamo.utils.counters
    torch._dynamo.reset()
    counters.clear()
    device = torch.device("cuda", rank)
    cfg = NCCL_CFG
    full = TPDraft(cfg, device=device)
    model = sharded(kind, full, rank, world_size, device)
    heads = rank_heads(cfg, rank, world_size)
    # Inductor codegen as users compile, its caches off for this compile (a hit would skip the passes)
    capture = CaptureBackend(inner="inductor")
    compiled = torch.compile(model, backend=capture, fullgraph=True)

    def compare(out: torch.Tensor, inputs: tuple[torch.Tensor, ...], what: str) -> None:
        expected = full(*inputs)
        try:
            error = output_error(out, expected)
            assert error <= TOLERANCES[cfg.dtype], f"the output differs by {error:.1e} of its largest value"
            assert_rank_caches(model, full, heads, cfg.dtype, "the caches")
        except AssertionError as e:
            raise AssertionError(f"rank {rank} {kind}, {what}: {e}") from e

    with compile_counts() as frames, torch.no_grad():
        for step in range(2):
            inputs = draft_inputs(cfg, step, device=device)
            compare(compiled(*inputs), inputs, f"eager call {step}")
            update_weights(kind, full, model)
        static = draft_inputs(cfg, 2, device=device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up before capture, as CUDA graphs require (it writes the caches)
            for _ in range(2):
                compiled(*static)
        torch.cuda.current_stream(device).wait_stream(side)
        full(*static)  # the same writes in the unsharded draft's caches
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = compiled(*static)
        for step in (3, 4):
            if step == 4:
                update_weights(kind, full, model)
            for into, values in zip(static, draft_inputs(cfg, step, device=device), strict=True):
                into.copy_(values)
            graph.replay()
            compare(out, static, f"CUDA-graph replay {step - 2}")
    return compiled_facts(rank, capture, frames["frames"])
