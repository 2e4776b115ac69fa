#!/usr/bin/env bash
# Distillation into a sparse student, bundled corpus (data/kjv): the SLoPe recipe
# (configs/recipes/slope.yaml: llama-tiny, slope on the attention and MLP output linears from
# step 0; STUDENT widens it) trained without a teacher and with `distill` from two dense
# teachers, all for the same steps with the same seed and data, each teacher trained for
# those steps too:
#   twin  the student's dense twin (the same config without the recipe): its gap is the cost
#         of slope's sparsity alone (on llama-tiny within seed-to-seed noise)
#   wide  a wider and deeper llama (WIDE; default d_model 128, 4 layers, d_ff 352)
# Every model is evaluated at the end on the whole validation split (`esplag eval`); a
# distilled row's gap_closed is (undistilled - distilled) / (undistilled - its teacher), or
# no_gap where the undistilled student is not behind its teacher.
#
#   bench/distill.sh [build dir] [out.csv]   (defaults build/cpu, bench/results/distill-$DEVICE.csv)
#   env: DEVICE (cpu; cuda trains and evaluates on the GPU), STEPS (600), ALPHA (0.5),
#   TEMPERATURE (2.0), STUDENT and WIDE (space-separated config keys, a bare key being the
#   model's, e.g. "d_model=256 n_layer=4 d_ff=704 optimizer.lr=1e-3"; STUDENT applies to the
#   student and its twin)
set -euo pipefail
cd "$(dirname "$0")/.."
esplag=${1:-build/cpu}/esplag
device=${DEVICE:-cpu}
out=${2:-bench/results/distill-$device.csv}
steps=${STEPS:-600} alpha=${ALPHA:-0.5} temperature=${TEMPERATURE:-2.0}
[ -x "$esplag" ] || { echo "distill: $esplag is missing: build the $device preset first" >&2; exit 2; }
[ -f data/kjv/meta.json ] || { echo "distill: data/kjv is missing: run scripts/setup.sh" >&2; exit 2; }
sets() {  # "k=v a.k=v" -> --set model.k=v --set a.k=v (keys without a section are the model's)
  for kv in $1; do [[ ${kv%%=*} == *.* ]] && printf -- '--set\n%s\n' "$kv" || printf -- '--set\nmodel.%s\n' "$kv"; done
}
mapfile -t student_sets < <(sets "${STUDENT:-}")
mapfile -t wide_sets < <(sets "${WIDE:-d_model=128 n_layer=4 d_ff=352}")
name() { [ -z "$2" ] && echo "$1" || echo "$1($(echo "$2" | tr ' ' ';'))"; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
student=configs/recipes/slope.yaml
sed '/^recipe:/,$d' "$student" >"$work/twin.yaml"
common=(--set train.steps="$steps" --set train.checkpoint_every=0 --set train.eval_every=0 --set train.log_every=100
  --set train.device="$device")
commit=${ESPLAG_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
if [ "$device" = cuda ]; then
  machine=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
else
  machine="$(nproc) cores $(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1)"
fi
declare -A loss seconds

train() {  # name, config, then more train options
  local name=$1 config=$2; shift 2
  local t0=$SECONDS
  "$esplag" train --config "$config" --out "$work/$name" "${common[@]}" "$@" >"$work/$name.log" 2>&1 ||
    { echo "distill: training $name failed:" >&2; tail -5 "$work/$name.log" >&2; exit 1; }
  seconds[$name]=$((SECONDS - t0))
  loss[$name]=$("$esplag" eval --checkpoint "$work/$name" --device "$device" --json | grep -o '"loss":[0-9.]*' |
    cut -d: -f2)
  printf '%-16s val loss %.4f  (%ss)\n' "$name" "${loss[$name]}" "${seconds[$name]}"
}
distilled() {  # name, teacher run
  cat "$student" >"$work/$1.yaml"
  echo "  - distill: {teacher: $work/$2, alpha: $alpha, temperature: $temperature}" >>"$work/$1.yaml"
  train "$1" "$work/$1.yaml" "${student_sets[@]}"
}

echo "commit $commit  $device: $machine  steps $steps  alpha $alpha  temperature $temperature"
train teacher-twin "$work/twin.yaml" "${student_sets[@]}"
train teacher-wide "$work/twin.yaml" "${wide_sets[@]}"
train slope "$student" "${student_sets[@]}"
distilled slope+twin teacher-twin
distilled slope+wide teacher-wide

tokens=$("$esplag" eval --checkpoint "$work/slope" --device "$device" --json | grep -o '"tokens":[0-9]*' | cut -d: -f2)
row() {  # name, model, teacher, alpha, temperature
  local gap=
  [ "$3" = - ] || gap=$(awk -v u="${loss[slope]}" -v d="${loss[$1]}" -v t="${loss[$3]}" \
    'BEGIN { if (u > t) printf "%.3f", (u - d) / (u - t); else printf "no_gap" }')
  echo "$commit,$machine,$1,$2,$3,$4,$5,$steps,16,128,${loss[$1]},$tokens,${seconds[$1]},$gap"
}
mkdir -p "$(dirname "$out")"
# Rows already in the file (other settings, other commits) are kept; the new ones follow.
[ -f "$out" ] || echo "commit,machine,run,model,teacher,alpha,temperature,steps,batch,seq,val_loss,val_tokens,train_s,gap_closed" >"$out"
student_name=$(name llama-tiny "${STUDENT:-}")
{
  row teacher-twin "$student_name" - - -
  row teacher-wide "$(name llama-tiny "${WIDE:-d_model=128 n_layer=4 d_ff=352}")" - - -
  row slope "$student_name+slope" - - -
  row slope+twin "$student_name+slope" teacher-twin "$alpha" "$temperature"
  row slope+wide "$student_name+slope" teacher-wide "$alpha" "$temperature"
} >>"$out"
column -s, -t "$out" 2>/dev/null || cat "$out"
