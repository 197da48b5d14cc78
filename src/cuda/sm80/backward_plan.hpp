// The backward pass's plan, shared by the host (workspace size, dispatch, unit tests without a GPU)
// and the kernels (FA_HD): the workspace layout and which (query tile, key tile) pairs do work.
//
// The backward runs three kernels (src/cuda/sm80/backward_kernel.cuh):
//   1. preprocess  dsum[i] = rowsum(dO_i * O_i) and lse_log2[i] = lse_i * log2(e) (+inf for an empty
//                  row, so that its probabilities come out as exp2(-inf) = 0)
//   2. main        one CTA per (key tile, sequence, key/value head): dK, dV in registers; dQ summed
//                  in float32 into dq_accum (atomics; in deterministic mode in key-tile order)
//   3. postprocess dq = softmax_scale * dq_accum, converted to the element type
// Workspace (O(S): linear in the number of tokens, never Sq x Sk), rows padded per (sequence, head)
// to a multiple of kBackwardRowAlign so every query tile reads whole, 16-byte aligned blocks:
//   dq_accum   float32 [B, Hq, padded_seqlen_q, head_dim_bucket] in MMA-fragment order (below)
//   lse_log2   float32 [B, Hq, padded_seqlen_q]
//   dsum       float32 [B, Hq, padded_seqlen_q]
//   semaphore  int32   [B, Hq, padded_seqlen_q / block_m]   (deterministic mode only)
//   dkv_accum  float32 [tail capacity][2][block_n x head_dim_bucket], dK then dV of each tail unit, in
//              dq_accum's fragment order (keys as rows); only where the tail split may run (below)
// Varlen uses the same padded layout with padded_seqlen_q from max_seqlen_q (B * max rows: an upper
// bound of total_q that the host can compute without reading cu_seqlens).
#pragma once

#include <cstdint>

#include "core/host_device.hpp"
#include "core/mask.hpp"
#include "core/params.hpp"

