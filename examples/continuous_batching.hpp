// A toy continuous-batching server over PagedKvCache and fa_kvcache (no model: the queries, keys and
// values of each token are random). Shared by examples/continuous_batching.cpp (which prints its log)
// and tests/cpp/test_kv_cache_manager.cpp (which checks every call against the float64 oracle).
//
// Each step of ToyServer::run:
//   1. arrivals: requests whose arrival_step has come join the waiting queue (first come, first served);
//   2. admission: the head of the queue is admitted when the pool can hold it to its very end next to
//      every admitted request (the sum of their lifetime block bounds, see lifetime_blocks()), so a
//      later step never runs out of blocks; a real server would preempt instead;
//   3. prefill: each admitted prompt takes one causal fa_kvcache call of its next chunk (B = 1,
//      Sq = S_new = chunk, cache_seqlens = prompt tokens already in); when its prompt is complete a
//      request with beams > 1 forks into beams sequences that share the prompt's blocks;
//   4. decode: every sequence that was decoding when the step began appends one token, all in ONE
//      fa_kvcache call (B = that count, Sq = S_new = 1); the first decode after a fork copies the
//      shared partially filled prompt block (copy-on-write) for all but one beam;
//   5. sequences that produced their last token release their blocks; new arrivals reuse them.
// Every attention call is the manager's three steps: reserve, make_batch + fa_kvcache, commit.
// With ServerConfig::mixed_step, steps 3 and 4 are ONE call pair for all of them instead: every prefill chunk and
// every decode token of the step appended by one fa_kvcache_append, attended by one causal varlen fa_forward over
// the paged pool (reserve each, make_step, append + forward, commit); forks follow that call.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.hpp"  // internal header: host float16 / bfloat16 rounding of the random inputs
#include "core/fp8.hpp"    // internal header: e4m3 codes of an FP8 pool's history
#include "core/status.hpp"
#include "flashattn/kv_cache.hpp"

namespace flashattn::toy {

struct Request {
  int arrival_step = 0;   // the step at which the request arrives
  int prompt_tokens = 1;  // >= 1: prefilled causally, in chunks of ServerConfig::prefill_chunk
  int decode_tokens = 1;  // >= 1: one token per decode step once the prompt is in
  int beams = 1;          // >= 1: after the prompt, `beams` sequences share its blocks (fork)
};

struct ServerConfig {
  int heads_q = 4, heads_k = 2, head_dim = 64, head_dim_v = 0;  // head_dim_v 0: = head_dim
  fa_dtype dtype = FA_FLOAT32;
  int num_blocks = 64, block_size = 16;
  int prefill_chunk = 0;          // 0: a whole prompt in one call; else at most this many tokens per call
  bool mixed_step = false;        // prefills and decodes of a step in one fa_kvcache_append + one varlen fa_forward
                                  // (16-bit or float32 pools: fa_forward does not read FP8 ones)
  fa_device_kind device = FA_DEVICE_CPU;
  int device_id = 0;
  fa_backend backend = FA_BACKEND_AUTO;
  int num_threads = 0;            // CPU backends: 0 = all hardware threads
  double input_std = 1.0;         // of the random q / k / v: > 3 makes the softmax peaky
  uint64_t seed = 1;
  bool poison = false;            // NaN in the pool at start and in out / lse before every call
  // An FP8 (e4m3) pool (dtype, of q / k_new / v_new / out, then float16 or bfloat16) with these dequantisation
  // scales: fa_kvcache stores the appended rows as e4m3(x / scale).
  bool fp8_cache = false;
  float k_scale = 0.0625f, v_scale = 0.0625f;
  int dv() const { return head_dim_v > 0 ? head_dim_v : head_dim; }
  fa_dtype cache_dtype() const { return fp8_cache ? FA_FLOAT8_E4M3 : dtype; }
};

// One sequence's share of one attention call, as host copies (for verification).
struct CallRecord {
  int step = 0;
  SeqId seq = 0;
  int request = 0, beam = 0;
  bool prefill = false;
  int cached = 0;                  // tokens in the cache before the call (its cache_seqlens entry)
  int new_tokens = 0;              // Sq = S_new of the call
  bool causal = false;
  const uint8_t* q = nullptr;      // (new_tokens, Hq, D), in the dtype
  const uint8_t* out = nullptr;    // (new_tokens, Hq, Dv)
  const float* lse = nullptr;      // (Hq, new_tokens)
  // The sequence's whole key / value history, dense: (cached + new_tokens, Hk, D / Dv), in the cache's dtype
  // (an FP8 pool: the e4m3 codes that the appends stored, real = code value x k_scale / v_scale).
  const std::vector<uint8_t>* k_history = nullptr;
  const std::vector<uint8_t>* v_history = nullptr;
};

struct StepLog {
  int step = 0;
  int arrived = 0, admitted = 0, waiting = 0;  // this step; waiting = queue length after admission
  int prefill_calls = 0, prefill_tokens = 0;
  int decode_batch = 0;                        // B of the decode call (0: none)
  int forked = 0, finished = 0;                // sequences created by fork / released this step
  int active = 0;                              // live sequences after the step
  int free_blocks = 0, num_blocks = 0;
  int64_t copies_made = 0;                     // copy-on-write copies so far
};

class ToyServer {
 public:
  using Observer = std::function<void(const CallRecord&)>;
  using Logger = std::function<void(const StepLog&)>;

