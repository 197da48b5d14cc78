// KV-cache attention on the CPU flash backend: append (with rotary) into contiguous and paged
// caches, attention over the cache, and split-KV, against the float64 reference on fresh inputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "core/dtype.hpp"
#include "core/fp8.hpp"
#include "kvcache_cases.hpp"
#include "testing.hpp"

namespace flashattn {
namespace {

using fa_test::HostTensor;
using fa_test::KvTensors;
using fa_test::make_kv;
using fa_test::same_bytes;

// The CPU tests' cases: smaller than the shared defaults, float32 unless a test says otherwise, 2 threads.
struct KvCase : fa_test::KvCase {
  KvCase() {
    heads_q = 4;
    head_dim = 64;
    dtype = FA_FLOAT32;
    num_threads = 2;
  }
};

fa_options kv_options(const KvCase& c, fa_backend backend, KvTensors& t) {
  fa_options o = fa_test::options_for(backend);
  o.causal = c.causal;
  o.window_left = c.window_left;
  o.window_right = c.window_right;
  o.softcap = c.softcap;
  o.softmax_scale = c.softmax_scale;  // a field of the shared case: never silently dropped here
  o.num_threads = c.num_threads;
  o.dropout_p = c.dropout_p;
  o.dropout_seed = 42;
  o.dropout_offset = 9;
  if (c.alibi) o.alibi_slopes = t.slopes.view();
  return o;
}

// Runs the case on the flash backend and on the reference, each on its own copy of the cache.
// The appended caches must be identical bit for bit (the same rotation in double, one rounding);
// out / lse within the float32 rule (16-bit cases: see HalfPrecisionAgainstOracle).
void expect_kvcache_like_reference(const KvCase& c, const std::string& what) {
  auto rng = fa_test::make_rng(what + c.to_string());
  KvTensors flash = make_kv(c, rng);
  KvTensors ref = flash;
  KvCase ref_case = c;
  fa_kvcache_args flash_args = flash.args(), ref_args = ref.args();
  flash_args.num_splits = c.num_splits;
  const Status fs = kvcache(flash_args, kv_options(c, FA_BACKEND_CPU_FLASH, flash));
  ASSERT_TRUE(fs.ok()) << what << ": " << fs.to_string();
  const Status rs = kvcache(ref_args, kv_options(ref_case, FA_BACKEND_CPU_REFERENCE, ref));
  ASSERT_TRUE(rs.ok()) << what << ": " << rs.to_string();
  EXPECT_TRUE(same_bytes(flash.k_cache, ref.k_cache)) << what << " k_cache after append [" << c.to_string() << "]";
  EXPECT_TRUE(same_bytes(flash.v_cache, ref.v_cache)) << what << " v_cache after append [" << c.to_string() << "]";
  const fa_test::ErrorStats out = fa_test::compare(flash.out, ref.out), lse = fa_test::compare(flash.lse, ref.lse);
  if (c.dtype == FA_FLOAT32) {
    EXPECT_TRUE(fa_test::within_tolerance(what + " out [" + c.to_string() + "]", FA_FLOAT32, out, nullptr));
  } else {  // both sides rounded once to the 16-bit output: a rounding step apart at most
    EXPECT_EQ(out.nan + out.mismatched_inf, 0) << what;
    EXPECT_LE(out.rel_l2, c.dtype == FA_BFLOAT16 ? 8e-3 : 1e-3) << what << " out [" << c.to_string() << "] " << out.to_string();
  }
  EXPECT_EQ(lse.nan + lse.mismatched_inf, 0) << what << " lse [" << c.to_string() << "] " << lse.to_string();
  EXPECT_LE(lse.rel_l2, c.dtype == FA_FLOAT32 ? 1e-5 : 1e-3) << what << " lse [" << c.to_string() << "] " << lse.to_string();
}

TEST(CpuKvcache, DecodeContiguousAndPaged) {
  for (const int block_size : {0, 1, 3, 16, 256}) {
    KvCase c;
    c.block_size = block_size;
    c.seqlen_new = 1;
    expect_kvcache_like_reference(c, "decode");
    c.causal = true;
    c.heads_k = 1;  // MQA, 4 heads in one tile
    expect_kvcache_like_reference(c, "decode causal mqa");
  }
}

// cache_batch_idx: sequence b reads and appends to slot idx[b] of a contiguous cache of more slots. The same call on
// the gathered cache (slot idx[b] copied to entry b) must give the same out and lse bit for bit and the same
// appended rows in those slots, and the other slots must stay as they were. Flash backend (1 and 3 splits) and
// the reference; fp32 and bf16.
TEST(CpuKvcache, CacheBatchIdxEqualsGatheredCache) {
  for (const fa_backend backend : {FA_BACKEND_CPU_FLASH, FA_BACKEND_CPU_REFERENCE})
    for (const fa_dtype dtype : {FA_FLOAT32, FA_BFLOAT16})
      for (const int splits : {1, 3}) {
        KvCase c;
        c.batch = 3;
        c.cached = {37, 300, 0};
        c.seqlen_new = 2;
        c.seqlen_q = 2;
        c.causal = true;
        c.rotary = 1;
        c.dtype = dtype;
        c.num_splits = splits;
        const std::string what = std::string(backend == FA_BACKEND_CPU_FLASH ? "flash " : "reference ") + c.to_string();
        auto rng = fa_test::make_rng("slots" + what);
        KvTensors gathered = make_kv(c, rng);
        constexpr int kSlots = 5;
        const int32_t slot_of[3] = {4, 0, 2};
        const int64_t entry = int64_t(c.capacity) * c.heads_k * c.head_dim;  // elements of one batch entry
        KvTensors slotted = gathered;
        slotted.k_cache = HostTensor({kSlots, c.capacity, c.heads_k, c.head_dim}, c.dtype);
        slotted.v_cache = HostTensor({kSlots, c.capacity, c.heads_k, c.head_dim}, c.dtype);
        slotted.k_cache.fill_normal(rng);
        slotted.v_cache.fill_normal(rng);
        HostTensor slots({c.batch}, FA_INT32);
        for (int b = 0; b < c.batch; ++b) {
          slots.set_int(b, slot_of[b]);
          for (int64_t x = 0; x < entry; ++x) {
            slotted.k_cache.set(slot_of[b] * entry + x, gathered.k_cache.get(b * entry + x));
            slotted.v_cache.set(slot_of[b] * entry + x, gathered.v_cache.get(b * entry + x));
          }
        }
        const KvTensors before = slotted;
        fa_kvcache_args ga = gathered.args(), sa = slotted.args();
        sa.cache_batch_idx = slots.view();
        ga.num_splits = sa.num_splits = splits;
        const Status gs = kvcache(ga, kv_options(c, backend, gathered));
        ASSERT_TRUE(gs.ok()) << what << ": " << gs.to_string();
        const Status ss = kvcache(sa, kv_options(c, backend, slotted));
        ASSERT_TRUE(ss.ok()) << what << ": " << ss.to_string();
        EXPECT_TRUE(same_bytes(slotted.out, gathered.out)) << what << ": out";
        EXPECT_TRUE(same_bytes(slotted.lse, gathered.lse)) << what << ": lse";
        for (int slot = 0; slot < kSlots; ++slot) {
          const int b = int(std::find(slot_of, slot_of + 3, slot) - slot_of);  // 3: no sequence
          for (int64_t x = 0; x < entry; ++x) {
            const int64_t at = slot * entry + x;
            ASSERT_EQ(slotted.k_cache.get(at), b < 3 ? gathered.k_cache.get(b * entry + x) : before.k_cache.get(at))
                << what << ": k_cache slot " << slot << " element " << x;
            ASSERT_EQ(slotted.v_cache.get(at), b < 3 ? gathered.v_cache.get(b * entry + x) : before.v_cache.get(at))
                << what << ": v_cache slot " << slot << " element " << x;
          }
        }
      }
}

TEST(CpuKvcache, RotaryHalvesAndInterleaved) {
  for (const int rotary : {1, 2})
    for (const int rotary_dim : {0, 32})
      for (const bool causal : {false, true}) {
        KvCase c;
        c.rotary = rotary;
        c.rotary_dim = rotary_dim;
        c.causal = causal;
        c.seqlen_q = 4;
        c.seqlen_new = 4;
        c.block_size = causal ? 16 : 0;
        expect_kvcache_like_reference(c, "rotary");
      }
  KvCase windowed;  // windows give per-token positions too
  windowed.rotary = 2;
  windowed.seqlen_q = 3;
  windowed.seqlen_new = 5;
  windowed.window_left = 50;
  windowed.window_right = 2;
  expect_kvcache_like_reference(windowed, "rotary window");
  KvCase bf16 = windowed;
  bf16.dtype = FA_BFLOAT16;
  expect_kvcache_like_reference(bf16, "rotary bf16");
}

TEST(CpuKvcache, OptionsAndShapes) {
  KvCase base;
  base.seqlen_q = 7;
  base.seqlen_new = 7;
  base.block_size = 3;
  std::vector<KvCase> cases;
  for (int n = 0; n < 8; ++n) cases.push_back(base);
  cases[0].causal = true;
  cases[1].window_left = 20;
  cases[1].window_right = 0;
  cases[2].softcap = 2.f;
  cases[3].alibi = true;
  cases[3].causal = true;
  cases[4].dropout_p = 0.2f;
  cases[5].heads_k = 4;  // MHA
  cases[5].head_dim = 128;
  cases[6].heads_q = 8;  // GQA 8
  cases[6].heads_k = 1;
  cases[6].seqlen_q = 1;
  cases[6].head_dim = 40;
  cases[7].seqlen_q = 70;  // chunked prefill: more than one query tile
  cases[7].seqlen_new = 70;
  cases[7].causal = true;
  for (const KvCase& c : cases) expect_kvcache_like_reference(c, "options");
}

// Sequences of length 0 (nothing cached, nothing appended: out = 0, lse = -inf) and 1.
TEST(CpuKvcache, EmptyAndSingleKeySequences) {
  KvCase c;
  c.batch = 3;
  c.cached = {0, 1, 0};
  c.seqlen_new = 0;
  expect_kvcache_like_reference(c, "lengths 0 and 1");
  auto rng = fa_test::make_rng("empty");
  KvTensors t = make_kv(c, rng);
  ASSERT_TRUE(kvcache(t.args(), kv_options(c, FA_BACKEND_CPU_FLASH, t)).ok());
  for (const int b : {0, 2})
    for (int h = 0; h < c.heads_q; ++h) {
      EXPECT_EQ(t.lse.get(int64_t(b) * c.heads_q + h), -std::numeric_limits<double>::infinity());
      for (int e = 0; e < c.head_dim; ++e) EXPECT_EQ(t.out.get((int64_t(b) * c.heads_q + h) * c.head_dim + e), 0.0);
    }
  c.seqlen_new = 1;  // the append alone gives each sequence 1 or 2 keys
  c.block_size = 1;
  expect_kvcache_like_reference(c, "appended to empty");
}

// Every split count gives the same attention (to float rounding of the merge) as no split.
TEST(CpuKvcache, EverySplitCountAgrees) {
  for (const int block_size : {0, 16}) {
    KvCase c;
    c.batch = 1;
    c.heads_q = 4;
    c.heads_k = 1;
    c.capacity = 1100;
    c.cached = {1037};
    c.seqlen_new = 2;
    c.seqlen_q = 2;
    c.causal = true;
    c.block_size = block_size;
    auto rng = fa_test::make_rng("splits");
    const KvTensors pristine = make_kv(c, rng);
    HostTensor out1, lse1;
    for (const int splits : {1, 2, 3, 4, 5, 8, 13, 64}) {
      KvTensors t = pristine;
      fa_kvcache_args a = t.args();
      a.num_splits = splits;
      fa_stats stats{};
      fa_options o = kv_options(c, FA_BACKEND_CPU_FLASH, t);
      o.stats = &stats;
      ASSERT_TRUE(kvcache(a, o).ok());
      EXPECT_EQ(stats.num_splits, splits);
      if (splits == 1) {
        out1 = t.out;
        lse1 = t.lse;
        continue;
      }
      const fa_test::ErrorStats out = fa_test::compare(t.out, out1), lse = fa_test::compare(t.lse, lse1);
      EXPECT_LE(out.rel_l2, 1e-6) << splits << " splits: " << out.to_string();
      EXPECT_LE(lse.max_abs, 1e-5) << splits << " splits: " << lse.to_string();
      c.num_splits = splits;
      expect_kvcache_like_reference(c, "splits " + std::to_string(splits));
    }
  }
}

// plan: splits for a decode step with few heads; the planned workspace makes the call allocate
// nothing; a smaller one is an error naming the workspace.
TEST(CpuKvcache, PlanAndWorkspace) {
  KvCase c;
  c.batch = 1;
  c.heads_q = 2;
  c.heads_k = 2;
  c.capacity = 4096;
  c.cached = {4000};
  c.seqlen_new = 1;
  c.num_threads = 8;
  auto rng = fa_test::make_rng("plan");
  KvTensors t = make_kv(c, rng);
  KvTensors ref = t;
  fa_options o = kv_options(c, FA_BACKEND_CPU_FLASH, t);
  fa_kvcache_args a = t.args();
  fa_kvcache_plan plan{};
  ASSERT_TRUE(kvcache_plan(a, o, &plan).ok());
  EXPECT_GT(plan.num_splits, 1) << "2 heads, 1 query, 8 threads, 4001 keys: split-KV expected";
  EXPECT_GT(plan.workspace_bytes, 0);
  // Any start address works, and the call writes nothing past the workspace it is given: guard bytes follow it.
  constexpr int kGuard = 256;
  HostTensor workspace({plan.workspace_bytes + 1 + kGuard}, FA_UINT8);
  uint8_t* const guard = static_cast<uint8_t*>(workspace.data()) + 1 + plan.workspace_bytes;
  std::memset(workspace.data(), 0, size_t(plan.workspace_bytes + 1));
  std::memset(guard, 0xA5, kGuard);
  a.num_splits = plan.num_splits;
  a.workspace = workspace.view();
  a.workspace.data = static_cast<char*>(workspace.data()) + 1;
  a.workspace.shape[0] = plan.workspace_bytes;
  fa_stats stats{};
  o.stats = &stats;
  ASSERT_TRUE(kvcache(a, o).ok());
  EXPECT_EQ(stats.scratch_bytes_peak, 0) << "allocated despite the planned workspace";
  EXPECT_TRUE(std::all_of(guard, guard + kGuard, [](uint8_t byte) { return byte == 0xA5; }))
      << "the call wrote past the end of its workspace";
  EXPECT_EQ(stats.num_splits, plan.num_splits);
  ASSERT_TRUE(kvcache(ref.args(), kv_options(c, FA_BACKEND_CPU_REFERENCE, ref)).ok());
  EXPECT_TRUE(fa_test::within_tolerance("planned", FA_FLOAT32, fa_test::compare(t.out, ref.out), nullptr));
  // Without a workspace the call allocates what the plan says (and reports it).
  KvTensors again = make_kv(c, rng);
  fa_kvcache_args b = again.args();
  fa_options o2 = kv_options(c, FA_BACKEND_CPU_FLASH, again);
  o2.stats = &stats;
  ASSERT_TRUE(kvcache(b, o2).ok());
  EXPECT_EQ(stats.num_splits, plan.num_splits);
  EXPECT_GT(stats.scratch_bytes_peak, 0);
  EXPECT_LE(stats.scratch_bytes_peak, plan.workspace_bytes);
  // Many heads: one split.
  KvCase wide = c;
  wide.batch = 4;
  wide.cached = {10, 20, 30, 40};
  wide.heads_q = wide.heads_k = 8;
  KvTensors w = make_kv(wide, rng);
  fa_kvcache_plan wide_plan{};
  ASSERT_TRUE(kvcache_plan(w.args(), kv_options(wide, FA_BACKEND_CPU_FLASH, w), &wide_plan).ok());
  EXPECT_EQ(wide_plan.num_splits, 1);
  // Left padding: the split heuristic counts the keys, not the rows: 4001 rows but 201 keys is one split.
  KvCase padded = c;
  padded.leftpad = {3800};
  KvTensors pt = make_kv(padded, rng);
  fa_kvcache_plan padded_plan{};
  ASSERT_TRUE(kvcache_plan(pt.args(), kv_options(padded, FA_BACKEND_CPU_FLASH, pt), &padded_plan).ok());
  EXPECT_EQ(padded_plan.num_splits, 1) << "201 keys after the padding: no split of 256 keys or more";
  // Too small a workspace.
  a.workspace.shape[0] = plan.workspace_bytes - 1;
  const Status s = kvcache(a, o);
  EXPECT_EQ(s.code(), FA_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(s.message().rfind("workspace:", 0), 0u) << s.message();
}

// After the append, attending over the cache is attending over the concatenation [cache; new].
TEST(CpuKvcache, AppendEqualsAttentionOverConcatenation) {
  KvCase c;
  c.seqlen_q = 5;
  c.seqlen_new = 5;
  c.causal = true;
  c.cached = {0, 123};
  c.capacity = 200;
  auto rng = fa_test::make_rng("concat");
  KvTensors t = make_kv(c, rng);
  const HostTensor k_before = t.k_cache, v_before = t.v_cache;
  fa_options o = kv_options(c, FA_BACKEND_CPU_FLASH, t);
  ASSERT_TRUE(kvcache(t.args(), o).ok());
  const int hk = c.heads_k, d = c.head_dim;
  for (int b = 0; b < c.batch; ++b) {
    const int sk = c.cached[size_t(b)] + c.seqlen_new;
    HostTensor k({1, sk, hk, d}, FA_FLOAT32), v({1, sk, hk, d}, FA_FLOAT32), q({1, c.seqlen_q, c.heads_q, d}, FA_FLOAT32),
        out({1, c.seqlen_q, c.heads_q, d}, FA_FLOAT32);
    for (int j = 0; j < sk; ++j)
      for (int x = 0; x < hk * d; ++x) {
        const bool fresh = j >= c.cached[size_t(b)];
        const int64_t cache_index = (int64_t(b) * c.capacity + j) * hk * d + x;
        const int64_t new_index = (int64_t(b) * c.seqlen_new + (j - c.cached[size_t(b)])) * hk * d + x;
        k.set(int64_t(j) * hk * d + x, fresh ? t.k_new.get(new_index) : k_before.get(cache_index));
        v.set(int64_t(j) * hk * d + x, fresh ? t.v_new.get(new_index) : v_before.get(cache_index));
        ASSERT_EQ(t.k_cache.get(cache_index), k.get(int64_t(j) * hk * d + x)) << "k not appended at " << j;
        ASSERT_EQ(t.v_cache.get(cache_index), v.get(int64_t(j) * hk * d + x)) << "v not appended at " << j;
      }
    for (int x = 0; x < c.seqlen_q * c.heads_q * d; ++x) q.set(x, t.q.get(int64_t(b) * c.seqlen_q * c.heads_q * d + x));
    fa_forward_args f{};
    f.q = q.view();
    f.k = k.view();
    f.v = v.view();
    f.out = out.view();
    fa_options fo = fa_test::options_for(FA_BACKEND_CPU_FLASH);
    fo.causal = 1;
    ASSERT_TRUE(forward(f, fo).ok());
    std::vector<double> cached_out(static_cast<size_t>(out.numel()));
    for (int64_t x = 0; x < out.numel(); ++x) cached_out[size_t(x)] = t.out.get(int64_t(b) * out.numel() + x);
    EXPECT_LE(fa_test::compare(cached_out, out.to_double()).rel_l2, 1e-6) << "sequence " << b;
  }
  // rows past cached + new are untouched
  for (int b = 0; b < c.batch; ++b)
    for (int j = c.cached[size_t(b)] + c.seqlen_new; j < c.capacity; ++j)
      for (int x = 0; x < hk * d; ++x) {
        const int64_t index = (int64_t(b) * c.capacity + j) * hk * d + x;
        ASSERT_EQ(t.k_cache.get(index), k_before.get(index));
        ASSERT_EQ(t.v_cache.get(index), v_before.get(index));
      }
}

// Runs the case on the flash backend, then judges its out / lse against the float64 oracle under the
// same-precision rule. Without rotary, attention over the appended cache is a varlen forward over
// [cache; new] (bottom-right aligned the same way), which fa_test's oracle knows how to judge; the keys and
// values are read back from the cache as stored (an FP8 cache dequantised: with power-of-two scales the
// values are exact in the 16-bit dtype, so the oracle and the naive baseline see exactly what the cache holds).
void expect_kvcache_like_oracle(const KvCase& c, const std::string& what) {
  auto rng = fa_test::make_rng(what + c.to_string());
  KvTensors t = make_kv(c, rng);
  const fa_options o = kv_options(c, FA_BACKEND_CPU_FLASH, t);
  ASSERT_TRUE(kvcache(t.args(), o).ok());
  fa_test::Problem pr;
  pr.batch = c.batch;
  pr.heads_q = c.heads_q;
  pr.heads_k = c.heads_k;
  pr.head_dim = c.head_dim;
  pr.dtype = c.dtype;
  pr.varlen_q.assign(size_t(c.batch), c.seqlen_q);
  // the keys of sequence b are rows [leftpad, cached + new) of its cache
  for (int b = 0; b < c.batch; ++b) pr.varlen_k.push_back(c.cached[size_t(b)] + c.seqlen_new - c.floor_of(b));
  fa_test::Tensors v = fa_test::make_tensors(pr, rng);
  const double k_scale = c.fp8 ? c.k_scale : 1.0, v_scale = c.fp8 ? c.v_scale : 1.0;
  const int row = c.heads_k * c.head_dim;
  int64_t k0 = 0;
  for (int b = 0; b < c.batch; ++b) {
    for (int j = 0; j < pr.varlen_k[size_t(b)]; ++j) {
      const int row_j = j + c.floor_of(b);  // the key's row in the cache
      int64_t src_row = int64_t(b) * c.capacity + row_j;
      if (c.block_size > 0)
        src_row = int64_t(t.block_table.get_int(int64_t(b) * t.block_table.shape()[1] + row_j / c.block_size)) * c.block_size +
                  row_j % c.block_size;
      for (int x = 0; x < row; ++x) {
        const double kv = t.k_cache.get(src_row * row + x) * k_scale, vv = t.v_cache.get(src_row * row + x) * v_scale;
        v.k.set((k0 + j) * row + x, kv);
        v.v.set((k0 + j) * row + x, vv);
        ASSERT_EQ(v.k.get((k0 + j) * row + x), kv) << "the test needs dequantised values exact in the 16-bit dtype";
        ASSERT_EQ(v.v.get((k0 + j) * row + x), vv) << "the test needs dequantised values exact in the 16-bit dtype";
      }
    }
    k0 += pr.varlen_k[size_t(b)];
  }
  for (int64_t x = 0; x < v.q.numel(); ++x) v.q.set(x, t.q.get(x));
  fa_options oracle_options = fa_test::options_for(FA_BACKEND_CPU_REFERENCE);
  oracle_options.causal = c.causal;
  const fa_test::Oracle oracle = fa_test::run_oracle(v, oracle_options, false);
  // kvcache's out (B, Sq, Hq, D) and lse (B, Hq, Sq) in varlen layout (B*Sq, Hq, D), (Hq, B*Sq)
  for (int64_t x = 0; x < v.out.numel(); ++x) v.out.set(x, t.out.get(x));
  for (int b = 0; b < c.batch; ++b)
    for (int h = 0; h < c.heads_q; ++h)
      for (int i = 0; i < c.seqlen_q; ++i)
        v.lse.set(int64_t(h) * c.batch * c.seqlen_q + b * c.seqlen_q + i, t.lse.get((int64_t(b) * c.heads_q + h) * c.seqlen_q + i));
  fa_test::expect_forward_matches(what + " [" + c.to_string() + "]", v, oracle, c.dtype);
}

TEST(CpuKvcache, HalfPrecisionAgainstOracle) {
  for (const fa_dtype dtype : {FA_FLOAT16, FA_BFLOAT16})
    for (const int block_size : {0, 16}) {
      KvCase c;
      c.dtype = dtype;
      c.block_size = block_size;
      c.seqlen_q = 3;
      c.seqlen_new = 3;
      c.causal = true;
      c.cached = {200, 57};
      expect_kvcache_like_oracle(c, "kvcache 16-bit block " + std::to_string(block_size));
    }
}

// The few-rows kernels (cpu/flash/few_rows.hpp) take the decode tiles: every row-block shape they cut a tile into
// (4 rows x 2 keys, 3 x 2, 2 x 4, 1 x 8, and single keys at a tile's end), head dims with a tail past the last
// multiple of 8 (12, 130), caches whose last 256-key tile ends off the 8-key grid (700 = 2 x 256 + 188), paged
// blocks of 3 and 16 rows, 1 and 3 splits, each storage type; the path is checked by name in the call's stats.
// 16-bit and FP8 caches against the float64 oracle; float32 against the reference backend.
TEST(CpuKvcache, FewRowKernelsEveryRowBlockAndTail) {
  struct Shape {
    int heads_q, seqlen_q;
  };
  const Shape shapes[] = {{1, 1}, {2, 1}, {3, 1}, {4, 1}, {5, 1}, {7, 1}, {8, 1}, {3, 3}, {5, 3}, {8, 4}};
  for (const fa_dtype dtype : {FA_FLOAT32, FA_BFLOAT16, FA_FLOAT16})
    for (const bool fp8 : {false, true}) {
      if (fp8 && dtype == FA_FLOAT32) continue;  // an FP8 cache serves 16-bit queries
      for (const Shape& shape : shapes) {
        const int rows = shape.heads_q * shape.seqlen_q;  // one K/V head: the whole group in one tile
        if (rows > (dtype == FA_FLOAT32 && !fp8 ? 8 : 32)) continue;  // the BLAS path's (other tests)
        for (const int head_dim : {12, 130}) {
          KvCase c;
          c.dtype = dtype;
          c.fp8 = fp8;
          c.k_scale = 0.0625f;  // powers of two: the dequantised cache is exact in the oracle's 16-bit tensors
          c.v_scale = 0.03125f;
          c.heads_q = shape.heads_q;
          c.heads_k = 1;
          c.seqlen_q = c.seqlen_new = shape.seqlen_q;
          c.causal = shape.seqlen_q > 1;
          c.head_dim = head_dim;
          c.cached = {700 - shape.seqlen_q, 19};
          c.capacity = 720;
          c.block_size = head_dim == 12 ? 3 : 16;
          c.num_splits = head_dim == 12 ? 1 : 3;
          const std::string what = "few-rows " + std::string(dtype_name(dtype)) + (fp8 ? " fp8" : "");
          if (dtype == FA_FLOAT32) expect_kvcache_like_reference(c, what);
          else expect_kvcache_like_oracle(c, what);
          c.block_size = 0;  // and contiguous
          if (dtype == FA_FLOAT32) expect_kvcache_like_reference(c, what + " contiguous");
          else expect_kvcache_like_oracle(c, what + " contiguous");

          auto rng = fa_test::make_rng(what + c.to_string());
          KvTensors t = make_kv(c, rng);
          fa_options o = kv_options(c, FA_BACKEND_CPU_FLASH, t);
          fa_stats stats{};
          o.stats = &stats;
          ASSERT_TRUE(kvcache(t.args(), o).ok());
          EXPECT_NE(std::string(stats.kernel).find("few-rows"), std::string::npos) << what << ": " << stats.kernel;
        }
      }
    }
}

// cache_leftpad: sequence b's keys are cache rows [leftpad[b], cached[b] + new); the padding rows hold NaN (make_kv).
// Against the float64 oracle over exactly those keys (causal alignment unchanged: positions are the rows'), and the
// flash backend against the reference with the options the oracle does not take (rotary at the rows' positions,
// windows, ALiBi, softcap), contiguous and paged, every split count.
TEST(CpuKvcache, LeftPaddingAgainstOracle) {
  for (const int block_size : {0, 1, 3, 16})
    for (const fa_dtype dtype : {FA_FLOAT32, FA_BFLOAT16}) {
      KvCase c;
      c.batch = 4;
      c.cached = {200, 57, 9, 120};
      c.leftpad = {13, 57, 0, 64};  // one sequence wholly padding before its new keys, one none, one tile-aligned
      c.seqlen_q = 3;
      c.seqlen_new = 3;
      c.causal = true;
      c.block_size = block_size;
      c.dtype = dtype;
      expect_kvcache_like_oracle(c, "leftpad block " + std::to_string(block_size));
      c.num_splits = 3;
      expect_kvcache_like_oracle(c, "leftpad 3 splits block " + std::to_string(block_size));
    }
}

TEST(CpuKvcache, LeftPaddingLikeReference) {
  std::vector<KvCase> cases(6);
  for (KvCase& c : cases) {
    c.batch = 3;
    c.cached = {300, 40, 77};
    c.leftpad = {250, 40, 5};
    c.seqlen_new = 2;
    c.seqlen_q = 2;
  }
  cases[0].rotary = 1;
  cases[0].causal = true;
  cases[1].rotary = 2;  // non-causal: every query at position cached (flash_attn's convention)
  cases[1].block_size = 16;
  cases[2].window_left = 30;
  cases[2].window_right = 0;
  cases[2].block_size = 3;
  cases[3].alibi = true;
  cases[3].causal = true;
  cases[4].softcap = 5.f;
  cases[4].num_splits = 4;
  cases[5].seqlen_new = 0;  // read only, one sequence without keys: leftpad = cached
  for (const KvCase& c : cases)
    for (const int splits : {0, 1, 5}) {
      KvCase s = c;
      if (s.num_splits == 0) s.num_splits = splits;
      expect_kvcache_like_reference(s, "leftpad");
    }
  // No key at all: out = 0, lse = -inf
  KvCase empty = cases[5];
  auto rng = fa_test::make_rng("leftpad empty");
  KvTensors t = make_kv(empty, rng);
  ASSERT_TRUE(kvcache(t.args(), kv_options(empty, FA_BACKEND_CPU_FLASH, t)).ok());
  for (int h = 0; h < empty.heads_q; ++h)
    for (int i = 0; i < empty.seqlen_q; ++i) {
      EXPECT_EQ(t.lse.get((int64_t(1) * empty.heads_q + h) * empty.seqlen_q + i), -std::numeric_limits<double>::infinity());
      for (int e = 0; e < empty.head_dim; ++e)
        EXPECT_EQ(t.out.get(((int64_t(1) * empty.seqlen_q + i) * empty.heads_q + h) * empty.head_dim + e), 0.0);
    }
}

// ---- FP8 (e4m3) caches ----

KvCase fp8_case(fa_dtype dtype) {
  KvCase c;
  c.dtype = dtype;
  c.fp8 = true;
  return c;
}

// Flash == reference (appended bytes identical, out / lse within the 16-bit rule) over contiguous and
// paged caches (block sizes 1, 3, 16, 256), decode and GQA / MQA, with a scale that is not a power of two.
TEST(CpuKvcacheFp8, ContiguousAndPagedLikeReference) {
  for (const fa_dtype dtype : {FA_FLOAT16, FA_BFLOAT16})
    for (const int block_size : {0, 1, 3, 16, 256}) {
      KvCase c = fp8_case(dtype);
      c.block_size = block_size;
      c.seqlen_new = 1;
      expect_kvcache_like_reference(c, "fp8 decode");
      c.causal = true;
      c.heads_k = 1;  // MQA
      c.seqlen_q = 3;
      c.seqlen_new = 3;
      expect_kvcache_like_reference(c, "fp8 causal mqa Sq 3");
    }
}

TEST(CpuKvcacheFp8, RotarySplitsAndShortSequences) {
  for (const int rotary : {1, 2}) {
    KvCase c = fp8_case(FA_BFLOAT16);
    c.rotary = rotary;
    c.causal = true;
    c.seqlen_q = 4;
    c.seqlen_new = 4;
    c.block_size = rotary == 1 ? 16 : 0;
    expect_kvcache_like_reference(c, "fp8 rotary");
  }
  KvCase empty = fp8_case(FA_FLOAT16);  // cache lengths 0 and 1, with and without an append
  empty.batch = 3;
  empty.cached = {0, 1, 0};
  expect_kvcache_like_reference(empty, "fp8 lengths 0 and 1");
  empty.seqlen_new = 1;
  empty.block_size = 1;
  expect_kvcache_like_reference(empty, "fp8 appended to lengths 0 and 1");
  for (const int splits : {1, 3, 8}) {
    KvCase c = fp8_case(FA_FLOAT16);
    c.batch = 1;
    c.capacity = 1100;
    c.cached = {1037};
    c.seqlen_new = 2;
    c.seqlen_q = 2;
    c.causal = true;
    c.num_splits = splits;
    expect_kvcache_like_reference(c, "fp8 splits " + std::to_string(splits));
  }
}

// The appended codes are exactly e4m3(x / scale) of the new rows (nearest even, saturating): here the
// scales are small enough that a good share of the new values saturate to +-448.
TEST(CpuKvcacheFp8, AppendQuantisesAndSaturates) {
  for (const fa_dtype dtype : {FA_FLOAT16, FA_BFLOAT16})
    for (const float k_scale : {0.05f, 0.004f}) {
      KvCase c = fp8_case(dtype);
      c.k_scale = k_scale;
      c.v_scale = k_scale * 0.5f;
      c.seqlen_q = 2;
      c.seqlen_new = 5;
      c.cached = {0, 123};
      c.capacity = 200;
      expect_kvcache_like_reference(c, "fp8 append");  // flash and reference write the same bytes
      auto rng = fa_test::make_rng("fp8 append codes");
      KvTensors t = make_kv(c, rng);
      ASSERT_TRUE(kvcache(t.args(), kv_options(c, FA_BACKEND_CPU_FLASH, t)).ok());
      const int row = c.heads_k * c.head_dim;
      int saturated = 0;
      for (int b = 0; b < c.batch; ++b)
        for (int s = 0; s < c.seqlen_new; ++s)
          for (int x = 0; x < row; ++x) {
            const int64_t cache_index = (int64_t(b) * c.capacity + c.cached[size_t(b)] + s) * row + x;
            const int64_t new_index = (int64_t(b) * c.seqlen_new + s) * row + x;
            const float k = float(t.k_new.get(new_index)), v = float(t.v_new.get(new_index));
            const uint8_t k_code = static_cast<const uint8_t*>(t.k_cache.data())[cache_index];
            const uint8_t v_code = static_cast<const uint8_t*>(t.v_cache.data())[cache_index];
            ASSERT_EQ(int(k_code), int(float_to_e4m3(k / c.k_scale))) << "k at " << b << "," << s << "," << x;
            ASSERT_EQ(int(v_code), int(float_to_e4m3(v / c.v_scale))) << "v at " << b << "," << s << "," << x;
            saturated += (k_code & 0x7F) == 0x7E;
          }
      if (k_scale < 0.01f) {
        EXPECT_GT(saturated, 10) << "the small scale should saturate some values";
      } else {
        EXPECT_EQ(saturated, 0);
      }
    }
}

// Against the float64 oracle under the 16-bit same-precision rule (power-of-two scales: the dequantised values
// are exact in the 16-bit dtype), contiguous and paged, decode and chunked prefill, after an append.
TEST(CpuKvcacheFp8, AgainstOracle) {
  for (const fa_dtype dtype : {FA_FLOAT16, FA_BFLOAT16})
    for (const int block_size : {0, 16, 3}) {
      KvCase c = fp8_case(dtype);
      c.k_scale = 0.0625f;
      c.v_scale = 0.03125f;
      c.block_size = block_size;
      c.seqlen_q = block_size == 3 ? 1 : 3;
      c.seqlen_new = c.seqlen_q;
      c.causal = true;
      c.cached = {200, 57};
      expect_kvcache_like_oracle(c, "kvcache fp8 block " + std::to_string(block_size));
    }
}

// The public rules: FP8 only for the cache, with 16-bit q, scales finite and > 0 (16-bit caches: 0 or 1).
TEST(CpuKvcacheFp8, Validation) {
  KvCase c = fp8_case(FA_BFLOAT16);
  c.seqlen_new = 1;
  auto rng = fa_test::make_rng("fp8 validation");
  KvTensors t = make_kv(c, rng);
  const fa_options o = kv_options(c, FA_BACKEND_CPU_FLASH, t);
  auto expect_invalid = [&](fa_kvcache_args a, const std::string& prefix, const std::string& fragment) {
    const Status s = kvcache(a, o);
    EXPECT_EQ(s.code(), FA_ERROR_INVALID_ARGUMENT) << prefix;
    EXPECT_EQ(s.message().rfind(prefix, 0), 0u) << s.message();
    EXPECT_NE(s.message().find(fragment), std::string::npos) << s.message();
  };
  ASSERT_TRUE(kvcache(t.args(), o).ok());
  for (const float bad : {0.f, -1.f, std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    fa_kvcache_args a = t.args();
    a.k_scale = bad;
    expect_invalid(a, "k_scale:", "> 0");
    a = t.args();
    a.v_scale = bad;
    expect_invalid(a, "v_scale:", "> 0");
  }
  HostTensor q8({c.batch, c.seqlen_q, c.heads_q, c.head_dim}, FA_FLOAT8_E4M3);
  fa_kvcache_args a = t.args();
  a.q = q8.view();
  expect_invalid(a, "q:", "float8_e4m3 is accepted only for fa_kvcache's k_cache and v_cache");
  HostTensor q32({c.batch, c.seqlen_q, c.heads_q, c.head_dim}, FA_FLOAT32);
  a = t.args();
  a.q = q32.view();
  expect_invalid(a, "q:", "float16 or bfloat16 with a float8_e4m3 cache");
  HostTensor k_new8(t.k_new.shape(), FA_FLOAT8_E4M3);
  a = t.args();
  a.k_new = k_new8.view();
  expect_invalid(a, "k_new:", "float8_e4m3 is accepted only");
  HostTensor out8(t.out.shape(), FA_FLOAT8_E4M3);
  a = t.args();
  a.out = out8.view();
  expect_invalid(a, "out:", "float8_e4m3 is accepted only");
  HostTensor v16(t.v_cache.shape(), FA_BFLOAT16);
  a = t.args();
  a.v_cache = v16.view();
  expect_invalid(a, "v_cache:", "both float8_e4m3");
  // 16-bit caches: scales 0 (unset) or 1 only
  KvCase h = c;
  h.fp8 = false;
  KvTensors t16 = make_kv(h, rng);
  for (const float fine : {0.f, 1.f}) {
    fa_kvcache_args b = t16.args();
    b.k_scale = b.v_scale = fine;
    EXPECT_TRUE(kvcache(b, o).ok()) << fine;
  }
  fa_kvcache_args b = t16.args();
  b.k_scale = 0.5f;
  expect_invalid(b, "k_scale:", "must be 0 or 1");
  b = t16.args();
  b.v_scale = 2.f;
  expect_invalid(b, "v_scale:", "must be 0 or 1");
}

// FP8 is rejected everywhere but the kvcache cache: forward and backward.
TEST(CpuKvcacheFp8, ForwardAndBackwardRejectFp8) {
  fa_test::Problem pr;
  pr.dtype = FA_BFLOAT16;
  auto rng = fa_test::make_rng("fp8 forward");
  fa_test::Tensors t = fa_test::make_tensors(pr, rng);
  HostTensor k8(t.k.shape(), FA_FLOAT8_E4M3);
  fa_forward_args f = fa_test::forward_args(t);
  f.k = k8.view();
  for (const fa_backend backend : {FA_BACKEND_CPU_FLASH, FA_BACKEND_CPU_REFERENCE}) {
    const Status s = forward(f, fa_test::options_for(backend));
    EXPECT_EQ(s.code(), FA_ERROR_INVALID_ARGUMENT);
    EXPECT_EQ(s.message().rfind("k: dtype must be", 0), 0u) << s.message();
    EXPECT_NE(s.message().find("float8_e4m3 is accepted only"), std::string::npos) << s.message();
  }
  fa_backward_args bw = fa_test::backward_args(t);
  bw.v = k8.view();
  const Status s = backward(bw, fa_test::options_for(FA_BACKEND_CPU_FLASH));
  EXPECT_EQ(s.code(), FA_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(s.message().rfind("v: dtype must be", 0), 0u) << s.message();
}

}  // namespace
}  // namespace flashattn
