// The textbook attention, unfused, on the same BLAS and the same vectorised exp as the flash path,
// so that the comparison shows the algorithm and nothing else. Per (b, h), one at a time:
//   1. S = scale * Q K^T            one GEMM into a materialised Sq x Sk float32 matrix
//   2. S = mask(transform(S))       a pass over S (only when softcap, ALiBi or a mask apply)
//   3. P = softmax(S) row by row    max, exp and sum, normalise (LSE on the side)
//   4. P = dropout(P)               a pass over P (only with dropout)
//   5. O = P V                      one GEMM
// The threads split the rows of S (each runs the five steps on its rows, single-threaded BLAS), so
// the scratch is one Sq x Sk matrix plus float copies of the head's inputs: it grows with Sq * Sk,
// which is the point of the comparison.
#include "cpu/standard/standard.hpp"

#include <omp.h>

#include <cmath>

#include "core/mask.hpp"
#include "cpu/flash/row_ops.hpp"
#include "cpu/flash/scratch.hpp"
#include "cpu/flash/team.hpp"
#include "cpu/flash/tile_io.hpp"
#include "cpu/flash/vec_math.hpp"

namespace flashattn::cpu::standard {

Status forward(const AttentionParams& p) {
  // Dense only: api.cpp rejects varlen, paged and seqused_k for this backend before we get here.
  const int sq = p.seqlen_q, sk = p.seqlen_k, d = p.head_dim, dv = p.head_dim_v;
  const int group = p.heads_q / p.heads_k;
  const int threads = team_size(p.num_threads, sq);
  const int ld_s = padded_ld(sk), ld_d = padded_ld(d), ld_dv = padded_ld(dv);

  // Scratch: the score matrix, float32 copies of the head's q / k / v (fp16 / bf16 inputs, or
  // rows that are not evenly spaced), the output before it is rounded, and a keep row per thread.
  auto carve = [&](Slab& slab, float** scores, float** q, float** k, float** v, float** o, uint8_t** keep) {
    *scores = slab.take<float>(int64_t(sq) * ld_s);
    *q = slab.take<float>(int64_t(sq) * ld_d);
    *k = slab.take<float>(int64_t(sk) * ld_d);
    *v = slab.take<float>(int64_t(sk) * ld_dv);
    *o = slab.take<float>(int64_t(sq) * ld_dv);
    *keep = slab.take<uint8_t>(int64_t(threads) * ld_s);
  };
  float *scores, *q_buffer, *k_buffer, *v_buffer, *o_buffer;
  uint8_t* keep_rows;
  Slab measure;
  carve(measure, &scores, &q_buffer, &k_buffer, &v_buffer, &o_buffer, &keep_rows);
  ScratchLedger ledger;
  const ScratchBlock block(ledger, sq > 0 ? measure.bytes() : 0);
  Slab slab(block.data());
  carve(slab, &scores, &q_buffer, &k_buffer, &v_buffer, &o_buffer, &keep_rows);
  const Dropout dropout(p);
  const SequenceExtent e{0, 0, sq, sk};

  for (int b = 0; b < p.batch && sq > 0; ++b)
    for (int hk = 0; hk < p.heads_k; ++hk) {
      const FloatRows k = load_rows(p.k, p.dtype, sk, d, [&](int j) { return kv_offset(p, p.k_batch_stride, p.k_row_stride, p.k_head_stride, b, e, j, hk); }, k_buffer, ld_d);
      const FloatRows v = load_rows(p.v, p.dtype, sk, dv, [&](int j) { return kv_offset(p, p.v_batch_stride, p.v_row_stride, p.v_head_stride, b, e, j, hk); }, v_buffer, ld_dv);
      for (int h = hk * group; h < (hk + 1) * group; ++h) {
        const RowVariant variant(p, b, h, sq, sk);
        const bool masked = p.window_left >= 0 || p.window_right >= 0;
#pragma omp parallel num_threads(threads)
        {
          blas_single_threaded_here();
          const int thread = omp_get_thread_num();
          const int r0 = int(int64_t(sq) * thread / threads), r1 = int(int64_t(sq) * (thread + 1) / threads);
          const int rows = r1 - r0;
          const FloatRows q = load_rows(
              p.q, p.dtype, rows, d,
              [&](int r) { return q_offset(p, p.q_batch_stride, p.q_row_stride, p.q_head_stride, b, e, r0 + r, h); },
              q_buffer + int64_t(r0) * ld_d, ld_d);
          float* s_rows = scores + int64_t(r0) * ld_s;

          // 1. S = alpha * Q K^T (alpha = scale, times log2(e) when nothing else touches the score)
          gemm_abt(rows, sk, d, variant.gemm_alpha, q.data, q.ld, k.data, k.ld, 0.f, s_rows, ld_s);

          // 2. transform and mask, over the whole matrix
          if (variant.transform_per_element || masked)
            for (int r = 0; r < rows; ++r) variant.apply(s_rows + int64_t(r) * ld_s, sk, r0 + r, 0, masked);

          // 3. softmax, row by row (base 2: exp(s - m) = exp2(s2 - m2))
          for (int r = 0; r < rows; ++r) {
            float* s_row = s_rows + int64_t(r) * ld_s;
            const float m = row_max(s_row, sk);
            float lse = kNegInf;
            if (m == kNegInf) {
              fill(s_row, sk, 0.f);  // no visible key: P = 0, O = 0
            } else {
              const float sum = exp2_shifted_inplace(s_row, sk, m);
              scale_inplace(s_row, sk, 1.f / sum);
              lse = m * kLn2 + std::log(sum);
            }
            if (p.lse != nullptr) p.lse[lse_offset(p, b, e, r0 + r, h)] = lse;
          }

          // 4. dropout, over the whole matrix
          if (dropout.enabled) {
            uint8_t* keep = keep_rows + int64_t(thread) * ld_s;
            for (int r = 0; r < rows; ++r) {
              float* s_row = s_rows + int64_t(r) * ld_s;
              dropout.keep_row(uint32_t(b * p.heads_q + h), uint32_t(r0 + r), 0, sk, keep);
              for (int j = 0; j < sk; ++j) s_row[j] = keep[j] ? s_row[j] * dropout.keep_scale : 0.f;
            }
          }

          // 5. O = P V
          float* o_rows = o_buffer + int64_t(r0) * ld_dv;
          gemm_ab(rows, dv, sk, 1.f, s_rows, ld_s, v.data, v.ld, 0.f, o_rows, ld_dv);
          for (int r = 0; r < rows; ++r)
            store_row(o_rows + int64_t(r) * ld_dv, 1.f, p.out,
                      q_offset(p, p.out_batch_stride, p.out_row_stride, p.out_head_stride, b, e, r0 + r, h), p.dtype, dv);
        }
      }
    }

  report_stats(p, ledger, 1, "cpu_standard (scores materialised per head) threads=%d", threads);
  return Status();
}

}  // namespace flashattn::cpu::standard
