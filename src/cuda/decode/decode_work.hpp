// The work partition of the CUDA KV-cache (decode) kernels: which query rows one CTA packs into the M
// dimension of its MMAs, and which key tiles each split of a sequence's key range streams. Plain C++ with
// FA_HD functions: the host planner, its unit tests (tests/cpp/test_cuda_kvcache_plan.cpp) and the three
// kernels (attention, combine, guard) all call these, so they agree on the partition by construction.
//
// Packing (GQA): the G = Hq / Hk query heads that read one K/V head, times the Sq new tokens, are the
// "packed rows" of one (sequence b, K/V head hk):  r = i * G + g  <->  query i, query head hk * G + g.
// A CTA takes kBlockM consecutive packed rows (an "m-block"), so K and V are read once per group.
//
// Splits (flash-decoding): the key tiles [first, first + tiles) that an m-block sees are cut into runs of
// per_split tiles; split s streams run s. The lengths live in device memory (cache_seqlens), so the host
// plans the most splits (num_splits) from the shapes, and every kernel derives the splits a sequence really
// uses from its length on the device: per_split = max(ceil(tiles / num_splits), min_tiles_per_split),
// used = ceil(tiles / per_split). Short sequences thus use fewer, longer splits; every used split is
// non-empty. used == 0 (no visible key) and used == 1 write the final output directly; used >= 2 write
// per-split partials that the combine kernel merges through their LSEs.
#pragma once

#include <cstdint>

#include "core/host_device.hpp"
#include "core/mask.hpp"
#include "core/params.hpp"

