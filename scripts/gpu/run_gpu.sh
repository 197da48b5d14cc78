#!/usr/bin/env bash
# The one script of the GPU machine: GPU tests (+ compute-sanitizer memcheck and racecheck on a
# subset), our benchmark beside the peers' in the same run, the memory sweep (ours and torch's math
# path), the decode benchmark, and optionally the Python package's GPU tests. Writes logs and JSON
# into the folder it is given; everything is packed into OUT_DIR/results.tgz at the end (the device
# tool returns at most 8 files), with the short summary also as OUT_DIR/summary.txt. While benchmarks run,
# nvidia-smi logs the SM clock, power, temperature and clock-event reasons every 200 ms (run/clocks.csv; the
# summary gives min / median / max).
#
#   scripts/gpu/run_gpu.sh OUT_DIR [BUILD_DIR] [--quick]
#
# BUILD_DIR holds binaries built on the development machine with static runtimes (the GPU machine has
# no OpenBLAS or GoogleTest), sm_90a only to keep them small:
#   cmake -S . -B build-gpu -G Ninja -DFLASHATTN_CUDA=ON -DFLASHATTN_CUDA_ARCHS=90a-real \
#         -DFLASHATTN_BLAS_STATIC=ON -DFLASHATTN_STATIC_RUNTIME=ON
#   ninja -C build-gpu flashattn_tests flashattn_cuda_bench flashattn_cli
# and carried compressed (the device tool carries at most 64 MiB) in the ignored folder .gpucarry/:
#   scripts/gpu/pack.sh build-gpu        (writes .gpucarry/bins.tar.xz and .gpucarry/blas.tar.xz)
# The script unpacks .gpucarry/bins.tar.xz into BUILD_DIR when the binaries are not there.
#
# --quick: the D = 128 bf16 points of the sweep only.
# Environment (all optional):
#   FA_GPU_TESTS       gtest filter of the GPU tests (default 'Cuda*')
#   FA_SKIP_TESTS=1    no tests;  FA_SKIP_BENCH=1  no benchmarks;  FA_SKIP_PEERS=1  no peer timings
#   FA_SANITIZE_TESTS  gtest filter run under compute-sanitizer memcheck
#   FA_RACECHECK_TESTS gtest filter run under compute-sanitizer racecheck; FA_RACECHECK_ARGS: more
#                      compute-sanitizer options, e.g. '--kernel-name kns=backward_main_kernel' to check one
#                      kernel family of a long test (the others then run unchecked, at full speed)
#   FA_MEMORY=1        the peak-memory sweep (ours: flashattn_cuda_bench --memory; torch: peers.py --memory)
#   FA_DECODE=1        the decode benchmark (flashattn_decode_bench; FA_DECODE_ARGS) beside torch's decode;
#                      FA_DECODE_ROUNDS=N (default 3): per point, the layouts N times back to back (medians).
#                      The issue's whole sweep: FA_DECODE_ARGS='--batches 1,4,16,64,256 --caches 1024,8192,32768,131072
#                      --budget-gib 128' (B = 256 / 128k is 128 GiB of K/V: an H200; a smaller card skips and lists it)
#   FA_ROUNDS=N        ours against FlashAttention-2 in N alternating rounds (bench/rounds.py: medians and
#                      ranges of the ratios; FA_ROUNDS_ARGS, default D = 128 / 256 in bf16 and fp16; each point
#                      warms up for 300 ms in both processes, rounds.py --warmup-ms)
#   FA_WARMUP_MS=T     the sweep's warm-up per point: 3 calls, then calls until T ms have passed, ours and the peers
#                      alike (default 0: the 3 calls; see flashattn_cuda_bench --warmup-ms)
#   FA_TUNING=1        the tile-tuning harnesses when BUILD_DIR has them (-DFLASHATTN_BUILD_TUNING=ON):
#                      bench/flashattn_forward_tiles, bench/flashattn_backward_tiles (FA_TUNING_ARGS)
#   FA_STEP=1          the serving step (tools/flashattn step --backend cuda): decodes beside prefill chunks over a
#                      paged pool, timed as mixed (append + one varlen forward), grouped (fa_kvcache per group) and
#                      split (append + fa_kvcache over the decodes + varlen forward over the chunks); JSON per point
#   FA_CHUNK=1         few query rows over many keys (a prompt chunk after a long prefix): ours (tools/flashattn run; the
#                      split-KV forward) beside torch SDPA's flash and cuDNN backends (bench/chunk_peers.py; FA_CHUNK_ARGS)
#   FA_EXAMPLES=1      the continuous-batching example on the GPU (examples/continuous_batching --device cuda, in
#                      bf16: decode steps, chunked prefill, and the mixed step of fa_kvcache_append + fa_forward);
#                      each run checks itself against the float64 reference and exits non-zero on a mismatch
#   FA_PYTHON=1        build the Python package here (pip, no network: CUDA for sm_90a, OpenBLAS from
#                      .gpucarry/blas.tar.xz) and run tests/python and python/bench_overhead.py
#                      (FA_PYTEST_ARGS: pytest's arguments instead of tests/python, e.g. tests/python/test_gpu.py)
#   FA_PTX_TESTS       gtest filter run from .gpucarry/ptx80.tar.xz (pack.sh's PTX_BUILD_DIR: a build with
#                      -DFLASHATTN_CUDA_ARCHS=80-virtual), whose kernels the driver compiles from compute_80 PTX:
#                      the sm_80 code paths (e.g. the FP8 bit-move conversion) on this Hopper GPU
#   FA_BENCH_ARGS, FA_PEERS_ARGS   extra arguments;  FA_TEST_TIMEOUT (seconds, default 300)
set -uo pipefail
out=${1:?usage: run_gpu.sh OUT_DIR [BUILD_DIR] [--quick]}
build=${2:-build-gpu}
quick=${3:-}
here=$(cd "$(dirname "$0")/../.." && pwd)
work="$out/run"
mkdir -p "$work"
sweep=()
peer_sweep=()
if [[ "$quick" == "--quick" ]]; then
  sweep=(--dtypes bf16 --dims 128)
  peer_sweep=(--dims 128)
