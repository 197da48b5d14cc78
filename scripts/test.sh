#!/usr/bin/env bash
# Sets up, builds and runs the test suite (GoogleTest via CTest; Python tests when the package is
# installed). On a machine without a GPU the CUDA tests skip with a message and everything else runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh "$@"
ctest --test-dir "${BUILD_DIR:-build}" --output-on-failure -j "${JOBS:-$(nproc)}"
