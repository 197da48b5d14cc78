// Host side of the CUDA backend: CUDA-specific rules and the kernel choice (dispatch.cpp, plain C++),
// then the launch of the chosen row of the generated kernel table on the tensors' device and stream.
#include <cuda_runtime.h>

#include <cstdio>

#include "cuda/common/check.hpp"
#include "cuda/common/device_guard.hpp"
#include "cuda/decode/kvcache.hpp"
#include "cuda/cuda_backend.hpp"
#include "cuda/device_info.hpp"
#include "cuda/dispatch.hpp"
#include "cuda/sm80/backward_plan.hpp"

namespace flashattn::cuda {
namespace {

// The device's limits for dispatch (device_info.hpp caches the attributes per device).
Status device_limits(int device, DeviceLimits* limits) {
  DeviceAttributes a;
  FA_RETURN_IF_ERROR(device_attributes(device, &a));
  *limits = DeviceLimits{a.device, a.sm_major, a.sm_minor, a.smem_per_block_optin};
  return Status();
}

void report(const AttentionParams& p, const KernelEntry& entry, int64_t scratch_bytes) {
  if (p.stats == nullptr) return;
  p.stats->scratch_bytes_peak = scratch_bytes;
  p.stats->num_splits = 1;
  std::snprintf(p.stats->kernel, sizeof(p.stats->kernel), "cuda %s", entry.name);
}

// Common front of forward and backward: the tensors' device, its limits, and the table row.
Status select(KernelKind kind, const AttentionParams& p, int* index) {
  DeviceLimits limits;
  FA_RETURN_IF_ERROR(device_limits(p.device_id, &limits));
  return choose_kernel(kind, p, limits, index);
}

}  // namespace

Status forward(const AttentionParams& p) {
  FA_RETURN_IF_ERROR(check_forward_support(p));
  int index = -1;
  FA_RETURN_IF_ERROR(select(KernelKind::kForward, p, &index));
  const KernelEntry& entry = kernel_entry(index);
  const KernelLaunch& launch = generated::kKernelLaunch[index];
  if (launch.forward == nullptr) return error(FA_ERROR_INTERNAL, "kernel table row %s has no forward launcher", entry.name);
  DeviceGuard guard(p.device_id);
  FA_CUDA_RETURN_IF_ERROR(guard.status());
  // A paged varlen call (a serving step): its short sequences (decode tokens) run in the decode kernels, which pack a
  // K/V head's query heads and split long key ranges (decode_plan.hpp, short_sequence_max_q); the forward kernel
  // then skips them. Only the paged instantiation knows to skip (forward_kernel.cuh).
  decode::ShortSequences routed;
  if (entry.paged_kv) FA_RETURN_IF_ERROR(decode::run_short_sequences(p, &routed));
  if (routed.max_q == 0) {
    report(p, entry, 0);  // the forward allocates nothing beyond out and lse
    return launch.forward(p, p.stream);
  }
  const bool all_routed = routed.max_q >= p.seqlen_q;  // max_seqlen_q bounds every sequence: no row left
  if (p.stats != nullptr) {
    p.stats->scratch_bytes_peak = routed.scratch_bytes;
    p.stats->num_splits = routed.num_splits;
    if (routed.in_place)
      std::snprintf(p.stats->kernel, sizeof(p.stats->kernel), "cuda %s splits=%d (every sequence %d row%s, in place)",
                    routed.kernel, routed.num_splits, p.seqlen_q, p.seqlen_q == 1 ? "" : "s");
    else
      std::snprintf(p.stats->kernel, sizeof(p.stats->kernel), "cuda %s%s%s splits=%d (sequences of <= %d rows)",
                    all_routed ? "" : entry.name, all_routed ? "" : " + ", routed.kernel, routed.num_splits, routed.max_q);
  }
  if (all_routed) return Status();
  AttentionParams rest = p;
  rest.routed_seqlen_q = uint8_t(routed.max_q);
  return launch.forward(rest, p.stream);
}

// Backward: rules and choice as for forward; the launcher (src/cuda/sm80/backward_launch.cuh) owns its
// workspace (fp32 dQ accumulator, dot(dO, O) rows) and reports it through stats.
Status backward(const BackwardParams& p) {
  FA_RETURN_IF_ERROR(check_backward_support(p));
  int index = -1;
  FA_RETURN_IF_ERROR(select(KernelKind::kBackward, p, &index));
  const KernelEntry& entry = kernel_entry(index);
  const KernelLaunch& launch = generated::kKernelLaunch[index];
  if (launch.backward == nullptr) return error(FA_ERROR_INTERNAL, "kernel table row %s has no backward launcher", entry.name);
  report(p, entry, 0);
  DeviceGuard guard(p.device_id);
  FA_CUDA_RETURN_IF_ERROR(guard.status());
  return launch.backward(p, p.stream);
}

Status backward_workspace_size(const BackwardParams& p, int64_t* bytes) {
  FA_RETURN_IF_ERROR(check_backward_support(p));
  int index = -1;
  FA_RETURN_IF_ERROR(select(KernelKind::kBackward, p, &index));
  // O(S): fp32 dQ accumulator + row statistics (+ semaphores when deterministic); src/cuda/sm80/backward_plan.hpp.
  const KernelEntry& entry = kernel_entry(index);
  // + the tail split's dK / dV accumulators where it may run (their size depends on the SM count)
  int sm_count = 0;
  int64_t tail_capacity = 0;
  if (sm80::backward_tail_eligible(p)) {
    FA_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, p.device_id));
    tail_capacity = sm80::backward_tail_capacity(p, entry.block_n, sm_count);
  }
  *bytes = sm80::backward_workspace_layout(p, entry.head_dim, entry.block_m, entry.block_n, tail_capacity).total_bytes;
  return Status();
}

// KV-cache (decode): split-KV kernels, paged caches, append + rotary; src/cuda/decode/kvcache.cpp.
Status kvcache_plan(const KvcacheParams& p, fa_kvcache_plan* plan) { return decode::plan_kvcache(p, plan); }
Status kvcache(const KvcacheParams& p) { return decode::run_kvcache(p); }
Status kvcache_append(const KvcacheAppendParams& p) { return decode::run_kvcache_append(p); }

}  // namespace flashattn::cuda
