// The paged KV-cache manager (include/flashattn/kv_cache.hpp) and the continuous-batching loop over it
// (examples/continuous_batching.hpp):
//   - configuration and argument rules, each error naming the argument;
//   - allocator invariants over long random sequences of operations, against an independent model of
//     what every sequence holds (no block leaked or freed twice, the free count exact, contents kept);
//   - fork shares blocks, copy-on-write copies exactly the shared partially filled block and only then;
//   - exhaustion fails with FA_ERROR_OUT_OF_MEMORY and leaves every piece of state as it was;
//   - the batch tensors for fa_kvcache;
//   - an FP8 (e4m3) pool: its scales in every batch, the appended codes of every sequence (a forked one's
//     copy-on-write block included), each call against the float64 reference over the dequantised history;
//   - end to end: every sequence's output of every prefill and decode call of the serving loop
//     (CPU flash backend, paged cache, poisoned pool and outputs) matches the float64 reference
//     computed on that sequence's dense key/value history, under the tolerance rule.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "../../examples/continuous_batching.hpp"  // the loop under test (header-only, examples/)
#include "core/fp8.hpp"
#include "flashattn/kv_cache.hpp"
#include "testing.hpp"

namespace flashattn {
namespace {

// Small rows for the allocator tests: every element of a token's K row is distinct, V = -K.
constexpr int kHeadsK = 2, kHeadDim = 3, kHeadDimV = 2;
constexpr int kRowK = kHeadsK * kHeadDim, kRowV = kHeadsK * kHeadDimV;

float k_value(int token, int e) { return float(token * 16 + e); }  // exact in float32
float v_value(int token, int e) { return -float(token * 16 + e) - 0.5f; }

std::unique_ptr<PagedKvCache> make_cache(int num_blocks, int block_size) {
  PagedKvCacheConfig c;
  c.num_blocks = num_blocks;
  c.block_size = block_size;
  c.heads_k = kHeadsK;
  c.head_dim = kHeadDim;
  c.head_dim_v = kHeadDimV;
  c.dtype = FA_FLOAT32;
  std::unique_ptr<PagedKvCache> cache;
  const Status s = PagedKvCache::create(c, &cache);
  EXPECT_TRUE(s.ok()) << s.to_string();
  if (cache) {
    EXPECT_TRUE(cache->poison().ok());  // NaN: a row read before it is written fails the content checks
  }
  return cache;
}

// Writes the pending rows of `seq` (tokens[length ..]) into its blocks, as fa_kvcache's append does.
void write_pending(PagedKvCache& cache, SeqId seq, const std::vector<int>& tokens) {
  const int bs = cache.config().block_size, length = cache.length(seq);
  const std::vector<int32_t> blocks = cache.blocks(seq);
  float* k = static_cast<float*>(cache.k_cache().data);
  float* v = static_cast<float*>(cache.v_cache().data);
  for (int t = length; t < length + cache.pending(seq); ++t) {
    const int64_t row = int64_t(blocks[size_t(t / bs)]) * bs + t % bs;
    for (int e = 0; e < kRowK; ++e) k[row * kRowK + e] = k_value(tokens[size_t(t)], e);
    for (int e = 0; e < kRowV; ++e) v[row * kRowV + e] = v_value(tokens[size_t(t)], e);
  }
}

// Everything observable about the cache, for "nothing changed" checks.
struct Snapshot {
  std::map<SeqId, std::vector<int32_t>> blocks;
  std::map<SeqId, std::pair<int, int>> length_pending;
  std::vector<int> ref_counts;
  int free_blocks = 0;
  int64_t copies = 0;
  bool operator==(const Snapshot& o) const {
    return blocks == o.blocks && length_pending == o.length_pending && ref_counts == o.ref_counts && free_blocks == o.free_blocks &&
           copies == o.copies;
  }
};

Snapshot snapshot(const PagedKvCache& cache) {
  Snapshot s;
  for (SeqId id : cache.sequences()) {
    s.blocks[id] = cache.blocks(id);
    s.length_pending[id] = {cache.length(id), cache.pending(id)};
  }
  for (int b = 0; b < cache.num_blocks(); ++b) s.ref_counts.push_back(cache.ref_count(b));
  s.free_blocks = cache.free_blocks();
  s.copies = cache.copies_made();
  return s;
}

int blocks_for(int tokens, int bs) { return (tokens + bs - 1) / bs; }

// The test's own account of the cache: every sequence's tokens and pending count. Checks the cache
// against it: lengths, block counts, reference counts and the free count recomputed from the block
// lists, and every committed row's contents.
struct Model {
  std::map<SeqId, std::vector<int>> tokens;  // committed tokens, then the pending ones
  std::map<SeqId, int> pending;

  void expect_matches(const PagedKvCache& cache, const std::string& where) const {
    ASSERT_TRUE(cache.check_invariants().ok()) << where << ": " << cache.check_invariants().to_string();
    ASSERT_EQ(cache.num_sequences(), int(tokens.size())) << where;
    const int bs = cache.config().block_size;
    std::map<int32_t, int> holders;
    for (const auto& entry : tokens) {
      const SeqId id = entry.first;
      const int p = pending.at(id), length = int(entry.second.size()) - p;
      ASSERT_EQ(cache.length(id), length) << where << " seq " << id;
      ASSERT_EQ(cache.pending(id), p) << where << " seq " << id;
      const std::vector<int32_t> blocks = cache.blocks(id);
      ASSERT_EQ(int(blocks.size()), blocks_for(length + p, bs)) << where << " seq " << id;
      for (int32_t b : blocks) ++holders[b];
      std::vector<float> k(size_t(length) * kRowK), v(size_t(length) * kRowV);
      ASSERT_TRUE(cache.read_rows(id, 0, length, k.data(), v.data()).ok());
      std::vector<float> k_expected(k.size()), v_expected(v.size());
      for (int t = 0; t < length; ++t) {
        for (int e = 0; e < kRowK; ++e) k_expected[size_t(t) * kRowK + e] = k_value(entry.second[size_t(t)], e);
        for (int e = 0; e < kRowV; ++e) v_expected[size_t(t) * kRowV + e] = v_value(entry.second[size_t(t)], e);
      }
      // Exact: rows are only ever copied, never computed (NaN from the poisoned pool fails too).
      ASSERT_TRUE(k == k_expected) << where << " seq " << id << ": cached keys differ from the model";
      ASSERT_TRUE(v == v_expected) << where << " seq " << id << ": cached values differ from the model";
      // A window that starts inside a block (read_rows copies a run of rows per block from the row it starts at).
      if (length >= 2) {
        const int first = length / 2, count = length - first;
        std::vector<float> k_tail(size_t(count) * kRowK), v_tail(size_t(count) * kRowV);
        ASSERT_TRUE(cache.read_rows(id, first, count, k_tail.data(), v_tail.data()).ok());
        ASSERT_TRUE(std::equal(k_tail.begin(), k_tail.end(), k_expected.begin() + int64_t(first) * kRowK))
            << where << " seq " << id << ": rows [" << first << ", " << length << ") read back differ";
        ASSERT_TRUE(std::equal(v_tail.begin(), v_tail.end(), v_expected.begin() + int64_t(first) * kRowV))
            << where << " seq " << id << ": rows [" << first << ", " << length << ") read back differ";
      }
    }
    for (int b = 0; b < cache.num_blocks(); ++b)
      ASSERT_EQ(cache.ref_count(b), holders.count(b) ? holders.at(b) : 0) << where << " block " << b;
    ASSERT_EQ(cache.free_blocks(), cache.num_blocks() - int(holders.size())) << where;
  }

