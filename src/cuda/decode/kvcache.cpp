// fa_plan_kvcache / fa_kvcache on the CUDA backend: the CUDA rules, the kernel choice (the kKvcache rows of
// the one generated table, through dispatch.cpp's choose_kernel), the split plan, the workspace, the
// optional checked mode, then the generated launcher (append -> attention -> combine on the caller's stream).
#include "cuda/decode/kvcache.hpp"

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdio>

#include "cuda/common/check.hpp"
#include "cuda/common/device_guard.hpp"
#include "cuda/common/scratch_pool.hpp"
#include "cuda/common/stream_fork.hpp"
#include "cuda/decode/decode_aux.hpp"
#include "cuda/decode/decode_plan.hpp"
#include "cuda/decode/short_sequences.hpp"
#include "cuda/device_info.hpp"
#include "cuda/dispatch.hpp"
#include "cuda/forward_run.hpp"
#include "cuda/generated/kernel_table.hpp"

namespace flashattn::cuda::decode {
namespace {

// What the planner needs to know about the device (device_info.hpp caches the attributes per device).
Status decode_device(int device, DecodeDevice* out) {
  DeviceAttributes a;
  FA_RETURN_IF_ERROR(device_attributes(device, &a));
  *out = DecodeDevice{a.device, a.sm_major, a.sm_minor, a.sm_count, a.smem_per_block_optin, a.smem_per_sm};
  return Status();
}

// Tests: the routed short sequences through padded copies (gather, decode call, scatter) instead of the decode call
// over the forward's own rows (run_short_sequences). Process-wide.
std::atomic<bool> g_routed_copies{false};

struct Selection {
  int index = -1;  // row of the generated kernel table
  DecodePlan plan;
};

// Everything decided on the host: rules, kernel, plan. No device memory is touched.
Status select(const KvcacheParams& p, Selection* s) {
  FA_RETURN_IF_ERROR(check_kvcache_support(p));
  DecodeDevice device;
  FA_RETURN_IF_ERROR(decode_device(p.device_id, &device));
  const DeviceLimits limits{device.device, device.sm_major, device.sm_minor, device.smem_per_block_optin};
  FA_RETURN_IF_ERROR(choose_kernel(KernelKind::kKvcache, p, limits, &s->index));
  // Short contiguous caches at many waves take the bucket's many_waves row where it is compiled (decode_plan.hpp).
  if (wants_many_waves_tile(p, kernel_entry(s->index).block_m, device)) {
    const int alternative = decode_alternative(s->index, DecodeRole::kManyWaves, limits);
    if (alternative >= 0) s->index = alternative;
  }
  FA_RETURN_IF_ERROR(make_decode_plan(p, kernel_entry(s->index), device, &s->plan));
  // Contiguous caches take the bucket's long_contiguous row where it is compiled (decode_plan.hpp): in the lower part
  // of the one wave at kOneWaveFourSplits splits, at 1.5-4 CTAs per SM at the general row's split count; else (or
  // without that row) the general row's plan stands. (The two rules never hold together: the first needs the general
  // plan's 1 split at under 0.75 CTAs per SM, the second >= 1.5 CTAs per SM.)
  const int long_tile_splits = wants_one_wave_long_tile(p, s->plan, device)     ? kOneWaveFourSplits
                               : wants_long_contiguous_tile(p, s->plan, device) ? s->plan.num_splits
                                                                                : 0;
  if (long_tile_splits > 0) {
    const int alternative = decode_alternative(s->index, DecodeRole::kLongContiguous, limits);
    if (alternative >= 0) {
      KvcacheParams planned = p;
      planned.num_splits = long_tile_splits;
      s->index = alternative;
      return make_decode_plan(planned, kernel_entry(s->index), device, &s->plan);
    }
  }
  return Status();
}

// The checked mode: the guard kernel finds the first bad (sequence, column), the host waits for it and
// names the entry. Runs before any other kernel of the call. cu_seqlens_new: fa_kvcache_append's (else null).
Status check_indices(const DecodeArgs& args, cudaStream_t stream, const int32_t* cu_seqlens_new = nullptr, int64_t total_new = 0) {
  const KvcacheParams& p = args.p;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  FA_CUDA_RETURN_IF_ERROR(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone)
    return error(FA_ERROR_UNSUPPORTED,
                 "check_indices: checking the index tensors (cache_seqlens, cache_leftpad, block_table or cache_batch_idx) "
                 "synchronises the stream, which a CUDA graph capture does not allow; set check_indices = 0 while capturing");
  unsigned long long* status_device = nullptr;
  FA_CUDA_RETURN_IF_ERROR(cudaMalloc(&status_device, sizeof(unsigned long long)));
  unsigned long long status = kGuardAllValid;
  Status launched = [&]() -> Status {
    FA_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(status_device, 0xFF, sizeof(status), stream));  // kGuardAllValid
    FA_RETURN_IF_ERROR(launch_guard(args, status_device, stream, cu_seqlens_new, total_new));
    FA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(&status, status_device, sizeof(status), cudaMemcpyDeviceToHost, stream));
    FA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    return Status();
  }();
  cudaFree(status_device);
  FA_RETURN_IF_ERROR(launched);
  if (status == kGuardAllValid) return Status();
  int b = 0, column = 0;
  guard_entry(status, &b, &column);
  int32_t new_entries[2] = {0, p.seqlen_new};  // fa_kvcache: S_new rows per sequence
  if (cu_seqlens_new != nullptr) {
    FA_CUDA_RETURN_IF_ERROR(cudaMemcpy(new_entries, cu_seqlens_new + b, sizeof(new_entries), cudaMemcpyDeviceToHost));
    if (column == -2 && b == 0 && new_entries[0] != 0)  // (found by RandomCalls.AppendOnTheCudaBackend, 2026-12-06)
      return error(FA_ERROR_INVALID_ARGUMENT,
                   "cu_seqlens_new: must start at 0, got %d; checked on the device (check_indices), nothing was written",
                   new_entries[0]);
    if (column == -2)
      return error(FA_ERROR_INVALID_ARGUMENT,
                   "cu_seqlens_new: entries %d and %d = %d, %d must be a run of k_new's %lld rows (0 <= first <= end <= "
                   "%lld) of at most max_seqlen_new = %d rows; checked on the device (check_indices), nothing was written",
                   b, b + 1, new_entries[0], new_entries[1], (long long)total_new, (long long)total_new, p.seqlen_new);
  }
  const int new_rows = new_entries[1] - new_entries[0];
  if (column < 0) {
    int32_t cached = 0;
    FA_CUDA_RETURN_IF_ERROR(cudaMemcpy(&cached, p.cache_seqlens + b, sizeof(cached), cudaMemcpyDeviceToHost));
    int32_t key_floor = 0;
    if (p.cache_leftpad != nullptr)
      FA_CUDA_RETURN_IF_ERROR(cudaMemcpy(&key_floor, p.cache_leftpad + b, sizeof(key_floor), cudaMemcpyDeviceToHost));
    if (cache_length_ok(cached, new_rows, p.seqlen_k))  // then the padding is what is wrong
      return error(FA_ERROR_INVALID_ARGUMENT,
                   "cache_leftpad: entry %d = %d must be in [0, cache_seqlens[%d] = %d]; checked on the device "
                   "(check_indices), nothing was written",
                   b, key_floor, b, cached);
    if (cu_seqlens_new != nullptr)
      return error(FA_ERROR_INVALID_ARGUMENT,
                   "cache_seqlens: entry %d = %d plus its %d new rows must be in [0, %d] (the cache capacity); checked on "
                   "the device (check_indices), nothing was written",
                   b, cached, new_rows, p.seqlen_k);
    return error(FA_ERROR_INVALID_ARGUMENT,
                 "cache_seqlens: entry %d = %d plus S_new = %d must be in [0, %d] (the cache capacity); checked on the "
                 "device (check_indices), nothing was written",
                 b, cached, p.seqlen_new, p.seqlen_k);
  }
  int32_t id = 0;
  FA_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(&id, p.block_table + b * p.block_table_batch_stride + column, sizeof(id), cudaMemcpyDeviceToHost));
  if (p.block_table_is_batch_idx)  // the caller's cache_batch_idx, as a one-column table (validate.cpp)
    return error(FA_ERROR_INVALID_ARGUMENT,
                 "cache_batch_idx: entry %d = %d is not a batch entry of k_cache in [0, %d); checked on the device "
                 "(check_indices), nothing was written",
                 b, id, p.num_blocks);
  return error(FA_ERROR_INVALID_ARGUMENT,
               "block_table: entry (%d, %d) = %d is not a block id in [0, %d); checked on the device (check_indices), "
               "nothing was written",
               b, column, id, p.num_blocks);
}

