// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11) and the
// dropout keep-mask built on it. This file is the single definition used by every backend: the
// CPU reference, the CPU flash path and the CUDA kernels compute the same keep bit for the same
// (seed, offset, b, h, i, j), so the CPU reproduces the GPU's mask bit for bit and backward
// regenerates the forward's mask instead of storing it.
//
// The keep bit of score (b, h, i, j) (h = query head, i = query row, j = key row of sequence b):
//   key     = (lo32(seed), hi32(seed) ^ hi32(offset))
//   counter = (i, 4 * (j / 32) + (j / 2) % 4, b * Hq + h, lo32(offset))
//   r[0..3] = Philox4x32-10(counter, key);  the call yields 8 uniform 16-bit values
//             u[k] = (r[k / 2] >> (16 * (k % 2))) & 0xffff,  k = 0..7
//   k       = 2 * ((j / 8) % 4) + j % 2
//   keep    = u[k] >= threshold,  threshold = round(p * 65536)
// One call covers the 8 keys {8n + 2t, 8n + 2t + 1 : n = 0..3} of a 32-key block for t = (j/2)%4:
// exactly the columns that one thread of an m16n8 tensor-core accumulator holds in a row, so a
// GPU thread makes one Philox call per row per 32 keys and wastes none of its output.
// The drop probability is therefore threshold / 65536 (p rounded to a multiple of 2^-16); kept
// values are scaled by 1 / (1 - p) with the caller's p.
#pragma once

#include <cstdint>

#include "core/host_device.hpp"

namespace flashattn {

struct Philox4x32 {
  uint32_t x[4];
};

// Constants of Philox4x32 (the round multipliers and the Weyl key increments).
constexpr uint32_t kPhiloxM0 = 0xD2511F53u;
constexpr uint32_t kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u;
constexpr uint32_t kPhiloxW1 = 0xBB67AE85u;
constexpr int kPhiloxRounds = 10;

FA_HD uint32_t mul_hi_u32(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return uint32_t((uint64_t(a) * uint64_t(b)) >> 32);
#endif
}

FA_HD Philox4x32 philox4x32_10(Philox4x32 counter, uint32_t key0, uint32_t key1) {
  Philox4x32 c = counter;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = 0; round < kPhiloxRounds; ++round) {
    const uint32_t lo0 = kPhiloxM0 * c.x[0];
    const uint32_t hi0 = mul_hi_u32(kPhiloxM0, c.x[0]);
    const uint32_t lo1 = kPhiloxM1 * c.x[2];
    const uint32_t hi1 = mul_hi_u32(kPhiloxM1, c.x[2]);
    Philox4x32 next;
    next.x[0] = hi1 ^ c.x[1] ^ key0;
    next.x[1] = lo1;
    next.x[2] = hi0 ^ c.x[3] ^ key1;
    next.x[3] = lo0;
    c = next;
    key0 += kPhiloxW0;
    key1 += kPhiloxW1;
  }
  return c;
}

// Drop threshold on the 16-bit uniform: keep iff u16 >= threshold.
FA_HD uint32_t dropout_threshold_u16(float p) {
  const float scaled = p * 65536.f + 0.5f;
  return scaled <= 0.f ? 0u : (scaled >= 65536.f ? 65536u : uint32_t(scaled));
}

// The Philox call for query row i, key block (j / 32), sub-column t = (j / 2) % 4 of head bh.
FA_HD Philox4x32 dropout_random_block(uint64_t seed, uint64_t offset, uint32_t bh, uint32_t i,
                                      uint32_t j) {
  const uint32_t key0 = uint32_t(seed);
  const uint32_t key1 = uint32_t(seed >> 32) ^ uint32_t(offset >> 32);
  Philox4x32 counter;
  counter.x[0] = i;
  counter.x[1] = 4u * (j >> 5) + ((j >> 1) & 3u);
  counter.x[2] = bh;
  counter.x[3] = uint32_t(offset);
  return philox4x32_10(counter, key0, key1);
}

// Which of the 8 16-bit values of the block belongs to key j.
FA_HD uint32_t dropout_u16_of_key(const Philox4x32& r, uint32_t j) {
  const uint32_t k = 2u * ((j >> 3) & 3u) + (j & 1u);
  return (r.x[k >> 1] >> (16u * (k & 1u))) & 0xFFFFu;
}

// The keep bit of (b, h, i, j); bh = b * Hq + h. Reference form: one Philox call per element.
FA_HD bool dropout_keep(uint64_t seed, uint64_t offset, uint32_t bh, uint32_t i, uint32_t j,
                        uint32_t threshold) {
  return dropout_u16_of_key(dropout_random_block(seed, offset, bh, i, j), j) >= threshold;
}

}  // namespace flashattn
