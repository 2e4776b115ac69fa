#!/usr/bin/env bash
# The one command a GPU-machine run executes: configures the `cuda` preset for sm_90
# against the dependencies carried in .deps/ (made by scripts/fetch-gpu-deps.sh on the
# development machine, since the GPU machine has no GoogleTest, yaml-cpp or nlohmann-json),
# builds with every core, runs the tests labelled `gpu`, writes full logs under $OUT (or
# build/gpu-check-logs) and prints a short table last. Exit status: non-zero if the
# configure, the build or any test failed.
#
#   scripts/gpu-check.sh                    configure + build + ctest -L gpu
#   scripts/gpu-check.sh --bench            also run the benchmarks: training steps, GEMMs
#                                           (dense vs 2:4 and V:N:M), sparse layers,
#                                           attention, sparsification, sparse AdamW,
#                                           SLoPe's merged inference product
#   scripts/gpu-check.sh --bench-only       the benchmarks without the tests
#   scripts/gpu-check.sh --tests REGEX      only the gpu tests whose names match REGEX
#   scripts/gpu-check.sh --multigpu         only the gpu tests of several GPUs (GpuDataParallel.*:
#                                           data parallel over NCCL; they skip with fewer than two)
#   scripts/gpu-check.sh --benches A,B      only these benchmarks (implies --bench): train,
#                                           gemm, layer, attention, sparsify, sparse-adamw,
#                                           vnm, slope-merged
#   scripts/gpu-check.sh --sanitize         instead of ctest: compute-sanitizer memcheck over the
#                                           gpu tests and racecheck over those of the kernels
#                                           that use shared memory (list below), within
#                                           ESPLAG_SANITIZE_BUDGET seconds of the script's start
#   scripts/gpu-check.sh --configure-only   stop after configuring (no GPU needed)
#   scripts/gpu-check.sh --deps-only        also hide the system's /usr packages from
#                                           CMake, to prove .deps/ suffices
# Environment: ESPLAG_GPU_BUILD_DIR (default build/cuda), ESPLAG_CUDA_ARCHS (default 90),
# ESPLAG_COMMIT (recorded with the results instead of the copy's git HEAD),
# ESPLAG_CUSPARSELT_LIB (where libcusparseLt.so.0 is; default: the loader's search, or the
# nvidia-cusparselt wheel of python3's environment), ESPLAG_NCCL_LIB (where libnccl.so.2 is;
# default: the system's, or the nvidia-nccl wheel's), ESPLAG_SANITIZE_BUDGET (default 540:
# the sanitizer runs stop starting, and a running one is stopped, that many seconds after
# the script started, so that a build and the runs fit a 10-minute call; runs left out are
# listed) and ESPLAG_SANITIZE_TIMEOUT (default 150, the most seconds one run may take).
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD

configure_only=0
deps_only=0
bench=0
tests=1
sanitize=0
test_regex=""
benches="train,gemm,layer,attention,sparsify,sparse-adamw,vnm,slope-merged"
while (($#)); do
  case "$1" in
    --bench) bench=1 ;;
    --bench-only) bench=1; tests=0 ;;
    --sanitize) sanitize=1; tests=0 ;;
    --configure-only) configure_only=1 ;;
    --deps-only) deps_only=1 ;;
    --tests) shift; test_regex=${1:?gpu-check: --tests needs a regular expression} ;;
    --multigpu) test_regex='^GpuDataParallel\.' ;;
    --benches) shift; benches=${1:?gpu-check: --benches needs a list}; bench=1 ;;
    *) echo "gpu-check: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
for b in ${benches//,/ }; do
  case "$b" in
    train|gemm|layer|attention|sparsify|sparse-adamw|vnm|slope-merged) ;;
    *) echo "gpu-check: --benches: unknown benchmark '$b'" >&2; exit 2 ;;
  esac
done
wants() { [[ ",$benches," == *",$1,"* ]]; }

