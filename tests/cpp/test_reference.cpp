// The float64 oracle checked against what can be known without it: closed-form answers for the
// semantics (bottom-right causal alignment, windows, softcap, ALiBi, fully masked rows), finite
// differences for its analytic backward, and layout identities (varlen = per-sequence dense,
// GQA = repeated heads, KV-cache append = attention over the concatenation).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "cpu/reference/reference.hpp"
#include "testing.hpp"

namespace flashattn {
namespace {

using cpu::reference::HeadProblem;
using fa_test::HostTensor;

HeadProblem random_problem(std::mt19937_64& rng, int sq, int sk, int d, int dv) {
  HeadProblem p{};
  p.seqlen_q = sq;
  p.seqlen_k = sk;
  p.head_dim = d;
  p.head_dim_v = dv;
  std::normal_distribution<double> n(0, 1);
  p.q.resize(size_t(sq) * d);
  p.k.resize(size_t(sk) * d);
  p.v.resize(size_t(sk) * dv);
  for (double& x : p.q) x = n(rng);
  for (double& x : p.k) x = n(rng);
  for (double& x : p.v) x = n(rng);
  p.scale = 1.0 / std::sqrt(double(d));
  p.window_left = p.window_right = -1;
  return p;
}

// With identical keys every visible key gets the same probability, so out_i is the mean of the
// visible values: this pins down which keys each query sees.
// A call whose float64 copies do not fit in memory (here 2^31 - 2^20 keys of D = 256, 4 TiB as float64; the
// inputs are one row at stride 0) is FA_ERROR_OUT_OF_MEMORY, not a terminated program: the allocation fails
// inside the backend's parallel loop, which no exception may leave. (Not under AddressSanitizer, which
// reports so large an allocation itself.)
TEST(Reference, MemoryPastTheMachineIsAnErrorNotACrash) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer reports the allocation itself";
#else
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
  GTEST_SKIP() << "AddressSanitizer reports the allocation itself";
#endif
#endif
  constexpr int64_t kKeys = (int64_t(1) << 31) - (int64_t(1) << 20);
  constexpr int kD = 256;
  std::vector<float> q(kD, 0.1f), kv(kD, 1.f), out(kD, 7.f), lse(1, 7.f);
  auto view = [](float* data, const std::vector<int64_t>& shape, const std::vector<int64_t>& strides) {
    return fa_test::host_view(data, FA_FLOAT32, shape, strides);
  };
  fa_forward_args a{};
  a.q = view(q.data(), {1, 1, 1, kD}, {kD, kD, kD, 1});
  a.k = view(kv.data(), {1, kKeys, 1, kD}, {0, 0, kD, 1});
  a.v = a.k;
  a.out = view(out.data(), {1, 1, 1, kD}, {kD, kD, kD, 1});
  a.lse = view(lse.data(), {1, 1, 1}, {1, 1, 1});
  const Status s = forward(a, fa_test::options_for(FA_BACKEND_CPU_REFERENCE));
  EXPECT_EQ(s.code(), FA_ERROR_OUT_OF_MEMORY) << s.to_string();
  EXPECT_NE(s.message().find("host allocation failed"), std::string::npos) << s.to_string();
#endif
}

TEST(Reference, CausalIsBottomRightAligned) {
  auto rng = fa_test::make_rng("causal");
  HeadProblem p = random_problem(rng, 2, 5, 4, 3);
  for (int j = 1; j < 5; ++j)
    for (int d = 0; d < 4; ++d) p.k[j * 4 + d] = p.k[d];
  p.window_right = 0;  // causal
  const auto r = cpu::reference::attend(p);
  for (int i = 0; i < 2; ++i) {
    const int last_visible = i + 5 - 2;  // query i sees keys j <= i + Sk - Sq
    for (int e = 0; e < 3; ++e) {
      double mean = 0;
      for (int j = 0; j <= last_visible; ++j) mean += p.v[j * 3 + e];
      mean /= last_visible + 1;
      EXPECT_NEAR(r.out[i * 3 + e], mean, 1e-12) << "query " << i;
    }
  }
}

TEST(Reference, SlidingWindowAndFullyMaskedRows) {
  auto rng = fa_test::make_rng("window");
  HeadProblem p = random_problem(rng, 6, 4, 8, 8);
  for (int j = 1; j < 4; ++j)
    for (int d = 0; d < 8; ++d) p.k[j * 8 + d] = p.k[d];
  p.window_left = 1;
  p.window_right = 0;
  const auto r = cpu::reference::attend(p);
  for (int i = 0; i < 6; ++i) {
    const int aligned = i + 4 - 6;  // diagonal key of query i
    const int lo = std::max(0, aligned - 1), hi = std::min(3, aligned);
    if (hi < lo) {  // Sq > Sk: the first rows see nothing
      EXPECT_EQ(r.lse[i], -std::numeric_limits<double>::infinity()) << "row " << i;
      for (int e = 0; e < 8; ++e) EXPECT_EQ(r.out[i * 8 + e], 0.0);
      continue;
    }
    for (int e = 0; e < 8; ++e) {
      double mean = 0;
      for (int j = lo; j <= hi; ++j) mean += p.v[j * 8 + e];
      EXPECT_NEAR(r.out[i * 8 + e], mean / (hi - lo + 1), 1e-12) << "row " << i;
    }
  }
}

TEST(Reference, SoftcapAndAlibiClosedForm) {
  auto rng = fa_test::make_rng("softcap");
  HeadProblem p = random_problem(rng, 1, 2, 2, 1);
  p.q = {3.0, 1.0};
  p.k = {2.0, 0.5, -1.0, 4.0};
  p.v = {10.0, -2.0};
  p.scale = 0.7;
  p.softcap = 1.5;
  p.alibi_slope = 0.25;
  // Sq = 1, Sk = 2: query 0 is aligned with key 1; distances |0 + 1 - j| = 1, 0.
  const double s0 = 1.5 * std::tanh(0.7 * (3 * 2.0 + 1 * 0.5) / 1.5) - 0.25 * 1;
  const double s1 = 1.5 * std::tanh(0.7 * (3 * -1.0 + 1 * 4.0) / 1.5) - 0.25 * 0;
  const double m = std::max(s0, s1);
  const double z = std::exp(s0 - m) + std::exp(s1 - m);
  const auto r = cpu::reference::attend(p);
  EXPECT_NEAR(r.out[0], (std::exp(s0 - m) * 10.0 + std::exp(s1 - m) * -2.0) / z, 1e-12);
  EXPECT_NEAR(r.lse[0], m + std::log(z), 1e-12);
}

TEST(Reference, DropoutScalesKeptProbabilities) {
  auto rng = fa_test::make_rng("dropout");
  HeadProblem p = random_problem(rng, 3, 40, 8, 8);
  HeadProblem undropped = p;
  p.dropout_p = 0.4;
  p.seed = 99;
  p.offset = 5;
  p.dropout_bh = 3;
  const auto r = cpu::reference::attend(p);
  // Rebuild the output from the undropped probabilities and the keep mask.
  std::vector<double> probs;
  HeadProblem one_hot = undropped;
  for (int i = 0; i < 3; ++i)
    for (int e = 0; e < 8; ++e) {
      double expected = 0;
      for (int j = 0; j < 40; ++j) {
        // probability of key j: attend with v = unit vector e_j
        one_hot.head_dim_v = 1;
        one_hot.v.assign(40, 0.0);
        one_hot.v[j] = 1.0;
        const double prob = cpu::reference::attend(one_hot).out[i];
        expected += prob * cpu::reference::dropout_multiplier(p, i, j) * p.v[j * 8 + e];
      }
      EXPECT_NEAR(r.out[i * 8 + e], expected, 1e-12);
    }
  // the lse is that of the undropped softmax
  const auto u = cpu::reference::attend(undropped);
  for (int i = 0; i < 3; ++i) EXPECT_NEAR(r.lse[i], u.lse[i], 1e-12);
}

// Central finite differences of L = sum(out * dout) against the analytic backward.
void check_gradients_by_finite_differences(HeadProblem p, const char* what) {
  auto rng = fa_test::make_rng(what);
  std::normal_distribution<double> n(0, 1);
  std::vector<double> dout(size_t(p.seqlen_q) * p.head_dim_v);
  for (double& x : dout) x = n(rng);
  const auto g = cpu::reference::attend_backward(p, dout);
  auto loss = [&](const HeadProblem& q) {
    const auto r = cpu::reference::attend(q);
    double l = 0;
    for (size_t t = 0; t < dout.size(); ++t) l += r.out[t] * dout[t];
    return l;
  };
  const double h = 1e-5;
  auto check = [&](std::vector<double> HeadProblem::*field, const std::vector<double>& analytic, const char* name) {
    for (size_t t = 0; t < analytic.size(); ++t) {
      HeadProblem plus = p, minus = p;
      (plus.*field)[t] += h;
      (minus.*field)[t] -= h;
      const double numeric = (loss(plus) - loss(minus)) / (2 * h);
      EXPECT_NEAR(analytic[t], numeric, 1e-6 * (1 + std::abs(numeric))) << what << " " << name << "[" << t << "]";
    }
  };
  check(&HeadProblem::q, g.dq, "dq");
  check(&HeadProblem::k, g.dk, "dk");
  check(&HeadProblem::v, g.dv, "dv");
}

TEST(Reference, GradientsMatchFiniteDifferences) {
  auto rng = fa_test::make_rng("fd");
  HeadProblem plain = random_problem(rng, 3, 5, 4, 3);
  check_gradients_by_finite_differences(plain, "plain");
  HeadProblem causal = random_problem(rng, 4, 6, 4, 4);
  causal.window_right = 0;
  causal.window_left = 2;
  check_gradients_by_finite_differences(causal, "causal-window");
  HeadProblem capped = random_problem(rng, 3, 4, 4, 2);
  capped.softcap = 0.8;
  capped.alibi_slope = 0.3;
  capped.scale = 1.3;
  check_gradients_by_finite_differences(capped, "softcap-alibi");
  HeadProblem dropped = random_problem(rng, 3, 9, 4, 3);
  dropped.dropout_p = 0.3;
  dropped.seed = 17;
  dropped.dropout_bh = 1;
  check_gradients_by_finite_differences(dropped, "dropout");
  HeadProblem masked = random_problem(rng, 5, 2, 4, 3);  // Sq > Sk causal: masked rows get zero grads
  masked.window_right = 0;
  check_gradients_by_finite_differences(masked, "masked-rows");
}

// ---- layout identities through the public API ----

TEST(Reference, VarlenEqualsPerSequenceDense) {
  auto rng = fa_test::make_rng("varlen");
  fa_test::Problem vp;
  vp.varlen_q = {5, 0, 9, 1};
  vp.varlen_k = {7, 3, 4, 1};
  vp.heads_q = 4;
  vp.heads_k = 2;
  vp.head_dim = 16;
  fa_test::Tensors v = fa_test::make_tensors(vp, rng);
  fa_options o = fa_test::options_for(FA_BACKEND_CPU_REFERENCE);
  o.causal = 1;
  fa_forward_args va = fa_test::forward_args(v);
  ASSERT_TRUE(forward(va, o).ok());
  int64_t q0 = 0, k0 = 0;
  for (size_t b = 0; b < vp.varlen_q.size(); ++b) {
    fa_test::Problem dp = vp;
    dp.varlen_q.clear();
    dp.varlen_k.clear();
    dp.seqlen_q = vp.varlen_q[b];
    dp.seqlen_k = vp.varlen_k[b];
    fa_test::Tensors d = fa_test::make_tensors(dp, rng);
    const int64_t qn = int64_t(dp.seqlen_q) * vp.heads_q * vp.head_dim, kn = int64_t(dp.seqlen_k) * vp.heads_k * vp.head_dim;
    for (int64_t t = 0; t < qn; ++t) d.q.set(t, v.q.get(q0 * vp.heads_q * vp.head_dim + t));
    for (int64_t t = 0; t < kn; ++t) {
      d.k.set(t, v.k.get(k0 * vp.heads_k * vp.head_dim + t));
      d.v.set(t, v.v.get(k0 * vp.heads_k * vp.head_dim + t));
    }
    fa_forward_args da = fa_test::forward_args(d);
    ASSERT_TRUE(forward(da, o).ok());
    for (int64_t t = 0; t < qn; ++t) ASSERT_EQ(d.out.get(t), v.out.get(q0 * vp.heads_q * vp.head_dim + t));
    for (int h = 0; h < vp.heads_q; ++h)
      for (int i = 0; i < dp.seqlen_q; ++i)
        ASSERT_EQ(d.lse.get(int64_t(h) * dp.seqlen_q + i), v.lse.get(h * v.lse.shape()[1] + q0 + i));
    q0 += dp.seqlen_q;
    k0 += dp.seqlen_k;
  }
}

// ALiBi slopes per (batch, head): sequence b of a (B, Hq) call equals a call of sequence b alone with row b as its
// (Hq) slopes, bit for bit (the float64 reference, and the CPU flash backend as it reads them).
TEST(Reference, AlibiPerBatchRowsEqualPerSequenceCalls) {
  auto rng = fa_test::make_rng("alibi-per-batch");
  fa_test::Problem bp;
  bp.batch = 3;
  bp.seqlen_q = 5;
  bp.seqlen_k = 11;
  bp.heads_q = 4;
  bp.heads_k = 2;
  bp.head_dim = 16;
  fa_test::Tensors all = fa_test::make_tensors(bp, rng);
  HostTensor slopes({3, 4}, FA_FLOAT32);
  slopes.fill_uniform(rng, 0.1, 2.0);  // rows far apart: a row read for another would show
  for (const fa_backend backend : {FA_BACKEND_CPU_REFERENCE, FA_BACKEND_CPU_FLASH}) {
    fa_options o = fa_test::options_for(backend);
    o.alibi_slopes = slopes.view();
    o.causal = 1;
    ASSERT_TRUE(forward(fa_test::forward_args(all), o).ok());
    fa_test::Problem one = bp;
    one.batch = 1;
    const int64_t qn = int64_t(bp.seqlen_q) * bp.heads_q * bp.head_dim, kn = int64_t(bp.seqlen_k) * bp.heads_k * bp.head_dim;
    for (int b = 0; b < bp.batch; ++b) {
      fa_test::Tensors t = fa_test::make_tensors(one, rng);
      for (int64_t x = 0; x < qn; ++x) t.q.set(x, all.q.get(b * qn + x));
      for (int64_t x = 0; x < kn; ++x) {
        t.k.set(x, all.k.get(b * kn + x));
        t.v.set(x, all.v.get(b * kn + x));
      }
      HostTensor row({4}, FA_FLOAT32);
      for (int h = 0; h < 4; ++h) row.set(h, slopes.get(b * 4 + h));
      fa_options ob = o;
      ob.alibi_slopes = row.view();
      ASSERT_TRUE(forward(fa_test::forward_args(t), ob).ok());
      for (int64_t x = 0; x < qn; ++x) ASSERT_EQ(t.out.get(x), all.out.get(b * qn + x)) << "backend " << int(backend) << " b " << b;
      for (int64_t x = 0; x < t.lse.numel(); ++x)
        ASSERT_EQ(t.lse.get(x), all.lse.get(b * t.lse.numel() + x)) << "backend " << int(backend) << " b " << b;
    }
  }
}

TEST(Reference, GroupedQueryGradientsSumOverTheGroup) {
  auto rng = fa_test::make_rng("gqa");
  fa_test::Problem gp;
  gp.seqlen_q = 6;
  gp.seqlen_k = 9;
  gp.heads_q = 4;
  gp.heads_k = 1;
  gp.head_dim = 8;
  fa_test::Tensors g = fa_test::make_tensors(gp, rng);
  fa_options o = fa_test::options_for(FA_BACKEND_CPU_REFERENCE);
  fa_backward_args ga = fa_test::backward_args(g);
  ASSERT_TRUE(forward(fa_test::forward_args(g), o).ok());
  ASSERT_TRUE(backward(ga, o).ok());
  // The same problem with K/V repeated per head (MHA) must give dk/dv whose group sum is GQA's.
  fa_test::Problem mp = gp;
  mp.heads_k = 4;
  fa_test::Tensors m = fa_test::make_tensors(mp, rng);
  for (int64_t t = 0; t < g.q.numel(); ++t) m.q.set(t, g.q.get(t));
  for (int64_t t = 0; t < g.dout.numel(); ++t) m.dout.set(t, g.dout.get(t));
  for (int j = 0; j < 9; ++j)
    for (int h = 0; h < 4; ++h)
      for (int d = 0; d < 8; ++d) {
        m.k.set((j * 4 + h) * 8 + d, g.k.get(j * 8 + d));
        m.v.set((j * 4 + h) * 8 + d, g.v.get(j * 8 + d));
      }
  ASSERT_TRUE(forward(fa_test::forward_args(m), o).ok());
  ASSERT_TRUE(backward(fa_test::backward_args(m), o).ok());
  for (int64_t t = 0; t < g.dq.numel(); ++t) EXPECT_NEAR(g.dq.get(t), m.dq.get(t), 1e-5);
  for (int j = 0; j < 9; ++j)
    for (int d = 0; d < 8; ++d) {
      double dk = 0, dv = 0;
      for (int h = 0; h < 4; ++h) {
        dk += m.dk.get((j * 4 + h) * 8 + d);
        dv += m.dv.get((j * 4 + h) * 8 + d);
      }
      EXPECT_NEAR(g.dk.get(j * 8 + d), dk, 1e-5);
      EXPECT_NEAR(g.dv.get(j * 8 + d), dv, 1e-5);
    }
}

TEST(Reference, KvcacheAppendEqualsAttentionOverConcatenation) {
  auto rng = fa_test::make_rng("kvcache");
  const int B = 2, capacity = 12, hk = 2, hq = 4, d = 8, s_new = 3, sq = 3;
  const int cached[B] = {4, 9};
  HostTensor q({B, sq, hq, d}, FA_FLOAT32), kc({B, capacity, hk, d}, FA_FLOAT32), vc({B, capacity, hk, d}, FA_FLOAT32);
  HostTensor kn({B, s_new, hk, d}, FA_FLOAT32), vn({B, s_new, hk, d}, FA_FLOAT32), out({B, sq, hq, d}, FA_FLOAT32);
  HostTensor seqlens({B}, FA_INT32);
  q.fill_normal(rng);
  kc.fill_normal(rng);
  vc.fill_normal(rng);
  kn.fill_normal(rng);
  vn.fill_normal(rng);
  out.poison();
  for (int b = 0; b < B; ++b) seqlens.set_int(b, cached[b]);
  HostTensor kc_before = kc, vc_before = vc;
  fa_kvcache_args a{};
  a.q = q.view();
  a.k_cache = kc.view();
  a.v_cache = vc.view();
  a.cache_seqlens = seqlens.view();
  a.k_new = kn.view();
  a.v_new = vn.view();
  a.out = out.view();
  fa_options o = fa_test::options_for(FA_BACKEND_CPU_REFERENCE);
  o.causal = 1;
  ASSERT_TRUE(kvcache(a, o).ok());
  for (int b = 0; b < B; ++b) {
    const int sk = cached[b] + s_new;
    HostTensor k({1, sk, hk, d}, FA_FLOAT32), v({1, sk, hk, d}, FA_FLOAT32), qb({1, sq, hq, d}, FA_FLOAT32),
        ob({1, sq, hq, d}, FA_FLOAT32);
    for (int j = 0; j < sk; ++j)
      for (int t = 0; t < hk * d; ++t) {
        const bool fresh = j >= cached[b];
        const int64_t cache_index = (int64_t(b) * capacity + j) * hk * d + t;
        const int64_t new_index = (int64_t(b) * s_new + (j - cached[b])) * hk * d + t;
        k.set(int64_t(j) * hk * d + t, fresh ? kn.get(new_index) : kc_before.get(cache_index));
        v.set(int64_t(j) * hk * d + t, fresh ? vn.get(new_index) : vc_before.get(cache_index));
        EXPECT_EQ(kc.get(cache_index), k.get(int64_t(j) * hk * d + t)) << "cache not appended";
      }
    for (int t = 0; t < sq * hq * d; ++t) qb.set(t, q.get(int64_t(b) * sq * hq * d + t));
    fa_forward_args f{};
    f.q = qb.view();
    f.k = k.view();
    f.v = v.view();
    f.out = ob.view();
    ASSERT_TRUE(forward(f, o).ok());
    for (int t = 0; t < sq * hq * d; ++t) EXPECT_EQ(ob.get(t), out.get(int64_t(b) * sq * hq * d + t));
  }
  // rows past cached + s_new are untouched
  for (int b = 0; b < B; ++b)
    for (int j = cached[b] + s_new; j < capacity; ++j)
      for (int t = 0; t < hk * d; ++t) {
        const int64_t index = (int64_t(b) * capacity + j) * hk * d + t;
        EXPECT_EQ(kc.get(index), kc_before.get(index));
      }
}

}  // namespace
}  // namespace flashattn
