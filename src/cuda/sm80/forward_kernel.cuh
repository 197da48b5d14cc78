// The sm80 forward kernel: exact attention with online softmax on mma.sync tensor cores (FlashAttention-2
// style; our own code). Runs on sm_80 and later (compiled as sm_80 and sm_90a machine code).
//
// One CTA computes kBlockM query rows of one (head, sequence); its warps split the rows (kBlockM / kWarps
// each, in m16 tiles). Per key tile of kBlockN rows:
//   S = Q K^T      ldmatrix Q (shared, loaded once) and K (shared, cp.async), mma.m16n8k16, fp32 S fragments
//   transform      softcap / ALiBi through core/mask.hpp's ScoreTransform, only when enabled
//   mask           core/mask.hpp's WindowMask (causal, sliding window) and the key count, only on tiles that
//                  straddle a boundary of a warp's rows; tiles that no query of the CTA sees are never
//                  loaded, and a warp skips the math of tiles that none of its own rows sees
//   softmax        running row max / sum in registers (quad shuffles), exp2 with the scale and log2(e)
//                  folded into one multiplier; O is rescaled only when a row's max grows by more than
//                  kMaxStaleLog2 (lazy rescaling, below), so interior tiles usually skip it
//   dropout        keep bits from core/philox.hpp (one Philox call per row per 32 keys), applied to P before
//                  P V and not to the row sum
//   O += P V       P converted to 16-bit in registers: the m16n8 accumulator layout of S is the A-operand
//                  layout of the next mma, so P never touches shared memory; V read with ldmatrix.trans.
//                  Without dropout the row sums come from the same P fragments times a column of ones
//                  (one more mma per k16 step instead of kBlockN / 4 FADDs per row pair)
// Epilogue: O / rowsum (x 1 / (1 - p) with dropout) through shared memory to 16-byte global stores; LSE.
//
// Warp groups (KernelConfig::kGroupWarps, the manifest's Tile.group_warps). With 1, each warp owns its rows
// alone and reads all of every K and V tile from shared memory for them. With 2 (for D = 256), two warps
// share 32 rows: each computes S for its half of the tile's keys, the two trade their row maxima through
// shared memory (the online softmax needs the max over the whole tile), each writes its half of P (16-bit)
// to shared memory, and each accumulates O for its half of the columns from all of P (its own half from
// registers). Per 32 rows and tile that reads Q 2 x, K 1 x and V 1 x plus P (104 KiB at D = 256, N = 64)
// where 16-row warps read Q 1 x, K 2 x and V 2 x (144 KiB): D = 256 is bound by shared-memory reads, and O
// stays at 128 registers per thread either way (32 rows x 128 columns, or 16 x 256).
//
// Shared memory: Q (kBlockM x kHeadDim), then kStages x (K, V) tiles (kBlockN x kHeadDim each), all
// swizzled (common/smem_tile.cuh); with warp groups, then P (kBlockM x kBlockN) and the exchanged row
// statistics (kBlockM x kGroupWarps floats). kStages = 2: the next tile's K and V load during this tile's math.
// kStages = 1 (less memory): V loads during S = Q K^T and the next K during softmax and P V.
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
#include "cuda/sm80/forward_packing.hpp"
#include "cuda/sm80/forward_split.hpp"

