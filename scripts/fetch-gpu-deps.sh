#!/usr/bin/env bash
# Unpacks the build-time dependencies the GPU machine lacks (GoogleTest, yaml-cpp,
# nlohmann-json: headers, static libraries and CMake package files; the cuSPARSELt and
# cuDNN-frontend headers from PyPI) into .deps/, an
# ignored folder that travels with the working tree to the GPU machine, where
# scripts/gpu-check.sh points CMake at it. Runs on the development machine (Debian),
# through apt-get download and dpkg -x: nothing is installed, no root needed.
#
#   scripts/fetch-gpu-deps.sh          (re)creates .deps/
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(libgtest-dev googletest libyaml-cpp-dev nlohmann-json3-dev)

if ! git check-ignore -q .deps/ 2>/dev/null; then
  echo "fetch-gpu-deps: .deps/ is not ignored by git; add '/.deps/' to .gitignore first" >&2
  exit 1
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
chmod 755 "$tmp"  # apt's download user must be able to write there
echo "== downloading: ${packages[*]}"
(cd "$tmp" && apt-get download "${packages[@]}")

rm -rf .deps
mkdir -p .deps
for deb in "$tmp"/*.deb; do
  echo "   unpacking $(basename "$deb")"
  dpkg -x "$deb" .deps
done

# What gpu-check.sh relies on; fail here rather than on the GPU machine.
for f in usr/lib/x86_64-linux-gnu/cmake/GTest/GTestConfig.cmake \
         usr/lib/x86_64-linux-gnu/libgtest.a \
         usr/lib/x86_64-linux-gnu/libgtest_main.a \
         usr/lib/x86_64-linux-gnu/libyaml-cpp.a \
         usr/include/yaml-cpp/yaml.h \
         usr/share/cmake/nlohmann_json/nlohmann_jsonConfig.cmake \
         usr/include/nlohmann/json.hpp; do
  [ -e ".deps/$f" ] || { echo "fetch-gpu-deps: .deps/$f missing after unpacking" >&2; exit 1; }
done
# The cuSPARSELt and cuDNN-frontend headers (from PyPI) go into the same folder.
scripts/fetch-vendor-headers.sh
echo "== .deps ready ($(du -sh .deps | cut -f1))"
