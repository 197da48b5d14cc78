// The split-KV decode attention kernel (flash-decoding on mma.sync tensor cores; our own code). Runs on
// sm_80 and later (compiled as sm_80 and sm_90a machine code).
//
// One CTA per (m-block, split) x K/V head x sequence (grid: m_blocks * num_splits, Hk, B). Its M dimension
// is kBlockM "packed rows": the G = Hq / Hk query heads of the K/V head times the new tokens, row
// r = i * G + g (decode_work.hpp), so each K/V tile is read from memory once for the whole group. Decode is
// memory-bound: the kernel's job is to stream the split's K/V tiles at HBM bandwidth.
//   loads      K/V tiles of kBlockN keys through a kStages-deep cp.async ring (swizzled shared memory,
//              common/smem_tile.cuh); paged caches (the kPaged instantiation) read the block ids of
//              kTilesPerIdBatch tiles at once, a batch ahead, one per 16-row slot (power-of-two block sizes
//              >= 16; else one per row, a tile ahead), so the table's latency never stalls the copies (split
//              0 reads its first batch beside cache_seqlens; contiguous caches: split 0 copies Q and its
//              first tiles before cache_seqlens has arrived, the "early tiles"; every other split, paged ones
//              too, guesses its length and first block ids while it waits for the previous grid and copies
//              its first tiles right after the wait, kept if the real values agree: the "speculative
//              tiles"; the lines of cache_seqlens and of the table are prefetched into L2 during that wait
//              as well); blocks that are runs of rows (the usual
//              [num_blocks, block, Hk, D] layout, DecodeArgs::paged_rows) are addressed by their row in the
//              pool, one shuffle plus a contiguous cache's address per row; with 16-bit caches, 64-key tiles,
//              full-width heads and 32-bit strides every tile of such a cache takes that path ("lean paged copies", a tile
//              loop of its own: zero-fill past the key count, bad ids checked once per id batch)
//   S = Q K^T  the kWarps warps split each tile's keys (kWarpKeys each); every warp owns all kBlockM rows
//   mask       core/mask.hpp's WindowMask (causal within the new tokens, sliding window, the key count) and in the
//              kLeftPad kernel PaddedWindowMask (cache_leftpad: rows below it are never read, and load as zeros in
//              a tile), only on warp slices that straddle a boundary; softcap / ALiBi through ScoreTransform when enabled
//   softmax    online, per warp, exp2 with the scale and log2(e) folded into one multiplier; O rescaled
//              lazily (kMaxStaleLog2)
//   O += P V   P stays in registers (accumulator layout = A-operand layout); V via ldmatrix.trans
// Epilogue: the warps' (max, sum, O) are merged through shared memory; then either the final output (out in
// the dtype, lse) when the sequence uses one split, or the split's normalised fp32 partial and its LSE (in log2
// units): in global memory for the combine kernel (decode_aux.cu), or, on sm_90 with a cluster per m-block, in
// shared memory, merged by the cluster's CTAs through distributed shared memory (no second kernel).
//
// FP8 cache (C::kFp8Cache): the ring holds the K/V tiles as streamed, e4m3 codes (half the bytes; an fp8 row of D
// codes is laid out as a 16-bit SwizzledTile row of D / 2 columns, so the load code is the same). The MMAs read
// the codes straight from the ring with the 16-bit ldmatrix and convert them in registers (fp8_convert.cuh,
// exact): no 16-bit copy of the tile, no extra barrier. The fragments then come in other orders: Q is stored
// with each 16-column group permuted, and O's even and odd columns land in separate n8 tiles
// (fp8_layout.hpp says why and where; the S and O += P V loops use them).
// The MMAs run in fp16 whatever q's type (an e4m3 code becomes fp16 in one instruction, bf16 in four): a bf16 q
// is stored as fp16 times a power of two per CTA, which the softmax scale takes back (exact).
// The dequantisation scales cost nothing per element: k_scale is folded into the softmax scale, v_scale into
// the final 1 / rowsum.
//
// Index safety without host checks (cache_seqlens, cache_leftpad and block_table are device memory): a sequence
// whose cache_seqlens entry is outside [0, capacity - S_new], or whose cache_leftpad entry is outside [0,
// cache_seqlens], gets NaN in out and lse and nothing is read for it; a block id outside [0, num_blocks) is never
// dereferenced (its rows load as zeros) and makes the CTA's result NaN. The opt-in checked mode
// (fa_kvcache_args.check_indices, src/cuda/decode/kvcache.cpp) reports these as errors before any kernel writes.
#pragma once

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "core/mask.hpp"
#include "core/params.hpp"
#include "cuda/common/ptx.cuh"
#include "cuda/common/smem_tile.cuh"
#include "cuda/decode/cache_rows.cuh"
#include "cuda/decode/decode_config.cuh"
#include "cuda/decode/decode_work.hpp"
#include "cuda/decode/fp8_convert.cuh"
#include "cuda/decode/fp8_layout.hpp"

