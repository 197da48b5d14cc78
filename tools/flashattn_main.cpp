// The `flashattn` command: info / run / bench on random inputs, through the public C++ API.
//
//   flashattn info                      version, backends, devices, compiled kernels
//   flashattn run [options]             one problem: time, TFLOP/s, GB/s, memory; --check vs float64
//   flashattn bench [options]           flash vs the textbook path over sequence lengths: time and
//                                       peak memory per length (table + JSON); shows O(S) vs O(S^2)
//   flashattn decode [options]          one KV-cache (decode) call: contiguous or paged cache, append,
//                                       FP8 cache; time and K/V GB/s; --check vs float64 (exit 1 past tolerance)
//   flashattn step [options]            one continuous-batching step (decodes beside prefill chunks, paged): one
//                                       fa_kvcache_append + one varlen fa_forward, against fa_kvcache per group
// `flashattn <command> --help` lists each command's options.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <cblas.h>
#include <omp.h>

#include "core/dtype.hpp"
#include "flashattn/flashattn.hpp"

#if defined(FLASHATTN_WITH_CUDA)
#include <cuda_runtime.h>

#include "cuda/common/stream_fork.hpp"  // --fork: the library's side-stream switch
#endif

namespace {

// `count` values N(0, 1) / divide_by (0: 1) as `dtype`: an FP8 cache's codes take the cache's scale as divide_by.
// Chunks of 2^20 values, each from a generator of its own seeded from one draw of `rng` and the chunk's index: the same
// values for a seed whatever the thread count, made on every core (a serving step's pool of 4 GiB took ~50 s on one).
std::vector<uint8_t> random_values(std::mt19937_64& rng, int64_t count, fa_dtype dtype, float divide_by = 0.f) {
  constexpr int64_t kChunk = int64_t(1) << 20;
  const uint64_t base = rng();
  const float scale = 1.f / (divide_by > 0 ? divide_by : 1.f);
  std::vector<uint8_t> host(size_t(count * flashattn::dtype_size(dtype)));
  const int64_t chunks = (count + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t c = 0; c < chunks; ++c) {
    std::seed_seq seed{uint32_t(base), uint32_t(base >> 32), uint32_t(c), uint32_t(c >> 32)};
    std::mt19937_64 chunk_rng(seed);
    std::normal_distribution<float> normal(0.f, 1.f);
    for (int64_t n = c * kChunk; n < std::min(count, (c + 1) * kChunk); ++n)
      flashattn::store_from_float(host.data(), n, dtype, normal(chunk_rng) * scale);
  }
  return host;
}

using flashattn::Status;

// ---------------------------------------------------------------------------------------------
// Command-line parsing: --key value, --key=value, --flag.
class Args {
 public:
  Args(int argc, char** argv, int first) {
    for (int i = first; i < argc; ++i) {
      std::string a = argv[i];
      if (a.rfind("--", 0) != 0) {
        bad_.push_back(a);
        continue;
      }
      a = a.substr(2);
      const size_t eq = a.find('=');
      if (eq != std::string::npos) {
        values_[a.substr(0, eq)] = a.substr(eq + 1);
      } else if (i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0) {
        values_[a] = argv[++i];
      } else {
        values_[a] = "";
      }
    }
  }
  bool has(const std::string& k) const { return values_.count(k) > 0; }
  std::string str(const std::string& k, const std::string& def) {
    used_.push_back(k);
    return has(k) ? values_.at(k) : def;
  }
  long long integer(const std::string& k, long long def) {
    const std::string v = str(k, "");
    if (v.empty()) return def;
    char* end = nullptr;
    const long long x = std::strtoll(v.c_str(), &end, 10);
    if (*end != '\0') fail("--" + k + ": expected an integer, got '" + v + "'");
    return x;
  }
  double real(const std::string& k, double def) {
    const std::string v = str(k, "");
    if (v.empty()) return def;
    char* end = nullptr;
    const double x = std::strtod(v.c_str(), &end);
    if (*end != '\0') fail("--" + k + ": expected a number, got '" + v + "'");
    return x;
  }
  bool flag(const std::string& k) {
    used_.push_back(k);
    return has(k);
  }
  // Rejects options nobody asked for (typos must not be ignored silently).
  void finish() const {
    for (const std::string& b : bad_) fail("unexpected argument '" + b + "'");
    for (const auto& kv : values_)
      if (std::find(used_.begin(), used_.end(), kv.first) == used_.end()) fail("unknown option --" + kv.first);
  }
  [[noreturn]] static void fail(const std::string& message) {
    std::fprintf(stderr, "flashattn: %s (see --help)\n", message.c_str());
    std::exit(2);
  }

 private:
  std::map<std::string, std::string> values_;
  std::vector<std::string> used_;
  std::vector<std::string> bad_;
};

fa_dtype parse_dtype(const std::string& s) {
  if (s == "f32" || s == "fp32" || s == "float32") return FA_FLOAT32;
  if (s == "f16" || s == "fp16" || s == "float16") return FA_FLOAT16;
  if (s == "bf16" || s == "bfloat16") return FA_BFLOAT16;
  Args::fail("--dtype: expected f32, f16 or bf16, got '" + s + "'");
}

fa_backend parse_backend(const std::string& s) {
  if (s == "auto") return FA_BACKEND_AUTO;
  if (s == "reference" || s == "cpu_reference") return FA_BACKEND_CPU_REFERENCE;
  if (s == "cpu" || s == "flash" || s == "cpu_flash") return FA_BACKEND_CPU_FLASH;
  if (s == "standard" || s == "cpu_standard") return FA_BACKEND_CPU_STANDARD;
  if (s == "cuda") return FA_BACKEND_CUDA;
  Args::fail("--backend: expected auto, cpu, standard, reference or cuda, got '" + s + "'");
}

const char* backend_label(fa_backend b) {
  switch (b) {
    case FA_BACKEND_CPU_REFERENCE: return "cpu_reference";
    case FA_BACKEND_CPU_FLASH: return "cpu_flash";
    case FA_BACKEND_CPU_STANDARD: return "cpu_standard";
    case FA_BACKEND_CUDA: return "cuda";
    default: return "auto";
  }
}

// ---------------------------------------------------------------------------------------------
// Memory: host or device buffers, and the process's peak resident set.

struct Buffer {
  void* data = nullptr;
  int64_t bytes = 0;
  bool device = false;
  Buffer() = default;
  Buffer(int64_t n, bool on_device) : bytes(n), device(on_device) {
    if (device) {
#if defined(FLASHATTN_WITH_CUDA)
      if (cudaMalloc(&data, size_t(std::max<int64_t>(n, 16))) != cudaSuccess)
        Args::fail("cudaMalloc of " + std::to_string(n) + " bytes failed");
#endif
    } else {
      data = std::malloc(size_t(std::max<int64_t>(n, 16)));
      if (data == nullptr) Args::fail("out of host memory");
    }
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& o) noexcept { *this = std::move(o); }
  Buffer& operator=(Buffer&& o) noexcept {
    std::swap(data, o.data);
    std::swap(bytes, o.bytes);
    std::swap(device, o.device);
    return *this;
  }
  ~Buffer() {
    if (data == nullptr) return;
#if defined(FLASHATTN_WITH_CUDA)
    if (device) {
      cudaFree(data);
      return;
    }
#endif
    std::free(data);
  }
  void upload(const std::vector<uint8_t>& host) {
#if defined(FLASHATTN_WITH_CUDA)
    if (device) {
      cudaMemcpy(data, host.data(), host.size(), cudaMemcpyHostToDevice);
      return;
    }
#endif
    std::memcpy(data, host.data(), host.size());
  }
  std::vector<uint8_t> download() const {
    std::vector<uint8_t> host(static_cast<size_t>(bytes));
#if defined(FLASHATTN_WITH_CUDA)
    if (device) {
      cudaMemcpy(host.data(), data, host.size(), cudaMemcpyDeviceToHost);
      return host;
    }
#endif
    std::memcpy(host.data(), data, host.size());
    return host;
  }
};

void device_synchronize(bool device) {
#if defined(FLASHATTN_WITH_CUDA)
  if (device) cudaDeviceSynchronize();
#endif
}

// Peak resident set of this process (VmHWM), reset on request through /proc/self/clear_refs.
bool reset_peak_rss() {
  std::ofstream f("/proc/self/clear_refs");
  if (!f) return false;
  f << "5";
  return bool(f);
}
int64_t peak_rss_bytes() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::atoll(line.c_str() + 6) * 1024;
  rusage u;
  getrusage(RUSAGE_SELF, &u);
  return int64_t(u.ru_maxrss) * 1024;
}
int64_t current_rss_bytes() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::atoll(line.c_str() + 6) * 1024;
  return 0;
}

std::string rate(double flop_per_s) {
  char s[32];
  if (flop_per_s >= 1e12) std::snprintf(s, sizeof(s), "%.1f TFLOP/s", flop_per_s / 1e12);
  else std::snprintf(s, sizeof(s), "%.2f GFLOP/s", flop_per_s / 1e9);
  return s;
}

std::string human_bytes(double b) {
  if (b < 0) return "n/a";
  char s[32];
  if (b >= 1073741824.0) std::snprintf(s, sizeof(s), "%.2f GiB", b / 1073741824.0);
  else if (b >= 1048576.0) std::snprintf(s, sizeof(s), "%.1f MiB", b / 1048576.0);
  else std::snprintf(s, sizeof(s), "%.1f KiB", b / 1024.0);
  return s;
}

// ---------------------------------------------------------------------------------------------
// One attention problem with random inputs.

struct Shape {
  int batch = 1, seqlen_q = 1024, seqlen_k = 1024, heads_q = 16, heads_k = 16, head_dim = 128, head_dim_v = 128;
  fa_dtype dtype = FA_FLOAT32;
};

struct Problem {
  Shape shape;
  bool device = false;
  std::vector<uint8_t> q_host, k_host, v_host, dout_host;
  Buffer q, k, v, out, lse, dout, dq, dk, dv;

  static int64_t elements(const Shape& s, bool query_side, bool value) {
    return int64_t(s.batch) * (query_side ? s.seqlen_q : s.seqlen_k) * (query_side ? s.heads_q : s.heads_k) *
           (value ? s.head_dim_v : s.head_dim);
  }
  int64_t element_size() const { return flashattn::dtype_size(shape.dtype); }

