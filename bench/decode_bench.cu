// flashattn_decode_bench: the CUDA KV-cache (decode) path through the public API, as bytes of K/V read per
// second, beside the device's streaming-read bandwidth measured in the same run.
//
// Sweep (the issue's): bf16, D = 128, 32 query heads and 8 K/V heads (GQA 4), one new query per sequence,
// batch 1..256, cache 1k..128k keys (every sequence full: cache_seqlens = S), contiguous cache and paged
// cache (page 16, block ids shuffled). Points whose K/V exceed --budget-gib are skipped (and listed).
// K/V bytes of a call = B * S * Hk * (D + Dv) * 2. Each call is planned once (fa_plan_kvcache) and runs with
// the planned workspace; the timed unit is a CUDA graph of one call per copy of the inputs, where copies
// are added until they exceed 2x the L2 (so every call reads from HBM, as in serving); time per call =
// graph time / copies, median over repetitions. "eager" is one call launched normally (launch overhead
// included), for reference.
// Streaming read: a read-only kernel (16-byte loads, grid-stride) over 4 GiB; device copy: cudaMemcpy D2D,
// read + write bytes counted (DESIGN.md's anchor, 4.27 TB/s on the H200).
//
// Usage: flashattn_decode_bench [--json FILE] [--batches 1,4,16,64,256] [--caches 1024,...,131072]
//                               [--heads 32:8] [--dim 128] [--page 16] [--dtype bf16|f16] [--layouts contiguous,paged]
//                               [--budget-gib 32] [--reps 10]
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "flashattn/flashattn.hpp"

namespace {

#define CHECK_CUDA(call)                                                                         \
  do {                                                                                           \
    const cudaError_t e_ = (call);                                                               \
    if (e_ != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                                              \
    }                                                                                            \
  } while (0)

constexpr int64_t kStreamBytes = int64_t(4) << 30;  // the streaming-read buffer
constexpr int kStreamThreads = 256;
constexpr int kMaxCopies = 64;

std::vector<int64_t> parse_ints(const std::string& s) {
  std::vector<int64_t> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) v.push_back(std::stoll(item));
  return v;
}

// Reads `words` 16-byte words; the XOR of everything read is stored only if it hits a value that random data
// practically never gives, so the loads cannot be optimised away and almost nothing is written.
__global__ void stream_read_kernel(const uint4* data, int64_t words, unsigned int* sink) {
  uint4 acc = make_uint4(0, 0, 0, 0);
  for (int64_t w = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; w < words; w += int64_t(gridDim.x) * blockDim.x) {
    const uint4 v = __ldcs(data + w);  // streaming: do not keep in L2
    acc.x ^= v.x, acc.y ^= v.y, acc.z ^= v.z, acc.w ^= v.w;
  }
  if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x9E3779B9u) *sink = acc.x;
}

// Fills 16-bit elements with hashed values in [-1, 1) (never zeros, no host traffic).
__global__ void fill_kernel(uint16_t* data, int64_t count, uint32_t seed, bool bf16) {
  for (int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; n < count; n += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(n) * 0x9E3779B1u ^ uint32_t(n >> 32) ^ seed;
    h ^= h >> 16, h *= 0x85EBCA6Bu, h ^= h >> 13, h *= 0xC2B2AE35u, h ^= h >> 16;
    const float x = float(h >> 8) * (2.f / 16777216.f) - 1.f;
    data[n] = bf16 ? __bfloat16_as_ushort(__float2bfloat16(x)) : __half_as_ushort(__float2half(x));
  }
}

void fill(void* data, int64_t count, uint32_t seed, fa_dtype dtype) {
  fill_kernel<<<1024, 256>>>(static_cast<uint16_t*>(data), count, seed, dtype == FA_BFLOAT16);
  CHECK_CUDA(cudaGetLastError());
}

struct Buffer {
  void* data = nullptr;
  int64_t bytes = 0;
  Buffer() = default;
  explicit Buffer(int64_t n) : bytes(n) { CHECK_CUDA(cudaMalloc(&data, size_t(std::max<int64_t>(n, 16)))); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& o) noexcept : data(o.data), bytes(o.bytes) { o.data = nullptr; }
  Buffer& operator=(Buffer&& o) noexcept {
    std::swap(data, o.data);
    std::swap(bytes, o.bytes);
    return *this;
  }
  ~Buffer() {
    if (data) cudaFree(data);
  }
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? -1 : v[v.size() / 2];
}

