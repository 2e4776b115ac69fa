#!/usr/bin/env bash
# Sets up a fresh Debian machine for esplag: installs the packages the build needs,
# builds the CPU configuration, and prepares the bundled corpus (the King James Bible,
# public domain, from Debian's bible-kjv package) as byte-level token shards in data/kjv.
#
#   scripts/setup.sh               packages + CPU build + corpus
#   scripts/setup.sh --cuda        also builds the CUDA configuration (build/cuda)
#   scripts/setup.sh --no-browser  leaves out Chromium (large), needed only by the tests of
#                                  tests/test_profile_report_browser.cpp, which then skip
#   scripts/setup.sh --fuzz        also installs clang, for scripts/fuzz.sh
set -euo pipefail
cd "$(dirname "$0")/.."

with_cuda=0
browser=1
fuzz=0
for arg in "$@"; do
  case "$arg" in
    --cuda) with_cuda=1 ;;
    --no-browser) browser=0 ;;
    --fuzz) fuzz=1 ;;
    *) echo "setup.sh: unknown option $arg" >&2; exit 2 ;;
  esac
done

# Each package with why it is needed (printed before anything is installed).
packages=("cmake: the build" "g++: the compiler" "make: the build" "libgtest-dev: the tests (GoogleTest)"
          "libyaml-cpp-dev: run configs (linked statically)" "nlohmann-json3-dev: safetensors headers, state.json"
          "bible-kjv: the bundled corpus (King James Bible)")
if ((browser)); then
  packages+=("chromium: headless browser for the tests of test_profile_report_browser (--no-browser: skipped)")
fi
((fuzz)) && packages+=("clang: the libFuzzer targets of scripts/fuzz.sh")
missing=()
for entry in "${packages[@]}"; do
  p=${entry%%:*}
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$entry")
done
if ((${#missing[@]})); then
  echo "== installing ${#missing[@]} Debian package(s):"
  printf '   %s\n' "${missing[@]}"
  missing=("${missing[@]%%:*}")
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}" >/dev/null
fi
((browser)) || echo "== no browser: the tests of test_profile_report_browser will be skipped"

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
