"""GPU checks of the horizontal fusion: bf16 parity on CUDA and CUDA-graph capture under reduce-overhead."""

import copy

import pytest
import torch
from helpers import draft_inputs, eager_and_compiled, small_config

import dspark_fx
from dspark_fx.reference_draft import DraftKVConfig, DraftKVWriter
from dspark_fx.testing import CaptureBackend, assert_close_for_dtype

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("proj", ["qkv_slice", "qkv_split", "kv_separate"])
@pytest.mark.parametrize("write", ["cache_loc", "commit", "return"])
def test_cuda_bf16_parity_inductor(proj, write):
    torch._dynamo.reset()
    cfg = small_config(proj=proj, write=write, dtype=torch.bfloat16, hidden=256, head_dim=64, num_layers=5)
    capture = CaptureBackend(inner="inductor")
    for eager, compiled in eager_and_compiled(cfg, capture, tokens_list=(8, 33), device="cuda"):
        assert_close_for_dtype(compiled, eager, torch.bfloat16)
    if write == "return":  # K and V leave the graph: the fused GEMM and the batched norm/RoPE
        capture.assert_fused(n_groups=1)
    else:  # the whole write path is one dspark::multi_linear_kv_write on CUDA (kv_write_op="auto")
        assert all(len(r.kv_writes) == 1 and r.n_groups == 0 for r in capture.reports), capture.reports


def test_lowered_write_copies_no_weights():
    """Qwen3-8B draft dims: compiling and running the lowered write allocates nothing that outlives the call (no
    concatenated or cast copy of the 5 layers' weights), and an in-place weight update is seen."""
    torch._dynamo.reset()
    cfg = DraftKVConfig(num_layers=5, hidden=4096, num_heads=32, num_kv_heads=8, head_dim=128, num_slots=4096)
    model = DraftKVWriter(cfg, "cuda")
    args = draft_inputs(cfg, 8, "cuda", seed=3)
    capture = CaptureBackend(inner="inductor")
    compiled = torch.compile(model, backend=capture)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with torch.no_grad():
        compiled(*args)
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated() - before
    assert grown < 1 << 20, f"{grown} bytes outlive the compiled call"
    assert len(capture.report.kv_writes) == 1, capture.report
    reference = DraftKVWriter(cfg, "cuda")
    with torch.no_grad():
        for p in model.layers[2].parameters():
            p.mul_(-1.5)
        reference.load_state_dict(model.state_dict())
        compiled(*args)
        reference(*args)
    for (k_r, v_r), (k_c, v_c) in zip(reference.caches(), model.caches(), strict=True):
        assert_close_for_dtype(k_c, k_r, torch.bfloat16)
        assert_close_for_dtype(v_c, v_r, torch.bfloat16)


def test_colocated_weights_write_what_separate_weights_write():
    """`colocate_weights=True` on a draft with separate k_proj / v_proj: the weights move into one allocation after
    the first compile, and the lowered write (fused kernel at 8 tokens, GEMM path at 64 and 300, one symbolic graph
    for both) writes the caches a compile of an unmoved copy writes; an in-place update after the move is seen."""
    torch._dynamo.reset()
    cfg = DraftKVConfig(
        num_layers=5, hidden=1024, num_heads=8, num_kv_heads=4, head_dim=128, num_slots=2048, proj="kv_separate"
    )
    moved = DraftKVWriter(cfg, "cuda")
    plain = copy.deepcopy(moved)
    capture = CaptureBackend(config={"colocate_weights": True}, inner="inductor")
    moved_compiled = torch.compile(moved, backend=capture)
    plain_compiled = torch.compile(plain, backend=dspark_fx.dspark_backend)
    weights = [w for layer in moved.layers for w in (layer.k_proj.weight, layer.v_proj.weight)]
    for step, tokens in enumerate((8, 64, 300)):
        args = draft_inputs(cfg, tokens, "cuda", seed=step + 1)
        with torch.no_grad():
            if step == 2:  # an update through the parameters lands in the allocation the op reads
                for model in (moved, plain):
                    model.layers[3].v_proj.weight.mul_(-0.5)
            moved_compiled(*args)
            plain_compiled(*args)
        storage = weights[0].untyped_storage().data_ptr()
        assert all(w.untyped_storage().data_ptr() == storage for w in weights)
        assert [w.storage_offset() for w in weights] == [i * weights[0].numel() for i in range(len(weights))]
        for (k_m, v_m), (k_p, v_p) in zip(moved.caches(), plain.caches(), strict=True):
            assert_close_for_dtype(k_m, k_p, torch.bfloat16)
            assert_close_for_dtype(v_m, v_p, torch.bfloat16)
    assert all(len(r.kv_writes) == 1 for r in capture.reports), capture.reports
    assert capture.reports[0].colocated[0].moved


def _cudagraph_counters():
    counters = torch._dynamo.utils.counters["inductor"]
    return counters["cudagraph_skips"], counters["cudagraph_recorded_non_static_inputs"]


@pytest.mark.parametrize("write", ["cache_loc", "commit"])
def test_reduce_overhead_runs_as_cuda_graphs(write):
    """Caches held as registered buffers: Inductor must capture CUDA graphs (no 'mutated inputs' skip)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    cfg = small_config(write=write, dtype=torch.bfloat16, hidden=256, head_dim=64, num_layers=5)
    eager = DraftKVWriter(cfg, "cuda")
    model = DraftKVWriter(cfg, "cuda")
    model.load_state_dict(eager.state_dict())
    compiled = torch.compile(model, backend=dspark_fx.dspark_backend, mode="reduce-overhead")
    with torch.no_grad():
        for step in range(6):
            args = draft_inputs(cfg, 16, "cuda", seed=step)
            eager(*args)
            compiled(*args)
    torch.cuda.synchronize()
    skips, _ = _cudagraph_counters()
    assert skips == 0, f"Inductor skipped CUDA graphs: {dict(torch._dynamo.utils.counters['inductor'])}"
    from torch._inductor.cudagraph_trees import get_container

    manager = get_container(torch.cuda.current_device()).tree_manager
    assert manager is not None and manager.new_graph_id().id > 0, "no CUDA graph was recorded"
    for (k_e, v_e), (k_c, v_c) in zip(eager.caches(), model.caches(), strict=True):
        assert_close_for_dtype(k_c, k_e, torch.bfloat16)
        assert_close_for_dtype(v_c, v_e, torch.bfloat16)
