#include "testing.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <thread>
#include <utility>

#include "api/validate.hpp"
#include "core/dtype.hpp"
#include "cpu/reference/reference.hpp"

namespace fa_test {

using flashattn::dtype_size;

namespace {
std::vector<int64_t> row_major_strides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> strides(shape.size(), 1);
  for (int d = int(shape.size()) - 2; d >= 0; --d) strides[d] = strides[d + 1] * std::max<int64_t>(shape[d + 1], 1);
  return strides;
}

// Whether every logical element of (shape, strides) has its own storage slot: ordered by stride, each dimension of
// extent > 1 steps past the whole span of the ones below it.
bool offsets_are_distinct(const std::vector<int64_t>& shape, const std::vector<int64_t>& strides) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, extent)
  for (size_t d = 0; d < shape.size(); ++d)
    if (shape[d] > 1) dims.emplace_back(strides[d], shape[d]);
  std::sort(dims.begin(), dims.end());
  int64_t span = 1;  // storage slots covered by the dimensions so far
  for (const auto& [stride, extent] : dims) {
    if (stride < span) return false;
    span = stride * extent;
  }
  return true;
}

// Elements per chunk of the parallel fills and conversions below.
constexpr int64_t kChunk = int64_t(1) << 20;
}  // namespace

HostTensor::HostTensor(std::vector<int64_t> shape, fa_dtype dtype) : shape_(std::move(shape)), dtype_(dtype) {
  strides_ = row_major_strides(shape_);
  row_major_ = true;
  storage_.assign(size_t(std::max<int64_t>(numel(), 1) * dtype_size(dtype_)), 0);
}

HostTensor::HostTensor(std::vector<int64_t> shape, std::vector<int64_t> strides, fa_dtype dtype)
    : shape_(std::move(shape)), strides_(std::move(strides)), dtype_(dtype) {
  row_major_ = strides_ == row_major_strides(shape_);
  distinct_offsets_ = offsets_are_distinct(shape_, strides_);
  int64_t extent = 1;
  for (size_t d = 0; d < shape_.size(); ++d)
    if (shape_[d] > 0) extent += (shape_[d] - 1) * strides_[d];
  storage_.assign(size_t(extent * dtype_size(dtype_)), 0);
}

int64_t HostTensor::numel() const {
  int64_t n = 1;
  for (int64_t s : shape_) n *= s;
  return n;
}

fa_tensor HostTensor::view() { return view_on(storage_.data(), FA_DEVICE_CPU, 0); }

fa_tensor HostTensor::view_on(void* data, fa_device_kind device, int device_id) const {
  fa_tensor t;
  std::memset(&t, 0, sizeof(t));
  t.data = data;
  t.ndim = int32_t(shape_.size());
  for (size_t d = 0; d < shape_.size(); ++d) {
    t.shape[d] = shape_[d];
    t.strides[d] = strides_[d];
  }
  t.dtype = dtype_;
  t.device = device;
  t.device_id = device_id;
  return t;
}

int64_t HostTensor::offset_of(int64_t logical) const {
  if (row_major_) return logical;
  int64_t offset = 0;
  for (int d = int(shape_.size()) - 1; d >= 0; --d) {
    offset += (logical % shape_[d]) * strides_[d];
    logical /= shape_[d];
  }
  return offset;
}

double HostTensor::get(int64_t logical) const {
  return flashattn::load_as_float(storage_.data(), offset_of(logical), dtype_);
}
void HostTensor::set(int64_t logical, double value) {
  flashattn::store_from_float(storage_.data(), offset_of(logical), dtype_, float(value));
}
int32_t HostTensor::get_int(int64_t logical) const {
  return reinterpret_cast<const int32_t*>(storage_.data())[offset_of(logical)];
}
void HostTensor::set_int(int64_t logical, int32_t value) {
  reinterpret_cast<int32_t*>(storage_.data())[offset_of(logical)] = value;
}

std::vector<double> HostTensor::to_double() const {
  const int64_t count = numel();
  std::vector<double> v(static_cast<size_t>(count));
  parallel_chunks(count, kChunk, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) v[size_t(n)] = get(n);
  });
  return v;
}