  Status init(const ServerConfig& config) {
    config_ = config;
    PagedKvCacheConfig c;
    c.num_blocks = config.num_blocks;
    c.block_size = config.block_size;
    c.heads_k = config.heads_k;
    c.head_dim = config.head_dim;
    c.head_dim_v = config.dv();
    c.dtype = config.cache_dtype();
    if (config.fp8_cache) {
      c.k_scale = config.k_scale;
      c.v_scale = config.v_scale;
    }
    c.device = config.device;
    c.device_id = config.device_id;
    FA_RETURN_IF_ERROR(PagedKvCache::create(c, &cache_));
    if (config.poison) FA_RETURN_IF_ERROR(cache_->poison());
    return Status();
  }

  const PagedKvCache& cache() const { return *cache_; }

  // Blocks a request can hold at most at one time: the prompt's full blocks, shared by all beams, plus
  // per beam every block from the prompt's partial one on (its own copy, or the original).
  int64_t lifetime_blocks(const Request& r) const {
    const int64_t bs = config_.block_size;
    const int64_t shared_full = r.prompt_tokens / bs;
    const int64_t per_beam = (int64_t(r.prompt_tokens) + r.decode_tokens + bs - 1) / bs - shared_full;
    return shared_full + int64_t(r.beams) * per_beam;
  }

