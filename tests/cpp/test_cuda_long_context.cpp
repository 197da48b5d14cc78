// Long context on the GPU: forward + backward at S = 128k (D = 128, bf16, one GQA group: Hq = 2,
// Hk = 1) runs, and matches float64 on sampled rows. A full float64 oracle at this size would cost
// ~10^13 operations, so the check samples:
//   - query rows: out, lse and dq of the row, exactly (each needs only its own row of scores);
//   - key rows: dk and dv of the row, in float64 from the inputs and the GPU's lse and out (lse is the
//     forward's statistic that the backward consumes; out gives D_i = dout_i . out_i, as the kernels
//     do), so they check the backward's accumulation over all 128k queries.
// The 16-bit tolerance rule compares with a naive same-precision computation of the same rows.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "core/dtype.hpp"
#include "testing.hpp"

#if defined(FLASHATTN_WITH_CUDA)
#include <cuda_runtime.h>
#endif

namespace {

using fa_test::HostTensor;

#if defined(FLASHATTN_WITH_CUDA)
struct DeviceCopy {
  void* data = nullptr;
  explicit DeviceCopy(const HostTensor& t) {
    EXPECT_EQ(cudaMalloc(&data, size_t(t.storage_bytes())), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(data, t.data(), size_t(t.storage_bytes()), cudaMemcpyHostToDevice), cudaSuccess);
  }
  ~DeviceCopy() { cudaFree(data); }
  void download(HostTensor& t) const {
    EXPECT_EQ(cudaMemcpy(t.data(), data, size_t(t.storage_bytes()), cudaMemcpyDeviceToHost), cudaSuccess);
  }
};
#endif

[[maybe_unused]] double round_bf16(double x) { return flashattn::to_float(flashattn::to_bf16(float(x))); }

TEST(CudaLongContext, Seqlen128kForwardBackwardSampledRows) {
  if (fa_cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: the long-context test runs on the GPU machine";
#if defined(FLASHATTN_WITH_CUDA)
  const int S = 131072, D = 128, HQ = 2, HK = 1;
  auto rng = fa_test::make_rng("long_context");
  HostTensor q({1, S, HQ, D}, FA_BFLOAT16), k({1, S, HK, D}, FA_BFLOAT16), v({1, S, HK, D}, FA_BFLOAT16);
  HostTensor dout({1, S, HQ, D}, FA_BFLOAT16), out({1, S, HQ, D}, FA_BFLOAT16), lse({1, HQ, S}, FA_FLOAT32);
  HostTensor dq({1, S, HQ, D}, FA_BFLOAT16), dk({1, S, HK, D}, FA_BFLOAT16), dv({1, S, HK, D}, FA_BFLOAT16);
  q.fill_normal(rng);
  k.fill_normal(rng);
  v.fill_normal(rng);
  dout.fill_normal(rng);
  for (HostTensor* t : {&out, &lse, &dq, &dk, &dv}) t->poison();
  DeviceCopy q_d(q), k_d(k), v_d(v), dout_d(dout), out_d(out), lse_d(lse), dq_d(dq), dk_d(dk), dv_d(dv);
  fa_forward_args fa{};
  fa.q = q.view_on(q_d.data, FA_DEVICE_CUDA, 0);
  fa.k = k.view_on(k_d.data, FA_DEVICE_CUDA, 0);
  fa.v = v.view_on(v_d.data, FA_DEVICE_CUDA, 0);
  fa.out = out.view_on(out_d.data, FA_DEVICE_CUDA, 0);
  fa.lse = lse.view_on(lse_d.data, FA_DEVICE_CUDA, 0);
  fa_options options = fa_test::options_for(FA_BACKEND_CUDA);
  ASSERT_TRUE(flashattn::forward(fa, options).ok());
  fa_backward_args ba{};
  ba.q = fa.q, ba.k = fa.k, ba.v = fa.v, ba.out = fa.out, ba.lse = fa.lse;
  ba.dout = dout.view_on(dout_d.data, FA_DEVICE_CUDA, 0);
  ba.dq = dq.view_on(dq_d.data, FA_DEVICE_CUDA, 0);
  ba.dk = dk.view_on(dk_d.data, FA_DEVICE_CUDA, 0);
  ba.dv = dv.view_on(dv_d.data, FA_DEVICE_CUDA, 0);
  const flashattn::Status bs = flashattn::backward(ba, options);
  ASSERT_TRUE(bs.ok()) << bs.to_string();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  out_d.download(out);
  lse_d.download(lse);
  dq_d.download(dq);
  dk_d.download(dk);
  dv_d.download(dv);
  for (HostTensor* t : {&out, &lse, &dq, &dk, &dv}) ASSERT_EQ(t->count_nonfinite(), 0) << "unwritten or non-finite outputs";

  const double scale = 1.0 / std::sqrt(double(D));
  // float64 copies (the checks below read each element many times)
  const std::vector<double> q64 = q.to_double(), k64 = k.to_double(), v64 = v.to_double(), dout64 = dout.to_double(),
                            out64 = out.to_double();
  auto at = [](const std::vector<double>& t, int row, int heads, int h, int d) {
    return t[size_t((int64_t(row) * heads + h) * 128 + d)];
  };
  auto got = [](const HostTensor& t, int row, int heads, int h, int d) { return t.get((int64_t(row) * heads + h) * 128 + d); };
  const int sampled[] = {0, 1, 4095, 65536, 99991, S - 2, S - 1, 31337};

  // ---- query rows: exact out, lse, dq (and the naive same-precision values) ----
  std::vector<double> got_out, exact_out, naive_out, got_dq, exact_dq, naive_dq, got_lse, exact_lse;
  for (int h = 0; h < HQ; ++h)
    for (int i : sampled) {
      std::vector<double> s(S), s_naive(S);
      double m = -INFINITY, m_naive = -INFINITY;
      for (int j = 0; j < S; ++j) {
        double dot = 0;
        for (int d = 0; d < D; ++d) dot += at(q64, i, HQ, h, d) * at(k64, j, HK, 0, d);
        s[j] = scale * dot;
        s_naive[j] = round_bf16(s[j]);
        m = std::max(m, s[j]);
        m_naive = std::max(m_naive, s_naive[j]);
      }
      double z = 0, z_naive = 0;
      for (int j = 0; j < S; ++j) z += std::exp(s[j] - m), z_naive += std::exp(s_naive[j] - m_naive);
      std::vector<double> o(D, 0), o_naive(D, 0), dp(S), p(S), p_naive(S);
      for (int j = 0; j < S; ++j) {
        p[j] = std::exp(s[j] - m) / z;
        p_naive[j] = round_bf16(std::exp(s_naive[j] - m_naive) / z_naive);
        double dpj = 0;
        for (int d = 0; d < D; ++d) {
          o[d] += p[j] * at(v64, j, HK, 0, d);
          o_naive[d] += p_naive[j] * at(v64, j, HK, 0, d);
          dpj += at(dout64, i, HQ, h, d) * at(v64, j, HK, 0, d);
        }
        dp[j] = dpj;
      }
      double row_dot = 0;
      for (int j = 0; j < S; ++j) row_dot += p[j] * dp[j];
      std::vector<double> g(D, 0), g_naive(D, 0);
      for (int j = 0; j < S; ++j) {
        const double ds = p[j] * (dp[j] - row_dot), ds_naive = round_bf16(p_naive[j] * (round_bf16(dp[j]) - row_dot));
        for (int d = 0; d < D; ++d) {
          g[d] += scale * ds * at(k64, j, HK, 0, d);
          g_naive[d] += scale * ds_naive * at(k64, j, HK, 0, d);
        }
      }
      for (int d = 0; d < D; ++d) {
        got_out.push_back(at(out64, i, HQ, h, d));
        exact_out.push_back(o[d]);
        naive_out.push_back(round_bf16(o_naive[d]));
        got_dq.push_back(got(dq, i, HQ, h, d));
        exact_dq.push_back(g[d]);
        naive_dq.push_back(round_bf16(g_naive[d]));
      }
      got_lse.push_back(lse.get(int64_t(h) * S + i));
      exact_lse.push_back(m + std::log(z));
    }
  const fa_test::ErrorStats out_naive = fa_test::compare(naive_out, exact_out);
  const fa_test::ErrorStats dq_naive = fa_test::compare(naive_dq, exact_dq);
  EXPECT_TRUE(fa_test::within_tolerance("out rows", FA_BFLOAT16, fa_test::compare(got_out, exact_out), &out_naive));
  EXPECT_TRUE(fa_test::within_tolerance("dq rows", FA_BFLOAT16, fa_test::compare(got_dq, exact_dq), &dq_naive));
  EXPECT_LE(fa_test::compare(got_lse, exact_lse).rel_l2, 1e-5) << "lse rows";

  // ---- key rows: dk, dv summed over all queries of both heads, from the GPU's lse and out ----
  std::vector<double> got_dk, exact_dk, got_dv, exact_dv;
  const int n_sampled = int(sizeof(sampled) / sizeof(sampled[0]));
  std::vector<std::vector<double>> gk_rows(n_sampled, std::vector<double>(D, 0)), gv_rows(n_sampled, std::vector<double>(D, 0));
#pragma omp parallel for schedule(dynamic, 1)
  for (int n = 0; n < n_sampled; ++n) {
    const int j = sampled[n];
    std::vector<double>& gk = gk_rows[n];
    std::vector<double>& gv = gv_rows[n];
    for (int h = 0; h < HQ; ++h)
      for (int i = 0; i < S; ++i) {
        double dot = 0, dpj = 0, row_dot = 0;
        for (int d = 0; d < D; ++d) {
          dot += at(q64, i, HQ, h, d) * at(k64, j, HK, 0, d);
          dpj += at(dout64, i, HQ, h, d) * at(v64, j, HK, 0, d);
          row_dot += at(dout64, i, HQ, h, d) * at(out64, i, HQ, h, d);
        }
        const double p = std::exp(scale * dot - lse.get(int64_t(h) * S + i));
        const double ds = p * (dpj - row_dot);
        for (int d = 0; d < D; ++d) {
          gv[d] += p * at(dout64, i, HQ, h, d);
          gk[d] += scale * ds * at(q64, i, HQ, h, d);
        }
      }
  }
  for (int n = 0; n < n_sampled; ++n) {
    const int j = sampled[n];
    const std::vector<double>& gk = gk_rows[n];
    const std::vector<double>& gv = gv_rows[n];
    for (int d = 0; d < D; ++d) {
      got_dk.push_back(got(dk, j, HK, 0, d));
      exact_dk.push_back(gk[d]);
      got_dv.push_back(got(dv, j, HK, 0, d));
      exact_dv.push_back(gv[d]);
    }
  }
  // These sums run over 262k terms whose inputs (lse, out) are themselves rounded: hold them to a
  // bf16-level relative error (the output rounding alone is ~2^-9 = 2e-3).
  const fa_test::ErrorStats dk_err = fa_test::compare(got_dk, exact_dk), dv_err = fa_test::compare(got_dv, exact_dv);
  EXPECT_LE(dk_err.rel_l2, 1e-2) << "dk rows: " << dk_err.to_string();
  EXPECT_LE(dv_err.rel_l2, 1e-2) << "dv rows: " << dv_err.to_string();
  std::printf("S=128k sampled rows: out %s | dq %s | dk %s | dv %s\n", fa_test::compare(got_out, exact_out).to_string().c_str(),
              fa_test::compare(got_dq, exact_dq).to_string().c_str(), dk_err.to_string().c_str(), dv_err.to_string().c_str());
#endif
}

}  // namespace