  void init(const Shape& s, bool on_device, uint64_t seed, bool with_backward) {
    shape = s;
    device = on_device;
    std::mt19937_64 rng(seed);
    auto random = [&](int64_t count) { return random_values(rng, count, shape.dtype); };
    q_host = random(elements(s, true, false));
    k_host = random(elements(s, false, false));
    v_host = random(elements(s, false, true));
    q = Buffer(int64_t(q_host.size()), device);
    k = Buffer(int64_t(k_host.size()), device);
    v = Buffer(int64_t(v_host.size()), device);
    q.upload(q_host);
    k.upload(k_host);
    v.upload(v_host);
    out = Buffer(elements(s, true, true) * element_size(), device);
    lse = Buffer(int64_t(s.batch) * s.heads_q * s.seqlen_q * 4, device);
    if (with_backward) {
      dout_host = random(elements(s, true, true));
      dout = Buffer(int64_t(dout_host.size()), device);
      dout.upload(dout_host);
      dq = Buffer(q.bytes, device);
      dk = Buffer(k.bytes, device);
      dv = Buffer(v.bytes, device);
    }
  }

  fa_tensor view(Buffer& b, std::initializer_list<int64_t> dims, fa_dtype dtype) {
    return flashattn::tensor(b.data, dims, dtype, device ? FA_DEVICE_CUDA : FA_DEVICE_CPU, 0);
  }
  fa_forward_args forward_args() {
    const Shape& s = shape;
    fa_forward_args a{};
    a.q = view(q, {s.batch, s.seqlen_q, s.heads_q, s.head_dim}, s.dtype);
    a.k = view(k, {s.batch, s.seqlen_k, s.heads_k, s.head_dim}, s.dtype);
    a.v = view(v, {s.batch, s.seqlen_k, s.heads_k, s.head_dim_v}, s.dtype);
    a.out = view(out, {s.batch, s.seqlen_q, s.heads_q, s.head_dim_v}, s.dtype);
    a.lse = view(lse, {s.batch, s.heads_q, s.seqlen_q}, FA_FLOAT32);
    return a;
  }
  fa_backward_args backward_args() {
    const Shape& s = shape;
    const fa_forward_args f = forward_args();
    fa_backward_args a{};
    a.q = f.q, a.k = f.k, a.v = f.v, a.out = f.out, a.lse = f.lse;
    a.dout = view(dout, {s.batch, s.seqlen_q, s.heads_q, s.head_dim_v}, s.dtype);
    a.dq = view(dq, {s.batch, s.seqlen_q, s.heads_q, s.head_dim}, s.dtype);
    a.dk = view(dk, {s.batch, s.seqlen_k, s.heads_k, s.head_dim}, s.dtype);
    a.dv = view(dv, {s.batch, s.seqlen_k, s.heads_k, s.head_dim_v}, s.dtype);
    return a;
  }
  int64_t forward_io_bytes() const {  // each input read once, each output written once
    return q.bytes + k.bytes + v.bytes + out.bytes + lse.bytes;
  }
  int64_t backward_io_bytes() const {
    return q.bytes + k.bytes + v.bytes + out.bytes + lse.bytes + dout.bytes + dq.bytes + dk.bytes + dv.bytes;
  }
};

// Visible (query, key) pairs of one head of the problem under the options' mask.
double visible_pairs(const Shape& s, const fa_options& o) {
  const int right = o.causal ? 0 : o.window_right;
  const int left = o.window_left;
  double pairs = 0;
  for (int i = 0; i < s.seqlen_q; ++i) {
    const long long aligned = i + (long long)s.seqlen_k - s.seqlen_q;
    const long long lo = left >= 0 ? std::max(0LL, aligned - left) : 0;
    const long long hi = right >= 0 ? std::min<long long>(s.seqlen_k - 1, aligned + right) : s.seqlen_k - 1;
    if (hi >= lo) pairs += double(hi - lo + 1);
  }
  return pairs;
}
// FLOPs of the forward: two GEMMs over the visible pairs (2 * (D + Dv) per pair).
double forward_flops(const Shape& s, const fa_options& o) {
  return 2.0 * (s.head_dim + s.head_dim_v) * visible_pairs(s, o) * s.batch * s.heads_q;
}

struct Timing {
  double median_s = 0, min_s = 0;
  int iterations = 0;
};

Timing time_call(const std::function<Status()>& call, bool device, int warmup, int iterations, double max_seconds) {
  for (int w = 0; w < warmup; ++w) {
    const Status s = call();
    if (!s.ok()) Args::fail(s.to_string());
  }
  device_synchronize(device);
  std::vector<double> times;
  const auto start_all = std::chrono::steady_clock::now();
  for (int it = 0; it < iterations; ++it) {
    const auto t0 = std::chrono::steady_clock::now();
    const Status s = call();
    device_synchronize(device);
    const auto t1 = std::chrono::steady_clock::now();
    if (!s.ok()) Args::fail(s.to_string());
    times.push_back(std::chrono::duration<double>(t1 - t0).count());
    if (std::chrono::duration<double>(t1 - start_all).count() > max_seconds) break;
  }
  std::sort(times.begin(), times.end());
  Timing t;
  t.iterations = int(times.size());
  t.median_s = times[times.size() / 2];
  t.min_s = times.front();
  return t;
}

// Time per call of `iterations` calls issued back to back with one synchronisation after them (as a server queues its
// steps): where the synchronised median of time_call is well above it, the call's time is its round trip (launches
// and the wait), not the device's work.
double time_call_pipelined(const std::function<Status()>& call, bool device, int warmup, int iterations) {
  for (int w = 0; w < warmup; ++w) {
    const Status s = call();
    if (!s.ok()) Args::fail(s.to_string());
  }
  device_synchronize(device);
  const auto t0 = std::chrono::steady_clock::now();
  for (int it = 0; it < iterations; ++it) {
    const Status s = call();
    if (!s.ok()) Args::fail(s.to_string());
  }
  device_synchronize(device);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / std::max(iterations, 1);
}

// `call` with options.stats = stats on its first invocation only (time_call's first warm-up call,
// or the first timed one without warm-up): the timed calls then run as a caller's would, without
// the stats' bookkeeping (the kernel name's formatting). `call` must read `options`.
template <typename Call>
std::function<Status()> stats_on_first_call(fa_options& options, fa_stats* stats, Call call) {
  options.stats = stats;
  return [&options, call]() {
    const Status s = call();
    options.stats = nullptr;
    return s;
  };
}

// cblas_sgemm rate of this machine with the given threads (the CPU's matrix ceiling for fp32).
double measure_sgemm_gflops(int threads, int n) {
  std::vector<float> a(size_t(n) * n), b(size_t(n) * n), c(size_t(n) * n);
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-1, 1);
  for (float& x : a) x = u(rng);
  for (float& x : b) x = u(rng);
  std::vector<double> times;
  omp_set_num_threads(threads);
  for (int it = 0; it < 4; ++it) {
    const auto t0 = std::chrono::steady_clock::now();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, n, n, 1.f, a.data(), n, b.data(), n, 0.f, c.data(), n);
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(times.begin(), times.end());
  return 2.0 * n * double(n) * n / times[1] / 1e9;  // second best of 4 (first is warm-up)
}

// Options shared by run and bench.
struct CommonOptions {
  Shape shape;
  fa_options options;
  fa_backend backend = FA_BACKEND_AUTO;
  uint64_t seed = 0;
};

void add_common_help(std::string& h) {
  h +=
      "  --batch B            sequences (default 1)\n"
      "  --heads H            query heads (default 16)\n"
      "  --heads-k HK         key/value heads, divides H (default H)\n"
      "  --head-dim D         (default 128); --head-dim-v DV (default D)\n"
      "  --dtype T            f32 | f16 | bf16 (default f32)\n"
      "  --backend NAME       auto | cpu | standard | reference | cuda (default: auto)\n"
      "  --threads N          CPU threads (default: all)\n"
      "  --causal             causal mask, bottom-right aligned\n"
      "  --window L,R         sliding window (-1 = unbounded)\n"
      "  --softcap C          soft-capping of scores\n"
      "  --alibi              ALiBi with the standard geometric slopes\n"
      "  --dropout P          dropout probability (seeded Philox)\n"
      "  --scale S            softmax scale (default 1/sqrt(D))\n"
      "  --seed N             input seed (default: time-based; printed)\n";
}

CommonOptions parse_common(Args& a) {
  CommonOptions c;
  c.shape.batch = int(a.integer("batch", 1));
  c.shape.heads_q = int(a.integer("heads", 16));
  c.shape.heads_k = int(a.integer("heads-k", c.shape.heads_q));
  c.shape.head_dim = int(a.integer("head-dim", 128));
  c.shape.head_dim_v = int(a.integer("head-dim-v", c.shape.head_dim));
  c.shape.dtype = parse_dtype(a.str("dtype", "f32"));
  c.backend = parse_backend(a.str("backend", "auto"));
  if (c.backend == FA_BACKEND_CUDA && fa_cuda_device_count() == 0)
    Args::fail("--backend cuda: no CUDA device found (or this build has no CUDA)");
  fa_options_init(&c.options);
  c.options.backend = c.backend;
  c.options.num_threads = int(a.integer("threads", 0));
  c.options.causal = a.flag("causal");
  const std::string window = a.str("window", "");
  if (!window.empty() && std::sscanf(window.c_str(), "%d,%d", &c.options.window_left, &c.options.window_right) != 2)
    Args::fail("--window: expected L,R, got '" + window + "'");
  c.options.softcap = float(a.real("softcap", 0));
  c.options.dropout_p = float(a.real("dropout", 0));
  c.options.softmax_scale = float(a.real("scale", 0));
  c.seed = uint64_t(a.integer("seed", (long long)(std::chrono::steady_clock::now().time_since_epoch().count() & 0xffffffff)));
  c.options.dropout_seed = c.seed;
  return c;
}

std::vector<float> alibi_slopes(int heads) {
  std::vector<float> s(static_cast<size_t>(heads));
  for (int h = 0; h < heads; ++h) s[size_t(h)] = std::pow(2.f, -8.f * float(h + 1) / float(heads));
  return s;
}

bool is_device_backend(const CommonOptions& c) { return c.backend == FA_BACKEND_CUDA; }

// ---------------------------------------------------------------------------------------------
// flashattn run

