// The sm80 backward pass (tensor-core mma.sync m16n8k16, ldmatrix, cp.async; runs on sm_80 and later).
// The plan (kernels, workspace, tile ranges) is described in src/cuda/sm80/backward_plan.hpp.
//
// Notation: one CTA owns key tile n (kBlockN keys) of one (sequence b, key/value head hk) and loops
// over the query heads h of the group of hk and, for each, over the query tiles m (kBlockM rows) that
// see any of its keys. Per query tile, with S = scale * Q K^T (transformed by softcap / ALiBi), P the
// probabilities recomputed from the forward's LSE, Z the dropout multiplier (0 or 1 / (1 - p)):
//   dV += (P * Z)^T dO                       (kept in registers for the CTA's lifetime)
//   dP  = (dO V^T) * Z
//   dS  = P * (dP - dsum) * tanh'            (dsum_i = rowsum(dO_i * O_i) = sum_j P_ij dP_ij)
//   dK += dS^T Q                             (registers; times scale in the epilogue)
//   dQ += dS K                               (float32 atomics into dq_accum; times scale afterwards)
// Everything is computed transposed (keys on the MMA's M side): S^T = K Q^T and dP^T = V dO^T have
// the accumulator layout of an A operand with keys as rows, so P^T and dS^T feed dV and dK straight
// from registers when one warp holds all kBlockM queries of its keys (kWarpsD == 1). Otherwise the
// queries of S^T and the dK / dV columns are split over kWarpsD warps, which then exchange P^T and
// dS^T through shared memory.
//
// Warp layout (w = warp index, K = kWarpKeys = 16 or 32 keys per warp, set by the manifest):
//                                key rows    K * (w % kWarpsN) .. +K       (S^T, dP^T, dK, dV)
//                                query cols  (w / kWarpsN) * kBlockM / kWarpsD ..  (S^T, dP^T)
//                                head cols   (w / kWarpsN) * kHeadDim / kWarpsD .. (dK, dV)
//   dQ = dS K is split differently: K query rows x kHeadDim / kDqWarpsD columns per warp.
// Why K = 32: the kernel is bound by shared-memory (ldmatrix) bandwidth, and a warp that owns two m16
// key blocks uses every Q / dO fragment it reads for both (likewise each K fragment of dQ for two
// query blocks): at D = 128, 64 x 128 tiles, 8 warps, ldmatrix traffic per tile drops from 1472 to
// 1152 x4-loads (-22%).
// MMA fragment notation: lane = 4 * group + quad; an m16n8 accumulator holds rows group and
// group + 8, columns 2 * quad and 2 * quad + 1.
//
// Tail split (backward_plan.hpp): where every unit (key tile, sequence, K/V head) has the same length, the
// units of the last, partial wave are not run one per CTA: a second launch (kTail) gives every CTA slot an
// equal range of their iterations, and those units add dK / dV into a float32 accumulator that
// backward_tail_kernel writes out. Each piece is the loop below over a sub-range of the unit's iterations.
//
// Interior tiles of plain attention take a short elementwise path (scale, exp2, dropout); masks,
// softcap and ALiBi run only on tiles that need them. Deterministic mode orders the dQ additions of
// the key tiles of each query tile by a semaphore per (b, h, query tile): same bits run to run.
//
// Speed (H200, bf16, bench/backward_tiles.cu, 2026-11-30 05:25 UTC; FlashAttention-2 of torch 2.11 on that
// H200 at 03:15 UTC: 281.4 / 298.5 / 252.6 TFLOP/s): S = 16k non-causal, D = 64: 328.1, D = 128: 300.7, D = 256:
// 255.2. What got it there from 229 / 230 / 172: 32 keys per warp (each Q / dO fragment feeds two key
// blocks), 4-warp tiles that fit twice per SM where dK + dV allow (D <= 64), dq_accum in MMA-fragment
// order (one coalesced 16-byte reduction per lane instead of two scattered 8-byte ones; ncu had shown
// the LSU queue (lg_throttle) as a top stall) and dQ in two passes at D = 256 (no spills).
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "core/mask.hpp"
#include "core/params.hpp"
#include "core/philox.hpp"
#include "cuda/common/kernel_config.cuh"
#include "cuda/common/ptx.cuh"
#include "cuda/common/smem_tile.cuh"
#include "cuda/sm80/backward_plan.hpp"

// Everything here lives in sm80::bwd so that it never meets the forward kernel's helpers of the
// same name (kLog2e, load_tile_async) in a translation unit that includes both.
namespace flashattn::cuda::sm80::bwd {

constexpr float kLog2e = 1.4426950408889634f;  // log2(e): exp(x) = exp2(x * kLog2e)

// Device pointers into the workspace (layout in backward_plan.hpp).
struct BackwardWorkspacePointers {
  float* dq_accum;
  float* lse_log2;
  float* dsum;
  int* semaphores;           // null unless deterministic
  int64_t padded_seqlen_q;
  float* dkv_accum;          // tail units' dK, dV (backward_plan.hpp); null when the layout has none
  int key_tiles;             // units are (key tile, sequence, K/V head), key tile fastest
  BackwardTail tail;         // which units run whole and which in pieces (backward_plan.hpp)
};

// Everything the kernels derive from the manifest's KernelConfig. Tiles affect speed, registers
// and shared memory only, never results.
template <class Config>
struct BackwardTraits {
  using Element = typename Config::Element;
  static constexpr int kHeadDim = Config::kHeadDim;  // bucket; the real D may be smaller (zero-padded)
  static constexpr int kBlockM = Config::kBlockM;    // query rows per inner iteration
  static constexpr int kBlockN = Config::kBlockN;    // key rows per CTA
  static constexpr int kWarps = Config::kWarps;
  static constexpr int kThreads = Config::kThreads;
  static constexpr int kStages = Config::kStages;    // Q / dO shared-memory stages
  static constexpr bool kDropout = Config::kDropout;
  // Lean iteration: which query tiles need the mask is found once per unit (a range), and whole Q / dO tiles load
  // without predicates, one 64-bit add per copy. Each iteration re-derived both (64-bit tile bounds, address
  // selects): about 100 of its 1175 instructions per warp (ncu, causal S = 16k, D = 128, 2026-12-01). Speed
  // only. bench/backward_tiles.cu, H200, bf16, 2026-12-01 00:26 UTC, 3 runs: D = 128 +2.0-3.2% at S = 2k-16k,
  // causal or not; D = 64 +0.8-1.9%; D = 256 -0.7-1.0% (ptxas spills 20 bytes more), so D = 64 and 128 only
  // (the others unmeasured), and not with dropout (its kernels are at their register limit).
  static constexpr bool kLean = (kHeadDim == 64 || kHeadDim == 128) && !kDropout;

