// Random calls of the four entry points through the C ABI (fa_kvcache, fa_kvcache_append, fa_forward, fa_backward), valid
// ones and ones broken in one or two places (a shape, a stride, a dtype, a device, a missing tensor, an index
// entry, an option). Whatever the caller passes, a call must either
//   - fail with a clear error (a status of the argument kind, a message that names what it rejects) and
//     leave every byte of every buffer as it was, or
//   - succeed, write nothing but its outputs (out and lse; dq, dk and dv; the workspace; exactly the
//     appended cache rows), and agree with the float64 reference backend given the same arguments.
// Every buffer has guard bytes on both sides and slack after its view, so a broken shape or stride may
// reach further than the valid call did. The test calls only when each view it can measure lies inside its
// buffer and no output's elements share bytes: a view past its storage, or an output that overlaps itself,
// is the caller's fault, which no library can see (flash_attn and torch do not look either). Views it cannot
// measure (a negative extent or stride, an unknown dtype, a rank out of range) must be rejected before
// any access; under AddressSanitizer (CI) a read through one would fail the run.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "api/validate.hpp"
#include "core/dtype.hpp"
#include "flashattn/flashattn.h"
#include "testing.hpp"

#if defined(FLASHATTN_WITH_CUDA)
#include <cuda_runtime.h>
#endif

namespace flashattn {
namespace {

constexpr size_t kGuardBytes = 64;  // before and after each buffer's storage
constexpr uint8_t kGuardByte = 0xA5;
constexpr int kSlackFactor = 3;     // storage = kSlackFactor x the valid view's bytes (+ 64)

// A C caller may store any int in an enum field; C++ may not load one outside the enum's range, so the
// test reads the fields' bits, as the library does.
template <typename Enum>
int raw(const Enum& field) {
  int value;
  static_assert(sizeof(Enum) == sizeof(int));
  std::memcpy(&value, &field, sizeof(value));
  return value;
}

int64_t size_of(int t) {
  switch (t) {
    case FA_FLOAT32: case FA_INT32: return 4;
    case FA_FLOAT16: case FA_BFLOAT16: return 2;
    case FA_UINT8: case FA_FLOAT8_E4M3: return 1;
    default: return 0;  // not a dtype
  }
}

// One tensor argument: its view (as the library gets it) and the buffer behind it.
struct Buffer {
  std::string name;
  fa_tensor* view = nullptr;   // the field inside the call's args / options
  std::vector<uint8_t> bytes;  // guard | storage | guard
  size_t storage = 0;          // bytes the view may reach from data
  bool written = false;        // out, lse, or a cache (written when the call appends)
  uint8_t* data() { return bytes.data() + kGuardBytes; }
};

// Bytes from data to the end of the view's last element; -1 when the view cannot be measured
// (rank out of range, unknown dtype, negative extent or stride); 2^62 when it reaches beyond 2^40 elements.
int64_t reach_bytes(const fa_tensor& t) {
  const int64_t elem = size_of(raw(t.dtype));
  if (t.ndim < 0 || t.ndim > FA_MAX_DIMS || elem == 0) return -1;
  int64_t last = 0;
  for (int d = 0; d < t.ndim; ++d) {
    if (t.shape[d] < 0 || t.strides[d] < 0) return -1;
    if (t.shape[d] == 0) return 0;
  }
  constexpr int64_t kFar = int64_t(1) << 40;
  for (int d = 0; d < t.ndim; ++d) {
    // (shape - 1) * stride without overflow: both may be up to 2^63 after a break
    if (t.strides[d] > 0 && t.shape[d] - 1 > kFar / t.strides[d]) return int64_t(1) << 62;
    last += (t.shape[d] - 1) * t.strides[d];
    if (last > kFar) return int64_t(1) << 62;
  }
  return (last + 1) * elem;
}

// Element offsets (in elements) of every index tuple of a measurable view, row-major.
std::vector<int64_t> element_offsets(const fa_tensor& t);

// Elements of a measurable view, saturating at 2^40.
int64_t numel_of(const fa_tensor& t) {
  constexpr int64_t kFar = int64_t(1) << 40;
  int64_t n = 1;
  for (int d = 0; d < t.ndim; ++d) n = t.shape[d] > 0 && n > kFar / t.shape[d] ? kFar : std::min(n * t.shape[d], kFar);
  return n;
}

// Whether two elements of a measurable view share an address (strides that do not separate them).
bool overlaps_itself(const fa_tensor& t) {
  if (numel_of(t) > reach_bytes(t) / size_of(raw(t.dtype))) return true;  // more elements than addresses
  std::vector<int64_t> offsets = element_offsets(t);
  std::sort(offsets.begin(), offsets.end());
  return std::adjacent_find(offsets.begin(), offsets.end()) != offsets.end();
}

std::vector<int64_t> element_offsets(const fa_tensor& t) {
  for (int d = 0; d < t.ndim; ++d)
    if (t.shape[d] == 0) return {};
  std::vector<int64_t> offsets{0};
  for (int d = 0; d < t.ndim; ++d) {
    std::vector<int64_t> next;
    next.reserve(offsets.size() * size_t(t.shape[d]));
    for (int64_t o : offsets)
      for (int64_t i = 0; i < t.shape[d]; ++i) next.push_back(o + i * t.strides[d]);
    offsets.swap(next);
  }
  return offsets;
}

// A random call: its tensors, its arguments and options, and a record of what was drawn and broken.
enum class Api { kKvcache, kAppend, kForward, kBackward };

struct Call {
  Call() = default;
  Call(const Call&) = delete;  // buffers point into args / options, views into buffers
  Call& operator=(const Call&) = delete;
  Api api = Api::kKvcache;
  fa_kvcache_args args{};  // api kKvcache
  fa_kvcache_append_args app{};  // api kAppend
  fa_forward_args fwd{};   // api kForward
  fa_backward_args bwd{};  // api kBackward
  fa_options options{};
  std::vector<Buffer> buffers;
  std::string log;
  fa_dtype dtype = FA_FLOAT32;
  bool fp8 = false, append = false;
  bool on_device = false;  // drawn for the CUDA backend: its buffers are mirrored in device memory for the call

