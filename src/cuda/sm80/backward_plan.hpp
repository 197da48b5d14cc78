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

struct BackwardWorkspaceLayout {
  int64_t padded_seqlen_q;   // round_up(seqlen_q, kBackwardRowAlign)
  int head_dim_accum;        // row length of dq_accum: the kernel's head-dim bucket
  int block_m;               // query tile of the kernel (semaphore granularity)
  int64_t dq_accum_offset;   // byte offsets from the workspace base
  int64_t lse_log2_offset;
  int64_t dsum_offset;
  int64_t semaphore_offset;  // == total_bytes when not deterministic (no semaphores)
  int64_t semaphore_bytes;
  int64_t total_bytes;
};

// The layout for a kernel with head-dim bucket `head_dim_bucket` and query tile `block_m`.
FA_HD BackwardWorkspaceLayout backward_workspace_layout(const BackwardParams& p, int head_dim_bucket, int block_m) {
  BackwardWorkspaceLayout w;
  w.padded_seqlen_q = round_up(p.seqlen_q, kBackwardRowAlign);
  w.head_dim_accum = head_dim_bucket;
  w.block_m = block_m;
  const int64_t rows = int64_t(p.batch) * p.heads_q * w.padded_seqlen_q;
  w.dq_accum_offset = 0;
  w.lse_log2_offset = round_up(w.dq_accum_offset + rows * head_dim_bucket * 4, kBackwardRegionAlign);
  w.dsum_offset = round_up(w.lse_log2_offset + rows * 4, kBackwardRegionAlign);
  w.semaphore_offset = round_up(w.dsum_offset + rows * 4, kBackwardRegionAlign);
  w.semaphore_bytes = p.deterministic ? int64_t(p.batch) * p.heads_q * (w.padded_seqlen_q / block_m) * 4 : 0;
  w.total_bytes = w.semaphore_offset + w.semaphore_bytes;
  return w;
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
