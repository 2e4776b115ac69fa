#!/usr/bin/env bash
# Fetches the headers of the two NVIDIA libraries the CUDA build uses through their
# headers only, from PyPI, into .deps/vendor/include (an ignored folder):
#   - cuSPARSELt (nvidia-cusparselt-cu13): 2:4 sparse GEMMs. The engine opens
#     libcusparseLt.so.0 at run time, so the binary runs (with a dense fallback)
#     where the library is missing.
#   - cuDNN frontend (nvidia-cudnn-frontend): header-only C++ graph API over cuDNN, used
#     for fused attention; it loads libcudnn at run time too.
# The versions are pinned to those of the GPU machine's Python environment. Wheels are
# cached in .whl/ so a rerun downloads nothing.
#
#   scripts/fetch-vendor-headers.sh
set -euo pipefail
cd "$(dirname "$0")/.."

cusparselt=nvidia-cusparselt-cu13==0.8.0
cudnn_frontend=nvidia-cudnn-frontend==1.32.0
dest=.deps/vendor/include

python=$(command -v python3 || true)
[ -n "$python" ] || { echo "fetch-vendor-headers: python3 (with pip) is needed" >&2; exit 1; }
mkdir -p .whl "$dest"
for spec in "$cusparselt" "$cudnn_frontend"; do
  name=${spec%%==*}
  wheel=$(ls .whl/"${name//-/_}"-"${spec##*==}"-*.whl 2>/dev/null | head -1 || true)
  if [ -z "$wheel" ]; then
    echo "== downloading $spec"
    "$python" -m pip download --quiet --no-deps --only-binary=:all: "$spec" -d .whl
    wheel=$(ls .whl/"${name//-/_}"-"${spec##*==}"-*.whl | head -1)
  fi
  tmp=$(mktemp -d)
  "$python" -m zipfile -e "$wheel" "$tmp"
  case "$name" in
    nvidia-cusparselt-cu13) cp "$tmp"/nvidia/cusparselt/include/cusparseLt.h "$dest"/ ;;
    nvidia-cudnn-frontend) cp -r "$tmp"/include/. "$dest"/ ;;
  esac
  rm -rf "$tmp"
done
for f in cusparseLt.h cudnn_frontend.h; do
  [ -f "$dest/$f" ] || { echo "fetch-vendor-headers: $dest/$f missing after unpacking" >&2; exit 1; }
done
echo "== vendor headers in $dest ($(du -sh "$dest" | cut -f1))"