HostTensor HostTensor::converted(fa_dtype dtype) const {
  HostTensor r(shape_, strides_, dtype);
  // Slot by slot over the whole storage (padding too: both tensors share the strides, so the slots line up); float16
  // and bfloat16 -> float32 is exact, the other way rounds as set() does.
  const int64_t slots = std::min(storage_bytes() / dtype_size(dtype_), r.storage_bytes() / dtype_size(dtype));
  parallel_chunks(slots, kChunk, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      flashattn::store_from_float(r.storage_.data(), n, dtype, flashattn::load_as_float(storage_.data(), n, dtype_));
  });
  return r;
}

void HostTensor::copy_values_from(const HostTensor& from) {
  const int64_t count = numel();
  // Overlapping strides (elements sharing a slot): one chunk, so the last logical element wins as it did sequentially.
  parallel_chunks(count, distinct_offsets_ ? kChunk : std::max<int64_t>(count, 1), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) set(n, from.get(n));
  });
}

template <class Distribution>
void HostTensor::fill_from(std::mt19937_64& rng, const Distribution& distribution) {
  const int64_t count = numel();
  if (count <= kChunk || !distinct_offsets_) {  // one stream from rng, in logical order
    Distribution d = distribution;
    for (int64_t n = 0; n < count; ++n) set(n, d(rng));
    return;
  }
  std::vector<uint64_t> seeds(size_t((count + kChunk - 1) / kChunk));
  for (uint64_t& seed : seeds) seed = rng();  // drawn in order here, so the values do not depend on the threads
  parallel_chunks(count, kChunk, [&](int64_t begin, int64_t end) {
    std::mt19937_64 chunk_rng(seeds[size_t(begin / kChunk)]);
    Distribution d = distribution;
    for (int64_t n = begin; n < end; ++n) set(n, d(chunk_rng));
  });
}

void HostTensor::fill_normal(std::mt19937_64& rng, double stddev, double mean) {
  fill_from(rng, std::normal_distribution<double>(mean, stddev));
}

void HostTensor::fill_uniform(std::mt19937_64& rng, double lo, double hi) {
  fill_from(rng, std::uniform_real_distribution<double>(lo, hi));
}

void HostTensor::poison() {
  const int64_t count = int64_t(storage_.size()) / dtype_size(dtype_);
  for (int64_t n = 0; n < count; ++n) {
    if (dtype_ == FA_INT32) reinterpret_cast<int32_t*>(storage_.data())[n] = 0x7eadbeef;
    else if (dtype_ != FA_UINT8) flashattn::store_from_float(storage_.data(), n, dtype_, std::numeric_limits<float>::quiet_NaN());
  }
}

int64_t HostTensor::count_nonfinite() const {
  int64_t bad = 0;
  for (int64_t n = 0, count = numel(); n < count; ++n) bad += !std::isfinite(get(n));
  return bad;
}

fa_tensor host_view(void* data, fa_dtype dtype, const std::vector<int64_t>& shape, const std::vector<int64_t>& strides) {
  fa_tensor t{};
  t.data = data;
  t.ndim = int32_t(shape.size());
  for (size_t d = 0; d < shape.size(); ++d) t.shape[d] = shape[d], t.strides[d] = strides[d];
  t.dtype = dtype;
  t.device = FA_DEVICE_CPU;
  return t;
}

void parallel_chunks(int64_t count, int64_t chunk, const std::function<void(int64_t begin, int64_t end)>& body) {
  if (count <= 0) return;
  const int64_t chunks = (count + chunk - 1) / chunk;
  const int64_t threads = std::min<int64_t>(chunks, std::max(1u, std::thread::hardware_concurrency()));
  std::atomic<int64_t> next{0};
  auto worker = [&] {
    for (int64_t c = next++; c < chunks; c = next++) body(c * chunk, std::min(count, (c + 1) * chunk));
  };
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (std::thread& t : pool) t.join();
}

std::mt19937_64 make_rng(const std::string& salt) {
  // Fresh inputs every run (DESIGN.md), reproducible from the printed seed: FA_TEST_SEED=<n>.
  static const uint64_t base = [] {
    const char* env = std::getenv("FA_TEST_SEED");
    const uint64_t seed = env ? std::strtoull(env, nullptr, 10)
                              : uint64_t(std::chrono::high_resolution_clock::now().time_since_epoch().count());
    std::printf("[fa_test] FA_TEST_SEED=%llu\n", (unsigned long long)seed);
    return seed;
  }();
  return std::mt19937_64(base ^ std::hash<std::string>()(salt));
}

