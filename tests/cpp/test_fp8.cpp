// float8 e4m3 <-> float (src/core/fp8.hpp): every code, round trips, ties to even, saturation, NaN.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "core/dtype.hpp"
#include "core/fp8.hpp"
#include "cpu/flash/tile_io.hpp"

namespace flashattn {
namespace {

// The value of a code from the format's definition, in double (independent of the bit tricks).
double e4m3_by_definition(int code) {
  const int sign = code >> 7, exponent = (code >> 3) & 15, mantissa = code & 7;
  if ((code & 0x7F) == 0x7F) return std::numeric_limits<double>::quiet_NaN();
  const double magnitude = exponent == 0 ? std::ldexp(mantissa / 8.0, -6) : std::ldexp(1.0 + mantissa / 8.0, exponent - 7);
  return sign ? -magnitude : magnitude;
}

TEST(Fp8E4m3, EveryCodeDecodesAndRoundTrips) {
  int nan_codes = 0;
  for (int code = 0; code < 256; ++code) {
    const double expected = e4m3_by_definition(code);
    const float value = e4m3_to_float(uint8_t(code));
    if (std::isnan(expected)) {
      EXPECT_TRUE(std::isnan(value)) << "code " << code;
      EXPECT_EQ(float_to_e4m3(value) & 0x7F, 0x7F) << "NaN must stay NaN, code " << code;
      ++nan_codes;
      continue;
    }
    EXPECT_EQ(double(value), expected) << "code " << code;
    EXPECT_EQ(int(float_to_e4m3(value)), code) << "round trip of code " << code << " (" << value << ")";
    // exactly representable in both 16-bit types
    EXPECT_EQ(to_float(to_f16(value)), value) << "code " << code;
    EXPECT_EQ(to_float(to_bf16(value)), value) << "code " << code;
  }
  EXPECT_EQ(nan_codes, 2);  // 0x7F and 0xFF
  EXPECT_EQ(e4m3_to_float(0x7E), 448.f);
  EXPECT_EQ(e4m3_to_float(0x01), 0.001953125f);  // 2^-9
  EXPECT_TRUE(std::signbit(e4m3_to_float(0x80)));
}

// Between two neighbouring finite codes: below the midpoint rounds down, above rounds up, the midpoint
// itself to the even code. For every pair of neighbours of either sign.
// The CPU flash backend's 8-lane decode (cpu/flash/tile_io.hpp) and its dequantising row load against the
// definition for every code and sign, with the MXCSR as a C program starts and with denormals-are-zero and
// flush-to-zero set (as a framework's thread pool may leave them): the decode must not pass through a subnormal.
TEST(Fp8E4m3, CpuVectorDecodeEveryCodeAnyMxcsr) {
#if defined(__AVX2__)
  uint8_t codes[256];
  for (int code = 0; code < 256; ++code) codes[code] = uint8_t(code);
  const unsigned int mxcsr = _mm_getcsr();
  constexpr unsigned int kDenormalsAreZero = 0x0040, kFlushToZero = 0x8000;
  for (const unsigned int mode : {mxcsr, mxcsr | kDenormalsAreZero | kFlushToZero}) {
    _mm_setcsr(mode);
    alignas(32) float lanes[256];
    for (int first = 0; first < 256; first += 8) _mm256_store_ps(lanes + first, cpu::e4m3x8_to_float(codes + first));
    float loaded[256];  // the row load: 8-lane blocks, then a scalar tail of 3, times a scale
    cpu::load_row(codes, 0, FA_FLOAT8_E4M3, 251, loaded, 0.375f);
    cpu::load_row(codes, 251, FA_FLOAT8_E4M3, 5, loaded + 251, 0.375f);
    _mm_setcsr(mxcsr);
    for (int code = 0; code < 256; ++code) {
      const double expected = e4m3_by_definition(code);
      if (std::isnan(expected)) {
        EXPECT_TRUE(std::isnan(lanes[code])) << "code " << code << " mxcsr " << mode;
        EXPECT_TRUE(std::isnan(loaded[code])) << "code " << code << " mxcsr " << mode;
        continue;
      }
      EXPECT_EQ(double(lanes[code]), expected) << "code " << code << " mxcsr " << mode;
      EXPECT_EQ(std::signbit(lanes[code]), std::signbit(expected)) << "code " << code << " (signed zero)";
      EXPECT_EQ(loaded[code], float(expected) * 0.375f) << "code " << code << " mxcsr " << mode;
    }
  }
#else
  GTEST_SKIP() << "built without AVX2: the CPU backend decodes e4m3 through its table only";
#endif
}

TEST(Fp8E4m3, RoundsToNearestTiesToEven) {
  for (const int sign : {0, 0x80})
    for (int code = 0; code < 0x7E; ++code) {
      const float lo = e4m3_to_float(uint8_t(sign | code)), hi = e4m3_to_float(uint8_t(sign | (code + 1)));
      const float mid = 0.5f * (lo + hi);  // exact: both have few bits
      const int even = (code % 2 == 0) ? code : code + 1;
      EXPECT_EQ(int(float_to_e4m3(mid)), sign | even) << "tie between codes " << code << " and " << code + 1;
      EXPECT_EQ(int(float_to_e4m3(std::nextafter(mid, lo))), sign | code) << "just below the midpoint of " << code;
      EXPECT_EQ(int(float_to_e4m3(std::nextafter(mid, hi))), sign | (code + 1)) << "just above the midpoint of " << code;
    }
  // Below half the smallest subnormal: zero (with the sign); exactly half: the even code, zero.
  EXPECT_EQ(int(float_to_e4m3(0.0009765625f)), 0x00);  // 2^-10
  EXPECT_EQ(int(float_to_e4m3(-0.0009765625f)), 0x80);
  EXPECT_EQ(int(float_to_e4m3(0.0009766f)), 0x01);
  EXPECT_EQ(int(float_to_e4m3(1e-30f)), 0x00);
  EXPECT_EQ(int(float_to_e4m3(std::numeric_limits<float>::denorm_min())), 0x00);
  EXPECT_EQ(int(float_to_e4m3(-0.f)), 0x80);
}

TEST(Fp8E4m3, SaturatesAndKeepsNaN) {
  const float inf = std::numeric_limits<float>::infinity();
  for (const float big : {448.f, 449.f, 463.99f, 464.f, 480.f, 1e6f, 3e38f, inf}) {
    EXPECT_EQ(int(float_to_e4m3(big)), 0x7E) << big;
    EXPECT_EQ(int(float_to_e4m3(-big)), 0xFE) << -big;
  }
  EXPECT_EQ(int(float_to_e4m3(447.f)), 0x7E);  // rounds to 448
  EXPECT_EQ(int(float_to_e4m3(431.f)), 0x7D);  // 416 + 15 < 432: rounds down to 416
  EXPECT_EQ(int(float_to_e4m3(std::numeric_limits<float>::quiet_NaN())), 0x7F);
  EXPECT_EQ(int(float_to_e4m3(-std::numeric_limits<float>::quiet_NaN())), 0xFF);
  // Through the dtype helpers that every CPU path and the tests use.
  uint8_t cell = 0;
  store_from_float(&cell, 0, FA_FLOAT8_E4M3, 1000.f);
  EXPECT_EQ(cell, 0x7E);
  EXPECT_EQ(load_as_float(&cell, 0, FA_FLOAT8_E4M3), 448.f);
  EXPECT_EQ(dtype_size(FA_FLOAT8_E4M3), 1);
}

}  // namespace
}  // namespace flashattn
