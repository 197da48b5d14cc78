#include "cpu/reference/reference.hpp"

#include <atomic>
#include <cmath>
#include <limits>
#include <new>
#include <stdexcept>

#include "core/dtype.hpp"
#include "core/mask.hpp"
#include "core/philox.hpp"

namespace flashattn::cpu::reference {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// Identity, except in the naive same-precision baseline (tests), where it rounds to the dtype.
double rounded(const HeadProblem& p, double x) {
  if (!p.emulate) return x;
  float r = float(x);
  if (p.emulate_dtype == FA_FLOAT16) r = to_float(to_f16(r));
  if (p.emulate_dtype == FA_BFLOAT16) r = to_float(to_bf16(r));
  return r;
}

bool visible(const HeadProblem& p, int i, int j) {
  return j >= p.key_floor && WindowMask(p.window_left, p.window_right, p.seqlen_q, p.seqlen_k).visible(i, j);
}

// Scaled, soft-capped, ALiBi-biased score of (i, j); also d(score)/d(scale * q.k) for backward.
double score(const HeadProblem& p, int i, int j, double* dscore_draw) {
  double dot = 0;
  for (int d = 0; d < p.head_dim; ++d) dot += p.q[size_t(i) * p.head_dim + d] * p.k[size_t(j) * p.head_dim + d];
  double s = rounded(p, p.scale * dot);
  double derivative = 1;
  if (p.softcap > 0) {
    const double t = std::tanh(s / p.softcap);
    s = p.softcap * t;
    derivative = 1 - t * t;
  }
  s -= p.alibi_slope * std::abs(double(i) + (p.seqlen_k - p.seqlen_q) - j);
  if (dscore_draw) *dscore_draw = derivative;
  return s;
}

// Softmax probabilities P [sq, sk] (undropped; 0 where masked) and the lse of each row.
void probabilities(const HeadProblem& p, std::vector<double>* probs, std::vector<double>* lse,
                   std::vector<double>* dscore_draw) {
  const int sq = p.seqlen_q, sk = p.seqlen_k;
  probs->assign(size_t(sq) * sk, 0.0);
  lse->assign(sq, kNegInf);
  if (dscore_draw) dscore_draw->assign(size_t(sq) * sk, 0.0);
  std::vector<double> row(sk);
  for (int i = 0; i < sq; ++i) {
    double row_max = kNegInf;
    for (int j = 0; j < sk; ++j) {
      if (!visible(p, i, j)) continue;
      row[j] = score(p, i, j, dscore_draw ? &(*dscore_draw)[size_t(i) * sk + j] : nullptr);
      // NaN-propagating max: a NaN score must spoil its row, not vanish (std::max would drop it)
      if (std::isnan(row[j]) || row[j] > row_max) row_max = row[j];
    }
    if (row_max == kNegInf) continue;  // no visible key (or all at -inf): P = 0, lse = -inf
    double sum = 0;
    for (int j = 0; j < sk; ++j)
      if (visible(p, i, j)) sum += std::exp(row[j] - row_max);
    for (int j = 0; j < sk; ++j)
      if (visible(p, i, j)) (*probs)[size_t(i) * sk + j] = rounded(p, std::exp(row[j] - row_max) / sum);
    (*lse)[i] = row_max + std::log(sum);
  }
}

}  // namespace

double dropout_multiplier(const HeadProblem& p, int i, int j) {
  if (p.dropout_p <= 0) return 1.0;
  const uint32_t threshold = dropout_threshold_u16(float(p.dropout_p));
  const bool keep = dropout_keep(p.seed, p.offset, p.dropout_bh, uint32_t(i), uint32_t(j), threshold);
  return keep ? 1.0 / (1.0 - p.dropout_p) : 0.0;
}

HeadResult attend(const HeadProblem& p) {
  std::vector<double> probs;
  HeadResult result;
  probabilities(p, &probs, &result.lse, nullptr);
  const int sq = p.seqlen_q, sk = p.seqlen_k, dv = p.head_dim_v;
  result.out.assign(size_t(sq) * dv, 0.0);
  for (int i = 0; i < sq; ++i)
    for (int j = 0; j < sk; ++j) {
      const double weight = probs[size_t(i) * sk + j] * dropout_multiplier(p, i, j);
      if (weight == 0) continue;
      for (int d = 0; d < dv; ++d) result.out[size_t(i) * dv + d] += weight * p.v[size_t(j) * dv + d];
    }
  return result;
}

