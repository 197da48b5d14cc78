#!/usr/bin/env bash
# Packs what the GPU machine needs from this machine into the ignored folder .gpucarry/ (the device
# tool carries at most 64 MiB, so everything travels xz-compressed):
#   bins.tar.xz   the static test, benchmark and tool binaries of BUILD_DIR (see run_gpu.sh)
#   blas.tar.xz   OpenBLAS (OpenMP build) with its Fortran runtime and cblas.h, for building the
#                 Python package there (the GPU machine has no OpenBLAS)
#   ptx80.tar.xz  with PTX_BUILD_DIR: that build's test binary (configured with
#                 -DFLASHATTN_CUDA_ARCHS=80-virtual), for run_gpu.sh's FA_PTX_TESTS
#   scripts/gpu/pack.sh BUILD_DIR [PTX_BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:?usage: pack.sh BUILD_DIR [PTX_BUILD_DIR]}
ptx_build=${2:-}
mkdir -p .gpucarry
# The static binaries share most of their bytes (every kernel, BLAS): xz -9's 64 MiB dictionary
# stores them about once (4 binaries of ~54 MB: 5-6 MB), where -6 stored each (15 MB).
bins=(tests/cpp/flashattn_tests bench/flashattn_cuda_bench bench/flashattn_decode_bench tools/flashattn)
# Optional: the tuning harnesses (-DFLASHATTN_BUILD_TUNING=ON), the serving example (run_gpu.sh's FA_EXAMPLES=1) and
# tools/flashattn_main, a tool binary of another commit copied there by hand (the base of step_ab.sh's A/B).
for extra in bench/flashattn_forward_tiles bench/flashattn_backward_tiles bench/flashattn_decode_tiles \
             examples/continuous_batching tools/flashattn_main; do
  [[ -x "$build/$extra" ]] && bins+=("$extra")
done
# The binaries are ~90 MB each and mostly the same kernels: a dictionary larger than one binary lets xz store the
# shared part once (5 binaries: 9 MB instead of 32 MB with -9's 64 MiB window; the device tool carries 64 MiB with
# the working tree). Unpacking needs ~256 MiB of memory.
tar -C "$build" -cf - "${bins[@]}" | xz -T1 --lzma2=preset=9,dict=256MiB > .gpucarry/bins.tar.xz
if [[ -n "$ptx_build" ]]; then
  tar -C "$ptx_build" -cf - tests/cpp/flashattn_tests | xz -T2 -6 > .gpucarry/ptx80.tar.xz
fi
blas=$(mktemp -d)
cp -L /usr/lib/x86_64-linux-gnu/openblas-openmp/libopenblas.so.0 /usr/lib/x86_64-linux-gnu/libgfortran.so.5 \
      /usr/lib/x86_64-linux-gnu/libquadmath.so.0 "$blas/"
cp /usr/include/x86_64-linux-gnu/openblas-openmp/{cblas.h,openblas_config.h} "$blas/"
tar -C "$blas" -cf - . | xz -T2 -6 > .gpucarry/blas.tar.xz
rm -rf "$blas"
ls -la .gpucarry