# NVLink multicast (NVLS) off in every process started from here, NCCL's included: on a
# shared multi-GPU host it can take the GPUs out of service. Set it to 1 yourself to allow it.
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
build=${ESPLAG_GPU_BUILD_DIR:-$root/build/cuda}
archs=${ESPLAG_CUDA_ARCHS:-90}
logs=${OUT:-$root/build/gpu-check-logs}
mkdir -p "$logs"
deps=$root/.deps/usr
jobs=$(nproc)
[ -d /usr/local/cuda/bin ] && export PATH=/usr/local/cuda/bin:$PATH
# cuSPARSELt from a pip wheel, when the loader's normal search would not find it.
if [ -z "${ESPLAG_CUSPARSELT_LIB:-}" ] && command -v python3 >/dev/null; then
  wheel_lib=$(python3 -c 'import nvidia.cusparselt as m, os; print(os.path.join(list(m.__path__)[0], "lib"))' 2>/dev/null || true)
  [ -n "$wheel_lib" ] && [ -d "$wheel_lib" ] && export ESPLAG_CUSPARSELT_LIB=$wheel_lib
fi
# NCCL (data-parallel tests on machines with several GPUs): the system's, else the wheel's.
if [ -z "${ESPLAG_NCCL_LIB:-}" ] && ! ldconfig -p 2>/dev/null | grep -q 'libnccl\.so\.2' && command -v python3 >/dev/null; then
  wheel_lib=$(python3 -c 'import nvidia.nccl as m, os; print(os.path.join(list(m.__path__)[0], "lib"))' 2>/dev/null || true)
  [ -n "$wheel_lib" ] && [ -d "$wheel_lib" ] && export ESPLAG_NCCL_LIB=$wheel_lib
