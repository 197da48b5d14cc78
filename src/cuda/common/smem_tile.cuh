// Shared-memory tiles of 16-bit elements with an XOR swizzle that makes ldmatrix (8 rows x 16 bytes
// per phase) and the 16-byte cp.async writes bank-conflict free.
//
// A kRows x kCols tile is stored as column blocks of kBlockCols elements (64 when kCols % 64 == 0,
// else 32), each block row-major. Inside a block, the 16-byte chunk c of row r sits at chunk
//   c ^ (r % 8)            with 8 chunks per block row (128 bytes: rows r..r+7 hit 8 distinct 16-byte
//                          bank groups for any fixed c)
//   c ^ ((r / 2) % 4)      with 4 chunks per block row (64 bytes: two rows share a 128-byte line; the
//                          pair (r % 2, c ^ (r / 2) % 4) is distinct for 8 consecutive rows)
// so any 8 consecutive rows (8-aligned) at one logical chunk, which is what one ldmatrix 8x8 matrix
// reads (also with .trans), fall in 8 different groups of 4 banks.
#pragma once

#include <cstdint>

namespace flashattn::cuda {

template <int kRows, int kCols>
struct SwizzledTile {
  static constexpr int kBlockCols = (kCols % 64 == 0) ? 64 : 32;
  static_assert(kCols % kBlockCols == 0, "columns must be a multiple of 32");
  static_assert(kRows % 8 == 0, "rows must be a multiple of 8");
  static constexpr int kChunksPerBlockRow = kBlockCols / 8;  // 16-byte chunks: 8 or 4
  static constexpr int kChunksPerRow = kCols / 8;
  static constexpr int kBlockBytes = kRows * kBlockCols * 2;
  static constexpr int kBytes = kRows * kCols * 2;

  // Byte offset of the 16-byte chunk `chunk` (0 .. kCols / 8 - 1) of row `row` (any row, any chunk).
  __device__ static __forceinline__ uint32_t chunk_offset(int row, int chunk) {
    const int block = chunk / kChunksPerBlockRow;
    const int c = chunk % kChunksPerBlockRow;
    return uint32_t(block * kBlockBytes + row * kBlockRowBytes + ((c ^ swizzle_of(row)) << 4));
  }

  // The same offset split into a per-lane part, computed once, and compile-time parts, so that an unrolled
  // loop of ldmatrix needs one register per operand instead of one per address:
  //   row = row_const + row_lane     with row_const % 8 == 0
  //   chunk = chunk_const + chunk_lane  with the bits of chunk_const and chunk_lane disjoint
  //                                  (e.g. chunk_const even and chunk_lane in {0, 1}), chunk_lane < 8 and 4
  // Then (chunk_const + chunk_lane) ^ s == (chunk_const % kChunksPerBlockRow) ^ (chunk_lane ^ s), a XOR on
  // bits 4..6 of the lane part, which the row term (a multiple of kBlockRowBytes >= 64) leaves alone.
  __device__ static __forceinline__ uint32_t lane_offset(int row_lane, int chunk_lane) {
    return uint32_t(row_lane * kBlockRowBytes + ((chunk_lane ^ swizzle_of(row_lane)) << 4));
  }
  __device__ static __forceinline__ uint32_t offset(uint32_t lane_part, int row_const, int chunk_const) {
    const int block = chunk_const / kChunksPerBlockRow;
    const int c = chunk_const % kChunksPerBlockRow;
    return (lane_part ^ uint32_t(c << 4)) + uint32_t(block * kBlockBytes + row_const * kBlockRowBytes);
  }

 private:
  static constexpr int kBlockRowBytes = kBlockCols * 2;
  __device__ static __forceinline__ int swizzle_of(int row) {
    return kChunksPerBlockRow == 8 ? (row & 7) : ((row >> 1) & 3);
  }
};

}  // namespace flashattn::cuda
