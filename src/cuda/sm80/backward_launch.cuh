// Launch of the sm80 backward for one manifest configuration (src/cuda/manifest.py, BACKWARD_TILES):
// preprocess -> main (-> main again for the tail split, backward_plan.hpp) -> postprocess (-> tail) on the
// caller's stream. The CUDA-specific argument rules were checked by dispatch (src/cuda/dispatch.cpp,
// check_backward_support); this function checks the workspace and the shared-memory limit, then launches.
// Allocation: when params.workspace is null, the workspace (backward_plan.hpp, O(S)) is taken from the library's
// scratch pool on the stream (scratch_pool.hpp: stream-ordered, kept mapped between calls up to its threshold) and
// released after the last kernel (documented behaviour); otherwise nothing is allocated.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <cstdio>

#include "core/status.hpp"
#include "cuda/common/check.hpp"
#include "cuda/common/scratch_pool.hpp"
#include "cuda/sm80/backward_kernel.cuh"

namespace flashattn::cuda {

template <typename Config>
Status launch_backward_sm80(const BackwardParams& params, cudaStream_t stream) {
  using T = sm80::bwd::BackwardTraits<Config>;
  using Element = typename T::Element;
  static_assert(T::kSmemBytes == sm80::backward_smem_bytes(T::kHeadDim, T::kBlockM, T::kBlockN, T::kWarps, T::kStages,
                                                         T::kWarpKeys),
                "backward_plan.hpp (and the manifest) must describe the kernel's shared memory");
  const BackwardParams& p = params;
  int sm_count = 0;
  FA_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, p.device_id));
  const int64_t tail_capacity = sm80::backward_tail_capacity(p, T::kBlockN, sm_count);  // as fa_backward_workspace_size
  const sm80::BackwardWorkspaceLayout layout =
      sm80::backward_workspace_layout(p, T::kHeadDim, T::kBlockM, T::kBlockN, tail_capacity);

  const int key_tiles = (p.seqlen_k + T::kBlockN - 1) / T::kBlockN;
  const int64_t units = int64_t(key_tiles) * p.batch * p.heads_k;  // CTAs without a tail split
  if (p.batch > 65535 || p.heads_k > 65535)  // the main kernel's grid limits (y, z), before anything runs
    return error(FA_ERROR_UNSUPPORTED, "q: the cuda backward runs at most 65535 sequences (batch %d) and 65535 kv heads (%d)",
                 p.batch, p.heads_k);
  if (units > int64_t(INT32_MAX))  // unit indices are int in the kernels
    return error(FA_ERROR_UNSUPPORTED, "q: the cuda backward runs fewer than 2^31 (key tile, sequence, kv head) units; "
                 "%d key tiles x batch %d x %d kv heads is too many", key_tiles, p.batch, p.heads_k);

  void* base = p.workspace;
  if (base != nullptr) {
    if (p.workspace_bytes < layout.total_bytes)
      return error(FA_ERROR_INVALID_ARGUMENT,
                   "workspace: %lld bytes given, the cuda backward needs %lld (ask fa_backward_workspace_size)",
                   (long long)p.workspace_bytes, (long long)layout.total_bytes);
    if (reinterpret_cast<uintptr_t>(base) % 16 != 0)
      return error(FA_ERROR_INVALID_ARGUMENT, "workspace: data pointer must be 16-byte aligned for the cuda backward");
  }

  const auto main_kernel = sm80::bwd::backward_main_kernel<Config, false>;
  // Above 48 KiB a CTA must opt in; the attribute fails when the device allows less.
  FA_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(main_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(T::kSmemBytes)));
  int ctas_per_sm = 0;  // for the tail split: whole waves are sm_count x this CTAs
  if (tail_capacity > 0)
    FA_CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas_per_sm, main_kernel, T::kThreads, T::kSmemBytes));

  const bool owned = base == nullptr && layout.total_bytes > 0;
  if (owned) FA_RETURN_IF_ERROR(scratch_alloc(p.device_id, size_t(layout.total_bytes), stream, &base));
  char* bytes = static_cast<char*>(base);
  sm80::bwd::BackwardWorkspacePointers ws;
  ws.dq_accum = reinterpret_cast<float*>(bytes + layout.dq_accum_offset);
  ws.lse_log2 = reinterpret_cast<float*>(bytes + layout.lse_log2_offset);
  ws.dsum = reinterpret_cast<float*>(bytes + layout.dsum_offset);
  ws.semaphores = p.deterministic ? reinterpret_cast<int*>(bytes + layout.semaphore_offset) : nullptr;
  ws.padded_seqlen_q = layout.padded_seqlen_q;
  ws.dkv_accum = layout.tail_capacity > 0 ? reinterpret_cast<float*>(bytes + layout.dkv_accum_offset) : nullptr;
  ws.key_tiles = key_tiles;
  ws.tail = sm80::plan_backward_tail(p, units, int64_t(sm_count) * ctas_per_sm, layout.tail_capacity, T::kBlockM);

  cudaError_t status = cudaSuccess;
  auto check = [&](cudaError_t e) {
    if (status == cudaSuccess) status = e;
    return status == cudaSuccess;
  };
  const int64_t padded_rows = layout.padded_seqlen_q * p.heads_q;  // per sequence
  constexpr int kPrePostThreads = 256;
  if (padded_rows > 0 && p.batch > 0) {
    // The preprocess also zeroes dq_accum (no memset).
    if (ws.semaphores != nullptr) check(cudaMemsetAsync(ws.semaphores, 0, size_t(layout.semaphore_bytes), stream));
    if (ws.tail.tail_units > 0)
      check(cudaMemsetAsync(ws.dkv_accum, 0, size_t(sm80::backward_tail_accum_bytes(ws.tail.tail_units, T::kBlockN, T::kHeadDim)),
                            stream));
    const int64_t threads = padded_rows * sm80::bwd::kPreThreadsPerRow;
    const dim3 grid(unsigned((threads + kPrePostThreads - 1) / kPrePostThreads), unsigned(p.batch));
    if (status == cudaSuccess)
      sm80::bwd::backward_preprocess_kernel<Element><<<grid, kPrePostThreads, 0, stream>>>(p, ws, T::kHeadDim);
    check(cudaGetLastError());
  }
  if (key_tiles > 0 && p.batch > 0 && status == cudaSuccess) {
    // Key tile fastest: the CTAs running together are mostly the key tiles of the same (b, hk), which
    // read the same Q / dO from L2. (Key tile slowest, i.e. longest causal CTAs first, measured 1.5%
    // faster at causal S = 16k but up to 12% slower at S = 512-1k, where B x Hk sequences of Q / dO no
    // longer fit in L2: H200, bf16, 2026-11-30 06:14 UTC.) Deterministic mode relies on this order.
    // The units of the tail split (the last ones in this order) are left to a second launch.
    const dim3 grid(unsigned(key_tiles), unsigned(p.batch), unsigned(p.heads_k));
    main_kernel<<<grid, T::kThreads, T::kSmemBytes, stream>>>(p, ws);
    check(cudaGetLastError());
    if constexpr (!T::kDropout) {  // the tail split never runs with dropout (backward_tail_eligible)
      if (ws.tail.tail_units > 0 && status == cudaSuccess) {
        const auto tail_kernel = sm80::bwd::backward_main_kernel<Config, true>;
        check(cudaFuncSetAttribute(tail_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(T::kSmemBytes)));
        if (status == cudaSuccess) tail_kernel<<<unsigned(ws.tail.ctas), T::kThreads, T::kSmemBytes, stream>>>(p, ws);
        check(cudaGetLastError());
      }
    }
  }
  if (ws.tail.tail_units > 0 && status == cudaSuccess) {
    const int64_t items = ws.tail.tail_units * (T::kBlockN / 16) * 8 * (T::kHeadDim / 8);
    const unsigned blocks = unsigned((items + kPrePostThreads - 1) / kPrePostThreads);
    sm80::bwd::backward_tail_kernel<Element><<<blocks, kPrePostThreads, 0, stream>>>(p, ws, T::kHeadDim, T::kBlockN);
    check(cudaGetLastError());
  }
  // Postprocess: one thread per (16-row block, head, 8-column block, row of 8) of the longest sequence.
  const int64_t dq_items = int64_t((p.seqlen_q + 15) / 16) * p.heads_q * (p.head_dim / 8) * 8;  // per sequence
  if (dq_items > 0 && p.batch > 0 && status == cudaSuccess) {
    const dim3 grid(unsigned((dq_items + kPrePostThreads - 1) / kPrePostThreads), unsigned(p.batch));
    sm80::bwd::backward_postprocess_kernel<Element><<<grid, kPrePostThreads, 0, stream>>>(p, ws, T::kHeadDim);
    check(cudaGetLastError());
  }
  if (owned) check(scratch_free(base, stream));
  FA_CUDA_RETURN_IF_ERROR(status);

  if (p.stats != nullptr) {
    p.stats->scratch_bytes_peak = owned ? layout.total_bytes : 0;  // beyond the caller's arguments
    p.stats->num_splits = 1;
  }
  return Status();
}

}  // namespace flashattn::cuda