// With Z = dropout multiplier and P the softmax:  out = (P * Z) v.
//   dv    = (P * Z)^T dout
//   dP    = (dout v^T) * Z
//   dS    = P * (dP - rowsum(P * dP))       gradient of the transformed score
//   dU    = dS * d(transform)/d(scale q.k)  (softcap's tanh'; ALiBi is a constant shift)
//   dq    = scale * dU k,   dk = scale * dU^T q
HeadGradients attend_backward(const HeadProblem& p, const std::vector<double>& dout) {
  std::vector<double> probs, lse, dscore_draw;
  probabilities(p, &probs, &lse, &dscore_draw);
  const int sq = p.seqlen_q, sk = p.seqlen_k, d = p.head_dim, dv = p.head_dim_v;
  HeadGradients g;
  g.dq.assign(size_t(sq) * d, 0.0);
  g.dk.assign(size_t(sk) * d, 0.0);
  g.dv.assign(size_t(sk) * dv, 0.0);
  std::vector<double> dp(sk);
  for (int i = 0; i < sq; ++i) {
    double row_dot = 0;  // rowsum(P * dP)
    for (int j = 0; j < sk; ++j) {
      const double prob = probs[size_t(i) * sk + j];
      if (prob == 0) { dp[j] = 0; continue; }
      const double z = dropout_multiplier(p, i, j);
      double dov = 0;
      for (int e = 0; e < dv; ++e) dov += dout[size_t(i) * dv + e] * p.v[size_t(j) * dv + e];
      dp[j] = rounded(p, dov * z);
      row_dot += prob * dp[j];
      for (int e = 0; e < dv; ++e) g.dv[size_t(j) * dv + e] += prob * z * dout[size_t(i) * dv + e];
    }
    for (int j = 0; j < sk; ++j) {
      const double prob = probs[size_t(i) * sk + j];
      if (prob == 0) continue;
      const double du = rounded(p, prob * (dp[j] - row_dot) * dscore_draw[size_t(i) * sk + j]) * p.scale;
      for (int e = 0; e < d; ++e) {
        g.dq[size_t(i) * d + e] += du * p.k[size_t(j) * d + e];
        g.dk[size_t(j) * d + e] += du * p.q[size_t(i) * d + e];
      }
    }
  }
  return g;
}

namespace {

// Gathers / scatters between strided tensors of any dtype and float64 row-major matrices.
struct HeadIndex {
  const AttentionParams* p;
  int b, h, hk;
  SequenceExtent e;
  int key_floor = 0;  // keys below it are no keys (a KV cache's left padding): never read, never visible
};

std::vector<double> load_q_like(const HeadIndex& x, const void* base, int64_t bs, int64_t rs, int64_t hs,
                                int cols) {
  std::vector<double> m(size_t(x.e.seqlen_q) * cols);
  for (int i = 0; i < x.e.seqlen_q; ++i) {
    const int64_t row = q_offset(*x.p, bs, rs, hs, x.b, x.e, i, x.h);
    for (int c = 0; c < cols; ++c) m[size_t(i) * cols + c] = load_as_float(base, row + c, x.p->dtype);
  }
  return m;
}

// k or v as stored (kv_dtype), dequantised: value * scale (the scale is 1 except for an FP8 cache).
std::vector<double> load_kv(const HeadIndex& x, const void* base, int64_t bs, int64_t rs, int64_t hs,
                            int cols, double scale) {
  std::vector<double> m(size_t(x.e.seqlen_k) * cols, 0.0);
  for (int j = x.key_floor; j < x.e.seqlen_k; ++j) {
    const int64_t row = kv_offset(*x.p, bs, rs, hs, x.b, x.e, j, x.hk);
    for (int c = 0; c < cols; ++c) m[size_t(j) * cols + c] = double(load_as_float(base, row + c, x.p->kv_dtype)) * scale;
  }
  return m;
}

void store_q_like(const HeadIndex& x, void* base, int64_t bs, int64_t rs, int64_t hs, int cols,
                  const std::vector<double>& m) {
  for (int i = 0; i < x.e.seqlen_q; ++i) {
    const int64_t row = q_offset(*x.p, bs, rs, hs, x.b, x.e, i, x.h);
    for (int c = 0; c < cols; ++c) store_from_float(base, row + c, x.p->dtype, float(m[size_t(i) * cols + c]));
  }
}

HeadProblem make_problem(const HeadIndex& x, bool emulate = false) {
  const AttentionParams& p = *x.p;
  HeadProblem hp;
  hp.seqlen_q = x.e.seqlen_q;
  hp.seqlen_k = x.e.seqlen_k;
  hp.head_dim = p.head_dim;
  hp.head_dim_v = p.head_dim_v;
  hp.q = load_q_like(x, p.q, p.q_batch_stride, p.q_row_stride, p.q_head_stride, p.head_dim);
  hp.k = load_kv(x, p.k, p.k_batch_stride, p.k_row_stride, p.k_head_stride, p.head_dim, p.k_scale);
  hp.v = load_kv(x, p.v, p.v_batch_stride, p.v_row_stride, p.v_head_stride, p.head_dim_v, p.v_scale);
  hp.scale = p.softmax_scale;
  hp.window_left = p.window_left;
  hp.window_right = p.window_right;
  hp.key_floor = x.key_floor;
  hp.softcap = p.softcap;
  hp.alibi_slope = alibi_slope(p, x.b, x.h);
  hp.dropout_p = p.dropout_p;
  hp.seed = p.dropout_seed;
  hp.offset = p.dropout_offset;
  hp.dropout_bh = uint32_t(x.b * p.heads_q + x.h);
  hp.emulate = emulate;
  hp.emulate_dtype = p.dtype;
  return hp;
}

HeadIndex head_index(const AttentionParams& p, int bh) {
  HeadIndex x;
  x.p = &p;
  x.b = bh / p.heads_q;
  x.h = bh % p.heads_q;
  x.hk = x.h / (p.heads_q / p.heads_k);
  x.e = sequence_extent(p, x.b);
  return x;
}

void store_result(const HeadIndex& x, const HeadResult& r) {
  const AttentionParams& p = *x.p;
  store_q_like(x, p.out, p.out_batch_stride, p.out_row_stride, p.out_head_stride, p.head_dim_v, r.out);
  if (p.lse)
    for (int i = 0; i < x.e.seqlen_q; ++i) p.lse[lse_offset(p, x.b, x.e, i, x.h)] = float(r.lse[i]);
}

// x' = rotary(x) at `position`: GPT-NeoX halves, or interleaved pairs.
void rotate(const KvcacheParams& p, int position, double* x) {
  const int half = p.rotary_dim / 2;
  for (int d = 0; d < half; ++d) {
    const double c = load_as_float(p.rotary_cos, position * p.rotary_cos_row_stride + d, p.dtype);
    const double s = load_as_float(p.rotary_sin, position * p.rotary_sin_row_stride + d, p.dtype);
    const int a = p.rotary_interleaved ? 2 * d : d;
    const int b = p.rotary_interleaved ? 2 * d + 1 : d + half;
    const double x0 = x[a], x1 = x[b];
    x[a] = x0 * c - x1 * s;
    x[b] = x0 * s + x1 * c;
  }
}

}  // namespace