namespace flashattn::cuda::decode {

constexpr float kLog2e = 1.4426950408889634f;  // log2(e): exp(x) = exp2(x * kLog2e)
// Lazy rescaling (affects speed only): a row's running max moves only when a tile's scores exceed it by more
// than this many log2 units, so P and the row sum stay below 2^8 and most tiles skip the multiply of O.
constexpr float kMaxStaleLog2 = 8.f;
// Paged: block-table rows of at most this many entries (32 per 128-byte line) are prefetched into L2 at the
// start (affects speed only).
constexpr int kPrefetchTableEntries = 1024;

// a * b as a 64-bit byte offset from one IMAD.WIDE.U32, for factors known to be in [0, 2^31): a row or block
// index of the plain load path (ids checked, rows below the key count) and a byte stride below 2^31 (strides
// are non-negative: src/api/validate.cpp; the plain path takes strides_32bit only). Signed
// 64-bit products cost 3-4 integer instructions each, and the paged path takes 4 per row (SASS, 2026-11-30).
// kPtx (16-bit caches): PTX's mul.wide.u32. In C++, `uint64_t(a) * b` with b widened once outside the tile loop
// became a 64 x 64-bit multiply (SASS, sm_90a, 2026-12-01). FP8 caches keep the C++ form (see "lean copy
// addresses" at decode_kernel below).
template <bool kPtx>
__device__ __forceinline__ uint64_t wide_product(uint32_t a, uint32_t b) {
  if constexpr (kPtx) {
    uint64_t product;
    asm("mul.wide.u32 %0, %1, %2;" : "=l"(product) : "r"(a), "r"(b));
    return product;
  } else {
    return uint64_t(a) * b;
  }
}
// x itself, through a shuffle from the thread's own lane (every lane of the warp active): ptxas then keeps it in
// registers instead of rebuilding it from the kernel parameters in every tile.
__device__ __forceinline__ uint64_t opaque_u64(uint64_t x, int lane) {
  const uint32_t lo = __shfl_sync(0xffffffffu, uint32_t(x), lane), hi = __shfl_sync(0xffffffffu, uint32_t(x >> 32), lane);
  return uint64_t(hi) << 32 | lo;
}

// kPaged: the cache is paged (args.p.block_table != null). kLeftPad: the call has left padding (args.p.cache_leftpad !=
// null; contiguous caches only, the host refuses it with a paged one). The launcher picks the instantiation.
// Launch bounds: C::kMinCtasPerSm (decode_config.cuh) is 0, "no bound", for 16-bit caches (ptxas's own register
// choice) and 2 or 3 for FP8 caches (see there).
template <typename C, bool kPaged, bool kLeftPad>
__global__ void __launch_bounds__(C::kThreads, C::kMinCtasPerSm) decode_kernel(const __grid_constant__ DecodeArgs args) {
  using Element = typename C::Element;
  constexpr int kBlockM = C::kBlockM;
  constexpr int kBlockN = C::kBlockN;
  constexpr int kHeadDim = C::kHeadDim;
  constexpr int kThreads = C::kThreads;
  constexpr int kWarps = C::kWarps;
  constexpr int kStages = C::kStages;
  constexpr int kWarpKeys = C::kWarpKeys;
  constexpr int kMTiles = kBlockM / 16;       // m16 row tiles (every warp owns all of them)
  constexpr int kNTiles = kWarpKeys / 8;      // n8 key tiles of this warp's slice of S
  constexpr int kDTiles = kHeadDim / 8;       // n8 column tiles of O
  constexpr int kQKSteps = kHeadDim / 16;     // k16 steps of S = Q K^T
  constexpr int kPVSteps = kWarpKeys / 16;    // k16 steps of O += P V
  using QTile = SwizzledTile<kBlockM, kHeadDim>;
  constexpr bool kFp8 = C::kFp8Cache;
  // Lean copy addresses (16-bit caches): the plain copies' row bases stay in registers (opaque_u64) and their products
  // are PTX mul.wide.u32 (wide_product<true>); with them, every cache works a paged pass's slot lane out unsigned
  // (pass_pool_row; FP8 caches too: 0.994-1.014x against main, 2026-12-02 02:06 UTC,
  // ...-0206-h200-decode-fp8-unsigned-slot-lane-ab-summary.txt).
  // ptxas then gives the D = 128 tile 149 registers instead of 128 and a 4-byte spill, and 4% fewer instructions
  // (sm_90a). Affects speed only. H200, the library against main, 3 alternating runs, medians:
  // - 2026-12-02 01:35 UTC (bench/results/2026-12-02-0135-h200-decode-lean-addresses-ab-summary.txt; with the
  //   one-CTA split cap of decode_plan.hpp): 32 / 8 D = 128, the issue's points, contiguous 1.001-1.046 (B = 1 / 32k
  //   36.72 -> 36.09 us, B = 4 / 8k 36.46 -> 35.68, B = 256 / 1k 250.9 -> 245.7), paged 0.987-1.019; 8 / 1 B = 1-4
  //   0.996-1.094; FP8 (these plain forms) 0.983-1.007.
  // - 01:23 UTC, every cache lean (...-0123-h200-decode-lean-all-caches-ab-summary.txt): D = 64 0.993-1.077, D = 256
  //   0.998-1.040, 28 / 4 and MHA 0.996-1.036; FP8 paged 0.978-0.992 (mul.wide alone took the paged FP8 kernel from
  //   185 to 195 registers), so FP8 caches keep the plain forms.
  constexpr bool kLean = !kFp8;
  // cache_leftpad (a key floor per sequence) in an instantiation of its own, so that the kernels of calls without it
  // are the code they were before it: with the floor read in every kernel, calls without padding ran slower against
  // main (bf16 paged B = 16 / 1k 1.6-2.0%, FP8 paged B = 1 / 32k 4.0% at 182 -> 198 registers; H200, 2026-12-04 20:35
  // and 20:49 UTC, bench/results/2026-12-04-2035-*, -2049-*), and with it in the contiguous kernels only, FP8 caches
  // lost 1.5-3.2% at four of eight points (20:23-21:24 UTC, docs/PERFORMANCE.md). So the kernels for calls without it
  // are byte for byte those of main built with an unused 8-byte field in KvcacheParams, sm_90a and sm_80 (every decode
  // kernel, bench/cubin_diff.py; bench/results/2026-12-04-2246-decode-leftpad-kernel-cubin-identity.txt). A change
  // here should keep that: compare the cubins (compiled locally with -cubin) as that file says.
  // The kLeftPad kernel runs only for calls with cache_leftpad, yet tests `p.cache_leftpad == nullptr` where the
  // padding turns the early and speculative tiles off, as a runtime test: with those paths compiled out ptxas gave
  // its bf16 D = 128 (m16n64) instance 128 registers and a 16-byte spill, so 152 and none (ptxas -v, sm_90a).
  static_assert(!(kPaged && kLeftPad), "cache_leftpad: contiguous caches only");
  // The cache's element, and a K or V tile as streamed through the ring: the 16-bit tile itself, or (FP8) the
  // tile's codes, whose D bytes per row are stored as the D / 2 columns of a 16-bit tile.
  using CacheElement = std::conditional_t<kFp8, uint8_t, Element>;
  // The MMAs' 16-bit type: q's, or fp16 with an FP8 cache whatever q's type. An e4m3 code becomes fp16 in one
  // instruction (cvt.rn.f16x2.e4m3x2) where bf16 takes four, and the FP8 loop is bound by its instructions.
  // A bf16 q is then stored as fp16 scaled by 2^q_exponent (below): every value within 2^-29 of the block's
  // largest |q| stays exact, smaller ones become fp16 subnormals (steps of 2^-39 of it); P (in [0, 2^8]) is
  // fp16 too, with 3 more mantissa bits than bf16.
  using MmaElement = std::conditional_t<kFp8, __half, Element>;
  constexpr bool kScaledQ = kFp8 && !std::is_same_v<Element, __half>;
  using StageTile = SwizzledTile<kBlockN, kFp8 ? kHeadDim / 2 : kHeadDim>;
  constexpr int kCacheElementBytes = int(sizeof(CacheElement));
  constexpr int kChunkElements = 16 / kCacheElementBytes;  // cache elements per 16-byte copy
  static_assert(kDTiles % 2 == 0 && kNTiles % 2 == 0, "ldmatrix.x4 loads two n8 tiles at once");
  static_assert(!C::kFp8Cache || (kQKSteps % 2 == 0 && kDTiles % 4 == 0), "FP8: an ldmatrix.x4 holds two 16-code chunks");
  // K/V loads: the threads sweep one column block (StageTile::kBlockCols) at a time, kRowsPerPass rows per pass.
  constexpr int kChunksPerBlockRow = StageTile::kChunksPerBlockRow;
  constexpr int kRowsPerPass = kThreads / kChunksPerBlockRow;
  constexpr int kPasses = kBlockN / kRowsPerPass;
  constexpr int kColBlocks = StageTile::kChunksPerRow / kChunksPerBlockRow;
  constexpr int kBlockColElements = StageTile::kBlockCols * 2 / kCacheElementBytes;  // cache elements per column block
  static_assert(kThreads % kChunksPerBlockRow == 0 && kRowsPerPass % 8 == 0 && kBlockN % kRowsPerPass == 0,
                "K/V loads in passes of whole swizzle periods");
  // Epilogue: per-warp O (fp32, rows padded by kMergePad floats: conflict-free float2 stores) and (max, sum).
  constexpr int kMergePad = 8;
  constexpr int kMergeRow = kHeadDim + kMergePad;
  constexpr int kMergeBytes = kWarps * kBlockM * kMergeRow * 4 + kWarps * kBlockM * 8;
  // Shared memory: Q, then the ring of kStages (K, V) stage tiles.
  constexpr int kKVRegionBytes = kStages * 2 * StageTile::kBytes;
  static_assert(QTile::kBytes + kKVRegionBytes == C::kSmemBytes, "the launcher's shared memory is the kernel's");
  static_assert(kMergeBytes <= kKVRegionBytes, "the warp merge reuses the K/V stages");

  const KvcacheParams& p = args.p;
  extern __shared__ __align__(128) uint8_t smem[];
  const uint32_t q_smem = smem_address(smem);
  const uint32_t kv_smem = q_smem + QTile::kBytes;  // stage s: K at kv_smem + 2 s StageTile::kBytes, V after it

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int quad_row = lane >> 2;  // accumulator row (and row + 8) of this thread in an m16 tile
  const int quad_col = lane & 3;   // accumulator columns 2 quad_col, 2 quad_col + 1 of an n8 tile

  // Neighbouring CTAs share a split (its K/V stays in L2 across m-blocks); with a cluster merge the splits of
  // an m-block are neighbours instead: a cluster is num_splits consecutive CTAs of grid.x, rank = split.
  const bool clustered = args.cluster_merge != 0;
  const int m_block = clustered ? int(blockIdx.x) / args.num_splits : int(blockIdx.x) % args.m_blocks;
  const int split = clustered ? int(blockIdx.x) % args.num_splits : int(blockIdx.x) / args.m_blocks;
  const int hk = blockIdx.y;
  const int b = blockIdx.z;
  const int group = args.group;

  Element* out_gmem = static_cast<Element*>(p.out);
  const int d_chunks = p.head_dim / 8;  // D may be below the bucket kHeadDim: the rest is zero-filled
  C::stamp(C::kStampStart, p.out);
  // Paged: the block-table lines this CTA reads first, brought into L2 so that its id loads are not a second DRAM
  // round trip after cache_seqlens (which decides the split's tiles, hence which entries) before the first K/V
  // copy. A short row (up to kPrefetchTableEntries entries) whole, one line per thread of the first warp; a longer
  // one (with args.prefetch_inputs), the two lines of the first id batch of this split as a full cache would place
  // it (a guess: the length is not known yet; a wrong guess costs two idle lines).
  auto prefetch_table_lines = [&]() {
    if constexpr (kPaged) {
      const int32_t* row = p.block_table + b * p.block_table_batch_stride;
      const int64_t row_entries = (int64_t(p.seqlen_k) + p.page_block_size - 1) / p.page_block_size;
      if (row_entries <= kPrefetchTableEntries) {
        if (tid * 32 < row_entries) prefetch_l2(row + tid * 32);
      } else if (args.prefetch_inputs != 0 && args.page_shift >= 0 && tid < 2) {
        const BlockRows full = block_rows(args, m_block, p.seqlen_k);
        const SplitWork guess = split_work(full.key_begin, full.key_end, kBlockN, args.num_splits, args.min_tiles_per_split, split);
        const int64_t entry = (int64_t(guess.tile_begin) * kBlockN >> args.page_shift) + tid * 32;
        if (split < guess.used && entry < row_entries) prefetch_l2(row + entry);
      }
    }
  };
  // Prefetch while waiting (args.prefetch_inputs): launched as a programmatic dependent, the CTA sits at the wait
  // below until the grid before it has finished. A prefetch into L2 changes no value that anyone reads (L2 is where
  // every SM's and copy engine's writes land: a producer's later write to these lines is what the loads after the
  // wait see), so it may come first; the loads of the length and of the first block ids after the wait then hit
  // L2 instead of each making a DRAM round trip before the first K/V copy.
  if (args.prefetch_inputs != 0) {
    if (tid == 0) prefetch_l2(p.cache_seqlens + b);
    prefetch_table_lines();
  }
  // ---- speculative tiles, part 1: the guess (args.speculative_tiles; 16-bit caches without rotary or a left
  // window; not split 0 of a contiguous cache, whose early tiles below need no length). While the CTA waits for the
  // grid before it, it reads this sequence's cache_seqlens entry and, paged, the block ids of the first tiles of
  // the split that length gives. These reads may race with a producer that is still writing the length or the
  // table: they are only a guess. After the wait, the guessed split's first tiles are copied at once (part 2), and
  // they are kept only if the real length, read after the wait, gives the same first tiles and, paged, the real
  // ids of those tiles are the guessed ones (part 3); else they are drained and copied again as usual. So the
  // values used are always those read after the wait; a right guess takes the length's (and the ids') round
  // trips off the path to the first copy. One lane reads the length and broadcasts it: every thread of a warp
  // then works from the same guess. Affects speed only. ----
  constexpr int kSlots = kBlockN / 16;  // 16-row slots of a tile (one block id each; see the paged block ids below)
  constexpr int kTilesPerIdBatch = 32 / kSlots;  // tiles whose slot ids one warp register holds (lane l: slot l)
  static_assert(kBlockN % 16 == 0 && 32 % kSlots == 0, "16-row id slots, a whole number of tiles per warp register");
  // The first key of this lane's slot in an id batch that starts at tile `first_tile` (lane l: slot l % kSlots of
  // tile l / kSlots).
  auto lane_slot_key = [&](int first_tile) { return (first_tile + lane / kSlots) * kBlockN + (lane % kSlots) * 16; };
  const bool speculate = !kFp8 && args.speculative_tiles != 0 && p.rotary_dim == 0 && p.window_left < 0 &&
                         (!kLeftPad || p.cache_leftpad == nullptr) &&
                         (kPaged ? args.page_shift >= 4 && args.paged_rows != 0 : !(split == 0 && args.early_tiles != 0));
  int guess_seqlen_k = -1;     // keys after the append under the guessed length (-1: no usable guess)
  SplitWork guess{0, 0, 0};    // the split's tiles under it
  int32_t guess_ids = 0;       // paged, lanes < (kStages - 1) kSlots: this lane's slot id under the guess (as load_id_batch reads it)
  if (speculate) {
    int guessed = 0;
    if (lane == 0) guessed = p.cache_seqlens[b];
    guessed = __shfl_sync(0xffffffffu, guessed, 0);
    if (args.speculative_tiles == 2) guessed /= 2;  // tests: a wrong length
    if (cache_length_ok(guessed, p.seqlen_new, p.seqlen_k)) {
      guess_seqlen_k = guessed + p.seqlen_new;
      const BlockRows guess_rows = block_rows(args, m_block, guess_seqlen_k);
      guess = split_work(guess_rows.key_begin, guess_rows.key_end, kBlockN, args.num_splits, args.min_tiles_per_split, split);
      if constexpr (kPaged) {  // the slots of the kStages - 1 tiles that part 2 copies
        const int j = lane_slot_key(guess.tile_begin);
        if (split < guess.used && lane < (kStages - 1) * kSlots && j < guess_seqlen_k)
          guess_ids = p.block_table[b * p.block_table_batch_stride + (j >> args.page_shift)];
      }
    }
  }
  // Launched as a programmatic dependent (sm_90): everything above overlapped the previous kernel's tail;
  // from here on global memory is read and written, so the previous kernels (the append, the caller's
  // producers of q and the caches) must be complete. Then the combine may start launching.
  wait_for_previous_grids();
  allow_next_grid_launch();
  C::stamp(C::kStampWaited, p.out);
  // Tests: wrong guessed ids. After the wait, where the guessed ids are first used: nothing before the wait reads the
  // guessed ids' load. Beside that load, ptxas had put this line's (predicated) read of it ahead of the grid wait
  // (sm_90a SASS). Moved here: 0.99-1.01x on the H200 (2026-12-02 03:28 UTC,
  // bench/results/2026-12-02-0328-h200-decode-guess-hook-after-wait-summary.txt).
  if (kPaged && args.speculative_tiles == 3 && p.num_blocks > 1) guess_ids = int32_t((uint32_t(guess_ids) + 1u) % uint32_t(p.num_blocks));
  if (args.prefetch_inputs == 0) prefetch_table_lines();  // beside the length's load instead
  // The split's first batch of block ids (see the paged block ids below), read beside cache_seqlens instead of one
  // dependent round trip after it, at the tile where the split starts under the guessed length (part 1 above), or
  // for split 0 without a guess at tile 0 (where its tiles start unless a window moves them). These are the real
  // ids (read after the wait), used when the real length starts the split at that tile; bounded by the capacity,
  // which the table row covers, so every lane's entry is there whatever the length.
  int32_t first_ids = 0;
  const int first_ids_tile = speculate && guess_seqlen_k >= 0 && split < guess.used ? guess.tile_begin : (split == 0 ? 0 : -1);
  if (kPaged && args.page_shift >= 4 && first_ids_tile >= 0) {
    const int j = lane_slot_key(first_ids_tile);
    if (j < p.seqlen_k) first_ids = p.block_table[b * p.block_table_batch_stride + (j >> args.page_shift)];
  }
  // The length first: its round trip is the one the early and speculative tiles below overlap. Both loads are
  // issued before those tiles' copies (the compiler barrier keeps them there): behind the copies in the memory
  // pipeline they arrived ~1 us later (H200 timeline, 2026-12-01).
  const int cached = p.cache_seqlens[b];
  // Varlen rows (paged kernels only: the routed short sequences of a paged varlen forward; decode_work.hpp,
  // varlen_query_rows): where this sequence's rows are in the forward's q / out / lse, loaded beside the length (the
  // same round trip). Dense calls: the batch strides, as before.
  const bool varlen_rows = kPaged && p.cu_seqlens_q != nullptr;
  QueryRows qrows;
  if constexpr (kPaged)
    if (varlen_rows) qrows = varlen_query_rows(p, b);
  auto row_offset = [&](int64_t batch_stride, int64_t row_stride) -> int64_t {
    if constexpr (kPaged) return query_rows_offset(p, qrows, b, batch_stride, row_stride);
    return b * batch_stride;
  };
  auto call_row = [&](int i) { return !varlen_rows || i >= qrows.first; };  // not a padding row
  // cache_leftpad: the sequence's keys start there (decode_work.hpp). Without it (kLeftPad false) key_floor is 0 at
  // compile time and unused.
  const int key_floor = kLeftPad ? key_floor_of(p, b) : 0;
  asm volatile("" ::: "memory");
  const Element* q_gmem = static_cast<const Element*>(p.q);
  const CacheElement* k_gmem = static_cast<const CacheElement*>(p.k);
  const CacheElement* v_gmem = static_cast<const CacheElement*>(p.v);
  // ---- K/V tile loads: thread (row_lane, chunk_lane) copies rows row_lane + pass * kRowsPerPass ----
  // Decode streams K/V, so the instructions per copy matter: at HBM rate an SM has ~2000 cycles per 32 KiB
  // tile and its warps share 4 issue slots per cycle with the MMAs and the softmax. Whole tiles of a
  // full-width head with good block ids (nearly all tiles) take the plain path: one row address per pass and
  // unpredicated copies; the last tile of a split, narrow heads (D below the bucket), bad block ids and
  // block sizes that are not a power of two >= 16 take the checked path. The lean paged copies (lean_paged below)
  // take every tile of the usual paged cache through one path instead.
  const int row_lane = tid / kChunksPerBlockRow;
  const int chunk_lane = tid % kChunksPerBlockRow;
  const uint32_t load_lane = StageTile::lane_offset(row_lane, chunk_lane);
  // Where a key row starts: contiguous, k_rows + j * row stride (sequence and head folded in once); paged,
  // k_rows + id * block stride + (j mod block size) * row stride (head folded in).
  const CacheElement* k_rows = k_gmem + hk * p.k_head_stride + (kPaged ? 0 : b * p.k_batch_stride) + chunk_lane * kChunkElements;
  const CacheElement* v_rows = v_gmem + hk * p.v_head_stride + (kPaged ? 0 : b * p.v_batch_stride) + chunk_lane * kChunkElements;
  const int32_t* table_row = kPaged ? p.block_table + b * p.block_table_batch_stride : nullptr;
  const int load_chunks = p.head_dim / kChunkElements;  // 16-byte chunks of a cache row (FP8: the host checked D % 16)
  const bool full_width = load_chunks == StageTile::kChunksPerRow;
  bool chunk_ok[kColBlocks];  // this thread's chunk of column block `block` is inside the head
#pragma unroll
  for (int block = 0; block < kColBlocks; ++block) chunk_ok[block] = block * kChunksPerBlockRow + chunk_lane < load_chunks;
  bool bad_block_id = false;  // this thread met a block id outside the cache (the CTA's result becomes NaN)
  // Byte strides of the plain path as 32-bit values, so a row address is one or two wide multiply-adds
  // (IMAD.WIDE) on a 64-bit base; strides beyond 2^31 bytes take the checked path.
  const int64_t k_row_stride_bytes = p.k_row_stride * kCacheElementBytes, v_row_stride_bytes = p.v_row_stride * kCacheElementBytes;
  const int64_t k_block_stride_bytes = kPaged ? p.k_batch_stride * kCacheElementBytes : 0;
  const int64_t v_block_stride_bytes = kPaged ? p.v_batch_stride * kCacheElementBytes : 0;
  const bool strides_32bit = k_row_stride_bytes <= INT32_MAX && v_row_stride_bytes <= INT32_MAX &&
                             k_block_stride_bytes <= INT32_MAX && v_block_stride_bytes <= INT32_MAX;
  const int k_row_bytes = int(k_row_stride_bytes), v_row_bytes = int(v_row_stride_bytes);
  const int k_block_bytes = int(k_block_stride_bytes), v_block_bytes = int(v_block_stride_bytes);
  const char* k_bytes = reinterpret_cast<const char*>(k_rows);
  const char* v_bytes = reinterpret_cast<const char*>(v_rows);
  const int page_mask = kPaged ? p.page_block_size - 1 : 0;  // slot ids (paged): row in block = j & page_mask
  // args.paged_rows: when a pass covers whole 16-row slots (kRowsPerPass a multiple of 16), a thread's row
  // within its slot is row_lane % 16 in every pass, and that row's offset is folded into the base once.
  constexpr bool kSlotRowInBase = kRowsPerPass % 16 == 0;
  const uint32_t base_slot_row = kPaged && kSlotRowInBase ? uint32_t(row_lane & 15) : 0u;
  auto opaque_bases = [&](uint64_t x) { return kLean ? opaque_u64(x, lane) : x; };
  const uint64_t k_slot_row_base = opaque_bases(uint64_t(k_bytes) + wide_product<kLean>(base_slot_row, k_row_bytes));
  const uint64_t v_slot_row_base = opaque_bases(uint64_t(v_bytes) + wide_product<kLean>(base_slot_row, v_row_bytes));
  // args.paged_rows: the pool row of key j's slot when block `id` holds it (id * block size + row in block), and
  // the pool row of a pass's row of tile `tile_in_batch`, from the slot rows of a batch (lane l holds slot l's).
  auto slot_pool_row = [&](int32_t id, int j) { return (uint32_t(id) << args.page_shift) + uint32_t(j & page_mask); };
  // The lane of an id batch that holds slot `slot` of tile `rel`, the tile's index from the split's first tile (its
  // batch of ids: rel % kTilesPerIdBatch). Worked out unsigned, and in pass_pool_row (whole slots per pass) from pass
  // 0's slot plus a compile-time step: a signed row / 16 per pass took three instructions more per pass (SASS,
  // sm_90a, 2026-12-01). The other paths pass their row / 16 as computed (signed, >= 0): an unsigned one there gave
  // the FP8 paged kernel 196 registers instead of 184 (ptxas, sm_90a, 2026-12-02).
  auto slot_lane = [&](int rel, uint32_t slot) { return int(uint32_t(rel) % kTilesPerIdBatch * kSlots + slot); };
  const uint32_t row_lane_slot = uint32_t(row_lane) / 16u;  // the tile's slot that holds this thread's row in pass 0
  auto pass_pool_row = [&](uint32_t slot_rows, int rel, int pass) {
    const uint32_t row = uint32_t(row_lane) + uint32_t(pass * kRowsPerPass);  // of the tile
    const uint32_t slot = kSlotRowInBase ? row_lane_slot + uint32_t(pass * (kRowsPerPass / 16)) : row / 16u;
    return __shfl_sync(0xffffffffu, slot_rows, slot_lane(rel, slot)) + (kSlotRowInBase ? 0u : row & 15u);
  };

  // ---- early tiles (args.early_tiles; a contiguous 16-bit cache, no rotary, no left window, full-width heads):
  // split 0's key tiles start at key 0 whatever the sequence's length, so its Q and its first kStages - 1 tiles
  // are copied before cache_seqlens is read, and the length's round trip (0.5-0.8 us on the H200: the timeline
  // of 2026-12-01) overlaps them instead of preceding them. The rows copied are rows of the capacity, inside the
  // cache whatever the length. They are kept when the length shows that the split streams those tiles whole
  // (the same stages, commit groups and copies as the prologue's plain path); else they are drained and the
  // prologue copies what it needs as usual. Affects speed only. ----
  auto copy_q = [&](int row_begin, int block_rows_used) {  // Q's rows of the m-block, zero-filled past them
    for (int idx = tid; idx < kBlockM * QTile::kChunksPerRow; idx += kThreads) {
      const int row = idx / QTile::kChunksPerRow, chunk = idx % QTile::kChunksPerRow;
      const int r = row_begin + row;
      const int i = r / group, h = hk * group + r % group;
      const bool valid = row < block_rows_used && chunk < d_chunks && call_row(i);
      const Element* src = valid ? q_gmem + row_offset(p.q_batch_stride, p.q_row_stride) + int64_t(i) * p.q_row_stride +
                                       h * p.q_head_stride + chunk * 8
                                 : q_gmem;
      if (varlen_rows) {  // plain loads and stores (no commit group; the loop's first barrier orders them before Q's use)
        uint4 value = make_uint4(0u, 0u, 0u, 0u);
        if (valid) value = *reinterpret_cast<const uint4*>(src);
        *reinterpret_cast<uint4*>(smem + QTile::chunk_offset(row, chunk)) = value;
      } else {
        cp_async_16(q_smem + QTile::chunk_offset(row, chunk), src, valid);
      }
    }
  };
  // The plain path's copies of one pass: this thread's chunks of one row of a tile (kColBlocks column blocks, K
  // and V) into the stage tiles at k_tile / v_tile (this thread's lane offset included).
  auto copy_pass = [&](uint32_t k_tile, uint32_t v_tile, int pass, const char* k_src, const char* v_src) {
#pragma unroll
    for (int block = 0; block < kColBlocks; ++block) {
      const uint32_t to = StageTile::offset(0, pass * kRowsPerPass, block * kChunksPerBlockRow);
      cp_async_16_full(k_tile + to, k_src + block * StageTile::kBlockCols * 2);
      cp_async_16_full(v_tile + to, v_src + block * StageTile::kBlockCols * 2);
    }
  };
  // The same with zero-fill: rows past the key count (`valid` false) read nothing and land as zeros.
  auto copy_pass_zfill = [&](uint32_t k_tile, uint32_t v_tile, int pass, const char* k_src, const char* v_src, bool valid) {
#pragma unroll
    for (int block = 0; block < kColBlocks; ++block) {
      const uint32_t to = StageTile::offset(0, pass * kRowsPerPass, block * kChunksPerBlockRow);
      cp_async_16(k_tile + to, k_src + block * StageTile::kBlockCols * 2, valid);
      cp_async_16(v_tile + to, v_src + block * StageTile::kBlockCols * 2, valid);
    }
  };
  // The same for key j of a contiguous cache, and for a pool row of a paged one (args.paged_rows).
  auto copy_cache_row = [&](uint32_t k_tile, uint32_t v_tile, int pass, int j) {
    copy_pass(k_tile, v_tile, pass, k_bytes + wide_product<kLean>(j, k_row_bytes), v_bytes + wide_product<kLean>(j, v_row_bytes));
  };
  auto copy_pool_row = [&](uint32_t k_tile, uint32_t v_tile, int pass, uint32_t pool_row) {
    copy_pass(k_tile, v_tile, pass, reinterpret_cast<const char*>(k_slot_row_base + wide_product<kLean>(pool_row, k_row_bytes)),
              reinterpret_cast<const char*>(v_slot_row_base + wide_product<kLean>(pool_row, v_row_bytes)));
  };
  // Q and the kStages - 1 whole tiles from tile `first_tile`, one commit group each: the stages, groups and copies
  // of the prologue's plain path (the early and the speculative tiles). Paged: lane l of `slot_rows` holds the pool
  // row of slot l of those tiles (as rows_now of the paged block ids below).
  auto copy_first_tiles = [&](int first_tile, uint32_t slot_rows) {
    const BlockRows q_rows = block_rows(args, m_block, 0);  // the rows do not depend on the length
    // (varlen rows: Q is copied at its place below instead; its rows' loads come after the tiles' copies)
    if (!varlen_rows) copy_q(q_rows.row_begin, q_rows.rows);
#pragma unroll 1
    for (int n = 0; n < kStages - 1; ++n) {
      const uint32_t k_tile = kv_smem + uint32_t(n) * 2u * StageTile::kBytes + load_lane;
#pragma unroll
      for (int pass = 0; pass < kPasses; ++pass) {
        if constexpr (kPaged) copy_pool_row(k_tile, k_tile + StageTile::kBytes, pass, pass_pool_row(slot_rows, n, pass));
        else copy_cache_row(k_tile, k_tile + StageTile::kBytes, pass, (first_tile + n) * kBlockN + row_lane + pass * kRowsPerPass);
      }
      cp_async_commit();
    }
  };
  int first_copied = -1;  // the tile from which Q and the first tiles were copied early (early or speculative); -1: none
  if constexpr (!kPaged && !kFp8) {
    // (the padding test first: in the middle of the chain, kLeftPad false changed the sm_80 code of the kernels
    // without padding)
    if ((!kLeftPad || p.cache_leftpad == nullptr) && args.early_tiles != 0 && split == 0 && p.rotary_dim == 0 &&
        p.window_left < 0 && full_width && strides_32bit && (kStages - 1) * kBlockN <= p.seqlen_k) {
      copy_first_tiles(0, 0u);
      first_copied = 0;
    }
  }
  // ---- speculative tiles, part 2: Q and the guessed split's first kStages - 1 tiles (copy_first_tiles), when they
  // are whole tiles of the guessed keys and (paged) their ids are blocks of the cache. ----
  if (speculate && guess_seqlen_k >= 0 && split < guess.used && guess.tile_end - guess.tile_begin >= kStages - 1 &&
      (guess.tile_begin + kStages - 1) * kBlockN <= guess_seqlen_k && full_width && strides_32bit) {
    uint32_t guess_rows_now = 0;
    bool ids_good = true;
    if constexpr (kPaged) {
      const bool used_lane = lane < (kStages - 1) * kSlots;  // slots of the tiles copied now
      ids_good = __ballot_sync(0xffffffffu, used_lane && uint32_t(guess_ids) >= uint32_t(p.num_blocks)) == 0;
      guess_rows_now = slot_pool_row(guess_ids, lane_slot_key(guess.tile_begin));
    }
    if (ids_good) {
      copy_first_tiles(guess.tile_begin, guess_rows_now);
      first_copied = guess.tile_begin;
    }
  }
  const int seqlen_k = cached + p.seqlen_new;  // keys after the append
  // Without padding (kLeftPad false) the checks and rows as they were before cache_leftpad: a floor of 0 passed through
  // (cache_keys_ok, padded_block_rows) changed the kernels' PTX.
  const bool length_ok = kLeftPad ? cache_keys_ok(cached, key_floor, p.seqlen_new, p.seqlen_k)
                                  : cache_length_ok(cached, p.seqlen_new, p.seqlen_k);
  const BlockRows rows = kLeftPad ? padded_block_rows(args, m_block, length_ok ? seqlen_k : 0, length_ok ? key_floor : 0)
                                  : block_rows(args, m_block, length_ok ? seqlen_k : 0);
  const SplitWork work = split_work(rows.key_begin, rows.key_end, kBlockN, args.num_splits, args.min_tiles_per_split, split);
  C::stamp(C::kStampPlanned, p.out);
  // ---- early and speculative tiles, part 3: they are the prologue's when the real length starts the split at the
  // tile they were copied from and it streams them whole; paged (speculative only), also only if the real ids of
  // those tiles, first_ids (read after the wait at the same tile), are the guessed ones. Warp-uniform (a guess is
  // one lane's): a warp whose copies do not stand drains them and its threads copy their rows again in the
  // prologue. ----
  bool first_kept = first_copied >= 0 && length_ok && split < work.used && work.tile_begin == first_copied &&
                    work.tile_end - work.tile_begin >= kStages - 1 && (work.tile_begin + kStages - 1) * kBlockN <= seqlen_k;
  if (kPaged && first_kept) first_kept = __all_sync(0xffffffffu, lane >= (kStages - 1) * kSlots || first_ids == guess_ids);
  if (first_copied >= 0 && !first_kept) cp_async_wait<0>();  // never leave (or refill) stages a copy may still target
  // Varlen rows: a sequence that is the forward kernel's has no row here (its key count is 0: no split copied a tile,
  // and all of a cluster's CTAs are this sequence's, so they leave together).
  if (varlen_rows && qrows.first >= p.seqlen_q) {
    cp_async_wait<0>();
    return;
  }

  // Direct result of a row without any key work: NaN (bad cache_seqlens entry) or empty (no visible key:
  // out = 0, lse = -inf). Written by split 0; the combine kernel skips these m-blocks.
  auto write_rows_directly = [&](float value, float lse_value) {
    for (int idx = tid; idx < rows.rows * d_chunks; idx += kThreads) {
      const int r = rows.row_begin + idx / d_chunks, chunk = idx % d_chunks;
      const int i = r / group, h = hk * group + r % group;
      const uint32_t packed = ElementTraits<Element>::pack(value, value);
      const uint4 v = make_uint4(packed, packed, packed, packed);
      if (call_row(i))
        *reinterpret_cast<uint4*>(out_gmem + row_offset(p.out_batch_stride, p.out_row_stride) + int64_t(i) * p.out_row_stride +
                                  h * p.out_head_stride + chunk * 8) = v;
    }
    if (p.lse != nullptr)
      for (int r = rows.row_begin + tid; r < rows.row_begin + rows.rows; r += kThreads) {
        const int i = r / group, h = hk * group + r % group;
        if (call_row(i))
          p.lse[row_offset(p.lse_batch_stride, p.lse_row_stride) + h * p.lse_head_stride + int64_t(i) * p.lse_row_stride] = lse_value;
      }
  };
  if (!length_ok) {
    if (split == 0) write_rows_directly(NAN, NAN);
    return;
  }
  // ---- cluster merge (sm_90, args.cluster_merge): each CTA of the cluster (one per split) has put its
  // normalised partial and its LSE per row into shared memory (cluster_out, cluster_lse); CTA `split` then
  // merges rows split, split + num_splits, ... from the partials of the `used` working splits, read from
  // their CTAs' shared memory in split order (the same sums on every run), as the combine kernel does from
  // global memory. Every CTA of the cluster takes part, working or not: the two cluster barriers need all.
  // Used only when used >= 2, which is the same for every CTA of a cluster (same rows, same length). ----
  constexpr int kClusterOutFloats = kBlockM * kHeadDim;
  static_assert(kMergeBytes + (kClusterOutFloats + kBlockM) * 4 <= kKVRegionBytes,
                "the cluster partial follows the warp merge in the K/V stages");
  float* cluster_out = reinterpret_cast<float*>(smem + QTile::kBytes + kMergeBytes);  // [row][kHeadDim] fp32
  float* cluster_lse = cluster_out + kClusterOutFloats;                                // [row], log2 units
  auto merge_cluster = [&](int used) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    namespace cg = cooperative_groups;
    cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();  // every working split's partial is in its shared memory (release / acquire)
    C::stamp(C::kStampClusterSynced, p.out);
    const int quads = p.head_dim_v / 4;
    const int my_rows = (rows.rows - split + args.num_splits - 1) / args.num_splits;
    for (int idx = tid; idx < my_rows * quads; idx += kThreads) {
      const int row = split + (idx / quads) * args.num_splits, col = (idx % quads) * 4;
      const int r = rows.row_begin + row;
      const int i = r / group, h = hk * group + r % group;
      // The largest split LSE (log2 units; weights exp2(lse_s - max) <= 1); NaN from a split that met a bad block
      // id; no split saw a key: out = 0, lse = -inf.
      float lse_max = -INFINITY;
      bool any_nan = false;
      for (int s = 0; s < used; ++s) {
        const float lse = cluster.map_shared_rank(cluster_lse, s)[row];
        any_nan = any_nan || isnan(lse);
        lse_max = fmaxf(lse_max, lse);
      }
      float weight_sum = 0.f;
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
      if (lse_max != -INFINITY)
        for (int s = 0; s < used; ++s) {
          const float w = exp2_approx(cluster.map_shared_rank(cluster_lse, s)[row] - lse_max);
          const float4 part = *reinterpret_cast<const float4*>(cluster.map_shared_rank(cluster_out, s) + row * kHeadDim + col);
          weight_sum += w;
          acc.x += w * part.x, acc.y += w * part.y, acc.z += w * part.z, acc.w += w * part.w;
        }
      const float inv = any_nan ? NAN : (weight_sum > 0.f ? rcp_approx(weight_sum) : 0.f);
      if (!call_row(i)) continue;  // a padding row (varlen rows): its place is another sequence's
      Element* out_row = out_gmem + row_offset(p.out_batch_stride, p.out_row_stride) + int64_t(i) * p.out_row_stride +
                         h * p.out_head_stride + col;
      *reinterpret_cast<uint2*>(out_row) = make_uint2(ElementTraits<Element>::pack(acc.x * inv, acc.y * inv),
                                                      ElementTraits<Element>::pack(acc.z * inv, acc.w * inv));
      if (col == 0 && p.lse != nullptr)
        p.lse[row_offset(p.lse_batch_stride, p.lse_row_stride) + h * p.lse_head_stride + int64_t(i) * p.lse_row_stride] =
            any_nan ? NAN : (weight_sum > 0.f ? (lse_max + log2_approx(weight_sum)) * kLn2 : -INFINITY);
    }
    C::stamp(C::kStampClusterRead, p.out);
    cluster.sync();  // no CTA leaves (freeing its shared memory) while another still reads it
#else
    (void)used;  // the launcher sets cluster_merge on sm_90+ only
#endif
  };

