// The CUDA forward on the GPU, through the public API (fa_forward, backend = cuda), against the float64
// oracle on the host under the tolerance rule of DESIGN.md. Every run draws fresh inputs (FA_TEST_SEED
// reproduces one), poisons out and lse with NaN on the device before the call, and checks every option:
// odd sizes, Sq != Sk, GQA/MQA, causal and windows, softcap, ALiBi, dropout (the keep mask bit for bit
// against core/philox.hpp), varlen, seqused_k, paged K/V, strided tensors, head dims between buckets.
// Without a GPU (CI) every test skips with a message.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "api/validate.hpp"
#include "core/philox.hpp"
#include "cpu/reference/reference.hpp"
#include "cuda/sm80/forward_split.hpp"
#include "testing.hpp"

#if defined(FLASHATTN_WITH_CUDA)
#include <cuda_runtime.h>

#include "cuda/common/stream_fork.hpp"
#include "cuda/decode/kvcache.hpp"
#endif

namespace {

using fa_test::HostTensor;
using flashattn::Status;

// All host tensors of one forward call; empty ones are absent.
struct Call {
  HostTensor q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, alibi;
  int max_seqlen_q = 0, max_seqlen_k = 0;
  fa_options options = fa_test::options_for(FA_BACKEND_CPU_REFERENCE);
};

bool present(const HostTensor& t) { return !t.shape().empty(); }

fa_forward_args host_args(Call& c) {
  fa_forward_args a{};
  a.q = c.q.view();
  a.k = c.k.view();
  a.v = c.v.view();
  a.out = c.out.view();
  if (present(c.lse)) a.lse = c.lse.view();
  if (present(c.cu_seqlens_q)) {
    a.cu_seqlens_q = c.cu_seqlens_q.view();
    a.cu_seqlens_k = c.cu_seqlens_k.view();
    a.max_seqlen_q = c.max_seqlen_q;
    a.max_seqlen_k = c.max_seqlen_k;
  }
  if (present(c.seqused_k)) a.seqused_k = c.seqused_k.view();
  if (present(c.block_table)) a.block_table = c.block_table.view();
  return a;
}

fa_options host_options(Call& c) {
  fa_options o = c.options;
  if (present(c.alibi)) o.alibi_slopes = c.alibi.view();
  return o;
}

struct Expected {
  std::vector<double> out64, lse64;  // float64 oracle
  HostTensor naive_out;              // the naive same-precision baseline
};

// The oracle reads the same rounded inputs as float32 copies (so out can be float32, far below any
// tolerance here), and the naive baseline computes in the inputs' own dtype.
Expected oracle(Call& c) {
  Expected e;
  Call exact = c;
  exact.q = c.q.converted(FA_FLOAT32);
  exact.k = c.k.converted(FA_FLOAT32);
  exact.v = c.v.converted(FA_FLOAT32);
  exact.out = c.out.converted(FA_FLOAT32);
  exact.options.backend = FA_BACKEND_CPU_REFERENCE;
  const Status s = flashattn::forward(host_args(exact), host_options(exact));
  EXPECT_TRUE(s.ok()) << "oracle: " << s.to_string();
  e.out64 = exact.out.to_double();
  if (present(c.lse)) e.lse64 = exact.lse.to_double();
  Call naive = c;
  flashattn::AttentionParams p;
  const Status v = flashattn::api::make_forward_params(host_args(naive), host_options(naive), &p);
  EXPECT_TRUE(v.ok()) << v.to_string();
  const Status n = flashattn::cpu::reference::forward_naive_same_precision(p);
  EXPECT_TRUE(n.ok()) << n.to_string();
  e.naive_out = naive.out;
  return e;
}

#if defined(FLASHATTN_WITH_CUDA)
// Device copies of a call's host tensors (the whole storage, strides and padding included).
class DeviceCall {
 public:
  explicit DeviceCall(Call& c) : c_(c) {
    for (HostTensor* t : {&c.q, &c.k, &c.v, &c.out, &c.lse, &c.cu_seqlens_q, &c.cu_seqlens_k, &c.seqused_k, &c.block_table,
                          &c.alibi})
      if (present(*t)) upload(t);
  }
  ~DeviceCall() {
    for (auto& [host, device] : buffers_) cudaFree(device);
  }
  fa_tensor view(HostTensor& t) { return t.view_on(buffers_.at(&t), FA_DEVICE_CUDA, 0); }
  Status run(fa_stats* stats = nullptr) {
    const Status s = flashattn::forward(args(), options(stats));
    const cudaError_t sync = cudaDeviceSynchronize();
    if (sync != cudaSuccess) return Status(FA_ERROR_DEVICE, std::string("kernel failed: ") + cudaGetErrorString(sync));
    return s;
  }
  // The call's arguments and options on the device copies.
  fa_forward_args args() {
    fa_forward_args a = host_args(c_);
    a.q = view(c_.q);
    a.k = view(c_.k);
    a.v = view(c_.v);
    a.out = view(c_.out);
    if (present(c_.lse)) a.lse = view(c_.lse);
    if (present(c_.cu_seqlens_q)) {
      a.cu_seqlens_q = view(c_.cu_seqlens_q);
      a.cu_seqlens_k = view(c_.cu_seqlens_k);
    }
    if (present(c_.seqused_k)) a.seqused_k = view(c_.seqused_k);
    if (present(c_.block_table)) a.block_table = view(c_.block_table);
    return a;
  }
  fa_options options(fa_stats* stats = nullptr) {
    fa_options o = c_.options;
    o.backend = FA_BACKEND_CUDA;
    o.stats = stats;
    if (present(c_.alibi)) o.alibi_slopes = view(c_.alibi);
    return o;
  }
  // Host -> device again (after the host copy changed, e.g. poisoned).
  void upload_again(HostTensor& t) {
    EXPECT_EQ(cudaMemcpy(buffers_.at(&t), t.data(), size_t(t.storage_bytes()), cudaMemcpyHostToDevice), cudaSuccess);
  }
  void download(HostTensor& t) {
    EXPECT_EQ(cudaMemcpy(t.data(), buffers_.at(&t), size_t(t.storage_bytes()), cudaMemcpyDeviceToHost), cudaSuccess);
  }
  void* device_data(const HostTensor& t) const { return buffers_.at(&t); }

