"""The dspark_fx rewrites emit a dspark op for CUDA tensors only where the dspark CUDA library is loaded or can be
built (`custom_ops._build.cuda_library_problem`): CUDA torch, a CUDA device, nvcc and ninja. Elsewhere the first
call of the rewritten graph would raise `BuildError`; instead the GEMMs stay as they are and the report names what
is missing. A build says so on stderr, before it starts and when it is done. No GPU needed: the toolchain and the
build are simulated with monkeypatch, the graphs hold fake CUDA tensors."""

from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import cpp_extension

from custom_ops import _build, build
from dspark_fx import DsparkConfig
from dspark_fx.passes import gemm_branches, kv_write
from dspark_fx.passes.horizontal import fuse_kv_branches

UNAVAILABLE = "the dspark CUDA library is not built and cannot be built here: "
# a CUDA build of torch on a machine without a driver initializes CUDA for a fake CUDA tensor, and fails (the CPU
# wheel, and a machine with a GPU, make them)
MAKES_FAKE_CUDA_TENSORS = pytest.mark.skipif(
    torch.backends.cuda.is_built() and not torch.cuda.is_available(),
    reason="a CUDA build of torch without a driver cannot make fake CUDA tensors",
)


def _clear_probes() -> None:
    _build.cuda_library_problem.cache_clear()


@pytest.fixture
def toolchain(monkeypatch):
    """A process whose CUDA library is not loaded, on CUDA torch with a device, nvcc and ninja (each test takes one
    away); the probes' caches are cleared before and after."""
    monkeypatch.setattr(_build, "_loaded", None)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", "/usr/local/cuda")
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: True)
    _clear_probes()
    yield monkeypatch
    _clear_probes()


MISSING = {
    "CPU-only torch": (torch.version, "cuda", None, "has no CUDA support"),
    "no nvcc": (cpp_extension, "CUDA_HOME", None, "nvcc not found"),
    "no ninja": (cpp_extension, "is_ninja_available", lambda: False, "ninja not found"),
    "no CUDA device": (torch.cuda, "is_available", lambda: False, "no CUDA device"),
}


@pytest.mark.parametrize("missing", list(MISSING))
def test_the_probe_names_what_is_missing(toolchain, missing):
    """One probe says why, for each thing the library needs; a loaded library needs none of them; `load` refuses for
    the same reasons (a device aside: building needs none)."""
    assert _build.cuda_library_problem() == ""
    owner, name, value, why = MISSING[missing]
    toolchain.setattr(owner, name, value)
    _clear_probes()
    problem = _build.cuda_library_problem()
    assert problem.startswith(UNAVAILABLE) and why in problem, problem
    if missing != "no CUDA device":
        with pytest.raises(_build.BuildError, match=why):
            _build.load()
    toolchain.setattr(_build, "_loaded", Path("dspark_ops.so"))
    _clear_probes()
    assert _build.cuda_library_problem() == ""


def _two_gemms(x: torch.Tensor, w0: torch.Tensor, w1: torch.Tensor):
    return torch.mm(x, w0.t()) + 1, torch.mm(x, w1.t()) * 2


def _graph(device: str) -> torch.fx.GraphModule:
    with FakeTensorMode():
        x = torch.empty(8, 64, device=device, dtype=torch.bfloat16)
        ws = [torch.empty(32, 64, device=device, dtype=torch.bfloat16) for _ in range(2)]
        return make_fx(_two_gemms)(x, *ws)