fi
if [[ ! -x "$build/tests/cpp/flashattn_tests" && -f "$here/.gpucarry/bins.tar.xz" ]]; then
  mkdir -p "$build"
  python3 -c "import tarfile,sys; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$here/.gpucarry/bins.tar.xz" "$build"
fi
summary="$work/summary.txt"
note() { echo "$*" | tee -a "$summary"; }

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
  nvcc --version 2>/dev/null | tail -1
  python3 -c "import torch; print('torch', torch.__version__, 'cuDNN', torch.backends.cudnn.version())" 2>/dev/null
  "$build/tools/flashattn" info 2>/dev/null || true
} > "$work/env.txt" 2>&1
cat "$work/env.txt" | tee -a "$summary"

status=0
if [[ "${FA_SKIP_TESTS:-0}" != "1" ]]; then
  # GPU tests (every test also runs in CI, where the CUDA ones skip): GPU against the float64 oracle.
  timeout "${FA_TEST_TIMEOUT:-300}" "$build/tests/cpp/flashattn_tests" --gtest_filter="${FA_GPU_TESTS:-Cuda*}" \
      --gtest_output="json:$work/gpu_tests.json" > "$work/gpu_tests.log" 2>&1
  status=$?
  note "== GPU tests (exit $status)"
  grep -E "^\[  FAILED|FA_TEST_SEED|Failure|S=128k" "$work/gpu_tests.log" | head -40 | tee -a "$summary"
  tail -3 "$work/gpu_tests.log" | tee -a "$summary"
fi
if [[ "${FA_EXAMPLES:-0}" == "1" && -x "$build/examples/continuous_batching" ]]; then
  note "== examples/continuous_batching --device cuda"
  for flags in "" "--prefill-chunk 5" "--mixed-step" "--mixed-step --prefill-chunk 5"; do
    # shellcheck disable=SC2086  # flags: options, split on spaces
    timeout 120 "$build/examples/continuous_batching" --device cuda --dtype bfloat16 $flags > "$work/example.log" 2>&1
    example_status=$?
    note "  [${flags:-decode}] exit $example_status: $(tail -1 "$work/example.log")"
    [[ $example_status -ne 0 ]] && status=$example_status && tail -5 "$work/example.log" | tee -a "$summary"
  done
