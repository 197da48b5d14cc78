// fa_kvcache_append: new K/V rows written into a contiguous or paged cache, n_b rows for sequence b (the write half of
// fa_kvcache, for a continuous-batching step whose requests bring different numbers of tokens).
//
// The oracle of the rows: fa_kvcache on the float64 reference backend, one call per sequence (B = 1, S_new = n_b),
// whose append is the library's definition of where and how new rows land (FP8: quantised as e4m3(x / scale)). The
// caches must come out bit for bit the same, every row that is not appended included. The serving step (append, then
// one varlen forward over the paged cache) must give what fa_kvcache gives per sequence. On the GPU (skipped
// without one) the CUDA append must write the CPU's bytes, and its checked mode must name bad entries before any
// write.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.hpp"
#include "testing.hpp"

#if defined(FLASHATTN_WITH_CUDA)
#include <cuda_runtime.h>
#endif

namespace {

using fa_test::HostTensor;
using flashattn::Status;

struct AppendCase {
  std::vector<int> cached = {0, 5, 17, 40};  // rows already in each sequence's cache
  std::vector<int> rows = {3, 0, 16, 1};     // new rows n_b of each sequence
  int heads_k = 2, head_dim = 64;
  int capacity = 96;     // rows a sequence's cache holds
  int block_size = 0;    // 0: contiguous cache; else paged with this block size (shuffled ids, spare blocks)
  fa_dtype dtype = FA_FLOAT32;  // of k_new / v_new (and of the cache unless fp8)
  bool fp8 = false;             // float8 e4m3 cache with these scales
  float k_scale = 0.05f, v_scale = 0.03f;
  int batch() const { return int(cached.size()); }
  std::string to_string() const {
    std::string s = std::string(flashattn::dtype_name(dtype)) + (fp8 ? " fp8 cache" : "") + " Hk=" + std::to_string(heads_k) +
                    " D=" + std::to_string(head_dim) + " block=" + std::to_string(block_size) + " cached/new=[";
    for (int b = 0; b < batch(); ++b) s += std::to_string(cached[size_t(b)]) + "+" + std::to_string(rows[size_t(b)]) + ",";
    return s + "]";
  }
};

struct AppendTensors {
  HostTensor k_cache, v_cache, block_table, cache_seqlens, k_new, v_new, cu_seqlens_new;
  int max_rows = 0;
  float k_scale = 0.f, v_scale = 0.f;
  fa_kvcache_append_args args() {
    fa_kvcache_append_args a{};
    a.k_cache = k_cache.view();
    a.v_cache = v_cache.view();
    if (!block_table.shape().empty()) a.block_table = block_table.view();
    a.cache_seqlens = cache_seqlens.view();
    a.k_new = k_new.view();
    a.v_new = v_new.view();
    a.cu_seqlens_new = cu_seqlens_new.view();
    a.max_seqlen_new = max_rows;
    a.k_scale = k_scale;
    a.v_scale = v_scale;
    return a;
  }
};

AppendTensors make_append(const AppendCase& c, std::mt19937_64& rng) {
  AppendTensors t;
  const int d = c.head_dim, B = c.batch();
  const fa_dtype cache_dtype = c.fp8 ? FA_FLOAT8_E4M3 : c.dtype;
  if (c.fp8) t.k_scale = c.k_scale, t.v_scale = c.v_scale;
  if (c.block_size == 0) {
    t.k_cache = HostTensor({B, c.capacity, c.heads_k, d}, cache_dtype);
    t.v_cache = HostTensor({B, c.capacity, c.heads_k, d}, cache_dtype);
  } else {
    const int per_seq = (c.capacity + c.block_size - 1) / c.block_size;
    const int blocks = B * per_seq + 3;
    t.k_cache = HostTensor({blocks, c.block_size, c.heads_k, d}, cache_dtype);
    t.v_cache = HostTensor({blocks, c.block_size, c.heads_k, d}, cache_dtype);
    std::vector<int32_t> ids(static_cast<size_t>(blocks));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    t.block_table = HostTensor({B, per_seq}, FA_INT32);
    for (int n = 0; n < B * per_seq; ++n) t.block_table.set_int(n, ids[size_t(n)]);
  }
  // Every row random, appended or not: a write to the wrong row changes bytes that the oracle leaves alone.
  t.k_cache.fill_normal(rng, c.fp8 ? 1.0 / c.k_scale : 1.0);
  t.v_cache.fill_normal(rng, c.fp8 ? 1.0 / c.v_scale : 1.0);
  t.cache_seqlens = HostTensor({B}, FA_INT32);
  t.cu_seqlens_new = HostTensor({B + 1}, FA_INT32);
  int total = 0;
  t.cu_seqlens_new.set_int(0, 0);
  for (int b = 0; b < B; ++b) {
    t.cache_seqlens.set_int(b, c.cached[size_t(b)]);
    total += c.rows[size_t(b)];
    t.cu_seqlens_new.set_int(b + 1, total);
    t.max_rows = std::max(t.max_rows, c.rows[size_t(b)]);
  }
  t.k_new = HostTensor({total, c.heads_k, d}, c.dtype);
  t.v_new = HostTensor({total, c.heads_k, d}, c.dtype);
  t.k_new.fill_normal(rng);
  t.v_new.fill_normal(rng);
  return t;
}

// A view of entry b of a (B, ...) host tensor as a (1, ...) tensor.
fa_tensor entry_view(HostTensor& t, int b) {
  const int64_t element = flashattn::dtype_size(t.dtype());
  std::vector<int64_t> shape = t.shape();
  shape[0] = 1;
  return fa_test::host_view(static_cast<char*>(t.data()) + b * t.strides()[0] * element, t.dtype(), shape, t.strides());
}

// The oracle: t's caches after one fa_kvcache call per sequence with new rows on the float64 reference (B = 1, one
// query, S_new = n_b). causal, out_per_seq: the same calls' attention (Sq = n_b queries, causal), for the serving
// step's check; out_per_seq[b] is (1, n_b, Hq, D).
void append_per_sequence(const AppendCase& c, AppendTensors& t, fa_backend backend, int heads_q = 0,
                         std::vector<HostTensor>* q_per_seq = nullptr, std::vector<HostTensor>* out_per_seq = nullptr) {
  const int d = c.head_dim;
  for (int b = 0; b < c.batch(); ++b) {
    const int n = c.rows[size_t(b)];
    if (n == 0) continue;
    const int first = t.cu_seqlens_new.get_int(b);
    const bool attend = q_per_seq != nullptr;
    const int hq = attend ? heads_q : c.heads_k;
    HostTensor q_one({1, attend ? n : 1, hq, d}, c.dtype), out({1, attend ? n : 1, hq, d}, c.dtype);
    std::mt19937_64 q_rng(7);
    if (attend) q_one = (*q_per_seq)[size_t(b)];
    else q_one.fill_uniform(q_rng, -1, 1);
    HostTensor seqlen({1}, FA_INT32);
    seqlen.set_int(0, c.cached[size_t(b)]);
    const std::vector<int64_t> row_strides = t.k_new.strides();
    const int64_t element = flashattn::dtype_size(c.dtype);
    fa_kvcache_args a{};
    a.q = q_one.view();
    a.out = out.view();
    a.cache_seqlens = seqlen.view();
    a.k_new = fa_test::host_view(static_cast<char*>(t.k_new.data()) + first * row_strides[0] * element, c.dtype,
                                 {1, n, c.heads_k, d}, {0, row_strides[0], row_strides[1], 1});
    a.v_new = fa_test::host_view(static_cast<char*>(t.v_new.data()) + first * t.v_new.strides()[0] * element, c.dtype,
                                 {1, n, c.heads_k, d}, {0, t.v_new.strides()[0], t.v_new.strides()[1], 1});
    HostTensor table_row;
    if (c.block_size > 0) {
      a.k_cache = t.k_cache.view();
      a.v_cache = t.v_cache.view();
      table_row = HostTensor({1, t.block_table.shape()[1]}, FA_INT32);
      for (int64_t n2 = 0; n2 < t.block_table.shape()[1]; ++n2)
        table_row.set_int(n2, t.block_table.get_int(b * t.block_table.shape()[1] + n2));
      a.block_table = table_row.view();
    } else {
      a.k_cache = entry_view(t.k_cache, b);
      a.v_cache = entry_view(t.v_cache, b);
    }
    a.k_scale = t.k_scale;
    a.v_scale = t.v_scale;
    fa_options o = fa_test::options_for(backend);
    o.causal = attend ? 1 : 0;
    o.num_threads = 2;
    const Status s = flashattn::kvcache(a, o);
    ASSERT_TRUE(s.ok()) << "sequence " << b << ": " << s.to_string();
    if (out_per_seq != nullptr) (*out_per_seq)[size_t(b)] = out;
  }
}

bool same_bytes(const HostTensor& a, const HostTensor& b) {
  return a.storage_bytes() == b.storage_bytes() && std::memcmp(a.data(), b.data(), size_t(a.storage_bytes())) == 0;
}

std::vector<AppendCase> every_layout_and_dtype() {
  std::vector<AppendCase> cases;
  for (int block : {0, 16, 3, 1})
    for (int kind = 0; kind < 4; ++kind) {
      AppendCase c;
      c.block_size = block;
      c.dtype = kind == 0 ? FA_FLOAT32 : (kind == 1 ? FA_FLOAT16 : FA_BFLOAT16);
      c.fp8 = kind == 3;
      cases.push_back(c);
    }
  return cases;
}

TEST(CpuKvcacheAppend, EqualsKvcachePerSequence) {
  for (const fa_backend backend : {FA_BACKEND_CPU_FLASH, FA_BACKEND_CPU_REFERENCE})
    for (const AppendCase& c : every_layout_and_dtype()) {
      auto rng = fa_test::make_rng("append " + c.to_string());
      AppendTensors got = make_append(c, rng);
      AppendTensors want = got;
      fa_options o = fa_test::options_for(backend);
      o.num_threads = 2;
      fa_stats stats{};
      o.stats = &stats;
      const Status s = flashattn::kvcache_append(got.args(), o);
      ASSERT_TRUE(s.ok()) << c.to_string() << ": " << s.to_string();
      EXPECT_EQ(std::string(stats.kernel).rfind("cpu kvcache_append", 0), 0u) << stats.kernel;
      EXPECT_EQ(stats.num_splits, 1);
      EXPECT_EQ(stats.scratch_bytes_peak, 0);
      append_per_sequence(c, want, FA_BACKEND_CPU_REFERENCE);
      EXPECT_TRUE(same_bytes(got.k_cache, want.k_cache)) << "k_cache, " << c.to_string();
      EXPECT_TRUE(same_bytes(got.v_cache, want.v_cache)) << "v_cache, " << c.to_string();
    }
}

// Sequences without new rows, a sequence filled to the capacity, a whole block written at once, one row into a
// partially filled block, and a sequence of length 0: every case writes exactly its rows.
TEST(CpuKvcacheAppend, EdgeLengths) {
  for (int block : {0, 16, 5}) {
    AppendCase c;
    c.block_size = block;
    c.capacity = 48;
    c.cached = {0, 47, 16, 10, 0};
    c.rows = {0, 1, 16, 1, 48};
    auto rng = fa_test::make_rng("append edges " + c.to_string());
    AppendTensors got = make_append(c, rng);
    AppendTensors want = got;
    ASSERT_TRUE(flashattn::kvcache_append(got.args(), fa_test::options_for(FA_BACKEND_CPU_FLASH)).ok());
    append_per_sequence(c, want, FA_BACKEND_CPU_REFERENCE);
    EXPECT_TRUE(same_bytes(got.k_cache, want.k_cache)) << c.to_string();
    EXPECT_TRUE(same_bytes(got.v_cache, want.v_cache)) << c.to_string();
  }
  // k_new / v_new rows past cu_seqlens_new[B] belong to no sequence: they are never written.
  for (int block : {0, 16}) {
    AppendCase c;
    c.block_size = block;
    auto rng = fa_test::make_rng("append spare rows " + c.to_string());
    AppendTensors got = make_append(c, rng);
    AppendTensors want = got;
    const int total = int(got.k_new.shape()[0]), spare = 5;
    HostTensor k_new({total + spare, c.heads_k, c.head_dim}, c.dtype), v_new({total + spare, c.heads_k, c.head_dim}, c.dtype);
    k_new.fill_normal(rng);
    v_new.fill_normal(rng);
    const int64_t row_elements = int64_t(c.heads_k) * c.head_dim;
    for (int64_t e = 0; e < total * row_elements; ++e) {
      k_new.set(e, got.k_new.get(e));
      v_new.set(e, got.v_new.get(e));
    }
    got.k_new = k_new;
    got.v_new = v_new;
    ASSERT_TRUE(flashattn::kvcache_append(got.args(), fa_test::options_for(FA_BACKEND_CPU_FLASH)).ok()) << c.to_string();
    append_per_sequence(c, want, FA_BACKEND_CPU_REFERENCE);
    EXPECT_TRUE(same_bytes(got.k_cache, want.k_cache)) << "spare rows, " << c.to_string();
    EXPECT_TRUE(same_bytes(got.v_cache, want.v_cache)) << "spare rows, " << c.to_string();
  }
  // No new rows at all (total_new = 0): nothing changes.
  AppendCase c;
  c.block_size = 16;
  c.rows = {0, 0, 0, 0};
  auto rng = fa_test::make_rng("append nothing");
  AppendTensors got = make_append(c, rng);
  const AppendTensors before = got;
  ASSERT_TRUE(flashattn::kvcache_append(got.args(), fa_test::options_for(FA_BACKEND_CPU_FLASH)).ok());
  EXPECT_TRUE(same_bytes(got.k_cache, before.k_cache));
  EXPECT_TRUE(same_bytes(got.v_cache, before.v_cache));
}

// The serving step: every sequence's new rows appended in one call, then one causal varlen forward over the paged
// cache (q rows cu_seqlens_new, keys cache_seqlens[b] + n_b through block_table) equals fa_kvcache per sequence.
TEST(CpuKvcacheAppend, MixedStepEqualsKvcachePerSequence) {
  for (int block : {16, 3}) {
    AppendCase c;
    c.block_size = block;
    c.cached = {0, 33, 7, 60, 12};
    c.rows = {20, 1, 0, 1, 9};  // two prefills (one from empty), two decodes, one idle sequence
    const int heads_q = 4, d = c.head_dim, B = c.batch();
    auto rng = fa_test::make_rng("mixed step " + c.to_string());
    AppendTensors step = make_append(c, rng);
    AppendTensors per_seq = step;
    const int total = int(step.k_new.shape()[0]);
    HostTensor q({total, heads_q, d}, FA_FLOAT32), out({total, heads_q, d}, FA_FLOAT32);
    q.fill_normal(rng);
    out.poison();
    std::vector<HostTensor> q_per_seq(static_cast<size_t>(B)), out_per_seq(static_cast<size_t>(B));
    for (int b = 0; b < B; ++b) {
      const int n = c.rows[size_t(b)], first = step.cu_seqlens_new.get_int(b);
      q_per_seq[size_t(b)] = HostTensor({1, n, heads_q, d}, FA_FLOAT32);
      for (int64_t e = 0; e < int64_t(n) * heads_q * d; ++e) q_per_seq[size_t(b)].set(e, q.get(int64_t(first) * heads_q * d + e));
    }
    append_per_sequence(c, per_seq, FA_BACKEND_CPU_FLASH, heads_q, &q_per_seq, &out_per_seq);

    fa_options o = fa_test::options_for(FA_BACKEND_CPU_FLASH);
    o.num_threads = 2;
    ASSERT_TRUE(flashattn::kvcache_append(step.args(), o).ok());
    EXPECT_TRUE(same_bytes(step.k_cache, per_seq.k_cache)) << c.to_string();
    EXPECT_TRUE(same_bytes(step.v_cache, per_seq.v_cache)) << c.to_string();
    HostTensor cu_k({B + 1}, FA_INT32);
    cu_k.set_int(0, 0);
    int max_k = 0;
    for (int b = 0; b < B; ++b) {
      const int keys = c.cached[size_t(b)] + c.rows[size_t(b)];
      cu_k.set_int(b + 1, cu_k.get_int(b) + keys);
      max_k = std::max(max_k, keys);
    }
    fa_forward_args f{};
    f.q = q.view();
    f.k = step.k_cache.view();
    f.v = step.v_cache.view();
    f.out = out.view();
    f.cu_seqlens_q = step.cu_seqlens_new.view();
    f.cu_seqlens_k = cu_k.view();
    f.max_seqlen_q = step.max_rows;
    f.max_seqlen_k = max_k;
    f.block_table = step.block_table.view();
    o.causal = 1;
    const Status s = flashattn::forward(f, o);
    ASSERT_TRUE(s.ok()) << s.to_string();
    for (int b = 0; b < B; ++b) {
      const int n = c.rows[size_t(b)], first = step.cu_seqlens_new.get_int(b);
      if (n == 0) continue;
      HostTensor got({1, n, heads_q, d}, FA_FLOAT32);
      for (int64_t e = 0; e < got.numel(); ++e) got.set(e, out.get(int64_t(first) * heads_q * d + e));
      const fa_test::ErrorStats err = fa_test::compare(got, out_per_seq[size_t(b)]);
      EXPECT_TRUE(fa_test::within_tolerance("mixed step, sequence " + std::to_string(b) + " [" + c.to_string() + "]",
                                            FA_FLOAT32, err, nullptr));
    }
  }
}

// ---- validation: each rule rejects the call with its message, and nothing is written ----
struct Expect {
  fa_status code;
  std::string prefix;
};

void check_rule(const std::string& what, const std::function<void(AppendCase&, AppendTensors&, fa_kvcache_append_args&)>& breaker,
                const Expect& e, bool fp8 = false) {
  AppendCase c;
  c.block_size = 16;
  c.fp8 = fp8;
  if (fp8) c.dtype = FA_BFLOAT16;
  auto rng = fa_test::make_rng("append rule " + what);
  AppendTensors t = make_append(c, rng);
  {
    AppendTensors valid = t;
    ASSERT_TRUE(flashattn::kvcache_append(valid.args(), fa_test::options_for(FA_BACKEND_CPU_FLASH)).ok()) << "baseline must be valid";
  }
  fa_kvcache_append_args a = t.args();
  breaker(c, t, a);
  const AppendTensors before = t;
  const Status s = flashattn::kvcache_append(a, fa_test::options_for(FA_BACKEND_CPU_FLASH));
  EXPECT_EQ(s.code(), e.code) << what << ": " << s.to_string();
  EXPECT_EQ(s.message().rfind(e.prefix, 0), 0u) << what << ": message \"" << s.message() << "\" does not start with \"" << e.prefix << "\"";
  EXPECT_TRUE(same_bytes(t.k_cache, before.k_cache)) << what << ": k_cache written";
  EXPECT_TRUE(same_bytes(t.v_cache, before.v_cache)) << what << ": v_cache written";
}

constexpr fa_status kInvalid = FA_ERROR_INVALID_ARGUMENT;
using Breaker = std::function<void(AppendCase&, AppendTensors&, fa_kvcache_append_args&)>;

TEST(CpuKvcacheAppend, Validation) {
  // make_append's valid call: B = 4, cached {0, 5, 17, 40} + new {3, 0, 16, 1} (cu_seqlens_new {0, 3, 3, 19, 20}),
  // Hk = 2, D = 64, capacity 96 (6 blocks of 16), float32.
  const std::vector<std::pair<std::string, std::pair<Breaker, Expect>>> rules = {
      {"no cu_seqlens_new", {[](auto&, auto&, auto& a) { a.cu_seqlens_new = fa_tensor{}; }, {kInvalid, "cu_seqlens_new: required tensor is missing"}}},
      {"cu_seqlens_new 2-D", {[](auto&, auto&, auto& a) { a.cu_seqlens_new.ndim = 2; }, {kInvalid, "cu_seqlens_new: expected 1 dimensions (B+1)"}}},
      {"cu_seqlens_new not at 0", {[](auto&, auto& t, auto&) { t.cu_seqlens_new.set_int(0, 1); }, {kInvalid, "cu_seqlens_new: must start at 0, got 1"}}},
      {"cu_seqlens_new decreasing", {[](auto&, auto& t, auto&) { t.cu_seqlens_new.set_int(2, 2); }, {kInvalid, "cu_seqlens_new: must be non-decreasing, but entry 2 < entry 1"}}},
      {"cu_seqlens_new past k_new", {[](auto&, auto& t, auto&) { t.cu_seqlens_new.set_int(4, 21); }, {kInvalid, "cu_seqlens_new: last entry 21 exceeds the 20 rows of the tensor"}}},
      {"a sequence over max_seqlen_new", {[](auto&, auto&, auto& a) { a.max_seqlen_new = 15; }, {kInvalid, "cu_seqlens_new: sequence 2 has length 16 > max_seqlen_new = 15"}}},
      {"negative max_seqlen_new", {[](auto&, auto&, auto& a) { a.max_seqlen_new = -1; }, {kInvalid, "max_seqlen_new: must be >= 0, got -1"}}},
      {"no cache_seqlens", {[](auto&, auto&, auto& a) { a.cache_seqlens = fa_tensor{}; }, {kInvalid, "cache_seqlens: required tensor is missing"}}},
      {"cache_seqlens B", {[](auto&, auto&, auto& a) { a.cache_seqlens.shape[0] = 3; }, {kInvalid, "cache_seqlens: dimension 0 (B) must be 4 like cu_seqlens_new"}}},
      {"overflow", {[](auto&, auto& t, auto&) { t.cache_seqlens.set_int(2, 81); }, {kInvalid, "cache_seqlens: entry 2 = 81 plus its 16 new rows must be in [0, 96]"}}},
      {"negative length", {[](auto&, auto& t, auto&) { t.cache_seqlens.set_int(1, -1); }, {kInvalid, "cache_seqlens: entry 1 = -1 plus its 0 new rows"}}},
      {"bad block id written", {[](auto&, auto& t, auto&) { t.block_table.set_int(2 * 6 + 2, 99); }, {kInvalid, "block_table: entry (2, 2) = 99 is not a block id in [0, 27)"}}},
      {"block table B", {[](auto&, auto&, auto& a) { a.block_table.shape[0] = 2; }, {kInvalid, "block_table: dimension 0 (B) must be 4 like cu_seqlens_new"}}},
      {"k_new dtype", {[](auto&, auto&, auto& a) { a.k_new.dtype = FA_FLOAT16; }, {kInvalid, "k_new: dtype must match k_cache (float32), got float16"}}},
      {"k_new 4-D", {[](auto&, auto&, auto& a) { a.k_new.ndim = 4; }, {kInvalid, "k_new: expected 3 dimensions (total_new, Hk, D)"}}},
      {"k_new heads", {[](auto&, auto&, auto& a) { a.k_new.shape[1] = 1; }, {kInvalid, "k_new: dimension 1 (Hk) must be 2 like k_cache"}}},
      {"k_new D", {[](auto&, auto&, auto& a) { a.k_new.shape[2] = 32; }, {kInvalid, "k_new: dimension 2 (D) must be 64 like k_cache"}}},
      {"v_new rows", {[](auto&, auto&, auto& a) { a.v_new.shape[0] = 19; }, {kInvalid, "v_new: dimension 0 (total_new) must be 20 like k_new"}}},
      {"v_cache heads", {[](auto&, auto&, auto& a) { a.v_cache.shape[2] = 1; }, {kInvalid, "v_cache: dimension 2 (Hk) must be 2 like k_cache"}}},
      {"cache 3-D", {[](auto&, auto& t, auto& a) { a.k_cache = fa_test::host_view(t.k_cache.data(), FA_FLOAT32, {27 * 16, 2, 64}, {128, 64, 1}); }, {kInvalid, "k_cache: expected 4 dimensions (num_blocks, block_size, Hk, D)"}}},
      {"scale on a 16-bit cache", {[](auto&, auto&, auto& a) { a.k_scale = 0.5f; }, {kInvalid, "k_scale: applies to a float8_e4m3 cache only"}}},
  };
  for (const auto& [what, rule] : rules) check_rule(what, rule.first, rule.second);
  // The dtype check of v_new names k_new, its reference (v_new float32 like k_new passes; bfloat16 does not).
  check_rule("v_new dtype names k_new", [](auto&, auto&, auto& a) { a.v_new.dtype = FA_BFLOAT16; },
             {kInvalid, "v_new: dtype must match k_new (float32), got bfloat16"});
  check_rule("v_new device", [](auto&, auto&, auto& a) { a.v_new.device = FA_DEVICE_CUDA; },
             {kInvalid, "v_new: must be on the device of k_new"});
  // A contiguous cache holds one entry per sequence.
  check_rule("contiguous B", [](auto&, auto& t, auto& a) {
    a.block_table = fa_tensor{};
    a.k_cache = fa_test::host_view(t.k_cache.data(), FA_FLOAT32, {3, 96, 2, 64}, {96 * 128, 128, 64, 1});
    a.v_cache = a.k_cache;
  }, {kInvalid, "k_cache: dimension 0 (B) must be 4 like cu_seqlens_new"});
  // FP8 caches: 16-bit rows, scales > 0.
  check_rule("fp8 scale", [](auto&, auto&, auto& a) { a.k_scale = 0.f; }, {kInvalid, "k_scale: must be finite and > 0 with a float8_e4m3 cache"}, true);
  check_rule("fp8 rows float32", [](auto&, auto&, auto& a) { a.k_new.dtype = FA_FLOAT32; },
             {kInvalid, "k_new: dtype must be float16 or bfloat16 with a float8_e4m3 cache, got float32"}, true);
  check_rule("fp8 one cache", [](auto&, auto&, auto& a) { a.v_cache.dtype = FA_BFLOAT16; },
             {kInvalid, "v_cache: an FP8 cache needs k_cache and v_cache both float8_e4m3, got bfloat16"}, true);
  // A bad id in a block that no new row goes to is never read or written: accepted (sequence 3's block 0 holds
  // rows 0-15, below its 40 cached rows; sequence 1 appends nothing, so none of its blocks is checked).
  {
    AppendCase c;
    c.block_size = 16;
    auto rng = fa_test::make_rng("append unwritten block");
    AppendTensors t = make_append(c, rng);
    t.block_table.set_int(3 * 6 + 0, -5);
    for (int n = 0; n < 6; ++n) t.block_table.set_int(1 * 6 + n, 1000);
    const Status s = flashattn::kvcache_append(t.args(), fa_test::options_for(FA_BACKEND_CPU_FLASH));
    EXPECT_TRUE(s.ok()) << s.to_string();
  }
  // The C ABI: a null args pointer.
  fa_error error{};
  EXPECT_EQ(fa_kvcache_append(nullptr, nullptr, &error), kInvalid);
  EXPECT_EQ(std::string(error.message), "args: must not be NULL");
}

// ---- the CUDA append against the CPU's bytes ----
#if defined(FLASHATTN_WITH_CUDA)
class DeviceCopies {
 public:
  ~DeviceCopies() {
    for (auto& entry : buffers_) cudaFree(entry.second);
  }
  fa_tensor upload(HostTensor& t) {
    void*& device = buffers_[&t];
    if (device == nullptr) {
      EXPECT_EQ(cudaMalloc(&device, size_t(std::max<int64_t>(t.storage_bytes(), 16))), cudaSuccess);
    }
    EXPECT_EQ(cudaMemcpy(device, t.data(), size_t(t.storage_bytes()), cudaMemcpyHostToDevice), cudaSuccess);
    return t.view_on(device, FA_DEVICE_CUDA, 0);
  }
  void download(HostTensor& t) {
    EXPECT_EQ(cudaMemcpy(t.data(), buffers_.at(&t), size_t(t.storage_bytes()), cudaMemcpyDeviceToHost), cudaSuccess);
  }

