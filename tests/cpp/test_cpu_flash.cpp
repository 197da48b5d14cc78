// The CPU flash backend (forward, backward) and the textbook standard path, against the float64
// oracle on fresh random inputs, through the public API. Covers odd sizes, Sq != Sk both ways,
// GQA, head dims, every option and their combinations, varlen, paged K/V, non-contiguous strides,
// fp32/fp16/bf16, bit-exact dropout, fully masked rows, determinism and the scratch bound.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "core/dtype.hpp"
#include "cpu/flash/vec_math.hpp"
#include "testing.hpp"

namespace flashattn {
namespace {

using fa_test::HostTensor;
using fa_test::Problem;
using fa_test::Tensors;

constexpr double kInf = std::numeric_limits<double>::infinity();

// The options under test; `tweak` adds the variant.
struct Variant {
  std::string name;
  std::function<void(fa_options&)> tweak;
};

// Slopes that keep ALiBi visible next to the scores (one per head, or per (batch, head)).
HostTensor alibi_slopes(std::mt19937_64& rng, int batch, int heads, bool per_batch) {
  HostTensor slopes = per_batch ? HostTensor({batch, heads}, FA_FLOAT32) : HostTensor({heads}, FA_FLOAT32);
  slopes.fill_uniform(rng, 0.05, 0.6);
  return slopes;
}

Problem problem(int batch, int sq, int sk, int hq, int hk, int d, fa_dtype dtype = FA_FLOAT32, int dv = -1) {
  Problem p;
  p.batch = batch;
  p.seqlen_q = sq;
  p.seqlen_k = sk;
  p.heads_q = hq;
  p.heads_k = hk;
  p.head_dim = d;
  p.head_dim_v = dv;
  p.dtype = dtype;
  return p;
}

fa_options flash_options(int threads = 2) {
  fa_options o = fa_test::options_for(FA_BACKEND_CPU_FLASH);
  o.num_threads = threads;
  return o;
}

// Runs `backend` and the oracle on the same fresh inputs; checks out and lse under the rule.
void expect_forward_like_oracle(const Problem& pr, fa_options o, const std::string& what) {
  auto rng = fa_test::make_rng(what);
  Tensors t = fa_test::make_tensors(pr, rng);
  const fa_test::Oracle oracle = fa_test::run_oracle(t, o, /*with_backward=*/false);
  t.poison_outputs();
  const Status s = forward(fa_test::forward_args(t), o);
  ASSERT_TRUE(s.ok()) << what << ": " << s.to_string();
  fa_test::expect_forward_matches(what + " [" + pr.to_string() + "]", t, oracle, pr.dtype);
}

// fa_test::expect_backward_matches, except for a gradient that is exactly zero in the oracle: when
// every row sees a single key (Sk = 1, window (0, 0)) P = 1 is constant and dq = dk = 0, which a
// float computation reaches only up to the cancellation in dS = P (dP - delta), about eps |dO| |v|
// per term, summed over the rows. There a relative error is meaningless; the bound is 1e-5 of the
// largest gradient of the same problem (dv = P^T dO is then the sum of those rows' dO).
void expect_gradients_match(const std::string& what, const Tensors& t, const fa_test::Oracle& o, fa_dtype dtype) {
  struct Item {
    const char* name;
    const HostTensor& got;
    const std::vector<double>& exact;
    const HostTensor& naive;
  };
  const Item items[] = {{" dq", t.dq, o.dq64, o.naive_dq}, {" dk", t.dk, o.dk64, o.naive_dk}, {" dv", t.dv, o.dv64, o.naive_dv}};
  double largest_gradient = 0;
  for (const Item& item : items)
    for (const double x : item.exact) largest_gradient = std::max(largest_gradient, std::abs(x));
  for (const Item& item : items) {
    const fa_test::ErrorStats e = fa_test::compare(item.got.to_double(), item.exact);
    double exact_norm = 0;
    for (const double x : item.exact) exact_norm += x * x;
    if (exact_norm == 0) {
      EXPECT_EQ(e.nan + e.mismatched_inf, 0) << what << item.name;
      EXPECT_LE(e.max_abs, 1e-5 * std::max(1.0, largest_gradient))
          << what << item.name << " (exactly zero in the oracle; largest gradient " << largest_gradient << "): " << e.to_string();
      continue;
    }
    fa_test::ErrorStats naive;
    if (dtype != FA_FLOAT32) naive = fa_test::compare(item.naive.to_double(), item.exact);
    EXPECT_TRUE(fa_test::within_tolerance(what + item.name, dtype, e, dtype != FA_FLOAT32 ? &naive : nullptr));
  }
}

// The backward's two schedules (backward.cpp): "fused" or "three-pass", as fa_stats.kernel names them.
constexpr const char* kSchedules[] = {"fused", "three-pass"};

std::string backward_kernel(const Tensors& t, fa_options o) {
  fa_stats stats{};
  o.stats = &stats;
  Tensors copy = t;
  const Status s = backward(fa_test::backward_args(copy), o);
  return s.ok() ? std::string(stats.kernel) : "error: " + s.to_string();
}

// The least thread count in [1, 16] that runs `schedule` on t's problem (0: none does).
int threads_for_schedule(const Tensors& t, fa_options o, const std::string& schedule) {
  for (int threads = 1; threads <= 16; ++threads) {
    o.num_threads = threads;
    if (backward_kernel(t, o).find(" " + schedule) != std::string::npos) return threads;
  }
  return 0;
}

// The backward against the oracle, once with each schedule (each at a thread count that picks it).
void expect_backward_like_oracle(const Problem& pr, fa_options o, const std::string& what) {
  auto rng = fa_test::make_rng(what);
  Tensors t = fa_test::make_tensors(pr, rng);
  const fa_test::Oracle oracle = fa_test::run_oracle(t, o, /*with_backward=*/true);
  t.poison_outputs();
  // The forward under test provides out and lse, as in training.
  Status s = forward(fa_test::forward_args(t), o);
  ASSERT_TRUE(s.ok()) << what << ": " << s.to_string();
  fa_test::expect_forward_matches(what + " fwd [" + pr.to_string() + "]", t, oracle, pr.dtype);
  for (const char* schedule : kSchedules) {
    fa_options os = o;
    os.num_threads = threads_for_schedule(t, o, schedule);
    ASSERT_GT(os.num_threads, 0) << what << ": no thread count in [1, 16] runs the " << schedule << " backward";
    t.dq.poison();
    t.dk.poison();
    t.dv.poison();
    fa_stats stats{};
    os.stats = &stats;
    s = backward(fa_test::backward_args(t), os);
    ASSERT_TRUE(s.ok()) << what << ": " << s.to_string();
    EXPECT_NE(std::string(stats.kernel).find(schedule), std::string::npos) << stats.kernel;
    expect_gradients_match(what + " bwd " + schedule + " x" + std::to_string(os.num_threads) + " [" + pr.to_string() + "]",
                           t, oracle, pr.dtype);
  }
}

// ---------------------------------------------------------------------------------------------
// The vectorised exp2 of the softmax: accuracy, the masked (-inf) limit, and lanes equal to scalar.

TEST(CpuFlashMath, Exp2FastAccuracy) {
  using cpu::exp2_fast;
  double worst_ulps = 0;
  for (double x = -126.0; x <= 127.0; x += 1.0 / 1024 + 1e-7) {
    const float xf = float(x);
    const double exact = std::exp2(double(xf));
    const double ulp = std::ldexp(1.0, std::ilogb(exact) - 23);
    worst_ulps = std::max(worst_ulps, std::abs(double(exp2_fast(xf)) - exact) / ulp);
    cpu::f32x8 lanes;
    for (int l = 0; l < 8; ++l) lanes[l] = float(x + 0.37 * l);
    const cpu::f32x8 vector_result = exp2_fast(lanes);
    for (int l = 0; l < 8; ++l) ASSERT_EQ(vector_result[l], exp2_fast(lanes[l])) << "lane " << l << " of x = " << x;
  }
  EXPECT_LE(worst_ulps, 2.0);
  std::printf("[cpu_flash] exp2_fast: worst error %.2f ulp on [-126, 127]\n", worst_ulps);
  EXPECT_EQ(exp2_fast(-std::numeric_limits<float>::infinity()), 0.f);  // masked scores
  EXPECT_EQ(exp2_fast(-200.f), 0.f);
  EXPECT_EQ(exp2_fast(0.f), 1.f);
  // exp2_shifted_inplace on a row with a tail that is not a multiple of the vector width
  std::vector<float> row(37);
  for (size_t j = 0; j < row.size(); ++j) row[j] = -0.25f * float(j);
  row[5] = -std::numeric_limits<float>::infinity();
  const float sum = cpu::exp2_shifted_inplace(row.data(), int(row.size()), -1.f);
  double expected_sum = 0;
  for (size_t j = 0; j < row.size(); ++j) {
    const double expected = j == 5 ? 0.0 : std::exp2(-0.25 * double(j) + 1.0);
    EXPECT_NEAR(row[j], expected, 3e-7 * expected) << j;
    expected_sum += expected;
  }
  EXPECT_NEAR(sum, expected_sum, 1e-6 * expected_sum);
}

// ---------------------------------------------------------------------------------------------
// Forward

TEST(CpuFlashForward, SizesAndShapes) {
  // Odd sizes, Sq != Sk both ways, partial tiles, GQA 1/2/8.
  const int sizes[][2] = {{1, 1}, {17, 17}, {127, 127}, {1, 127}, {127, 1}, {17, 300}, {300, 17}, {129, 257}};
  for (const auto& s : sizes) {
    for (const int group : {1, 2, 8}) {
      const Problem pr = problem(2, s[0], s[1], 8, 8 / group, 64);
      expect_forward_like_oracle(pr, flash_options(), "sizes");
    }
  }
}

TEST(CpuFlashForward, HeadDims) {
  for (const int d : {32, 40, 64, 96, 128, 192, 256}) {
    expect_forward_like_oracle(problem(1, 67, 131, 2, 1, d), flash_options(), "head dim " + std::to_string(d));
  }
  // Dv != D, both ways
  expect_forward_like_oracle(problem(1, 33, 70, 2, 2, 64, FA_FLOAT32, 32), flash_options(), "dv < d");
  expect_forward_like_oracle(problem(1, 33, 70, 2, 2, 32, FA_FLOAT32, 96), flash_options(), "dv > d");
}

TEST(CpuFlashForward, ThousandAndPeaky) {
  Problem pr = problem(1, 1000, 1000, 2, 1, 64);
  expect_forward_like_oracle(pr, flash_options(), "1000");
  pr.input_std = 3.0;  // peaky softmax
  fa_options o = flash_options();
  o.causal = 1;
  expect_forward_like_oracle(pr, o, "1000 peaky causal");
}

TEST(CpuFlashForward, Long4097) {
  expect_forward_like_oracle(problem(1, 4097, 4097, 1, 1, 32), flash_options(), "4097");
}

std::vector<Variant> all_variants(const HostTensor* slopes_1d, const HostTensor* slopes_2d) {
  std::vector<Variant> v = {
      {"plain", [](fa_options&) {}},
      {"causal", [](fa_options& o) { o.causal = 1; }},
      {"window(5,3)", [](fa_options& o) { o.window_left = 5; o.window_right = 3; }},
      {"window(0,0)", [](fa_options& o) { o.window_left = 0; o.window_right = 0; }},
      {"window(-1,7)", [](fa_options& o) { o.window_right = 7; }},
      {"causal window 20", [](fa_options& o) { o.causal = 1; o.window_left = 20; }},
      {"softcap", [](fa_options& o) { o.softcap = 2.5f; }},
      {"scale", [](fa_options& o) { o.softmax_scale = 0.31f; }},
      {"dropout", [](fa_options& o) { o.dropout_p = 0.17f; o.dropout_seed = 0x1234567890abcdefull; o.dropout_offset = 77; }},
      {"causal softcap dropout",
       [](fa_options& o) { o.causal = 1; o.softcap = 1.7f; o.dropout_p = 0.3f; o.dropout_seed = 5; o.dropout_offset = 1ull << 40; }},
  };
  if (slopes_1d) {
    const fa_tensor a = const_cast<HostTensor*>(slopes_1d)->view();
    v.push_back({"alibi 1-D", [a](fa_options& o) { o.alibi_slopes = a; }});
    v.push_back({"alibi causal window softcap", [a](fa_options& o) {
                   o.alibi_slopes = a; o.causal = 1; o.window_left = 9; o.softcap = 3.f; }});
  }
  if (slopes_2d) {
    const fa_tensor a = const_cast<HostTensor*>(slopes_2d)->view();
    v.push_back({"alibi 2-D dropout", [a](fa_options& o) { o.alibi_slopes = a; o.dropout_p = 0.1f; o.dropout_seed = 3; }});
  }
  return v;
}

TEST(CpuFlashForward, EveryOptionAndCombinations) {
  auto rng = fa_test::make_rng("variants");
  const HostTensor slopes_1d = alibi_slopes(rng, 2, 4, false), slopes_2d = alibi_slopes(rng, 2, 4, true);
  const int shapes[][2] = {{37, 150}, {150, 37}, {64, 64}};
  for (const Variant& v : all_variants(&slopes_1d, &slopes_2d))
    for (const auto& s : shapes) {
      fa_options o = flash_options();
      v.tweak(o);
      expect_forward_like_oracle(problem(2, s[0], s[1], 4, 2, 48), o, v.name);
    }
}

TEST(CpuFlashForward, HalfPrecision) {
  auto rng = fa_test::make_rng("half");
  const HostTensor slopes = alibi_slopes(rng, 2, 4, false);
  for (const fa_dtype dtype : {FA_FLOAT16, FA_BFLOAT16})
    for (const Variant& v : all_variants(&slopes, nullptr)) {
      fa_options o = flash_options();
      v.tweak(o);
      Problem pr = problem(2, 77, 201, 4, 2, 64, dtype);
      expect_forward_like_oracle(pr, o, v.name + " 16-bit");
      if (v.name != "plain" && v.name != "causal" && v.name != "softcap") continue;
      pr.input_std = 3.0;  // peaky softmax
      expect_forward_like_oracle(pr, o, v.name + " 16-bit peaky");
    }
}

TEST(CpuFlashForward, Varlen) {
  Problem pr = problem(4, 0, 0, 4, 2, 64);
  pr.varlen_q = {5, 0, 130, 1, 64};
  pr.varlen_k = {7, 3, 200, 1, 0};
  pr.batch = 5;
  for (const char* name : {"plain", "causal", "window"}) {
    fa_options o = flash_options();
    if (std::string(name) == "causal") o.causal = 1;
    if (std::string(name) == "window") { o.window_left = 10; o.window_right = 2; }
    expect_forward_like_oracle(pr, o, std::string("varlen ") + name);
  }
  pr.dtype = FA_BFLOAT16;
  expect_forward_like_oracle(pr, flash_options(), "varlen bf16");
}

// max_seqlen_q / max_seqlen_k are upper bounds: a loose one, up to INT32_MAX, gives the tight one's results
// (to float32 rounding: the tiles may be cut differently), forward and backward. (INT32_MAX used to overflow
// the tile count: no tile ran and out stayed 0. Found by RandomCalls.)
TEST(CpuFlashForward, VarlenLooseMaxSeqlen) {
  auto rng = fa_test::make_rng("varlen-loose-max");
  Problem pr = problem(3, 0, 0, 4, 2, 32);
  pr.varlen_q = {5, 0, 37};
  pr.varlen_k = {7, 3, 50};
  fa_test::Tensors tight = fa_test::make_tensors(pr, rng);
  fa_options o = flash_options();
  o.causal = 1;
  ASSERT_TRUE(forward(fa_test::forward_args(tight), o).ok());
  ASSERT_TRUE(backward(fa_test::backward_args(tight), o).ok());
  for (const int32_t loose : {51, 1 << 20, std::numeric_limits<int32_t>::max()}) {  // the longest sequence has 50 keys
    fa_test::Tensors t = tight;
    t.poison_outputs();
    t.max_seqlen_q = loose;
    t.max_seqlen_k = loose;
    ASSERT_TRUE(forward(fa_test::forward_args(t), o).ok()) << loose;
    ASSERT_TRUE(backward(fa_test::backward_args(t), o).ok()) << loose;
    for (const auto& [name, got, want] : {std::tuple{"out", &t.out, &tight.out}, std::tuple{"lse", &t.lse, &tight.lse},
                                          std::tuple{"dq", &t.dq, &tight.dq}, std::tuple{"dk", &t.dk, &tight.dk},
                                          std::tuple{"dv", &t.dv, &tight.dv}}) {
      const fa_test::ErrorStats e = fa_test::compare(*got, *want);
      EXPECT_TRUE(e.nan == 0 && e.mismatched_inf == 0 && e.rel_l2 <= 1e-6) << name << ", max_seqlen " << loose << ": " << e.to_string();
    }
  }
}

// 2^31 - 2^20 keys, the largest extent (flashattn.h), all rows at one address (stride 0): with a window of
// one key per query the answer is known: out = that v row, lse = its score. (At 2^31 - 48 keys the key loop
// used to step past INT32_MAX and read at negative rows.)
TEST(CpuFlashForward, KeysAtTheLargestExtent) {
  constexpr int64_t kLargest = (int64_t(1) << 31) - (int64_t(1) << 20);
  constexpr int kSq = 3, kD = 8;
  std::vector<float> q(size_t(kSq) * kD), kv(kD), out(size_t(kSq) * kD, std::nanf("")), lse(kSq, std::nanf(""));
  for (int i = 0; i < kSq * kD; ++i) q[size_t(i)] = 0.25f * float(i % 7) - 0.5f;
  for (int d = 0; d < kD; ++d) kv[size_t(d)] = float(d) - 3.f;
  auto view = [](float* data, const std::vector<int64_t>& shape, const std::vector<int64_t>& strides) {
    return fa_test::host_view(data, FA_FLOAT32, shape, strides);
  };
  fa_forward_args a{};
  a.q = view(q.data(), {1, kSq, 1, kD}, {kSq * kD, kD, kD, 1});
  a.k = view(kv.data(), {1, kLargest, 1, kD}, {0, 0, kD, 1});
  a.v = a.k;
  a.out = view(out.data(), {1, kSq, 1, kD}, {kSq * kD, kD, kD, 1});
  a.lse = view(lse.data(), {1, 1, kSq}, {kSq, kSq, 1});
  fa_options o = flash_options();
  o.causal = 1;        // query i sees keys up to Sk - Sq + i ...
  o.window_left = 0;   // ... and none before it: one key
  const Status s = forward(a, o);
  ASSERT_TRUE(s.ok()) << s.to_string();
  const double scale = 1.0 / std::sqrt(double(kD));
  for (int i = 0; i < kSq; ++i) {
    double score = 0;
    for (int d = 0; d < kD; ++d) score += double(q[size_t(i) * kD + d]) * kv[size_t(d)];
    EXPECT_NEAR(lse[size_t(i)], score * scale, 1e-5) << "row " << i;
    for (int d = 0; d < kD; ++d) EXPECT_EQ(out[size_t(i) * kD + d], kv[size_t(d)]) << "row " << i << " column " << d;
  }
}

// Varlen gives what each sequence gives alone, densely.
TEST(CpuFlashForward, VarlenEqualsPerSequenceDense) {
  auto rng = fa_test::make_rng("varlen-dense");
  Problem vp = problem(3, 0, 0, 4, 2, 32);
  vp.varlen_q = {40, 1, 70};
  vp.varlen_k = {90, 5, 33};
  Tensors v = fa_test::make_tensors(vp, rng);
  fa_options o = flash_options();
  o.causal = 1;
  ASSERT_TRUE(forward(fa_test::forward_args(v), o).ok());
  int64_t q0 = 0, k0 = 0;
  for (size_t b = 0; b < vp.varlen_q.size(); ++b) {
    Problem dp = problem(1, vp.varlen_q[b], vp.varlen_k[b], 4, 2, 32);
    Tensors d = fa_test::make_tensors(dp, rng);
    const int64_t qn = int64_t(dp.seqlen_q) * 4 * 32, kn = int64_t(dp.seqlen_k) * 2 * 32;
    for (int64_t t = 0; t < qn; ++t) d.q.set(t, v.q.get(q0 * 4 * 32 + t));
    for (int64_t t = 0; t < kn; ++t) {
      d.k.set(t, v.k.get(k0 * 2 * 32 + t));
      d.v.set(t, v.v.get(k0 * 2 * 32 + t));
    }
    ASSERT_TRUE(forward(fa_test::forward_args(d), o).ok());
    const std::vector<double> dense = d.out.to_double();
    std::vector<double> packed(static_cast<size_t>(qn));
    for (int64_t t = 0; t < qn; ++t) packed[size_t(t)] = v.out.get(q0 * 4 * 32 + t);
    EXPECT_LE(fa_test::compare(packed, dense).rel_l2, 1e-6) << "sequence " << b;
    for (int h = 0; h < 4; ++h)
      for (int i = 0; i < dp.seqlen_q; ++i) {
        const double alone = d.lse.get(int64_t(h) * dp.seqlen_q + i), packed_lse = v.lse.get(h * v.lse.shape()[1] + q0 + i);
        if (std::isinf(alone)) EXPECT_EQ(alone, packed_lse);  // causal Sq > Sk: rows without keys
        else EXPECT_NEAR(alone, packed_lse, 1e-5);
      }
    q0 += dp.seqlen_q;
    k0 += dp.seqlen_k;
  }
}

// A paged copy of dense K/V: (num_blocks, block_size, Hk, D) and a block table. Blocks are handed
// out in a shuffled order, plus spare blocks; `share_first` makes every sequence's first block the
// same id when the sequences' first block_size keys are equal (copied from sequence 0).
struct Paged {
  HostTensor k, v, table;
};
Paged make_paged(HostTensor& k_dense, HostTensor& v_dense, int block_size, std::mt19937_64& rng, bool share_first) {
  const int64_t B = k_dense.shape()[0], S = k_dense.shape()[1], H = k_dense.shape()[2], D = k_dense.shape()[3],
                Dv = v_dense.shape()[3];
  const int64_t per_seq = (S + block_size - 1) / block_size;
  const int64_t num_blocks = B * per_seq + 3;
  std::vector<int32_t> ids(static_cast<size_t>(num_blocks));
  for (size_t n = 0; n < ids.size(); ++n) ids[n] = int32_t(n);
  std::shuffle(ids.begin(), ids.end(), rng);
  Paged p;
  p.k = HostTensor({num_blocks, block_size, H, D}, k_dense.dtype());
  p.v = HostTensor({num_blocks, block_size, H, Dv}, v_dense.dtype());
  p.k.fill_normal(rng);  // garbage in unused slots
  p.v.fill_normal(rng);
  p.table = HostTensor({B, per_seq + 1}, FA_INT32);
  for (int64_t n = 0; n < p.table.numel(); ++n) p.table.set_int(n, 0x7eadbeef);  // unused columns
  for (int64_t b = 0; b < B; ++b)
    for (int64_t n = 0; n < per_seq; ++n) {
      const int32_t id = (share_first && n == 0) ? ids[0] : ids[size_t(b * per_seq + n)];
      p.table.set_int(b * (per_seq + 1) + n, id);
      for (int64_t r = 0; r < block_size && n * block_size + r < S; ++r) {
        const int64_t j = n * block_size + r;
        for (int64_t t = 0; t < H * D; ++t) p.k.set((int64_t(id) * block_size + r) * H * D + t, k_dense.get((b * S + j) * H * D + t));
        for (int64_t t = 0; t < H * Dv; ++t) p.v.set((int64_t(id) * block_size + r) * H * Dv + t, v_dense.get((b * S + j) * H * Dv + t));
      }
    }
  return p;
}

TEST(CpuFlashForward, PagedEqualsContiguous) {
  for (const int block_size : {1, 3, 16, 256}) {
    for (const bool share_first : {false, true}) {
      auto rng = fa_test::make_rng("paged" + std::to_string(block_size));
      Problem pr = problem(3, 23, 300, 4, 2, 32);
      Tensors t = fa_test::make_tensors(pr, rng);
      if (share_first)  // repeated block ids: every sequence starts with sequence 0's first block
        for (int64_t b = 1; b < 3; ++b)
          for (int64_t j = 0; j < std::min(block_size, 300); ++j)
            for (int64_t x = 0; x < 2 * 32; ++x) {
              t.k.set((b * 300 + j) * 64 + x, t.k.get(j * 64 + x));
              t.v.set((b * 300 + j) * 64 + x, t.v.get(j * 64 + x));
            }
      fa_options o = flash_options();
      o.causal = 1;
      const fa_test::Oracle oracle = fa_test::run_oracle(t, o, false);
      Paged paged = make_paged(t.k, t.v, block_size, rng, share_first);
      fa_forward_args a = fa_test::forward_args(t);
      a.k = paged.k.view();
      a.v = paged.v.view();
      a.block_table = paged.table.view();
      // seqused_k trims the paged capacity back to the 300 keys (and a little less for one check).
      HostTensor used({3}, FA_INT32);
      for (int b = 0; b < 3; ++b) used.set_int(b, 300);
      a.seqused_k = used.view();
      t.poison_outputs();
      const Status s = forward(a, o);
      ASSERT_TRUE(s.ok()) << s.to_string();
      fa_test::expect_forward_matches("paged block " + std::to_string(block_size), t, oracle, FA_FLOAT32);
    }
  }
}

// Varlen queries against a paged cache (continuous batching): cu_seqlens_k gives the lengths, the
// block table the pages. Flash and the reference read the same arguments.
TEST(CpuFlashForward, VarlenWithPagedKv) {
  auto rng = fa_test::make_rng("varlen paged");
  const int lengths_q[3] = {4, 1, 33}, lengths_k[3] = {50, 7, 90}, block = 16, hq = 4, hk = 2, d = 64;
  const int total_q = 38, max_blocks = 6, num_blocks = 20;
  HostTensor q({total_q, hq, d}, FA_FLOAT32), k({num_blocks, block, hk, d}, FA_FLOAT32), v({num_blocks, block, hk, d}, FA_FLOAT32);
  HostTensor out({total_q, hq, d}, FA_FLOAT32), lse({hq, total_q}, FA_FLOAT32), table({3, max_blocks}, FA_INT32);
  HostTensor cu_q({4}, FA_INT32), cu_k({4}, FA_INT32);
  q.fill_normal(rng);
  k.fill_normal(rng);
  v.fill_normal(rng);
  std::vector<int32_t> ids(num_blocks);
  for (int n = 0; n < num_blocks; ++n) ids[size_t(n)] = n;
  std::shuffle(ids.begin(), ids.end(), rng);
  for (int n = 0; n < 3 * max_blocks; ++n) table.set_int(n, ids[size_t(n)]);
  cu_q.set_int(0, 0);
  cu_k.set_int(0, 0);
  for (int b = 0; b < 3; ++b) {
    cu_q.set_int(b + 1, cu_q.get_int(b) + lengths_q[b]);
    cu_k.set_int(b + 1, cu_k.get_int(b) + lengths_k[b]);
  }
  fa_forward_args a{};
  a.q = q.view();
  a.k = k.view();
  a.v = v.view();
  a.out = out.view();
  a.lse = lse.view();
  a.cu_seqlens_q = cu_q.view();
  a.cu_seqlens_k = cu_k.view();
  a.max_seqlen_q = 33;
  a.max_seqlen_k = 90;
  a.block_table = table.view();
  fa_options o = flash_options();
  o.causal = 1;
  out.poison();
  ASSERT_TRUE(forward(a, o).ok());
  const HostTensor flash_out = out, flash_lse = lse;
  o.backend = FA_BACKEND_CPU_REFERENCE;
  out.poison();
  ASSERT_TRUE(forward(a, o).ok());
  EXPECT_TRUE(fa_test::within_tolerance("varlen paged out", FA_FLOAT32, fa_test::compare(flash_out, out), nullptr));
  const fa_test::ErrorStats e = fa_test::compare(flash_lse, lse);
  EXPECT_EQ(e.nan + e.mismatched_inf, 0) << e.to_string();
  EXPECT_LE(e.rel_l2, 1e-5) << e.to_string();
}

TEST(CpuFlashForward, SequsedK) {
  auto rng = fa_test::make_rng("seqused");
  Problem pr = problem(3, 20, 90, 2, 1, 32);
  Tensors t = fa_test::make_tensors(pr, rng);
  HostTensor used({3}, FA_INT32);
  const int lengths[3] = {90, 0, 41};
  for (int b = 0; b < 3; ++b) used.set_int(b, lengths[b]);
  fa_options o = flash_options();
  o.causal = 1;
  fa_forward_args a = fa_test::forward_args(t);
  a.seqused_k = used.view();
  ASSERT_TRUE(forward(a, o).ok());
  HostTensor flash_out = t.out, flash_lse = t.lse;
  o.backend = FA_BACKEND_CPU_REFERENCE;
  t.poison_outputs();
  ASSERT_TRUE(forward(a, o).ok());
  EXPECT_TRUE(fa_test::within_tolerance("seqused out", FA_FLOAT32, fa_test::compare(flash_out, t.out), nullptr));
  const fa_test::ErrorStats lse = fa_test::compare(flash_lse, t.lse);
  EXPECT_EQ(lse.mismatched_inf + lse.nan, 0) << lse.to_string();
  EXPECT_LE(lse.rel_l2, 1e-5) << lse.to_string();
}

// flashattn.h's visibility rule written out on its own (not through core/mask.hpp).
struct WindowMaskProbe {
  int sq, sk, left, right;
  bool any_visible(int i) const {
    for (int j = 0; j < sk; ++j) {
      const int aligned = i + sk - sq;
      if ((left < 0 || j >= aligned - left) && (right < 0 || j <= aligned + right)) return true;
    }
    return false;
  }
};

// Rows that see no key: out = 0 exactly, lse = -inf, never NaN.
TEST(CpuFlashForward, FullyMaskedRows) {
  auto rng = fa_test::make_rng("masked");
  // Causal with Sq > Sk: the first Sq - Sk rows see nothing. A window with a gap: nothing either.
  struct Setup { int sq, sk, left, right; bool causal; };
  for (const Setup su : {Setup{150, 40, -1, -1, true}, Setup{30, 30, 0, 0, false}, Setup{70, 10, 2, 0, false}}) {
    Problem pr = problem(1, su.sq, su.sk, 2, 2, 32);
    Tensors t = fa_test::make_tensors(pr, rng);
    fa_options o = flash_options();
    o.causal = su.causal;
    if (!su.causal) { o.window_left = su.left; o.window_right = su.right; }
    ASSERT_TRUE(forward(fa_test::forward_args(t), o).ok());
    int masked_rows = 0;
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < su.sq; ++i) {
        const WindowMaskProbe probe{su.sq, su.sk, su.causal ? -1 : su.left, su.causal ? 0 : su.right};
        const bool sees_nothing = !probe.any_visible(i);
        const double lse = t.lse.get(int64_t(h) * su.sq + i);
        if (sees_nothing) {
          ++masked_rows;
          EXPECT_EQ(lse, -kInf) << "row " << i;
          for (int e = 0; e < 32; ++e) EXPECT_EQ(t.out.get((int64_t(i) * 2 + h) * 32 + e), 0.0);
        } else {
          EXPECT_TRUE(std::isfinite(lse)) << "row " << i;
        }
      }
    if (su.causal) {
      EXPECT_EQ(masked_rows, 2 * (su.sq - su.sk));
    }
    EXPECT_EQ(t.out.count_nonfinite(), 0);
  }
}


// The keep mask is the shared Philox one, bit for bit: with V = identity (Dv = Sk) the output row is
// the dropped probability row itself, so every dropped key shows as an exact 0, and the pattern must
// equal the reference's. The keep rate must be 1 - p within 4 sigma.
TEST(CpuFlashForward, DropoutMaskBitExactAndKeepRate) {
  auto rng = fa_test::make_rng("dropout-mask");
  const int sq = 50, sk = 96, heads = 2, batch = 2;
  const float drop = 0.3f;
  Problem pr = problem(batch, sq, sk, heads, heads, 32, FA_FLOAT32, sk);
  Tensors t = fa_test::make_tensors(pr, rng);
  for (int b = 0; b < batch; ++b)
    for (int j = 0; j < sk; ++j)
      for (int h = 0; h < heads; ++h)
        for (int c = 0; c < sk; ++c) t.v.set(((int64_t(b) * sk + j) * heads + h) * sk + c, j == c ? 1.0 : 0.0);
  fa_options o = flash_options();
  o.dropout_p = drop;
  o.dropout_seed = 0xfeedfacecafebeefull;
  o.dropout_offset = 12345;
  ASSERT_TRUE(forward(fa_test::forward_args(t), o).ok());
  const HostTensor flash_out = t.out;
  o.backend = FA_BACKEND_CPU_REFERENCE;
  t.poison_outputs();
  ASSERT_TRUE(forward(fa_test::forward_args(t), o).ok());
  int64_t dropped = 0, mismatched = 0;
  const int64_t total = flash_out.numel();
  for (int64_t n = 0; n < total; ++n) {
    const bool flash_dropped = flash_out.get(n) == 0.0, reference_dropped = t.out.get(n) == 0.0;
    dropped += flash_dropped;
    mismatched += flash_dropped != reference_dropped;
  }
  EXPECT_EQ(mismatched, 0) << "keep bits differ from the reference's";
  const double sigma = std::sqrt(double(total) * drop * (1 - drop));
  EXPECT_NEAR(double(dropped), double(total) * drop, 4 * sigma) << "drop rate " << double(dropped) / double(total);
  EXPECT_TRUE(fa_test::within_tolerance("dropout identity out", FA_FLOAT32, fa_test::compare(flash_out, t.out), nullptr));
  // Another offset gives another mask.
  o.backend = FA_BACKEND_CPU_FLASH;
  o.dropout_offset = 12346;
  ASSERT_TRUE(forward(fa_test::forward_args(t), o).ok());
  int64_t differ = 0;
  for (int64_t n = 0; n < total; ++n) differ += (t.out.get(n) == 0.0) != (flash_out.get(n) == 0.0);
  EXPECT_GT(differ, total / 10);
}

// Each tile is computed by one thread in a fixed order: any thread count gives the same bits.
TEST(CpuFlashForward, ThreadCountDoesNotChangeBits) {
  auto rng = fa_test::make_rng("threads");
  Tensors t = fa_test::make_tensors(problem(2, 300, 257, 4, 2, 64), rng);
  fa_options o = flash_options(1);
  o.causal = 1;
  o.dropout_p = 0.1f;
  ASSERT_TRUE(forward(fa_test::forward_args(t), o).ok());
  const HostTensor out1 = t.out, lse1 = t.lse;
  for (const int threads : {2, 3, 7}) {
    o.num_threads = threads;
    t.poison_outputs();
    ASSERT_TRUE(forward(fa_test::forward_args(t), o).ok());
    EXPECT_EQ(std::memcmp(out1.data(), t.out.data(), size_t(out1.storage_bytes())), 0) << threads << " threads";
    EXPECT_EQ(std::memcmp(lse1.data(), t.lse.data(), size_t(lse1.storage_bytes())), 0) << threads << " threads";
  }
}

// Element (logical row-major index) of a strided fa_tensor view, as double.
double get(const fa_tensor& t, int64_t logical) {
  int64_t offset = 0;
  for (int d = t.ndim - 1; d >= 0; --d) {
    offset += (logical % t.shape[d]) * t.strides[d];
    logical /= t.shape[d];
  }
  return load_as_float(t.data, offset, t.dtype);
}
int64_t numel(const fa_tensor& t) {
  int64_t n = 1;
  for (int d = 0; d < t.ndim; ++d) n *= t.shape[d];
  return n;
}
std::vector<double> values(const fa_tensor& t) {
  std::vector<double> v(static_cast<size_t>(numel(t)));
  for (int64_t n = 0; n < numel(t); ++n) v[size_t(n)] = get(t, n);
  return v;
}

// q, k, v as slices of one packed (B, S, 3, H, D) qkv tensor; out and gradients padded per row.
TEST(CpuFlash, NonContiguousStrides) {
  for (const fa_dtype dtype : {FA_FLOAT32, FA_BFLOAT16}) {
    auto rng = fa_test::make_rng("strides");
    const int64_t B = 2, S = 45, H = 3, D = 40, pad = 8;
    HostTensor qkv({B, S, 3 * H * D}, dtype), dout({B, S, H, D}, dtype);
    qkv.fill_normal(rng);
    dout.fill_normal(rng);
    auto slice = [&](HostTensor& base, int64_t first, std::initializer_list<int64_t> strides) {
      fa_tensor t = base.view();
      t.ndim = 4;
      const int64_t shape[4] = {B, S, H, D};
      int d = 0;
      for (int64_t s : strides) {
        t.shape[d] = shape[d];
        t.strides[d] = s;
        ++d;
      }
      t.data = static_cast<char*>(base.data()) + first * (dtype == FA_FLOAT32 ? 4 : 2);
      return t;
    };
    HostTensor outputs[2][4];  // [flash, reference][out, dq, dk, dv], each padded per head row
    fa_tensor views[2][4];
    for (int which = 0; which < 2; ++which)
      for (int g = 0; g < 4; ++g) {
        outputs[which][g] = HostTensor({B, S, H, D + pad}, dtype);
        outputs[which][g].poison();
        views[which][g] = slice(outputs[which][g], 0, {S * H * (D + pad), H * (D + pad), D + pad, 1});
      }
    HostTensor lse[2] = {HostTensor({B, H, S}, FA_FLOAT32), HostTensor({B, H, S}, FA_FLOAT32)};
    const fa_tensor q = slice(qkv, 0, {S * 3 * H * D, 3 * H * D, D, 1});
    const fa_tensor k = slice(qkv, H * D, {S * 3 * H * D, 3 * H * D, D, 1});
    const fa_tensor v = slice(qkv, 2 * H * D, {S * 3 * H * D, 3 * H * D, D, 1});
    for (int which = 0; which < 2; ++which) {
      fa_options o = which == 0 ? flash_options() : fa_test::options_for(FA_BACKEND_CPU_REFERENCE);
      o.causal = 1;
      fa_forward_args f{};
      f.q = q;
      f.k = k;
      f.v = v;
      f.out = views[which][0];
      f.lse = lse[which].view();
      ASSERT_TRUE(forward(f, o).ok());
      fa_backward_args a{};
      a.q = q;
      a.k = k;
      a.v = v;
      a.out = views[which][0];
      a.lse = lse[which].view();
      a.dout = dout.view();
      a.dq = views[which][1];
      a.dk = views[which][2];
      a.dv = views[which][3];
      ASSERT_TRUE(backward(a, o).ok());
    }
    const char* names[4] = {"out", "dq", "dk", "dv"};
    for (int g = 0; g < 4; ++g) {
      const fa_test::ErrorStats e = fa_test::compare(values(views[0][g]), values(views[1][g]));
      if (dtype == FA_FLOAT32) {
        EXPECT_TRUE(fa_test::within_tolerance(names[g], dtype, e, nullptr));
      } else {  // both rounded to bf16 once at the end: a few bf16 ulps apart at most
        EXPECT_EQ(e.nan, 0) << names[g];
        EXPECT_LE(e.rel_l2, 2e-2) << names[g] << " " << e.to_string();
      }
      // the padding stays untouched (NaN)
      for (int64_t row = 0; row < B * S * H; ++row)
        for (int64_t c = D; c < D + pad; ++c) ASSERT_TRUE(std::isnan(outputs[0][g].get(row * (D + pad) + c))) << names[g];
    }
  }
}

// The flash path holds per-thread tiles only: its peak scratch does not grow with Sq x Sk.
TEST(CpuFlashForward, ScratchDoesNotGrowWithScores) {
  auto rng = fa_test::make_rng("scratch");
  int64_t peak[2] = {0, 0};
  const int lengths[2] = {1000, 4097};
  for (int n = 0; n < 2; ++n) {
    const int s = lengths[n];
    Tensors t = fa_test::make_tensors(problem(1, s, s, 2, 2, 64), rng);
    fa_stats stats{};
    stats.scratch_bytes_peak = -1;
    fa_options o = flash_options();
    o.stats = &stats;
    ASSERT_TRUE(forward(fa_test::forward_args(t), o).ok());
    EXPECT_EQ(t.out.count_nonfinite(), 0);
    EXPECT_EQ(stats.num_splits, 1);
    EXPECT_NE(std::string(stats.kernel).find("cpu_flash fwd"), std::string::npos) << stats.kernel;
    peak[n] = stats.scratch_bytes_peak;
    EXPECT_GT(peak[n], 0);
  }
  EXPECT_LT(peak[1], int64_t(4097) * 4097 * 4 / 16);
  // 4.1x the length may cost at most 4.1x the memory (linear); it costs nothing more here.
  EXPECT_LE(double(peak[1]), double(peak[0]) * 4.097 * 1.01);
  std::printf("[cpu_flash] forward scratch peak: %lld bytes at S=1000, %lld bytes at S=4097\n", (long long)peak[0],
              (long long)peak[1]);
}

// ---------------------------------------------------------------------------------------------
// Backward

TEST(CpuFlashBackward, SizesAndGqa) {
  const int sizes[][2] = {{1, 1}, {17, 17}, {127, 127}, {1, 127}, {127, 1}, {17, 300}, {300, 17}};
  for (const auto& s : sizes)
    for (const int group : {1, 2, 8}) expect_backward_like_oracle(problem(2, s[0], s[1], 8, 8 / group, 32), flash_options(), "bwd sizes");
}

TEST(CpuFlashBackward, HeadDims) {
  for (const int d : {32, 40, 64, 96, 128, 192, 256})
    expect_backward_like_oracle(problem(1, 45, 70, 2, 1, d), flash_options(), "bwd head dim " + std::to_string(d));
  expect_backward_like_oracle(problem(1, 33, 70, 2, 2, 64, FA_FLOAT32, 32), flash_options(), "bwd dv < d");
  expect_backward_like_oracle(problem(1, 33, 70, 2, 2, 32, FA_FLOAT32, 96), flash_options(), "bwd dv > d");
}

TEST(CpuFlashBackward, EveryOptionAndCombinations) {
  auto rng = fa_test::make_rng("bwd variants");
  const HostTensor slopes_1d = alibi_slopes(rng, 2, 4, false), slopes_2d = alibi_slopes(rng, 2, 4, true);
  const int shapes[][2] = {{37, 150}, {150, 37}};
  for (const Variant& v : all_variants(&slopes_1d, &slopes_2d))
    for (const auto& s : shapes) {
      fa_options o = flash_options();
      v.tweak(o);
      expect_backward_like_oracle(problem(2, s[0], s[1], 4, 2, 48), o, "bwd " + v.name);
    }
}

TEST(CpuFlashBackward, LongerAndPeaky) {
  Problem pr = problem(1, 1000, 1000, 2, 1, 64);
  pr.input_std = 3.0;
  fa_options o = flash_options();
  o.causal = 1;
  expect_backward_like_oracle(pr, o, "bwd 1000 peaky causal");
}

TEST(CpuFlashBackward, HalfPrecision) {
  auto rng = fa_test::make_rng("bwd half");
  const HostTensor slopes = alibi_slopes(rng, 2, 4, false);
  for (const fa_dtype dtype : {FA_FLOAT16, FA_BFLOAT16})
    for (const Variant& v : all_variants(&slopes, nullptr)) {
      fa_options o = flash_options();
      v.tweak(o);
      Problem pr = problem(2, 77, 130, 4, 2, 64, dtype);
      expect_backward_like_oracle(pr, o, "bwd " + v.name + " 16-bit");
    }
  Problem peaky = problem(1, 100, 100, 2, 2, 64, FA_BFLOAT16);
  peaky.input_std = 3.0;
  expect_backward_like_oracle(peaky, flash_options(), "bwd bf16 peaky");
}

TEST(CpuFlashBackward, Varlen) {
  Problem pr = problem(5, 0, 0, 4, 2, 32);
  pr.varlen_q = {5, 0, 130, 1, 64};
  pr.varlen_k = {7, 3, 200, 1, 0};
  for (const bool causal : {false, true}) {
    fa_options o = flash_options();
    o.causal = causal;
    o.dropout_p = 0.2f;
    expect_backward_like_oracle(pr, o, causal ? "bwd varlen causal dropout" : "bwd varlen dropout");
  }
}

// Deterministic: the same bits for every run at a thread count, and for every thread count that
// runs the same schedule (the two schedules group the tiles differently).
TEST(CpuFlashBackward, DeterministicBitwise) {
  auto rng = fa_test::make_rng("bwd determinism");
  Tensors t = fa_test::make_tensors(problem(2, 200, 333, 8, 2, 64), rng);
  fa_options o = flash_options(2);
  o.deterministic = 1;
  o.causal = 1;
  o.dropout_p = 0.15f;
  ASSERT_TRUE(forward(fa_test::forward_args(t), o).ok());
  std::vector<HostTensor> first[2];  // dq, dk, dv of the first thread count of each schedule
  int runs[2] = {0, 0};
  for (const int threads : {2, 1, 3, 5, 6}) {
    o.num_threads = threads;
    fa_stats stats{};
    o.stats = &stats;
    for (int run = 0; run < 2; ++run) {
      t.dq.poison();
      t.dk.poison();
      t.dv.poison();
      ASSERT_TRUE(backward(fa_test::backward_args(t), o).ok());
      const int schedule = std::string(stats.kernel).find("fused") != std::string::npos ? 0 : 1;
      ++runs[schedule];
      if (first[schedule].empty()) {
        first[schedule] = {t.dq, t.dk, t.dv};
        continue;
      }
      const HostTensor* got[3] = {&t.dq, &t.dk, &t.dv};
      const char* names[3] = {"dq", "dk", "dv"};
      for (int n = 0; n < 3; ++n)
        EXPECT_EQ(std::memcmp(first[schedule][n].data(), got[n]->data(), size_t(got[n]->storage_bytes())), 0)
            << names[n] << " differs: " << threads << " threads, run " << run << ", " << stats.kernel;
    }
  }
  // B x Hk = 4 work items: 1, 2 and 5 threads fuse, 3 and 6 run the three passes.
  EXPECT_EQ(runs[0], 6);
  EXPECT_EQ(runs[1], 4);
}

// A caller's workspace of fa_backward_workspace_size bytes: used (nothing allocated), same bits;
// one byte less is an error that names the workspace. Both schedules (B x Hk = 4: 2 threads fuse,
// 3 run the three passes).
TEST(CpuFlashBackward, Workspace) {
  for (const int threads : {2, 3}) {
    SCOPED_TRACE(std::to_string(threads) + " threads");
    auto rng = fa_test::make_rng("bwd workspace");
    Tensors t = fa_test::make_tensors(problem(1, 90, 150, 4, 4, 32), rng);
    fa_stats stats{};
    fa_options o = flash_options(threads);
    o.stats = &stats;
    ASSERT_TRUE(forward(fa_test::forward_args(t), o).ok());
    fa_backward_args a = fa_test::backward_args(t);
    ASSERT_TRUE(backward(a, o).ok());
    const int64_t allocated = stats.scratch_bytes_peak;
    EXPECT_NE(std::string(stats.kernel).find("cpu_flash bwd"), std::string::npos) << stats.kernel;
    EXPECT_NE(std::string(stats.kernel).find(threads == 2 ? " fused" : " three-pass"), std::string::npos) << stats.kernel;
    const HostTensor dq = t.dq, dk = t.dk, dv = t.dv;
    int64_t bytes = -1;
    ASSERT_TRUE(backward_workspace_size(a, o, &bytes).ok());
    EXPECT_GT(bytes, 0);
    EXPECT_GE(bytes, allocated - 64);
    HostTensor workspace({bytes + 3}, FA_UINT8);
    a.workspace = workspace.view();
    a.workspace.data = static_cast<char*>(workspace.data()) + 3;  // any start address works
    a.workspace.shape[0] = bytes;
    t.dq.poison();
    t.dk.poison();
    t.dv.poison();
    ASSERT_TRUE(backward(a, o).ok());
    EXPECT_EQ(stats.scratch_bytes_peak, 0);
    EXPECT_EQ(std::memcmp(dq.data(), t.dq.data(), size_t(dq.storage_bytes())), 0);
    EXPECT_EQ(std::memcmp(dk.data(), t.dk.data(), size_t(dk.storage_bytes())), 0);
    EXPECT_EQ(std::memcmp(dv.data(), t.dv.data(), size_t(dv.storage_bytes())), 0);
    a.workspace.shape[0] = bytes - 1;
    const Status s = backward(a, o);
    EXPECT_EQ(s.code(), FA_ERROR_INVALID_ARGUMENT);
    EXPECT_EQ(s.message().rfind("workspace:", 0), 0u) << s.message();
  }
}

// Rows that saw no key give zero dq; keys that no query sees get zero dk / dv. Both schedules (one
// (b, kv head) item: 1 thread fuses, 2 run the three passes).
TEST(CpuFlashBackward, FullyMaskedRowsAndKeys) {
  auto rng = fa_test::make_rng("bwd masked");
  // Sq > Sk causal: the first rows see nothing. A window (2, 0) with Sq < Sk: early keys unseen.
  for (const int threads : {1, 2}) {
    for (const int sq : {60, 10}) {
      const int sk = 25;
      Tensors t = fa_test::make_tensors(problem(1, sq, sk, 2, 1, 32), rng);
      fa_options o = flash_options(threads);
      o.causal = 1;
      o.window_left = 2;
      ASSERT_TRUE(forward(fa_test::forward_args(t), o).ok());
      ASSERT_TRUE(backward(fa_test::backward_args(t), o).ok());
      EXPECT_EQ(t.dq.count_nonfinite() + t.dk.count_nonfinite() + t.dv.count_nonfinite(), 0);
      const WindowMaskProbe probe{sq, sk, 2, 0};
      for (int i = 0; i < sq; ++i) {
        if (probe.any_visible(i)) continue;
        for (int h = 0; h < 2; ++h)
          for (int c = 0; c < 32; ++c) EXPECT_EQ(t.dq.get((int64_t(i) * 2 + h) * 32 + c), 0.0) << "row " << i;
      }
      for (int j = 0; j < sk; ++j) {
        bool seen = false;
        for (int i = 0; i < sq; ++i) seen |= (j >= i + sk - sq - 2 && j <= i + sk - sq);
        if (seen) continue;
        for (int c = 0; c < 32; ++c) {
          EXPECT_EQ(t.dk.get(int64_t(j) * 32 + c), 0.0) << "key " << j;
          EXPECT_EQ(t.dv.get(int64_t(j) * 32 + c), 0.0) << "key " << j;
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The textbook standard path: same semantics, scores materialised.

TEST(CpuStandard, MatchesOracle) {
  auto rng = fa_test::make_rng("standard");
  const HostTensor slopes_1d = alibi_slopes(rng, 2, 4, false), slopes_2d = alibi_slopes(rng, 2, 4, true);
  for (const Variant& v : all_variants(&slopes_1d, &slopes_2d)) {
    fa_options o = fa_test::options_for(FA_BACKEND_CPU_STANDARD);
    o.num_threads = 2;
    v.tweak(o);
    expect_forward_like_oracle(problem(2, 37, 150, 4, 2, 48), o, "standard " + v.name);
    expect_forward_like_oracle(problem(2, 150, 37, 4, 4, 48), o, "standard " + v.name);
  }
  fa_options o = fa_test::options_for(FA_BACKEND_CPU_STANDARD);
  for (const auto& s : {std::make_pair(1, 1), std::make_pair(17, 127), std::make_pair(127, 17), std::make_pair(400, 400)})
    expect_forward_like_oracle(problem(1, s.first, s.second, 2, 1, 64), o, "standard sizes");
  for (const fa_dtype dtype : {FA_FLOAT16, FA_BFLOAT16}) {
    o.causal = 1;
    Problem pr = problem(2, 77, 201, 4, 2, 96, dtype);
    pr.input_std = 3.0;
    expect_forward_like_oracle(pr, o, "standard 16-bit");
  }
}

// Its scratch is the score matrix: about Sq x Sk x 4 bytes.
TEST(CpuStandard, ScratchHoldsTheScores) {
  auto rng = fa_test::make_rng("standard scratch");
  const int s = 1000;
  Tensors t = fa_test::make_tensors(problem(1, s, s, 2, 2, 64), rng);
  fa_stats stats{};
  fa_options o = fa_test::options_for(FA_BACKEND_CPU_STANDARD);
  o.stats = &stats;
  ASSERT_TRUE(forward(fa_test::forward_args(t), o).ok());
  EXPECT_GE(stats.scratch_bytes_peak, int64_t(s) * s * 4);
  EXPECT_NE(std::string(stats.kernel).find("cpu_standard"), std::string::npos) << stats.kernel;
}

TEST(CpuStandard, RejectsVarlenAndBackward) {
  auto rng = fa_test::make_rng("standard rejects");
  Problem pr = problem(2, 0, 0, 2, 2, 32);
  pr.varlen_q = {3, 4};
  pr.varlen_k = {5, 6};
  Tensors t = fa_test::make_tensors(pr, rng);
  const fa_options o = fa_test::options_for(FA_BACKEND_CPU_STANDARD);
  EXPECT_EQ(forward(fa_test::forward_args(t), o).code(), FA_ERROR_UNSUPPORTED);
  EXPECT_EQ(backward(fa_test::backward_args(t), o).code(), FA_ERROR_UNSUPPORTED);
}

}  // namespace
}  // namespace flashattn
