// CPU flash KV-cache attention (decode and chunked prefill):
//   1. append k_new / v_new at rows cache_seqlens[b] + t of the cache (contiguous or paged), with
//      the rotary embedding applied to k_new at its absolute position;
//   2. attend q (rotated the same way) over keys [cache_leftpad[b] (0 without), cache_seqlens[b] + seqlen_new),
//      with the forward mainloop of attend_tile.hpp (the padding rows are never read). A decode step's single
//      query per head fills a tile's rows with the query heads of one GQA group, which share their keys.
//   3. split-KV: when there are fewer query tiles than threads, each tile's key range is cut into
//      num_splits chunks on the key-tile grid; every (tile, split) writes a normalised partial
//      output and its LSE, and a final pass merges the splits through their LSEs:
//        lse = log(sum_s exp(lse_s)),  out = sum_s exp(lse_s - lse) * out_s
//      in a fixed split order (the result does not depend on the thread count).
// kvcache_plan() makes every choice from the shapes; kvcache() then allocates nothing when the
// caller passes a workspace of plan.workspace_bytes.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "cpu/flash/attend_tile.hpp"
#include "cpu/flash/flash.hpp"

namespace flashattn::cpu::flash {
namespace {

// Split-KV heuristic. Affects speed only: every split count gives the same result up to float
// rounding of the merge.
constexpr int kItemsPerThread = 2;       // (tile, split) items per thread, for a balanced end
constexpr int kMinKeysPerSplit = 256;    // below this a split costs more than it saves
constexpr int kMaxSplits = 64;

struct Plan {
  TileConfig cfg;
  TileGrid grid;
  int64_t tiles;    // query tiles (before splitting)
  int splits;
  int64_t items;    // tiles * splits
  int threads;
  int64_t partial_rows;  // B * Hq * Sq partial rows per split
  int64_t partial_out_bytes, partial_lse_bytes, per_thread_bytes, total_bytes;

  Plan(const KvcacheParams& p, int requested_splits)
      : cfg(forward_tiles(p.head_dim, p.head_dim_v, p.window_left >= 0 || p.window_right >= 0)),
        grid(p, cfg),
        tiles(grid.tiles(p)) {
    splits = requested_splits > 0 ? requested_splits : choose_splits(p);
    items = tiles * splits;
    threads = team_size(p.num_threads, items);
    partial_rows = int64_t(p.batch) * p.heads_q * p.seqlen_q;
    Slab out_slab, lse_slab, tiles_slab;
    out_slab.take<float>(splits > 1 ? partial_rows * splits * p.head_dim_v : 0);
    lse_slab.take<float>(splits > 1 ? partial_rows * splits : 0);
    ForwardTiles::carve(tiles_slab, grid, cfg, p.head_dim, p.head_dim_v);
    partial_out_bytes = out_slab.bytes();
    partial_lse_bytes = lse_slab.bytes();
    per_thread_bytes = tiles_slab.bytes();
    // + one alignment unit: a caller's workspace may start anywhere; the tiles start aligned.
    total_bytes = tiles > 0 ? partial_out_bytes + partial_lse_bytes + per_thread_bytes * threads + kScratchAlignment : 0;
  }