fi
export ESPLAG_CUSPARSELT_TUNING=${ESPLAG_CUSPARSELT_TUNING:-$logs/cusparselt-tuning.json}
# ESPLAG_COMMIT wins: a copy of the tree may carry an older .git than the tree it holds.
commit=${ESPLAG_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export ESPLAG_COMMIT=$commit

if [ ! -d "$deps" ]; then
  echo "gpu-check: $deps is missing: run scripts/fetch-gpu-deps.sh on a machine with Debian packages and copy .deps along" >&2
  exit 2
fi

{
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
  echo "host: $(hostname)  cores: $jobs  date: $(date -u +%FT%TZ)"
  cmake --version | head -1
  nvcc --version | tail -2
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
} >"$logs/environment.txt" 2>&1

# CMake before 3.26 knows no CUDA 20 dialect flag for nvcc; giving it the flag explicitly
# is harmless where CMake knows it.
cfg=(--preset cuda -B "$build"
     -DCMAKE_CUDA_ARCHITECTURES="$archs"
     -DCMAKE_CUDA20_STANDARD_COMPILE_OPTION=-std=c++20
     -DCMAKE_CUDA20_EXTENSION_COMPILE_OPTION=-std=c++20
     -DCMAKE_PREFIX_PATH="$deps"
     -DGTest_ROOT="$deps"
     -DCMAKE_INCLUDE_PATH="$deps/include"
     -DCMAKE_LIBRARY_PATH="$deps/lib/x86_64-linux-gnu")
((deps_only)) && cfg+=(-DCMAKE_IGNORE_PREFIX_PATH=/usr)
# Ninja when available, unless the folder was already configured with another generator.
if command -v ninja >/dev/null && [ ! -f "$build/CMakeCache.txt" ]; then cfg+=(-G Ninja); fi

stage=configure
status=0
echo "== configure ($build, sm_$archs)"
cmake "${cfg[@]}" >"$logs/configure.log" 2>&1 || status=$?
if ((status == 0)) && ((configure_only)); then
  grep -E "Found (GTest|nlohmann_json)|CUDA compiler identification|Found CUDAToolkit" "$logs/configure.log"
  grep -E "^(YAML_CPP_STATIC|YAML_CPP_INCLUDE|GTest_DIR|nlohmann_json_DIR)[:=]" "$build/CMakeCache.txt"
  echo "== configure only: done (logs in $logs)"
  exit 0
fi
if ((status == 0)); then
  stage=build
  echo "== build ($jobs jobs)"
  cmake --build "$build" -j "$jobs" >"$logs/build.log" 2>&1 || status=$?
fi
if ((status == 0)) && ((tests)); then
  stage=test
  echo "== ctest -L gpu"
  ctest_args=(--test-dir "$build" -L gpu --output-on-failure --timeout 300 --output-junit "$logs/ctest-junit.xml")
  [ -n "$test_regex" ] && ctest_args+=(-R "$test_regex")
  ctest "${ctest_args[@]}" >"$logs/ctest.log" 2>&1 || status=$?
  # The GEMM tests print which calls used fused epilogues; keep that (cheap to rerun).
  if [ -x "$build/tests/gpu_ops" ]; then
    "$build/tests/gpu_ops" --gtest_filter='GpuOps.Gemm*' >"$logs/gemm.log" 2>&1 || true
  fi
fi

# compute-sanitizer: memcheck (invalid or misaligned global, local and shared accesses)
# over the gpu tests, racecheck (shared-memory hazards) over the tests of the kernels that
# use shared memory. Timings and benchmarks are left out (they measure speed, and a
# sanitizer slows kernels 10-100x), and so are the longest training curves; most
# important first, since the budget may stop the list. CUDA API errors are not reported:
# several tests provoke them on purpose (out of memory, bad arguments).
sanitizer_runs=(
  "memcheck gpu_core *"
  "memcheck gpu_ops *"
  "memcheck gpu_attention_cudnn *"
  "memcheck gpu_sparsify *-*Timing*"
  "memcheck gpu_vnm *-*Timing*"
  "memcheck gpu_sparse_adamw *-*Timing*"
  "memcheck gpu_cusparselt_layout *"
  "racecheck gpu_ops GpuOps.Embedding*:GpuOps.*Norm*:GpuOps.CrossEntropy*:GpuOps.AdamW*"
  "racecheck gpu_model GpuAttention.*:GpuFused.*"
  "racecheck gpu_sparsify *-*Timing*"
  "racecheck gpu_vnm *-*Timing*"
  "racecheck gpu_sparse_adamw *-*Timing*"
  "racecheck gpu_cusparselt_layout *"
  "memcheck gpu_cusparselt *"
  "memcheck gpu_sparse_linear *-*Timing*"
  "memcheck gpu_sparse_activation_linear *"
  "memcheck gpu_kept_values *"
  "memcheck gpu_slope_merged *"
  "memcheck gpu_gemm_autotune *"
  "memcheck gpu_profile *"
  "memcheck gpu_model *-*Llama*:*TrainingCurve*"
  "memcheck gpu_model_sparse *-*TrainingCurve*:*TrainsLikeTheCpu*"
  "memcheck gpu_train GpuTrain.LossCurveMatchesTheCpu:GpuTrain.GpuCheckpointResumesOnTheGpuAndOnTheCpu:GpuTrain.Semi*"
)
sanitize_results=()
if ((status == 0)) && ((sanitize)); then
  stage=sanitize
  budget=${ESPLAG_SANITIZE_BUDGET:-540}
  run_limit=${ESPLAG_SANITIZE_TIMEOUT:-150}
  echo "== compute-sanitizer (until ${budget}s after the start, at most ${run_limit}s a run)"
  if ! command -v compute-sanitizer >/dev/null; then
    echo "gpu-check: compute-sanitizer not found (it comes with the CUDA toolkit, in /usr/local/cuda/bin)" >&2
    status=2
    sanitizer_runs=()
  fi
  for run in "${sanitizer_runs[@]}"; do
    read -r tool bin filter <<<"$run"
    log="$logs/$tool-$bin.log"
    left=$((budget - SECONDS))
    if ((left < 10)); then
      sanitize_results+=("$tool $bin not-run(budget-spent)")
      continue
    fi
    if [ ! -x "$build/tests/$bin" ]; then
      sanitize_results+=("$tool $bin not-built")
      status=1
      continue
    fi
    limit=$((left < run_limit ? left : run_limit))
    start=$SECONDS
    rc=0
    timeout -k 10 "$limit" compute-sanitizer --tool "$tool" --error-exitcode 99 --report-api-errors no \
      "$build/tests/$bin" --gtest_filter="$filter" >"$log" 2>&1 || rc=$?
    # "ERROR SUMMARY: N errors" (memcheck), "RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)"
    errors=$(sed -nE 's/^=+ (ERROR SUMMARY: ([0-9]+) error|RACECHECK SUMMARY: .*\(([0-9]+) error).*/\2\3/p' "$log" | tail -1)
    # compute-sanitizer reports a child stopped by `timeout` as its own failure.
    ((SECONDS - start >= limit)) && rc=124
    case $rc in
      0) result=clean ;;
      99) result="${errors:-?}-errors"; status=1 ;;
      124 | 137) result="timeout(partial,${errors:-0}-errors)"; [ "${errors:-0}" = 0 ] || status=1 ;;
      *) result="test-failed(exit-$rc)"; status=1 ;;
    esac
    sanitize_results+=("$tool $bin $result $((SECONDS - start))")
  done
