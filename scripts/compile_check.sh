#!/usr/bin/env bash
# Compile CUDA sources on a machine without a GPU (nvcc + the CPU torch wheel's headers): syntax, templates,
# registers and spills (-Xptxas -v) before spending device time. Usage: bash scripts/compile_check.sh [file.cu ...]
# Objects go to ${OBJ_DIR:-/tmp/dspark_compile_check}; nothing is linked or loaded.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
inc=$("$py" -c 'import torch.utils.cpp_extension as c; print(" ".join("-I" + p for p in c.include_paths()))')
abi=$("$py" -c 'import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))')
out=${OBJ_DIR:-/tmp/dspark_compile_check}
shim="$out/shim"
mkdir -p "$shim/c10/cuda/impl"
# The CPU wheel ships c10/cuda headers without the generated build-macro header they include.
[ -f "$shim/c10/cuda/impl/cuda_cmake_macros.h" ] || echo '#pragma once' >"$shim/c10/cuda/impl/cuda_cmake_macros.h"
files=("$@")
[ ${#files[@]} -gt 0 ] || mapfile -t files < <(find custom_ops/csrc -name '*.cu' -o -name '*.cpp' | sort)
for f in "${files[@]}"; do
  echo "== $f"
  rm -f "$out/$(basename "$f").o"
  nvcc -c -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Xptxas -v -Xcompiler -fPIC -w \
    -D_GLIBCXX_USE_CXX11_ABI="$abi" -I"$shim" $inc -Icustom_ops/csrc "$f" -o "$out/$(basename "$f").o" 2>&1 |
    grep -E 'error|Compiling entry|registers|spill|bytes stack' || true
  test -f "$out/$(basename "$f").o"
done