// The forward route (decode_plan.hpp, wants_forward_route): the forward's params over the cache (q / out / lse dense,
// K / V the contiguous or paged cache of capacity p.seqlen_k, the key counts as seqused_k), its kernel plan (p.num_splits
// > 0: that many splits), and its workspace: key counts and bad flags (B int32 each, 256-byte aligned), then the split
// partials, from the caller's pointer aligned up to 256 bytes (as make_decode_args aligns the decode partials).
struct ForwardRoute {
  AttentionParams params;
  ForwardKernelPlan plan;
  int64_t counts_bytes = 0;
  int64_t workspace_bytes = 0;
};
Status plan_forward_route(const KvcacheParams& p, ForwardRoute* r) {
  FA_RETURN_IF_ERROR(check_kvcache_support(p));
  r->params = static_cast<const AttentionParams&>(p);
  r->params.seqused_k = nullptr;  // set at run time: the key counts in the workspace
  r->params.stats = nullptr;
  FA_RETURN_IF_ERROR(plan_forward_kernel(r->params, p.num_splits, &r->plan));
  r->counts_bytes = (int64_t(p.batch) * 4 + 255) / 256 * 256;
  r->workspace_bytes = 256 + 2 * r->counts_bytes + r->plan.scratch_bytes;  // + 256: the caller's pointer aligned up
  return Status();
}

