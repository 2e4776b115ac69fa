#!/usr/bin/env bash
# Activation checkpointing on the GPU against none, in one session: llama-1b (configs/gpu/
# llama-1b.yaml) trained for a few steps with train.checkpointing none, full and selective at
# its micro-batch (4 x 2048), then full at a micro-batch `none` cannot hold. Prints the
# steady tokens/s and the device memory the model takes (the run's first log line).
#
#   bench/checkpointing-gpu.sh [build dir]     (default build/cuda, built with the cuda preset)
set -uo pipefail
cd "$(dirname "$0")/.."
esplag=${1:-build/cuda}/esplag
[ -x "$esplag" ] || { echo "checkpointing-gpu: $esplag is missing: build the cuda preset first" >&2; exit 2; }
run_dir=$(mktemp -d)
trap 'rm -rf "$run_dir"' EXIT
run() {  # name, then --set assignments
  local name=$1; shift
  local sets=()
  for s in "$@"; do sets+=(--set "$s"); done
  local log="$run_dir/$name.log"
  timeout 150 "$esplag" train --config configs/gpu/llama-1b.yaml --out "$run_dir/$name" --set train.steps=12 \
    --set train.log_every=4 --set schedule.warmup_steps=2 --set train.eval_every=0 --set train.checkpoint_every=0 "${sets[@]}" >"$log" 2>&1
  local rc=$?
  local mem tok
  mem=$(grep -o '[0-9.]* GiB of device memory' "$log" | head -1)
  tok=$(grep -E '^step +12/' "$log" | grep -o '[0-9.]*K tok/s')
  printf '%-28s rc=%-3s %-12s %s\n' "$name" "$rc" "${tok:-?}" "${mem:-$(tail -1 "$log")}"
}
echo "commit ${ESPLAG_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}  $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)"
run none-4x2048 train.checkpointing=none
run full-4x2048 train.checkpointing=full
run selective-4x2048 train.checkpointing=selective
run none-48x2048 train.checkpointing=none train.batch_size=48
run full-64x2048 train.checkpointing=full train.batch_size=64