namespace flashattn::cuda::sm80 {

constexpr float kLog2e = 1.4426950408889634f;  // log2(e): exp(x) = exp2(x * kLog2e)
constexpr float kLn2 = 0.6931471805599453f;    // ln(2): converts the log2-domain LSE back to natural log

// Lazy rescaling of the online softmax (affects speed only, never results beyond rounding). The running
// max m of a row only has to bound the scores well enough that exp2(s - m) cannot overflow: O / sum and
// the LSE (m + log2(sum)) are exact for any m. So a row keeps its stale max while the tile's max exceeds it
// by at most kMaxStaleLog2 (log2 units): P and the row sum then hold values up to 2^8 = 256 (fp32 sum and
// 16-bit P have room to spare), and when no row of a warp moved, the warp skips the multiply of all of O
// (kHeadDim / 2 per row) that an eager rescale costs on every tile. Measured (bench/forward_tiles.cu, H200,
// 2026-11-30 05:07 UTC, S = 16k non-causal, TFLOP/s, lazy vs eager, both with whole-tile loads): D = 64
// (m128 n128) 325.5 vs 307.4; D = 128 (m128 n64) 372.4 vs 354.3; D = 256 (m128 n64 w8) 315.5 vs 310.1.
constexpr float kMaxStaleLog2 = 8.f;

// A config may set `static constexpr bool kLazyRescale = false` to get the eager rescale (the tuning
// harness compares both); KernelConfig does not name it, and the default is lazy.
template <typename C, typename = void>
struct LazyRescaleOf : std::true_type {};
template <typename C>
struct LazyRescaleOf<C, std::void_t<decltype(C::kLazyRescale)>> : std::bool_constant<C::kLazyRescale> {};

// Copies rows [0, rows_valid) x 16-byte chunks [0, d_chunks) of a kRows x kHeadDim tile from global memory
// into the swizzled tile at `tile_smem`, zero-filling the rest (rows past the sequence, columns past D), so
// partial tiles contribute exact zeros to both products. `row_offset(r)` is the element offset of row r from
// `gmem`. The threads sweep one column block (SwizzledTile::kBlockCols) at a time: a thread keeps its
// (row % rows-per-pass, chunk) for the whole tile, so its shared addresses are one register plus
// immediates and consecutive threads read consecutive 16-byte chunks of a row (coalesced).
template <int kRows, int kHeadDim, int kThreads, typename Element, typename RowOffset>
__device__ __forceinline__ void load_tile_async(uint32_t tile_smem, const Element* gmem, RowOffset row_offset,
                                                int rows_valid, int d_chunks, int tid) {
  using Tile = SwizzledTile<kRows, kHeadDim>;
  constexpr int kChunksPerBlockRow = Tile::kChunksPerBlockRow;
  constexpr int kRowsPerPass = kThreads / kChunksPerBlockRow;
  static_assert(kThreads % kChunksPerBlockRow == 0 && kRowsPerPass % 8 == 0 && kRows % kRowsPerPass == 0,
                "passes of whole swizzle periods");
  const int row_lane = tid / kChunksPerBlockRow;
  const int chunk_lane = tid % kChunksPerBlockRow;
  const uint32_t lane_part = tile_smem + Tile::lane_offset(row_lane, chunk_lane);
#pragma unroll
  for (int pass = 0; pass < kRows / kRowsPerPass; ++pass) {
    const int row = row_lane + pass * kRowsPerPass;
    const bool row_valid = row < rows_valid;
    const Element* row_src = row_valid ? gmem + row_offset(row) : gmem;  // not read when invalid
#pragma unroll
    for (int block = 0; block < kHeadDim / Tile::kBlockCols; ++block) {
      const int chunk = block * kChunksPerBlockRow + chunk_lane;
      const bool valid = row_valid && chunk < d_chunks;
      cp_async_16(Tile::offset(lane_part, pass * kRowsPerPass, block * kChunksPerBlockRow), valid ? row_src + chunk * 8 : gmem,
                  valid);
    }
  }
}

// The same copy for a whole tile of a dense (or varlen) tensor: every row and chunk valid, rows `row_stride`
// elements apart. No predicates and no selects; a thread's source moves by one 64-bit add per pass, and the
// column blocks are immediate offsets. Interior K/V tiles take this path (about 8 instructions fewer per
// 16-byte copy, i.e. ~100 per tile of the kernel's ~1500 at D = 64, N = 128; SASS, 2026-11-30), which also
// freed the registers that made D = 64, N = 128 spill. Measured (as above, with vs without, lazy rescale on):
// D = 64 325.5 vs 299.3; D = 128 372.4 vs 358.8; D = 256 315.5 vs 300.5 TFLOP/s.
template <int kRows, int kHeadDim, int kThreads, typename Element>
__device__ __forceinline__ void load_full_tile_async(uint32_t tile_smem, const Element* gmem, int64_t row_stride,
                                                     int tid) {
  using Tile = SwizzledTile<kRows, kHeadDim>;
  constexpr int kChunksPerBlockRow = Tile::kChunksPerBlockRow;
  constexpr int kRowsPerPass = kThreads / kChunksPerBlockRow;
  static_assert(kThreads % kChunksPerBlockRow == 0 && kRowsPerPass % 8 == 0 && kRows % kRowsPerPass == 0,
                "passes of whole swizzle periods");
  const int row_lane = tid / kChunksPerBlockRow;
  const int chunk_lane = tid % kChunksPerBlockRow;
  const uint32_t lane_part = tile_smem + Tile::lane_offset(row_lane, chunk_lane);
  const Element* src = gmem + row_lane * row_stride + chunk_lane * 8;
  const int64_t pass_stride = kRowsPerPass * row_stride;
#pragma unroll
  for (int pass = 0; pass < kRows / kRowsPerPass; ++pass) {
#pragma unroll
    for (int block = 0; block < kHeadDim / Tile::kBlockCols; ++block)
      cp_async_16_full(Tile::offset(lane_part, pass * kRowsPerPass, block * kChunksPerBlockRow), src + block * Tile::kBlockCols);
    src += pass_stride;
  }
}

// The copy of one K or V tile of a paged cache row by row (the kPagedKv kernels' path for other block sizes and
// layouts). `row_source(row)` is the first element of tile row `row` in the cache, or nullptr when the row is not to
// be read (past the sequence, or its block id is not a block of the cache). Rows not read are zero-filled, as in
// load_tile_async.
template <int kRows, int kHeadDim, int kThreads, typename Element, typename RowSource>
__device__ __forceinline__ void load_paged_tile_async(uint32_t tile_smem, const Element* gmem, RowSource row_source,
                                                      int rows_valid, int d_chunks, int tid) {
  using Tile = SwizzledTile<kRows, kHeadDim>;
  constexpr int kChunksPerBlockRow = Tile::kChunksPerBlockRow;
  constexpr int kRowsPerPass = kThreads / kChunksPerBlockRow;
  static_assert(kThreads % kChunksPerBlockRow == 0 && kRowsPerPass % 8 == 0 && kRows % kRowsPerPass == 0,
                "passes of whole swizzle periods");
  const int row_lane = tid / kChunksPerBlockRow;
  const int chunk_lane = tid % kChunksPerBlockRow;
  const uint32_t lane_part = tile_smem + Tile::lane_offset(row_lane, chunk_lane);
#pragma unroll
  for (int pass = 0; pass < kRows / kRowsPerPass; ++pass) {
    const int row = row_lane + pass * kRowsPerPass;
    const Element* row_src = row_source(row);
    const bool row_valid = row_src != nullptr && row < rows_valid;
#pragma unroll
    for (int block = 0; block < kHeadDim / Tile::kBlockCols; ++block) {
      const int chunk = block * kChunksPerBlockRow + chunk_lane;
      const bool valid = row_valid && chunk < d_chunks;
      cp_async_16(Tile::offset(lane_part, pass * kRowsPerPass, block * kChunksPerBlockRow), valid ? row_src + chunk * 8 : gmem,
                  valid);
    }
  }
}

// The copy of one K or V tile of a paged cache addressed by pool rows (the kPagedKv kernels' slot rows, see the
// kernel): lane l of `slot_pool_rows` holds the pool row of the first key of the tile's slot l (16 rows), and
// `lane_src` is this thread's element of pool row 0 (its row within a slot and its chunk folded in), so a pass costs
// one shuffle and one row-stride product over a dense tile's copy. kWhole: every row inside the sequence and
// D == kHeadDim, no predicates; else rows from rows_valid and chunks from d_chunks on are zero-filled.
template <int kRows, int kHeadDim, int kThreads, bool kWhole, typename Element>
__device__ __forceinline__ void load_pool_tile_async(uint32_t tile_smem, const Element* lane_src, int64_t row_stride,
                                                     uint32_t slot_pool_rows, int rows_valid, int d_chunks, int tid) {
  using Tile = SwizzledTile<kRows, kHeadDim>;
  constexpr int kChunksPerBlockRow = Tile::kChunksPerBlockRow;
  constexpr int kRowsPerPass = kThreads / kChunksPerBlockRow;
  static_assert(kThreads % kChunksPerBlockRow == 0 && kRowsPerPass % 16 == 0 && kRows % kRowsPerPass == 0,
                "passes of whole 16-row slots");
  const int row_lane = tid / kChunksPerBlockRow;
  const int chunk_lane = tid % kChunksPerBlockRow;
  const uint32_t lane_part = tile_smem + Tile::lane_offset(row_lane, chunk_lane);
#pragma unroll
  for (int pass = 0; pass < kRows / kRowsPerPass; ++pass) {
    const int row = row_lane + pass * kRowsPerPass;
    const uint32_t pool_row = __shfl_sync(0xffffffffu, slot_pool_rows, row >> 4);  // every lane, every pass
    const Element* src = lane_src + int64_t(pool_row) * row_stride;
#pragma unroll
    for (int block = 0; block < kHeadDim / Tile::kBlockCols; ++block) {
      const uint32_t smem_chunk = Tile::offset(lane_part, pass * kRowsPerPass, block * kChunksPerBlockRow);
      if constexpr (kWhole) {
        cp_async_16_full(smem_chunk, src + block * Tile::kBlockCols);
      } else {
        const bool valid = row < rows_valid && block * kChunksPerBlockRow + chunk_lane < d_chunks;
        cp_async_16(smem_chunk, valid ? src + block * Tile::kBlockCols : lane_src, valid);
      }
    }
  }
}

// A config may set `static constexpr bool kFullTileLoads = false` to load every tile through the predicated
// path (the tuning harness's baseline); the default takes load_full_tile_async for whole dense tiles.
template <typename C, typename = void>
struct FullTileLoadsOf : std::true_type {};
template <typename C>
struct FullTileLoadsOf<C, std::void_t<decltype(C::kFullTileLoads)>> : std::bool_constant<C::kFullTileLoads> {};

// Row sums from the tensor cores (see sum_acc in the kernel), an option that is OFF by default: it sums the
// 16-bit P that P V uses instead of the fp32 P, so the row sum, and with it the returned LSE, carries the
// 16-bit rounding of P (relative 2^-9 per term for bf16, not averaged away on peaky rows). The GPU test at
// S = 128k measured lse rel_l2 1.7e-5 against its 1e-5 bound (H200, 2026-11-30 06:07 UTC), where fp32 sums
// pass; the LSE feeds the backward and any merge of partial attentions, so it stays exact. Speed it would
// buy (bench/forward_tiles.cu, H200, 2026-11-30 05:19 UTC, S = 16k non-causal / causal TFLOP/s with /
// without): D = 64 336.7 / 329.5 vs 323.2 / 313.6; D = 128 388.3 / 363.6 vs 377.6 / 350.5; D = 256
// (m64 n64 w4 s1) 321.6 / 331.1 vs 315.1 / 323.7. A config may set `kSumByMma = true` (never with dropout).
template <typename C, typename = void>
struct SumByMmaOf : std::false_type {};
template <typename C>
struct SumByMmaOf<C, std::void_t<decltype(C::kSumByMma)>> : std::bool_constant<C::kSumByMma> {};

// A config may set `static constexpr bool kCompactEpilogue = true` (WithCompactEpilogue below): the output
// stores of the epilogue address each row from one base (q_offset is linear in the row) in a rolled loop, which
// cuts the straight-line code every CTA runs once, after its loop, by about 1000 instructions at D = 128. Short
// calls gain: their CTAs are short, and ncu saw a third of their epilogue's warp samples waiting on
// instruction fetch (H200, 2026-12-01 03:28 UTC, D = 128, S = 512). Long calls lose: ptxas then allocates the
// main loop differently (fewer uniform-datapath instructions, more IMADs), 1-2% at S = 16k. Hence an option
// of short-call rows (FORWARD_TILES, max_seqlen); affects speed only.
template <typename C, typename = void>
struct CompactEpilogueOf : std::false_type {};
template <typename C>
struct CompactEpilogueOf<C, std::void_t<decltype(C::kCompactEpilogue)>> : std::bool_constant<C::kCompactEpilogue> {};
template <typename Base>
struct WithCompactEpilogue : Base {
  static constexpr bool kCompactEpilogue = true;
};

// A config may set `static constexpr bool kPagedKv = true` (WithPagedKv below): the instantiation for paged K/V
// (block_table set; dispatch sends it only such calls). It reads the block ids of a K/V tile a tile ahead, one per
// 16-row slot, addresses rows by their row in the block pool (load_pool_tile_async), and never dereferences an id
// outside [0, num_blocks). Without it, a kernel reads paged K/V through kv_offset: a table load and two integer
// divisions per row of every tile, waited on where the copies are issued (0.46-0.69x dense on an H200, 2026-12-02
// 17:12 UTC; with it 0.91-0.99x, 22:44 UTC). The other kernels' machine code is unchanged by it (every paged step sits
// under `if constexpr (kPagedKv)`; their SASS compared equal, 2026-12-02). Affects speed and bad-id handling only.
template <typename C, typename = void>
struct PagedKvOf : std::false_type {};
template <typename C>
struct PagedKvOf<C, std::void_t<decltype(C::kPagedKv)>> : std::bool_constant<C::kPagedKv> {};
template <typename Base>
struct WithPagedKv : Base {
  static constexpr bool kPagedKv = true;
};

// A config may set `static constexpr bool kSplitKv = true` (WithSplitKv below): the instantiation for split-KV calls
// (flash-decoding for the forward: a call whose CTAs would leave SMs idle, e.g. a chunk of 128 prompt tokens over 32k
// cached keys, is 32 CTAs of 32k keys each on 132 SMs). The grid's x is then query tiles x splits; split s of a query tile
// takes an even share of that tile's key tiles, and the epilogue writes, instead of out and lse, the share's partial
// result in float32: O / rowsum, and the LSE in log2 units, at params.out / params.lse laid out as forward_split.hpp
// says (the launcher points them at the split partials). forward_combine.cu then merges the shares through their LSEs.
// A varlen call runs from a work list instead (forward_split.hpp): x is an item (sequence, query tile, split, the
// sequence's splits) of the list its plan kernel wrote, the partials are per item, and an item of a sequence of one
// split writes out and lse as the unsplit kernel does.
// No dropout (the manifest gives it no such rows). The other kernels' machine code is unchanged by it (every step sits
// under `if constexpr (kSplitKv)`). Affects speed only (the merge changes rounding).
template <typename C, typename = void>
struct SplitKvOf : std::false_type {};
template <typename C>
struct SplitKvOf<C, std::void_t<decltype(C::kSplitKv)>> : std::bool_constant<C::kSplitKv> {};
template <typename Base>
struct WithSplitKv : Base {
  static constexpr bool kSplitKv = true;
};

// The rows that may run a call GQA-packed (forward_packing.hpp; the manifest's gqa_packing rows, KernelEntry::gqa_packing):
// those short calls take. The others never read pack_gqa, and their code is as without it.
template <typename C, typename = void>
struct GqaPackingOf : std::false_type {};
template <typename C>
struct GqaPackingOf<C, std::void_t<decltype(C::kGqaPacking)>> : std::bool_constant<C::kGqaPacking> {};
template <typename Base>
struct WithGqaPacking : Base {
  static constexpr bool kGqaPacking = true;
};

// A config may set `static constexpr int kMinBlocksPerSm` (launch bounds: ptxas then caps registers at
// 64K / (kThreads * kMinBlocksPerSm)); default 1, i.e. up to 255 registers.
template <typename C, typename = void>
struct MinBlocksOf : std::integral_constant<int, 1> {};
template <typename C>
struct MinBlocksOf<C, std::void_t<decltype(C::kMinBlocksPerSm)>> : std::integral_constant<int, C::kMinBlocksPerSm> {};

// Shared memory after Q and the K / V stages that warp groups use to trade P and the row statistics.
template <typename C>
constexpr int forward_exchange_smem_bytes() {
  return C::kGroupWarps == 1 ? 0 : C::kBlockM * C::kBlockN * 2 + C::kBlockM * C::kGroupWarps * 4;
}

template <typename C>
__global__ void __launch_bounds__(C::kThreads, MinBlocksOf<C>::value) forward_kernel(const __grid_constant__ AttentionParams params,
                                                                                   const ForwardSplitWork work) {
  using Element = typename C::Element;
  constexpr int kBlockM = C::kBlockM;
  constexpr int kBlockN = C::kBlockN;
  constexpr int kHeadDim = C::kHeadDim;
  constexpr int kThreads = C::kThreads;
  constexpr int kGroupWarps = C::kGroupWarps;  // warps sharing one group of query rows (see the header)
  constexpr int kGroupRows = kBlockM / (C::kWarps / kGroupWarps);  // query rows of a warp's group
  constexpr int kMTiles = kGroupRows / 16;       // m16 row tiles per warp
  constexpr int kWarpKeys = kBlockN / kGroupWarps;  // keys of a tile whose scores this warp computes
  constexpr int kNTiles = kWarpKeys / 8;         // n8 key tiles of this warp's S
  constexpr int kWarpCols = kHeadDim / kGroupWarps;  // columns of O this warp accumulates
  constexpr int kDTiles = kWarpCols / 8;         // n8 column tiles of this warp's O
  constexpr int kQKSteps = kHeadDim / 16;        // k16 steps of S = Q K^T
  constexpr int kPVSteps = kWarpKeys / 16;       // k16 steps of O += P V per warp's share of the keys
  constexpr bool kLazyRescale = LazyRescaleOf<C>::value;
  constexpr bool kFullTileLoads = FullTileLoadsOf<C>::value;
  constexpr bool kSumByMma = SumByMmaOf<C>::value;
  constexpr bool kCompactEpilogue = CompactEpilogueOf<C>::value;
  constexpr bool kSplitKv = SplitKvOf<C>::value;
  static_assert(!(kSumByMma && C::kDropout), "the row sum is of the undropped P: with dropout it needs the FADDs");
  static_assert(!(kSplitKv && C::kDropout), "split-KV rows have no dropout");
  constexpr bool kGqaPacking = GqaPackingOf<C>::value;
  static_assert(!(kGqaPacking && C::kDropout), "packed rows have no dropout (the Philox stream is per query head)");
  using QTile = SwizzledTile<kBlockM, kHeadDim>;
  using KVTile = SwizzledTile<kBlockN, kHeadDim>;
  using PTile = SwizzledTile<kGroupRows, kBlockN>;  // P of one warp group (warp groups only)
  static_assert(kGroupRows % 16 == 0, "each warp group owns whole m16 tiles");
  static_assert(kDTiles % 2 == 0 && kNTiles % 2 == 0, "ldmatrix.x4 loads two n8 tiles at once");
  static_assert(kGroupWarps == 1 || kGroupWarps == 2, "warps work alone or in pairs");
  static_assert(C::kWarps % kGroupWarps == 0 && C::kWarps / kGroupWarps <= 15, "whole groups, one named barrier each");
  static_assert(kGroupWarps == 1 || (kWarpCols % KVTile::kBlockCols == 0 && !kSumByMma),
                "a warp's columns are whole swizzle blocks; row sums by FADDs (partial sums are traded)");
  static_assert(!C::kDropout || kWarpKeys % 32 == 0, "a warp's keys are whole Philox blocks of 32");

  extern __shared__ __align__(128) uint8_t smem[];
  const uint32_t q_smem = smem_address(smem);
  const uint32_t kv_smem = q_smem + QTile::kBytes;  // stage s: K at kv_smem + 2 s KVTile::kBytes, V after it

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int group = warp / kGroupWarps;  // this warp's group of query rows
  const int part = warp % kGroupWarps;   // its share of a group: keys [part kWarpKeys, +kWarpKeys) of S,
                                         // columns [part kWarpCols, +kWarpCols) of O
  const int quad_row = lane >> 2;  // accumulator row (and row + 8) of this thread in an m16 tile
  const int quad_col = lane & 3;   // accumulator columns 2 quad_col, 2 quad_col + 1 of an n8 tile

  // Heaviest query tiles first (causal): the tail of the grid is then made of short CTAs. kSplitKv: x = query tile x
  // splits + split (the launcher's grid is query tiles x splits wide), or, a work-list call (varlen; forward_split.hpp),
  // x = the item of the list this CTA takes: its sequence, query tile, split and the sequence's split count.
  // GQA packing (forward_packing.hpp): `pack` rows per query row, the grid's y a K/V head; the CTA's rows are packed
  // rows (query row r / pack of query head hk pack + r % pack). Unpacked, pack = 1 and a row is a query row of head h.
  const int pack = kGqaPacking ? gqa_pack_factor(params) : 1;
  const bool work_list = kSplitKv && work.items != nullptr;
  const SplitWorkItem cta = [&]() -> SplitWorkItem {
    const int tile_linear = int(gridDim.x) - 1 - int(blockIdx.x);
    if constexpr (kSplitKv) {
      if (work_list) return work.items[blockIdx.x];
      const int splits = int(gridDim.x) / ((params.seqlen_q * pack + kBlockM - 1) / kBlockM);
      return SplitWorkItem{int(blockIdx.z), tile_linear / splits, tile_linear % splits, splits};
    }
    return SplitWorkItem{int(blockIdx.z), tile_linear, 0, 1};
  }();
  if constexpr (kSplitKv)
    if (cta.b < 0) return;  // past the work list's end
  const int num_splits = cta.splits;
  const int m_block = cta.m_block;
  const int split = cta.split;
  const int h = blockIdx.y;  // the query head; packed: the K/V head
  const int b = cta.b;
  const SequenceExtent ext = sequence_extent(params, b);
  const int rows_total = ext.seqlen_q * pack;  // this sequence's rows (packed rows when packed)
  const int row_begin = m_block * kBlockM;
  if (row_begin >= rows_total) return;  // varlen: this sequence is shorter than max_seqlen_q
  // Paged varlen: a sequence of at most routed_seqlen_q rows (decode tokens) is the decode kernels' in this call
  // (src/cuda/decode/kvcache.cpp, run_short_sequences). Only the paged instantiation can be handed such a call.
  if constexpr (PagedKvOf<C>::value)
    if (ext.seqlen_q <= int(params.routed_seqlen_q)) return;
  const int hk = pack > 1 ? h : h / (params.heads_q / params.heads_k);  // GQA / MQA: the K/V head of query head h
  const int rows_valid = min(kBlockM, rows_total - row_begin);
  // The query row and the query head of row r (of the sequence's rows, packed or not).
  auto query_of = [&](int r) { return packed_query_row(r, pack); };
  auto head_of = [&](int r) { return pack > 1 ? packed_query_head(r, hk, pack) : h; };
  const int d_chunks = params.head_dim / 8;  // D may be below the bucket kHeadDim: the rest is zero-filled

  // Key tiles that some query of this CTA sees; all others are skipped without being loaded.
  const WindowMask mask(params.window_left, params.window_right, ext.seqlen_q, ext.seqlen_k);
  const int key_begin = mask.key_begin(query_of(row_begin));
  const int key_end = mask.key_end(kGqaPacking ? query_of(row_begin + rows_valid - 1) + 1 : row_begin + rows_valid,
                                   ext.seqlen_k);
  const int tile_n_begin = key_begin / kBlockN;
  const int tile_n_end = key_end > key_begin ? (key_end + kBlockN - 1) / kBlockN : tile_n_begin;
  // kSplitKv: this CTA's share, tiles [split x share, (split + 1) x share) of the query tile's, counted from its first; a
  // share past the last tile is empty (its rows' partials become O = 0, LSE = -inf, which the merge weighs 0).
  const int split_share = kSplitKv ? (tile_n_end - tile_n_begin + num_splits - 1) / num_splits : 0;
  const int n_begin = kSplitKv ? min(tile_n_end, tile_n_begin + split * split_share) : tile_n_begin;
  const int n_end = kSplitKv ? min(tile_n_end, n_begin + split_share) : tile_n_end;
  const int num_tiles = n_end - n_begin;

  const Element* q_gmem = static_cast<const Element*>(params.q);
  const Element* k_gmem = static_cast<const Element*>(params.k);
  const Element* v_gmem = static_cast<const Element*>(params.v);
  // K/V row addressing: dense and varlen rows are linear in the key index (offset of key 0 plus j rows);
  // paged rows go through the block table, one lookup per row.
  const bool paged = params.block_table != nullptr;
  const int64_t k_key0_offset =
      paged ? 0 : kv_offset(params, params.k_batch_stride, params.k_row_stride, params.k_head_stride, b, ext, 0, hk);
  const int64_t v_key0_offset =
      paged ? 0 : kv_offset(params, params.v_batch_stride, params.v_row_stride, params.v_head_stride, b, ext, 0, hk);
  // Whole tiles (all kBlockN keys inside the sequence, D == kHeadDim) of dense / varlen K and V.
  const bool full_columns = kFullTileLoads && !paged && d_chunks == QTile::kChunksPerRow;
  // Paged K/V, the kPagedKv kernels. The fast path ("slot rows"): power-of-two block sizes >= 16 (all the usual ones)
  // in a cache whose blocks are runs of rows (block stride = block size x row stride, the [num_blocks, block, Hk, D]
  // layout, both K and V). 16-aligned rows then lie in one block, so a tile needs one block id per 16-row slot, and a
  // row is addressed by its row in the whole pool, id x block size + row in block (32 bits): one row stride from a
  // per-thread base, as in a dense tensor. Lane l < kSlots of every warp holds slot l's id, read from the table when
  // the previous tile's K is issued (a tile of math before it is used, so the table's latency never stalls the
  // copies), and turns it into the slot's pool row when the tile's K is issued; a thread takes its row's pool row
  // with one shuffle per pass. Other blocks read each row's id where it is copied (paged_row: a division per row).
  // An id outside [0, num_blocks) is never dereferenced (slot rows: its slot reads pool row 0 instead; per row: its
  // rows load as zeros), and the CTA's out and lse become NaN (bad_block_id, the epilogue).
  constexpr bool kPagedKv = PagedKvOf<C>::value;
  constexpr int kSlots = kBlockN / 16;  // 16-row slots of a K/V tile
  static_assert(kSlots <= 32 && (!kPagedKv || (kThreads / KVTile::kChunksPerBlockRow) % 16 == 0),
                "a warp register holds a tile's slots; a copy pass covers whole slots (a thread's row in its slot is fixed)");
  const int page_size = kPagedKv ? params.page_block_size : 1;
  const int page_shift = kPagedKv ? __ffs(page_size) - 1 : 0;
  const bool slot_rows = kPagedKv && page_size >= 16 && (page_size & (page_size - 1)) == 0 &&
                         params.k_batch_stride == int64_t(page_size) * params.k_row_stride &&
                         params.v_batch_stride == int64_t(page_size) * params.v_row_stride &&
                         params.num_blocks > 0 && int64_t(params.num_blocks) * page_size <= int64_t(INT32_MAX);
  bool bad_block_id = false;  // this thread met a block id of the sequence that is not a block of the cache
  // slot_rows: the id of slot `lane` of tile n_block (0 past the sequence or the CTA's tiles: never used there).
  auto slot_id = [&](int n_block) -> int32_t {
    const int j = n_block * kBlockN + lane * 16;
    if (n_block < n_begin || lane >= kSlots || j >= ext.seqlen_k) return 0;
    return params.block_table[int64_t(b) * params.block_table_batch_stride + (j >> page_shift)];
  };
  // slot_rows: the pool row of the first key of slot `lane` of tile n_block, given its id (a bad id: pool row 0, whose
  // rows are copied but never matter, the CTA's result being NaN).
  auto slot_pool_row = [&](int32_t id, int n_block) -> uint32_t {
    const int j = n_block * kBlockN + lane * 16;
    const bool ok = uint32_t(id) < uint32_t(params.num_blocks);  // also catches negative ids
    if (!ok && lane < kSlots && j < ext.seqlen_k) bad_block_id = true;
    return ok ? (uint32_t(id) << page_shift) + uint32_t(j & (page_size - 1)) : 0u;
  };
  int32_t k_ids = 0;         // slot_rows: the slot ids (lane l: slot l) of the tile whose K is copied next
  uint32_t v_pool_rows = 0;  // and the slot pool rows of the tile whose V is copied next (a tile's K comes first)
  if (slot_rows) k_ids = slot_id(n_end - 1);
  // slot_rows: this thread's element of pool row 0 (its row within a slot, as every pass covers whole slots, and its
  // 16-byte chunk; head hk) in K and V.
  const int kv_row_lane = tid / KVTile::kChunksPerBlockRow;
  const int kv_chunk_lane = tid % KVTile::kChunksPerBlockRow;
  auto lane_pool_src = [&](const Element* gmem, int64_t row_stride, int64_t head_stride) {
    return gmem + int64_t(hk) * head_stride + int64_t(kv_row_lane & 15) * row_stride + kv_chunk_lane * 8;
  };
  auto load_pool = [&](const Element* lane_src, int64_t row_stride, uint32_t pool_rows, int n_block, uint32_t tile_smem) {
    const int keys_valid = min(kBlockN, ext.seqlen_k - n_block * kBlockN);
    if (keys_valid == kBlockN && d_chunks == QTile::kChunksPerRow)
      load_pool_tile_async<kBlockN, kHeadDim, kThreads, true>(tile_smem, lane_src, row_stride, pool_rows, keys_valid,
                                                              d_chunks, tid);
    else
      load_pool_tile_async<kBlockN, kHeadDim, kThreads, false>(tile_smem, lane_src, row_stride, pool_rows, keys_valid,
                                                               d_chunks, tid);
  };
  // Other paged caches: row `row` of the tile at key0 (`row_stride`, `block_stride`, head hk), or nullptr (not read).
  auto paged_row = [&](const Element* gmem, int64_t block_stride, int64_t row_stride, int64_t head_stride, int key0,
                       int row) -> const Element* {
    const int j = key0 + row;
    if (j >= ext.seqlen_k) return nullptr;
    const int block = j / page_size;
    const int32_t id = params.block_table[int64_t(b) * params.block_table_batch_stride + block];
    if (uint32_t(id) >= uint32_t(params.num_blocks)) {
      bad_block_id = true;
      return nullptr;
    }
    return gmem + int64_t(id) * block_stride + int64_t(j - block * page_size) * row_stride + int64_t(hk) * head_stride;
  };
  auto load_paged_rows = [&](const Element* gmem, int64_t block_stride, int64_t row_stride, int64_t head_stride,
                             int n_block, uint32_t tile_smem) {
    const int key0 = n_block * kBlockN;
    const int keys_valid = min(kBlockN, ext.seqlen_k - key0);
    load_paged_tile_async<kBlockN, kHeadDim, kThreads>(
        tile_smem, gmem, [&](int row) { return paged_row(gmem, block_stride, row_stride, head_stride, key0, row); },
        keys_valid, d_chunks, tid);
  };
  auto load_k = [&](int n_block, uint32_t tile_smem) {
    if constexpr (kPagedKv) {
      if (slot_rows) {
        const uint32_t pool_rows = slot_pool_row(k_ids, n_block);
        load_pool(lane_pool_src(k_gmem, params.k_row_stride, params.k_head_stride), params.k_row_stride, pool_rows,
                  n_block, tile_smem);
        v_pool_rows = pool_rows;       // this tile's V comes next
        k_ids = slot_id(n_block - 1);  // the next tile's ids: read now, a tile of math ahead of their use
      } else {
        load_paged_rows(k_gmem, params.k_batch_stride, params.k_row_stride, params.k_head_stride, n_block, tile_smem);
      }
      return;
    }
    const int key0 = n_block * kBlockN;
    const int keys_valid = min(kBlockN, ext.seqlen_k - key0);
    if (full_columns && keys_valid == kBlockN) {
      load_full_tile_async<kBlockN, kHeadDim, kThreads>(tile_smem, k_gmem + k_key0_offset + int64_t(key0) * params.k_row_stride,
                                                        params.k_row_stride, tid);
    } else if (paged) {
      load_tile_async<kBlockN, kHeadDim, kThreads>(
          tile_smem, k_gmem,
          [&](int r) {
            return kv_offset(params, params.k_batch_stride, params.k_row_stride, params.k_head_stride, b, ext, key0 + r, hk);
          },
          keys_valid, d_chunks, tid);
    } else {
      load_tile_async<kBlockN, kHeadDim, kThreads>(
          tile_smem, k_gmem + k_key0_offset + int64_t(key0) * params.k_row_stride,
          [&](int r) { return int64_t(r) * params.k_row_stride; }, keys_valid, d_chunks, tid);
    }
  };
  auto load_v = [&](int n_block, uint32_t tile_smem) {
    if constexpr (kPagedKv) {
      if (slot_rows)
        load_pool(lane_pool_src(v_gmem, params.v_row_stride, params.v_head_stride), params.v_row_stride, v_pool_rows,
                  n_block, tile_smem);
      else
        load_paged_rows(v_gmem, params.v_batch_stride, params.v_row_stride, params.v_head_stride, n_block, tile_smem);
      return;
    }
    const int key0 = n_block * kBlockN;
    const int keys_valid = min(kBlockN, ext.seqlen_k - key0);
    if (full_columns && keys_valid == kBlockN) {
      load_full_tile_async<kBlockN, kHeadDim, kThreads>(tile_smem, v_gmem + v_key0_offset + int64_t(key0) * params.v_row_stride,
                                                        params.v_row_stride, tid);
    } else if (paged) {
      load_tile_async<kBlockN, kHeadDim, kThreads>(
          tile_smem, v_gmem,
          [&](int r) {
            return kv_offset(params, params.v_batch_stride, params.v_row_stride, params.v_head_stride, b, ext, key0 + r, hk);
          },
          keys_valid, d_chunks, tid);
    } else {
      load_tile_async<kBlockN, kHeadDim, kThreads>(
          tile_smem, v_gmem + v_key0_offset + int64_t(key0) * params.v_row_stride,
          [&](int r) { return int64_t(r) * params.v_row_stride; }, keys_valid, d_chunks, tid);
    }
  };
  auto k_stage = [&](int stage) { return kv_smem + uint32_t(stage) * 2u * KVTile::kBytes; };
  auto v_stage = [&](int stage) { return kv_smem + uint32_t(stage) * 2u * KVTile::kBytes + KVTile::kBytes; };
  // Warp groups: this group's P tile and its row statistics (kGroupWarps x kGroupRows floats).
  const uint32_t p_smem = kv_smem + uint32_t(C::kStages) * 2u * KVTile::kBytes + uint32_t(group) * PTile::kBytes;
  const uint32_t stats_smem = kv_smem + uint32_t(C::kStages) * 2u * KVTile::kBytes + uint32_t(kBlockM * kBlockN * 2) +
                              uint32_t(group * kGroupWarps * kGroupRows * 4);
  auto group_barrier = [&] { named_barrier_sync(1 + group, 32 * kGroupWarps); };

  // Scores reach the softmax as s * score_log2_scale in log2 units. Fast path: s is the raw q.k and the
  // softmax scale is folded into the one multiplier. With softcap / ALiBi (or a negative scale, whose
  // sign would flip the max) s is first transformed into natural-log units.
  const bool natural_units = params.softcap > 0.f || params.alibi_slopes != nullptr || params.softmax_scale < 0.f;
  // ALiBi's slope is per query head: packed calls have none (gqa_packing_allowed).
  const ScoreTransform transform{params.softcap, alibi_slope(params, b, h), ext.seqlen_k - ext.seqlen_q};
  const float score_log2_scale = natural_units ? kLog2e : params.softmax_scale * kLog2e;

  float o_acc[kMTiles][kDTiles][4];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
      for (int c = 0; c < 4; ++c) o_acc[mt][dt][c] = 0.f;
  float row_max[kMTiles][2];  // running max of s over the keys seen, per accumulator row (-inf: none yet)
  float row_sum[kMTiles][2];  // running sum of exp2(s * scale - max), this thread's columns only
  // kSumByMma: the row sums come from the tensor cores instead, as P times a column of ones (one extra
  // m16n8k16 per k16 step of P V, which replaces kBlockN / 4 FADDs per row pair); every column of the n8
  // result holds the whole row's sum (of the 16-bit P that P V uses), so no quad reduction at the end.
  float sum_acc[kMTiles][4];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      row_max[mt][half] = -INFINITY;
      row_sum[mt][half] = 0.f;
      sum_acc[mt][2 * half] = sum_acc[mt][2 * half + 1] = 0.f;
    }
  // Per-lane parts of the ldmatrix addresses (see SwizzledTile::offset): A (Q) rows lane % 16 and chunk
  // lane / 16; B (K) keys lane % 8 + 8 (lane / 16) and chunk (lane / 8) % 2; B (V, transposed) keys
  // lane % 8 + 8 ((lane / 8) % 2) and chunk lane / 16.
  const uint32_t q_lane = QTile::lane_offset(lane & 15, lane >> 4);
  // With warp groups, K's lane part starts at this warp's keys and V's at its columns (whole swizzle blocks).
  const uint32_t k_lane =
      KVTile::lane_offset((lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1) + KVTile::offset(0, part * kWarpKeys, 0);
  const uint32_t v_lane =
      KVTile::lane_offset((lane & 7) + (((lane >> 3) & 1) << 3), lane >> 4) + KVTile::offset(0, 0, part * kWarpCols / 8);
  const uint32_t p_lane = PTile::lane_offset(lane & 15, lane >> 4);  // A of P (warp groups): as Q's
  // Row (within the sequence's rows: a packed row when packed) of accumulator row `half` of m16 tile `mt` of this thread.
  auto query_row = [&](int mt, int half) { return row_begin + group * kGroupRows + mt * 16 + quad_row + 8 * half; };

  // This warp's query rows. A warp skips the math of key tiles that none of its rows sees (the far side
  // of a causal / window diagonal, rows past the end of a partial tile) and masks only the tiles that
  // straddle its rows' boundaries; it still takes part in every load and barrier.
  const int warp_row_begin = row_begin + group * kGroupRows;
  const int warp_row_end = min(warp_row_begin + kGroupRows, rows_total);
  const bool warp_has_rows = warp_row_begin < warp_row_end;
  // ... and the query rows they are: [warp_query_begin, warp_query_end) (packed rows: each query row's `pack` heads).
  const int warp_query_begin = kGqaPacking ? (warp_has_rows ? query_of(warp_row_begin) : 0) : warp_row_begin;
  const int warp_query_end = kGqaPacking ? (warp_has_rows ? query_of(warp_row_end - 1) + 1 : 0) : warp_row_end;
  const int warp_key_begin = warp_has_rows ? mask.key_begin(warp_query_begin) : 0;
  const int warp_key_end = warp_has_rows ? mask.key_end(warp_query_end, ext.seqlen_k) : 0;

  // ---- prologue: Q and the first key tile (the last one: tiles run from n_end - 1 down to n_begin, so
  // the diagonal / partial tile that needs a mask comes first) ----
  if (num_tiles > 0) {
    if (pack > 1)  // packed: each row its own query row and head
      load_tile_async<kBlockM, kHeadDim, kThreads>(
          q_smem, q_gmem,
          [&](int r) {
            return q_offset(params, params.q_batch_stride, params.q_row_stride, params.q_head_stride, b, ext,
                            query_of(row_begin + r), head_of(row_begin + r));
          },
          rows_valid, d_chunks, tid);
    else
      load_tile_async<kBlockM, kHeadDim, kThreads>(
          q_smem,
          q_gmem + q_offset(params, params.q_batch_stride, params.q_row_stride, params.q_head_stride, b, ext, row_begin, h),
          [&](int r) { return int64_t(r) * params.q_row_stride; }, rows_valid, d_chunks, tid);
    load_k(n_end - 1, k_stage(0));
    if constexpr (C::kStages == 2) load_v(n_end - 1, v_stage(0));
    cp_async_commit();
  }

  // ---- the steps of one key tile (the main loop below runs them in order) ----
  using ScoreFrags = float[kMTiles][kNTiles][4];  // S (then P) of one key tile, m16n8 accumulator layout
  // Warp-uniform: some row of this warp sees some key of the tile at key0 (else the warp skips its math).
  // Uniform over a warp group too (same rows), so both warps of a group take the group barriers or neither.
  auto warp_sees = [&](int key0) { return key0 < warp_key_end && key0 + kBlockN > warp_key_begin; };

  // S = Q K^T (fp32) from the K tile at k_tile.
  auto compute_scores = [&](ScoreFrags& s_acc, uint32_t k_tile) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) s_acc[mt][nt][c] = 0.f;
#pragma unroll
    for (int ks = 0; ks < kQKSteps; ++ks) {
      uint32_t q_frag[kMTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)  // A: rows +lane % 16, chunk 2 ks + lane / 16
        ldmatrix_x4(q_frag[mt], q_smem + QTile::offset(q_lane, group * kGroupRows + mt * 16, 2 * ks));
#pragma unroll
      for (int np = 0; np < kNTiles / 2; ++np) {
        // B for key tiles 2np, 2np + 1: matrices (keys +0..7, d chunk 2ks), (+0..7, 2ks+1), (+8..15, 2ks), (+8..15, 2ks+1)
        uint32_t k_frag[4];
        ldmatrix_x4(k_frag, k_tile + KVTile::offset(k_lane, np * 16, 2 * ks));
        const uint32_t b_lo[2] = {k_frag[0], k_frag[1]};
        const uint32_t b_hi[2] = {k_frag[2], k_frag[3]};
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          mma_m16n8k16<Element>(s_acc[mt][2 * np], q_frag[mt], b_lo);
          mma_m16n8k16<Element>(s_acc[mt][2 * np + 1], q_frag[mt], b_hi);
        }
      }
    }
  };

  // Score transform and mask (uniform branches: only when enabled / on boundary tiles) of this warp's keys
  // [key0, key0 + kWarpKeys).
  auto transform_and_mask = [&](ScoreFrags& s_acc, int key0) {
    if (natural_units) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
          for (int c = 0; c < 4; ++c)
            s_acc[mt][nt][c] = transform(s_acc[mt][nt][c] * params.softmax_scale, query_of(query_row(mt, c >> 1)),
                                         key0 + nt * 8 + 2 * quad_col + (c & 1));
    }
    const bool tile_needs_mask =
        key0 + kWarpKeys > ext.seqlen_k || !mask.tile_fully_visible(warp_query_begin, warp_query_end, key0, key0 + kWarpKeys);
    if (tile_needs_mask) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          // Row i sees keys [key_begin(i), key_end(i + 1)) (WindowMask's bounds for a one-row range, clamped
          // to the sequence): two compares per score, against offsets relative to this thread's first column.
          const int i = query_of(query_row(mt, half));
          const int first_col = key0 + 2 * quad_col;
          const int visible_begin = mask.key_begin(i) - first_col;
          const int visible_end = mask.key_end(i + 1, ext.seqlen_k) - first_col;
