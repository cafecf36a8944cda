"""Every ```python block of README.md and docs/*.md runs as written (each block on its own, on CPU).

A block can be marked by an HTML comment on the line before its fence:
`<!-- snippet: cuda -->` (skipped without a CUDA GPU), `<!-- snippet: slow -->` (runs Inductor codegen:
`pytest.mark.slow`), `<!-- snippet: skip (reason) -->` (never run; the reason is required).
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"<!--\s*snippet:\s*(cuda|slow|skip)\b\s*(.*?)\s*-->")


def _blocks(path: Path) -> list[tuple[int, str, str | None, str]]:
    """(line of the fence, code, marker kind or None, marker text) of every ```python block of `path`."""
    lines = path.read_text().splitlines()
    out = []
    i = 0
    while i < len(lines):
        fence = lines[i].lstrip()
        if fence.startswith("```python"):
            indent = lines[i][: len(lines[i]) - len(fence)]
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```"))
            code = textwrap.dedent("\n".join(lines[i + 1 : end]))
            mark = MARKER.search(lines[i - 1]) if i > 0 and lines[i - 1].startswith(indent) else None
            out.append((i + 1, code, mark and mark.group(1), mark.group(2) if mark else ""))
            i = end
        i += 1
    return out


def _cases():
    for path in FILES:
        for line, code, kind, reason in _blocks(path):
            first = next((s.strip() for s in code.splitlines() if s.strip()), "")
            marks = []
            if kind == "cuda":
                marks.append(pytest.mark.cuda)
            elif kind == "slow":
                marks.append(pytest.mark.slow)
            elif kind == "skip":
                marks.append(pytest.mark.skip(reason=reason or "MISSING REASON"))
            name = f"{path.relative_to(ROOT)}:{line}:{first[:40]}"
            yield pytest.param(path, line, code, id=name, marks=marks)


CASES = list(_cases())


def test_blocks_were_found_and_skips_give_a_reason():
    assert len(CASES) >= 6, [c.id for c in CASES]
    for path in FILES:
        for line, _, kind, reason in _blocks(path):
            assert kind != "skip" or reason, f"{path.name}:{line}: a `snippet: skip` marker needs a reason"


@pytest.fixture(autouse=True)
def defaults_as_shipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """A snippet runs as a user runs it: without the suite's CPU GEMM-group fusing (tests/conftest.py)."""
    from dspark_fx.passes import horizontal

    monkeypatch.setattr(horizontal, "GROUP_GEMM_DEVICES", ("cuda",))


@pytest.mark.parametrize(("path", "line", "code"), CASES)
def test_snippet_runs(path, line, code):
    inductor = torch._inductor.config.shallow_copy_dict()
    dynamo = torch._dynamo.config.shallow_copy_dict()
    try:
        exec(compile(code, f"{path.name}:{line}", "exec"), {"__name__": "__snippet__"})
    finally:  # a snippet may install passes or change settings: later tests see the settings they had
        torch._inductor.config.load_config(inductor)
        torch._dynamo.config.load_config(dynamo)
        torch._dynamo.reset()
