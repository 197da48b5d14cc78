// The small kernels around the decode attention kernel (src/cuda/decode/decode_aux.cu), one launch function
// each. Plain C++ declarations (`stream` is a cudaStream_t); the dtype comes from args.p.dtype.
#pragma once

#include <cstdint>

#include "core/status.hpp"
#include "cuda/decode/decode_work.hpp"

namespace flashattn::cuda::decode {

// Append: k_new / v_new rows written at cache rows cache_seqlens[b] + t (paged or not), k_new rotated at that
// position when rotary is on. Runs before the attention kernel on the same stream (fa_kvcache), or alone
// (fa_kvcache_append, with cu_seqlens_new: sequence b's rows are k_new rows cu_seqlens_new[b] + t, t < n_b <=
// args.p.seqlen_new, of total_new). Sequences whose cache_seqlens, cache_leftpad or cu_seqlens_new entries are out of
// range, and rows whose block id is not a block of the cache, are not written.
Status launch_append(const DecodeArgs& args, void* stream, const int32_t* cu_seqlens_new = nullptr, int64_t total_new = 0);

// Combine: merges the per-split partials (out_s, lse_s) of every m-block that used two or more splits:
//   lse = log(sum_s exp(lse_s)),  out = sum_s exp(lse_s - lse) out_s,  in split order (deterministic).
Status launch_combine(const DecodeArgs& args, void* stream);

// The checked mode's guard (src/cuda/decode/kvcache.cpp): finds the first (sequence, block-table column) that
// is invalid: cache_seqlens[b] outside [0, capacity - S_new] or cache_leftpad[b] outside [0, cache_seqlens[b]]
// (column -1), or a block id outside [0, num_blocks) among the columns that hold keys [cache_leftpad[b],
// cache_seqlens[b] + S_new). With cu_seqlens_new (fa_kvcache_append): S_new is n_b, entries of cu_seqlens_new out of
// range are column -2, and only the columns written, rows [cache_seqlens[b], + n_b), are checked. Writes
// kGuardAllValid, or guard_key(b, column) of the smallest such pair, to *status (device memory).
constexpr unsigned long long kGuardAllValid = ~0ull;
FA_HD unsigned long long guard_key(int b, int column) {
  return (static_cast<unsigned long long>(b) << 32) | static_cast<unsigned int>(column + 1);
}
FA_HD void guard_entry(unsigned long long key, int* b, int* column) {
  *b = static_cast<int>(key >> 32);
  *column = static_cast<int>(key & 0xFFFFFFFFull) - 1;
}
Status launch_guard(const DecodeArgs& args, unsigned long long* status, void* stream, const int32_t* cu_seqlens_new = nullptr,
                    int64_t total_new = 0);

}  // namespace flashattn::cuda::decode