namespace {

// body(i) for i in [0, n) on `threads` OpenMP threads. An exception must not leave a parallel region (the
// program would terminate), so each is caught in its iteration, the rest are skipped, and the first kind is
// reported after the loop: this backend holds a head's Sq x Sk scores in float64, which a long call may fail
// to allocate (FA_ERROR_OUT_OF_MEMORY; outputs may then be partly written).
template <typename Body>
Status parallel_for(int n, int threads, const Body& body) {
  enum { kNone, kMemory, kOther };
  std::atomic<int> failure{kNone};
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int i = 0; i < n; ++i) {
    if (failure.load(std::memory_order_relaxed) != kNone) continue;
    try {
      body(i);
    } catch (const std::bad_alloc&) {
      failure = kMemory;
    } catch (const std::length_error&) {  // a vector longer than the address space
      failure = kMemory;
    } catch (...) {
      failure = kOther;
    }
  }
  if (failure == kMemory)
    return error(FA_ERROR_OUT_OF_MEMORY, "host allocation failed: cpu_reference holds each head's Sq x Sk scores in float64");
  if (failure == kOther) return error(FA_ERROR_INTERNAL, "cpu_reference: unexpected exception");
  return Status();
}

Status forward_impl(const AttentionParams& p, bool emulate) {
  return parallel_for(p.batch * p.heads_q, p.num_threads, [&](int bh) {
    const HeadIndex x = head_index(p, bh);
    store_result(x, attend(make_problem(x, emulate)));
  });
}

