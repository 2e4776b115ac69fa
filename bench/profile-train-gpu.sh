#!/usr/bin/env bash
# Where the dense GPU training step's time goes, on the machine with the GPU: the
# benchmark shapes (gpt2-124m 16x1024, gpt2-350m 8x1024, llama-1b 4x2048) with per-op
# CUDA-event timing and with each GpuModelOptions choice switched off, then cuBLASLt's
# heuristic candidates timed for every GEMM shape of those steps. Both are the disabled
# GpuModelBench cases of tests/gpu_model.cu (measurements, not tests).
#
#   bench/profile-train-gpu.sh [build dir]        (default build/cuda; logs under $OUT or the build dir)
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build/cuda}
logs=${OUT:-$build/profile-logs}
mkdir -p "$logs"
bin="$build/tests/gpu_model"
if [ ! -x "$bin" ]; then
  echo "profile-train-gpu: $bin is missing: build the cuda preset (target gpu_model) first" >&2
  exit 2
fi
"$bin" --gtest_also_run_disabled_tests --gtest_filter='GpuModelBench.*' 2>&1 | tee "$logs/profile-train-gpu.log"
