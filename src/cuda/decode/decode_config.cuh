// The compile-time configuration of one decode (kvcache) kernel instantiation, as listed in
// src/cuda/manifest.py (DECODE_TILES, DECODE_FP8_TILES). Every field but Element, kHeadDim and kFp8Cache
// affects speed, registers and shared memory only, never results.
#pragma once

namespace flashattn::cuda::decode {

template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kWarps_, int kStages_, bool kDropout_,
          bool kFp8Cache_ = false>
struct DecodeConfig {
  using Element = Element_;                   // __half or __nv_bfloat16 (q, out; the cache too unless kFp8Cache)
  // The K/V cache is float8 e4m3 (params.kv_dtype): its tiles stream through the kStages ring as fp8 codes,
  // which the MMA loops convert (exactly) in registers; k_scale / v_scale are folded into the softmax scale and
  // the final normalisation.
  static constexpr bool kFp8Cache = kFp8Cache_;
  static constexpr int kHeadDim = kHeadDim_;  // head-dim bucket: D <= kHeadDim, D % 8 == 0, zero-padded
  static constexpr int kBlockM = kBlockM_;    // packed rows (query head x new token) per CTA, in m16 tiles
  static constexpr int kBlockN = kBlockN_;    // keys per K/V tile; warp w computes keys [w, w + 1) * kWarpKeys of it
  static constexpr int kWarps = kWarps_;
  static constexpr int kThreads = 32 * kWarps_;
  static constexpr int kStages = kStages_;    // K/V tiles in shared memory: all kStages load while one is awaited (tile_loop)
  static constexpr int kWarpKeys = kBlockN_ / kWarps_;
  // Dynamic shared memory (decode_kernel.cuh's layout; the manifest computes the same): Q in 16-bit, then
  // kStages x (K, V) in the cache's element (FP8: 1 byte).
  static constexpr int kSmemBytes = kBlockM * kHeadDim * 2 + 2 * kStages * kBlockN * kHeadDim * (kFp8Cache ? 1 : 2);
  // Launch bounds' minimum CTAs per SM: 0 (none: ptxas's own register choice) for 16-bit caches. FP8 caches: as
  // many as an H200 SM's shared memory holds (227 KiB), 2 or 3, so that registers never limit them more
  // (ptxas's own choice for a 68 KiB D = 128 tile, 194-220 registers, allowed 2 where shared memory allowed 3;
  // ptxas -v, 2026-11-30).
  static constexpr int kMinCtasPerSm = !kFp8Cache ? 0 : (3 * (kSmemBytes + 1024) <= 228 * 1024 ? 3 : 2);
  // Whether the launcher instantiates the kernel for calls with cache_leftpad (decode_kernel.cuh, kLeftPad) besides
  // those for a contiguous and a paged cache: the library's configs do; bench/decode_bench.cu's tuning variants do
  // not (build time), and refuse such a call.
  static constexpr bool kLeftPadKernel = true;

  // Timeline probe (tuning only): the kernel calls C::stamp(event, out) at the phase boundaries below. Here a
  // no-op that compiles to nothing; bench/decode_bench.cu's "tl_" variants derive a config whose stamp records
  // %globaltimer per CTA.
  enum Stamp : int {
    kStampStart = 0,    // CTA start, before waiting for the previous grids
    kStampWaited,       // previous grids done (programmatic launch)
    kStampPlanned,      // cache_seqlens read, the split's tiles known
    kStampFirstTile,    // the first K/V tile has landed in shared memory
    kStampLoopDone,     // the last tile's P V is done
    kStampEnd,          // out / partial stored
    kStampDrained,      // epilogue: every warp is done with K/V (the barrier after the loop)
    kStampMerged,       // epilogue: every warp's O and (max, sum) are in shared memory (the barrier after them)
    kStampClusterSynced,  // cluster merge: past its first cluster barrier (every split's partial is in place)
    kStampClusterRead,    // cluster merge: this thread's rows merged and stored, before the second cluster barrier
    kStampCount
  };
  static __device__ __forceinline__ void stamp(int, const void*) {}

  static_assert(!kDropout_, "the decode kernels have no dropout path (the host rejects dropout_p > 0)");
  static_assert(kHeadDim % 32 == 0 && kHeadDim <= 256, "head-dim buckets are multiples of 32 up to 256");
  static_assert(kBlockM % 16 == 0, "packed rows come in m16 tiles");
  static_assert(kWarpKeys % 16 == 0, "each warp's key slice is whole k16 steps of P V");
  static_assert(kStages >= 2 && kStages <= 4, "2 to 4 K/V stages");
  static_assert(!kFp8Cache || kHeadDim % 64 == 0, "an fp8 staging tile is a 16-bit SwizzledTile of kHeadDim / 2 columns");
};

}  // namespace flashattn::cuda::decode
