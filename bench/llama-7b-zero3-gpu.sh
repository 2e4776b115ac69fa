#!/usr/bin/env bash
# slope llama-7b on two GPUs of one machine under ZeRO stage 3 (docs/distributed.md): builds
# the esplag binary (the cuda preset, against .deps/ as scripts/gpu-check.sh does), prepares
# the bundled corpus, and trains configs/gpu/llama-7b-slope-offload.yaml without its adapters
# (stage 3 keeps every layer's kind from step 0) and without the offload, train.memory auto,
# for 4 steps of 16 x 1 x 4096 tokens per GPU. The run is stopped after step 4's log line,
# before the last step's 40 GB checkpoint. Writes the log, the device memory every GPU uses
# (nvidia-smi, every 5 s) and the build's log under $OUT (default: a new temporary folder);
# prints the run's first lines, its step lines and the largest device memory seen.
#
#   bench/llama-7b-zero3-gpu.sh [zero stage, default 3]
set -u
cd "$(dirname "$0")/.."
zero=${1:-3}
OUT=${OUT:-$(mktemp -d)}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}  # NVLink multicast off (scripts/gpu-check.sh says why)
if [ -z "${ESPLAG_CUSPARSELT_LIB:-}" ]; then
  ESPLAG_CUSPARSELT_LIB=$(python3 -c 'import nvidia.cusparselt as m; print(list(m.__path__)[0] + "/lib")' 2>/dev/null)
  export ESPLAG_CUSPARSELT_LIB
fi
scripts/gpu-check.sh --configure-only >/dev/null 2>&1
ninja -C build/cuda -j"$(nproc)" esplag >"$OUT/build7b.log" 2>&1 || { tail -20 "$OUT/build7b.log"; exit 1; }
build/cuda/esplag data prepare --input data/kjv.txt --tokenizer byte --out data/kjv >/dev/null 2>&1
config=$OUT/llama-7b-slope.yaml
grep -v "lora_rank\|lora_start" configs/gpu/llama-7b-slope-offload.yaml |
  sed "s|path: data/kjv|path: $PWD/data/kjv|" >"$config"
(while sleep 5; do nvidia-smi --query-gpu=memory.used --format=csv,noheader | tr '\n' ' '; echo; done) >"$OUT/smi.txt" &
smi=$!
log=$OUT/train7b.log
build/cuda/esplag train --gpus 2 --config "$config" --out "$OUT/run" --set train.offload=none \
  --set train.memory=auto --set parallel.zero="$zero" --set train.steps=5 --set schedule.warmup_steps=2 >"$log" 2>&1 &
run=$!
for _ in $(seq 1 400); do
  sleep 1
  grep -qE "^step +4/" "$log" && break
  kill -0 "$run" 2>/dev/null || break
done
pkill -9 -f "esplag train --gpus 2 --config $config"
kill "$smi"
head -3 "$log"
grep -E "^step +[0-9]+/" "$log"
echo "largest device memory in use (MiB, per GPU): $(sort -n "$OUT/smi.txt" | tail -1)"