Status run_forward_route(const KvcacheParams& p) {
  ForwardRoute r;
  FA_RETURN_IF_ERROR(plan_forward_route(p, &r));
  if (p.workspace != nullptr && p.workspace_bytes < r.workspace_bytes)
    return error(FA_ERROR_INVALID_ARGUMENT,
                 "workspace: %lld bytes is less than the %lld bytes fa_plan_kvcache reports for num_splits = %d",
                 (long long)p.workspace_bytes, (long long)r.workspace_bytes, r.plan.splits);
  DeviceGuard guard(p.device_id);
  FA_CUDA_RETURN_IF_ERROR(guard.status());
  const auto stream = static_cast<cudaStream_t>(p.stream);
  DecodePlan append_plan{};
  append_plan.num_splits = 1;  // no decode attention: the args carry the cache addressing (page_shift) only
  const DecodeArgs args = make_decode_args(p, append_plan, nullptr);
  if (p.check_indices) FA_RETURN_IF_ERROR(check_indices(args, stream));
  void* owned = nullptr;
  void* workspace = p.workspace;
  if (workspace == nullptr) {  // the library's pool, as the decode path's partials
    FA_RETURN_IF_ERROR(scratch_alloc(p.device_id, size_t(r.workspace_bytes), stream, &owned));
    workspace = owned;
  }
  const auto address = reinterpret_cast<uintptr_t>(workspace);
  char* base = static_cast<char*>(workspace) + (256 - address % 256) % 256;  // any caller pointer: aligned up
  int32_t* counts = reinterpret_cast<int32_t*>(base);
  int32_t* bad = reinterpret_cast<int32_t*>(base + r.counts_bytes);
  r.params.seqused_k = counts;
  const Status launched = [&]() -> Status {
    if (p.k_new != nullptr) FA_RETURN_IF_ERROR(launch_append(args, stream));  // before anyone reads the cache
    FA_RETURN_IF_ERROR(launch_route_key_counts(p, counts, bad, stream));
    FA_RETURN_IF_ERROR(run_forward_kernel(r.params, r.plan, r.plan.scratch_bytes > 0 ? base + 2 * r.counts_bytes : nullptr));
    return launch_route_poison_bad(p, bad, stream);
  }();
  const cudaError_t freed = owned != nullptr ? scratch_free(owned, stream) : cudaSuccess;
  FA_RETURN_IF_ERROR(launched);
  FA_CUDA_RETURN_IF_ERROR(freed);
  if (p.stats != nullptr) {
    p.stats->scratch_bytes_peak = owned != nullptr ? r.workspace_bytes : 0;
    p.stats->num_splits = r.plan.splits;
    const KernelEntry& e = kernel_entry(r.plan.splits > 1 ? r.plan.split_index : r.plan.index);
    const char* packed = r.plan.pack_gqa ? " gqa-packed" : "";
    if (r.plan.splits > 1)
      std::snprintf(p.stats->kernel, sizeof(p.stats->kernel), "cuda %s splits=%d + combine%s (fa_kvcache, forward route)",
                    e.name, r.plan.splits, packed);
    else
      std::snprintf(p.stats->kernel, sizeof(p.stats->kernel), "cuda %s%s (fa_kvcache, forward route)", e.name, packed);
  }
  return Status();
}

}  // namespace

