#!/usr/bin/env bash
# fp8 training on the GPU (train.precision fp8: the block Linear layers' GEMMs on fp8
# operands, docs/fp8.md) against bf16, in one session: llama-1b 4 x 2048
# (configs/gpu/llama-1b.yaml) dense, slope (configs/gpu/llama-1b-slope.yaml), semi_sparse
# (configs/gpu/llama-1b-semi-sparse.yaml) and VENOM (configs/gpu/llama-1b-venom.yaml: masked,
# then vnm from 70% of the steps), and gpt2-124m 16 x 1024 dense, each trained a few
# steps in bf16 and in fp8 (the 2:4 kinds with train.fp8_grad e4m3: their fp8 input-gradient
# products take e4m3 only), fp8 once per scaling of SCALINGS (precision "fp8" for current
# scaling, "fp8-delayed" for train.fp8_scaling delayed). Prints the steady tokens/s of each
# run, the speed-up over the same model's bf16 dense run, and the device memory the first log
# line reports.
#
#   bench/fp8-gpu.sh [build dir]     (default build/cuda; MODELS, default "llama-1b gpt2-124m", chooses the
#                                    models; KINDS, default "slope semi_sparse venom", llama-1b's sparse
#                                    runs besides dense; SCALINGS, default "current", fp8's scalings
#                                    ("current delayed" for both); LOGS, a folder, keeps the runs' logs there)
set -uo pipefail
cd "$(dirname "$0")/.."
esplag=${1:-build/cuda}/esplag
[ -x "$esplag" ] || { echo "fp8-gpu: $esplag is missing: build the cuda preset first" >&2; exit 2; }
run_dir=$(mktemp -d)
trap '[ -n "${LOGS:-}" ] && cp "$run_dir"/*.log "$LOGS"/; rm -rf "$run_dir"' EXIT
steps=16
sed -e 's/preset: llama-1b/preset: gpt2-124m/' -e 's/vocab_size: 32000/vocab_size: 50257/' \
  -e 's/batch_size: 4/batch_size: 16/' -e 's/seq_len: 2048/seq_len: 1024/' configs/gpu/llama-1b.yaml >"$run_dir/gpt2-124m.yaml"
rate() {  # name, config, then esplag train options: prints "tokens/s,device GiB" of the last step
  local name=$1 config=$2; shift 2
  local log="$run_dir/$name.log"
  timeout 300 "$esplag" train "$@" --config "$config" --out "$run_dir/$name" --set train.steps=$steps \
    --set train.log_every=4 --set schedule.warmup_steps=2 --set train.eval_every=0 --set train.checkpoint_every=0 \
    >"$log" 2>&1 || { echo "$name failed: $(tail -2 "$log")" >&2; echo "0,0"; return; }
  rm -rf "${run_dir:?}/$name"  # its checkpoint: llama-1b's take GBs, and the disk holds a few
  local tps gib
  tps=$(grep -E "^step +$steps/" "$log" | grep -oE '[0-9.]+[KM]? tok/s' | awk '{v=$1; m=1;
    if (v ~ /K$/) m=1e3; if (v ~ /M$/) m=1e6; sub(/[KM]$/, "", v); print v*m}')
  gib=$(grep -m1 -oE '[0-9.]+ GiB of device memory' "$log" | awk '{print $1}')
  echo "${tps:-0},${gib:-0}"
}
echo "# commit ${ESPLAG_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}  $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
echo "model,kind,precision,tokens_per_s,device_gib,speedup"
row() {  # model, kind, precision, "tokens/s,GiB", the bf16 dense tokens/s
  awk -v m="$1" -v k="$2" -v p="$3" -v r="$4" -v base="$5" \
    'BEGIN { split(r, f, ","); printf "%s,%s,%s,%s,%.2f\n", m, k, p, r, (base > 0 ? f[1] / base : 0) }'
}
precision() { [ "$1" = current ] && echo fp8 || echo "fp8-$1"; }  # the precision column of a scaling
for model in ${MODELS:-llama-1b gpt2-124m}; do
  config=configs/gpu/llama-1b.yaml
  [ "$model" = gpt2-124m ] && config="$run_dir/gpt2-124m.yaml"
  bf16=$(rate "$model-bf16" "$config")
  row "$model" dense bf16 "$bf16" "${bf16%%,*}"
  for scaling in ${SCALINGS:-current}; do
    fp8=$(rate "$model-fp8-$scaling" "$config" --set train.precision=fp8 --set train.fp8_scaling="$scaling")
    row "$model" dense "$(precision "$scaling")" "$fp8" "${bf16%%,*}"
  done
  [ "$model" = llama-1b ] || continue
  for kind in ${KINDS:-slope semi_sparse venom}; do
    case $kind in
      slope) config=configs/gpu/llama-1b-slope.yaml ;;
      semi_sparse) config=configs/gpu/llama-1b-semi-sparse.yaml ;;
      venom) config=configs/gpu/llama-1b-venom.yaml ;;  # the last steps are in its vnm phase
      *) echo "fp8-gpu: unknown kind $kind in KINDS" >&2; exit 2 ;;
    esac
    sparse_bf16=$(rate "$model-$kind-bf16" "$config")
    row "$model" "$kind" bf16 "$sparse_bf16" "${bf16%%,*}"
    for scaling in ${SCALINGS:-current}; do
      sparse_fp8=$(rate "$model-$kind-fp8-$scaling" "$config" --set train.precision=fp8 --set train.fp8_grad=e4m3 \
        --set train.fp8_scaling="$scaling")
      row "$model" "$kind" "$(precision "$scaling")" "$sparse_fp8" "${bf16%%,*}"
    done
  done
done
