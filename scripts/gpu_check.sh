#!/usr/bin/env bash
# One device call: environment, CUDA extension build, then one of
#   tests     every CUDA-marked test
#   bench     every benchmark (benchmarks/[!_]*.py --out $OUT/<name>.md)
#   all       tests, then bench (the default)
#   sanitize  scripts/sanitize_driver.py under compute-sanitizer's memcheck, racecheck, initcheck and synccheck
#             (every tensor its own allocation; SANITIZE_ONLY="GROUP ...": those groups of its calls, and benchmark_dims,
#             the K/V write at the write benchmark's dims, is made only so; SANITIZE_TOOLS="memcheck": only those tools;
#             SANITIZE_BARRIER=0: not the subset-barrier kernel below);
#             each tool's summary goes to $OUT/sanitize.txt (initcheck's reads of cuBLAS outputs counted apart, with a
#             torch.mm control), then what racecheck says of scripts/racecheck_subset_barrier.cu
#   sweep     the multi_linear kernel-variant sweep only (benchmarks/multi_linear.py --sweep)
#   placement the op on ten K/V weights placed apart, in pairs or adjacent, M >= 512 (benchmarks/multi_linear.py
#             --placement)
#   tune      the standalone kernel sweeps (benchmarks/*_tune.cu, or those TUNE names, e.g. TUNE="kv_write
#             multi_linear"; nvcc, no torch; built in parallel, then run one at a time, each stopped after
#             TUNE_TIMEOUT seconds, default 420: a kernel waiting on an mbarrier that never completes spins forever;
#             line-buffered, so a stopped program's lines are kept; TUNE_ARGS: the programs' arguments, e.g. for
#             kv_write: regs, forms, small (the reads and 1-16 tokens) or wide (32 and 64 tokens))
#   write     every CUDA-marked test, then the context-KV write's benchmarks only: benchmarks/dspark_write.py
#             (tables and --breakdown) and benchmarks/kv_write_tune.cu
#   spellings the ops' build, then the context-KV write of every draft spelling (benchmarks/_spellings.py), all timed
#             together, Qwen3-8B dims, T 1..4096, the columns torch.compile, hand-stacked, dspark_backend and never
#             lowered (benchmarks/dspark_write.py --spellings ... --variants ...)
#   tp        tensor parallel over the GPUs of the machine (at most 2): the NCCL tests (tests/test_tensor_parallel.py,
#             eager and CUDA-graph replay), examples/tp_draft.py under torchrun, and benchmarks/dspark_write.py --tp
#             (Qwen3-8B dims, each rank's shard); on one GPU the 1-rank forms of all three
#   check     one call for a session short of device time: every CUDA test, then the write table at
#             T = 8 / 64 / 512 (or CHECK_TOKENS; benchmarks/dspark_write.py --variants compile hand dspark
#             --rounds 30), then the draft step (benchmarks/draft_step.py), each stopped after its share of the 600 s
#             a device call may take (CHECK_TIMEOUTS="tests write draft" seconds, default "200 110 140"; 0 skips a
#             part). On a fresh H100: the build 70-95 s, every CUDA test 123 s in 4 processes (the default), that
#             write table about 100 s, the draft step about 100 s
#   acceptance one call for the performance targets, no tests (`check` runs them): the write table at
#             T = 1 / 8 / 64 / 512 / 4096 (every config, the reference and HF spellings; torch.compile, hand-stacked,
#             dspark_backend and dspark_backend with colocate_weights; --rounds 30), the draft step
#             (benchmarks/draft_step.py), the multi_linear table (benchmarks/multi_linear.py; each row printed as it
#             is timed), the lone-linears model (benchmarks/lone_linears.py) and the binding's host time per eager
#             call (benchmarks/host_cost.py), each stopped after its share of the 600 s a device call may take
#             (ACCEPT_TIMEOUTS="write draft multi_linear lone host" seconds, default "340 0 80 40 20"; 0 skips a
#             part). On a fresh H100 the build took 93 s, the write about 290 s (before its one-launch read also
#             timed the copy-engine reader: a few seconds more, its nvcc build included), multi_linear 60 s, the
#             last two 40 s, and the draft step (five compiled variants then; six with its control since) about
#             170 s: more than one call holds, so the draft step is off by default; ACCEPT_TIMEOUTS="0 250 0 0 0" runs it alone in a second call (50 s
#             on a warm machine, which keeps the build and Inductor's cache)
#   profile   where the write's replay time goes, per kernel, per spelling (benchmarks/dspark_write.py --breakdown;
#             PROFILE_SPELLINGS, default "reference sglang hf complex"; PROFILE_VARIANTS, default "dspark never
#             compile"; PROFILE_TOKENS, default "64 4096"), with Inductor's generated code in $OUT/output_code.log
# Usage on the GPU machine: bash scripts/gpu_check.sh
#   [tests|bench|all|sanitize|sweep|placement|tune|write|spellings|tp|check|acceptance|profile]
# (logs under $OUT, default ./gpu_out)
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
# CUDA_TEST_WORKERS=N: the CUDA tests in N pytest-xdist processes sharing the GPU, a test file per process (on a
# fresh machine most of the suite's time is Inductor compiling the first files' models: 4 processes took 123 s where
# one takes about 360 on an H100, every test passing either way); default 4, 1 for one process
cuda_tests=(python3 -m pytest -m cuda -q -p no:cacheprovider)
[ "${CUDA_TEST_WORKERS:-4}" -gt 1 ] && cuda_tests+=(-n "${CUDA_TEST_WORKERS:-4}" --dist loadfile)
if [ "$what" != bench ] && [ "$what" != tune ]; then
  (time python3 -m custom_ops.build) 2>&1 | tee "$OUT/build.log" || status=1
