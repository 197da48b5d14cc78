#!/usr/bin/env bash
# Installs what flashattn needs to build and test on Debian/Ubuntu (idempotent; skips what is there).
#   compilers and tools: g++, cmake (>= 3.24), ninja
#   libraries: OpenBLAS built with OpenMP (the CPU backends' sgemm), GoogleTest
# The CUDA backend is built when nvcc is on PATH (CUDA toolkit >= 12.4; not installed by this script).
set -euo pipefail
packages=(g++ cmake ninja-build pkg-config libopenblas-openmp-dev libgtest-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "flashattn setup: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
