// Launch of one decode configuration of the manifest (src/cuda/manifest.py, DECODE_TILES). Each generated
// file src/cuda/generated/kernels/dec_*.cu instantiates launch_kvcache_sm80 once. On the caller's stream:
//   append (when k_new is given) -> attention (grid m_blocks * num_splits, Hk, B) -> combine (num_splits > 1)
// Allocates nothing: params.num_splits is resolved and params.workspace holds the plan's workspace
// (src/cuda/decode/kvcache.cpp does both), so the whole sequence can be captured in a CUDA graph.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "core/params.hpp"
#include "core/status.hpp"
#include "cuda/common/check.hpp"
#include "cuda/decode/decode_aux.hpp"
#include "cuda/decode/decode_kernel.cuh"
#include "cuda/decode/decode_plan.hpp"

namespace flashattn::cuda {

// Dynamic shared memory of the decode kernel: Q, then kStages x (K, V). The manifest computes the same.
template <typename C>
constexpr int decode_smem_bytes() {
  return (C::kBlockM + 2 * C::kStages * C::kBlockN) * C::kHeadDim * 2;
}

template <typename C>
Status launch_kvcache_sm80(const KvcacheParams& p, cudaStream_t stream) {
  constexpr int kSmem = decode_smem_bytes<C>();
  const decode::DecodePlan plan = decode::decode_layout(p, C::kBlockM, C::kBlockN, p.num_splits);
  const decode::DecodeArgs args = decode::make_decode_args(p, plan, p.workspace);
  if (plan.workspace_bytes > 0 && (args.partial_lse == nullptr || p.workspace_bytes < plan.workspace_bytes))
    return error(FA_ERROR_INTERNAL, "kvcache launcher: %d splits need a workspace of %lld bytes", plan.num_splits,
                 (long long)plan.workspace_bytes);
  const auto kernel = &decode::decode_kernel<C>;
  // Raising the kernel's shared-memory limit is per device and sticks: done once per device (bit d).
  static std::atomic<uint64_t> configured{0};
  const uint64_t device_bit = p.device_id < 64 ? (uint64_t(1) << p.device_id) : 0;
  if (device_bit == 0 || (configured.load(std::memory_order_relaxed) & device_bit) == 0) {
    const cudaError_t attribute = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (attribute == cudaErrorInvalidDeviceFunction || attribute == cudaErrorNoKernelImageForDevice) {
      cudaGetLastError();  // clear it: the call did not run
      return error(FA_ERROR_NOT_COMPILED, "q: the kvcache kernel (D %d, %s) has no image for cuda:%d in this build",
                   C::kHeadDim, ElementTraits<typename C::Element>::kName, p.device_id);
    }
    FA_CUDA_RETURN_IF_ERROR(attribute);
    configured.fetch_or(device_bit, std::memory_order_relaxed);
  }
  FA_RETURN_IF_ERROR(decode::launch_append(args, stream));  // the new rows are in the cache before anyone reads it
  const dim3 grid(unsigned(plan.m_blocks) * unsigned(plan.num_splits), p.heads_k, p.batch);
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return Status();
  kernel<<<grid, C::kThreads, kSmem, stream>>>(args);
  FA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return decode::launch_combine(args, stream);
}

}  // namespace flashattn::cuda
