#!/usr/bin/env bash
# Distillation into a sparse student on the CPU, bundled corpus (data/kjv): the SLoPe recipe
# (configs/recipes/slope.yaml: llama-tiny, slope on the attention and MLP output linears from
# step 0) trained without a teacher and with `distill` from two dense teachers, all for the
# same steps with the same seed and data, each teacher trained for those steps too:
#   twin  the student's dense twin (the same config without the recipe): its gap is the cost
#         of slope's sparsity alone, but on this model it is within seed-to-seed noise
#   wide  a wider and deeper llama (d_model 128, 4 layers, d_ff 352): a gap well above noise
# Every model is evaluated at the end on the whole validation split (`esplag eval`); a
# distilled row's gap_closed is (undistilled - distilled) / (undistilled - its teacher), or
# no_gap where the undistilled student is not behind its teacher.
#
#   bench/distill-cpu.sh [build dir] [out.csv]   (defaults build/cpu, bench/results/distill-cpu.csv)
#   env: STEPS (600), ALPHA (0.5), TEMPERATURE (2.0)
set -euo pipefail
cd "$(dirname "$0")/.."
esplag=${1:-build/cpu}/esplag
out=${2:-bench/results/distill-cpu.csv}
steps=${STEPS:-600} alpha=${ALPHA:-0.5} temperature=${TEMPERATURE:-2.0}
[ -x "$esplag" ] || { echo "distill-cpu: $esplag is missing: build the cpu preset first" >&2; exit 2; }
[ -f data/kjv/meta.json ] || { echo "distill-cpu: data/kjv is missing: run scripts/setup.sh" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
student=configs/recipes/slope.yaml
sed '/^recipe:/,$d' "$student" >"$work/twin.yaml"
wide=(--set model.d_model=128 --set model.n_layer=4 --set model.d_ff=352)
common=(--set train.steps="$steps" --set train.checkpoint_every=0 --set train.eval_every=0 --set train.log_every=100)
commit=${ESPLAG_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
cores=$(nproc)
cpu=$(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1)
declare -A loss seconds

train() {  # name, config, then more train options
  local name=$1 config=$2; shift 2
  local t0=$SECONDS
  "$esplag" train --config "$config" --out "$work/$name" "${common[@]}" "$@" >"$work/$name.log" 2>&1 ||
    { echo "distill-cpu: training $name failed:" >&2; tail -5 "$work/$name.log" >&2; exit 1; }
  seconds[$name]=$((SECONDS - t0))
  loss[$name]=$("$esplag" eval --checkpoint "$work/$name" --json | grep -o '"loss":[0-9.]*' | cut -d: -f2)
  printf '%-16s val loss %.4f  (%ss)\n' "$name" "${loss[$name]}" "${seconds[$name]}"
}
distilled() {  # name, teacher run
  cat "$student" >"$work/$1.yaml"
  echo "  - distill: {teacher: $work/$2, alpha: $alpha, temperature: $temperature}" >>"$work/$1.yaml"
  train "$1" "$work/$1.yaml"
}

echo "commit $commit  cpu: $cores cores ($cpu)  steps $steps  alpha $alpha  temperature $temperature"
train teacher-twin "$work/twin.yaml"
train teacher-wide "$work/twin.yaml" "${wide[@]}"
train slope "$student"
distilled slope+twin teacher-twin
distilled slope+wide teacher-wide

tokens=$("$esplag" eval --checkpoint "$work/slope" --json | grep -o '"tokens":[0-9]*' | cut -d: -f2)
row() {  # name, model, teacher, alpha, temperature
  local gap=
  [ "$3" = - ] || gap=$(awk -v u="${loss[slope]}" -v d="${loss[$1]}" -v t="${loss[$3]}" \
    'BEGIN { if (u > t) printf "%.3f", (u - d) / (u - t); else printf "no_gap" }')
  echo "$commit,$cores,$1,$2,$3,$4,$5,$steps,16,128,${loss[$1]},$tokens,${seconds[$1]},$gap"
}
mkdir -p "$(dirname "$out")"
# Rows already in the file (other settings, other commits) are kept; the new ones follow.
[ -f "$out" ] || echo "commit,cpu_cores,run,model,teacher,alpha,temperature,steps,batch,seq,val_loss,val_tokens,train_s,gap_closed" >"$out"
{
  row teacher-twin llama-tiny - - -
  row teacher-wide llama-128x4 - - -
  row slope llama-tiny+slope - - -
  row slope+twin llama-tiny+slope teacher-twin "$alpha" "$temperature"
  row slope+wide llama-tiny+slope teacher-wide "$alpha" "$temperature"
} >>"$out"
column -s, -t "$out"
