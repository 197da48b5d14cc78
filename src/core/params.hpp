// The params structs that cross from the API layer to every backend (CPU and CUDA alike).
//
// src/api/validate.cpp fills them from the public fa_* structs after checking every rule, so a
// backend may trust them: shapes agree, strides are in elements, the last dimension of every
// tensor is contiguous, Hq % Hk == 0, optional pointers are null when absent.
//
// Index conventions: b = sequence (batch entry), h = query head, i = query row, j = key row.
// "Row" is one token. For sequence b the query rows are i in [0, seqlen_q(b)) and key rows
// j in [0, seqlen_k(b)); the mask aligns the two to the bottom-right corner (see mask.hpp).
#pragma once

#include <cstdint>

#include "core/host_device.hpp"
#include "flashattn/flashattn.h"

namespace flashattn {

struct AttentionParams {
  fa_dtype dtype;           // of q, k, v, out (and dout, dq, dk, dv in backward): f32, f16 or bf16
  fa_device_kind device;
  int device_id;

  // ---- sizes ----
  int batch;                // B: number of sequences
  int seqlen_q;             // dense: Sq of every sequence; varlen: min(max_seqlen_q, total_q) (an upper bound)
  int seqlen_k;             // dense: Sk; varlen: min(max_seqlen_k, total_k); paged: max_blocks * page_block_size
  int heads_q;              // Hq
  int heads_k;              // Hk, Hq % Hk == 0; query head h reads key/value head h / (Hq / Hk)
  int head_dim;             // D of q and k
  int head_dim_v;           // Dv of v and out

  // ---- tensors (pointer to element 0; strides in elements) ----
  // q: dense [B, Sq, Hq, D]; varlen [total_q, Hq, D] (q_batch_stride unused, row = cu_seqlens_q[b] + i)
  const void* q;
  int64_t q_batch_stride, q_row_stride, q_head_stride;
  // k, v: dense [B, Sk, Hk, D]; varlen [total_k, Hk, D]; paged [num_blocks, page_block_size, Hk, D]
  // (when paged, *_batch_stride is the stride between blocks)
  const void* k;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  const void* v;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  // element type of k and v: `dtype`, except an FP8 KV cache of fa_kvcache (FA_FLOAT8_E4M3), whose values are
  // dequantised as code value * k_scale / v_scale (both 1 otherwise)
  fa_dtype kv_dtype;
  float k_scale, v_scale;
  // varlen: the rows of q (every sequence's; validate.cpp), else 0. In the padding before `out`: every later field keeps
  // its offset. Read by the CUDA backend's host code (decode_plan.cpp, short_sequence_max_q).
  int32_t varlen_total_q = 0;
  // out: layout of q with Dv
  void* out;
  int64_t out_batch_stride, out_row_stride, out_head_stride;
  // lse (float32, natural log), optional: dense [B, Hq, Sq]; varlen [Hq, total_q]
  // (lse_batch_stride unused for varlen, row = cu_seqlens_q[b] + i)
  float* lse;
  int64_t lse_batch_stride, lse_head_stride, lse_row_stride;

  // ---- variable length and paging (all optional, null when absent) ----
  const int32_t* cu_seqlens_q;  // [B+1] prefix sums of query lengths
  const int32_t* cu_seqlens_k;  // [B+1] prefix sums of key lengths
  const int32_t* seqused_k;     // [B] keys used of sequence b (overrides the length above)
  const int32_t* block_table;   // [B, max_blocks]: block ids of sequence b's keys, in order
  int64_t block_table_batch_stride;
  int page_block_size;          // keys per block when paged, else 0
  int num_blocks;               // blocks in the paged cache, else 0

