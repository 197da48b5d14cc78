// The compile-time configuration of one decode (kvcache) kernel instantiation, as listed in
// src/cuda/manifest.py (DECODE_TILES). Every field but Element and kHeadDim affects speed, registers and
// shared memory only, never results.
#pragma once

namespace flashattn::cuda::decode {

template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kWarps_, int kStages_, bool kDropout_>
struct DecodeConfig {
  using Element = Element_;                   // __half or __nv_bfloat16
  static constexpr int kHeadDim = kHeadDim_;  // head-dim bucket: D <= kHeadDim, D % 8 == 0, zero-padded
  static constexpr int kBlockM = kBlockM_;    // packed rows (query head x new token) per CTA, in m16 tiles
  static constexpr int kBlockN = kBlockN_;    // keys per K/V tile; warp w computes keys [w, w + 1) * kWarpKeys of it
  static constexpr int kWarps = kWarps_;
  static constexpr int kThreads = 32 * kWarps_;
  static constexpr int kStages = kStages_;    // K/V tiles in shared memory: kStages - 1 load while one is used
  static constexpr int kWarpKeys = kBlockN_ / kWarps_;

  static_assert(!kDropout_, "the decode kernels have no dropout path (the host rejects dropout_p > 0)");
  static_assert(kHeadDim % 32 == 0 && kHeadDim <= 256, "head-dim buckets are multiples of 32 up to 256");
  static_assert(kBlockM % 16 == 0, "packed rows come in m16 tiles");
  static_assert(kWarpKeys % 16 == 0, "each warp's key slice is whole k16 steps of P V");
  static_assert(kStages >= 2 && kStages <= 4, "2 to 4 K/V stages");
};

}  // namespace flashattn::cuda::decode
