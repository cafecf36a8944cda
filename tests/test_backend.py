"""The backend object: validated settings at `make_backend` time, nothing kept per compile."""

import copy
import gc
import importlib.metadata
import subprocess
import sys

import pytest
import torch
from helpers import draft_inputs, small_config
from torch import nn
from torch._inductor.custom_graph_pass import CustomGraphPass

import custom_ops._build
import dspark_fx
from dspark_fx import DsparkConfig, make_backend
from dspark_fx.backend import DsparkBackend
from dspark_fx.passes.manager import _INFERENCE_AWARE, KEPT_REPORTS, DsparkPassManager
from dspark_fx.reference_draft import DraftKVWriter
from dspark_fx.testing import CaptureBackend, assert_close_for_dtype

counters = torch._dynamo.utils.counters


class _Three(nn.Module):
    """Three GEMMs on one input: one fused group."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(3))

    def forward(self, x):
        return [lin(x).relu() for lin in self.lins]


def _compile_and_run(backend, width: int = 16):
    model = _Three(width)
    x = torch.randn(4, width)
    with torch.no_grad():
        assert_close_for_dtype(torch.compile(model, backend=backend)(x), model(x))


def _container_sizes(obj) -> dict[str, int]:
    return {k: len(v) for k, v in vars(obj).items() if isinstance(v, (list, dict, set, tuple))}


def _live_managers() -> int:
    gc.collect()
    return sum(type(o) is DsparkPassManager for o in gc.get_objects())


def test_backends_keep_nothing_per_compile():
    """A server that compiles again and again must not accumulate pass managers in the backend."""
    torch._dynamo.reset()
    backend = make_backend(inner="aot_eager")
    sizes = _container_sizes(backend)
    for width in (8, 16, 24):  # three graphs
        _compile_and_run(backend, width)
    assert _container_sizes(backend) == sizes
    torch._dynamo.reset()
    assert _live_managers() == 0, "a pass manager outlived the compiled code that used it"


def test_default_backend_is_a_stateless_backend_object():
    assert isinstance(dspark_fx.backend._DEFAULT, DsparkBackend)
    assert _container_sizes(dspark_fx.backend._DEFAULT) == {}
    assert isinstance(make_backend(), DsparkBackend)


def test_make_backend_accepts_a_dict_of_config_fields():
    torch._dynamo.reset()
    backend = make_backend({"min_branches": 3, "batch_regions": False}, inner="aot_eager")
    assert backend.config == DsparkConfig(min_branches=3, batch_regions=False)
    _compile_and_run(backend)
    capture = CaptureBackend({"min_branches": 4})
    _compile_and_run(capture)
    capture.assert_fused(n_groups=0)
    assert DsparkPassManager({"skinny_linears": False}).config == DsparkConfig(skinny_linears=False)


@pytest.mark.parametrize(
    ("name", "value"),
    [("config", DsparkConfig(min_branches=3)), ("inner", "aot_eager"), ("observer", None), ("move_weights", False)],
)
def test_a_backends_settings_cannot_be_changed_after_it_compiled(name, value):
    """A graph compiled before a change would keep the old decisions and a later one take the new: one model running
    a mix of both. Each setting refuses the change, naming it and the way to change it."""
    torch._dynamo.reset()
    backend = make_backend(inner="aot_eager")
    _compile_and_run(backend)
    before = getattr(backend, name)
    with pytest.raises(AttributeError, match=rf"DsparkBackend\.{name} cannot be changed: .*make_backend"):
        setattr(backend, name, value)
    assert getattr(backend, name) is before
    backend.note = "other attributes stay free"
    assert backend.note == "other attributes stay free"


@pytest.mark.parametrize(
    ("config", "error", "match"),
    [
        ({"min_branch": 2}, ValueError, r"make_backend: config has unknown field\(s\) \['min_branch'\]"),
        ({"min_branches": 1}, ValueError, r"make_backend: config: DsparkConfig.min_branches must be >= 2"),
        ({"min_branches": "2"}, TypeError, r"make_backend: config: DsparkConfig.min_branches must be int, got str"),
        ({"batch_regions": 1}, TypeError, r"DsparkConfig.batch_regions must be bool, got int"),
        (5, TypeError, r"make_backend: config must be a DsparkConfig, a dict of its fields or None, got int"),
        ("min_branches=2", TypeError, r"make_backend: config must be .*, got str"),
    ],
)
def test_make_backend_rejects_a_wrong_config_at_call_time(config, error, match):
    with pytest.raises(error, match=match):
        make_backend(config)


def test_other_arguments_are_checked_at_call_time():
    with pytest.raises(ValueError, match="make_backend: inner must be one of"):
        make_backend(inner="eager")
    with pytest.raises(TypeError, match="make_backend: observer must be callable"):
        make_backend(observer=[])
    with pytest.raises(TypeError, match="CaptureBackend: config must be"):
        CaptureBackend(3)
    with pytest.raises(ValueError, match="CaptureBackend: inner must be one of"):
        CaptureBackend(inner="eager")
    with pytest.raises(ValueError, match=r"DsparkBackend: config has unknown field\(s\) \['x'\]"):
        DsparkBackend({"x": 1})
    with pytest.raises(TypeError, match="explain: config must be"):
        dspark_fx.explain(_Three(), torch.randn(2, 16), config=3)
    with pytest.raises(TypeError, match=r"DsparkConfig\.max_leaf_numel must be int"):
        DsparkConfig(max_leaf_numel=2.5)


class _Recording(CustomGraphPass):
    """A user post-grad pass that records when it ran (and what it saw) in a shared log."""

    def __init__(self, name, log, uuid=True):
        self.name, self.log, self._uuid = name, log, uuid

    def __call__(self, graph):
        self.log.append((self.name, "dspark.multi_linear" in str(graph)))

    def uuid(self):
        return f"recording-{self.name}".encode() if self._uuid else None


@pytest.mark.parametrize("container", [list, tuple])
def test_a_list_of_user_post_grad_passes_is_composed_element_by_element(container):
    torch._dynamo.reset()
    log = []
    first, second = _Recording("first", log), _Recording("second", log)
    backend = make_backend(inner="aot_eager", observer=lambda _b, after, _r: log.append(("dspark", True)))
    with torch._inductor.config.patch(post_grad_custom_post_pass=container([first, second])):
        _compile_and_run(backend)
    assert log == [("first", False), ("second", False), ("dspark", True)]  # user passes first, in order


def test_an_installed_pass_manager_does_not_run_twice_under_a_backend():
    """A DsparkPassManager installed for plain torch.compile, then a dspark backend: the backend's manager (and
    config) runs once; the other installed passes still run first."""
    torch._dynamo.reset()
    counters.clear()
    log = []
    installed = [_Recording("user", log), DsparkPassManager({"fuse_on_cpu": True})]
    with torch._inductor.config.patch(post_grad_custom_post_pass=installed):
        _compile_and_run(make_backend(inner="aot_eager"))
    assert counters["dspark_fx"]["pass_runs"] == 1 and log == [("user", False)]


def test_the_user_passes_of_an_installed_pass_manager_still_run_under_a_backend():
    """README's way to keep a user pass with the pass installed for plain torch.compile, `DsparkPassManager(
    user_pass=...)`: under a dspark backend the manager gives way to the backend's, and its user passes run, in
    their place among the installed ones."""
    torch._dynamo.reset()
    counters.clear()
    log = []
    installed = [_Recording("first", log), DsparkPassManager(user_pass=[_Recording("a", log), _Recording("b", log)])]
    with torch._inductor.config.patch(post_grad_custom_post_pass=installed):
        _compile_and_run(make_backend(inner="aot_eager"))
    assert counters["dspark_fx"]["pass_runs"] == 1
    assert log == [("first", False), ("a", False), ("b", False)]


def test_the_install_lines_run_twice_keep_one_manager():
    """README's install lines for plain torch.compile, run twice (a notebook cell run again): the second manager
    takes the first's place instead of composing it (the pass would run twice per graph), the user pass that was
    there before both is still composed, once; the last manager's config is the one used."""
    user = _Recording("user", [])
    with torch._inductor.config.patch(post_grad_custom_post_pass=user):
        for config in ({"fuse_on_cpu": True, "min_branches": 4}, {"fuse_on_cpu": True}):
            installed = torch._inductor.config.post_grad_custom_post_pass
            torch._inductor.config.post_grad_custom_post_pass = DsparkPassManager(config, user_pass=installed)
        manager = torch._inductor.config.post_grad_custom_post_pass
    assert manager.user_passes == (user,) and manager.config == DsparkConfig(fuse_on_cpu=True)
    assert manager.uuid() == DsparkPassManager({"fuse_on_cpu": True}, user_pass=user).uuid()


def test_uuid_of_composed_passes():
    log = []
    base = DsparkPassManager().uuid()
    one = DsparkPassManager(user_pass=_Recording("a", log)).uuid()
    both = DsparkPassManager(user_pass=[_Recording("a", log), _Recording("b", log)]).uuid()
    assert len({base, one, both}) == 3 and None not in (base, one, both)
    assert DsparkPassManager(user_pass=[_Recording("a", log), lambda graph: None]).uuid() is None
    assert DsparkPassManager(user_pass=[_Recording("a", log, uuid=False)]).uuid() is None
    assert DsparkPassManager(user_pass=[]).uuid() == base
    with pytest.raises(TypeError, match="post_grad_custom_post_pass: expected a pass"):
        DsparkPassManager(user_pass=[_Recording("a", log), "not a pass"])


def test_uuid_is_none_under_freezing_and_tells_whether_the_cuda_library_runs(monkeypatch):
    """Under freezing the pass adds constants to the graph module, which Inductor's cache would keep by value under a
    key that hashes frozen parameters by shape: no key, no cache. What the pass emits for CUDA tensors depends on
    whether the dspark CUDA library can run here: part of the key."""
    base = DsparkPassManager().uuid()
    with torch._inductor.config.patch(freezing=True):
        assert DsparkPassManager().uuid() is None
    problem = custom_ops._build.cuda_library_problem()
    monkeypatch.setattr(custom_ops._build, "cuda_library_problem", lambda: "" if problem else "no nvcc")
    assert DsparkPassManager().uuid() not in (base, None)


@pytest.mark.skipif(_INFERENCE_AWARE is None, reason="torch without inference-aware post-grad passes")
def test_an_inference_aware_user_pass_gets_is_inference():
    class InferenceAware(_INFERENCE_AWARE):
        def __init__(self):
            self.calls = []

        def __call__(self, graph, is_inference):
            self.calls.append(is_inference)

        def uuid(self):
            return b"inference-aware"

    torch._dynamo.reset()
    user_pass = InferenceAware()
    with torch._inductor.config.patch(post_grad_custom_post_pass=[user_pass]):
        _compile_and_run(make_backend(inner="aot_eager"))  # under no_grad: an inference graph
    assert user_pass.calls == [True]
    with pytest.raises(TypeError, match="inference-aware pass"):
        DsparkPassManager(user_pass=user_pass)(torch.fx.Graph())


def test_a_backward_graphs_report_names_the_forward_inputs():
    """A training compile runs the pass on the backward graph too, whose placeholders are `primals_<i>` (the forward's
    inputs, in order) and `tangents_<i>`: its report lines name the forward's inputs by their paths."""
    torch._dynamo.reset()
    capture = CaptureBackend(inner="aot_eager")
    model = _Three()
    sum(y.sum() for y in torch.compile(model, backend=capture)(torch.randn(5, 16))).backward()
    backward = capture.reports[-1]
    assert backward.rejected and "primals_" not in str(backward), str(backward)


@pytest.mark.parametrize("how", ["dspark_backend", "make_backend", "capture", "explain"])
def test_parameters_can_be_swapped_after_a_compile(how):
    """Dynamo drops its weak references to the real tensors at the end of a compile only for registered backends,
    and a tensor it still refers to cannot be swapped (`torch.utils.swap_tensors`): `module.to(dtype)` of DTensor
    parameters, which always swaps them, or of any module under `swap_module_params_on_conversion`, raised after a
    compile with these backends. Every backend of the package counts as registered now."""
    torch._dynamo.reset()
    model = _Three()
    x = torch.randn(4, 16)
    backends = {
        "dspark_backend": dspark_fx.dspark_backend,
        "make_backend": make_backend(inner="aot_eager"),
        "capture": CaptureBackend(),
    }
    with torch.no_grad():
        if how == "explain":
            dspark_fx.explain(model, x)
        else:
            torch.compile(model, backend=backends[how])(x)
    before = [p.clone() for p in model.parameters()]
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to(torch.float64)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    assert all(p.dtype == torch.float64 for p in model.parameters())
    assert_close_for_dtype([p.float() for p in model.parameters()], before)


def test_an_installed_manager_keeps_the_last_reports_only():
    """A manager installed for plain torch.compile lives as long as the process: it keeps its last compiles'
    reports, not one per compile for ever."""
    manager = DsparkPassManager()
    graph = torch.fx.Graph()
    graph.output(graph.placeholder("x"))
    for _ in range(KEPT_REPORTS + 5):
        manager(graph)
    assert len(manager.reports) == KEPT_REPORTS


@pytest.mark.skipif(
    "dspark" not in importlib.metadata.entry_points(group="torch_dynamo_backends").names,
    reason="the package is not installed (its entry point names the backend)",
)
def test_the_installed_package_names_its_backend_dspark():
    """`torch.compile(model, backend="dspark")` in a fresh process that never imported dspark_fx (the package's
    entry point), then a compile with another instance of the backend (which registers the name only if missing):
    no duplicate registration, the passes ran (or Inductor's cache served what they made)."""
    code = (
        "import sys, torch\n"
        "lins = torch.nn.ModuleList(torch.nn.Linear(16, 16, bias=False) for _ in range(3))\n"
        "f = lambda x: [lin(x) for lin in lins]\n"
        "torch.compile(f, backend='dspark')(torch.randn(4, 16))\n"
        "import dspark_fx\n"
        "g = lambda x: [lin(x).relu() for lin in lins]\n"
        "torch.compile(g, backend=dspark_fx.make_backend())(torch.randn(4, 16))\n"
        "runs = torch._dynamo.utils.counters['dspark_fx']\n"
        "print('dspark_fx' in sys.modules, torch._dynamo.list_backends().count('dspark'),"
        " runs['pass_runs'] + runs['graphs_from_cache'])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["True", "1", "2"], done.stdout


@pytest.mark.parametrize(("write", "graphs"), [("cache_loc", {3}), ("slice", {3, 4})])
def test_graphs_per_token_count(write, graphs):
    """README's count: the first T static, one symbolic graph for every later T > 1, T=1 its own; a Python int first
    slot adds at most Dynamo's one graph symbolic in it. Each call leaves eager's caches."""
    torch._dynamo.reset()
    cfg = small_config(write=write)
    eager = DraftKVWriter(cfg)
    compiled_module = copy.deepcopy(eager)
    capture = CaptureBackend({"fuse_on_cpu": True, "kv_write_op": "always"})
    compiled = torch.compile(compiled_module, backend=capture)
    with torch.no_grad():
        for seed, tokens in enumerate((5, 1, *range(2, 10), *range(9, 0, -1))):
            args = draft_inputs(cfg, tokens, seed=seed)
            eager(*args)
            compiled(*args)
            assert_close_for_dtype(list(compiled_module.caches()), list(eager.caches()))
    assert len(capture.reports) in graphs
    assert all(report.kv_writes for report in capture.reports), capture.report