  // ---- the attention variant ----
  float softmax_scale;      // already resolved (never 0)
  bool causal;              // true iff window_right == 0 came from `causal` (kernels may specialise)
  // CUDA, paged varlen forward: the sequences of 1 to routed_seqlen_q query rows were handed to the decode kernels
  // (src/cuda/decode/kvcache.cpp, run_short_sequences), so the forward kernel leaves their rows alone; 0: none. Set
  // by the CUDA backend only. A byte in causal's padding: every later field keeps its offset (the kernels' parameter
  // loads are unchanged).
  uint8_t routed_seqlen_q = 0;
  // CUDA forward: nonzero = the G = Hq / Hk query heads of a K/V head run packed in one grid row, G x Sq rows of query
  // tiles per K/V head (src/cuda/sm80/forward_packing.hpp). Set by the CUDA backend's plan only; in the same padding.
  uint8_t pack_gqa = 0;
  int window_left;          // -1 unbounded, else >= 0
  int window_right;         // -1 unbounded, else >= 0
  float softcap;            // 0 off
  const float* alibi_slopes;  // optional [B, Hq] or [Hq] (alibi_batch_stride 0)
  int64_t alibi_batch_stride;
  float dropout_p;          // 0 off; in [0, 1)
  uint64_t dropout_seed;
  uint64_t dropout_offset;

  // ---- execution ----
  int num_threads;          // CPU: resolved thread count (>= 1)
  void* stream;             // CUDA: cudaStream_t
  fa_stats* stats;          // optional out: scratch peak, splits, kernel name

  bool is_varlen() const { return cu_seqlens_q != nullptr; }
  bool is_paged() const { return block_table != nullptr; }
};

struct BackwardParams : AttentionParams {
  // dout: layout of out; dq/dk/dv: layouts of q/k/v
  const void* dout;
  int64_t dout_batch_stride, dout_row_stride, dout_head_stride;
  void* dq;
  int64_t dq_batch_stride, dq_row_stride, dq_head_stride;
  void* dk;
  int64_t dk_batch_stride, dk_row_stride, dk_head_stride;
  void* dv;
  int64_t dv_batch_stride, dv_row_stride, dv_head_stride;
  bool deterministic;
  void* workspace;          // null: the backend allocates what it needs itself
  int64_t workspace_bytes;
};

struct KvcacheParams : AttentionParams {
  // AttentionParams describes q/out/lse (dense) and the cache as k/v (contiguous [B, S_cache, Hk, D]
  // or paged). seqlen_k is the cache capacity per sequence (S_cache, or max_blocks * block size).
  const int32_t* cache_seqlens;  // [B] tokens in the cache before the append
  // k_new / v_new [B, seqlen_new, Hk, D / Dv], optional: written at rows cache_seqlens[b] + t
  const void* k_new;
  int64_t k_new_batch_stride, k_new_row_stride, k_new_head_stride;
  const void* v_new;
  int64_t v_new_batch_stride, v_new_row_stride, v_new_head_stride;
  int seqlen_new;                // 0 when there is no append
  // rotary embedding, optional: cos/sin [seqlen_rotary, rotary_dim / 2]
  const void* rotary_cos;
  const void* rotary_sin;
  int64_t rotary_cos_row_stride, rotary_sin_row_stride;
  int rotary_dim;                // 0 when absent; even, <= D
  int seqlen_rotary;
  bool rotary_interleaved;
  int num_splits;                // 0 = chosen by the backend (its plan), else >= 1
  bool check_indices;            // CUDA: check device index tensors before any write (syncs the stream)
  // The caller passed cache_batch_idx with a contiguous cache [cache batch, S_cache, Hk, D]: validate.cpp made it the
  // paged cache it is, blocks of S_cache rows, with block_table = cache_batch_idx as one column (sequence b's one
  // block is entry cache_batch_idx[b]). Read by the messages (an index error names cache_batch_idx) and by the CUDA
  // backend's S_cache rule (decode_plan.cpp); no kernel reads it. Sits in check_indices' padding: the fields after
  // it keep the offsets the decode kernels were tuned with.
  bool block_table_is_batch_idx;
  void* workspace;
  int64_t workspace_bytes;
  // cache_leftpad [B], optional (null: none): sequence b's keys are rows [cache_leftpad[b], cache_seqlens[b] +
  // seqlen_new) of its cache; positions (rotary, mask alignment, ALiBi) stay the rows' own. Last, so that the fields
  // above keep the offsets the decode kernels were tuned with.
  const int32_t* cache_leftpad;
};

// fa_kvcache_append: the cache and the new rows as a KvcacheParams with no queries (q, out null, seqlen_q 0; k_new /
// v_new rows addressed with batch stride 0, row cu_seqlens_new[b] + t; seqlen_new = max_seqlen_new, capped at
// total_new), and the per-sequence row counts.
struct KvcacheAppendParams {
  KvcacheParams cache;
  const int32_t* cu_seqlens_new;  // [B + 1], host or device memory as the cache
  int64_t total_new;              // rows of k_new / v_new
};

// New rows of sequence b: n_b = cu[b + 1] - cu[b], or -1 when the entries are not a valid run of k_new's rows with at
// most max_rows of them (device memory is not checked before the kernels: they write nothing for such a sequence).
FA_HD int appended_rows(const int32_t* cu_seqlens_new, int64_t total_new, int max_rows, int b) {
  const int32_t first = cu_seqlens_new[b], end = cu_seqlens_new[b + 1];
  if (first < 0 || end < first || int64_t(end) > total_new || end - first > max_rows) return -1;
  return end - first;
}

// Per-sequence extents, the one place that reads cu_seqlens / seqused_k (host or device memory,
// whichever side calls it).
struct SequenceExtent {
  int64_t q_row0;   // first query row of the sequence in q's row dimension (varlen offset)
  int64_t k_row0;   // first key row in k's row dimension (varlen offset; 0 when dense or paged)
  int seqlen_q;
  int seqlen_k;
};

FA_HD SequenceExtent sequence_extent(const AttentionParams& p, int b) {
  SequenceExtent e;
  if (p.cu_seqlens_q != nullptr) {
    e.q_row0 = p.cu_seqlens_q[b];
    e.seqlen_q = p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b];
  } else {
    e.q_row0 = 0;
    e.seqlen_q = p.seqlen_q;
  }
  if (p.cu_seqlens_k != nullptr) {
    e.k_row0 = p.cu_seqlens_k[b];
    e.seqlen_k = p.cu_seqlens_k[b + 1] - p.cu_seqlens_k[b];
  } else {
    e.k_row0 = 0;
    e.seqlen_k = p.seqlen_k;
  }
  if (p.seqused_k != nullptr) e.seqlen_k = p.seqused_k[b];
  return e;
}