namespace flashattn::cuda::decode {

// ln(2): the decode kernel, its cluster merge and the combine kernel turn a log2-unit LSE (the split partials') into
// the natural-log LSE of the API.
constexpr float kLn2 = 0.6931471805599453f;

// Everything the decode kernels read, passed by value (a __grid_constant__ kernel parameter).
struct DecodeArgs {
  KvcacheParams p;          // validated by src/api/validate.cpp; p.seqlen_k is the cache capacity per sequence
  int group;                // G = Hq / Hk: query heads that share one K/V head
  int packed_rows;          // G * Sq rows per (sequence, K/V head); row r = i * G + g
  int block_m;              // packed rows per CTA (the kernel's kBlockM)
  int block_n;              // keys per K/V tile (the kernel's kBlockN)
  int m_blocks;             // ceil(packed_rows / block_m)
  int num_splits;           // the most splits of one key range (>= 1); grid.x = m_blocks * num_splits
  int min_tiles_per_split;  // a split streams at least this many key tiles (affects speed only)
  int page_shift;           // paged cache: log2(block size) when it is a power of two, else -1 (divisions)
  int paged_rows;           // 1 = paged cache whose blocks are block-size runs of rows (block stride = block size x
                            // row stride, K and V; every row index of the pool < 2^31): a key's row in the pool is
                            // id * block size + its row in the block, and its address is computed as a contiguous
                            // cache's (vLLM / FlashAttention's [num_blocks, block, Hk, D] layout). Speed only.
  int programmatic_launch;  // 1 = the kernels launch as programmatic dependents (sm_90+; set by the launcher)
  int early_tiles;          // 1 = split 0 of a contiguous 16-bit cache copies Q and its first tiles before reading
                            // cache_seqlens (decode_kernel.cuh; affects speed only)
  int prefetch_inputs;      // 1 = before its wait for the previous grids, a CTA prefetches into L2 the line of
                            // cache_seqlens[b] and (paged) the block-table lines it reads first (affects speed only)
  int speculative_tiles;    // 1 = a CTA guesses its length (and paged, its first block ids) while it waits for the previous
                            // grids, copies the guessed split's first tiles right after the wait and keeps them if the
                            // real values agree (decode_kernel.cuh; speed only); tests: 2 = guess half the length,
                            // 3 = the right length but (paged) each guessed id one block off
  int cluster_merge;        // 1 = the num_splits CTAs of one (m-block, K/V head, sequence) are a thread-block
                            // cluster (grid.x split-fastest) that merges its partials through distributed
                            // shared memory, with no combine kernel (sm_90+, <= kMaxClusterSplits; the launcher)
  float* partial_lse;       // [num_splits][B * Hq * Sq] LSE per split in log2 units (the natural-log LSE x log2(e));
                            // null when num_splits == 1
  float* partial_out;       // [num_splits][B * Hq * Sq][Dv] per-split output, already normalised
};

// The cache of sequence b holds `cached` rows before the append; the kernels accept it only in
// [0, capacity - seqlen_new] (anything else would read or write past the sequence's cache).
FA_HD bool cache_length_ok(int cached, int seqlen_new, int capacity) {
  return cached >= 0 && int64_t(cached) + seqlen_new <= int64_t(capacity);
}

// The first key of sequence b: cache_leftpad[b], 0 without padding. With it the sequence's keys are [key_floor,
// cached + seqlen_new); the kernels accept it only in [0, cached] (cache_keys_ok).
FA_HD int key_floor_of(const KvcacheParams& p, int b) { return p.cache_leftpad != nullptr ? p.cache_leftpad[b] : 0; }
FA_HD bool cache_keys_ok(int cached, int key_floor, int seqlen_new, int capacity) {
  return cache_length_ok(cached, seqlen_new, capacity) && key_floor >= 0 && key_floor <= cached;
}

// Key tiles of one split. `used` is the same for every split of the m-block.
struct SplitWork {
  int used;        // splits with work: 0 when no key is visible to the m-block's rows
  int tile_begin;  // this split's key tiles [tile_begin, tile_end), absolute tile indices; empty when split >= used
  int tile_end;
};

FA_HD SplitWork split_work(int key_begin, int key_end, int block_n, int num_splits, int min_tiles_per_split, int split) {
  SplitWork w{0, 0, 0};
  if (key_end <= key_begin) return w;
  const int first = key_begin / block_n;
  const int tiles = (key_end - 1) / block_n - first + 1;
  int per_split = (tiles + num_splits - 1) / num_splits;
  if (per_split < min_tiles_per_split) per_split = min_tiles_per_split;
  w.used = (tiles + per_split - 1) / per_split;
  if (split < w.used) {
    w.tile_begin = first + split * per_split;
    const int end = w.tile_begin + per_split;
    w.tile_end = end < first + tiles ? end : first + tiles;
  }
  return w;
}

// The packed rows of m-block `m_block` and the keys any of them sees (bottom-right aligned mask of
// core/mask.hpp with Sk = cached + seqlen_new).
struct BlockRows {
  int row_begin;   // first packed row
  int rows;        // packed rows of this m-block (< block_m in the last one)
  int query_begin; // queries [query_begin, query_end) of those rows
  int query_end;
  int key_begin;   // keys [key_begin, key_end) visible to at least one of them (may be empty)
  int key_end;
};

FA_HD BlockRows block_rows(const DecodeArgs& a, int m_block, int seqlen_k) {
  BlockRows r;
  r.row_begin = m_block * a.block_m;
  const int left = a.packed_rows - r.row_begin;
  r.rows = left < a.block_m ? left : a.block_m;
  r.query_begin = r.row_begin / a.group;
  r.query_end = (r.row_begin + r.rows - 1) / a.group + 1;
  const WindowMask mask(a.p.window_left, a.p.window_right, a.p.seqlen_q, seqlen_k);
  r.key_begin = mask.key_begin(r.query_begin);
  r.key_end = mask.key_end(r.query_end, seqlen_k);
  return r;
}

// The same with left padding (cache_leftpad): no key below key_floor (core/mask.hpp's PaddedWindowMask, whose
// key_begin is WindowMask's raised to the floor). A function of its own so that the kernels for calls without padding
// (decode_kernel.cuh, kLeftPad false) compile to the code they had before it: a floor of 0 passed through changed it.
FA_HD BlockRows padded_block_rows(const DecodeArgs& a, int m_block, int seqlen_k, int key_floor) {
  BlockRows r = block_rows(a, m_block, seqlen_k);
  if (r.key_begin < key_floor) r.key_begin = key_floor;
  return r;
}

// Index of output row (b, h, i) in the partial buffers: the layout of lse, (B, Hq, Sq).
FA_HD int64_t partial_row(const KvcacheParams& p, int b, int h, int i) {
  return (int64_t(b) * p.heads_q + h) * p.seqlen_q + i;
}

// Where sequence b's query rows are in q, out and lse. A dense call (p.cu_seqlens_q null): row i at b x the batch
// strides + i x the row strides, every row [0, Sq) the call's. Varlen rows (p.cu_seqlens_q set: the routed short
// sequences of a paged varlen forward, kvcache.cpp's run_short_sequences, read and written in the forward's own
// tensors, the batch strides unused): cu_seqlens_q is the forward's, Sq = T, and sequence b's n = cu[b + 1] - cu[b]
// queries are left-padded to the call's T rows: row i is the forward's row row0 + i, row0 = cu[b + 1] - T, and rows
// i < first = T - n are padding, neither read (zeros) nor written; a sequence with n outside [1, T] is the forward
// kernel's: first = T, no row (its CTAs leave; its key count, 0, makes the combine kernel skip it).
struct QueryRows {
  int row0 = 0;   // varlen rows: the forward's row of row 0 (< 0 where sequence 0 has padding rows)
  int first = 0;  // the first row that is the call's
};
FA_HD QueryRows varlen_query_rows(const KvcacheParams& p, int b) {
  const int end = p.cu_seqlens_q[b + 1];
  const int n = end - p.cu_seqlens_q[b];
  return QueryRows{end - p.seqlen_q, n >= 1 && n <= p.seqlen_q ? p.seqlen_q - n : p.seqlen_q};
}
// Offset (elements) of sequence b's row 0 in a tensor with these strides.
FA_HD int64_t query_rows_offset(const KvcacheParams& p, const QueryRows& rows, int b, int64_t batch_stride, int64_t row_stride) {
  return p.cu_seqlens_q != nullptr ? int64_t(rows.row0) * row_stride : b * batch_stride;
}

// The combine kernel's shape (decode_aux.cu), shared by its launcher and its CTAs; affects speed only. Each output
// item (a packed row's 4 columns) is merged by combine_lanes(num_splits) neighbouring lanes, each loading at most
// kCombineSplitsPerLane splits at once; an m-block's items are dealt to combine_chunks CTAs of kCombineThreads.
constexpr int kCombineThreads = 128;
constexpr int kCombineSplitsPerLane = 16;
FA_HD int combine_lanes(int num_splits) {  // a power of two, 1 to 32
  int lanes = 1;
  while (lanes < 32 && lanes * kCombineSplitsPerLane < num_splits) lanes *= 2;
  return lanes;
}
FA_HD int combine_chunks(const DecodeArgs& a) {
  const int64_t rows = a.packed_rows < a.block_m ? a.packed_rows : a.block_m;  // packed rows of the fullest m-block
  const int64_t items = rows * (a.p.head_dim_v / 4);
  const int64_t per_cta = kCombineThreads / combine_lanes(a.num_splits);
  return int(items > 0 ? (items + per_cta - 1) / per_cta : 1);
}

}  // namespace flashattn::cuda::decode
