// The forward mainloop shared by forward() and kvcache(): one tile of query rows against a range
// of keys, with the online softmax (FlashAttention, Algorithm 1):
//   for each key tile:  S = Q K^T              (GEMM, float32, base-2 domain)
//                       m_new = max(m, rowmax(S));  P = exp2(S - m_new)
//                       l = l * exp2(m - m_new) + rowsum(P);  O = O * exp2(m - m_new)
//                       O += dropout(P) V       (GEMM)
// It leaves O unnormalised with (m, l) per row; the caller's epilogue divides by l and writes
// either the output (forward) or a partial result to merge (split-KV).
#pragma once

#include <cstdint>

#include "core/params.hpp"
#include "cpu/flash/few_rows.hpp"
#include "cpu/flash/row_ops.hpp"
#include "cpu/flash/scratch.hpp"
#include "cpu/flash/team.hpp"
#include "cpu/flash/tile_config.hpp"
#include "cpu/flash/tile_io.hpp"
#include "cpu/flash/vec_math.hpp"

namespace flashattn::cpu::flash {

// One unit of forward work: `queries` consecutive query rows of sequence b, for `heads`
// consecutive query heads of one GQA group (they read the same keys, so a decode step with a
// single query fills the tile's rows with the group's heads). Tile row r is head h0 + r / queries,
// query i0 + r % queries.
struct QueryTile {
  int b;
  int h0, heads;
  int i0, queries;
  int rows() const { return heads * queries; }
  int head_of(int r) const { return h0 + r / queries; }
  int query_of(int r) const { return i0 + r % queries; }
  // Drops the rows past the end of a sequence of seqlen_q queries (varlen tiles may be empty).
  void clip(int seqlen_q) {
    const int left = seqlen_q - i0;
    queries = left < queries ? (left > 0 ? left : 0) : queries;
  }
};

// How a problem is cut into QueryTiles (the same for every sequence; varlen and kvcache use the
// longest sequence and skip empty tiles).
struct TileGrid {
  int queries_per_tile;  // <= block_q
  int heads_per_tile;    // 1, or several heads of a group when the sequences are shorter than a tile
  int head_chunks;       // per key/value head: ceil(group / heads_per_tile)
  int query_tiles;       // ceil(seqlen_q / queries_per_tile)

  TileGrid(const AttentionParams& p, const TileConfig& cfg) {
    const int group = p.heads_q / p.heads_k;
    const int seqlen_q = p.seqlen_q > 0 ? p.seqlen_q : 1;
    queries_per_tile = seqlen_q < cfg.block_q ? seqlen_q : cfg.block_q;
    heads_per_tile = cfg.block_q / queries_per_tile;
    heads_per_tile = heads_per_tile < 1 ? 1 : (heads_per_tile > group ? group : heads_per_tile);
    head_chunks = (group + heads_per_tile - 1) / heads_per_tile;
    query_tiles = (p.seqlen_q + queries_per_tile - 1) / queries_per_tile;
  }
  int64_t tiles(const AttentionParams& p) const { return int64_t(p.batch) * p.heads_k * head_chunks * query_tiles; }
  int rows() const { return heads_per_tile * queries_per_tile; }  // the most rows of any tile

  // Tile number `index` in [0, tiles), before clipping to its sequence's length (QueryTile::clip).
  // Query tiles run last-first so that, under a causal mask, the longest tiles start first and the
  // short ones fill the end of the schedule.
  QueryTile tile(const AttentionParams& p, int64_t index) const {
    const int group = p.heads_q / p.heads_k;
    QueryTile t;
    const int q_tile = query_tiles - 1 - int(index % query_tiles);
    index /= query_tiles;
    const int chunk = int(index % head_chunks);
    index /= head_chunks;
    const int hk = int(index % p.heads_k);
    t.b = int(index / p.heads_k);
    t.h0 = hk * group + chunk * heads_per_tile;
    t.heads = group - chunk * heads_per_tile < heads_per_tile ? group - chunk * heads_per_tile : heads_per_tile;
    t.i0 = q_tile * queries_per_tile;
    t.queries = queries_per_tile;
    return t;
  }

