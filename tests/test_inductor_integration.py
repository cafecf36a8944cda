"""The dspark backend through real Inductor codegen: dynamic token counts, FX graph cache, weight updates,
no per-call weight copies, mode/options, and composition with a user's post-grad pass."""

import copy
from pathlib import Path

import pytest
import torch
from helpers import draft_inputs, dspark_log_messages, small_config
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.utils import run_and_get_code

import custom_ops
import dspark_fx
from dspark_fx.passes import manager as manager_module
from dspark_fx.passes.manager import DsparkPassManager
from dspark_fx.reference_draft import DraftKVWriter
from dspark_fx.testing import CaptureBackend, assert_close_for_dtype, compile_counts

try:
    from torch._inductor.utils import fresh_cache
except ImportError:  # torch 2.11
    from torch._inductor.utils import fresh_inductor_cache as fresh_cache

pytestmark = pytest.mark.slow
counters = torch._dynamo.utils.counters


def _pair(cfg):
    eager = DraftKVWriter(cfg)
    return eager, copy.deepcopy(eager)


def test_dynamic_token_counts_compile_at_most_twice():
    torch._dynamo.reset()
    cfg = small_config(write="return")
    eager, model = _pair(cfg)
    compiled = torch.compile(model, backend=dspark_fx.dspark_backend)
    with compile_counts() as counts, torch.no_grad():
        for tokens in (1, 7, 64, 300):
            args = draft_inputs(cfg, tokens, seed=tokens)
            assert_close_for_dtype(compiled(*args), eager(*args))
    assert counts["frames"] <= 2, f"compiled {counts['frames']} graphs for 4 token counts"


def _compile_once(backend, cfg):
    torch._dynamo.reset()
    eager, model = _pair(cfg)
    args = draft_inputs(cfg, 9)
    with torch.no_grad():
        assert_close_for_dtype(torch.compile(model, backend=backend)(*args), eager(*args))


def test_capture_backend_observes_compiles_that_the_cache_would_serve():
    cfg = small_config(write="return", num_layers=2)
    with fresh_cache():
        _compile_once(dspark_fx.make_backend(), cfg)  # the same graph is now in the FX graph cache
        counters.clear()
        capture = CaptureBackend(inner="inductor")
        _compile_once(capture, cfg)
        capture.assert_fused(n_groups=1, n_branches=[2])
        assert counters["inductor"]["fxgraph_cache_hit"] == 0, dict(counters["inductor"])


def test_fx_graph_cache_hits_and_misses(tmp_path, monkeypatch):
    cfg = small_config(write="return", num_layers=2)
    with fresh_cache():
        counters.clear()
        _compile_once(dspark_fx.make_backend(), cfg)
        assert counters["inductor"]["fxgraph_cache_miss"] == 1
        _compile_once(dspark_fx.make_backend(), cfg)
        assert counters["inductor"]["fxgraph_cache_hit"] == 1, dict(counters["inductor"])
        _compile_once(dspark_fx.make_backend(dspark_fx.DsparkConfig(max_leaf_numel=4096)), cfg)
        assert counters["inductor"]["fxgraph_cache_miss"] == 2, "a changed pass config must miss the cache"
        changed_source = tmp_path / "extra_pass.py"
        changed_source.write_text("# a pass source that changed\n")
        sources = (*manager_module.source_files(), str(changed_source))
        monkeypatch.setattr(
            manager_module, "_SOURCES", manager_module._digest(sources)
        )  # as imported by another version
        _compile_once(dspark_fx.make_backend(), cfg)
        assert counters["inductor"]["fxgraph_cache_miss"] == 3, "a changed pass source must miss the cache"


def test_the_uuid_hashes_the_sources_as_imported_and_what_decides_the_rewrite(monkeypatch):
    """The sources are hashed once, when the passes are imported: files changed on disk afterwards (an editable
    install being edited) must not label the graphs of the code this process runs with their hash, where a later
    process running the changed code would take them from the cache. Hashed: the passes, the ops' modules and the
    checks their fake calls run (a refusal keeps writes on their path); in the key: the fp32 matmul precision the
    outer-product rewrite reads."""
    uuid = DsparkPassManager().uuid()
    monkeypatch.setattr(manager_module, "source_files", lambda: ("/nonexistent/changed_pass.py",))
    assert DsparkPassManager().uuid() == uuid, "uuid() read the files again"
    monkeypatch.undo()
    names = {
        Path(p).relative_to(Path(custom_ops.__file__).parent.parent).as_posix() for p in manager_module.source_files()
    }
    assert {
        "custom_ops/checks.py",
        "custom_ops/_library.py",
        "custom_ops/_inductor_offsets.py",
        "dspark_fx/passes/kv_write.py",
    } <= names, names
    assert "custom_ops/linear/multi_linear_kv_write.py" in names
    mkldnn = torch.backends.mkldnn.matmul
    precision = mkldnn.fp32_precision
    mkldnn.fp32_precision = "bf16"
    try:
        assert DsparkPassManager().uuid() != uuid, "an fp32 matmul precision that rounds must change the key"
    finally:
        mkldnn.fp32_precision = precision
    assert DsparkPassManager().uuid() == uuid