Status plan_kvcache(const KvcacheParams& p, fa_kvcache_plan* plan) {
  if (wants_forward_route(p)) {
    ForwardRoute r;
    FA_RETURN_IF_ERROR(plan_forward_route(p, &r));
    plan->num_splits = r.plan.splits;
    plan->workspace_bytes = r.workspace_bytes;
    return Status();
  }
  Selection s;
  FA_RETURN_IF_ERROR(select(p, &s));
  plan->num_splits = s.plan.num_splits;
  plan->workspace_bytes = s.plan.workspace_bytes;
  return Status();
}

Status run_kvcache(const KvcacheParams& p) {
  if (wants_forward_route(p)) return run_forward_route(p);
  Selection s;
  FA_RETURN_IF_ERROR(select(p, &s));
  const KernelEntry& entry = kernel_entry(s.index);
  const KvcacheLaunchFn launch = generated::kKernelLaunch[s.index].kvcache;
  if (launch == nullptr) return error(FA_ERROR_INTERNAL, "kernel table row %s has no kvcache launcher", entry.name);
  if (p.workspace != nullptr && p.workspace_bytes < s.plan.workspace_bytes)
    return error(FA_ERROR_INVALID_ARGUMENT,
                 "workspace: %lld bytes is less than the %lld bytes fa_plan_kvcache reports for num_splits = %d",
                 (long long)p.workspace_bytes, (long long)s.plan.workspace_bytes, s.plan.num_splits);
  DeviceGuard guard(p.device_id);
  FA_CUDA_RETURN_IF_ERROR(guard.status());
  const auto stream = static_cast<cudaStream_t>(p.stream);
  if (p.check_indices) FA_RETURN_IF_ERROR(check_indices(make_decode_args(p, s.plan, nullptr), stream));

  // Without a caller workspace the partials live in a stream-ordered allocation from the library's scratch pool
  // (capturable as graph nodes; kept mapped between calls: scratch_pool.hpp); with the planned workspace the call
  // allocates nothing.
  KvcacheParams run = p;
  run.num_splits = s.plan.num_splits;
  void* owned = nullptr;
  if (s.plan.workspace_bytes > 0 && p.workspace == nullptr) {
    FA_RETURN_IF_ERROR(scratch_alloc(p.device_id, size_t(s.plan.workspace_bytes), stream, &owned));
    run.workspace = owned;
    run.workspace_bytes = s.plan.workspace_bytes;
  }
  const Status launched = launch(run, stream);
  if (owned != nullptr) {
    const cudaError_t freed = scratch_free(owned, stream);
    FA_RETURN_IF_ERROR(launched);
    FA_CUDA_RETURN_IF_ERROR(freed);
  }
  FA_RETURN_IF_ERROR(launched);
  if (p.stats != nullptr) {
    p.stats->scratch_bytes_peak = owned != nullptr ? s.plan.workspace_bytes : 0;
    p.stats->num_splits = s.plan.num_splits;
    std::snprintf(p.stats->kernel, sizeof(p.stats->kernel), "cuda %s splits=%d", entry.name, s.plan.num_splits);
  }
  return Status();
}

Status run_kvcache_append(const KvcacheAppendParams& a) {
  const KvcacheParams& p = a.cache;
  FA_RETURN_IF_ERROR(check_kvcache_append_support(p, a.total_new));
  DeviceGuard guard(p.device_id);
  FA_CUDA_RETURN_IF_ERROR(guard.status());
  const auto stream = static_cast<cudaStream_t>(p.stream);
  DecodePlan plan{};
  plan.num_splits = 1;  // no attention: the args carry the cache addressing (page_shift) only
  const DecodeArgs args = make_decode_args(p, plan, nullptr);
  if (p.check_indices) FA_RETURN_IF_ERROR(check_indices(args, stream, a.cu_seqlens_new, a.total_new));
  FA_RETURN_IF_ERROR(launch_append(args, stream, a.cu_seqlens_new, a.total_new));
  if (p.stats != nullptr) {
    p.stats->scratch_bytes_peak = 0;
    p.stats->num_splits = 1;
    std::snprintf(p.stats->kernel, sizeof(p.stats->kernel), "cuda kvcache_append");
  }
  return Status();
}

