#!/usr/bin/env bash
# Data-parallel scaling on the GPUs of one machine, in one session: llama-1b (configs/gpu/
# llama-1b.yaml, and its slope config) trained for a few steps on one GPU, then with
# `esplag train --gpus N` at the same micro-batch per GPU (so N times the global batch).
# Prints the steady tokens/s of each run and the scaling efficiency
# (tokens/s on N GPUs / (N x tokens/s on one)).
#
#   bench/data-parallel-gpu.sh [N] [build dir]     (default 2 and build/cuda)
set -uo pipefail
cd "$(dirname "$0")/.."
gpus=${1:-2}
esplag=${2:-build/cuda}/esplag
[ -x "$esplag" ] || { echo "data-parallel-gpu: $esplag is missing: build the cuda preset first" >&2; exit 2; }
run_dir=$(mktemp -d)
trap 'rm -rf "$run_dir"' EXIT
steps=16
rate() {  # name, config, then esplag train options: prints tokens/s at the last step
  local name=$1 config=$2; shift 2
  local log="$run_dir/$name.log"
  timeout 240 "$esplag" train "$@" --config "$config" --out "$run_dir/$name" --set train.steps=$steps \
    --set train.log_every=4 --set schedule.warmup_steps=2 --set train.eval_every=0 --set train.checkpoint_every=0 \
    >"$log" 2>&1 || { echo "$name failed: $(tail -2 "$log")" >&2; echo 0; return; }
  grep -E "^step +$steps/" "$log" | grep -oE '[0-9.]+[KM]? tok/s' | awk '{v=$1; m=1;
    if (v ~ /K$/) m=1e3; if (v ~ /M$/) m=1e6; sub(/[KM]$/, "", v); print v*m}'
}
echo "commit ${ESPLAG_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}  $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1) x$gpus"
echo "config,gpus,tokens_per_s,efficiency"
for config in configs/gpu/llama-1b.yaml configs/gpu/llama-1b-slope.yaml; do
  one=$(rate "one-$(basename "$config" .yaml)" "$config")
  many=$(rate "many-$(basename "$config" .yaml)" "$config" --gpus "$gpus")
  echo "$(basename "$config" .yaml),1,$one,1.00"
  awk -v c="$(basename "$config" .yaml)" -v n="$gpus" -v a="$one" -v b="$many" \
    'BEGIN { printf "%s,%d,%s,%.2f\n", c, n, b, (a > 0 ? b / (n * a) : 0) }'
done