@MAKES_FAKE_CUDA_TENSORS
@pytest.mark.parametrize("missing", ["CPU-only torch", "no nvcc"])
def test_gemms_on_cuda_tensors_stay_where_the_library_cannot_be_built(toolchain, missing):
    """Two GEMMs on one CUDA activation: fused into one dspark::multi_linear while the library can be built, left
    as they are otherwise, each reported with the reason (before, they were fused whatever the machine)."""
    fused = _graph("cuda")
    assert not fuse_kv_branches(fused.graph, DsparkConfig()).rejected
    assert any(n.target is gemm_branches.MULTI_LINEAR for n in fused.graph.nodes)

    owner, name, value, why = MISSING[missing]
    toolchain.setattr(owner, name, value)
    _clear_probes()
    kept = _graph("cuda")
    report = fuse_kv_branches(kept.graph, DsparkConfig())
    assert not report.groups and not report.routed
    assert not any(n.target is gemm_branches.MULTI_LINEAR for n in kept.graph.nodes)
    assert len(report.rejected) == 2
    assert all(r.reason.startswith(UNAVAILABLE) and why in r.reason for r in report.rejected), report.rejected

    on_cpu = _graph("cpu")  # the CPU reference needs no library
    assert fuse_kv_branches(on_cpu.graph, DsparkConfig()).groups


@MAKES_FAKE_CUDA_TENSORS
@pytest.mark.parametrize("missing", ["CPU-only torch", "no nvcc"])
def test_kv_write_auto_names_the_missing_library(toolchain, missing):
    """The multi_linear_kv_write rewrite's device rule: no kernel on CUDA tensors where the library cannot be built,
    with the reason (before, the op's sources alone made it say yes)."""
    if torch._C._dispatch_has_kernel_for_dispatch_key("dspark::multi_linear_kv_write", "CUDA"):
        pytest.skip("the CUDA library is loaded in this process: its kernel is registered")
    with FakeTensorMode():
        x = torch.empty(4, 64, device="cuda", dtype=torch.bfloat16)
        caches = [torch.empty(32, 2, 16, device="cuda", dtype=torch.bfloat16)]
        assert kv_write.kernel_mismatch(x, 16, caches) == ""
        owner, name, value, why = MISSING[missing]
        toolchain.setattr(owner, name, value)
        _clear_probes()
        reason = kv_write.kernel_mismatch(x, 16, caches)
    assert UNAVAILABLE in reason and why in reason, reason


def test_a_build_says_so_on_stderr_before_it_starts_and_when_it_is_done(toolchain, tmp_path, capsys):
    """The first CUDA call's build: one line before the compiler starts (what it builds, about how long, the command
    that builds ahead of time), one when it is done (the path). A library already built loads silently. The
    `python -m custom_ops.build` command: the same two lines, without the hint, and the path on stdout."""
    toolchain.setenv("DSPARK_OPS_CACHE_DIR", str(tmp_path))
    toolchain.setattr(_build.checks, "attach_native", lambda path: None)
    before_build = []

    def compile_library(name: str, build_directory: str, **kwargs) -> None:
        before_build.append(capsys.readouterr().err)
        (Path(build_directory) / f"{name}.so").write_bytes(b"")

    toolchain.setattr(cpp_extension, "load", compile_library)
    path = _build.load()
    assert path == _build.library_path() and path.parent.parent == tmp_path
    (start,) = before_build
    assert start.startswith("custom_ops: building the dspark CUDA kernels on first use (") and start.count("\n") == 1
    assert _build.BUILD_TIME in start and "`python -m custom_ops.build` builds them ahead of time" in start, start
    assert capsys.readouterr().err == f"custom_ops: built the dspark CUDA kernels in 0 s: {path}\n"

    toolchain.setattr(_build, "_loaded", None)  # another process: the library is built (ninja finds nothing to do)
    assert _build.load() == path and before_build[1:] == [""]
    assert capsys.readouterr().err == ""

    path.unlink()
    toolchain.setattr(_build, "_loaded", None)
    assert build.main([]) == 0
    (start,) = before_build[2:]
    assert start.startswith("custom_ops: building the dspark CUDA kernels (") and "custom_ops.build" not in start
    assert _build.BUILD_TIME in start and start.count("\n") == 1
    assert capsys.readouterr() == (f"{path}\n", f"custom_ops: built the dspark CUDA kernels in 0 s: {path}\n")