// Float64 reference on batch entry 0 and the first key/value head group (a sample that keeps the
// check affordable at long sequence lengths), against the run's output.
void check_against_reference(Problem& p, const fa_options& options, bool backward) {
  const Shape& s = p.shape;
  const int group = s.heads_q / s.heads_k;
  const int64_t es = p.element_size();
  // Host copies of batch 0, heads [0, group) / key head 0, contiguous.
  auto slice = [&](const std::vector<uint8_t>& full, int rows, int heads_total, int heads, int dim) {
    std::vector<uint8_t> part(size_t(int64_t(rows) * heads * dim * es));
    for (int r = 0; r < rows; ++r)
      std::memcpy(&part[size_t(int64_t(r) * heads * dim * es)], &full[size_t(int64_t(r) * heads_total * dim * es)],
                  size_t(int64_t(heads) * dim * es));
    return part;
  };
  std::vector<uint8_t> q = slice(p.q_host, s.seqlen_q, s.heads_q, group, s.head_dim);
  std::vector<uint8_t> k = slice(p.k_host, s.seqlen_k, s.heads_k, 1, s.head_dim);
  std::vector<uint8_t> v = slice(p.v_host, s.seqlen_k, s.heads_k, 1, s.head_dim_v);
  std::vector<uint8_t> out(size_t(int64_t(s.seqlen_q) * group * s.head_dim_v * es));
  std::vector<float> lse(size_t(int64_t(group) * s.seqlen_q));
  fa_forward_args a{};
  a.q = flashattn::tensor(q.data(), {1, s.seqlen_q, group, s.head_dim}, s.dtype);
  a.k = flashattn::tensor(k.data(), {1, s.seqlen_k, 1, s.head_dim}, s.dtype);
  a.v = flashattn::tensor(v.data(), {1, s.seqlen_k, 1, s.head_dim_v}, s.dtype);
  a.out = flashattn::tensor(out.data(), {1, s.seqlen_q, group, s.head_dim_v}, s.dtype);
  a.lse = flashattn::tensor(lse.data(), {1, group, s.seqlen_q}, FA_FLOAT32);
  fa_options ref = options;
  ref.backend = FA_BACKEND_CPU_REFERENCE;
  ref.stats = nullptr;
  ref.stream = nullptr;
  // ALiBi slopes: the first `group` heads of the run's slopes (host copy held by the caller).
  const Status st = flashattn::forward(a, ref);
  if (!st.ok()) Args::fail("reference: " + st.to_string());
  const std::vector<uint8_t> got_out = p.out.download();
  const std::vector<uint8_t> got_lse = p.lse.download();
  double max_abs = 0, diff2 = 0, ref2 = 0, lse_max = 0;
  int64_t nonfinite = 0;
  for (int i = 0; i < s.seqlen_q; ++i)
    for (int h = 0; h < group; ++h)
      for (int d = 0; d < s.head_dim_v; ++d) {
        const double r = flashattn::load_as_float(out.data(), (int64_t(i) * group + h) * s.head_dim_v + d, s.dtype);
        const double g = flashattn::load_as_float(got_out.data(), (int64_t(i) * s.heads_q + h) * s.head_dim_v + d, s.dtype);
        if (!std::isfinite(g)) ++nonfinite;
        max_abs = std::max(max_abs, std::abs(g - r));
        diff2 += (g - r) * (g - r);
        ref2 += r * r;
      }
  for (int h = 0; h < group; ++h)
    for (int i = 0; i < s.seqlen_q; ++i) {
      const double r = lse[size_t(int64_t(h) * s.seqlen_q + i)];
      const double g = reinterpret_cast<const float*>(got_lse.data())[int64_t(h) * s.seqlen_q + i];
      if (std::isinf(r) && r == g) continue;
      lse_max = std::max(lse_max, std::abs(g - r));
    }
  std::printf("check (batch 0, heads 0..%d vs float64 reference): out max_abs %.3e rel_l2 %.3e, lse max_abs %.3e%s\n",
              group - 1, max_abs, std::sqrt(diff2) / std::max(std::sqrt(ref2), 1e-30), lse_max,
              nonfinite ? " NON-FINITE VALUES" : "");
  if (backward) std::printf("check: gradients are checked by the test suite (ctest), not by `run`\n");
}

int command_run(int argc, char** argv) {
  Args a(argc, argv, 2);
  if (a.flag("help")) {
    std::string h =
        "flashattn run: one attention problem on random inputs.\n"
        "  --seqlen S           query and key length (default 1024); or --seqlen-q / --seqlen-k\n";
    add_common_help(h);
    h +=
        "  --backward           also time the backward pass\n"
        "  --iters N            timed iterations (default 5); --warmup N (default 1)\n"
        "  --check              compare with the float64 reference (batch 0, first head group)\n"
        "  --seqused            the mixed step's fa_forward also takes seqused_k (every sequence's key count, as vLLM\n"
        "                       passes it): on CUDA a step of decodes only then reads the counts in place\n"
        "  --json FILE          also write the result as JSON\n";
    std::fputs(h.c_str(), stdout);
    return 0;
  }
  CommonOptions c = parse_common(a);
  const int seqlen = int(a.integer("seqlen", 1024));
  c.shape.seqlen_q = int(a.integer("seqlen-q", seqlen));
  c.shape.seqlen_k = int(a.integer("seqlen-k", seqlen));
  const bool backward = a.flag("backward");
  const int iters = int(a.integer("iters", 5));
  const int warmup = int(a.integer("warmup", 1));
  const bool check = a.flag("check");
  const bool with_alibi = a.flag("alibi");
  const std::string json = a.str("json", "");
  a.finish();

  const bool device = is_device_backend(c);
  std::vector<float> slopes_host;
  Buffer slopes;
  if (with_alibi) {
    slopes_host = alibi_slopes(c.shape.heads_q);
    slopes = Buffer(int64_t(slopes_host.size()) * 4, device);
    std::vector<uint8_t> bytes(slopes_host.size() * 4);
    std::memcpy(bytes.data(), slopes_host.data(), bytes.size());
    slopes.upload(bytes);
    c.options.alibi_slopes = flashattn::tensor(slopes.data, {c.shape.heads_q}, FA_FLOAT32, device ? FA_DEVICE_CUDA : FA_DEVICE_CPU);
  }
  Problem p;
  reset_peak_rss();
  const int64_t rss_before = current_rss_bytes();
  p.init(c.shape, device, c.seed, backward);
  fa_stats stats{};
  fa_forward_args fa = p.forward_args();
  const Timing t = time_call(stats_on_first_call(c.options, &stats, [&] { return flashattn::forward(fa, c.options); }),
                             device, warmup, iters, 120);
  const double flops = forward_flops(c.shape, c.options);
  std::printf("flashattn run: B=%d Sq=%d Sk=%d Hq=%d Hk=%d D=%d Dv=%d %s%s%s backend=%s seed=%llu\n", c.shape.batch,
              c.shape.seqlen_q, c.shape.seqlen_k, c.shape.heads_q, c.shape.heads_k, c.shape.head_dim, c.shape.head_dim_v,
              flashattn::dtype_name(c.shape.dtype), c.options.causal ? " causal" : "", c.options.dropout_p > 0 ? " dropout" : "",
              backend_label(c.backend), (unsigned long long)c.seed);
  // Four decimals: 0.1 us, so that short GPU calls (tens of us) compare to the decode tool's us.
  std::printf("forward:  %.4f ms (median of %d, min %.4f ms)  %s  %.1f GB/s  kernel: %s\n", t.median_s * 1e3, t.iterations,
              t.min_s * 1e3, rate(flops / t.median_s).c_str(), p.forward_io_bytes() / t.median_s / 1e9, stats.kernel);
  const int64_t fwd_scratch = stats.scratch_bytes_peak;
  const std::string fwd_kernel = stats.kernel;
  const int fwd_splits = stats.num_splits;
  Timing tb;
  int64_t bwd_scratch = 0;
  if (backward) {
    fa_backward_args ba = p.backward_args();
    tb = time_call(stats_on_first_call(c.options, &stats, [&] { return flashattn::backward(ba, c.options); }), device,
                   warmup, iters, 120);
    bwd_scratch = stats.scratch_bytes_peak;
    std::printf("backward: %.4f ms (median of %d)  %s (2.5x forward FLOPs)  %.1f GB/s  kernel: %s\n", tb.median_s * 1e3,
                tb.iterations, rate(2.5 * flops / tb.median_s).c_str(), p.backward_io_bytes() / tb.median_s / 1e9, stats.kernel);
  }
  const int64_t rss_peak = peak_rss_bytes();
  std::printf("memory: inputs+outputs %s, scratch peak forward %s%s%s, process peak RSS %s (+%s over start)\n",
              human_bytes(double(backward ? p.backward_io_bytes() : p.forward_io_bytes())).c_str(),
              human_bytes(double(fwd_scratch)).c_str(), backward ? " backward " : "",
              backward ? human_bytes(double(bwd_scratch)).c_str() : "", human_bytes(double(rss_peak)).c_str(),
              human_bytes(double(rss_peak - rss_before)).c_str());
  if (check) {
    flashattn::Status st = flashattn::forward(fa, c.options);  // fresh output for the comparison
    device_synchronize(device);
    if (!st.ok()) Args::fail(st.to_string());
    fa_options ref = c.options;
    if (with_alibi) ref.alibi_slopes = flashattn::tensor(slopes_host.data(), {c.shape.heads_q}, FA_FLOAT32);
    check_against_reference(p, ref, backward);
  }
  if (!json.empty()) {
    std::ofstream f(json);
    f << "{\"B\":" << c.shape.batch << ",\"Sq\":" << c.shape.seqlen_q << ",\"Sk\":" << c.shape.seqlen_k
      << ",\"Hq\":" << c.shape.heads_q << ",\"Hk\":" << c.shape.heads_k << ",\"D\":" << c.shape.head_dim
      << ",\"dtype\":\"" << flashattn::dtype_name(c.shape.dtype) << "\",\"causal\":" << (c.options.causal ? "true" : "false")
      << ",\"backend\":\"" << backend_label(c.backend) << "\",\"forward_ms\":" << t.median_s * 1e3
      << ",\"forward_tflops\":" << flops / t.median_s / 1e12 << ",\"forward_scratch_bytes\":" << fwd_scratch
      << ",\"forward_kernel\":\"" << fwd_kernel << "\",\"forward_splits\":" << fwd_splits;
    if (backward) f << ",\"backward_ms\":" << tb.median_s * 1e3 << ",\"backward_tflops\":" << 2.5 * flops / tb.median_s / 1e12;
    f << "}\n";
  }
  return 0;
}

// ---------------------------------------------------------------------------------------------
// flashattn bench

struct BenchRow {
  int seqlen;
  const char* path;
  double ms = 0, gflops = 0;
  int64_t scratch = 0, rss_peak_delta = 0, io = 0;
  bool skipped = false;
  std::string kernel;
};

