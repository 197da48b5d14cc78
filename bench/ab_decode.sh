#!/usr/bin/env bash
# A/B timing of two (or more) builds of flashattn_decode_bench on the GPU machine: the same six sets of points,
# run in alternating order (a, n, a, n, ...) ROUNDS times so that clock drift between runs lands on both builds,
# then bench/ab_summary.py prints the medians per point and a / n (> 1: n faster).
#
#   bench/ab_decode.sh OUT_DIR a=BIN_A n=BIN_N [more=BIN ...]
# Environment: ROUNDS (default 3), SETS (default "1 2 3 4 5 6"), EXTRA (more flashattn_decode_bench arguments).
# Sets (bf16 q; the issue's shape first):
#   s1  32 / 8 D = 128, B = 1, 4, 16 x 1k, 8k, 32k, contiguous, paged, paged-seq (page 16)
#   s2  32 / 8 D = 128, B = 64, 256 x 1k, 8k              s3  8 / 1 D = 128, B = 1, 4 x 4k, 16k
#   s4  32 / 8 D = 64, B = 1, 8 x 4k, 16k                 s5  32 / 8 D = 128 FP8 cache, B = 1, 16 x 8k, 32k
#   s6  16 / 16 D = 256, B = 1, 10 x 8k
#   s7  (not in the default SETS) 32 / 8 D = 128, B = 1, 16 x 1k, 32k, contiguous and contiguous-leftpad: the kernel for
#       cache_leftpad against the one without, in one binary (builds from before it have no such layout)
set -uo pipefail
out=${1:?usage: ab_decode.sh OUT_DIR name=BIN ...}
shift
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out/ab"
set_args() {
  case $1 in
    1) echo "--heads 32:8 --batches 1,4,16 --caches 1024,8192,32768 --layouts contiguous,paged,paged-seq" ;;
    2) echo "--heads 32:8 --batches 64,256 --caches 1024,8192" ;;
    3) echo "--heads 8:1 --batches 1,4 --caches 4096,16384" ;;
    4) echo "--heads 32:8 --dim 64 --batches 1,8 --caches 4096,16384" ;;
    5) echo "--heads 32:8 --kv fp8 --batches 1,16 --caches 8192,32768" ;;
    6) echo "--heads 16:16 --dim 256 --batches 1,10 --caches 8192" ;;
    7) echo "--heads 32:8 --batches 1,16 --caches 1024,32768 --layouts contiguous,contiguous-leftpad" ;;
  esac
}
for r in $(seq 1 "${ROUNDS:-3}"); do
  for s in ${SETS:-1 2 3 4 5 6}; do
    for nb in "$@"; do
      name=${nb%%=*}
      bin=${nb#*=}
      # shellcheck disable=SC2046  # the set's arguments, split on spaces
      timeout 120 "$bin" --json "$out/ab/$name-s$s-r$r.json" $(set_args "$s") ${EXTRA:-} > "$out/ab/$name-s$s-r$r.log" 2>&1 ||
        echo "run $name s$s r$r failed: $(tail -2 "$out/ab/$name-s$s-r$r.log")"
    done
  done
done
python3 "$here/bench/ab_summary.py" "$out/ab" --json "$out/ab.json" | tee "$out/ab_summary.txt"
