// CPU flash forward: threads over query tiles (sequence, query heads, query rows); each tile runs
// the online-softmax mainloop of attend_tile.hpp over the keys its rows can see. Scratch is one
// set of tiles per thread: nothing grows with Sq x Sk.
#include <omp.h>


#include "cpu/flash/attend_tile.hpp"
#include "cpu/flash/flash.hpp"

namespace flashattn::cpu::flash {

Status forward(const AttentionParams& p) {
  const TileConfig cfg = forward_tiles(p.head_dim, p.head_dim_v, p.window_left >= 0 || p.window_right >= 0);
  const TileGrid grid(p, cfg);
  const int64_t tiles = grid.tiles(p);
  const int threads = team_size(p.num_threads, tiles);

  Slab measure;
  ForwardTiles::carve(measure, grid, cfg, p.head_dim, p.head_dim_v);
  const int64_t per_thread_bytes = measure.bytes();
  ScratchLedger ledger;
  const ScratchBlock scratch(ledger, tiles > 0 ? per_thread_bytes * threads : 0);
  const Dropout dropout(p);

#pragma omp parallel num_threads(threads) if (tiles > 0)
  {
    blas_single_threaded_here();
    Slab slab(scratch.data() + per_thread_bytes * omp_get_thread_num());
    const ForwardTiles w = ForwardTiles::carve(slab, grid, cfg, p.head_dim, p.head_dim_v);
#pragma omp for schedule(dynamic, 1)
    for (int64_t index = 0; index < tiles; ++index) {
      QueryTile t = grid.tile(p, index);
      const SequenceExtent e = sequence_extent(p, t.b);
      t.clip(e.seqlen_q);
      if (t.queries == 0 || !grid.widen_heads(p, t)) continue;
      for (int r = 0; r < t.rows(); ++r) {
        const int64_t q_row = q_offset(p, p.q_batch_stride, p.q_row_stride, p.q_head_stride, t.b, e, t.query_of(r), t.head_of(r));
        load_row(p.q, q_row, p.dtype, p.head_dim, w.q + int64_t(r) * w.ld_q);
      }
      // Only the keys some row of the tile can see (causal and windows skip whole key tiles).
      const WindowMask mask(p.window_left, p.window_right, e.seqlen_q, e.seqlen_k);
      const int key_lo = mask.key_begin(t.i0), key_hi = mask.key_end(t.i0 + t.queries, e.seqlen_k);
      attend_keys(p, t, e, key_lo, key_hi, cfg, w);

      for (int r = 0; r < t.rows(); ++r) {
        const int i = t.query_of(r), h = t.head_of(r);
        const RowResult result = finish_row(w, r, dropout.keep_scale);
        const int64_t out_row = q_offset(p, p.out_batch_stride, p.out_row_stride, p.out_head_stride, t.b, e, i, h);
        if (result.factor == 0.f) store_zero_row(p.out, out_row, p.dtype, p.head_dim_v);  // no visible key: O = 0
        else store_row(w.o_acc + int64_t(r) * w.ld_o, result.factor, p.out, out_row, p.dtype, p.head_dim_v);
        if (p.lse != nullptr) p.lse[lse_offset(p, t.b, e, i, h)] = result.lse;
      }
    }
  }

  report_stats(p, ledger, 1, "cpu_flash fwd Br=%d Bc=%d threads=%d %s", cfg.block_q, cfg.block_k, threads,
               few_rows::applies(grid.rows(), p.kv_dtype) ? "few-rows" : "blas");
  return Status();
}

}  // namespace flashattn::cpu::flash