int command_bench(int argc, char** argv) {
  Args a(argc, argv, 2);
  if (a.flag("help")) {
    std::string h =
        "flashattn bench: flash vs the textbook (standard) path over sequence lengths, on one backend.\n"
        "Prints time and peak memory per length (a progress line each), then a table; --json writes it.\n"
        "  --seqlens LIST       comma-separated lengths (default 1024,2048,4096,8192,16384)\n";
    add_common_help(h);
    h +=
        "  --paths LIST         flash,standard (default both on the CPU; cuda runs flash only)\n"
        "  --iters N            timed iterations per point (default 3, capped at ~20 s per point)\n"
        "  --json FILE          write all rows and the machine's sgemm rate as JSON\n";
    std::fputs(h.c_str(), stdout);
    return 0;
  }
  CommonOptions c = parse_common(a);
  std::vector<int> seqlens;
  {
    std::stringstream ss(a.str("seqlens", "1024,2048,4096,8192,16384"));
    std::string item;
    while (std::getline(ss, item, ',')) seqlens.push_back(std::atoi(item.c_str()));
  }
  const bool device = is_device_backend(c);
  const std::string paths = a.str("paths", device ? "flash" : "flash,standard");
  const int iters = int(a.integer("iters", 3));
  const std::string json = a.str("json", "");
  if (a.flag("alibi")) Args::fail("--alibi: not offered by bench (use run)");
  a.finish();
  const int threads = c.options.num_threads > 0 ? c.options.num_threads : omp_get_num_procs();
  c.options.num_threads = threads;

  double sgemm = 0;
  if (!device) {
    std::printf("measuring cblas_sgemm (2048^3, %d threads)... ", threads);
    std::fflush(stdout);
    sgemm = measure_sgemm_gflops(threads, 2048);
    std::printf("%.1f GFLOP/s\n", sgemm);
  }
  std::vector<BenchRow> rows;
  for (int s : seqlens) {
    for (const char* path : {"flash", "standard"}) {
      if (paths.find(path) == std::string::npos) continue;
      BenchRow r;
      r.seqlen = s;
      r.path = path;
      Shape shape = c.shape;
      shape.seqlen_q = shape.seqlen_k = s;
      fa_options o = c.options;
      o.backend = std::string(path) == "standard" ? FA_BACKEND_CPU_STANDARD : c.backend;
      if (o.backend == FA_BACKEND_AUTO) o.backend = FA_BACKEND_CPU_FLASH;
      fa_stats stats{};
      std::printf("[%zu/%zu] S=%-6d %-8s ... ", rows.size() + 1, seqlens.size() * (paths.find(',') != std::string::npos ? 2 : 1),
                  s, path);
      std::fflush(stdout);
      reset_peak_rss();
      const int64_t rss_before = current_rss_bytes();
      Problem p;
      p.init(shape, device, c.seed + uint64_t(s), false);
      fa_forward_args fa = p.forward_args();
      const Timing t = time_call(stats_on_first_call(o, &stats, [&] { return flashattn::forward(fa, o); }), device, 1, iters, 20);
      r.ms = t.median_s * 1e3;
      r.gflops = forward_flops(shape, o) / t.median_s / 1e9;
      r.scratch = stats.scratch_bytes_peak;
      r.io = p.forward_io_bytes();
      r.rss_peak_delta = peak_rss_bytes() - rss_before;
      r.kernel = stats.kernel;
      std::printf("%9.2f ms  %8.1f GFLOP/s  scratch %-10s  peak RSS +%s\n", r.ms, r.gflops, human_bytes(double(r.scratch)).c_str(),
                  human_bytes(double(r.rss_peak_delta)).c_str());
      rows.push_back(r);
    }
  }
  std::printf("\nflashattn bench: %s, D=%d, H=%d (Hk=%d), B=%d, %s%s, %d threads, backend %s\n",
              flashattn::dtype_name(c.shape.dtype), c.shape.head_dim, c.shape.heads_q, c.shape.heads_k, c.shape.batch,
              c.options.causal ? "causal" : "non-causal", c.options.dropout_p > 0 ? ", dropout" : "", threads,
              backend_label(c.backend));
  std::printf("%8s | %12s %10s %12s | %12s %10s %12s | %8s %9s\n", "S", "flash ms", "GFLOP/s", "scratch", "standard ms", "GFLOP/s",
              "scratch", "speedup", "mem ratio");
  for (int s : seqlens) {
    const BenchRow* f = nullptr;
    const BenchRow* st = nullptr;
    for (const BenchRow& r : rows)
      if (r.seqlen == s) (std::string(r.path) == "flash" ? f : st) = &r;
    auto cell = [](const BenchRow* r, char* buf, size_t n) {
      if (!r) std::snprintf(buf, n, "%12s %10s %12s", "-", "-", "-");
      else std::snprintf(buf, n, "%12.2f %10.1f %12s", r->ms, r->gflops, human_bytes(double(r->scratch)).c_str());
    };
    char fb[64], sb[64];
    cell(f, fb, sizeof(fb));
    cell(st, sb, sizeof(sb));
    char ratio[32] = "-", mem[32] = "-";
    if (f && st) {
      std::snprintf(ratio, sizeof(ratio), "%.2fx", st->ms / f->ms);
      std::snprintf(mem, sizeof(mem), "%.0fx", double(st->scratch) / std::max<double>(1.0, double(f->scratch)));
    }
    std::printf("%8d | %s | %s | %8s %9s\n", s, fb, sb, ratio, mem);
  }
  if (sgemm > 0) {
    double best = 0;
    for (const BenchRow& r : rows)
      if (std::string(r.path) == "flash") best = std::max(best, r.gflops);
    std::printf("cblas_sgemm in this run: %.1f GFLOP/s; best flash forward %.1f GFLOP/s = %.0f%% of sgemm\n", sgemm, best,
                100.0 * best / sgemm);
  }
  if (!json.empty()) {
    std::ofstream f(json);
    f << "{\n  \"dtype\": \"" << flashattn::dtype_name(c.shape.dtype) << "\", \"D\": " << c.shape.head_dim << ", \"H\": "
      << c.shape.heads_q << ", \"Hk\": " << c.shape.heads_k << ", \"B\": " << c.shape.batch
      << ", \"causal\": " << (c.options.causal ? "true" : "false") << ", \"threads\": " << threads
      << ", \"backend\": \"" << backend_label(c.backend) << "\", \"sgemm_gflops\": " << sgemm << ",\n  \"rows\": [\n";
    for (size_t n = 0; n < rows.size(); ++n) {
      const BenchRow& r = rows[n];
      f << "    {\"S\": " << r.seqlen << ", \"path\": \"" << r.path << "\", \"ms\": " << r.ms << ", \"gflops\": " << r.gflops
        << ", \"scratch_bytes\": " << r.scratch << ", \"io_bytes\": " << r.io << ", \"peak_rss_delta_bytes\": " << r.rss_peak_delta
        << ", \"kernel\": \"" << r.kernel << "\"}" << (n + 1 < rows.size() ? "," : "") << "\n";
    }
    f << "  ]\n}\n";
    std::printf("wrote %s\n", json.c_str());
  }
  return 0;
}

int command_info(int argc, char** argv) {
  Args a(argc, argv, 2);
  if (a.flag("help")) {
    std::puts("flashattn info: version, backends, CUDA devices, compiled kernels (head dims, dtypes).");
    return 0;
  }
  a.finish();
  std::fputs(fa_build_info(), stdout);
  std::printf("cpu: %d hardware threads; BLAS: %s\n", omp_get_num_procs(), openblas_get_config());
  if (fa_cuda_device_count() == 0) std::puts("no GPU found: the CPU backends are used (cpu_flash by default)");
  return 0;
}

// `got` (a run's output, downloaded) against `want` (the reference's, on the host): `count` elements of `dtype`.
struct OutError {
  double rel_l2 = 0, max_abs = 0;
  int64_t nonfinite = 0;  // elements of `got` that are NaN or infinite
};
OutError out_error(const Buffer& got_buffer, const void* want, int64_t count, fa_dtype dtype) {
  const std::vector<uint8_t> got = got_buffer.download();
  double diff2 = 0, want2 = 0;
  OutError e;
  for (int64_t n = 0; n < count; ++n) {
    const double w = flashattn::load_as_float(want, n, dtype), g = flashattn::load_as_float(got.data(), n, dtype);
    if (!std::isfinite(g)) ++e.nonfinite;
    diff2 += (g - w) * (g - w);
    want2 += w * w;
    e.max_abs = std::max(e.max_abs, std::abs(g - w));
  }
  e.rel_l2 = std::sqrt(diff2) / std::max(std::sqrt(want2), 1e-30);
  return e;
}

// ---------------------------------------------------------------------------------------------
// flashattn decode: one KV-cache call (fa_kvcache) on random inputs, as a server's decode step makes it.