  Status run(const std::vector<Request>& requests, const Observer& on_call = nullptr, const Logger& on_step = nullptr) {
    for (size_t n = 0; n < requests.size(); ++n) {
      const Request& r = requests[n];
      if (r.prompt_tokens < 1 || r.decode_tokens < 1 || r.beams < 1 || r.arrival_step < 0)
        return error(FA_ERROR_INVALID_ARGUMENT, "requests[%zu]: prompt_tokens, decode_tokens, beams must be >= 1 and arrival_step >= 0",
                     n);
      if (lifetime_blocks(r) > config_.num_blocks)
        return error(FA_ERROR_INVALID_ARGUMENT, "requests[%zu]: needs up to %lld blocks but the pool has %d; it could never run", n,
                     (long long)lifetime_blocks(r), config_.num_blocks);
    }
    on_call_ = on_call;
    std::vector<int> order(requests.size());  // arrival order; ties keep the list order
    for (size_t n = 0; n < order.size(); ++n) order[n] = int(n);
    std::stable_sort(order.begin(), order.end(),
                     [&](int a, int b) { return requests[size_t(a)].arrival_step < requests[size_t(b)].arrival_step; });
    size_t next_arrival = 0;
    std::deque<int> waiting;
    int64_t admitted_blocks = 0;                  // sum of lifetime_blocks of admitted, unfinished requests
    std::map<int, int> live_beams;                // request -> its live sequences
    size_t done = 0;
    for (step_ = 0; done < requests.size(); ++step_) {
      StepLog log;
      log.step = step_;
      // 1. arrivals
      for (; next_arrival < order.size() && requests[size_t(order[next_arrival])].arrival_step <= step_; ++next_arrival) {
        waiting.push_back(order[next_arrival]);
        ++log.arrived;
      }
      // 2. admission (first come, first served: a request that does not fit holds back the rest)
      while (!waiting.empty() && admitted_blocks + lifetime_blocks(requests[size_t(waiting.front())]) <= config_.num_blocks) {
        const int r = waiting.front();
        waiting.pop_front();
        admitted_blocks += lifetime_blocks(requests[size_t(r)]);
        Sequence s;
        s.id = cache_->add_sequence();
        s.request = r;
        s.rng.seed(config_.seed * 1000003u + uint64_t(s.id));
        live_[s.id] = std::move(s);
        live_beams[r] = 1;
        ++log.admitted;
      }
      log.waiting = int(waiting.size());
      // Who decodes this step: the sequences whose prompt was complete before the step began.
      std::vector<SeqId> decoding;
      for (const auto& entry : live_)
        if (entry.second.prompt_done == requests[size_t(entry.second.request)].prompt_tokens) decoding.push_back(entry.first);
      // 3. prefill, one call per prompt (Sq differs between prompts); then fork the beams. Mixed steps: every
      // chunk and every decode token in one call pair (the decode part of step 4 then has nothing left to do).
      std::vector<SeqId> prefilling;
      std::vector<int> chunks;
      for (const auto& entry : live_) {
        const Sequence& s = entry.second;
        const int remaining = requests[size_t(s.request)].prompt_tokens - s.prompt_done;
        if (remaining == 0) continue;
        prefilling.push_back(entry.first);
        chunks.push_back(config_.prefill_chunk > 0 ? std::min(config_.prefill_chunk, remaining) : remaining);
      }
      if (config_.mixed_step && !(prefilling.empty() && decoding.empty())) {
        std::vector<SeqId> seqs = prefilling;
        std::vector<int> counts = chunks;
        seqs.insert(seqs.end(), decoding.begin(), decoding.end());
        counts.insert(counts.end(), decoding.size(), 1);
        FA_RETURN_IF_ERROR(attend_mixed(seqs, counts, prefilling.size()));
        log.prefill_calls += prefilling.empty() ? 0 : 1;
        log.decode_batch = int(decoding.size());
      }
      for (size_t p = 0; p < prefilling.size(); ++p) {
        const SeqId id = prefilling[p];
        const int chunk = chunks[p];
        const Request& r = requests[size_t(live_.at(id).request)];
        if (!config_.mixed_step) {
          FA_RETURN_IF_ERROR(attend({id}, chunk, /*prefill=*/true));
          ++log.prefill_calls;
        }
        live_.at(id).prompt_done += chunk;
        log.prefill_tokens += chunk;
        if (live_.at(id).prompt_done == r.prompt_tokens) {
          for (int beam = 1; beam < r.beams; ++beam) {
            Sequence child;
            FA_RETURN_IF_ERROR(cache_->fork(id, &child.id));
            const Sequence& parent = live_.at(id);
            child.request = parent.request;
            child.beam = beam;
            child.prompt_done = parent.prompt_done;
            child.k_history = parent.k_history;  // the same tokens so far; they diverge from here
            child.v_history = parent.v_history;
            child.rng.seed(config_.seed * 1000003u + uint64_t(child.id));
            ++live_beams[child.request];
            live_[child.id] = std::move(child);
            ++log.forked;
          }
        }
      }
      // 4. decode: one token for every decoding sequence, one call (mixed steps: done in step 3's call)
      if (!decoding.empty()) {
        if (!config_.mixed_step) {
          FA_RETURN_IF_ERROR(attend(decoding, 1, /*prefill=*/false));
          log.decode_batch = int(decoding.size());
        }
        // 5. finished sequences give their blocks back
        for (SeqId id : decoding) {
          Sequence& s = live_.at(id);
          const Request& r = requests[size_t(s.request)];
          if (++s.decoded < r.decode_tokens) continue;
          FA_RETURN_IF_ERROR(cache_->release(id));
          const int request = s.request;
          live_.erase(id);
          ++log.finished;
          if (--live_beams[request] == 0) {
            live_beams.erase(request);
            admitted_blocks -= lifetime_blocks(requests[size_t(request)]);
            ++done;
          }
        }
      }
      log.active = int(live_.size());
      log.free_blocks = cache_->free_blocks();
      log.num_blocks = cache_->num_blocks();
      log.copies_made = cache_->copies_made();
      if (on_step) on_step(log);
    }
    return Status();
  }