 private:
  std::map<const HostTensor*, void*> buffers_;
};

// Runs t's call on the GPU (every tensor uploaded) and downloads both caches into t.
Status run_cuda(AppendTensors& t, bool check_indices) {
  DeviceCopies d;
  fa_kvcache_append_args a = t.args();
  a.k_cache = d.upload(t.k_cache);
  a.v_cache = d.upload(t.v_cache);
  if (!t.block_table.shape().empty()) a.block_table = d.upload(t.block_table);
  a.cache_seqlens = d.upload(t.cache_seqlens);
  a.k_new = d.upload(t.k_new);
  a.v_new = d.upload(t.v_new);
  a.cu_seqlens_new = d.upload(t.cu_seqlens_new);
  a.check_indices = check_indices ? 1 : 0;
  Status s = flashattn::kvcache_append(a, fa_test::options_for(FA_BACKEND_CUDA));
  const cudaError_t sync = cudaDeviceSynchronize();
  if (s.ok() && sync != cudaSuccess) s = Status(FA_ERROR_DEVICE, std::string("kernel failed: ") + cudaGetErrorString(sync));
  d.download(t.k_cache);
  d.download(t.v_cache);
  return s;
}
#else
Status run_cuda(AppendTensors&, bool) { return Status(FA_ERROR_NOT_COMPILED, "no CUDA in this build"); }
#endif

TEST(CudaKvcacheAppend, WritesTheCpuBytes) {
  SKIP_WITHOUT_GPU();
  for (AppendCase c : every_layout_and_dtype()) {
    if (c.dtype == FA_FLOAT32) continue;  // the CUDA kernels take 16-bit rows (the rule is checked below)
    for (int d : {64, 128}) {
      c.head_dim = d;
      auto rng = fa_test::make_rng("cuda append " + c.to_string());
      AppendTensors gpu = make_append(c, rng);
      AppendTensors cpu = gpu;
      ASSERT_TRUE(flashattn::kvcache_append(cpu.args(), fa_test::options_for(FA_BACKEND_CPU_FLASH)).ok());
      for (bool checked : {false, true}) {
        AppendTensors run = gpu;
        const Status s = run_cuda(run, checked);
        ASSERT_TRUE(s.ok()) << c.to_string() << ": " << s.to_string();
        EXPECT_TRUE(same_bytes(run.k_cache, cpu.k_cache)) << "k_cache, checked=" << checked << ", " << c.to_string();
        EXPECT_TRUE(same_bytes(run.v_cache, cpu.v_cache)) << "v_cache, checked=" << checked << ", " << c.to_string();
      }
    }
  }
  AppendCase f32;
  auto rng = fa_test::make_rng("cuda append float32");
  AppendTensors t = make_append(f32, rng);
  const Status s = run_cuda(t, false);
  EXPECT_EQ(s.code(), FA_ERROR_UNSUPPORTED) << s.to_string();
  EXPECT_EQ(s.message().rfind("k_new: dtype float32 is not supported by the cuda append kernel", 0), 0u) << s.message();
}

// Index tensors in device memory: the checked mode names the first bad entry and writes nothing; without it a sequence
// whose entries are bad writes nothing, and the others write their rows.
TEST(CudaKvcacheAppend, BadDeviceIndices) {
  SKIP_WITHOUT_GPU();
  AppendCase c;
  c.block_size = 16;
  c.dtype = FA_BFLOAT16;
  c.head_dim = 128;
  struct Breakage {
    std::string what, message;
    std::function<void(AppendTensors&)> apply;
    int bad_sequence;
  };
  const std::vector<Breakage> breakages = {
      {"cu_seqlens_new not from 0", "cu_seqlens_new: must start at 0, got 1",
       [](AppendTensors& t) { t.cu_seqlens_new.set_int(0, 1); }, 0},
      {"cu_seqlens_new past k_new", "cu_seqlens_new: entries 3 and 4 = 19, 21 must be a run of k_new's 20 rows",
       [](AppendTensors& t) { t.cu_seqlens_new.set_int(4, 21); }, 3},
      {"too many rows for max_seqlen_new", "cu_seqlens_new: entries 2 and 3 = 3, 19",
       [](AppendTensors& t) { t.max_rows = 15; }, 2},
      {"overflow", "cache_seqlens: entry 2 = 81 plus its 16 new rows must be in [0, 96]",
       [](AppendTensors& t) { t.cache_seqlens.set_int(2, 81); }, 2},
      {"bad block id", "block_table: entry (2, 2) = 99 is not a block id in [0, 27)",
       [](AppendTensors& t) { t.block_table.set_int(2 * 6 + 2, 99); }, 2},
  };
  for (const Breakage& k : breakages) {
    auto rng = fa_test::make_rng("cuda append bad " + k.what);
    AppendTensors t = make_append(c, rng);
    AppendTensors good = t;
    ASSERT_TRUE(flashattn::kvcache_append(good.args(), fa_test::options_for(FA_BACKEND_CPU_FLASH)).ok());
    k.apply(t);
    const AppendTensors before = t;
    AppendTensors checked = t;
    const Status s = run_cuda(checked, true);
    EXPECT_EQ(s.code(), FA_ERROR_INVALID_ARGUMENT) << k.what << ": " << s.to_string();
    EXPECT_EQ(s.message().rfind(k.message, 0), 0u) << k.what << ": " << s.message();
    EXPECT_TRUE(same_bytes(checked.k_cache, before.k_cache)) << k.what << ": checked mode wrote k_cache";
    // Unchecked: OK, and the bad sequence's rows are not written (the bad block id: the rows of its good blocks are).
    AppendTensors unchecked = t;
    ASSERT_TRUE(run_cuda(unchecked, false).ok()) << k.what;
    const int64_t row_elems = int64_t(c.heads_k) * c.head_dim;
    for (int b = 0; b < c.batch(); ++b) {
      for (int j = c.cached[size_t(b)]; j < c.cached[size_t(b)] + c.rows[size_t(b)]; ++j) {
        const int32_t id = before.block_table.get_int(b * 6 + j / 16);
        if (id < 0 || id >= int32_t(t.k_cache.shape()[0])) continue;  // never written through
        const int64_t at = (int64_t(id) * 16 + j % 16) * row_elems;
        const HostTensor& want = (b == k.bad_sequence && k.what != "bad block id") ? before.k_cache : good.k_cache;
        for (int64_t e = 0; e < row_elems; ++e)
          ASSERT_EQ(unchecked.k_cache.get(at + e), want.get(at + e)) << k.what << ": sequence " << b << " row " << j;
      }
    }
  }
}

}  // namespace
