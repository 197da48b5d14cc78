#!/usr/bin/env bash
# Sets up, builds and runs the main job: `flashattn bench` on the default backend (the CPU here):
# flash vs textbook attention, fp32, D = 128, H = 16, S = 1k..16k, time and peak memory per length.
# Any arguments are passed to `flashattn bench` (see `flashattn bench --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
mkdir -p out
bash scripts/build.sh > out/build.log 2>&1 || { tail -40 out/build.log; exit 1; }
"${BUILD_DIR:-build}/tools/flashattn" bench --dtype f32 --head-dim 128 --heads 16 \
  --seqlens 1024,2048,4096,8192,16384 --json out/bench_cpu.json "$@"
