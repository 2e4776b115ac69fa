#!/usr/bin/env bash
# Builds the CPU configuration (if needed) and runs every test labelled `cpu`.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake --preset cpu >/dev/null
cmake --build --preset cpu -j "$(nproc)"
ctest --preset cpu -j "$(nproc)" "$@"