std::string ErrorStats::to_string() const {
  std::ostringstream s;
  s << "max_abs=" << max_abs << " rel_l2=" << rel_l2 << " nan=" << nan << " inf_mismatch=" << mismatched_inf;
  return s.str();
}

ErrorStats compare(const std::vector<double>& got, const std::vector<double>& ref) {
  ErrorStats e;
  double diff2 = 0, ref2 = 0;
  for (size_t n = 0; n < got.size() && n < ref.size(); ++n) {
    const double g = got[n], r = ref[n];
    if (std::isnan(g)) { ++e.nan; continue; }
    if (std::isinf(g) || std::isinf(r)) {
      if (g != r) ++e.mismatched_inf;
      continue;
    }
    e.max_abs = std::max(e.max_abs, std::abs(g - r));
    diff2 += (g - r) * (g - r);
    ref2 += r * r;
  }
  if (got.size() != ref.size()) e.nan += int64_t(std::max(got.size(), ref.size()) - std::min(got.size(), ref.size()));
  e.rel_l2 = std::sqrt(diff2) / std::max(std::sqrt(ref2), 1e-30);
  return e;
}

ErrorStats compare(const HostTensor& got, const HostTensor& ref) { return compare(got.to_double(), ref.to_double()); }

::testing::AssertionResult within_tolerance(const std::string& what, fa_dtype dtype, const ErrorStats& fast,
                                            const ErrorStats* naive, double factor, double abs_slack,
                                            const ErrorStats* input_floor) {
  if (fast.nan > 0 || fast.mismatched_inf > 0)
    return ::testing::AssertionFailure() << what << ": non-finite mismatch: " << fast.to_string();
  if (dtype == FA_FLOAT32 || naive == nullptr) {
    if (fast.rel_l2 <= 1e-5) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << what << ": float32 error above 1e-5 relative: " << fast.to_string();
  }
  const double floor_abs = input_floor ? input_floor->max_abs : 0.0, floor_rel = input_floor ? input_floor->rel_l2 : 0.0;
  const bool ok = fast.max_abs <= factor * naive->max_abs + abs_slack + floor_abs &&
                  fast.rel_l2 <= factor * naive->rel_l2 + abs_slack + floor_rel;
  if (ok) return ::testing::AssertionSuccess();
  auto failure = ::testing::AssertionFailure() << what << ": error " << fast.to_string() << " exceeds " << factor
                                               << "x the naive same-precision error " << naive->to_string() << " + " << abs_slack;
  if (input_floor) failure << " + the input-rounding floor " << input_floor->to_string();
  return failure;
}

std::string Problem::to_string() const {
  std::ostringstream s;
  s << "B=" << batch << " Sq=" << seqlen_q << " Sk=" << seqlen_k << " Hq=" << heads_q << " Hk=" << heads_k
    << " D=" << head_dim << " Dv=" << dv() << " " << flashattn::dtype_name(dtype);
  if (!varlen_q.empty()) {
    s << " varlen q=[";
    for (int l : varlen_q) s << l << ",";
    s << "] k=[";
    for (int l : varlen_k) s << l << ",";
    s << "]";
  }
  if (input_std != 1.0) s << " std=" << input_std;
  return s.str();
}

void Tensors::poison_outputs() {
  out.poison();
  lse.poison();
  dq.poison();
  dk.poison();
  dv.poison();
}