  // After QueryTile::clip: a tile left with fewer queries than the grid's (a varlen sequence shorter than the longest,
  // e.g. a decode token beside a prefill chunk, or a sequence's last partial tile) takes more heads of its group, up
  // to rows(), so that the group's keys are read by fewer tiles (a decode token's group by one, as when the whole
  // batch decodes). The head chunks are cut anew at that width; false = this chunk's heads went to an earlier one
  // (the tile has nothing left to do).
  bool widen_heads(const AttentionParams& p, QueryTile& t) const {
    const int group = p.heads_q / p.heads_k;
    if (t.queries == 0 || t.queries >= queries_per_tile || heads_per_tile >= group) return true;
    const int per_tile = rows() / t.queries < group ? rows() / t.queries : group;
    const int first = (t.h0 % group) / heads_per_tile * per_tile;  // chunk index x the new width
    if (first >= group) return false;
    t.h0 = t.h0 - t.h0 % group + first;
    t.heads = group - first < per_tile ? group - first : per_tile;
    return true;
  }
};

// One thread's forward tiles (float32, row-major, leading dimensions padded).
struct ForwardTiles {
  int ld_q, ld_k, ld_v, ld_s, ld_o;
  float* q;        // [block_q, ld_q]  the query tile, converted (and rotated, for kvcache)
  float* k;        // [block_k, ld_k]  a key tile that cannot be read in place
  float* v;        // [block_k, ld_v]  a value tile that cannot be read in place
  float* s;        // [block_q, ld_s]  scores, then probabilities in place
  float* o_acc;    // [block_q, ld_o]  unnormalised output
  float* row_max;  // [block_q]        running max of s2 (base 2)
  float* row_sum;  // [block_q]        running sum of exp2(s2 - row_max)
  uint8_t* keep;   // [block_k]        dropout keep bits of one row
  const void** kv_rows;  // [2 block_k + few_rows::kMaxPrefetchRows] row pointers of a few-rows tile (few_rows.hpp)

  // Tiles for at most grid.rows() query rows (block_q, or fewer for short sequences and decode).
  static ForwardTiles carve(Slab& slab, const TileGrid& grid, const TileConfig& cfg, int head_dim, int head_dim_v) {
    ForwardTiles w;
    const int64_t rows = grid.rows();
    w.ld_q = w.ld_k = padded_ld(head_dim);
    w.ld_v = w.ld_o = padded_ld(head_dim_v);
    w.ld_s = padded_ld(cfg.block_k);
    w.q = slab.take<float>(rows * w.ld_q);
    w.k = slab.take<float>(int64_t(cfg.block_k) * w.ld_k);
    w.v = slab.take<float>(int64_t(cfg.block_k) * w.ld_v);
    w.s = slab.take<float>(rows * w.ld_s);
    w.o_acc = slab.take<float>(rows * w.ld_o);
    w.row_max = slab.take<float>(rows);
    w.row_sum = slab.take<float>(rows);
    w.keep = slab.take<uint8_t>(cfg.block_k);
    w.kv_rows = slab.take<const void*>(2 * int64_t(cfg.block_k) + few_rows::kMaxPrefetchRows);
    return w;
  }
};

// Where the keys of one (sequence, key/value head) live: dense, varlen or paged, via kv_offset.
struct KeySource {
  const AttentionParams& p;
  int b, hk;
  const SequenceExtent& e;
  int64_t k_offset(int j) const { return kv_offset(p, p.k_batch_stride, p.k_row_stride, p.k_head_stride, b, e, j, hk); }
  int64_t v_offset(int j) const { return kv_offset(p, p.v_batch_stride, p.v_row_stride, p.v_head_stride, b, e, j, hk); }

