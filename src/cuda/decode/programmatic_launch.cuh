// Kernel launches of the decode path, optionally as programmatic dependents of the previous work on the
// stream (sm_90+: cudaLaunchAttributeProgrammaticStreamSerialization). Such a kernel may be launched while
// the previous kernel is still running; it must call wait_for_previous_grids() (cache_rows.cuh) before
// touching global memory. What that buys: the launch latency of each decode kernel (a few microseconds,
// a large part of a batch-1 decode step) overlaps the kernel before it. Works inside CUDA graph capture.
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace flashattn::cuda::decode {

template <typename... KernelParams, typename... Args>
cudaError_t launch_decode_kernel(void (*kernel)(KernelParams...), dim3 grid, dim3 block, size_t smem_bytes,
                                 cudaStream_t stream, bool programmatic, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = programmatic ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace flashattn::cuda::decode