fi
case "$what" in
  sanitize)
    sanitizer=${SANITIZER:-/usr/local/cuda/bin/compute-sanitizer}
    for tool in ${SANITIZE_TOOLS:-memcheck racecheck initcheck synccheck}; do
      driver_args=(${SANITIZE_ONLY:+--only $SANITIZE_ONLY})
      limit=50
      [ "$tool" = initcheck ] && limit=1000000  # every report: they are sorted below
      log="$OUT/sanitize_$tool.log"
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$sanitizer" --tool "$tool" --error-exitcode 99 --print-limit $limit \
        python3 scripts/sanitize_driver.py "${driver_args[@]}" >"$log" 2>&1
      rc=$?
      summary=$(grep -hE '(ERROR|RACECHECK) SUMMARY' "$log" | tail -1)
      if [ "$tool" = initcheck ] && [ $rc -eq 99 ]; then
        # initcheck does not see cuBLAS's writes (the control below), so the heads kernels of the K/V write's GEMM
        # path, reading the projections that a cuBLAS GEMM wrote (frames copy_unit and load_unit), are reported
        # reading uninitialized memory; any other report fails the run
        errors=$(grep -hoE 'ERROR SUMMARY: [0-9]+' "$log" | tail -1 | grep -oE '[0-9]+$')
        projections=$(awk '/^========= [A-Z]/ { if (n) print b; b = ""; n = 1 } n { b = b $0 } END { if (n) print b }' \
          "$log" | grep -cE '^========= Uninitialized __global__ memory read.*(copy|load)_unit<')
        other=$((${errors:-1} - projections))
        summary="$summary; $other of them not the heads kernels' reads of the cuBLAS output"
        [ "$other" -eq 0 ] && rc=0
      fi
      [ $rc -eq 0 ] || status=1
      echo "$tool rc=$rc $summary" | tee -a "$OUT/sanitize.txt"
    done
    # the control: initcheck on a plain bf16 torch.mm and an elementwise kernel reading its output (no dspark code)
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$sanitizer" --tool initcheck --print-limit 1 python3 -c 'import torch
a = torch.randn(65, 256, device="cuda", dtype=torch.bfloat16)
(a @ torch.randn(256, 384, device="cuda", dtype=torch.bfloat16) + 1).sum().item()' >"$OUT/sanitize_initcheck_mm.log" 2>&1
    echo "initcheck control, torch.mm then add: $(grep -hE 'ERROR SUMMARY' "$OUT/sanitize_initcheck_mm.log" | tail -1)" |
      tee -a "$OUT/sanitize.txt"
    # racecheck on a race-free kernel in which only some warps use named barriers (see the file): what racecheck says
    # of the multi-weight GEMM's k-warps without a K step; information, not a check of this project's code
    # (racecheck reports only races it observes, so each mode runs 10 times)
    if [ "${SANITIZE_BARRIER:-1}" = 0 ]; then
      :
    elif nvcc -O3 -std=c++17 -arch=sm_90a -lineinfo scripts/racecheck_subset_barrier.cu -o /tmp/subset_barrier; then
      for mode in subset all; do
        log="$OUT/racecheck_subset_barrier_$mode.log"
        : >"$log"
        for _ in $(seq 10); do "$sanitizer" --tool racecheck /tmp/subset_barrier "$mode" >>"$log" 2>&1; done
        echo "racecheck of the race-free subset-barrier kernel, mode $mode: hazards reported in" \
          "$(grep -c 'RACECHECK SUMMARY: [1-9]' "$log") of 10 runs, $(grep -c 'every thread read' "$log") of them" \
          "with the right result" | tee -a "$OUT/sanitize.txt"
      done
    else
      status=1
    fi
    ;;
  sweep)
    python3 benchmarks/multi_linear.py --sweep --out "$OUT/multi_linear_sweep.md" 2>&1 |
      tee "$OUT/multi_linear_sweep.log" || status=1
    ;;
  placement)
    python3 benchmarks/multi_linear.py --placement --out "$OUT/multi_linear_placement.md" 2>&1 |
      tee "$OUT/multi_linear_placement.log" || status=1
    ;;
  write)
    "${cuda_tests[@]}" tests 2>&1 | tee "$OUT/cuda_tests.log" || status=1
    python3 benchmarks/dspark_write.py --out "$OUT/dspark_write.md" 2>&1 | tee "$OUT/dspark_write.log" || status=1
    python3 benchmarks/dspark_write.py --breakdown --tokens 8 64 512 4096 2>&1 |
      tee "$OUT/dspark_write_breakdown.log" || status=1
    { nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Icustom_ops/csrc benchmarks/kv_write_tune.cu \
      -o /tmp/kv_write_tune && /tmp/kv_write_tune; } 2>&1 | tee "$OUT/kv_write_tune.log" || status=1
    ;;
  spellings)
    python3 benchmarks/dspark_write.py --configs qwen3-8b --spellings reference sglang hf hf_static llama complex gptj_stack \
      --variants compile hand dspark never --tokens 1 8 64 512 1024 4096 \
      --out "$OUT/dspark_write_spellings.md" 2>&1 | tee "$OUT/dspark_write_spellings.log" || status=1
    ;;
  tp)
    ranks=$(python3 -c 'import torch; print(min(2, torch.cuda.device_count()))')
    python3 -m pytest -m cuda -q -p no:cacheprovider tests/test_tensor_parallel.py 2>&1 |
      tee "$OUT/tp_tests.log" || status=1
    torchrun --nproc-per-node "$ranks" examples/tp_draft.py 2>&1 | tee "$OUT/tp_draft.log" || status=1
    python3 benchmarks/dspark_write.py --tp "$ranks" --configs qwen3-8b --variants compile hand dspark \
      --tokens ${TP_TOKENS:-1 8 64 512 4096} --out "$OUT/dspark_write_tp.md" 2>&1 | tee "$OUT/dspark_write_tp.log" ||
      status=1
    ;;
  check)
    read -r t_tests t_write t_draft <<<"${CHECK_TIMEOUTS:-200 110 140}"
    if [ "$t_tests" -gt 0 ]; then
      timeout "$t_tests" "${cuda_tests[@]}" tests 2>&1 | tee "$OUT/cuda_tests.log" ||
        status=1
    fi
    if [ "$t_write" -gt 0 ]; then
      timeout "$t_write" python3 benchmarks/dspark_write.py --variants compile hand dspark \
        --tokens ${CHECK_TOKENS:-8 64 512} --rounds 30 --out "$OUT/dspark_write.md" 2>&1 |
        tee "$OUT/dspark_write.log" || status=1
    fi
    if [ "$t_draft" -gt 0 ]; then
      timeout "$t_draft" python3 benchmarks/draft_step.py --out "$OUT/draft_step.md" 2>&1 |
        tee "$OUT/draft_step.log" || status=1
    fi
    ;;
  acceptance)
    read -r t_write t_draft t_multi t_lone t_host <<<"${ACCEPT_TIMEOUTS:-340 0 80 40 20}"
    # timed_benchmark SECONDS NAME ARGS...: benchmarks/NAME.py ARGS, its table in $OUT/NAME.md (0 seconds: skipped)
    timed_benchmark() {
      local seconds=${1:-0} name=$2
      shift 2
      [ "$seconds" -gt 0 ] || return 0
      timeout "$seconds" python3 "benchmarks/$name.py" "$@" --out "$OUT/$name.md" 2>&1 | tee "$OUT/$name.log" ||
        status=1
    }
    timed_benchmark "$t_write" dspark_write --spellings reference hf --variants compile hand dspark colocated \
      --tokens 1 8 64 512 4096 --rounds 30
    timed_benchmark "$t_draft" draft_step
    timed_benchmark "$t_multi" multi_linear
    timed_benchmark "$t_lone" lone_linears
    timed_benchmark "$t_host" host_cost
    ;;
  profile)
    TORCH_LOGS=output_code TORCH_LOGS_OUT="$OUT/output_code.log" python3 benchmarks/dspark_write.py \
      --configs qwen3-8b --spellings ${PROFILE_SPELLINGS:-reference sglang hf complex} --breakdown ${PROFILE_VARIANTS:-dspark never compile} \
      --tokens ${PROFILE_TOKENS:-64 4096} --out "$OUT/breakdown.md" 2>&1 | tee "$OUT/breakdown.log" || status=1
    ;;
  tune)
    # cuBLAS from the CUDA wheels torch depends on (benchmarks/cublas_paths_tune.cu)
    cu=$(python3 -c 'import nvidia.cu13; print(list(nvidia.cu13.__path__)[0])')
    sources=(benchmarks/*_tune.cu)
    if [ -n "${TUNE:-}" ]; then
      sources=()
      for tune in $TUNE; do sources+=("benchmarks/${tune}_tune.cu"); done
    fi
    names=()
    for src in "${sources[@]}"; do names+=("$(basename "$src" .cu)"); done
    for name in "${names[@]}"; do  # the builds in parallel, then the runs one at a time
      nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Icustom_ops/csrc -I"$cu/include" \
        "benchmarks/$name.cu" -o "/tmp/$name" -L"$cu/lib" -l:libcublas.so.13 -l:libcublasLt.so.13 -Xlinker -rpath="$cu/lib" \
        >"$OUT/$name.build.log" 2>&1 &
    done
    wait
    for name in "${names[@]}"; do
      { cat "$OUT/$name.build.log" && [ -x "/tmp/$name" ] &&
        stdbuf -oL timeout "${TUNE_TIMEOUT:-420}" "/tmp/$name" ${TUNE_ARGS:-}; } 2>&1 | tee "$OUT/$name.log" || status=1
    done
    ;;
  tests | bench | all)
    if [ "$what" != bench ]; then
      "${cuda_tests[@]}" tests 2>&1 | tee "$OUT/cuda_tests.log" || status=1
    fi
    if [ "$what" != tests ]; then
      for bench in benchmarks/[!_]*.py; do
        name=$(basename "$bench" .py)
        python3 "$bench" --out "$OUT/$name.md" 2>&1 | tee "$OUT/$name.log" || status=1
      done
    fi
    ;;
  *)
    echo "unknown mode: $what (tests|bench|all|sanitize|sweep|placement|tune|write|spellings|tp|check|acceptance|profile)" >&2
    exit 2
    ;;
esac
exit $status
