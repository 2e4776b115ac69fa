#!/usr/bin/env bash
# The optimizer offload (train.offload, docs/memory.md) on one GPU, in one session:
# llama-1b (configs/gpu/llama-1b.yaml, 4 x 2048) without offload and with each offload, then
# llama-7b (configs/gpu/llama-7b-offload.yaml, 1 x 4096, 16 accumulated) with
# optimizer+master, dense and slope (configs/gpu/llama-7b-slope-offload.yaml). Each run trains until STEPS steps are logged and is then ended (a
# llama-7b checkpoint, 81 GB, does not fit a 64 GB disk; nothing is saved by any run).
# Prints one CSV row per run: the last step's time and tokens/s, MFU, the peak device memory
# (nvidia-smi, sampled each second) and the peak host memory of the process (VmHWM).
#
# MFU = (6 N + 6 L T d) tokens/s / 989e12: N parameters, L layers, T sequence length, d model
# width (the attention's causal half of 12 L T d), against the H100's dense bf16 peak.
#
#   bench/offload-gpu.sh [build dir] [llama-7b steps] [all|1b|7b|7b-slope]     (default build/cuda, 4, all)
set -uo pipefail
cd "$(dirname "$0")/.."
esplag=${1:-build/cuda}/esplag
big_steps=${2:-4}
which=${3:-all}
[ -x "$esplag" ] || { echo "offload-gpu: $esplag is missing: build the cuda preset first" >&2; exit 2; }
run_dir=$(mktemp -d)
trap 'rm -rf "$run_dir"' EXIT

# run NAME CONFIG STEPS PARAMS LAYERS SEQ DMODEL TOKENS_PER_STEP [esplag train options]
run() {
  local name=$1 config=$2 steps=$3 params=$4 layers=$5 seq=$6 dmodel=$7 tokens=$8; shift 8
  local out="$run_dir/$name" peak_gpu=0 g
  "$esplag" train --config "$config" --out "$out" --set train.steps=$((steps + 1)) --set train.log_every=1 \
    --set train.eval_every=0 --set train.checkpoint_every=0 --set schedule.warmup_steps=2 "$@" \
    >"$run_dir/$name.log" 2>&1 &
  local pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    [ -f "$out/metrics.jsonl" ] && [ "$(grep -c '"loss"' "$out/metrics.jsonl")" -ge "$steps" ] && break
    g=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)
    [ "${g:-0}" -gt "$peak_gpu" ] && peak_gpu=$g
    sleep 1
  done
  local rss
  rss=$(awk '/VmHWM/ {print $2}' "/proc/$pid/status" 2>/dev/null)
  kill -9 "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
  if [ ! -f "$out/metrics.jsonl" ] || [ "$(grep -c '"loss"' "$out/metrics.jsonl")" -lt "$steps" ]; then
    echo "$name failed: $(tail -3 "$run_dir/$name.log")" >&2
    echo "$name,failed,,,,,"
    return
  fi
  grep '"loss"' "$out/metrics.jsonl" | tail -1 | python3 -c "
import json, sys
m = json.loads(sys.stdin.read())
tps = m['tokens_per_s']
flops = 6 * $params + 6 * $layers * $seq * $dmodel
print('$name,%d,%.0f,%.2f,%.1f,%d,%.1f' % (m['step'], tps, $tokens / tps, 100 * flops * tps / 989e12,
      $peak_gpu, ${rss:-0} / 2**20))
"
  grep -m1 "^model " "$run_dir/$name.log" | sed "s/^/# $name: /"
}

echo "# commit ${ESPLAG_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}  $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
echo "run,step,tokens_per_s,step_s,mfu_percent,gpu_peak_mib,host_peak_gib"
l1b=(953223168 16 2048 2048 8192)
if [ "$which" = all ] || [ "$which" = 1b ]; then
  for offload in none optimizer optimizer+master; do
    run "llama-1b-$offload" configs/gpu/llama-1b.yaml 8 "${l1b[@]}" --set train.offload="$offload"
  done
fi
if [ "$which" = all ] || [ "$which" = 7b ]; then
  run "llama-7b-optimizer+master" configs/gpu/llama-7b-offload.yaml "$big_steps" 6738415616 32 4096 4096 65536
fi
if [ "$which" != 1b ]; then
  # MFU of the slope run counts the dense model's FLOPs (the work a dense step does).
  run "llama-7b-slope-optimizer+master" configs/gpu/llama-7b-slope-offload.yaml "$big_steps" 6738415616 32 4096 4096 65536
fi
exit 0
