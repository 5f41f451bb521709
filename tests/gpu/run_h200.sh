#!/usr/bin/env bash
# One H200 call: the GPU test files as parallel processes (they are JIT-bound, and the host
# has 16 cores), memcheck of the adversarial-offset tests, then the timing stages alone on
# the GPU. Usage on the device machine, after the README's DSL unpack:
#   bash tests/gpu/run_h200.sh
# Environment:
#   STAGES        subset of "tests sanitize overhead kernels ncu sncu bench sbench ebench lbench"
#                 (default: the first four)
#   CAND_DIR      a tree with candidate sources: its window-family tests run beside ours and
#                 the kernels stage times both
#   KERNEL_SHAPES bench/time_kernels.py --only filters (comma separated)
#   KNOBS         bench/time_kernels.py --knobs variants of the default keys ("pdl=0;linear=0")
#   SWEEP_SHAPES  shapes (comma separated) whose window keys are all timed (--sweep)
#   SWEEP_DIRS    directions of those sweeps (default "fwd,bwd")
#   BENCH_SHAPES  bench shapes (comma separated; default the production list), BENCH_SKIP variants
#   SNCU_CASES    bench_store.py cases (config:shape, space separated) whose warp stalls
#                 the sncu stage tables per instruction (bench/stall_table.py)
#   T_TESTS, T_BENCH  per-stage limits in seconds
#   ONLY          the jobs to run, by name ("store serving-*"; default all of the stages)
# Logs land in $OUT/logs; $OUT/summary.txt has one line per job.
set -u
OUT=${OUT:-/tmp/csa-out}
mkdir -p "$OUT/logs"
export PYTHONUNBUFFERED=1
STAGES=${STAGES:-"tests sanitize overhead kernels"}
PYTEST="python3 -m pytest -q -p no:cacheprovider -rfE"
ROOT=$(pwd)

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/summary.txt"
python3 -c "import torch, cutlass; print(torch.__version__, torch.version.cuda, cutlass.__version__)" \
  >> "$OUT/summary.txt" 2>&1

# The native launch path's library (csa_ops.native): built once here, in the user cache, which
# the test sessions copy it from (tests/conftest.py) and the benchmarks load it from.
python3 -m csa_ops.native build >> "$OUT/summary.txt" 2>&1

wants() { [[ " $STAGES " == *" $1 "* ]]; }
# job NAME SECONDS DIR COMMAND...: runs in the background in DIR, logs to logs/NAME.log.
# ONLY (space-separated job names, a trailing * matches a prefix) keeps the jobs it names.
job() {
  local name=$1 limit=$2 dir=$3; shift 3
  if [ -n "${ONLY:-}" ]; then
    local pattern keep=""
    for pattern in $ONLY; do [[ $name == $pattern ]] && keep=1; done
    [ -n "$keep" ] || return 0
  fi
  (
    cd "$dir" && timeout "$limit" "$@" > "$OUT/logs/$name.log" 2>&1
    echo "$name rc=$? $(tail -n 1 "$OUT/logs/$name.log" | cut -c1-300)" >> "$OUT/summary.txt"
  ) &
}
# run NAME SECONDS DIR COMMAND...: the same in the foreground (timing stages run alone).
run() { job "$@"; wait; }

T=${T_TESTS:-330}
if wants tests; then
  for i in 0 1 2; do
    job "window-$i" "$T" "$ROOT" env CSA_TEST_SHARD=$i/3 $PYTEST tests/gpu/test_kernels_window.py
  done
  if [ -n "${CAND_DIR:-}" ]; then
    for i in 0 1; do
      job "cand-window-$i" "$T" "$CAND_DIR" env PYTHONPATH="$CAND_DIR:$PYTHONPATH" \
        CSA_TEST_SHARD=$i/2 $PYTEST tests/gpu/test_kernels_window.py
    done
  fi
  job streaming "$T" "$ROOT" $PYTEST tests/gpu/test_kernels_streaming.py
  job op "$T" "$ROOT" $PYTEST tests/gpu/test_op_gpu.py
  job graphs "$T" "$ROOT" $PYTEST tests/gpu/test_graphs.py tests/gpu/test_kernel_cache_gpu.py
  job lowering "$T" "$ROOT" $PYTEST tests/gpu/test_lowering_gpu.py
  for i in 0 1; do
    job "serving-$i" "$T" "$ROOT" env CSA_TEST_SHARD=$i/2 $PYTEST tests/gpu/test_serving_gpu.py
  done
  job native "$T" "$ROOT" $PYTEST tests/gpu/test_native_gpu.py
  job distributed "$T" "$ROOT" $PYTEST tests/gpu/test_distributed_gpu.py
  job epilogue "$T" "$ROOT" $PYTEST tests/gpu/test_epilogue_gpu.py
  job capacity "$T" "$ROOT" $PYTEST tests/gpu/test_row_capacity_gpu.py
  job store "$T" "$ROOT" $PYTEST tests/gpu/test_store_kernel_gpu.py tests/gpu/test_decode_step_gpu.py
  job prefill "$T" "$ROOT" $PYTEST tests/gpu/test_prefill_store_gpu.py
  job devices "$T" "$ROOT" $PYTEST tests/gpu/test_multi_device_gpu.py
