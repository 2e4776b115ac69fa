#!/usr/bin/env bash
# Where a data-parallel GPU step's time goes, in one session: `esplag profile` of a config
# on one GPU, then on N (`--gpus N`, the same micro-batch per GPU) with ZeRO stage 0 and the
# gradients averaged after the backward (parallel.bucket_mb 0) or in buckets during it (25),
# and with ZeRO stage 1 in buckets. Each N-GPU profile predicts the step with a link twice as
# fast (comm=2) and with free collectives (comm=inf). Prints each summary (rank 0's step:
# docs/profiler.md); the reports stay under the output directory.
#
#   bench/profile-data-parallel-gpu.sh [N] [build dir] [config] [output dir]
#   (default 2, build/cuda, configs/gpu/llama-1b.yaml, runs/profile-data-parallel)
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}  # NVLink multicast off unless asked for (scripts/gpu-check.sh says why)
gpus=${1:-2}
esplag=${2:-build/cuda}/esplag
config=${3:-configs/gpu/llama-1b.yaml}
out=${4:-runs/profile-data-parallel}
[ -x "$esplag" ] || { echo "profile-data-parallel-gpu: $esplag is missing: build the cuda preset first" >&2; exit 2; }
name=$(basename "$config" .yaml)
echo "commit ${ESPLAG_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}  $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1) x$gpus  $name"
profile() {  # title, then esplag profile options
  local title=$1; shift
  echo "== $title"
  timeout 300 "$esplag" profile --config "$config" --warmup 2 --steps 3 "$@" 2>&1 | grep -v '^reports:' ||
    echo "$title failed" >&2
}
profile "1 GPU" --out "$out/$name-1"
for run in "0 0" "0 25" "1 25"; do
  read -r zero mb <<<"$run"
  profile "$gpus GPUs, ZeRO stage $zero, bucket_mb $mb" --gpus "$gpus" --set parallel.zero="$zero" \
    --set parallel.bucket_mb="$mb" --what-if comm=2 --what-if comm=inf --out "$out/$name-$gpus-z$zero-b$mb"
done