  Buffer& add(const std::string& name, fa_tensor* field, std::vector<int64_t> shape, fa_dtype t) {
    Buffer b;
    b.name = name;
    b.written = is_output(name);
    b.view = field;
    int64_t numel = 1;
    for (int64_t s : shape) numel *= s;
    b.storage = size_t(kSlackFactor * numel * size_of(t) + 64);
    b.bytes.assign(b.storage + 2 * kGuardBytes, kGuardByte);
    std::memset(b.data(), 0, b.storage);
    *field = fa_tensor{};
    field->data = b.data();
    field->ndim = int32_t(shape.size());
    field->dtype = t;
    // CUDA calls: the buffers are mirrored in device memory for the call (invoke_on_device); the views say so
    field->device = raw(options.backend) == FA_BACKEND_CUDA ? FA_DEVICE_CUDA : FA_DEVICE_CPU;
    int64_t stride = 1;
    for (int d = int(shape.size()) - 1; d >= 0; --d) {
      field->shape[d] = shape[size_t(d)];
      field->strides[d] = stride;
      stride *= shape[size_t(d)];
    }
    buffers.push_back(std::move(b));
    return buffers.back();
  }
  // The buffers a call of this api may write (the caches: only at the appended rows, see writable()).
  bool is_output(const std::string& name) const {
    switch (api) {
      case Api::kKvcache: return name == "out" || name == "lse" || name == "workspace" || name == "k_cache" || name == "v_cache";
      case Api::kAppend: return name == "k_cache" || name == "v_cache";
      case Api::kForward: return name == "out" || name == "lse";
      case Api::kBackward: return name == "dq" || name == "dk" || name == "dv" || name == "workspace";
    }
    return false;
  }
};

fa_status invoke(Call& c, const fa_options& options, fa_error* error) {
  switch (c.api) {
    case Api::kKvcache: return fa_kvcache(&c.args, &options, error);
    case Api::kAppend: return fa_kvcache_append(&c.app, &options, error);
    case Api::kForward: return fa_forward(&c.fwd, &options, error);
    case Api::kBackward: return fa_backward(&c.bwd, &options, error);
  }
  return FA_ERROR_INTERNAL;
}

// A call drawn for the CUDA backend (Call::on_device): every buffer, guards and slack included, copied to device
// memory; the views pointed there for the call (the same offsets, so the same alignment mod 64) and back to the
// host after; the device bytes, all of them, copied back over the host buffers. The checks then read the host.
fa_status invoke_on_device(Call& c, const fa_options& options, fa_error* error) {
#if defined(FLASHATTN_WITH_CUDA)
  // A CUDA error (a kernel that faulted, say) is fatal: the test stops at this call (run_many stops on it).
  auto cuda_ok = [&](cudaError_t e, const char* what) {
    if (e != cudaSuccess) [&] { FAIL() << c.log << ": " << what << ": " << cudaGetErrorString(e); }();
  };
  std::vector<uint8_t*> device(c.buffers.size(), nullptr);
  std::vector<void*> host_data(c.buffers.size(), nullptr);
  for (size_t i = 0; i < c.buffers.size(); ++i) {
    Buffer& b = c.buffers[i];
    cuda_ok(cudaMalloc(reinterpret_cast<void**>(&device[i]), b.bytes.size()), "cudaMalloc");
    cuda_ok(cudaMemcpy(device[i], b.bytes.data(), b.bytes.size(), cudaMemcpyHostToDevice), "copy to the device");
    host_data[i] = b.view->data;
    // (a view's data is its buffer's storage, or null when absent)
    if (b.view->data != nullptr) b.view->data = device[i] + (static_cast<uint8_t*>(b.view->data) - b.bytes.data());
  }
  const fa_status status = invoke(c, options, error);
  cuda_ok(cudaDeviceSynchronize(), "after the call");
  for (size_t i = 0; i < c.buffers.size(); ++i) {
    Buffer& b = c.buffers[i];
    b.view->data = host_data[i];
    cuda_ok(cudaMemcpy(b.bytes.data(), device[i], b.bytes.size(), cudaMemcpyDeviceToHost), "copy back");
    cudaFree(device[i]);
  }
  return status;
#else
  (void)c, (void)options;
  error->message[0] = '\0';
  return FA_ERROR_NOT_COMPILED;  // unreachable: run_one skips such calls without a CUDA device
#endif
}

// Fills every storage byte of a floating buffer with values of its dtype (normal, times `scale`), so that
// slack a broken view reaches holds numbers too.
void fill_float(Buffer& b, fa_dtype t, std::mt19937_64& rng, double scale) {
  std::normal_distribution<double> normal(0.0, scale);
  const int64_t n = int64_t(b.storage) / size_of(t);
  for (int64_t i = 0; i < n; ++i) store_from_float(b.data(), i, t, float(normal(rng)));
}

void set_int(Buffer& b, int64_t i, int32_t v) { std::memcpy(b.data() + 4 * i, &v, 4); }
int32_t get_int(const fa_tensor& t, int64_t element) {
  int32_t v;
  std::memcpy(&v, static_cast<const uint8_t*>(t.data) + 4 * element, 4);
  return v;
}

template <typename T>
T pick(std::mt19937_64& rng, std::initializer_list<T> values) {
  return *(values.begin() + std::uniform_int_distribution<size_t>(0, values.size() - 1)(rng));
}
int uniform(std::mt19937_64& rng, int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }
bool chance(std::mt19937_64& rng, double p) { return std::uniform_real_distribution<double>(0, 1)(rng) < p; }

// Masks and the other options of a valid call (ALiBi slopes of (B, Hq) or (Hq); dropout where `dropout`).
void draw_options(Call& c, std::mt19937_64& rng, int batch, int heads_q, bool dropout) {
  c.options.causal = chance(rng, 0.4);
  if (chance(rng, 0.25)) c.options.window_left = uniform(rng, 0, 6);
  if (!c.options.causal && chance(rng, 0.15)) c.options.window_right = uniform(rng, 0, 3);
  if (chance(rng, 0.2)) c.options.softcap = pick(rng, {2.f, 30.f});
  if (chance(rng, 0.3)) c.options.softmax_scale = pick(rng, {0.05f, 0.3f, 1.f});
  if (dropout && chance(rng, 0.2)) {
    c.options.dropout_p = pick(rng, {0.1f, 0.5f});
    c.options.dropout_seed = rng();
    c.options.dropout_offset = rng() % 1000;
  }
  if (chance(rng, 0.15)) {
    const bool per_batch = chance(rng, 0.5);
    Buffer& s = per_batch ? c.add("options.alibi_slopes", &c.options.alibi_slopes, {batch, heads_q}, FA_FLOAT32)
                          : c.add("options.alibi_slopes", &c.options.alibi_slopes, {heads_q}, FA_FLOAT32);
    for (int64_t i = 0; i < int64_t(s.storage) / 4; ++i) store_from_float(s.data(), i, FA_FLOAT32, 0.1f * float(1 + i % 5));
  }
  c.log += std::string(" causal=") + std::to_string(c.options.causal) + " window=(" + std::to_string(c.options.window_left) +
           "," + std::to_string(c.options.window_right) + ") softcap=" + std::to_string(c.options.softcap) +
           " dropout=" + std::to_string(c.options.dropout_p) + " alibi=" + std::to_string(c.options.alibi_slopes.data != nullptr);
}

// A valid KV-cache call: small random sizes, contiguous or paged (block sizes 1 to 16, shuffled ids, spare blocks)
// or through cache_batch_idx, float32 / float16 / bfloat16, FP8 caches, append, rotary, left padding,
// masks and the other options.
// The start of every drawn call: its entry point, default options for `backend`, 1 or 2 threads.
void start_call(Call& c, Api api, fa_backend backend, std::mt19937_64& rng) {
  c.api = api;
  c.buffers.reserve(20);  // at most 17 buffers: references stay valid while adding
  fa_options_init(&c.options);
  c.options.backend = backend;
  c.options.num_threads = uniform(rng, 1, 2);
}

// A paged cache of B sequences of `capacity` rows: the block size (1 to 16), blocks per sequence, blocks in the pool
// (spare ones too), and the sequences' blocks, distinct and shuffled (B x per_seq ids, row-major).
struct PagedLayout {
  int rows_per_entry, per_seq, entries;
  std::vector<int32_t> table_ids;
};
PagedLayout draw_paged_layout(std::mt19937_64& rng, int B, int capacity) {
  PagedLayout l;
  l.rows_per_entry = pick(rng, {1, 3, 4, 16});
  l.per_seq = (capacity + l.rows_per_entry - 1) / l.rows_per_entry;
  l.entries = B * l.per_seq + uniform(rng, 0, 3);
  std::vector<int32_t> ids(static_cast<size_t>(l.entries));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  l.table_ids.assign(ids.begin(), ids.begin() + B * l.per_seq);
  return l;
}

void make_kvcache_call(Call& c, std::mt19937_64& rng, fa_backend backend) {
  start_call(c, Api::kKvcache, backend, rng);
  // CUDA: what its decode kernels take (16-bit q, Dv = D, their head dims; cache_batch_idx with S_cache a power of
  // two >= 16; cache_leftpad with a contiguous cache), the index tensors checked on the device (check_indices)
  const bool cuda = backend == FA_BACKEND_CUDA;
  c.on_device = cuda;
  const int B = uniform(rng, 1, 3), Sq = pick(rng, {1, 1, 2, 3, 5}), Hk = uniform(rng, 1, 2), Hq = Hk * pick(rng, {1, 2, 3});
  const int D = cuda ? pick(rng, {32, 64, 80}) : pick(rng, {8, 16, 40, 64});
  const int Dv = cuda || chance(rng, 0.8) ? D : pick(rng, {8, 24});
  c.dtype = cuda ? pick(rng, {FA_FLOAT16, FA_BFLOAT16}) : pick(rng, {FA_FLOAT32, FA_FLOAT16, FA_BFLOAT16});
  c.fp8 = c.dtype != FA_FLOAT32 && chance(rng, 0.3);
  const fa_dtype cache_dtype = c.fp8 ? FA_FLOAT8_E4M3 : c.dtype;
  const int S_new = chance(rng, 0.5) ? uniform(rng, 1, 3) : 0;
  c.append = S_new > 0;
  const int layout = uniform(rng, 0, 2);  // 0 contiguous, 1 paged, 2 contiguous through cache_batch_idx
  const int capacity = cuda && layout == 2 ? pick(rng, {16, 32}) : uniform(rng, S_new + 1, 40);
  std::vector<int> cached(static_cast<size_t>(B)), pad(static_cast<size_t>(B), 0);
  for (int b = 0; b < B; ++b) cached[size_t(b)] = uniform(rng, 0, capacity - S_new);
  const bool leftpad = (!cuda || layout == 0) && chance(rng, 0.25);
  c.args.check_indices = cuda ? 1 : 0;
  if (leftpad)
    for (int b = 0; b < B; ++b) pad[size_t(b)] = uniform(rng, 0, cached[size_t(b)]);
  c.log = "B=" + std::to_string(B) + " Sq=" + std::to_string(Sq) + " Hq=" + std::to_string(Hq) + " Hk=" + std::to_string(Hk) +
          " D=" + std::to_string(D) + " Dv=" + std::to_string(Dv) + " " + dtype_name(c.dtype) + (c.fp8 ? " fp8-cache" : "") +
          " S_new=" + std::to_string(S_new) + " capacity=" + std::to_string(capacity) + " layout=" + std::to_string(layout);

  fill_float(c.add("q", &c.args.q, {B, Sq, Hq, D}, c.dtype), c.dtype, rng, 1.0);
  c.add("out", &c.args.out, {B, Sq, Hq, Dv}, c.dtype);
  if (chance(rng, 0.7)) c.add("lse", &c.args.lse, {B, Hq, Sq}, FA_FLOAT32);
  if (c.fp8) {
    c.args.k_scale = pick(rng, {0.05f, 0.25f, 1.f});
    c.args.v_scale = pick(rng, {0.03f, 0.5f});
  } else if (chance(rng, 0.2)) {
    c.args.k_scale = c.args.v_scale = 1.f;  // "no scale", allowed for 16-bit caches
  }
  const double k_std = c.fp8 ? 1.0 / c.args.k_scale : 1.0, v_std = c.fp8 ? 1.0 / c.args.v_scale : 1.0;

  int rows_per_entry = capacity, entries = B;  // the cache's dimensions 0 and 1
  std::vector<int32_t> table_ids;
  int per_seq = 1;
  if (layout == 1) {
    PagedLayout l = draw_paged_layout(rng, B, capacity);
    rows_per_entry = l.rows_per_entry, per_seq = l.per_seq, entries = l.entries;
    table_ids = std::move(l.table_ids);
    // Without an append, blocks may repeat (shared prefixes); with one, the blocks a sequence writes must be its own.
    if (!c.append && chance(rng, 0.3)) table_ids[size_t(uniform(rng, 0, B * per_seq - 1))] = table_ids[0];
  } else if (layout == 2) {
    entries = B + uniform(rng, 0, 3);
  }
  fill_float(c.add("k_cache", &c.args.k_cache, {entries, rows_per_entry, Hk, D}, cache_dtype), cache_dtype, rng, k_std);
  fill_float(c.add("v_cache", &c.args.v_cache, {entries, rows_per_entry, Hk, Dv}, cache_dtype), cache_dtype, rng, v_std);
  if (layout == 1) {
    Buffer& t = c.add("block_table", &c.args.block_table, {B, per_seq}, FA_INT32);
    for (int i = 0; i < B * per_seq; ++i) set_int(t, i, table_ids[size_t(i)]);
  } else if (layout == 2) {
    std::vector<int32_t> slots(static_cast<size_t>(entries));
    std::iota(slots.begin(), slots.end(), 0);
    std::shuffle(slots.begin(), slots.end(), rng);
    Buffer& s = c.add("cache_batch_idx", &c.args.cache_batch_idx, {B}, FA_INT32);
    for (int b = 0; b < B; ++b) set_int(s, b, slots[size_t(b)]);
  }
  Buffer& lengths = c.add("cache_seqlens", &c.args.cache_seqlens, {B}, FA_INT32);
  for (int b = 0; b < B; ++b) set_int(lengths, b, cached[size_t(b)]);
  if (leftpad) {
    Buffer& p = c.add("cache_leftpad", &c.args.cache_leftpad, {B}, FA_INT32);
    for (int b = 0; b < B; ++b) set_int(p, b, pad[size_t(b)]);
  }
  if (c.append) {
    fill_float(c.add("k_new", &c.args.k_new, {B, S_new, Hk, D}, c.dtype), c.dtype, rng, 1.0);
    fill_float(c.add("v_new", &c.args.v_new, {B, S_new, Hk, Dv}, c.dtype), c.dtype, rng, 1.0);
  }
  if (Dv == D && chance(rng, 0.3)) {
    // positions: past every row of the cache's table (paged: whole blocks; CUDA's rule, its lengths being in device
    // memory, asks that much), and some spare
    const int half = uniform(rng, 1, D / 2), positions = rows_per_entry * per_seq + Sq + uniform(rng, 0, 2);
    // cos and sin of angles, as a rotary table holds (any values would do; these keep |q|, |k| as they are)
    Buffer& cos = c.add("rotary_cos", &c.args.rotary_cos, {positions, half}, c.dtype);
    Buffer& sin = c.add("rotary_sin", &c.args.rotary_sin, {positions, half}, c.dtype);
    std::uniform_real_distribution<double> angle(0, 6.283185307179586);
    for (int64_t i = 0; i < int64_t(cos.storage) / size_of(c.dtype); ++i) {
      const double a = angle(rng);
      store_from_float(cos.data(), i, c.dtype, float(std::cos(a)));
      store_from_float(sin.data(), i, c.dtype, float(std::sin(a)));
    }
    c.args.rotary_interleaved = uniform(rng, 0, 1);
  }
  draw_options(c, rng, B, Hq, /*dropout=*/false);
  if (chance(rng, 0.3)) c.args.num_splits = uniform(rng, 1, 4);
  c.log += std::string(" rotary=") + (c.args.rotary_cos.data ? std::to_string(c.args.rotary_cos.shape[1] * 2) : "-") +
           " leftpad=" + std::to_string(leftpad) + " splits=" + std::to_string(c.args.num_splits);
  if (chance(rng, 0.25) && (!cuda || fa_cuda_device_count() > 0)) {  // a caller's workspace of the planned size
    fa_kvcache_plan plan{};
    fa_error error{};
    const fa_status planned = fa_plan_kvcache(&c.args, &c.options, &plan, &error);
    // CUDA may refuse a combination its kernels lack (FA_ERROR_UNSUPPORTED, as the call will); the CPU plans all
    if (cuda && planned == FA_ERROR_UNSUPPORTED) return;
    ASSERT_EQ(planned, FA_OK) << c.log << ": " << error.message;
    c.add("workspace", &c.args.workspace, {std::max<int64_t>(plan.workspace_bytes, 1)}, FA_UINT8);
    c.log += " workspace=" + std::to_string(plan.workspace_bytes);
  }
}

// A valid fa_kvcache_append call: n_b new rows (0 to 3) per sequence into a contiguous or paged cache (block sizes 1
// to 16, shuffled ids, spare blocks), float32 / float16 / bfloat16, FP8 caches; max_seqlen_new the largest count or
// more. CUDA: 16-bit rows, Dv = D, D % 16 == 0, the index tensors checked on the device (check_indices).
void make_append_call(Call& c, std::mt19937_64& rng, fa_backend backend) {
  start_call(c, Api::kAppend, backend, rng);
  const bool cuda = backend == FA_BACKEND_CUDA;
  c.on_device = cuda;
  c.append = true;
  const int B = uniform(rng, 1, 3), Hk = uniform(rng, 1, 2);
  const int D = cuda ? pick(rng, {32, 64, 80}) : pick(rng, {8, 16, 40, 64});
  const int Dv = cuda || chance(rng, 0.8) ? D : pick(rng, {8, 24});
  c.dtype = cuda ? pick(rng, {FA_FLOAT16, FA_BFLOAT16}) : pick(rng, {FA_FLOAT32, FA_FLOAT16, FA_BFLOAT16});
  c.fp8 = c.dtype != FA_FLOAT32 && chance(rng, 0.3);
  const fa_dtype cache_dtype = c.fp8 ? FA_FLOAT8_E4M3 : c.dtype;
  const bool paged = chance(rng, 0.5);
  const int capacity = uniform(rng, 3, 40);
  std::vector<int> counts(static_cast<size_t>(B)), cached(static_cast<size_t>(B));
  int total = 0, longest = 0;
  for (int b = 0; b < B; ++b) {
    counts[size_t(b)] = uniform(rng, 0, 3);
    cached[size_t(b)] = uniform(rng, 0, capacity - counts[size_t(b)]);
    total += counts[size_t(b)];
    longest = std::max(longest, counts[size_t(b)]);
  }
  c.app.max_seqlen_new = longest + (chance(rng, 0.2) ? uniform(rng, 1, 5) : 0);  // an upper bound
  c.app.check_indices = cuda ? 1 : 0;
  if (c.fp8) {
    c.app.k_scale = pick(rng, {0.05f, 0.25f, 1.f});
    c.app.v_scale = pick(rng, {0.03f, 0.5f});
  } else if (chance(rng, 0.2)) {
    c.app.k_scale = c.app.v_scale = 1.f;
  }
  c.log = "append B=" + std::to_string(B) + " Hk=" + std::to_string(Hk) + " D=" + std::to_string(D) + " Dv=" + std::to_string(Dv) +
          " " + dtype_name(c.dtype) + (c.fp8 ? " fp8-cache" : "") + " capacity=" + std::to_string(capacity) +
          " paged=" + std::to_string(paged) + " total_new=" + std::to_string(total);
  int rows_per_entry = capacity, entries = B, per_seq = 1;
  std::vector<int32_t> table_ids;
  if (paged) {
    PagedLayout l = draw_paged_layout(rng, B, capacity);
    rows_per_entry = l.rows_per_entry, per_seq = l.per_seq, entries = l.entries;
    table_ids = std::move(l.table_ids);
  }
  const double k_std = c.fp8 ? 1.0 / c.app.k_scale : 1.0, v_std = c.fp8 ? 1.0 / c.app.v_scale : 1.0;
  fill_float(c.add("k_cache", &c.app.k_cache, {entries, rows_per_entry, Hk, D}, cache_dtype), cache_dtype, rng, k_std);
  fill_float(c.add("v_cache", &c.app.v_cache, {entries, rows_per_entry, Hk, Dv}, cache_dtype), cache_dtype, rng, v_std);
  if (paged) {
    Buffer& t = c.add("block_table", &c.app.block_table, {B, per_seq}, FA_INT32);
    for (int i = 0; i < B * per_seq; ++i) set_int(t, i, table_ids[size_t(i)]);
  }
  Buffer& lengths = c.add("cache_seqlens", &c.app.cache_seqlens, {B}, FA_INT32);
  for (int b = 0; b < B; ++b) set_int(lengths, b, cached[size_t(b)]);
  Buffer& cu = c.add("cu_seqlens_new", &c.app.cu_seqlens_new, {B + 1}, FA_INT32);
  for (int b = 0, sum = 0; b <= B; sum += b < B ? counts[size_t(b)] : 0, ++b) set_int(cu, b, sum);
  fill_float(c.add("k_new", &c.app.k_new, {total, Hk, D}, c.dtype), c.dtype, rng, 1.0);
  fill_float(c.add("v_new", &c.app.v_new, {total, Hk, Dv}, c.dtype), c.dtype, rng, 1.0);
}

// Cumulative offsets of `lengths` as an int32 (B+1) tensor; returns the total.
int add_cu_seqlens(Call& c, const std::string& name, fa_tensor* field, const std::vector<int>& lengths) {
  Buffer& cu = c.add(name, field, {int64_t(lengths.size()) + 1}, FA_INT32);
  int total = 0;
  set_int(cu, 0, 0);
  for (size_t b = 0; b < lengths.size(); ++b) set_int(cu, int64_t(b) + 1, total += lengths[b]);
  return total;
}

// q, k, v (and out, lse, the index tensors) of a valid forward or backward problem: dense, variable-length,
// or (forward only) with k / v in a paged cache, with or without seqused_k (forward only).
struct Shapes {
  int B, Hq, Hk, D, Dv;
  bool varlen;
  std::vector<int64_t> q, k, v, out, lse;
};

Shapes draw_attention(Call& c, std::mt19937_64& rng, bool dense_only, fa_tensor& q, fa_tensor& k, fa_tensor& v, fa_tensor& cu_q,
                      fa_tensor& cu_k, int32_t& max_q, int32_t& max_k, fa_tensor* seqused_k, fa_tensor* block_table) {
  Shapes s{};
  s.B = uniform(rng, 1, 3);
  s.Hk = uniform(rng, 1, 2);
  s.Hq = s.Hk * pick(rng, {1, 2, 3});
  s.D = pick(rng, {8, 16, 40, 64});
  s.Dv = chance(rng, 0.8) ? s.D : pick(rng, {8, 24});
  // backward: float32 mostly, whose gradients this test compares (see run_one)
  c.dtype = c.api == Api::kBackward && chance(rng, 0.6) ? FA_FLOAT32 : pick(rng, {FA_FLOAT32, FA_FLOAT16, FA_BFLOAT16});
  s.varlen = !dense_only && chance(rng, 0.4);
  const bool paged = !dense_only && block_table != nullptr && chance(rng, 0.35);
  std::vector<int> lens_q(size_t(s.B)), lens_k(size_t(s.B));
  const int Sq = uniform(rng, 1, 6), Sk = uniform(rng, 1, 20);
  for (int b = 0; b < s.B; ++b) {
    lens_q[size_t(b)] = s.varlen ? uniform(rng, 0, 6) : Sq;
    lens_k[size_t(b)] = s.varlen ? uniform(rng, 0, 20) : Sk;
  }
  c.log = std::string(c.api == Api::kForward ? "forward" : "backward") + " B=" + std::to_string(s.B) + " Hq=" +
          std::to_string(s.Hq) + " Hk=" + std::to_string(s.Hk) + " D=" + std::to_string(s.D) + " Dv=" + std::to_string(s.Dv) +
          " " + dtype_name(c.dtype) + (s.varlen ? " varlen" : " dense") + (paged ? " paged" : "");
  if (s.varlen) {
    const int total_q = add_cu_seqlens(c, "cu_seqlens_q", &cu_q, lens_q);
    const int total_k = add_cu_seqlens(c, "cu_seqlens_k", &cu_k, lens_k);
    max_q = *std::max_element(lens_q.begin(), lens_q.end()) + (chance(rng, 0.3) ? uniform(rng, 1, 2) : 0);  // an upper bound
    max_k = *std::max_element(lens_k.begin(), lens_k.end());
    s.q = {total_q, s.Hq, s.D};
    s.out = {total_q, s.Hq, s.Dv};
    s.lse = {s.Hq, total_q};
    s.k = {total_k, s.Hk, s.D};
    s.v = {total_k, s.Hk, s.Dv};
  } else {
    s.q = {s.B, Sq, s.Hq, s.D};
    s.out = {s.B, Sq, s.Hq, s.Dv};
    s.lse = {s.B, s.Hq, Sq};
    s.k = {s.B, Sk, s.Hk, s.D};
    s.v = {s.B, Sk, s.Hk, s.Dv};
  }
  fill_float(c.add("q", &q, s.q, c.dtype), c.dtype, rng, 1.0);
  if (paged) {
    // The cache holds every sequence's keys in its blocks: with cu_seqlens_k (varlen) their lengths, else the
    // table's capacity (seqused_k may shorten that).
    const int block_size = pick(rng, {1, 3, 4, 16});
    const int most = s.varlen ? std::max(max_k, 1) : Sk;
    const int per_seq = (most + block_size - 1) / block_size;
    const int blocks = s.B * per_seq + uniform(rng, 0, 3);
    std::vector<int32_t> ids(static_cast<size_t>(blocks));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    Buffer& table = c.add("block_table", block_table, {s.B, per_seq}, FA_INT32);
    for (int i = 0; i < s.B * per_seq; ++i) set_int(table, i, ids[size_t(i)]);
    if (chance(rng, 0.3)) set_int(table, uniform(rng, 0, s.B * per_seq - 1), ids[0]);  // a block read by two sequences
    s.k = {blocks, block_size, s.Hk, s.D};
    s.v = {blocks, block_size, s.Hk, s.Dv};
    if (!s.varlen)
      for (int b = 0; b < s.B; ++b) lens_k[size_t(b)] = per_seq * block_size;
    c.log += " block_size=" + std::to_string(block_size);
  }
  fill_float(c.add("k", &k, s.k, c.dtype), c.dtype, rng, 1.0);
  fill_float(c.add("v", &v, s.v, c.dtype), c.dtype, rng, 1.0);
  if (!dense_only && seqused_k != nullptr && chance(rng, 0.3)) {
    Buffer& used = c.add("seqused_k", seqused_k, {s.B}, FA_INT32);
    for (int b = 0; b < s.B; ++b) set_int(used, b, uniform(rng, 0, lens_k[size_t(b)]));
    c.log += " seqused_k";
  }
  return s;
}

void make_forward_call(Call& c, std::mt19937_64& rng, fa_backend backend) {
  start_call(c, Api::kForward, backend, rng);
  fa_forward_args& a = c.fwd;
  // cpu_standard takes the dense layout only (else FA_ERROR_UNSUPPORTED: not what this test draws calls for)
  const Shapes s = draw_attention(c, rng, backend == FA_BACKEND_CPU_STANDARD, a.q, a.k, a.v, a.cu_seqlens_q, a.cu_seqlens_k,
                                  a.max_seqlen_q, a.max_seqlen_k, &a.seqused_k, &a.block_table);
  c.add("out", &a.out, s.out, c.dtype);
  if (chance(rng, 0.7)) c.add("lse", &a.lse, s.lse, FA_FLOAT32);
  draw_options(c, rng, s.B, s.Hq, /*dropout=*/true);
}

// out and lse of a backward call from the reference forward of the same q, k, v, lengths and options.
fa_status forward_for_backward(Call& c, fa_error* error) {
  const fa_backward_args& a = c.bwd;
  fa_forward_args f{};
  f.q = a.q, f.k = a.k, f.v = a.v, f.out = a.out, f.lse = a.lse;
  f.cu_seqlens_q = a.cu_seqlens_q, f.cu_seqlens_k = a.cu_seqlens_k, f.max_seqlen_q = a.max_seqlen_q, f.max_seqlen_k = a.max_seqlen_k;
  fa_options reference = c.options;
  reference.backend = FA_BACKEND_CPU_REFERENCE;
  return fa_forward(&f, &reference, error);
}

// A backward problem whose out and lse are the reference forward's (an lse drawn at random would overflow
// the recomputed probabilities, and the backends may compute rowsum(dP * P) as rowsum(dout * out), which
// holds only for the forward's out).
void make_backward_call(Call& c, std::mt19937_64& rng, fa_backend backend) {
  start_call(c, Api::kBackward, backend, rng);
  c.options.deterministic = uniform(rng, 0, 1);
  fa_backward_args& a = c.bwd;
  const Shapes s = draw_attention(c, rng, false, a.q, a.k, a.v, a.cu_seqlens_q, a.cu_seqlens_k, a.max_seqlen_q,
                                  a.max_seqlen_k, nullptr, nullptr);
  c.add("out", &a.out, s.out, c.dtype);
  c.add("lse", &a.lse, s.lse, FA_FLOAT32);
  fill_float(c.add("dout", &a.dout, s.out, c.dtype), c.dtype, rng, 1.0);
  c.add("dq", &a.dq, s.q, c.dtype);
  c.add("dk", &a.dk, s.k, c.dtype);
  c.add("dv", &a.dv, s.v, c.dtype);
  draw_options(c, rng, s.B, s.Hq, /*dropout=*/true);
  fa_error error{};
  ASSERT_EQ(forward_for_backward(c, &error), FA_OK) << c.log << ": " << error.message;
  if (chance(rng, 0.25)) {  // a caller's workspace of the reported size
    int64_t bytes = 0;
    ASSERT_EQ(fa_backward_workspace_size(&a, &c.options, &bytes, &error), FA_OK) << c.log << ": " << error.message;
    c.add("workspace", &a.workspace, {std::max<int64_t>(bytes, 1)}, FA_UINT8);
    c.log += " workspace=" + std::to_string(bytes);
  }
}

// Breaks (or, by chance, keeps valid) one thing of the call, and says what in the log.
void mutate(Call& c, std::mt19937_64& rng) {
  const int kind = uniform(rng, 0, 9);
  Buffer& b = c.buffers[size_t(uniform(rng, 0, int(c.buffers.size()) - 1))];
  fa_tensor& t = *b.view;
  const bool index = raw(t.dtype) == FA_INT32;
  std::string what;
  switch (kind) {
    case 0: {  // rank
      const int v = pick(rng, {-1, 0, int(t.ndim) - 1, int(t.ndim) + 1, 5, 1 << 20});
      what = b.name + ".ndim=" + std::to_string(v);
      t.ndim = v;
      break;
    }
    case 1: case 2: {  // an extent
      if (t.ndim < 1 || t.ndim > FA_MAX_DIMS) return mutate(c, rng);
      const int d = uniform(rng, 0, t.ndim - 1);
      const int64_t s = std::clamp<int64_t>(t.shape[d], -1, int64_t(1) << 40);  // an earlier break may have left any value
      const int64_t v = pick<int64_t>(rng, {-1, 0, 1, s - 1, s + 1, 2 * s, int64_t(1) << 31, std::numeric_limits<int64_t>::max()});
      what = b.name + ".shape[" + std::to_string(d) + "]=" + std::to_string(v);
      t.shape[d] = v;
      break;
    }
    case 3: {  // a stride
      if (t.ndim < 1 || t.ndim > FA_MAX_DIMS) return mutate(c, rng);
      const int d = uniform(rng, 0, t.ndim - 1);
      const int64_t s = std::clamp<int64_t>(t.strides[d], -1, int64_t(1) << 40);
      const int64_t v = d == t.ndim - 1 ? pick<int64_t>(rng, {-1, 0, 2, 3})
                                        : pick<int64_t>(rng, {-1, 0, s + 1, 2 * s, s > 1 ? s - 1 : 1, int64_t(1) << 40});
      what = b.name + ".strides[" + std::to_string(d) + "]=" + std::to_string(v);
      t.strides[d] = v;
      break;
    }
    case 4: {  // dtype, stored raw as a C caller can
      const int v = pick(rng, {-1, 0, 1, 2, 3, 4, 5, 6, 1000});
      what = b.name + ".dtype=" + std::to_string(v);
      std::memcpy(&t.dtype, &v, sizeof(int));
      break;
    }
    case 5: {  // device: never CUDA (host pointers on a GPU machine would be the caller's fault); a bad kind or ordinal
      if (chance(rng, 0.5)) {
        const int v = pick(rng, {-1, 2, 77});
        what = b.name + ".device=" + std::to_string(v);
        std::memcpy(&t.device, &v, sizeof(int));
      } else {
        t.device_id = pick(rng, {-1, 1, 99});
        what = b.name + ".device_id=" + std::to_string(t.device_id);
      }
      break;
    }
    case 6: {  // absent (optional: a different valid call; required: an error)
      what = b.name + " absent";
      t.data = nullptr;
      break;
    }
    case 7: {  // an entry of an index tensor (float data is left alone: NaN inputs are NonFinite's subject)
      if (!index || t.data == nullptr) return mutate(c, rng);
      const int64_t n = std::clamp<int64_t>(reach_bytes(t) / 4, 1, int64_t(b.storage) / 4);
      const int64_t i = uniform(rng, 0, int(n) - 1);
      // With an append, a block id may only turn invalid: a valid id of another sequence's block would make two
      // sequences write one row (a race the caller made; see flashattn.h).
      const int32_t v = (c.api == Api::kKvcache || c.api == Api::kAppend) && c.append && b.name == "block_table"
                            ? pick(rng, {-1, std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max(), 1 << 20})
                            : pick(rng, {-1, 0, 1, 2, 5, 39, 40, 41, 1 << 20, std::numeric_limits<int32_t>::min(),
                                         std::numeric_limits<int32_t>::max()});
      const int32_t old = get_int(t, i);
      std::memcpy(static_cast<uint8_t*>(t.data) + 4 * i, &v, 4);
      what = b.name + " element " + std::to_string(i) + ": " + std::to_string(old) + " -> " + std::to_string(v);
      break;
    }
    case 8: {  // an option
      switch (uniform(rng, 0, 8)) {
        case 0: c.options.softmax_scale = pick(rng, {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(), -1.f, 0.5f}); what = "softmax_scale=" + std::to_string(c.options.softmax_scale); break;
        case 1: c.options.causal = pick(rng, {-1, 2, 0, 1}); what = "causal=" + std::to_string(c.options.causal); break;
        case 2: c.options.window_left = pick(rng, {-2, -1, 0, 1, std::numeric_limits<int32_t>::max(), std::numeric_limits<int32_t>::min()}); what = "window_left=" + std::to_string(c.options.window_left); break;
        case 3: c.options.window_right = pick(rng, {-2, -1, 0, 1, std::numeric_limits<int32_t>::max()}); what = "window_right=" + std::to_string(c.options.window_right); break;
        case 4: c.options.softcap = pick(rng, {-1.f, std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(), 1e-30f}); what = "softcap=" + std::to_string(c.options.softcap); break;
        case 5: c.options.dropout_p = pick(rng, {-0.1f, 1.f, std::numeric_limits<float>::quiet_NaN(), 0.3f}); what = "dropout_p=" + std::to_string(c.options.dropout_p); break;
        case 6: c.options.num_threads = pick(rng, {-1, 0, 3, 64}); what = "num_threads=" + std::to_string(c.options.num_threads); break;
        case 7: { const int v = pick(rng, {-1, 1, 2, 3, 4, 9}); std::memcpy(&c.options.backend, &v, sizeof(int)); what = "backend=" + std::to_string(v); break; }
        default: c.options.abi_version = pick(rng, {0, FA_ABI_VERSION + 1, -1}); what = "abi_version=" + std::to_string(c.options.abi_version); break;
      }
      break;
    }
    default: {  // a scalar argument
      if (c.api == Api::kAppend) {
        switch (uniform(rng, 0, 2)) {
          case 0: c.app.max_seqlen_new = pick(rng, {-1, 0, 1, 2, 1 << 20, std::numeric_limits<int32_t>::max()}); what = "max_seqlen_new=" + std::to_string(c.app.max_seqlen_new); break;
          case 1: c.app.k_scale = pick(rng, {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(), -1.f, 0.f, 1.f, 2.f}); what = "k_scale=" + std::to_string(c.app.k_scale); break;
          default: c.app.v_scale = pick(rng, {std::numeric_limits<float>::quiet_NaN(), -0.f, 1.f, 1e-3f}); what = "v_scale=" + std::to_string(c.app.v_scale); break;
        }
        break;
      }
      if (c.api != Api::kKvcache) {
        int32_t& max_q = c.api == Api::kForward ? c.fwd.max_seqlen_q : c.bwd.max_seqlen_q;
        int32_t& max_k = c.api == Api::kForward ? c.fwd.max_seqlen_k : c.bwd.max_seqlen_k;
        int32_t& field = chance(rng, 0.5) ? max_q : max_k;
        const int32_t old = field;
        const int32_t near = std::clamp(old, 1, (1 << 20) - 1);  // an earlier break may have left any value
        field = pick(rng, {-1, 0, near - 1, near + 1, 1 << 20, std::numeric_limits<int32_t>::max()});
        what = std::string(&field == &max_q ? "max_seqlen_q" : "max_seqlen_k") + "=" + std::to_string(field);
        break;
      }
      switch (uniform(rng, 0, 3)) {
        case 0: c.args.num_splits = pick(rng, {-1, 0, 1, 7, 1000, std::numeric_limits<int32_t>::max()}); what = "num_splits=" + std::to_string(c.args.num_splits); break;
        case 1: c.args.k_scale = pick(rng, {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(), -1.f, 0.f, 1.f, 2.f}); what = "k_scale=" + std::to_string(c.args.k_scale); break;
        case 2: c.args.v_scale = pick(rng, {std::numeric_limits<float>::quiet_NaN(), -0.f, 1.f, 1e-3f}); what = "v_scale=" + std::to_string(c.args.v_scale); break;
        default: c.args.rotary_interleaved = pick(rng, {-1, 7, 0, 1}); what = "rotary_interleaved=" + std::to_string(c.args.rotary_interleaved); break;
      }
      break;
    }
  }
  c.log += "; broken: " + what;
}

using Snapshot = std::vector<std::vector<uint8_t>>;
Snapshot snapshot(const Call& c) {
  Snapshot s;
  for (const Buffer& b : c.buffers) s.push_back(b.bytes);
  return s;
}
void restore(Call& c, const Snapshot& s) {  // in place: the views' data pointers stay valid
  for (size_t i = 0; i < s.size(); ++i) std::copy(s[i].begin(), s[i].end(), c.buffers[i].bytes.begin());
}

// The rows an accepted fa_kvcache_append call writes, as (cache entry, row in it), sequence by sequence: rows
// cache_seqlens[b] .. + n_b - 1 (n_b from cu_seqlens_new), through block_table when paged.
std::vector<std::pair<int64_t, int64_t>> appended_rows(const Call& c) {
  const fa_kvcache_append_args& a = c.app;
  std::vector<std::pair<int64_t, int64_t>> rows;
  const int64_t B = a.cu_seqlens_new.shape[0] - 1, rows_per_entry = a.k_cache.shape[1];
  for (int64_t s = 0; s < B; ++s) {
    const int64_t n = get_int(a.cu_seqlens_new, (s + 1) * a.cu_seqlens_new.strides[0]) - get_int(a.cu_seqlens_new, s * a.cu_seqlens_new.strides[0]);
    const int64_t first = get_int(a.cache_seqlens, s * a.cache_seqlens.strides[0]);
    for (int64_t row = first; row < first + n; ++row) {
      if (a.block_table.data == nullptr) {
        rows.emplace_back(s, row);
      } else {
        const int64_t id = get_int(a.block_table, s * a.block_table.strides[0] + (row / rows_per_entry) * a.block_table.strides[1]);
        rows.emplace_back(id, row % rows_per_entry);
      }
    }
  }
  return rows;
}

// The bytes a successful call may write, per buffer: its outputs wholly (every element of their views;
// Call::is_output), the caches only at the appended rows [cache_seqlens[b], + S_new) of each sequence.
std::vector<std::vector<bool>> writable(Call& c) {
  std::vector<std::vector<bool>> w;
  auto mark = [](std::vector<bool>& m, int64_t byte, int64_t n) {
    for (int64_t i = 0; i < n; ++i) m[size_t(kGuardBytes + byte + i)] = true;
  };
  const fa_kvcache_args& a = c.args;
  for (Buffer& b : c.buffers) {
    std::vector<bool> m(b.bytes.size(), false);
    const fa_tensor& t = *b.view;
    const int64_t elem = size_of(raw(t.dtype));
    const bool cache = (c.api == Api::kKvcache || c.api == Api::kAppend) && (b.name == "k_cache" || b.name == "v_cache");
    if (t.data == nullptr || !b.written) {
      // absent, or an input: nothing may be written
    } else if (!cache) {
      for (int64_t o : element_offsets(t)) mark(m, o * elem, elem);
    } else if (c.api == Api::kAppend) {
      for (const auto& [entry, in_entry] : appended_rows(c))
        for (int64_t h = 0; h < t.shape[2]; ++h)
          for (int64_t d = 0; d < t.shape[3]; ++d)
            mark(m, (entry * t.strides[0] + in_entry * t.strides[1] + h * t.strides[2] + d * t.strides[3]) * elem, elem);
    } else if (a.k_new.data != nullptr) {
      const int64_t B = a.q.shape[0], S_new = a.k_new.shape[1];
      for (int64_t s = 0; s < B; ++s)
        for (int64_t j = 0; j < S_new; ++j) {
          const int64_t row = get_int(a.cache_seqlens, s * a.cache_seqlens.strides[0]) + j;
          int64_t entry = s, in_entry = row;
          if (a.block_table.data != nullptr) {
            entry = get_int(a.block_table, s * a.block_table.strides[0] + (row / t.shape[1]) * a.block_table.strides[1]);
            in_entry = row % t.shape[1];
          } else if (a.cache_batch_idx.data != nullptr) {
            entry = get_int(a.cache_batch_idx, s * a.cache_batch_idx.strides[0]);
          }
          for (int64_t h = 0; h < t.shape[2]; ++h)
            for (int64_t d = 0; d < t.shape[3]; ++d)
              mark(m, (entry * t.strides[0] + in_entry * t.strides[1] + h * t.strides[2] + d * t.strides[3]) * elem, elem);
        }
    }
    w.push_back(std::move(m));
  }
  return w;
}

// Whether an accepted KV-cache call appends a row that another sequence reads or writes (a block table
// whose rows a broken stride or slack entries make share blocks): a race the caller made (flashattn.h,
// block_table), in which the backends may order the writes and reads differently.
bool appends_race(const Call& c) {
  if (c.api == Api::kAppend) {  // two sequences writing one row (an append has no reads)
    std::vector<std::pair<int64_t, int64_t>> rows = appended_rows(c);
    std::sort(rows.begin(), rows.end());
    return std::adjacent_find(rows.begin(), rows.end()) != rows.end();
  }
  const fa_kvcache_args& a = c.args;
  if (c.api != Api::kKvcache || a.k_new.data == nullptr) return false;
  const int64_t rows_per_entry = a.k_cache.shape[1];
  auto cache_row = [&](int64_t s, int64_t row) {  // (entry, row in it) as one number
    if (a.block_table.data != nullptr)
      return int64_t(get_int(a.block_table, s * a.block_table.strides[0] + (row / rows_per_entry) * a.block_table.strides[1])) *
                 rows_per_entry + row % rows_per_entry;
    const int64_t entry = a.cache_batch_idx.data != nullptr ? get_int(a.cache_batch_idx, s * a.cache_batch_idx.strides[0]) : s;
    return entry * rows_per_entry + row;
  };
  const int64_t B = a.q.shape[0], S_new = a.k_new.shape[1];
  auto length = [&](int64_t s) { return int64_t(get_int(a.cache_seqlens, s * a.cache_seqlens.strides[0])); };
  auto first = [&](int64_t s) {
    return a.cache_leftpad.data != nullptr ? int64_t(get_int(a.cache_leftpad, s * a.cache_leftpad.strides[0])) : int64_t(0);
  };
  std::vector<std::pair<int64_t, int64_t>> appended;  // (cache row, sequence)
  for (int64_t s = 0; s < B; ++s)
    for (int64_t j = 0; j < S_new; ++j) appended.emplace_back(cache_row(s, length(s) + j), s);
  std::sort(appended.begin(), appended.end());
  for (int64_t s = 0; s < B; ++s)
    for (int64_t row = first(s); row < length(s) + S_new; ++row) {
      const int64_t r = cache_row(s, row);
      auto it = std::lower_bound(appended.begin(), appended.end(), std::make_pair(r, std::numeric_limits<int64_t>::min()));
      for (; it != appended.end() && it->first == r; ++it)
        if (it->second != s) return true;
    }
  return false;
}

// Elements of a view as doubles (floating dtypes; e4m3 as its code's value).
std::vector<double> values(const fa_tensor& t) {
  std::vector<double> v;
  for (int64_t o : element_offsets(t)) v.push_back(load_as_float(t.data, o, t.dtype));
  return v;
}

bool same_class(double a, double b) {  // both finite, or the same infinity, or both NaN
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  if (std::isinf(a) || std::isinf(b)) return a == b;
  return true;
}

// The tolerance of one element of an output rounded to `t`, computed in float32 (the backend under test)
// against float64 (the reference): both round about the same exact value, so they may differ by one unit in
// the last place of `t`, plus float32's accumulation error relative to the tensor's largest value `scale`
// (gradients sum over many rows).
// float32 gradients sum terms that may cancel (a row of one key has gradient 0 in exact arithmetic), so
// their absolute part is relative to the terms, larger than the result's. (Gradients of 16-bit inputs:
// see run_one.)
double tolerance(fa_dtype t, double reference, double scale, bool gradient) {
  const double ulp = t == FA_BFLOAT16 ? 1.0 / 128 : t == FA_FLOAT16 ? 1.0 / 1024 : 1.0 / (1 << 23);
  return 2 * ulp * std::abs(reference) + (t == FA_FLOAT32 ? (gradient ? 2e-4 : 2e-5) : 2e-3) * std::max(1.0, scale);
}
double rel_l2_bound(fa_dtype t) { return t == FA_BFLOAT16 ? 1e-2 : t == FA_FLOAT16 ? 2e-3 : 1e-5; }


// The outputs compared against the reference backend, by buffer name.
std::vector<std::string> compared_outputs(const Call& c) {
  switch (c.api) {
    case Api::kKvcache: return {"out", "lse", "k_cache", "v_cache"};
    case Api::kAppend: return {"k_cache", "v_cache"};
    case Api::kForward: return {"out", "lse"};
    case Api::kBackward: return {"dq", "dk", "dv"};
  }
  return {};
}

struct Counts {
  int accepted = 0, rejected = 0, skipped = 0, raced = 0;
};

void run_one(std::mt19937_64& rng, Api api, fa_backend backend, int breaks, Counts* counts, const std::string& seed_note) {
  Call c;
  switch (api) {
    case Api::kKvcache: make_kvcache_call(c, rng, backend); break;
    case Api::kAppend: make_append_call(c, rng, backend); break;
    case Api::kForward: make_forward_call(c, rng, backend); break;
    case Api::kBackward: make_backward_call(c, rng, backend); break;
  }
  if (::testing::Test::HasFatalFailure()) return;
  for (int i = 0; i < breaks; ++i) mutate(c, rng);
  if ((c.on_device || raw(c.options.backend) == FA_BACKEND_CUDA) && fa_cuda_device_count() == 0) {
    // Without a GPU the CUDA backend fails before it looks at the tensors: a different error each place. Not this
    // test's subject (Validation.CudaTensorsWithoutUsableGpu is). (With one, a CPU call given the CUDA backend must
    // refuse its host tensors, and a CUDA call given a CPU backend its device ones, before reading them.)
    ++counts->skipped;
    return;
  }
  for (Buffer& b : c.buffers) {
    if (b.view->data == nullptr) continue;
    const int64_t reach = reach_bytes(*b.view);
    const bool cache = c.api == Api::kKvcache && (b.name == "k_cache" || b.name == "v_cache");
    // (a backward's out and lse are written too, by its forward in this test)
    const bool writes = (b.written && (!cache || c.args.k_new.data != nullptr)) ||
                        (c.api == Api::kBackward && (b.name == "out" || b.name == "lse"));
    if (reach > int64_t(b.storage) || (reach > 0 && writes && overlaps_itself(*b.view)) || (reach > 0 && numel_of(*b.view) > (1 << 22))) {
      // the caller's fault: a view past its storage, an output whose elements share bytes; or a view of a stride 0
      // over millions of elements, whose elements this test would list
      ++counts->skipped;
      return;
    }
  }
  fa_error error{};
  bool forward_refused = false;
  if (c.api == Api::kBackward && breaks > 0) {
    // The broken call's own forward, so that out and lse stay the forward's of what the backward is given.
    forward_refused = forward_for_backward(c, &error) != FA_OK;
  }
  const Snapshot before = snapshot(c);
  const fa_status status = c.on_device ? invoke_on_device(c, c.options, &error) : invoke(c, c.options, &error);
  if (::testing::Test::HasFatalFailure()) return;
  const std::string where = c.log + " [" + seed_note + "]";
  if (status != FA_OK) {
    ++counts->rejected;
    EXPECT_TRUE(status == FA_ERROR_INVALID_ARGUMENT || status == FA_ERROR_UNSUPPORTED)
        << where << ": status " << fa_status_name(status) << ": " << error.message;
    const std::string message = error.message;
    EXPECT_TRUE(status != FA_ERROR_INVALID_ARGUMENT || message.find(": ") != std::string::npos)
        << where << ": the message names no argument: \"" << message << "\"";
    EXPECT_FALSE(message.empty()) << where;
    for (size_t i = 0; i < c.buffers.size(); ++i)
      ASSERT_TRUE(c.buffers[i].bytes == before[i]) << where << ": rejected (" << message << ") but " << c.buffers[i].name << " changed";
    return;
  }
  ++counts->accepted;
  ASSERT_FALSE(forward_refused) << where << ": the backward ran where its forward is refused";
  // Only the outputs changed, and only where they may.
  const std::vector<std::vector<bool>> may_write = writable(c);
  for (size_t i = 0; i < c.buffers.size(); ++i) {
    const std::vector<uint8_t>& now = c.buffers[i].bytes;
    for (size_t k = 0; k < now.size(); ++k)
      ASSERT_TRUE(now[k] == before[i][k] || may_write[i][k])
          << where << ": " << c.buffers[i].name << " byte " << int64_t(k) - int64_t(kGuardBytes) << " changed outside the call's outputs";
  }
  if (appends_race(c)) {
    ++counts->raced;
    return;
  }
  // The same call on the float64 reference backend: the same outputs, within the rounding of their dtype.
  std::vector<const Buffer*> outputs;
  std::vector<std::vector<double>> got;
  for (const std::string& name : compared_outputs(c))
    for (const Buffer& b : c.buffers)
      if (b.name == name && b.view->data != nullptr) {
        outputs.push_back(&b);
        got.push_back(values(*b.view));
        if (name == "out") {  // a convex combination of v's rows (or 0); gradients may overflow, as the reference's do
          for (double x : got.back()) ASSERT_TRUE(std::isfinite(x)) << where << ": " << name << " holds " << x << " for finite inputs";
        }
      }
  if (raw(c.options.backend) == FA_BACKEND_CPU_REFERENCE) return;
  restore(c, before);
  if (c.on_device)  // the same call on the host: every view of the accepted call was on the one GPU
    for (Buffer& b : c.buffers) b.view->device = FA_DEVICE_CPU;
  fa_options reference = c.options;
  reference.backend = FA_BACKEND_CPU_REFERENCE;
  ASSERT_EQ(invoke(c, reference, &error), FA_OK) << where << ": the reference backend refuses what the backend under test ran: "
                                                 << error.message;
  std::vector<std::vector<double>> refs;
  for (const Buffer* b : outputs) refs.push_back(values(*b->view));
  for (size_t n = 0; n < outputs.size(); ++n) {
    const std::string& name = outputs[n]->name;
    const std::vector<double>& ref = refs[n];
    if (name == "k_cache" || name == "v_cache") {
      // The appended rows: both backends round the same float32 value (after rotary) to the cache's dtype.
      ASSERT_TRUE(got[n] == ref) << where << ": the appended " << name << " rows differ from the reference backend's";
    } else if (c.on_device) {
      // CUDA against the float64 reference: finite, infinite or NaN alike, element by element. Its kernels round the
      // rotated q and the probabilities to the 16-bit dtype for the tensor cores, so their error is bounded by the
      // naive same-precision computation's, not by one rounding of the result: how close they come is the subject
      // of test_cuda_kvcache.cpp (the test policy's rule against the float64 oracle); this test's is the contract.
      for (size_t i = 0; i < ref.size(); ++i)
        ASSERT_TRUE(same_class(got[n][i], ref[i])) << where << ": " << name << " element " << i << " = " << got[n][i]
                                                   << ", reference " << ref[i];
    } else if (name == "lse") {
      for (size_t i = 0; i < ref.size(); ++i) {
        ASSERT_TRUE(same_class(got[n][i], ref[i])) << where << ": lse element " << i << " = " << got[n][i] << ", reference " << ref[i];
        if (std::isfinite(ref[i])) {
          ASSERT_LE(std::abs(got[n][i] - ref[i]), 1e-4 * (1 + std::abs(ref[i]))) << where << ": lse element " << i;
        }
      }
    } else if (c.api == Api::kBackward && outputs[n]->view->dtype != FA_FLOAT32) {
      // Gradients of 16-bit inputs: only where each is finite. The backends round intermediates to the inputs'
      // dtype and compute rowsum(dP * P) as rowsum(dout * out) with the stored (rounded) out, as FlashAttention
      // does, so their error is relative to the terms of a sum that may cancel to 0, not to the gradient; how
      // accurate they are is the subject of test_cpu_flash.cpp (the test policy's rule, against unrounded
      // float64 gradients). The masks, rows and tiles of the backward are dtype-independent code, which the
      // float32 calls check (most backward calls draw float32).
      for (size_t i = 0; i < ref.size(); ++i)
        ASSERT_TRUE(same_class(got[n][i], ref[i])) << where << ": " << name << " element " << i << " = " << got[n][i]
                                                   << ", reference " << ref[i];
    } else {
      double scale = 0, error2 = 0, norm2 = 0;
      for (double x : ref)
        if (std::isfinite(x)) scale = std::max(scale, std::abs(x));
      const fa_dtype t = outputs[n]->view->dtype;
      const bool gradient = c.api == Api::kBackward;
      for (size_t i = 0; i < ref.size(); ++i) {
        ASSERT_TRUE(same_class(got[n][i], ref[i])) << where << ": " << name << " element " << i << " = " << got[n][i]
                                                   << ", reference " << ref[i];
        if (!std::isfinite(ref[i])) continue;
        ASSERT_LE(std::abs(got[n][i] - ref[i]), tolerance(t, ref[i], scale, gradient))
            << where << ": " << name << " element " << i << " = " << got[n][i] << ", reference " << ref[i];
        error2 += (got[n][i] - ref[i]) * (got[n][i] - ref[i]);
        norm2 += ref[i] * ref[i];
      }
      // (the elements' absolute part adds up too: a gradient that is 0 in exact arithmetic, as with one key per row,
      // is a difference of rounded terms)
      const double floor = tolerance(t, 0.0, scale, gradient) * std::sqrt(double(ref.size()));
      ASSERT_LE(std::sqrt(error2), rel_l2_bound(t) * std::sqrt(norm2) + floor) << where << ": " << name << "'s relative L2 error";
    }
  }
}

void run_many(const char* salt, Api api, fa_backend backend, int calls) {
  auto rng = fa_test::make_rng(salt);
  const uint64_t first = rng();
  Counts counts;
  for (int n = 0; n < calls && !::testing::Test::HasFatalFailure(); ++n) {
    // Each call's own generator, so that a failure names a call that can be replayed alone.
    std::mt19937_64 call_rng(first + uint64_t(n));
    const int breaks = n % 4 == 0 ? 0 : n % 4 == 3 ? 2 : 1;
    run_one(call_rng, api, backend, breaks, &counts, std::string(salt) + " call " + std::to_string(n));
  }
  std::printf("[random calls] %s: %d accepted (%d of them not compared: appends that race), %d rejected, %d not made (a view "
              "past its storage, an output that overlaps itself)\n",
              salt, counts.accepted, counts.raced, counts.rejected, counts.skipped);
  // The generator must keep reaching both outcomes: else this test would check nothing.
  EXPECT_GE(counts.accepted, calls / 4);
  EXPECT_GE(counts.rejected, calls / 4);
}

TEST(RandomCalls, KvcacheOnTheCpuFlashBackend) { run_many("random-kvcache-cpu-flash", Api::kKvcache, FA_BACKEND_CPU_FLASH, 3000); }
TEST(RandomCalls, KvcacheThroughAuto) { run_many("random-kvcache-auto", Api::kKvcache, FA_BACKEND_AUTO, 1000); }
// The generator's CUDA calls of `api`, before any break, pass the validation (no GPU needed: the views are labelled
// CUDA and never dereferenced), so that the GPU tests below start from valid calls.
void expect_cuda_calls_valid(const char* salt, Api api) {
  auto rng = fa_test::make_rng(salt);
  for (int n = 0; n < 500 && !::testing::Test::HasFatalFailure(); ++n) {
    Call c;
    Status s;
    if (api == Api::kKvcache) {
      make_kvcache_call(c, rng, FA_BACKEND_CUDA);
      KvcacheParams p;
      s = api::make_kvcache_params(c.args, c.options, &p);
    } else {
      make_append_call(c, rng, FA_BACKEND_CUDA);
      KvcacheAppendParams p;
      s = api::make_kvcache_append_params(c.app, c.options, &p);
    }
    ASSERT_TRUE(s.ok()) << c.log << ": " << s.to_string();
  }
}
TEST(RandomCalls, CudaCallsAreValidBeforeTheyAreBroken) { expect_cuda_calls_valid("random-kvcache-cuda-valid", Api::kKvcache); }

// The CUDA backend's calls with their buffers in device memory (invoke_on_device), the index tensors checked there.
TEST(RandomCalls, KvcacheOnTheCudaBackend) {
  SKIP_WITHOUT_GPU();
  run_many("random-kvcache-cuda", Api::kKvcache, FA_BACKEND_CUDA, 1500);
}
TEST(RandomCalls, AppendOnTheCpuFlashBackend) { run_many("random-append-cpu-flash", Api::kAppend, FA_BACKEND_CPU_FLASH, 2000); }
TEST(RandomCalls, AppendThroughAuto) { run_many("random-append-auto", Api::kAppend, FA_BACKEND_AUTO, 500); }
TEST(RandomCalls, CudaAppendCallsAreValidBeforeTheyAreBroken) { expect_cuda_calls_valid("random-append-cuda-valid", Api::kAppend); }
TEST(RandomCalls, AppendOnTheCudaBackend) {
  SKIP_WITHOUT_GPU();
  run_many("random-append-cuda", Api::kAppend, FA_BACKEND_CUDA, 1000);
}
TEST(RandomCalls, ForwardOnTheCpuFlashBackend) { run_many("random-forward-cpu-flash", Api::kForward, FA_BACKEND_CPU_FLASH, 3000); }
TEST(RandomCalls, ForwardOnTheCpuStandardBackend) { run_many("random-forward-cpu-standard", Api::kForward, FA_BACKEND_CPU_STANDARD, 1000); }
TEST(RandomCalls, BackwardOnTheCpuFlashBackend) { run_many("random-backward-cpu-flash", Api::kBackward, FA_BACKEND_CPU_FLASH, 2000); }
TEST(RandomCalls, BackwardThroughAuto) { run_many("random-backward-auto", Api::kBackward, FA_BACKEND_AUTO, 500); }

}  // namespace
}  // namespace flashattn
