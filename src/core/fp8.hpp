// float8 e4m3 ("fn", the OCP 8-bit format of FP8 KV caches) <-> float, exact and table-free, usable on the
// host and in CUDA kernels (FA_HD). One definition for every backend: the CPU backends, the float64 reference
// and the CUDA append kernel all quantise through float_to_e4m3, so appended caches agree bit for bit.
//
// The format: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits.
//   exponent 1..15: (1 + m / 8) * 2^(e - 7)      largest finite: 0x7E = 448
//   exponent 0:     (m / 8) * 2^-6              subnormals, smallest 2^-9; 0x00 = +0, 0x80 = -0
//   0x7F, 0xFF:     NaN                          no infinities
// Every e4m3 value is exactly representable in float16, bfloat16 and float32.
//
// Quantisation (float_to_e4m3): round to nearest, ties to even; magnitudes that round above 448
// (infinities included) saturate to +-448; NaN stays NaN (0x7F with the input's sign bit).
#pragma once

#include <cstdint>

#include "core/host_device.hpp"

namespace flashattn {

constexpr float kE4m3Max = 448.f;  // largest finite e4m3 magnitude (code 0x7E)

namespace fp8_detail {
FA_HD uint32_t bits_of(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  return __builtin_bit_cast(uint32_t, f);
#endif
}
FA_HD float float_of(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  return __builtin_bit_cast(float, u);
#endif
}
}  // namespace fp8_detail

// The value of e4m3 code `code`, exactly.
FA_HD float e4m3_to_float(uint8_t code) {
  const uint32_t sign = uint32_t(code & 0x80u) << 24;
  const uint32_t exponent = (code >> 3) & 0xFu;
  const uint32_t mantissa = code & 0x7u;
  if ((code & 0x7Fu) == 0x7Fu) return fp8_detail::float_of(sign | 0x7FC00000u);  // NaN
  if (exponent != 0) return fp8_detail::float_of(sign | ((exponent + 120u) << 23) | (mantissa << 20));  // rebias 7 -> 127
  // subnormal (or zero): mantissa * 2^-9, exact in float
  const float magnitude = float(mantissa) * 0.001953125f;
  return sign ? -magnitude : magnitude;
}

// The e4m3 code nearest to x (ties to even), saturating to +-448; NaN -> NaN. Integer arithmetic only, so the
// host and the device round identically whatever their floating-point modes.
FA_HD uint8_t float_to_e4m3(float x) {
  const uint32_t u = fp8_detail::bits_of(x);
  const uint8_t sign = uint8_t((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7FFFFFFFu;  // |x|
  if (a > 0x7F800000u) return uint8_t(sign | 0x7Fu);  // NaN
  if (a >= 0x43E00000u) return uint8_t(sign | 0x7Eu);  // |x| >= 448 (Inf too): saturate
  if (a >= 0x3C800000u) {
    // |x| >= 2^-6: a normal e4m3. Round the 23-bit mantissa to 3 bits, nearest even; a carry moves into the
    // exponent, which is what rounding up to the next binade means. Then rebias 127 -> 7.
    const uint32_t rounded = a + 0x7FFFFu + ((a >> 20) & 1u);
    const uint32_t code = (rounded >> 20) - (120u << 3);
    return uint8_t(sign | (code > 0x7Eu ? 0x7Eu : code));  // (|x| < 448 never rounds past 0x7E: a guard)
  }
  // |x| < 2^-6: subnormal e4m3, code = round(|x| * 2^9) in [0, 8] (8 is 2^-6, the smallest normal: code 0x08).
  const int exponent = int(a >> 23) - 127;  // |x| = 1.f * 2^exponent (float subnormals round to 0 below)
  if (exponent < -11) return sign;          // |x| < 2^-11 < half of 2^-9: rounds to 0
  const uint32_t significand = (a & 0x7FFFFFu) | 0x800000u;  // 1.f * 2^23
  const int shift = 14 - exponent;          // |x| * 2^9 = significand * 2^-(shift); shift in [21, 25]
  uint32_t q = significand >> shift;
  const uint32_t remainder = significand & ((1u << shift) - 1u), half = 1u << (shift - 1);
  if (remainder > half || (remainder == half && (q & 1u))) ++q;
  return uint8_t(sign | q);
}

}  // namespace flashattn