 private:
  struct Sequence {
    SeqId id = 0;
    int request = 0, beam = 0;
    int prompt_done = 0;  // prompt tokens in the cache
    int decoded = 0;      // tokens generated
    std::vector<uint8_t> k_history, v_history;  // (length, Hk, D / Dv): what the cache holds, dense
    std::mt19937_64 rng;  // this sequence's token stream (does not depend on how calls are batched)
  };

  // One fa_kvcache call over `seqs`, each taking `n` new tokens: reserve, make_batch + attend, commit.
  Status attend(const std::vector<SeqId>& seqs, int n, bool prefill) {
    FA_RETURN_IF_ERROR(cache_->reserve(seqs, n));
    const Status attended = attend_reserved(seqs, n, prefill);
    if (!attended.ok()) {
      cache_->cancel(seqs);  // give the reserved blocks back; the call's status is what matters
      return attended;
    }
    FA_RETURN_IF_ERROR(cache_->commit(seqs));
    if (on_call_) report(seqs, n, prefill);
    return Status();
  }

  Status attend_reserved(const std::vector<SeqId>& seqs, int n, bool prefill) {
    const ServerConfig& c = config_;
    const int64_t batch = int64_t(seqs.size()), es = dtype_size(c.dtype);
    const int64_t q_row = int64_t(c.heads_q) * c.head_dim, k_row = int64_t(c.heads_k) * c.head_dim;
    const int64_t v_row = int64_t(c.heads_k) * c.dv(), out_row = int64_t(c.heads_q) * c.dv();
    // Random q / k_new / v_new on the host, each sequence from its own stream.
    q_host_.resize(size_t(batch * n * q_row * es));
    k_new_host_.resize(size_t(batch * n * k_row * es));
    v_new_host_.resize(size_t(batch * n * v_row * es));
    for (int64_t b = 0; b < batch; ++b) {
      std::mt19937_64& rng = live_.at(seqs[size_t(b)]).rng;
      fill_normal(rng, q_host_.data(), b * n * q_row, n * q_row);
      fill_normal(rng, k_new_host_.data(), b * n * k_row, n * k_row);
      fill_normal(rng, v_new_host_.data(), b * n * v_row, n * v_row);
    }
    out_host_.resize(size_t(batch * n * out_row * es));
    lse_host_.resize(size_t(batch * c.heads_q * n));
    FA_RETURN_IF_ERROR(stage_call());

    // The cache side: block_table and cache_seqlens (= lengths before this call) on the device.
    FA_RETURN_IF_ERROR(cache_->make_batch(seqs, &batch_));
    fa_kvcache_args args = batch_.args();
    args.q = tensor(q_dev_.data(), {batch, n, c.heads_q, c.head_dim}, c.dtype, c.device, c.device_id);
    args.k_new = tensor(k_new_dev_.data(), {batch, n, c.heads_k, c.head_dim}, c.dtype, c.device, c.device_id);
    args.v_new = tensor(v_new_dev_.data(), {batch, n, c.heads_k, c.dv()}, c.dtype, c.device, c.device_id);
    args.out = tensor(out_dev_.data(), {batch, n, c.heads_q, c.dv()}, c.dtype, c.device, c.device_id);
    args.lse = tensor(lse_dev_.data(), {batch, c.heads_q, n}, FA_FLOAT32, c.device, c.device_id);
    Options options = default_options();
    options.causal = prefill ? 1 : 0;  // a decode query sees every key anyway (Sq = 1, bottom-right)
    options.backend = c.backend;
    options.num_threads = c.num_threads;
    // Plan on the host, then run with the planned splits and a workspace that is reused across calls.
    KvcachePlan plan{};
    FA_RETURN_IF_ERROR(kvcache_plan(args, options, &plan));
    args.num_splits = plan.num_splits;
    if (plan.workspace_bytes > 0) {
      FA_RETURN_IF_ERROR(workspace_dev_.ensure(plan.workspace_bytes, c.device, c.device_id));
      args.workspace = tensor(workspace_dev_.data(), {plan.workspace_bytes}, FA_UINT8, c.device, c.device_id);
    }
    FA_RETURN_IF_ERROR(kvcache(args, options));
    FA_RETURN_IF_ERROR(out_dev_.download(out_host_.data(), int64_t(out_host_.size())));
    FA_RETURN_IF_ERROR(lse_dev_.download(lse_host_.data(), int64_t(lse_host_.size() * sizeof(float))));
    // The library appended k_new / v_new (an FP8 pool: their codes); keep the dense history in step with it.
    for (int64_t b = 0; b < batch; ++b) {
      Sequence& s = live_.at(seqs[size_t(b)]);
      append(&s.k_history, k_new_host_.data(), b * n * k_row, n * k_row, c.k_scale);
      append(&s.v_history, v_new_host_.data(), b * n * v_row, n * v_row, c.v_scale);
    }
    causal_ = options.causal != 0;
    return Status();
  }

