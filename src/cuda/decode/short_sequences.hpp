// The small kernels around the decode call that computes a paged varlen forward's short sequences (decode_plan.hpp,
// short_sequence_max_q; kvcache.cpp, run_short_sequences): the routed sequences' key counts before it (the call then
// reads and writes their rows in the forward's own tensors), or, the tests' other way, a gather of their rows into
// padded copies before it and a scatter back after it; for a step whose sequences all have the same count of rows (the
// call in place), the key counts. Plain C++ declarations (`stream` is a cudaStream_t); the kernels are in
// short_sequences.cu.
#pragma once

#include <cstdint>

#include "core/params.hpp"
#include "core/status.hpp"

namespace flashattn::cuda::decode {

// The decode call's buffers (device memory). Sequence b is routed when it has n in [1, max_q] query rows.
struct ShortSequenceRows {
  int max_q = 0;                     // T
  int32_t* cache_seqlens = nullptr;  // [B]: a routed sequence's key count, else 0 (its decode rows see no key)
  void* q = nullptr;                 // [B, T, Hq, D]: a routed sequence's queries at rows T - n .. T - 1, zeros above
  void* out = nullptr;               // [B, T, Hq, Dv]: the decode call's out
  float* lse = nullptr;              // [B, Hq, T]: the decode call's lse, or null (the forward has no lse)
};

// Fills cache_seqlens and q from the forward's cu_seqlens_q / cu_seqlens_k / seqused_k and q (`p`).
Status launch_gather_short_sequences(const AttentionParams& p, const ShortSequenceRows& rows, void* stream);
// key_counts[b] = sequence b's key count (from cu_seqlens_k / seqused_k), one thread per sequence. routed_max_q = 0:
// for every b (the uniform route without seqused_k; decode_plan.hpp, uniform_short_sequences). routed_max_q >= 1: 0 for
// a sequence of more than routed_max_q (or no) query rows, i.e. the cache_seqlens that the gather writes, for the
// decode call over the forward's own rows (decode_plan.hpp, varlen_rows_call), which needs no copies.
Status launch_key_counts(const AttentionParams& p, int routed_max_q, int32_t* key_counts, void* stream);
// Copies the routed sequences' rows of the decode call's out (and lse) into the forward's out (and lse); writes nothing
// else.
Status launch_scatter_short_sequences(const AttentionParams& p, const ShortSequenceRows& rows, void* stream);

// fa_kvcache's forward route (decode_plan.hpp, wants_forward_route): key_counts[b] = cache_seqlens[b] + S_new and
// bad[b] = 0 for a sequence whose cache_seqlens entry is in [0, capacity - S_new]; else key_counts[b] = 0 (the forward
// reads none of its keys) and bad[b] = 1.
Status launch_route_key_counts(const KvcacheParams& p, int32_t* key_counts, int32_t* bad, void* stream);
// Then NaN in every out and lse row of the sequences with bad[b] set (the decode kernels' rule for a bad length).
Status launch_route_poison_bad(const KvcacheParams& p, const int32_t* bad, void* stream);

}  // namespace flashattn::cuda::decode