  static constexpr int kWarpKeys = Config::kWarpKeys;  // keys per warp: 16 or 32 (m16 blocks of the MMA)
  static constexpr int kKeyFrags = kWarpKeys / 16;     // m16 key blocks per warp
  static constexpr int kWarpsN = kBlockN / kWarpKeys;  // warps along keys
  static constexpr int kWarpsD = kWarps / kWarpsN;     // warps sharing those keys
  static constexpr int kQueriesPerWarp = kBlockM / kWarpsD;
  static constexpr int kDPerWarp = kHeadDim / kWarpsD;
  static constexpr int kAccFrags = kDPerWarp / 8;      // n8 blocks of dK / dV per warp and key block
  // dQ = dS K: kWarpKeys query rows (kDqRowFrags m16 blocks) x kDqDPerWarp head columns per warp.
  static constexpr int kDqRowFrags = kWarpKeys / 16;
  static constexpr int kDqWarpsM = kBlockM / kWarpKeys;
  static constexpr int kDqWarpsD = kWarps / kDqWarpsM;
  static constexpr int kDqDPerWarp = kHeadDim / kDqWarpsD;
  static constexpr int kDqFrags = kDqDPerWarp / 8;
  // dQ is computed in kDqSplit passes of kDqPassFrags n8 column blocks when a warp has more than 4 (D = 256):
  // 32 fewer live registers next to dK / dV for a second read of the dS fragments. Affects speed only.
  static constexpr int kDqSplit = kDqFrags > 4 && kDqFrags % 4 == 0 ? kDqFrags / 4 : 1;
  static constexpr int kDqPassFrags = kDqFrags / kDqSplit;
  static constexpr bool kPInRegisters = kWarpsD == 1;
  // S^T / dP^T of a warp are computed in kSplit passes of kSubQueries queries: 32 when dK + dV
  // (D >= 96, or two key blocks per warp) or Philox (dropout) already hold many registers, else 64.
  // Fewer live registers for a few more ldmatrix of K / V. Affects registers and speed only.
  static constexpr int kPassQueries = (kHeadDim >= 96 || kDropout || kKeyFrags > 1) ? 32 : 64;
  static constexpr int kSubQueries = kPassQueries < kQueriesPerWarp ? kPassQueries : kQueriesPerWarp;
  static constexpr int kSplit = kQueriesPerWarp / kSubQueries;
  static constexpr int kSubFrags = kSubQueries / 8;

  static_assert(kBlockN % kWarpKeys == 0 && kWarps % kWarpsN == 0, "block_n / warp_keys warps along keys must divide warps");
  static_assert(kSubFrags % 2 == 0, "each pass's query columns must be a multiple of 16 (k16 steps)");
  static_assert(kAccFrags % 2 == 0, "each warp's dK/dV columns must be a multiple of 16 (ldmatrix x4)");
  static_assert(kBlockM % kWarpKeys == 0 && kWarps % kDqWarpsM == 0, "block_m / warp_keys dQ warp rows must divide warps");
  static_assert(kDqFrags % 2 == 0 && kDqDPerWarp * kDqWarpsD == kHeadDim, "dQ columns per warp: multiple of 16");
  static_assert(kStages == 2, "the backward double-buffers Q / dO (prefetch of the next query tile)");
  static_assert(kBlockM % 4 == 0, "lse / dsum rows are copied 4 floats (16 bytes) at a time");

  using KTile = SwizzledTile<kBlockN, kHeadDim>;   // K and V: [key][d]
  using QTile = SwizzledTile<kBlockM, kHeadDim>;   // Q and dO: [query][d]
  using STile = SwizzledTile<kBlockN, kBlockM>;    // dS^T and P^T: [key][query]

  // Shared memory, bytes from the base. Affects occupancy only.
  static constexpr int kKOffset = 0;
  static constexpr int kVOffset = kKOffset + KTile::kBytes;
  static constexpr int kQOffset = kVOffset + KTile::kBytes;                 // [stage]
  static constexpr int kDoOffset = kQOffset + kStages * QTile::kBytes;      // [stage]
  static constexpr int kDsOffset = kDoOffset + kStages * QTile::kBytes;
  static constexpr int kPOffset = kDsOffset + STile::kBytes;                 // only when !kPInRegisters
  static constexpr int kLseOffset = kPOffset + (kPInRegisters ? 0 : STile::kBytes);  // float [stage][kBlockM]
  static constexpr int kDsumOffset = kLseOffset + kStages * kBlockM * 4;
  static constexpr int kSmemBytes = kDsumOffset + kStages * kBlockM * 4;
};

// Converts two floats into the packed 16-bit pair an mma operand register holds (low = first).
template <typename Element>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  return ElementTraits<Element>::pack(lo, hi);
}

template <typename Element>
__device__ __forceinline__ float2 unpack2(uint32_t bits);
template <>
__device__ __forceinline__ float2 unpack2<__half>(uint32_t bits) {
  return __half22float2(*reinterpret_cast<const __half2*>(&bits));
}
template <>
__device__ __forceinline__ float2 unpack2<__nv_bfloat16>(uint32_t bits) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits));
}

// Adds v[0..3] to dst[0..3] in global memory (dst 16-byte aligned), as reductions (no value returned).
// sm_90+: one 16-byte vector reduction (red.global.add.v4.f32, PTX 8.1); before: four scalar ones.
__device__ __forceinline__ void atomic_add_float4(float* dst, const float (&v)[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst), "f"(v[0]), "f"(v[1]), "f"(v[2]), "f"(v[3])
               : "memory");
#else
#pragma unroll
  for (int x = 0; x < 4; ++x) atomicAdd(dst + x, v[x]);
#endif
}

// dropout_u16_of_key (core/philox.hpp) without indexing r.x[] at run time, which would put the
// Philox result in local memory: the same 16-bit value, picked with selects.
__device__ __forceinline__ uint32_t dropout_u16_select(const Philox4x32& r, uint32_t j) {
  const uint32_t word = (j >> 3) & 3u;  // k >> 1 with k = 2 * ((j / 8) % 4) + j % 2
  const uint32_t bits = word == 0 ? r.x[0] : (word == 1 ? r.x[1] : (word == 2 ? r.x[2] : r.x[3]));
  return (bits >> (16u * (j & 1u))) & 0xFFFFu;
}

// cp.async of a whole [kRows][kCols] tile (every row and chunk real): no predicates, one 64-bit add per copy.
template <class Tile, int kThreads, typename Element>
__device__ __forceinline__ void load_whole_tile_async(uint32_t smem_base, const Element* gmem, int64_t row_stride) {
  constexpr int kChunksPerRow = Tile::kChunksPerRow;
  constexpr int kRows = Tile::kBytes / (kChunksPerRow * 16);
  constexpr int kRounds = kRows * kChunksPerRow / kThreads;
  static_assert(kThreads % kChunksPerRow == 0 && (kThreads / kChunksPerRow) % 8 == 0, "whole rows per round");
  constexpr int kRowsPerRound = kThreads / kChunksPerRow;
  const int row = int(threadIdx.x) / kChunksPerRow, chunk = int(threadIdx.x) % kChunksPerRow;
  const char* src = reinterpret_cast<const char*>(gmem + row * row_stride + chunk * 8);
  const int64_t step = int64_t(kRowsPerRound) * row_stride * int64_t(sizeof(Element));
  const uint32_t dst = smem_base + Tile::chunk_offset(row, chunk);
#pragma unroll
  for (int round = 0; round < kRounds; ++round)
    cp_async_16_full(dst + Tile::chunk_offset(round * kRowsPerRound, 0), src + round * step);
}

