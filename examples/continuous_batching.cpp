// Continuous batching over the paged KV cache: requests arrive at different steps with different
// prompt lengths, are prefilled through fa_kvcache (causal, optionally in chunks), then decode one
// token per step all together in one fa_kvcache call; they finish at different steps and their
// blocks go to later arrivals. Some requests run beam search: their beams share the prompt's blocks
// (fork) and copy the partially filled one on their first write (copy-on-write).
// The loop itself is ToyServer in continuous_batching.hpp; this file makes a workload and prints.
//
//   continuous_batching [--device cpu|cuda] [--dtype float32|float16|bfloat16] [--requests 12]
//                       [--num-blocks 48] [--block-size 16] [--prefill-chunk 0] [--seed 1]
//                       [--heads-q 4] [--heads-k 2] [--head-dim 64] [--threads 0] [--kv-fp8] [--mixed-step] [--verify]
//
// --mixed-step runs each step's prefill chunks and decode tokens as ONE fa_kvcache_append (every sequence's new rows)
// and ONE causal varlen fa_forward over the paged pool (PagedKvCache::make_step), instead of a fa_kvcache call per
// prompt and one for the decodes (not with --kv-fp8: fa_forward reads 16-bit and float32 pools).
// --kv-fp8 keeps the pool in FP8 (e4m3, scales 1/16; with --dtype float16 or bfloat16, the dtype of q and out).
// --verify checks every sequence's output of every call against the float64 reference
// (FA_BACKEND_CPU_REFERENCE) on that sequence's dense key/value history, and prints the worst error.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "continuous_batching.hpp"

namespace {

using flashattn::Status;
using flashattn::toy::CallRecord;
using flashattn::toy::Request;
using flashattn::toy::ServerConfig;
using flashattn::toy::StepLog;

int usage(const char* message) {
  FILE* stream = message ? stderr : stdout;
  if (message) std::fprintf(stderr, "continuous_batching: %s\n", message);
  std::fprintf(stream,
               "usage: continuous_batching [--device cpu|cuda] [--dtype float32|float16|bfloat16] [--requests N]\n"
               "       [--num-blocks N] [--block-size N] [--prefill-chunk N] [--seed N] [--heads-q N] [--heads-k N]\n"
               "       [--head-dim N] [--threads N] [--kv-fp8] [--mixed-step] [--verify]\n"
               "A toy continuous-batching server over the paged KV cache (flashattn/kv_cache.hpp): requests arrive\n"
               "and finish at different steps; each step prefills new prompts and decodes one token for every\n"
               "active sequence in one fa_kvcache call. --mixed-step: the prefills and decodes of a step in one\n"
               "fa_kvcache_append + one varlen fa_forward. --verify checks every call against the float64 reference.\n");
  return message ? 2 : 0;
}

// A mixed workload: arrivals spread over the first steps, prompts from 1 to 96 tokens, 1 to 32 decode
// tokens, and every fourth request a 3-beam search.
std::vector<Request> make_workload(int count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> gap(0, 3), prompt(1, 96), decode(1, 32);
  std::vector<Request> requests;
  int step = 0;
  for (int n = 0; n < count; ++n) {
    Request r;
    r.arrival_step = step;
    r.prompt_tokens = n == 0 ? 1 : prompt(rng);  // one single-token prompt for the edge
    r.decode_tokens = decode(rng);
    r.beams = n % 4 == 1 ? 3 : 1;
    requests.push_back(r);
    step += gap(rng);
  }
  return requests;
}

// Relative L2 error of one record's output against the float64 reference on the dense history.
struct Verifier {
  ServerConfig config;
  double worst = 0;
  int calls = 0;
  Status status;