#pragma unroll
          for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int col = nt * 8 + e;  // compile-time
              if (col < visible_begin || col >= visible_end) s_acc[mt][nt][2 * half + e] = -INFINITY;
            }
        }
    }
  };

  // Warp groups: the max (is_max) or the sum over the group's warps of a per-row value (row
  // `mt * 16 + quad_row + 8 half` of the group), through the group's statistics in shared memory, in the
  // fixed order of the parts (so every warp of the group gets the same bits).
  auto group_reduce = [&](float (&value)[kMTiles][2], bool is_max) {
    if (quad_col == 0)
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half)
          st_shared_b32(stats_smem + uint32_t((part * kGroupRows + mt * 16 + quad_row + 8 * half) * 4),
                        __float_as_uint(value[mt][half]));
    group_barrier();  // the other warps' values are written
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const uint32_t row_addr = stats_smem + uint32_t((mt * 16 + quad_row + 8 * half) * 4);
        float total = ld_shared_f32(row_addr);
#pragma unroll
        for (int w = 1; w < kGroupWarps; ++w) {
          const float other = ld_shared_f32(row_addr + uint32_t(w * kGroupRows * 4));
          total = is_max ? fmaxf(total, other) : total + other;
        }
        value[mt][half] = total;
      }
    // No barrier after the reads: the next write to these statistics comes after this group's next
    // group_barrier (P's, or the next tile's), which no warp passes before every warp has done these reads.
  };

  // Online softmax, dropout and O += P V of the (transformed, masked) tile: this warp's keys start at
  // warp_key0; the V tile is at v_tile.
  auto softmax_and_pv = [&](ScoreFrags& s_acc, int warp_key0, uint32_t v_tile) {
    // ---- online softmax: P = exp2(s * scale - max), rescale O and the sum when the max grows ----
    float tile_max[kMTiles][2];  // max of s over the tile's keys per row (over the whole group's keys)
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float m = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) m = fmaxf(m, fmaxf(s_acc[mt][nt][2 * half], s_acc[mt][nt][2 * half + 1]));
        tile_max[mt][half] = quad_max(m);  // the 4 threads of a quad hold the row's columns
      }
    // Every warp of a group then moves its max identically (same inputs, same rule), so its O columns and
    // its partial row sum keep one common scale.
    if constexpr (kGroupWarps > 1) group_reduce(tile_max, /*is_max=*/true);
    float correction[kMTiles][2];  // factor of O and the sum of each row: exp2(old max - new max), or 1
    bool rescale_any = false;      // some row of this thread moved its max on this tile
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float old_max = row_max[mt][half];
        const float new_max = fmaxf(old_max, tile_max[mt][half]);
        // Lazy: move the max only when the tile's scores exceed the stale one by more than kMaxStaleLog2.
        // First visible tile: new - (-inf) = +inf, moves. A row with no visible key yet: -inf - (-inf) is
        // NaN, the compare is false and the max stays -inf.
        const bool rescale = !kLazyRescale || (new_max - old_max) * score_log2_scale > kMaxStaleLog2;
        // A row that so far sees only masked keys keeps max = -inf; subtracting 0 instead gives
        // exp2(-inf) = 0 for its entries, where -inf - (-inf) would give NaN.
        const float row_max_now = rescale ? new_max : old_max;
        const float max_scaled = row_max_now == -INFINITY ? 0.f : row_max_now * score_log2_scale;
        correction[mt][half] = rescale ? exp2_approx(old_max * score_log2_scale - max_scaled) : 1.f;  // 0 on the first visit
        rescale_any |= rescale;
        row_max[mt][half] = row_max_now;
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float p = exp2_approx(fmaf(s_acc[mt][nt][2 * half + e], score_log2_scale, -max_scaled));
            s_acc[mt][nt][2 * half + e] = p;
          }
      }
    // Warp-uniform branch (a vote): rows of one quad decide alike, and the skip pays only when the whole warp skips.
    if (!kLazyRescale || __any_sync(0xffffffffu, rescale_any)) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          row_sum[mt][half] *= correction[mt][half];
          if constexpr (kSumByMma) sum_acc[mt][2 * half] *= correction[mt][half];
