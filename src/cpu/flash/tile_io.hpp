// Moving tiles between the caller's strided tensors (fp32 / fp16 / bf16; FP8 KV caches) and float32 scratch, and
// the three GEMM shapes the CPU kernels use, through CBLAS (OpenBLAS, OpenMP build).
#pragma once

#include <cblas.h>

#include <cstdint>
#include <cstring>
#include <limits>

#include "core/dtype.hpp"
#include "cpu/flash/vec_math.hpp"

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace flashattn::cpu {

// ---- element conversion ----

// The value of every e4m3 code, e4m3_to_float's, as a table: one load per element instead of a
// decode with branches (which held an FP8 cache's CPU decode to ~1 GB/s on the dev machine).
inline const float* e4m3_value_table() {
  static const struct Table {
    float value[256];
    Table() {
      for (int code = 0; code < 256; ++code) value[code] = e4m3_to_float(uint8_t(code));
    }
  } table;
  return table.value;
}

#if defined(__AVX2__)
// The values of the 8 e4m3 codes at src, e4m3_to_float's bit for bit (NaN codes: a NaN), without a
// table and without a subnormal float anywhere (so the result does not depend on the MXCSR's
// denormals-are-zero / flush-to-zero bits, which a caller such as a framework's thread pool may set):
//   normal codes (exponent field e >= 1): magnitude bits eeee mmm moved to float bits 26-20 plus
//     120 in the exponent field is (1 + m/8) 2^(e + 120 - 127), the code's value, exactly;
//   subnormal codes (e = 0): the same bits give (1 + m/8) 2^-7, and the value m/8 2^-6 is
//     2 ((1 + m/8) 2^-7 - 2^-7), both steps exact;
//   the NaN codes (magnitude 0x7F) give 480, past the largest finite 448, and become NaN;
//   the sign bit goes in last.
inline __m256 e4m3x8_to_float(const uint8_t* src) {
  const __m256i codes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
  constexpr int kMantissaShift = 20;                  // e4m3's 3 mantissa bits to float's top 3 (bits 22-20)
  constexpr int32_t kExponentOffset = 120 << 23;      // float bias 127 - e4m3 bias 7
  constexpr float kSubnormalBase = 0.0078125f;        // 2^-7: the offset's value at e = 0, m = 0
  constexpr float kSmallestNormal = 0.015625f;        // 2^-6: e4m3's smallest normal value
  const __m256i magnitude_bits = _mm256_add_epi32(
      _mm256_slli_epi32(_mm256_and_si256(codes, _mm256_set1_epi32(0x7F)), kMantissaShift), _mm256_set1_epi32(kExponentOffset));
  const __m256 normal = _mm256_castsi256_ps(magnitude_bits);
  const __m256 base = _mm256_set1_ps(kSubnormalBase);
  const __m256 subnormal = _mm256_add_ps(_mm256_sub_ps(normal, base), _mm256_sub_ps(normal, base));
  __m256 magnitude = _mm256_blendv_ps(normal, subnormal, _mm256_cmp_ps(normal, _mm256_set1_ps(kSmallestNormal), _CMP_LT_OQ));
  magnitude = _mm256_or_ps(magnitude, _mm256_cmp_ps(magnitude, _mm256_set1_ps(kE4m3Max), _CMP_GT_OQ));  // all ones: NaN
  const __m256i sign = _mm256_slli_epi32(_mm256_srli_epi32(codes, 7), 31);
  return _mm256_or_ps(magnitude, _mm256_castsi256_ps(sign));
}
#endif

// dst[0, cols) = the `cols` elements of `base` (dtype t) starting at element `offset`, as float.
// The conversions from float32 / float16 / bfloat16 are exact; float8 e4m3 codes are dequantised as
// code value * scale (one float32 rounding; `scale` is ignored for the other types).
inline void load_row(const void* base, int64_t offset, fa_dtype t, int cols, float* dst, float scale = 1.f) {
  if (t == FA_FLOAT8_E4M3) {
    const uint8_t* src = static_cast<const uint8_t*>(base) + offset;
    int c = 0;
#if defined(__AVX2__)
    for (; c + 8 <= cols; c += 8) _mm256_storeu_ps(dst + c, _mm256_mul_ps(e4m3x8_to_float(src + c), _mm256_set1_ps(scale)));
#endif
    const float* value_of = e4m3_value_table();
    for (; c < cols; ++c) dst[c] = value_of[src[c]] * scale;
  } else if (t == FA_FLOAT32) {
    std::memcpy(dst, static_cast<const float*>(base) + offset, size_t(cols) * sizeof(float));
  } else if (t == FA_BFLOAT16) {
    const uint16_t* src = static_cast<const uint16_t*>(base) + offset;
#pragma omp simd
    for (int c = 0; c < cols; ++c) dst[c] = __builtin_bit_cast(float, uint32_t(src[c]) << 16);  // bf16 = top half
  } else {
    const uint16_t* src = static_cast<const uint16_t*>(base) + offset;
    int c = 0;
#if defined(__F16C__)
    for (; c + 8 <= cols; c += 8)
      _mm256_storeu_ps(dst + c, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + c))));