  // Enough (tile, split) items for every thread, but no split shorter than kMinKeysPerSplit keys.
  int choose_splits(const KvcacheParams& p) const {
    if (tiles == 0 || tiles >= p.num_threads) return 1;
    int max_keys = 0;  // cache_seqlens and cache_leftpad are host memory on the CPU backend
    for (int b = 0; b < p.batch; ++b) {
      // the sequence's keys: none in its left padding (validated to lie within its cache)
      const int keys = p.cache_seqlens[b] + p.seqlen_new - (p.cache_leftpad != nullptr ? p.cache_leftpad[b] : 0);
      max_keys = keys > max_keys ? keys : max_keys;
    }
    int64_t chosen = (int64_t(kItemsPerThread) * p.num_threads + tiles - 1) / tiles;
    const int64_t by_keys = max_keys / kMinKeysPerSplit;
    chosen = chosen < by_keys ? chosen : by_keys;
    chosen = chosen < kMaxSplits ? chosen : kMaxSplits;
    return chosen < 1 ? 1 : int(chosen);
  }
};

// x' = rotary(x) at `position`, in double like the reference (the appended keys then hold the very
// same bits): GPT-NeoX halves (d, d + half) or interleaved pairs (2d, 2d + 1).
void rotate(const KvcacheParams& p, int position, double* x) {
  const int half = p.rotary_dim / 2;
  for (int d = 0; d < half; ++d) {
    const double c = load_as_float(p.rotary_cos, position * p.rotary_cos_row_stride + d, p.dtype);
    const double s = load_as_float(p.rotary_sin, position * p.rotary_sin_row_stride + d, p.dtype);
    const int a = p.rotary_interleaved ? 2 * d : d;
    const int b = p.rotary_interleaved ? 2 * d + 1 : d + half;
    const double x0 = x[a], x1 = x[b];
    x[a] = x0 * c - x1 * s;
    x[b] = x0 * s + x1 * c;
  }
}

// Keys of sequence b once the new rows are in: cache_seqlens[b] + seqlen_new.
SequenceExtent extent_after_append(const KvcacheParams& p, int b) {
  return SequenceExtent{0, 0, p.seqlen_q, p.cache_seqlens[b] + p.seqlen_new};
}

// Step 1 for one (b, t, hk): the new key (rotated) and value at row cache_seqlens[b] + t. Its source is row t of
// sequence b of k_new / v_new: (B, S_new, Hk, D), or fa_kvcache_append's (total_new, Hk, D) at row first_row + t
// (batch strides 0 there). Only the block table is read of `e` (paged), or nothing (contiguous).
void append_row(const KvcacheParams& p, int b, int t, int hk, double* row, int64_t first_row = 0) {
  const int position = p.cache_seqlens[b] + t;
  const SequenceExtent e = extent_after_append(p, b);
  const int64_t k_src = b * p.k_new_batch_stride + (first_row + t) * p.k_new_row_stride + hk * p.k_new_head_stride;
  for (int c = 0; c < p.head_dim; ++c) row[c] = load_as_float(p.k_new, k_src + c, p.dtype);
  if (p.rotary_dim > 0) rotate(p, position, row);
  const int64_t k_dst = kv_offset(p, p.k_batch_stride, p.k_row_stride, p.k_head_stride, b, e, position, hk);
  const int64_t v_src = b * p.v_new_batch_stride + (first_row + t) * p.v_new_row_stride + hk * p.v_new_head_stride;
  const int64_t v_dst = kv_offset(p, p.v_batch_stride, p.v_row_stride, p.v_head_stride, b, e, position, hk);
  if (p.kv_dtype == FA_FLOAT8_E4M3) {
    // FP8 cache: e4m3(float(x) / scale), the division in float32 (core/fp8.hpp rounds and saturates), as the
    // reference and the CUDA append kernel quantise.
    void* k_cache = const_cast<void*>(p.k);
    void* v_cache = const_cast<void*>(p.v);
    for (int c = 0; c < p.head_dim; ++c) store_from_float(k_cache, k_dst + c, FA_FLOAT8_E4M3, float(row[c]) / p.k_scale);
    for (int c = 0; c < p.head_dim_v; ++c)
      store_from_float(v_cache, v_dst + c, FA_FLOAT8_E4M3, load_as_float(p.v_new, v_src + c, p.dtype) / p.v_scale);
    return;
  }
  for (int c = 0; c < p.head_dim; ++c) store_from_float(const_cast<void*>(p.k), k_dst + c, p.dtype, float(row[c]));
  // v is copied element for element: the same dtype on both sides, no rounding.
  const size_t element = size_t(dtype_size(p.dtype));
  std::memcpy(static_cast<char*>(const_cast<void*>(p.v)) + v_dst * element, static_cast<const char*>(p.v_new) + v_src * element,
              size_t(p.head_dim_v) * element);
}

// Loads tile t's queries into w.q, rotated at their positions: cached + i when causal or windowed
// (each query is a new token), else all at `cached` (flash_attn's convention for non-causal decode).
void load_queries(const KvcacheParams& p, const QueryTile& t, const SequenceExtent& e, const ForwardTiles& w, double* row) {
  const bool per_token_positions = p.window_left >= 0 || p.window_right >= 0;
  const int cached = p.cache_seqlens[t.b];
  for (int r = 0; r < t.rows(); ++r) {
    const int i = t.query_of(r);
    const int64_t q_row = q_offset(p, p.q_batch_stride, p.q_row_stride, p.q_head_stride, t.b, e, i, t.head_of(r));
    float* dst = w.q + int64_t(r) * w.ld_q;
    if (p.rotary_dim == 0) {
      load_row(p.q, q_row, p.dtype, p.head_dim, dst);
      continue;
    }
    for (int c = 0; c < p.head_dim; ++c) row[c] = load_as_float(p.q, q_row + c, p.dtype);
    rotate(p, per_token_positions ? cached + i : cached, row);
    for (int c = 0; c < p.head_dim; ++c) dst[c] = float(row[c]);
  }
}

// Key range [lo, hi) of split `split` of tile t: the tile's visible keys, cut on the key-tile grid
// into `splits` runs of whole tiles (empty when the split has none).
void split_range(const Plan& plan, const QueryTile& t, const SequenceExtent& e, const PaddedWindowMask& mask, int split,
                 int* lo, int* hi) {
  const int visible_lo = mask.key_begin(t.i0), visible_hi = mask.key_end(t.i0 + t.queries, e.seqlen_k);
  *lo = *hi = visible_lo;
  if (visible_lo >= visible_hi) return;
  const int block = plan.cfg.block_k;
  const int first_tile = visible_lo / block, key_tiles = (visible_hi - 1) / block - first_tile + 1;
  const int per_split = (key_tiles + plan.splits - 1) / plan.splits;
  const int64_t begin = int64_t(first_tile + split * per_split) * block, end = begin + int64_t(per_split) * block;
  *lo = int(begin > visible_lo ? (begin < visible_hi ? begin : visible_hi) : visible_lo);
  *hi = int(end < visible_hi ? end : visible_hi);
  if (*hi < *lo) *hi = *lo;
}

}  // namespace

Status kvcache_plan(const KvcacheParams& p, fa_kvcache_plan* out_plan) {
  const Plan plan(p, p.num_splits);
  out_plan->num_splits = plan.splits;
  out_plan->workspace_bytes = plan.total_bytes;
  return Status();
}

Status kvcache(const KvcacheParams& p) {
  const Plan plan(p, p.num_splits);
  const TileConfig cfg = plan.cfg;
  if (p.workspace != nullptr && p.workspace_bytes < plan.total_bytes)
    return error(FA_ERROR_INVALID_ARGUMENT,
                 "workspace: %lld bytes is less than the %lld bytes fa_plan_kvcache reports for num_splits = %d with "
                 "%d threads",
                 (long long)p.workspace_bytes, (long long)plan.total_bytes, plan.splits, plan.threads);
  ScratchLedger ledger;
  const ScratchBlock owned(ledger, p.workspace != nullptr ? 0 : plan.total_bytes);
  char* const scratch = plan.total_bytes == 0
                            ? nullptr
                            : align_pointer(p.workspace != nullptr ? static_cast<char*>(p.workspace) : owned.data());
  float* const partial_out = reinterpret_cast<float*>(scratch);  // [split][b][h][i][Dv]
  float* const partial_lse = reinterpret_cast<float*>(scratch + plan.partial_out_bytes);  // [split][b][h][i]
  char* const tiles_base = scratch + plan.partial_out_bytes + plan.partial_lse_bytes;
  const int64_t append_items = int64_t(p.batch) * p.seqlen_new * p.heads_k;
  const Dropout dropout(p);
  // A double row for rotary (D <= 1024, validate.cpp's bound): on the thread's stack, not the heap.
  constexpr int kMaxRotaryRow = 1024;

#pragma omp parallel num_threads(plan.threads)
  {
    blas_single_threaded_here();
    double rotary_row[kMaxRotaryRow];

    // ---- 1. append ----
#pragma omp for schedule(static)
    for (int64_t item = 0; item < append_items; ++item) {
      const int hk = int(item % p.heads_k), t = int(item / p.heads_k % p.seqlen_new), b = int(item / p.heads_k / p.seqlen_new);
      append_row(p, b, t, hk, rotary_row);
    }
    // (implicit barrier: the cache holds the new rows before anyone reads it)

    // ---- 2. attend, per (query tile, split) ----
    Slab slab(scratch == nullptr ? nullptr : tiles_base + plan.per_thread_bytes * omp_get_thread_num());
    const ForwardTiles w = ForwardTiles::carve(slab, plan.grid, cfg, p.head_dim, p.head_dim_v);
    if (plan.tiles > 0) {
#pragma omp for schedule(dynamic, 1)
      for (int64_t item = 0; item < plan.items; ++item) {
        const int split = int(item % plan.splits);
        QueryTile t = plan.grid.tile(p, item / plan.splits);
        const SequenceExtent e = extent_after_append(p, t.b);
        t.clip(e.seqlen_q);
        if (t.queries == 0) continue;
        load_queries(p, t, e, w, rotary_row);
        const PaddedWindowMask mask(p.window_left, p.window_right, e.seqlen_q, e.seqlen_k,
                                    p.cache_leftpad != nullptr ? p.cache_leftpad[t.b] : 0);
        int key_lo, key_hi;
        split_range(plan, t, e, mask, split, &key_lo, &key_hi);
        attend_keys(p, t, e, key_lo, key_hi, cfg, w);
        for (int r = 0; r < t.rows(); ++r) {
          const int i = t.query_of(r), h = t.head_of(r);
          const RowResult result = finish_row(w, r, dropout.keep_scale);
          const float* o_row = w.o_acc + int64_t(r) * w.ld_o;
          if (plan.splits == 1) {
            const int64_t out_row = q_offset(p, p.out_batch_stride, p.out_row_stride, p.out_head_stride, t.b, e, i, h);
            if (result.factor == 0.f) store_zero_row(p.out, out_row, p.dtype, p.head_dim_v);  // no visible key: O = 0
            else store_row(o_row, result.factor, p.out, out_row, p.dtype, p.head_dim_v);
            if (p.lse != nullptr) p.lse[lse_offset(p, t.b, e, i, h)] = result.lse;
          } else {
            const int64_t index = ((int64_t(split) * p.batch + t.b) * p.heads_q + h) * p.seqlen_q + i;
            float* dst = partial_out + index * p.head_dim_v;
            for (int c = 0; c < p.head_dim_v; ++c) dst[c] = result.factor == 0.f ? 0.f : o_row[c] * result.factor;
            partial_lse[index] = result.lse;
          }
        }
      }
    }

    // ---- 3. merge the splits (fixed order) ----
    if (plan.splits > 1) {
#pragma omp for schedule(static)
      for (int64_t row = 0; row < plan.partial_rows; ++row) {
        const int i = int(row % p.seqlen_q), h = int(row / p.seqlen_q % p.heads_q), b = int(row / p.seqlen_q / p.heads_q);
        float lse_max = kNegInf;
        for (int s = 0; s < plan.splits; ++s) {
          const float lse = partial_lse[s * plan.partial_rows + row];
          lse_max = max_propagating_nan(lse, lse_max);
        }
        const SequenceExtent e = extent_after_append(p, b);
        const int64_t out_row = q_offset(p, p.out_batch_stride, p.out_row_stride, p.out_head_stride, b, e, i, h);
        if (lse_max == kNegInf) {  // no split saw a key
          store_zero_row(p.out, out_row, p.dtype, p.head_dim_v);
          if (p.lse != nullptr) p.lse[lse_offset(p, b, e, i, h)] = kNegInf;
          continue;
        }
        // out = sum_s w_s out_s / sum_s w_s with w_s = exp(lse_s - lse_max) <= 1 (no overflow)
        float* merged = w.o_acc;  // the thread's tiles are free now
        fill(merged, p.head_dim_v, 0.f);
        float weight_sum = 0.f;
        for (int s = 0; s < plan.splits; ++s) {
          const float lse = partial_lse[s * plan.partial_rows + row];
          if (lse == kNegInf) continue;
          const float weight = std::exp(lse - lse_max);
          weight_sum += weight;
          const float* part = partial_out + (s * plan.partial_rows + row) * p.head_dim_v;
          for (int c = 0; c < p.head_dim_v; ++c) merged[c] += weight * part[c];
        }
        store_row(merged, 1.f / weight_sum, p.out, out_row, p.dtype, p.head_dim_v);
        if (p.lse != nullptr) p.lse[lse_offset(p, b, e, i, h)] = lse_max + std::log(weight_sum);
      }
    }
  }

  report_stats(p, ledger, plan.splits, "cpu_flash kvcache Br=%d Bc=%d splits=%d threads=%d %s", cfg.block_q, cfg.block_k,
               plan.splits, plan.threads, few_rows::applies(plan.grid.rows(), p.kv_dtype) ? "few-rows" : "blas");
  return Status();
}

Status kvcache_append(const KvcacheAppendParams& params) {
  const KvcacheParams& p = params.cache;
  // One item per (new row, K/V head): the work is the rows there are, whatever max_seqlen_new says. The host checked
  // every entry (validate.cpp: cu_seqlens_new and cache_seqlens are host memory on the CPU backends), so
  // cu_seqlens_new is sorted and a row's sequence is the last b with cu_seqlens_new[b] <= row.
  const int32_t* cu = params.cu_seqlens_new;
  const int64_t items = params.total_new * p.heads_k;
  const int threads = team_size(p.num_threads, items);
  constexpr int kMaxRotaryRow = 1024;  // append_row's double row (D <= 1024, validate.cpp's bound)
#pragma omp parallel num_threads(threads)
  {
    double row[kMaxRotaryRow];
#pragma omp for schedule(static)
    for (int64_t item = 0; item < items; ++item) {
      const int hk = int(item % p.heads_k);
      const int64_t r = item / p.heads_k;
      const int b = int(std::upper_bound(cu, cu + p.batch + 1, r) - cu) - 1;
      if (b >= p.batch) continue;  // rows past cu_seqlens_new[B] belong to no sequence
      append_row(p, b, int(r - cu[b]), hk, row, cu[b]);
    }
  }
  if (p.stats != nullptr) {
    p.stats->scratch_bytes_peak = 0;
    p.stats->num_splits = 1;
    std::snprintf(p.stats->kernel, sizeof(p.stats->kernel), "cpu kvcache_append threads=%d", threads);
  }
  return Status();
}

}  // namespace flashattn::cpu::flash
