"""The HF-style draft of `benchmarks/draft_step.py` under the dspark passes (tiny dims, fp32, no Inductor codegen):
it matches eager, the context K/V GEMMs of all layers become one `dspark.multi_linear` with one batched k_norm/RoPE,
and context lengths share one symbolic graph (plus the T=1 graph)."""

import copy
import importlib
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dspark_fx import DsparkConfig
from dspark_fx.testing import CaptureBackend, assert_close_for_dtype, compile_counts, op_counts

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
draft_step = importlib.import_module("draft_step")

CFG = draft_step.SMALL
LAYERS = CFG.num_layers


def _eager_and_compiled():
    torch._dynamo.reset()
    model = draft_step.build_draft(CFG, "cpu", torch.float32)
    capture = CaptureBackend()
    return model, torch.compile(copy.deepcopy(model), backend=capture), capture


def _inputs(ctx_len: int) -> tuple:
    return draft_step.draft_inputs(CFG, ctx_len, "cpu", torch.float32, seed=ctx_len)


@pytest.mark.usefixtures("lone_gemms_routed_on_cpu")
def test_context_kv_of_all_layers_fuse_into_one_multi_linear():
    model, compiled, capture = _eager_and_compiled()
    with torch.no_grad():
        inputs = _inputs(9)
        assert_close_for_dtype(compiled(*inputs), model(*inputs))
    (report,) = capture.reports
    (context,) = [group for group in report.groups if group.activation == "target_hidden"]
    weights = [branch.split("[")[0] for branch in context.branches]
    assert weights == [f"layers.{i}.{proj}_proj.weight" for i in range(LAYERS) for proj in ("k", "v")]
    assert sorted(len(cls.branches) for cls in context.classes) == [LAYERS, LAYERS]  # K norm+RoPE, V views
    before, after = op_counts(capture.before[0]), op_counts(capture.after[0])
    assert before["aten.mm"] == 9 * LAYERS and before["dspark.multi_linear"] == 0
    # context K/V: one group; per layer q/k/v and gate/up: one group each; o_proj and down_proj (skinny linears)
    # are routed through multi_linear on their own (as on CUDA)
    assert after["dspark.multi_linear"] == 1 + 4 * LAYERS and after["aten.mm"] == 0
    assert len(capture.report.routed) == 2 * LAYERS
    assert after["aten.rsqrt"] == before["aten.rsqrt"] - (LAYERS - 1)  # the context k_norms run once


@pytest.mark.usefixtures("lone_gemms_routed_on_cpu")
def test_the_unbatched_column_fuses_the_same_gemms_and_norms_each_layer_on_its_slice():
    """The benchmark's "no batched regions" column (`batch_regions=False`): the same multi_linear calls as
    dspark_backend, context K/V of all layers in one, but every layer's k_norm on its own slice of that GEMM's output
    (as many rsqrt as before the pass), and the eager result."""
    torch._dynamo.reset()
    model = draft_step.build_draft(CFG, "cpu", torch.float32)
    capture = CaptureBackend(DsparkConfig(batch_regions=False))
    compiled = torch.compile(copy.deepcopy(model), backend=capture)
    with torch.no_grad():
        inputs = _inputs(9)
        assert_close_for_dtype(compiled(*inputs), model(*inputs))
    before, after = op_counts(capture.before[0]), op_counts(capture.after[0])
    assert after["dspark.multi_linear"] == 1 + 4 * LAYERS and after["aten.mm"] == 0
    assert after["aten.rsqrt"] == before["aten.rsqrt"]