#pragma unroll
          for (int dt = 0; dt < kDTiles; ++dt) {
            o_acc[mt][dt][2 * half] *= correction[mt][half];
            o_acc[mt][dt][2 * half + 1] *= correction[mt][half];
          }
        }
    }
    if constexpr (!kSumByMma) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
          for (int nt = 0; nt < kNTiles; ++nt)  // the undropped probability: dropout rescales, it does not renormalise
            row_sum[mt][half] += s_acc[mt][nt][2 * half] + s_acc[mt][nt][2 * half + 1];
    }

    // ---- dropout: zero the dropped probabilities (the 1 / (1 - p) factor is applied once, at the end) ----
    if constexpr (C::kDropout) {
      const uint32_t threshold = dropout_threshold_u16(params.dropout_p);
      const uint32_t bh = uint32_t(b * params.heads_q + h);
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
          for (int block32 = 0; block32 < kWarpKeys / 32; ++block32) {
            // One call gives the 8 keys 8n + 2 quad_col + e (n = 0..3, e = 0..1) of this 32-key block:
            // exactly this thread's columns of n8 tiles 4 block32 + n (see core/philox.hpp).
            const Philox4x32 random = dropout_random_block(params.dropout_seed, params.dropout_offset, bh,
                                                           uint32_t(query_row(mt, half)),
                                                           uint32_t(warp_key0 + block32 * 32 + 2 * quad_col));
#pragma unroll
            for (int n = 0; n < 4; ++n)
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                const uint32_t u16 = (random.x[n] >> (16 * e)) & 0xFFFFu;  // dropout_u16_of_key for that key
                if (u16 < threshold) s_acc[mt][block32 * 4 + n][2 * half + e] = 0.f;
              }
          }
    }

    // ---- O += P V: S accumulators become A fragments in registers; V via ldmatrix.trans ----
    // One k16 step: P's A fragments of 16 keys (V rows key_row..) times this warp's columns of V.
    auto pv_step = [&](const uint32_t (&p_frag)[kMTiles][4], int key_row) {
#pragma unroll
      for (int dp = 0; dp < kDTiles / 2; ++dp) {
        // B for d tiles 2dp, 2dp + 1 (transposed): matrices (keys +0..7, chunk 2dp), (+8..15, 2dp), (+0..7, 2dp+1), (+8..15, 2dp+1)
        uint32_t v_frag[4];
        ldmatrix_x4_trans(v_frag, v_tile + KVTile::offset(v_lane, key_row, 2 * dp));
        const uint32_t b_lo[2] = {v_frag[0], v_frag[1]};
        const uint32_t b_hi[2] = {v_frag[2], v_frag[3]};
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          mma_m16n8k16<Element>(o_acc[mt][2 * dp], p_frag[mt], b_lo);
          mma_m16n8k16<Element>(o_acc[mt][2 * dp + 1], p_frag[mt], b_hi);
        }
      }
      if constexpr (kSumByMma) {
        const uint32_t ones = ElementTraits<Element>::pack(1.f, 1.f);
        const uint32_t b_ones[2] = {ones, ones};
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) mma_m16n8k16<Element>(sum_acc[mt], p_frag[mt], b_ones);
      }
    };
    if constexpr (kGroupWarps > 1) {
      // Share this warp's P (its keys' columns of the group's P tile); 16-bit, as P V uses it.
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
          for (int nt = 0; nt < kNTiles; ++nt)
            st_shared_b32(p_smem + PTile::chunk_offset(mt * 16 + quad_row + 8 * half, part * kNTiles + nt) + quad_col * 4,
                          ElementTraits<Element>::pack(s_acc[mt][nt][2 * half], s_acc[mt][nt][2 * half + 1]));
    }
