// Host side of the CUDA backend: CUDA-specific rules and the kernel choice (dispatch.cpp, plain C++),
// then the launch of the chosen row of the generated kernel table on the tensors' device and stream.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <string>

#include "cuda/common/check.hpp"
#include "cuda/common/device_guard.hpp"
#include "cuda/common/scratch_pool.hpp"
#include "cuda/common/stream_fork.hpp"
#include "cuda/decode/decode_plan.hpp"
#include "cuda/decode/kvcache.hpp"
#include "cuda/cuda_backend.hpp"
#include "cuda/device_info.hpp"
#include "cuda/dispatch.hpp"
#include "cuda/forward_run.hpp"
#include "cuda/generated/kernel_table.hpp"
#include "cuda/sm80/backward_plan.hpp"
#include "cuda/sm80/forward_packing.hpp"
#include "cuda/sm80/forward_split.hpp"

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
Status select(KernelKind kind, const AttentionParams& p, DeviceLimits* limits, int* index) {
  FA_RETURN_IF_ERROR(device_limits(p.device_id, limits));
  return choose_kernel(kind, p, *limits, index);
}
Status select(KernelKind kind, const AttentionParams& p, int* index) {
  DeviceLimits limits;
  return select(kind, p, &limits, index);
}

// Resident CTAs per SM of split row `index` on `device` (the split plan's slots): asked of the runtime once per (row,
// device), then cached; attributes cannot change while the process runs. The occupancy query and the kernel's
// shared-memory attribute act on the current device: p.device_id is made current for them (fa_plan_kvcache and the
// plans run before a call's own guard), so the caller's current device is neither asked nor given a context.
Status split_ctas_per_sm(int index, const AttentionParams& p, int* ctas) {
  constexpr int kDevices = 16;
  static std::atomic<int> cache[generated::kKernelCount > 0 ? generated::kKernelCount : 1][kDevices] = {};
  const bool cached = p.device_id >= 0 && p.device_id < kDevices;
  if (cached && (*ctas = cache[index][p.device_id].load(std::memory_order_relaxed)) > 0) return Status();
  DeviceGuard guard(p.device_id);
  FA_CUDA_RETURN_IF_ERROR(guard.status());
  FA_RETURN_IF_ERROR(generated::kKernelLaunch[index].forward_split(p, 0, sm80::ForwardSplitWork{}, ctas, p.stream));
  if (cached) cache[index][p.device_id].store(*ctas, std::memory_order_relaxed);
  return Status();
}

// The plan of `p` as given (packed or not: p.pack_gqa is the view's). min_rows: varlen, at least this many of the
// view's rows run in the forward kernel (the sequences' rows less those the decode kernels may take), else -1.
Status plan_forward_rows(const AttentionParams& p, int forced_splits, int64_t min_rows, ForwardKernelPlan* plan) {
  *plan = ForwardKernelPlan{};
  DeviceLimits limits;
  FA_RETURN_IF_ERROR(select(KernelKind::kForward, p, &limits, &plan->index));
  if (generated::kKernelLaunch[plan->index].forward == nullptr)
    return error(FA_ERROR_INTERNAL, "kernel table row %s has no forward launcher", kernel_entry(plan->index).name);
  const int split_index = split_alternative(plan->index, p, limits);
  if (split_index < 0) return Status();
  const KernelEntry& split_entry = kernel_entry(split_index);
  DeviceAttributes device;
  FA_RETURN_IF_ERROR(device_attributes(p.device_id, &device));
  int ctas = 0;
  FA_RETURN_IF_ERROR(split_ctas_per_sm(split_index, p, &ctas));
  // A varlen call of several sequences is planned as its longest sequence alone (B = 1): if that would not split, no
  // mix of the call's sequences does; if it would, the device's plan kernel decides per sequence (the work list,
  // forward_split.hpp). One sequence: the grid mode's count is its own (no plan kernel).
  const bool by_sequence = p.is_varlen() && p.batch > 1;
  AttentionParams planned = p;
  if (by_sequence) planned.batch = 1;
  const int splits = forced_splits > 0 ? std::min(forced_splits, sm80::kMaxForwardSplits)
                                       : sm80::forward_split_count(planned, split_entry.block_m, split_entry.block_n,
                                                                   device.sm_count, ctas);  // (the tests' count too)
  const bool forced = forced_splits > 0 || sm80::forward_splits_for_tests() > 0;
  // Varlen: the tiles that surely run already fill half the slots, so the plan kernel could only pick one split each.
  const bool surely_full = by_sequence && !forced && min_rows > 0 &&
                           2 * ((min_rows + split_entry.block_m - 1) / split_entry.block_m) * p.heads_q >
                               int64_t(device.sm_count) * ctas;
  if (splits > 1 && !surely_full) {
    plan->split_index = split_index;
    plan->splits = splits;
    if (by_sequence) {
      plan->work_list = true;
      plan->work = sm80::forward_work_shape(p, split_entry.block_m, split_entry.block_n, device.sm_count, ctas,
                                              forced ? splits : 0);
      plan->scratch_bytes = sm80::forward_work_layout(p, plan->work).total_bytes;
    } else {
      plan->scratch_bytes = sm80::forward_split_layout(p, splits).total_bytes;
    }
  }
  return Status();
}

}  // namespace