def test_the_hand_stacked_column_is_the_same_draft_with_one_weight_per_merged_projection():
    """The benchmark's hand-stacked baseline (`HandStackedDraft`, plain torch.compile): the eager result, and in its
    graph one GEMM for the context K/V of all layers and per layer one for q/k/v, o_proj, gate/up and down_proj, each
    reading one parameter of the concatenated rows, with one batched context k_norm (one rsqrt fewer per layer but
    one)."""
    torch._dynamo.reset()
    model = draft_step.build_draft(CFG, "cpu", torch.float32)
    hand = draft_step.HandStackedDraft(model)
    capture = CaptureBackend(DsparkConfig(min_branches=LAYERS * 100, skinny_linears=False))  # the pass fuses nothing
    with torch.no_grad():
        inputs = _inputs(9)
        assert_close_for_dtype(torch.compile(hand, backend=capture)(*inputs), model(*inputs))
        plain = CaptureBackend(DsparkConfig(min_branches=LAYERS * 100, skinny_linears=False))
        torch.compile(copy.deepcopy(model), backend=plain)(*inputs)
    counts, plain_counts = op_counts(capture.before[0]), op_counts(plain.before[0])
    assert counts["aten.mm"] + counts["aten.addmm"] == 1 + 4 * LAYERS
    assert plain_counts["aten.mm"] + plain_counts["aten.addmm"] == 9 * LAYERS
    assert counts["aten.rsqrt"] == plain_counts["aten.rsqrt"] - (LAYERS - 1)
    stacked = {name: p.shape for name, p in hand.named_parameters() if "proj" in name and "o_proj" not in name}
    kv, q = CFG.num_kv_heads * CFG.head_dim, CFG.num_heads * CFG.head_dim
    assert stacked["ctx_kv_proj.weight"] == (LAYERS * 2 * kv, CFG.hidden)
    assert stacked["layers.0.qkv_proj.weight"] == (q + 2 * kv, CFG.hidden)
    assert stacked["layers.0.mlp.gate_up_proj.weight"] == (2 * CFG.intermediate, CFG.hidden)
    assert not any(name.endswith(("q_proj.weight", "k_proj.weight", "gate_proj.weight")) for name in stacked)


@pytest.mark.slow
def test_context_lengths_share_one_symbolic_graph():
    model, compiled, capture = _eager_and_compiled()
    with compile_counts() as counts, torch.no_grad():
        for ctx_len in (1, 7, 16, 40):
            inputs = _inputs(ctx_len)
            assert_close_for_dtype(compiled(*inputs), model(*inputs))
    assert counts["frames"] <= 2, f"compiled {counts['frames']} graphs for 4 context lengths"
    capture.assert_fused(n_groups=1 + 2 * LAYERS)


