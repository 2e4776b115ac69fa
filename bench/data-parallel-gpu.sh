#!/usr/bin/env bash
# Data-parallel scaling on the GPUs of one machine, in one session: llama-1b (configs/gpu/
# llama-1b.yaml, and its slope config) trained for a few steps on one GPU, then with
# `esplag train --gpus N` at the same micro-batch per GPU (so N times the global batch).
# The N-GPU runs with ZeRO stage 0 and stage 1 (parallel.zero), each with the gradients
# averaged after the backward (parallel.bucket_mb 0) and in buckets during it (the values
# of BUCKETS, default "0 25"). Prints the steady tokens/s
# of each run, the scaling efficiency (tokens/s on N GPUs / (N x tokens/s on one)) and the
# device memory each GPU's model takes (its plan, from the run's first line).
#
#   bench/data-parallel-gpu.sh [N] [build dir] [configs]
#   (default 2, build/cuda and "configs/gpu/llama-1b.yaml configs/gpu/llama-1b-slope.yaml");
#   ZEROS (default "0 1") and BUCKETS (default "0 25") choose the N-GPU runs.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}  # NVLink multicast off unless asked for (scripts/gpu-check.sh says why)
gpus=${1:-2}
esplag=${2:-build/cuda}/esplag
configs=${3:-configs/gpu/llama-1b.yaml configs/gpu/llama-1b-slope.yaml}
[ -x "$esplag" ] || { echo "data-parallel-gpu: $esplag is missing: build the cuda preset first" >&2; exit 2; }
run_dir=$(mktemp -d)
trap 'rm -rf "$run_dir"' EXIT
steps=16
rate() {  # name, config, then esplag train options: prints "tokens/s GiB" at the last step
  local name=$1 config=$2; shift 2
  local log="$run_dir/$name.log"
  timeout 240 "$esplag" train "$@" --config "$config" --out "$run_dir/$name" --set train.steps=$steps \
    --set train.log_every=4 --set schedule.warmup_steps=2 --set train.eval_every=0 --set train.checkpoint_every=0 \
    >"$log" 2>&1 || { echo "$name failed: $(tail -2 "$log")" >&2; echo "0 0"; return; }
  local tps gib
  tps=$(grep -E "^step +$steps/" "$log" | grep -oE '[0-9.]+[KM]? tok/s' | awk '{v=$1; m=1;
    if (v ~ /K$/) m=1e3; if (v ~ /M$/) m=1e6; sub(/[KM]$/, "", v); print v*m}')
  gib=$(grep -oE '[0-9.]+ GiB of device memory' "$log" | head -1 | awk '{print $1}')
  echo "${tps:-0} ${gib:-0}"
}
echo "commit ${ESPLAG_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}  $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1) x$gpus"
echo "config,gpus,zero,bucket_mb,tokens_per_s,efficiency,model_gib_per_gpu"
for config in $configs; do
  name=$(basename "$config" .yaml)
  read -r one one_gib < <(rate "one-$name" "$config")
  echo "$name,1,0,,$one,1.00,$one_gib"
  for zero in ${ZEROS:-0 1}; do
    for mb in ${BUCKETS:-0 25}; do
      read -r many gib < <(rate "many-$name-$zero-$mb" "$config" --gpus "$gpus" --set parallel.zero=$zero \
        --set parallel.bucket_mb=$mb)
      awk -v c="$name" -v n="$gpus" -v z="$zero" -v m="$mb" -v a="$one" -v b="$many" -v g="$gib" \
        'BEGIN { printf "%s,%d,%d,%s,%s,%.2f,%s\n", c, n, z, m, b, (a > 0 ? b / (n * a) : 0), g }'
    done
  done
done
