// Kernel launches of the decode path, optionally as programmatic dependents of the previous work on the
// stream (sm_90+: cudaLaunchAttributeProgrammaticStreamSerialization). Such a kernel may be launched while
// the previous kernel is still running; it must call wait_for_previous_grids() (cache_rows.cuh) before
// touching global memory. (The attention kernel's exceptions, decode_kernel.cuh: L2 prefetches, which change no
// value, and the speculative tiles' guess of the length and the first block ids: the copies started from it are
// kept only where values read after the wait confirm it.) What that buys: the launch latency of each decode
// kernel (a few microseconds, a large part of a batch-1 decode step) overlaps the kernel before it. Works inside
// CUDA graph capture.
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace flashattn::cuda::decode {

// cluster_x > 1: the grid is launched in thread-block clusters of cluster_x x 1 x 1 CTAs (sm_90+; grid.x a
// multiple of it), placed on the SMs under `cluster_policy` (a cudaClusterSchedulingPolicy; 0: the default).
template <typename... KernelParams, typename... Args>
cudaError_t launch_decode_kernel(void (*kernel)(KernelParams...), dim3 grid, dim3 block, size_t smem_bytes,
                                 cudaStream_t stream, bool programmatic, unsigned cluster_x, int cluster_policy,
                                 Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  cudaLaunchAttribute attribute[3];
  unsigned count = 0;
  if (programmatic) {
    attribute[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[count].val.programmaticStreamSerializationAllowed = 1;
    ++count;
  }
  if (cluster_x > 1) {
    attribute[count].id = cudaLaunchAttributeClusterDimension;
    attribute[count].val.clusterDim.x = cluster_x;
    attribute[count].val.clusterDim.y = 1;
    attribute[count].val.clusterDim.z = 1;
    ++count;
    if (cluster_policy != 0) {
      attribute[count].id = cudaLaunchAttributeClusterSchedulingPolicyPreference;
      attribute[count].val.clusterSchedulingPolicyPreference = static_cast<cudaClusterSchedulingPolicy>(cluster_policy);
      ++count;
    }
  }
  config.attrs = attribute;
  config.numAttrs = count;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace flashattn::cuda::decode
