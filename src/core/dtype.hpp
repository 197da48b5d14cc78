// Host-side element types and conversions (IEEE binary16 and bfloat16 <-> float), exact and
// round-to-nearest-even, with NaN and Inf preserved; float8 e4m3 through core/fp8.hpp (saturating).
// CUDA code uses the CUDA types instead.
#pragma once

#include <cstdint>
#include <cstring>

#include "core/fp8.hpp"
#include "flashattn/flashattn.h"

namespace flashattn {

inline int64_t dtype_size(fa_dtype t) {
  switch (t) {
    case FA_FLOAT32: return 4;
    case FA_FLOAT16: return 2;
    case FA_BFLOAT16: return 2;
    case FA_INT32: return 4;
    case FA_UINT8: return 1;
    case FA_FLOAT8_E4M3: return 1;
  }
  return 0;
}

inline const char* dtype_name(fa_dtype t) {
  switch (t) {
    case FA_FLOAT32: return "float32";
    case FA_FLOAT16: return "float16";
    case FA_BFLOAT16: return "bfloat16";
    case FA_INT32: return "int32";
    case FA_UINT8: return "uint8";
    case FA_FLOAT8_E4M3: return "float8_e4m3";
  }
  return "unknown";
}

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// bfloat16: the top 16 bits of a float32, rounded to nearest even.
struct bf16 {
  uint16_t bits;
};
inline float to_float(bf16 h) { return bits_float(uint32_t(h.bits) << 16); }
inline bf16 to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return bf16{uint16_t((u >> 16) | 0x40u)};  // quiet NaN
  const uint32_t rounding = 0x7FFFu + ((u >> 16) & 1u);
  return bf16{uint16_t((u + rounding) >> 16)};
}

// IEEE binary16.
struct f16 {
  uint16_t bits;
};
inline float to_float(f16 h) {
  const uint32_t sign = uint32_t(h.bits & 0x8000u) << 16;
  const uint32_t exponent = (h.bits >> 10) & 0x1Fu;
  const uint32_t mantissa = h.bits & 0x3FFu;
  if (exponent == 0x1F) return bits_float(sign | 0x7F800000u | (mantissa << 13));  // Inf / NaN
  if (exponent != 0) return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  if (mantissa == 0) return bits_float(sign);
  // subnormal: value = mantissa * 2^-24, exact in float
  const float magnitude = float(mantissa) * 5.9604644775390625e-8f;
  return sign ? -magnitude : magnitude;
}
inline f16 to_f16(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return f16{uint16_t(sign | 0x7E00u)};  // NaN
  if (a >= 0x477FF000u) return f16{uint16_t(sign | 0x7C00u)};  // rounds to Inf (>= 65520)
  if (a < 0x38800000u) {
    // subnormal or zero in binary16: round a * 2^24 to an integer, nearest even
    const float magnitude = bits_float(a) * 16777216.f;  // exact scaling by 2^24
    // add and subtract 2^23 to round to an integer with the current (nearest-even) mode
    const float rounded = (magnitude + 8388608.f) - 8388608.f;
    return f16{uint16_t(sign | uint16_t(rounded))};
  }
  // normal: rebias the exponent and round the mantissa from 23 to 10 bits, nearest even
  const uint32_t rounding = 0xFFFu + ((a >> 13) & 1u);
  const uint32_t r = a + rounding;
  return f16{uint16_t(sign | uint16_t(((r >> 13) - (112u << 10)) & 0x7FFFu))};
}

// Reads element `index` of a floating tensor of dtype t as float.
inline float load_as_float(const void* base, int64_t index, fa_dtype t) {
  switch (t) {
    case FA_FLOAT16: return to_float(static_cast<const f16*>(base)[index]);
    case FA_BFLOAT16: return to_float(static_cast<const bf16*>(base)[index]);
    case FA_FLOAT8_E4M3: return e4m3_to_float(static_cast<const uint8_t*>(base)[index]);  // the code's value, unscaled
    default: return static_cast<const float*>(base)[index];
  }
}
// Writes element `index` of a floating tensor of dtype t, rounding to nearest even (e4m3: saturating
// to +-448, core/fp8.hpp).
inline void store_from_float(void* base, int64_t index, fa_dtype t, float value) {
  switch (t) {
    case FA_FLOAT16: static_cast<f16*>(base)[index] = to_f16(value); break;
    case FA_BFLOAT16: static_cast<bf16*>(base)[index] = to_bf16(value); break;
    case FA_FLOAT8_E4M3: static_cast<uint8_t*>(base)[index] = float_to_e4m3(value); break;  // saturating
    default: static_cast<float*>(base)[index] = value; break;
  }
}

}  // namespace flashattn
