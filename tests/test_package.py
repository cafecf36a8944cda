"""Package hygiene: no dead top-level code in dspark_fx."""

import ast
import re
from pathlib import Path

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
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                word = re.compile(rf"\b{re.escape(node.name)}\b")
                if sum(len(word.findall(text)) for text in texts.values()) <= 1:  # only its definition
                    dead.append(f"{path.relative_to(ROOT)}: {node.name}")
    assert not dead, f"defined but never used: {dead}"