  if (split >= work.used) {  // nothing for this split; with no visible key at all, split 0 writes the empty rows
    if (work.used == 0 && split == 0) write_rows_directly(0.f, -INFINITY);
    if (clustered && work.used >= 2) merge_cluster(work.used);
    return;
  }
  const bool direct = work.used == 1;  // the only split: write out / lse, no partials
  const int num_tiles = work.tile_end - work.tile_begin;

  // ---- bf16 q over an FP8 cache: the power of two that brings the block's largest finite |q| just below 2^15
  // (fp16's largest is 65504); infinities and NaN stay what they are. With rotary, rotation keeps each pair's
  // norm, so |rotated| <= sqrt(2) max |q| bounds it. The block maximum goes through the last ring stage, which
  // the prologue's copies do not touch (the loop's first barrier comes before its refill). ----
  int q_exponent = 0;  // Q is stored as q * 2^q_exponent; the softmax scale takes 2^-q_exponent
  if constexpr (kScaledQ) {
    float local_max = 0.f;
    for (int idx = tid; idx < kBlockM * QTile::kChunksPerRow; idx += kThreads) {
      const int row = idx / QTile::kChunksPerRow, chunk = idx % QTile::kChunksPerRow;
      if (row >= rows.rows || chunk >= d_chunks) continue;
      const int r = rows.row_begin + row;
      const int i = r / group, h = hk * group + r % group;
      if (!call_row(i)) continue;
      const uint4 v = *reinterpret_cast<const uint4*>(q_gmem + row_offset(p.q_batch_stride, p.q_row_stride) +
                                                      int64_t(i) * p.q_row_stride + h * p.q_head_stride + chunk * 8);
      const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const float2 pair = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&words[w]));
        const float a = fabsf(pair.x), c = fabsf(pair.y);
        if (a <= FLT_MAX) local_max = fmaxf(local_max, a);  // false for inf and NaN
        if (c <= FLT_MAX) local_max = fmaxf(local_max, c);
      }
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) local_max = fmaxf(local_max, __shfl_xor_sync(0xffffffffu, local_max, offset));
    float* warp_max = reinterpret_cast<float*>(smem + QTile::kBytes + (kStages - 1) * 2 * StageTile::kBytes);
    if (lane == 0) warp_max[warp] = local_max;
    __syncthreads();
    float block_max = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) block_max = fmaxf(block_max, warp_max[w]);
    if (p.rotary_dim > 0) block_max *= 1.5f;  // >= sqrt(2), rounded up
    if (block_max > 0.f) {
      int e;
      frexpf(block_max, &e);  // block_max < 2^e
      // bf16's range bounds it: e from -132 (2^-133, the smallest subnormal) to 128, q_exponent from -113 to 147.
      // The softmax multiplier qk_scale * 2^-q_exponent (below) overflows only where q.key itself would (no
      // fp32 could hold the logits), and becomes subnormal or zero only where the logits are below 2^-90.
      q_exponent = 15 - e;
    }
  }
  // Stores one pair of q values (floats) as two MmaElements at smem byte offset `at`.
  auto store_q_pair = [&](uint32_t at0, uint32_t at1, float x0, float x1) {
    if constexpr (kScaledQ) {
      x0 = ldexpf(x0, q_exponent);
      x1 = ldexpf(x1, q_exponent);
    }
    *reinterpret_cast<MmaElement*>(smem + at0) = MmaElement(x0);
    *reinterpret_cast<MmaElement*>(smem + at1) = MmaElement(x1);
  };

  // ---- Q: the m-block's packed rows, rotated at their positions when rotary is on; FP8 cache: each
  // 16-column group permuted (fp8_q_column) ----
  if (kFp8 && p.rotary_dim == 0) {
    // Through registers: a group's 8 pairs go to two chunks as (0, 2, 4, 6) and (1, 3, 5, 7). The loop's first
    // barrier orders these stores before any ldmatrix of Q. (FP8 caches need D % 16 == 0: whole groups.)
    for (int idx = tid; idx < kBlockM * (kHeadDim / 16); idx += kThreads) {
      const int row = idx / (kHeadDim / 16), group16 = idx % (kHeadDim / 16);
      const int r = rows.row_begin + row;
      const int i = r / group, h = hk * group + r % group;
      uint4 lo = make_uint4(0, 0, 0, 0), hi = lo;  // pairs 0..3, 4..7 of the group
      if (row < rows.rows && group16 < p.head_dim / 16 && call_row(i)) {
        const uint4* src = reinterpret_cast<const uint4*>(q_gmem + row_offset(p.q_batch_stride, p.q_row_stride) +
                                                          int64_t(i) * p.q_row_stride + h * p.q_head_stride + group16 * 16);
        lo = src[0];
        hi = src[1];
      }
      if constexpr (kScaledQ) {  // bf16 pairs -> scaled fp16 pairs (exact: powers of two, fp16's range)
        auto rescale = [&](uint32_t& word) {
          const float2 x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&word));
          word = ElementTraits<__half>::pack(ldexpf(x.x, q_exponent), ldexpf(x.y, q_exponent));
        };
        rescale(lo.x), rescale(lo.y), rescale(lo.z), rescale(lo.w);
        rescale(hi.x), rescale(hi.y), rescale(hi.z), rescale(hi.w);
      }
      *reinterpret_cast<uint4*>(smem + QTile::chunk_offset(row, 2 * group16)) = make_uint4(lo.x, lo.z, hi.x, hi.z);
      *reinterpret_cast<uint4*>(smem + QTile::chunk_offset(row, 2 * group16 + 1)) = make_uint4(lo.y, lo.w, hi.y, hi.w);
    }
  } else if (p.rotary_dim == 0) {
    // Q does not depend on the length: copied with the early or speculative tiles, even when those are drained.
    if (first_copied < 0 || varlen_rows) copy_q(rows.row_begin, rows.rows);
  } else {
    // Positions: cached + i when causal or windowed (each query is a new token), else all at `cached`.
    const bool per_token_positions = p.window_left >= 0 || p.window_right >= 0;
    for (int idx = tid; idx < kBlockM * (kHeadDim / 2); idx += kThreads) {
      const int row = idx / (kHeadDim / 2), q = idx % (kHeadDim / 2);
      const int r = rows.row_begin + row;
      const int i = r / group, h = hk * group + r % group;
      const bool valid = row < rows.rows && q < p.head_dim / 2 && call_row(i);
      const RotaryPair pair = valid ? rotary_pair(p, q) : RotaryPair{2 * q, 2 * q + 1, false};
      float x0 = 0.f, x1 = 0.f;
      if (valid) {
        const Element* src = q_gmem + row_offset(p.q_batch_stride, p.q_row_stride) + int64_t(i) * p.q_row_stride +
                             h * p.q_head_stride;
        x0 = float(src[pair.first]);
        x1 = float(src[pair.second]);
        if (pair.rotated) rotate_pair<Element>(p, per_token_positions ? cached + i : cached, q, &x0, &x1);
      }
      const int col0 = kFp8 ? fp8_q_column(pair.first) : pair.first;
      const int col1 = kFp8 ? fp8_q_column(pair.second) : pair.second;
      store_q_pair(QTile::chunk_offset(row, col0 / 8) + (col0 % 8) * 2, QTile::chunk_offset(row, col1 / 8) + (col1 % 8) * 2, x0,
                   x1);
    }
  }


  // Paged block ids. Power-of-two block sizes >= 16 (all common ones) take the id of each 16-row "slot" of
  // a tile (16-aligned rows: one block), kTilesPerIdBatch tiles per warp register (lane l: slot l % kSlots
  // of tile l / kSlots of the batch), read a whole batch ahead, so the table's latency (a DRAM round trip
  // under full load, ~1-2 us) never delays a tile's copies; each thread picks its slot's id with a shuffle.
  // Other block sizes look up every row's id one tile ahead (per_row_ids). kTilesPerIdBatch: with kSlots, above.
  const bool slot_ids = kPaged && args.page_shift >= 4;
  // Lean paged copies (16-bit caches): 16-row slots of blocks that are runs of rows, full-width heads, 32-bit strides
  // (the usual serving cache). Every tile, the last partial one too, is copied from the slot pool rows with
  // zero-fill past the key count; the id checks are the batch rotation's. The tile loop is then compiled without the
  // other paths (a separate instantiation, chosen per CTA), as a contiguous cache's is. Affects speed only. H200,
  // against main with the contiguous split counts (decode_plan.cpp), 3 alternating rounds, 2026-12-03 20:25 UTC
  // (bench/results/2026-12-03-2023-h200-decode-lean-paged-landed-ab-summary.txt): the issue's paged points 1.004-1.035
  // (B = 1 / 32k 37.71 -> 36.42 us, B = 16 / 1k 20.38 -> 19.78), 8 / 1 paged 1.001-1.045; short one-wave calls lose up
  // to 1.4% (B = 1 / 1k 6.61 -> 6.71 us, D = 256 B = 1 0.991).
  // Only tiles of 64 keys (4 passes): on D = 64's 128-key tiles (8 passes) the lean loop ran 0.959-0.966 at B = 1 and
  // 1.023-1.030 at B = 8 (20:14 UTC, ...-2014-...-three-way-ab-summary.txt); those keep the other paths.
  // decode_plan.cpp's lean_paged_copies is the host's copy of this rule (its split counts follow it): keep them in step.
  constexpr bool kLeanPagedTile = kPaged && !kFp8 && kBlockN == 64;
  const bool lean_paged = kLeanPagedTile && slot_ids && args.paged_rows != 0 && full_width && strides_32bit;
  int32_t ids_now = 0, ids_next = 0;  // slot_ids: the id batches of the tile being issued and of the next one
  int j_next = 0;                      // the first key of this lane's slot in the next batch
  bool needed_next = false;            // whether this lane's entry of the next batch was read (a key exists)
  uint32_t bad_now = 0;                // lanes of the current batch whose id is not a block of the cache
  uint32_t rows_now = 0;               // args.paged_rows: the pool row of this lane's slot (id * block size + row in block)
  auto load_id_batch = [&](int batch) {  // tiles [batch, batch + 1) * kTilesPerIdBatch into ids_next
    const int first_tile = work.tile_begin + batch * kTilesPerIdBatch;
    j_next = lane_slot_key(first_tile);  // the slot's first key
    needed_next = first_tile + lane / kSlots < work.tile_end && j_next < seqlen_k;  // never read past the keys' blocks
    if (batch == 0 && work.tile_begin == first_ids_tile) ids_next = first_ids;  // read beside cache_seqlens
    else ids_next = needed_next ? table_row[j_next >> args.page_shift] : 0;
  };
  // The next batch becomes the current one. Its ids are checked only now (a vote waits for the loads, which
  // were issued a batch ago), never right after the load.
  // In the kernels with lean copies (kLeanPagedTile) a bad id (not a block of the cache, also < 0) in a slot with keys
  // makes the CTA's result NaN here, once, and its pool row becomes block 0's (in the cache), so that the lean copies
  // (below) never read outside the cache. The other paths take such a tile's rows through the checked path, which
  // reads nothing there and flags the CTA itself.
  auto rotate_id_batches = [&]() {
    ids_now = ids_next;
    const bool bad = needed_next && uint32_t(ids_now) >= uint32_t(p.num_blocks);  // also < 0
    bad_now = __ballot_sync(0xffffffffu, bad);
    if constexpr (kLeanPagedTile) {  // only there: with them in every paged kernel FP8 paged B = 1 / 32k ran 0.981-0.983
      if (bad_now != 0) bad_block_id = true;
      rows_now = slot_pool_row(bad ? 0 : ids_now, j_next);  // < 2^31: a good id's, or block 0's
    } else {
      rows_now = slot_pool_row(ids_now, j_next);  // < 2^31 where the id is good
    }
  };
  int32_t per_row_ids[kPasses];  // other block sizes: the ids of this thread's rows of the next tile
  auto fetch_per_row_ids = [&](int n) {  // rows past the key count are never looked up
#pragma unroll 1  // a division per row: rolled, like the checked path (code size; affects speed only)
    for (int pass = 0; pass < kPasses; ++pass) {
      const int j = n * kBlockN + row_lane + pass * kRowsPerPass;
      per_row_ids[pass] = j < seqlen_k ? table_row[page_of(args, j)] : 0;
    }
  };
  if constexpr (kPaged) {
    if (slot_ids) {
      load_id_batch(0);
      rotate_id_batches();  // the first tile cannot start before its ids are here
      load_id_batch(1);
    } else if (num_tiles > 0) {
      fetch_per_row_ids(work.tile_begin);
    }
  }


  // Copies the rows of the split's tile `rel` (relative index) into `stage`. Called for rel = 0, 1, 2, ...
  // in order, by every thread (the shuffles need whole warps).
  // Padding (cache_leftpad, contiguous caches) can sit only in split 0's first tile: the prologue passes it
  // padding_floor() as tile_floor, every other call 0 (no code: see `plain`). padding_floor() is rows.key_begin
  // (>= key_floor; the keys between are invisible to every row of the m-block, so they may be skipped too) in the
  // kLeftPad kernel, else 0: key_floor itself is dead after padded_block_rows.
  auto padding_floor = [&]() { return kLeftPad && p.cache_leftpad != nullptr ? rows.key_begin : 0; };
  auto issue_tile = [&](int rel, int stage, auto lean, int tile_floor) {
    const int n = work.tile_begin + rel;
    const uint32_t k_tile = kv_smem + uint32_t(stage) * 2u * StageTile::kBytes + load_lane;
    const uint32_t v_tile = k_tile + StageTile::kBytes;
    if constexpr (decltype(lean)::value) {  // lean_paged (above)
      if (rel > 0 && rel % kTilesPerIdBatch == 0) {  // next batch: its ids were read a batch ago
        rotate_id_batches();
        load_id_batch(rel / kTilesPerIdBatch + 1);
      }
#pragma unroll
      for (int pass = 0; pass < kPasses; ++pass) {
        const uint32_t pool_row = pass_pool_row(rows_now, rel, pass);
        copy_pass_zfill(k_tile, v_tile, pass, reinterpret_cast<const char*>(k_slot_row_base + wide_product<kLean>(pool_row, k_row_bytes)),
                        reinterpret_cast<const char*>(v_slot_row_base + wide_product<kLean>(pool_row, v_row_bytes)),
                        n * kBlockN + row_lane + pass * kRowsPerPass < seqlen_k);
      }
      return;
    }
    uint32_t tile_bad_ids = 0;
    if constexpr (kPaged) {
      if (slot_ids) {
        if (rel > 0 && rel % kTilesPerIdBatch == 0) {  // next batch: its ids were read a batch ago
          rotate_id_batches();
          load_id_batch(rel / kTilesPerIdBatch + 1);
        }
        tile_bad_ids = (bad_now >> slot_lane(rel, 0u)) & ((1u << kSlots) - 1);
      }
    }
    // (tile_floor == 0 || ...): no code where the caller passes 0 (the tile loop)
    const bool plain = (n + 1) * kBlockN <= seqlen_k && (tile_floor == 0 || n * kBlockN >= tile_floor) && full_width &&
                       strides_32bit && (!kPaged || slot_ids) && tile_bad_ids == 0;
    if (kPaged && __builtin_expect(plain && args.paged_rows, 1)) {
      // The pool row of the slot (one shuffle) plus the thread's row in it (in the base): one wide multiply-add
      // per row of K and of V, as for a contiguous cache.
#pragma unroll
      for (int pass = 0; pass < kPasses; ++pass) {
        copy_pool_row(k_tile, v_tile, pass, pass_pool_row(rows_now, rel, pass));
      }
    } else if (__builtin_expect(plain, 1)) {
#pragma unroll
      for (int pass = 0; pass < kPasses; ++pass) {
        const int row = row_lane + pass * kRowsPerPass;  // row of the tile
        const int j = n * kBlockN + row;
        const char* k_src;
        const char* v_src;
        if constexpr (kPaged) {
          const uint32_t id = __shfl_sync(0xffffffffu, ids_now, slot_lane(rel, row / 16));
          const uint32_t slot = j & page_mask;
          k_src = k_bytes + (wide_product<kLean>(id, k_block_bytes) + wide_product<kLean>(slot, k_row_bytes));
          v_src = v_bytes + (wide_product<kLean>(id, v_block_bytes) + wide_product<kLean>(slot, v_row_bytes));
        } else {
          k_src = k_bytes + wide_product<kLean>(j, k_row_bytes);
          v_src = v_bytes + wide_product<kLean>(j, v_row_bytes);
        }
        copy_pass(k_tile, v_tile, pass, k_src, v_src);
      }
    } else {
      // Rolled (affects speed only; the plain path's copies are unrolled): a smaller loop body. The paged FP8
      // kernel's main loop is ~37 KiB of code and its warps wait on instruction fetch 41% of the time (ncu,
      // B = 1, 8k keys, 2026-11-30); unrolled, this path made it 49%.
#pragma unroll 1
      for (int pass = 0; pass < kPasses; ++pass) {
        const int row = row_lane + pass * kRowsPerPass;
        const int j = n * kBlockN + row;
        bool row_valid = j < seqlen_k && (tile_floor == 0 || j >= tile_floor);  // rows outside the keys load as zeros
        int64_t k_offset, v_offset;     // elements from k_rows / v_rows to the row's chunk
        if constexpr (kPaged) {
          const int32_t id =
              slot_ids ? __shfl_sync(0xffffffffu, ids_now, slot_lane(rel, row / 16)) : per_row_ids[pass];
          if (row_valid && uint32_t(id) >= uint32_t(p.num_blocks)) {  // also catches negative ids
            bad_block_id = true;
            row_valid = false;
          }
          const int slot = page_slot_of(args, j);
          k_offset = int64_t(id) * p.k_batch_stride + int64_t(slot) * p.k_row_stride;
          v_offset = int64_t(id) * p.v_batch_stride + int64_t(slot) * p.v_row_stride;
        } else {
          k_offset = int64_t(j) * p.k_row_stride;
          v_offset = int64_t(j) * p.v_row_stride;
        }
#pragma unroll
        for (int block = 0; block < kColBlocks; ++block) {
          const bool valid = row_valid && chunk_ok[block];
          const uint32_t to = StageTile::offset(0, pass * kRowsPerPass, block * kChunksPerBlockRow);
          cp_async_16(k_tile + to, valid ? k_rows + k_offset + block * kBlockColElements : k_gmem, valid);
          cp_async_16(v_tile + to, valid ? v_rows + v_offset + block * kBlockColElements : v_gmem, valid);
        }
      }
    }
    if (kPaged && !slot_ids && rel + 1 < num_tiles) fetch_per_row_ids(n + 1);  // used by the next call
  };

  // ---- prologue: Q (above) and the first kStages - 1 tiles, one commit group each (empty ones too, so that the
  // tile loop's "wait until kStages - 1 groups are pending", after its own commit, always means "tile it has
  // landed"). Rolled: one copy of issue_tile's code instead of kStages - 1 (code size; affects speed only) ----
