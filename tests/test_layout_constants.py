"""One source of truth per language, checked across languages, for

- the FlashMLA V4 layout: the constants of `custom_ops/csrc/common/layouts.cuh` (used by the FlashMLA and
  DeepSeek-V4 store kernels and bindings) equal those of `custom_ops/layouts/fp8.py` (the CPU references, fake impls
  and docs);
- the DeepSeek-V4 compression ratios: `csrc/dsv4/dsv4_ratio.h` (`kRatio*`, `kWindow*`, `is_ratio`, `window_of`) and
  `check_ratio` of `csrc/dsv4/dsv4_checks.h` agree with `RATIOS`, `WINDOWS`, `window_of` and `check_ratio` of
  `custom_ops/dsv4/common.py`, and no other source spells the rule.

The headers are parsed as text (and the torch-free ratio header is also compiled for the host when a C++ compiler is
there), so this runs without a GPU or nvcc."""

import ast
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from custom_ops.dsv4 import common
from custom_ops.layouts import fp8

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "custom_ops" / "csrc"
HEADER = CSRC / "common" / "layouts.cuh"
RATIO_HEADER = CSRC / "dsv4" / "dsv4_ratio.h"


def _header_ints(header: Path = HEADER) -> dict[str, int]:
    """`constexpr int kName = <integer expression of earlier names>;` at namespace level, evaluated in order."""
    values: dict[str, int] = {}
    for name, expr in re.findall(r"^constexpr int (k\w+) = ([^;]+);", header.read_text(), flags=re.M):
        tree = ast.parse(re.sub(r"\b(k\w+)\b", lambda m: str(values[m.group(1)]), expr), mode="eval")
        values[name] = int(eval(compile(tree, str(header), "eval"), {"__builtins__": {}}))
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


# ---------------------------------------------------------------------------------------------- DSV4 ratios


def test_ratio_header_and_python_agree():
    header = _header_ints(RATIO_HEADER)
    windows = {header["kRatioC4"]: header["kWindowC4"], header["kRatioC128"]: header["kWindowC128"]}
    assert windows == common.WINDOWS
    assert set(windows) == set(common.RATIOS) and len(common.RATIOS) == 2
    assert {r: common.window_of(r) for r in common.RATIOS} == windows


def test_ratio_functions_of_the_header_match_python(tmp_path):
    """`is_ratio` / `window_of` compiled for the host (the header is plain C++) against the Python rule."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("needs a C++ compiler")
    (tmp_path / "main.cpp").write_text(
        '#include <cstdio>\n#include "dsv4/dsv4_ratio.h"\n'
        "int main() {\n"
        "  for (long r = -2; r <= 260; ++r)\n"
        '    if (dspark::dsv4::is_ratio(r)) std::printf("%ld %d\\n", r, dspark::dsv4::window_of(r));\n'
        "}\n"
    )
    exe = tmp_path / "ratios"
    build = subprocess.run([cxx, "-std=c++17", f"-I{CSRC}", str(tmp_path / "main.cpp"), "-o", str(exe)], text=True,
                           capture_output=True)  # fmt: skip
    assert build.returncode == 0, build.stderr[-4000:]
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    assert {int(r): int(w) for r, w in (line.split() for line in out.splitlines())} == common.WINDOWS


def test_cpp_check_ratio_words_its_error_like_python():
    """`check_ratio` of dsv4_checks.h builds the CPU path's message from the header's constants."""
    line = re.search(r"inline void check_ratio\(int64_t ratio\) \{\n\s*TORCH_CHECK_VALUE\((.*)\);", (CSRC / "dsv4" /
                     "dsv4_checks.h").read_text())  # fmt: skip
    assert line, "check_ratio not found in dsv4_checks.h"
    header = _header_ints(RATIO_HEADER)
    condition, *pieces = [p.strip() for p in re.findall(r'\s*("[^"]*"|[^,]+)', line.group(1))]
    assert condition == "is_ratio(ratio)"
    values = {**{f"num({k})": str(v) for k, v in header.items()}, "num(ratio)": "5"}
    text = "".join(p[1:-1] if p.startswith('"') else values[p] for p in pieces)
    with pytest.raises(ValueError) as error:
        common.check_ratio(5)
    assert text == str(error.value) == "ratio: expected 4 or 128, got 5"


def test_the_ratio_rule_is_spelled_once_per_language():
    """No source but dsv4_ratio.h / dsv4/common.py spells the valid ratios or the ratio -> window rule."""
    rule = re.compile(r"ratio\s*==\s*4\s*\|\||ratio\s*==\s*128|\?\s*8\s*:|in \(4, 128\)|expected 4 or 128")
    sources = [*CSRC.rglob("*.c*"), *CSRC.rglob("*.h"), *(ROOT / "custom_ops").rglob("*.py")]
    sources = [p for p in sources if p not in (RATIO_HEADER, ROOT / "custom_ops" / "dsv4" / "common.py")]
    assert len(sources) > 20
    spelled = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in sources for m in rule.finditer(p.read_text())]
    assert not spelled, spelled