  // One mixed step over `seqs`, sequence b taking counts[b] new tokens (the first `prefills` are prompt chunks, the
  // rest decode tokens): reserve each, make_step, fa_kvcache_append + one causal varlen fa_forward, commit.
  Status attend_mixed(const std::vector<SeqId>& seqs, const std::vector<int>& counts, size_t prefills) {
    for (size_t b = 0; b < seqs.size(); ++b) {
      const Status reserved = cache_->reserve({seqs[b]}, counts[b]);
      if (!reserved.ok()) {
        cache_->cancel(std::vector<SeqId>(seqs.begin(), seqs.begin() + int64_t(b)));
        return reserved;
      }
    }
    const Status attended = attend_mixed_reserved(seqs, counts);
    if (!attended.ok()) {
      cache_->cancel(seqs);
      return attended;
    }
    FA_RETURN_IF_ERROR(cache_->commit(seqs));
    if (on_call_) {
      const ServerConfig& c = config_;
      const int64_t es = dtype_size(c.dtype);
      const int64_t q_row = int64_t(c.heads_q) * c.head_dim, out_row = int64_t(c.heads_q) * c.dv();
      const int total = mixed_.total_new;
      for (size_t b = 0; b < seqs.size(); ++b) {
        const Sequence& s = live_.at(seqs[b]);
        const int first = mixed_.cu_seqlens_new_host[b], n = counts[b];
        CallRecord r;
        r.step = step_;
        r.seq = s.id;
        r.request = s.request;
        r.beam = s.beam;
        r.prefill = b < prefills;
        r.cached = mixed_.cache_seqlens_host[b];
        r.new_tokens = n;
        r.causal = true;
        r.q = q_host_.data() + int64_t(first) * q_row * es;
        r.out = out_host_.data() + int64_t(first) * out_row * es;
        lse_rows_.resize(size_t(c.heads_q) * n);  // (Hq, total_new) -> this sequence's (Hq, n)
        for (int h = 0; h < c.heads_q; ++h)
          std::copy_n(lse_host_.begin() + int64_t(h) * total + first, n, lse_rows_.begin() + int64_t(h) * n);
        r.lse = lse_rows_.data();
        r.k_history = &s.k_history;
        r.v_history = &s.v_history;
        on_call_(r);
      }
    }
    return Status();
  }

