#!/usr/bin/env bash
# Configures and builds flashattn into ${BUILD_DIR:-build} (Release; CUDA when nvcc is found).
# Extra CMake arguments pass through: scripts/build.sh -DFLASHATTN_CUDA=OFF
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${BUILD_DIR:-build}
mkdir -p "$build_dir"
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release "$@" > "$build_dir/configure.log" 2>&1 || {
  cat "$build_dir/configure.log"; exit 1; }
grep -E "^-- flashattn:" "$build_dir/configure.log" || true
cmake --build "$build_dir" --parallel "${JOBS:-$(nproc)}"
