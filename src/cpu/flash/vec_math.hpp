// Float math for the CPU tile loops, written to run vectorised (AVX2 with -march=x86-64-v3): plain
// loops that GCC vectorises, and the exponential through GCC / Clang vector extensions. libm's expf
// is a call per element and does not vectorise; the softmax of a 256 x 256 tile would then cost
// more than the two GEMMs around it.
#pragma once

#include <cstdint>
#include <limits>

namespace flashattn::cpu {

constexpr float kLog2e = 1.44269504088896340736f;  // log2(e): e^x = 2^(x * kLog2e)
constexpr float kLn2 = 0.69314718055994530942f;     // ln(2): ln(x) = log2(x) * kLn2
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

namespace detail {
// Taylor coefficients of 2^f = e^(f ln2) = sum_k (ln2)^k / k! * f^k, k = 0..7. With |f| <= 1/2 the
// first dropped term is (ln2 / 2)^8 / 8! < 6e-9 relative: below float rounding (6e-8).
constexpr float kExp2C1 = 6.9314718055994531e-01f;
constexpr float kExp2C2 = 2.4022650695910071e-01f;
constexpr float kExp2C3 = 5.5504108664821580e-02f;
constexpr float kExp2C4 = 9.6181291076284772e-03f;
constexpr float kExp2C5 = 1.3333558146428443e-03f;
constexpr float kExp2C6 = 1.5403530393381608e-04f;
constexpr float kExp2C7 = 1.5252733804059841e-05f;
// (x + 1.5 * 2^23) - 1.5 * 2^23 rounds |x| < 2^22 to the nearest integer in the current (nearest)
// rounding mode: the addition pushes the fraction bits out of the mantissa.
constexpr float kRoundToIntMagic = 12582912.f;
// 2^n is built in the exponent field as (n + 127) << 23. n = -127 gives the bit pattern of +0, so
// every argument below about -126.5 (including -inf, the masked scores) returns exactly 0.
constexpr float kExp2MinArg = -127.f;
constexpr float kExp2MaxArg = 127.f;  // 2^127 is the largest power of two in float
constexpr int32_t kFloatExponentBias = 127;
constexpr int kFloatMantissaBits = 23;
}  // namespace detail

// 2^x in float, within 2 ulp for x in [-126, 127]; 0 below (and for -inf); 2^127 above.
inline float exp2_fast(float x) {
  x = x < detail::kExp2MinArg ? detail::kExp2MinArg : x;
  x = x > detail::kExp2MaxArg ? detail::kExp2MaxArg : x;
  const float n = (x + detail::kRoundToIntMagic) - detail::kRoundToIntMagic;
  const float f = x - n;  // in [-1/2, 1/2]
  float poly = detail::kExp2C7;
  poly = poly * f + detail::kExp2C6;
  poly = poly * f + detail::kExp2C5;
  poly = poly * f + detail::kExp2C4;
  poly = poly * f + detail::kExp2C3;
  poly = poly * f + detail::kExp2C2;
  poly = poly * f + detail::kExp2C1;
  poly = poly * f + 1.f;
  const int32_t pow2_bits = (int32_t(n) + detail::kFloatExponentBias) << detail::kFloatMantissaBits;
  return poly * __builtin_bit_cast(float, pow2_bits);
}

// The same function on 8 floats at once (GCC / Clang vector extensions: one AVX2 register, or two
// SSE registers on older targets), bit for bit equal to exp2_fast lane by lane. The loops below use
// it directly: GCC does not if-convert exp2_fast's clamps once it is inlined into a mainloop, and
// would run the softmax's exponentials one at a time.
typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
constexpr int kF32x8Lanes = 8;

inline f32x8 exp2_fast(f32x8 x) {
  x = x < detail::kExp2MinArg ? detail::kExp2MinArg : x;
  x = x > detail::kExp2MaxArg ? detail::kExp2MaxArg : x;
  const f32x8 n = (x + detail::kRoundToIntMagic) - detail::kRoundToIntMagic;
  const f32x8 f = x - n;
  f32x8 poly = f * detail::kExp2C7 + detail::kExp2C6;
  poly = poly * f + detail::kExp2C5;
  poly = poly * f + detail::kExp2C4;
  poly = poly * f + detail::kExp2C3;
  poly = poly * f + detail::kExp2C2;
  poly = poly * f + detail::kExp2C1;
  poly = poly * f + 1.f;
  const i32x8 pow2_bits = (__builtin_convertvector(n, i32x8) + detail::kFloatExponentBias) << detail::kFloatMantissaBits;
  return poly * __builtin_bit_cast(f32x8, pow2_bits);
}

// x[j] = 2^(x[j] - shift) in place, for j in [0, n). shift must be finite.
inline void exp2_shifted(float* x, int n, float shift) {
  int j = 0;
  for (; j + kF32x8Lanes <= n; j += kF32x8Lanes) {
    f32x8 v;
    __builtin_memcpy(&v, x + j, sizeof(v));  // unaligned load
    v = exp2_fast(v - shift);
    __builtin_memcpy(x + j, &v, sizeof(v));
  }
  for (; j < n; ++j) x[j] = exp2_fast(x[j] - shift);
}

// Reductions keep kReductionLanes partial results side by side (GCC turns the fixed-width inner
// loop into two AVX2 or one AVX-512 operation) and combine them at the end: a fixed order, so the
// result does not depend on the vector width. `#pragma omp simd reduction` would do the same, but
// GCC 12 stops vectorising it once the helper is inlined into a large mainloop.
constexpr int kReductionLanes = 16;

// The larger of a and b, NaN when either is NaN: a NaN score must spoil its row (the NaN/Inf
// policy), not vanish as it would through `a > b ? a : b` or fmaxf.
inline float max_propagating_nan(float a, float b) { return (a > b || a != a) ? a : b; }

// Largest element of x[0, n); -inf when n == 0 or all are -inf; NaN when any is NaN.
// Written with vector types: GCC does not vectorise max_propagating_nan's `a != a` in a plain loop,
// and the scalar loop it left (from the NaN policy's commit until 2026-12-05) cost the forward a
// quarter of its time (2-core Zen 3, fp32, D = 128: 98-107 GFLOP/s against 132-143 with this one).
// The max below ignores NaN (`v > lane` is false for it); a separate mask remembers one was seen.
inline float row_max(const float* x, int n) {
  constexpr int kLanes = 2 * kF32x8Lanes;
  const f32x8 neg_inf = {kNegInf, kNegInf, kNegInf, kNegInf, kNegInf, kNegInf, kNegInf, kNegInf};
  f32x8 lane0 = neg_inf, lane1 = neg_inf;
  i32x8 nan_seen = {};
  int j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    f32x8 v0, v1;
    __builtin_memcpy(&v0, x + j, sizeof(v0));  // unaligned loads
    __builtin_memcpy(&v1, x + j + kF32x8Lanes, sizeof(v1));
    nan_seen |= (v0 != v0) | (v1 != v1);
    lane0 = v0 > lane0 ? v0 : lane0;
    lane1 = v1 > lane1 ? v1 : lane1;
  }
  float m = kNegInf;
  for (; j < n; ++j) m = max_propagating_nan(x[j], m);
  for (int l = 0; l < kF32x8Lanes; ++l) {
    if (nan_seen[l] != 0) return std::numeric_limits<float>::quiet_NaN();
    m = max_propagating_nan(lane0[l], m);
    m = max_propagating_nan(lane1[l], m);
  }
  return m;
}

// Sum of x[0, n).
inline float row_sum(const float* x, int n) {
  float lane[kReductionLanes] = {};
  int j = 0;
  for (; j + kReductionLanes <= n; j += kReductionLanes)
    for (int l = 0; l < kReductionLanes; ++l) lane[l] += x[j + l];
  float sum = 0.f;
  for (; j < n; ++j) sum += x[j];
  for (int l = 0; l < kReductionLanes; ++l) sum += lane[l];
  return sum;
}

// x[j] = 2^(x[j] - shift) in place; returns the sum. shift must be finite.
inline float exp2_shifted_inplace(float* x, int n, float shift) {
  exp2_shifted(x, n, shift);
  return row_sum(x, n);
}

inline void scale_inplace(float* x, int n, float factor) {
#pragma omp simd
  for (int j = 0; j < n; ++j) x[j] *= factor;
}

inline void fill(float* x, int n, float value) {
#pragma omp simd
  for (int j = 0; j < n; ++j) x[j] = value;
}

}  // namespace flashattn::cpu
