// CPU flash backward: gradients by recomputation from the forward's LSE (FlashAttention-2,
// Algorithm 2), over one parallel region, without a stored P and without races. After
//
//   pass 0  per query row:       delta_i = dout_i . out_i  (= rowsum(P o dP), dropout included)
//
// one of two schedules (BackwardPlan::fused, from the work items and the thread count):
//
//   fused   per (b, kv head): for each key tile, each query head of the group and each query tile
//           that sees the keys: recompute P and dS, then dV += dropout(P)^T dO, dK += dS^T Q and
//           dQ += dS K into a float32 dQ of the group's rows (per thread: group x Sq x Dq floats).
//           5 GEMMs per tile pair, but only B x Hk work items.
//   three passes, when there are too few (b, kv head) items for the threads:
//     pass 1  per (b, kv head, key tile): the fused loop without dQ
//     pass 2  per (b, head, query tile):  for each key tile it sees: recompute P and dS, then
//             dQ += dS K (7 GEMMs per tile pair: S and dP are computed twice).
//
// Every gradient element is computed by one thread in a fixed order (key tiles, GQA heads and
// query tiles ascending), so for a given thread count the backward is deterministic, bit for bit,
// always; options.deterministic asks for nothing more. Thread counts that pick the same schedule
// give the same bits; the two schedules group the tiles differently and may differ in rounding.
//
// With P = exp(s - lse), Z the dropout multiplier (0 or 1 / (1 - p)) and s the transformed score:
//   dP = (dO V^T) o Z,   dS = P o (dP - delta),   dU = dS o d(transform)   (softcap: 1 - tanh^2)
//   dQ = scale * dU K,   dK = scale * dU^T Q,     dV = (P o Z)^T dO
#include <omp.h>


#include "cpu/flash/attend_tile.hpp"
#include "cpu/flash/flash.hpp"

namespace flashattn::cpu::flash {
namespace {

// One thread's backward tiles (float32, row-major, leading dimensions padded).
struct BackwardTiles {
  int ld_d, ld_dv, ld_s;
  float* q;         // [block_q, ld_d]   query tile that cannot be read in place
  float* dout;      // [block_q, ld_dv]  dO tile that cannot be read in place (pass 0: out row)
  float* k;         // [block_k, ld_d]
  float* v;         // [block_k, ld_dv]
  float* p;         // [block_q, ld_s]   scores, then P, then dropout(P)
  float* ds;        // [block_q, ld_s]   dO V^T, then dS
  float* dtanh;     // [block_q, ld_s]   softcap derivative (carved only with softcap)
  float* acc;       // [max(block_q, block_k), ld_d]  dK (pass 1) or dQ (pass 2), unscaled
  float* acc_v;     // [block_k, ld_dv]  dV
  float* dq_acc;    // fused schedule: [group][max Sq][ld_d]  dQ of one (b, kv head), unscaled
  float* lse2;      // [block_q]  lse * log2(e) of the tile's rows
  float* delta;     // [block_q]  delta of the tile's rows
  uint8_t* keep;    // [block_k]  dropout keep bits of one row