namespace flashattn::cuda::sm80 {

// Padding of the workspace's query rows: a multiple of every backward block_m (32, 64, 128).
constexpr int kBackwardRowAlign = 128;
// Alignment of each workspace region (bytes): 16 for cp.async, 256 to keep regions on their own lines.
constexpr int64_t kBackwardRegionAlign = 256;

constexpr FA_HD int64_t round_up(int64_t x, int64_t multiple) { return (x + multiple - 1) / multiple * multiple; }
constexpr FA_HD int ceil_div(int x, int y) { return (x + y - 1) / y; }
// Floor division that rounds toward -infinity (the tile-range math meets negative numbers).
constexpr FA_HD int floor_div(int64_t x, int y) { return int(x >= 0 ? x / y : -((-x + y - 1) / y)); }

// ---- the tail split (speed only) ----
// The main kernel's work units are (key tile, sequence, K/V head) in grid order. They all take the same
// time when every key tile works on every query tile (no causal mask, no window) and every sequence has
// the same lengths (dense, no seqused_k). With W CTA slots (SMs x CTAs per SM), units / W full waves
// leave a last wave of rem = units % W units that runs on rem slots while the others idle: 2048 units
// on 132 SMs (D = 128, S = 16k, 16 heads) are 15.5 waves, the last one half empty. Measured (H200,
// 2026-11-30 19:46 UTC, `flashattn run`, bf16 / fp16, S = 16k, two runs each): 33 heads (4224 units, 32
// whole waves) ran at 298.5-301.8 TFLOP/s against 285.4-292.6 for 16 heads, D = 256 254.0-257.7
// against 243.3-249.1 for 8 heads.
// The tail split runs the rem last units' iterations (query head of the group x query tile) on W
// CTAs instead, each taking an equal contiguous range of them (the stream-K idea of GEMMs): a tail CTA
// works through pieces of at most a few units, and every tail unit adds its dK / dV in float32 into
// dkv_accum (atomics; zeroed before the main kernel); a small kernel then writes them in the element
// type. Not in deterministic mode (the atomics' order varies run to run), not with dropout (its kernels
// are at their register limit: no tail instantiation).
constexpr int kTailMaxCtasPerSm = 2;  // dkv_accum holds up to SMs x this units; more slots: no tail split
constexpr double kTailMaxFill = 0.95;  // no tail split when the last wave is at least this full
// Units of fewer iterations are not split: their last wave is short, and the split's fixed costs (a second
// launch of the main kernel, the accumulators' memset, the tail kernel) ate the gain. H200, bf16,
// non-causal, 16k tokens, old / new binaries alternating, 2 runs each (2026-11-30 20:07 UTC): S = 1k (16
// iterations per unit) 0.98-0.99x, S = 4k (64) 1.005-1.020x, S = 16k (256) 1.017-1.023x at D = 64 / 128 / 256.
constexpr int kTailMinUnitIterations = 64;

// Whether the tail split may run for these arguments (every unit of the same length, atomics allowed).
FA_HD bool backward_tail_eligible(const BackwardParams& p) {
  return !p.deterministic && p.dropout_p == 0.f && p.cu_seqlens_q == nullptr && p.cu_seqlens_k == nullptr && p.seqused_k == nullptr &&
         p.block_table == nullptr && p.window_left < 0 && p.window_right < 0;
}

// Units whose dK / dV the workspace can accumulate (0: no tail split) on a device of `sm_count` SMs.
FA_HD int64_t backward_tail_capacity(const BackwardParams& p, int block_n, int sm_count) {
  if (!backward_tail_eligible(p) || block_n <= 0 || sm_count <= 0) return 0;
  const int64_t units = int64_t(ceil_div(p.seqlen_k, block_n)) * p.batch * p.heads_k;
  const int64_t most = int64_t(kTailMaxCtasPerSm) * sm_count;
  return units < most ? units : most;
}

// Bytes of dkv_accum for `units` tail units (dK and dV, block_n x head_dim_bucket floats each).
constexpr FA_HD int64_t backward_tail_accum_bytes(int64_t units, int block_n, int head_dim_bucket) {
  return units * 2 * block_n * head_dim_bucket * 4;
}

struct BackwardWorkspaceLayout {
  int64_t padded_seqlen_q;   // round_up(seqlen_q, kBackwardRowAlign)
  int head_dim_accum;        // row length of dq_accum: the kernel's head-dim bucket
  int block_m;               // query tile of the kernel (semaphore granularity)
  int64_t tail_capacity;     // units dkv_accum holds (0: none)
  int64_t dq_accum_offset;   // byte offsets from the workspace base
  int64_t lse_log2_offset;
  int64_t dsum_offset;
  int64_t semaphore_offset;  // == dkv_accum_offset when not deterministic (no semaphores)
  int64_t semaphore_bytes;
  int64_t dkv_accum_offset;  // == total_bytes when tail_capacity == 0
  int64_t dkv_accum_bytes;
  int64_t total_bytes;
};

// The layout for a kernel with head-dim bucket `head_dim_bucket` and query tile `block_m`; with key tile
// `block_n` and `tail_capacity` (backward_tail_capacity) units of tail-split accumulators.
FA_HD BackwardWorkspaceLayout backward_workspace_layout(const BackwardParams& p, int head_dim_bucket, int block_m,
                                                        int block_n = 0, int64_t tail_capacity = 0) {
  BackwardWorkspaceLayout w;
  w.padded_seqlen_q = round_up(p.seqlen_q, kBackwardRowAlign);
  w.head_dim_accum = head_dim_bucket;
  w.block_m = block_m;
  w.tail_capacity = block_n > 0 ? tail_capacity : 0;
  const int64_t rows = int64_t(p.batch) * p.heads_q * w.padded_seqlen_q;
  w.dq_accum_offset = 0;
  w.lse_log2_offset = round_up(w.dq_accum_offset + rows * head_dim_bucket * 4, kBackwardRegionAlign);
  w.dsum_offset = round_up(w.lse_log2_offset + rows * 4, kBackwardRegionAlign);
  w.semaphore_offset = round_up(w.dsum_offset + rows * 4, kBackwardRegionAlign);
  w.semaphore_bytes = p.deterministic ? int64_t(p.batch) * p.heads_q * (w.padded_seqlen_q / block_m) * 4 : 0;
  w.dkv_accum_offset = round_up(w.semaphore_offset + w.semaphore_bytes, kBackwardRegionAlign);
  w.dkv_accum_bytes = backward_tail_accum_bytes(w.tail_capacity, block_n, head_dim_bucket);
  w.total_bytes = w.tail_capacity > 0 ? w.dkv_accum_offset + w.dkv_accum_bytes : w.semaphore_offset + w.semaphore_bytes;
  return w;
}

// The tail split of one call: the whole-unit launch runs units [0, dp_units) (in its grid order, key tile
// fastest), one per CTA; the kTail launch's `ctas` CTAs share the iterations of [dp_units, dp_units + tail_units).
struct BackwardTail {
  int64_t dp_units = 0;    // units run whole, one per CTA
  int64_t tail_units = 0;  // units run in pieces (0: no tail split)
  int ctas = 0;            // CTAs of the tail
  int unit_iterations = 0; // iterations of every unit: (query heads of a group) x (query tiles)
};

// units: all units of the launch; slots: CTAs resident at once; capacity: layout.tail_capacity.
FA_HD BackwardTail plan_backward_tail(const BackwardParams& p, int64_t units, int64_t slots, int64_t capacity,
                                      int block_m) {
  BackwardTail t;
  t.dp_units = units;
  if (capacity <= 0 || slots <= 0 || units <= 0 || !backward_tail_eligible(p)) return t;
  const int64_t rem = units % slots;
  const int64_t iterations = int64_t(p.heads_q / p.heads_k) * ceil_div(p.seqlen_q, block_m);
  if (rem == 0 || rem > capacity || double(rem) >= kTailMaxFill * double(slots) || iterations < kTailMinUnitIterations ||
      iterations > (int64_t(1) << 30))
    return t;
  t.dp_units = units - rem;
  t.tail_units = rem;
  const int64_t pieces = rem * iterations;  // every tail CTA gets at least one iteration
  t.ctas = int(pieces < slots ? pieces : slots);
  t.unit_iterations = int(iterations);
  return t;
}

// ---- dq_accum's element order ----
// Within the [padded_seqlen_q, head_dim_bucket] block of one (b, h), the 16-row x 8-column blocks of dQ
// are stored one after another (row block major, then column block), and inside a block the four
// floats that one lane holds in an m16n8 MMA accumulator are contiguous:
//   lane = 4 * (r % 8) + (c % 8) / 2,  element = 2 * (r / 8) + c % 2      (r = i % 16, c = d % 8)
// so a warp adds its accumulator to dq_accum with one 16-byte reduction per lane, 512 contiguous bytes
// per instruction (the row-major order took two 8-byte reductions spread over 8 rows). The postprocess
// reads it back with the same function.
constexpr FA_HD int64_t dq_accum_index(int64_t i, int d, int head_dim_bucket) {
  const int64_t block = (i / 16) * (head_dim_bucket / 8) + d / 8;
  const int r = int(i % 16), c = d % 8;
  return block * 128 + (4 * (r % 8) + c / 2) * 4 + 2 * (r / 8) + c % 2;
}

// ---- which tiles do work ----
// Tile pair (query tile m, key tile n) holds a visible (i, j) iff the band of visible keys of its
// queries, [i_first + diagonal - window_left, i_last + diagonal + window_right] (contiguous because
// both windows are >= 0), meets [j_first, j_last]. Both ranges below follow from that one condition,
// so the key tiles that work on a query tile are exactly [first_key_tile(m), ...] in order: the
// deterministic mode's semaphores rely on this.
struct TileRange {
  int begin, end;  // [begin, end); empty when end <= begin
};

// Query tiles that key tile n (keys [n * block_n, min((n + 1) * block_n, seqlen_k))) works on.
// The right window ignores the clamp of the last query tile to seqlen_q: at worst that tile is
// visited with every probability masked to zero (it is a boundary tile, so the mask runs).
FA_HD TileRange query_tiles_of_key_tile(const WindowMask& mask, int seqlen_q, int seqlen_k, int block_m, int block_n,
                                        int n) {
  const int j_first = n * block_n;
  const int j_last = (j_first + block_n < seqlen_k ? j_first + block_n : seqlen_k) - 1;
  TileRange r{0, ceil_div(seqlen_q, block_m)};
  if (mask.window_right >= 0) {
    const int begin = floor_div(int64_t(j_first) - mask.diagonal - mask.window_right, block_m);
    if (begin > r.begin) r.begin = begin;
  }
  if (mask.window_left >= 0) {
    const int end = floor_div(int64_t(j_last) - mask.diagonal + mask.window_left, block_m) + 1;
    if (end < r.end) r.end = end;
  }
  if (r.end < r.begin) r.end = r.begin;
  return r;
}

// Query tiles of `m_range` (query_tiles_of_key_tile of key tile n) whose pair with key tile n needs no mask: every
// (i, j) visible and every key inside the sequence. Each of tile_fully_visible's four bounds is monotone in m, so
// these tiles form one range; it is found by walking in from both ends (the masked tiles are few: the diagonal, the
// window edges, or all of them when a window is narrower than a tile). Empty (at m_range.end) when the key tile
// runs past the sequence.
FA_HD TileRange unmasked_query_tiles(const WindowMask& mask, int seqlen_q, int seqlen_k, int block_m, int block_n, int n,
                                     TileRange m_range) {
  TileRange r{m_range.end, m_range.end};
  const int j0 = n * block_n;
  const int j1 = j0 + block_n < seqlen_k ? j0 + block_n : seqlen_k;
  if (j0 + block_n > seqlen_k) return r;
  auto fully_visible = [&](int m) {
    const int i0 = m * block_m, i1 = i0 + block_m < seqlen_q ? i0 + block_m : seqlen_q;
    return mask.tile_fully_visible(i0, i1, j0, j1);
  };
  int lo = m_range.begin;
  while (lo < m_range.end && !fully_visible(lo)) ++lo;
  int hi = m_range.end;
  while (hi > lo && !fully_visible(hi - 1)) --hi;
  r.begin = lo, r.end = hi;
  return r;
}

// The first key tile that works on query tile m (the semaphore of m counts key tiles from it).
FA_HD int first_key_tile_of_query_tile(const WindowMask& mask, int block_m, int block_n, int m) {
  if (mask.window_left < 0) return 0;
  const int n = floor_div(int64_t(m) * block_m + mask.diagonal - mask.window_left, block_n);
  return n < 0 ? 0 : n;
}

// Bytes of dynamic shared memory of the main kernel (mirrors BackwardTraits::kSmemBytes; the manifest
// computes the same formula for dispatch). Affects occupancy only.
constexpr FA_HD int64_t backward_smem_bytes(int head_dim, int block_m, int block_n, int warps, int stages,
                                            int warp_keys) {
  const int warps_d = warps / (block_n / warp_keys);  // > 1: P^T goes through shared memory too
  const int64_t kv = 2 * int64_t(block_n) * head_dim * 2;
  const int64_t q_do = 2 * int64_t(stages) * block_m * head_dim * 2;
  const int64_t ds_p = (warps_d > 1 ? 2 : 1) * int64_t(block_n) * block_m * 2;
  const int64_t stats = 2 * int64_t(stages) * block_m * 4;
  return kv + q_do + ds_p + stats;
}

}  // namespace flashattn::cuda::sm80