// Every sequence S rows (uniform_short_sequences): one decode call in place over the forward's q / out / lse, the key
// counts seqused_k or copied into scratch by one small kernel. Sets routed->max_q = 0 when the decode kernels refuse
// the call (the caller then tries the gather route).
Status run_uniform_sequences(const AttentionParams& p, int max_q, ShortSequences* routed) {
  const bool copy_counts = p.seqused_k == nullptr;
  Selection s;
  const Status selected = select(uniform_sequence_call(p, copy_counts ? nullptr : p.seqused_k), &s);
  if (selected.code() == FA_ERROR_UNSUPPORTED || selected.code() == FA_ERROR_NOT_COMPILED) return Status();
  FA_RETURN_IF_ERROR(selected);
  const KvcacheLaunchFn launch = generated::kKernelLaunch[s.index].kvcache;
  if (launch == nullptr) return error(FA_ERROR_INTERNAL, "kernel table row %s has no kvcache launcher", kernel_entry(s.index).name);
  const int64_t counts_bytes = copy_counts ? (int64_t(p.batch) * 4 + 255) / 256 * 256 : 0;
  const int64_t total = counts_bytes + s.plan.workspace_bytes;
  const auto stream = static_cast<cudaStream_t>(p.stream);
  void* scratch = nullptr;
  if (total > 0) FA_RETURN_IF_ERROR(scratch_alloc(p.device_id, size_t(total), stream, &scratch));
  char* base = static_cast<char*>(scratch);
  int32_t* counts = copy_counts ? reinterpret_cast<int32_t*>(base) : nullptr;
  KvcacheParams kv = uniform_sequence_call(p, copy_counts ? counts : p.seqused_k);
  kv.num_splits = s.plan.num_splits;
  kv.workspace = s.plan.workspace_bytes > 0 ? base + counts_bytes : nullptr;
  kv.workspace_bytes = s.plan.workspace_bytes;
  const Status launched = [&]() -> Status {
    if (copy_counts) FA_RETURN_IF_ERROR(launch_key_counts(p, 0, counts, stream));
    return launch(kv, stream);
  }();
  const cudaError_t freed = scratch != nullptr ? scratch_free(scratch, stream) : cudaSuccess;
  FA_RETURN_IF_ERROR(launched);
  FA_CUDA_RETURN_IF_ERROR(freed);
  routed->max_q = max_q;
  routed->in_place = true;
  routed->scratch_bytes = total;
  routed->num_splits = s.plan.num_splits;
  routed->kernel = kernel_entry(s.index).name;
  return Status();
}

void set_routed_copies_for_tests(bool copies) { g_routed_copies.store(copies, std::memory_order_relaxed); }

