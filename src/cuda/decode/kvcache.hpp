// The CUDA KV-cache entry points (fa_plan_kvcache / fa_kvcache with backend cuda), called from
// src/cuda/backend.cpp. CUDA builds only; the host logic they use is in decode_plan.hpp (plain C++).
//
// What runs: fp16 / bf16 caches, D % 8 == 0 up to 256 (in the next compiled bucket), Dv == D, no dropout;
// float8 e4m3 caches (with fp16 / bf16 q) in the FP8 rows of the manifest, D % 16 == 0 up to 256
// (docs/FP8_KV_CACHE.md);
// Sq from 1 up (decode, speculative decoding, chunked prefill; causal within the new tokens, windows,
// softcap, ALiBi), GQA / MQA packed (one CTA reads a K/V head once for all its query heads), rotary
// (interleaved or halves) on q and k_new in the kernels. Calls of >= 48 query rows over a 16-bit cache without rotary
// or left padding run the forward kernel over the cache instead (decode_plan.hpp, wants_forward_route).
// Caches: contiguous (B, S_cache, Hk, D), any strides with 16-byte alignment, or paged with any block_size >= 1:
// power-of-two sizes (1, 16, 32, 64, 128, 256, ...) address rows with shifts, other sizes with divisions (correct,
// slower per row).
//
// Index checks. cache_seqlens and block_table (or cache_batch_idx, which validate.cpp makes a one-column block table)
// live in device memory, which the host cannot read without a synchronisation, so the default path checks them on
// the device, free of cost: the kernels never read or write through a block id outside [0, num_blocks) or past a
// sequence's cache, a sequence whose cache_seqlens entry is outside [0, capacity - S_new] is not appended to and
// gets NaN in out and lse, and a split that meets a bad block id makes its rows NaN (the call itself returns OK: it
// cannot know).
// The checked mode, fa_kvcache_args.check_indices (for debugging and servers that cannot trust their
// tables), runs a guard kernel first and synchronises the stream: a bad entry is then reported as
// FA_ERROR_INVALID_ARGUMENT naming the entry (the same wording as the host-side rules of validate.cpp),
// before any kernel writes anything. It cannot run inside a CUDA graph capture (that is an error).
#pragma once

#include "core/params.hpp"
#include "core/status.hpp"

namespace flashattn::cuda {
class StreamFork;  // common/stream_fork.hpp
}  // namespace flashattn::cuda

namespace flashattn::cuda::decode {

Status plan_kvcache(const KvcacheParams& params, fa_kvcache_plan* plan);
Status run_kvcache(const KvcacheParams& params);
// fa_kvcache_append: the append kernel alone, with n_b rows per sequence (the checked mode as above, with
// cu_seqlens_new among the entries it checks).
Status run_kvcache_append(const KvcacheAppendParams& params);

// A forward's short sequences (decode_plan.hpp, short_sequence_max_q: a paged varlen call's decode tokens, or all of a
// call that is not varlen, of at most T query rows) through the decode kernels, on the
// forward's stream: the key counts (a routed sequence's keys, 0 for the others), then the decode call (attention,
// combine) over the forward's own q / out / lse, its sequences' queries left-padded to T rows in place (decode_plan.hpp,
// varlen_rows_call; decode_work.hpp, varlen_query_rows): it reads and writes the routed sequences' rows only. The
// call's scratch (the key counts and the split partials) is a stream-ordered allocation from the library's pool
// (common/scratch_pool.hpp), freed on the stream after the call (capturable in a CUDA graph). When every sequence has
// max_seqlen_q <= T rows (a decode step), one decode call over the forward's tensors as they are (decode_plan.hpp,
// uniform_short_sequences). `routed.max_q` = 0 when nothing was routed (a call the rule or the decode kernels do not
// take: the forward kernel then computes every row).
//
// `fork` (optional; the forward kernel will run too): the key counts and the decode call go on the fork's side
// stream (common/stream_fork.hpp) when it forks, after the scratch's allocation on the forward's stream; the caller then
// enqueues the forward kernel, joins, and frees `routed.scratch` on the forward's stream. Without a fork, or where it
// does not fork, everything is on the forward's stream and the scratch is freed here (`routed.scratch` null). (The
// tests' other way, set_routed_copies_for_tests: a gather into padded copies, the call, a scatter back.)
struct ShortSequences {
  int max_q = 0;                  // the sequences of 1 to max_q query rows were computed (the forward kernel skips them)
  bool in_place = false;          // every sequence had max_seqlen_q rows: one decode call over the forward's tensors
  int64_t scratch_bytes = 0;      // the stream-ordered allocation
  void* scratch = nullptr;        // forked: the allocation, for the caller to free on the forward's stream after the join
  int num_splits = 1;             // of the decode call
  const char* kernel = nullptr;   // its table row's name
};
Status run_short_sequences(const AttentionParams& params, ShortSequences* routed, StreamFork* fork = nullptr);
// Tests: true routes the short sequences through padded copies of their rows (a gather before the decode call, a
// scatter after it) instead of the decode call over the forward's own rows (decode_plan.hpp, varlen_rows_call; the
// default). Both give the same values. Process-wide.
void set_routed_copies_for_tests(bool copies);

}  // namespace flashattn::cuda::decode
