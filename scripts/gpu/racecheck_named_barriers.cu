// Probe of a compute-sanitizer racecheck false positive that the warp-pair forward kernel runs into
// (src/cuda/sm80/forward_kernel.cuh, KernelConfig::kGroupWarps = 2). Not part of the library or the tests.
//
// The kernel below has the shape of that kernel's single-stage loop with one warp group idle: every
// iteration, all warps pass two __syncthreads (after the first they copy a V tile, after the second the next
// K tile); the working group (warps 0, 1) reads K between them and V after the second, and trades values
// through shared memory with two named barriers (bar.sync 1, 64) that the idle group (warps 2, 3) does not
// take. Every shared-memory write is ordered after every read of the same words by a __syncthreads that all
// warps pass, so the kernel is race-free. racecheck (CUDA 13.0, H200, 2026-11-30) still reports hazards
// between the K / V reads and the next copies when the idle group passes fewer named barriers (6 errors),
// and none when it passes the same number (`--equal`: 0 errors), or when no named barrier is used.
//
//   nvcc -arch=sm_90a -lineinfo scripts/gpu/racecheck_named_barriers.cu -o racecheck_probe
//   compute-sanitizer --tool racecheck ./racecheck_probe            # hazards reported
//   compute-sanitizer --tool racecheck ./racecheck_probe --equal    # none
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>

namespace {

constexpr int kThreads = 128;  // 4 warps: group 0 (warps 0, 1) works, group 1 (warps 2, 3) is idle

__global__ void pair_loop(const int4* tiles, int* out, int num_tiles, bool equal_barrier_counts) {
  __shared__ int4 k_smem[kThreads], v_smem[kThreads];
  __shared__ int max_smem[64], p_smem[64];  // the working group's two exchanges, one buffer each
  const int tid = threadIdx.x;
  const bool working = tid < 64;
  int acc = 0;
  k_smem[tid] = tiles[tid];
  for (int tile = 0; tile < num_tiles; ++tile) {
    __syncthreads();  // K of this tile is written; every read of V of the last tile is done
    v_smem[tid] = tiles[tile * kThreads + tid];
    if (working) acc += k_smem[(tid * 7) % kThreads].x;  // "S = Q K^T"
    __syncthreads();  // V is written; every read of K is done
    if (tile + 1 < num_tiles) k_smem[tid] = tiles[(tile + 1) * kThreads + tid];
    if (!working) {
      if (equal_barrier_counts) {  // the idle group takes its own barrier (id 2) as often
        asm volatile("bar.sync 2, 64;\n" ::: "memory");
        asm volatile("bar.sync 2, 64;\n" ::: "memory");
      }
      continue;
    }
    max_smem[tid] = acc;
    asm volatile("bar.sync 1, 64;\n" ::: "memory");  // "row max exchange"
    acc += max_smem[63 - tid] + v_smem[(tid * 5) % kThreads].y;
    p_smem[tid] = acc;
    asm volatile("bar.sync 1, 64;\n" ::: "memory");  // "P exchange"
    acc += p_smem[63 - tid] + v_smem[(tid * 3) % kThreads].z;
  }
  out[blockIdx.x * kThreads + tid] = acc;
}

}  // namespace

int main(int argc, char** argv) {
  const bool equal = argc > 1 && std::strcmp(argv[1], "--equal") == 0;
  constexpr int kTiles = 8;
  int4* tiles = nullptr;
  int* out = nullptr;
  cudaMalloc(&tiles, kTiles * kThreads * sizeof(int4));
  cudaMemset(tiles, 1, kTiles * kThreads * sizeof(int4));
  cudaMalloc(&out, 2 * kThreads * sizeof(int));
  pair_loop<<<2, kThreads>>>(tiles, out, kTiles, equal);
  const cudaError_t status = cudaDeviceSynchronize();
  std::printf("idle group %s named barriers: %s\n", equal ? "takes as many" : "takes no", cudaGetErrorString(status));
  cudaFree(tiles);
  cudaFree(out);
  return status == cudaSuccess ? 0 : 1;
}
