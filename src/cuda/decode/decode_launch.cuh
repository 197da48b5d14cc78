// Launch of one decode configuration of the manifest (src/cuda/manifest.py, DECODE_TILES). Each generated
// file src/cuda/generated/kernels/dec_*.cu instantiates launch_kvcache_sm80 once. On the caller's stream:
//   append (when k_new is given) -> attention (grid m_blocks * num_splits, Hk, B) -> combine (num_splits > 1)
// On sm_90+ the three launch as programmatic dependents (programmatic_launch.cuh): each one's launch
// overlaps the previous kernel, and waits for it on the device before touching memory.
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
#include "cuda/decode/programmatic_launch.cuh"

namespace flashattn::cuda {

// Dynamic shared memory of the decode kernel (decode_config.cuh). The manifest computes the same.
template <typename C>
constexpr int decode_smem_bytes() {
  return C::kSmemBytes;
}

// The attention kernels of config C, by cache: 0 contiguous, 1 paged, 2 contiguous with cache_leftpad (null where
// the config has no such kernel, C::kLeftPadKernel).
using DecodeKernelFn = void (*)(decode::DecodeArgs);
enum DecodeKernelKind : int { kContiguousKernel = 0, kPagedKernel = 1, kLeftPadKernel = 2, kDecodeKernelKinds = 3 };
// (A paged cache with cache_leftpad never gets here: decode_plan.cpp's check_kvcache_support refuses it.)
inline DecodeKernelKind decode_kernel_kind(const KvcacheParams& p) {
  return p.block_table != nullptr ? kPagedKernel : p.cache_leftpad != nullptr ? kLeftPadKernel : kContiguousKernel;
}
template <typename C>
DecodeKernelFn decode_kernel_of(DecodeKernelKind kind) {
  if (kind == kPagedKernel) return &decode::decode_kernel<C, true, false>;
  if (kind == kLeftPadKernel) {
    if constexpr (C::kLeftPadKernel) return &decode::decode_kernel<C, false, true>;
    return nullptr;
  }
  return &decode::decode_kernel<C, false, false>;
}

// Once per device and kernel: raise its shared-memory limit (sticky), allow clusters of up to 16 CTAs on
// sm_90+, and learn whether programmatic dependent launches and the cluster merge may be used: `*sm90` is
// true when the device has compute capability 9.0+ AND the kernel's image was compiled for it (PTX version
// >= 9.0). A build for sm_80 only that runs on an H100 / H200 through its compute_80 PTX (JIT) has neither
// the kernels' griddepcontrol.wait nor their cluster merge (#if __CUDA_ARCH__ >= 900): launching it as a
// programmatic dependent or in clusters would let it read the append's rows too early and leave the split
// partials unmerged (found on the H200 with a compute_80 build, 2026-11-30: 7 of 9 FP8 decode tests failed).
template <typename C>
Status prepare_decode_kernel(int device, bool* sm90) {
  constexpr int kSmem = decode_smem_bytes<C>();
  static std::atomic<uint64_t> configured{0};  // bit d: device d done
  static std::atomic<uint64_t> sm90_bits{0};   // bit d: device d is sm_90+
  const uint64_t device_bit = device >= 0 && device < 64 ? (uint64_t(1) << device) : 0;
  if (device_bit != 0 && (configured.load(std::memory_order_acquire) & device_bit) != 0) {
    *sm90 = (sm90_bits.load(std::memory_order_relaxed) & device_bit) != 0;
    return Status();
  }
  cudaError_t attribute = cudaSuccess;
  for (int kind = 0; kind < kDecodeKernelKinds && attribute == cudaSuccess; ++kind)
    if (const DecodeKernelFn kernel = decode_kernel_of<C>(DecodeKernelKind(kind)))
      attribute = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (attribute == cudaErrorInvalidDeviceFunction || attribute == cudaErrorNoKernelImageForDevice) {
    cudaGetLastError();  // clear it: the call did not run
    return error(FA_ERROR_NOT_COMPILED, "q: the kvcache kernel (D %d, %s%s) has no image for cuda:%d in this build",
                 C::kHeadDim, ElementTraits<typename C::Element>::kName, C::kFp8Cache ? ", float8_e4m3 cache" : "", device);
  }
  FA_CUDA_RETURN_IF_ERROR(attribute);
  int major = 0;
  FA_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  cudaFuncAttributes image{};
  FA_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&image, decode_kernel_of<C>(kContiguousKernel)));
  *sm90 = major >= 9 && image.ptxVersion >= 90;
  if (*sm90) {
    for (int kind = 0; kind < kDecodeKernelKinds; ++kind)
      if (const DecodeKernelFn kernel = decode_kernel_of<C>(DecodeKernelKind(kind)))
        FA_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    sm90_bits.fetch_or(device_bit, std::memory_order_relaxed);
  }
  configured.fetch_or(device_bit, std::memory_order_release);
  return Status();
}