// The call unpacked, then, where GQA packing is allowed, packed (its view: Hk heads of G x Sq rows, whose own tile and
// split count the same rules pick); packed where the rows it takes may pack and it reads K/V fewer times
// (sm80/forward_packing.hpp). The split partials' layout is the call's own (rows of query heads) either way.
Status plan_forward_kernel(const AttentionParams& p, int forced_splits, ForwardKernelPlan* plan) {
  // Varlen: the query rows that surely run in the forward kernel, all of q's less the most that the decode kernels may
  // take (decode::short_sequence_max_q rows of each sequence, paged calls only).
  const int64_t routed_rows = p.is_varlen() && p.is_paged() ? int64_t(p.batch) * decode::short_sequence_max_q(p) : 0;
  const int64_t min_rows = p.is_varlen() ? std::max<int64_t>(0, int64_t(p.varlen_total_q) - routed_rows) : -1;
  FA_RETURN_IF_ERROR(plan_forward_rows(p, forced_splits, min_rows, plan));
  if (!sm80::gqa_packing_allowed(p)) return Status();
  ForwardKernelPlan packed;
  const int64_t group = p.heads_q / p.heads_k;
  FA_RETURN_IF_ERROR(plan_forward_rows(sm80::gqa_packed_view(p), forced_splits, min_rows < 0 ? -1 : min_rows * group, &packed));
  const KernelEntry& packed_rows = kernel_entry(packed.splits > 1 ? packed.split_index : packed.index);
  const KernelEntry& rows = kernel_entry(plan->splits > 1 ? plan->split_index : plan->index);
  if (!sm80::gqa_packing_pays(p, rows, packed_rows)) return Status();
  packed.pack_gqa = true;
  // The grid-mode partials are rows of query heads (the call's own layout), sized by the call; the work list's are
  // the packed tiles' (its shape is the view's).
  if (packed.splits > 1 && !packed.work_list) packed.scratch_bytes = sm80::forward_split_layout(p, packed.splits).total_bytes;
  *plan = packed;
  return Status();
}

// Split: the partials in `scratch` or a stream-ordered allocation from the library's pool (capturable), the split
// kernel, the merge.
Status run_forward_kernel(const AttentionParams& call, const ForwardKernelPlan& plan, void* scratch) {
  AttentionParams p = call;
  p.pack_gqa = plan.pack_gqa ? 1 : 0;  // the kernels' grid and rows; the merge reads the call's rows either way
  if (plan.splits <= 1) return generated::kKernelLaunch[plan.index].forward(p, p.stream);
  const auto stream = static_cast<cudaStream_t>(p.stream);
  void* owned = nullptr;
  if (scratch == nullptr) {
    FA_RETURN_IF_ERROR(scratch_alloc(p.device_id, size_t(plan.scratch_bytes), stream, &owned));
    scratch = owned;
  }
  const ForwardSplitLaunchFn split_kernel = generated::kKernelLaunch[plan.split_index].forward_split;
  const Status launched = [&]() -> Status {
    char* const base = static_cast<char*>(scratch);
    if (plan.work_list) {  // the plan kernel, the split kernel over its list (out and lse, or partials), the merge
      const sm80::ForwardWorkLayout layout = sm80::forward_work_layout(p, plan.work);
      sm80::ForwardSplitWork work;
      work.items = reinterpret_cast<sm80::SplitWorkItem*>(base);
      work.merges = reinterpret_cast<int32_t*>(base + layout.items_bytes);
      work.o_partial = reinterpret_cast<float*>(base + layout.items_bytes + layout.merges_bytes);
      work.lse_partial = reinterpret_cast<float*>(base + layout.items_bytes + layout.merges_bytes + layout.o_bytes);
      work.max_items = plan.work.max_items;
      FA_RETURN_IF_ERROR(sm80::launch_forward_split_plan(p, plan.work, work, p.stream));
      FA_RETURN_IF_ERROR(split_kernel(p, plan.splits, work, nullptr, p.stream));
      return sm80::launch_forward_combine_work(p, plan.work, work, p.stream);
    }
    const sm80::ForwardSplitLayout layout = sm80::forward_split_layout(p, plan.splits);
    AttentionParams partial = p;  // the split kernel writes the partials where out and lse were
    partial.out = base;
    partial.lse = reinterpret_cast<float*>(base + layout.o_bytes);
    FA_RETURN_IF_ERROR(split_kernel(partial, plan.splits, sm80::ForwardSplitWork{}, nullptr, p.stream));
    return sm80::launch_forward_combine(p, plan.splits, static_cast<const float*>(partial.out), partial.lse, p.stream);
  }();
  const cudaError_t freed = owned != nullptr ? scratch_free(owned, stream) : cudaSuccess;
  FA_RETURN_IF_ERROR(launched);
  FA_CUDA_RETURN_IF_ERROR(freed);
  return Status();
}