Status backward_impl(const BackwardParams& p, bool emulate) {
  // Parallel over (b, key head): the query heads of one group accumulate into the same dk/dv.
  const int groups = p.batch * p.heads_k;
  const int group_size = p.heads_q / p.heads_k;
  return parallel_for(groups, p.num_threads, [&](int bg) {
    const int b = bg / p.heads_k, hk = bg % p.heads_k;
    const SequenceExtent e = sequence_extent(p, b);
    std::vector<double> dk(size_t(e.seqlen_k) * p.head_dim, 0.0), dv(size_t(e.seqlen_k) * p.head_dim_v, 0.0);
    for (int h = hk * group_size; h < (hk + 1) * group_size; ++h) {
      const HeadIndex x = head_index(p, b * p.heads_q + h);
      const std::vector<double> dout =
          load_q_like(x, p.dout, p.dout_batch_stride, p.dout_row_stride, p.dout_head_stride, p.head_dim_v);
      const HeadGradients g = attend_backward(make_problem(x, emulate), dout);
      store_q_like(x, p.dq, p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride, p.head_dim, g.dq);
      for (size_t n = 0; n < dk.size(); ++n) dk[n] += g.dk[n];
      for (size_t n = 0; n < dv.size(); ++n) dv[n] += g.dv[n];
    }
    for (int j = 0; j < e.seqlen_k; ++j) {
      const int64_t k_row = kv_offset(p, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride, b, e, j, hk);
      const int64_t v_row = kv_offset(p, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride, b, e, j, hk);
      for (int c = 0; c < p.head_dim; ++c) store_from_float(p.dk, k_row + c, p.dtype, float(dk[size_t(j) * p.head_dim + c]));
      for (int c = 0; c < p.head_dim_v; ++c) store_from_float(p.dv, v_row + c, p.dtype, float(dv[size_t(j) * p.head_dim_v + c]));
    }
  });
}

}  // namespace

Status forward(const AttentionParams& p) { return forward_impl(p, false); }
Status backward(const BackwardParams& p) { return backward_impl(p, false); }
Status forward_naive_same_precision(const AttentionParams& p) { return forward_impl(p, true); }
Status backward_naive_same_precision(const BackwardParams& p) { return backward_impl(p, true); }

namespace {

// Element `index` of the cache `base` = x: rounded once to a 16-bit cache's dtype, or quantised into an FP8
// cache as e4m3(float(x) / scale) (the division in float32, then nearest even, saturating: core/fp8.hpp).
void store_cache(const KvcacheParams& p, const void* base, int64_t index, float scale, float x) {
  store_from_float(const_cast<void*>(base), index, p.kv_dtype, p.kv_dtype == FA_FLOAT8_E4M3 ? x / scale : x);
}

}  // namespace

Status kvcache(const KvcacheParams& p) {
  // 1. Append: new rows go to positions cache_seqlens[b] + t, rotated there when rotary is on.
  for (int b = 0; b < p.batch; ++b) {
    const int cached = p.cache_seqlens[b];
    SequenceExtent e{0, 0, p.seqlen_q, cached + p.seqlen_new};
    for (int t = 0; t < p.seqlen_new; ++t)
      for (int hk = 0; hk < p.heads_k; ++hk) {
        std::vector<double> row(p.head_dim);
        const int64_t src = b * p.k_new_batch_stride + t * p.k_new_row_stride + hk * p.k_new_head_stride;
        for (int c = 0; c < p.head_dim; ++c) row[c] = load_as_float(p.k_new, src + c, p.dtype);
        if (p.rotary_dim > 0) rotate(p, cached + t, row.data());
        const int64_t dst = kv_offset(p, p.k_batch_stride, p.k_row_stride, p.k_head_stride, b, e, cached + t, hk);
        for (int c = 0; c < p.head_dim; ++c) store_cache(p, p.k, dst + c, p.k_scale, float(row[c]));
        const int64_t vsrc = b * p.v_new_batch_stride + t * p.v_new_row_stride + hk * p.v_new_head_stride;
        const int64_t vdst = kv_offset(p, p.v_batch_stride, p.v_row_stride, p.v_head_stride, b, e, cached + t, hk);
        for (int c = 0; c < p.head_dim_v; ++c)
          store_cache(p, p.v, vdst + c, p.v_scale, load_as_float(p.v_new, vsrc + c, p.dtype));
      }
  }
  // 2. Attend over keys [cache_leftpad[b], cache_seqlens[b] + seqlen_new) (the padding below is no key; positions
  //    stay the cache rows'). Rotary positions of the queries: cached + i when causal or windowed (each query is
  //    a new token), else all at `cached` (flash_attn's convention for non-causal decode).
  const bool per_token_positions = p.window_left >= 0 || p.window_right >= 0;
  return parallel_for(p.batch * p.heads_q, p.num_threads, [&](int bh) {
    HeadIndex x = head_index(p, bh);
    const int cached = p.cache_seqlens[x.b];
    x.e.seqlen_k = cached + p.seqlen_new;
    if (p.cache_leftpad != nullptr) x.key_floor = p.cache_leftpad[x.b];
    HeadProblem hp = make_problem(x);
    if (p.rotary_dim > 0)
      for (int i = 0; i < x.e.seqlen_q; ++i)
        rotate(p, per_token_positions ? cached + i : cached, &hp.q[size_t(i) * p.head_dim]);
    store_result(x, attend(hp));
  });
}

}  // namespace flashattn::cpu::reference