// Whether clusters of `splits` CTAs of the kernel `kind` can be resident on the device (cudaOccupancyMaxActiveClusters
// > 0), asked once per (kind, device < 64, cluster size) and remembered.
template <typename C>
bool cluster_merge_fits(DecodeKernelKind kind, int device, int splits) {
  static std::atomic<uint64_t> asked[kDecodeKernelKinds][decode::kMaxClusterSplits + 1];  // bit d: device d asked
  static std::atomic<uint64_t> fits[kDecodeKernelKinds][decode::kMaxClusterSplits + 1];   // bit d: and the answer was yes
  const DecodeKernelFn kernel = decode_kernel_of<C>(kind);
  if (kernel == nullptr || splits < 2 || splits > decode::kMaxClusterSplits || device < 0 || device >= 64) return false;
  const uint64_t bit = uint64_t(1) << device;
  if ((asked[kind][splits].load(std::memory_order_acquire) & bit) != 0)
    return (fits[kind][splits].load(std::memory_order_relaxed) & bit) != 0;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(unsigned(splits));
  config.blockDim = dim3(C::kThreads);
  config.dynamicSmemBytes = decode_smem_bytes<C>();
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = unsigned(splits);
  attribute[0].val.clusterDim.y = 1;
  attribute[0].val.clusterDim.z = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  int clusters = 0;
  const bool ok = cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) == cudaSuccess && clusters > 0;
  cudaGetLastError();  // a refusal is an answer, not an error of this call
  if (ok) fits[kind][splits].fetch_or(bit, std::memory_order_relaxed);
  asked[kind][splits].fetch_or(bit, std::memory_order_release);
  return ok;
}

// How the attention kernel of a call is placed on the SMs; changes no value (tuning: bench/decode_bench.cu's
// variants sweep these; the library's launcher passes its own).
struct DecodeLaunchTuning {
  int extra_smem_bytes = 0;  // dynamic shared memory beyond the kernel's own, so that fewer CTAs share an SM
  int cluster_policy = 0;    // cluster launches: a cudaClusterSchedulingPolicy (0: the default)
};

// The kernels of one call from its resolved arguments (the launcher below, and bench/decode_bench.cu's
// tuning variants, which set the knobs of `args` themselves).
template <typename C>
Status launch_decode_args(const decode::DecodeArgs& args, const decode::DecodePlan& plan, cudaStream_t stream,
                          const DecodeLaunchTuning& tuning = DecodeLaunchTuning{}) {
  const KvcacheParams& p = args.p;
  if (plan.workspace_bytes > 0 && (args.partial_lse == nullptr || p.workspace_bytes < plan.workspace_bytes))
    return error(FA_ERROR_INTERNAL, "kvcache launcher: %d splits need a workspace of %lld bytes", plan.num_splits,
                 (long long)plan.workspace_bytes);
  const DecodeKernelFn kernel = decode_kernel_of<C>(decode_kernel_kind(p));
  if (kernel == nullptr)  // bench/decode_bench.cu's tuning variants only; before anything is written
    return error(FA_ERROR_UNSUPPORTED, "cache_leftpad: this kernel configuration has no instantiation for left padding");
  FA_RETURN_IF_ERROR(decode::launch_append(args, stream));  // the new rows are in the cache before anyone reads it
  const dim3 grid(unsigned(plan.m_blocks) * unsigned(plan.num_splits), p.heads_k, p.batch);
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return Status();
  const int smem = decode_smem_bytes<C>() + tuning.extra_smem_bytes;
  if (tuning.extra_smem_bytes > 0) FA_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  FA_CUDA_RETURN_IF_ERROR(decode::launch_decode_kernel(kernel, grid, dim3(C::kThreads), size_t(smem), stream,
                                                       args.programmatic_launch != 0,
                                                       args.cluster_merge != 0 ? unsigned(args.num_splits) : 0u,
                                                       args.cluster_merge != 0 ? tuning.cluster_policy : 0, args));
  if (args.cluster_merge != 0) return Status();  // the clusters merged their splits
  return decode::launch_combine(args, stream);
}

template <typename C>
Status launch_kvcache_sm80(const KvcacheParams& p, cudaStream_t stream) {
  bool sm90 = false;
  FA_RETURN_IF_ERROR(prepare_decode_kernel<C>(p.device_id, &sm90));
  const decode::DecodePlan plan = decode::decode_layout(p, C::kBlockM, C::kBlockN, p.num_splits);
  decode::DecodeArgs args = decode::make_decode_args(p, plan, p.workspace);
  args.programmatic_launch = decode::kProgrammaticLaunch && sm90 ? 1 : 0;
  // Splits merged inside a thread-block cluster where that pays (decode_plan.hpp) and the device has clusters
  // that fit; else (sm_80, long or many splits) the combine kernel. The plan's workspace is the same either way.
  args.cluster_merge = sm90 && decode::wants_cluster_merge(plan.num_splits, p.seqlen_k, C::kBlockN) &&
                               cluster_merge_fits<C>(decode_kernel_kind(p), p.device_id, plan.num_splits)
                           ? 1
                           : 0;
  return launch_decode_args<C>(args, plan, stream);
}

}  // namespace flashattn::cuda
