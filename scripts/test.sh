#!/usr/bin/env bash
# Set up a virtual environment (CPU torch 2.13.0 on machines without a GPU build) and run the test suite in parallel;
# arguments go to pytest (-m "not slow": the quick tier).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
# the installs run again only when pyproject.toml changed since the last run that made them (the package itself is
# installed in editable mode: edits to its code need no install)
stamp=.venv/.dspark-installed
if [ "$(cat "$stamp" 2>/dev/null)" != "$(sha256sum pyproject.toml)" ]; then
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/python -c 'import torch' 2>/dev/null || .venv/bin/pip install -q torch==2.13.0
  .venv/bin/python -c 'import numpy' 2>/dev/null || .venv/bin/pip install -q numpy  # a dependency (the KV-write proof)
  .venv/bin/pip install -q -e '.[test]'
  sha256sum pyproject.toml >"$stamp"
fi
.venv/bin/ruff check .
# one xdist worker per core; each test file runs on one worker (the fuzz coverage tests read the outcomes that the
# file's model tests cached in the process), the longest files first (tests/conftest.py, LONGEST_FILES)
.venv/bin/python -m pytest -q -n auto --dist loadfile --no-loadscope-reorder "$@"