@pytest.mark.slow
def test_gemm_profile_reads_every_weight_once_per_step():
    """`gemm_profile` (the benchmark's per-GEMM table) on the passes' graph without codegen: one family for the
    context K/V of all layers, and, summed over the families, every nn.Linear weight read once per step (k_proj and
    v_proj twice: for the context and for the block)."""
    model, compiled, _ = _eager_and_compiled()
    ctx_len = 9
    families, kernels, gemm_kernels, others = draft_step.gemm_profile(compiled, _inputs(ctx_len), model, "cpu")
    assert kernels == gemm_kernels == 0 and others == {}  # no CUDA kernels on CPU
    calls = draft_step.PROFILED_CALLS
    assert all(f.calls % calls == 0 and f.us > 0 for f in families), families
    weights = sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, torch.nn.Linear))
    block_kv = sum((layer.k_proj.weight.numel() + layer.v_proj.weight.numel()) * 4 for layer in model.layers)
    assert sum(f.weight_bytes(4) * f.calls // calls for f in families) == weights + block_kv  # k/v: context, block
    kv = CFG.num_kv_heads * CFG.head_dim
    (context,) = [f for f in families if f.rows == ctx_len]
    assert (context.op, context.columns, context.projections) == (
        "dspark::multi_linear",
        (kv,) * 2 * LAYERS,
        "k_proj/v_proj",
    )
    assert context.calls == calls
    lines = draft_step.gemm_table("dspark_backend", ctx_len, (families, 0, 0, {}), 1e9, 4, "cpu")
    assert sum(line.startswith("| ") for line in lines) == 1 + len(families)  # the header, one row per family


def _event(name: str, parent=None, kernels=()):
    """A stand-in for a profiler op event: its name, parent op and the CUDA kernels it launched (name, µs)."""
    return SimpleNamespace(
        name=name, cpu_parent=parent, kernels=[SimpleNamespace(name=k, duration=us) for k, us in kernels]
    )


def test_other_kernels_leave_out_the_gemms_and_sum_per_name():
    """`other_kernels`: the kernels launched outside the GEMM ops (also those a GEMM op launches through nested ops
    are left out), launches and µs summed per kernel name; the table lists them per step, the longest first."""
    gemm_names = {"aten::mm", "dspark::multi_linear"}
    mm = _event("aten::mm")
    multi = _event("dspark::multi_linear")
    events = [
        mm,
        _event("cudaLaunchKernel", mm, [("gemm_kernel", 20.0)]),
        multi,
        _event("cudaLaunchKernel", _event("aten::mm", multi), [("nested_gemm", 9.0)]),
        _event("cuLaunchKernel", None, [("triton_poi_fused_add", 2.0)]),
        _event("cuLaunchKernel", _event("aten::add"), [("triton_poi_fused_add", 3.0), ("flash_fwd", 7.5)]),
        _event("aten::view"),
    ]
    others = draft_step.other_kernels(events, gemm_names)
    assert others == {"triton_poi_fused_add": [2, 5.0], "flash_fwd": [1, 7.5]}
    calls = draft_step.PROFILED_CALLS
    lines = draft_step.gemm_table("dspark_backend", 16, ([], 3 * calls, 2 * calls, others), 1e9, 2, "cuda")
    rows = [line for line in lines if line.startswith("| `")]
    assert rows == [
        f"| `flash_fwd` | {1 / calls:g} | {7.5 / calls:.1f} |",
        f"| `triton_poi_fused_add` | {2 / calls:g} | {5 / calls:.1f} |",
    ]
    assert not any(line.startswith("| the other") for line in lines)


def test_other_kernels_past_the_row_limit_are_summed_and_long_names_keep_their_end(monkeypatch):
    """Past `OTHER_KERNEL_ROWS` the kernels are summed in one row; a name longer than 80 characters keeps its start
    and its end (two Triton kernels of one fusion differ only in their index)."""
    calls = draft_step.PROFILED_CALLS
    long = "triton_per_fused__to_copy_add_arange_cat_cos_div_mean_mul_neg_pow_rsqrt_sin_slice_view_"
    others = {f"{long}{i}": [calls, float(10 - i)] for i in range(4)}
    monkeypatch.setattr(draft_step, "OTHER_KERNEL_ROWS", 2)
    lines = draft_step.gemm_table("dspark_backend", 16, ([], 0, 0, others), 1e9, 2, "cuda")
    rows = [line for line in lines if line.startswith("| `") or line.startswith("| the other")]
    names = [row.split("`")[1] for row in rows[:2]]
    assert [len(n) for n in names] == [80, 80] and names[0] != names[1]
    assert names[0].startswith("triton_per_fused") and names[0].endswith("_view_0") and names[1].endswith("_view_1")
    assert rows[2] == f"| the other 2 kernels | 2 | {(8 + 7) / calls:.1f} |"


@pytest.mark.parametrize("with_q", [False, True], ids=["kv-merged", "qkv-merged"])
@pytest.mark.parametrize("ctx_len", [1, 9])
def test_the_merged_kv_probe_is_the_same_draft(with_q, ctx_len):
    """`benchmarks/experimental/merged_kv_draft.py` times the draft with each layer's K/V (and Q) weights applied
    once to the context and block rows together: eagerly it gives the draft's result, so its times compare the same
    computation."""
    merged_kv_draft = importlib.import_module("experimental.merged_kv_draft")
    model = draft_step.build_draft(CFG, "cpu", torch.float32)
    with torch.no_grad():
        inputs = _inputs(ctx_len)
        assert_close_for_dtype(merged_kv_draft.MergedKVDraft(model, with_q)(*inputs), model(*inputs))


def test_step_gemm_work_reads_each_weight_once_and_multiplies_every_row():
    """`step_gemm_work`: one entry per nn.Linear, its weight's bytes once, its FLOPs over the block's rows, plus the
    context's for k_proj and v_proj (they also project `target_hidden`)."""
    model = draft_step.build_draft(CFG, "cpu", torch.float32)
    ctx_len, block = 9, draft_step.BLOCK
    work = draft_step.step_gemm_work(model, ctx_len)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert len(work) == len(linears) == 7 * LAYERS
    for (name, linear), (weight_bytes, flops) in zip(linears, work, strict=True):
        rows = block + ctx_len if name.endswith(("k_proj", "v_proj")) else block
        assert weight_bytes == linear.in_features * linear.out_features * 4
        assert flops == 2 * rows * linear.in_features * linear.out_features


def test_gemm_bounds_floor_and_roofline():
    """`gemm_bounds`: the floor is the larger of all bytes at the copy rate and all FLOPs at the GEMM rate; the
    roofline sums each GEMM's larger one (a memory-bound and a compute-bound GEMM: both counted in full)."""
    bandwidth = rate = 1e6  # bytes/s and FLOP/s: 1 µs per byte and per FLOP
    floor, roofline = draft_step.gemm_bounds([(100, 10), (10, 1000)], bandwidth, rate)
    assert floor == pytest.approx(1010.0) and roofline == pytest.approx(1100.0)


@pytest.mark.parametrize(("cublas_us", "verdict"), [(900.0, "above"), (800.0, "within")])
def test_speedup_bound_measures_the_target_against_the_fastest_way_of_running_the_gemms(cublas_us, verdict):
    """`speedup_bound`: the target time (torch.compile's ÷ `TARGET_SPEEDUP`) less the other kernels is what the
    GEMMs may take, as µs and as an average rate over their weights; it is set against the fastest of the measured
    ways (a reader slower than cuBLAS bounds nothing), the others listed after it, and the roofline."""
    compile_us = 1000.0 * draft_step.TARGET_SPEEDUP
    times = {"dspark_backend's GEMM kernels": 990.0, "cuBLAS": cublas_us, draft_step.READ: 950.0}
    bandwidth = 4e12  # bytes/s: 3.4 GB in 850 µs is that rate
    line = draft_step.speedup_bound(512, compile_us, 700.0, 150.0, 3_400_000_000, bandwidth, times)
    assert line.startswith(f"Context 512: {draft_step.TARGET_SPEEDUP}x faster than torch.compile is 1000.0 µs")
    assert (
        "take 150.0 (the gaps between launches not counted), which leaves its GEMMs at most 850.0 (4.00 TB/s, 100 %"
        in line
    )
    assert f"fastest of them as measured: cuBLAS {cublas_us:.1f} " in line
    assert f"{verdict} that (then {draft_step.READ} 950.0; dspark_backend's GEMM kernels 990.0)" in line
    assert line.endswith(
        "at their roofline with each weight read once (700.0; the GEMMs as run read the K/V weights twice) the step "
        "would take 850.0."
    )


def test_speedup_bound_when_the_other_kernels_alone_miss_the_target():
    """Other kernels slower than the whole target leave the GEMMs no time: said so, not as a negative rate."""
    line = draft_step.speedup_bound(16, 130.0, 50.0, 120.0, 10**7, 1e12, {"cuBLAS": 60.0})
    assert "which leaves its GEMMs at most -20.0, less than nothing for the 10.0 MB of weights" in line
    assert "cuBLAS 60.0 (0.17 TB/s, 17 % of the copy rate), above that;" in line


def test_gemm_read_us_weighs_each_family_by_its_calls_per_step():
    """`gemm_read_us`: each family's read time (cached per byte count, as measured once per run) times its calls per
    step (`calls` counts every profiled call)."""
    calls = draft_step.PROFILED_CALLS
    qkv = draft_step.GemmFamily("dspark::multi_linear", 16, 64, (64, 32, 32), "q_proj", calls=5 * calls)
    context = draft_step.GemmFamily("dspark::multi_linear", 9, 64, (32,) * 6, "k_proj/v_proj", calls=calls)
    reads = {qkv.weight_bytes(2): 3.0, context.weight_bytes(2): 7.0}
    assert draft_step.gemm_read_us([qkv, context], 2, reads) == pytest.approx(5 * 3.0 + 7.0)