 private:
  void upload(HostTensor* t) {
    void* device = nullptr;
    ASSERT_EQ(cudaMalloc(&device, size_t(std::max<int64_t>(t->storage_bytes(), 16))), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(device, t->data(), size_t(t->storage_bytes()), cudaMemcpyHostToDevice), cudaSuccess);
    buffers_[t] = device;
  }
  Call& c_;
  std::map<const HostTensor*, void*> buffers_;
};

// Runs the call on the GPU (outputs poisoned with NaN first) and downloads out and lse into c.
Status run_gpu(Call& c, fa_stats* stats = nullptr) {
  c.out.poison();
  if (present(c.lse)) c.lse.poison();
  DeviceCall d(c);
  const Status s = d.run(stats);
  d.download(c.out);
  if (present(c.lse)) d.download(c.lse);
  return s;
}
#else
Status run_gpu(Call&, fa_stats* = nullptr) { return Status(FA_ERROR_NOT_COMPILED, "no CUDA in this build"); }
#endif

// GPU vs oracle under the tolerance rule; lse within 1e-3 relative (float32 from 16-bit inputs). The run's fa_stats
// into *stats_out where given.
void check_against_oracle(const std::string& what, Call& c, fa_stats* stats_out = nullptr) {
  const Expected e = oracle(c);
  fa_stats local_stats{};
  fa_stats& stats = stats_out ? *stats_out : local_stats;
  const Status s = run_gpu(c, &stats);
  ASSERT_TRUE(s.ok()) << what << ": " << s.to_string();
  const fa_test::ErrorStats out = fa_test::compare(c.out.to_double(), e.out64);
  const fa_test::ErrorStats naive = fa_test::compare(e.naive_out.to_double(), e.out64);
  EXPECT_TRUE(fa_test::within_tolerance(what + " [" + stats.kernel + "] out", c.q.dtype(), out, &naive));
  if (present(c.lse)) {
    const fa_test::ErrorStats lse = fa_test::compare(c.lse.to_double(), e.lse64);
    EXPECT_EQ(lse.nan, 0) << what << " lse has NaN (unwritten?): " << lse.to_string();
    EXPECT_EQ(lse.mismatched_inf, 0) << what << " lse -inf rows differ: " << lse.to_string();
    EXPECT_LE(lse.rel_l2, 1e-3) << what << " lse: " << lse.to_string();
  }
}

// A dense or varlen call from the shared test problem builder (random q/k/v, poisoned outputs).
Call make_call(const fa_test::Problem& p, std::mt19937_64& rng) {
  fa_test::Tensors t = fa_test::make_tensors(p, rng);
  Call c;
  c.q = t.q;
  c.k = t.k;
  c.v = t.v;
  c.out = t.out;
  c.lse = t.lse;
  if (!p.varlen_q.empty()) {
    c.cu_seqlens_q = t.cu_seqlens_q;
    c.cu_seqlens_k = t.cu_seqlens_k;
    c.max_seqlen_q = t.max_seqlen_q;
    c.max_seqlen_k = t.max_seqlen_k;
  }
  return c;
}

fa_test::Problem problem(int b, int sq, int sk, int hq, int hk, int d, fa_dtype dtype, double std = 1.0) {
  fa_test::Problem p;
  p.batch = b;
  p.seqlen_q = sq;
  p.seqlen_k = sk;
  p.heads_q = hq;
  p.heads_k = hk;
  p.head_dim = d;
  p.dtype = dtype;
  p.input_std = std;
  return p;
}

const char* short_name(fa_dtype t) { return t == FA_FLOAT16 ? "f16" : "bf16"; }

// ---- the grid ----

TEST(CudaForward, HeadDimsDtypesCausalGqaPartialTiles) {
  SKIP_WITHOUT_GPU();
  auto rng = fa_test::make_rng("cuda_forward_grid");
  for (fa_dtype dtype : {FA_FLOAT16, FA_BFLOAT16})
    for (int d : {32, 64, 96, 128, 192, 256})
      for (int causal : {0, 1}) {
        Call c = make_call(problem(2, 127, 200, 4, 2, d, dtype), rng);
        c.options.causal = causal;
        check_against_oracle(std::string(short_name(dtype)) + " D=" + std::to_string(d) + (causal ? " causal" : ""), c);
      }
}

TEST(CudaForward, OddSizes) {
  SKIP_WITHOUT_GPU();
  auto rng = fa_test::make_rng("cuda_forward_sizes");
  const int sizes[][2] = {{1, 1}, {17, 17}, {1, 1000}, {1000, 1}, {127, 1000}, {1000, 127}, {1000, 1000}, {64, 64}, {129, 65}};
  for (const auto& s : sizes)
    for (int causal : {0, 1}) {
      Call c = make_call(problem(1, s[0], s[1], 2, 1, 128, FA_BFLOAT16), rng);
      c.options.causal = causal;
      check_against_oracle("Sq=" + std::to_string(s[0]) + " Sk=" + std::to_string(s[1]) + (causal ? " causal" : ""), c);
    }
}

TEST(CudaForward, Long4097) {
  SKIP_WITHOUT_GPU();
  auto rng = fa_test::make_rng("cuda_forward_4097");
  Call c = make_call(problem(1, 4097, 4097, 1, 1, 64, FA_BFLOAT16), rng);
  c.options.causal = 1;
  check_against_oracle("4097 causal", c);
}

TEST(CudaForward, PeakySoftmax) {
  SKIP_WITHOUT_GPU();
  auto rng = fa_test::make_rng("cuda_forward_peaky");
  for (fa_dtype dtype : {FA_FLOAT16, FA_BFLOAT16})
    for (int d : {64, 128, 256}) {
      // std 4 per element: scores of magnitude ~ 16 sqrt(D) * scale = 16, a nearly one-hot softmax
      Call c = make_call(problem(2, 300, 333, 2, 2, d, dtype, 4.0), rng);
      check_against_oracle(std::string("peaky ") + short_name(dtype) + " D=" + std::to_string(d), c);
    }
}

TEST(CudaForward, GqaAndMqa) {
  SKIP_WITHOUT_GPU();
  auto rng = fa_test::make_rng("cuda_forward_gqa");
  for (int hk : {1, 2, 8}) {
    Call c = make_call(problem(2, 150, 170, 8, hk, 64, FA_FLOAT16), rng);
    check_against_oracle("Hq=8 Hk=" + std::to_string(hk), c);
  }
}

TEST(CudaForward, HeadDimsBetweenBucketsAreZeroPadded) {
  SKIP_WITHOUT_GPU();
  auto rng = fa_test::make_rng("cuda_forward_padded_d");
  for (int d : {8, 40, 80, 136, 200}) {
    Call c = make_call(problem(1, 100, 90, 2, 1, d, FA_BFLOAT16), rng);
    c.options.causal = 1;
    check_against_oracle("D=" + std::to_string(d), c);
  }
}

TEST(CudaForward, SlidingWindows) {
  SKIP_WITHOUT_GPU();
  auto rng = fa_test::make_rng("cuda_forward_window");
  const int windows[][2] = {{32, 16}, {0, 0}, {100, -1}, {-1, 5}, {200, 0}, {1, 300}};
  // D = 256 runs the warp-pair kernel, whose two warps trade row maxima that may still be -inf.
  for (int d : {128, 256})
    for (const auto& w : windows)
      for (int shape = 0; shape < 2; ++shape) {
        // Sq < Sk and Sq > Sk (then some rows see no key at all: O = 0, lse = -inf)
        Call c = make_call(shape == 0 ? problem(2, 150, 400, 2, 1, d, FA_FLOAT16) : problem(2, 400, 150, 2, 1, d, FA_FLOAT16), rng);
        c.options.window_left = w[0];
        c.options.window_right = w[1];
        check_against_oracle("D=" + std::to_string(d) + " window (" + std::to_string(w[0]) + ", " + std::to_string(w[1]) +
                                 ") shape " + std::to_string(shape),
                             c);
      }
  Call c = make_call(problem(1, 300, 100, 2, 2, 64, FA_BFLOAT16), rng);
  c.options.causal = 1;  // rows 0..199 see no key
  check_against_oracle("causal Sq > Sk: fully masked rows", c);
}

TEST(CudaForward, SoftcapAlibiScale) {
  SKIP_WITHOUT_GPU();
  auto rng = fa_test::make_rng("cuda_forward_variants");
  for (int d : {64, 128, 256}) {
    Call c = make_call(problem(2, 140, 260, 4, 2, d, FA_BFLOAT16, 3.0), rng);
    c.options.softcap = 5.f;
    c.options.causal = 1;
    check_against_oracle("softcap causal D=" + std::to_string(d), c);

    Call a = make_call(problem(2, 140, 260, 4, 2, d, FA_FLOAT16), rng);
    a.alibi = HostTensor({4}, FA_FLOAT32);
    a.alibi.fill_uniform(rng, 0.01, 0.5);
    check_against_oracle("alibi (Hq) D=" + std::to_string(d), a);

    Call ab = make_call(problem(2, 140, 260, 4, 2, d, FA_FLOAT16), rng);
    ab.alibi = HostTensor({2, 4}, FA_FLOAT32);
    ab.alibi.fill_uniform(rng, 0.01, 0.5);
    ab.options.softcap = 20.f;
    ab.options.window_left = 50;
    ab.options.window_right = 10;
    check_against_oracle("alibi (B, Hq) + softcap + window D=" + std::to_string(d), ab);

    Call s = make_call(problem(1, 100, 120, 2, 2, d, FA_BFLOAT16), rng);
    s.options.softmax_scale = -0.07f;  // a negative scale flips which key is the max
    check_against_oracle("negative scale D=" + std::to_string(d), s);
  }
}

TEST(CudaForward, Varlen) {
  SKIP_WITHOUT_GPU();
  auto rng = fa_test::make_rng("cuda_forward_varlen");
  for (int d : {128, 256})
    for (int causal : {0, 1}) {
      fa_test::Problem p = problem(5, 0, 0, 4, 2, d, FA_BFLOAT16);
      p.varlen_q = {1, 130, 0, 257, 64};
      p.varlen_k = {17, 100, 40, 300, 0};
      Call c = make_call(p, rng);
      c.options.causal = causal;
      check_against_oracle("varlen D=" + std::to_string(d) + (causal ? " causal" : ""), c);
    }
}

TEST(CudaForward, SequsedK) {
  SKIP_WITHOUT_GPU();
  auto rng = fa_test::make_rng("cuda_forward_seqused");
  Call c = make_call(problem(3, 90, 300, 2, 1, 64, FA_FLOAT16), rng);
  c.seqused_k = HostTensor({3}, FA_INT32);
  c.seqused_k.set_int(0, 300);
  c.seqused_k.set_int(1, 77);
  c.seqused_k.set_int(2, 0);
  check_against_oracle("seqused_k", c);
  c.options.causal = 1;
  check_against_oracle("seqused_k causal", c);
}

// A paged cache of `block_size` keys per block holding `batch` sequences of up to max_keys keys, every block id once
// in random order (scattered, out of order), plus `spare` blocks no sequence uses; with `repeat`, column 1 of
// sequence 2 names the block of column 0 of sequence 0 (a block shared by two tables, as after a fork).
void make_paged_cache(Call& c, std::mt19937_64& rng, int batch, int max_keys, int block_size, int hk, int d, fa_dtype dtype,
                      bool repeat, int spare = 3) {
  const int max_blocks = (max_keys + block_size - 1) / block_size;
  const int num_blocks = batch * max_blocks + spare;
  c.k = HostTensor({num_blocks, block_size, hk, d}, dtype);
  c.v = HostTensor({num_blocks, block_size, hk, d}, dtype);
  c.k.fill_normal(rng);
  c.v.fill_normal(rng);
  std::vector<int> ids(num_blocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  c.block_table = HostTensor({batch, max_blocks}, FA_INT32);
  for (int n = 0; n < batch * max_blocks; ++n) c.block_table.set_int(n, ids[n]);
  if (repeat && batch > 2 && max_blocks > 1) c.block_table.set_int(2 * max_blocks + 1, c.block_table.get_int(0));
}

// A causal bf16 D = 128 call of Sq rows per sequence over a paged cache (a repeated block) of `max_keys` rows, with
// seqused_k = `used` (B = used.size()), lse present.
Call paged_causal_call(std::mt19937_64& rng, int sq, int hq, int hk, int max_keys, int block_size, const std::vector<int>& used) {
  const int batch = int(used.size());
  Call c;
  c.q = HostTensor({batch, sq, hq, 128}, FA_BFLOAT16);
  c.q.fill_normal(rng);
  make_paged_cache(c, rng, batch, max_keys, block_size, hk, 128, FA_BFLOAT16, /*repeat=*/true);
  c.out = HostTensor({batch, sq, hq, 128}, FA_BFLOAT16);
  c.lse = HostTensor({batch, hq, sq}, FA_FLOAT32);
  c.seqused_k = HostTensor({batch}, FA_INT32);
  for (int b = 0; b < batch; ++b) c.seqused_k.set_int(b, used[size_t(b)]);
  c.options.causal = 1;
  return c;
}

// Paged K/V for every head-dim bucket (and D = 72, between buckets), block sizes of the slot-id path (powers of two
// >= 16) and of the per-row lookup (1, 3, 5, 8), causal or not, one empty and one one-key sequence. Without dropout
// the call must run the paged instantiation (kernel name ...pk).
TEST(CudaForward, PagedKv) {
  SKIP_WITHOUT_GPU();
  auto rng = fa_test::make_rng("cuda_forward_paged");
  const int batch = 4, hq = 4, hk = 2, sq = 70;
  const std::vector<int> used = {250, 1, 131, 0};
  struct Shape {
    int d, block_size;
    fa_dtype dtype;
  };
  std::vector<Shape> shapes;
  for (int d : {32, 64, 96, 128, 192, 256})
    for (int block_size : {16, 5, 64, 256}) shapes.push_back({d, block_size, d % 64 == 0 ? FA_BFLOAT16 : FA_FLOAT16});
  for (int block_size : {1, 3, 8, 32, 128}) shapes.push_back({128, block_size, FA_BFLOAT16});
  shapes.push_back({72, 16, FA_BFLOAT16});
  shapes.push_back({72, 5, FA_FLOAT16});
  for (const Shape& shape : shapes) {
    Call c;
    c.q = HostTensor({batch, sq, hq, shape.d}, shape.dtype);
    c.q.fill_normal(rng);
    make_paged_cache(c, rng, batch, 250, shape.block_size, hk, shape.d, shape.dtype, /*repeat=*/shape.block_size >= 16);
    c.out = HostTensor({batch, sq, hq, shape.d}, shape.dtype);
    c.lse = HostTensor({batch, hq, sq}, FA_FLOAT32);
    c.seqused_k = HostTensor({batch}, FA_INT32);
    for (int b = 0; b < batch; ++b) c.seqused_k.set_int(b, used[b]);
    for (int causal : {0, 1}) {
      c.options.causal = causal;
      const std::string what = std::string("paged ") + short_name(shape.dtype) + " D=" + std::to_string(shape.d) +
                               " block_size=" + std::to_string(shape.block_size) + (causal ? " causal" : "");
      check_against_oracle(what, c);
      fa_stats stats{};
      Call again = c;
      ASSERT_TRUE(run_gpu(again, &stats).ok()) << what;
      EXPECT_NE(std::string(stats.kernel).find("pk"), std::string::npos) << what << " ran " << stats.kernel;
    }
  }
}

// A block id outside [0, num_blocks) in a device block table (which the host cannot check) is never dereferenced: the
// CTAs that meet it write NaN to their out and lse rows, and every other sequence's rows are exact. Both lookups
// (slot ids, block size 16; per row, 5), ids past the end and negative, in the middle of a sequence.
TEST(CudaForward, PagedBadBlockIdGivesNanNotARead) {
  SKIP_WITHOUT_GPU();
  auto rng = fa_test::make_rng("cuda_forward_paged_bad_id");
  const int batch = 3, hq = 4, hk = 2, sq = 70, d = 128;
  for (int block_size : {16, 5})
    for (int bad : {1 << 20, -1}) {
      Call c;
      c.q = HostTensor({batch, sq, hq, d}, FA_BFLOAT16);
      c.q.fill_normal(rng);
      make_paged_cache(c, rng, batch, 200, block_size, hk, d, FA_BFLOAT16, false);
      c.out = HostTensor({batch, sq, hq, d}, FA_BFLOAT16);
      c.lse = HostTensor({batch, hq, sq}, FA_FLOAT32);
      const Expected e = oracle(c);  // with the valid table
      const int max_blocks = int(c.block_table.shape()[1]);
      const int column = 100 / block_size;  // keys around 100 of sequence 1
      c.block_table.set_int(max_blocks + column, bad);
      const std::string what = "block_size=" + std::to_string(block_size) + " bad id " + std::to_string(bad);
      // Through the public API with a device table: nothing to check on the host, the kernel must cope.
      ASSERT_TRUE(run_gpu(c).ok()) << what;
      const std::vector<double> out = c.out.to_double(), lse = c.lse.to_double();
      const std::vector<double> naive_all = e.naive_out.to_double();
      std::vector<double> got, ref, naive;
      int64_t nan_out = 0, nan_lse = 0;
      for (int b = 0; b < batch; ++b)
        for (int i = 0; i < sq; ++i)
          for (int h = 0; h < hq; ++h) {
            const int64_t row = (int64_t(b) * sq + i) * hq + h;
            const double l = lse[(int64_t(b) * hq + h) * sq + i];
            if (b == 1) {
              nan_lse += std::isnan(l);
              for (int x = 0; x < d; ++x) nan_out += std::isnan(out[row * d + x]);
              continue;
            }
            EXPECT_FALSE(std::isnan(l)) << what << " b " << b << " i " << i << " h " << h;
            for (int x = 0; x < d; ++x) {
              got.push_back(out[row * d + x]);
              ref.push_back(e.out64[row * d + x]);
              naive.push_back(naive_all[row * d + x]);
            }
          }
      EXPECT_EQ(nan_lse, int64_t(sq) * hq) << what << ": every row of sequence 1 NaN";
      EXPECT_EQ(nan_out, int64_t(sq) * hq * d) << what;
      const fa_test::ErrorStats err = fa_test::compare(got, ref), naive_err = fa_test::compare(naive, ref);
      EXPECT_TRUE(fa_test::within_tolerance(what + " sequences 0 and 2 out", FA_BFLOAT16, err, &naive_err));
    }
}

// A varlen call over a paged cache: sequence b has lengths_q[b] queries and lengths_k[b] keys, q / k / v random,
// block ids a permutation of the pool (shuffled, or in order) with `spare` blocks beyond the table, out poisoned and
// lse (Hq, total_q) present, max_seqlen_q / max_seqlen_k the true maxima.
Call varlen_paged_call(std::mt19937_64& rng, const std::vector<int>& lengths_q, const std::vector<int>& lengths_k, int hq,
                       int hk, int d, int block_size, fa_dtype dtype, int spare, bool shuffle = true) {
  const int batch = int(lengths_q.size());
  const int max_k = *std::max_element(lengths_k.begin(), lengths_k.end());
  const int max_blocks = std::max(1, (max_k + block_size - 1) / block_size);
  const int num_blocks = batch * max_blocks + spare;
  const int total_q = std::accumulate(lengths_q.begin(), lengths_q.end(), 0);
  Call c;
  c.q = HostTensor({total_q, hq, d}, dtype);
  c.k = HostTensor({num_blocks, block_size, hk, d}, dtype);
  c.v = HostTensor({num_blocks, block_size, hk, d}, dtype);
  c.q.fill_normal(rng);
  c.k.fill_normal(rng);
  c.v.fill_normal(rng);
  c.out = HostTensor({total_q, hq, d}, dtype);
  c.lse = HostTensor({hq, total_q}, FA_FLOAT32);
  std::vector<int> ids(num_blocks);
  std::iota(ids.begin(), ids.end(), 0);
  if (shuffle) std::shuffle(ids.begin(), ids.end(), rng);
  c.block_table = HostTensor({batch, max_blocks}, FA_INT32);
  for (int n = 0; n < batch * max_blocks; ++n) c.block_table.set_int(n, ids[n]);
  c.cu_seqlens_q = HostTensor({batch + 1}, FA_INT32);
  c.cu_seqlens_k = HostTensor({batch + 1}, FA_INT32);
  c.cu_seqlens_q.set_int(0, 0);
  c.cu_seqlens_k.set_int(0, 0);
  for (int b = 0; b < batch; ++b) {
    c.cu_seqlens_q.set_int(b + 1, c.cu_seqlens_q.get_int(b) + lengths_q[b]);
    c.cu_seqlens_k.set_int(b + 1, c.cu_seqlens_k.get_int(b) + lengths_k[b]);
  }
  c.max_seqlen_q = *std::max_element(lengths_q.begin(), lengths_q.end());
  c.max_seqlen_k = max_k;
  return c;
}

// One continuous-batching step in one call: variable-length queries (decode tokens, a prefill chunk, a whole
// prompt, an empty request) over a paged cache whose lengths come from cu_seqlens_k, the blocks scattered. Block
// sizes 16 and 256 (the shift path of the row lookup) and 7 (the division path).
TEST(CudaForward, VarlenQueriesOverPagedKv) {
  SKIP_WITHOUT_GPU();
  auto rng = fa_test::make_rng("cuda_forward_varlen_paged");
  const std::vector<int> lengths_q = {1, 37, 0, 120, 1}, lengths_k = {300, 37, 9, 250, 1};
  const int hq = 8, hk = 2;
  for (int d : {64, 128})
    for (int block_size : {16, 7, 256}) {
      Call c = varlen_paged_call(rng, lengths_q, lengths_k, hq, hk, d, block_size, FA_BFLOAT16, 2);
      ASSERT_EQ(c.cu_seqlens_q.get_int(5), 159);
      for (int causal : {0, 1}) {
        c.options.causal = causal;
        check_against_oracle("varlen q, paged D=" + std::to_string(d) + " block_size=" + std::to_string(block_size) +
                                 (causal ? " causal" : ""),
                             c);
      }
    }
}

// A varlen call over a paged cache (a serving step) for one CUDA forward call: its sequences of 1 to T query rows
// (T = max(1, 16 / G), decode_plan.hpp's short_sequence_max_q) run in the decode kernels, which read and write their
// rows in the forward's own tensors, the others in the forward kernel. Every sequence's out and lse rows against the float64 oracle, outputs
// poisoned: lengths 0, 1, T, T + 1 and a chunk beside long caches (split-KV), key counts below the query count (rows
// with no key), G = 1, 4, 8 and 32, block sizes 16 and 5, causal or not, a window, softcap with ALiBi, and a call whose
// sequences are all short (the forward kernel does not run). The kernel name says which kernels ran.
// check_against_oracle on a copy of the call; the checked run's fa_stats.
fa_stats oracle_then_stats(const std::string& what, const Call& call) {
  Call checked = call;
  fa_stats stats{};
  check_against_oracle(what, checked, &stats);
  return stats;
}
// ... whose fa_stats must name a decode kernel.
fa_stats checked_stats(const std::string& what, const Call& call) {
  const fa_stats stats = oracle_then_stats(what, call);
  EXPECT_NE(std::string(stats.kernel).find("dec_"), std::string::npos) << what << " ran " << stats.kernel;
  return stats;
}

TEST(CudaForward, VarlenPagedShortSequencesTakeTheDecodeKernels) {
  SKIP_WITHOUT_GPU();
  auto rng = fa_test::make_rng("cuda_forward_varlen_paged_short");
  struct Heads {
    int hq, hk;
  };
  for (const Heads heads : {Heads{8, 8}, Heads{8, 2}, Heads{16, 2}, Heads{32, 1}})
    for (int block_size : {16, 5})
      for (bool all_short : {false, true}) {
        const int group = heads.hq / heads.hk;
        const int t = std::max(1, 16 / group);
        std::vector<int> lengths_q = {1, t, 0, t + 1, 40, 1, std::min(2, t), 3};
        std::vector<int> lengths_k = {2900, 700, 9, 1200, 300, 1, 1, 2};
        if (all_short)
          for (int& n : lengths_q) n = std::min(n, t);
        const fa_dtype dtype = block_size == 16 ? FA_BFLOAT16 : FA_FLOAT16;
        const Call c = varlen_paged_call(rng, lengths_q, lengths_k, heads.hq, heads.hk, 128, block_size, dtype, 3);
        struct Variant {
          const char* name;
          int causal, window_left, window_right;
          float softcap;
          bool alibi;
        };
        for (const Variant& variant : {Variant{"", 0, -1, -1, 0.f, false}, Variant{" causal", 1, -1, -1, 0.f, false},
                                       Variant{" window (100, 0)", 0, 100, 0, 0.f, false},
                                       Variant{" causal softcap alibi", 1, -1, -1, 15.f, true}}) {
          Call call = c;
          call.options.causal = variant.causal;
          call.options.window_left = variant.window_left;
          call.options.window_right = variant.window_right;
          call.options.softcap = variant.softcap;
          if (variant.alibi) {
            call.alibi = HostTensor({heads.hq}, FA_FLOAT32);
            call.alibi.fill_uniform(rng, 0.01, 0.3);
          }
          const std::string what = "Hq " + std::to_string(heads.hq) + " / Hk " + std::to_string(heads.hk) + " block_size " +
                                   std::to_string(block_size) + (all_short ? " all short" : "") + variant.name;
          const fa_stats stats = checked_stats(what, call);
          const std::string kernel = stats.kernel;
          EXPECT_NE(kernel.find("<= " + std::to_string(t) + " rows"), std::string::npos) << what << " ran " << kernel;
          EXPECT_EQ(kernel.find("fwd_") == std::string::npos, all_short) << what << " ran " << kernel;
          EXPECT_GT(stats.scratch_bytes_peak, 0) << what;
        }
      }
}

// A decode step through the varlen call (vLLM's: every sequence S = max_seqlen_q <= T rows, a block table, seqused_k or
// cu_seqlens_k for the key counts): one decode call in place on the forward's q / out / lse, no copies. S = 1 and
// S = T, G = 1, 4 and 8, key counts 0, 1, fewer than S and up to 3000 (split-KV), seqused_k below cu_seqlens_k's counts,
// causal, a window, softcap with ALiBi; outputs poisoned, every row against the float64 oracle; the kernel name says
// the call ran in place.
TEST(CudaForward, VarlenPagedDecodeStepRunsInPlace) {
  SKIP_WITHOUT_GPU();
  auto rng = fa_test::make_rng("cuda_forward_varlen_paged_uniform");
  struct Heads {
    int hq, hk;
  };
  for (const Heads heads : {Heads{8, 8}, Heads{16, 4}, Heads{32, 4}})
    for (bool one_row : {true, false})
      for (bool seqused : {false, true}) {
        const int group = heads.hq / heads.hk;
        const int t = std::max(1, 16 / group);
        const int rows = one_row ? 1 : t;
        const std::vector<int> lengths_k = {3000, 1, 0, 700, 2, 129, 1500};
        const std::vector<int> lengths_q(lengths_k.size(), rows);
        const fa_dtype dtype = seqused ? FA_BFLOAT16 : FA_FLOAT16;
        Call c = varlen_paged_call(rng, lengths_q, lengths_k, heads.hq, heads.hk, 128, 16, dtype, 2);
        if (seqused) {  // fewer keys than cu_seqlens_k says for some sequences (a cache filled ahead of the step)
          c.seqused_k = HostTensor({int(lengths_k.size())}, FA_INT32);
          for (size_t b = 0; b < lengths_k.size(); ++b) c.seqused_k.set_int(int64_t(b), lengths_k[b] - (b % 3 == 0 ? lengths_k[b] / 3 : 0));
        }
        for (int variant = 0; variant < 3; ++variant) {
          Call call = c;
          call.options.causal = variant != 1 ? 1 : 0;
          if (variant == 1) call.options.window_left = 100, call.options.window_right = 0;
          if (variant == 2) {
            call.options.softcap = 15.f;
            call.alibi = HostTensor({heads.hq}, FA_FLOAT32);
            call.alibi.fill_uniform(rng, 0.01, 0.3);
          }
          const std::string what = "Hq " + std::to_string(heads.hq) + " / Hk " + std::to_string(heads.hk) + ", " +
                                   std::to_string(rows) + " rows each" + (seqused ? ", seqused_k" : "") +
                                   (variant == 0 ? " causal" : variant == 1 ? " window (100, 0)" : " causal softcap alibi");
          const std::string kernel = checked_stats(what, call).kernel;
          EXPECT_NE(kernel.find("every sequence " + std::to_string(rows) + (rows == 1 ? " row" : " rows") + ", in place"),
                    std::string::npos)
              << what << " ran " << kernel;
          EXPECT_EQ(kernel.find("fwd_"), std::string::npos) << what << " ran " << kernel;
        }
      }
}

// A call that is not varlen, of Sq <= T = max(1, min(16, 32 / G)) query rows (64 / G over a paged cache) (a decode step or speculative tokens
// through fa_forward over a dense or paged cache, as torch SDPA users make it): the whole call in the decode kernels, in
// place (decode_plan.hpp, short_sequence_max_q). Sq = 1 and T at G = 1, 4 and 8, keys 3000 (split-KV) and 5, fewer
// keys than queries (causal
// rows without keys), seqused_k with an empty sequence, a window, softcap with ALiBi, D = 64 fp16, a paged cache; and
// Sq = T + 1, which stays in the forward kernel. Outputs poisoned, every row against the float64 oracle.
TEST(CudaForward, ShortDenseCallsRunInTheDecodeKernels) {
  SKIP_WITHOUT_GPU();
  auto rng = fa_test::make_rng("cuda_forward_short_dense");
  struct Heads {
    int hq, hk;
  };
  for (const Heads heads : {Heads{8, 8}, Heads{16, 4}, Heads{32, 4}}) {
    const int t = std::max(1, std::min(16, 32 / (heads.hq / heads.hk)));
    for (const int rows : {1, t, t + 1})
      for (const int keys : {3000, 5, 2})
        for (int variant = 0; variant < 4; ++variant) {
          if (keys == 2 && variant != 0) continue;  // Sq > Sk: the causal case only
          const int d = variant == 3 ? 64 : 128;
          const fa_dtype dtype = variant == 3 ? FA_FLOAT16 : FA_BFLOAT16;
          Call c = make_call(problem(3, rows, keys, heads.hq, heads.hk, d, dtype), rng);
          c.options.causal = variant != 1 ? 1 : 0;
          if (variant == 1) c.options.window_left = 100, c.options.window_right = 0;
          if (variant == 2) {
            c.options.softcap = 15.f;
            c.alibi = HostTensor({3, heads.hq}, FA_FLOAT32);
            c.alibi.fill_uniform(rng, 0.01, 0.3);
            c.seqused_k = HostTensor({3}, FA_INT32);
            c.seqused_k.set_int(0, keys);
            c.seqused_k.set_int(1, 0);
            c.seqused_k.set_int(2, keys / 2);
          }
          const std::string what = "Hq " + std::to_string(heads.hq) + " / Hk " + std::to_string(heads.hk) + ", Sq " +
                                   std::to_string(rows) + ", Sk " + std::to_string(keys) +
                                   (variant == 0   ? " causal"
                                    : variant == 1 ? " window (100, 0)"
                                    : variant == 2 ? " causal softcap alibi seqused_k"
                                                   : " causal D=64 f16");
          const std::string kernel = oracle_then_stats(what, c).kernel;
          if (rows <= t) {
            EXPECT_NE(kernel.find("dec_"), std::string::npos) << what << " ran " << kernel;
            EXPECT_NE(kernel.find(", in place"), std::string::npos) << what << " ran " << kernel;
            EXPECT_EQ(kernel.find("fwd_"), std::string::npos) << what << " ran " << kernel;
          } else {
            EXPECT_NE(kernel.find("fwd_"), std::string::npos) << what << " ran " << kernel;
            EXPECT_EQ(kernel.find("dec_"), std::string::npos) << what << " ran " << kernel;
          }
        }
  }
  // A paged cache, not varlen: the decode kernels' paged copies, up to 16 rows at G = 4 (64 packed rows); 17 rows run
  // in the forward kernel.
  for (const int block_size : {16, 5})
    for (const int rows : {2, 16, 17}) {
      const Call c = paged_causal_call(rng, rows, 16, 4, 900, block_size, {900, 1, 433});
      const std::string what = "paged block_size=" + std::to_string(block_size) + ", Sq " + std::to_string(rows) +
                               ", Hq 16 / Hk 4";
      const std::string kernel = oracle_then_stats(what, c).kernel;
      EXPECT_EQ(kernel.find("dec_") != std::string::npos, rows <= 16) << what << " ran " << kernel;
      EXPECT_EQ(kernel.find(", in place") != std::string::npos, rows <= 16) << what << " ran " << kernel;
    }
}

// D = 128 calls of at most 64 query rows that do not split (enough sequences x heads to fill the SMs) run the 64-row
// compact-epilogue tile (manifest.py): dense and varlen, causal or not, a window, partial tiles; 65 rows take the
// 128-row one. Outputs poisoned, against the float64 oracle.
TEST(CudaForward, ShortCallsTakeThe64RowTile) {
  SKIP_WITHOUT_GPU();
  auto rng = fa_test::make_rng("cuda_forward_short_m64");
  for (const int sq : {40, 64, 65})
    for (int variant = 0; variant < 3; ++variant) {
      const fa_dtype dtype = variant == 1 ? FA_FLOAT16 : FA_BFLOAT16;
      Call c = make_call(problem(8, sq, 1500, 32, 32, 128, dtype), rng);  // 8 x 32 CTAs: no split; G = 1: no packing
      c.options.causal = variant == 0 ? 1 : 0;
      if (variant == 2) c.options.window_left = 200, c.options.window_right = 10;
      const std::string what = "Sq " + std::to_string(sq) + (variant == 0 ? " causal" : variant == 1 ? " f16" : " window (200, 10)");
      const fa_stats stats = oracle_then_stats(what, c);
      const std::string kernel = stats.kernel;
      EXPECT_EQ(stats.num_splits, 1) << what << " ran " << kernel;
      EXPECT_EQ(kernel.find("_m64n64w4s2ce") != std::string::npos, sq <= 64) << what << " ran " << kernel;
    }
  fa_test::Problem p = problem(9, 0, 0, 32, 32, 128, FA_BFLOAT16);
  p.varlen_q = {64, 1, 0, 17, 64, 33, 64, 2, 50};
  p.varlen_k = {900, 5, 7, 17, 1200, 0, 64, 640, 300};
  Call c = make_call(p, rng);
  c.options.causal = 1;
  const std::string kernel = oracle_then_stats("varlen causal, max 64 rows", c).kernel;
  EXPECT_NE(kernel.find("_m64n64w4s2ce"), std::string::npos) << kernel;
}

// The library's split count forced for one scope (its test hook), the plan's restored after.
struct ForcedForwardSplits {
  explicit ForcedForwardSplits(int splits) { flashattn::cuda::sm80::set_forward_splits_for_tests(splits); }
  ~ForcedForwardSplits() { flashattn::cuda::sm80::set_forward_splits_for_tests(0); }
};

// GQA packing (src/cuda/sm80/forward_packing.hpp): a short call's G query heads of a K/V head in one grid row, G x Sq
// packed rows per tile. Every case against the float64 oracle (out and lse, outputs poisoned) and the kernel name says
// whether it packed: unsplit in the 64-row short-call row (dense G = 2; varlen at G = 4 and 8 with empty sequences, no
// keys, a window, softcap), split (the plan's count or a forced one) in the 64- and 128-row split rows, dense, seqused_k
// with an empty cache, paged (block sizes 16 and 5), Sq > Sk causal (rows with no key), D = 32, 64 and 256 (warp
// pairs), Sq = 64 (in 128-row tiles); and the calls that must not pack: ALiBi (a slope per query head), G = 1, D = 64
// unsplit (no row of that bucket packs unsplit).
TEST(CudaForward, GqaPackedShortCalls) {
  SKIP_WITHOUT_GPU();
  auto rng = fa_test::make_rng("cuda_forward_gqa_packed");
  auto check = [](const std::string& what, const Call& c, bool packed, const std::string& tile = "") {
    const std::string kernel = oracle_then_stats(what, c).kernel;
    EXPECT_EQ(kernel.find("gqa-packed") != std::string::npos, packed) << what << " ran " << kernel;
    if (!tile.empty()) {
      EXPECT_NE(kernel.find(tile), std::string::npos) << what << " ran " << kernel << ", not " << tile;
    }
  };
  auto varlen = [&](std::vector<int> lengths_q, std::vector<int> lengths_k, int hq, int hk, int d, fa_dtype dtype) {
    fa_test::Problem p = problem(int(lengths_q.size()), 0, 0, hq, hk, d, dtype);
    p.varlen_q = std::move(lengths_q);
    p.varlen_k = std::move(lengths_k);
    return make_call(p, rng);
  };
  {
    ForcedForwardSplits unsplit(1);
    Call c = make_call(problem(3, 24, 1000, 8, 4, 128, FA_BFLOAT16), rng);  // G = 2: 48 packed rows in one 64-row tile
    c.options.causal = 1;
    check("unsplit dense G=2 Sq=24 causal", c, true, "_m64n64w4s2ce");
    Call v = varlen({1, 16, 0, 9, 5}, {300, 900, 4, 0, 17}, 16, 4, 128, FA_FLOAT16);
    v.options.causal = 1;
    check("unsplit varlen G=4 causal", v, true, "_m64n64w4s2ce");
    Call w = varlen({8, 3, 7}, {700, 2, 64}, 32, 4, 128, FA_BFLOAT16);
    w.options.window_left = 50, w.options.window_right = 0, w.options.softcap = 30.f;
    check("unsplit varlen G=8 window (50, 0) softcap", w, true, "_m64n64w4s2ce");
    Call alibi = make_call(problem(3, 24, 1000, 8, 4, 128, FA_BFLOAT16), rng);
    alibi.alibi = HostTensor({8}, FA_FLOAT32);
    alibi.alibi.fill_uniform(rng, 0.01, 0.3);
    alibi.options.causal = 1;
    check("unsplit ALiBi G=2 (no packing)", alibi, false);
    check("unsplit D=64 G=2 (no packing row)", make_call(problem(3, 24, 1000, 8, 4, 64, FA_FLOAT16), rng), false);
    check("unsplit G=1 (nothing to pack)", make_call(problem(3, 24, 1000, 8, 8, 128, FA_BFLOAT16), rng), false);
    // Paged varlen steps of speculative tokens beside decode tokens (the decode kernels take sequences of at most
    // T = 16 / G rows): the 64-row paged row, packed; block sizes 16 (slot rows) and 5 (a lookup per row).
    for (int block_size : {16, 5}) {
      const std::string bs = " block_size=" + std::to_string(block_size);
      Call g4 = varlen_paged_call(rng, {1, 8, 16, 3, 0, 12}, {500, 900, 300, 64, 7, 1000}, 16, 4, 128, block_size,
                                  FA_BFLOAT16, 2);
      g4.options.causal = 1;
      check("unsplit paged varlen G=4 causal" + bs, g4, true, "_m64n64w4s2cepk");
      Call g8 = varlen_paged_call(rng, {2, 8, 5}, {40, 700, 129}, 32, 4, 128, block_size, FA_FLOAT16, 0);
      g8.options.window_left = 100, g8.options.window_right = 0;
      check("unsplit paged varlen G=8 window (100, 0)" + bs, g8, true, "_m64n64w4s2cepk");
      // 32 and 60 rows at G = 4: 128 and 240 packed rows, past the 64-row paged row; the 128-row paged packed-only row
      // (1 and 2 tiles against 4). 100 rows: 400 packed rows, 4 tiles against 4 of the 128-row paged row, not packed.
      Call wide = varlen_paged_call(rng, {32, 20}, {600, 333}, 16, 4, 128, block_size, FA_BFLOAT16, 1);
      wide.options.causal = 1;
      check("unsplit paged varlen G=4 32 rows" + bs, wide, true, "_m128n64w4s2cepkgp");
      Call wider = varlen_paged_call(rng, {60, 3, 41}, {600, 90, 1000}, 16, 4, 128, block_size, FA_FLOAT16, 1);
      wider.options.causal = 1;
      check("unsplit paged varlen G=4 60 rows" + bs, wider, true, "_m128n64w4s2cepkgp");
      Call widest = varlen_paged_call(rng, {100, 3, 70}, {600, 90, 1000}, 16, 4, 128, block_size, FA_FLOAT16, 1);
      widest.options.causal = 1;
      check("unsplit paged varlen G=4 100 rows (not packed)" + bs, widest, false, "_m128n64w4s2pk");
    }
    // Dense views of 65-512 packed rows: the 128-row packed-only row (47 rows at G = 4: 2 tiles against 4 of 64).
    Call d47 = make_call(problem(3, 47, 1000, 16, 4, 128, FA_BFLOAT16), rng);
    d47.options.causal = 1;
    check("unsplit dense G=4 Sq=47 causal", d47, true, "_m128n64w4s2cegp");
    Call v100 = varlen({100, 1, 0, 57}, {1200, 40, 8, 57}, 32, 4, 128, FA_FLOAT16);  // G = 8: 800 rows, past 512
    v100.options.causal = 1;
    check("unsplit varlen G=8 100 rows (not packed: 800 packed rows)", v100, false);
    Call v60 = varlen({60, 1, 0, 33}, {1200, 40, 8, 33}, 32, 4, 128, FA_BFLOAT16);  // G = 8: 480 rows, 4 tiles against 8
    v60.options.window_left = 200, v60.options.window_right = 0, v60.options.softcap = 20.f;
    check("unsplit varlen G=8 60 rows window softcap", v60, true, "_m128n64w4s2cegp");
  }
  {
    Call c = make_call(problem(1, 32, 8192, 32, 8, 128, FA_BFLOAT16), rng);  // 128 packed rows: the 128-row split row
    c.options.causal = 1;
    check("split (the plan's) B=1 Sq=32 G=4 over 8k causal", c, true, "sk splits=");
    Call used = c;
    used.seqused_k = HostTensor({1}, FA_INT32);
    used.seqused_k.set_int(0, 5000);
    check("split seqused_k", used, true, "sk splits=");
    for (int block_size : {16, 5}) {
      const Call paged = paged_causal_call(rng, 24, 16, 4, 3000, block_size, {3000, 0});
      check("split paged G=4 Sq=24 block_size=" + std::to_string(block_size), paged, true, "pksk splits=");
    }
    Call d256 = make_call(problem(1, 20, 3000, 16, 2, 256, FA_BFLOAT16), rng);
    d256.options.causal = 1;
    check("split D=256 G=8 Sq=20", d256, true, "sk splits=");
    check("split D=32 G=4 Sq=20", make_call(problem(1, 20, 3000, 16, 4, 32, FA_FLOAT16), rng), true, "sk splits=");
    check("split D=64 G=4 Sq=20", make_call(problem(1, 20, 3000, 16, 4, 64, FA_BFLOAT16), rng), true, "sk splits=");
    Call sq64 = make_call(problem(1, 64, 8192, 16, 8, 128, FA_BFLOAT16), rng);  // G = 2: 128 packed rows, 1 tile against 2
    check("split G=2 Sq=64", sq64, true, "_m128n64w4s2sk");
  }
  {
    ForcedForwardSplits forced(3);
    Call c = make_call(problem(2, 40, 30, 8, 2, 128, FA_FLOAT16), rng);  // Sq > Sk causal: rows 0..9 see no key
    c.options.causal = 1;
    check("split (3) Sq > Sk causal G=4", c, true, "sk splits=3");
    Call v = varlen({1, 16, 0, 9, 5}, {300, 900, 4, 0, 17}, 16, 4, 128, FA_BFLOAT16);
    v.options.causal = 1;
    check("split (3) varlen G=4 causal", v, true, "_m64n64w4s2sk splits=3");
    Call m64 = make_call(problem(1, 64, 2000, 8, 2, 128, FA_BFLOAT16), rng);  // 256 packed rows in 128-row tiles
    check("split (3) G=4 Sq=64", m64, true, "_m128n64w4s2sk splits=3");
  }
}

// A bad block id in a short (routed) sequence's device block table: that sequence's rows are NaN, the others exact.
TEST(CudaForward, VarlenPagedShortSequenceBadBlockIdGivesNan) {
  SKIP_WITHOUT_GPU();
  auto rng = fa_test::make_rng("cuda_forward_varlen_paged_short_bad_id");
  const std::vector<int> lengths_q = {1, 2, 30}, lengths_k = {400, 500, 300};
  const int hq = 8, hk = 2, d = 128, block_size = 16, total_q = 33;
  Call c = varlen_paged_call(rng, lengths_q, lengths_k, hq, hk, d, block_size, FA_BFLOAT16, 0, /*shuffle=*/false);
  const int max_blocks = int(c.block_table.shape()[1]), num_blocks = int(c.k.shape()[0]);
  c.options.causal = 1;
  const Expected e = oracle(c);
  c.block_table.set_int(max_blocks + 7, num_blocks + 5);  // sequence 1 (2 rows: routed at G = 4), keys 112..127
  ASSERT_TRUE(run_gpu(c).ok());
  const std::vector<double> out = c.out.to_double(), lse = c.lse.to_double();
  std::vector<double> got, ref;
  int64_t nan_out = 0, nan_lse = 0;
  for (int row = 0; row < total_q; ++row)
    for (int h = 0; h < hq; ++h) {
      const bool bad = row == 1 || row == 2;  // sequence 1's rows
      const double l = lse[int64_t(h) * total_q + row];
      if (bad) nan_lse += std::isnan(l);
      else EXPECT_FALSE(std::isnan(l)) << "row " << row << " h " << h;
      for (int x = 0; x < d; ++x) {
        const int64_t n = (int64_t(row) * hq + h) * d + x;
        if (bad) {
          nan_out += std::isnan(out[n]);
        } else {
          got.push_back(out[n]);
          ref.push_back(e.out64[n]);
        }
      }
    }
  EXPECT_EQ(nan_lse, 2 * hq);
  EXPECT_EQ(nan_out, 2 * hq * d);
  const fa_test::ErrorStats err = fa_test::compare(got, ref);
  EXPECT_LE(err.rel_l2, 1e-2) << err.to_string();
  EXPECT_EQ(err.nan, 0);
}

#if defined(FLASHATTN_WITH_CUDA)
// Sets whether the paged varlen forward's routed half may fork onto a side stream (common/stream_fork.hpp; on by
// default) for the scope; after it the environment's setting applies again.
struct ForkSwitch {
  explicit ForkSwitch(bool fork) { flashattn::cuda::set_stream_fork_enabled(fork); }
  ~ForkSwitch() { flashattn::cuda::clear_stream_fork_override(); }
  void set(bool fork) { flashattn::cuda::set_stream_fork_enabled(fork); }
};

// Captures the call into a CUDA graph on a stream of its own (after one eager call there: kernel attributes are set
// outside the capture) and replays it twice over poisoned out and lse: each replay must write `eager`'s bytes.
void expect_graph_replays_match(Call& c, const Call& eager) {
  DeviceCall d(c);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  fa_options o = d.options();
  o.stream = stream;
  ASSERT_TRUE(flashattn::forward(d.args(), o).ok());
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  const Status s = flashattn::forward(d.args(), o);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_TRUE(s.ok()) << s.to_string();
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int replay = 0; replay < 2; ++replay) {
    c.out.poison();
    c.lse.poison();
    d.upload_again(c.out);
    d.upload_again(c.lse);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    d.download(c.out);
    d.download(c.lse);
    EXPECT_EQ(std::memcmp(c.out.data(), eager.out.data(), size_t(c.out.storage_bytes())), 0) << "replay " << replay;
    EXPECT_EQ(std::memcmp(c.lse.data(), eager.lse.data(), size_t(c.lse.storage_bytes())), 0) << "replay " << replay;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}
#endif

// The routed call (key counts, decode call, forward; its scratch from the library's pool) and the in-place decode
// step (key counts, decode call) capture into a CUDA graph on a stream of their own, and each replay writes the eager
// call's out and lse, bit for bit, over poisoned ones.
TEST(CudaForward, VarlenPagedShortSequencesInACudaGraph) {
  SKIP_WITHOUT_GPU();
#if defined(FLASHATTN_WITH_CUDA)
  auto rng = fa_test::make_rng("cuda_forward_varlen_paged_short_graph");
  ForkSwitch fork_switch(false);
  // The routed call beside the forward kernel (its decode half on the caller's stream, then on the side stream:
  // common/stream_fork.hpp), and a decode step in place (every sequence 1 row; key counts copied).
  for (const bool fork : {false, true})
  for (const std::vector<int>& lengths_q : {std::vector<int>{1, 1, 37, 4, 1}, std::vector<int>{1, 1, 1, 1, 1}}) {
    const bool in_place = lengths_q[2] == 1;
    if (fork && in_place) continue;  // (nothing to fork)
    fork_switch.set(fork);
    SCOPED_TRACE(in_place ? "in place" : fork ? "routed, forked" : "routed");
    Call c = varlen_paged_call(rng, lengths_q, {3000, 200, 500, 900, 1}, 32, 8, 128, 16, FA_BFLOAT16, 1);
    c.options.causal = 1;
    Call eager = c;
    fa_stats stats{};
    ASSERT_TRUE(run_gpu(eager, &stats).ok());
    ASSERT_NE(std::string(stats.kernel).find("dec_"), std::string::npos) << stats.kernel;
    ASSERT_EQ(std::string(stats.kernel).find("in place") != std::string::npos, in_place) << stats.kernel;
    const int64_t forks = flashattn::cuda::stream_forks_made();
    expect_graph_replays_match(c, eager);
    // forked: its eager call and its capture both fork (the capture takes the side stream in)
    EXPECT_EQ(flashattn::cuda::stream_forks_made(), forks + (fork ? 2 : 0));
  }
#endif
}

// The routed sequences run on a side stream beside the forward kernel (src/cuda/common/stream_fork.hpp): the same
// bytes as with both halves on the caller's stream, and the call keeps the caller's stream order. On a stream of its
// own, behind a 1 GiB memset (a few hundred microseconds), out and lse are poisoned by a memset, the call runs, and its
// out and lse are copied to the host, all enqueued without a wait in between: a side half that started before the
// poison (no fork wait) would be overwritten by it, and a copy that ran before the side half ended (no join) would
// read poison. A decode sequence over 60000 keys keeps the side half longer than the forward's.
TEST(CudaForward, VarlenPagedShortSequencesBesideTheForward) {
  SKIP_WITHOUT_GPU();
#if defined(FLASHATTN_WITH_CUDA)
  auto rng = fa_test::make_rng("cuda_forward_varlen_paged_side_stream");
  Call c = varlen_paged_call(rng, {1, 3, 37, 1, 130, 2}, {60000, 200, 500, 900, 700, 1}, 32, 8, 128, 16, FA_BFLOAT16, 1);
  c.options.causal = 1;
  // Off for the serial reference, then on (the default: stream_fork.hpp).
  ForkSwitch fork_switch(false);
  Call serial = c;
  fa_stats stats{};
  const Status serial_status = run_gpu(serial, &stats);
  fork_switch.set(true);
  ASSERT_TRUE(serial_status.ok()) << serial_status.to_string();
  ASSERT_NE(std::string(stats.kernel).find("dec_"), std::string::npos) << stats.kernel;
  ASSERT_NE(std::string(stats.kernel).find("fwd_"), std::string::npos) << stats.kernel;
  Call forked = c;
  const int64_t forks_before = flashattn::cuda::stream_forks_made();
  ASSERT_TRUE(run_gpu(forked).ok());
  ASSERT_EQ(flashattn::cuda::stream_forks_made(), forks_before + 1) << "the call did not fork";
  EXPECT_EQ(std::memcmp(forked.out.data(), serial.out.data(), size_t(serial.out.storage_bytes())), 0);
  EXPECT_EQ(std::memcmp(forked.lse.data(), serial.lse.data(), size_t(serial.lse.storage_bytes())), 0);

  Call ordered = c;
  DeviceCall d(ordered);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  void* slow = nullptr;
  const size_t slow_bytes = size_t(1) << 30;
  ASSERT_EQ(cudaMalloc(&slow, slow_bytes), cudaSuccess);
  fa_options o = d.options();
  o.stream = stream;
  for (int round = 0; round < 3; ++round) {
    ASSERT_EQ(cudaMemsetAsync(slow, round, slow_bytes, stream), cudaSuccess);
    ASSERT_EQ(cudaMemsetAsync(d.device_data(ordered.out), 0xff, size_t(ordered.out.storage_bytes()), stream), cudaSuccess);
    ASSERT_EQ(cudaMemsetAsync(d.device_data(ordered.lse), 0xff, size_t(ordered.lse.storage_bytes()), stream), cudaSuccess);
    const int64_t forks = flashattn::cuda::stream_forks_made();
    const Status s = flashattn::forward(d.args(), o);
    ASSERT_TRUE(s.ok()) << s.to_string();
    ASSERT_EQ(flashattn::cuda::stream_forks_made(), forks + 1) << "round " << round << ": the call did not fork";
    ASSERT_EQ(cudaMemcpyAsync(ordered.out.data(), d.device_data(ordered.out), size_t(ordered.out.storage_bytes()),
                              cudaMemcpyDeviceToHost, stream),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpyAsync(ordered.lse.data(), d.device_data(ordered.lse), size_t(ordered.lse.storage_bytes()),
                              cudaMemcpyDeviceToHost, stream),
              cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_EQ(std::memcmp(ordered.out.data(), serial.out.data(), size_t(serial.out.storage_bytes())), 0) << "round " << round;
    EXPECT_EQ(std::memcmp(ordered.lse.data(), serial.lse.data(), size_t(serial.lse.storage_bytes())), 0) << "round " << round;
  }
  cudaFree(slow);
  cudaStreamDestroy(stream);
#endif
}

// FLASHATTN_STREAM_FORK's values (src/cuda/common/stream_fork.hpp): unset is the default, "0" and "1" switch, anything
// else is refused. Host code: runs in every CUDA build.
TEST(CudaForward, StreamForkEnvironmentSetting) {
#if defined(FLASHATTN_WITH_CUDA)
  using flashattn::cuda::parse_stream_fork_setting;
  bool enabled = false;
  EXPECT_TRUE(parse_stream_fork_setting(nullptr, &enabled));
  EXPECT_EQ(enabled, flashattn::cuda::kStreamForkByDefault);
  EXPECT_TRUE(parse_stream_fork_setting("0", &enabled));
  EXPECT_FALSE(enabled);
  EXPECT_TRUE(parse_stream_fork_setting("1", &enabled));
  EXPECT_TRUE(enabled);
  for (const char* bad : {"", "2", "yes", "on", " 1", "1 ", "01", "true"}) {
    enabled = true;
    EXPECT_FALSE(parse_stream_fork_setting(bad, &enabled)) << "'" << bad << "'";
    EXPECT_TRUE(enabled) << "'" << bad << "' changed the setting";
  }
  // The override, and back to the environment's setting (the variable as this process has it) once it is cleared.
  bool from_environment = false;
  const bool valid = parse_stream_fork_setting(std::getenv(flashattn::cuda::kStreamForkVariable), &from_environment);
  for (const bool on : {false, true}) {
    flashattn::cuda::set_stream_fork_enabled(on);
    EXPECT_EQ(flashattn::cuda::stream_fork_enabled(), on);
    EXPECT_TRUE(flashattn::cuda::stream_fork_setting().ok());
  }
  flashattn::cuda::clear_stream_fork_override();
  EXPECT_EQ(flashattn::cuda::stream_fork_enabled(), valid && from_environment);
  EXPECT_EQ(flashattn::cuda::stream_fork_setting().ok(), valid);
#else
  GTEST_SKIP() << "no CUDA in this build";
#endif
}

// The routed sequences' two ways (src/cuda/decode/kvcache.hpp, set_routed_copies_for_tests): the decode call over the
// forward's own rows (the default: no gather, no scatter; padding rows neither read nor written) and over padded
// copies give the same bytes, over poisoned out and lse, on the caller's stream and forked. The lengths put routed
// sequences first (sequence 0's padding rows would lie before q's first row), back to back (a padding row of one is a
// row of the one before), before and after long ones and beside empty ones.
TEST(CudaForward, VarlenPagedShortSequencesInPlaceMatchTheCopies) {
  SKIP_WITHOUT_GPU();
#if defined(FLASHATTN_WITH_CUDA)
  auto rng = fa_test::make_rng("cuda_forward_varlen_paged_in_place_rows");
  struct Copies {  // the setting for the scope (default: in place)
    ~Copies() { flashattn::cuda::decode::set_routed_copies_for_tests(false); }
    void set(bool copies) { flashattn::cuda::decode::set_routed_copies_for_tests(copies); }
  } copies_switch;
  ForkSwitch fork_switch(false);
  struct Heads {
    int hq, hk;
  };
  for (const Heads heads : {Heads{32, 8}, Heads{8, 8}, Heads{16, 2}})
    for (const std::vector<int>& lengths_q : {std::vector<int>{1, 2, 1, 37, 3, 0, 1, 130, 2},
                                              std::vector<int>{2, 40, 1, 1, 1, 1, 65, 1}})
      for (const bool fork : {false, true}) {
        const std::vector<int> lengths_k = {3000, 200, 17, 900, 1, 64, 700, 1500, 5};
        const std::vector<int> keys(lengths_k.begin(), lengths_k.begin() + int(lengths_q.size()));
        Call c = varlen_paged_call(rng, lengths_q, keys, heads.hq, heads.hk, 128, 16, FA_BFLOAT16, 1);
        c.options.causal = 1;
        const std::string what = "Hq " + std::to_string(heads.hq) + " / Hk " + std::to_string(heads.hk) + " lengths " +
                                 std::to_string(lengths_q.size()) + (fork ? " forked" : "");
        fork_switch.set(fork);
        Call copied = c, in_place = c;
        for (Call* call : {&copied, &in_place}) {  // (run_gpu poisons out and lse)
          copies_switch.set(call == &copied);
          fa_stats stats{};
          const Status st = run_gpu(*call, &stats);
          ASSERT_TRUE(st.ok()) << what << ": " << st.to_string();
          EXPECT_NE(std::string(stats.kernel).find("dec_"), std::string::npos) << what << " ran " << stats.kernel;
        }
        copies_switch.set(false);
        EXPECT_EQ(std::memcmp(in_place.out.data(), copied.out.data(), size_t(copied.out.storage_bytes())), 0) << what;
        EXPECT_EQ(std::memcmp(in_place.lse.data(), copied.lse.data(), size_t(copied.lse.storage_bytes())), 0) << what;
        check_against_oracle(what, in_place);
      }
#endif
}

// ---- split-KV (src/cuda/sm80/forward_split.hpp) ----

// check_against_oracle, then the call once more for its fa_stats: a split call (splits > 1) runs a split row ("sk") and
// the merge, and reports its split count.
// tile: when not empty, the split kernel's name must hold it (e.g. "_m64n64": the 64-row split rows of D = 128).
fa_stats check_split_call(const std::string& what, const Call& call, int splits, const std::string& tile = "") {
  const fa_stats stats = oracle_then_stats(what, call);
  const std::string kernel = stats.kernel;
  if (splits > 1) {
    EXPECT_NE(kernel.find("sk splits=" + std::to_string(splits) + " + combine"), std::string::npos) << what << " ran " << kernel;
    if (!tile.empty()) {
      EXPECT_NE(kernel.find(tile), std::string::npos) << what << " ran " << kernel << ", not a " << tile << " tile";
    }
    EXPECT_EQ(stats.num_splits, splits) << what;
    EXPECT_GT(stats.scratch_bytes_peak, 0) << what;
  } else {
    EXPECT_EQ(kernel.find("combine"), std::string::npos) << what << " ran " << kernel;
  }
  return stats;
}

// Every split count gives the oracle's result: 1 (no split), 2, 3, 5 and 32 (more splits than key tiles: empty shares,
// whose rows weigh nothing), every head-dim bucket, causal or not (the diagonal tile in the last share), windows that
// leave rows without a key in a share or in all of them (O = 0, LSE = -inf), softcap with ALiBi, varlen with empty
// sequences, seqused_k, paged caches (slot ids and per-row lookups), a paged varlen serving step whose short
// sequences run in the decode kernels (the merge must leave their rows alone), and D = 128's 64-row split rows (calls
// of at most 64 query rows: dense, varlen, paged). Outputs poisoned.
TEST(CudaForward, SplitKvMatchesOracleAtEveryCount) {
  SKIP_WITHOUT_GPU();
  auto rng = fa_test::make_rng("cuda_forward_split_kv");
  for (int splits : {1, 2, 3, 5, 32}) {
    ForcedForwardSplits forced(splits);
    const std::string n = " splits=" + std::to_string(splits);
    for (int d : {32, 64, 96, 128, 192, 256})
      for (int causal : {0, 1}) {
        const fa_dtype dtype = (d / 32 + causal) % 2 == 0 ? FA_BFLOAT16 : FA_FLOAT16;
        Call c = make_call(problem(2, 130, 700, 4, 2, d, dtype), rng);
        c.options.causal = causal;
        check_split_call(std::string(short_name(dtype)) + " D=" + std::to_string(d) + (causal ? " causal" : "") + n, c, splits);
      }
    for (const auto& w : {std::pair<int, int>{32, 16}, std::pair<int, int>{200, 0}, std::pair<int, int>{-1, 5}}) {
      Call c = make_call(problem(2, 400, 650, 2, 1, 128, FA_FLOAT16), rng);  // Sq < Sk
      c.options.window_left = w.first;
      c.options.window_right = w.second;
      check_split_call("window (" + std::to_string(w.first) + ", " + std::to_string(w.second) + ")" + n, c, splits);
    }
    {
      Call c = make_call(problem(1, 700, 300, 2, 2, 64, FA_BFLOAT16), rng);
      c.options.causal = 1;  // rows 0..399 see no key at all
      check_split_call("causal Sq > Sk: fully masked rows" + n, c, splits);
    }
    {
      Call c = make_call(problem(2, 140, 600, 4, 2, 256, FA_FLOAT16), rng);
      c.alibi = HostTensor({2, 4}, FA_FLOAT32);
      c.alibi.fill_uniform(rng, 0.01, 0.5);
      c.options.softcap = 20.f;
      c.options.causal = 1;
      check_split_call("alibi (B, Hq) + softcap causal D=256" + n, c, splits);
    }
    {
      fa_test::Problem p = problem(5, 0, 0, 4, 2, 128, FA_BFLOAT16);
      p.varlen_q = {1, 130, 0, 257, 64};
      p.varlen_k = {17, 1000, 40, 300, 0};
      Call c = make_call(p, rng);
      c.options.causal = 1;
      check_split_call("varlen causal" + n, c, splits);
    }
    {
      Call c = make_call(problem(3, 90, 900, 2, 1, 64, FA_FLOAT16), rng);
      c.seqused_k = HostTensor({3}, FA_INT32);
      c.seqused_k.set_int(0, 900);
      c.seqused_k.set_int(1, 77);
      c.seqused_k.set_int(2, 0);
      check_split_call("seqused_k" + n, c, splits);
    }
    for (int block_size : {16, 5}) {
      const Call c = paged_causal_call(rng, 70, 4, 2, 800, block_size, {800, 1, 431});
      check_split_call("paged block_size=" + std::to_string(block_size) + n, c, splits);
    }
    {
      // decode tokens (1 row: the decode kernels at G = 4) beside chunks of 37 and 120 rows (the split forward kernel)
      Call c = varlen_paged_call(rng, {1, 37, 0, 120, 1}, {3000, 600, 9, 900, 1}, 8, 2, 128, 16, FA_BFLOAT16, 2);
      c.options.causal = 1;
      check_split_call("paged varlen step with decode tokens" + n, c, splits);
    }
    // D = 128, at most 64 query rows: the 64-row split rows (16 rows per warp); a partial tile, one row, varlen, paged.
    // G = 1, so that no call packs (the packed cases follow). (Sq <= 16 would run in the decode kernels: not varlen,
    // short_call_max_q; the varlen case has 1 row)
    for (const auto& [sq, causal, dtype] : {std::tuple<int, int, fa_dtype>{64, 1, FA_BFLOAT16}, {33, 0, FA_FLOAT16},
                                            {17, 1, FA_BFLOAT16}}) {
      Call c = make_call(problem(2, sq, 700, 4, 4, 128, dtype), rng);
      c.options.causal = causal;
      check_split_call("64-row split tile Sq=" + std::to_string(sq) + (causal ? " causal" : "") + n, c, splits, "_m64n64");
    }
    {
      fa_test::Problem p = problem(4, 0, 0, 4, 4, 128, FA_FLOAT16);
      p.varlen_q = {1, 64, 0, 17};
      p.varlen_k = {500, 900, 3, 64};
      Call c = make_call(p, rng);
      c.options.causal = 1;
      check_split_call("64-row split tile varlen causal" + n, c, splits, "_m64n64");
    }
    {
      const Call c = paged_causal_call(rng, 50, 4, 4, 640, 16, {640, 333});
      check_split_call("64-row split tile paged" + n, c, splits, "_m64n64");
    }
    // GQA-packed split calls (forward_packing.hpp): G x Sq packed rows per K/V head in the 64- and 128-row split rows.
    for (const auto& [sq, hq, hk, causal] : {std::tuple<int, int, int, int>{17, 8, 2, 1}, {40, 16, 2, 0}, {50, 8, 4, 1}}) {
      Call c = make_call(problem(2, sq, 900, hq, hk, 128, FA_BFLOAT16), rng);
      c.options.causal = causal;
      const std::string what = "packed Sq=" + std::to_string(sq) + " G=" + std::to_string(hq / hk) + n;
      const std::string kernel = check_split_call(what, c, splits).kernel;
      if (splits > 1) {
        EXPECT_NE(kernel.find("gqa-packed"), std::string::npos) << what << " ran " << kernel;
      }
    }
  }
}

// The plan splits where the unsplit grid leaves SMs idle (B = 1, Hq = 32: 32 CTAs for Sq = 128), not where it fills the
// device (Sq = 2048 over 16 sequences); dropout never splits. The split call also captures into a CUDA graph (its
// partials from the library's pool), each replay bit-identical to the eager call.
TEST(CudaForward, SplitKvPlanAndCudaGraph) {
  SKIP_WITHOUT_GPU();
#if defined(FLASHATTN_WITH_CUDA)
  auto rng = fa_test::make_rng("cuda_forward_split_plan");
  Call c = make_call(problem(1, 128, 4096, 32, 8, 128, FA_BFLOAT16), rng);
  c.options.causal = 1;
  {
    Call checked = c;
    check_against_oracle("B = 1, Sq = 128, Sk = 4096, Hq = 32 / Hk = 8", checked);
  }
  Call eager = c;
  fa_stats stats{};
  ASSERT_TRUE(run_gpu(eager, &stats).ok());
  EXPECT_GT(stats.num_splits, 1) << stats.kernel;
  EXPECT_NE(std::string(stats.kernel).find("combine"), std::string::npos) << stats.kernel;
  {
    Call big = make_call(problem(16, 2048, 2048, 8, 8, 128, FA_BFLOAT16), rng);
    fa_stats big_stats{};
    ASSERT_TRUE(run_gpu(big, &big_stats).ok());
    EXPECT_EQ(big_stats.num_splits, 1) << big_stats.kernel;
    Call dropout = make_call(problem(1, 128, 4096, 32, 8, 128, FA_BFLOAT16), rng);
    dropout.options.dropout_p = 0.1f;
    fa_stats dropout_stats{};
    ASSERT_TRUE(run_gpu(dropout, &dropout_stats).ok());
    EXPECT_EQ(dropout_stats.num_splits, 1) << dropout_stats.kernel;
  }
  expect_graph_replays_match(c, eager);
#endif
}

// Varlen calls split by sequence (the work list, forward_split.hpp): the device's plan counts the query tiles that
// really run, so a serving step of many decode tokens (the decode kernels') beside one chunk over a long prefix splits
// the chunk, which the B x longest-sequence count never did; a sequence of few keys in the same call takes one split
// and writes its rows itself, beside the merged ones. Each against the oracle (outputs poisoned), then captured into a
// CUDA graph whose replays match the eager call bit for bit.
TEST(CudaForward, VarlenSplitsBySequence) {
  SKIP_WITHOUT_GPU();
#if defined(FLASHATTN_WITH_CUDA)
  auto rng = fa_test::make_rng("cuda_forward_varlen_work_list");
  {
    // 24 decode tokens and a chunk of 100 rows over 3000 keys (G = 4: 400 packed rows), paged, bf16
    std::vector<int> lengths_q(24, 1), lengths_k(24, 700);
    lengths_q[7] = 100;
    lengths_k[7] = 3000;
    Call c = varlen_paged_call(rng, lengths_q, lengths_k, 8, 2, 128, 16, FA_BFLOAT16, 3);
    c.options.causal = 1;
    const fa_stats stats = oracle_then_stats("24 decode tokens + a chunk of 100 over 3000 keys", c);
    EXPECT_GT(stats.num_splits, 1) << stats.kernel;
    EXPECT_NE(std::string(stats.kernel).find("sk splits="), std::string::npos) << stats.kernel;
    EXPECT_NE(std::string(stats.kernel).find("combine"), std::string::npos) << stats.kernel;
    Call eager = c;
    ASSERT_TRUE(run_gpu(eager, nullptr).ok());
    expect_graph_replays_match(c, eager);
  }
  for (const auto& [d, dtype, causal] : {std::tuple<int, fa_dtype, int>{128, FA_FLOAT16, 1}, {64, FA_BFLOAT16, 0},
                                         {256, FA_FLOAT16, 1}}) {
    // one long sequence (splits), one of few keys (one split: its own out and lse), an empty one, contiguous K/V
    fa_test::Problem p = problem(4, 0, 0, 4, 2, d, dtype);
    p.varlen_q = {50, 30, 0, 9};
    p.varlen_k = {3000, 100, 0, 2200};
    Call c = make_call(p, rng);
    c.options.causal = causal;
    const std::string what = "varlen D=" + std::to_string(d) + (causal ? " causal" : "");
    const fa_stats stats = oracle_then_stats(what, c);
    EXPECT_GT(stats.num_splits, 1) << what << " ran " << stats.kernel;
  }
  {
    // 12 sequences of 256 rows over 1024 keys, Hq = Hk = 32: the longest alone would split (64 CTAs), but q's 3072 rows
    // surely fill the device (768 CTAs): no plan kernel, no split
    fa_test::Problem p = problem(12, 0, 0, 32, 32, 128, FA_BFLOAT16);
    p.varlen_q.assign(12, 256);
    p.varlen_k.assign(12, 1024);
    Call c = make_call(p, rng);
    fa_stats stats{};
    ASSERT_TRUE(run_gpu(c, &stats).ok());
    EXPECT_EQ(stats.num_splits, 1) << stats.kernel;
    EXPECT_EQ(std::string(stats.kernel).find("combine"), std::string::npos) << stats.kernel;
  }
#endif
}

// A bad block id in a split call: the shares that meet it are NaN, and the merge makes every row of that sequence NaN
// (as the unsplit kernel does), the other sequences' rows finite.
TEST(CudaForward, SplitKvBadBlockIdGivesNan) {
  SKIP_WITHOUT_GPU();
  auto rng = fa_test::make_rng("cuda_forward_split_bad_id");
  ForcedForwardSplits forced(4);
  const int batch = 3, hq = 4, hk = 2, sq = 70, d = 128;
  for (int block_size : {16, 5}) {
    Call c;
    c.q = HostTensor({batch, sq, hq, d}, FA_BFLOAT16);
    c.q.fill_normal(rng);
    make_paged_cache(c, rng, batch, 1000, block_size, hk, d, FA_BFLOAT16, false);
    c.out = HostTensor({batch, sq, hq, d}, FA_BFLOAT16);
    c.lse = HostTensor({batch, hq, sq}, FA_FLOAT32);
    const int max_blocks = int(c.block_table.shape()[1]);
    c.block_table.set_int(max_blocks + 100 / block_size, 1 << 20);  // keys around 100 of sequence 1: its first share
    fa_stats stats{};
    ASSERT_TRUE(run_gpu(c, &stats).ok());
    ASSERT_EQ(stats.num_splits, 4) << stats.kernel;
    const std::vector<double> out = c.out.to_double(), lse = c.lse.to_double();
    for (int b = 0; b < batch; ++b)
      for (int h = 0; h < hq; ++h)
        for (int i = 0; i < sq; ++i) {
          const double l = lse[(int64_t(b) * hq + h) * sq + i];
          const double o = out[((int64_t(b) * sq + i) * hq + h) * d + 5];
          EXPECT_EQ(std::isnan(l), b == 1) << "block_size " << block_size << " b " << b << " h " << h << " i " << i;
          EXPECT_EQ(std::isnan(o), b == 1) << "block_size " << block_size << " b " << b << " h " << h << " i " << i;
        }
  }
}

TEST(CudaForward, StridedTensors) {
  SKIP_WITHOUT_GPU();
  auto rng = fa_test::make_rng("cuda_forward_strided");
  // D = 128 calls of at most 1k query rows run the compact-epilogue kernel, whose stores step through out's row stride
  // from one base: the padding check below covers both epilogues.
  for (int d : {64, 128}) {
    SCOPED_TRACE("D = " + std::to_string(d));
    const int b = 2, sq = 100, sk = 140, hq = 4, hk = 2;
    Call c;
    // heads interleaved with padding: (B, S, H, D) with row stride H * (D + 16) and head stride D + 16
    c.q = HostTensor({b, sq, hq, d}, {int64_t(sq) * hq * (d + 16), hq * (d + 16), d + 16, 1}, FA_FLOAT16);
    c.k = HostTensor({b, sk, hk, d}, {int64_t(sk) * hk * (d + 8), hk * (d + 8), d + 8, 1}, FA_FLOAT16);
    // v stored head-major (B, H, S, D) and viewed as (B, S, H, D)
    c.v = HostTensor({b, sk, hk, d}, {int64_t(hk) * sk * d, d, int64_t(sk) * d, 1}, FA_FLOAT16);
    c.out = HostTensor({b, sq, hq, d}, {int64_t(sq) * hq * (d + 24), hq * (d + 24), d + 24, 1}, FA_FLOAT16);
    c.lse = HostTensor({b, hq, sq}, FA_FLOAT32);
    c.q.fill_normal(rng);
    c.k.fill_normal(rng);
    c.v.fill_normal(rng);
    c.options.causal = 1;
    check_against_oracle("strided q/k/v/out", c);
    // the padding of out stays untouched (poisoned NaN) and was not written
    int64_t padding = 0, padding_nan = 0;
    const auto* raw = static_cast<const uint16_t*>(c.out.data());
    for (int64_t e = 0; e < c.out.storage_bytes() / 2; ++e) {
      if (e % (d + 24) < d) continue;
      ++padding;
      padding_nan += (raw[e] & 0x7c00) == 0x7c00 && (raw[e] & 0x3ff) != 0;
    }
    EXPECT_GT(padding, 0);
    EXPECT_EQ(padding_nan, padding) << "the kernel wrote into the padding between out's heads";
  }
}

// ---- dropout ----

// With V = identity rows (key j carries e_j) the output is O[i][j] = P[i][j] * keep(i, j) / (1 - p), so
// each output element shows the keep bit of (b, h, i, j): compared bit for bit with core/philox.hpp.
TEST(CudaForward, DropoutKeepMaskIsBitIdenticalToPhilox) {
  SKIP_WITHOUT_GPU();
  auto rng = fa_test::make_rng("cuda_forward_dropout_mask");
  for (int d : {64, 128, 256}) {
    const int b = 2, hq = 4, hk = 2, sq = 200, sk = d;  // keys <= D: key j writes column j
    Call c = make_call(problem(b, sq, sk, hq, hk, d, FA_BFLOAT16, 0.5), rng);
    for (int64_t n = 0; n < c.v.numel(); ++n) {
      const int64_t col = n % d, key = (n / (d * hk)) % sk;
      c.v.set(n, col == key ? 1.0 : 0.0);
    }
    c.options.dropout_p = 0.3f;
    c.options.dropout_seed = rng();
    c.options.dropout_offset = rng();
    const Status s = run_gpu(c);
    ASSERT_TRUE(s.ok()) << s.to_string();
    const uint32_t threshold = flashattn::dropout_threshold_u16(c.options.dropout_p);
    int64_t mismatches = 0, kept = 0, total = 0;
    for (int bi = 0; bi < b; ++bi)
      for (int i = 0; i < sq; ++i)
        for (int h = 0; h < hq; ++h)
          for (int j = 0; j < sk; ++j) {
            const double o = c.out.get(((int64_t(bi) * sq + i) * hq + h) * d + j);
            ASSERT_TRUE(std::isfinite(o)) << "out not written at " << bi << "," << i << "," << h << "," << j;
            const bool gpu_keep = o != 0.0;
            const bool ref_keep = flashattn::dropout_keep(c.options.dropout_seed, c.options.dropout_offset,
                                                          uint32_t(bi * hq + h), uint32_t(i), uint32_t(j), threshold);
            mismatches += gpu_keep != ref_keep;
            kept += gpu_keep;
            ++total;
          }
    EXPECT_EQ(mismatches, 0) << "D=" << d << ": keep bits differ from core/philox.hpp in " << mismatches << " of " << total;
    // keep rate within 4 sigma of 1 - p
    const double rate = double(kept) / double(total), expected = 0.7;
    EXPECT_NEAR(rate, expected, 4.0 * std::sqrt(expected * (1 - expected) / double(total))) << "D=" << d;
  }
}

TEST(CudaForward, DropoutMatchesOracle) {
  SKIP_WITHOUT_GPU();
  auto rng = fa_test::make_rng("cuda_forward_dropout");
  for (fa_dtype dtype : {FA_FLOAT16, FA_BFLOAT16})
    for (int d : {32, 64, 96, 128, 192, 256}) {
      Call c = make_call(problem(2, 130, 170, 4, 2, d, dtype), rng);
      c.options.dropout_p = 0.17f;
      c.options.dropout_seed = rng();
      c.options.dropout_offset = rng();
      c.options.causal = d % 64 == 0;
      check_against_oracle(std::string("dropout ") + short_name(dtype) + " D=" + std::to_string(d), c);
    }
}

// ---- determinism, reports, errors ----

TEST(CudaForward, RunTwiceBitIdenticalAndReportsKernel) {
  SKIP_WITHOUT_GPU();
  auto rng = fa_test::make_rng("cuda_forward_twice");
  Call c = make_call(problem(2, 300, 300, 4, 4, 128, FA_BFLOAT16), rng);
  c.options.dropout_p = 0.1f;
  fa_stats stats{};
  ASSERT_TRUE(run_gpu(c, &stats).ok());
  const HostTensor first = c.out;
  ASSERT_TRUE(run_gpu(c).ok());
  EXPECT_EQ(std::memcmp(first.data(), c.out.data(), size_t(first.storage_bytes())), 0);
  EXPECT_NE(std::string(stats.kernel).find("fwd_sm80_bf16_d128"), std::string::npos) << stats.kernel;
  EXPECT_EQ(stats.scratch_bytes_peak, 0);  // the forward allocates nothing
}

TEST(CudaForward, UnsupportedCombinationsAreClearErrors) {
  SKIP_WITHOUT_GPU();
  auto rng = fa_test::make_rng("cuda_forward_errors");
  {
    Call c = make_call(problem(1, 10, 10, 1, 1, 64, FA_FLOAT32), rng);
    const Status s = run_gpu(c);
    EXPECT_EQ(s.code(), FA_ERROR_UNSUPPORTED);
    EXPECT_EQ(s.message().rfind("q: dtype float32", 0), 0u) << s.message();
  }
  {
    Call c = make_call(problem(1, 10, 10, 1, 1, 264, FA_FLOAT16), rng);
    const Status s = run_gpu(c);
    EXPECT_EQ(s.code(), FA_ERROR_NOT_COMPILED);
    EXPECT_EQ(s.message().rfind("q: head dim 264 is not compiled", 0), 0u) << s.message();
  }
  {
    Call c = make_call(problem(1, 10, 10, 1, 1, 60, FA_FLOAT16), rng);
    const Status s = run_gpu(c);
    EXPECT_EQ(s.code(), FA_ERROR_UNSUPPORTED);
    EXPECT_NE(s.message().find("multiple of 8"), std::string::npos) << s.message();
  }
}

}  // namespace
