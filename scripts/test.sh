#!/usr/bin/env bash
# Set up a virtual environment (CPU torch 2.13.0 on machines without a GPU build) and run the test suite in parallel;
# arguments go to pytest (-m "not slow": the quick tier).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/python -c 'import torch' 2>/dev/null || .venv/bin/pip install -q torch==2.13.0
.venv/bin/python -c 'import numpy' 2>/dev/null || .venv/bin/pip install -q numpy  # a dependency (the KV-write proof)
.venv/bin/pip install -q -e '.[test]'
.venv/bin/ruff check .
# one xdist worker per core; each test file runs on one worker (the fuzz coverage tests read the outcomes that the
# file's model tests cached in the process)
.venv/bin/python -m pytest -q -n auto --dist loadfile "$@"
