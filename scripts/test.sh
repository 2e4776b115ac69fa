#!/usr/bin/env bash
# Builds the CPU configuration (if needed) and runs every test labelled `cpu`; other
# arguments go to ctest (e.g. -R BpeTrainer).
#
#   scripts/test.sh [CTEST_ARGS...]             preset `cpu` (build/cpu)
#   scripts/test.sh --sanitize [CTEST_ARGS...]  the same tests built with AddressSanitizer and
#                                               UndefinedBehaviorSanitizer (preset `asan`,
#                                               build/asan): the first invalid access, leak or
#                                               undefined behaviour fails its test with the
#                                               sanitizer's report (several times slower)
set -euo pipefail
cd "$(dirname "$0")/.."
preset=cpu
if [ "${1:-}" = --sanitize ]; then
  preset=asan
  shift
  export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:check_initialization_order=1:strict_string_checks=1}
  export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1}
fi
cmake --preset "$preset" >/dev/null
cmake --build --preset "$preset" -j "$(nproc)"
ctest --preset "$preset" -j "$(nproc)" "$@"