fi
if [[ -n "${FA_PTX_TESTS:-}" && -f "$here/.gpucarry/ptx80.tar.xz" ]]; then
  # The sm_80 code paths, run here through the compute_80 PTX (the first launch of each kernel JIT-compiles it).
  ptx_build="$work/ptx80"
  mkdir -p "$ptx_build"
  python3 -c "import tarfile,sys; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$here/.gpucarry/ptx80.tar.xz" "$ptx_build"
  CUDA_CACHE_MAXSIZE=4294967296 timeout "${FA_TEST_TIMEOUT:-300}" "$ptx_build/tests/cpp/flashattn_tests" \
      --gtest_filter="$FA_PTX_TESTS" > "$work/ptx80_tests.log" 2>&1
  ptx_status=$?
  note "== GPU tests of the compute_80 PTX build (exit $ptx_status): $FA_PTX_TESTS"
  grep -E "^\[  FAILED|Failure" "$work/ptx80_tests.log" | head -20 | tee -a "$summary"
  tail -3 "$work/ptx80_tests.log" | tee -a "$summary"
  rm -rf "$ptx_build"
  [[ $ptx_status -ne 0 ]] && status=$ptx_status
fi
if [[ -n "${FA_SANITIZE_TESTS:-}" ]]; then
  # Out-of-bounds and misaligned accesses of the kernels (slow: small tests only).
  timeout 150 compute-sanitizer --tool memcheck --print-limit 20 "$build/tests/cpp/flashattn_tests" \
      --gtest_filter="$FA_SANITIZE_TESTS" > "$work/memcheck.log" 2>&1
  note "== compute-sanitizer memcheck (exit $?): $FA_SANITIZE_TESTS"
  grep -E "ERROR SUMMARY|Invalid|^\[  PASSED|^\[  FAILED" "$work/memcheck.log" | head -20 | tee -a "$summary"
fi
if [[ -n "${FA_RACECHECK_TESTS:-}" ]]; then
  # Shared-memory hazards between threads of a block (slower still: one or two small tests).
  # shellcheck disable=SC2086  # FA_RACECHECK_ARGS: options, split on spaces
  timeout 200 compute-sanitizer --tool racecheck --racecheck-report hazard --print-limit 20 ${FA_RACECHECK_ARGS:-} \
      "$build/tests/cpp/flashattn_tests" --gtest_filter="$FA_RACECHECK_TESTS" > "$work/racecheck.log" 2>&1
  note "== compute-sanitizer racecheck (exit $?): $FA_RACECHECK_TESTS ${FA_RACECHECK_ARGS:-}"
  grep -E "RACECHECK SUMMARY|ERROR SUMMARY|hazard|^\[  PASSED|^\[  FAILED" "$work/racecheck.log" | head -20 | tee -a "$summary"
fi

# The card's SM clock, power and throttle reasons every 200 ms while the benchmarks run (clocks.csv): a ratio that
# moves between runs can then be read against the clock it ran at.
clock_log=""
if [[ "${FA_SKIP_BENCH:-0}" != "1" || "${FA_MEMORY:-0}" == "1" || "${FA_DECODE:-0}" == "1" || "${FA_CHUNK:-0}" == "1" ||
      -n "${FA_ROUNDS:-}" ]] &&
   command -v nvidia-smi > /dev/null; then
  reasons=clocks_event_reasons.active  # the newer name; older drivers know clocks_throttle_reasons.active
  nvidia-smi --query-gpu=$reasons --format=csv,noheader > /dev/null 2>&1 || reasons=clocks_throttle_reasons.active
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,$reasons \
      --format=csv,noheader,nounits -lms 200 > "$work/clocks.csv" 2> /dev/null &
  clock_log=$!
fi