// cp.async of a [kRows][kCols] tile whose row r starts at gmem + r * row_stride (elements). Rows
// >= rows_valid and 16-byte chunks >= chunks_valid are zero-filled (partial tiles, D < bucket).
// When the CTA covers whole rows per round, 8k of them, a thread keeps its
// chunk column and steps down by a fixed number of rows: its addresses are one base plus a constant
// per round (the swizzle of row r + 8n equals that of r, so the shared offset is too).
template <class Tile, int kThreads, typename Element>
__device__ __forceinline__ void load_tile_async(uint32_t smem_base, const Element* gmem, int64_t row_stride,
                                                int rows_valid, int chunks_valid) {
  constexpr int kChunksPerRow = Tile::kChunksPerRow;
  constexpr int kRows = Tile::kBytes / (kChunksPerRow * 16);
  constexpr int kRounds = kRows * kChunksPerRow / kThreads;
  static_assert(kRows * kChunksPerRow % kThreads == 0, "the tile is copied in whole rounds of the CTA");
  if constexpr (kThreads % kChunksPerRow == 0 && (kThreads / kChunksPerRow) % 8 == 0) {
    constexpr int kRowsPerRound = kThreads / kChunksPerRow;  // a multiple of 8: same swizzle phase
    const int row = int(threadIdx.x) / kChunksPerRow, chunk = int(threadIdx.x) % kChunksPerRow;
    const Element* src = gmem + row * row_stride + chunk * 8;
    const uint32_t dst = smem_base + Tile::chunk_offset(row, chunk);
    const bool chunk_valid = chunk < chunks_valid;
#pragma unroll
    for (int round = 0; round < kRounds; ++round) {
      const bool valid = chunk_valid && row + round * kRowsPerRound < rows_valid;
      // An invalid chunk still needs a readable address for the instruction; nothing is read from it.
      cp_async_16(dst + Tile::chunk_offset(round * kRowsPerRound, 0), valid ? src + round * kRowsPerRound * row_stride : gmem,
                  valid);
    }
  } else {
#pragma unroll
    for (int round = 0; round < kRounds; ++round) {
      const int index = round * kThreads + int(threadIdx.x);
      const int row = index / kChunksPerRow;
      const int chunk = index % kChunksPerRow;
      const bool valid = row < rows_valid && chunk < chunks_valid;
      cp_async_16(smem_base + Tile::chunk_offset(row, chunk), valid ? gmem + row * row_stride + chunk * 8 : gmem, valid);
    }
  }
}

// The lane-dependent part of ldmatrix addresses into SwizzledTiles with kChunksPerBlockRow 16-byte
// chunks per column-block row, computed once per thread, for accesses of the form
//   row = row0 + lane_row, chunk = 2 * k + lane_chunk   (row0 a multiple of 8, lane_chunk 0 or 1)
// The swizzle then depends on lane_row alone, and with c0 = (2k) % kChunksPerBlockRow (even)
//   Tile::chunk_offset(row, chunk) = block(k) * Tile::kBlockBytes + (row0 + lane_row) * pitch
//                                    + ((c0 << 4) ^ lane_x16)
// so an access costs one XOR and adds, mostly constant-folded.
template <int kChunksPerBlockRow>
struct LdsmLanes {
  static constexpr int kPitch = kChunksPerBlockRow * 16;  // bytes per row inside a column block
  uint32_t lane_bytes;  // lane_row * kPitch
  uint32_t lane_x16;    // (lane_chunk ^ swizzle(lane_row)) << 4
  __device__ __forceinline__ LdsmLanes(int lane_row, int lane_chunk) {
    const int swizzle = kChunksPerBlockRow == 8 ? (lane_row & 7) : ((lane_row >> 1) & 3);
    lane_bytes = uint32_t(lane_row * kPitch);
    lane_x16 = uint32_t((lane_chunk ^ swizzle) << 4);
  }
  // Same as Tile::chunk_offset(row0 + lane_row, 2 * k + lane_chunk).
  template <class Tile>
  __device__ __forceinline__ uint32_t offset(int row0, int k) const {
    static_assert(Tile::kChunksPerBlockRow == kChunksPerBlockRow, "lane offsets of another swizzle");
    const int chunk0 = 2 * k;
    const int block = chunk0 / kChunksPerBlockRow, c0 = chunk0 % kChunksPerBlockRow;
    return uint32_t(block * Tile::kBlockBytes + row0 * kPitch) + lane_bytes + (uint32_t(c0 << 4) ^ lane_x16);
  }
};

// One k16 step (queries q0 .. q0 + 15) of dV += (P Z)^T dO and dK += dS^T Q for the warp's kKeyFrags
// m16 key blocks and its kDPerWarp head columns from d0. B operands: dO / Q rows q0.. transposed into
// column-major fragments, each read once and used for every key block of the warp.
// lanes: LdsmLanes<QTile> of the pattern lane_row = lane % 16 (rows +0/+8), lane_chunk = lane / 16.
template <class T>
__device__ __forceinline__ void mma_dkdv(float (&dk_acc)[T::kKeyFrags][T::kAccFrags][4],
                                         float (&dv_acc)[T::kKeyFrags][T::kAccFrags][4],
                                         const uint32_t (&p_frag)[T::kKeyFrags][4],
                                         const uint32_t (&ds_frag)[T::kKeyFrags][4], uint32_t q_smem, uint32_t do_smem,
                                         int q0, int d0, const LdsmLanes<T::QTile::kChunksPerBlockRow>& lanes) {
  using Element = typename T::Element;
#pragma unroll
  for (int f = 0; f < T::kAccFrags; f += 2) {
    // rows q0 + (lane % 16), columns d0 + 8 f + 8 (lane / 16)
    const uint32_t offset = lanes.template offset<typename T::QTile>(q0, d0 / 16 + f / 2);
    uint32_t do_frag[4], q_frag[4];
    ldmatrix_x4_trans(do_frag, do_smem + offset);
    ldmatrix_x4_trans(q_frag, q_smem + offset);
#pragma unroll
    for (int kf = 0; kf < T::kKeyFrags; ++kf) {
      mma_m16n8k16<Element>(dv_acc[kf][f], p_frag[kf], {do_frag[0], do_frag[1]});
      mma_m16n8k16<Element>(dv_acc[kf][f + 1], p_frag[kf], {do_frag[2], do_frag[3]});
      mma_m16n8k16<Element>(dk_acc[kf][f], ds_frag[kf], {q_frag[0], q_frag[1]});
      mma_m16n8k16<Element>(dk_acc[kf][f + 1], ds_frag[kf], {q_frag[2], q_frag[3]});
    }
  }
}

// ---------------------------------------------------------------------------------------------
// 1. Preprocess, for every padded row of every head: dsum = rowsum(dO * O), lse in log2 units, and the
//    row's share of dq_accum zeroed (one pass instead of a memset and a pass). Rows past the sequence get
//    the padding values (lse_log2 = +inf, dsum = 0) that make their probabilities and gradients exactly
//    zero in the main kernel. kPreThreadsPerRow threads per (row, head): each issues all its 16-byte loads
//    of O and dO before using any (one row per thread, one chunk at a time, ran at ~1.9 TB/s), and the
//    group adds its partial sums with shuffles (a fixed order: deterministic).
constexpr int kPreThreadsPerRow = 8;
constexpr int kPreChunksPerThread = 256 / 8 / kPreThreadsPerRow;  // D <= 256: 32 chunks per row at most

