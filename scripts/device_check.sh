#!/usr/bin/env bash
# One GPU-machine session: environment, GPU tests, quick timings. Logs under $OUT.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# Without a GPU: one sentence and exit status 2 before any stage (the standard library alone asks).
python3 deepep_cupy/driver_check.py scripts/device_check.sh || exit
OUT=${OUT:-/tmp/deepep_out}; mkdir -p "$OUT"
STAGES=${STAGES:-"env worker perf"}
for stage in $STAGES; do
  echo "=== $stage $(date +%T)"
  case $stage in
    env)
      nvidia-smi -L; nvidia-smi topo -m > "$OUT/topo.txt" 2>&1; head -5 "$OUT/topo.txt"
      python3 -c "import cupy, mpi4py, torch; print('cupy', cupy.__version__, 'gpus', cupy.cuda.runtime.getDeviceCount(), 'mpi4py', mpi4py.__version__, 'torch', torch.__version__)";;
    worker)
      DEEPEP_TEST_TIMEOUT_S=${DEEPEP_TEST_TIMEOUT_S:-15} timeout ${WORKER_TIMEOUT:-400} \
        mpirun -n 2 python3 tests/workers/gpu_worker.py ${SCENARIOS:-} > "$OUT/worker.log" 2>&1
      echo "worker exit $?"
      python3 scripts/summarize_results.py < "$OUT/worker.log"
      grep -v "^RESULT" "$OUT/worker.log" | tail -30;;
    perf)
      DEEPEP_CUPY_PROFILE=${PROFILE:-0} timeout ${PERF_TIMEOUT:-150} mpirun -n 2 python3 scripts/quick_perf.py ${PERF_ARGS:-} 2>&1 | tee "$OUT/perf.log" | tail -${PERF_TAIL:-60};;
    ab)
      # Same-run A/B of kernel variants (AB_VARIANTS: "name:DEFINE=value,DEFINE=value ...", built from
      # kernels/ by sed) and of allocate-ahead on/off, alternated AB_ROUNDS times.
      for round in $(seq ${AB_ROUNDS:-2}); do
        for variant in ${AB_VARIANTS:-base:}; do
          name=${variant%%:*}; defines=${variant#*:}; dir=/tmp/kernels_$name
          rm -rf $dir; cp -r kernels $dir
          for d in ${defines//,/ }; do sed -i "s/^#define ${d%%=*} .*/#define ${d%%=*} ${d#*=}/" $dir/*.cu; done
          for ahead in ${AB_AHEAD:-1}; do
            echo "--- round $round variant $name ($defines) allocate_ahead=$ahead"
            DEEPEP_CUPY_KERNEL_DIR=$dir PERF_ALLOCATE_AHEAD=$ahead timeout ${PERF_TIMEOUT:-150} \
              mpirun -n 2 python3 scripts/quick_perf.py ${PERF_ARGS:-} 2>&1 | tail -14
          done
        done
      done 2>&1 | tee -a "$OUT/ab.log";;
    loop-ab)
      # Issue 36's loop model, an old tree (LOOP_AB_OLD: a checkout, say `git archive f89c4ff | tar -x
      # -C old`) against this one, both in one process (scripts/loop_ab_in_process.py), pinned to one core.
      for tokens in ${LOOP_AB_TOKENS:-128 4096}; do
        timeout 120 taskset -c ${LOOP_AB_CORE:-2} python3 scripts/loop_ab_in_process.py --old "$LOOP_AB_OLD" \
          --tokens $tokens --rounds ${LOOP_AB_ROUNDS:-24} --ops fresh,cached,combine 2>&1
      done | tee "$OUT/loop_ab.log";;
    test)
      timeout ${TEST_TIMEOUT:-500} make test 2>&1 | tee "$OUT/test.log" | tail -40;;
    suite1|suite2|files)
      # The GPU test files in two halves that each fit one call (or, stage files, GPU_TEST_FILES), on
      # one GPU (ranks share it): DEEPEP_TEST_ONE_GPU_MPI=1, and too few GPUs is a failure, not a skip.
      files=$(ls tests/test_gpu_*.py | sort)
      half=$(( ($(echo "$files" | wc -l) + 1) / 2 ))
      case $stage in
        suite1) files=$(echo "$files" | head -n $half);;
        suite2) files=$(echo "$files" | tail -n +$((half + 1)));;
        files) files=${GPU_TEST_FILES:?stage files: set GPU_TEST_FILES};;
      esac
      DEEPEP_TEST_ONE_GPU_MPI=1 DEEPEP_TEST_REQUIRE_GPUS=1 DEEPEP_TEST_LOG_DIR="$OUT/runs_$stage" \
        timeout ${SUITE_TIMEOUT:-560} python3 -m pytest -q -ra \
        --durations=15 $files > "$OUT/$stage.log" 2>&1
      echo "$stage: pytest exit $?"; grep -E "passed|failed|FAILED|ERROR" "$OUT/$stage.log" | tail -30;;
    local)
      for n in ${LOCAL_RANKS:-4 8}; do
        timeout ${LOCAL_TIMEOUT:-150} python3 tests/workers/local_gpu_worker.py --ranks $n --timeout ${KERNEL_TIMEOUT:-20} \
          ${LOCAL_ARGS:-} > "$OUT/local$n.log" 2>&1
        echo "local --ranks $n exit $?"; python3 scripts/summarize_results.py < "$OUT/local$n.log"
        grep -v "^RESULT" "$OUT/local$n.log" | tail -8
      done;;
    failures)
      timeout ${FAILURES_TIMEOUT:-240} python3 -m pytest -q -ra tests/test_gpu_failures.py \
        2>&1 | tee "$OUT/failures.log" | tail -40;;
    bench)
      timeout ${BENCH_TIMEOUT:-300} python3 -m deepep_cupy.bench ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -80;;
  esac
done