if [[ "${FA_SKIP_BENCH:-0}" != "1" ]]; then
  # Our sweep, then the peers' on the same shapes, then the side-by-side table.
  warmup=(--warmup-ms "${FA_WARMUP_MS:-0}")
  timeout 240 "$build/bench/flashattn_cuda_bench" --json "$work/bench_ours.json" "${sweep[@]}" "${warmup[@]}" \
      ${FA_BENCH_ARGS:-} > "$work/bench.log" 2>&1
  if [[ "${FA_SKIP_PEERS:-0}" != "1" ]]; then
    PYTHONUNBUFFERED=1 timeout 300 python3 "$here/bench/peers.py" --json "$work/bench_peers.json" "${peer_sweep[@]}" \
        "${warmup[@]}" ${FA_PEERS_ARGS:-} > "$work/peers.log" 2>&1 || tail -5 "$work/peers.log"
    note "== forward / backward TFLOP/s: ours beside the peers (same run)"
    python3 "$here/bench/compare.py" "$work/bench_ours.json" "$work/bench_peers.json" 2>&1 | tee -a "$summary"
  else
    cat "$work/bench.log" | tee -a "$summary"
  fi
fi
if [[ "${FA_MEMORY:-0}" == "1" ]]; then
  note "== peak device memory of forward + backward (B=1, H=16, D=128, bf16)"
  timeout 120 "$build/bench/flashattn_cuda_bench" --memory --json "$work/memory_ours.json" 2>&1 | tee -a "$summary"
  PYTHONUNBUFFERED=1 timeout 150 python3 "$here/bench/peers.py" --memory --json "$work/memory_peers.json" 2>&1 \
      | tee -a "$summary"
fi
if [[ "${FA_STEP:-0}" == "1" && -x "$build/tools/flashattn" ]]; then
  note "== serving step: us per step (mixed = append + varlen forward; grouped = fa_kvcache per group; split = append +"
  note "   fa_kvcache over the decodes + varlen forward over the chunks); bf16, 32 / 8 heads, D = 128, page 16"
  n=0
  # scripts/gpu/step_points.txt's points, then its first two again with --check (against the float64 reference)
  mapfile -t step_points < "$here/scripts/gpu/step_points.txt"
  for point in "${step_points[@]}" "${step_points[0]} --check" "${step_points[1]} --check"; do
    n=$((n + 1))
    # shellcheck disable=SC2086  # point: options, split on spaces
    timeout 120 "$build/tools/flashattn" step --backend cuda --iters 30 --warmup 5 --seed 7 $point \
        --json "$work/step_$n.json" > "$work/step_$n.log" 2>&1
    note "  [$point] exit $?: $(grep -E '^(append|mixed|grouped|split):' "$work/step_$n.log" | awk '{printf "%s %s us  ", $1, $2}')"
    grep -E "^check" "$work/step_$n.log" | tee -a "$summary"
  done
fi
if [[ "${FA_CHUNK:-0}" == "1" && -x "$build/tools/flashattn" ]]; then
  note "== few query rows over many keys: ours beside torch SDPA (bench/chunk_peers.py)"
  PYTHONUNBUFFERED=1 timeout 300 python3 "$here/bench/chunk_peers.py" --flashattn "$build/tools/flashattn" \
      --json "$work/chunk.json" ${FA_CHUNK_ARGS:-} 2>&1 | tee -a "$summary"
fi
if [[ "${FA_DECODE:-0}" == "1" ]]; then
  # K/V bytes read per second beside a streaming read of the same run, and torch SDPA decode (cuDNN, FA2).
  decode_args=(${FA_DECODE_ARGS:---batches 1,16,256 --caches 4096,32768,131072})
  note "== decode (${decode_args[*]})"
  timeout 400 "$build/bench/flashattn_decode_bench" --json "$work/decode_ours.json" "${decode_args[@]}" \
      --rounds "${FA_DECODE_ROUNDS:-3}" > "$work/decode_bench.log" 2>&1
  head -5 "$work/decode_bench.log" | tee -a "$summary"  # the table below has the points (medians of the rounds)
  PYTHONUNBUFFERED=1 timeout 150 python3 "$here/bench/peers_decode.py" --json "$work/decode_peers.json" "${decode_args[@]}" \
      > "$work/decode_peers.log" 2>&1 || tail -5 "$work/decode_peers.log"
  python3 "$here/bench/compare_decode.py" "$work/decode_ours.json" "$work/decode_peers.json" 2>&1 | tee -a "$summary"
