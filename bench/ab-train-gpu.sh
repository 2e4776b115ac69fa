#!/usr/bin/env bash
# A change against its baseline in one session on the machine with the GPU: builds `esplag`
# of this tree and of a copy with PATCH reversed (the baseline), then trains each RUN with
# both builds in turn, ROUNDS times, and prints a CSV: tokens/s at the last step of each
# build, the change, and both losses at that step (equal losses say the change kept the
# arithmetic). The speed claim of a change comes from one such table, never from numbers
# of different sessions.
#
#   git diff BASE -- src > change.patch      (on a machine with the repository's history)
#   bench/ab-train-gpu.sh change.patch [RUN]...
#
# RUN is LABEL=CONFIG[,KEY=VALUE...] (the --set assignments of the run), e.g.
#   fp8=configs/gpu/llama-1b.yaml,train.precision=fp8,train.fp8_scaling=delayed
# Default: llama-1b bf16 and fp8 with delayed scaling. Environment: ROUNDS (default 1),
# STEPS (default 20, a multiple of 4: the speed is the last 4 steps'), BUILD (default
# build/cuda; configured by scripts/gpu-check.sh --configure-only when it has no build
# files), LOGS (a folder: keeps the builds' and runs' logs).
set -uo pipefail
cd "$(dirname "$0")/.."
usage() { sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; }
case "${1:-}" in
  -h|--help) usage; exit 0 ;;
  "") echo "ab-train-gpu: the first argument is the change's patch (bench/ab-train-gpu.sh --help)" >&2; exit 2 ;;
esac
patch=$(realpath "$1") || exit 2
shift
[ -s "$patch" ] || { echo "ab-train-gpu: $patch is missing or empty" >&2; exit 2; }
runs=("$@")
((${#runs[@]})) || runs=("bf16=configs/gpu/llama-1b.yaml"
  "fp8=configs/gpu/llama-1b.yaml,train.precision=fp8,train.fp8_scaling=delayed")
rounds=${ROUNDS:-1} steps=${STEPS:-20} build=${BUILD:-build/cuda}
[[ "$rounds" =~ ^[1-9][0-9]*$ && "$steps" =~ ^[1-9][0-9]*$ ]] && ((steps % 4 == 0)) || {
  echo "ab-train-gpu: ROUNDS must be a positive integer, STEPS a positive multiple of 4" >&2; exit 2; }
for r in "${runs[@]}"; do
  [[ "$r" == *=* ]] || { echo "ab-train-gpu: RUN '$r' is not LABEL=CONFIG[,KEY=VALUE...]" >&2; exit 2; }
  config=${r#*=}; config=${config%%,*}
  [ -f "$config" ] || { echo "ab-train-gpu: RUN '$r': no config $config" >&2; exit 2; }
done

# cuSPARSELt (the 2:4 kinds) from the nvidia-cusparselt wheel where the loader would not find
# it, as scripts/gpu-check.sh does; NVLink multicast off, as there.
if [ -z "${ESPLAG_CUSPARSELT_LIB:-}" ] && command -v python3 >/dev/null; then
  wheel='import nvidia.cusparselt as m; print(list(m.__path__)[0] + "/lib")'
  ESPLAG_CUSPARSELT_LIB=$(python3 -c "$wheel" 2>/dev/null) && export ESPLAG_CUSPARSELT_LIB
fi
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}

work=$(mktemp -d)
trap '[ -n "${LOGS:-}" ] && mkdir -p "$LOGS" && cp "$work"/*.log "$LOGS"/ 2>/dev/null; rm -rf "$work"' EXIT
base=$work/base
mkdir -p "$base"
tar --exclude=./build --exclude=./.git -cf - . | tar -xf - -C "$base"
(cd "$base" && git apply -R "$patch") || {
  echo "ab-train-gpu: $patch does not reverse on this tree (is it the diff from its baseline to this tree?)" >&2
  exit 2
}
build_esplag() {  # tree, build folder (relative to the tree), which (new|base)
  local log=$work/build-$3.log
  mkdir -p "$work/configure-$3"
  (cd "$1" && { [ -f "$2/build.ninja" ] || [ -f "$2/Makefile" ] ||
      ESPLAG_GPU_BUILD_DIR="$2" OUT="$work/configure-$3" scripts/gpu-check.sh --configure-only; } >"$log" 2>&1 &&
    cmake --build "$2" --target esplag -j "$(nproc)" >>"$log" 2>&1)
}
build_esplag . "$build" new & new_pid=$!
build_esplag "$base" build/cuda base & base_pid=$!
wait $new_pid || { echo "ab-train-gpu: this tree's build failed: $(tail -3 "$work/build-new.log")" >&2; exit 1; }
wait $base_pid || { echo "ab-train-gpu: the baseline's build failed: $(tail -3 "$work/build-base.log")" >&2; exit 1; }

train() {  # which (new|base), label, config, sets...: prints "tokens/s,loss" of the last step
  local which=$1 label=$2 config=$3; shift 3
  local bin=$build/esplag tree=$PWD log="$work/$label-$which.log" args=()
  [[ "$build" == /* ]] || bin=$PWD/$bin
  [ "$which" = base ] && bin=$base/build/cuda/esplag tree=$base
  for s in "$@"; do args+=(--set "$s"); done
  (cd "$tree" && timeout 600 "$bin" train --config "$config" --out "$work/run-$label-$which" "${args[@]}" \
     --set train.steps="$steps" --set train.log_every=4 --set schedule.warmup_steps=2 --set train.eval_every=0 \
     --set train.checkpoint_every=0) >"$log" 2>&1 || { echo "failed,"; return; }
  rm -rf "${work:?}/run-$label-$which"
  grep -E "^step +$steps/" "$log" | awk -F'|' '{
    for (i = 1; i <= NF; ++i) {
      if ($i ~ /tok\/s/) {
        v = $i; gsub(/[^0-9.KM]/, "", v); m = v ~ /K$/ ? 1e3 : v ~ /M$/ ? 1e6 : 1; sub(/[KM]$/, "", v); t = v * m
      }
      if ($i ~ /loss/) { l = $i; gsub(/[^0-9.]/, "", l) }
    }
    printf "%.0f,%s\n", t, l }'
}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
echo "# ${gpu:-no GPU name}; baseline: $(basename "$patch") reversed"
echo "run,round,base tokens/s,new tokens/s,change,base loss,new loss"
for r in "${runs[@]}"; do
  label=${r%%=*} spec=${r#*=}
  IFS=, read -ra parts <<< "$spec"
  for ((k = 1; k <= rounds; ++k)); do
    new=$(train new "$label" "${parts[@]}")
    old=$(train base "$label" "${parts[@]}")
    awk -F, -v run="$label" -v k="$k" -v n="$new" -v o="$old" 'BEGIN {
      split(n, a, ","); split(o, b, ",");
      timed = a[1] ~ /^[0-9]+$/ && b[1] ~ /^[0-9]+$/ && b[1] > 0;
      change = timed ? sprintf("%+.1f%%", 100 * (a[1] / b[1] - 1)) : "-";
      printf "%s,%d,%s,%s,%s,%s,%s\n", run, k, b[1], a[1], change, b[2], a[2] }'
  done
done