#pragma unroll 1
  for (int s = 0; s < kStages - 1 && !first_kept; ++s) {  // (kept: issued before cache_seqlens arrived)
    if (s < num_tiles) {
      if constexpr (kLeanPagedTile) {
        if (lean_paged) issue_tile(s, s, std::true_type{}, 0);  // (paged: no padding)
        else issue_tile(s, s, std::false_type{}, 0);
      } else {
        issue_tile(s, s, std::false_type{}, s == 0 ? padding_floor() : 0);
      }
    }
    cp_async_commit();
  }

  // Scores reach the softmax as s * score_log2_scale in log2 units. Fast path: s is the raw q.k and the scale
  // is folded into the multiplier. With softcap / ALiBi (or a negative scale, whose sign would flip the max)
  // s is first transformed into natural-log units.
  // FP8: the keys are codes, key = code * k_scale, so q.key = (q.code) * k_scale: the scale joins the softmax scale.
  // A scaled q (kScaledQ) gives q.key * 2^q_exponent: the exponent comes off here (exact, a power of two).
  const float qk_scale = kFp8 ? ldexpf(p.softmax_scale * p.k_scale, -q_exponent) : p.softmax_scale;
  const bool natural_units = p.softcap > 0.f || p.alibi_slopes != nullptr || p.softmax_scale < 0.f;
  const float score_log2_scale = natural_units ? kLog2e : qk_scale * kLog2e;
  // The mask of core/mask.hpp's PaddedWindowMask, from a WindowMask and rows.key_begin: the first key of query i is
  // max(key_floor, window_begin(i)) = max(rows.key_begin, window_begin(i)), as window_begin grows with i and
  // rows.key_begin = max(key_floor, window_begin(the block's first query)). So key_floor is not live in the tile loop
  // (rows.key_begin is already).
  const WindowMask mask(p.window_left, p.window_right, p.seqlen_q, seqlen_k);
  auto first_key = [&](int i) { return kLeftPad ? max(mask.key_begin(i), rows.key_begin) : mask.key_begin(i); };
  // Keys [unmasked_begin, unmasked_end) are visible to every row of the m-block (the visible range of
  // query i only moves right with i: the last query's first key, the first query's end), so a warp slice
  // inside it needs no mask: two compares per tile instead of WindowMask::tile_fully_visible.
  const int unmasked_begin = first_key(rows.query_end - 1);
  const int unmasked_end = mask.key_end(rows.query_begin + 1, seqlen_k);

  // This thread's accumulator rows (mt, half): their query and, for ALiBi, their head's transform.
  int row_query[kMTiles][2];
  ScoreTransform transform[kMTiles][2];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = rows.row_begin + mt * 16 + quad_row + 8 * half;  // padding rows (>= rows.rows) are never stored
      row_query[mt][half] = r / group;
      transform[mt][half] = ScoreTransform{p.softcap, alibi_slope(p, b, hk * group + r % group), seqlen_k - p.seqlen_q};
    }

  float o_acc[kMTiles][kDTiles][4];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
      for (int c = 0; c < 4; ++c) o_acc[mt][dt][c] = 0.f;
  float row_max[kMTiles][2];  // running max of s over this warp's keys so far (-inf: none visible yet)
  float row_sum[kMTiles][2];  // running sum of exp2(s * scale - max), this thread's columns only
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      row_max[mt][half] = -INFINITY;
      row_sum[mt][half] = 0.f;
    }

  // Per-lane parts of the ldmatrix addresses (SwizzledTile::offset): A (Q) rows lane % 16, chunk lane / 16;
  // B (K) keys lane % 8 + 8 (lane / 16), chunk (lane / 8) % 2; B (V, transposed) keys lane % 8 + 8 ((lane / 8)
  // % 2), chunk lane / 16 (FP8: K's codes too, see the S loop); K and V shifted to this warp's key slice (a
  // multiple of 16 rows: same swizzle).
  const uint32_t q_lane = QTile::lane_offset(lane & 15, lane >> 4);
  const uint32_t k_lane = StageTile::offset(StageTile::lane_offset((lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1), warp * kWarpKeys, 0);
  const uint32_t v_lane = StageTile::offset(StageTile::lane_offset((lane & 7) + (((lane >> 3) & 1) << 3), lane >> 4), warp * kWarpKeys, 0);

  // The tile loop, compiled twice: with the score transform (softcap, ALiBi, a negative scale) and without it.
  // The transform's inlined code (~700 instructions: a software tanhf per score) sat inside the one loop even
  // when skipped, and with it the paged kernels' loops outgrew the instruction cache (ncu: up to 45% of warp
  // samples stalled on "no instruction"). Code size only: both copies compute the same.
  auto tile_loop = [&](auto with_transform, auto lean) {
    // The stage of tile it - 1 is refilled as soon as every warp is done with it, before the wait for tile it:
    // the ring's every stage is then in flight while a tile waits to land, kStages tiles instead of kStages - 1
    // (the MMAs take a stage for a small part of a tile's time). One barrier more per tile. Affects speed only:
    // H200, against the loop that refilled it after tile it had landed, 1.005x over bench/ab_decode.sh's 63 points,
    // short calls +1-3% (2026-12-03 16:02 UTC, bench/results/2026-12-03-1602-h200-decode-stage-free-issue-*).
    for (int it = 0; it < num_tiles; ++it) {
      __syncthreads();  // every warp is done with tile it - 1 (its stage is refilled now)
      const int ahead = it + kStages - 1;
      if (ahead < num_tiles) issue_tile(ahead, ahead % kStages, lean, 0);
      cp_async_commit();
      cp_async_wait<kStages - 1>();  // this thread's copies of tile `it` (and Q) have landed
      __syncthreads();               // everyone's have
      if (it == 0) C::stamp(C::kStampFirstTile, p.out);

      const int stage = it % kStages;
      const uint32_t k_tile = kv_smem + uint32_t(stage) * 2u * StageTile::kBytes;
      const uint32_t v_tile = k_tile + StageTile::kBytes;
      const int slice0 = (work.tile_begin + it) * kBlockN + warp * kWarpKeys;  // first key of this warp's slice
      // Warp-uniform: skip slices that no row of the m-block sees (past the keys, or outside the window).
      if (slice0 >= rows.key_end || slice0 + kWarpKeys <= rows.key_begin) continue;

      // ---- S = Q K^T (fp32) over this warp's keys ----
      float s_acc[kMTiles][kNTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
          for (int c = 0; c < 4; ++c) s_acc[mt][nt][c] = 0.f;
      if constexpr (kFp8) {
        // Two k16 steps (d chunks 2ks2, 2ks2 + 1 of the codes) per ldmatrix: matrices (keys +0..7, chunk 2ks2),
        // (+8..15, 2ks2), (+0..7, 2ks2 + 1), (+8..15, 2ks2 + 1) give thread t codes d = 4 (t % 4) .. + 3 of key
        // t / 4 of each, i.e. B registers 0 and 1 of an n8 tile in Q's permuted d order (fp8_q_column).
#pragma unroll
        for (int ks2 = 0; ks2 < kQKSteps / 2; ++ks2) {
          uint32_t q_frag[2][kMTiles][4];
#pragma unroll
          for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt)
              ldmatrix_x4(q_frag[j][mt], q_smem + QTile::offset(q_lane, mt * 16, 2 * (2 * ks2 + j)));
#pragma unroll
          for (int np = 0; np < kNTiles / 2; ++np) {
            uint32_t codes[4];
            ldmatrix_x4(codes, k_tile + StageTile::offset(v_lane, np * 16, 2 * ks2));
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
              for (int t = 0; t < 2; ++t) {  // key tile 2np + t
                const uint2 k_values = e4m3x4_to_half4(codes[2 * j + t]);
                const uint32_t b[2] = {k_values.x, k_values.y};
#pragma unroll
                for (int mt = 0; mt < kMTiles; ++mt) mma_m16n8k16<MmaElement>(s_acc[mt][2 * np + t], q_frag[j][mt], b);
              }
          }
        }
      } else {
#pragma unroll
        for (int ks = 0; ks < kQKSteps; ++ks) {
          uint32_t q_frag[kMTiles][4];
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt) ldmatrix_x4(q_frag[mt], q_smem + QTile::offset(q_lane, mt * 16, 2 * ks));
#pragma unroll
          for (int np = 0; np < kNTiles / 2; ++np) {
            // B for key tiles 2np, 2np + 1: matrices (keys +0..7, chunk 2ks), (+0..7, 2ks+1), (+8..15, 2ks), (+8..15, 2ks+1)
            uint32_t k_frag[4];
            ldmatrix_x4(k_frag, k_tile + StageTile::offset(k_lane, np * 16, 2 * ks));
            const uint32_t b_lo[2] = {k_frag[0], k_frag[1]};
            const uint32_t b_hi[2] = {k_frag[2], k_frag[3]};
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt) {
              mma_m16n8k16<Element>(s_acc[mt][2 * np], q_frag[mt], b_lo);
              mma_m16n8k16<Element>(s_acc[mt][2 * np + 1], q_frag[mt], b_hi);
            }
          }
        }
      }

      // ---- score transform (the with_transform loop only) and mask (a uniform branch: boundary slices only) ----
      if constexpr (decltype(with_transform)::value) {
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
          for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
            for (int c = 0; c < 4; ++c)
              s_acc[mt][nt][c] = transform[mt][c >> 1](s_acc[mt][nt][c] * qk_scale, row_query[mt][c >> 1],
                                                       slice0 + nt * 8 + 2 * quad_col + (c & 1));
      }
      const bool slice_needs_mask = slice0 < unmasked_begin || slice0 + kWarpKeys > unmasked_end;
      if (slice_needs_mask) {
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            // Row i sees keys [key_begin(i), key_end(i + 1)) (clamped to the keys): two compares per score,
            // against offsets relative to this thread's first column.
            const int i = row_query[mt][half];
            const int first_col = slice0 + 2 * quad_col;
            const int visible_begin = first_key(i) - first_col;
            const int visible_end = mask.key_end(i + 1, seqlen_k) - first_col;
#pragma unroll
            for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                const int col = nt * 8 + e;  // compile-time
                if (col < visible_begin || col >= visible_end) s_acc[mt][nt][2 * half + e] = -INFINITY;
              }
          }
      }

      // ---- online softmax: P = exp2(s * scale - max); lazy: the max moves (and O and the sum are rescaled)
      // only when a tile's scores exceed it by more than kMaxStaleLog2 (as in the forward kernel:
      // sm80/forward_kernel.cuh explains why any max that bounds the scores gives the same O and LSE) ----
      float correction[kMTiles][2];
      bool rescale_any = false;
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          float tile_max = -INFINITY;
#pragma unroll
          for (int nt = 0; nt < kNTiles; ++nt)
            tile_max = fmaxf(tile_max, fmaxf(s_acc[mt][nt][2 * half], s_acc[mt][nt][2 * half + 1]));
          tile_max = quad_max(tile_max);  // the 4 threads of a quad hold the row's columns
          const float old_max = row_max[mt][half];
          const float new_max = fmaxf(old_max, tile_max);
          // First visible tile: new - (-inf) = +inf, moves. A row with no visible key yet: -inf - (-inf) is NaN,
          // the compare is false and the max stays -inf.
          const bool rescale = (new_max - old_max) * score_log2_scale > kMaxStaleLog2;
          const float row_max_now = rescale ? new_max : old_max;
          // A row that so far sees only masked keys keeps max = -inf; subtracting 0 instead gives exp2(-inf) = 0
          // for its entries, where -inf - (-inf) would give NaN.
          const float max_scaled = row_max_now == -INFINITY ? 0.f : row_max_now * score_log2_scale;
          correction[mt][half] = rescale ? exp2_approx(old_max * score_log2_scale - max_scaled) : 1.f;  // 0 on the first visit
          rescale_any |= rescale;
          row_max[mt][half] = row_max_now;
          float tile_sum = 0.f;