int command_decode(int argc, char** argv) {
  Args a(argc, argv, 2);
  if (a.flag("help")) {
    std::string h =
        "flashattn decode: one KV-cache (decode) call on random inputs: every sequence holds --cache keys,\n"
        "--new query tokens attend to them (causal within the new tokens with --causal).\n"
        "  --cache S            keys in each sequence's cache (default 4096)\n"
        "  --new N              query tokens per sequence (default 1)\n"
        "  --append             also append N new K/V rows per sequence in the call (the cache then holds S + N)\n"
        "  --page P             paged cache of P-row blocks, block ids shuffled (default 0: contiguous)\n"
        "  --kv fp8             K/V cache float8 e4m3 with scales (q/out in --dtype f16 or bf16)\n"
        "  --splits N           split-KV count (default 0: the backend's plan, fa_plan_kvcache)\n";
    add_common_help(h);
    h +=
        "  --iters N            timed calls (default 20); --warmup N (default 2)\n"
        "  --check              compare out and lse with the float64 reference backend on the same inputs; exit\n"
        "                       status 1 when out's relative L2 error exceeds 1e-4 (float32) or 2e-2 (16-bit)\n"
        "  --json FILE          also write the result as JSON\n"
        "Reported: time per call (planned once, then run with the planned workspace: no allocation), and the\n"
        "K/V bytes of the cache read per second (B x S x Hk x (D + Dv) x the cache element).\n";
    std::fputs(h.c_str(), stdout);
    return 0;
  }
  CommonOptions c = parse_common(a);
  const int cache = int(a.integer("cache", 4096));
  const int seqlen_new = int(a.integer("new", 1));
  const bool append = a.flag("append");
  const int page = int(a.integer("page", 0));
  const std::string kv = a.str("kv", "");
  const int splits = int(a.integer("splits", 0));
  const int iters = int(a.integer("iters", 20));
  const int warmup = int(a.integer("warmup", 2));
  const bool check = a.flag("check");
  const bool with_alibi = a.flag("alibi");
  const std::string json = a.str("json", "");
  a.finish();
  if (!kv.empty() && kv != "fp8") Args::fail("--kv: expected fp8, got '" + kv + "'");
  if (cache < 0 || seqlen_new < 1 || page < 0) Args::fail("--cache >= 0, --new >= 1 and --page >= 0 are required");
  const bool fp8 = kv == "fp8";
  const Shape& s = c.shape;
  const bool device = is_device_backend(c);
  const fa_dtype cache_dtype = fp8 ? FA_FLOAT8_E4M3 : s.dtype;
  const float k_scale = fp8 ? 1.f / 64 : 0.f, v_scale = fp8 ? 1.f / 64 : 0.f;  // codes of N(0, 1) values / scale
  const int capacity = cache + (append ? seqlen_new : 0);  // rows per sequence the cache must hold
  const int64_t per_seq = page > 0 ? (capacity + page - 1) / page : 1;
  const int64_t blocks = page > 0 ? int64_t(s.batch) * per_seq : 0;
  const int64_t rows_per_seq = page > 0 ? per_seq * page : capacity;
  const int64_t cache_elems_k = int64_t(s.batch) * rows_per_seq * s.heads_k * s.head_dim;
  const int64_t cache_elems_v = int64_t(s.batch) * rows_per_seq * s.heads_k * s.head_dim_v;
  const int64_t q_elems = int64_t(s.batch) * seqlen_new * s.heads_q * s.head_dim;
  const int64_t out_elems = int64_t(s.batch) * seqlen_new * s.heads_q * s.head_dim_v;
  const int64_t new_k_elems = int64_t(s.batch) * seqlen_new * s.heads_k * s.head_dim;
  const int64_t new_v_elems = int64_t(s.batch) * seqlen_new * s.heads_k * s.head_dim_v;

  std::mt19937_64 rng(c.seed);
  auto random = [&](int64_t count, fa_dtype dtype, float scale) { return random_values(rng, count, dtype, scale); };
  struct Inputs {
    std::vector<uint8_t> q, k_cache, v_cache, k_new, v_new, seqlens, table, slopes;
  } host;
  host.q = random(q_elems, s.dtype, 0);
  host.k_cache = random(cache_elems_k, cache_dtype, k_scale);
  host.v_cache = random(cache_elems_v, cache_dtype, v_scale);
  if (append) {
    host.k_new = random(new_k_elems, s.dtype, 0);
    host.v_new = random(new_v_elems, s.dtype, 0);
  }
  host.seqlens.resize(size_t(s.batch) * 4);
  for (int b = 0; b < s.batch; ++b) std::memcpy(&host.seqlens[size_t(b) * 4], &cache, 4);
  if (page > 0) {  // a serving cache's blocks are scattered: every sequence's ids drawn from one shuffled pool
    std::vector<int32_t> ids(static_cast<size_t>(blocks));
    for (int64_t n = 0; n < blocks; ++n) ids[size_t(n)] = int32_t(n);
    std::shuffle(ids.begin(), ids.end(), rng);
    host.table.resize(ids.size() * 4);
    std::memcpy(host.table.data(), ids.data(), host.table.size());
  }
  if (with_alibi) {
    const std::vector<float> slopes = alibi_slopes(s.heads_q);
    host.slopes.resize(slopes.size() * 4);
    std::memcpy(host.slopes.data(), slopes.data(), host.slopes.size());
  }

  // The call's tensors over buffers on `on_device` (the run's) or on the host (the reference's).
  struct Call {
    Buffer q, k_cache, v_cache, k_new, v_new, seqlens, table, slopes, out, lse;
    fa_kvcache_args args{};
    fa_options options{};
  };
  auto make_call = [&](bool on_device, const fa_options& base) {
    Call call;
    auto put = [&](Buffer& b, const std::vector<uint8_t>& bytes) {
      b = Buffer(int64_t(bytes.size()), on_device);
      b.upload(bytes);
    };
    const fa_device_kind where = on_device ? FA_DEVICE_CUDA : FA_DEVICE_CPU;
    put(call.q, host.q);
    put(call.k_cache, host.k_cache);
    put(call.v_cache, host.v_cache);
    put(call.seqlens, host.seqlens);
    call.out = Buffer(out_elems * flashattn::dtype_size(s.dtype), on_device);
    call.lse = Buffer(int64_t(s.batch) * s.heads_q * seqlen_new * 4, on_device);
    fa_kvcache_args& x = call.args;
    x.q = flashattn::tensor(call.q.data, {s.batch, seqlen_new, s.heads_q, s.head_dim}, s.dtype, where);
    if (page > 0) {
      put(call.table, host.table);
      x.k_cache = flashattn::tensor(call.k_cache.data, {blocks, page, s.heads_k, s.head_dim}, cache_dtype, where);
      x.v_cache = flashattn::tensor(call.v_cache.data, {blocks, page, s.heads_k, s.head_dim_v}, cache_dtype, where);
      x.block_table = flashattn::tensor(call.table.data, {s.batch, per_seq}, FA_INT32, where);
    } else {
      x.k_cache = flashattn::tensor(call.k_cache.data, {s.batch, rows_per_seq, s.heads_k, s.head_dim}, cache_dtype, where);
      x.v_cache = flashattn::tensor(call.v_cache.data, {s.batch, rows_per_seq, s.heads_k, s.head_dim_v}, cache_dtype, where);
    }
    x.cache_seqlens = flashattn::tensor(call.seqlens.data, {s.batch}, FA_INT32, where);
    if (append) {
      put(call.k_new, host.k_new);
      put(call.v_new, host.v_new);
      x.k_new = flashattn::tensor(call.k_new.data, {s.batch, seqlen_new, s.heads_k, s.head_dim}, s.dtype, where);
      x.v_new = flashattn::tensor(call.v_new.data, {s.batch, seqlen_new, s.heads_k, s.head_dim_v}, s.dtype, where);
    }
    x.out = flashattn::tensor(call.out.data, {s.batch, seqlen_new, s.heads_q, s.head_dim_v}, s.dtype, where);
    x.lse = flashattn::tensor(call.lse.data, {s.batch, s.heads_q, seqlen_new}, FA_FLOAT32, where);
    x.num_splits = splits;
    x.k_scale = k_scale;
    x.v_scale = v_scale;
    call.options = base;
    if (with_alibi) {
      put(call.slopes, host.slopes);
      call.options.alibi_slopes = flashattn::tensor(call.slopes.data, {s.heads_q}, FA_FLOAT32, where);
    }
    return call;
  };

  Call run = make_call(device, c.options);
  fa_kvcache_plan plan{};
  Status st = flashattn::kvcache_plan(run.args, run.options, &plan);
  if (!st.ok()) Args::fail(st.to_string());
  Buffer workspace(plan.workspace_bytes, device);
  run.args.num_splits = plan.num_splits;
  if (plan.workspace_bytes > 0)
    run.args.workspace = flashattn::tensor(workspace.data, {plan.workspace_bytes}, FA_UINT8, device ? FA_DEVICE_CUDA : FA_DEVICE_CPU);
  fa_stats stats{};
  // (with --append every call writes the same new rows at the same place: the cache's contents stay those of one call)
  const Timing t = time_call(stats_on_first_call(run.options, &stats, [&] { return flashattn::kvcache(run.args, run.options); }),
                             device, warmup, iters, 60);
  const double kv_bytes =
      double(s.batch) * (cache + (append ? seqlen_new : 0)) * s.heads_k * (s.head_dim + s.head_dim_v) * flashattn::dtype_size(cache_dtype);
  std::printf("flashattn decode: B=%d cache=%d new=%d%s Hq=%d Hk=%d D=%d Dv=%d %s, cache %s%s%s backend=%s seed=%llu\n",
              s.batch, cache, seqlen_new, append ? " (appended)" : "", s.heads_q, s.heads_k, s.head_dim, s.head_dim_v,
              flashattn::dtype_name(s.dtype), flashattn::dtype_name(cache_dtype),
              page > 0 ? (" paged " + std::to_string(page)).c_str() : " contiguous", c.options.causal ? " causal" : "",
              backend_label(c.backend), (unsigned long long)c.seed);
  std::printf("decode: %.3f us (median of %d, min %.3f us)  K/V %s at %.1f GB/s  splits %d  workspace %s  kernel: %s\n",
              t.median_s * 1e6, t.iterations, t.min_s * 1e6, human_bytes(kv_bytes).c_str(), kv_bytes / t.median_s / 1e9,
              plan.num_splits, human_bytes(double(plan.workspace_bytes)).c_str(), stats.kernel);
  int status = 0;
  double rel_l2 = -1, lse_max = -1;
  if (check) {
    // The reference on host copies of the same inputs (its own cache, appended to by its own call). The run's cache
    // after the timed calls holds the same appended rows (each call wrote them), so both attend over the same keys.
    fa_options ref_options = c.options;
    ref_options.backend = FA_BACKEND_CPU_REFERENCE;
    ref_options.stream = nullptr;
    Call ref = make_call(false, ref_options);
    ref.args.num_splits = 0;
    st = flashattn::kvcache(ref.args, ref.options);
    if (!st.ok()) Args::fail("reference: " + st.to_string());
    const OutError e = out_error(run.out, ref.out.data, out_elems, s.dtype);
    const std::vector<uint8_t> got_lse = run.lse.download();
    lse_max = 0;
    for (int64_t n = 0; n < int64_t(s.batch) * s.heads_q * seqlen_new; ++n) {
      const double r = static_cast<const float*>(ref.lse.data)[n], g = reinterpret_cast<const float*>(got_lse.data())[n];
      if (!(std::isinf(r) && r == g)) lse_max = std::max(lse_max, std::abs(g - r));
    }
    rel_l2 = e.rel_l2;
    const double tolerance = s.dtype == FA_FLOAT32 ? 1e-4 : 2e-2;
    const bool ok = e.nonfinite == 0 && rel_l2 <= tolerance && std::isfinite(lse_max);
    std::printf("check (every sequence and head vs the float64 reference backend): out max_abs %.3e rel_l2 %.3e, lse "
                "max_abs %.3e%s: %s (tolerance rel_l2 %.0e)\n",
                e.max_abs, rel_l2, lse_max, e.nonfinite ? ", NON-FINITE VALUES" : "", ok ? "ok" : "FAILED", tolerance);
    status = ok ? 0 : 1;
  }
  if (!json.empty()) {
    std::ofstream f(json);
    f << "{\"B\":" << s.batch << ",\"cache\":" << cache << ",\"new\":" << seqlen_new << ",\"append\":" << (append ? "true" : "false")
      << ",\"page\":" << page << ",\"Hq\":" << s.heads_q << ",\"Hk\":" << s.heads_k << ",\"D\":" << s.head_dim
      << ",\"dtype\":\"" << flashattn::dtype_name(s.dtype) << "\",\"cache_dtype\":\"" << flashattn::dtype_name(cache_dtype)
      << "\",\"backend\":\"" << backend_label(c.backend) << "\",\"splits\":" << plan.num_splits << ",\"us\":" << t.median_s * 1e6
      << ",\"kv_gb_per_s\":" << kv_bytes / t.median_s / 1e9 << ",\"kernel\":\"" << stats.kernel << "\"";
    if (check) f << ",\"check_rel_l2\":" << rel_l2 << ",\"check_lse_max_abs\":" << lse_max;
    f << "}\n";
  }
  return status;
}