  // rows[r] = the first element of key j0 + r's row in `tensor` (p.k or p.v), r in [0, n): the
  // offsets of kv_offset, with one block-table read per page instead of a division per row.
  void row_pointers(const void* tensor, int64_t batch_stride, int64_t row_stride, int64_t head_stride, int j0, int n,
                    const void** rows) const {
    if (n <= 0) return;
    const char* base = static_cast<const char*>(tensor);
    const int64_t element = dtype_size(p.kv_dtype);
    if (p.block_table == nullptr) {  // dense or varlen: evenly spaced rows
      const int64_t first = kv_offset(p, batch_stride, row_stride, head_stride, b, e, j0, hk);
      for (int r = 0; r < n; ++r) rows[r] = base + (first + r * row_stride) * element;
      return;
    }
    const int32_t* table = p.block_table + int64_t(b) * p.block_table_batch_stride;
    int slot = j0 / p.page_block_size, row_in_block = j0 % p.page_block_size;
    for (int r = 0; r < n; ++slot, row_in_block = 0) {
      const int64_t block_offset = int64_t(table[slot]) * batch_stride + hk * head_stride;
      for (; row_in_block < p.page_block_size && r < n; ++row_in_block, ++r)
        rows[r] = base + (block_offset + row_in_block * row_stride) * element;
    }
  }
};

// Calls fn with the few_rows element type of `t`.
template <typename Fn>
void with_few_rows_type(fa_dtype t, const Fn& fn) {
#if FLASHATTN_CPU_FEW_ROWS
  if (t == FA_BFLOAT16) return fn(few_rows::BFloat16Row{});
  if (t == FA_FLOAT16) return fn(few_rows::Float16Row{});
  if (t == FA_FLOAT8_E4M3) return fn(few_rows::E4m3Row{});
  fn(few_rows::Float32Row{});
#endif
}

// Runs the online softmax of tile t (queries already in w.q) over keys [key_lo, key_hi) of a
// sequence with lengths (e.seqlen_q, e.seqlen_k). Leaves w.o_acc, w.row_max, w.row_sum.
inline void attend_keys(const AttentionParams& p, const QueryTile& t, const SequenceExtent& e, int key_lo, int key_hi,
                        const TileConfig& cfg, const ForwardTiles& w) {
  const int rows = t.rows();
  const int head_dim = p.head_dim, head_dim_v = p.head_dim_v;
  for (int r = 0; r < rows; ++r) {
    fill(w.o_acc + int64_t(r) * w.ld_o, head_dim_v, 0.f);
    w.row_max[r] = kNegInf;
    w.row_sum[r] = 0.f;
  }
  const KeySource keys{p, t.b, t.h0 / (p.heads_q / p.heads_k), e};
  const Dropout dropout(p);
  // The variant differs between heads only by the ALiBi slope.
  const RowVariant first_head(p, t.b, t.h0, e.seqlen_q, e.seqlen_k);
  // A tile of few rows (decode) takes the few_rows.hpp kernels instead of load_rows + BLAS.
  const bool few_rows_tile = few_rows::applies(rows, p.kv_dtype);
  // An FP8 cache: tiles of up to 4 rows read its codes in place, so its scales go elsewhere: k_scale into the
  // scores' factor (alpha q . (k_scale k) = (alpha k_scale) q . k), v_scale into P once the softmax has its sums
  // (sum_j p_j (v_scale v_j) = sum_j (v_scale p_j) v_j; P is not read again). Larger tiles dequantise the rows
  // (code value * scale) into float32 scratch first.
  const bool fp8_cache = p.kv_dtype == FA_FLOAT8_E4M3;
  const bool fp8_in_place = few_rows_tile && fp8_cache && few_rows::fp8_in_place(rows);
  const bool fp8_scratch = few_rows_tile && fp8_cache && !fp8_in_place;
  const fa_dtype row_type = fp8_scratch ? FA_FLOAT32 : p.kv_dtype;  // what the few-rows kernels read
  const float score_alpha = fp8_in_place ? first_head.gemm_alpha * p.k_scale : first_head.gemm_alpha;
  const float p_factor = fp8_in_place ? p.v_scale : 1.f;

  // Key tiles on the grid of multiples of block_k (split-KV boundaries fall on it too).
  for (int tile_start = key_lo / cfg.block_k * cfg.block_k; tile_start < key_hi; tile_start += cfg.block_k) {
    const int j0 = tile_start > key_lo ? tile_start : key_lo;
    const int j1 = tile_start + cfg.block_k < key_hi ? tile_start + cfg.block_k : key_hi;
    const int n = j1 - j0;
    FloatRows k_tile{}, v_tile{};
    few_rows::RowStream stream{w.kv_rows, n, 0, 0, 0, 0};
    if (few_rows_tile) {
      // The rows in the order they are read: this tile's K rows, its V rows, then the next tile's
      // first K rows (prefetched only).
      keys.row_pointers(p.k, p.k_batch_stride, p.k_row_stride, p.k_head_stride, j0, n, stream.rows);
      keys.row_pointers(p.v, p.v_batch_stride, p.v_row_stride, p.v_head_stride, j0, n, stream.rows + n);
      stream.k_row_bytes = int(head_dim * dtype_size(p.kv_dtype));
      stream.v_row_bytes = int(head_dim_v * dtype_size(p.kv_dtype));
      stream.ahead = few_rows::prefetch_rows_for(stream.k_row_bytes > stream.v_row_bytes ? stream.k_row_bytes : stream.v_row_bytes);
      stream.next = key_hi - j1 < stream.ahead ? key_hi - j1 : stream.ahead;
      keys.row_pointers(p.k, p.k_batch_stride, p.k_row_stride, p.k_head_stride, j1, stream.next, stream.rows + 2 * n);
      if (fp8_scratch) {
        // Each row dequantised once, read with the same prefetch; the kernels then read the float32
        // rows and prefetch nothing.
        for (int r = 0; r < 2 * n; ++r) {
          stream.prefetch_ahead_of(r, r + 1);
          const bool is_k = r < n;
          float* row = is_k ? w.k + int64_t(r) * w.ld_k : w.v + int64_t(r - n) * w.ld_v;
          load_row(stream.rows[r], 0, FA_FLOAT8_E4M3, is_k ? head_dim : head_dim_v, row, is_k ? p.k_scale : p.v_scale);
          stream.rows[r] = row;
        }
        stream.ahead = 0;
      }
    } else {
      // (an FP8 KV cache is dequantised here: code value * k_scale / v_scale)
      k_tile = load_rows(p.k, p.kv_dtype, n, head_dim, [&](int r) { return keys.k_offset(j0 + r); }, w.k, w.ld_k, p.k_scale);
      v_tile = load_rows(p.v, p.kv_dtype, n, head_dim_v, [&](int r) { return keys.v_offset(j0 + r); }, w.v, w.ld_v, p.v_scale);
    }

    // S = alpha * Q K^T
    if (few_rows_tile)
      with_few_rows_type(row_type, [&](auto row) {
        few_rows::scores<decltype(row)>(rows, head_dim, score_alpha, w.q, w.ld_q, stream, w.s, w.ld_s);
      });
    else
      gemm_abt(rows, n, head_dim, first_head.gemm_alpha, w.q, w.ld_q, k_tile.data, k_tile.ld, 0.f, w.s, w.ld_s);

    const bool tile_masked = !first_head.mask.tile_fully_visible(t.i0, t.i0 + t.queries, j0, j1);
    for (int r = 0; r < rows; ++r) {
      const int i = t.query_of(r), h = t.head_of(r);
      float* s_row = w.s + int64_t(r) * w.ld_s;
      if (t.heads == 1) {
        first_head.apply(s_row, n, i, j0, tile_masked);
      } else {
        RowVariant(p, t.b, h, e.seqlen_q, e.seqlen_k).apply(s_row, n, i, j0, tile_masked);
      }
      const float m_old = w.row_max[r];
      const float m_tile = row_max(s_row, n);
      const float m_new = max_propagating_nan(m_tile, m_old);  // a NaN max sticks to the row
      if (m_new == kNegInf) {  // no visible key yet: P = 0 (and never exp2(-inf - -inf) = NaN)
        fill(s_row, n, 0.f);
        continue;
      }
      const float row_sum = exp2_shifted_inplace(s_row, n, m_new);
      if (m_new > m_old) {
        // Rescale what was accumulated under the old max; m_old = -inf gives exactly 0.
        const float correction = exp2_fast(m_old - m_new);
        w.row_sum[r] *= correction;
        scale_inplace(w.o_acc + int64_t(r) * w.ld_o, head_dim_v, correction);
      }
      w.row_sum[r] += row_sum;  // the softmax denominator uses the undropped P
      w.row_max[r] = m_new;
      if (dropout.enabled) {
        dropout.keep_row(uint32_t(t.b * p.heads_q + h), uint32_t(i), j0, n, w.keep);
        for (int j = 0; j < n; ++j) s_row[j] = w.keep[j] ? s_row[j] : 0.f;  // 1 / (1 - p) in the epilogue
      }
      if (p_factor != 1.f) scale_inplace(s_row, n, p_factor);  // an FP8 cache's v_scale (above)
    }

    // O += P V
    if (few_rows_tile)
      with_few_rows_type(row_type, [&](auto row) {
        few_rows::accumulate_pv<decltype(row)>(rows, head_dim_v, w.s, w.ld_s, stream, w.o_acc, w.ld_o);
      });
    else
      gemm_ab(rows, head_dim_v, n, 1.f, w.s, w.ld_s, v_tile.data, v_tile.ld, 1.f, w.o_acc, w.ld_o);
  }
}

// Epilogue of row r: the factor that normalises o_acc (1 / l, times 1 / (1 - p) under dropout) and
// the row's natural-log LSE. A row that saw no key gets factor 0 (O = 0) and LSE = -inf.
struct RowResult {
  float factor;
  float lse;
};
inline RowResult finish_row(const ForwardTiles& w, int r, float keep_scale) {
  const float l = w.row_sum[r];
  if (std::isnan(l)) return RowResult{l, l};  // a NaN input reached this row: out and lse are NaN
  if (!(l > 0.f)) return RowResult{0.f, kNegInf};
  // lse = ln(sum_j e^{s_j}) = m2 * ln2 + ln(l), with m2 the base-2 max
  return RowResult{keep_scale / l, w.row_max[r] * kLn2 + std::log(l)};
}

}  // namespace flashattn::cpu::flash