  void check(const CallRecord& r) {
    if (!status.ok()) return;
    const int total = r.cached + r.new_tokens, hq = config.heads_q, hk = config.heads_k, d = config.head_dim, dv = config.dv();
    // (an FP8 pool's history holds e4m3 codes: real = code value x scale)
    auto to_f32 = [&](const uint8_t* src, int64_t count, fa_dtype dtype, float scale) {
      std::vector<float> dst(static_cast<size_t>(count));
      for (int64_t e = 0; e < count; ++e) dst[size_t(e)] = flashattn::load_as_float(src, e, dtype) * scale;
      return dst;
    };
    const fa_dtype cache = config.cache_dtype();
    const float k_scale = config.fp8_cache ? config.k_scale : 1.f, v_scale = config.fp8_cache ? config.v_scale : 1.f;
    std::vector<float> q = to_f32(r.q, int64_t(r.new_tokens) * hq * d, config.dtype, 1.f);
    std::vector<float> k = to_f32(r.k_history->data(), int64_t(total) * hk * d, cache, k_scale);
    std::vector<float> v = to_f32(r.v_history->data(), int64_t(total) * hk * dv, cache, v_scale);
    std::vector<float> ref(size_t(r.new_tokens) * hq * dv);
    fa_forward_args args{};
    args.q = flashattn::tensor(q.data(), {1, r.new_tokens, hq, d}, FA_FLOAT32);
    args.k = flashattn::tensor(k.data(), {1, total, hk, d}, FA_FLOAT32);
    args.v = flashattn::tensor(v.data(), {1, total, hk, dv}, FA_FLOAT32);
    args.out = flashattn::tensor(ref.data(), {1, r.new_tokens, hq, dv}, FA_FLOAT32);
    flashattn::Options options = flashattn::default_options();
    options.causal = r.causal ? 1 : 0;  // bottom-right aligned: query i sees keys <= cached + i
    options.backend = FA_BACKEND_CPU_REFERENCE;
    status = flashattn::forward(args, options);
    double diff2 = 0, ref2 = 0;
    for (size_t e = 0; e < ref.size(); ++e) {
      const double got = flashattn::load_as_float(r.out, int64_t(e), config.dtype);
      diff2 += (got - ref[e]) * (got - ref[e]);
      ref2 += double(ref[e]) * ref[e];
    }
    const double rel = std::isfinite(diff2) ? std::sqrt(diff2 / std::max(ref2, 1e-300)) : INFINITY;
    worst = std::max(worst, rel);
    ++calls;
  }
};

}  // namespace