// ---------------------------------------------------------------------------------------------
// flashattn step: one continuous-batching step with requests of mixed lengths over a paged pool.

int command_step(int argc, char** argv) {
  Args a(argc, argv, 2);
  if (a.flag("help")) {
    std::string h =
        "flashattn step: one continuous-batching step over a paged KV cache on random inputs: --decode sequences\n"
        "that each add 1 token (or --decode-tokens) to --cache keys, beside --prefill sequences that each add a --chunk\n"
        "of prompt tokens to --prefill-cache keys. Every new token attends causally (bottom-right). Timed five ways:\n"
        "  append    fa_kvcache_append of every sequence's new K/V rows (the write half alone)\n"
        "  mixed     that append + ONE causal varlen fa_forward over the pool: the step as a server with requests\n"
        "            of mixed lengths runs it (2 calls, whatever the mix)\n"
        "  grouped   fa_kvcache (append + attend) once per group of equal counts: the decodes in one call (Sq = 1\n"
        "            or --decode-tokens, split-KV), the prefills in another (Sq = chunk)\n"
        "  split     that append + fa_kvcache over the decodes (no append, split-KV) + one causal varlen\n"
        "            fa_forward over the prefills: any prefill lengths, decodes through the decode kernels (3 calls)\n"
        "  concurrent split (CUDA, with decodes and prefills) with its decode call on a second stream, forked\n"
        "            after the append and joined by events: what running a step's two independent halves side by side gives\n"
        "            (--check checks its out: it runs after split, into the same rows)\n"
        "  --decode N           decoding sequences (default 64)\n"
        "  --decode-tokens T    tokens each decoding sequence adds (default 1; > 1: speculative tokens to verify)\n"
        "  --cache S            keys already cached in each decoding sequence (default 4096)\n"
        "  --prefill M          sequences adding --chunk tokens (default 2)\n"
        "  --chunk C            tokens per prefill chunk (default 512)\n"
        "  --prefill-cache P    keys already cached in each prefilling sequence (default 0: a first chunk)\n"
        "  --page P             rows per block of the pool, block ids shuffled (default 16)\n"
        "  --heads H            query heads (default 32); --heads-k HK key/value heads (default 8)\n"
        "  --head-dim D         (default 128); --head-dim-v DV (default D)\n"
        "  --dtype T            f32 | f16 | bf16 (default bf16)\n"
        "  --backend NAME       auto | cpu | standard | reference | cuda (default: auto)\n"
        "  --threads N          CPU threads (default: all)\n"
        "  --seed N             input seed (default: time-based; printed)\n"
        "  --iters N            timed calls (default 20); --warmup N (default 2)\n"
        "  --check              out of mixed, grouped and split against the float64 reference backend (the mixed step on\n"
        "                       host copies); exit status 1 when a relative L2 error exceeds 1e-4 (float32) or 2e-2\n"
        "  --keep-pool          CUDA: the device's default memory pool keeps freed memory mapped (its release\n"
        "                       threshold at its maximum, as a server would set it). The library's builds before\n"
        "                       393d8b9 took the mixed step's fa_forward scratch from that pool, which otherwise unmaps\n"
        "                       it at each synchronisation (an A/B against them); later builds use a pool of their own\n"
        "  --pipelined          also time mixed, grouped, split and concurrent as --iters steps issued back to back with one\n"
        "                       synchronisation after them (per step: the total / iters), as a server queues its steps\n"
        "  --side-priority      concurrent: the decode call's stream at the device's greatest priority (else least)\n"
        "  --forward-first      concurrent: the prefills' forward enqueued before the decode call (else after)\n"
        "  --fork               CUDA: also time the mixed step with the library's side-stream fork on (its routed\n"
        "                       decode half beside its forward kernel; src/cuda/common/stream_fork.hpp) and with it\n"
        "                       off, alternating in this process: the lines `mixed (fork on)` / `mixed (fork off)`\n"
        "  --json FILE          also write the result as JSON\n"
        "Reported: time per step (eager calls, launch included; the calls allocate only the CUDA paged forward's\n"
        "stream-ordered scratch for its decode tokens).\n";
    std::fputs(h.c_str(), stdout);
    return 0;
  }
  const int decodes = int(a.integer("decode", 64)), cached_decode = int(a.integer("cache", 4096));
  const int decode_tokens = int(a.integer("decode-tokens", 1));
  const int prefills = int(a.integer("prefill", 2)), chunk = int(a.integer("chunk", 512));
  const int cached_prefill = int(a.integer("prefill-cache", 0)), page = int(a.integer("page", 16));
  const int hq = int(a.integer("heads", 32)), hk = int(a.integer("heads-k", 8));
  const int d = int(a.integer("head-dim", 128)), dv = int(a.integer("head-dim-v", d));
  const fa_dtype dtype = parse_dtype(a.str("dtype", "bf16"));
  const fa_backend backend = parse_backend(a.str("backend", "auto"));
  const int threads = int(a.integer("threads", 0));
  const uint64_t seed = uint64_t(a.integer("seed", (long long)(std::chrono::steady_clock::now().time_since_epoch().count() & 0xffffffff)));
  const int iters = int(a.integer("iters", 20)), warmup = int(a.integer("warmup", 2));
  const bool check = a.flag("check");
  const bool keep_pool = a.flag("keep-pool");
  const bool seqused = a.flag("seqused");
  const bool pipelined = a.flag("pipelined");
  const bool side_priority = a.flag("side-priority");
  const bool forward_first = a.flag("forward-first");
  const bool fork_ab = a.flag("fork");
  const std::string json = a.str("json", "");
  a.finish();
  if (decodes < 0 || prefills < 0 || decodes + prefills < 1) Args::fail("--decode and --prefill: >= 0, one of them >= 1");
  if (cached_decode < 0 || cached_prefill < 0 || chunk < 1 || page < 1 || decode_tokens < 1)
    Args::fail("--cache >= 0, --prefill-cache >= 0, --chunk >= 1, --decode-tokens >= 1 and --page >= 1 are required");
  if (backend == FA_BACKEND_CUDA && fa_cuda_device_count() == 0)
    Args::fail("--backend cuda: no CUDA device found (or this build has no CUDA)");
  if (fork_ab && backend != FA_BACKEND_CUDA) Args::fail("--fork: needs --backend cuda");
  const bool device = backend == FA_BACKEND_CUDA;
  const fa_device_kind where = device ? FA_DEVICE_CUDA : FA_DEVICE_CPU;
  const int64_t es = flashattn::dtype_size(dtype);
#if defined(FLASHATTN_WITH_CUDA)
  if (device && keep_pool) {
    cudaMemPool_t pool = nullptr;
    uint64_t threshold = UINT64_MAX;
    if (cudaDeviceGetDefaultMemPool(&pool, 0) != cudaSuccess ||
        cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold) != cudaSuccess)
      Args::fail("--keep-pool: could not set the default memory pool's release threshold");
  }
#else
  (void)keep_pool;  // no CUDA in this build: nothing to keep