Tensors make_tensors(const Problem& p, std::mt19937_64& rng) {
  Tensors t;
  const int dv = p.dv();
  if (p.varlen_q.empty()) {
    t.q = HostTensor({p.batch, p.seqlen_q, p.heads_q, p.head_dim}, p.dtype);
    t.k = HostTensor({p.batch, p.seqlen_k, p.heads_k, p.head_dim}, p.dtype);
    t.v = HostTensor({p.batch, p.seqlen_k, p.heads_k, dv}, p.dtype);
    t.out = HostTensor({p.batch, p.seqlen_q, p.heads_q, dv}, p.dtype);
    t.lse = HostTensor({p.batch, p.heads_q, p.seqlen_q}, FA_FLOAT32);
  } else {
    int64_t total_q = 0, total_k = 0;
    t.cu_seqlens_q = HostTensor({int64_t(p.varlen_q.size()) + 1}, FA_INT32);
    t.cu_seqlens_k = HostTensor({int64_t(p.varlen_k.size()) + 1}, FA_INT32);
    t.cu_seqlens_q.set_int(0, 0);
    t.cu_seqlens_k.set_int(0, 0);
    for (size_t b = 0; b < p.varlen_q.size(); ++b) {
      total_q += p.varlen_q[b];
      total_k += p.varlen_k[b];
      t.cu_seqlens_q.set_int(int64_t(b) + 1, int32_t(total_q));
      t.cu_seqlens_k.set_int(int64_t(b) + 1, int32_t(total_k));
      t.max_seqlen_q = std::max(t.max_seqlen_q, p.varlen_q[b]);
      t.max_seqlen_k = std::max(t.max_seqlen_k, p.varlen_k[b]);
    }
    t.q = HostTensor({total_q, p.heads_q, p.head_dim}, p.dtype);
    t.k = HostTensor({total_k, p.heads_k, p.head_dim}, p.dtype);
    t.v = HostTensor({total_k, p.heads_k, dv}, p.dtype);
    t.out = HostTensor({total_q, p.heads_q, dv}, p.dtype);
    t.lse = HostTensor({p.heads_q, total_q}, FA_FLOAT32);
  }
  t.q.fill_normal(rng, p.input_std);
  t.k.fill_normal(rng, p.input_std);
  t.v.fill_normal(rng);
  t.dout = HostTensor(t.out.shape(), p.dtype);
  t.dout.fill_normal(rng);
  t.dq = HostTensor(t.q.shape(), p.dtype);
  t.dk = HostTensor(t.k.shape(), p.dtype);
  t.dv = HostTensor(t.v.shape(), p.dtype);
  t.poison_outputs();
  return t;
}

fa_forward_args forward_args(Tensors& t) {
  fa_forward_args a{};
  a.q = t.q.view();
  a.k = t.k.view();
  a.v = t.v.view();
  a.out = t.out.view();
  a.lse = t.lse.view();
  if (t.cu_seqlens_q.numel() > 0 && !t.cu_seqlens_q.shape().empty()) {
    a.cu_seqlens_q = t.cu_seqlens_q.view();
    a.cu_seqlens_k = t.cu_seqlens_k.view();
    a.max_seqlen_q = t.max_seqlen_q;
    a.max_seqlen_k = t.max_seqlen_k;
  }
  return a;
}

fa_backward_args backward_args(Tensors& t) {
  const fa_forward_args f = forward_args(t);
  fa_backward_args a{};
  a.q = f.q;
  a.k = f.k;
  a.v = f.v;
  a.out = f.out;
  a.lse = f.lse;
  a.dout = t.dout.view();
  a.dq = t.dq.view();
  a.dk = t.dk.view();
  a.dv = t.dv.view();
  a.cu_seqlens_q = f.cu_seqlens_q;
  a.cu_seqlens_k = f.cu_seqlens_k;
  a.max_seqlen_q = f.max_seqlen_q;
  a.max_seqlen_k = f.max_seqlen_k;
  return a;
}

fa_options options_for(fa_backend backend) {
  fa_options o;
  fa_options_init(&o);
  o.backend = backend;
  return o;
}

namespace {

// A float64 copy of `like` (same shape, contiguous) to receive exact oracle results.
HostTensor exact_like(const HostTensor& like) { return HostTensor(like.shape(), FA_FLOAT32); }

void check_ok(const flashattn::Status& s, const char* what) {
  if (!s.ok()) ADD_FAILURE() << what << ": " << s.to_string();
}

}  // namespace