#pragma unroll
          for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const float prob = exp2_approx(fmaf(s_acc[mt][nt][2 * half + e], score_log2_scale, -max_scaled));
              tile_sum += prob;
              s_acc[mt][nt][2 * half + e] = prob;
            }
          row_sum[mt][half] = fmaf(row_sum[mt][half], correction[mt][half], tile_sum);
        }
      // Warp-uniform branch (a vote): the skip pays only when no row of the warp moved its max.
      if (__any_sync(0xffffffffu, rescale_any)) {
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
          for (int half = 0; half < 2; ++half)
#pragma unroll
            for (int dt = 0; dt < kDTiles; ++dt) {
              o_acc[mt][dt][2 * half] *= correction[mt][half];
              o_acc[mt][dt][2 * half + 1] *= correction[mt][half];
            }
      }

      // ---- O += P V: S accumulators become A fragments in registers; V via ldmatrix.trans ----
#pragma unroll
      for (int ks = 0; ks < kPVSteps; ++ks) {
        uint32_t p_frag[kMTiles][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          // A of m16n8k16 (rows g, g + 8; k 2t.. and 2t + 8..) = S tiles 2ks (keys +0..7) and 2ks + 1 (+8..15)
          p_frag[mt][0] = ElementTraits<MmaElement>::pack(s_acc[mt][2 * ks][0], s_acc[mt][2 * ks][1]);
          p_frag[mt][1] = ElementTraits<MmaElement>::pack(s_acc[mt][2 * ks][2], s_acc[mt][2 * ks][3]);
          p_frag[mt][2] = ElementTraits<MmaElement>::pack(s_acc[mt][2 * ks + 1][0], s_acc[mt][2 * ks + 1][1]);
          p_frag[mt][3] = ElementTraits<MmaElement>::pack(s_acc[mt][2 * ks + 1][2], s_acc[mt][2 * ks + 1][3]);
        }
        if constexpr (kFp8) {
          // Two code chunks (32 columns, O tiles 4cp .. 4cp + 3) per ldmatrix.trans: matrices (keys +0..7, chunk
          // 2cp), (+8..15, 2cp), (+0..7, 2cp + 1), (+8..15, 2cp + 1) give thread t, of keys 2 (t % 4) and + 1 (+ 8
          // in the second matrix), the codes of columns 2 (t / 4) and + 1 of the chunk: B registers 0 and 1 of the
          // chunk's even-column tile and of its odd-column tile (fp8_o_column).
#pragma unroll
          for (int cp = 0; cp < kDTiles / 4; ++cp) {
            uint32_t codes[4];
            ldmatrix_x4_trans(codes, v_tile + StageTile::offset(v_lane, ks * 16, 2 * cp));
#pragma unroll
            for (int j = 0; j < 2; ++j) {
              const uint32_t b_even[2] = {e4m3_column_to_half2<false>(codes[2 * j]),
                                          e4m3_column_to_half2<false>(codes[2 * j + 1])};
              const uint32_t b_odd[2] = {e4m3_column_to_half2<true>(codes[2 * j]),
                                         e4m3_column_to_half2<true>(codes[2 * j + 1])};
#pragma unroll
              for (int mt = 0; mt < kMTiles; ++mt) {
                mma_m16n8k16<MmaElement>(o_acc[mt][4 * cp + 2 * j], p_frag[mt], b_even);
                mma_m16n8k16<MmaElement>(o_acc[mt][4 * cp + 2 * j + 1], p_frag[mt], b_odd);
              }
            }
          }
        } else {
#pragma unroll
          for (int dp = 0; dp < kDTiles / 2; ++dp) {
            // B for d tiles 2dp, 2dp + 1 (transposed): matrices (keys +0..7, chunk 2dp), (+8..15, 2dp), (+0..7, 2dp+1), (+8..15, 2dp+1)
            uint32_t v_frag[4];
            ldmatrix_x4_trans(v_frag, v_tile + StageTile::offset(v_lane, ks * 16, 2 * dp));
            const uint32_t b_lo[2] = {v_frag[0], v_frag[1]};
            const uint32_t b_hi[2] = {v_frag[2], v_frag[3]};
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt) {
              mma_m16n8k16<Element>(o_acc[mt][2 * dp], p_frag[mt], b_lo);
              mma_m16n8k16<Element>(o_acc[mt][2 * dp + 1], p_frag[mt], b_hi);
            }
          }
        }
      }
    }
  };
  if (natural_units) {
    tile_loop(std::true_type{}, std::false_type{});
  } else if constexpr (kLeanPagedTile) {
    if (lean_paged) tile_loop(std::false_type{}, std::true_type{});
    else tile_loop(std::false_type{}, std::false_type{});
  } else {
    tile_loop(std::false_type{}, std::false_type{});
  }

  C::stamp(C::kStampLoopDone, p.out);
  // ---- epilogue 1: every warp puts its (max, sum) per row and its unnormalised O into the (now idle) K/V
  // stages; one barrier; then epilogue 2 merges the warps per output element. (One barrier: the warps' shares
  // are not normalised before the barrier, which took a second barrier and a dependent chain of shared-memory
  // round trips before any store.) ----
  cp_async_wait<0>();  // only empty groups can be pending here, but never reuse memory a copy may still target
  // also: every warp is done reading K/V. The result passes through an opaque move: nvcc 13.0 otherwise dropped it
  // and re-ran the barrier reduction inside epilogue 2's loop, which only some threads enter (SASS: a second
  // BAR.RED.OR after the loop's branch; with a cluster merge after it, the CTA deadlocked on the H200, 2026-12-01).
  uint32_t bad_word = uint32_t(__syncthreads_or(bad_block_id) != 0);
  asm volatile("mov.b32 %0, %0;\n" : "+r"(bad_word));
  const bool bad = bad_word != 0;
  C::stamp(C::kStampDrained, p.out);
  float* merge_o = reinterpret_cast<float*>(smem + QTile::kBytes);               // [warp][row][kMergeRow]
  float2* merge_stats = reinterpret_cast<float2*>(merge_o + kWarps * kBlockM * kMergeRow);  // [warp][row] (max, sum)
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = mt * 16 + quad_row + 8 * half;
      float* merge_row = merge_o + (warp * kBlockM + row) * kMergeRow;
      if constexpr (kFp8) {  // tiles 2c, 2c + 1 hold the even and odd columns of 16c .. 16c + 15 (fp8_o_column)
#pragma unroll
        for (int dt = 0; dt < kDTiles; dt += 2)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            *reinterpret_cast<float2*>(merge_row + fp8_o_column(dt, quad_col, e)) =
                make_float2(o_acc[mt][dt][2 * half + e], o_acc[mt][dt + 1][2 * half + e]);
      } else {
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt)
          *reinterpret_cast<float2*>(merge_row + dt * 8 + 2 * quad_col) = make_float2(o_acc[mt][dt][2 * half], o_acc[mt][dt][2 * half + 1]);
      }
      const float sum = quad_sum(row_sum[mt][half]);
      const float max_scaled = row_max[mt][half] == -INFINITY ? -INFINITY : row_max[mt][half] * score_log2_scale;
      if (quad_col == 0) merge_stats[warp * kBlockM + row] = make_float2(max_scaled, sum);
    }
  __syncthreads();
  C::stamp(C::kStampMerged, p.out);

  // ---- epilogue 2: kMergeRowThreads threads per row, each the row's columns 4 t + 32 k (t = tid % 8; a quarter-warp
  // reads one contiguous 128-byte line per float4: no bank conflict):
  //   O = (sum_w exp2(max_w - M) O_w) / (sum_w exp2(max_w - M) sum_w), M = the largest max_w over the warps w,
  //   LSE = M + log2(the denominator), stored as out in the dtype (and lse), or as the split's fp32 partial.
  // The numerator's sum runs beside the reciprocal of the denominator (one multiply per element at the end); the
  // exp2, the reciprocal and the log2 are single MUFU instructions (ptx.cuh; weights <= 1, denominator >= 1 for a
  // row with a key). A row's weights are computed once per thread (each of a row's threads for itself: cheaper
  // than a second barrier). A warp that saw no key of the row has max -inf: weight 0. When no warp has a finite
  // max, each sum is 0, or NaN where a NaN input reached the row (its max stayed -inf under fmaxf): the weights
  // are 1, the sum is 0 (O = 0, LSE = -inf: no visible key) or NaN (propagates: the NaN/Inf policy). H200,
  // 2026-12-04: the previous epilogue (one thread per (row, 8 columns), two items per thread, exp2f / IEEE
  // division / log2f) spent ~0.25 us of its ~0.72 us after the barrier in this math
  // (bench/results/2026-12-04-0437-decode-epilogue-merge-math-probe-not-kept.patch). ----
  constexpr int kMergeRowThreads = 8;       // threads per row of the merge; 4 columns per thread and step
  constexpr int kColSteps = kHeadDim / 32;  // steps of 32 columns
  constexpr int kMergeRowsPerPass = kThreads / kMergeRowThreads;
  static_assert(kHeadDim % 32 == 0 && kThreads % kMergeRowThreads == 0, "whole 32-column steps, whole rows per pass");
  const int64_t partial_base = int64_t(split) * int64_t(p.batch) * p.heads_q * p.seqlen_q;  // first row of this split
  const int col_lane = (tid % kMergeRowThreads) * 4;  // this thread's first column
  const int out_cols = d_chunks * 8;                   // D: columns from D up to kHeadDim are padding