#endif

  // Sequences 0 .. decodes - 1 decode, the rest prefill: every packed tensor (q, k_new, v_new, out) holds the
  // decodes' rows first, so each group's rows are one contiguous slice of it (the grouped calls' dense views).
  const int batch = decodes + prefills;
  std::vector<int32_t> cached(static_cast<size_t>(batch)), counts(static_cast<size_t>(batch));
  for (int b = 0; b < batch; ++b) {
    cached[size_t(b)] = b < decodes ? cached_decode : cached_prefill;
    counts[size_t(b)] = b < decodes ? decode_tokens : chunk;
  }
  std::vector<int32_t> cu_new(size_t(batch) + 1, 0), cu_k(size_t(batch) + 1, 0);
  int max_keys = 0;
  for (int b = 0; b < batch; ++b) {
    cu_new[size_t(b) + 1] = cu_new[size_t(b)] + counts[size_t(b)];
    cu_k[size_t(b) + 1] = cu_k[size_t(b)] + cached[size_t(b)] + counts[size_t(b)];
    max_keys = std::max(max_keys, cached[size_t(b)] + counts[size_t(b)]);
  }
  const int total_new = cu_new.back();
  const int max_new = std::max(prefills > 0 ? chunk : 0, decodes > 0 ? decode_tokens : 0);
  const int64_t per_seq = (max_keys + page - 1) / page, blocks = int64_t(batch) * per_seq;

  std::mt19937_64 rng(seed);
  auto random = [&](int64_t count) { return random_values(rng, count, dtype); };
  auto int_bytes = [](const std::vector<int32_t>& v) {
    std::vector<uint8_t> bytes(v.size() * 4);
    std::memcpy(bytes.data(), v.data(), bytes.size());
    return bytes;
  };
  const std::vector<uint8_t> pool_k_host = random(blocks * page * hk * d), pool_v_host = random(blocks * page * hk * dv);
  const std::vector<uint8_t> q_host = random(int64_t(total_new) * hq * d);
  const std::vector<uint8_t> k_new_host = random(int64_t(total_new) * hk * d), v_new_host = random(int64_t(total_new) * hk * dv);
  std::vector<int32_t> ids(static_cast<size_t>(blocks));  // a serving pool's blocks are scattered
  for (int64_t n = 0; n < blocks; ++n) ids[size_t(n)] = int32_t(n);
  std::shuffle(ids.begin(), ids.end(), rng);

  // The step's tensors over buffers on the run's device or on the host (the reference's).
  struct Step {
    Buffer pool_k, pool_v, q, k_new, v_new, table, seqlens, cu_new, cu_k, keys, out, lse, out_grouped;
    Buffer out_split, seqlens_after, cu_q_prefills, cu_k_prefills;  // split: its out, the decodes' lengths after the
                                                                    // append, the prefills' own running sums
    fa_kvcache_args split_decodes{};
    fa_forward_args split_prefills{};
    fa_kvcache_append_args append{};
    fa_forward_args forward{};
    fa_kvcache_args group[2]{};  // decodes, prefills
    int group_batch[2]{};
  };
  auto make_step = [&](bool on_device) {
    Step st;
    const fa_device_kind w = on_device ? FA_DEVICE_CUDA : FA_DEVICE_CPU;
    auto put = [&](Buffer& b, const std::vector<uint8_t>& bytes) {
      b = Buffer(int64_t(bytes.size()), on_device);
      b.upload(bytes);
    };
    put(st.pool_k, pool_k_host);
    put(st.pool_v, pool_v_host);
    put(st.q, q_host);
    put(st.k_new, k_new_host);
    put(st.v_new, v_new_host);
    put(st.table, int_bytes(ids));
    put(st.seqlens, int_bytes(cached));
    put(st.cu_new, int_bytes(cu_new));
    put(st.cu_k, int_bytes(cu_k));
    st.out = Buffer(int64_t(total_new) * hq * dv * es, on_device);
    st.out_grouped = Buffer(int64_t(total_new) * hq * dv * es, on_device);
    st.out_split = Buffer(int64_t(total_new) * hq * dv * es, on_device);
    st.lse = Buffer(int64_t(hq) * total_new * 4, on_device);
    const fa_tensor pool_k = flashattn::tensor(st.pool_k.data, {blocks, page, hk, d}, dtype, w);
    const fa_tensor pool_v = flashattn::tensor(st.pool_v.data, {blocks, page, hk, dv}, dtype, w);
    fa_kvcache_append_args& ap = st.append;
    ap.k_cache = pool_k;
    ap.v_cache = pool_v;
    ap.block_table = flashattn::tensor(st.table.data, {batch, per_seq}, FA_INT32, w);
    ap.cache_seqlens = flashattn::tensor(st.seqlens.data, {batch}, FA_INT32, w);
    ap.k_new = flashattn::tensor(st.k_new.data, {total_new, hk, d}, dtype, w);
    ap.v_new = flashattn::tensor(st.v_new.data, {total_new, hk, dv}, dtype, w);
    ap.cu_seqlens_new = flashattn::tensor(st.cu_new.data, {batch + 1}, FA_INT32, w);
    ap.max_seqlen_new = max_new;
    fa_forward_args& fw = st.forward;
    fw.q = flashattn::tensor(st.q.data, {total_new, hq, d}, dtype, w);
    fw.k = pool_k;
    fw.v = pool_v;
    fw.out = flashattn::tensor(st.out.data, {total_new, hq, dv}, dtype, w);
    fw.lse = flashattn::tensor(st.lse.data, {hq, total_new}, FA_FLOAT32, w);
    fw.cu_seqlens_q = ap.cu_seqlens_new;
    fw.cu_seqlens_k = flashattn::tensor(st.cu_k.data, {batch + 1}, FA_INT32, w);
    fw.max_seqlen_q = max_new;
    fw.max_seqlen_k = max_keys;
    fw.block_table = ap.block_table;
    if (seqused) {  // cu_seqlens_k's counts once more, as a serving engine's seqused_k
      std::vector<int32_t> keys(static_cast<size_t>(batch));
      for (int b = 0; b < batch; ++b) keys[size_t(b)] = cu_k[size_t(b) + 1] - cu_k[size_t(b)];
      put(st.keys, int_bytes(keys));
      fw.seqused_k = flashattn::tensor(st.keys.data, {batch}, FA_INT32, w);
    }
    // The groups: dense (B_g, n_g, H, D) views of their slices of the packed rows, their rows of table and lengths.
    const int first_seq[2] = {0, decodes}, rows_per_seq[2] = {decode_tokens, chunk};
    st.group_batch[0] = decodes;
    st.group_batch[1] = prefills;
    for (int g = 0; g < 2; ++g) {
      const int64_t bg = st.group_batch[g], n = rows_per_seq[g], row0 = cu_new[size_t(first_seq[g])];
      if (bg == 0) continue;
      auto at = [&](const Buffer& b, int64_t row, int64_t row_elems, int64_t elem_bytes) {
        return static_cast<uint8_t*>(b.data) + row * row_elems * elem_bytes;
      };
      fa_kvcache_args& x = st.group[g];
      x.q = flashattn::tensor(at(st.q, row0, int64_t(hq) * d, es), {bg, n, hq, d}, dtype, w);
      x.k_cache = pool_k;
      x.v_cache = pool_v;
      x.block_table = flashattn::tensor(at(st.table, first_seq[g], per_seq, 4), {bg, per_seq}, FA_INT32, w);
      x.cache_seqlens = flashattn::tensor(at(st.seqlens, first_seq[g], 1, 4), {bg}, FA_INT32, w);
      x.k_new = flashattn::tensor(at(st.k_new, row0, int64_t(hk) * d, es), {bg, n, hk, d}, dtype, w);
      x.v_new = flashattn::tensor(at(st.v_new, row0, int64_t(hk) * dv, es), {bg, n, hk, dv}, dtype, w);
      x.out = flashattn::tensor(at(st.out_grouped, row0, int64_t(hq) * dv, es), {bg, n, hq, dv}, dtype, w);
      if (g == 0) {  // split's decode call: the group's views without k_new, over the lengths after the append
        std::vector<int32_t> after(cached.begin(), cached.begin() + decodes);
        for (int32_t& length : after) length += decode_tokens;
        put(st.seqlens_after, int_bytes(after));
        fa_kvcache_args& y = st.split_decodes;
        y = x;
        y.k_new = y.v_new = fa_tensor{};
        y.cache_seqlens = flashattn::tensor(st.seqlens_after.data, {bg}, FA_INT32, w);
        y.out = flashattn::tensor(at(st.out_split, row0, int64_t(hq) * dv, es), {bg, n, hq, dv}, dtype, w);
      } else {  // split's prefill call: the varlen forward over the prefills alone (running sums from 0)
        std::vector<int32_t> cu_q(cu_new.begin() + decodes, cu_new.end()), cu_kp(cu_k.begin() + decodes, cu_k.end());
        for (int32_t& x0 : cu_q) x0 -= cu_new[size_t(decodes)];
        for (int32_t& x0 : cu_kp) x0 -= cu_k[size_t(decodes)];
        put(st.cu_q_prefills, int_bytes(cu_q));
        put(st.cu_k_prefills, int_bytes(cu_kp));
        const int64_t rows = int64_t(cu_q.back());
        fa_forward_args& y = st.split_prefills;
        y = fw;
        y.seqused_k = fa_tensor{};  // (--seqused: the mixed step's alone)
        y.q = flashattn::tensor(at(st.q, row0, int64_t(hq) * d, es), {rows, hq, d}, dtype, w);
        y.out = flashattn::tensor(at(st.out_split, row0, int64_t(hq) * dv, es), {rows, hq, dv}, dtype, w);
        y.lse = fa_tensor{};
        y.cu_seqlens_q = flashattn::tensor(st.cu_q_prefills.data, {bg + 1}, FA_INT32, w);
        y.cu_seqlens_k = flashattn::tensor(st.cu_k_prefills.data, {bg + 1}, FA_INT32, w);
        y.block_table = x.block_table;
      }
    }
    return st;
  };

  fa_options options;
  fa_options_init(&options);
  options.backend = backend;
  options.num_threads = threads;
  options.causal = 1;
  Step run = make_step(device);
  // The fa_kvcache calls are planned once (split count and workspace), as a server would per batch shape.
  Buffer workspace[3];
  auto plan_call = [&](fa_kvcache_args& x, Buffer& space) {
    fa_kvcache_plan plan{};
    const Status st = flashattn::kvcache_plan(x, options, &plan);
    if (!st.ok()) Args::fail(st.to_string());
    x.num_splits = plan.num_splits;
    space = Buffer(plan.workspace_bytes, device);
    if (plan.workspace_bytes > 0) x.workspace = flashattn::tensor(space.data, {plan.workspace_bytes}, FA_UINT8, where);
  };
  for (int g = 0; g < 2; ++g)
    if (run.group_batch[g] > 0) plan_call(run.group[g], workspace[g]);
  if (decodes > 0) plan_call(run.split_decodes, workspace[2]);
  // Every timed call writes the same rows at the same places (the pool after any of them is the pool after one), and
  // the attention reads cached + new keys each time: the calls are repeatable.
  auto append = [&] { return flashattn::kvcache_append(run.append, options); };
  auto mixed = [&] {
    const Status st = flashattn::kvcache_append(run.append, options);
    return st.ok() ? flashattn::forward(run.forward, options) : st;
  };
  auto grouped = [&] {
    for (int g = 0; g < 2; ++g) {
      if (run.group_batch[g] == 0) continue;
      const Status st = flashattn::kvcache(run.group[g], options);
      if (!st.ok()) return st;
    }
    return Status();
  };
  auto split = [&] {
    Status st = flashattn::kvcache_append(run.append, options);
    if (st.ok() && decodes > 0) st = flashattn::kvcache(run.split_decodes, options);
    if (st.ok() && prefills > 0) st = flashattn::forward(run.split_prefills, options);
    return st;
  };
  // concurrent (CUDA, decodes and prefills both): split's calls with the decode call on a second stream, forked after
  // the append and joined before the step ends (events): what running the two independent halves of a step side by
  // side would give. A measurement of the tool's own; the library runs a call's work on the caller's stream.
  std::function<Status()> concurrent;
#if defined(FLASHATTN_WITH_CUDA)
  cudaStream_t side = nullptr;
  cudaEvent_t forked = nullptr, joined = nullptr;
  if (device && decodes > 0 && prefills > 0) {
    int least = 0, greatest = 0;  // --side-priority: the decode call's stream at the device's greatest priority
    if (cudaDeviceGetStreamPriorityRange(&least, &greatest) != cudaSuccess ||
        cudaStreamCreateWithPriority(&side, cudaStreamNonBlocking, side_priority ? greatest : least) != cudaSuccess ||
        cudaEventCreateWithFlags(&forked, cudaEventDisableTiming) != cudaSuccess ||
        cudaEventCreateWithFlags(&joined, cudaEventDisableTiming) != cudaSuccess)
      Args::fail("concurrent: could not create a stream and two events");
    concurrent = [&]() -> Status {
      const auto main_stream = static_cast<cudaStream_t>(options.stream);
      Status st = flashattn::kvcache_append(run.append, options);
      if (!st.ok()) return st;
      if (cudaEventRecord(forked, main_stream) != cudaSuccess || cudaStreamWaitEvent(side, forked, 0) != cudaSuccess)
        return Status(FA_ERROR_DEVICE, "concurrent: fork failed");
      fa_options side_options = options;
      side_options.stream = side;
      if (forward_first) {  // --forward-first: the prefills' forward enqueued before the decode call
        st = flashattn::forward(run.split_prefills, options);
        if (st.ok()) st = flashattn::kvcache(run.split_decodes, side_options);
      } else {
        st = flashattn::kvcache(run.split_decodes, side_options);
        if (st.ok()) st = flashattn::forward(run.split_prefills, options);
      }
      if (cudaEventRecord(joined, side) != cudaSuccess || cudaStreamWaitEvent(main_stream, joined, 0) != cudaSuccess)
        return Status(FA_ERROR_DEVICE, "concurrent: join failed");
      return st;
    };
  }
