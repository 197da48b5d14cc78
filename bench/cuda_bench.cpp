// flashattn_cuda_bench: times the CUDA forward (and backward) through the public API over the standard
// sweep of DESIGN.md: total 16k tokens (B = 16384 / S), hidden 2048 (H = 2048 / D), S = 512 .. 16k,
// D in {64, 128, 256}, causal and not, bf16 and fp16. CUDA events around each call, warm-up first,
// the median of the timed repetitions; inputs are random (never zeros) and, being 64 MiB per tensor,
// larger than the L2, so repetitions do not run from cache.
//   TFLOP/s = 4 B H S^2 D / t  (half of that when causal); backward counts 2.5x the forward's FLOPs.
// The backward gets its workspace from here (allocated once, outside the timing), as the Python bindings
// pass one from torch's caching allocator. Without one the library takes it with cudaMallocAsync from the
// default memory pool, whose default release threshold (0) returns it to the driver at every
// synchronisation, so each timed call (an event sync apart) paid a fresh mapping of its 128 MiB: 0.14-0.15
// ms per call (bf16, D = 64 / 128, S = 512 / 1k: 0.778 against 0.929 ms at D = 64, S = 512; H200,
// 2026-11-30 10:17 UTC, --library-workspace; see fa_backward_args::workspace in flashattn.h).
// Usage: flashattn_cuda_bench [--json FILE] [--dtypes bf16,f16] [--dims 64,128,256]
//                             [--seqlens 512,...] [--causal 0,1] [--reps 10] [--fwd-reps N] [--warmup-ms T] [--no-backward]
//                             [--library-workspace]  (the backward allocates its own workspace per call)
//                             [--paged 0,16,64,256]
//   --paged: the forward also over K / V as a paged cache of that block size (0: dense, the default): the same bytes
//   viewed as (B * S / block, block, H, D) blocks, which a block table (B, S / block) of one random permutation of the
//   block ids hands out to the sequences (the variable-length prefill of a serving step reads K / V so). Forward
//   only (the backward takes dense K / V); the block size must divide S.
//   --fwd-reps: timed forward calls (default --reps); bench/clock_probe.py runs the backward for seconds with
//   --reps large and --fwd-reps small, so that the card's clock it logs belongs to the backward.
//   --warmup-ms T: after the 3 warm-up calls, more calls until T ms have passed (default 0). The H200 runs these
//   shapes at its 700 W power cap, and a point timed right after seconds of heavier work runs at a clock still
//   lowered by it (fp16 D = 128 causal 16k backward: 287-298 TFLOP/s after the D = 64 / 128 points against
//   304-309 alone; H200, 2026-12-01 04:47 UTC, docs/PERFORMANCE.md). bench/rounds.py gives ours and the peers
//   the same T, so each point is timed in its own steady state, independent of the points before it.
//        flashattn_cuda_bench --memory [--json FILE]
//   --memory: peak device memory of forward + backward against S (1k .. 128k; B = 1, H = 16, D = 128,
//   bf16): every byte the calls touch is allocated here (q, k, v, out, lse, dout, dq, dk, dv and the
//   backward workspace that fa_backward_workspace_size reports; the forward allocates nothing), so the
//   sum is the peak; the device's used memory (cudaMemGetInfo) is read around the calls to confirm it.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <ctime>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "core/dtype.hpp"
#include "flashattn/flashattn.hpp"

namespace {

constexpr int64_t kTokens = 16384;  // B * S of every point of the sweep
constexpr int64_t kHidden = 2048;   // H * D

std::vector<std::string> parse_words(const std::string& s) {
  std::vector<std::string> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) v.push_back(item);
  return v;
}

// A device buffer of kTokens * kHidden 16-bit elements (the size of q, k, v, out, dout at every point).
struct Buffer {
  void* data = nullptr;
  explicit Buffer(int64_t bytes) { CHECK_CUDA(cudaMalloc(&data, size_t(bytes))); }
  ~Buffer() { cudaFree(data); }
};

