"""Package hygiene: light imports, no dead top-level code in dspark_fx."""

import ast
import re
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ("dspark_fx", "custom_ops", "tests", "examples", "benchmarks", "scripts", "docs")


def _corpus() -> dict[Path, str]:
    files = [p for d in CORPUS for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".md")]
    return {p: p.read_text() for p in [*files, ROOT / "README.md"]}


def test_every_top_level_function_and_class_of_dspark_fx_is_used():
    texts = _corpus()
    words = Counter(word for text in texts.values() for word in re.findall(r"\w+", text))  # whole words
    dead = []
    for path in sorted((ROOT / "dspark_fx").rglob("*.py")):
        for node in ast.parse(texts[path]).body:
            is_def = isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("__")
            if is_def and words[node.name] <= 1:  # only its definition
                dead.append(f"{path.relative_to(ROOT)}: {node.name}")
    assert not dead, f"defined but never used: {dead}"


HEAVY = ("torch._inductor.compile_fx", "torch._functorch.aot_autograd", "torch._dynamo", "torch._inductor")


@pytest.mark.parametrize("module", ["dspark_fx", "custom_ops"])
def test_import_does_not_load_dynamo_aot_autograd_or_inductor(module):
    """`import dspark_fx` / `import custom_ops` cost little more than `import torch`: the compiler stack is
    imported when the backend first compiles (compile_fx and aot_autograd alone take seconds to import)."""
    code = f"import sys, {module}; print([m for m in {HEAVY!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"import {module} imported {out.stdout.strip()}"


def test_lazy_names_of_dspark_fx_resolve():
    import dspark_fx
    from dspark_fx.passes import manager

    assert dspark_fx.DsparkPassManager is manager.DsparkPassManager
    assert dspark_fx.graph_diff is manager.graph_diff
    assert set(dspark_fx.__all__) <= set(dir(dspark_fx))
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        dspark_fx.nope  # noqa: B018


def test_public_names_of_custom_ops_resolve():
    import custom_ops
    from custom_ops.dsv4.compressor import DSV4Compressor

    assert custom_ops.DSV4Compressor is DSV4Compressor
    for name in custom_ops.__all__:
        assert getattr(custom_ops, name) is not None
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        custom_ops.nope  # noqa: B018


@pytest.mark.parametrize("version", ["2.10.0", "2.9.1+cu128", "2.14.0", "2.14.0a0+git1234", "3.0.0"])
def test_an_untested_torch_warns_naming_the_tested_range(monkeypatch, version):
    from custom_ops import _torch_range

    monkeypatch.setattr(torch, "__version__", version)
    monkeypatch.setattr(_torch_range, "_warned", False)
    with pytest.warns(UserWarning, match=rf"torch {re.escape(version)} is outside .*torch>=2\.11,<2\.14"):
        _torch_range.warn_if_untested_torch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _torch_range.warn_if_untested_torch()  # once per process


