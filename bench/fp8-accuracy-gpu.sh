#!/usr/bin/env bash
# fp8 training's accuracy on the GPU (docs/fp8.md): llama-tiny widened (d_model 512, 4 layers,
# d_ff 1408), bundled corpus (data/kjv), STEPS steps of 16 x 128, dense and slope
# (configs/recipes/slope.yaml's recipe), each in bf16 and fp8 (dense with e5m2 and with e4m3
# gradients; slope with e4m3, the only format its GPU input-gradient products take), and the
# e4m3 runs again with delayed scaling (train.fp8_scaling: delayed, "-delayed" rows). Every
# run is evaluated on the whole validation split; fp8 rows give their loss relative to the
# bf16 run of the same kind.
#
#   bench/fp8-accuracy-gpu.sh [build dir] [out.csv]   (defaults build/cuda, bench/results/fp8-accuracy-h100.csv)
#   env: STEPS (2000)
set -euo pipefail
cd "$(dirname "$0")/.."
esplag=${1:-build/cuda}/esplag
out=${2:-bench/results/fp8-accuracy-h100.csv}
steps=${STEPS:-2000}
[ -x "$esplag" ] || { echo "fp8-accuracy-gpu: $esplag is missing: build the cuda preset first" >&2; exit 2; }
[ -f data/kjv/meta.json ] || { echo "fp8-accuracy-gpu: data/kjv is missing: run scripts/setup.sh" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
slope=configs/recipes/slope.yaml
sed '/^recipe:/,$d' "$slope" >"$work/dense.yaml"
common=(--set train.steps="$steps" --set train.checkpoint_every=0 --set train.eval_every=0 --set train.log_every=500
  --set train.device=cuda --set model.d_model=512 --set model.n_layer=4 --set model.n_head=8 --set model.n_kv_head=4
  --set model.d_ff=1408)
commit=${ESPLAG_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
declare -A loss

run() {  # name, config, then more train options
  local name=$1 config=$2; shift 2
  "$esplag" train --config "$config" --out "$work/$name" "${common[@]}" "$@" >"$work/$name.log" 2>&1 ||
    { echo "fp8-accuracy-gpu: training $name failed:" >&2; tail -5 "$work/$name.log" >&2; exit 1; }
  loss[$name]=$("$esplag" eval --checkpoint "$work/$name" --device cuda --json | grep -o '"loss":[0-9.]*' | cut -d: -f2)
  printf '%-24s val loss %.4f\n' "$name" "${loss[$name]}"
}

echo "commit $commit  $gpu  steps $steps"
run dense-bf16 "$work/dense.yaml"
run dense-fp8-e5m2 "$work/dense.yaml" --set train.precision=fp8 --set train.fp8_grad=e5m2
run dense-fp8-e4m3 "$work/dense.yaml" --set train.precision=fp8 --set train.fp8_grad=e4m3
run slope-bf16 "$slope"
run slope-fp8-e4m3 "$slope" --set train.precision=fp8 --set train.fp8_grad=e4m3
run dense-fp8-e4m3-delayed "$work/dense.yaml" --set train.precision=fp8 --set train.fp8_scaling=delayed
run slope-fp8-e4m3-delayed "$slope" --set train.precision=fp8 --set train.fp8_scaling=delayed

mkdir -p "$(dirname "$out")"
[ -f "$out" ] || echo "commit,gpu,run,steps,val_loss,vs_bf16" >"$out"
for name in dense-bf16 dense-fp8-e5m2 dense-fp8-e4m3 dense-fp8-e4m3-delayed slope-bf16 slope-fp8-e4m3 \
  slope-fp8-e4m3-delayed; do
  base=${loss[${name%%-*}-bf16]}
  awk -v c="$commit" -v g="$gpu" -v n="$name" -v s="$steps" -v l="${loss[$name]}" -v b="$base" \
    'BEGIN { printf "%s,%s,%s,%s,%s,%+.2f%%\n", c, g, n, s, l, 100 * (l - b) / b }' >>"$out"
done
tail -7 "$out"