void fill_random(void* device, int64_t count, fa_dtype dtype, uint64_t seed) {
  std::vector<uint16_t> host(static_cast<size_t>(count));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (auto& h : host) {
    const float x = normal(rng);
    h = dtype == FA_BFLOAT16 ? flashattn::to_bf16(x).bits : flashattn::to_f16(x).bits;
  }
  CHECK_CUDA(cudaMemcpy(device, host.data(), host.size() * 2, cudaMemcpyHostToDevice));
}

// Median time in milliseconds of `reps` calls of `body` after `warmup` calls and then more calls until
// `warmup_ms` milliseconds of warm-up have passed (0: the calls only); -1 when a call fails.
template <typename Body>
double median_ms(int warmup, double warmup_ms, int reps, Body body, std::string* error) {
  const auto warmup_start = std::chrono::steady_clock::now();
  for (int w = 0;; ++w) {
    if (w >= warmup) {
      CHECK_CUDA(cudaDeviceSynchronize());
      const double elapsed =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - warmup_start).count();
      if (elapsed >= warmup_ms) break;
    }
    const flashattn::Status s = body();
    if (!s.ok()) {
      *error = s.to_string();
      return -1;
    }
  }
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<double> times;
  for (int r = 0; r < reps; ++r) {
    CHECK_CUDA(cudaEventRecord(start));
    const flashattn::Status s = body();
    CHECK_CUDA(cudaEventRecord(stop));
    CHECK_CUDA(cudaEventSynchronize(stop));
    if (!s.ok()) {
      *error = s.to_string();
      return -1;
    }
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

fa_tensor view(void* data, int64_t b, int64_t s, int64_t h, int64_t d, fa_dtype dtype) {
  const int64_t shape[4] = {b, s, h, d};
  return fa_tensor_contiguous(data, 4, shape, dtype, FA_DEVICE_CUDA, 0);
}

// Peak device memory of forward + backward over S: O(S) for flashattn (see the usage comment).
int memory_sweep(const std::string& json_path) {
  const int64_t h = 16, d = 128;
  const fa_dtype dtype = FA_BFLOAT16;
  std::string json = "{\n \"points\": [\n";
  std::printf("%8s | %14s %14s %14s %14s | %8s %8s\n", "S", "tensors MiB", "workspace MiB", "peak MiB", "measured MiB",
              "fwd ms", "bwd ms");
  for (int64_t s = 1024; s <= 131072; s *= 2) {
    size_t free_before = 0, total = 0;
    CHECK_CUDA(cudaDeviceSynchronize());
    CHECK_CUDA(cudaMemGetInfo(&free_before, &total));
    const int64_t elements = s * h * d, bytes = elements * 2;
    Buffer q(bytes), k(bytes), v(bytes), out(bytes), dout(bytes), dq(bytes), dk(bytes), dv(bytes), lse(h * s * 4);
    fill_random(q.data, elements, dtype, 11);
    fill_random(k.data, elements, dtype, 12);
    fill_random(v.data, elements, dtype, 13);
    fill_random(dout.data, elements, dtype, 14);
    fa_forward_args fwd{};
    fwd.q = view(q.data, 1, s, h, d, dtype);
    fwd.k = view(k.data, 1, s, h, d, dtype);
    fwd.v = view(v.data, 1, s, h, d, dtype);
    fwd.out = view(out.data, 1, s, h, d, dtype);
    const int64_t lse_shape[3] = {1, h, s};
    fwd.lse = fa_tensor_contiguous(lse.data, 3, lse_shape, FA_FLOAT32, FA_DEVICE_CUDA, 0);
    fa_backward_args bwd{};
    bwd.q = fwd.q, bwd.k = fwd.k, bwd.v = fwd.v, bwd.out = fwd.out, bwd.lse = fwd.lse;
    bwd.dout = view(dout.data, 1, s, h, d, dtype);
    bwd.dq = view(dq.data, 1, s, h, d, dtype);
    bwd.dk = view(dk.data, 1, s, h, d, dtype);
    bwd.dv = view(dv.data, 1, s, h, d, dtype);
    fa_options options;
    fa_options_init(&options);
    options.backend = FA_BACKEND_CUDA;
    int64_t workspace_bytes = 0;
    flashattn::Status st = flashattn::backward_workspace_size(bwd, options, &workspace_bytes);
    if (!st.ok()) {
      std::fprintf(stderr, "S=%lld: %s\n", (long long)s, st.to_string().c_str());
      return 1;
    }
    Buffer workspace(std::max<int64_t>(workspace_bytes, 16));
    const int64_t ws_shape[1] = {workspace_bytes};
    bwd.workspace = fa_tensor_contiguous(workspace.data, 1, ws_shape, FA_UINT8, FA_DEVICE_CUDA, 0);
    std::string error;
    const double fwd_ms = median_ms(1, 0, 1, [&] { return flashattn::forward(fwd, options); }, &error);
    const double bwd_ms = median_ms(1, 0, 1, [&] { return flashattn::backward(bwd, options); }, &error);
    size_t free_after = 0;
    CHECK_CUDA(cudaDeviceSynchronize());
    CHECK_CUDA(cudaMemGetInfo(&free_after, &total));
    const int64_t tensors = 8 * bytes + h * s * 4;
    const double mib = 1048576.0;
    std::printf("%8lld | %14.1f %14.1f %14.1f %14.1f | %8.2f %8.2f %s\n", (long long)s, tensors / mib, workspace_bytes / mib,
                (tensors + workspace_bytes) / mib, double(free_before - free_after) / mib, fwd_ms, bwd_ms, error.c_str());
    std::fflush(stdout);
    char line[256];
    std::snprintf(line, sizeof(line),
                  "  {\"S\": %lld, \"tensor_bytes\": %lld, \"workspace_bytes\": %lld, \"peak_bytes\": %lld, "
                  "\"measured_used_bytes\": %lld, \"fwd_ms\": %.3f, \"bwd_ms\": %.3f}",
                  (long long)s, (long long)tensors, (long long)workspace_bytes, (long long)(tensors + workspace_bytes),
                  (long long)(free_before - free_after), fwd_ms, bwd_ms);
    json += std::string(s > 1024 ? ",\n" : "") + line;
  }
  json += "\n ],\n \"config\": {\"B\": 1, \"H\": 16, \"D\": 128, \"dtype\": \"bf16\"}\n}\n";
  if (!json_path.empty()) {
    FILE* f = std::fopen(json_path.c_str(), "w");
    if (f != nullptr) {
      std::fputs(json.c_str(), f);
      std::fclose(f);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string json_path, dtypes_arg = "bf16,f16", dims_arg = "64,128,256", seqlens_arg = "512,1024,2048,4096,8192,16384",
                         causal_arg = "0,1", paged_arg = "0";
  int reps = 10, fwd_reps = -1, warmup = 3;
  double warmup_ms = 0;
  bool backward = true, memory = false, library_workspace = false;
  for (int a = 1; a < argc; ++a) {
    const std::string arg = argv[a];
    auto next = [&]() -> std::string {
      if (a + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", arg.c_str());
        std::exit(2);
      }
      return argv[++a];
    };
    if (arg == "--json") json_path = next();
    else if (arg == "--dtypes") dtypes_arg = next();
    else if (arg == "--dims") dims_arg = next();
    else if (arg == "--seqlens") seqlens_arg = next();
    else if (arg == "--causal") causal_arg = next();
    else if (arg == "--reps") reps = std::stoi(next());
    else if (arg == "--fwd-reps") fwd_reps = std::stoi(next());
    else if (arg == "--warmup-ms") warmup_ms = std::stod(next());
    else if (arg == "--no-backward") backward = false;
    else if (arg == "--memory") memory = true;
    else if (arg == "--library-workspace") library_workspace = true;
    else if (arg == "--paged") paged_arg = next();
    else {
      std::fprintf(stderr, "usage: %s [--json FILE] [--dtypes bf16,f16] [--dims 64,128,256] [--seqlens 512,...] "
                   "[--causal 0,1] [--reps N] [--fwd-reps N] [--warmup-ms T] [--no-backward] [--library-workspace] "
                   "[--paged 0,16,...]\n", argv[0]);
      return 2;
    }
  }
  if (reps < 1 || fwd_reps == 0 || fwd_reps < -1 || !(warmup_ms >= 0)) {
    std::fprintf(stderr, "--reps and --fwd-reps must be at least 1, --warmup-ms at least 0\n");
    return 2;
  }
  if (fwd_reps < 0) fwd_reps = reps;
  const std::vector<int> paged_blocks = flashattn::bench::parse_ints(paged_arg);
  for (int block : paged_blocks) {  // checked before any point runs
    if (block < 0) {
      std::fprintf(stderr, "--paged: block sizes must be >= 1 (0: dense), got %d\n", block);
      return 2;
    }
    for (int s : flashattn::bench::parse_ints(seqlens_arg))
      if (block > 0 && s % block != 0) {
        std::fprintf(stderr, "--paged %d: the block size must divide every S of --seqlens, not %d\n", block, s);
        return 2;
      }
  }
  if (fa_cuda_device_count() == 0) {
    std::fprintf(stderr, "flashattn_cuda_bench: no CUDA device\n");
    return 1;
  }
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof(date), "%Y-%m-%d %H:%M UTC", std::gmtime(&now));
  std::printf("flashattn %s, %s (%d SMs), %s\n", fa_version(), prop.name, prop.multiProcessorCount, date);
  if (memory) return memory_sweep(json_path);

  const int64_t elements = kTokens * kHidden;
  Buffer q(elements * 2), k(elements * 2), v(elements * 2), out(elements * 2), dout(elements * 2), dq(elements * 2),
      dk(elements * 2), dv(elements * 2);
  Buffer lse(kTokens * kHidden / 32 * 4);  // B * H * S floats; H = 2048 / D <= 64 heads at D >= 32
  Buffer table(kTokens * 4);               // --paged: the block table, at most B * S = kTokens ids (block size 1)

  std::string json = "{\n \"env\": {\"gpu\": \"" + std::string(prop.name) + "\", \"sms\": " +
                     std::to_string(prop.multiProcessorCount) + ", \"date\": \"" + date + "\", \"flashattn\": \"" +
                     fa_version() + "\", \"warmup_ms\": " + std::to_string(warmup_ms) + "},\n \"points\": [\n";
  bool first = true;
  std::printf("%-5s %4s %6s %3s %3s %6s %5s | %9s %9s | %9s %9s\n", "dtype", "D", "S", "B", "H", "causal", "paged", "fwd ms",
              "fwd TF/s", "bwd ms", "bwd TF/s");
  std::unique_ptr<Buffer> workspace;  // the backward's, grown to the largest point so far
  int64_t workspace_capacity = 0;
  for (const std::string& dtype_name : parse_words(dtypes_arg)) {
    const fa_dtype dtype = dtype_name == "f16" ? FA_FLOAT16 : FA_BFLOAT16;
    fill_random(q.data, elements, dtype, 1);
    fill_random(k.data, elements, dtype, 2);
    fill_random(v.data, elements, dtype, 3);
    fill_random(dout.data, elements, dtype, 4);
    for (int d : flashattn::bench::parse_ints(dims_arg))
      for (int s : flashattn::bench::parse_ints(seqlens_arg))
        for (int causal : flashattn::bench::parse_ints(causal_arg))
          for (int block : paged_blocks) {
            const int64_t b = kTokens / s, h = kHidden / d;
            fa_forward_args fwd{};
            fwd.q = view(q.data, b, s, h, d, dtype);
            fwd.k = view(k.data, b, s, h, d, dtype);
            fwd.v = view(v.data, b, s, h, d, dtype);
            fwd.out = view(out.data, b, s, h, d, dtype);
            if (block > 0) {  // the same K / V bytes as blocks, handed out in a random order
              const int64_t blocks = b * s / block, per_seq = s / block;
              fwd.k = view(k.data, blocks, block, h, d, dtype);
              fwd.v = view(v.data, blocks, block, h, d, dtype);
              std::vector<int32_t> ids(static_cast<size_t>(blocks));
              for (int64_t n = 0; n < blocks; ++n) ids[size_t(n)] = int32_t(n);
              std::shuffle(ids.begin(), ids.end(), std::mt19937_64(uint64_t(block) * 1000003u + uint64_t(s)));
              CHECK_CUDA(cudaMemcpy(table.data, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
              const int64_t table_shape[2] = {b, per_seq};
              fwd.block_table = fa_tensor_contiguous(table.data, 2, table_shape, FA_INT32, FA_DEVICE_CUDA, 0);
            }
            const int64_t lse_shape[3] = {b, h, s};
            fwd.lse = fa_tensor_contiguous(lse.data, 3, lse_shape, FA_FLOAT32, FA_DEVICE_CUDA, 0);
            fa_options options;
            fa_options_init(&options);
            options.backend = FA_BACKEND_CUDA;
            options.causal = causal;
            fa_stats stats{};
            options.stats = &stats;
            const double flops = 4.0 * double(b) * double(h) * double(s) * double(s) * double(d) * (causal ? 0.5 : 1.0);
            std::string fwd_error, bwd_error;
            const double fwd_ms = median_ms(warmup, warmup_ms, fwd_reps, [&] { return flashattn::forward(fwd, options); }, &fwd_error);
            const std::string kernel = stats.kernel;
            double bwd_ms = -1;
            // ---- backward timing (the backward engineer's kernel; same sweep, 2.5x the forward FLOPs) ----
            if (backward && block == 0 && fwd_ms > 0) {
              fa_backward_args bwd{};
              bwd.q = fwd.q;
              bwd.k = fwd.k;
              bwd.v = fwd.v;
              bwd.out = fwd.out;
              bwd.lse = fwd.lse;
              bwd.dout = view(dout.data, b, s, h, d, dtype);
              bwd.dq = view(dq.data, b, s, h, d, dtype);
              bwd.dk = view(dk.data, b, s, h, d, dtype);
              bwd.dv = view(dv.data, b, s, h, d, dtype);
              int64_t workspace_bytes = 0;
              const flashattn::Status sized = flashattn::backward_workspace_size(bwd, options, &workspace_bytes);
              if (sized.ok() && workspace_bytes > workspace_capacity) {
                workspace.reset();
                workspace = std::make_unique<Buffer>(workspace_bytes);
                workspace_capacity = workspace_bytes;
              }
              if (sized.ok() && workspace_bytes > 0 && !library_workspace) {
                const int64_t ws_shape[1] = {workspace_bytes};
                bwd.workspace = fa_tensor_contiguous(workspace->data, 1, ws_shape, FA_UINT8, FA_DEVICE_CUDA, 0);
              }
              bwd_ms = median_ms(warmup, warmup_ms, reps, [&] { return flashattn::backward(bwd, options); }, &bwd_error);
            }
            const double fwd_tflops = fwd_ms > 0 ? flops / (fwd_ms * 1e-3) / 1e12 : 0;
            const double bwd_tflops = bwd_ms > 0 ? 2.5 * flops / (bwd_ms * 1e-3) / 1e12 : 0;
            std::printf("%-5s %4d %6d %3lld %3lld %6d %5d | %9.3f %9.1f | %9.3f %9.1f %s%s\n", dtype_name.c_str(), d, s,
                        (long long)b, (long long)h, causal, block, fwd_ms, fwd_tflops, bwd_ms, bwd_tflops,
                        fwd_error.empty() ? "" : ("fwd: " + fwd_error).c_str(),
                        bwd_error.empty() ? "" : (" bwd: " + bwd_error.substr(0, 80)).c_str());
            std::fflush(stdout);
            char line[512];
            std::snprintf(line, sizeof(line),
                          "  {\"dtype\": \"%s\", \"D\": %d, \"S\": %d, \"B\": %lld, \"H\": %lld, \"causal\": %s, \"paged\": %d, "
                          "\"fwd_ms\": %.4f, \"fwd_tflops\": %.1f, \"bwd_ms\": %.4f, \"bwd_tflops\": %.1f, \"kernel\": \"%s\"}",
                          dtype_name.c_str(), d, s, (long long)b, (long long)h, causal ? "true" : "false", block, fwd_ms, fwd_tflops,
                          bwd_ms, bwd_tflops, kernel.c_str());
            json += std::string(first ? "" : ",\n") + line;
            first = false;
          }
  }
  json += "\n ]\n}\n";
  if (!json_path.empty()) {
    FILE* f = std::fopen(json_path.c_str(), "w");
    if (f == nullptr) {
      std::fprintf(stderr, "cannot write %s\n", json_path.c_str());
      return 1;
    }
    std::fputs(json.c_str(), f);
    std::fclose(f);
  }
  return 0;
}
