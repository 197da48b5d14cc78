#!/usr/bin/env bash
# A/B of the serving step (tools/flashattn step --backend cuda) between two tool binaries, alternating rounds:
#   scripts/gpu/step_ab.sh OUT_DIR BASE_TOOL NEW_TOOL [ROUNDS]
# Prints one line per (round, point, run) with the mixed / grouped / split times, and keeps the JSON per run. Runs:
# base, new, and new with --keep-pool (the default memory pool keeps freed memory mapped).
set -uo pipefail
out=${1:?usage: step_ab.sh OUT_DIR BASE_TOOL NEW_TOOL [ROUNDS]}
base=${2:?}
new=${3:?}
rounds=${4:-3}
mkdir -p "$out"
points=("--decode 8 --cache 1024 --prefill 1 --chunk 128" "--decode 64 --cache 4096 --prefill 2 --chunk 512"
        "--decode 256 --cache 4096 --prefill 4 --chunk 256 --prefill-cache 1024" "--decode 128 --cache 8192 --prefill 0"
        "--decode 16 --cache 32768 --prefill 1 --chunk 1024 --prefill-cache 2048" "--decode 0 --prefill 4 --chunk 2048"
        "--decode 1 --cache 32768 --prefill 0")
for r in $(seq 1 "$rounds"); do
  n=0
  for point in "${points[@]}"; do
    n=$((n + 1))
    for which in base new keep; do
      tool=$new
      extra=()
      [[ $which == base ]] && tool=$base
      [[ $which == keep ]] && extra=(--keep-pool)
      # shellcheck disable=SC2086  # point: options, split on spaces
      timeout 120 "$tool" step --backend cuda --iters 30 --warmup 5 --seed 7 $point "${extra[@]}" --json "$out/r${r}_p${n}_$which.json" \
          > "$out/r${r}_p${n}_$which.log" 2>&1
      echo "round $r [$point] $which exit $?: $(grep -E '^(mixed|grouped|split):' "$out/r${r}_p${n}_$which.log" | awk '{printf "%s %s us  ", $1, $2}')"
    done
  done
done
