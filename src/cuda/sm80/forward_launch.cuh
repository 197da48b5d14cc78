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

// Raises the kernel's shared-memory limit to kSmem, once per device (bit d of the kernel's own `configured`): it is per
// device and sticks, so a call costs one launch and no extra driver round trips.
template <typename C>
Status configure_forward_kernel(const void* kernel, int smem, int device_id) {
  static std::atomic<uint64_t> configured{0};
  const uint64_t device_bit = device_id < 64 ? (uint64_t(1) << device_id) : 0;
  if (device_bit != 0 && (configured.load(std::memory_order_relaxed) & device_bit) != 0) return Status();
  const cudaError_t attribute = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (attribute == cudaErrorInvalidDeviceFunction || attribute == cudaErrorNoKernelImageForDevice) {
    cudaGetLastError();  // clear it: the call did not run
    return error(FA_ERROR_NOT_COMPILED, "q: the forward kernel (D %d, %s) has no image for cuda:%d in this build",
                 C::kHeadDim, ElementTraits<typename C::Element>::kName, device_id);
  }
  FA_CUDA_RETURN_IF_ERROR(attribute);
  configured.fetch_or(device_bit, std::memory_order_relaxed);
  return Status();
}

// The grid's query tiles per sequence and heads: Sq rows of Hq heads, or, packed (forward_packing.hpp), G x Sq rows
// of Hk heads. A row that cannot pack is never handed a packed call (the plan checks KernelEntry::gqa_packing).
template <typename C>
Status forward_grid_rows(const AttentionParams& p, int64_t* tiles, int* heads) {
  if (p.pack_gqa != 0 && !sm80::GqaPackingOf<C>::value)
    return error(FA_ERROR_INTERNAL, "forward: a packed call handed to a kernel without GQA packing");
  const int pack = sm80::GqaPackingOf<C>::value ? sm80::gqa_pack_factor(p) : 1;
  *tiles = (int64_t(p.seqlen_q) * pack + C::kBlockM - 1) / C::kBlockM;
  *heads = pack > 1 ? p.heads_k : p.heads_q;
  return Status();
}

// Grid: (query tiles, Hq, B), packed (query tiles of G x Sq rows, Hk, B). Allocates nothing; writes only out and lse.
// Dispatch has checked the CUDA rules (dtype, D <= kHeadDim, alignment) and the shared-memory limit.
template <typename C>
Status launch_forward_sm80(const AttentionParams& p, cudaStream_t stream) {
  constexpr int kSmem = forward_smem_bytes<C>();
  const auto kernel = &sm80::forward_kernel<C>;
  FA_RETURN_IF_ERROR(configure_forward_kernel<C>(reinterpret_cast<const void*>(kernel), kSmem, p.device_id));
  int64_t tiles = 0;
  int heads = 0;
  FA_RETURN_IF_ERROR(forward_grid_rows<C>(p, &tiles, &heads));
  const dim3 grid(uint32_t(tiles), heads, p.batch);
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return Status();
  kernel<<<grid, C::kThreads, kSmem, stream>>>(p, sm80::ForwardSplitWork{});
  FA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status();
}

// A split-KV row (kSplitKv). Grid mode (work.items null): grid (query tiles x num_splits, Hq or packed Hk, B), p.out /
// p.lse pointing at the float32 partials (forward_split.hpp's layout; the caller allocates them and merges). Work list
// (varlen; num_splits unused): grid (work.max_items, Hq or packed Hk), p.out / p.lse the call's, the partials at work's
// pointers. ctas_per_sm non-null: the kernel's resident CTAs per SM on p.device_id (the split plan's slots), nothing
// launched.
template <typename C>
Status launch_forward_split_sm80(const AttentionParams& p, int num_splits, const sm80::ForwardSplitWork& work,
                                 int* ctas_per_sm, cudaStream_t stream) {
  static_assert(sm80::SplitKvOf<C>::value, "a split-KV row");
  constexpr int kSmem = forward_smem_bytes<C>();
  const auto kernel = &sm80::forward_kernel<C>;
  FA_RETURN_IF_ERROR(configure_forward_kernel<C>(reinterpret_cast<const void*>(kernel), kSmem, p.device_id));
  if (ctas_per_sm != nullptr) {
    FA_CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(ctas_per_sm, kernel, C::kThreads, kSmem));
    return Status();
  }
  int64_t tiles = 0;
  int heads = 0;
  FA_RETURN_IF_ERROR(forward_grid_rows<C>(p, &tiles, &heads));
  if (work.items == nullptr && (num_splits < 1 || tiles * num_splits > int64_t(INT32_MAX)))
    return error(FA_ERROR_INTERNAL, "forward split: %d splits of %lld query tiles", num_splits, (long long)tiles);
  const dim3 grid = work.items != nullptr ? dim3(uint32_t(work.max_items), heads, 1)
                                          : dim3(uint32_t(tiles * num_splits), heads, p.batch);
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return Status();
  kernel<<<grid, C::kThreads, kSmem, stream>>>(p, work);
  FA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status();
}

}  // namespace flashattn::cuda
