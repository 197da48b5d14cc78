// Launch of the sm80 forward kernel for one configuration of the manifest (src/cuda/manifest.py). Each
// generated file src/cuda/generated/kernels/fwd_*.cu instantiates launch_forward_sm80 once.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "core/params.hpp"
#include "core/status.hpp"
#include "cuda/common/check.hpp"
#include "cuda/common/kernel_config.cuh"
#include "cuda/sm80/forward_kernel.cuh"

namespace flashattn::cuda {

// Dynamic shared memory of the forward kernel: Q, then kStages x (K, V), then (warp groups only) P and the
// traded row statistics. The manifest computes the same.
template <typename C>
constexpr int forward_smem_bytes() {
  return (C::kBlockM + 2 * C::kStages * C::kBlockN) * C::kHeadDim * 2 + sm80::forward_exchange_smem_bytes<C>();
}

// Grid: (query tiles, Hq, B). Allocates nothing; writes only out and lse. Dispatch has checked the
// CUDA rules (dtype, D <= kHeadDim, alignment) and the shared-memory limit.
template <typename C>
Status launch_forward_sm80(const AttentionParams& p, cudaStream_t stream) {
  constexpr int kSmem = forward_smem_bytes<C>();
  const auto kernel = &sm80::forward_kernel<C>;
  // Raising the kernel's shared-memory limit is per device and sticks: done once per device (bit d of
  // `configured`), so that a call costs one launch and no extra driver round trips.
  static std::atomic<uint64_t> configured{0};
  const uint64_t device_bit = p.device_id < 64 ? (uint64_t(1) << p.device_id) : 0;
  if (device_bit == 0 || (configured.load(std::memory_order_relaxed) & device_bit) == 0) {
    const cudaError_t attribute = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (attribute == cudaErrorInvalidDeviceFunction || attribute == cudaErrorNoKernelImageForDevice) {
      cudaGetLastError();  // clear it: the call did not run
      return error(FA_ERROR_NOT_COMPILED, "q: the forward kernel (D %d, %s) has no image for cuda:%d in this build",
                   C::kHeadDim, ElementTraits<typename C::Element>::kName, p.device_id);
    }
    FA_CUDA_RETURN_IF_ERROR(attribute);
    configured.fetch_or(device_bit, std::memory_order_relaxed);
  }
  const dim3 grid((p.seqlen_q + C::kBlockM - 1) / C::kBlockM, p.heads_q, p.batch);
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return Status();
  kernel<<<grid, C::kThreads, kSmem, stream>>>(p);
  FA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status();
}

}  // namespace flashattn::cuda