int main(int argc, char** argv) {
  ServerConfig config;
  config.num_blocks = 48;
  config.block_size = 16;
  config.poison = true;  // cheap at this size, and an unwritten row would show up as NaN
  int requests = 12;
  bool verify = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    auto value = [&]() { return std::string(argv[++i]); };
    auto number = [&]() { return std::atoi(argv[++i]); };
    if (a == "--help" || a == "-h") return usage(nullptr);
    if (a == "--verify") verify = true;
    else if (a == "--kv-fp8") config.fp8_cache = true;
    else if (a == "--mixed-step") config.mixed_step = true;
    else if (!has_value) return usage(("missing value after " + a).c_str());
    else if (a == "--device") {
      const std::string d = value();
      if (d == "cpu") config.device = FA_DEVICE_CPU;
      else if (d == "cuda") config.device = FA_DEVICE_CUDA;
      else return usage("--device must be cpu or cuda");
    } else if (a == "--dtype") {
      const std::string t = value();
      if (t == "float32") config.dtype = FA_FLOAT32;
      else if (t == "float16") config.dtype = FA_FLOAT16;
      else if (t == "bfloat16") config.dtype = FA_BFLOAT16;
      else return usage("--dtype must be float32, float16 or bfloat16");
    } else if (a == "--requests") requests = number();
    else if (a == "--num-blocks") config.num_blocks = number();
    else if (a == "--block-size") config.block_size = number();
    else if (a == "--prefill-chunk") config.prefill_chunk = number();
    else if (a == "--seed") config.seed = uint64_t(std::strtoull(argv[++i], nullptr, 10));
    else if (a == "--heads-q") config.heads_q = number();
    else if (a == "--heads-k") config.heads_k = number();
    else if (a == "--head-dim") config.head_dim = number();
    else if (a == "--threads") config.num_threads = number();
    else return usage(("unknown option " + a).c_str());
  }
  if (config.fp8_cache && config.dtype == FA_FLOAT32) return usage("--kv-fp8: needs --dtype float16 or bfloat16 (q and out)");
  if (config.fp8_cache && config.mixed_step) return usage("--mixed-step: fa_forward does not read an FP8 pool (drop --kv-fp8)");
  if (config.device == FA_DEVICE_CUDA && fa_cuda_device_count() == 0)
    return usage("--device cuda: no CUDA device (or this build has no CUDA backend)");

  flashattn::toy::ToyServer server;
  Status status = server.init(config);
  if (!status.ok()) {
    std::fprintf(stderr, "continuous_batching: %s\n", status.to_string().c_str());
    return 1;
  }
  const std::vector<Request> workload = make_workload(requests, config.seed);
  std::printf("%d requests on %s, %s%s, Hq=%d Hk=%d D=%d, %d blocks of %d tokens\n", requests,
              config.device == FA_DEVICE_CPU ? "cpu" : "cuda", flashattn::dtype_name(config.dtype),
              config.fp8_cache ? " (float8_e4m3 pool)" : "", config.heads_q, config.heads_k, config.head_dim, config.num_blocks,
              config.block_size);
  for (size_t n = 0; n < workload.size(); ++n)
    std::printf("  request %2zu: arrives at step %3d, prompt %3d, decode %2d, beams %d (needs <= %lld blocks)\n", n,
                workload[n].arrival_step, workload[n].prompt_tokens, workload[n].decode_tokens, workload[n].beams,
                (long long)server.lifetime_blocks(workload[n]));
  std::printf("step | arrived admitted waiting | prefill calls (tokens) | decode B | forked finished | active | free blocks | cow copies\n");

  Verifier verifier;
  verifier.config = config;
  auto on_call = [&](const CallRecord& r) { verifier.check(r); };
  // A line per step where a request arrives, is admitted, prefills, forks or finishes, and every
  // kLogEvery-th step of plain decoding.
  constexpr int kLogEvery = 8;
  auto on_step = [](const StepLog& s) {
    const bool eventful = s.arrived + s.admitted + s.prefill_calls + s.forked + s.finished > 0;
    if (!eventful && s.step % kLogEvery != 0) return;
    std::printf("%4d | %7d %8d %7d | %7d (%5d)        | %8d | %6d %8d | %6d | %5d / %-5d | %lld\n", s.step, s.arrived, s.admitted,
                s.waiting, s.prefill_calls, s.prefill_tokens, s.decode_batch, s.forked, s.finished, s.active, s.free_blocks,
                s.num_blocks, (long long)s.copies_made);
  };
  status = server.run(workload, verify ? flashattn::toy::ToyServer::Observer(on_call) : nullptr, on_step);
  if (status.ok()) status = verifier.status;
  if (!status.ok()) {
    std::fprintf(stderr, "continuous_batching: %s\n", status.to_string().c_str());
    return 1;
  }
  std::printf("done: %d of %d blocks free, %d sequences live\n", server.cache().free_blocks(), server.cache().num_blocks(),
              server.cache().num_sequences());
  if (verify) {
    std::printf("verify: %d sequence-calls against the float64 reference, worst relative L2 error %.3g (%s)\n", verifier.calls,
                verifier.worst, flashattn::dtype_name(config.dtype));
    // float32: the library's rule, 1e-5 relative. 16-bit: the output alone is rounded to the dtype
    // (relative error up to its unit roundoff u) and so are the probabilities before P V; a sanity
    // bound of 4u (the tests apply the exact rule against a naive same-precision computation).
    constexpr double kUnitRoundoffF16 = 1.0 / 2048, kUnitRoundoffBf16 = 1.0 / 256;  // 2^-11, 2^-8
    const double limit = config.dtype == FA_FLOAT32 ? 1e-5 : 4 * (config.dtype == FA_FLOAT16 ? kUnitRoundoffF16 : kUnitRoundoffBf16);
    if (!(verifier.worst <= limit)) {
      std::fprintf(stderr, "verify: FAILED (limit %.g)\n", limit);
      return 1;
    }
  }
  return 0;
}