#endif
    for (; c < cols; ++c) dst[c] = to_float(f16{src[c]});
  }
}

// The `cols` elements of `base` (dtype t) at element `offset` = factor * src[0, cols), rounded to
// nearest even (core/dtype.hpp) for the 16-bit types.
inline void store_row(const float* src, float factor, void* base, int64_t offset, fa_dtype t, int cols) {
  if (t == FA_FLOAT32) {
    float* dst = static_cast<float*>(base) + offset;
#pragma omp simd
    for (int c = 0; c < cols; ++c) dst[c] = src[c] * factor;
  } else {
    for (int c = 0; c < cols; ++c) store_from_float(base, offset + c, t, src[c] * factor);
  }
}

inline void store_zero_row(void* base, int64_t offset, fa_dtype t, int cols) {
  for (int c = 0; c < cols; ++c) store_from_float(base, offset + c, t, 0.f);
}

// ---- tiles ----

// Leading dimensions of scratch tiles are padded to a multiple of 16 floats (64 bytes).
constexpr int kTileLdMultiple = 16;
inline int padded_ld(int cols) { return (cols + kTileLdMultiple - 1) / kTileLdMultiple * kTileLdMultiple; }

// `rows` x `cols` float32 values, row r at data + r * ld.
struct FloatRows {
  const float* data;
  int64_t ld;
};

// The largest leading dimension handed to CBLAS (its dimensions are int).
constexpr int64_t kMaxBlasLd = std::numeric_limits<int>::max();

// Rows r in [0, rows) of a strided tensor, row r starting at element offset_of(r) of `base`.
// fp32 rows that are evenly spaced at least `cols` apart (dense and varlen tensors, a paged tile
// inside one block or across consecutive blocks) are read in place, without a copy; anything else
// (fp16/bf16, scattered pages) is converted into `buffer` (leading dimension buffer_ld).
template <typename OffsetOf>
FloatRows load_rows(const void* base, fa_dtype t, int rows, int cols, const OffsetOf& offset_of, float* buffer,
                    int64_t buffer_ld, float scale = 1.f) {
  if (t == FA_FLOAT32 && rows > 0) {
    const int64_t first = offset_of(0);
    const int64_t step = rows > 1 ? offset_of(1) - first : cols;
    bool evenly_spaced = step >= cols && step <= kMaxBlasLd;
    for (int r = 2; evenly_spaced && r < rows; ++r) evenly_spaced = offset_of(r) - first == int64_t(r) * step;
    if (evenly_spaced) return FloatRows{static_cast<const float*>(base) + first, step};
  }
  for (int r = 0; r < rows; ++r) load_row(base, offset_of(r), t, cols, buffer + r * buffer_ld, scale);
  return FloatRows{buffer, buffer_ld};
}

// ---- GEMMs (row-major CBLAS; single-threaded inside our regions, see team.hpp) ----

// C = beta * C for an empty inner dimension (CBLAS would reject the leading dimensions of an
// m x 0 operand instead of scaling C).
inline void scale_matrix(int m, int n, float beta, float* c, int64_t ldc) {
  for (int r = 0; r < m; ++r) {
    if (beta == 0.f) fill(c + int64_t(r) * ldc, n, 0.f);
    else scale_inplace(c + int64_t(r) * ldc, n, beta);
  }
}

// C[m x n] = alpha * A[m x k] * B[n x k]^T + beta * C    (scores Q K^T, dP = dO V^T)
inline void gemm_abt(int m, int n, int k, float alpha, const float* a, int64_t lda, const float* b, int64_t ldb, float beta,
                     float* c, int64_t ldc) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0) return scale_matrix(m, n, beta, c, ldc);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, alpha, a, int(lda), b, int(ldb), beta, c, int(ldc));
}

// C[m x n] = alpha * A[m x k] * B[k x n] + beta * C       (O += P V, dQ += dS K)
inline void gemm_ab(int m, int n, int k, float alpha, const float* a, int64_t lda, const float* b, int64_t ldb, float beta,
                    float* c, int64_t ldc) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0) return scale_matrix(m, n, beta, c, ldc);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, k, alpha, a, int(lda), b, int(ldb), beta, c, int(ldc));
}

// C[m x n] = alpha * A[k x m]^T * B[k x n] + beta * C     (dV += P^T dO, dK += dS^T Q)
inline void gemm_atb(int m, int n, int k, float alpha, const float* a, int64_t lda, const float* b, int64_t ldb, float beta,
                     float* c, int64_t ldc) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0) return scale_matrix(m, n, beta, c, ldc);
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, m, n, k, alpha, a, int(lda), b, int(ldb), beta, c, int(ldc));
}

}  // namespace flashattn::cpu
