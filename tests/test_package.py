"""Package hygiene: light imports, no dead top-level code in dspark_fx."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ("dspark_fx", "custom_ops", "tests", "examples", "benchmarks", "scripts", "docs")


def _corpus() -> dict[Path, str]:
    files = [p for d in CORPUS for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".md")]
    return {p: p.read_text() for p in [*files, ROOT / "README.md"]}


def test_every_top_level_function_and_class_of_dspark_fx_is_used():
    texts = _corpus()
    dead = []
    for path in sorted((ROOT / "dspark_fx").rglob("*.py")):
        for node in ast.parse(texts[path]).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("__"):
                word = re.compile(rf"\b{re.escape(node.name)}\b")
                if sum(len(word.findall(text)) for text in texts.values()) <= 1:  # only its definition
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
