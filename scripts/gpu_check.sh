#!/usr/bin/env bash
# One device call: environment, CUDA extension build, every CUDA-marked test, the benchmarks.
# Usage on the GPU machine: bash scripts/gpu_check.sh [tests|bench|all|sweep]   (logs under $OUT, default ./gpu_out)
# sweep: build, then only the multi_linear kernel-variant sweep (benchmarks/multi_linear.py --sweep).
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
what=${1:-all}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())'
} 2>&1 | tee "$OUT/env.txt"
status=0
if [ -f custom_ops/build.py ] && [ "$what" != bench ]; then
  (time python3 -m custom_ops.build) 2>&1 | tee "$OUT/build.log" || status=1
fi
if [ "$what" = sweep ]; then
  python3 benchmarks/multi_linear.py --sweep --out "$OUT/multi_linear_sweep.md" 2>&1 | tee "$OUT/multi_linear_sweep.log" ||
    status=1
  exit $status
fi
if [ "$what" != bench ]; then
  python3 -m pytest -m cuda -q -p no:cacheprovider tests 2>&1 | tee "$OUT/cuda_tests.log" || status=1
fi
if [ "$what" != tests ]; then
  for bench in benchmarks/*.py; do
    name=$(basename "$bench" .py)
    python3 "$bench" --out "$OUT/$name.md" 2>&1 | tee "$OUT/$name.log" || status=1
  done
fi
exit $status