template <typename Element>
__global__ void backward_preprocess_kernel(const BackwardParams p, const BackwardWorkspacePointers ws, int head_dim_accum) {
  const int b = blockIdx.y;
  const int64_t item = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / kPreThreadsPerRow;  // (row, head)
  const int part = int(threadIdx.x % kPreThreadsPerRow);
  // No early return: every lane of a warp takes part in the shuffles below.
  const bool active = item < ws.padded_seqlen_q * p.heads_q;
  const int i = int(item / p.heads_q);
  const int h = int(item % p.heads_q);
  const SequenceExtent e = sequence_extent(p, b);
  const int64_t row = (int64_t(b) * p.heads_q + h) * ws.padded_seqlen_q + i;
  if (active) {
    // head_dim_accum floats of this (b, h)'s dq_accum block per row: the block's element order
    // (dq_accum_index) does not matter for zeroing, the rows together cover it.
    float4* zero = reinterpret_cast<float4*>(ws.dq_accum + row * head_dim_accum);
    for (int c = part; c < head_dim_accum / 4; c += kPreThreadsPerRow) zero[c] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  const bool in_sequence = active && i < e.seqlen_q;
  float sum = 0.f;
  if (in_sequence) {
    const Element* out = static_cast<const Element*>(p.out) +
                         q_offset(p, p.out_batch_stride, p.out_row_stride, p.out_head_stride, b, e, i, h);
    const Element* dout = static_cast<const Element*>(p.dout) +
                          q_offset(p, p.dout_batch_stride, p.dout_row_stride, p.dout_head_stride, b, e, i, h);
    const int chunks = p.head_dim / 8;  // 16-byte chunks (alignment checked by dispatch)
    uint4 o8[kPreChunksPerThread], d8[kPreChunksPerThread];
#pragma unroll
    for (int k = 0; k < kPreChunksPerThread; ++k) {
      const int c = part + k * kPreThreadsPerRow;
      if (c < chunks) {
        o8[k] = *reinterpret_cast<const uint4*>(out + c * 8);
        d8[k] = *reinterpret_cast<const uint4*>(dout + c * 8);
      }
    }
#pragma unroll
    for (int k = 0; k < kPreChunksPerThread; ++k) {
      if (part + k * kPreThreadsPerRow < chunks) {
        const uint32_t ow[4] = {o8[k].x, o8[k].y, o8[k].z, o8[k].w}, dw[4] = {d8[k].x, d8[k].y, d8[k].z, d8[k].w};
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          const float2 o = unpack2<Element>(ow[w]), d = unpack2<Element>(dw[w]);
          sum = fmaf(o.x, d.x, fmaf(o.y, d.y, sum));
        }
      }
    }
  }
#pragma unroll
  for (int offset = 1; offset < kPreThreadsPerRow; offset *= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (!active || part != 0) return;
  if (!in_sequence) {
    ws.lse_log2[row] = INFINITY;  // exp2(score - inf) = 0: padding rows contribute nothing
    ws.dsum[row] = 0.f;
    return;
  }
  const float lse = p.lse[lse_offset(p, b, e, i, h)];
  // An empty row has lse = -inf and P = 0: store +inf so that exp2(s - lse_log2) = 0, never
  // exp2(-inf - (-inf)) = NaN.
  ws.lse_log2[row] = lse == -INFINITY ? INFINITY : lse * kLog2e;
  ws.dsum[row] = sum;
}

// ---------------------------------------------------------------------------------------------
// 3. Postprocess: dq = softmax_scale * dq_accum in the element type. One thread per (16-row block, head,
//    8-column block, r8): it reads the 64 contiguous bytes that hold rows r8 and r8 + 8 of the block's
//    8 columns (four MMA lanes' float4s, dq_accum_index) and writes those two 16-byte row chunks; a warp
//    reads 2 KiB contiguous and writes 64 contiguous bytes per row.
template <typename Element>
__global__ void backward_postprocess_kernel(const BackwardParams p, const BackwardWorkspacePointers ws,
                                            int head_dim_accum) {
  const int b = blockIdx.y;
  const int col_blocks = p.head_dim / 8;
  const int64_t item = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int r8 = int(item % 8);
  const int cb = int((item / 8) % col_blocks);
  const int64_t rest = item / 8 / col_blocks;
  const int h = int(rest % p.heads_q);
  const int64_t row_block = rest / p.heads_q;
  const SequenceExtent e = sequence_extent(p, b);
  if (row_block * 16 >= e.seqlen_q) return;
  const float4* acc = reinterpret_cast<const float4*>(
      ws.dq_accum + (int64_t(b) * p.heads_q + h) * ws.padded_seqlen_q * head_dim_accum +
      dq_accum_index(row_block * 16 + r8, cb * 8, head_dim_accum));  // lane 4 r8 of the block: 4 float4 follow
  float4 v[4];  // v[q] = (row r8: columns 2q, 2q + 1; row r8 + 8: columns 2q, 2q + 1)
#pragma unroll
  for (int q = 0; q < 4; ++q) v[q] = acc[q];
  const float s = p.softmax_scale;
  const int i0 = int(row_block * 16) + r8;
  if (i0 < e.seqlen_q) {
    Element* dq0 = static_cast<Element*>(p.dq) + q_offset(p, p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride, b, e, i0, h);
    *reinterpret_cast<uint4*>(dq0 + cb * 8) = make_uint4(pack2<Element>(v[0].x * s, v[0].y * s), pack2<Element>(v[1].x * s, v[1].y * s),
                                                         pack2<Element>(v[2].x * s, v[2].y * s), pack2<Element>(v[3].x * s, v[3].y * s));
  }
  if (i0 + 8 < e.seqlen_q) {
    Element* dq1 = static_cast<Element*>(p.dq) + q_offset(p, p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride, b, e, i0 + 8, h);
    *reinterpret_cast<uint4*>(dq1 + cb * 8) = make_uint4(pack2<Element>(v[0].z * s, v[0].w * s), pack2<Element>(v[1].z * s, v[1].w * s),
                                                         pack2<Element>(v[2].z * s, v[2].w * s), pack2<Element>(v[3].z * s, v[3].w * s));
  }
}

// ---------------------------------------------------------------------------------------------
// 4. Tail units (after the main kernel, only with a tail split): dK = softmax_scale * dK sum, dV = dV sum
//    from dkv_accum, in the element type. Same thread layout as the postprocess: one thread per (tail
//    unit, 16-key block, r8, 8-column block) writes keys r8 and r8 + 8 of the block's 8 columns.
template <typename Element>
__global__ void backward_tail_kernel(const BackwardParams p, const BackwardWorkspacePointers ws, int head_dim_accum,
                                     int block_n) {
  const int col_blocks = head_dim_accum / 8;
  const int64_t item = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int cb = int(item % col_blocks);
  const int r8 = int((item / col_blocks) % 8);
  const int64_t rest = item / col_blocks / 8;
  const int row_block = int(rest % (block_n / 16));
  const int64_t tail_unit = rest / (block_n / 16);
  if (tail_unit >= ws.tail.tail_units || cb * 8 >= p.head_dim) return;
  const int64_t unit = ws.tail.dp_units + tail_unit;
  const int n_tile = int(unit % ws.key_tiles);
  const int b = int((unit / ws.key_tiles) % p.batch), hk = int(unit / ws.key_tiles / p.batch);
  const SequenceExtent e = sequence_extent(p, b);
#pragma unroll
  for (int which = 0; which < 2; ++which) {  // 0: dK, 1: dV
    const float4* acc = reinterpret_cast<const float4*>(
        ws.dkv_accum + (tail_unit * 2 + which) * block_n * head_dim_accum +
        dq_accum_index(row_block * 16 + r8, cb * 8, head_dim_accum));  // lane 4 r8 of the block: 4 float4 follow
    float4 v[4];  // v[q] = (key r8: columns 2q, 2q + 1; key r8 + 8: columns 2q, 2q + 1)
#pragma unroll
    for (int q = 0; q < 4; ++q) v[q] = acc[q];
    const float s = which == 0 ? p.softmax_scale : 1.f;
    Element* base = static_cast<Element*>(which == 0 ? p.dk : p.dv);
    const int64_t batch_stride = which == 0 ? p.dk_batch_stride : p.dv_batch_stride;
    const int64_t row_stride = which == 0 ? p.dk_row_stride : p.dv_row_stride;
    const int64_t head_stride = which == 0 ? p.dk_head_stride : p.dv_head_stride;
    const int j = n_tile * block_n + row_block * 16 + r8;
    if (j < e.seqlen_k)
      *reinterpret_cast<uint4*>(base + kv_offset(p, batch_stride, row_stride, head_stride, b, e, j, hk) + cb * 8) =
          make_uint4(pack2<Element>(v[0].x * s, v[0].y * s), pack2<Element>(v[1].x * s, v[1].y * s),
                     pack2<Element>(v[2].x * s, v[2].y * s), pack2<Element>(v[3].x * s, v[3].y * s));
    if (j + 8 < e.seqlen_k)
      *reinterpret_cast<uint4*>(base + kv_offset(p, batch_stride, row_stride, head_stride, b, e, j + 8, hk) + cb * 8) =
          make_uint4(pack2<Element>(v[0].z * s, v[0].w * s), pack2<Element>(v[1].z * s, v[1].w * s),
                     pack2<Element>(v[2].z * s, v[2].w * s), pack2<Element>(v[3].z * s, v[3].w * s));
  }
}

// ---------------------------------------------------------------------------------------------
// 2. Main kernel. kTail = false: the whole units, grid (key tiles of the longest sequence, B, Hk), one unit
// per CTA. kTail = true (a tail split, backward_plan.hpp; kernels without dropout only): ws.tail.ctas CTAs
// that share the iterations of the last ws.tail.tail_units units. Two instantiations, so that the
// tail's extra index arithmetic never costs the whole-unit kernel registers (one kernel with both paths
// spilled 24-236 bytes more, sm_90a, 2026-11-30).
template <class Config, bool kTail>
__global__ void __launch_bounds__(Config::kThreads, 1)
    backward_main_kernel(const BackwardParams p, const BackwardWorkspacePointers ws) {
  using T = BackwardTraits<Config>;
  using Element = typename T::Element;
  using KTile = typename T::KTile;
  using QTile = typename T::QTile;
  using STile = typename T::STile;
  constexpr int kBlockM = T::kBlockM, kBlockN = T::kBlockN, kHeadDim = T::kHeadDim, kThreads = T::kThreads;
  static_assert(KTile::kChunksPerBlockRow == QTile::kChunksPerBlockRow, "K and Q tiles share ldmatrix lane offsets");

  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t smem_base = smem_address(smem);
  const uint32_t k_smem = smem_base + T::kKOffset;
  const uint32_t v_smem = smem_base + T::kVOffset;
  const uint32_t ds_smem = smem_base + T::kDsOffset;   // dS^T [key][query], element type
  const uint32_t p_smem = smem_base + T::kPOffset;     // (P * Z)^T, when split over kWarpsD warps
  float* lse_smem = reinterpret_cast<float*>(smem + T::kLseOffset);    // [stage][kBlockM]
  float* dsum_smem = reinterpret_cast<float*>(smem + T::kDsumOffset);  // [stage][kBlockM]

  const int group = p.heads_q / p.heads_k;
  const int chunks_valid = p.head_dim / 8;  // 16-byte chunks of real columns; the rest zero-filled

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group_row = lane / 4, quad = lane % 4;  // mma fragment coordinates (see top of file)
  const int warp_n = warp % T::kWarpsN, warp_d = T::kWarpsD == 1 ? 0 : warp / T::kWarpsN;
  const int key_w0 = warp_n * T::kWarpKeys;           // this warp's keys in the tile
  const int query_w0 = warp_d * T::kQueriesPerWarp;    // its S^T columns
  const int d_w0 = warp_d * T::kDPerWarp;              // its dK / dV columns
  const int dq_m0 = (warp % T::kDqWarpsM) * T::kWarpKeys;    // its dQ rows
  const int dq_d0 = (warp / T::kDqWarpsM) * T::kDqDPerWarp;  // and dQ columns
  // ldmatrix x4 lane patterns: "rows" = lane % 16 (8x8 tiles at rows +0/+8), chunk + lane / 16;
  // "cols" = lane % 8 + 8 (lane / 16) (tiles at rows +0/+8 are the 3rd/4th), chunk + (lane / 8) % 2.
  const int rows_lane_row = (lane % 8) + ((lane >> 3) & 1) * 8, rows_lane_chunk = lane >> 4;
  const int cols_lane_row = (lane % 8) + (lane >> 4) * 8, cols_lane_chunk = (lane >> 3) & 1;
  const LdsmLanes<QTile::kChunksPerBlockRow> qk_rows(rows_lane_row, rows_lane_chunk);  // K/V, dO/Q/K transposed
  const LdsmLanes<QTile::kChunksPerBlockRow> qk_cols(cols_lane_row, cols_lane_chunk);  // Q/dO (B of S^T, dP^T)
  const LdsmLanes<STile::kChunksPerBlockRow> s_rows(rows_lane_row, rows_lane_chunk);   // P^T / dS^T (A)
  const LdsmLanes<STile::kChunksPerBlockRow> s_cols(cols_lane_row, cols_lane_chunk);   // dS^T transposed

  // Iterations [it_first, it_last) of unit `unit` (it_last < 0: all of them). tail_unit >= 0: a unit of the
  // tail split, whose dK / dV are added into dkv_accum instead of written.
  auto run_unit = [&](const int n_tile, const int b, const int hk, const int it_first, int it_last, const int tail_unit) {
    const SequenceExtent e = sequence_extent(p, b);
    const int j0 = n_tile * kBlockN;  // first key of the tile (sequence-relative)
    if (j0 >= e.seqlen_k) return;     // the grid covers the longest sequence; this one is shorter
    const int seqlen_q = e.seqlen_q, seqlen_k = e.seqlen_k;
    __syncthreads();  // a tail CTA's previous unit is done with every shared-memory tile

    // ---- K and V of this tile, once (their own cp.async group, waited for with the first Q tile) ----
    {
      const int rows = seqlen_k - j0 < kBlockN ? seqlen_k - j0 : kBlockN;
      const Element* k = static_cast<const Element*>(p.k) +
                         kv_offset(p, p.k_batch_stride, p.k_row_stride, p.k_head_stride, b, e, j0, hk);
      const Element* v = static_cast<const Element*>(p.v) +
                         kv_offset(p, p.v_batch_stride, p.v_row_stride, p.v_head_stride, b, e, j0, hk);
      // Rows are p.*_row_stride apart: dense or varlen (the backward takes no paged caches).
      load_tile_async<KTile, kThreads>(k_smem, k, p.k_row_stride, rows, chunks_valid);
      load_tile_async<KTile, kThreads>(v_smem, v, p.v_row_stride, rows, chunks_valid);
      cp_async_commit();
    }

    const WindowMask mask(p.window_left, p.window_right, seqlen_q, seqlen_k);
    const TileRange m_range = query_tiles_of_key_tile(mask, seqlen_q, seqlen_k, kBlockM, kBlockN, n_tile);
    const int tiles_per_head = m_range.end - m_range.begin;
    const int iterations = group * tiles_per_head;  // (head of the group, query tile), head-major
    if (it_last < 0) it_last = iterations;

    // Row 0, head 0 of this sequence in q and dout (dense or varlen: rows are *_row_stride apart).
    const Element* q_seq =
        static_cast<const Element*>(p.q) + q_offset(p, p.q_batch_stride, p.q_row_stride, p.q_head_stride, b, e, 0, 0);
    const Element* dout_seq = static_cast<const Element*>(p.dout) +
                              q_offset(p, p.dout_batch_stride, p.dout_row_stride, p.dout_head_stride, b, e, 0, 0);

    // Q, dO, lse_log2, dsum of query head h, tile m into stage `stage`.
    auto load_query_tile = [&](int h, int m, int stage) {
      const int i0 = m * kBlockM;
      const int rows = seqlen_q - i0 < kBlockM ? seqlen_q - i0 : kBlockM;
      // Q and dO rows [i0, i0 + rows) with zero-filled rows past the sequence and columns past D.
      auto load_predicated = [&] {
        load_tile_async<QTile, kThreads>(smem_base + T::kQOffset + stage * QTile::kBytes,
                                         q_seq + h * p.q_head_stride + i0 * p.q_row_stride, p.q_row_stride, rows, chunks_valid);
        load_tile_async<QTile, kThreads>(smem_base + T::kDoOffset + stage * QTile::kBytes,
                                         dout_seq + h * p.dout_head_stride + i0 * p.dout_row_stride, p.dout_row_stride, rows,
                                         chunks_valid);
      };
      if constexpr (T::kLean) {
        if (rows == kBlockM && chunks_valid == QTile::kChunksPerRow) {  // every row and column real: no predicates
          load_whole_tile_async<QTile, kThreads>(smem_base + T::kQOffset + stage * QTile::kBytes,
                                                 q_seq + h * p.q_head_stride + i0 * p.q_row_stride, p.q_row_stride);
          load_whole_tile_async<QTile, kThreads>(smem_base + T::kDoOffset + stage * QTile::kBytes,
                                                 dout_seq + h * p.dout_head_stride + i0 * p.dout_row_stride,
                                                 p.dout_row_stride);
        } else {
          load_predicated();
        }
      } else {
        load_predicated();
      }
      // lse_log2 / dsum: padded rows exist for the whole tile (backward_plan.hpp), 4 floats per copy.
      const int64_t row0 = (int64_t(b) * p.heads_q + h) * ws.padded_seqlen_q + i0;
      for (int c = threadIdx.x; c < 2 * kBlockM / 4; c += kThreads) {
        const bool is_lse = c < kBlockM / 4;
        const int r = (is_lse ? c : c - kBlockM / 4) * 4;
        const float* src = (is_lse ? ws.lse_log2 : ws.dsum) + row0 + r;
        float* dst = (is_lse ? lse_smem : dsum_smem) + stage * kBlockM + r;
        cp_async_16(smem_address(dst), src, true);
      }
    };

    float dk_acc[T::kKeyFrags][T::kAccFrags][4], dv_acc[T::kKeyFrags][T::kAccFrags][4];
#pragma unroll
    for (int kf = 0; kf < T::kKeyFrags; ++kf)
#pragma unroll
      for (int f = 0; f < T::kAccFrags; ++f)
#pragma unroll
        for (int x = 0; x < 4; ++x) dk_acc[kf][f][x] = dv_acc[kf][f][x] = 0.f;

    const float scale_log2 = p.softmax_scale * kLog2e;
    const bool has_softcap = p.softcap > 0.f;
    const float softcap_inv_scale = has_softcap ? p.softmax_scale / p.softcap : 0.f;  // raw q.k -> tanh argument
    const float softcap_log2 = p.softcap * kLog2e;
    const uint32_t dropout_threshold = T::kDropout ? dropout_threshold_u16(p.dropout_p) : 0u;
    const float dropout_rescale = T::kDropout ? 1.f / (1.f - p.dropout_p) : 1.f;

    // kLean: the query tiles that need no mask, found once per unit (backward_plan.hpp).
    TileRange unmasked{m_range.end, m_range.end};
    if constexpr (T::kLean) unmasked = unmasked_query_tiles(mask, seqlen_q, seqlen_k, kBlockM, kBlockN, n_tile, m_range);

    // Iterations run over (query head h of the group, query tile m), head-major.
    int h = hk * group, m_tile = m_range.begin;
    if (it_first > 0) h += it_first / tiles_per_head, m_tile += it_first % tiles_per_head;  // tail: tiles_per_head > 0
    const int count = it_last - it_first;  // iterations of this piece
    if (count > 0) load_query_tile(h, m_tile, 0);
    cp_async_commit();

    for (int it = 0; it < count; ++it) {
      const int stage = it % T::kStages;
      const int i0 = m_tile * kBlockM;
      const bool last_tile_of_head = m_tile + 1 == m_range.end;
      const int h_next = last_tile_of_head ? h + 1 : h;
      const int m_next = last_tile_of_head ? m_range.begin : m_tile + 1;
      // Wait for this stage's copies (and K / V on the first pass); the barrier also tells every warp
      // that the previous iteration is done with the other stage and with dS^T / P^T.
      cp_async_wait<0>();
      __syncthreads();
      if (it + 1 < count) load_query_tile(h_next, m_next, (it + 1) % T::kStages);
      cp_async_commit();

      const uint32_t q_smem = smem_base + T::kQOffset + stage * QTile::kBytes;
      const uint32_t do_smem = smem_base + T::kDoOffset + stage * QTile::kBytes;
      const float* lse_tile = lse_smem + stage * kBlockM;
      const float* dsum_tile = dsum_smem + stage * kBlockM;

      const int i_end = i0 + kBlockM < seqlen_q ? i0 + kBlockM : seqlen_q;
      const int j_end = j0 + kBlockN < seqlen_k ? j0 + kBlockN : seqlen_k;
      // Masks only on tiles that straddle a boundary: the window, or keys past the sequence (their K
      // rows are zero-filled, which would otherwise give exp2(0 - lse) > 0).
      const bool need_mask = T::kLean ? (m_tile < unmasked.begin || m_tile >= unmasked.end)
                                      : (j0 + kBlockN > seqlen_k || !mask.tile_fully_visible(i0, i_end, j0, j_end));
      const float alibi_log2 = alibi_slope(p, b, h) * kLog2e;
      // Interior tiles of plain attention take the short elementwise path (no mask, softcap, ALiBi).
      const bool general = need_mask || has_softcap || alibi_log2 != 0.f;
      const uint32_t dropout_bh = uint32_t(b * p.heads_q + h);

      // The warp's queries in kSplit passes of kSubQueries (fewer live registers; see BackwardTraits).
#pragma unroll 1
      for (int sub = 0; sub < T::kSplit; ++sub) {
        const int sub_q0 = query_w0 + sub * T::kSubQueries;  // first query column of this pass

        // ---- S^T = K Q^T and dP^T = V dO^T: kWarpKeys keys x kSubQueries queries ----
        float s_acc[T::kKeyFrags][T::kSubFrags][4], dp_acc[T::kKeyFrags][T::kSubFrags][4];
#pragma unroll
        for (int kf = 0; kf < T::kKeyFrags; ++kf)
#pragma unroll
          for (int f = 0; f < T::kSubFrags; ++f)
#pragma unroll
            for (int x = 0; x < 4; ++x) s_acc[kf][f][x] = dp_acc[kf][f][x] = 0.f;
#pragma unroll
        for (int kk = 0; kk < kHeadDim / 16; ++kk) {
          // A: 16 keys x 16 head columns per key block; B: Q / dO rows (queries) x the same 16 columns,
          // each B fragment used for every key block of the warp.
          uint32_t k_frag[T::kKeyFrags][4], v_frag[T::kKeyFrags][4];
#pragma unroll
          for (int kf = 0; kf < T::kKeyFrags; ++kf) {
            const uint32_t a_offset = qk_rows.template offset<KTile>(key_w0 + 16 * kf, kk);
            ldmatrix_x4(k_frag[kf], k_smem + a_offset);
            ldmatrix_x4(v_frag[kf], v_smem + a_offset);
          }
#pragma unroll
          for (int f = 0; f < T::kSubFrags; f += 2) {
            const uint32_t b_offset = qk_cols.template offset<QTile>(sub_q0 + f * 8, kk);
            uint32_t q_frag[4], do_frag[4];
            ldmatrix_x4(q_frag, q_smem + b_offset);
            ldmatrix_x4(do_frag, do_smem + b_offset);
#pragma unroll
            for (int kf = 0; kf < T::kKeyFrags; ++kf) {
              mma_m16n8k16<Element>(s_acc[kf][f], k_frag[kf], {q_frag[0], q_frag[1]});
              mma_m16n8k16<Element>(s_acc[kf][f + 1], k_frag[kf], {q_frag[2], q_frag[3]});
              mma_m16n8k16<Element>(dp_acc[kf][f], v_frag[kf], {do_frag[0], do_frag[1]});
              mma_m16n8k16<Element>(dp_acc[kf][f + 1], v_frag[kf], {do_frag[2], do_frag[3]});
            }
          }
        }

        // ---- P, dS elementwise (in place: s_acc becomes P * Z, dp_acc becomes dS) ----
        // kGeneral: mask, softcap and ALiBi (boundary tiles, variants); else scale, exp2 and dropout only.
        auto elementwise = [&](auto general_tag) {
          constexpr bool kGeneral = decltype(general_tag)::value;
#pragma unroll
          for (int f = 0; f < T::kSubFrags; ++f) {
#pragma unroll
            for (int col = 0; col < 2; ++col) {
              const int query_local = sub_q0 + f * 8 + 2 * quad + col;
              const int i = i0 + query_local;
              const float lse2 = lse_tile[query_local];
              const float dsum = dsum_tile[query_local];
#pragma unroll
              for (int kf = 0; kf < T::kKeyFrags; ++kf) {
                const int key_f0 = key_w0 + 16 * kf;  // first key (tile-relative) of this key block
                // One Philox call covers both of this thread's keys of the block (group_row and
                // group_row + 8: the same 32-key block and the same (j / 2) % 4, see core/philox.hpp).
                [[maybe_unused]] Philox4x32 random{};
                if constexpr (T::kDropout)
                  random = dropout_random_block(p.dropout_seed, p.dropout_offset, dropout_bh, uint32_t(i),
                                                uint32_t(j0 + key_f0 + group_row));
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                  const int x = 2 * half + col;  // accumulator element: row group_row + 8 * half, column col
                  const int j = j0 + key_f0 + group_row + 8 * half;
                  const float raw = s_acc[kf][f][x];  // q.k, unscaled
                  float score_log2 = raw * scale_log2, dtanh = 1.f;
                  float prob;
                  if constexpr (kGeneral) {
                    if (has_softcap) {
                      // softcap * tanh(scale * q.k / softcap); its derivative w.r.t. scale * q.k is 1 - tanh^2.
                      const float t = tanhf(raw * softcap_inv_scale);
                      score_log2 = softcap_log2 * t;
                      dtanh = 1.f - t * t;
                    }
                    score_log2 -= alibi_log2 * fabsf(float(i + mask.diagonal - j));
                    prob = exp2_approx(score_log2 - lse2);
                    if (!(j < seqlen_k && mask.visible(i, j))) prob = 0.f;
                  } else {
                    prob = exp2_approx(score_log2 - lse2);
                  }
                  float z = 1.f;  // dropout multiplier
                  if constexpr (T::kDropout)
                    z = dropout_u16_select(random, uint32_t(j)) >= dropout_threshold ? dropout_rescale : 0.f;
                  dp_acc[kf][f][x] = prob * (dp_acc[kf][f][x] * z - dsum) * dtanh;  // dS (w.r.t. scale * q.k, unscaled)
                  s_acc[kf][f][x] = prob * z;                                        // P * Z, for dV
                }
              }
            }
          }
        };
        if (general)
          elementwise(std::true_type{});
        else
          elementwise(std::false_type{});

        // ---- stage dS^T (always: dQ needs every warp's keys) and P^T (when split over warps) ----
#pragma unroll
        for (int kf = 0; kf < T::kKeyFrags; ++kf) {
#pragma unroll
          for (int f = 0; f < T::kSubFrags; ++f) {
            const int chunk = (sub_q0 + f * 8) / 8;
#pragma unroll
            for (int half = 0; half < 2; ++half) {
              const int row = key_w0 + 16 * kf + group_row + 8 * half;
              const uint32_t offset = STile::chunk_offset(row, chunk) + quad * 4;  // 2 elements per quad lane
              const uint32_t ds2 = pack2<Element>(dp_acc[kf][f][2 * half], dp_acc[kf][f][2 * half + 1]);
              asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(ds_smem + offset), "r"(ds2));
              if constexpr (!T::kPInRegisters) {
                const uint32_t p2 = pack2<Element>(s_acc[kf][f][2 * half], s_acc[kf][f][2 * half + 1]);
                asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(p_smem + offset), "r"(p2));
              }
            }
          }
        }

        // ---- one warp holds all queries of its keys: dV += (P Z)^T dO, dK += dS^T Q from registers ----
        if constexpr (T::kPInRegisters) {
#pragma unroll
          for (int kk = 0; kk < T::kSubFrags / 2; ++kk) {
            // The m16n8 accumulators of query blocks 2kk and 2kk+1 are exactly an m16k16 A fragment.
            uint32_t p_frag[T::kKeyFrags][4], ds_frag[T::kKeyFrags][4];
#pragma unroll
            for (int kf = 0; kf < T::kKeyFrags; ++kf) {
              p_frag[kf][0] = pack2<Element>(s_acc[kf][2 * kk][0], s_acc[kf][2 * kk][1]);
              p_frag[kf][1] = pack2<Element>(s_acc[kf][2 * kk][2], s_acc[kf][2 * kk][3]);
              p_frag[kf][2] = pack2<Element>(s_acc[kf][2 * kk + 1][0], s_acc[kf][2 * kk + 1][1]);
              p_frag[kf][3] = pack2<Element>(s_acc[kf][2 * kk + 1][2], s_acc[kf][2 * kk + 1][3]);
              ds_frag[kf][0] = pack2<Element>(dp_acc[kf][2 * kk][0], dp_acc[kf][2 * kk][1]);
              ds_frag[kf][1] = pack2<Element>(dp_acc[kf][2 * kk][2], dp_acc[kf][2 * kk][3]);
              ds_frag[kf][2] = pack2<Element>(dp_acc[kf][2 * kk + 1][0], dp_acc[kf][2 * kk + 1][1]);
              ds_frag[kf][3] = pack2<Element>(dp_acc[kf][2 * kk + 1][2], dp_acc[kf][2 * kk + 1][3]);
            }
            mma_dkdv<T>(dk_acc, dv_acc, p_frag, ds_frag, q_smem, do_smem, sub_q0 + kk * 16, d_w0, qk_rows);
          }
        }
      }
      __syncthreads();  // dS^T (and P^T) of every warp visible

      // ---- split over warps: dV += (P Z)^T dO, dK += dS^T Q with A read back from shared memory ----
      if constexpr (!T::kPInRegisters) {
#pragma unroll
        for (int kk = 0; kk < kBlockM / 16; ++kk) {
          uint32_t p_frag[T::kKeyFrags][4], ds_frag[T::kKeyFrags][4];
#pragma unroll
          for (int kf = 0; kf < T::kKeyFrags; ++kf) {
            const uint32_t a_offset = s_rows.template offset<STile>(key_w0 + 16 * kf, kk);
            ldmatrix_x4(p_frag[kf], p_smem + a_offset);
            ldmatrix_x4(ds_frag[kf], ds_smem + a_offset);
          }
          mma_dkdv<T>(dk_acc, dv_acc, p_frag, ds_frag, q_smem, do_smem, kk * 16, d_w0, qk_rows);
        }
      }

      // ---- dQ_tile = dS K: kWarpKeys query rows x kDqDPerWarp columns per warp, summed over the tile's keys,
      //      in kDqSplit passes of kDqPassFrags column blocks (fewer live registers), each added to dq_accum.
      //      Deterministic mode: the key tiles of one query tile add in index order (semaphore).
      int* semaphore = nullptr;
      if (p.deterministic)
        semaphore = ws.semaphores + (int64_t(b) * p.heads_q + h) * (ws.padded_seqlen_q / kBlockM) + m_tile;
      // Fragment order (dq_accum_index): the accumulator of an m16n8 block is 4 contiguous floats per lane.
      // Block (row block r, column block f) of this warp is (r * kHeadDim / 8 + f) blocks of 128 floats
      // after its first one: compile-time offsets from one pointer. Rows past the sequence add exact
      // zeros (their dS is 0) inside the padded region: no guard needed.
      float* dq_warp = ws.dq_accum + (int64_t(b) * p.heads_q + h) * ws.padded_seqlen_q * kHeadDim +
                       (int64_t((i0 + dq_m0) / 16) * (kHeadDim / 8) + dq_d0 / 8) * 128 + 4 * lane;
#pragma unroll
      for (int pass = 0; pass < T::kDqSplit; ++pass) {
        const int f0 = pass * T::kDqPassFrags;  // first column block (n8) of this pass
        float dq_acc[T::kDqRowFrags][T::kDqPassFrags][4];
#pragma unroll
        for (int r = 0; r < T::kDqRowFrags; ++r)
#pragma unroll
          for (int f = 0; f < T::kDqPassFrags; ++f)
#pragma unroll
            for (int x = 0; x < 4; ++x) dq_acc[r][f][x] = 0.f;
#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; ++kk) {
          // A = dS (queries x keys) read transposed from dS^T [key][query]: keys kk*16.., queries dq_m0..
          uint32_t ds_frag[T::kDqRowFrags][4];
#pragma unroll
          for (int r = 0; r < T::kDqRowFrags; ++r)
            ldmatrix_x4_trans(ds_frag[r], ds_smem + s_cols.template offset<STile>(kk * 16, dq_m0 / 16 + r));
#pragma unroll
          for (int f = 0; f < T::kDqPassFrags; f += 2) {
            uint32_t k_frag[4];  // B = K (keys x head columns), transposed; used for every row block
            ldmatrix_x4_trans(k_frag, k_smem + qk_rows.template offset<KTile>(kk * 16, dq_d0 / 16 + (f0 + f) / 2));
#pragma unroll
            for (int r = 0; r < T::kDqRowFrags; ++r) {
              mma_m16n8k16<Element>(dq_acc[r][f], ds_frag[r], {k_frag[0], k_frag[1]});
              mma_m16n8k16<Element>(dq_acc[r][f + 1], ds_frag[r], {k_frag[2], k_frag[3]});
            }
          }
        }
        if (p.deterministic && pass == 0) {
          const int turn = n_tile - first_key_tile_of_query_tile(mask, kBlockM, kBlockN, m_tile);
          if (threadIdx.x == 0) {
            // Key tiles before ours of this query tile are earlier CTAs of this (b, hk) (lower blockIdx.x,
            // dispatched first), which never wait on later ones: no deadlock.
            while (atomicAdd(semaphore, 0) != turn) __nanosleep(64);
            __threadfence();  // acquire: order our adds after the previous tile's
          }
          __syncthreads();
        }
#pragma unroll
        for (int r = 0; r < T::kDqRowFrags; ++r)
#pragma unroll
          for (int f = 0; f < T::kDqPassFrags; ++f)
            atomic_add_float4(dq_warp + (r * (kHeadDim / 8) + f0 + f) * 128, dq_acc[r][f]);
      }
      if (p.deterministic) {
        __threadfence();  // release: our adds are visible before the next key tile's turn
        __syncthreads();
        if (threadIdx.x == 0) atomicAdd(semaphore, 1);
      }
      h = h_next;
      m_tile = m_next;
    }
    cp_async_wait<0>();

    if (tail_unit >= 0) {
      // ---- tail unit: add dK_acc (unscaled), dV_acc into its dkv_accum block, one 16-byte reduction per
      //      lane and m16n8 block (dq_accum_index order, keys as rows); backward_tail_kernel writes them ----
      float* dk_sum = ws.dkv_accum + int64_t(tail_unit) * 2 * kBlockN * kHeadDim;
      float* dv_sum = dk_sum + kBlockN * kHeadDim;
#pragma unroll
      for (int kf = 0; kf < T::kKeyFrags; ++kf)
#pragma unroll
        for (int f = 0; f < T::kAccFrags; ++f) {
          const int64_t at = (int64_t((key_w0 + 16 * kf) / 16) * (kHeadDim / 8) + (d_w0 + f * 8) / 8) * 128 + 4 * lane;
          atomic_add_float4(dk_sum + at, dk_acc[kf][f]);
          atomic_add_float4(dv_sum + at, dv_acc[kf][f]);
        }
      return;
    }

    // ---- epilogue: dK = scale * dK_acc, dV = dV_acc, keys < seqlen_k and columns < head_dim only ----
    Element* dk = static_cast<Element*>(p.dk);
    Element* dv = static_cast<Element*>(p.dv);
