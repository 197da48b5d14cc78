// The CUDA KV-cache (decode) path on the GPU, through the public API (fa_kvcache, backend = cuda), against the
// float64 oracle under the tolerance rule of DESIGN.md. Every run draws fresh inputs (FA_TEST_SEED reproduces
// one) and poisons out and lse with NaN before the call.
//
// The oracle of a call: the float64 reference kvcache gives the appended caches (which the GPU must
// reproduce bit for bit, rotary included); attention over the appended cache is then a varlen forward over
// [cache; new] with bottom-right alignment, judged on the float64 reference forward (q rotated in double),
// against the naive same-precision baseline (q rotated, rounded to the dtype, naive attention in the dtype).
// With rotary, the rotated q must be held in the 16-bit dtype by any 16-bit kernel: the difference that rounding
// alone makes (the float64 attention of the rounded q against the oracle: the input-rounding floor) is added to the
// bounds, as the naive baseline carries it too but its own roundings can cancel it (judge).
// FP8 caches: the oracle reads the appended codes dequantised (code * scale, float64 -> float32, one rounding far
// below every 16-bit tolerance); the naive baseline attends over the codes themselves (exact in the 16-bit
// dtype) with k_scale folded into the softmax scale and v_scale applied to its output, which is how any
// same-precision FP8 kernel computes: so the error budget is the 16-bit cache's.
// Without a GPU (CI) every test skips with a message.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "api/validate.hpp"
#include "core/dtype.hpp"
#include "cpu/reference/reference.hpp"
#include "cuda/decode/decode_plan.hpp"
#include "cuda/sm80/forward_split.hpp"
#include "kvcache_cases.hpp"
#include "testing.hpp"

#if defined(FLASHATTN_WITH_CUDA)
#include <cuda_runtime.h>
#endif

namespace {

using fa_test::HostTensor;
using flashattn::Status;

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

using fa_test::cache_index;
using fa_test::KvCase;
using fa_test::KvTensors;
using fa_test::make_kv;
using fa_test::poison_cache_rows;
using fa_test::present;
using fa_test::same_bytes;

fa_options kv_options(const KvCase& c, fa_backend backend) {
  fa_options o = fa_test::options_for(backend);
  o.causal = c.causal;
  o.window_left = c.window_left;
  o.window_right = c.window_right;
  o.softcap = c.softcap;
  o.softmax_scale = c.softmax_scale;
  return o;
}

// x' = rotary(x) at `position` in double (the reference's formula).
void rotate(const KvCase& c, const KvTensors& t, int position, double* x) {
  const int rd = c.rotary_dim > 0 ? c.rotary_dim : c.head_dim, half = rd / 2;
  for (int f = 0; f < half; ++f) {
    const double cs = t.cos.get(int64_t(position) * half + f), sn = t.sin.get(int64_t(position) * half + f);
    const int a = c.rotary == 2 ? 2 * f : f, b = c.rotary == 2 ? 2 * f + 1 : f + half;
    const double x0 = x[a], x1 = x[b];
    x[a] = x0 * cs - x1 * sn;
    x[b] = x0 * sn + x1 * cs;
  }
}

struct Expected {
  KvTensors after;                     // the reference kvcache's caches after the append
  std::vector<double> out64, lse64;    // float64 oracle; out in (B, Sq, Hq, D), lse in (B, Hq, Sq) order
  std::vector<double> naive_out;       // naive same-precision baseline, same order as out64
  std::vector<double> naive_lse;       // its lse, same order as lse64
  // Rotary: the input-rounding floor, the distance to the oracle of the float64 attention of q rotated and rounded
  // to the dtype (exact K and V): out's, and lse's largest. Zero without rotary (q is then exact in the dtype).
  bool has_floor = false;
  fa_test::ErrorStats out_floor;
  double lse_floor = 0.0;
};

// The oracle of a case from its pristine tensors (see the header comment).
Expected expected_for(const KvCase& c, const KvTensors& pristine) {
  Expected e;
  e.after = pristine;
  fa_options ro = kv_options(c, FA_BACKEND_CPU_REFERENCE);
  if (c.alibi) ro.alibi_slopes = e.after.slopes.view();
  const Status s = flashattn::kvcache(e.after.args(), ro);
  EXPECT_TRUE(s.ok()) << "reference kvcache: " << s.to_string();

  // The equivalent varlen forward: q (rotated in double) against each sequence's appended keys.
  const int d = c.head_dim, rows_q = c.batch * c.seqlen_q;
  std::vector<int> seqlen_k(size_t(c.batch));
  int total_k = 0, max_k = 0;
  for (int b = 0; b < c.batch; ++b) {
    seqlen_k[size_t(b)] = c.cached[size_t(b)] + c.seqlen_new - c.floor_of(b);  // keys: rows [leftpad, cached + new)
    total_k += seqlen_k[size_t(b)];
    max_k = std::max(max_k, seqlen_k[size_t(b)]);
  }
  HostTensor q_exact({rows_q, c.heads_q, d}, FA_FLOAT32), q_naive({rows_q, c.heads_q, d}, c.dtype);
  const bool per_token = c.causal || c.window_left >= 0 || c.window_right >= 0;
  std::vector<double> row(static_cast<size_t>(d));
  for (int b = 0; b < c.batch; ++b)
    for (int i = 0; i < c.seqlen_q; ++i)
      for (int h = 0; h < c.heads_q; ++h) {
        const int64_t base = ((int64_t(b) * c.seqlen_q + i) * c.heads_q + h) * d;
        for (int x = 0; x < d; ++x) row[size_t(x)] = pristine.q.get(base + x);
        if (c.rotary) rotate(c, pristine, per_token ? c.cached[size_t(b)] + i : c.cached[size_t(b)], row.data());
        for (int x = 0; x < d; ++x) {
          q_exact.set(base + x, row[size_t(x)]);
          q_naive.set(base + x, row[size_t(x)]);  // rounded to the dtype, as any 16-bit kernel must
        }
      }
  HostTensor k_exact({std::max(total_k, 1), c.heads_k, d}, FA_FLOAT32), v_exact = k_exact;
  HostTensor k_naive({std::max(total_k, 1), c.heads_k, d}, c.dtype), v_naive = k_naive;
  // FP8: the oracle's keys / values are the codes dequantised; the naive baseline's are the codes (see the header)
  const double k_scale = c.fp8 ? c.k_scale : 1.0, v_scale = c.fp8 ? c.v_scale : 1.0;
  HostTensor cu_q({c.batch + 1}, FA_INT32), cu_k({c.batch + 1}, FA_INT32);
  std::vector<int> first_key(size_t(c.batch) + 1, 0);  // sequence b's keys are varlen rows [first_key[b], first_key[b + 1])
  for (int b = 0; b < c.batch; ++b) first_key[size_t(b) + 1] = first_key[size_t(b)] + seqlen_k[size_t(b)];
  for (int b = 0; b <= c.batch; ++b) {
    cu_q.set_int(b, b * c.seqlen_q);
    cu_k.set_int(b, first_key[size_t(b)]);
  }
  fa_test::parallel_chunks(total_k, 256, [&](int64_t begin, int64_t end) {  // each varlen row written once
    for (int64_t r = begin; r < end; ++r) {
      const int b = int(std::upper_bound(first_key.begin(), first_key.end(), int(r)) - first_key.begin()) - 1;
      const int j = int(r - first_key[size_t(b)]);
      for (int hk = 0; hk < c.heads_k; ++hk)
        for (int x = 0; x < d; ++x) {
          const int64_t to = (r * c.heads_k + hk) * d + x;
          const int64_t from = cache_index(c, e.after, b, j + c.floor_of(b), hk, x);  // logical: get() applies the strides
          k_exact.set(to, e.after.k_cache.get(from) * k_scale);
          v_exact.set(to, e.after.v_cache.get(from) * v_scale);
          k_naive.set(to, e.after.k_cache.get(from));
          v_naive.set(to, e.after.v_cache.get(from));
        }
    }
  });
  auto forward_args = [&](HostTensor& q, HostTensor& k, HostTensor& v, HostTensor& out, HostTensor* lse) {
    fa_forward_args f{};
    f.q = q.view();
    f.k = k.view();
    f.v = v.view();
    f.out = out.view();
    if (lse) f.lse = lse->view();
    f.cu_seqlens_q = cu_q.view();
    f.cu_seqlens_k = cu_k.view();
    f.max_seqlen_q = c.seqlen_q;
    f.max_seqlen_k = max_k;
    return f;
  };
  HostTensor slopes = e.after.slopes;
  fa_options fo = kv_options(c, FA_BACKEND_CPU_REFERENCE);
  if (c.alibi) fo.alibi_slopes = slopes.view();
  HostTensor out_exact({rows_q, c.heads_q, d}, FA_FLOAT32), lse_exact({c.heads_q, rows_q}, FA_FLOAT32);
  const Status fs = flashattn::forward(forward_args(q_exact, k_exact, v_exact, out_exact, &lse_exact), fo);
  EXPECT_TRUE(fs.ok()) << "oracle: " << fs.to_string();
  e.out64 = out_exact.to_double();
  auto kvcache_lse_order = [&](const HostTensor& varlen_lse) {  // the forward's (Hq, rows) as the kvcache's (B, Hq, Sq)
    std::vector<double> lse(size_t(c.batch) * c.heads_q * c.seqlen_q);
    for (int b = 0; b < c.batch; ++b)
      for (int h = 0; h < c.heads_q; ++h)
        for (int i = 0; i < c.seqlen_q; ++i)
          lse[(size_t(b) * c.heads_q + h) * c.seqlen_q + i] = varlen_lse.get(int64_t(h) * rows_q + b * c.seqlen_q + i);
    return lse;
  };
  e.lse64 = kvcache_lse_order(lse_exact);
  if (c.rotary != 0) {  // the input-rounding floor (see Expected): q_naive's values, held in float32 (exact)
    HostTensor q_rounded({rows_q, c.heads_q, d}, FA_FLOAT32);
    for (int64_t n = 0; n < q_rounded.numel(); ++n) q_rounded.set(n, q_naive.get(n));
    HostTensor out_rounded({rows_q, c.heads_q, d}, FA_FLOAT32), lse_rounded({c.heads_q, rows_q}, FA_FLOAT32);
    const Status rs = flashattn::forward(forward_args(q_rounded, k_exact, v_exact, out_rounded, &lse_rounded), fo);
    EXPECT_TRUE(rs.ok()) << "oracle of the rounded q: " << rs.to_string();
    e.has_floor = true;
    e.out_floor = fa_test::compare(out_rounded.to_double(), e.out64);
    e.lse_floor = fa_test::compare(kvcache_lse_order(lse_rounded), e.lse64).max_abs;
  }
  HostTensor out_naive({rows_q, c.heads_q, d}, c.dtype), lse_naive({c.heads_q, rows_q}, FA_FLOAT32);
  fa_options naive_options = fo;
  if (c.fp8) {  // scores = scale * q . (code * k_scale): k_scale joins the softmax scale, in float as a kernel would
    const float scale = c.softmax_scale != 0.f ? c.softmax_scale : float(1.0 / std::sqrt(double(d)));
    naive_options.softmax_scale = scale * c.k_scale;
  }
  flashattn::AttentionParams p;
  const Status v =
      flashattn::api::make_forward_params(forward_args(q_naive, k_naive, v_naive, out_naive, &lse_naive), naive_options, &p);
  EXPECT_TRUE(v.ok()) << v.to_string();
  EXPECT_TRUE(flashattn::cpu::reference::forward_naive_same_precision(p).ok());
  e.naive_out = out_naive.to_double();
  e.naive_lse = kvcache_lse_order(lse_naive);
  // out = (P codes) * v_scale, delivered in the output dtype like every kernel's: the scaled value is rounded
  // to it once more (a one-key row's out is code x v_scale, which the 16-bit dtype cannot hold: without this
  // rounding the baseline's error there is ~0 and no 16-bit output could meet it; H200, 2026-11-30 11:22 UTC).
  for (double& x : e.naive_out) {
    x *= v_scale;
    if (c.fp8)
      x = c.dtype == FA_BFLOAT16 ? double(flashattn::to_float(flashattn::to_bf16(float(x))))
                                 : double(flashattn::to_float(flashattn::to_f16(float(x))));
  }
  return e;
}

#if defined(FLASHATTN_WITH_CUDA)
// Device copies of a case's host tensors (whole storage, strides and padding included).
class DeviceKv {
 public:
  explicit DeviceKv(KvTensors& t) : t_(t) {
    for (HostTensor* h : {&t.q, &t.k_cache, &t.v_cache, &t.block_table, &t.cache_seqlens, &t.k_new, &t.v_new, &t.cos, &t.sin,
                          &t.out, &t.lse, &t.slopes, &t.cache_batch_idx, &t.cache_leftpad})
      if (present(*h)) upload(h);
  }
  ~DeviceKv() {
    for (auto& [host, device] : buffers_) cudaFree(device);
  }
  DeviceKv(const DeviceKv&) = delete;
  DeviceKv& operator=(const DeviceKv&) = delete;
  void* device(const HostTensor& t) { return buffers_.at(&t); }
  fa_tensor view(HostTensor& t) { return t.view_on(device(t), FA_DEVICE_CUDA, 0); }
  fa_kvcache_args args() {
    fa_kvcache_args a = t_.args();
    a.q = view(t_.q);
    a.k_cache = view(t_.k_cache);
    a.v_cache = view(t_.v_cache);
    if (present(t_.block_table)) a.block_table = view(t_.block_table);
    if (present(t_.cache_batch_idx)) a.cache_batch_idx = view(t_.cache_batch_idx);
    if (present(t_.cache_leftpad)) a.cache_leftpad = view(t_.cache_leftpad);
    a.cache_seqlens = view(t_.cache_seqlens);
    if (present(t_.k_new)) {
      a.k_new = view(t_.k_new);
      a.v_new = view(t_.v_new);
    }
    if (present(t_.cos)) {
      a.rotary_cos = view(t_.cos);
      a.rotary_sin = view(t_.sin);
    }
    a.out = view(t_.out);
    a.lse = view(t_.lse);
    return a;
  }
  fa_options options(const KvCase& c) {
    fa_options o = kv_options(c, FA_BACKEND_CUDA);
    if (c.alibi) o.alibi_slopes = view(t_.slopes);
    return o;
  }
  void upload(HostTensor* t) {
    void*& device = buffers_[t];
    if (device == nullptr) {
      ASSERT_EQ(cudaMalloc(&device, size_t(std::max<int64_t>(t->storage_bytes(), 16))), cudaSuccess);
    }
    ASSERT_EQ(cudaMemcpy(device, t->data(), size_t(t->storage_bytes()), cudaMemcpyHostToDevice), cudaSuccess);
  }
  void download(HostTensor& t) {
    EXPECT_EQ(cudaMemcpy(t.data(), buffers_.at(&t), size_t(t.storage_bytes()), cudaMemcpyDeviceToHost), cudaSuccess);
  }
  void download_results() {
    for (HostTensor* h : {&t_.out, &t_.lse, &t_.k_cache, &t_.v_cache}) download(*h);
  }