Status run_short_sequences(const AttentionParams& p, ShortSequences* routed, StreamFork* fork) {
  *routed = ShortSequences{};
  const int max_q = short_sequence_max_q(p);
  if (max_q == 0) return Status();
  if (uniform_short_sequences(p, max_q)) {
    FA_RETURN_IF_ERROR(run_uniform_sequences(p, max_q, routed));
    if (routed->max_q > 0) return Status();
  }
  if (!p.is_varlen()) return Status();  // the decode kernels refused it: the forward kernel computes every row
  // A call that may fork (both halves run): a bad FLASHATTN_STREAM_FORK fails it here, before anything is allocated.
  if (fork != nullptr && max_q < p.seqlen_q) FA_RETURN_IF_ERROR(stream_fork_setting());
  // Two ways to the same values: the decode call over the forward's own rows (varlen_rows_call: the key counts, the
  // call), or over padded copies (short_sequence_call: the gather, the call, the scatter; the tests' other way,
  // set_routed_copies_for_tests). The plan depends on the shapes only: planned with the forward's q / out standing
  // in for the padded buffers (both 16-byte aligned, as the padded rows are). The split count is that of the
  // sequences that can be short (routed_sequences_bound); the call's own selection at that count then sizes the
  // workspace for all B.
  const bool copies = g_routed_copies.load(std::memory_order_relaxed);
  auto call_of = [&](void* q, void* out, float* lse, const int32_t* counts) {
    return copies ? short_sequence_call(p, max_q, q, out, lse, counts) : varlen_rows_call(p, max_q, counts);
  };
  Selection s;
  KvcacheParams planned = call_of(const_cast<void*>(p.q), p.out, p.lse, nullptr);
  const int full_batch = planned.batch;
  planned.batch = routed_sequences_bound(p, max_q);
  Status selected = select(planned, &s);
  if (selected.ok() && planned.batch != full_batch) {
    planned.batch = full_batch;
    planned.num_splits = s.plan.num_splits;
    selected = select(planned, &s);
  }
  if (selected.code() == FA_ERROR_UNSUPPORTED || selected.code() == FA_ERROR_NOT_COMPILED) return Status();
  FA_RETURN_IF_ERROR(selected);
  const KvcacheLaunchFn launch = generated::kKernelLaunch[s.index].kvcache;
  if (launch == nullptr) return error(FA_ERROR_INTERNAL, "kernel table row %s has no kvcache launcher", kernel_entry(s.index).name);

  // Scratch: key counts, (copies: padded q and out (16-bit: the CUDA rules), lse,) then the decode call's split
  // partials (aligned by make_decode_args).
  auto aligned = [](int64_t bytes) { return (bytes + 255) / 256 * 256; };
  const int64_t rows = copies ? int64_t(p.batch) * max_q * p.heads_q : 0;
  const int64_t seqlens_bytes = aligned(int64_t(p.batch) * 4);
  const int64_t q_bytes = aligned(rows * p.head_dim * 2);
  const int64_t out_bytes = aligned(rows * p.head_dim_v * 2);
  const int64_t lse_bytes = p.lse != nullptr ? aligned(rows * 4) : 0;
  const int64_t total = seqlens_bytes + q_bytes + out_bytes + lse_bytes + s.plan.workspace_bytes;
  const auto stream = static_cast<cudaStream_t>(p.stream);
  void* scratch = nullptr;  // the library's pool, not the default one: no mapping per call (scratch_pool.hpp)
  FA_RETURN_IF_ERROR(scratch_alloc(p.device_id, size_t(total), stream, &scratch));
  char* base = static_cast<char*>(scratch);
  ShortSequenceRows buffers;
  buffers.max_q = max_q;
  buffers.cache_seqlens = reinterpret_cast<int32_t*>(base);
  if (copies) {
    buffers.q = base + seqlens_bytes;
    buffers.out = base + seqlens_bytes + q_bytes;
    buffers.lse = p.lse != nullptr ? reinterpret_cast<float*>(base + seqlens_bytes + q_bytes + out_bytes) : nullptr;
  }
  KvcacheParams kv = call_of(buffers.q, buffers.out, buffers.lse, buffers.cache_seqlens);
  kv.num_splits = s.plan.num_splits;
  kv.workspace = s.plan.workspace_bytes > 0 ? base + seqlens_bytes + q_bytes + out_bytes + lse_bytes : nullptr;
  kv.workspace_bytes = s.plan.workspace_bytes;
  // With a fork (the forward kernel runs too), the launches go on the side stream, after the allocation above on the
  // forward's stream; the caller joins after enqueueing the forward kernel, then frees (routed->scratch).
  const Status forked = fork != nullptr && max_q < p.seqlen_q ? fork->fork(p.device_id, stream) : Status();
  const cudaStream_t launch_stream = fork != nullptr && fork->forked() ? fork->stream() : stream;
  kv.stream = launch_stream;
  const Status launched = [&]() -> Status {
    FA_RETURN_IF_ERROR(forked);
    if (!copies) {
      FA_RETURN_IF_ERROR(launch_key_counts(p, max_q, buffers.cache_seqlens, launch_stream));
      return launch(kv, launch_stream);
    }
    FA_RETURN_IF_ERROR(launch_gather_short_sequences(p, buffers, launch_stream));
    FA_RETURN_IF_ERROR(launch(kv, launch_stream));
    return launch_scatter_short_sequences(p, buffers, launch_stream);
  }();
  if (!launched.ok() || fork == nullptr || !fork->forked()) {  // the free in stream order after the launches
    const Status joined = fork != nullptr ? fork->join() : Status();
    const cudaError_t freed = scratch_free(scratch, stream);
    FA_RETURN_IF_ERROR(launched);
    FA_RETURN_IF_ERROR(joined);
    FA_CUDA_RETURN_IF_ERROR(freed);
  } else {
    routed->scratch = scratch;  // freed by the caller after its join
  }
  routed->max_q = max_q;
  routed->scratch_bytes = total;
  routed->num_splits = s.plan.num_splits;
  routed->kernel = kernel_entry(s.index).name;
  return Status();
}

}  // namespace flashattn::cuda::decode