#pragma unroll
  for (int pass = 0; pass < (kBlockM + kMergeRowsPerPass - 1) / kMergeRowsPerPass; ++pass) {
    const int row = pass * kMergeRowsPerPass + tid / kMergeRowThreads;
    if (row >= rows.rows) break;
    const int r = rows.row_begin + row;
    const int i = r / group, h = hk * group + r % group;
    float2 stats[kWarps];
    float merged_max = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      stats[w] = merge_stats[w * kBlockM + row];
      merged_max = fmaxf(merged_max, stats[w].x);
    }
    float weight[kWarps];
    float merged_sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      weight[w] = merged_max == -INFINITY ? 1.f : exp2_approx(stats[w].x - merged_max);  // ex2(-inf) = 0
      merged_sum = fmaf(stats[w].y, weight[w], merged_sum);
    }
    float4 v[kColSteps];
#pragma unroll
    for (int k = 0; k < kColSteps; ++k) {
      v[k] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float* o_row = merge_o + (w * kBlockM + row) * kMergeRow;
        const float4 o = *reinterpret_cast<const float4*>(o_row + 32 * k + col_lane);
        v[k].x = fmaf(weight[w], o.x, v[k].x), v[k].y = fmaf(weight[w], o.y, v[k].y);
        v[k].z = fmaf(weight[w], o.z, v[k].z), v[k].w = fmaf(weight[w], o.w, v[k].w);
      }
    }
    const bool no_visible_key = merged_sum == 0.f;
    // FP8: values are codes, value = code * v_scale, so O = (P codes) * v_scale: folded in here.
    const float scale = bad ? NAN : (no_visible_key ? 0.f : (kFp8 ? p.v_scale : 1.f) * rcp_approx(merged_sum));