fi
if wants sanitize; then
  # Without the caching allocator every tensor is its own allocation, so memcheck sees any
  # access past a tensor's end.
  job sanitize "$T" "$ROOT" env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer \
    --tool memcheck --report-api-errors no --error-exitcode 99 $PYTEST -k adversarial \
    tests/gpu/test_kernels_window.py tests/gpu/test_kernels_streaming.py \
    tests/gpu/test_serving_gpu.py tests/gpu/test_store_kernel_gpu.py tests/gpu/test_decode_step_gpu.py \
    tests/gpu/test_prefill_store_gpu.py
fi
wait

wants overhead && run overhead 90 "$ROOT" python3 bench/time_overhead.py "$OUT/overhead.json"
if wants kernels; then
  IFS=, read -ra shapes <<< "${KERNEL_SHAPES:-1x8192 d128 r4 c2,3x8192 d512 r4 c2}"
  for shape in "${shapes[@]}"; do
    tag=${shape// /_}
    sweep=""
    [[ ",${SWEEP_SHAPES:-}," == *",$shape,"* ]] && sweep="--sweep=${SWEEP_DIRS:-fwd,bwd}"
    run "kernels-$tag" "${T_KERNELS:-60}" "$ROOT" python3 bench/time_kernels.py \
      --only "$shape" ${KNOBS:+--knobs "$KNOBS"} $sweep
    [ -n "${CAND_DIR:-}" ] && run "cand-kernels-$tag" 60 "$CAND_DIR" \
      env PYTHONPATH="$CAND_DIR:$PYTHONPATH" python3 bench/time_kernels.py --only "$shape"
  done
fi
if wants ncu; then
  run ncu 150 "$ROOT" ncu -k regex:kernel_cutlass --section SpeedOfLight --section Occupancy --section LaunchStats \
    --section WarpStateStats --section MemoryWorkloadAnalysis python3 bench/profile_once.py
fi
if wants sncu; then  # the decode step's warp stalls, instruction by instruction
  for case in ${SNCU_CASES:-d512_r4c2_ds_mla:decode_B64 d512_r4c2_ds_mla:decode_B256}; do
    tag=${case//:/-}
    # Sampling every 32 cycles: a decode step's few microseconds give the default
    # interval only a few hundred samples.
    run "sncu-$tag" 150 "$ROOT" bash -c "ncu --profile-from-start off --set full \
      --warp-sampling-interval 0 --import-source yes -o '$OUT/$tag' -f \
      python3 bench/profile_store.py --cases '$case' \
      && ncu -i '$OUT/$tag.ncu-rep' --page source --csv --print-source sass > '$OUT/$tag.csv' \
      && python3 bench/stall_table.py '$OUT/$tag.csv' --top 40"
  done
fi
if wants bench; then
  run bench "${T_BENCH:-400}" "$ROOT" python3 bench/bench_compressor.py --warmup 1 --iters 5 \
    --out "$OUT/bench" ${BENCH_SHAPES:+--shapes "$BENCH_SHAPES"} \
    ${BENCH_SKIP:+--skip "$BENCH_SKIP"}
fi
if wants sbench; then  # csa::compressor_extend_store: the kernel, the torch route, compiled
  run sbench "${T_SBENCH:-300}" "$ROOT" python3 bench/bench_store.py --out "$OUT/bench-store" \
    ${SBENCH_SHAPES:+--shapes "$SBENCH_SHAPES"} ${SBENCH_NO_COMPILE:+--no-compile}
fi
if wants ebench; then  # csa::compressor_epilogue against the op and a compiled epilogue
  run ebench "${T_EBENCH:-240}" "$ROOT" python3 bench/bench_epilogue.py --out "$OUT/bench-epilogue" \
    ${EBENCH_SHAPES:+--shapes "$EBENCH_SHAPES"}
fi
if wants lbench; then  # the lowering modes' rows: extern, generate, auto +RMSNorm
  run lbench "${T_LBENCH:-330}" "$ROOT" python3 bench/bench_compressor.py --warmup 1 --iters 5 \
    --out "$OUT/bench-lowering" --variants "${LBENCH_VARIANTS:-[extern],[generate],+RMSNorm}" \
    --shapes "${LBENCH_SHAPES:-r4c2_1x8192_d128,r4c2_3x8192_d512,r128c1_1x65536_d128}"
fi
cat "$OUT/summary.txt"
# Failures first, then every log's tail, so the call's output tail carries the essentials.
grep -h -E "^(FAILED|ERROR)|Error|error:" "$OUT"/logs/*.log | sort | uniq -c | head -40
tar -czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
