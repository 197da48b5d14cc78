// The compile-time configuration of one kernel instantiation, as listed in src/cuda/manifest.py.
// Every field but Element, kHeadDim and kDropout affects speed, registers and shared memory only,
// never results.
#pragma once

namespace flashattn::cuda {

template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kWarps_, int kStages_, bool kDropout_,
          int kWarpKeys_ = 16, int kGroupWarps_ = 1>
struct KernelConfig {
  using Element = Element_;                 // __half or __nv_bfloat16
  static constexpr int kHeadDim = kHeadDim_;  // head-dim bucket: D <= kHeadDim, D % 8 == 0, zero-padded
  static constexpr int kBlockM = kBlockM_;    // query rows per CTA
  static constexpr int kBlockN = kBlockN_;    // key rows per K/V tile
  static constexpr int kWarps = kWarps_;
  static constexpr int kThreads = 32 * kWarps_;
  static constexpr int kStages = kStages_;    // K/V shared-memory stages (1 or 2)
  static constexpr bool kDropout = kDropout_;
  // Backward only: keys per warp on the MMA's M side (16 or 32; 32 reuses each Q / dO fragment for two
  // m16 key blocks). The forward and decode kernels ignore it (16).
  static constexpr int kWarpKeys = kWarpKeys_;
  // Forward only: warps that share one group of query rows (1, or 2: the pair splits the keys of S = Q K^T
  // and the columns of O; see src/cuda/sm80/forward_kernel.cuh). Backward and decode ignore it (1).
  static constexpr int kGroupWarps = kGroupWarps_;

  static_assert(kHeadDim % 32 == 0 && kHeadDim <= 256, "head-dim buckets are multiples of 32 up to 256");
  static_assert(kBlockN % 32 == 0, "the Philox keep-mask layout covers keys in blocks of 32");
  static_assert(kStages == 1 || kStages == 2, "1 (K and V alternate) or 2 (double-buffered) stages");
  static_assert(kWarpKeys == 16 || kWarpKeys == 32, "16 or 32 keys per warp");
  static_assert(kGroupWarps == 1 || kGroupWarps == 2, "warps alone or in pairs");
};

}  // namespace flashattn::cuda