// Element offset of key/value row j of sequence b, head hk (dense, varlen or paged).
FA_HD int64_t kv_offset(const AttentionParams& p, int64_t batch_stride, int64_t row_stride,
                        int64_t head_stride, int b, const SequenceExtent& e, int j, int hk) {
  if (p.block_table != nullptr) {
    const int32_t block = p.block_table[b * p.block_table_batch_stride + j / p.page_block_size];
    return block * batch_stride + (j % p.page_block_size) * row_stride + hk * head_stride;
  }
  if (p.cu_seqlens_k != nullptr) return (e.k_row0 + j) * row_stride + hk * head_stride;
  return b * batch_stride + j * row_stride + hk * head_stride;
}

// Element offset of query-layout row i of sequence b, head h (q, out, dout, dq share this shape).
FA_HD int64_t q_offset(const AttentionParams& p, int64_t batch_stride, int64_t row_stride,
                       int64_t head_stride, int b, const SequenceExtent& e, int i, int h) {
  if (p.cu_seqlens_q != nullptr) return (e.q_row0 + i) * row_stride + h * head_stride;
  return b * batch_stride + i * row_stride + h * head_stride;
}

FA_HD int64_t lse_offset(const AttentionParams& p, int b, const SequenceExtent& e, int i, int h) {
  if (p.cu_seqlens_q != nullptr) return h * p.lse_head_stride + (e.q_row0 + i) * p.lse_row_stride;
  return b * p.lse_batch_stride + h * p.lse_head_stride + i * p.lse_row_stride;
}

}  // namespace flashattn