def test_a_cache_hit_is_logged_and_counted():
    """The pass does not run on an FX graph cache hit; the backend still logs the compile, as a cache hit."""
    cfg = small_config(write="return", num_layers=2)
    with dspark_log_messages() as messages, fresh_cache():
        counters.clear()
        _compile_once(dspark_fx.make_backend(), cfg)
        assert not any("cache hit" in m for m in messages), messages
        _compile_once(dspark_fx.make_backend(), cfg)
    assert counters["inductor"]["fxgraph_cache_hit"] == 1, dict(counters["inductor"])
    hits = [m for m in messages if "cache hit" in m]
    assert len(hits) == 1 and "the pass did not run now" in hits[0], messages
    assert counters["dspark_fx"]["pass_runs"] == 1 and counters["dspark_fx"]["graphs_from_cache"] == 1


def test_in_place_weight_updates_are_seen_and_no_weight_is_copied_per_call():
    torch._dynamo.reset()
    cfg = small_config(write="return", qkv_bias=True)
    eager, model = _pair(cfg)
    compiled = torch.compile(model, backend=dspark_fx.dspark_backend)
    args = draft_inputs(cfg, 6)
    with torch.no_grad():
        _, (code,) = run_and_get_code(compiled, *args)
        assert "dspark.multi_linear" in code
        assert "aten.cat" not in code and "torch.cat" not in code
        for p_e, p_c in zip(eager.parameters(), model.parameters(), strict=True):
            noise = torch.randn_like(p_e)
            p_e.add_(noise)
            p_c.add_(noise)
        assert_close_for_dtype(compiled(*args), eager(*args))
        fresh = DraftKVWriter(small_config(write="return", qkv_bias=True, seed=7))
        eager.load_state_dict(fresh.state_dict())
        model.load_state_dict(fresh.state_dict())
        assert_close_for_dtype(compiled(*args), eager(*args))


class _CountingPass(CustomGraphPass):
    def __init__(self):
        self.calls = 0

    def __call__(self, graph):
        self.calls += 1

    def uuid(self):
        return b"counting-pass-v1"


def test_user_post_pass_is_composed_not_overwritten():
    torch._dynamo.reset()
    user_pass = _CountingPass()
    cfg = small_config(write="return", num_layers=2)
    reports = []
    backend = dspark_fx.make_backend(observer=lambda _before, _after, report: reports.append(report))
    with torch._inductor.config.patch(post_grad_custom_post_pass=user_pass, force_disable_caches=True):
        _compile_once(backend, cfg)
    assert user_pass.calls == 1
    assert [r.n_groups for r in reports] == [1]
    assert dspark_fx.DsparkPassManager(user_pass=user_pass).uuid() != dspark_fx.DsparkPassManager().uuid()


def test_a_list_of_user_post_passes_is_composed_through_inductor():
    torch._dynamo.reset()
    first, second = _CountingPass(), _CountingPass()
    cfg = small_config(write="return", num_layers=2)
    with torch._inductor.config.patch(post_grad_custom_post_pass=[first, second], force_disable_caches=True):
        _compile_once(dspark_fx.dspark_backend, cfg)
    assert (first.calls, second.calls) == (1, 1)


def test_mode_and_options_are_accepted():
    torch._dynamo.reset()
    cfg = small_config(write="return", num_layers=2)
    eager, model = _pair(cfg)
    compiled = torch.compile(model, backend=dspark_fx.dspark_backend, options={"epilogue_fusion": False})
    args = draft_inputs(cfg, 5)
    with torch.no_grad():
        assert_close_for_dtype(compiled(*args), eager(*args))
    torch._dynamo.reset()
    compiled = torch.compile(copy.deepcopy(eager), backend=dspark_fx.dspark_backend, mode="default")
    with torch.no_grad():
        assert_close_for_dtype(compiled(*args), eager(*args))


def test_reduce_overhead_reaches_inductor():
    """`torch.compile(..., backend=dspark_backend, mode="reduce-overhead")` hands the mode to the backend, which turns
    on Inductor's CUDA graphs (`triton.cudagraphs`): on CPU Inductor then records one skipped CUDA graph, which it
    does not without the mode."""
    cfg = small_config(num_layers=2)
    model = DraftKVWriter(cfg)
    args = draft_inputs(cfg, 5)
    skips = []
    for mode in (None, "reduce-overhead"):
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(copy.deepcopy(model), backend=dspark_fx.dspark_backend, mode=mode)
        with torch.no_grad():
            compiled(*args)
        skips.append(counters["inductor"]["cudagraph_skips"])
    assert skips == [0, 1]


class _TrainedBranches(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lins = torch.nn.ModuleList(torch.nn.Linear(16, 16, bias=False) for _ in range(3))

    def forward(self, x):
        return sum(lin(x).relu() for lin in self.lins)


def test_a_backward_graph_served_by_the_cache_at_the_first_backward_is_counted():
    """AOTAutograd compiles a training graph's backward at the first backward, after the backend returned: a
    second compile whose forward and backward both come from the FX graph cache counts two graphs from the cache
    (one a compile later than the backend call) and no pass run."""
    with fresh_cache(), torch._functorch.config.patch(enable_autograd_cache=False):
        for _ in range(2):
            torch._dynamo.reset()
            counters.clear()
            torch.manual_seed(0)
            model = torch.compile(_TrainedBranches(), backend=dspark_fx.make_backend({"fuse_on_cpu": True}))
            model(torch.randn(4, 16)).sum().backward()
    assert counters["inductor"]["fxgraph_cache_hit"] == 2, dict(counters["inductor"])
    assert counters["dspark_fx"]["pass_runs"] == 0 and counters["dspark_fx"]["graphs_from_cache"] == 2
