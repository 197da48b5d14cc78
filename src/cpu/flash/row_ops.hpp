// The attention variant applied to one row of a score tile, as the CPU kernels see it.
//
// Scores live in the base-2 domain: s2 = log2(e) * (transformed score), so that the softmax's
// exp(s - m) is exp2(s2 - m2), one subtraction and one exp2_fast per element. When nothing but the
// scale touches the score (no softcap, no ALiBi), the whole transform is the GEMM's alpha =
// scale * log2(e) and the row needs no pass of its own. The semantics come from core/mask.hpp
// (WindowMask, ScoreTransform) and core/philox.hpp (the dropout keep bit), shared by every backend.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/mask.hpp"
#include "core/philox.hpp"
#include "cpu/flash/vec_math.hpp"

namespace flashattn::cpu {

// Scale, softcap, ALiBi and the window mask of one (b, h) problem.
struct RowVariant {
  float gemm_alpha;           // the factor the score GEMM applies to q.k
  bool transform_per_element;  // softcap or ALiBi: ScoreTransform after the GEMM
  ScoreTransform transform;    // natural-log domain, from core/mask.hpp
  WindowMask mask;
  int seqlen_k;

  RowVariant(const AttentionParams& p, int b, int h, int seqlen_q, int seqlen_k_)
      : transform{p.softcap, alibi_slope(p, b, h), seqlen_k_ - seqlen_q},
        mask(p.window_left, p.window_right, seqlen_q, seqlen_k_),
        seqlen_k(seqlen_k_) {
    // Decided per problem, not per head: the heads of one tile share the score GEMM and its alpha.
    transform_per_element = p.softcap > 0.f || p.alibi_slopes != nullptr;
    gemm_alpha = transform_per_element ? p.softmax_scale : p.softmax_scale * kLog2e;
  }

  // s[0, n) holds gemm_alpha * q_i.k_j for keys j = j0 .. j0 + n - 1. Leaves s2 (base 2), with -inf
  // at keys that query i does not see when `apply_mask` (tiles that are fully visible skip it).
  void apply(float* s, int n, int i, int j0, bool apply_mask) const {
    if (transform_per_element)
      for (int j = 0; j < n; ++j) s[j] = transform(s[j], i, j0 + j) * kLog2e;
    if (apply_mask) {
      // Row i sees the contiguous keys [key_begin(i), key_end(i + 1)).
      int lo = mask.key_begin(i) - j0, hi = mask.key_end(i + 1, seqlen_k) - j0;
      lo = lo < 0 ? 0 : (lo > n ? n : lo);
      hi = hi < lo ? lo : (hi > n ? n : hi);
      fill(s, lo, kNegInf);
      fill(s + hi, n - hi, kNegInf);
    }
  }

  // Backward with softcap: d(score)/d(scale q.k) = 1 - tanh^2, from the same raw values `apply`
  // is about to transform (s = scale * q.k, gemm_alpha = scale when softcap is on).
  void softcap_derivative(const float* s, int n, float* derivative) const {
    const float softcap = transform.softcap;
    for (int j = 0; j < n; ++j) {
      const float t = tanhf(s[j] / softcap);
      derivative[j] = 1.f - t * t;
    }
  }
};

// The queries of a sequence that see at least one key of [j_begin, j_end): the inverse of
// WindowMask::key_begin / key_end (backward walks the queries of a key tile).
inline int query_begin(const WindowMask& mask, int j_begin) {
  if (mask.window_right < 0) return 0;
  const int64_t i = int64_t(j_begin) - mask.diagonal - mask.window_right;
  return i < 0 ? 0 : int(i);
}
inline int query_end(const WindowMask& mask, int j_end, int seqlen_q) {
  if (mask.window_left < 0) return seqlen_q;
  const int64_t i = int64_t(j_end) - 1 - mask.diagonal + mask.window_left + 1;
  return i < 0 ? 0 : (i > seqlen_q ? seqlen_q : int(i));
}

// Dropout of one call: the shared Philox keep bit of core/philox.hpp, produced a row at a time.
struct Dropout {
  bool enabled;
  uint64_t seed, offset;
  uint32_t threshold;  // keep iff the 16-bit uniform >= threshold
  float keep_scale;    // 1 / (1 - p): the multiplier of kept values

  explicit Dropout(const AttentionParams& p)
      : enabled(p.dropout_p > 0.f),
        seed(p.dropout_seed),
        offset(p.dropout_offset),
        threshold(dropout_threshold_u16(p.dropout_p)),
        keep_scale(p.dropout_p > 0.f ? float(1.0 / (1.0 - double(p.dropout_p))) : 1.f) {}

  // keep[j] = the keep bit of (bh, i, j0 + j) for j in [0, n). One Philox call yields the 8 keys
  // {32 m + 8 n + 2 t + {0, 1} : n = 0..3} of sub-column t of 32-key block m; every call made here
  // is used for all of its keys that fall in the range.
  void keep_row(uint32_t bh, uint32_t i, int j0, int n, uint8_t* keep) const {
    const int j1 = j0 + n;
    for (int block = j0 >> 5; block <= (j1 - 1) >> 5; ++block) {
      for (int t = 0; t < 4; ++t) {
        const uint32_t first_key = uint32_t(block) * 32u + 2u * uint32_t(t);
        const Philox4x32 r = dropout_random_block(seed, offset, bh, i, first_key);
        for (int m = 0; m < 4; ++m)
          for (int parity = 0; parity < 2; ++parity) {
            const int j = int(first_key) + 8 * m + parity;
            if (j >= j0 && j < j1) keep[j - j0] = dropout_u16_of_key(r, uint32_t(j)) >= threshold;
          }
      }
    }
  }
};

}  // namespace flashattn::cpu