Oracle run_oracle(Tensors& t, const fa_options& options, bool with_backward) {
  using namespace flashattn;
  Oracle o;
  fa_options ref_options = options;
  ref_options.backend = FA_BACKEND_CPU_REFERENCE;
  ref_options.stats = nullptr;
  // Exact results: run the reference into float32 copies (the oracle rounds once, to float32, which
  // is far below every tolerance here) and into tensors of the output dtype.
  Tensors exact = t;
  exact.out = exact_like(t.out);
  exact.dq = exact_like(t.dq);
  exact.dk = exact_like(t.dk);
  exact.dv = exact_like(t.dv);
  // dout must be read in the inputs' dtype: keep it; the reference reads all inputs as one dtype,
  // so run it on float32 copies of q/k/v/dout holding the same (already rounded) values.
  exact.q = t.q.converted(FA_FLOAT32);
  exact.k = t.k.converted(FA_FLOAT32);
  exact.v = t.v.converted(FA_FLOAT32);
  exact.dout = t.dout.converted(FA_FLOAT32);
  exact.lse = HostTensor(t.lse.shape(), FA_FLOAT32);
  fa_forward_args fa = forward_args(exact);
  check_ok(forward(fa, ref_options), "oracle forward");
  o.out64 = exact.out.to_double();
  o.lse64 = exact.lse.to_double();
  o.out = exact.out;
  o.lse = exact.lse;
  if (with_backward) {
    fa_backward_args ba = backward_args(exact);
    check_ok(backward(ba, ref_options), "oracle backward");
    o.dq64 = exact.dq.to_double();
    o.dk64 = exact.dk.to_double();
    o.dv64 = exact.dv.to_double();
  }
  if (t.q.dtype() != FA_FLOAT32) {
    // The naive same-precision baseline, in the inputs' own dtype.
    Tensors naive = t;
    naive.poison_outputs();
    AttentionParams p;
    check_ok(api::make_forward_params(forward_args(naive), ref_options, &p), "naive params");
    check_ok(cpu::reference::forward_naive_same_precision(p), "naive forward");
    o.naive_out = naive.out;
    if (with_backward) {
      BackwardParams bp;
      check_ok(api::make_backward_params(backward_args(naive), ref_options, &bp), "naive backward params");
      check_ok(cpu::reference::backward_naive_same_precision(bp), "naive backward");
      o.naive_dq = naive.dq;
      o.naive_dk = naive.dk;
      o.naive_dv = naive.dv;
    }
  }
  return o;
}

void expect_forward_matches(const std::string& what, const Tensors& t, const Oracle& o, fa_dtype dtype) {
  const ErrorStats out = compare(t.out.to_double(), o.out64);
  ErrorStats naive_out;
  if (dtype != FA_FLOAT32) naive_out = compare(o.naive_out.to_double(), o.out64);
  EXPECT_TRUE(within_tolerance(what + " out", dtype, out, dtype != FA_FLOAT32 ? &naive_out : nullptr));
  // lse is float32 on every path. An error e in lse scales every probability of its row by exp(e),
  // so it is judged absolutely, relative to max(1, |lse|) (a relative error is ill-conditioned
  // where lse is near 0); 16-bit paths may carry the input-rounding floor of their dtype.
  const ErrorStats lse = compare(t.lse.to_double(), o.lse64);
  double lse_magnitude = 1.0;
  for (double x : o.lse64)
    if (std::isfinite(x)) lse_magnitude = std::max(lse_magnitude, std::abs(x));
  const double lse_tol = dtype == FA_FLOAT32 ? 1e-5 : 1e-3;
  EXPECT_EQ(lse.nan, 0) << what << " lse has NaN (unwritten?): " << lse.to_string();
  EXPECT_EQ(lse.mismatched_inf, 0) << what << " lse -inf rows differ: " << lse.to_string();
  EXPECT_LE(lse.max_abs, lse_tol * lse_magnitude) << what << " lse: " << lse.to_string();
}

void expect_backward_matches(const std::string& what, const Tensors& t, const Oracle& o, fa_dtype dtype) {
  struct Item {
    const char* name;
    const HostTensor& got;
    const std::vector<double>& exact;
    const HostTensor& naive;
  };
  const Item items[] = {{" dq", t.dq, o.dq64, o.naive_dq}, {" dk", t.dk, o.dk64, o.naive_dk}, {" dv", t.dv, o.dv64, o.naive_dv}};
  for (const Item& item : items) {
    const ErrorStats e = compare(item.got.to_double(), item.exact);
    ErrorStats naive;
    if (dtype != FA_FLOAT32) naive = compare(item.naive.to_double(), item.exact);
    EXPECT_TRUE(within_tolerance(what + item.name, dtype, e, dtype != FA_FLOAT32 ? &naive : nullptr));
  }
}

}  // namespace fa_test