  Status attend_mixed_reserved(const std::vector<SeqId>& seqs, const std::vector<int>& counts) {
    const ServerConfig& c = config_;
    if (c.fp8_cache)
      return error(FA_ERROR_UNSUPPORTED, "mixed_step: fa_forward does not read an FP8 pool; run an FP8 pool without mixed_step");
    FA_RETURN_IF_ERROR(cache_->make_step(seqs, &mixed_));
    const int64_t total = mixed_.total_new, es = dtype_size(c.dtype);
    const int64_t q_row = int64_t(c.heads_q) * c.head_dim, k_row = int64_t(c.heads_k) * c.head_dim;
    const int64_t v_row = int64_t(c.heads_k) * c.dv(), out_row = int64_t(c.heads_q) * c.dv();
    // Random q / k_new / v_new rows on the host, each sequence's from its own stream (as in attend_reserved).
    q_host_.resize(size_t(total * q_row * es));
    k_new_host_.resize(size_t(total * k_row * es));
    v_new_host_.resize(size_t(total * v_row * es));
    for (size_t b = 0; b < seqs.size(); ++b) {
      std::mt19937_64& rng = live_.at(seqs[b]).rng;
      const int64_t first = mixed_.cu_seqlens_new_host[b], n = counts[b];
      fill_normal(rng, q_host_.data(), first * q_row, n * q_row);
      fill_normal(rng, k_new_host_.data(), first * k_row, n * k_row);
      fill_normal(rng, v_new_host_.data(), first * v_row, n * v_row);
    }
    out_host_.resize(size_t(total * out_row * es));
    lse_host_.resize(size_t(total * c.heads_q));
    FA_RETURN_IF_ERROR(stage_call());
    Options options = default_options();
    options.backend = c.backend;
    options.num_threads = c.num_threads;
    // The write half: every sequence's new rows into its blocks.
    fa_kvcache_append_args append_args = mixed_.append_args();
    append_args.k_new = tensor(k_new_dev_.data(), {total, c.heads_k, c.head_dim}, c.dtype, c.device, c.device_id);
    append_args.v_new = tensor(v_new_dev_.data(), {total, c.heads_k, c.dv()}, c.dtype, c.device, c.device_id);
    FA_RETURN_IF_ERROR(kvcache_append(append_args, options));
    // The attention: one varlen forward over the paged pool, causal (bottom-right: new token i sees the cached keys
    // and the new tokens 0 .. i; a decode token sees every key).
    fa_forward_args forward_args = mixed_.forward_args();
    forward_args.q = tensor(q_dev_.data(), {total, c.heads_q, c.head_dim}, c.dtype, c.device, c.device_id);
    forward_args.out = tensor(out_dev_.data(), {total, c.heads_q, c.dv()}, c.dtype, c.device, c.device_id);
    forward_args.lse = tensor(lse_dev_.data(), {c.heads_q, total}, FA_FLOAT32, c.device, c.device_id);
    options.causal = 1;
    FA_RETURN_IF_ERROR(forward(forward_args, options));
    FA_RETURN_IF_ERROR(out_dev_.download(out_host_.data(), int64_t(out_host_.size())));
    FA_RETURN_IF_ERROR(lse_dev_.download(lse_host_.data(), int64_t(lse_host_.size() * sizeof(float))));
    for (size_t b = 0; b < seqs.size(); ++b) {
      Sequence& s = live_.at(seqs[b]);
      const int64_t first = mixed_.cu_seqlens_new_host[b], n = counts[b];
      append(&s.k_history, k_new_host_.data(), first * k_row, n * k_row, c.k_scale);
      append(&s.v_history, v_new_host_.data(), first * v_row, n * v_row, c.v_scale);
    }
    return Status();
  }

