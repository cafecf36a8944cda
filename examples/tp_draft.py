"""A tensor-parallel draft step compiled with `dspark_backend` on every rank: what the pass fused there, and parity.

    torchrun --nproc-per-node 2 examples/tp_draft.py                       # CPU (gloo) or GPUs (nccl, bf16)
    torchrun --nproc-per-node 2 examples/tp_draft.py --kv-write-op always  # CPU: lower the K/V writes too

Each rank builds the draft step of `dspark_fx/reference_tp_draft.py` twice: sharded with
`torch.distributed.tensor.parallel` (DTensor) and hand-sharded with functional all-reduces, holding
`num_kv_heads / world_size` K/V heads of every layer. Both are compiled with `torch.compile(backend=dspark_backend)`
(Inductor), run for two steps with an in-place weight update between them, and compared with the unsharded draft
(the same seed on every rank): the output and the rank's heads of every layer's K/V caches. Rank 0 prints one line
per rank and kind, from the rank's `counters["dspark_fx"]`.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

import dspark_fx
from dspark_fx.reference_tp_draft import (
    HandShardedDraft,
    TPDraft,
    TPDraftConfig,
    output_error,
    parallelize,
    rank_heads,
)
from dspark_fx.testing import TOLERANCES


def _inputs(cfg: TPDraftConfig, step: int, tokens: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(step)  # the same inputs on every rank
    block = 4
    inputs = (
        torch.randn(tokens, cfg.hidden, generator=gen).to(cfg.dtype),
        torch.randint(0, cfg.max_position, (tokens,), generator=gen),
        torch.randperm(cfg.num_slots, generator=gen)[:tokens],
        torch.randn(block, cfg.hidden, generator=gen).to(cfg.dtype),
        torch.randint(0, cfg.max_position, (block,), generator=gen),
    )
    return tuple(t.to(device) for t in inputs)


def _sharded(kind: str, full: TPDraft, rank: int, world: int, device: torch.device) -> torch.nn.Module:
    if kind == "dtensor":
        from torch.distributed.device_mesh import init_device_mesh

        return parallelize(TPDraft(full.cfg, world, device), init_device_mesh(device.type, (world,)))
    model = HandShardedDraft(full.cfg, rank, world, dist.group.WORLD, device)
    model.load_(full)
    return model


@torch.no_grad()
def _update_weights(kind: str, full: TPDraft, model: torch.nn.Module) -> None:
    """An in-place weight update after compiling (a K projection, an o_proj, a k_norm weight)."""
    for m in (full, model) if kind == "dtensor" else (full,):
        m.layers[1].k_proj.weight.mul_(-1.5)
        m.layers[0].o_proj.weight.mul_(0.5)
        m.layers[0].k_norm_weight.add_(0.25)
    if kind == "hand":
        model.load_(full)


def _what_fused(counts: dict[str, int]) -> str:
    """The pass's work in this rank's compile, from `counters["dspark_fx"]`."""
    if not counts.get("pass_runs"):
        return "served from Inductor's cache (the pass ran in an earlier run)"
    kept = [key.removeprefix("kv_kept_") for key in sorted(counts) if key.startswith("kv_kept_") and counts[key]]
    kv = f"K/V writes -> {counts.get('kv_writes_lowered', 0)} multi_linear_kv_write"
    kv += f", kept: {', '.join(kept)}" if kept else ""
    return (
        f"{counts.get('groups_fused', 0)} fused GEMM groups ({counts.get('branches_fused', 0)} GEMMs), "
        f"{counts.get('lone_gemms_routed', 0)} lone GEMMs routed, {kv}"
    )


def _run(kind: str, cfg: TPDraftConfig, args: argparse.Namespace, rank: int, world: int, device: torch.device) -> str:
    counters = torch._dynamo.utils.counters["dspark_fx"]
    counters.clear()
    full = TPDraft(cfg, device=device)
    model = _sharded(kind, full, rank, world, device)
    graphs: list[tuple[list[str], list[str]]] = []  # the collectives before and after the pass, per compile
    observe = lambda before, after, _report: graphs.append((_collectives(before), _collectives(after)))
    # on CPU ranks (gloo) the GEMM groups fuse only when asked: asked here, to show the rewrite as on CUDA
    options = {"kv_write_op": args.kv_write_op, "fuse_on_cpu": device.type == "cpu"}
    backend = dspark_fx.make_backend(options, observer=observe)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    heads, tol = rank_heads(cfg, rank, world), TOLERANCES[cfg.dtype]
    worst = 0.0
    with torch.no_grad():
        for step in range(2):
            inputs = _inputs(cfg, step, args.tokens, device)
            got, want = compiled(*inputs), full(*inputs)
            worst = max(worst, output_error(got, want))
            assert worst <= tol, f"rank {rank} {kind}: the output differs by {worst:.1e} of its largest value"
            for kv, kv_full in zip(model.caches(), full.caches(), strict=True):
                for cache, cache_full in zip(kv, kv_full, strict=True):
                    torch.testing.assert_close(cache, cache_full[:, heads], rtol=tol, atol=tol)
            if step == 0:
                _update_weights(kind, full, model)
    if not graphs:  # served from Inductor's cache: the pass did not run in this process
        order = "collectives not seen"
    elif all(after == before for before, after in graphs):
        order = f"{sum('all_reduce.' in c for c in graphs[0][0])} all-reduces kept in order"
    else:
        order = "the pass CHANGED the collectives"
    return (
        f"[rank {rank}] {kind:7s} {_what_fused(dict(counters))}; {order}; parity (K/V heads "
        f"{heads.start}:{heads.stop}): OK, output error {worst:.1e} of its largest value"
    )


def _collectives(graph: torch.fx.Graph) -> list[str]:
    """The graph's collective nodes in order (`_c10d_functional` ops: all_reduce, wait_tensor), by name and op."""
    return [f"{n.name}: {n.target}" for n in graph.nodes if "_c10d_functional" in str(n.target)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default="dtensor,hand", help="comma-separated: dtensor, hand")
    parser.add_argument("--kv-write-op", default="auto", choices=("auto", "always", "never"))
    parser.add_argument("--tokens", type=int, default=8)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = TPDraftConfig(hidden=64, num_heads=8, num_kv_heads=8, head_dim=16, intermediate=128, dtype=dtype)
    try:
        lines = [_run(kind, cfg, args, rank, world, device) for kind in args.kinds.split(",")]
        gathered: list[list[str] | None] = [None] * world
        dist.all_gather_object(gathered, lines)
        if rank == 0:
            print(
                f"tensor-parallel draft step on {world} rank(s), {device.type}, {cfg.dtype}, kv_write_op="
                f"{args.kv_write_op!r}; parity: the output and the rank's K/V heads of every layer's caches against "
                "the unsharded draft, 2 steps with an in-place weight update between them"
            )
            print("\n".join(line for rank_lines in gathered for line in rank_lines or []))
        # every rank done before any rank tears the group down (the abort at exit that gloo ranks still showed
        # after this barrier is handled below: `_exit_before_interpreter_teardown`)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if not cuda:
        _exit_before_interpreter_teardown()


def _exit_before_interpreter_teardown() -> None:
    """Ends a gloo rank whose work is done without Python's interpreter teardown.

    Once functional collectives have run, torch (2.11 and 2.13, measured) keeps the gloo process group and its worker
    threads alive after `destroy_process_group`. A worker thread that drops its last finished work (an all-gather's
    tensors, created by Python) only once the interpreter is shutting down must release their Python objects, takes the
    GIL for that, is ended by the shutting-down interpreter inside a destructor, and the process aborts ("terminate
    called without an active exception"): seen on a loaded 2-core machine after every line was printed, in about 1 run
    of 10. Exiting directly, with the output flushed, starts no interpreter shutdown.
    """
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