@pytest.mark.parametrize("version", ["2.11.0", "2.11.0+cu130", "2.13.0+cpu", "2.13.1"])
def test_a_tested_torch_does_not_warn(monkeypatch, version):
    from custom_ops import _torch_range

    monkeypatch.setattr(torch, "__version__", version)
    monkeypatch.setattr(_torch_range, "_warned", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _torch_range.warn_if_untested_torch()


@pytest.mark.slow
@pytest.mark.parametrize("module", ["dspark_fx", "custom_ops"])
def test_import_warns_with_an_untested_torch(module):
    code = f"import torch; torch.__version__ = '2.10.0'; import {module}"
    out = subprocess.run([sys.executable, "-W", "error", "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode != 0 and "torch 2.10.0 is outside the range" in out.stderr, out.stderr[-2000:]


def test_package_metadata_declares_the_tested_torch_range_and_only_used_dependencies():
    tomllib = pytest.importorskip("tomllib")
    from custom_ops._torch_range import TESTED_TORCH

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["dependencies"] == [f"torch{TESTED_TORCH}", "numpy"]  # numpy: the KV-write proof's id arrays
    assert project["license"] == "MIT" and "MIT License" in (ROOT / "LICENSE").read_text()
    numpy_users = sorted(p.name for p, text in _corpus().items() if re.search(r"^\s*import numpy\b", text, re.M))
    assert numpy_users == ["kv_spec.py", "kv_symbolic.py", "kv_tables.py", "test_kv_symbolic.py"], numpy_users


CSRC = ROOT / "custom_ops" / "csrc"


def test_package_data_ships_every_file_under_csrc():
    """A non-editable install copies `custom_ops/csrc/**` through the package-data globs of pyproject.toml."""
    tomllib = pytest.importorskip("tomllib")

    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["custom_ops"]
    shipped = {p for g in globs for p in (ROOT / "custom_ops").glob(g)}
    files = {p for p in CSRC.rglob("*") if p.is_file()}
    assert files and files == shipped, sorted(str(p.relative_to(CSRC)) for p in files ^ shipped)


def test_the_build_compiles_every_source_of_every_subfolder_and_hashes_every_file(tmp_path, monkeypatch):
    from custom_ops import _build

    sources = {p.relative_to(CSRC).as_posix() for p in _build.source_files()}
    assert sources == {p.relative_to(CSRC).as_posix() for p in CSRC.rglob("*") if p.suffix in (".cu", ".cpp")}
    assert {s.split("/")[0] for s in sources} == {"common", "dsv4", "flashmla", "linear"}

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.cuh").write_text("// x\n")
    (tmp_path / "a" / "y.cu").write_text("// y\n")
    monkeypatch.setattr(_build, "CSRC", tmp_path)
    key = _build.build_key()
    (tmp_path / "a" / "x.cuh").write_text("// x, changed\n")  # a header in a subfolder is part of the key
    assert _build.build_key() != key
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "y.cpp").write_text("// another y\n")  # the extension builder would name both objects y.o
    with pytest.raises(_build.BuildError, match="share the object name 'y'"):
        _build.source_files()


def test_every_project_include_resolves_relative_to_csrc():
    """`#include "<family>/<header>"` everywhere (the build passes -I csrc; the emulation tests and the benchmark
    programs do the same). The benchmark programs' own headers (benchmarks/tune_*.cuh, and the experimental
    kernels of benchmarks/experimental/ that no op uses) are named from the including file's folder or, for
    `experimental/<header>`, from benchmarks/; the emulation tests, built with -I benchmarks too, name the benchmark
    headers from there."""
    benchmarks = ROOT / "benchmarks"
    users = [*CSRC.rglob("*.c*"), *CSRC.rglob("*.h"), *benchmarks.glob("*.cu"), *benchmarks.glob("experimental/*")]
    users += [p for p in (ROOT / "tests").glob("test_*emulation*.py")]
    missing = []
    for path in users:
        for name in re.findall(r'^\s*#include "([^"]+)"', path.read_text(), flags=re.M):
            if name.startswith(("cuda_", "driver")):  # the emulation shims' own headers
                continue
            from_benchmarks = name.startswith("experimental/") or path.parent == ROOT / "tests"
            where = [CSRC / name, benchmarks / name] if from_benchmarks else [CSRC / name]
            if benchmarks in path.parents:
                where.append(path.parent / name)
            if not any(p.is_file() for p in where):
                missing.append(f"{path.relative_to(ROOT)}: {name}")
    assert not missing, missing


def test_every_op_is_registered_through_register_op():
    """One registration path: no module but `_library` touches `torch.library` directly, and every op has the keys
    `register_op` gives it (reference under CPU plus the CUDA entry, or a composite reference for the planners)."""
    direct = re.compile(r"torch\.library\.|\bLIB\.|register_fake|register_cuda_entry")
    for path in sorted((ROOT / "custom_ops").rglob("*.py")):
        if path.name != "_library.py":
            assert not direct.search(path.read_text()), f"{path.relative_to(ROOT)} registers outside register_op"

    import custom_ops  # noqa: F401
    from custom_ops._library import register_op

    with pytest.raises(ValueError, match="reference_key: expected one of"):
        register_op("never_defined(Tensor x) -> Tensor", reference=lambda x: x, reference_key="CUDA")
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    ops = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("dspark::"))
    assert ops and "dspark::never_defined" not in ops
    for op in ops:
        composite = has(op, "CompositeExplicitAutograd")
        if op.startswith("dspark::dsv4_plan_"):
            assert composite and not has(op, "CPU") and has(op, "Meta"), op
        elif op in ("dspark::_multi_linear_variant", "dspark::_multi_linear_cublas"):
            assert composite and has(op, "CPU") and not has(op, "Meta"), op  # CPU: "CUDA-only debug op"
        else:
            assert composite and has(op, "CPU") and has(op, "Meta"), op
