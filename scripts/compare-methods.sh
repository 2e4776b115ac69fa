#!/usr/bin/env bash
# Trains every shipped sparsity recipe (configs/recipes/*.yaml) and its dense twin (the
# same config without the recipe) for the same steps on the same data, and writes the
# final validation losses to a CSV (default bench/results/methods-tiny-cpu.csv).
#
#   scripts/compare-methods.sh [--batch 8] [--seq 64] [--out FILE.csv]
set -euo pipefail
cd "$(dirname "$0")/.."
batch=8 seq=64 out=bench/results/methods-tiny-cpu.csv
while (($#)); do
  case "$1" in
    --batch) batch=$2; shift 2 ;;
    --seq) seq=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    *) echo "compare-methods.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
esplag=${ESPLAG_BIN:-build/cpu/esplag}
[ -x "$esplag" ] || { echo "compare-methods.sh: build first (scripts/setup.sh)" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
val_loss() { grep -o '"val_loss":[0-9.]*' "$1/metrics.jsonl" | tail -1 | cut -d: -f2; }
tok_s() { grep -o '"tokens_per_s":[0-9.]*' "$1/metrics.jsonl" | tail -1 | cut -d: -f2; }
echo "commit,recipe,model,steps,batch,seq,dense_val_loss,method_val_loss,dense_tokens_per_s,method_tokens_per_s" >"$work/out.csv"
for cfg in configs/recipes/*.yaml; do
  name=$(basename "$cfg" .yaml)
  sed '/^recipe:/,$d' "$cfg" >"$work/$name-dense.yaml"
  common=(--set train.batch_size="$batch" --set train.seq_len="$seq" --set train.checkpoint_every=0
          --set train.log_every=100 --set train.eval_batches=32)
  "$esplag" train --config "$work/$name-dense.yaml" "${common[@]}" --out "$work/$name-dense" >"$work/$name-dense.log"
  "$esplag" train --config "$cfg" "${common[@]}" --out "$work/$name" >"$work/$name.log"
  model=$(grep -m1 -o 'preset: [a-z0-9-]*' "$cfg" | cut -d' ' -f2)
  steps=$(grep -m1 -o 'steps: [0-9]*' "$cfg" | cut -d' ' -f2)
  row="$commit,$name,$model,$steps,$batch,$seq,$(val_loss "$work/$name-dense"),$(val_loss "$work/$name"),$(tok_s "$work/$name-dense"),$(tok_s "$work/$name")"
  echo "$row" | tee -a "$work/out.csv"
done
mkdir -p "$(dirname "$out")"
cp "$work/out.csv" "$out"
column -s, -t "$out"
