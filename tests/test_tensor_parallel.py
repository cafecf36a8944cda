"""Tensor-parallel drafts: each rank's graph of the draft step (`dspark_fx/reference_tp_draft.py`), sharded with
`torch.distributed.tensor.parallel` (DTensor) or by hand with functional all-reduces, compiled with the dspark
passes on 2 and 4 gloo ranks (CPU). On every rank the context K/V GEMMs of all layers fuse (one group of the rank's
K/V heads; with `kv_write_op="always"` one `multi_linear_kv_write`), the caches match the same heads of the
unsharded draft before and after in-place weight updates, Dynamo compiles one graph without breaks, and the
collectives of the post-pass graph are those of the graph before it, in the same order.

On GPUs (`cuda`): the same with NCCL, one rank per GPU, `dspark_backend` as users compile it (Inductor codegen, the
op's CUDA kernel), eagerly and in CUDA-graph replays; 1 rank needs one GPU, 2 ranks two."""

import pytest
import torch
from tp_cases import CFG, KINDS, NCCL_CFG, spawn

pytestmark = pytest.mark.slow  # gloo ranks in processes of their own

LAYERS = CFG.num_layers
# what the pass does on every rank, by kind, with kv_write_op="always" (counters["dspark_fx"])
EXPECTED = {
    # per layer: q/k/v on hidden (one group of 3) and gate/up (one group of 2); o_proj, down_proj routed alone
    "dtensor": dict(groups_fused=2 * LAYERS, branches_fused=5 * LAYERS, lone_gemms_routed=2 * LAYERS),
    # per layer: the fused qkv_proj, gate_up_proj, o_proj and down_proj GEMMs on hidden are one each: routed alone
    "hand": dict(groups_fused=0, branches_fused=0, lone_gemms_routed=4 * LAYERS),
}


def _check_ranks(summaries: dict, world_size: int, kinds: tuple[str, ...], explained: bool) -> None:
    kv_rows = CFG.num_kv_heads // world_size * CFG.head_dim
    for rank, by_kind in summaries.items():
        for kind in kinds:
            facts = by_kind[kind]
            counts = facts["counters"]
            want = {"pass_runs": 1, "kv_writes_lowered": 1, "kv_writes_kept": 0, "rejected": 0, **EXPECTED[kind]}
            assert {k: counts.get(k, 0) for k in want} == want, f"rank {rank} {kind}:\n{facts['report']}"
            assert facts["frames"] == 1 and facts["graph_breaks"] == 0, f"rank {rank} {kind}: {facts}"
            assert facts["gemms_left"] == 0, facts["report"]
            assert facts["collectives"] == ["_c10d_functional.all_reduce", "_c10d_functional.wait_tensor"] * (
                2 * LAYERS
            )
            (layers,) = facts["kv_writes"]
            assert len(layers) == LAYERS, facts["report"]
            first = "layers.0.k_proj.weight[0:" if kind == "dtensor" else "layers.0.qkv_proj.weight["
            assert layers[0].startswith(f"K {first}") and "-> k_cache_0" in layers[0], layers
            if not explained:
                continue
            # kv_write_op="auto" on CPU: the K/V GEMMs of all layers on ctx fuse, K norm/RoPE batched across layers
            report = facts["explain"]
            assert report["kv_kept"] == ["DEVICE"], report["text"]
            last = f"layers.{LAYERS - 1}."
            (ctx,) = [a for a, b in report["groups"].items() if b[0].startswith("layers.0.") and b[-1].startswith(last)]
            branches = report["groups"][ctx]
            if kind == "dtensor":
                assert branches == [
                    f"layers.{i}.{p}_proj.weight[0:{kv_rows}]" for i in range(LAYERS) for p in ("k", "v")
                ], report["text"]
                assert sorted(report["batched"][ctx]) == [[0, 2], [1, 3]], report["text"]
            else:  # the K and V rows of each layer's qkv_proj shard: one GEMM per layer
                q_rows = CFG.num_heads // world_size * CFG.head_dim
                assert branches == [
                    f"layers.{i}.qkv_proj.weight[{q_rows}:{q_rows + 2 * kv_rows}]" for i in range(LAYERS)
                ], report["text"]
                assert report["batched"][ctx] == [list(range(LAYERS))], report["text"]


def test_two_ranks_fuse_lower_and_match_the_unsharded_draft(tmp_path):
    summaries = spawn(2, tmp_path, KINDS, explain_too=True)
    _check_ranks(summaries, 2, KINDS, explained=True)


def test_four_ranks_one_kv_head_each(tmp_path):
    summaries = spawn(4, tmp_path, KINDS, explain_too=False)
    _check_ranks(summaries, 4, KINDS, explained=False)


@pytest.mark.cuda
@pytest.mark.parametrize("world_size", [1, 2])
def test_nccl_ranks_lower_and_match_eagerly_and_in_cuda_graph_replays(tmp_path, world_size):
    """Every NCCL rank lowers its K/V writes of all layers to one `multi_linear_kv_write` (the default "auto" on
    CUDA), keeps its collectives, compiles one graph, and matches the unsharded draft eagerly and in CUDA-graph
    replays, in-place weight updates included (checked in the rank: `tp_cases.check_rank_nccl`)."""
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs, this machine has {torch.cuda.device_count()}")
    summaries = spawn(world_size, tmp_path, KINDS, explain_too=False, backend="nccl")
    for rank, by_kind in summaries.items():
        for kind in KINDS:
            facts = by_kind[kind]
            counts = facts["counters"]
            want = {"kv_writes_lowered": 1, "kv_writes_kept": 0}
            assert {k: counts.get(k, 0) for k in want} == want, f"rank {rank} {kind}:\n{facts['report']}"
            assert facts["frames"] == 1 and facts["graph_breaks"] == 0, f"rank {rank} {kind}: {facts}"
            if world_size > 1:
                pairs = ["_c10d_functional.all_reduce", "_c10d_functional.wait_tensor"] * (2 * NCCL_CFG.num_layers)
                assert facts["collectives"] == pairs, f"rank {rank} {kind}: {facts['collectives']}"
