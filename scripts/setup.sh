#!/usr/bin/env bash
# Sets up a fresh Debian machine for esplag: installs the packages the build needs,
# builds the CPU configuration, and prepares the bundled corpus (the King James Bible,
# public domain, from Debian's bible-kjv package) as byte-level token shards in data/kjv.
#
#   scripts/setup.sh            packages + CPU build + corpus
#   scripts/setup.sh --cuda     also builds the CUDA configuration (build/cuda)
set -euo pipefail
cd "$(dirname "$0")/.."

with_cuda=0
for arg in "$@"; do
  case "$arg" in
    --cuda) with_cuda=1 ;;
    *) echo "setup.sh: unknown option $arg" >&2; exit 2 ;;
  esac
done

packages=(cmake g++ make libgtest-dev libyaml-cpp-dev nlohmann-json3-dev bible-kjv chromium)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "== installing: ${missing[*]}"
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}" >/dev/null
fi

jobs=$(nproc)
echo "== building (cpu preset, $jobs jobs)"
cmake --preset cpu >/dev/null
cmake --build --preset cpu -j "$jobs"

if ((with_cuda)); then
  command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
  command -v nvcc >/dev/null || { echo "setup.sh: --cuda needs the CUDA toolkit (nvcc not found)" >&2; exit 1; }
  # cuSPARSELt and cuDNN-frontend headers (PyPI) into .deps/vendor/include.
  scripts/fetch-vendor-headers.sh
  echo "== building (cuda preset)"
  cmake --preset cuda >/dev/null
  cmake --build --preset cuda -j "$jobs"
fi

if [ ! -f data/kjv/meta.json ]; then
  echo "== preparing the bundled corpus (King James Bible) in data/kjv"
  mkdir -p data
  bible Gen1:1-Rev22:21 </dev/null >data/kjv.txt.tmp
  mv data/kjv.txt.tmp data/kjv.txt
  build/cpu/esplag data prepare --input data/kjv.txt --tokenizer byte --out data/kjv
fi
echo "== setup done"