  void report(const std::vector<SeqId>& seqs, int n, bool prefill) {
    const ServerConfig& c = config_;
    const int64_t es = dtype_size(c.dtype);
    const int64_t q_row = int64_t(c.heads_q) * c.head_dim, out_row = int64_t(c.heads_q) * c.dv();
    for (size_t b = 0; b < seqs.size(); ++b) {
      const Sequence& s = live_.at(seqs[b]);
      CallRecord r;
      r.step = step_;
      r.seq = s.id;
      r.request = s.request;
      r.beam = s.beam;
      r.prefill = prefill;
      r.cached = batch_.cache_seqlens_host[b];
      r.new_tokens = n;
      r.causal = causal_;
      r.q = q_host_.data() + int64_t(b) * n * q_row * es;
      r.out = out_host_.data() + int64_t(b) * n * out_row * es;
      lse_rows_.resize(size_t(c.heads_q) * n);  // (B, Hq, n) -> this sequence's (Hq, n)
      std::copy_n(lse_host_.begin() + int64_t(b) * c.heads_q * n, c.heads_q * n, lse_rows_.begin());
      r.lse = lse_rows_.data();
      r.k_history = &s.k_history;
      r.v_history = &s.v_history;
      on_call_(r);
    }
  }

  void fill_normal(std::mt19937_64& rng, uint8_t* base, int64_t first, int64_t count) {
    std::normal_distribution<float> normal(0.f, float(config_.input_std));
    for (int64_t e = first; e < first + count; ++e) store_from_float(base, e, config_.dtype, normal(rng));
  }

  // q / k_new / v_new (host) staged on the cache's device (plain copies on the CPU), out / lse sized to their host
  // copies (NaN first with poison: a row the call forgets shows up).
  Status stage_call() {
    const ServerConfig& c = config_;
    FA_RETURN_IF_ERROR(stage(&q_dev_, q_host_));
    FA_RETURN_IF_ERROR(stage(&k_new_dev_, k_new_host_));
    FA_RETURN_IF_ERROR(stage(&v_new_dev_, v_new_host_));
    FA_RETURN_IF_ERROR(out_dev_.ensure(int64_t(out_host_.size()), c.device, c.device_id));
    FA_RETURN_IF_ERROR(lse_dev_.ensure(int64_t(lse_host_.size() * sizeof(float)), c.device, c.device_id));
    if (c.poison) {
      FA_RETURN_IF_ERROR(out_dev_.fill_bytes(0xFF));
      FA_RETURN_IF_ERROR(lse_dev_.fill_bytes(0xFF));
    }
    return Status();
  }

  Status stage(DeviceBuffer* dev, const std::vector<uint8_t>& host) {
    FA_RETURN_IF_ERROR(dev->ensure(int64_t(host.size()), config_.device, config_.device_id));
    return dev->upload(host.data(), int64_t(host.size()));
  }

  // Elements [first, first + count) of `rows` (in the dtype) onto the history, in the cache's dtype: an FP8 pool
  // takes e4m3(x / scale), the quantisation flashattn.h specifies for the append (core/fp8.hpp, the library's own).
  void append(std::vector<uint8_t>* history, const uint8_t* rows, int64_t first, int64_t count, float scale) const {
    if (!config_.fp8_cache) {
      const int64_t es = dtype_size(config_.dtype);
      history->insert(history->end(), rows + first * es, rows + (first + count) * es);
      return;
    }
    for (int64_t e = first; e < first + count; ++e) history->push_back(float_to_e4m3(load_as_float(rows, e, config_.dtype) / scale));
  }

  ServerConfig config_;
  std::unique_ptr<PagedKvCache> cache_;
  std::map<SeqId, Sequence> live_;
  Observer on_call_;
  int step_ = 0;
  bool causal_ = false;
  KvcacheBatch batch_;  // reused call after call: its index storage grows, then stays
  KvcacheStep mixed_;   // the same, for mixed steps
  DeviceBuffer q_dev_, k_new_dev_, v_new_dev_, out_dev_, lse_dev_, workspace_dev_;
  std::vector<uint8_t> q_host_, k_new_host_, v_new_host_, out_host_;
  std::vector<float> lse_host_, lse_rows_;
};

}  // namespace flashattn::toy