Status forward(const AttentionParams& p) {
  FA_RETURN_IF_ERROR(check_forward_support(p));
  DeviceGuard guard(p.device_id);
  FA_CUDA_RETURN_IF_ERROR(guard.status());
  // The plan depends on the shapes only (not on routed_seqlen_q below): made once, used if the forward kernel runs.
  ForwardKernelPlan plan;
  FA_RETURN_IF_ERROR(plan_forward_kernel(p, 0, &plan));
  const KernelEntry& entry = kernel_entry(plan.index);
  // A paged varlen call (a serving step): its short sequences (decode tokens) run in the decode kernels, which pack a
  // K/V head's query heads and split long key ranges (decode_plan.hpp, short_sequence_max_q); the forward kernel
  // then skips them. Only the paged instantiation knows to skip (forward_kernel.cuh). A call that is not varlen, of
  // at most T query rows (a decode step over a dense or paged cache), runs in the decode kernels whole, in place.
  // The routed sequences and the forward kernel's read and write disjoint rows: where the fork is on (the default:
  // common/stream_fork.hpp), the decode half goes on a side stream beside the forward kernel, joined before the call
  // returns.
  decode::ShortSequences routed;
  StreamFork fork;
  if (entry.paged_kv || !p.is_varlen()) FA_RETURN_IF_ERROR(decode::run_short_sequences(p, &routed, &fork));
  const bool all_routed = routed.max_q > 0 && routed.max_q >= p.seqlen_q;  // max_seqlen_q bounds every sequence
  int splits = 1;
  int64_t split_bytes = 0;
  const char* kernel_name = entry.name;
  Status ran;
  if (!all_routed) {
    AttentionParams rest = p;
    rest.routed_seqlen_q = uint8_t(routed.max_q);
    ran = run_forward_kernel(rest, plan, nullptr);
    splits = plan.splits;
    split_bytes = plan.scratch_bytes;
    if (plan.splits > 1) kernel_name = kernel_entry(plan.split_index).name;
  }
  const Status joined = fork.join();  // (also on an error: the routed half's scratch is freed after it, in stream order)
  const cudaError_t freed = routed.scratch != nullptr ? scratch_free(routed.scratch, static_cast<cudaStream_t>(p.stream))
                                                      : cudaSuccess;
  FA_RETURN_IF_ERROR(ran);
  FA_RETURN_IF_ERROR(joined);
  FA_CUDA_RETURN_IF_ERROR(freed);
  if (p.stats != nullptr) {
    // Both scratches are held at once only between the decode call's launch and its free: stream order frees the
    // first before the second is taken, so the peak is the larger.
    p.stats->scratch_bytes_peak = routed.scratch_bytes > split_bytes ? routed.scratch_bytes : split_bytes;
    p.stats->num_splits = splits > 1 ? splits : (routed.max_q > 0 ? routed.num_splits : 1);  // forward's, else decode's
    std::string forward_part = kernel_name;
    if (splits > 1) forward_part += " splits=" + std::to_string(splits) + " + combine";
    if (plan.pack_gqa) forward_part += " gqa-packed";
    if (routed.max_q == 0)
      std::snprintf(p.stats->kernel, sizeof(p.stats->kernel), "cuda %s", forward_part.c_str());
    else if (routed.in_place)
      std::snprintf(p.stats->kernel, sizeof(p.stats->kernel), "cuda %s splits=%d (every sequence %d row%s, in place)",
                    routed.kernel, routed.num_splits, p.seqlen_q, p.seqlen_q == 1 ? "" : "s");
    else  // the routed sequences' bound in few words: fa_stats.kernel holds 127 characters, and the longest such report
          // (a packed split forward at D = 256 beside the decode kernels) takes 126
      std::snprintf(p.stats->kernel, sizeof(p.stats->kernel), "cuda %s%s%s splits=%d (<= %d rows)",
                    all_routed ? "" : forward_part.c_str(), all_routed ? "" : " + ", routed.kernel, routed.num_splits,
                    routed.max_q);
  }
  return Status();
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