// Median milliseconds of `reps` runs of `body` (events on `stream`), after one warm-up run.
template <typename Body>
double time_ms(cudaStream_t stream, int reps, Body body) {
  body();
  CHECK_CUDA(cudaStreamSynchronize(stream));
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<double> times;
  for (int r = 0; r < reps; ++r) {
    CHECK_CUDA(cudaEventRecord(start, stream));
    body();
    CHECK_CUDA(cudaEventRecord(stop, stream));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return median(times);
}

fa_tensor tensor(void* data, std::vector<int64_t> shape, fa_dtype dtype) {
  return fa_tensor_contiguous(data, int32_t(shape.size()), shape.data(), dtype, FA_DEVICE_CUDA, 0);
}

struct Shape {
  int64_t batch, cache;
  int heads_q, heads_k, dim, page;
  bool paged;
  fa_dtype dtype;
  int64_t kv_bytes() const { return batch * cache * heads_k * int64_t(2 * dim) * 2; }
};

// One copy of a point's inputs (device memory) and its call arguments.
struct Copy {
  Buffer q, k, v, out, lse, seqlens, table;
  fa_kvcache_args args{};
};

Copy make_copy(const Shape& s, uint32_t seed, std::mt19937_64& rng) {
  Copy c;
  const int64_t q_elems = s.batch * s.heads_q * s.dim, kv_elems = s.batch * s.cache * s.heads_k * s.dim;
  c.q = Buffer(q_elems * 2);
  c.k = Buffer(kv_elems * 2);
  c.v = Buffer(kv_elems * 2);
  c.out = Buffer(q_elems * 2);
  c.lse = Buffer(s.batch * s.heads_q * 4);
  c.seqlens = Buffer(s.batch * 4);
  fill(c.q.data, q_elems, seed, s.dtype);
  fill(c.k.data, kv_elems, seed + 1, s.dtype);
  fill(c.v.data, kv_elems, seed + 2, s.dtype);
  const std::vector<int32_t> lengths(size_t(s.batch), int32_t(s.cache));
  CHECK_CUDA(cudaMemcpy(c.seqlens.data, lengths.data(), lengths.size() * 4, cudaMemcpyHostToDevice));
  fa_kvcache_args& a = c.args;
  a.q = tensor(c.q.data, {s.batch, 1, s.heads_q, s.dim}, s.dtype);
  a.out = tensor(c.out.data, {s.batch, 1, s.heads_q, s.dim}, s.dtype);
  a.lse = tensor(c.lse.data, {s.batch, s.heads_q, 1}, FA_FLOAT32);
  a.cache_seqlens = tensor(c.seqlens.data, {s.batch}, FA_INT32);
  if (s.paged) {
    const int64_t per_seq = s.cache / s.page, blocks = s.batch * per_seq;
    std::vector<int32_t> ids(static_cast<size_t>(blocks));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);  // a serving cache's pages are scattered
    c.table = Buffer(blocks * 4);
    CHECK_CUDA(cudaMemcpy(c.table.data, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
    a.k_cache = tensor(c.k.data, {blocks, s.page, s.heads_k, s.dim}, s.dtype);
    a.v_cache = tensor(c.v.data, {blocks, s.page, s.heads_k, s.dim}, s.dtype);
    a.block_table = tensor(c.table.data, {s.batch, per_seq}, FA_INT32);
  } else {
    a.k_cache = tensor(c.k.data, {s.batch, s.cache, s.heads_k, s.dim}, s.dtype);
    a.v_cache = tensor(c.v.data, {s.batch, s.cache, s.heads_k, s.dim}, s.dtype);
  }
  return c;
}

// Quotes would break the JSON string of an error message.
std::string json_safe(std::string s) {
  std::replace(s.begin(), s.end(), '"', '\'');
  return s;
}

struct Result {
  double us_graph = -1, us_eager = -1, kv_tbs = -1;
  int splits = 0, copies = 0;
  std::string kernel, error;
};

Result run_point(const Shape& s, int reps, int64_t l2_bytes, cudaStream_t stream) {
  Result r;
  std::mt19937_64 rng(uint64_t(s.batch * 1315423911u + s.cache));
  r.copies = int(std::min<int64_t>(kMaxCopies, std::max<int64_t>(1, (2 * l2_bytes) / s.kv_bytes() + 1)));
  std::vector<Copy> copies;
  for (int c = 0; c < r.copies; ++c) copies.push_back(make_copy(s, uint32_t(1000 * c + 7), rng));
  fa_options o;
  fa_options_init(&o);
  o.backend = FA_BACKEND_CUDA;
  o.stream = stream;
  fa_kvcache_plan plan{};
  flashattn::Status st = flashattn::kvcache_plan(copies[0].args, o, &plan);
  if (!st.ok()) {
    r.error = st.to_string();
    return r;
  }
  r.splits = plan.num_splits;
  std::vector<Buffer> workspaces;
  for (Copy& c : copies) {
    c.args.num_splits = plan.num_splits;
    if (plan.workspace_bytes > 0) {
      workspaces.emplace_back(plan.workspace_bytes);
      c.args.workspace = tensor(workspaces.back().data, {plan.workspace_bytes}, FA_UINT8);
    }
  }
  fa_stats stats{};
  o.stats = &stats;
  st = flashattn::kvcache(copies[0].args, o);  // eager warm-up (also sets the kernel attributes)
  CHECK_CUDA(cudaStreamSynchronize(stream));
  if (!st.ok()) {
    r.error = st.to_string();
    return r;
  }
  r.kernel = stats.kernel;
  o.stats = nullptr;
  r.us_eager = 1000 * time_ms(stream, reps, [&] { flashattn::kvcache(copies[0].args, o); });
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (Copy& c : copies) st = flashattn::kvcache(c.args, o);
  CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
  if (!st.ok()) {
    r.error = "capture: " + st.to_string();
    return r;
  }
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  const double ms = time_ms(stream, reps, [&] { CHECK_CUDA(cudaGraphLaunch(exec, stream)); });
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  r.us_graph = 1000 * ms / r.copies;
  r.kv_tbs = double(s.kv_bytes()) / (r.us_graph * 1e-6) / 1e12;
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  std::string json_path, batches_arg = "1,4,16,64,256", caches_arg = "1024,4096,16384,65536,131072", heads_arg = "32:8",
                         dtype_arg = "bf16", layouts_arg = "contiguous,paged";
  int dim = 128, page = 16, reps = 10;
  double budget_gib = 32;
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
    else if (arg == "--batches") batches_arg = next();
    else if (arg == "--caches") caches_arg = next();
    else if (arg == "--heads") heads_arg = next();
    else if (arg == "--dim") dim = std::stoi(next());
    else if (arg == "--page") page = std::stoi(next());
    else if (arg == "--dtype") dtype_arg = next();
    else if (arg == "--layouts") layouts_arg = next();
    else if (arg == "--budget-gib") budget_gib = std::stod(next());
    else if (arg == "--reps") reps = std::stoi(next());
    else {
      std::fprintf(stderr, "unknown argument %s (see the header of bench/decode_bench.cu)\n", arg.c_str());
      return 2;
    }
  }
  const int heads_q = std::stoi(heads_arg.substr(0, heads_arg.find(':')));
  const int heads_k = std::stoi(heads_arg.substr(heads_arg.find(':') + 1));
  const fa_dtype dtype = dtype_arg == "f16" ? FA_FLOAT16 : FA_BFLOAT16;
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  // ---- the device's own streaming bandwidth, in this run ----
  double stream_tbs = 0, copy_tbs = 0;
  {
    Buffer data(kStreamBytes), sink(64), copy_to(kStreamBytes / 2);
    fill(data.data, kStreamBytes / 2, 99, FA_BFLOAT16);
    const int blocks = prop.multiProcessorCount * 8;
    const double read_ms = time_ms(stream, 10, [&] {
      stream_read_kernel<<<blocks, kStreamThreads, 0, stream>>>(static_cast<const uint4*>(data.data), kStreamBytes / 16,
                                                                 static_cast<unsigned int*>(sink.data));
    });
    stream_tbs = double(kStreamBytes) / (read_ms * 1e-3) / 1e12;
    const double copy_ms = time_ms(stream, 10, [&] {
      CHECK_CUDA(cudaMemcpyAsync(copy_to.data, data.data, size_t(kStreamBytes / 2), cudaMemcpyDeviceToDevice, stream));
    });
    copy_tbs = double(kStreamBytes) / (copy_ms * 1e-3) / 1e12;  // read + write
  }
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof(date), "%Y-%m-%d %H:%M UTC", std::gmtime(&now));
  std::printf("flashattn_decode_bench %s on %s (%d SMs, L2 %d MiB), %s\n", date, prop.name, prop.multiProcessorCount,
              prop.l2CacheSize >> 20, fa_version());
  std::printf("streaming read %.2f TB/s; device copy (read + write) %.2f TB/s\n", stream_tbs, copy_tbs);
  std::printf("%s, D=%d, Hq=%d, Hk=%d, 1 query per sequence, page %d\n", dtype_arg.c_str(), dim, heads_q, heads_k, page);
  std::printf("%-10s %6s %7s | %6s %10s %10s %9s %8s | %s\n", "layout", "B", "S", "splits", "us/call", "us eager", "K/V TB/s",
              "vs read", "kernel");

  std::string json = "{\n \"tool\": \"flashattn_decode_bench\",\n \"date\": \"" + std::string(date) + "\",\n \"gpu\": \"" +
                     prop.name + "\",\n";
  char line[512];
  std::snprintf(line, sizeof(line),
                " \"stream_read_tbs\": %.4f,\n \"device_copy_tbs\": %.4f,\n \"config\": {\"dtype\": \"%s\", \"dim\": %d, "
                "\"heads_q\": %d, \"heads_k\": %d, \"page\": %d, \"seqlen_q\": 1},\n \"points\": [\n",
                stream_tbs, copy_tbs, dtype_arg.c_str(), dim, heads_q, heads_k, page);
  json += line;
  bool first = true;
  const std::vector<int64_t> batches = parse_ints(batches_arg), caches = parse_ints(caches_arg);
  for (const std::string layout : {std::string("contiguous"), std::string("paged")}) {
    if (layouts_arg.find(layout) == std::string::npos) continue;
    for (const int64_t batch : batches)
      for (const int64_t cache : caches) {
        const Shape s{batch, cache, heads_q, heads_k, dim, page, layout == "paged", dtype};
        Result r;
        if (double(s.kv_bytes()) > budget_gib * double(int64_t(1) << 30)) {
          r.error = "skipped: K/V " + std::to_string(s.kv_bytes() >> 30) + " GiB > --budget-gib";
        } else {
          r = run_point(s, reps, prop.l2CacheSize, stream);
        }
        std::printf("%-10s %6lld %7lld | %6d %10.2f %10.2f %9.3f %7.1f%% | %s%s\n", layout.c_str(), (long long)batch,
                    (long long)cache, r.splits, r.us_graph, r.us_eager, r.kv_tbs, 100 * r.kv_tbs / stream_tbs,
                    r.kernel.c_str(), r.error.c_str());
        std::fflush(stdout);
        std::snprintf(line, sizeof(line),
                      "  %s{\"layout\": \"%s\", \"batch\": %lld, \"cache\": %lld, \"kv_bytes\": %lld, \"splits\": %d, "
                      "\"copies\": %d, \"us_per_call\": %.3f, \"us_eager\": %.3f, \"kv_tbs\": %.4f, \"fraction_of_stream_read\": "
                      "%.4f, \"kernel\": \"%s\", \"error\": \"%s\"}",
                      first ? "" : ",", layout.c_str(), (long long)batch, (long long)cache, (long long)s.kv_bytes(), r.splits,
                      r.copies, r.us_graph, r.us_eager, r.kv_tbs, r.kv_tbs / stream_tbs, r.kernel.c_str(), json_safe(r.error).c_str());
        json += std::string(first ? "" : "\n") + line;
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
  cudaStreamDestroy(stream);
  return 0;
}