 private:
  KvTensors& t_;
  std::map<const HostTensor*, void*> buffers_;
};

Status synchronize(Status s) {
  const cudaError_t sync = cudaDeviceSynchronize();
  if (sync != cudaSuccess) return Status(FA_ERROR_DEVICE, std::string("kernel failed: ") + cudaGetErrorString(sync));
  return s;
}

// Runs the case on the GPU into t (out, lse and both caches downloaded). with_lse false: the call has no lse (t.lse
// comes back as it was uploaded).
Status run_gpu(const KvCase& c, KvTensors& t, fa_stats* stats = nullptr, bool with_lse = true) {
  DeviceKv d(t);
  fa_kvcache_args a = d.args();
  if (!with_lse) a.lse = fa_tensor{};
  a.num_splits = c.num_splits;
  a.check_indices = c.check_indices;
  fa_options o = d.options(c);
  o.stats = stats;
  const Status s = synchronize(flashattn::kvcache(a, o));
  d.download_results();
  return s;
}

#else
Status run_gpu(const KvCase&, KvTensors&, fa_stats* = nullptr, bool = true) {
  return Status(FA_ERROR_NOT_COMPILED, "no CUDA in this build");
}
#endif

// The same call on a CPU backend (host tensors): checks this file's oracle machinery where no GPU exists.
Status run_host(fa_backend backend, const KvCase& c, KvTensors& t, fa_stats* stats = nullptr) {
  fa_kvcache_args a = t.args();
  a.num_splits = c.num_splits;
  fa_options o = kv_options(c, backend);
  if (c.alibi) o.alibi_slopes = t.slopes.view();
  o.stats = stats;
  return flashattn::kvcache(a, o);
}

// The verdict on a run's out / lse and appended caches: the caches bit for bit, out under the tolerance rule,
// lse with the same -inf rows, no NaN, and an absolute error (see lse_bound) that a relative one would misjudge:
// an error e in lse scales each probability of its row by exp(e) whatever lse's size, and a row's lse may be ~0.
::testing::AssertionResult judge(const std::string& label, const KvCase& c, const KvTensors& got, const Expected& e) {
  if (!same_bytes(got.k_cache, e.after.k_cache))
    return ::testing::AssertionFailure() << label << ": k_cache after the append differs from the reference";
  if (!same_bytes(got.v_cache, e.after.v_cache))
    return ::testing::AssertionFailure() << label << ": v_cache after the append differs from the reference";
  const fa_test::ErrorStats out = fa_test::compare(got.out.to_double(), e.out64);
  const fa_test::ErrorStats naive = fa_test::compare(e.naive_out, e.out64);
  // Rotary: the input-rounding floor (Expected::out_floor). The naive baseline's error holds it, plus its
  // rounded scores' and probabilities' errors, which can cancel it: f16 draws of random case 76's shape (std 4, rotary)
  // had the kernel's error up to 7x the naive one's (H100, 2026-12-07 07:02 UTC: 7 of 400 over 3x; none without
  // rotary), while its distance to the rounded q's attention stayed within 1.08-1.75x the naive error (08:11 UTC, 300
  // draws per variant: the rest is the floor). The kernel may carry the floor on top of 3x the baseline's error.
  const ::testing::AssertionResult out_ok =
      fa_test::within_tolerance(label + " out", c.dtype, out, &naive, 3.0, 1e-5, e.has_floor ? &e.out_floor : nullptr);
  if (!out_ok) return out_ok;
  const fa_test::ErrorStats lse = fa_test::compare(got.lse.to_double(), e.lse64);
  // The bound: 1e-3 of the rows' largest |lse| (at least 1), plus twice the naive baseline's error, plus the
  // input-rounding floor (rotary; as for out): a rotated q is rounded to the 16-bit dtype before its scores, as any
  // 16-bit kernel must, which moves a one-key row's lse (= its score) by up to ~2e-3 (H100, 2026-12-05: the random
  // case "bf16 Sq=1 Hq=16 D=80 rotary=2 cached=[1]" had max_abs 0.00186 against |lse| ~ 1, which the old rule of
  // 1e-3 relative L2 refused).
  double magnitude = 1.0;
  for (double x : e.lse64)
    if (std::isfinite(x)) magnitude = std::max(magnitude, std::abs(x));
  const fa_test::ErrorStats naive_lse = fa_test::compare(e.naive_lse, e.lse64);
  const double lse_bound = 1e-3 * magnitude + 2.0 * naive_lse.max_abs + e.lse_floor;
  if (lse.nan != 0 || lse.mismatched_inf != 0 || !(lse.max_abs <= lse_bound))
    return ::testing::AssertionFailure() << label << " lse (NaN, -inf rows or error above " << lse_bound
                                         << "): " << lse.to_string() << "; naive " << naive_lse.to_string();
  return ::testing::AssertionSuccess();
}

void expect_matches(const std::string& what, const KvCase& c, const KvTensors& got, const Expected& e, const std::string& kernel) {
  EXPECT_TRUE(judge(what + " [" + c.to_string() + "] " + kernel, c, got, e));
}

// The case's K/V at capacity as the forward route's rule counts it (decode_plan.hpp, route_cache_bytes), and the
// fewest cache rows per sequence (a multiple of 16) that reach `bytes`.
int64_t route_cache_bytes(const KvCase& c) {
  return int64_t(c.batch) * c.capacity * c.heads_k * 2 * c.head_dim * (c.fp8 ? 1 : 2);
}
[[maybe_unused]] int cache_capacity_for(KvCase c, int64_t bytes) {
  c.capacity = 1;
  const int64_t per_row = route_cache_bytes(c);
  const int64_t rows = (bytes + per_row - 1) / per_row;
  return int((rows + 15) / 16 * 16);
}

// A run of the inputs `pristine` (on the GPU unless told otherwise), oracle, comparison.
void check_tensors(const std::string& what, const KvCase& c, const KvTensors& pristine, fa_backend backend = FA_BACKEND_CUDA) {
  const Expected e = expected_for(c, pristine);
  KvTensors t = pristine;
  fa_stats stats{};
  const Status s = backend == FA_BACKEND_CUDA ? run_gpu(c, t, &stats) : run_host(backend, c, t, &stats);
  ASSERT_TRUE(s.ok()) << what << " [" << c.to_string() << "]: " << s.to_string();
  if (c.num_splits > 0) {  // (the forward route takes at most sm80::kMaxForwardSplits)
    namespace decode = flashattn::cuda::decode;
    const bool packs = c.heads_q > c.heads_k && !c.alibi;
    const int64_t bytes = route_cache_bytes(c);
    const int min_rows = !packs ? decode::kForwardRouteMinRows
                         : bytes >= decode::kLongCacheRouteMinBytes ? decode::kLongCacheRouteMinRows
                         : bytes >= decode::kL2CacheRouteMinBytes   ? decode::kL2CacheRouteMinRows
                                                                    : decode::kForwardRouteMinRows;
    const bool route = c.seqlen_q >= min_rows && !c.fp8 && c.rotary == 0 && c.leftpad.empty();
    EXPECT_EQ(stats.num_splits, route ? std::min(c.num_splits, flashattn::cuda::sm80::kMaxForwardSplits) : c.num_splits);
  }
  expect_matches(what, c, t, e, stats.kernel);
}

// Fresh inputs, a run (on the GPU unless told otherwise), oracle, comparison.
void check_case(const std::string& what, const KvCase& c, fa_backend backend = FA_BACKEND_CUDA) {
  auto rng = fa_test::make_rng(what + c.to_string());
  check_tensors(what, c, make_kv(c, rng), backend);
}

// NaN in K and V of sequence b's cache rows [j_begin, j_end): rows that no result may read.
// Inputs whose scores rise along the cache: q = 0.1 in every element, and key j of every K/V head gets
// 0.1 * 177 * j / capacity added to each element (its random part scaled by 1/4). q.k then grows by about
// 1.28 * 177 / sqrt(128) = 20 (natural-log units, after the softmax scale) from the first key to the last, so each
// later split's LSE is far above the earlier ones': the combine's running maximum (decode_aux.cu) must rescale
// what it summed of the earlier batches of splits, or the result is off by orders of magnitude.
KvTensors rising_scores_kv(const KvCase& c, std::mt19937_64& rng) {
  KvTensors t = make_kv(c, rng);
  for (int64_t n = 0; n < int64_t(c.batch) * c.seqlen_q * c.heads_q * c.head_dim; ++n) t.q.set(n, 0.1);
  for (int b = 0; b < c.batch; ++b)
    for (int j = 0; j < c.capacity; ++j)
      for (int hk = 0; hk < c.heads_k; ++hk)
        for (int x = 0; x < c.head_dim; ++x) {
          const int64_t at = ((int64_t(b) * c.capacity + j) * c.heads_k + hk) * c.head_dim + x;
          t.k_cache.set(at, 0.25 * t.k_cache.get(at) + 0.1 * 177.0 * j / c.capacity);
        }
  return t;
}

KvCase rising_scores_case() {
  KvCase c;  // contiguous, 8 query heads, 2 K/V heads, D = 128
  c.batch = 1;
  c.capacity = 4096;
  c.cached = {4096};
  return c;
}

// The oracle machinery of this file, checked where no GPU is needed: it accepts the CPU flash backend's
// results on the kinds of case the GPU tests use, and rejects a result with one row off, or a cache append
// off by one bit.
TEST(CudaKvcacheHarness, JudgesTheCpuFlashBackend) {
  KvCase rotary;
  rotary.rotary = 1;
  rotary.rotary_dim = 32;
  rotary.causal = true;
  rotary.seqlen_q = 3;
  rotary.seqlen_new = 3;
  rotary.block_size = 16;
  KvCase split = rotary;
  split.rotary = 2;
  split.rotary_dim = 0;
  split.num_splits = 3;
  split.dtype = FA_FLOAT16;
  split.block_size = 3;
  KvCase options;
  options.alibi = true;
  options.softcap = 3.f;
  options.window_left = 40;
  options.window_right = 1;
  options.seqlen_q = 2;
  options.seqlen_new = 2;
  options.cache_row_pad = 8;
  options.head_dim = 64;
  KvCase empty;
  empty.batch = 3;
  empty.cached = {0, 1, 0};
  KvCase fp8 = rotary;  // FP8 cache, rotary append, paged
  fp8.fp8 = true;
  KvCase fp8_options = options;  // FP8, softcap / ALiBi / window, a strided contiguous cache
  fp8_options.fp8 = true;
  fp8_options.cache_row_pad = 32;
  fp8_options.dtype = FA_FLOAT16;
  for (const KvCase& c : {rotary, split, options, empty, fp8, fp8_options}) check_case("harness", c, FA_BACKEND_CPU_FLASH);
  {  // the inputs and oracle of CudaKvcache.SplitMergeRescalesAcrossSplitBatches
    KvCase c = rising_scores_case();
    c.num_splits = 33;
    auto rng = fa_test::make_rng("rising scores");
    const KvTensors pristine = rising_scores_kv(c, rng);
    const Expected e = expected_for(c, pristine);
    EXPECT_GT(e.lse64[size_t(c.heads_q - 1)], 10.0);
    KvTensors t = pristine;
    ASSERT_TRUE(run_host(FA_BACKEND_CPU_FLASH, c, t).ok());
    EXPECT_TRUE(judge("cpu_flash, rising scores, 33 splits", c, t, e));
  }

  auto rng = fa_test::make_rng("harness negative");
  const KvTensors pristine = make_kv(rotary, rng);
  const Expected e = expected_for(rotary, pristine);
  KvTensors t = pristine;
  ASSERT_TRUE(run_host(FA_BACKEND_CPU_FLASH, rotary, t).ok());
  ASSERT_TRUE(judge("cpu_flash", rotary, t, e));
  KvTensors wrong_row = t;  // one output row taken from the neighbouring head (a head-mapping bug)
  for (int x = 0; x < rotary.head_dim; ++x) wrong_row.out.set(x, t.out.get(rotary.head_dim + x));
  EXPECT_FALSE(judge("one row from the wrong head", rotary, wrong_row, e));
  KvTensors wrong_lse = t;
  wrong_lse.lse.set(0, t.lse.get(0) + 0.5);
  EXPECT_FALSE(judge("lse off", rotary, wrong_lse, e));
  // The input-rounding floor forgives the rounding of the rotated q only: q and the new keys rotated one position
  // off (the tables shifted by a row; the caches then taken from the right run, so that out and lse are judged).
  ASSERT_TRUE(e.has_floor);
  KvTensors shifted = pristine;
  const int64_t table_cols = shifted.cos.numel() / shifted.cos.shape()[0];
  for (int64_t n = 0; n + table_cols < shifted.cos.numel(); ++n) {
    shifted.cos.set(n, pristine.cos.get(n + table_cols));
    shifted.sin.set(n, pristine.sin.get(n + table_cols));
  }
  ASSERT_TRUE(run_host(FA_BACKEND_CPU_FLASH, rotary, shifted).ok());
  shifted.k_cache = t.k_cache;
  shifted.v_cache = t.v_cache;
  EXPECT_FALSE(judge("q rotated one position off", rotary, shifted, e));
  KvTensors wrong_cache = t;  // an appended key one bit off
  const int64_t at = cache_index(rotary, t, 1, rotary.cached[1], 0, 5);
  const uint16_t bits = static_cast<const uint16_t*>(t.k_cache.data())[t.k_cache.offset_of(at)];
  static_cast<uint16_t*>(wrong_cache.k_cache.data())[wrong_cache.k_cache.offset_of(at)] = uint16_t(bits ^ 1u);
  EXPECT_FALSE(judge("appended key one bit off", rotary, wrong_cache, e));

  // FP8: an appended code one step off, and a result computed without v_scale, are caught.
  const KvTensors fp8_pristine = make_kv(fp8, rng);
  const Expected fp8_e = expected_for(fp8, fp8_pristine);
  KvTensors f = fp8_pristine;
  ASSERT_TRUE(run_host(FA_BACKEND_CPU_FLASH, fp8, f).ok());
  ASSERT_TRUE(judge("cpu_flash fp8", fp8, f, fp8_e));
  KvTensors wrong_code = f;
  const int64_t code_at = wrong_code.k_cache.offset_of(cache_index(fp8, f, 1, fp8.cached[1], 0, 5));
  static_cast<uint8_t*>(wrong_code.k_cache.data())[code_at] ^= 1u;
  EXPECT_FALSE(judge("appended fp8 code one step off", fp8, wrong_code, fp8_e));
  KvCase unscaled_case = fp8;
  unscaled_case.v_scale = 1.f;  // reads the same codes as if v_scale were 1: out off by the factor v_scale
  KvTensors unscaled = fp8_pristine;
  unscaled.v_scale = 1.f;
  ASSERT_TRUE(run_host(FA_BACKEND_CPU_FLASH, unscaled_case, unscaled).ok());
  unscaled.v_cache = f.v_cache;  // (its appended v codes differ: only out is judged wrong here)
  unscaled.k_cache = f.k_cache;
  EXPECT_FALSE(judge("fp8 out without v_scale", fp8, unscaled, fp8_e));
}

// The tolerance rule's input-rounding floor (testing.hpp, within_tolerance): it adds the floor's error to 3x the
// naive error, no more, in both norms.
TEST(CudaKvcacheHarness, InputRoundingFloorAddsItsErrorOnly) {
  fa_test::ErrorStats naive, floor, got;
  naive.max_abs = 1e-3, naive.rel_l2 = 1e-4;
  floor.max_abs = 4e-3, floor.rel_l2 = 5e-4;
  got.max_abs = 3e-3 + 4e-3, got.rel_l2 = 3e-4 + 5e-4;  // 3x naive + floor, both norms
  EXPECT_FALSE(fa_test::within_tolerance("without the floor", FA_FLOAT16, got, &naive, 3.0, 0.0));
  EXPECT_TRUE(fa_test::within_tolerance("with the floor", FA_FLOAT16, got, &naive, 3.0, 0.0, &floor));
  fa_test::ErrorStats over_abs = got, over_rel = got;
  over_abs.max_abs *= 1.01;
  over_rel.rel_l2 *= 1.01;
  EXPECT_FALSE(fa_test::within_tolerance("max_abs past it", FA_FLOAT16, over_abs, &naive, 3.0, 0.0, &floor));
  EXPECT_FALSE(fa_test::within_tolerance("rel_l2 past it", FA_FLOAT16, over_rel, &naive, 3.0, 0.0, &floor));
  fa_test::ErrorStats nan = got;
  nan.nan = 1;
  EXPECT_FALSE(fa_test::within_tolerance("NaN", FA_FLOAT16, nan, &naive, 3.0, 0.0, &floor));
}

// Contiguous and paged caches (block sizes 1, 3, 16, 256) at GQA 4, MQA 8 and MHA, with one appended token, then
// causal over a longer cache; then blocks that are not runs of rows (heads-major: the general block addressing,
// plain and checked tiles) of `heads_major_sizes`. Each case from make_case(heads_k) (which gives the dtypes).
void check_layouts_and_heads(KvCase (*make_case)(int heads_k), std::initializer_list<int> heads_major_sizes,
                             const std::string& tag) {
  for (const int block_size : {0, 1, 3, 16, 256})
    for (const int heads_k : {2, 1, 8}) {  // GQA 4, MQA 8, MHA
      KvCase c = make_case(heads_k);
      c.block_size = block_size;
      c.heads_k = heads_k;
      c.seqlen_new = 1;
      check_case(tag + "decode", c);
      c.causal = true;
      c.cached = {1000, 17};
      c.capacity = 1100;
      check_case(tag + "decode causal", c);
    }
  for (const int block_size : heads_major_sizes) {
    KvCase c = make_case(2);
    c.block_size = block_size;
    c.heads_major_blocks = true;
    c.seqlen_new = 1;
    c.cached = {1000, 17};
    c.capacity = 1100;
    check_case(tag + "decode heads-major blocks", c);
  }
}

TEST(CudaKvcache, DecodeContiguousAndPaged) {
  SKIP_WITHOUT_GPU();
  check_layouts_and_heads([](int) { return KvCase{}; }, {16, 64, 3}, "");
}

// Head dims `dims` for both q dtypes, each case from make_case(dtype) (which gives the cache's type).
void check_head_dims(KvCase (*make_case)(fa_dtype), std::initializer_list<int> dims, const std::string& tag) {
  for (const fa_dtype dtype : {FA_FLOAT16, FA_BFLOAT16})
    for (const int d : dims) {
      KvCase c = make_case(dtype);
      c.head_dim = d;
      c.cached = {1000, 127};
      c.capacity = 1030;
      c.seqlen_new = 2;
      c.seqlen_q = 2;
      c.causal = true;
      c.block_size = 16;
      check_case(tag + "head dims", c);
    }
}

// A random case among those the CUDA kvcache takes (the test policy's fresh inputs and odd sizes, over every
// option at once): 16-bit or FP8 caches of the compiled head dims, GQA groups of 1 to 8, contiguous (strided
// rows, left padding) or paged (block sizes 1 to 256, heads-major blocks, repeated blocks when nothing is
// appended), append, rotary of either layout, masks, softcap, ALiBi, a scale, split counts, a peaky softmax.
// `small` bounds the sizes for the CPU run of the harness.
KvCase random_case(std::mt19937_64& rng, bool small) {
  auto pick = [&](std::initializer_list<int> values) { return *(values.begin() + rng() % values.size()); };
  auto chance = [&](double p) { return std::uniform_real_distribution<double>(0, 1)(rng) < p; };
  KvCase c;
  c.dtype = chance(0.5) ? FA_BFLOAT16 : FA_FLOAT16;
  c.fp8 = chance(0.25);
  c.head_dim = c.fp8 ? pick({32, 48, 64, 80, 112, 128, 192, 256}) : pick({32, 64, 80, 96, 128, 192, 256});
  c.heads_k = pick({1, 1, 2, 4});
  c.heads_q = c.heads_k * (small ? pick({1, 2, 4}) : pick({1, 2, 4, 8}));
  c.batch = 1 + int(rng() % (small ? 3 : 6));
  c.seqlen_q = small ? pick({1, 1, 2, 5}) : pick({1, 1, 1, 2, 4, 7, 16, 33});
  c.seqlen_new = chance(0.5) ? 0 : (chance(0.7) ? c.seqlen_q : 1 + int(rng() % 3));
  c.capacity = c.seqlen_new + (small ? pick({1, 17, 100, 300}) : pick({1, 17, 100, 300, 1030, 4100}));
  c.cached.resize(size_t(c.batch));
  for (int& n : c.cached) n = int(rng() % uint64_t(c.capacity - c.seqlen_new + 1));
  if (chance(0.5)) {
    c.block_size = pick({1, 3, 16, 16, 32, 64, 256});
    c.heads_major_blocks = chance(0.2);
    c.repeat_blocks = c.seqlen_new == 0 && chance(0.2);  // (appends into a shared block would race)
  } else {
    if (chance(0.2)) c.cache_row_pad = c.fp8 ? 32 : 8;  // 16-byte rows
    if (chance(0.2)) {
      c.leftpad.resize(size_t(c.batch));
      for (int b = 0; b < c.batch; ++b) c.leftpad[size_t(b)] = int(rng() % uint64_t(c.cached[size_t(b)] + 1));
    }
  }
  if (chance(0.3)) {
    c.rotary = chance(0.5) ? 1 : 2;
    c.rotary_dim = chance(0.5) ? 0 : c.head_dim / 2 - (c.head_dim / 2) % 2;
  }
  c.causal = chance(0.5);
  if (chance(0.2)) c.window_left = int(rng() % 300);
  if (!c.causal && chance(0.1)) c.window_right = int(rng() % 5);
  if (chance(0.15)) c.softcap = 30.f;
  c.alibi = chance(0.15);
  if (chance(0.2)) c.softmax_scale = 0.05f;
  if (chance(0.3)) c.num_splits = pick({1, 2, 3, 8, 33});
  if (chance(0.1)) c.input_std = 4.0;
  return c;
}

TEST(CudaKvcache, RandomCases) {
  SKIP_WITHOUT_GPU();
  auto rng = fa_test::make_rng("random kvcache cases");
  for (int n = 0; n < 200 && !HasFailure(); ++n) check_case("random case " + std::to_string(n), random_case(rng, false));
}

// The generator above on the CPU flash backend, so that CI runs its cases through this file's oracle and judge
// (which a wrong case, not a wrong kernel, would fail).
TEST(CudaKvcacheHarness, RandomCasesOnTheCpuFlashBackend) {
  auto rng = fa_test::make_rng("random kvcache cases on the cpu");
  for (int n = 0; n < 40 && !HasFailure(); ++n)
    check_case("random case " + std::to_string(n), random_case(rng, true), FA_BACKEND_CPU_FLASH);
}

// The generator's cases as the CUDA backend gets them (every tensor in device memory, so no index entry is read
// on the host) pass the validation, whose rules for device lengths are stricter (the rotary table's rows): no GPU
// run should meet a case refused for its inputs.
TEST(CudaKvcacheHarness, RandomCasesPassTheValidationOfDeviceTensors) {
  auto rng = fa_test::make_rng("random kvcache cases as device tensors");
  for (int n = 0; n < 100 && !HasFailure(); ++n) {
    const KvCase c = random_case(rng, n % 2 == 0);
    KvTensors t = make_kv(c, rng);
    fa_kvcache_args a = t.args();
    for (fa_tensor* v : {&a.q, &a.k_cache, &a.v_cache, &a.block_table, &a.cache_batch_idx, &a.cache_leftpad, &a.cache_seqlens,
                         &a.k_new, &a.v_new, &a.rotary_cos, &a.rotary_sin, &a.out, &a.lse})
      v->device = FA_DEVICE_CUDA;
    fa_options o = kv_options(c, FA_BACKEND_CUDA);
    if (c.alibi) {
      o.alibi_slopes = t.slopes.view();
      o.alibi_slopes.device = FA_DEVICE_CUDA;
    }
    flashattn::KvcacheParams p;
    const Status s = flashattn::api::make_kvcache_params(a, o, &p);
    EXPECT_TRUE(s.ok()) << "random case " << n << " [" << c.to_string() << "]: " << s.to_string();
  }
}

TEST(CudaKvcache, HeadDimsAndDtypes) {
  SKIP_WITHOUT_GPU();
  check_head_dims([](fa_dtype dtype) { KvCase c; c.dtype = dtype; return c; }, {32, 64, 80, 96, 128, 192, 256}, "");
}

// The options and shapes every cache type runs: 12 cases from `base` (which gives the cache's type), one of them a
// contiguous cache whose rows are padded by `row_pad` elements (the rows must stay 16-byte aligned).
std::vector<KvCase> options_and_shapes(KvCase base, int row_pad) {
  base.seqlen_q = 7;
  base.seqlen_new = 7;
  base.block_size = 3;
  std::vector<KvCase> cases(12, base);
  cases[0].causal = true;
  cases[1].window_left = 20;
  cases[1].window_right = 0;
  cases[2].softcap = 2.f;
  cases[2].input_std = 4.0;
  cases[3].alibi = true;
  cases[3].causal = true;
  cases[4].heads_k = 8;  // MHA
  cases[4].input_std = 4.0;  // peaky
  cases[5].heads_q = 16;  // GQA 16 (one full m-block per query)
  cases[5].heads_k = 1;
  cases[5].seqlen_q = 1;
  cases[5].seqlen_new = 1;
  cases[6].seqlen_q = 70;  // chunked prefill: many m-blocks
  cases[6].seqlen_new = 70;
  cases[6].causal = true;
  cases[7].window_left = 5;  // a window smaller than the new chunk: rows see disjoint key ranges
  cases[7].window_right = 3;
  cases[7].block_size = 0;
  cases[8].softmax_scale = -0.2f;  // a negative scale flips the max
  cases[9].cached = {0, 4097};      // odd lengths, a long one that splits
  cases[9].capacity = 4200;
  cases[9].block_size = 16;
  cases[10].block_size = 0;  // a strided (row-padded) contiguous cache
  cases[10].cache_row_pad = row_pad;
  cases[11].seqlen_q = 5;  // speculative decoding: 5 new tokens, non-causal (all see all keys)
  cases[11].seqlen_new = 5;
  return cases;
}

TEST(CudaKvcache, OptionsAndShapes) {
  SKIP_WITHOUT_GPU();
  for (const KvCase& c : options_and_shapes(KvCase{}, 24)) check_case("options", c);  // 48-byte row pad
}

TEST(CudaKvcache, RotaryHalvesAndInterleaved) {
  SKIP_WITHOUT_GPU();
  for (const int rotary : {1, 2})
    for (const int rotary_dim : {0, 32})
      for (const bool causal : {false, true})
        for (const fa_dtype dtype : {FA_BFLOAT16, FA_FLOAT16}) {
          KvCase c;
          c.dtype = dtype;
          c.rotary = rotary;
          c.rotary_dim = rotary_dim;
          c.causal = causal;
          c.seqlen_q = 4;
          c.seqlen_new = 4;
          c.block_size = causal ? 16 : 0;
          check_case("rotary", c);
        }
  KvCase windowed;  // windows give per-token positions too
  windowed.rotary = 2;
  windowed.seqlen_q = 3;
  windowed.seqlen_new = 5;
  windowed.window_left = 50;
  windowed.window_right = 2;
  check_case("rotary window", windowed);
}

// The same keys as a contiguous cache and as paged caches of block sizes 16, 256, 3 and 1 give bit-identical
// results with `splits` splits (the same arithmetic in the same order), and the appended rows land in the right
// blocks. `base` gives the cache's type (16-bit or FP8); `tag` prefixes the seed.
void check_paged_equals_contiguous(const KvCase& base, int splits, const std::string& tag) {
  KvCase c = base;
  c.cached = {700, 1500};
  c.capacity = 1536;
  c.seqlen_new = 2;
  c.seqlen_q = 2;
  c.causal = true;
  c.rotary = 1;
  c.num_splits = splits;
  auto rng = fa_test::make_rng(tag + "paged=contiguous");
  const KvTensors source = make_kv(c, rng);
  KvTensors contiguous = source;
  ASSERT_TRUE(run_gpu(c, contiguous).ok());
  for (const int block_size : {16, 256, 3, 1}) {  // 1: a block id per key, 64 ids per K/V tile
    KvCase pc = c;
    pc.block_size = block_size;
    KvTensors paged = make_kv(pc, rng);  // its own shuffled block table; then the contiguous case's values
    paged.q = source.q;
    paged.k_new = source.k_new;
    paged.v_new = source.v_new;
    paged.cos = source.cos;
    paged.sin = source.sin;
    for (int b = 0; b < c.batch; ++b)
      for (int j = 0; j < c.capacity; ++j)
        for (int hk = 0; hk < c.heads_k; ++hk)
          for (int x = 0; x < c.head_dim; ++x) {
            paged.k_cache.set(cache_index(pc, paged, b, j, hk, x), source.k_cache.get(cache_index(c, source, b, j, hk, x)));
            paged.v_cache.set(cache_index(pc, paged, b, j, hk, x), source.v_cache.get(cache_index(c, source, b, j, hk, x)));
          }
    ASSERT_TRUE(run_gpu(pc, paged).ok());
    EXPECT_TRUE(same_bytes(paged.out, contiguous.out)) << tag << "block size " << block_size << ", " << splits << " splits: out";
    EXPECT_TRUE(same_bytes(paged.lse, contiguous.lse)) << tag << "block size " << block_size << ", " << splits << " splits: lse";
    for (int b = 0; b < c.batch; ++b)
      for (int j = c.cached[size_t(b)]; j < c.cached[size_t(b)] + c.seqlen_new; ++j)
        for (int x = 0; x < c.heads_k * c.head_dim; ++x)
          ASSERT_EQ(paged.k_cache.get(cache_index(pc, paged, b, j, x / c.head_dim, x % c.head_dim)),
                    contiguous.k_cache.get(cache_index(c, contiguous, b, j, x / c.head_dim, x % c.head_dim)))
              << tag << "block size " << block_size << " sequence " << b << " row " << j;
  }
}

TEST(CudaKvcache, PagedEqualsContiguousBitwise) {
  SKIP_WITHOUT_GPU();
  for (const int splits : {1, 3}) check_paged_equals_contiguous(KvCase{}, splits, "");
}

// Runs case `c` with an explicit split count on a copy of `pristine`: the case in *sc, the tensors in *t, the call's
// statistics in *stats, which must report that count.
void run_at_splits(const KvCase& c, int splits, const KvTensors& pristine, KvCase* sc, KvTensors* t, fa_stats* stats) {
  *sc = c;
  sc->num_splits = splits;
  *t = pristine;
  ASSERT_TRUE(run_gpu(*sc, *t, stats).ok()) << splits << " splits";
  EXPECT_EQ(stats->num_splits, splits);
}

// Every split count gives the oracle's attention within tolerance, and nearly the unsplit result. `base`
// gives the cache's type (16-bit or FP8); `tag` prefixes the seed and the labels.
void check_every_split_count(const KvCase& base, const std::string& tag) {
  for (const int block_size : {0, 16}) {
    KvCase c = base;
    c.batch = 1;
    c.capacity = 5000;
    c.cached = {4097};
    c.seqlen_new = 3;
    c.seqlen_q = 3;
    c.causal = true;
    c.block_size = block_size;
    auto rng = fa_test::make_rng(tag + "splits");
    const KvTensors pristine = make_kv(c, rng);
    const Expected e = expected_for(c, pristine);
    HostTensor out1;
    for (const int splits : {1, 2, 3, 4, 5, 8, 13, 33, 64, 200}) {
      KvCase sc;
      KvTensors t;
      fa_stats stats{};
      ASSERT_NO_FATAL_FAILURE(run_at_splits(c, splits, pristine, &sc, &t, &stats));
      expect_matches(tag + "splits " + std::to_string(splits), sc, t, e, stats.kernel);
      if (splits == 1) {
        out1 = t.out;
        continue;
      }
      // Only the fp32 summation order differs: the outputs agree to about one 16-bit rounding step.
      EXPECT_LE(fa_test::compare(t.out, out1).rel_l2, 8e-3) << splits << " splits vs 1";
    }
  }
}

// The combine kernel merges a row's splits over 1 to 32 lanes (combine_lanes, decode_work.hpp) and each lane its
// splits 16 at a time, with the last keys dominating (the largest LSE in the last split): 16 splits (one lane),
// 17 to 64 (2 to 4 lanes, merged by shuffles), and 544 splits of a 68k cache (32 lanes of 17: a second batch of
// loads in a lane, whose larger LSE rescales the first). 16 splits of 4 tiles take the combine kernel, not a
// cluster (decode_plan.hpp).
TEST(CudaKvcache, SplitMergeRescalesAcrossSplitBatches) {
  SKIP_WITHOUT_GPU();
  for (const int capacity : {4096, 69632}) {
    KvCase c = rising_scores_case();
    c.capacity = capacity;
    c.cached = {capacity};
    auto rng = fa_test::make_rng("rising scores " + std::to_string(capacity));
    const KvTensors pristine = rising_scores_kv(c, rng);
    const Expected e = expected_for(c, pristine);
    ASSERT_GT(e.lse64[size_t(c.heads_q - 1)], 10.0) << "the inputs should make the last keys dominate";
    const std::vector<int> counts = capacity == 4096 ? std::vector<int>{16, 17, 33, 64} : std::vector<int>{544};
    for (const int splits : counts) {
      KvCase sc;
      KvTensors t;
      fa_stats stats{};
      ASSERT_NO_FATAL_FAILURE(run_at_splits(c, splits, pristine, &sc, &t, &stats));
      expect_matches("rising scores, " + std::to_string(capacity) + " keys, " + std::to_string(splits) + " splits", sc, t, e,
                     stats.kernel);
    }
  }
}

TEST(CudaKvcache, EverySplitCountAgrees) {
  SKIP_WITHOUT_GPU();
  check_every_split_count(KvCase{}, "");  // 8 query heads, 2 K/V heads (KvCase's defaults)
}

// lse is optional (flashattn.h): without it every path (one split, the combine kernel, the cluster merge; the
// plan's split counts and forced ones; contiguous and paged) writes the same out and caches, bit for bit, and
// nothing where an lse would be.
TEST(CudaKvcache, WithoutLseTheSameOut) {
  SKIP_WITHOUT_GPU();
  for (const int block_size : {0, 16})
    for (const int cached : {1000, 4097})
      for (const int splits : {0, 1, 3, 8, 16}) {
        KvCase c;
        c.batch = 1;
        c.capacity = 5000;
        c.cached = {cached};
        c.seqlen_new = 1;
        c.block_size = block_size;
        c.num_splits = splits;
        const std::string what = c.to_string();
        auto rng = fa_test::make_rng("without lse " + what);
        const KvTensors pristine = make_kv(c, rng);
        KvTensors with = pristine, without = pristine;
        fa_stats with_stats{}, without_stats{};
        ASSERT_TRUE(run_gpu(c, with, &with_stats).ok()) << what;
        ASSERT_TRUE(run_gpu(c, without, &without_stats, /*with_lse=*/false).ok()) << what;
        EXPECT_EQ(with_stats.num_splits, without_stats.num_splits) << what;
        EXPECT_EQ(std::string(with_stats.kernel), std::string(without_stats.kernel)) << what;
        EXPECT_EQ(with.lse.count_nonfinite(), 0) << what;
        EXPECT_TRUE(same_bytes(without.out, with.out)) << what << ": out without lse";
        EXPECT_TRUE(same_bytes(without.k_cache, with.k_cache) && same_bytes(without.v_cache, with.v_cache)) << what;
        EXPECT_TRUE(same_bytes(without.lse, pristine.lse)) << what << ": the lse tensor was not passed, yet it changed";
      }
}

// Sequences of length 0 (nothing cached, nothing appended: out = 0, lse = -inf) and 1.
TEST(CudaKvcache, EmptyAndSingleKeySequences) {
  SKIP_WITHOUT_GPU();
  for (const int splits : {0, 1, 4}) {
    KvCase c;
    c.batch = 3;
    c.cached = {0, 1, 0};
    c.num_splits = splits;
    check_case("lengths 0 and 1", c);
    auto rng = fa_test::make_rng("empty");
    KvTensors t = make_kv(c, rng);
    ASSERT_TRUE(run_gpu(c, t).ok());
    for (const int b : {0, 2})
      for (int h = 0; h < c.heads_q; ++h) {
        EXPECT_EQ(t.lse.get(int64_t(b) * c.heads_q + h), kNegInf);
        for (int x = 0; x < c.head_dim; ++x) ASSERT_EQ(t.out.get((int64_t(b) * c.heads_q + h) * c.head_dim + x), 0.0);
      }
    c.seqlen_new = 1;  // the append alone gives each sequence 1 or 2 keys
    c.block_size = 1;
    check_case("appended to empty", c);
  }
}

// A case of one query per sequence with these lengths (the batch is their count), and its fresh inputs (rng from
// `label` and the case) with NaN in K and V of every cache row past a sequence's keys: rows that no result may read.
KvCase lengths_case(int block_size, int capacity, std::vector<int> cached, int seqlen_new, int splits) {
  KvCase c;
  c.block_size = block_size;
  c.capacity = capacity;
  c.cached = std::move(cached);
  c.batch = int(c.cached.size());
  c.seqlen_new = seqlen_new;
  c.num_splits = splits;
  return c;
}
KvTensors kv_nan_past_keys(const KvCase& c, const std::string& label) {
  auto rng = fa_test::make_rng(label + c.to_string());
  KvTensors t = make_kv(c, rng);
  for (int b = 0; b < c.batch; ++b) poison_cache_rows(c, t, b, c.cached[size_t(b)] + c.seqlen_new, c.capacity);
  return t;
}

// The early tiles (decode_kernel.cuh: split 0 of a contiguous cache copies Q and its first two 64-key tiles before
// it reads cache_seqlens) at the lengths around them: kept from two whole tiles (128 keys) on, drained below,
// with and without an append, one split, two, and the heuristic's. Every cache row past a sequence's keys holds
// NaN in K and V: a copied row that reached the result would show.
TEST(CudaKvcache, EarlyTilesAtTheirLengthBoundaries) {
  SKIP_WITHOUT_GPU();
  for (const int seqlen_new : {0, 1})
    for (const int splits : {1, 2, 0}) {
      const KvCase c = lengths_case(0, 300, {0, 1, 63, 64, 126, 127, 128, 129, 200, 300 - seqlen_new}, seqlen_new, splits);
      check_tensors("early tiles", c, kv_nan_past_keys(c, "early tiles"));
    }
}

// Speculative tiles (decode_kernel.cuh, DecodeArgs::speculative_tiles): a CTA guesses its length (and paged, its
// first block ids) before its wait and keeps the tiles it copied early only if the real values agree. Each mode, off,
// on, a wrong length (2) and wrong ids (3), against the oracle and bit for bit against the mode off (the same
// arithmetic: only when the copies are issued differs). Lengths around tile and split boundaries, with and without an
// append, 1, 3 and the heuristic's splits, contiguous and paged (block sizes 16, 32 and 64; 3: no speculation), every
// cache row past a sequence's keys NaN: a kept copy of the wrong rows would show.
TEST(CudaKvcache, SpeculativeTilesRightAndWrongGuesses) {
  SKIP_WITHOUT_GPU();
  struct Restore {
    ~Restore() { flashattn::cuda::decode::set_speculation_for_tests(-1); }
  } restore;
  for (const int block_size : {0, 16, 32, 64, 3})
    for (const int seqlen_new : {0, 1})
      for (const int splits : {1, 3, 0}) {
        const KvCase c =
            lengths_case(block_size, 700, {0, 1, 127, 128, 129, 255, 256, 400, 511, 640, 700 - seqlen_new}, seqlen_new, splits);
        const KvTensors pristine = kv_nan_past_keys(c, "speculative tiles");
        const Expected e = expected_for(c, pristine);
        KvTensors off = pristine;
        flashattn::cuda::decode::set_speculation_for_tests(0);
        ASSERT_TRUE(run_gpu(c, off).ok()) << c.to_string();
        expect_matches("speculation off", c, off, e, "");
        for (const int mode : {1, 2, 3}) {
          flashattn::cuda::decode::set_speculation_for_tests(mode);
          KvTensors t = pristine;
          ASSERT_TRUE(run_gpu(c, t).ok()) << c.to_string();
          const std::string what = "speculation mode " + std::to_string(mode);
          expect_matches(what, c, t, e, "");
          EXPECT_TRUE(same_bytes(t.out, off.out)) << what << " [" << c.to_string() << "]: out differs from the mode off";
          EXPECT_TRUE(same_bytes(t.lse, off.lse)) << what << " [" << c.to_string() << "]: lse differs from the mode off";
        }
      }
}

// A paged cache's block-table entries past a sequence's blocks are never used as block ids: rows of 1024 and 1025
// entries (block size 16; the kernel prefetches rows of up to 1024 into L2), several splits, lengths that leave most
// of the row unused. Every table entry past a sequence's blocks is an invalid id and every cache row past its keys
// NaN: an entry or a row that was used would show.
TEST(CudaKvcache, PagedTableEntriesPastTheLengthAreNeverUsed) {
  SKIP_WITHOUT_GPU();
  for (const int capacity : {16384, 16400})
    for (const int splits : {0, 3, 16}) {
      KvCase c;
      c.block_size = 16;
      c.capacity = capacity;
      c.cached = {capacity - 1, 40, 1000, 0};
      c.batch = int(c.cached.size());
      c.seqlen_new = 1;
      c.num_splits = splits;
      auto rng = fa_test::make_rng("table row" + c.to_string());
      KvTensors pristine = make_kv(c, rng);
      const int per_seq = int(pristine.block_table.shape()[1]);
      const int64_t blocks = pristine.k_cache.shape()[0];
      for (int b = 0; b < c.batch; ++b) {
        const int keys = c.cached[size_t(b)] + c.seqlen_new, used_blocks = (keys + c.block_size - 1) / c.block_size;
        poison_cache_rows(c, pristine, b, keys, used_blocks * c.block_size);  // the last block's rest
        for (int n = used_blocks; n < per_seq; ++n)
          pristine.block_table.set_int(int64_t(b) * per_seq + n, n % 2 == 0 ? int32_t(blocks + n) : -1 - n);
      }
      check_tensors("table row", c, pristine);
    }
}

// Short contiguous caches at many waves run in the many_waves tile (decode_plan.hpp's wants_many_waves_tile: at least
// 7 CTAs per SM unsplit, at most 2k keys): the kernel's name says which ran, the oracle judges it; lengths from 0 to
// the capacity, with an append, both dtypes.
TEST(CudaKvcache, ManyWavesTile) {
  SKIP_WITHOUT_GPU();
#if defined(FLASHATTN_WITH_CUDA)
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  for (const fa_dtype dtype : {FA_BFLOAT16, FA_FLOAT16}) {
    KvCase c;  // 8 query heads, 2 K/V heads, D = 128: one m-block per (sequence, K/V head)
    c.dtype = dtype;
    c.batch = (7 * sms + 1) / 2 + 3;
    c.capacity = 256;
    c.seqlen_new = 1;
    std::mt19937_64 lengths(11);
    c.cached.resize(size_t(c.batch));
    for (int b = 0; b < c.batch; ++b) c.cached[size_t(b)] = int(lengths() % uint64_t(c.capacity));  // 0 .. 255
    auto rng = fa_test::make_rng(std::string("many waves ") + (dtype == FA_BFLOAT16 ? "bf16" : "f16"));
    const KvTensors pristine = make_kv(c, rng);
    const Expected e = expected_for(c, pristine);
    KvTensors t = pristine;
    fa_stats stats{};
    ASSERT_TRUE(run_gpu(c, t, &stats).ok());
    EXPECT_NE(std::string(stats.kernel).find("mw"), std::string::npos) << stats.kernel << ": not the many_waves tile";
    EXPECT_TRUE(judge("many waves", c, t, e)) << stats.kernel;
    KvCase fewer = c;  // one sequence fewer than 7 CTAs per SM: the general tile
    fewer.batch = (7 * sms + 1) / 2 - 1;
    fewer.cached.resize(size_t(fewer.batch));
    KvTensors f = make_kv(fewer, rng);
    ASSERT_TRUE(run_gpu(fewer, f, &stats).ok());
    EXPECT_EQ(std::string(stats.kernel).find("mw"), std::string::npos) << stats.kernel;
  }
#endif
}

// One call over `cached` lengths (one new token each) of 8 K/V heads (MHA: one m-block per sequence and head), every
// cache row past a sequence's keys NaN, judged by the oracle; whether it ran in the long_contiguous tile must be
// `long_tile`. The case, its inputs, the oracle's result and the call's statistics come back in *run.
struct TileRun {
  KvCase c;
  KvTensors pristine;
  Expected e;
  fa_stats stats{};
};
// (Its callers run on a GPU only: unused, but still compiled, in a build without CUDA.)
[[maybe_unused]] void check_tile_run(const std::string& label, fa_dtype dtype, int capacity, const std::vector<int>& cached,
                                     int splits, bool long_tile, TileRun* run) {
  run->c = lengths_case(0, capacity, cached, 1, splits);
  run->c.heads_q = run->c.heads_k = 8;
  run->c.dtype = dtype;
  run->pristine = kv_nan_past_keys(run->c, label + (dtype == FA_BFLOAT16 ? " bf16" : " f16"));
  run->e = expected_for(run->c, run->pristine);
  KvTensors t = run->pristine;
  ASSERT_TRUE(run_gpu(run->c, t, &run->stats).ok());
  EXPECT_EQ(std::string(run->stats.kernel).find("lc") != std::string::npos, long_tile) << run->stats.kernel;
  EXPECT_TRUE(judge(label, run->c, t, run->e)) << run->stats.kernel;
}

// Long contiguous caches run in the long_contiguous tile on sm_90+ (decode_plan.hpp's wants_long_contiguous_tile: at the
// general tile's split count, >= 2048 keys of the capacity per split and 1.5 to 4 CTAs per SM): the kernel's name says
// which ran, the oracle judges it; one split (bf16) and two (fp16), lengths from 0 to the capacity (partial 128-key
// tiles), with an append, NaN in every cache row past a sequence's keys. On sm_80 the general tile runs the same cases.
// (About 200 CTAs of >= 2048 keys: the test's inputs are large; ~30 s of host time on the GPU machine before the test
// support's fills and copies ran on every core.)
TEST(CudaKvcache, LongContiguousTile) {
  SKIP_WITHOUT_GPU();
#if defined(FLASHATTN_WITH_CUDA)
  int major = 0, sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  std::vector<int> cached(size_t((3 * sms / 2 + 7) / 8 + 1));  // 8 K/V heads: >= 1.5 CTAs per SM, <= 4 with 2 splits
  for (const auto& [dtype, splits] : {std::pair{FA_BFLOAT16, 1}, std::pair{FA_FLOAT16, 2}}) {
    const int capacity = 2050 * splits;  // >= 2048 keys per split
    const int lengths[] = {0, 1, 127, 128, 129, 2049, capacity - 100, capacity - 1};
    for (size_t b = 0; b < cached.size(); ++b) cached[b] = lengths[b % 8];
    TileRun run;
    ASSERT_NO_FATAL_FAILURE(check_tile_run("long tile", dtype, capacity, cached, splits, major >= 9, &run));
    KvCase short_splits = run.c;  // under 2048 keys of the capacity per split: the general tile
    short_splits.num_splits = 4;
    KvTensors g = run.pristine;
    fa_stats stats{};
    ASSERT_TRUE(run_gpu(short_splits, g, &stats).ok());
    EXPECT_EQ(std::string(stats.kernel).find("lc"), std::string::npos) << stats.kernel;
    EXPECT_TRUE(judge("general tile, 4 splits", short_splits, g, run.e)) << stats.kernel;
  }
#endif
}

// The lower part of the one wave, contiguous (decode_plan.hpp's wants_one_wave_long_tile): where the unsplit grid fills
// 0.7-0.75 of the SMs and the capacity has >= 8k keys, the heuristic runs 4 splits on the long_contiguous tile on
// sm_90+ (one split on the general tile on sm_80); the kernel's name and the split count say which ran, the oracle
// judges it. Both dtypes, lengths from 0 to the capacity with an append.
TEST(CudaKvcache, OneWaveLongTileSplits) {
  SKIP_WITHOUT_GPU();
#if defined(FLASHATTN_WITH_CUDA)
  int major = 0, sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  const int batch = (7 * sms + 79) / 80;  // the fewest sequences of 8 CTAs that fill >= 0.7 of the SMs (132: 12)
  ASSERT_LE(8 * batch, 3 * sms / 4) << "no batch of 8 CTAs per sequence falls in 0.7-0.75 of " << sms << " SMs";
  const int capacity = 8192;
  const int lengths[] = {0, 1, 2047, 2048, 4095, 5000, capacity - 64, capacity - 1};
  std::vector<int> cached(static_cast<size_t>(batch));
  for (int b = 0; b < batch; ++b) cached[size_t(b)] = lengths[b % 8];
  for (const fa_dtype dtype : {FA_BFLOAT16, FA_FLOAT16}) {
    TileRun run;
    ASSERT_NO_FATAL_FAILURE(check_tile_run("one wave", dtype, capacity, cached, 0, major >= 9, &run));
    EXPECT_EQ(run.stats.num_splits, major >= 9 ? 4 : 1) << run.stats.kernel;
  }
#endif
}

// Read-only: a block table with repeated and out-of-order blocks (several sequences share blocks).
TEST(CudaKvcache, RepeatedAndOutOfOrderBlocks) {
  SKIP_WITHOUT_GPU();
  for (const int block_size : {16, 3, 64}) {
    KvCase c;
    c.batch = 4;
    c.cached = {400, 1, 257, 333};
    c.block_size = block_size;
    c.repeat_blocks = true;
    c.num_splits = block_size == 3 ? 5 : 0;
    check_case("repeated blocks", c);
  }
}

// ---- FP8 (float8 e4m3) caches: the same kernels' FP8 instantiations (D buckets 64, 128, 256) ----

KvCase fp8_case(fa_dtype dtype = FA_BFLOAT16) {
  KvCase c;
  c.fp8 = true;
  c.dtype = dtype;
  return c;
}

TEST(CudaKvcacheFp8, DecodeContiguousAndPaged) {
  SKIP_WITHOUT_GPU();
  check_layouts_and_heads([](int heads_k) { return fp8_case(heads_k == 1 ? FA_FLOAT16 : FA_BFLOAT16); }, {16}, "fp8 ");
}

// Every D % 16 == 0 up to 256 runs in a compiled FP8 bucket (64, 128, 256), both q dtypes.
TEST(CudaKvcacheFp8, HeadDimsAndDtypes) {
  SKIP_WITHOUT_GPU();
  check_head_dims([](fa_dtype dtype) { return fp8_case(dtype); }, {32, 48, 64, 80, 112, 128, 192, 256}, "fp8 ");
}

TEST(CudaKvcacheFp8, OptionsAndShapes) {
  SKIP_WITHOUT_GPU();
  std::vector<KvCase> cases = options_and_shapes(fp8_case(), 32);  // 32 bytes of padding per row
  cases[11].dtype = FA_FLOAT16;  // q in fp16 over the FP8 cache
  for (const KvCase& c : cases) check_case("fp8 options", c);
}

TEST(CudaKvcacheFp8, RotaryHalvesAndInterleaved) {
  SKIP_WITHOUT_GPU();
  for (const int rotary : {1, 2})
    for (const int rotary_dim : {0, 32})
      for (const bool causal : {false, true})
        for (const fa_dtype dtype : {FA_BFLOAT16, FA_FLOAT16}) {
          KvCase c = fp8_case(dtype);
          c.rotary = rotary;
          c.rotary_dim = rotary_dim;
          c.causal = causal;
          c.seqlen_q = 4;
          c.seqlen_new = 4;
          c.block_size = causal ? 16 : 0;
          check_case("fp8 rotary", c);
        }
}

// The append writes exactly the bytes the CPU backends write (check_case compares with the reference; here
// also with the CPU flash backend), small scales included, where many new values saturate to +-448.
TEST(CudaKvcacheFp8, AppendWritesTheCpuBytes) {
  SKIP_WITHOUT_GPU();
  for (const float k_scale : {0.05f, 0.004f})
    for (const int block_size : {0, 16, 3})
      for (const int rotary : {0, 1, 2}) {
        KvCase c = fp8_case(rotary == 2 ? FA_FLOAT16 : FA_BFLOAT16);
        c.k_scale = k_scale;
        c.v_scale = k_scale * 0.5f;
        c.block_size = block_size;
        c.rotary = rotary;
        c.seqlen_new = 7;
        c.seqlen_q = 7;
        c.causal = true;
        check_case("fp8 append", c);
        auto rng = fa_test::make_rng("fp8 append bytes");
        const KvTensors pristine = make_kv(c, rng);
        KvTensors gpu = pristine, cpu = pristine;
        ASSERT_TRUE(run_gpu(c, gpu).ok());
        ASSERT_TRUE(run_host(FA_BACKEND_CPU_FLASH, c, cpu).ok());
        EXPECT_TRUE(same_bytes(gpu.k_cache, cpu.k_cache)) << "k_cache: " << c.to_string();
        EXPECT_TRUE(same_bytes(gpu.v_cache, cpu.v_cache)) << "v_cache: " << c.to_string();
        int saturated = 0;
        for (int64_t n = 0; n < gpu.k_cache.storage_bytes(); ++n)
          saturated += (static_cast<const uint8_t*>(gpu.k_cache.data())[n] & 0x7F) == 0x7E;
        if (k_scale < 0.01f) {
          EXPECT_GT(saturated, 0) << "expected saturated appended codes: " << c.to_string();
        }
      }
}

// The same codes, as contiguous and paged caches: bit-identical results.
TEST(CudaKvcacheFp8, PagedEqualsContiguousBitwise) {
  SKIP_WITHOUT_GPU();
  for (const int splits : {1, 2, 3, 5}) check_paged_equals_contiguous(fp8_case(), splits, "fp8 ");
}

TEST(CudaKvcacheFp8, EverySplitCountAgrees) {
  SKIP_WITHOUT_GPU();
  check_every_split_count(fp8_case(), "fp8 ");
}

TEST(CudaKvcacheFp8, EmptyAndSingleKeySequences) {
  SKIP_WITHOUT_GPU();
  for (const int splits : {0, 1, 4}) {
    KvCase c = fp8_case();
    c.batch = 3;
    c.cached = {0, 1, 0};
    c.num_splits = splits;
    check_case("fp8 lengths 0 and 1", c);
    c.seqlen_new = 1;
    c.block_size = 1;
    check_case("fp8 appended to empty", c);
  }
}

// A NaN code (0x7F / 0xFF) in the cache is a NaN value: it spoils exactly the rows that see it.
TEST(CudaKvcacheFp8, NaNCodesPropagate) {
  SKIP_WITHOUT_GPU();
  for (const bool in_v : {false, true})
    for (const uint8_t nan_code : {uint8_t(0x7F), uint8_t(0xFF)}) {
      KvCase c = fp8_case();
      c.block_size = 16;
      auto rng = fa_test::make_rng("fp8 nan");
      KvTensors t = make_kv(c, rng);
      HostTensor& cache = in_v ? t.v_cache : t.k_cache;
      static_cast<uint8_t*>(cache.data())[cache.offset_of(cache_index(c, t, 0, 20, 0, 3))] = nan_code;  // sequence 0, key 20
      ASSERT_TRUE(run_gpu(c, t).ok());
      const int group = c.heads_q / c.heads_k;
      for (int h = 0; h < c.heads_q; ++h) {
        const bool sees = h / group == 0;  // query heads of K/V head 0
        const double o = t.out.get(int64_t(h) * c.head_dim + 3);
        EXPECT_EQ(std::isnan(o), sees) << "head " << h << (in_v ? " (v)" : " (k)");
        for (int x = 0; x < c.head_dim; ++x)  // sequence 1 untouched
          ASSERT_FALSE(std::isnan(t.out.get((int64_t(c.heads_q) + h) * c.head_dim + x)));
      }
    }
}

// A bf16 q over an FP8 cache is stored as fp16 scaled by a power of two per CTA (from its block's largest |q|),
// and the power comes off the softmax scale. Query heads of one K/V group (one CTA) 2^-40 .. 2^20 apart; q near
// bf16's largest values and near its smallest normal ones, with k_scale the other way round (ordinary logits;
// unscaled, q would overflow fp16 in the first and underflow it in the second).
TEST(CudaKvcacheFp8, QMagnitudesWithinAndAcrossBlocks) {
  SKIP_WITHOUT_GPU();
  struct Scaling {
    std::vector<int> head_exponents;  // q of head h times 2^head_exponents[h] (heads 0-3: K/V head 0)
    int k_scale_exponent;             // k_scale times this power of two
  };
  const Scaling scalings[] = {{{0, -40, 20, -8, 3, 0, -12, 12}, 0},
                              {{116, 116, 116, 116, 116, 116, 116, 116}, -116},
                              {{-120, -120, -120, -120, -120, -120, -120, -120}, 120}};
  for (const bool paged : {false, true})
    for (const Scaling& scaling : scalings) {
      KvCase c = fp8_case(FA_BFLOAT16);
      c.block_size = paged ? 16 : 0;
      auto rng = fa_test::make_rng("fp8 q magnitudes");
      const KvTensors unscaled = make_kv(c, rng);
      KvTensors pristine = unscaled;  // the same codes, the scale moved (the oracle reads c.k_scale)
      c.k_scale = pristine.k_scale = std::ldexp(unscaled.k_scale, scaling.k_scale_exponent);
      for (int b = 0; b < c.batch; ++b)
        for (int h = 0; h < c.heads_q; ++h)
          for (int x = 0; x < c.head_dim; ++x) {
            const int64_t at = (int64_t(b) * c.heads_q + h) * c.head_dim + x;  // Sq = 1
            pristine.q.set(at, std::ldexp(unscaled.q.get(at), scaling.head_exponents[size_t(h)]));
          }
      const Expected e = expected_for(c, pristine);
      KvTensors t = pristine;
      fa_stats stats{};
      ASSERT_TRUE(run_gpu(c, t, &stats).ok());
      expect_matches("fp8 q 2^" + std::to_string(scaling.head_exponents[0]) + " k_scale 2^" +
                         std::to_string(scaling.k_scale_exponent) + (paged ? " paged" : ""),
                     c, t, e, stats.kernel);
    }
}

// ---- cache_leftpad: sequence b's keys are cache rows [leftpad[b], cached[b] + new); the padding holds NaN ----

// Cases over the load paths: contiguous (on CUDA the plain and checked copies), paged with 16-row slots, per-row ids
// (block size 3), one-row blocks (the CPU backends; CUDA refuses cache_leftpad with a paged cache); paddings inside
// a tile, on a tile boundary, equal to the length, none; D = 64's 128-key tiles; every split count family.
std::vector<KvCase> leftpad_cases() {
  std::vector<KvCase> cases;
  for (const int block_size : {0, 16, 64, 256, 3, 1}) {
    KvCase c;
    c.batch = 4;
    c.capacity = 700;
    c.cached = {600, 64, 130, 5};
    c.leftpad = {301, 64, 0, 5};  // inside a tile, = the length (only new keys), none, = the length of a short one
    c.seqlen_q = 4;
    c.seqlen_new = 4;
    c.causal = true;
    c.block_size = block_size;
    cases.push_back(c);
  }
  KvCase d64 = cases[0];  // 128-key tiles
  d64.head_dim = 64;
  cases.push_back(d64);
  KvCase read_only = cases[0];
  read_only.seqlen_new = 0;
  read_only.seqlen_q = 1;
  read_only.causal = false;
  read_only.leftpad = {128, 63, 1, 4};  // on a tile boundary, one key, 129 keys, one key
  cases.push_back(read_only);
  read_only.block_size = 16;
  cases.push_back(read_only);
  return cases;
}
std::vector<KvCase> contiguous_leftpad_cases() {
  std::vector<KvCase> cases;
  for (const KvCase& c : leftpad_cases())
    if (c.block_size == 0) cases.push_back(c);
  return cases;
}

TEST(CudaKvcacheHarness, JudgesLeftPaddingOnTheCpuFlashBackend) {
  for (KvCase c : leftpad_cases())
    for (const int splits : {1, 3}) {
      c.num_splits = splits;
      check_case("leftpad, cpu flash", c, FA_BACKEND_CPU_FLASH);
    }
}

TEST(CudaKvcache, LeftPadding) {
  SKIP_WITHOUT_GPU();
  for (KvCase c : contiguous_leftpad_cases())
    for (const int splits : {0, 1, 2, 7, 40}) {
      c.num_splits = splits;
      check_case("leftpad", c);
    }
  // With rotary (at the rows' own positions), windows, ALiBi and softcap, and FP8 caches.
  KvCase rotary = contiguous_leftpad_cases()[0];
  rotary.rotary = 1;
  rotary.rotary_dim = 64;
  check_case("leftpad rotary", rotary);
  rotary.rotary = 2;
  rotary.causal = false;  // every query at position cached
  check_case("leftpad rotary non-causal", rotary);
  KvCase window = contiguous_leftpad_cases()[0];
  window.window_left = 200;
  window.window_right = 0;
  check_case("leftpad window", window);
  window.alibi = true;
  window.softcap = 4.f;
  check_case("leftpad window alibi softcap", window);
  KvCase fp8 = contiguous_leftpad_cases()[0];
  fp8.fp8 = true;
  for (const int splits : {0, 1, 5}) {
    fp8.num_splits = splits;
    check_case("leftpad fp8", fp8);
  }
  // Paged (and cache_batch_idx, which runs as paged): refused by name before anything is written.
  for (const bool slots : {false, true}) {
    KvCase paged = leftpad_cases()[1];
    if (slots) paged.block_size = 0;
    auto rng = fa_test::make_rng("leftpad paged");
    KvTensors t = make_kv(paged, rng);
    if (slots) {
      t.cache_batch_idx = HostTensor({paged.batch}, FA_INT32);
      for (int b = 0; b < paged.batch; ++b) t.cache_batch_idx.set_int(b, paged.batch - 1 - b);
      t.k_cache = HostTensor({paged.batch, 1024, paged.heads_k, paged.head_dim}, paged.dtype);  // S_cache a power of two
      t.v_cache = t.k_cache;
    }
    const KvTensors before = t;
    const Status s = run_gpu(paged, t);
    EXPECT_EQ(s.code(), FA_ERROR_UNSUPPORTED) << s.to_string();
    EXPECT_EQ(s.message().rfind("cache_leftpad: on the cuda backend with a contiguous cache only", 0), 0u) << s.message();
    EXPECT_TRUE(same_bytes(t.k_cache, before.k_cache) && same_bytes(t.out, before.out)) << "written";
  }
}

// A padding entry out of range: NaN for that sequence and nothing written for it (default mode); a clear error
// before any write (checked mode).
TEST(CudaKvcache, LeftPaddingOutOfRange) {
  SKIP_WITHOUT_GPU();
  {  // a contiguous cache (CUDA refuses cache_leftpad with a paged one)
    KvCase c;
    c.batch = 3;
    c.cached = {100, 200, 50};
    c.leftpad = {10, 20, 5};
    c.seqlen_new = 1;
    auto rng = fa_test::make_rng("leftpad-range");
    const KvTensors valid = make_kv(c, rng);
    KvTensors good = valid;
    ASSERT_TRUE(run_gpu(c, good).ok());
    for (const int32_t bad_pad : {201, -1}) {
      KvTensors bad = valid;
      bad.cache_leftpad.set_int(1, bad_pad);
      const KvTensors before = bad;
      const std::string where = c.to_string() + ", leftpad[1] = " + std::to_string(bad_pad);
      ASSERT_TRUE(run_gpu(c, bad).ok()) << where;
      const int64_t per_seq = int64_t(c.seqlen_q) * c.heads_q * c.head_dim;
      for (int64_t x = 0; x < per_seq; ++x) {
        ASSERT_EQ(bad.out.get(x), good.out.get(x)) << where;
        ASSERT_TRUE(std::isnan(bad.out.get(per_seq + x))) << where;
        ASSERT_EQ(bad.out.get(2 * per_seq + x), good.out.get(2 * per_seq + x)) << where;
      }
      for (int hk = 0; hk < c.heads_k; ++hk)
        for (int x = 0; x < c.head_dim; ++x) {  // sequence 1's append did not happen
          const int64_t at = cache_index(c, before, 1, c.cached[1], hk, x);
          ASSERT_EQ(bad.k_cache.get(at), before.k_cache.get(at)) << where;
        }
      KvCase checked = c;
      checked.check_indices = true;
      KvTensors t = before;
      const Status s = run_gpu(checked, t);
      EXPECT_EQ(s.code(), FA_ERROR_INVALID_ARGUMENT) << where;
      const std::string expected = "cache_leftpad: entry 1 = " + std::to_string(bad_pad) + " must be in [0, cache_seqlens[1] = 200]";
      EXPECT_EQ(s.message().rfind(expected, 0), 0u) << s.message();
      EXPECT_TRUE(same_bytes(t.k_cache, before.k_cache) && same_bytes(t.out, before.out)) << "written: " << where;
    }
  }
}

#if defined(FLASHATTN_WITH_CUDA)
// A bad block id (in the append's target block of sequence 1) and an overflowing cache_seqlens (sequence 2).
KvCase invalid_case() {
  KvCase c;
  c.batch = 3;
  c.cached = {100, 200, 390};
  c.capacity = 400;
  c.seqlen_new = 1;
  c.block_size = 16;
  return c;
}
void break_indices(const KvCase& c, KvTensors& t) {
  const int64_t columns = t.block_table.shape()[1];
  t.block_table.set_int(1 * columns + (c.cached[1] / c.block_size), -1);
  t.cache_seqlens.set_int(2, c.capacity);  // capacity + S_new > capacity
}

// Default mode: the call returns OK (it cannot read device memory), writes nothing through the bad entries,
// gives NaN for the broken sequences, and the right result for the others.
TEST(CudaKvcache, InvalidIndicesDefaultMode) {
  SKIP_WITHOUT_GPU();
  // Sq = 1: the decode kernels; Sq = 64: the forward route (decode_plan.hpp, wants_forward_route, from 48 rows)
  for (const int seqlen_q : {1, 64})
  for (const int splits : {1, 4}) {
    SCOPED_TRACE("Sq " + std::to_string(seqlen_q) + " splits " + std::to_string(splits));
    KvCase c = invalid_case();
    c.seqlen_q = seqlen_q;
    c.num_splits = splits;
    auto rng = fa_test::make_rng("invalid");
    const KvTensors valid = make_kv(c, rng);
    KvTensors bad = valid;
    break_indices(c, bad);
    KvTensors good = valid;
    ASSERT_TRUE(run_gpu(c, good).ok());
    const KvTensors pristine_bad = bad;
    ASSERT_TRUE(run_gpu(c, bad).ok()) << "the default mode cannot see device indices";
    // Caches: exactly sequence 0's appended row changed.
    KvTensors expect = pristine_bad;
    for (int hk = 0; hk < c.heads_k; ++hk)
      for (int x = 0; x < c.head_dim; ++x) {
        const int64_t at = cache_index(c, valid, 0, c.cached[0], hk, x);
        expect.k_cache.set(at, good.k_cache.get(at));
        expect.v_cache.set(at, good.v_cache.get(at));
      }
    EXPECT_TRUE(same_bytes(bad.k_cache, expect.k_cache)) << "k_cache written through a bad entry";
    EXPECT_TRUE(same_bytes(bad.v_cache, expect.v_cache)) << "v_cache written through a bad entry";
    const int64_t per_seq = int64_t(c.seqlen_q) * c.heads_q * c.head_dim;
    for (int64_t x = 0; x < per_seq; ++x) {
      ASSERT_EQ(bad.out.get(x), good.out.get(x)) << "sequence 0 changed at " << x;
      ASSERT_TRUE(std::isnan(bad.out.get(per_seq + x))) << "sequence 1 (bad block id) not NaN at " << x;
      ASSERT_TRUE(std::isnan(bad.out.get(2 * per_seq + x))) << "sequence 2 (overflow) not NaN at " << x;
    }
    const int64_t lse_per_seq = int64_t(c.heads_q) * c.seqlen_q;  // lse (B, Hq, Sq)
    for (int64_t x = 0; x < lse_per_seq; ++x) {
      EXPECT_EQ(bad.lse.get(x), good.lse.get(x));
      EXPECT_TRUE(std::isnan(bad.lse.get(lse_per_seq + x)));
      EXPECT_TRUE(std::isnan(bad.lse.get(2 * lse_per_seq + x)));
    }
  }
}

// fa_kvcache calls of at least kForwardRouteMinRows (48) query rows over a 16-bit cache without rotary or left padding
// run the forward kernel over the cache (decode_plan.hpp, wants_forward_route: append, key counts, the forward with
// split-KV where it splits, NaN for bad lengths). Against the float64 oracle with the appended bytes: contiguous (and
// strided) and paged caches (block sizes 1, 3, 16, 256, heads-major blocks), appends of Sq and of fewer rows, causal with
// a sequence of fewer keys than queries (rows without keys), windows, softcap with ALiBi, num_splits 1, 3 and 40 (the
// forward takes at most 32), MHA / GQA / MQA, head dims 64 and 256, fp16; the kernel name says the route ran.
TEST(CudaKvcache, ForwardRouteManyQueryRows) {
  SKIP_WITHOUT_GPU();
  struct Variant {
    int block_size, heads_k, seqlen_q, seqlen_new;
    bool causal;
    int window_left;
    bool softcap_alibi;
    int num_splits, head_dim;
    fa_dtype dtype;
    bool heads_major;
    int row_pad;
  };
  const Variant variants[] = {
      {0, 2, 64, 64, true, -1, false, 0, 128, FA_BFLOAT16, false, 0},
      {16, 2, 48, 48, true, -1, false, 0, 128, FA_FLOAT16, false, 0},
      {0, 8, 48, 5, false, -1, false, 0, 128, FA_BFLOAT16, false, 0},
      {16, 2, 100, 100, true, -1, false, 0, 128, FA_BFLOAT16, false, 0},
      {16, 1, 130, 3, true, 50, false, 0, 128, FA_FLOAT16, false, 0},
      {3, 8, 64, 0, false, -1, true, 0, 128, FA_BFLOAT16, false, 0},
      {256, 2, 257, 257, true, -1, true, 3, 64, FA_BFLOAT16, false, 0},
      {1, 2, 64, 64, true, -1, false, 1, 128, FA_FLOAT16, false, 0},
      {16, 2, 80, 80, true, -1, false, 40, 256, FA_BFLOAT16, true, 0},
      {0, 4, 96, 96, false, 100, false, 0, 128, FA_FLOAT16, false, 8},
  };
  for (const Variant& v : variants) {
    KvCase c;
    c.batch = 3;
    c.heads_q = 8;
    c.heads_k = v.heads_k;
    c.seqlen_q = v.seqlen_q;
    c.seqlen_new = v.seqlen_new;
    c.cached = {900, 0, 333};  // sequence 1: no cached keys (causal: its first rows see none)
    c.capacity = 1200;
    c.block_size = v.block_size;
    c.heads_major_blocks = v.heads_major;
    c.cache_row_pad = v.row_pad;
    c.causal = v.causal;
    c.window_left = v.window_left;
    if (v.softcap_alibi) c.softcap = 20.f, c.alibi = true;
    c.num_splits = v.num_splits;
    c.head_dim = v.head_dim;
    c.dtype = v.dtype;
    const std::string what = "forward route " + c.to_string();
    check_case(what, c);
    auto rng = fa_test::make_rng(what);
    KvTensors t = make_kv(c, rng);
    fa_stats stats{};
    ASSERT_TRUE(run_gpu(c, t, &stats).ok()) << what;
    EXPECT_NE(std::string(stats.kernel).find("forward route"), std::string::npos) << what << " ran " << stats.kernel;
    if (v.num_splits > 0) {
      EXPECT_EQ(stats.num_splits, std::min(v.num_splits, 32)) << what;
    }
  }
}

// Calls that pack (G > 1, no ALiBi) with K/V of at least kLongCacheRouteMinBytes at capacity take the forward route
// from kLongCacheRouteMinRows (17) query rows, with at least kL2CacheRouteMinBytes from kL2CacheRouteMinRows (24)
// (decode_plan.hpp, forward_route_min_rows): 17, 24, 30 and 47 rows, contiguous and paged, appends, causal, softcap;
// and the calls that stay in the decode kernels: 16 rows, 23 rows in the lower tier, ALiBi, G = 1, a cache one block
// short of a bound. Against the float64 oracle; the kernel name says which path ran.
TEST(CudaKvcache, ForwardRouteShortCallsOverLongCaches) {
  SKIP_WITHOUT_GPU();
  namespace decode = flashattn::cuda::decode;
  struct Variant {
    int seqlen_q, heads_k, block_size, capacity;
    bool alibi;
    bool route;
  };
  auto capacity = [](int heads_k, int64_t bytes) {  // the cases below: B = 3, D = 128, bf16
    KvCase c;
    c.batch = 3;
    c.heads_k = heads_k;
    return cache_capacity_for(c, bytes);
  };
  const int64_t long_bytes = decode::kLongCacheRouteMinBytes, l2_bytes = decode::kL2CacheRouteMinBytes;
  const Variant variants[] = {
      {17, 2, 0, capacity(2, long_bytes), false, true},      {30, 2, 16, capacity(2, long_bytes), false, true},
      {47, 4, 0, capacity(4, long_bytes) + 5, false, true},  {16, 2, 16, capacity(2, long_bytes), false, false},
      {17, 2, 0, capacity(2, long_bytes), true, false},      {17, 8, 0, capacity(8, long_bytes), false, false},
      {17, 2, 16, capacity(2, long_bytes) - 16, false, false},
      {24, 2, 16, capacity(2, l2_bytes), false, true},       {23, 2, 0, capacity(2, l2_bytes), false, false},
      {24, 2, 0, capacity(2, l2_bytes) - 16, false, false},
  };
  for (const Variant& v : variants) {
    KvCase c;
    c.batch = 3;
    c.heads_q = 8;
    c.heads_k = v.heads_k;
    c.seqlen_q = v.seqlen_q;
    c.seqlen_new = v.seqlen_q;
    c.cached = {900, 0, 2000};  // the oracle reads the keys in use only
    c.capacity = v.capacity;
    c.block_size = v.block_size;
    c.causal = true;
    c.softcap = v.alibi ? 0.f : 25.f;
    c.alibi = v.alibi;
    const std::string what = "long cache " + c.to_string();
    check_case(what, c);
    auto rng = fa_test::make_rng(what);
    KvTensors t = make_kv(c, rng);
    fa_stats stats{};
    ASSERT_TRUE(run_gpu(c, t, &stats).ok()) << what;
    EXPECT_EQ(std::string(stats.kernel).find("forward route") != std::string::npos, v.route) << what << " ran " << stats.kernel;
    if (v.route) {
      EXPECT_NE(std::string(stats.kernel).find("gqa-packed"), std::string::npos) << what << " ran " << stats.kernel;
    }
  }
}

// Default mode, a bad block id (past the pool, or negative) inside a sequence (not its last tile): with block sizes
// 16 and 64 this D = 128 cache takes the kernel's lean paged copies, which check the ids of 16-row slots a batch of
// tiles ahead and read block 0 in a bad one's place; the sequence's rows must still come out NaN, and the other
// sequence exactly as without the bad entry. Block sizes 16 and 64 (slot ids) and 3
// (an id per row), one split and several; the bad key in the first 64-key tile (copied before the tile loop) and
// in later ones (with one split, copied inside the loop, whose ids come a batch ahead).
TEST(CudaKvcache, InteriorBadBlockIdDefaultMode) {
  SKIP_WITHOUT_GPU();
  for (const int block_size : {16, 64, 3})
    for (const int splits : {1, 3}) {
      KvCase c;
      c.batch = 2;
      c.cached = {300, 390};
      c.capacity = 400;
      c.block_size = block_size;
      c.num_splits = splits;
      auto rng = fa_test::make_rng("interior-bad");
      const KvTensors valid = make_kv(c, rng);
      KvTensors good = valid;  // the valid table's result, once per case: sequence 0 of every bad call must equal it
      ASSERT_TRUE(run_gpu(c, good).ok()) << c.to_string();
      for (const int bad_key : {40, 200, 330})
        for (const int32_t bad_id : {int32_t(1) << 30, int32_t(-1)}) {  // past the pool, and negative
          KvTensors bad = valid;
          const int64_t columns = bad.block_table.shape()[1];
          bad.block_table.set_int(1 * columns + bad_key / block_size, bad_id);
          const std::string where = c.to_string() + ", bad id " + std::to_string(bad_id) + " at key " + std::to_string(bad_key);
          ASSERT_TRUE(run_gpu(c, bad).ok()) << where;
          const int64_t per_seq = int64_t(c.seqlen_q) * c.heads_q * c.head_dim;
          for (int64_t x = 0; x < per_seq; ++x) {
            ASSERT_EQ(bad.out.get(x), good.out.get(x)) << "sequence 0 changed at " << x << ", " << where;
            ASSERT_TRUE(std::isnan(bad.out.get(per_seq + x))) << "sequence 1 (bad block id) not NaN at " << x << ", " << where;
          }
          for (int h = 0; h < c.heads_q; ++h) EXPECT_TRUE(std::isnan(bad.lse.get(c.heads_q + h))) << where;
        }
    }
}

// Checked mode: a clear error naming the entry, before any write (caches and the poisoned out untouched).
TEST(CudaKvcache, InvalidIndicesCheckedMode) {
  SKIP_WITHOUT_GPU();
  KvCase c = invalid_case();
  c.check_indices = true;
  auto rng = fa_test::make_rng("checked");
  KvTensors t = make_kv(c, rng);
  break_indices(c, t);
  const KvTensors before = t;
  Status s = run_gpu(c, t);
  EXPECT_EQ(s.code(), FA_ERROR_INVALID_ARGUMENT) << s.to_string();
  const std::string expected_id = "block_table: entry (1, " + std::to_string(c.cached[1] / c.block_size) + ") = -1 is not a block id in [0, ";
  EXPECT_EQ(s.message().rfind(expected_id, 0), 0u) << s.message();
  EXPECT_TRUE(same_bytes(t.k_cache, before.k_cache) && same_bytes(t.v_cache, before.v_cache)) << "cache written";
  EXPECT_TRUE(same_bytes(t.out, before.out) && same_bytes(t.lse, before.lse)) << "out / lse written";
  // Only the overflow left: it is named.
  t = before;
  t.block_table = make_kv(c, rng).block_table;
  s = run_gpu(c, t);
  EXPECT_EQ(s.code(), FA_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(s.message().rfind("cache_seqlens: entry 2 = 400 plus S_new = 1 must be in [0, 400]", 0), 0u) << s.message();
  EXPECT_TRUE(same_bytes(t.k_cache, before.k_cache)) << "cache written";
  // And a valid call passes the check and computes.
  KvCase ok = c;
  check_case("checked mode, valid", ok);
}

// ---- cache_batch_idx: sequence b reads and appends to slot idx[b] of a contiguous cache of kSlots entries ----
constexpr int kSlots = 5;

// `gathered`'s cache entries placed in slots `slot_of` of a kSlots-slot cache (the other slots random), with the
// index tensor set.
KvTensors slotted_kv(const KvCase& c, const KvTensors& gathered, const std::vector<int32_t>& slot_of, std::mt19937_64& rng) {
  const int64_t entry = int64_t(c.capacity) * c.heads_k * c.head_dim;  // elements of one batch entry
  KvTensors t = gathered;
  const fa_dtype cache_dtype = gathered.k_cache.dtype();
  t.k_cache = HostTensor({kSlots, c.capacity, c.heads_k, c.head_dim}, cache_dtype);
  t.v_cache = HostTensor({kSlots, c.capacity, c.heads_k, c.head_dim}, cache_dtype);
  t.k_cache.fill_normal(rng, c.fp8 ? 1.0 / c.k_scale : 1.0);
  t.v_cache.fill_normal(rng, c.fp8 ? 1.0 / c.v_scale : 1.0);
  t.cache_batch_idx = HostTensor({c.batch}, FA_INT32);
  for (int b = 0; b < c.batch; ++b) {
    t.cache_batch_idx.set_int(b, slot_of[size_t(b)]);
    if (slot_of[size_t(b)] < 0 || slot_of[size_t(b)] >= kSlots) continue;
    for (int64_t x = 0; x < entry; ++x) {
      t.k_cache.set(slot_of[size_t(b)] * entry + x, gathered.k_cache.get(b * entry + x));
      t.v_cache.set(slot_of[size_t(b)] * entry + x, gathered.v_cache.get(b * entry + x));
    }
  }
  return t;
}

// The slot cache through cache_batch_idx against the float64 oracle of the gathered cache (slot idx[b] as entry b);
// its appended rows equal the gathered call's bit for bit in the sequences' slots, and the other slots stay as they
// were. The library runs such a cache as the paged cache it is (blocks of S_cache rows; on CUDA S_cache a power of two
// >= 16, else refused). Decode and a causal two-token step with rotary; 16-bit and FP8 caches; the library's split
// count and explicit ones.
TEST(CudaKvcache, CacheBatchIdxEqualsGatheredCache) {
  SKIP_WITHOUT_GPU();
  const std::vector<int32_t> slot_of = {4, 0, 2};
  for (const int capacity : {1024, 2048})
    for (const bool fp8 : {false, true})
      for (const bool step : {false, true})
        for (const int splits : {0, 1, 3}) {
          KvCase c;
          c.batch = 3;
          c.heads_q = 32;
          c.heads_k = 8;
          c.capacity = capacity;
          c.cached = {37, capacity - 100, 0};
          c.seqlen_new = 1;
          c.fp8 = fp8;
          c.num_splits = splits;
          if (step) {
            c.seqlen_q = c.seqlen_new = 2;
            c.causal = true;
            c.rotary = 1;
          }
          const std::string what = "cache_batch_idx " + c.to_string();
          auto rng = fa_test::make_rng("slots" + what);
          const KvTensors pristine = make_kv(c, rng);
          KvTensors gathered = pristine;
          ASSERT_TRUE(run_gpu(c, gathered).ok()) << what;
          const KvTensors before = slotted_kv(c, pristine, slot_of, rng);
          KvTensors slotted = before;
          fa_stats stats{};
          const Status s = run_gpu(c, slotted, &stats);
          ASSERT_TRUE(s.ok()) << what << ": " << s.to_string();
          if (splits > 0) {
            EXPECT_EQ(stats.num_splits, splits) << what;
          }
          // The oracle's verdict on out and lse (judge's cache comparison is against the gathered layout: checked below).
          Expected e = expected_for(c, pristine);
          KvTensors as_gathered = gathered;
          as_gathered.out = slotted.out;
          as_gathered.lse = slotted.lse;
          expect_matches(what, c, as_gathered, e, stats.kernel);
          const int64_t entry = int64_t(c.capacity) * c.heads_k * c.head_dim;
          for (int slot = 0; slot < kSlots; ++slot) {
            const int b = int(std::find(slot_of.begin(), slot_of.end(), slot) - slot_of.begin());  // 3: no sequence's
            for (int64_t x = 0; x < entry; ++x) {
              const int64_t at = slot * entry + x;
              const double k_expected = b < c.batch ? gathered.k_cache.get(b * entry + x) : before.k_cache.get(at);
              const double v_expected = b < c.batch ? gathered.v_cache.get(b * entry + x) : before.v_cache.get(at);
              ASSERT_TRUE(slotted.k_cache.get(at) == k_expected || (std::isnan(k_expected) && std::isnan(slotted.k_cache.get(at))))
                  << what << ": k_cache slot " << slot << " element " << x;
              ASSERT_TRUE(slotted.v_cache.get(at) == v_expected || (std::isnan(v_expected) && std::isnan(slotted.v_cache.get(at))))
                  << what << ": v_cache slot " << slot << " element " << x;
            }
          }
        }
}

// A cache_batch_idx entry outside the cache: by default the call returns OK, the sequence gets NaN and writes nothing,
// the others are exactly as with a valid index; in the checked mode a clear error before any write.
TEST(CudaKvcache, CacheBatchIdxOutOfRange) {
  SKIP_WITHOUT_GPU();
  for (const int splits : {1, 4}) {
    KvCase c;
    c.batch = 3;
    c.capacity = 512;
    c.cached = {100, 200, 390};
    c.seqlen_new = 1;
    c.num_splits = splits;
    auto rng = fa_test::make_rng("slots-out-of-range");
    const KvTensors pristine = make_kv(c, rng);
    const KvTensors valid = slotted_kv(c, pristine, {4, 3, 0}, rng);
    KvTensors good = valid;
    ASSERT_TRUE(run_gpu(c, good).ok());
    for (const int32_t bad_entry : {kSlots, -1}) {
      KvTensors bad = valid;
      bad.cache_batch_idx.set_int(1, bad_entry);
      const KvTensors before = bad;
      ASSERT_TRUE(run_gpu(c, bad).ok()) << "the default mode cannot see device indices";
      const int64_t entry = int64_t(c.capacity) * c.heads_k * c.head_dim;
      for (int64_t at = 0; at < kSlots * entry; ++at) {  // slot 3 (sequence 1's in the valid call) untouched
        ASSERT_EQ(bad.k_cache.get(at), at / entry == 3 ? before.k_cache.get(at) : good.k_cache.get(at)) << "k_cache at " << at;
        ASSERT_EQ(bad.v_cache.get(at), at / entry == 3 ? before.v_cache.get(at) : good.v_cache.get(at)) << "v_cache at " << at;
      }
      const int64_t per_seq = int64_t(c.seqlen_q) * c.heads_q * c.head_dim;
      for (int64_t x = 0; x < per_seq; ++x) {
        ASSERT_EQ(bad.out.get(x), good.out.get(x)) << "sequence 0 changed at " << x;
        ASSERT_TRUE(std::isnan(bad.out.get(per_seq + x))) << "sequence 1 (entry " << bad_entry << ") not NaN at " << x;
        ASSERT_EQ(bad.out.get(2 * per_seq + x), good.out.get(2 * per_seq + x)) << "sequence 2 changed at " << x;
      }
      for (int h = 0; h < c.heads_q; ++h) {
        EXPECT_EQ(bad.lse.get(h), good.lse.get(h));
        EXPECT_TRUE(std::isnan(bad.lse.get(c.heads_q + h)));
        EXPECT_EQ(bad.lse.get(2 * c.heads_q + h), good.lse.get(2 * c.heads_q + h));
      }
      KvCase checked = c;
      checked.check_indices = true;
      KvTensors t = before;
      const Status s = run_gpu(checked, t);
      EXPECT_EQ(s.code(), FA_ERROR_INVALID_ARGUMENT) << s.to_string();
      const std::string expected = "cache_batch_idx: entry 1 = " + std::to_string(bad_entry) + " is not a batch entry of k_cache in [0, 5)";
      EXPECT_EQ(s.message().rfind(expected, 0), 0u) << s.message();
      EXPECT_TRUE(same_bytes(t.k_cache, before.k_cache) && same_bytes(t.v_cache, before.v_cache)) << "cache written";
      EXPECT_TRUE(same_bytes(t.out, before.out) && same_bytes(t.lse, before.lse)) << "out / lse written";
    }
  }
}

// S_cache not a power of two >= 16 with cache_batch_idx: a clear error before anything is written (it would run as
// paged blocks of S_cache rows through the slow per-row block path).
TEST(CudaKvcache, CacheBatchIdxNeedsPowerOfTwoCapacity) {
  SKIP_WITHOUT_GPU();
  for (const int capacity : {1100, 8}) {
    KvCase c;
    c.batch = 3;
    c.capacity = capacity;
    c.cached = {3, 5, 0};
    c.seqlen_new = 1;
    auto rng = fa_test::make_rng("slots-capacity");
    const KvTensors before = slotted_kv(c, make_kv(c, rng), {4, 0, 2}, rng);
    KvTensors t = before;
    const Status s = run_gpu(c, t);
    EXPECT_EQ(s.code(), FA_ERROR_UNSUPPORTED) << s.to_string();
    const std::string expected = "cache_batch_idx: on the cuda backend k_cache's dimension 1 (S_cache) must be a power of two >= 16, got " +
                                 std::to_string(capacity);
    EXPECT_EQ(s.message().rfind(expected, 0), 0u) << s.message();
    EXPECT_TRUE(same_bytes(t.k_cache, before.k_cache) && same_bytes(t.v_cache, before.v_cache)) << "cache written";
    EXPECT_TRUE(same_bytes(t.out, before.out) && same_bytes(t.lse, before.lse)) << "out / lse written";
  }
}

// Plan once, then run with the planned workspace: no allocation, and the call captures into a CUDA graph that
// replays correctly after the inputs (cache_seqlens, q, new rows) change in place. forward_route: 64 query rows and
// appended rows, no rotary (decode_plan.hpp, wants_forward_route: the forward kernel, split-KV, over the cache).
void check_plan_workspace_and_graph(bool forward_route) {
  KvCase c;
  c.batch = 2;
  c.heads_q = 32;
  c.heads_k = 8;
  c.capacity = 8192;
  c.cached = {8000, 3000};
  c.seqlen_new = 1;
  c.block_size = 16;
  c.rotary = 1;
  if (forward_route) {
    c.seqlen_q = c.seqlen_new = 64;
    c.cached = {8000 - 64, 3000};
    c.rotary = 0;
    c.causal = true;
  }
  auto rng = fa_test::make_rng(forward_route ? "graph route" : "graph");
  KvTensors t = make_kv(c, rng);
  const KvTensors pristine = t;
  DeviceKv d(t);
  fa_kvcache_args a = d.args();
  fa_options o = d.options(c);
  fa_kvcache_plan plan{};
  ASSERT_TRUE(flashattn::kvcache_plan(a, o, &plan).ok());
  EXPECT_GT(plan.num_splits, 1) << "2 x 8 K/V heads on a GPU with many SMs: split-KV expected";
  EXPECT_GT(plan.workspace_bytes, 0);
  void* workspace = nullptr;
  ASSERT_EQ(cudaMalloc(&workspace, size_t(plan.workspace_bytes) + 1), cudaSuccess);
  a.num_splits = plan.num_splits;
  a.workspace = fa_tensor_contiguous(static_cast<char*>(workspace) + 1, 1, &plan.workspace_bytes, FA_UINT8, FA_DEVICE_CUDA, 0);
  // Too small a workspace is an error naming it.
  fa_kvcache_args small = a;
  small.workspace.shape[0] = plan.workspace_bytes - 1;
  Status s = flashattn::kvcache(small, o);
  EXPECT_EQ(s.code(), FA_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(s.message().rfind("workspace:", 0), 0u) << s.message();

  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  o.stream = stream;
  fa_stats stats{};
  o.stats = &stats;
  // The checked mode cannot be captured: a clear error, and the capture is abandoned cleanly.
  {
    fa_kvcache_args checked = a;
    checked.check_indices = 1;
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    s = flashattn::kvcache(checked, o);
    cudaGraph_t abandoned = nullptr;
    cudaStreamEndCapture(stream, &abandoned);
    if (abandoned) cudaGraphDestroy(abandoned);
    cudaGetLastError();
    EXPECT_EQ(s.code(), FA_ERROR_UNSUPPORTED) << s.to_string();
    EXPECT_EQ(s.message().rfind("check_indices:", 0), 0u) << s.message();
  }
  // One eager step first (kernel attributes are set on a first launch, outside any capture); the graph's
  // first replay then appends the same rows again.
  ASSERT_TRUE(synchronize(flashattn::kvcache(a, o)).ok());
  EXPECT_EQ(stats.scratch_bytes_peak, 0) << "allocated despite the planned workspace";
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  s = flashattn::kvcache(a, o);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(stats.scratch_bytes_peak, 0) << "allocated despite the planned workspace";
  EXPECT_EQ(stats.num_splits, plan.num_splits);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);

  // Two decode steps through the same graph: step 2 appends at the next position with new q / k / v.
  KvTensors step_input = pristine;
  for (int step = 0; step < 2; ++step) {
    KvCase sc = c;
    if (step == 1) {
      for (int b = 0; b < c.batch; ++b) sc.cached[size_t(b)] = c.cached[size_t(b)] + 1;
      KvTensors fresh = make_kv(sc, rng);
      step_input.cache_seqlens = fresh.cache_seqlens;
      step_input.q = fresh.q;
      step_input.k_new = fresh.k_new;
      step_input.v_new = fresh.v_new;
      t.cache_seqlens = step_input.cache_seqlens;
      t.q = step_input.q;
      t.k_new = step_input.k_new;
      t.v_new = step_input.v_new;
      for (HostTensor* h : {&t.cache_seqlens, &t.q, &t.k_new, &t.v_new}) d.upload(h);
    }
    t.out.poison();
    t.lse.poison();
    d.upload(&t.out);
    d.upload(&t.lse);
    const Expected e = expected_for(sc, step_input);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    d.download_results();
    expect_matches("graph step " + std::to_string(step), sc, t, e, stats.kernel);
    step_input.k_cache = e.after.k_cache;  // the next step starts from the appended cache
    step_input.v_cache = e.after.v_cache;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);

  // Without a workspace the call allocates the plan's bytes itself (stream-ordered) and says so.
  fa_kvcache_args own = d.args();
  fa_options eager = d.options(c);
  eager.stats = &stats;
  ASSERT_TRUE(synchronize(flashattn::kvcache(own, eager)).ok());
  EXPECT_EQ(stats.scratch_bytes_peak, plan.workspace_bytes);
  cudaStreamDestroy(stream);
  cudaFree(workspace);
}

TEST(CudaKvcache, PlanWorkspaceAndCudaGraph) {
  SKIP_WITHOUT_GPU();
  check_plan_workspace_and_graph(false);
}

TEST(CudaKvcache, PlanWorkspaceAndCudaGraphOfTheForwardRoute) {
  SKIP_WITHOUT_GPU();
  check_plan_workspace_and_graph(true);
}

// What the CUDA kvcache does not do is an error naming the argument, before any device work.
TEST(CudaKvcache, UnsupportedConfigurations) {
  SKIP_WITHOUT_GPU();
  KvCase c;
  auto rng = fa_test::make_rng("unsupported");
  auto expect_error = [&](KvCase kc, fa_status code, const std::string& prefix, float dropout = 0.f, int byte_offset = 0) {
    KvTensors t = make_kv(kc, rng);
    DeviceKv d(t);
    fa_kvcache_args a = d.args();
    a.k_cache.data = static_cast<char*>(a.k_cache.data) + byte_offset;
    fa_options o = d.options(kc);
    o.dropout_p = dropout;
    const Status s = flashattn::kvcache(a, o);
    EXPECT_EQ(s.code(), code) << s.to_string();
    EXPECT_EQ(s.message().rfind(prefix, 0), 0u) << s.message();
  };
  KvCase f32 = c;
  f32.dtype = FA_FLOAT32;
  expect_error(f32, FA_ERROR_UNSUPPORTED, "q: dtype float32 is not supported by the cuda kvcache kernels");
  expect_error(c, FA_ERROR_UNSUPPORTED, "options.dropout_p:", 0.1f);
  KvCase d36 = c;
  d36.head_dim = 36;
  expect_error(d36, FA_ERROR_UNSUPPORTED, "q: head dim 36 must be a multiple of 8");
  KvCase d264 = c;
  d264.head_dim = 264;
  expect_error(d264, FA_ERROR_NOT_COMPILED, "q: head dim 264 is not compiled for the cuda kvcache");
  expect_error(c, FA_ERROR_UNSUPPORTED, "k_cache: data pointer must be 16-byte aligned", 0.f, 8);
  // FP8: 16 codes per 16-byte chunk, so D % 16 == 0 and 16-byte strides; D beyond the compiled buckets
  KvCase f40 = fp8_case();
  f40.head_dim = 40;
  expect_error(f40, FA_ERROR_UNSUPPORTED, "k_cache: head dim 40 must be a multiple of 16 with a float8_e4m3 cache");
  KvCase f_pad = fp8_case();
  f_pad.cache_row_pad = 8;
  expect_error(f_pad, FA_ERROR_UNSUPPORTED, "k_cache: row stride");
  KvCase f264 = fp8_case();
  f264.head_dim = 272;
  expect_error(f264, FA_ERROR_NOT_COMPILED, "q: head dim 272 is not compiled for the cuda kvcache (bfloat16, float8_e4m3 cache)");
}
#endif

}  // namespace
