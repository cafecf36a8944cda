"""Shared pytest setup: CUDA-marked tests skip cleanly on machines without a GPU; xdist workers share the cores
(torch's threads and Inductor's compile workers: the cores over the workers); every test starts from the same
global RNG state; the kernel emulations are built into pytest's cache folder (`emulation_cache`)."""

import os
from pathlib import Path

import pytest
import torch
import torch._inductor.config


def pytest_configure(config: pytest.Config) -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = max(1, len(os.sched_getaffinity(0)) // workers)
        torch.set_num_threads(threads)
        torch._inductor.config.compile_threads = threads


# The files that take longest on the 2-core CPU machine (about 80 % of the suite's time, measured with
# `--durations=0`), longest first. xdist's per-file scheduling hands out files in collection order (with
# `--no-loadscope-reorder`; by default it orders them by test count), so these start first and the workers finish
# together instead of one of them starting the longest file last.
LONGEST_FILES = (
    "test_spelling_generator.py",
    "test_pass_fuzz.py",
    "test_benchmarks_smoke.py",
    "test_kv_write_lowering.py",
    "test_examples.py",
    "test_multi_linear_kv_write_emulation.py",
    "test_spellings.py",
    "test_kv_write_cache_views.py",
    "test_fusion_reference.py",
    "test_tensor_parallel.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FILES)))  # stable: the rest keep their order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _same_global_rng_state() -> None:
    """Every test starts from the same state of torch's global RNG: modules initialise their weights from it, and
    without this their values would depend on which tests ran before on the same xdist worker. (A bf16 HF-style
    writer once drew weights whose lowered K cache differed from eager's by 0.0234 where 0.02 is allowed: eager rounds
    cos/sin to bf16 and the op does not, an error that grows with |K|.)"""
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def emulation_cache(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where `emulation_build.compile_emulation` keeps the libraries it builds: pytest's cache folder (shared by the
    xdist workers and kept across runs), a temporary folder where the cache plugin is off (`-p no:cacheprovider`)."""
    cache = getattr(request.config, "cache", None)
    return cache.mkdir("kernel_emulation") if cache is not None else tmp_path_factory.mktemp("kernel_emulation")


@pytest.fixture(autouse=True)
def gemm_groups_fused_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on CUDA, GEMM groups fuse on CPU too (`horizontal.GROUP_GEMM_DEVICES`; by default only `fuse_on_cpu`
    fuses them there): the tests check the rewrite where the op is its reference. `tests/test_cpu_default.py` undoes
    this to check the default."""
    from dspark_fx.passes import horizontal

    monkeypatch.setattr(horizontal, "GROUP_GEMM_DEVICES", ("cuda", "cpu"))


@pytest.fixture
def lone_gemms_routed_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on CUDA, lone GEMMs (`skinny_linears`) go through `dspark::multi_linear` on CPU too: the routing's rewrite,
    counters and report, tested where the op is its reference."""
    from dspark_fx.passes import horizontal

    monkeypatch.setattr(horizontal, "LONE_GEMM_DEVICES", ("cuda", "cpu"))


@pytest.fixture
def builds_cuda_library(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a machine that builds the dspark CUDA library (fake CUDA graphs route GEMMs through its ops)."""
    import custom_ops

    monkeypatch.setattr(custom_ops._build, "cuda_library_problem", lambda: "")