#pragma unroll
    for (int k = 0; k < kColSteps; ++k) v[k].x *= scale, v[k].y *= scale, v[k].z *= scale, v[k].w *= scale;
    // The LSE in log2 units (-inf for an empty row), stored by the row's first thread: out's lse in natural log;
    // the partials' (and the cluster's) stay in log2 units, where their merge's exp2 works (decode_work.hpp).
    const float lse_log2 = bad ? NAN : (no_visible_key ? -INFINITY : merged_max + log2_approx(merged_sum));
    const bool lse_thread = col_lane == 0;
    if (direct) {
      if (!call_row(i)) continue;  // a padding row (varlen rows): its place is another sequence's
      Element* out_row = out_gmem + row_offset(p.out_batch_stride, p.out_row_stride) + int64_t(i) * p.out_row_stride +
                         h * p.out_head_stride;
#pragma unroll
      for (int k = 0; k < kColSteps; ++k)
        if (32 * k + col_lane < out_cols)
          *reinterpret_cast<uint2*>(out_row + 32 * k + col_lane) =
              make_uint2(ElementTraits<Element>::pack(v[k].x, v[k].y), ElementTraits<Element>::pack(v[k].z, v[k].w));
      if (lse_thread && p.lse != nullptr)
        p.lse[row_offset(p.lse_batch_stride, p.lse_row_stride) + h * p.lse_head_stride + int64_t(i) * p.lse_row_stride] =
            lse_log2 * kLn2;
    } else if (clustered) {
#pragma unroll
      for (int k = 0; k < kColSteps; ++k)
        *reinterpret_cast<float4*>(cluster_out + row * kHeadDim + 32 * k + col_lane) = v[k];
      if (lse_thread) cluster_lse[row] = lse_log2;
    } else {
      const int64_t prow = partial_base + partial_row(p, b, h, i);
      float* partial_row_out = args.partial_out + prow * p.head_dim_v;
#pragma unroll
      for (int k = 0; k < kColSteps; ++k)
        if (32 * k + col_lane < out_cols) *reinterpret_cast<float4*>(partial_row_out + 32 * k + col_lane) = v[k];
      if (lse_thread) args.partial_lse[prow] = lse_log2;
    }
  }
  if (clustered && !direct) merge_cluster(work.used);
  C::stamp(C::kStampEnd, p.out);
}

}  // namespace flashattn::cuda::decode