#pragma unroll
    for (int kf = 0; kf < T::kKeyFrags; ++kf) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int j = j0 + key_w0 + 16 * kf + group_row + 8 * half;
        if (j >= seqlen_k) continue;
        const int64_t dk_row = kv_offset(p, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride, b, e, j, hk);
        const int64_t dv_row = kv_offset(p, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride, b, e, j, hk);
#pragma unroll
        for (int f = 0; f < T::kAccFrags; ++f) {
          const int col = d_w0 + f * 8 + 2 * quad;
          if (col >= p.head_dim) continue;
          *reinterpret_cast<uint32_t*>(dk + dk_row + col) = pack2<Element>(dk_acc[kf][f][2 * half] * p.softmax_scale,
                                                                           dk_acc[kf][f][2 * half + 1] * p.softmax_scale);
          *reinterpret_cast<uint32_t*>(dv + dv_row + col) =
              pack2<Element>(dv_acc[kf][f][2 * half], dv_acc[kf][f][2 * half + 1]);
        }
      }
    }
  };  // run_unit

  if constexpr (!kTail) {
    // Whole units: grid (key tiles, B, Hk); the units from ws.tail.dp_units on (in this order, key tile
    // fastest) are the tail split's, run by the kTail launch.
    if (int(blockIdx.x) + ws.key_tiles * (int(blockIdx.y) + p.batch * int(blockIdx.z)) >= int(ws.tail.dp_units)) return;
    run_unit(blockIdx.x, blockIdx.y, blockIdx.z, 0, -1, -1);
  } else {
    // Tail: CTA c walks its equal range [g, g_end) of the tail's iterations (tail unit u's iterations are
    // u * I .. u * I + I - 1, I = ws.tail.unit_iterations), one piece per unit it touches.
    const int64_t unit_iterations = ws.tail.unit_iterations, pieces = ws.tail.tail_units * unit_iterations;
    int64_t g = int64_t(blockIdx.x) * pieces / ws.tail.ctas;
    const int64_t g_end = (int64_t(blockIdx.x) + 1) * pieces / ws.tail.ctas;
    while (g < g_end) {
      const int tail_unit = int(g / unit_iterations);
      const int first = int(g - tail_unit * unit_iterations);
      const int last = int(g_end - g < unit_iterations - first ? first + (g_end - g) : unit_iterations);
      g += last - first;
      const int64_t unit = ws.tail.dp_units + tail_unit;
      run_unit(int(unit % ws.key_tiles), int(unit / ws.key_tiles % p.batch), int(unit / ws.key_tiles / p.batch),
               first, last, tail_unit);
    }
  }
}

}  // namespace flashattn::cuda::sm80::bwd