fi

# The benchmarks (timings are not tests), each appending to its CSV under $logs.
if ((status == 0)) && ((bench)); then
  stage=bench
  echo "== bench"
  run_bench() {  # name, then the esplag arguments
    local name=$1; shift
    echo "-- esplag bench $*" >>"$logs/bench.log"
    "$build/esplag" bench "$@" --csv "$logs/bench-$name.csv" >>"$logs/bench.log" 2>&1 || status=$?
  }
  if wants train; then
    for spec in "gpt2-124m 16 1024" "gpt2-350m 8 1024" "llama-1b 4 2048"; do
      set -- $spec
      # every block Linear semi_sparse (runtime 2:4, per-layer dispatch), then slope, each
      # after its dense baseline in the same process (two rows per run, and their ratios)
      run_bench train train --device cuda --model "$1" --batch "$2" --seq "$3" --steps 10 --warmup 3 --semi-sparse all
      run_bench train train --device cuda --model "$1" --batch "$2" --seq "$3" --steps 10 --warmup 3 --slope all
    done
  fi
  for b in gemm layer attention sparsify sparse-adamw vnm slope-merged; do
    [ "$b" = layer ] && extra=(--sparse-dw) || extra=()
    wants "$b" && run_bench "$b" "$b" "${extra[@]}"
  done
  # Rows of the training CSV start with the commit (the other CSVs carry it themselves).
  [ -f "$logs/bench-train.csv" ] && sed -i "s/^/$commit,/; 1s/^[^,]*,/commit,/" "$logs/bench-train.csv"
fi

echo
if ((status != 0)) && [ "$stage" != test ] && [ "$stage" != sanitize ]; then
  echo "gpu-check: $stage FAILED (exit $status); last lines of $logs/$stage.log:"
  tail -n 40 "$logs/$stage.log"
  exit "$status"
fi
echo "== results (full logs in $logs)"
if ((tests)); then
  grep -E "^\[ gemm" "$logs/gemm.log" 2>/dev/null | sed 's/^/   /'
  printf '%-52s %-8s %s\n' "test" "result" "seconds"
  sed -nE 's/^ *[0-9]+\/[0-9]+ Test +#[0-9]+: ([^ ]+) \.*[ *]*([A-Za-z][A-Za-z: ]*[A-Za-z]) +([0-9.]+) sec.*/\1 \2 \3/p' \
    "$logs/ctest.log" | awk '{ r = $2; for (i = 3; i < NF; ++i) r = r " " $i; printf "%-52s %-8s %s\n", $1, r, $NF }'
  grep -E "tests passed|tests failed" "$logs/ctest.log" || echo "(no ctest summary: see $logs/ctest.log)"
fi
if ((sanitize)); then
  printf '%-10s %-30s %-28s %s\n' "tool" "tests" "result" "seconds"
  for r in "${sanitize_results[@]}"; do
    read -r tool bin result secs <<<"$r"
    printf '%-10s %-30s %-28s %s\n' "$tool" "$bin" "$result" "${secs:-}"
  done
  echo "(logs: $logs/<tool>-<tests>.log; filters: scripts/gpu-check.sh, sanitizer_runs)"
fi
if ((bench)); then
  echo "== bench (full output in $logs/bench.log)"
  sed 's/^/   /' "$logs/bench.log"
fi
exit "$status"
