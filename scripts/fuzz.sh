#!/usr/bin/env bash
# Fuzzes the readers of the files a user hands the engine with libFuzzer: builds the
# targets of fuzz/ (preset `fuzz`: clang, ASan + UBSan, in build/fuzz), writes their seed
# corpus (build/fuzz/seeds, from the engine's own writers and configs/), then runs each
# target for SECONDS, one after the other, and prints per target the executions and what
# was found. A crash, a sanitizer report, an uncaught exception other than esplag::Error,
# a hang (one input over 10 s), a leak or an input needing more than 2 GiB stops that
# target and is saved under build/fuzz/findings/<target>/; the exit status is then 1.
#
#   scripts/fuzz.sh [--parallel N] [SECONDS] [TARGET...]
#                                           SECONDS per target (default 600); TARGETs
#                                           among safetensors shard tokenizer config
#                                           recipe state (default: all); N targets at a
#                                           time (default 1)
#
# Each run's inputs that reached new code are kept in build/fuzz/corpus/<target> for the
# next run; full logs are in build/fuzz/logs. Reproduce a finding (prints the stack):
#   build/fuzz/fuzz/fuzz_<target> build/fuzz/findings/<target>/crash-...
set -euo pipefail
cd "$(dirname "$0")/.."

all_targets=(safetensors shard tokenizer config recipe state)
parallel=1
if [ "${1:-}" = --parallel ]; then
  parallel=${2:-}
  [[ $parallel =~ ^[1-9][0-9]*$ ]] || { echo "fuzz.sh: --parallel needs a positive integer" >&2; exit 2; }
  shift 2
fi
seconds=${1:-600}
[[ $seconds =~ ^[1-9][0-9]*$ ]] || { echo "fuzz.sh: SECONDS must be a positive integer, got '$seconds'" >&2; exit 2; }
(($# > 0)) && shift
targets=("$@")
((${#targets[@]})) || targets=("${all_targets[@]}")
for t in "${targets[@]}"; do
  [[ " ${all_targets[*]} " == *" $t "* ]] || { echo "fuzz.sh: unknown target '$t' (${all_targets[*]})" >&2; exit 2; }
done
command -v clang++ >/dev/null || { echo "fuzz.sh: clang++ is missing (apt-get install clang)" >&2; exit 2; }

build=build/fuzz
mkdir -p "$build/logs" "$build/tmp"
echo "== building the fuzz targets ($build, log: $build/logs/build.log)"
if ! { cmake --preset fuzz && cmake --build --preset fuzz -j "$(nproc)" --target fuzz_seeds "${targets[@]/#/fuzz_}"; } \
     >"$build/logs/build.log" 2>&1; then
  tail -n 30 "$build/logs/build.log"
  exit 2
fi
rm -rf "$build/seeds"
"$build/fuzz/fuzz_seeds" "$build/seeds"
# The targets' scratch files (and those a crash leaves behind) stay inside the build folder.
export TMPDIR=$PWD/$build/tmp
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1}

# One target: runs it, then writes its row of the summary (and its status) beside its log.
fuzz_one() {
  local t=$1 corpus=$build/corpus/$1 findings=$build/findings/$1 log=$build/logs/$1.log rc=0
  mkdir -p "$corpus" "$findings"
  echo "== fuzz_$t for ${seconds}s (log: $log)"
  "$build/fuzz/fuzz_$t" -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
    -artifact_prefix="$findings/" "$corpus" "$build/seeds/$t" >"$log" 2>&1 || rc=$?
  local execs found
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  [ -n "$execs" ] || execs=$(grep -oE '^#[0-9]+' "$log" | tail -1 | tr -d '#')
  found=$(grep -oE '(crash|leak|timeout|oom)-[0-9a-f]+' <(grep -E "^(artifact_prefix|Test unit written)" "$log") |
          sort -u | tr '\n' ' ' || true)
  if ((rc != 0)); then
    echo "   fuzz_$t FOUND (exit $rc): ${found:-see the log}"
    grep -E "^(==[0-9]+==ERROR|SUMMARY|.*runtime error|terminate called|  what\(\)|fuzz: property)" "$log" | head -5 |
      sed 's/^/   /'
  fi
  printf '%-12s %12s %8s   %s\n' "$t" "${execs:-?}" "$(ls "$corpus" | wc -l)" \
    "$( ((rc == 0)) && echo none || echo "${found:-exit $rc, see $log}")" >"$build/logs/$t.summary"
  return "$rc"
}

status=0
running=0
for t in "${targets[@]}"; do
  if ((running == parallel)); then
    wait -n || status=1
    running=$((running - 1))
  fi
  fuzz_one "$t" &
  running=$((running + 1))
done
while ((running > 0)); do
  wait -n || status=1
  running=$((running - 1))
done

echo
echo "== results (${seconds}s per target; findings in $build/findings)"
printf '%-12s %12s %8s   %s\n' target executions corpus findings
for t in "${targets[@]}"; do cat "$build/logs/$t.summary"; done
exit "$status"