  // Whether reserve(seqs, n) must succeed: new blocks plus copy-on-write copies (a shared partially
  // filled last block, for all but the last of its holders in the call) within the free blocks plus
  // those that shrinking sequences give back.
  bool reserve_fits(const PagedKvCache& cache, const std::vector<SeqId>& seqs, int n) const {
    const int bs = cache.config().block_size;
    int64_t need = 0, available = cache.free_blocks();
    std::map<int32_t, int> holders_left;
    for (SeqId id : seqs) {
      const int length = cache.length(id);
      const int held = int(cache.blocks(id).size()), target = blocks_for(length + n, bs);
      if (target > held) need += target - held;
      else available += held - target;
      if (n > 0 && length % bs != 0) {
        const int32_t partial = cache.blocks(id)[size_t(length / bs)];
        if (!holders_left.count(partial)) holders_left[partial] = cache.ref_count(partial);
        if (holders_left[partial] > 1) {
          --holders_left[partial];
          ++need;
        }
      }
    }
    return need <= available;
  }
};

// ---------------------------------------------------------------------------------------------

TEST(KvCacheManager, ConfigRulesNameTheField) {
  struct Case {
    const char* field;
    void (*edit)(PagedKvCacheConfig&);
  };
  const Case cases[] = {
      {"num_blocks", [](PagedKvCacheConfig& c) { c.num_blocks = 0; }},
      {"block_size", [](PagedKvCacheConfig& c) { c.block_size = 0; }},
      {"heads_k", [](PagedKvCacheConfig& c) { c.heads_k = -1; }},
      {"head_dim", [](PagedKvCacheConfig& c) { c.head_dim = 0; }},
      {"head_dim_v", [](PagedKvCacheConfig& c) { c.head_dim_v = -2; }},
      {"dtype", [](PagedKvCacheConfig& c) { c.dtype = FA_INT32; }},
      {"device_id", [](PagedKvCacheConfig& c) { c.device_id = 1; }},  // the CPU is device 0
      {"k_scale", [](PagedKvCacheConfig& c) { c.dtype = FA_FLOAT8_E4M3; c.v_scale = 1.f; }},  // an FP8 pool needs both
      {"v_scale", [](PagedKvCacheConfig& c) { c.dtype = FA_FLOAT8_E4M3; c.k_scale = 0.5f; c.v_scale = NAN; }},
      {"v_scale", [](PagedKvCacheConfig& c) { c.dtype = FA_FLOAT8_E4M3; c.k_scale = 0.5f; c.v_scale = -1.f; }},
      {"k_scale", [](PagedKvCacheConfig& c) { c.k_scale = 0.5f; }},  // a 16-bit pool has none
  };
  for (const Case& k : cases) {
    PagedKvCacheConfig c;
    c.num_blocks = 4;
    c.block_size = 16;
    c.heads_k = 2;
    c.head_dim = 64;
    k.edit(c);
    std::unique_ptr<PagedKvCache> cache;
    const Status s = PagedKvCache::create(c, &cache);
    EXPECT_EQ(s.code(), FA_ERROR_INVALID_ARGUMENT) << k.field << ": " << s.to_string();
    EXPECT_NE(s.message().find(std::string("PagedKvCacheConfig.") + k.field), std::string::npos) << s.message();
    EXPECT_EQ(cache, nullptr);
  }
  {  // The pool's elements, num_blocks * block_size * heads_k * max(head_dim, head_dim_v), at most 2^40: refused before
     // any allocation (this one would be 2^43 elements, 16 TiB of bfloat16).
    PagedKvCacheConfig big;
    big.num_blocks = 1 << 20;
    big.block_size = 1 << 12;
    big.heads_k = 16;
    big.head_dim = 64;
    big.head_dim_v = 128;
    big.dtype = FA_BFLOAT16;
    std::unique_ptr<PagedKvCache> cache;
    const Status s = PagedKvCache::create(big, &cache);
    EXPECT_EQ(s.code(), FA_ERROR_INVALID_ARGUMENT) << s.to_string();
    EXPECT_NE(s.message().find("beyond 2^40"), std::string::npos) << s.message();
    EXPECT_EQ(cache, nullptr);
  }
  // CUDA: not compiled, or no such device; never a silent CPU cache.
  PagedKvCacheConfig c;
  c.num_blocks = 4;
  c.heads_k = 1;
  c.head_dim = 64;
  c.device = FA_DEVICE_CUDA;
  c.device_id = 1000;
  std::unique_ptr<PagedKvCache> cache;
  const Status s = PagedKvCache::create(c, &cache);
#if defined(FLASHATTN_WITH_CUDA)
  EXPECT_EQ(s.code(), FA_ERROR_DEVICE) << s.to_string();
#else
  EXPECT_EQ(s.code(), FA_ERROR_NOT_COMPILED) << s.to_string();
#endif
  EXPECT_EQ(cache, nullptr);
  // A valid one: the pool views have the documented shapes; head_dim_v 0 means head_dim.
  c = PagedKvCacheConfig{};
  c.num_blocks = 5;
  c.block_size = 3;
  c.heads_k = 2;
  c.head_dim = 8;
  c.dtype = FA_BFLOAT16;
  ASSERT_TRUE(PagedKvCache::create(c, &cache).ok());
  EXPECT_EQ(cache->config().head_dim_v, 8);
  const Tensor k = cache->k_cache(), v = cache->v_cache();
  EXPECT_EQ(k.ndim, 4);
  EXPECT_EQ(k.shape[0], 5);
  EXPECT_EQ(k.shape[1], 3);
  EXPECT_EQ(k.shape[2], 2);
  EXPECT_EQ(k.shape[3], 8);
  EXPECT_EQ(v.shape[3], 8);
  EXPECT_EQ(k.dtype, FA_BFLOAT16);
  EXPECT_EQ(k.device, FA_DEVICE_CPU);
  EXPECT_EQ(cache->free_blocks(), 5);
  EXPECT_EQ(cache->ref_count(0), 0);
  EXPECT_EQ(cache->ref_count(4), 0);
  EXPECT_EQ(cache->ref_count(5), -1);  // not an id
  EXPECT_EQ(cache->ref_count(-1), -1);
}

TEST(KvCacheManager, CallRulesNameTheArgument) {
  auto cache = make_cache(8, 4);
  const SeqId a = cache->add_sequence();
  auto expect_invalid = [](const Status& s, const char* needle) {
    EXPECT_EQ(s.code(), FA_ERROR_INVALID_ARGUMENT) << s.to_string();
    EXPECT_NE(s.message().find(needle), std::string::npos) << "'" << needle << "' not in: " << s.message();
  };
  expect_invalid(cache->reserve({a}, -1), "reserve: new_tokens");
  expect_invalid(cache->reserve({a, 99}, 1), "reserve: seqs[1] = 99");
  expect_invalid(cache->reserve({a, a}, 1), "appears twice");
  expect_invalid(cache->commit({42}), "commit: seqs[0] = 42");
  expect_invalid(cache->release(42), "release: seqs[0] = 42");
  SeqId child = -1;
  expect_invalid(cache->fork(42, &child), "fork: seqs[0] = 42");
  KvcacheBatch batch;
  expect_invalid(cache->make_batch({}, &batch), "make_batch: seqs");
  expect_invalid(cache->read_rows(a, 0, 1, nullptr, nullptr), "read_rows: rows [0, 1)");
  // A pending reservation blocks fork (the pending rows would land in a block the child shares).
  ASSERT_TRUE(cache->reserve({a}, 3).ok());
  expect_invalid(cache->fork(a, &child), "fork: sequence");
  EXPECT_EQ(child, -1);
  // One call appends the same S_new to every sequence.
  const SeqId b = cache->add_sequence();
  ASSERT_TRUE(cache->reserve({b}, 2).ok());
  expect_invalid(cache->make_batch({a, b}, &batch), "make_batch: seqs[1]");
  // A sequence holds at most INT32_MAX tokens (cache_seqlens is int32): one past it is refused as such; at it, the rule
  // passes and the blocks run out.
  const SeqId one = cache->add_sequence();
  ASSERT_TRUE(cache->reserve({one}, 1).ok());
  ASSERT_TRUE(cache->commit({one}).ok());
  const int max_tokens = std::numeric_limits<int32_t>::max();
  expect_invalid(cache->reserve({one}, max_tokens), "cache_seqlens is int32");
  EXPECT_EQ(cache->reserve({one}, max_tokens - 1).code(), FA_ERROR_OUT_OF_MEMORY);
  EXPECT_EQ(cache->length(one), 1);
  EXPECT_EQ(cache->pending(one), 0);
  // Released ids are gone for good (ids are never reused).
  ASSERT_TRUE(cache->release(a).ok());
  expect_invalid(cache->commit({a}), "not a live sequence");
  EXPECT_NE(cache->add_sequence(), a);
  EXPECT_TRUE(cache->check_invariants().ok());
}

TEST(KvCacheManager, DeviceBufferRangesAreChecked) {
  DeviceBuffer buffer;
  ASSERT_TRUE(buffer.allocate(64, FA_DEVICE_CPU, 0).ok());
  std::vector<uint8_t> host(80, 7);
  EXPECT_EQ(buffer.upload(host.data(), 65).code(), FA_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(buffer.upload(host.data(), 8, 60).code(), FA_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(buffer.download(host.data(), 8, -1).code(), FA_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(buffer.copy_within(8, 0, 16).code(), FA_ERROR_INVALID_ARGUMENT);  // overlapping
  ASSERT_TRUE(buffer.upload(host.data(), 16, 0).ok());
  ASSERT_TRUE(buffer.copy_within(32, 0, 16).ok());
  std::vector<uint8_t> back(16, 0);
  ASSERT_TRUE(buffer.download(back.data(), 16, 32).ok());
  EXPECT_EQ(back, std::vector<uint8_t>(16, 7));
  ASSERT_TRUE(buffer.ensure(32, FA_DEVICE_CPU, 0).ok());  // smaller: kept
  EXPECT_EQ(buffer.bytes(), 64);
  DeviceBuffer moved = std::move(buffer);
  EXPECT_EQ(moved.bytes(), 64);
  EXPECT_EQ(buffer.data(), nullptr);
}

TEST(KvCacheManager, ForkSharesAndCopyOnWriteCopiesOnlyWhenNeeded) {
  const int bs = 4;
  auto cache = make_cache(16, bs);
  Model model;
  int next_token = 1;
  auto add = [&]() {
    const SeqId id = cache->add_sequence();
    model.tokens[id] = {};
    model.pending[id] = 0;
    return id;
  };
  auto grow = [&](SeqId id, int n) {  // reserve, write (as fa_kvcache would), commit
    ASSERT_TRUE(cache->reserve({id}, n).ok());
    for (int t = 0; t < n; ++t) model.tokens[id].push_back(next_token++);
    model.pending[id] = n;
    write_pending(*cache, id, model.tokens[id]);
    ASSERT_TRUE(cache->commit({id}).ok());
    model.pending[id] = 0;
  };
  auto fork = [&](SeqId parent) {
    SeqId child = -1;
    EXPECT_TRUE(cache->fork(parent, &child).ok());
    model.tokens[child] = model.tokens[parent];
    model.pending[child] = 0;
    return child;
  };

  // A: 6 tokens = one full block + a partial block of 2 rows.
  const SeqId a = add();
  grow(a, 6);
  ASSERT_EQ(cache->free_blocks(), 14);
  const std::vector<int32_t> a_blocks = cache->blocks(a);
  // Fork shares every block: counts go to 2, nothing is allocated or copied.
  const SeqId b = fork(a);
  EXPECT_EQ(cache->blocks(b), a_blocks);
  EXPECT_EQ(cache->ref_count(a_blocks[0]), 2);
  EXPECT_EQ(cache->ref_count(a_blocks[1]), 2);
  EXPECT_EQ(cache->free_blocks(), 14);
  EXPECT_EQ(cache->copies_made(), 0);
  model.expect_matches(*cache, "after fork");
  // B writes into the shared partial block: it gets a private copy first; the full block stays shared.
  grow(b, 1);
  EXPECT_EQ(cache->copies_made(), 1);
  EXPECT_EQ(cache->blocks(b)[0], a_blocks[0]);
  EXPECT_NE(cache->blocks(b)[1], a_blocks[1]);
  EXPECT_EQ(cache->ref_count(a_blocks[0]), 2);
  EXPECT_EQ(cache->ref_count(a_blocks[1]), 1);
  EXPECT_EQ(cache->free_blocks(), 13);
  model.expect_matches(*cache, "after B's copy-on-write");  // A's rows intact, B's copy equal + its own
  // A now holds its partial block alone: it writes in place.
  grow(a, 1);
  EXPECT_EQ(cache->copies_made(), 1);
  EXPECT_EQ(cache->blocks(a), a_blocks);
  EXPECT_EQ(cache->free_blocks(), 13);
  model.expect_matches(*cache, "after A's in-place append");

  // A full last block is never written again, so a fork appending after it copies nothing.
  const SeqId c = add();
  grow(c, 8);
  const SeqId d = fork(c);
  const int free_before = cache->free_blocks();
  grow(d, 1);
  EXPECT_EQ(cache->copies_made(), 1);
  EXPECT_EQ(cache->free_blocks(), free_before - 1);
  const std::vector<int32_t> d_blocks = cache->blocks(d);
  ASSERT_EQ(d_blocks.size(), 3u);
  EXPECT_EQ(std::vector<int32_t>(d_blocks.begin(), d_blocks.begin() + 2), cache->blocks(c));
  model.expect_matches(*cache, "after appending past a full shared block");

  // Three holders of one partial block appending in one call: two copies, the last keeps the original.
  const SeqId e = add();
  grow(e, 5);
  const SeqId f = fork(e), g = fork(e);
  const int32_t shared = cache->blocks(e)[1];
  EXPECT_EQ(cache->ref_count(shared), 3);
  const int64_t copies_before = cache->copies_made();
  const int free_before_beams = cache->free_blocks();
  ASSERT_TRUE(cache->reserve({e, f, g}, 1).ok());
  EXPECT_EQ(cache->copies_made(), copies_before + 2);
  EXPECT_EQ(cache->free_blocks(), free_before_beams - 2);
  EXPECT_EQ(cache->ref_count(shared), 1);
  std::set<int32_t> partials = {cache->blocks(e)[1], cache->blocks(f)[1], cache->blocks(g)[1]};
  EXPECT_EQ(partials.size(), 3u);
  EXPECT_EQ(partials.count(shared), 1u);
  for (SeqId id : {e, f, g}) {
    model.tokens[id].push_back(next_token++);
    model.pending[id] = 1;
    write_pending(*cache, id, model.tokens[id]);
  }
  ASSERT_TRUE(cache->commit({e, f, g}).ok());
  for (SeqId id : {e, f, g}) model.pending[id] = 0;
  model.expect_matches(*cache, "after the beams' first step");

  // Release everything: every block comes back exactly once.
  for (SeqId id : cache->sequences()) {
    ASSERT_TRUE(cache->release(id).ok());
    model.tokens.erase(id);
    model.pending.erase(id);
    model.expect_matches(*cache, "after release");
  }
  EXPECT_EQ(cache->free_blocks(), 16);
}

TEST(KvCacheManager, ExhaustionFailsAndChangesNothing) {
  const int bs = 4;
  auto cache = make_cache(5, bs);
  const SeqId a = cache->add_sequence();
  ASSERT_TRUE(cache->reserve({a}, 10).ok());  // 3 blocks, the last one half full
  ASSERT_TRUE(cache->commit({a}).ok());
  ASSERT_EQ(cache->free_blocks(), 2);

  auto expect_exhausted = [&](const std::vector<SeqId>& seqs, int n, const char* needle) {
    const Snapshot before = snapshot(*cache);
    const Status s = cache->reserve(seqs, n);
    EXPECT_EQ(s.code(), FA_ERROR_OUT_OF_MEMORY) << s.to_string();
    EXPECT_NE(s.message().find("reserve:"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("nothing was changed"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find(needle), std::string::npos) << "'" << needle << "' not in: " << s.message();
    EXPECT_TRUE(snapshot(*cache) == before) << "state changed by a failed reserve: " << s.message();
    EXPECT_TRUE(cache->check_invariants().ok());
  };
  expect_exhausted({a}, 11, "need 3 free blocks (3 new, 0 copy-on-write) but 2 of 5 are free");
  // All or nothing: b (2 blocks) alone would fit, a (1 block) alone too; together they do not.
  const SeqId b = cache->add_sequence();
  expect_exhausted({b, a}, 5, "need 3 free blocks (3 new");
  // An exact fit is not refused.
  ASSERT_TRUE(cache->reserve({b, a}, 4).ok());  // b: 1 block, a: 10 + 4 tokens -> 4 blocks
  EXPECT_EQ(cache->free_blocks(), 0);
  // Blocks that a sequence gives back in the same call count: c, listed first, takes one block that
  // a frees by lowering its pending count from 4 to 2 (4 blocks -> 3).
  const SeqId c = cache->add_sequence();
  expect_exhausted({c}, 2, "need 1 free blocks (1 new, 0 copy-on-write) but 0 of 5");
  ASSERT_TRUE(cache->reserve({c, a}, 2).ok());
  EXPECT_EQ(cache->free_blocks(), 0);
  EXPECT_EQ(cache->blocks(a).size(), 3u);
  EXPECT_EQ(cache->blocks(c).size(), 1u);
  ASSERT_TRUE(cache->commit({a, c}).ok());
  EXPECT_EQ(cache->length(a), 12);
  ASSERT_TRUE(cache->cancel({b}).ok());  // b's pending block goes back
  EXPECT_EQ(cache->free_blocks(), 1);
  EXPECT_EQ(cache->pending(b), 0);
  // A copy-on-write copy needs a free block too: c (2 tokens, a half-full block) forked into c2.
  SeqId c2 = -1;
  ASSERT_TRUE(cache->fork(c, &c2).ok());
  ASSERT_TRUE(cache->reserve({b}, 4).ok());  // takes the last free block
  ASSERT_EQ(cache->free_blocks(), 0);
  expect_exhausted({c2}, 1, "need 1 free blocks (0 new, 1 copy-on-write) but 0 of 5");
  ASSERT_TRUE(cache->release(b).ok());
  ASSERT_TRUE(cache->reserve({c2}, 1).ok());
  EXPECT_EQ(cache->copies_made(), 1);
  EXPECT_NE(cache->blocks(c2)[0], cache->blocks(c)[0]);
  EXPECT_TRUE(cache->check_invariants().ok());
}

TEST(KvCacheManager, BatchTensorsForKvcache) {
  const int bs = 4;
  auto cache = make_cache(12, bs);
  const SeqId empty = cache->add_sequence(), five = cache->add_sequence(), nine = cache->add_sequence();
  ASSERT_TRUE(cache->reserve({five}, 5).ok());
  ASSERT_TRUE(cache->reserve({nine}, 9).ok());
  ASSERT_TRUE(cache->commit({five, nine}).ok());
  ASSERT_TRUE(cache->reserve({nine, empty, five}, 2).ok());
  KvcacheBatch batch;
  ASSERT_TRUE(cache->make_batch({nine, empty, five}, &batch).ok());
  EXPECT_EQ(batch.batch, 3);
  EXPECT_EQ(batch.new_tokens, 2);
  EXPECT_EQ(batch.max_blocks, 3);  // nine: 9 + 2 tokens -> 3 blocks
  const std::vector<SeqId> order = {nine, empty, five};
  const int32_t* table = static_cast<const int32_t*>(batch.block_table.data);
  const int32_t* seqlens = static_cast<const int32_t*>(batch.cache_seqlens.data);
  EXPECT_EQ(batch.block_table.ndim, 2);
  EXPECT_EQ(batch.block_table.shape[0], 3);
  EXPECT_EQ(batch.block_table.shape[1], 3);
  EXPECT_EQ(batch.block_table.dtype, FA_INT32);
  EXPECT_EQ(batch.cache_seqlens.ndim, 1);
  EXPECT_EQ(batch.cache_seqlens.shape[0], 3);
  for (int b = 0; b < 3; ++b) {
    EXPECT_EQ(seqlens[b], cache->length(order[size_t(b)]));  // BEFORE the step
    const std::vector<int32_t> blocks = cache->blocks(order[size_t(b)]);
    EXPECT_EQ(int(blocks.size()), blocks_for(cache->length(order[size_t(b)]) + 2, bs));
    for (int col = 0; col < 3; ++col) {
      const int32_t expected = col < int(blocks.size()) ? blocks[size_t(col)] : 0;  // padding: block 0
      EXPECT_EQ(table[b * 3 + col], expected) << "row " << b << " col " << col;
      EXPECT_EQ(batch.block_table_host[size_t(b * 3 + col)], expected);
    }
  }
  const fa_kvcache_args args = batch.args();
  EXPECT_EQ(args.k_cache.data, cache->k_cache().data);
  EXPECT_EQ(args.v_cache.shape[3], kHeadDimV);
  EXPECT_EQ(args.block_table.data, batch.block_table.data);
  // Sequences that hold no block yet (nothing cached, nothing pending) still get a table of one column (block 0):
  // fa_kvcache's block_table is (B, max_blocks >= 1).
  const SeqId fresh = cache->add_sequence(), fresh2 = cache->add_sequence();
  KvcacheBatch empty_batch;
  ASSERT_TRUE(cache->make_batch({fresh, fresh2}, &empty_batch).ok());
  EXPECT_EQ(empty_batch.max_blocks, 1);
  EXPECT_EQ(empty_batch.block_table.shape[1], 1);
  EXPECT_EQ(empty_batch.block_table_host, std::vector<int32_t>(2, 0));
  EXPECT_EQ(empty_batch.new_tokens, 0);
  // Reused: a smaller batch keeps the storage.
  const void* storage = batch.block_table_storage.data();
  ASSERT_TRUE(cache->make_batch({five}, &batch).ok());
  EXPECT_EQ(batch.block_table_storage.data(), storage);
  EXPECT_EQ(batch.batch, 1);
}

// make_step: sequences with different pending counts (one of them none); the index tensors of the append and of the
// varlen forward, and the call rules.
TEST(KvCacheManager, StepTensorsForAppendAndVarlenForward) {
  auto expect_invalid = [](const Status& s, const char* needle) {
    EXPECT_EQ(s.code(), FA_ERROR_INVALID_ARGUMENT) << s.to_string();
    EXPECT_NE(s.message().find(needle), std::string::npos) << "'" << needle << "' not in: " << s.message();
  };
  const int bs = 4;
  auto cache = make_cache(16, bs);
  const SeqId empty = cache->add_sequence(), five = cache->add_sequence(), nine = cache->add_sequence(), idle = cache->add_sequence();
  ASSERT_TRUE(cache->reserve({five}, 5).ok());
  ASSERT_TRUE(cache->reserve({nine, idle}, 9).ok());
  ASSERT_TRUE(cache->commit({five, nine, idle}).ok());
  ASSERT_TRUE(cache->reserve({nine}, 1).ok());    // a decode token
  ASSERT_TRUE(cache->reserve({empty}, 6).ok());   // a prompt from nothing
  ASSERT_TRUE(cache->reserve({five}, 3).ok());    // a prompt chunk into a partially filled block
  KvcacheStep step;
  KvcacheBatch batch;
  expect_invalid(cache->make_batch({nine, empty}, &batch), "make_batch: seqs[1]");  // different counts: make_step's
  const std::vector<SeqId> order = {nine, empty, idle, five};
  ASSERT_TRUE(cache->make_step(order, &step).ok());
  const std::vector<int> pending = {1, 6, 0, 3}, lengths = {9, 0, 9, 5};
  EXPECT_EQ(step.batch, 4);
  EXPECT_EQ(step.total_new, 10);
  EXPECT_EQ(step.max_new, 6);
  EXPECT_EQ(step.max_keys, 10);
  EXPECT_EQ(step.max_blocks, 3);  // nine: 10 tokens -> 3 blocks
  const int32_t* table = static_cast<const int32_t*>(step.block_table.data);
  const int32_t* seqlens = static_cast<const int32_t*>(step.cache_seqlens.data);
  const int32_t* cu_new = static_cast<const int32_t*>(step.cu_seqlens_new.data);
  const int32_t* cu_k = static_cast<const int32_t*>(step.cu_seqlens_k.data);
  EXPECT_EQ(step.block_table.shape[0], 4);
  EXPECT_EQ(step.block_table.shape[1], 3);
  EXPECT_EQ(step.cu_seqlens_new.shape[0], 5);
  EXPECT_EQ(step.cu_seqlens_k.shape[0], 5);
  EXPECT_EQ(cu_new[0], 0);
  EXPECT_EQ(cu_k[0], 0);
  for (int b = 0; b < 4; ++b) {
    EXPECT_EQ(seqlens[b], lengths[size_t(b)]);
    EXPECT_EQ(cu_new[b + 1] - cu_new[b], pending[size_t(b)]) << b;
    EXPECT_EQ(cu_k[b + 1] - cu_k[b], lengths[size_t(b)] + pending[size_t(b)]) << b;
    const std::vector<int32_t> blocks = cache->blocks(order[size_t(b)]);
    for (int col = 0; col < 3; ++col)
      EXPECT_EQ(table[b * 3 + col], col < int(blocks.size()) ? blocks[size_t(col)] : 0) << "row " << b << " col " << col;
  }
  const fa_kvcache_append_args a = step.append_args();
  EXPECT_EQ(a.k_cache.data, cache->k_cache().data);
  EXPECT_EQ(a.cu_seqlens_new.data, step.cu_seqlens_new.data);
  EXPECT_EQ(a.max_seqlen_new, 6);
  const fa_forward_args f = step.forward_args();
  EXPECT_EQ(f.cu_seqlens_q.data, step.cu_seqlens_new.data);
  EXPECT_EQ(f.cu_seqlens_k.data, step.cu_seqlens_k.data);
  EXPECT_EQ(f.block_table.data, step.block_table.data);
  EXPECT_EQ(f.max_seqlen_q, 6);
  EXPECT_EQ(f.max_seqlen_k, 10);
  expect_invalid(cache->make_step({}, &step), "make_step: seqs must name at least one sequence");
  expect_invalid(cache->make_step({nine, nine}, &step), "make_step: seqs[1]");
  expect_invalid(cache->make_step({nine}, nullptr), "make_step: step must not be NULL");
}

// An FP8 (e4m3) pool driven through the manager and fa_kvcache (CPU flash backend): each batch carries the pool's
// scales; the append writes e4m3(x / scale) codes into the sequences' blocks (checked against a model of every
// sequence's codes, so rows written before, and a forked sequence's copy-on-write block, are checked too); and
// every call's output matches the float64 reference over the sequence's dequantised history.
TEST(KvCacheManager, Fp8PoolAppendsCodesAndAttendsOverThem) {
  constexpr int hq = 4, hk = 2, d = 64, bs = 5;
  PagedKvCacheConfig c;
  c.num_blocks = 16;
  c.block_size = bs;
  c.heads_k = hk;
  c.head_dim = d;
  c.dtype = FA_FLOAT8_E4M3;
  c.k_scale = 0.0625f;  // powers of two: code value * scale is exact in bfloat16, the oracle's dtype
  c.v_scale = 0.125f;
  std::unique_ptr<PagedKvCache> cache;
  const Status created = PagedKvCache::create(c, &cache);
  ASSERT_TRUE(created.ok()) << created.to_string();
  ASSERT_TRUE(cache->poison().ok());  // 0xFF: an e4m3 NaN, so a row read before it is written shows up
  EXPECT_EQ(cache->k_cache().dtype, FA_FLOAT8_E4M3);
  std::mt19937_64 rng = fa_test::make_rng("kv cache manager fp8 pool");
  const int64_t row = int64_t(hk) * d;  // codes of one token's K (or V) row
  std::map<SeqId, std::vector<uint8_t>> k_codes, v_codes;  // the model: every sequence's codes in token order
  const SeqId a = cache->add_sequence(), b = cache->add_sequence();
  SeqId forked = -1;
  struct Step {
    std::vector<SeqId> seqs;
    int new_tokens;
  };
  // Prompts of 7 (a partially filled second block) and 3 tokens (causal), a fork of a, then decode steps of all three.
  const std::vector<Step> steps = {{{a}, 7}, {{b}, 3}, {{a, b, -1}, 1}, {{b, -1, a}, 1}, {{-1, a, b}, 2}};
  KvcacheBatch batch;
  int copies_before_fork = 0;
  for (size_t step = 0; step < steps.size(); ++step) {
    if (step == 2) {  // fork a: the child shares a's blocks (and its codes) until copy-on-write
      ASSERT_TRUE(cache->fork(a, &forked).ok());
      k_codes[forked] = k_codes[a];
      v_codes[forked] = v_codes[a];
      copies_before_fork = int(cache->copies_made());
    }
    std::vector<SeqId> seqs = steps[step].seqs;
    for (SeqId& s : seqs) s = s < 0 ? forked : s;
    const int batch_size = int(seqs.size()), n = steps[step].new_tokens;
    const std::string what = "step " + std::to_string(step);
    ASSERT_TRUE(cache->reserve(seqs, n).ok()) << what;
    ASSERT_TRUE(cache->make_batch(seqs, &batch).ok()) << what;
    EXPECT_EQ(batch.k_scale, c.k_scale);
    EXPECT_EQ(batch.v_scale, c.v_scale);
    KvcacheStep mixed;  // make_step's index tensors carry the pool's scales as well (fa_kvcache_append quantises with them)
    ASSERT_TRUE(cache->make_step(seqs, &mixed).ok()) << what;
    EXPECT_EQ(mixed.k_scale, c.k_scale);
    EXPECT_EQ(mixed.v_scale, c.v_scale);
    EXPECT_EQ(mixed.append_args().k_scale, c.k_scale);
    EXPECT_EQ(mixed.append_args().v_scale, c.v_scale);
    fa_test::HostTensor q({batch_size, n, hq, d}, FA_BFLOAT16), k_new({batch_size, n, hk, d}, FA_BFLOAT16),
        v_new({batch_size, n, hk, d}, FA_BFLOAT16), out({batch_size, n, hq, d}, FA_BFLOAT16), lse({batch_size, hq, n}, FA_FLOAT32);
    q.fill_normal(rng);
    k_new.fill_normal(rng, 2.0);  // codes up to ~2 x 4 / 0.0625 = 128 of e4m3's 448
    v_new.fill_normal(rng);
    out.poison();
    lse.poison();
    fa_kvcache_args args = batch.args();
    EXPECT_EQ(args.k_scale, c.k_scale);
    EXPECT_EQ(args.v_scale, c.v_scale);
    args.q = q.view();
    args.k_new = k_new.view();
    args.v_new = v_new.view();
    args.out = out.view();
    args.lse = lse.view();
    fa_options options = fa_test::options_for(FA_BACKEND_CPU_FLASH);
    options.causal = n > 1 ? 1 : 0;
    fa_error err{};
    ASSERT_EQ(fa_kvcache(&args, &options, &err), FA_OK) << what << ": " << err.message;
    ASSERT_TRUE(cache->commit(seqs).ok()) << what;
    for (int j = 0; j < batch_size; ++j) {
      const SeqId seq = seqs[size_t(j)];
      const std::string where = what + " sequence " + std::to_string(seq);
      for (int64_t e = 0; e < int64_t(n) * row; ++e) {  // the appended rows, as fa_kvcache quantises them
        k_codes[seq].push_back(float_to_e4m3(float(k_new.get(j * n * row + e)) / c.k_scale));
        v_codes[seq].push_back(float_to_e4m3(float(v_new.get(j * n * row + e)) / c.v_scale));
      }
      const int total = cache->length(seq);
      ASSERT_EQ(int64_t(k_codes[seq].size()), int64_t(total) * row) << where;
      std::vector<uint8_t> k_rows(size_t(total * row)), v_rows(size_t(total * row));
      ASSERT_TRUE(cache->read_rows(seq, 0, total, k_rows.data(), v_rows.data()).ok()) << where;
      EXPECT_TRUE(k_rows == k_codes[seq]) << where << ": cached K codes differ from the model";
      EXPECT_TRUE(v_rows == v_codes[seq]) << where << ": cached V codes differ from the model";
      // The oracle: q (1, n, Hq, D) against the dequantised history (1, total, Hk, D), causal bottom-right.
      fa_test::Problem p;
      p.seqlen_q = n;
      p.seqlen_k = total;
      p.heads_q = hq;
      p.heads_k = hk;
      p.head_dim = d;
      p.dtype = FA_BFLOAT16;
      fa_test::Tensors t = fa_test::make_tensors(p, rng);
      for (int64_t e = 0; e < int64_t(n) * hq * d; ++e) t.q.set(e, q.get(j * n * hq * d + e));
      for (int64_t e = 0; e < int64_t(total) * row; ++e) {
        t.k.set(e, double(e4m3_to_float(k_rows[size_t(e)])) * c.k_scale);
        t.v.set(e, double(e4m3_to_float(v_rows[size_t(e)])) * c.v_scale);
      }
      fa_options reference = fa_test::options_for(FA_BACKEND_CPU_REFERENCE);
      reference.causal = options.causal;
      const fa_test::Oracle oracle = fa_test::run_oracle(t, reference, /*with_backward=*/false);
      for (int64_t e = 0; e < int64_t(n) * hq * d; ++e) t.out.set(e, out.get(j * n * hq * d + e));
      for (int64_t e = 0; e < int64_t(hq) * n; ++e) t.lse.set(e, lse.get(j * hq * n + e));
      fa_test::expect_forward_matches(where, t, oracle, FA_BFLOAT16);
    }
  }
  // The forked sequence and a both wrote into a's shared, partially filled second block: one of them copied it first.
  EXPECT_GT(int(cache->copies_made()), copies_before_fork);
  EXPECT_TRUE(cache->check_invariants().ok());
}

// Long random sequences of every operation against the model: after each one, the invariants, the
// counts and every sequence's contents.
class KvCacheRandomOps : public ::testing::TestWithParam<int> {};

TEST_P(KvCacheRandomOps, InvariantsHoldAndContentsSurvive) {
  constexpr int kRandomOps = 20000;  // about 0.1 s per block size (more under sanitizers)
  const int bs = GetParam();
  const int num_blocks = 24;
  auto cache = make_cache(num_blocks, bs);
  std::mt19937_64 rng = fa_test::make_rng("kv_random_ops_" + std::to_string(bs));
  Model model;
  int next_token = 1, exhausted = 0, copies_seen = 0, forks = 0;
  auto pick = [&](int count) { return std::uniform_int_distribution<int>(0, count - 1)(rng); };
  auto random_subset = [&]() {
    std::vector<SeqId> ids = cache->sequences();
    std::shuffle(ids.begin(), ids.end(), rng);
    ids.resize(size_t(1 + pick(std::min<int>(3, int(ids.size())))));
    return ids;
  };
  for (int op = 0; op < kRandomOps; ++op) {
    const int kind = pick(7);
    const std::string where = "op " + std::to_string(op) + " kind " + std::to_string(kind);
    if (kind == 0 || cache->num_sequences() == 0) {  // add
      if (cache->num_sequences() < 12) {
        const SeqId id = cache->add_sequence();
        model.tokens[id] = {};
        model.pending[id] = 0;
      }
    } else if (kind == 1) {  // fork (refused while the parent has pending tokens)
      const SeqId parent = random_subset()[0];
      SeqId child = -1;
      const Status s = cache->fork(parent, &child);
      if (model.pending[parent] > 0) {
        EXPECT_EQ(s.code(), FA_ERROR_INVALID_ARGUMENT) << where;
      } else {
        ASSERT_TRUE(s.ok()) << where << ": " << s.to_string();
        model.tokens[child] = model.tokens[parent];
        model.pending[child] = 0;
        ++forks;
      }
    } else if (kind == 2 || kind == 3) {  // reserve (a new count replaces a pending one)
      const std::vector<SeqId> seqs = random_subset();
      const int n = pick(2 * bs + 2);
      const bool fits = model.reserve_fits(*cache, seqs, n);
      const Snapshot before = snapshot(*cache);
      const Status s = cache->reserve(seqs, n);
      if (fits) {
        ASSERT_TRUE(s.ok()) << where << ": " << s.to_string();
        for (SeqId id : seqs) {
          std::vector<int>& t = model.tokens[id];
          t.resize(t.size() - size_t(model.pending[id]));
          for (int i = 0; i < n; ++i) t.push_back(next_token++);
          model.pending[id] = n;
        }
        copies_seen += int(cache->copies_made() - before.copies);
      } else {
        ASSERT_EQ(s.code(), FA_ERROR_OUT_OF_MEMORY) << where << ": " << s.to_string();
        ASSERT_TRUE(snapshot(*cache) == before) << where << ": a failed reserve changed the state";
        ++exhausted;
      }
    } else if (kind == 4) {  // the attention call writes the pending rows; commit
      const std::vector<SeqId> seqs = random_subset();
      for (SeqId id : seqs) write_pending(*cache, id, model.tokens[id]);
      ASSERT_TRUE(cache->commit(seqs).ok()) << where;
      for (SeqId id : seqs) model.pending[id] = 0;
    } else if (kind == 5) {  // cancel
      const std::vector<SeqId> seqs = random_subset();
      ASSERT_TRUE(cache->cancel(seqs).ok()) << where;
      for (SeqId id : seqs) {
        model.tokens[id].resize(model.tokens[id].size() - size_t(model.pending[id]));
        model.pending[id] = 0;
      }
    } else {  // release
      const SeqId id = random_subset()[0];
      ASSERT_TRUE(cache->release(id).ok()) << where;
      model.tokens.erase(id);
      model.pending.erase(id);
    }
    model.expect_matches(*cache, where);
    if (::testing::Test::HasFatalFailure()) return;
  }
  // Every path was taken (with one token per block every block is full: nothing is ever copied),
  // and all blocks come back at the end.
  EXPECT_GT(exhausted, 0);
  if (bs > 1) EXPECT_GT(copies_seen, 0);
  else EXPECT_EQ(copies_seen, 0);
  EXPECT_GT(forks, 0);
  for (SeqId id : cache->sequences()) ASSERT_TRUE(cache->release(id).ok());
  EXPECT_EQ(cache->free_blocks(), num_blocks);
  EXPECT_TRUE(cache->check_invariants().ok());
}

INSTANTIATE_TEST_SUITE_P(BlockSizes, KvCacheRandomOps, ::testing::Values(1, 3, 8));

// ---------------------------------------------------------------------------------------------
// End to end: the serving loop of examples/continuous_batching.hpp against the float64 oracle.

struct ServingCase {
  fa_dtype dtype;
  int heads_q, heads_k, head_dim, head_dim_v;
  int block_size, num_blocks, prefill_chunk;
  double input_std;
  bool fp8_cache = false;  // an e4m3 pool with ServerConfig's scales (powers of two: the oracle's bf16 holds them exactly)
  bool mixed_step = false;  // ServerConfig::mixed_step: a step's prefills and decodes in one append + one varlen forward
};

std::string case_name(const ServingCase& c) {
  return std::string(dtype_name(c.dtype)) + " Hq=" + std::to_string(c.heads_q) + " Hk=" + std::to_string(c.heads_k) +
         " D=" + std::to_string(c.head_dim) + " Dv=" + std::to_string(c.head_dim_v > 0 ? c.head_dim_v : c.head_dim) + " block=" + std::to_string(c.block_size) +
         " blocks=" + std::to_string(c.num_blocks) + " chunk=" + std::to_string(c.prefill_chunk) +
         " std=" + std::to_string(c.input_std) + (c.fp8_cache ? " fp8 pool" : "") + (c.mixed_step ? " mixed steps" : "");
}

class ContinuousBatching : public ::testing::TestWithParam<ServingCase> {};

TEST_P(ContinuousBatching, EveryCallMatchesTheReferenceOnTheDenseHistory) {
  const ServingCase& sc = GetParam();
  toy::ServerConfig config;
  config.heads_q = sc.heads_q;
  config.heads_k = sc.heads_k;
  config.head_dim = sc.head_dim;
  config.head_dim_v = sc.head_dim_v;
  config.dtype = sc.dtype;
  config.block_size = sc.block_size;
  config.num_blocks = sc.num_blocks;
  config.prefill_chunk = sc.prefill_chunk;
  config.backend = FA_BACKEND_CPU_FLASH;
  config.num_threads = 2;
  config.input_std = sc.input_std;
  config.poison = true;  // NaN pool and outputs: a row read before it was written, or never written, fails
  config.fp8_cache = sc.fp8_cache;
  config.mixed_step = sc.mixed_step;
  std::mt19937_64 rng = fa_test::make_rng("continuous_batching " + case_name(sc));
  config.seed = rng();
  // Odd prompt lengths (1, 17, block edges), arrivals that overlap, beams, and more demand than the
  // pool holds at once, so requests wait and reuse released blocks.
  const std::vector<toy::Request> requests = {
      {0, 17, 6, 1}, {0, 1, 9, 1}, {1, 23, 3, 3}, {1, sc.block_size, 5, 2}, {2, 40, 2, 1},
      {4, 5, 12, 1}, {4, 33, 1, 2}, {5, 2, 7, 1}, {9, 19, 4, 1}, {9, 1, 1, 3},
  };
  toy::ToyServer server;
  ASSERT_TRUE(server.init(config).ok());

  const int hq = sc.heads_q, hk = sc.heads_k, d = sc.head_dim, dv = sc.head_dim_v > 0 ? sc.head_dim_v : sc.head_dim;
  const int64_t es = dtype_size(sc.dtype), cache_es = dtype_size(config.cache_dtype());
  int prefill_calls = 0, decode_calls = 0, forked_decode_calls = 0, max_waiting = 0, max_decode_batch = 0;
  auto on_call = [&](const toy::CallRecord& r) {
    const std::string what = case_name(sc) + " step " + std::to_string(r.step) + " seq " + std::to_string(r.seq) +
                             (r.prefill ? " prefill" : " decode") + " cached=" + std::to_string(r.cached) +
                             " new=" + std::to_string(r.new_tokens);
    const int total = r.cached + r.new_tokens;
    ASSERT_EQ(int64_t(r.k_history->size()), int64_t(total) * hk * d * cache_es) << what;
    // The cache holds exactly the dense history: the library appended k_new / v_new at cache_seqlens,
    // and copy-on-write kept the shared prefix.
    std::vector<uint8_t> k_rows(size_t(total) * hk * d * cache_es), v_rows(size_t(total) * hk * dv * cache_es);
    ASSERT_TRUE(server.cache().read_rows(r.seq, 0, total, k_rows.data(), v_rows.data()).ok()) << what;
    EXPECT_TRUE(k_rows == *r.k_history) << what << ": cached keys differ from the history";
    EXPECT_TRUE(v_rows == *r.v_history) << what << ": cached values differ from the history";
    // The oracle on the dense history: q (1, new, Hq, D) against k / v (1, cached + new, Hk, D),
    // causal bottom-right for prefill chunks (query i sees keys <= cached + i), all keys for decode.
    fa_test::Problem p;
    p.batch = 1;
    p.seqlen_q = r.new_tokens;
    p.seqlen_k = total;
    p.heads_q = hq;
    p.heads_k = hk;
    p.head_dim = d;
    p.head_dim_v = dv;
    p.dtype = sc.dtype;
    fa_test::Tensors t = fa_test::make_tensors(p, rng);
    std::memcpy(t.q.data(), r.q, size_t(r.new_tokens) * hq * d * es);
    if (sc.fp8_cache) {  // the dequantised history: code value x scale, exact in the 16-bit dtype
      for (int64_t e = 0; e < int64_t(total) * hk * d; ++e)
        t.k.set(e, double(load_as_float(r.k_history->data(), e, FA_FLOAT8_E4M3)) * config.k_scale);
      for (int64_t e = 0; e < int64_t(total) * hk * dv; ++e)
        t.v.set(e, double(load_as_float(r.v_history->data(), e, FA_FLOAT8_E4M3)) * config.v_scale);
    } else {
      std::memcpy(t.k.data(), r.k_history->data(), r.k_history->size());
      std::memcpy(t.v.data(), r.v_history->data(), r.v_history->size());
    }
    fa_options options = fa_test::options_for(FA_BACKEND_CPU_REFERENCE);
    options.causal = r.causal ? 1 : 0;
    // (Mixed steps attend every new token causally: a decode token, the last row of its sequence, sees every key.)
    EXPECT_EQ(r.causal, sc.mixed_step || r.prefill) << what;
    const fa_test::Oracle oracle = fa_test::run_oracle(t, options, /*with_backward=*/false);
    std::memcpy(t.out.data(), r.out, size_t(r.new_tokens) * hq * dv * es);
    std::memcpy(t.lse.data(), r.lse, size_t(hq) * r.new_tokens * sizeof(float));
    fa_test::expect_forward_matches(what, t, oracle, sc.dtype);
    if (r.prefill) ++prefill_calls;
    else ++decode_calls;
    if (!r.prefill && r.beam > 0) ++forked_decode_calls;
  };
  auto on_step = [&](const toy::StepLog& s) {
    max_waiting = std::max(max_waiting, s.waiting);
    max_decode_batch = std::max(max_decode_batch, s.decode_batch);
    EXPECT_TRUE(server.cache().check_invariants().ok()) << "step " << s.step;
  };
  const Status s = server.run(requests, on_call, on_step);
  ASSERT_TRUE(s.ok()) << s.to_string();
  // The workload did what it is for: chunks or whole prompts, batched decodes, beams, waiting.
  EXPECT_GE(prefill_calls, int(requests.size()));
  EXPECT_GT(decode_calls, 40);
  EXPECT_GT(forked_decode_calls, 0);
  EXPECT_GE(max_decode_batch, 4);
  EXPECT_GT(max_waiting, 0) << "the pool should be too small for every request at once";
  // Beams copy their prompt's partially filled block; with one token per block there is none.
  if (sc.block_size > 1) EXPECT_GT(server.cache().copies_made(), 0);
  else EXPECT_EQ(server.cache().copies_made(), 0);
  EXPECT_EQ(server.cache().free_blocks(), sc.num_blocks);
  EXPECT_EQ(server.cache().num_sequences(), 0);
}

INSTANTIATE_TEST_SUITE_P(
    Serving, ContinuousBatching,
    ::testing::Values(ServingCase{FA_FLOAT32, 4, 2, 64, 0, 16, 12, 0, 1.0},    // GQA 2, whole prompts
                      ServingCase{FA_FLOAT32, 6, 2, 32, 0, 5, 30, 7, 4.0},     // GQA 3, chunks, peaky softmax
                      ServingCase{FA_FLOAT32, 3, 3, 64, 32, 7, 24, 16, 1.0},   // MHA, Dv != D
                      ServingCase{FA_FLOAT16, 4, 1, 64, 0, 1, 160, 0, 1.0},    // MQA, one token per block
                      ServingCase{FA_BFLOAT16, 2, 2, 128, 0, 16, 12, 9, 3.0},   // chunks, peaky
                      ServingCase{FA_BFLOAT16, 4, 2, 64, 0, 16, 12, 7, 1.0, true},  // an FP8 pool, chunks
                      ServingCase{FA_FLOAT16, 3, 1, 128, 0, 3, 60, 0, 2.0, true},   // FP8, MQA, odd blocks
                      ServingCase{FA_FLOAT32, 6, 2, 32, 0, 5, 30, 7, 4.0, false, true},   // mixed steps, chunks, peaky
                      ServingCase{FA_BFLOAT16, 4, 2, 64, 0, 16, 12, 0, 1.0, false, true}, // mixed steps, whole prompts
                      ServingCase{FA_FLOAT16, 4, 1, 64, 0, 1, 160, 9, 1.0, false, true}), // mixed steps, MQA, block 1
    [](const ::testing::TestParamInfo<ServingCase>& info) { return "case" + std::to_string(info.index); });

}  // namespace
}  // namespace flashattn