  static BackwardTiles carve(Slab& slab, const TileConfig& cfg, int head_dim, int head_dim_v, bool softcap,
                             int64_t dq_rows) {
    BackwardTiles w;
    w.ld_d = padded_ld(head_dim);
    w.ld_dv = padded_ld(head_dim_v);
    w.ld_s = padded_ld(cfg.block_k);
    const int acc_rows = cfg.block_q > cfg.block_k ? cfg.block_q : cfg.block_k;
    w.q = slab.take<float>(int64_t(cfg.block_q) * w.ld_d);
    w.dout = slab.take<float>(int64_t(cfg.block_q) * w.ld_dv);
    w.k = slab.take<float>(int64_t(cfg.block_k) * w.ld_d);
    w.v = slab.take<float>(int64_t(cfg.block_k) * w.ld_dv);
    w.p = slab.take<float>(int64_t(cfg.block_q) * w.ld_s);
    w.ds = slab.take<float>(int64_t(cfg.block_q) * w.ld_s);
    w.dtanh = softcap ? slab.take<float>(int64_t(cfg.block_q) * w.ld_s) : nullptr;
    w.acc = slab.take<float>(int64_t(acc_rows) * w.ld_d);
    w.acc_v = slab.take<float>(int64_t(cfg.block_k) * w.ld_dv);
    w.dq_acc = dq_rows > 0 ? slab.take<float>(dq_rows * w.ld_d) : nullptr;
    w.lse2 = slab.take<float>(cfg.block_q);
    w.delta = slab.take<float>(cfg.block_q);
    w.keep = slab.take<uint8_t>(cfg.block_k);
    return w;
  }
};

// Sizes of the three passes and of the scratch; the same numbers for the workspace query and the run.
struct BackwardPlan {
  TileConfig cfg;
  int64_t query_rows;       // rows of q (B * Sq dense, total_q varlen): entries of delta per head
  int64_t key_tile_items;   // pass 1: B * Hk * ceil(Sk / block_k)
  int64_t query_tile_items; // pass 2: B * Hq * ceil(Sq / block_q)
  int64_t head_items;       // fused: B * Hk
  int threads;
  bool fused;               // the fused schedule (see the top of the file)
  int64_t dq_rows;          // fused: rows of one thread's dQ accumulator, group * Sq (varlen: max Sq)
  int64_t delta_bytes, per_thread_bytes, total_bytes;

  explicit BackwardPlan(const BackwardParams& p) {
    cfg = backward_tiles(p.head_dim, p.head_dim_v);
    query_rows = p.is_varlen() ? int64_t(p.cu_seqlens_q[p.batch]) : int64_t(p.batch) * p.seqlen_q;
    key_tile_items = int64_t(p.batch) * p.heads_k * ((p.seqlen_k + cfg.block_k - 1) / cfg.block_k);
    query_tile_items = int64_t(p.batch) * p.heads_q * ((p.seqlen_q + cfg.block_q - 1) / cfg.block_q);
    head_items = int64_t(p.batch) * p.heads_k;
    const int64_t most = key_tile_items > query_tile_items ? key_tile_items : query_tile_items;
    threads = team_size(p.num_threads, most > query_rows ? most : query_rows);
    fused = fuses(head_items, threads);
    dq_rows = fused ? int64_t(p.heads_q / p.heads_k) * p.seqlen_q : 0;
    if (fused && dq_rows * padded_ld(p.head_dim) * int64_t(sizeof(float)) > kMaxFusedDqBytesPerThread) {
      fused = false;
      dq_rows = 0;
    }
    Slab delta_slab;
    delta_slab.take<float>(query_rows * p.heads_q);
    delta_bytes = delta_slab.bytes();
    Slab tiles_slab;
    BackwardTiles::carve(tiles_slab, cfg, p.head_dim, p.head_dim_v, p.softcap > 0.f, dq_rows);
    per_thread_bytes = tiles_slab.bytes();
    // + one alignment unit: a caller's workspace may start anywhere; the tiles start aligned.
    total_bytes = delta_bytes + per_thread_bytes * threads + kScratchAlignment;
  }

