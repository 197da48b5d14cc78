// Philox4x32-10 known-answer tests (Random123's kat_vectors) and the dropout keep-mask layout.
#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "core/philox.hpp"

namespace flashattn {
namespace {

void expect_philox(Philox4x32 counter, uint32_t k0, uint32_t k1, Philox4x32 expected) {
  const Philox4x32 r = philox4x32_10(counter, k0, k1);
  for (int n = 0; n < 4; ++n) EXPECT_EQ(r.x[n], expected.x[n]) << "word " << n;
}

TEST(Philox, KnownAnswers) {
  expect_philox({{0, 0, 0, 0}}, 0, 0, {{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}});
  expect_philox({{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}}, 0xffffffffu, 0xffffffffu,
                {{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}});
  expect_philox({{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}}, 0xa4093822u, 0x299f31d0u,
                {{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}});
}

TEST(Philox, ThresholdRoundsToMultipleOf2PowMinus16) {
  EXPECT_EQ(dropout_threshold_u16(0.f), 0u);
  EXPECT_EQ(dropout_threshold_u16(0.5f), 32768u);
  EXPECT_EQ(dropout_threshold_u16(0.1f), 6554u);  // 6553.6 rounds to 6554
  EXPECT_EQ(dropout_threshold_u16(0.99999f), 65535u);
}

// One Philox call serves exactly the 8 keys {8n + 2t, 8n + 2t + 1 : n < 4} of a 32-key block, each
// key using a distinct 16-bit lane: the layout the GPU kernels rely on.
TEST(Philox, BlockLayoutCoversEachKeyOnce) {
  for (uint32_t t = 0; t < 4; ++t) {
    std::set<uint32_t> lanes;
    const Philox4x32 block = dropout_random_block(7, 3, 5, 11, 32 + 2 * t);
    for (uint32_t n = 0; n < 4; ++n)
      for (uint32_t half = 0; half < 2; ++half) {
        const uint32_t j = 32 + 8 * n + 2 * t + half;
        // every key of the group maps to the same Philox call...
        const Philox4x32 again = dropout_random_block(7, 3, 5, 11, j);
        for (int w = 0; w < 4; ++w) EXPECT_EQ(again.x[w], block.x[w]);
        // ...and to its own lane
        lanes.insert(2 * ((j >> 3) & 3) + (j & 1));
        EXPECT_EQ(dropout_u16_of_key(block, j), dropout_u16_of_key(again, j));
      }
    EXPECT_EQ(lanes.size(), 8u);
  }
}

TEST(Philox, KeepRateWithinFourSigma) {
  const float p = 0.3f;
  const uint32_t threshold = dropout_threshold_u16(p);
  const double keep_probability = 1.0 - threshold / 65536.0;
  int64_t kept = 0, total = 0;
  for (uint32_t bh = 0; bh < 4; ++bh)
    for (uint32_t i = 0; i < 200; ++i)
      for (uint32_t j = 0; j < 300; ++j) {
        kept += dropout_keep(1234567u, 42u, bh, i, j, threshold);
        ++total;
      }
  const double sigma = std::sqrt(total * keep_probability * (1 - keep_probability));
  EXPECT_NEAR(double(kept), total * keep_probability, 4 * sigma);
}

TEST(Philox, SeedAndOffsetChangeTheMask) {
  const uint32_t threshold = dropout_threshold_u16(0.5f);
  int differ_seed = 0, differ_offset = 0, differ_offset_hi = 0;
  for (uint32_t j = 0; j < 256; ++j) {
    const bool base = dropout_keep(1, 0, 0, 0, j, threshold);
    differ_seed += base != dropout_keep(2, 0, 0, 0, j, threshold);
    differ_offset += base != dropout_keep(1, 1, 0, 0, j, threshold);
    differ_offset_hi += base != dropout_keep(1, uint64_t(1) << 40, 0, 0, j, threshold);
  }
  EXPECT_GT(differ_seed, 64);
  EXPECT_GT(differ_offset, 64);
  EXPECT_GT(differ_offset_hi, 64);
}

}  // namespace
}  // namespace flashattn