#pragma unroll
    for (int ks = 0; ks < kPVSteps; ++ks) {  // this warp's keys: P from registers
      // A of m16n8k16 (rows g, g + 8; k 2t.. and 2t + 8..) = S tiles 2ks (keys +0..7) and 2ks + 1 (+8..15):
      // register r holds rows g (r even) or g + 8 (r odd) of tile 2ks + r / 2.
      uint32_t p_frag[kMTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int r = 0; r < 4; ++r)
          p_frag[mt][r] = ElementTraits<Element>::pack(s_acc[mt][2 * ks + r / 2][2 * (r % 2)], s_acc[mt][2 * ks + r / 2][2 * (r % 2) + 1]);
      pv_step(p_frag, part * kWarpKeys + ks * 16);
    }
    if constexpr (kGroupWarps > 1) {
      group_barrier();  // the other warps' P is written (and, one tile on, read: see group_reduce)
#pragma unroll
      for (int w = 1; w < kGroupWarps; ++w) {
        const int other = (part + w) % kGroupWarps;
#pragma unroll
        for (int ks = 0; ks < kPVSteps; ++ks) {  // the other warps' keys: P from shared memory
          uint32_t p_frag[kMTiles][4];
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt)
            ldmatrix_x4(p_frag[mt], p_smem + PTile::offset(p_lane, mt * 16, 2 * (other * kPVSteps + ks)));
          pv_step(p_frag, other * kWarpKeys + ks * 16);
        }
      }
    }
  };

  // ---- main loop: one key tile per iteration, S, softmax, P V in order ----
  for (int it = 0; it < num_tiles; ++it) {
    const int n_block = n_end - 1 - it;
    const int key0 = n_block * kBlockN;
    const int stage = C::kStages == 2 ? (it & 1) : 0;
    const uint32_t k_tile = k_stage(stage);
    const uint32_t v_tile = v_stage(stage);
    if constexpr (C::kStages == 2) {
      cp_async_wait<0>();  // this thread's copies of tile `it` (issued one iteration ago) have landed
      __syncthreads();     // everyone's have; and every warp is done with tile it - 1, whose stage we refill now
      if (it + 1 < num_tiles) {
        load_k(n_block - 1, k_stage(stage ^ 1));
        load_v(n_block - 1, v_stage(stage ^ 1));
      }
      cp_async_commit();
    } else {
      cp_async_wait<0>();  // K of this tile (and Q) have landed
      __syncthreads();     // for every thread; and every warp is done with P V of the previous tile's V
      load_v(n_block, v_tile);
      cp_async_commit();
    }

    const bool warp_sees_tile = warp_sees(key0);  // warp-uniform
    ScoreFrags s_acc;
    if (warp_sees_tile) compute_scores(s_acc, k_tile);

    if constexpr (C::kStages == 1) {
      cp_async_wait<0>();  // V of this tile has landed
      __syncthreads();     // for every thread; and every warp is done reading K: refill it with the next tile
      if (it + 1 < num_tiles) load_k(n_block - 1, k_tile);
      cp_async_commit();
    }

    if (!warp_sees_tile) {  // nothing of this tile is visible to this warp's rows: O, max, sum unchanged
      // A skipping group still passes its two group barriers (its own id, its own warps only: no wait on
      // anyone else), so that every group passes the same barriers between __syncthreads. Not needed for
      // correctness; it keeps compute-sanitizer racecheck from false reports (common/ptx.cuh).
      if constexpr (kGroupWarps > 1) {
        group_barrier();
        group_barrier();
      }
      continue;
    }
    transform_and_mask(s_acc, key0 + part * kWarpKeys);
    softmax_and_pv(s_acc, key0 + part * kWarpKeys, v_tile);
  }

  // ---- epilogue: normalise, LSE, O through this warp's own Q rows of shared memory to 16-byte stores ----
  const float keep_scale = C::kDropout ? 1.f / (1.f - params.dropout_p) : 1.f;
  // Compact epilogue: the LSE and O offsets of row_begin; both are linear in the row (dense and varlen).
  const int64_t lse_tile = kCompactEpilogue ? lse_offset(params, b, ext, row_begin, h) : 0;
  float sums[kMTiles][2];  // the row sums (of this warp's keys, then of the group's)
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) sums[mt][half] = kSumByMma ? sum_acc[mt][2 * half] : quad_sum(row_sum[mt][half]);
  // Paged: a block id outside the cache met by any thread of the CTA makes all of its rows NaN (out and lse), so a
  // corrupt table is visible, never a silently wrong attention over zeros.
  const bool poisoned = kPagedKv && __syncthreads_or(bad_block_id);
  // Warp groups: the partial sums share one max per row (see softmax_and_pv), so they add. The barrier in it
  // also means every warp of the group has done its last read of the group's Q rows (overwritten below).
  if constexpr (kGroupWarps > 1) group_reduce(sums, /*is_max=*/false);
  // kSplitKv: the share's partials, except for a work-list item of a sequence of one split (its rows' out and lse).
  if (kSplitKv && (!work_list || num_splits > 1)) {
    // The share's partial result, float32 (forward_split.hpp's layouts): O / rowsum straight from the accumulators (a
    // quad's 4 threads store a row's 8 consecutive columns of an n8 tile: whole 32-byte sectors), and the LSE in log2
    // units. A row that saw no key of this share: O = 0, LSE = -inf; a poisoned CTA (bad block id): NaN, which the
    // merge carries into out and lse. Grid mode: rows of query heads at params.out / params.lse; work list: rows of
    // the item's tile at work.o_partial / work.lse_partial.
    float* const o_partial = work_list ? work.o_partial : static_cast<float*>(params.out);
    float* const lse_partial = work_list ? work.lse_partial : params.lse;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = query_row(mt, half);
        if (r >= rows_total) continue;
        const float sum = sums[mt][half];
        const bool no_visible_key = sum == 0.f;
        const float inv = poisoned ? NAN : (no_visible_key ? 0.f : 1.f / sum);
        const int64_t partial_row = work_list ? work_partial_row(blockIdx.x, gridDim.y, h, kBlockM, r - row_begin)
                                              : split_partial_row(params, split, b, head_of(r), query_of(r));
        if (part == 0 && quad_col == 0)
          lse_partial[partial_row] =
              poisoned ? NAN : (no_visible_key ? -INFINITY : row_max[mt][half] * score_log2_scale + log2f(sum));
        float* const o_row = o_partial + partial_row * params.head_dim_v;
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) {
          const int col = part * kWarpCols + dt * 8 + 2 * quad_col;
          if (col < params.head_dim_v)
            *reinterpret_cast<float2*>(o_row + col) = make_float2(o_acc[mt][dt][2 * half] * inv, o_acc[mt][dt][2 * half + 1] * inv);
        }
      }
  } else {  // out and lse
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float sum = sums[mt][half];
        // sum == 0 only when the row saw no visible key: O = 0 and LSE = -inf, never NaN. A NaN sum
        // means a NaN input reached the row: it propagates to O and LSE (the NaN/Inf policy).
        const bool no_visible_key = sum == 0.f;
        const float inv = poisoned ? NAN : (no_visible_key ? 0.f : keep_scale / sum);
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) {
          o_acc[mt][dt][2 * half] *= inv;
          o_acc[mt][dt][2 * half + 1] *= inv;
        }
        const int r = query_row(mt, half);
        if (params.lse != nullptr && part == 0 && quad_col == 0 && r < rows_total)
          params.lse[kCompactEpilogue && pack == 1 ? lse_tile + int64_t(r - row_begin) * params.lse_row_stride
                                                   : lse_offset(params, b, ext, query_of(r), head_of(r))] =
              poisoned ? NAN : (no_visible_key ? -INFINITY : (row_max[mt][half] * score_log2_scale + log2f(sum)) * kLn2);
      }
    // Each warp group reads only its own Q rows (A operands), so after its last ldmatrix it may overwrite
    // them; each warp writes (and then stores) only its own columns of them.
    constexpr int kWarpChunks = kWarpCols / 8;  // 16-byte chunks of a row of this warp's O columns
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = group * kGroupRows + mt * 16 + quad_row + 8 * half;
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) {
          const uint32_t packed = ElementTraits<Element>::pack(o_acc[mt][dt][2 * half], o_acc[mt][dt][2 * half + 1]);
          *reinterpret_cast<uint32_t*>(smem + QTile::chunk_offset(row, part * kWarpChunks + dt) + quad_col * 4) = packed;
        }
      }
    __syncwarp();
    Element* out_gmem = static_cast<Element*>(params.out);
    constexpr int kOutChunksPerLane = kGroupRows * kWarpChunks / 32;
    static_assert((kGroupRows * kWarpChunks) % 32 == 0, "whole 16-byte chunks per lane");
    if (kCompactEpilogue && pack == 1) {
      Element* const out_tile = out_gmem + q_offset(params, params.out_batch_stride, params.out_row_stride,
                                                    params.out_head_stride, b, ext, row_begin, h);
#pragma unroll 1
      for (int k = 0; k < kOutChunksPerLane; ++k) {
        const int id = lane + 32 * k;  // consecutive lanes store consecutive chunks of a row: coalesced
        const int row = group * kGroupRows + id / kWarpChunks;
        const int chunk = part * kWarpChunks + id % kWarpChunks;
        if (row < rows_valid && chunk < d_chunks)
          *reinterpret_cast<uint4*>(out_tile + int64_t(row) * params.out_row_stride + chunk * 8) =
              *reinterpret_cast<const uint4*>(smem + QTile::chunk_offset(row, chunk));
      }
    } else {  // the same stores, unrolled, each addressed from scratch: the long-call kernels keep the code they were
              // measured with (see kCompactEpilogue); packed rows each have their own query row and head
#pragma unroll
      for (int k = 0; k < kOutChunksPerLane; ++k) {
        const int id = lane + 32 * k;
        const int row = group * kGroupRows + id / kWarpChunks;
        const int chunk = part * kWarpChunks + id % kWarpChunks;
        if (row < rows_valid && chunk < d_chunks) {
          const uint4 value = *reinterpret_cast<const uint4*>(smem + QTile::chunk_offset(row, chunk));
          const int64_t offset = q_offset(params, params.out_batch_stride, params.out_row_stride, params.out_head_stride, b,
                                          ext, query_of(row_begin + row), head_of(row_begin + row));
          *reinterpret_cast<uint4*>(out_gmem + offset + chunk * 8) = value;
        }
      }
    }
  }
}

}  // namespace flashattn::cuda::sm80