fi
if [[ -n "${FA_ROUNDS:-}" ]]; then
  note "== ours / FlashAttention-2 in $FA_ROUNDS alternating rounds"
  mkdir -p "$work/rounds"
  PYTHONUNBUFFERED=1 timeout 500 python3 "$here/bench/rounds.py" --bench "$build/bench/flashattn_cuda_bench" \
      --out "$work/rounds" --rounds "$FA_ROUNDS" ${FA_ROUNDS_ARGS:---dtypes bf16,f16 --dims 128,256} 2>&1 \
      | grep -v "^round " | tee -a "$summary"
fi
if [[ "${FA_TUNING:-0}" == "1" ]]; then
  for harness in forward_tiles backward_tiles; do
    [[ -x "$build/bench/flashattn_$harness" ]] || continue
    note "== tuning harness $harness"
    timeout 200 "$build/bench/flashattn_$harness" ${FA_TUNING_ARGS:-} > "$work/$harness.log" 2>&1
    tail -40 "$work/$harness.log" | tee -a "$summary"
  done
fi
if [[ "${FA_PYTHON:-0}" == "1" ]]; then
  note "== Python package on the GPU"
  blas="$work/blas"
  mkdir -p "$blas"
  python3 -c "import tarfile,sys; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$here/.gpucarry/blas.tar.xz" "$blas"
  export LD_LIBRARY_PATH="$blas${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  start=$(date +%s)
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) timeout 420 python3 -m pip install --no-build-isolation --no-deps --no-index -q \
      --target "$work/site" -C build-dir="$work/pybuild" \
      -C cmake.define.FLASHATTN_CUDA=ON -C cmake.define.FLASHATTN_CUDA_ARCHS=90a-real \
      -C cmake.define.FLASHATTN_BLAS_LIBRARY="$blas/libopenblas.so.0" \
      -C cmake.define.FLASHATTN_BLAS_INCLUDE_DIR="$blas" "$here" > "$work/pip.log" 2>&1
  note "pip install (exit $?, $(( $(date +%s) - start )) s)"
  tail -5 "$work/pip.log" | tee -a "$summary"
  export PYTHONPATH="$work/site"
  # shellcheck disable=SC2086  # FA_PYTEST_ARGS: test paths and options, split on spaces
  (cd "$here" && PYTHONUNBUFFERED=1 timeout 300 python3 -m pytest ${FA_PYTEST_ARGS:-tests/python} -q -p no:cacheprovider \
      > "$work/pytest.log" 2>&1)
  note "pytest (exit $?)"
  grep -E "passed|failed|error" "$work/pytest.log" | tail -5 | tee -a "$summary"
  (cd "$here" && timeout 120 python3 -P python/bench_overhead.py --device cuda 2>&1 | tail -15 | tee -a "$summary")
  rm -rf "$work/site" "$work/pybuild" "$blas"
fi
if [[ -n "$clock_log" ]]; then
  kill "$clock_log" 2> /dev/null
  wait "$clock_log" 2> /dev/null
  note "== SM clock (MHz), power (W), temperature (C) while the benchmarks ran: min / median / max ($work/clocks.csv)"
  python3 - "$work/clocks.csv" <<'PY' 2>&1 | tee -a "$summary"
import statistics, sys
rows = [r.split(", ") for r in open(sys.argv[1]) if r.count(",") >= 5]
for name, col in (("sm clock", 1), ("power", 3), ("temperature", 4)):
    v = sorted(float(r[col]) for r in rows if r[col].replace(".", "", 1).isdigit())
    if v:
        print(f"{name}: {v[0]:.0f} / {statistics.median(v):.0f} / {v[-1]:.0f} ({len(v)} samples)")
reasons = {}
for r in rows:
    reasons[r[5].strip()] = reasons.get(r[5].strip(), 0) + 1
print("clock-event reasons (bit mask: samples; 0x4 = software power cap):", ", ".join(f"{k}: {n}" for k, n in sorted(reasons.items())))
PY
fi
cp "$summary" "$out/summary.txt"
tar -czf "$out/results.tgz" -C "$out" run && rm -rf "$work"
exit $status
