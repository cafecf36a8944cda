"""One source of truth for the FlashMLA V4 layout: the constants of `custom_ops/csrc/common/layouts.cuh` (used by the
FlashMLA and DeepSeek-V4 store kernels and bindings) equal those of `custom_ops/layouts/fp8.py` (the CPU references,
fake impls and docs). The header is parsed as text, so this runs without a GPU or nvcc."""

import ast
import re
from pathlib import Path

from custom_ops.layouts import fp8

CSRC = Path(__file__).resolve().parents[1] / "custom_ops" / "csrc"
HEADER = CSRC / "common" / "layouts.cuh"


def _header_ints() -> dict[str, int]:
    """`constexpr int kName = <integer expression of earlier names>;` at namespace level, evaluated in order."""
    values: dict[str, int] = {}
    for name, expr in re.findall(r"^constexpr int (k\w+) = ([^;]+);", HEADER.read_text(), flags=re.M):
        tree = ast.parse(re.sub(r"\b(k\w+)\b", lambda m: str(values[m.group(1)]), expr), mode="eval")
        values[name] = int(eval(compile(tree, str(HEADER), "eval"), {"__builtins__": {}}))
    return values


def test_header_and_python_layout_constants_agree():
    python = {
        "kHeadDim": fp8.HEAD_DIM,
        "kNopeDim": fp8.NOPE_DIM,
        "kRopeDim": fp8.ROPE_DIM,
        "kValueBytes": fp8.VALUE_BYTES,
        "kScaleBytes": fp8.SCALE_BYTES,
        "kTokenBytes": fp8.TOKEN_BYTES,
        "kIndexerDim": fp8.INDEXER_DIM,
    }
    header = _header_ints()
    assert {name: header[name] for name in python} == python


def test_no_layout_literal_left_in_the_cuda_sources():
    """The 584-byte token and the 576-byte value region are named constants in every CUDA source."""
    sources = [p for p in sorted(CSRC.rglob("*")) if p.suffix in (".cu", ".cuh", ".h", ".cpp") and p != HEADER]
    assert len(sources) > 10, "the walk must reach the sources in every subfolder of csrc/"
    for path in sources:
        text = re.sub(r"//.*", "", path.read_text())
        assert not re.search(r"\b(584|576)\b", text), f"{path.relative_to(CSRC)} spells a layout size as a literal"


def test_python_defines_the_indexer_width_once():
    from custom_ops.dsv4 import store
    from custom_ops.flashmla import writes

    assert writes.INDEXER_DIM is fp8.INDEXER_DIM
    assert store.INDEXER_DIM is fp8.INDEXER_DIM