#endif
  const Timing t_append = time_call(append, device, warmup, iters, 30);
  const Timing t_mixed = time_call(mixed, device, warmup, iters, 60);
  const Timing t_grouped = time_call(grouped, device, warmup, iters, 60);
  const Timing t_split = time_call(split, device, warmup, iters, 60);
  Timing t_concurrent;
  if (concurrent) t_concurrent = time_call(concurrent, device, warmup, iters, 60);
  // --fork: the mixed step with the library's fork on and off, alternating (three rounds of each), so that both see
  // the same clocks; the environment's setting applies again after.
  Timing t_fork[2];            // [0] off, [1] on: the best median of the rounds
  double piped_fork[2] = {-1, -1};
  int64_t forks_made = 0;      // by the fork-on rounds (0: the mixed call never forked)
#if defined(FLASHATTN_WITH_CUDA)
  if (fork_ab) {
    for (int round = 0; round < 3; ++round)
      for (int on = 0; on < 2; ++on) {
        flashattn::cuda::set_stream_fork_enabled(on != 0);
        const int64_t before = flashattn::cuda::stream_forks_made();
        const Timing t = time_call(mixed, device, warmup, iters, 60);
        if (round == 0 || t.median_s < t_fork[on].median_s) t_fork[on] = t;
        if (pipelined) {
          const double p = time_call_pipelined(mixed, device, warmup, iters);
          if (round == 0 || p < piped_fork[on]) piped_fork[on] = p;
        }
        if (on) forks_made += flashattn::cuda::stream_forks_made() - before;
      }
    flashattn::cuda::clear_stream_fork_override();
  }
#endif
  double piped[4] = {-1, -1, -1, -1};  // mixed, grouped, split, concurrent (--pipelined)
  if (pipelined) {
    piped[0] = time_call_pipelined(mixed, device, warmup, iters);
    piped[1] = time_call_pipelined(grouped, device, warmup, iters);
    piped[2] = time_call_pipelined(split, device, warmup, iters);
    if (concurrent) piped[3] = time_call_pipelined(concurrent, device, warmup, iters);
  }
  const double kv_bytes = double(cu_k.back()) * hk * (d + dv) * es;
  std::printf("flashattn step: %d decodes (+%d token%s, %d cached) and %d prefills (+%d tokens, %d cached), %d new rows, "
              "Hq=%d Hk=%d D=%d Dv=%d %s, pool of %lld blocks of %d (shuffled), backend=%s seed=%llu\n",
              decodes, decode_tokens, decode_tokens == 1 ? "" : "s", cached_decode, prefills, chunk, cached_prefill,
              total_new, hq, hk, d, dv,
              flashattn::dtype_name(dtype), (long long)blocks, page, backend_label(backend), (unsigned long long)seed);
  std::printf("append:  %10.3f us (median of %d, min %.3f us)\n", t_append.median_s * 1e6, t_append.iterations,
              t_append.min_s * 1e6);
  std::printf("mixed:   %10.3f us (median of %d, min %.3f us)  K/V %s at %.1f GB/s\n", t_mixed.median_s * 1e6,
              t_mixed.iterations, t_mixed.min_s * 1e6, human_bytes(kv_bytes).c_str(), kv_bytes / t_mixed.median_s / 1e9);
  std::printf("grouped: %10.3f us (median of %d, min %.3f us)  K/V %s at %.1f GB/s  (mixed / grouped %.3f)\n",
              t_grouped.median_s * 1e6, t_grouped.iterations, t_grouped.min_s * 1e6, human_bytes(kv_bytes).c_str(),
              kv_bytes / t_grouped.median_s / 1e9, t_mixed.median_s / t_grouped.median_s);
  std::printf("split:   %10.3f us (median of %d, min %.3f us)  K/V %s at %.1f GB/s  (split / grouped %.3f)\n",
              t_split.median_s * 1e6, t_split.iterations, t_split.min_s * 1e6, human_bytes(kv_bytes).c_str(),
              kv_bytes / t_split.median_s / 1e9, t_split.median_s / t_grouped.median_s);
  if (concurrent)
    std::printf("concurrent: %7.3f us (median of %d, min %.3f us)  K/V %s at %.1f GB/s  (concurrent / grouped %.3f; "
                "split with its decode call on a second stream)\n",
                t_concurrent.median_s * 1e6, t_concurrent.iterations, t_concurrent.min_s * 1e6, human_bytes(kv_bytes).c_str(),
                kv_bytes / t_concurrent.median_s / 1e9, t_concurrent.median_s / t_grouped.median_s);
  if (pipelined)
    std::printf("pipelined (%d steps back to back, one synchronisation): mixed %.3f us, grouped %.3f us, split %.3f us, "
                "concurrent %.3f us per step (mixed / grouped %.3f)\n",
                iters, piped[0] * 1e6, piped[1] * 1e6, piped[2] * 1e6, piped[3] * 1e6, piped[0] / piped[1]);

  if (fork_ab) {
    for (int on = 1; on >= 0; --on)
      std::printf("mixed (fork %s): %8.3f us (best median of 3 rounds of %d, min %.3f us)%s\n", on ? "on" : "off",
                  t_fork[on].median_s * 1e6, t_fork[on].iterations, t_fork[on].min_s * 1e6,
                  pipelined ? (" pipelined " + std::to_string(piped_fork[on] * 1e6) + " us per step").c_str() : "");
    std::printf("mixed (fork on / off) %.3f%s; forks made by the fork-on rounds: %lld%s\n",
                t_fork[1].median_s / t_fork[0].median_s,
                pipelined ? (", pipelined " + std::to_string(piped_fork[1] / piped_fork[0])).c_str() : "",
                (long long)forks_made, forks_made == 0 ? " (the call never forked: nothing routed, or a capture)" : "");
  }

  int status = 0;
  double err_mixed = -1, err_grouped = -1, err_split = -1;
  if (check) {
    // The reference: the mixed step on host copies of the same inputs, through the float64 backend.
    fa_options ref_options = options;
    ref_options.backend = FA_BACKEND_CPU_REFERENCE;
    Step ref = make_step(false);
    Status st = flashattn::kvcache_append(ref.append, ref_options);
    if (st.ok()) st = flashattn::forward(ref.forward, ref_options);
    if (!st.ok()) Args::fail("reference: " + st.to_string());
    auto rel_l2 = [&](const Buffer& got, bool* finite) {
      const OutError e = out_error(got, ref.out.data, int64_t(total_new) * hq * dv, dtype);
      if (e.nonfinite > 0) *finite = false;
      return e.rel_l2;
    };
    bool finite = true;
    err_mixed = rel_l2(run.out, &finite);
    err_grouped = rel_l2(run.out_grouped, &finite);
    err_split = rel_l2(run.out_split, &finite);
    const double tolerance = dtype == FA_FLOAT32 ? 1e-4 : 2e-2;
    const bool ok = finite && err_mixed <= tolerance && err_grouped <= tolerance && err_split <= tolerance;
    std::printf("check (every new row and head vs the float64 reference backend): out rel_l2 mixed %.3e, grouped "
                "%.3e, split %.3e%s: %s (tolerance %.0e)\n",
                err_mixed, err_grouped, err_split, finite ? "" : ", NON-FINITE VALUES", ok ? "ok" : "FAILED", tolerance);
    status = ok ? 0 : 1;
  }
  if (!json.empty()) {
    std::ofstream f(json);
    f << "{\"decodes\":" << decodes << ",\"decode_tokens\":" << decode_tokens << ",\"cache\":" << cached_decode << ",\"prefills\":" << prefills << ",\"chunk\":"
      << chunk << ",\"prefill_cache\":" << cached_prefill << ",\"page\":" << page << ",\"Hq\":" << hq << ",\"Hk\":" << hk
      << ",\"D\":" << d << ",\"Dv\":" << dv << ",\"dtype\":\"" << flashattn::dtype_name(dtype) << "\",\"backend\":\""
      << backend_label(backend) << "\",\"us_append\":" << t_append.median_s * 1e6 << ",\"us_mixed\":"
      << t_mixed.median_s * 1e6 << ",\"us_grouped\":" << t_grouped.median_s * 1e6 << ",\"us_split\":" << t_split.median_s * 1e6;
    if (concurrent) f << ",\"us_concurrent\":" << t_concurrent.median_s * 1e6;
    if (pipelined)
      f << ",\"us_mixed_pipelined\":" << piped[0] * 1e6 << ",\"us_grouped_pipelined\":" << piped[1] * 1e6
        << ",\"us_split_pipelined\":" << piped[2] * 1e6;
    if (pipelined && concurrent) f << ",\"us_concurrent_pipelined\":" << piped[3] * 1e6;
    if (fork_ab)
      f << ",\"us_mixed_fork_off\":" << t_fork[0].median_s * 1e6 << ",\"us_mixed_fork_on\":" << t_fork[1].median_s * 1e6
        << ",\"us_mixed_fork_off_pipelined\":" << piped_fork[0] * 1e6 << ",\"us_mixed_fork_on_pipelined\":"
        << piped_fork[1] * 1e6 << ",\"forks_made\":" << forks_made;
    if (check)
      f << ",\"check_rel_l2_mixed\":" << err_mixed << ",\"check_rel_l2_grouped\":" << err_grouped
        << ",\"check_rel_l2_split\":" << err_split;
    f << "}\n";
  }
#if defined(FLASHATTN_WITH_CUDA)
  if (side != nullptr) {  // (the concurrent step's; all its work is done: check and timing synchronised)
    cudaEventDestroy(forked);
    cudaEventDestroy(joined);
    cudaStreamDestroy(side);
  }
#endif
  return status;
}

void usage() {
  std::puts(
      "flashattn: exact, IO-aware attention (FlashAttention) - command-line tool\n"
      "usage: flashattn <command> [options]\n"
      "  info     version, backends, devices, compiled kernels\n"
      "  run      one problem on random inputs: time, TFLOP/s, GB/s, memory; --check vs float64 reference\n"
      "  bench    flash vs textbook attention over sequence lengths: time and peak memory (table + JSON)\n"
      "  decode   one KV-cache (decode) call: contiguous or paged, append, FP8 cache; time, K/V GB/s; --check\n"
      "  step     one continuous-batching step (decodes beside prefill chunks, paged): append + varlen forward\n"
      "           against one fa_kvcache per group; time; --check\n"
      "`flashattn <command> --help` for the options of a command.");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h" || std::string(argv[1]) == "help") {
    usage();
    return argc < 2 ? 2 : 0;
  }
  const std::string command = argv[1];
  if (command == "info") return command_info(argc, argv);
  if (command == "run") return command_run(argc, argv);
  if (command == "bench") return command_bench(argc, argv);
  if (command == "decode") return command_decode(argc, argv);
  if (command == "step") return command_step(argc, argv);
  std::fprintf(stderr, "flashattn: unknown command '%s'\n", command.c_str());
  usage();
  return 2;
}
