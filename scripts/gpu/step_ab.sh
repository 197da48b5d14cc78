#!/usr/bin/env bash
# A/B of the serving step (tools/flashattn step --backend cuda) between two tool binaries, alternating rounds:
#   scripts/gpu/step_ab.sh OUT_DIR BASE_TOOL NEW_TOOL [ROUNDS]
# Prints one line per (round, point, run) with the append / mixed / grouped / split times, and keeps the JSON per run. Runs:
# base, new, and new with --keep-pool (the default memory pool keeps freed memory mapped); STEP_RUNS picks among them
# (e.g. "base new").
set -uo pipefail
out=${1:?usage: step_ab.sh OUT_DIR BASE_TOOL NEW_TOOL [ROUNDS]}
base=${2:?}
new=${3:?}
rounds=${4:-3}
mkdir -p "$out"
# The serving-step points (one per line; shared with run_gpu.sh's FA_STEP), or STEP_POINTS_FILE's.
mapfile -t points < "${STEP_POINTS_FILE:-$(dirname "$0")/step_points.txt}"
for r in $(seq 1 "$rounds"); do
  n=0
  for point in "${points[@]}"; do
    n=$((n + 1))
    for which in ${STEP_RUNS:-base new keep}; do
      tool=$new
      extra=()
      [[ $which == base ]] && tool=$base
      [[ $which == keep ]] && extra=(--keep-pool)
      # shellcheck disable=SC2086  # point: options, split on spaces
      timeout 120 "$tool" step --backend cuda --iters 30 --warmup 5 --seed 7 $point "${extra[@]}" --json "$out/r${r}_p${n}_$which.json" \
          > "$out/r${r}_p${n}_$which.log" 2>&1
      echo "round $r [$point] $which exit $?: $(grep -E '^(append|mixed|grouped|split):' "$out/r${r}_p${n}_$which.log" | awk '{printf "%s %s us  ", $1, $2}')"
    done
  done
done