  // Affects speed only. The fused schedule does 5/7 of the GEMM work of the three passes but has
  // only `items` units to share among the threads, in ceil(items / threads) rounds: it is taken
  // when those rounds of 5 cost no more than the three passes' 7 spread evenly, 5 ceil(i / t) <=
  // 7 i / t (equal work per item assumed).
  static bool fuses(int64_t items, int threads) {
    const int64_t rounds = (items + threads - 1) / threads;
    return items > 0 && 5 * rounds * threads <= 7 * items;
  }
  // Memory: the fused schedule runs only with threads <= 1.4 x items (fuses()), so its dQ
  // accumulators add at most 1.4x the size of dq in float32: linear in Sq, as dq itself. Beyond this
  // accumulator per thread (group x Sq x Dq floats: 64 MiB is Sq = 128k at D = 128 for MHA) the three
  // passes run instead, whose scratch does not grow with Sq. Affects speed and scratch only.
  static constexpr int64_t kMaxFusedDqBytesPerThread = int64_t(64) << 20;
};

// Index of (sequence b, query i, head h) in the delta array: [query row][head].
inline int64_t delta_index(const BackwardParams& p, int b, const SequenceExtent& e, int i, int h) {
  const int64_t row = p.is_varlen() ? e.q_row0 + i : int64_t(b) * p.seqlen_q + i;
  return row * p.heads_q + h;
}

// Recomputes one (query tile, key tile) of head h: w.p = dropout(P) (for dV) and w.ds = dS (for dQ
// and dK, before the final factor softmax_scale). q/dout rows i0.., k/v rows j0.. are loaded, and
// w.lse2 / w.delta hold the query rows' statistics.
void score_gradients(const BackwardParams& p, const RowVariant& variant, const Dropout& dropout, uint32_t bh,
                     const FloatRows& q, const FloatRows& dout, const FloatRows& k, const FloatRows& v, int i0, int rows,
                     int j0, int n, const BackwardTiles& w) {
  // S = alpha * Q K^T, then P = exp2(s2 - lse2): the forward's probabilities, exactly normalised.
  gemm_abt(rows, n, p.head_dim, variant.gemm_alpha, q.data, q.ld, k.data, k.ld, 0.f, w.p, w.ld_s);
  const bool tile_masked = !variant.mask.tile_fully_visible(i0, i0 + rows, j0, j0 + n);
  for (int r = 0; r < rows; ++r) {
    float* p_row = w.p + int64_t(r) * w.ld_s;
    if (w.dtanh != nullptr) variant.softcap_derivative(p_row, n, w.dtanh + int64_t(r) * w.ld_s);
    variant.apply(p_row, n, i0 + r, j0, tile_masked);
    const float lse2 = w.lse2[r];
    if (lse2 == kNegInf) {  // the row saw no key: it contributes nothing
      fill(p_row, n, 0.f);
      continue;
    }
    exp2_shifted(p_row, n, lse2);
  }
  // dP = dO V^T
  gemm_abt(rows, n, p.head_dim_v, 1.f, dout.data, dout.ld, v.data, v.ld, 0.f, w.ds, w.ld_s);
  for (int r = 0; r < rows; ++r) {
    float* p_row = w.p + int64_t(r) * w.ld_s;
    float* ds_row = w.ds + int64_t(r) * w.ld_s;
    const float delta = w.delta[r];
    if (dropout.enabled) {
      dropout.keep_row(bh, uint32_t(i0 + r), j0, n, w.keep);
      for (int j = 0; j < n; ++j) {
        const float z = w.keep[j] ? dropout.keep_scale : 0.f;
        ds_row[j] = p_row[j] * (ds_row[j] * z - delta);
        p_row[j] *= z;
      }
    } else {
#pragma omp simd
      for (int j = 0; j < n; ++j) ds_row[j] = p_row[j] * (ds_row[j] - delta);
    }
    if (w.dtanh != nullptr) {
      const float* dtanh_row = w.dtanh + int64_t(r) * w.ld_s;
      for (int j = 0; j < n; ++j) ds_row[j] *= dtanh_row[j];
    }
  }
}

}  // namespace

int64_t backward_workspace_bytes(const BackwardParams& p) { return BackwardPlan(p).total_bytes; }

Status backward(const BackwardParams& p) {
  const BackwardPlan plan(p);
  const TileConfig cfg = plan.cfg;
  ScratchLedger ledger;
  if (p.workspace != nullptr && p.workspace_bytes < plan.total_bytes)
    return error(FA_ERROR_INVALID_ARGUMENT,
                 "workspace: %lld bytes is less than the %lld bytes the cpu_flash backward needs with %d threads "
                 "(see fa_backward_workspace_size)",
                 (long long)p.workspace_bytes, (long long)plan.total_bytes, plan.threads);
  const ScratchBlock owned(ledger, p.workspace != nullptr ? 0 : plan.total_bytes);
  char* const scratch = align_pointer(p.workspace != nullptr ? static_cast<char*>(p.workspace) : owned.data());
  float* const delta_all = reinterpret_cast<float*>(scratch);
  const int group = p.heads_q / p.heads_k;
  const int key_tiles = (p.seqlen_k + cfg.block_k - 1) / cfg.block_k;
  const int query_tiles = (p.seqlen_q + cfg.block_q - 1) / cfg.block_q;
  const Dropout dropout(p);
  const float scale = p.softmax_scale;

#pragma omp parallel num_threads(plan.threads)
  {
    blas_single_threaded_here();
    Slab slab(scratch + plan.delta_bytes + plan.per_thread_bytes * omp_get_thread_num());
    const BackwardTiles w = BackwardTiles::carve(slab, cfg, p.head_dim, p.head_dim_v, p.softcap > 0.f, plan.dq_rows);
    auto q_rows = [&](int b, const SequenceExtent& e, int h, int i0, int rows) {
      return load_rows(p.q, p.dtype, rows, p.head_dim,
                       [&](int r) { return q_offset(p, p.q_batch_stride, p.q_row_stride, p.q_head_stride, b, e, i0 + r, h); },
                       w.q, w.ld_d);
    };
    auto dout_rows = [&](int b, const SequenceExtent& e, int h, int i0, int rows) {
      return load_rows(p.dout, p.dtype, rows, p.head_dim_v,
                       [&](int r) { return q_offset(p, p.dout_batch_stride, p.dout_row_stride, p.dout_head_stride, b, e, i0 + r, h); },
                       w.dout, w.ld_dv);
    };
    // lse (base 2) and delta of query rows i0.. of head h, into w.lse2 / w.delta.
    auto row_stats = [&](int b, const SequenceExtent& e, int h, int i0, int rows) {
      for (int r = 0; r < rows; ++r) {
        w.lse2[r] = p.lse[lse_offset(p, b, e, i0 + r, h)] * kLog2e;
        w.delta[r] = delta_all[delta_index(p, b, e, i0 + r, h)];
      }
    };

    // ---- pass 0: delta_i = dout_i . out_i, per (query row, head) ----
#pragma omp for schedule(static)
    for (int64_t row = 0; row < plan.query_rows; ++row) {
      // Dense rows are (b, i) = (row / Sq, row % Sq); varlen rows are absolute (q_row0 = 0, i = row).
      const int b = p.is_varlen() ? 0 : int(row / p.seqlen_q);
      const int i = p.is_varlen() ? int(row) : int(row % p.seqlen_q);
      const SequenceExtent e{0, 0, 0, 0};
      for (int h = 0; h < p.heads_q; ++h) {
        load_row(p.out, q_offset(p, p.out_batch_stride, p.out_row_stride, p.out_head_stride, b, e, i, h), p.dtype, p.head_dim_v, w.dout);
        load_row(p.dout, q_offset(p, p.dout_batch_stride, p.dout_row_stride, p.dout_head_stride, b, e, i, h), p.dtype, p.head_dim_v, w.v);
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int c = 0; c < p.head_dim_v; ++c) dot += w.dout[c] * w.v[c];
        delta_all[row * p.heads_q + h] = dot;
      }
    }
    // (implicit barrier: every delta is ready)

    // dK, dV of key tile kt of (b, kv head hk), over every query head of the group and every query
    // tile that sees the keys. With dq_acc (the fused schedule) also dQ += dS K into the group's
    // float32 dQ rows: head h's row i at dq_acc[((h - hk * group) * Sq + i) * ld_d].
    auto key_tile = [&](int b, int hk, const SequenceExtent& e, int kt, float* dq_acc) {
      const int j0 = kt * cfg.block_k;
      const int n = e.seqlen_k - j0 < cfg.block_k ? e.seqlen_k - j0 : cfg.block_k;
      const KeySource keys{p, b, hk, e};
      const FloatRows k = load_rows(p.k, p.dtype, n, p.head_dim, [&](int r) { return keys.k_offset(j0 + r); }, w.k, w.ld_d);
      const FloatRows v = load_rows(p.v, p.dtype, n, p.head_dim_v, [&](int r) { return keys.v_offset(j0 + r); }, w.v, w.ld_dv);
      for (int r = 0; r < n; ++r) {
        fill(w.acc + int64_t(r) * w.ld_d, p.head_dim, 0.f);
        fill(w.acc_v + int64_t(r) * w.ld_dv, p.head_dim_v, 0.f);
      }
      const WindowMask mask(p.window_left, p.window_right, e.seqlen_q, e.seqlen_k);
      const int q_lo = query_begin(mask, j0), q_hi = query_end(mask, j0 + n, e.seqlen_q);
      for (int h = hk * group; h < (hk + 1) * group; ++h) {
        const RowVariant variant(p, b, h, e.seqlen_q, e.seqlen_k);
        for (int start = q_lo / cfg.block_q * cfg.block_q; start < q_hi; start += cfg.block_q) {
          const int i0 = start > q_lo ? start : q_lo;
          const int rows = (start + cfg.block_q < q_hi ? start + cfg.block_q : q_hi) - i0;
          const FloatRows q = q_rows(b, e, h, i0, rows);
          const FloatRows dout = dout_rows(b, e, h, i0, rows);
          row_stats(b, e, h, i0, rows);
          score_gradients(p, variant, dropout, uint32_t(b * p.heads_q + h), q, dout, k, v, i0, rows, j0, n, w);
          gemm_atb(n, p.head_dim_v, rows, 1.f, w.p, w.ld_s, dout.data, dout.ld, 1.f, w.acc_v, w.ld_dv);  // dV += P^T dO
          gemm_atb(n, p.head_dim, rows, 1.f, w.ds, w.ld_s, q.data, q.ld, 1.f, w.acc, w.ld_d);            // dK += dS^T Q
          if (dq_acc != nullptr) {
            float* dq_rows = dq_acc + (int64_t(h - hk * group) * p.seqlen_q + i0) * w.ld_d;
            gemm_ab(rows, p.head_dim, n, 1.f, w.ds, w.ld_s, k.data, k.ld, 1.f, dq_rows, w.ld_d);  // dQ += dS K
          }
        }
      }
      for (int r = 0; r < n; ++r) {
        store_row(w.acc + int64_t(r) * w.ld_d, scale, p.dk,
                  kv_offset(p, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride, b, e, j0 + r, hk), p.dtype, p.head_dim);
        store_row(w.acc_v + int64_t(r) * w.ld_dv, 1.f, p.dv,
                  kv_offset(p, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride, b, e, j0 + r, hk), p.dtype, p.head_dim_v);
      }
    };

    if (plan.fused) {
      // ---- fused: dQ, dK, dV per (b, kv head) ----
#pragma omp for schedule(dynamic, 1)
      for (int64_t item = 0; item < plan.head_items; ++item) {
        const int hk = int(item % p.heads_k);
        const int b = int(item / p.heads_k);
        const SequenceExtent e = sequence_extent(p, b);
        for (int g = 0; g < group; ++g)
          for (int i = 0; i < e.seqlen_q; ++i) fill(w.dq_acc + (int64_t(g) * p.seqlen_q + i) * w.ld_d, p.head_dim, 0.f);
        for (int kt = 0; kt * cfg.block_k < e.seqlen_k; ++kt) key_tile(b, hk, e, kt, w.dq_acc);
        for (int g = 0; g < group; ++g)
          for (int i = 0; i < e.seqlen_q; ++i)
            store_row(w.dq_acc + (int64_t(g) * p.seqlen_q + i) * w.ld_d, scale, p.dq,
                      q_offset(p, p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride, b, e, i, hk * group + g),
                      p.dtype, p.head_dim);
      }
    } else {
      // ---- pass 1: dK, dV per (b, kv head, key tile) ----
#pragma omp for schedule(dynamic, 1)
      for (int64_t item = 0; item < plan.key_tile_items; ++item) {
        const int kt = int(item % key_tiles);
        const int hk = int(item / key_tiles % p.heads_k);
        const int b = int(item / key_tiles / p.heads_k);
        const SequenceExtent e = sequence_extent(p, b);
        if (kt * cfg.block_k >= e.seqlen_k) continue;
        key_tile(b, hk, e, kt, nullptr);
      }

      // ---- pass 2: dQ per (b, head, query tile) ----
#pragma omp for schedule(dynamic, 1)
      for (int64_t item = 0; item < plan.query_tile_items; ++item) {
        const int qt = query_tiles - 1 - int(item % query_tiles);  // long (causal) tiles first
        const int h = int(item / query_tiles % p.heads_q);
        const int b = int(item / query_tiles / p.heads_q);
        const SequenceExtent e = sequence_extent(p, b);
        const int i0 = qt * cfg.block_q;
        if (i0 >= e.seqlen_q) continue;
        const int rows = e.seqlen_q - i0 < cfg.block_q ? e.seqlen_q - i0 : cfg.block_q;
        const FloatRows q = q_rows(b, e, h, i0, rows);
        const FloatRows dout = dout_rows(b, e, h, i0, rows);
        row_stats(b, e, h, i0, rows);
        for (int r = 0; r < rows; ++r) fill(w.acc + int64_t(r) * w.ld_d, p.head_dim, 0.f);
        const RowVariant variant(p, b, h, e.seqlen_q, e.seqlen_k);
        const KeySource keys{p, b, h / group, e};
        const int key_lo = variant.mask.key_begin(i0), key_hi = variant.mask.key_end(i0 + rows, e.seqlen_k);
        for (int start = key_lo / cfg.block_k * cfg.block_k; start < key_hi; start += cfg.block_k) {
          const int j0 = start > key_lo ? start : key_lo;
          const int n = (start + cfg.block_k < key_hi ? start + cfg.block_k : key_hi) - j0;
          const FloatRows k = load_rows(p.k, p.dtype, n, p.head_dim, [&](int r) { return keys.k_offset(j0 + r); }, w.k, w.ld_d);
          const FloatRows v = load_rows(p.v, p.dtype, n, p.head_dim_v, [&](int r) { return keys.v_offset(j0 + r); }, w.v, w.ld_dv);
          score_gradients(p, variant, dropout, uint32_t(b * p.heads_q + h), q, dout, k, v, i0, rows, j0, n, w);
          gemm_ab(rows, p.head_dim, n, 1.f, w.ds, w.ld_s, k.data, k.ld, 1.f, w.acc, w.ld_d);  // dQ += dS K
        }
        for (int r = 0; r < rows; ++r)
          store_row(w.acc + int64_t(r) * w.ld_d, scale, p.dq,
                    q_offset(p, p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride, b, e, i0 + r, h), p.dtype, p.head_dim);
      }
    }
  }

  report_stats(p, ledger, 1, "cpu_flash bwd Br=%d Bc=%d threads=%d %s", cfg.block_q, cfg.block_k, plan.threads,
               plan.fused ? "fused" : "three-pass");
  return Status();
}

}  // namespace flashattn::cpu::flash
