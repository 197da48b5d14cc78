// The CUDA backward (src/cuda/sm80/backward_*) through the public API (fa_backward, backend = cuda),
// against the float64 oracle's analytic gradients under the tolerance rule of DESIGN.md.
//
// Every GPU case draws fresh inputs (FA_TEST_SEED reproduces one), feeds the backward the forward's
// out (rounded to the dtype) and lse from the oracle (so a backward bug is not masked or caused by the
// forward kernel; one end-to-end test uses the GPU forward's), poisons dq/dk/dv with NaN on the device
// before the call, and compares all three gradients. Options: odd sizes, Sq != Sk, GQA/MQA, causal and
// windows (with fully masked rows), softcap, ALiBi, dropout (keep bits compared bit for bit with
// core/philox.hpp), varlen, strided tensors, head dims between buckets, peaky softmax, deterministic
// mode (two runs compared bitwise), caller-provided workspace. Without a GPU (CI) the GPU tests skip
// with a message; the plan tests (tile ranges, workspace layout) run everywhere.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "core/mask.hpp"
#include "core/philox.hpp"
#include "cuda/sm80/backward_plan.hpp"
#include "testing.hpp"

#if defined(FLASHATTN_WITH_CUDA)
#include <cuda_runtime.h>

#include "cuda/generated/kernel_table.hpp"
#endif

namespace {

using fa_test::HostTensor;
using flashattn::Status;
namespace sm80 = flashattn::cuda::sm80;

// ---- the plan (host only) ----

// query_tiles_of_key_tile / first_key_tile_of_query_tile against brute force over every (i, j):
// the ranges must hold every tile pair with a visible element (else gradients are lost), and the key
// tiles of each query tile must be contiguous from first_key_tile (the deterministic semaphores).
TEST(CudaBackwardPlan, TileRangesMatchBruteForce) {
  auto rng = fa_test::make_rng("cuda_backward_plan_tiles");
  std::uniform_int_distribution<int> size(1, 300), window(-1, 120);
  for (int trial = 0; trial < 400; ++trial) {
    const int sq = size(rng), sk = size(rng);
    int left = window(rng), right = window(rng);
    if (trial % 4 == 0) right = 0;  // causal-like
    const int block_m = trial % 2 ? 64 : 32, block_n = trial % 3 ? 128 : 64;
    const flashattn::WindowMask mask(left, right, sq, sk);
    const int tiles_m = (sq + block_m - 1) / block_m, tiles_n = (sk + block_n - 1) / block_n;
    std::vector<std::vector<int>> works(tiles_m, std::vector<int>(tiles_n, 0));
    for (int n = 0; n < tiles_n; ++n) {
      const sm80::TileRange r = sm80::query_tiles_of_key_tile(mask, sq, sk, block_m, block_n, n);
      ASSERT_GE(r.begin, 0);
      ASSERT_LE(r.end, tiles_m);
      for (int m = r.begin; m < r.end; ++m) works[m][n] = 1;
      // The lean iteration's mask range: exactly the tiles of r whose every (i, j) is visible and inside the sequence.
      const sm80::TileRange u = sm80::unmasked_query_tiles(mask, sq, sk, block_m, block_n, n, r);
      for (int m = r.begin; m < r.end; ++m) {
        bool whole = (n + 1) * block_n <= sk;
        for (int i = m * block_m; whole && i < std::min((m + 1) * block_m, sq); ++i)
          for (int j = n * block_n; whole && j < (n + 1) * block_n; ++j) whole = mask.visible(i, j);
        EXPECT_EQ(m >= u.begin && m < u.end, whole) << "m=" << m << " n=" << n << " sq=" << sq << " sk=" << sk
                                                    << " window=(" << left << ", " << right << ")";
      }
    }
    for (int i = 0; i < sq; ++i)
      for (int j = 0; j < sk; ++j)
        if (mask.visible(i, j)) {
          ASSERT_TRUE(works[i / block_m][j / block_n]) << "visible (" << i << ", " << j << ") skipped: sq=" << sq << " sk=" << sk
                                                       << " window=(" << left << ", " << right << ")";
        }
    for (int m = 0; m < tiles_m; ++m) {
      const int first = sm80::first_key_tile_of_query_tile(mask, block_m, block_n, m);
      int n = 0;
      while (n < tiles_n && !works[m][n]) ++n;
      if (n == tiles_n) continue;  // no key tile works on m: nobody waits on its semaphore
      EXPECT_EQ(n, first) << "m=" << m << " sq=" << sq << " sk=" << sk << " window=(" << left << ", " << right << ")";
      while (n < tiles_n && works[m][n]) ++n;
      while (n < tiles_n) EXPECT_FALSE(works[m][n++]) << "key tiles of query tile " << m << " are not contiguous";
    }
  }
}

// dq_accum's fragment order (backward_plan.hpp) is a permutation of the row-major block of one (b, h):
// every (row, column) has its own slot inside [0, rows * D), and the four values of one MMA lane (rows
// r and r + 8, columns 2q and 2q + 1 of an m16n8 block) are the 16-byte-aligned slots 4 * lane .. + 3.
TEST(CudaBackwardPlan, DqAccumIndexIsAPermutationInFragmentOrder) {
  for (const int d : {32, 64, 96, 128, 192, 256}) {
    const int rows = 2 * sm80::kBackwardRowAlign;
    std::vector<int> seen(size_t(rows) * d, 0);
    for (int i = 0; i < rows; ++i)
      for (int c = 0; c < d; ++c) {
        const int64_t index = sm80::dq_accum_index(i, c, d);
        ASSERT_GE(index, 0);
        ASSERT_LT(index, int64_t(rows) * d);
        ++seen[size_t(index)];
      }
    EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), int64_t(rows) * d) << "D = " << d;
    for (int lane = 0; lane < 32; ++lane) {
      const int group = lane / 4, quad = lane % 4;
      const int64_t base = sm80::dq_accum_index(16 + group, 8 + 2 * quad, d);  // row block 1, column block 1
      EXPECT_EQ(base % 4, 0);
      EXPECT_EQ(sm80::dq_accum_index(16 + group, 8 + 2 * quad + 1, d), base + 1);
      EXPECT_EQ(sm80::dq_accum_index(16 + group + 8, 8 + 2 * quad, d), base + 2);
      EXPECT_EQ(sm80::dq_accum_index(16 + group + 8, 8 + 2 * quad + 1, d), base + 3);
      EXPECT_EQ(base, (int64_t(d / 8) + 1) * 128 + 4 * lane);
    }
  }
}

// O(S): the workspace grows linearly with the sequence length, never with Sq x Sk.
TEST(CudaBackwardPlan, WorkspaceIsLinearInSequenceLength) {
  flashattn::BackwardParams p{};
  p.batch = 2;
  p.heads_q = 8;
  p.heads_k = 2;
  p.head_dim = 128;
  p.deterministic = true;
  p.seqlen_q = p.seqlen_k = 4096;
  const int64_t small = sm80::backward_workspace_layout(p, 128, 64).total_bytes;
  p.seqlen_q = p.seqlen_k = 8192;
  const int64_t large = sm80::backward_workspace_layout(p, 128, 64).total_bytes;
  // dq_accum (4 bytes x D) + lse_log2 + dsum (4 + 4) + a semaphore per 64 rows, per (b, h, row)
  const int64_t per_row = 128 * 4 + 8;
  EXPECT_GE(small, int64_t(2) * 8 * 4096 * per_row);
  EXPECT_LE(large, 2 * small + 4 * sm80::kBackwardRegionAlign);
  const sm80::BackwardWorkspaceLayout w = sm80::backward_workspace_layout(p, 128, 64);
  EXPECT_EQ(w.dq_accum_offset % sm80::kBackwardRegionAlign, 0);
  EXPECT_EQ(w.lse_log2_offset % sm80::kBackwardRegionAlign, 0);
  EXPECT_EQ(w.dsum_offset % sm80::kBackwardRegionAlign, 0);
  EXPECT_EQ(w.semaphore_offset % sm80::kBackwardRegionAlign, 0);
  EXPECT_EQ(w.semaphore_bytes, int64_t(2) * 8 * (8192 / 64) * 4);
  p.deterministic = false;
  EXPECT_EQ(sm80::backward_workspace_layout(p, 128, 64).semaphore_bytes, 0);
}

// The tail split (backward_plan.hpp): when it runs, and that its CTAs' equal ranges cover the tail's
// iterations exactly once, each a whole number of iterations >= 1.
TEST(CudaBackwardPlan, TailSplitCoversTheLastWaveExactlyOnce) {
  flashattn::BackwardParams p{};
  p.batch = 1;
  p.heads_q = p.heads_k = 16;
  p.head_dim = p.head_dim_v = 128;
  p.seqlen_q = p.seqlen_k = 16384;
  p.window_left = p.window_right = -1;
  // D = 128 on 132 SMs, one CTA each: 2048 units = 15 waves + 68
  ASSERT_TRUE(sm80::backward_tail_eligible(p));
  const int64_t capacity = sm80::backward_tail_capacity(p, 128, 132);
  EXPECT_EQ(capacity, 264);
  sm80::BackwardTail t = sm80::plan_backward_tail(p, 2048, 132, capacity, 64);
  EXPECT_EQ(t.dp_units, 1980);
  EXPECT_EQ(t.tail_units, 68);
  EXPECT_EQ(t.ctas, 132);
  EXPECT_EQ(t.unit_iterations, 256);
  // the kernel's ranges [c * pieces / ctas, (c + 1) * pieces / ctas)
  auto check_ranges = [](const sm80::BackwardTail& tail) {
    const int64_t pieces = tail.tail_units * tail.unit_iterations;
    int64_t next = 0;
    for (int64_t c = 0; c < tail.ctas; ++c) {
      const int64_t g = c * pieces / tail.ctas, g_end = (c + 1) * pieces / tail.ctas;
      EXPECT_EQ(g, next);
      EXPECT_GE(g_end - g, 1) << "a tail CTA without work";
      EXPECT_LE(g_end - g, (pieces + tail.ctas - 1) / tail.ctas);
      next = g_end;
    }
    EXPECT_EQ(next, pieces);
  };
  check_ranges(t);
  // GQA (8 query heads per K/V head): iterations = group x query tiles
  p.heads_k = 2;
  t = sm80::plan_backward_tail(p, 2048, 132, capacity, 64);
  EXPECT_EQ(t.unit_iterations, 8 * 256);
  p.heads_k = 16;
  // a problem smaller than one wave: every unit in pieces
  t = sm80::plan_backward_tail(p, 3, 132, 3, 128);
  EXPECT_EQ(t.dp_units, 0);
  EXPECT_EQ(t.tail_units, 3);
  EXPECT_EQ(t.ctas, 132);
  check_ranges(t);
  p.seqlen_q = sm80::kTailMinUnitIterations * 64;  // the fewest iterations per unit that split
  t = sm80::plan_backward_tail(p, 1, 132, 1, 64);
  EXPECT_EQ(t.tail_units, 1);
  EXPECT_EQ(t.ctas, sm80::kTailMinUnitIterations);  // never more CTAs than iterations
  check_ranges(t);
  p.seqlen_q -= 64;  // one query tile fewer: not split
  EXPECT_EQ(sm80::plan_backward_tail(p, 1, 132, 1, 64).tail_units, 0);
  p.seqlen_q = 16384;
  // whole waves, a nearly full last wave, or a tail beyond the workspace's capacity: no split
  EXPECT_EQ(sm80::plan_backward_tail(p, 264, 132, capacity, 64).tail_units, 0);
  EXPECT_EQ(sm80::plan_backward_tail(p, 130, 132, capacity, 64).tail_units, 0);
  EXPECT_EQ(sm80::plan_backward_tail(p, 1000, 600, capacity, 64).tail_units, 0);  // rem 400 > 264
  // not eligible: deterministic, causal or windowed, dropout, varlen, seqused_k
  const int32_t lengths[2] = {0, 16384};
  for (int which = 0; which < 6; ++which) {
    flashattn::BackwardParams q = p;
    if (which == 0) q.deterministic = true;
    if (which == 1) q.window_right = 0;
    if (which == 2) q.window_left = 100;
    if (which == 3) q.dropout_p = 0.1f;
    if (which == 4) q.cu_seqlens_q = q.cu_seqlens_k = lengths;
    if (which == 5) q.seqused_k = lengths;
    EXPECT_FALSE(sm80::backward_tail_eligible(q)) << which;
    EXPECT_EQ(sm80::backward_tail_capacity(q, 128, 132), 0) << which;
    EXPECT_EQ(sm80::plan_backward_tail(q, 2048, 132, capacity, 64).tail_units, 0) << which;
  }
  // the workspace: dkv_accum after the other regions, aligned, capacity x (dK + dV) x block_n x D floats
  const sm80::BackwardWorkspaceLayout plain = sm80::backward_workspace_layout(p, 128, 64);
  const sm80::BackwardWorkspaceLayout w = sm80::backward_workspace_layout(p, 128, 64, 128, capacity);
  EXPECT_EQ(plain.dkv_accum_bytes, 0);
  EXPECT_EQ(w.dkv_accum_offset % sm80::kBackwardRegionAlign, 0);
  EXPECT_GE(w.dkv_accum_offset, w.semaphore_offset + w.semaphore_bytes);
  EXPECT_EQ(w.dkv_accum_bytes, capacity * 2 * 128 * 128 * 4);
  EXPECT_EQ(w.total_bytes, w.dkv_accum_offset + w.dkv_accum_bytes);
  EXPECT_EQ(w.dq_accum_offset, plain.dq_accum_offset);
  EXPECT_EQ(w.dsum_offset, plain.dsum_offset);
}

#if defined(FLASHATTN_WITH_CUDA)
// The manifest's shared-memory figure of each backward row is the kernel's (dispatch checks it
// against the device; the launch static_asserts the same formula).
TEST(CudaBackwardPlan, ManifestSharedMemoryMatchesKernel) {
  int rows = 0;
  for (const auto& e : flashattn::cuda::generated::kKernelTable) {
    if (e.kind != flashattn::cuda::KernelKind::kBackward) continue;
    ++rows;
    EXPECT_EQ(e.smem_bytes, sm80::backward_smem_bytes(e.head_dim, e.block_m, e.block_n, e.warps, e.stages, e.warp_keys))
        << e.name;
  }
  EXPECT_GT(rows, 0) << "no backward kernel in the generated table";
}
#endif

// ---- GPU cases ----

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

// A backward call: tensors from fa_test::make_tensors, options, optional ALiBi slopes.
struct Case {
  fa_test::Tensors t;
  fa_options options = fa_test::options_for(FA_BACKEND_CPU_REFERENCE);
  HostTensor alibi;
  bool varlen = false;
};

bool present(const HostTensor& t) { return !t.shape().empty(); }

Case make_case(const fa_test::Problem& p, std::mt19937_64& rng) {
  Case c;
  c.t = fa_test::make_tensors(p, rng);
  c.varlen = !p.varlen_q.empty();
  return c;
}

[[maybe_unused]] fa_options host_options(const Case& c) {  // unused without CUDA
  fa_options o = c.options;
  if (present(c.alibi)) o.alibi_slopes = const_cast<HostTensor&>(c.alibi).view();
  return o;
}

#if defined(FLASHATTN_WITH_CUDA)
// Device copies of host tensors (whole storage, strides and padding included).
class DeviceBuffers {
 public:
  ~DeviceBuffers() {
    for (auto& [host, device] : buffers_) cudaFree(device);
  }
  fa_tensor view(HostTensor& t) {
    auto it = buffers_.find(&t);
    if (it == buffers_.end()) {
      void* device = nullptr;
      EXPECT_EQ(cudaMalloc(&device, size_t(std::max<int64_t>(t.storage_bytes(), 16))), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(device, t.data(), size_t(t.storage_bytes()), cudaMemcpyHostToDevice), cudaSuccess);
      it = buffers_.emplace(&t, device).first;
    }
    return t.view_on(it->second, FA_DEVICE_CUDA, 0);
  }
  void download(HostTensor& t) {
    EXPECT_EQ(cudaMemcpy(t.data(), buffers_.at(&t), size_t(t.storage_bytes()), cudaMemcpyDeviceToHost), cudaSuccess);
  }

 private:
  std::map<const HostTensor*, void*> buffers_;
};

struct RunOptions {
  bool deterministic = false;
  int64_t workspace_bytes = -1;  // >= 0: pass a caller workspace of this size
  fa_stats* stats = nullptr;
};

// Runs the CUDA backward on c's tensors (dq/dk/dv poisoned with NaN first) and downloads dq/dk/dv.
Status run_gpu_backward(Case& c, const RunOptions& run = {}) {
  c.t.dq.poison();
  c.t.dk.poison();
  c.t.dv.poison();
  DeviceBuffers d;
  fa_backward_args a = fa_test::backward_args(c.t);
  a.q = d.view(c.t.q);
  a.k = d.view(c.t.k);
  a.v = d.view(c.t.v);
  a.out = d.view(c.t.out);
  a.lse = d.view(c.t.lse);
  a.dout = d.view(c.t.dout);
  a.dq = d.view(c.t.dq);
  a.dk = d.view(c.t.dk);
  a.dv = d.view(c.t.dv);
  if (c.varlen) {
    a.cu_seqlens_q = d.view(c.t.cu_seqlens_q);
    a.cu_seqlens_k = d.view(c.t.cu_seqlens_k);
  }
  fa_options o = c.options;
  o.backend = FA_BACKEND_CUDA;
  o.deterministic = run.deterministic;
  o.stats = run.stats;
  if (present(c.alibi)) o.alibi_slopes = d.view(c.alibi);
  HostTensor workspace;
  if (run.workspace_bytes >= 0) {
    workspace = HostTensor({std::max<int64_t>(run.workspace_bytes, 1)}, FA_UINT8);
    a.workspace = d.view(workspace);
    a.workspace.shape[0] = run.workspace_bytes;
  }
  const Status s = flashattn::backward(a, o);
  const cudaError_t sync = cudaDeviceSynchronize();
  if (sync != cudaSuccess) return Status(FA_ERROR_DEVICE, std::string("kernel failed: ") + cudaGetErrorString(sync));
  d.download(c.t.dq);
  d.download(c.t.dk);
  d.download(c.t.dv);
  return s;
}

// The oracle's forward gives out (rounded to the dtype) and lse; its backward the exact gradients.
fa_test::Oracle prepare(Case& c) {
  fa_test::Oracle o = fa_test::run_oracle(c.t, host_options(c), /*with_backward=*/true);
  c.t.out.copy_values_from(o.out);  // the float32 oracle's, rounded to out's dtype
  c.t.lse.copy_values_from(o.lse);
  return o;
}

// Bound on |dq|, |dk| where the exact gradient is identically zero. That happens when every query
// sees exactly one key (Sk = 1, a window (0, 0)): the softmax of one element has zero derivative,
// dS = P (dP - dsum) = 1 * (dP - dP). The oracle returns exact zeros, so its relative error is 0 / 0;
// the kernel computes dP (tensor cores) and dsum = dot(dO, O) (preprocess) in different float32
// orders and P = exp2(s - lse) in float32, leaving float32 rounding noise of a few 2^-23 |dP| per
// element (|dP| ~ sqrt(D) ~ 11 for unit-normal inputs: ~5e-6), times scale (~0.09) |q| and summed
// as a random walk over up to 1000 queries: ~1.5e-5 (measured on the H200: at most 1.6e-5). A bug
// shows as errors of order |dP| * scale ~ 1.
constexpr double kZeroGradientNoise = 1e-4;

void expect_gradients_match(const std::string& what, const fa_test::Tensors& t, const fa_test::Oracle& o) {
  const std::pair<const HostTensor*, const std::vector<double>*> zero_candidates[] = {{&t.dq, &o.dq64}, {&t.dk, &o.dk64}};
  bool any_zero = false;
  for (const auto& [got, exact] : zero_candidates) {
    const bool identically_zero = std::all_of(exact->begin(), exact->end(), [](double x) { return x == 0.0; });
    if (!identically_zero || exact->empty()) continue;
    any_zero = true;
    double max_abs = 0;
    int64_t nonfinite = 0;
    for (double g : got->to_double()) {
      nonfinite += !std::isfinite(g);
      max_abs = std::max(max_abs, std::abs(g));
    }
    EXPECT_EQ(nonfinite, 0) << what << ": non-finite gradient where the exact one is 0";
    EXPECT_LE(max_abs, kZeroGradientNoise) << what << ": gradient should be exactly 0 (one visible key per query)";
  }
  if (!any_zero) {
    fa_test::expect_backward_matches(what, t, o, t.q.dtype());
    return;
  }
  // dv (never identically zero here) under the normal rule
  const fa_test::ErrorStats e = fa_test::compare(t.dv.to_double(), o.dv64);
  const fa_test::ErrorStats naive = fa_test::compare(o.naive_dv.to_double(), o.dv64);
  EXPECT_TRUE(fa_test::within_tolerance(what + " dv", t.q.dtype(), e, &naive));
}

void check_against_oracle(const std::string& what, Case& c, const RunOptions& run = {}) {
  const fa_test::Oracle o = prepare(c);
  fa_stats stats{};
  RunOptions r = run;
  if (r.stats == nullptr) r.stats = &stats;
  const Status s = run_gpu_backward(c, r);
  ASSERT_TRUE(s.ok()) << what << ": " << s.to_string();
  expect_gradients_match(what + " [" + r.stats->kernel + "]", c.t, o);
}
#else
struct RunOptions {
  bool deterministic = false;
  int64_t workspace_bytes = -1;
  fa_stats* stats = nullptr;
};
Status run_gpu_backward(Case&, const RunOptions& = {}) { return Status(FA_ERROR_NOT_COMPILED, "no CUDA in this build"); }
void check_against_oracle(const std::string&, Case&, const RunOptions& = {}) {}
fa_test::Oracle prepare(Case&) { return fa_test::Oracle{}; }  // unreachable: the GPU tests skip first
#endif

// ---- the grid ----

TEST(CudaBackward, HeadDimsDtypesCausalGqaPartialTiles) {
  SKIP_WITHOUT_GPU();
  auto rng = fa_test::make_rng("cuda_backward_grid");
  for (fa_dtype dtype : {FA_FLOAT16, FA_BFLOAT16})
    for (int d : {32, 64, 96, 128, 192, 256})
      for (int causal : {0, 1}) {
        Case c = make_case(problem(2, 127, 200, 4, 2, d, dtype), rng);
        c.options.causal = causal;
        check_against_oracle(std::string(short_name(dtype)) + " D=" + std::to_string(d) + (causal ? " causal" : ""), c);
      }
}

TEST(CudaBackward, OddSizes) {
  SKIP_WITHOUT_GPU();
  auto rng = fa_test::make_rng("cuda_backward_sizes");
  const int sizes[][2] = {{1, 1}, {17, 17}, {1, 1000}, {1000, 1}, {127, 1000}, {1000, 127}, {64, 64}, {129, 65}};
  for (const auto& s : sizes)
    for (int causal : {0, 1}) {
      Case c = make_case(problem(1, s[0], s[1], 2, 1, 128, FA_BFLOAT16), rng);
      c.options.causal = causal;
      check_against_oracle("Sq=" + std::to_string(s[0]) + " Sk=" + std::to_string(s[1]) + (causal ? " causal" : ""), c);
    }
}

// Shapes whose last wave goes through the tail split on this GPU (backward_plan.hpp): whole units on most
// CTAs, then units done in pieces by CTAs whose ranges cross unit boundaries (dK / dV summed in float32 by
// atomics, written by the tail kernel). Partial key and query tiles, GQA. Against the oracle, and against
// deterministic mode (whole units only) within float32 summation-order noise.
TEST(CudaBackward, TailSplitMatchesOracleAndWholeUnits) {
  SKIP_WITHOUT_GPU();
#if defined(FLASHATTN_WITH_CUDA)
  auto rng = fa_test::make_rng("cuda_backward_tail");
  int sm_count = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  struct Shape {
    fa_test::Problem problem;
    int block_m, block_n, ctas_per_sm;  // of the kernel that runs it (BACKWARD_TILES)
  };
  // D = 128: m64 n128, 1 CTA per SM; D = 64: m64 n128, 2 per SM; D = 256 (sm_90): m64 n64, 1 per SM.
  // Units = key tiles x B x Hk: 200 or 320, more than one wave and a partial one on 100-150 SMs. Iterations
  // per unit = (Hq / Hk) x query tiles = kTailMinUnitIterations; few keys keep the float64 oracle cheap.
  std::vector<Shape> shapes = {{problem(2, 2048, 16, 200, 100, 128, FA_BFLOAT16), 64, 128, 1},
                               {problem(2, 2048, 129, 160, 80, 64, FA_FLOAT16), 64, 128, 2}};  // 2 key tiles
  int major = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0), cudaSuccess);
  if (major >= 9) shapes.push_back({problem(2, 4096, 8, 100, 100, 256, FA_BFLOAT16), 64, 64, 1});
  for (Shape& shape : shapes) {
    Case c = make_case(shape.problem, rng);
    const fa_test::Problem& pr = shape.problem;
    const std::string what = pr.to_string();
    // the plan for this device: the tail split runs, with more CTAs than tail units
    flashattn::BackwardParams bp{};
    bp.batch = pr.batch, bp.seqlen_q = pr.seqlen_q, bp.seqlen_k = pr.seqlen_k;
    bp.heads_q = pr.heads_q, bp.heads_k = pr.heads_k, bp.head_dim = bp.head_dim_v = pr.head_dim;
    bp.window_left = bp.window_right = -1;
    const int64_t units = int64_t((pr.seqlen_k + shape.block_n - 1) / shape.block_n) * pr.batch * pr.heads_k;
    const sm80::BackwardTail tail =
        sm80::plan_backward_tail(bp, units, int64_t(sm_count) * shape.ctas_per_sm,
                                 sm80::backward_tail_capacity(bp, shape.block_n, sm_count), shape.block_m);
    EXPECT_GT(tail.dp_units, 0) << what;
    EXPECT_GT(tail.tail_units, 0) << what << ": the shape should end in a partial wave on " << sm_count << " SMs";
    check_against_oracle("tail split " + what, c);
    const HostTensor dq = c.t.dq, dk = c.t.dk, dv = c.t.dv;
    RunOptions whole;
    whole.deterministic = true;
    ASSERT_TRUE(run_gpu_backward(c, whole).ok()) << what;
    // Both sum the same float32 terms in different orders, then round to the 16-bit type: they differ by
    // about one rounding step (2^-8 relative for bf16) in a few elements; a lost or doubled piece of a
    // unit would differ by O(1).
    for (const auto& [got, ref, name] : {std::tuple{&dq, &c.t.dq, "dq"}, std::tuple{&dk, &c.t.dk, "dk"}, std::tuple{&dv, &c.t.dv, "dv"}}) {
      const fa_test::ErrorStats e = fa_test::compare(*got, *ref);
      EXPECT_EQ(e.nan, 0) << what << " " << name;
      EXPECT_LT(e.rel_l2, 1e-2) << what << " " << name << ": tail split against whole units, " << e.to_string();
    }
  }
#endif
}

TEST(CudaBackward, Long4097) {
  SKIP_WITHOUT_GPU();
  auto rng = fa_test::make_rng("cuda_backward_4097");
  Case c = make_case(problem(1, 4097, 4097, 1, 1, 64, FA_BFLOAT16), rng);
  c.options.causal = 1;
  check_against_oracle("4097 causal", c);
}

TEST(CudaBackward, PeakySoftmax) {
  SKIP_WITHOUT_GPU();
  auto rng = fa_test::make_rng("cuda_backward_peaky");
  for (fa_dtype dtype : {FA_FLOAT16, FA_BFLOAT16})
    for (int d : {64, 128, 256}) {
      // std 4 per element: scores of magnitude ~ 16, a nearly one-hot softmax
      Case c = make_case(problem(2, 300, 333, 2, 2, d, dtype, 4.0), rng);
      check_against_oracle(std::string("peaky ") + short_name(dtype) + " D=" + std::to_string(d), c);
    }
}

TEST(CudaBackward, GqaAndMqaReduceOverTheGroup) {
  SKIP_WITHOUT_GPU();
  auto rng = fa_test::make_rng("cuda_backward_gqa");
  for (int hk : {8, 4, 1})  // group sizes 1, 2, 8
    for (int causal : {0, 1}) {
      Case c = make_case(problem(2, 150, 170, 8, hk, 64, FA_FLOAT16), rng);
      c.options.causal = causal;
      check_against_oracle("Hq=8 Hk=" + std::to_string(hk) + (causal ? " causal" : ""), c);
    }
}

TEST(CudaBackward, HeadDimsBetweenBucketsAreZeroPadded) {
  SKIP_WITHOUT_GPU();
  auto rng = fa_test::make_rng("cuda_backward_padded_d");
  for (int d : {8, 40, 80, 136, 200}) {
    Case c = make_case(problem(1, 100, 90, 2, 1, d, FA_BFLOAT16), rng);
    c.options.causal = 1;
    check_against_oracle("D=" + std::to_string(d), c);
  }
}

TEST(CudaBackward, SlidingWindowsAndEmptyRows) {
  SKIP_WITHOUT_GPU();
  auto rng = fa_test::make_rng("cuda_backward_window");
  const int windows[][2] = {{32, 16}, {0, 0}, {100, -1}, {-1, 5}, {200, 0}, {1, 300}};
  for (const auto& w : windows)
    for (int shape = 0; shape < 2; ++shape) {
      // Sq < Sk and Sq > Sk (then some rows see no key: lse = -inf, zero gradients)
      Case c = make_case(shape == 0 ? problem(2, 150, 400, 2, 1, 128, FA_FLOAT16) : problem(2, 400, 150, 2, 1, 128, FA_FLOAT16), rng);
      c.options.window_left = w[0];
      c.options.window_right = w[1];
      check_against_oracle("window (" + std::to_string(w[0]) + ", " + std::to_string(w[1]) + ") shape " + std::to_string(shape), c);
    }
  Case c = make_case(problem(1, 300, 100, 2, 2, 64, FA_BFLOAT16), rng);
  c.options.causal = 1;  // rows 0..199 see no key
  check_against_oracle("causal Sq > Sk: fully masked rows", c);
}

TEST(CudaBackward, SoftcapAlibiScale) {
  SKIP_WITHOUT_GPU();
  auto rng = fa_test::make_rng("cuda_backward_variants");
  for (int d : {64, 128, 256}) {
    Case c = make_case(problem(2, 140, 260, 4, 2, d, FA_BFLOAT16, 3.0), rng);
    c.options.softcap = 5.f;
    c.options.causal = 1;
    check_against_oracle("softcap causal D=" + std::to_string(d), c);

    Case a = make_case(problem(2, 140, 260, 4, 2, d, FA_FLOAT16), rng);
    a.alibi = HostTensor({4}, FA_FLOAT32);
    a.alibi.fill_uniform(rng, 0.01, 0.5);
    check_against_oracle("alibi (Hq) D=" + std::to_string(d), a);

    Case ab = make_case(problem(2, 140, 260, 4, 2, d, FA_FLOAT16), rng);
    ab.alibi = HostTensor({2, 4}, FA_FLOAT32);
    ab.alibi.fill_uniform(rng, 0.01, 0.5);
    ab.options.softcap = 20.f;
    ab.options.window_left = 50;
    ab.options.window_right = 10;
    check_against_oracle("alibi (B, Hq) + softcap + window D=" + std::to_string(d), ab);

    Case s = make_case(problem(1, 100, 120, 2, 2, d, FA_BFLOAT16), rng);
    s.options.softmax_scale = -0.07f;  // a negative scale flips which key is the max
    check_against_oracle("negative scale D=" + std::to_string(d), s);
  }
}

TEST(CudaBackward, Varlen) {
  SKIP_WITHOUT_GPU();
  auto rng = fa_test::make_rng("cuda_backward_varlen");
  for (int causal : {0, 1})
    for (int d : {64, 128}) {
      fa_test::Problem p = problem(5, 0, 0, 4, 2, d, FA_BFLOAT16);
      p.varlen_q = {1, 130, 0, 257, 64};
      p.varlen_k = {17, 100, 40, 300, 0};
      Case c = make_case(p, rng);
      c.options.causal = causal;
      check_against_oracle(std::string("varlen D=") + std::to_string(d) + (causal ? " causal" : ""), c);
    }
}

TEST(CudaBackward, StridedTensorsLeavePaddingUntouched) {
  SKIP_WITHOUT_GPU();
  auto rng = fa_test::make_rng("cuda_backward_strided");
  const int b = 2, sq = 100, sk = 140, hq = 4, hk = 2, d = 64;
  fa_test::Problem p = problem(b, sq, sk, hq, hk, d, FA_FLOAT16);
  Case c = make_case(p, rng);
  // Every tensor with padding between heads (row stride H * (D + pad), head stride D + pad);
  // v stored head-major (B, H, S, D) and viewed as (B, S, H, D).
  auto padded = [&](const HostTensor& like, int pad) {
    const auto& s = like.shape();
    HostTensor t(s, {s[1] * s[2] * (s[3] + pad), s[2] * (s[3] + pad), s[3] + pad, 1}, like.dtype());
    t.copy_values_from(like);
    return t;
  };
  c.t.q = padded(c.t.q, 16);
  c.t.k = padded(c.t.k, 8);
  HostTensor v({b, sk, hk, d}, {int64_t(hk) * sk * d, d, int64_t(sk) * d, 1}, FA_FLOAT16);
  v.copy_values_from(c.t.v);
  c.t.v = v;
  c.t.out = padded(c.t.out, 24);
  c.t.dout = padded(c.t.dout, 8);
  c.t.dq = padded(c.t.dq, 16);
  c.t.dk = padded(c.t.dk, 8);
  c.t.dv = padded(c.t.dv, 40);
  c.options.causal = 1;
  check_against_oracle("strided q/k/v/out/dout/dq/dk/dv", c);
  // the padding of dq/dk/dv stays poisoned (NaN): the kernels wrote only the tensors' elements
  auto padding_untouched = [&](const HostTensor& t, int row) {
    int64_t padding = 0, nan = 0;
    const auto* raw = static_cast<const uint16_t*>(t.data());
    for (int64_t e = 0; e < t.storage_bytes() / 2; ++e) {
      if (e % row < d) continue;
      ++padding;
      nan += (raw[e] & 0x7c00) == 0x7c00 && (raw[e] & 0x3ff) != 0;
    }
    return padding > 0 && nan == padding;
  };
  EXPECT_TRUE(padding_untouched(c.t.dq, d + 16)) << "dq padding written";
  EXPECT_TRUE(padding_untouched(c.t.dk, d + 8)) << "dk padding written";
  EXPECT_TRUE(padding_untouched(c.t.dv, d + 40)) << "dv padding written";
}

// ---- dropout ----

// dV = (P * Z)^T dO with dO row i = e_i (queries i < D) gives dV[j][i] = P[i][j] * keep(i, j) / (1 - p):
// each element shows one keep bit of the backward's regenerated mask, compared with core/philox.hpp.
TEST(CudaBackward, DropoutKeepMaskIsBitIdenticalToPhilox) {
  SKIP_WITHOUT_GPU();
  auto rng = fa_test::make_rng("cuda_backward_dropout_mask");
  for (int d : {64, 128, 256}) {
    const int b = 2, hq = 2, hk = 2, sq = d, sk = 300;  // queries <= D: query i writes column i
    Case c = make_case(problem(b, sq, sk, hq, hk, d, FA_BFLOAT16, 0.5), rng);
    for (int64_t n = 0; n < c.t.dout.numel(); ++n) {
      const int64_t col = n % d, query = (n / (int64_t(d) * hq)) % sq;
      c.t.dout.set(n, col == query ? 1.0 : 0.0);
    }
    c.options.dropout_p = 0.3f;
    c.options.dropout_seed = rng();
    c.options.dropout_offset = rng();
    prepare(c);
    const Status s = run_gpu_backward(c);
    ASSERT_TRUE(s.ok()) << s.to_string();
    const uint32_t threshold = flashattn::dropout_threshold_u16(c.options.dropout_p);
    int64_t mismatches = 0, kept = 0, total = 0;
    for (int bi = 0; bi < b; ++bi)
      for (int j = 0; j < sk; ++j)
        for (int h = 0; h < hk; ++h)
          for (int i = 0; i < sq; ++i) {
            const double g = c.t.dv.get(((int64_t(bi) * sk + j) * hk + h) * d + i);
            ASSERT_TRUE(std::isfinite(g)) << "dv not written at " << bi << "," << j << "," << h << "," << i;
            const bool gpu_keep = g != 0.0;
            const bool ref_keep = flashattn::dropout_keep(c.options.dropout_seed, c.options.dropout_offset,
                                                          uint32_t(bi * hq + h), uint32_t(i), uint32_t(j), threshold);
            mismatches += gpu_keep != ref_keep;
            kept += gpu_keep;
            ++total;
          }
    EXPECT_EQ(mismatches, 0) << "D=" << d << ": keep bits differ from core/philox.hpp in " << mismatches << " of " << total;
    const double rate = double(kept) / double(total), expected = 0.7;
    EXPECT_NEAR(rate, expected, 4.0 * std::sqrt(expected * (1 - expected) / double(total))) << "D=" << d;
  }
}

TEST(CudaBackward, DropoutMatchesOracle) {
  SKIP_WITHOUT_GPU();
  auto rng = fa_test::make_rng("cuda_backward_dropout");
  for (fa_dtype dtype : {FA_FLOAT16, FA_BFLOAT16})
    for (int d : {32, 64, 96, 128, 192, 256}) {
      Case c = make_case(problem(2, 130, 170, 4, 2, d, dtype), rng);
      c.options.dropout_p = 0.17f;
      c.options.dropout_seed = rng();
      c.options.dropout_offset = rng();
      c.options.causal = d % 64 == 0;
      check_against_oracle(std::string("dropout ") + short_name(dtype) + " D=" + std::to_string(d), c);
    }
}

// ---- determinism, workspace, reports, errors ----

bool same_bits(const HostTensor& a, const HostTensor& b) {
  return a.storage_bytes() == b.storage_bytes() && std::memcmp(a.data(), b.data(), size_t(a.storage_bytes())) == 0;
}

TEST(CudaBackward, DeterministicModeIsBitIdenticalRunToRun) {
  SKIP_WITHOUT_GPU();
  auto rng = fa_test::make_rng("cuda_backward_deterministic");
  struct Shape {
    fa_test::Problem p;
    int causal;
    float dropout;
  };
  fa_test::Problem varlen = problem(4, 0, 0, 8, 2, 128, FA_BFLOAT16);
  varlen.varlen_q = {700, 1, 0, 1025};
  varlen.varlen_k = {1100, 513, 64, 900};
  const Shape shapes[] = {{problem(2, 1000, 1200, 8, 2, 64, FA_BFLOAT16), 0, 0.f},
                          {problem(1, 1000, 1000, 4, 1, 128, FA_FLOAT16), 1, 0.1f},
                          {problem(2, 600, 700, 2, 2, 256, FA_BFLOAT16), 1, 0.f},
                          {varlen, 1, 0.f}};
  for (const Shape& shape : shapes) {
    Case c = make_case(shape.p, rng);
    c.options.causal = shape.causal;
    c.options.dropout_p = shape.dropout;
    c.options.dropout_seed = rng();
    const std::string what = "deterministic " + shape.p.to_string();
    RunOptions run;
    run.deterministic = true;
    check_against_oracle(what, c, run);  // also right, not only repeatable
    const HostTensor dq = c.t.dq, dk = c.t.dk, dv = c.t.dv;
    for (int repeat = 0; repeat < 3; ++repeat) {
      ASSERT_TRUE(run_gpu_backward(c, run).ok());
      EXPECT_TRUE(same_bits(dq, c.t.dq)) << what << ": dq differs between runs";
      EXPECT_TRUE(same_bits(dk, c.t.dk)) << what << ": dk differs between runs";
      EXPECT_TRUE(same_bits(dv, c.t.dv)) << what << ": dv differs between runs";
    }
  }
}

TEST(CudaBackward, WorkspaceSizeCallerWorkspaceAndStats) {
  SKIP_WITHOUT_GPU();
#if defined(FLASHATTN_WITH_CUDA)
  auto rng = fa_test::make_rng("cuda_backward_workspace");
  Case c = make_case(problem(2, 333, 444, 4, 2, 128, FA_BFLOAT16), rng);
  c.options.causal = 1;
  fa_stats stats{};
  RunOptions run;
  run.deterministic = true;
  run.stats = &stats;
  check_against_oracle("internal workspace", c, run);
  EXPECT_NE(std::string(stats.kernel).find("bwd_sm80_bf16_d128"), std::string::npos) << stats.kernel;
  const HostTensor dq = c.t.dq, dk = c.t.dk, dv = c.t.dv;

  // fa_backward_workspace_size agrees with what the call allocated (stats) and is O(S)
  DeviceBuffers d;
  fa_backward_args a = fa_test::backward_args(c.t);
  for (HostTensor* t : {&c.t.q, &c.t.k, &c.t.v, &c.t.out, &c.t.lse, &c.t.dout, &c.t.dq, &c.t.dk, &c.t.dv}) d.view(*t);
  a.q = d.view(c.t.q);
  a.k = d.view(c.t.k);
  a.v = d.view(c.t.v);
  a.out = d.view(c.t.out);
  a.lse = d.view(c.t.lse);
  a.dout = d.view(c.t.dout);
  a.dq = d.view(c.t.dq);
  a.dk = d.view(c.t.dk);
  a.dv = d.view(c.t.dv);
  fa_options o = c.options;
  o.backend = FA_BACKEND_CUDA;
  o.deterministic = 1;
  int64_t bytes = -1;
  fa_error err{};
  ASSERT_EQ(fa_backward_workspace_size(&a, &o, &bytes, &err), FA_OK) << err.message;
  EXPECT_EQ(bytes, stats.scratch_bytes_peak);
  EXPECT_GT(bytes, 0);
  EXPECT_LT(bytes, int64_t(2) * 4 * 384 * (128 * 4 + 64) + 4096);  // B * Hq * padded Sq * (D floats + stats)

  // a caller workspace of exactly that size: same bits (deterministic), nothing allocated
  fa_stats stats2{};
  run.workspace_bytes = bytes;
  run.stats = &stats2;
  ASSERT_TRUE(run_gpu_backward(c, run).ok());
  EXPECT_TRUE(same_bits(dq, c.t.dq) && same_bits(dk, c.t.dk) && same_bits(dv, c.t.dv)) << "caller workspace changed the result";
  EXPECT_EQ(stats2.scratch_bytes_peak, 0);

  // one byte short: a clear error naming the argument, before anything runs
  run.workspace_bytes = bytes - 1;
  const Status s = run_gpu_backward(c, run);
  EXPECT_EQ(s.code(), FA_ERROR_INVALID_ARGUMENT) << s.to_string();
  EXPECT_EQ(s.message().rfind("workspace:", 0), 0u) << s.message();
  EXPECT_EQ(c.t.dq.count_nonfinite(), c.t.dq.numel()) << "dq was written although the call failed";
#endif
}

// End to end: the GPU forward's out and lse feed the GPU backward.
TEST(CudaBackward, FromGpuForward) {
  SKIP_WITHOUT_GPU();
#if defined(FLASHATTN_WITH_CUDA)
  auto rng = fa_test::make_rng("cuda_backward_from_forward");
  for (int causal : {0, 1}) {
    Case c = make_case(problem(2, 257, 300, 4, 2, 128, FA_BFLOAT16), rng);
    c.options.causal = causal;
    c.options.dropout_p = causal ? 0.1f : 0.f;
    c.options.dropout_seed = rng();
    const fa_test::Oracle o = fa_test::run_oracle(c.t, host_options(c), true);
    {
      DeviceBuffers d;
      fa_forward_args f = fa_test::forward_args(c.t);
      f.q = d.view(c.t.q);
      f.k = d.view(c.t.k);
      f.v = d.view(c.t.v);
      f.out = d.view(c.t.out);
      f.lse = d.view(c.t.lse);
      fa_options fo = c.options;
      fo.backend = FA_BACKEND_CUDA;
      const Status s = flashattn::forward(f, fo);
      ASSERT_TRUE(s.ok()) << "GPU forward: " << s.to_string();
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      d.download(c.t.out);
      d.download(c.t.lse);
    }
    const Status s = run_gpu_backward(c);
    ASSERT_TRUE(s.ok()) << s.to_string();
    fa_test::expect_backward_matches(std::string("GPU forward -> backward") + (causal ? " causal dropout" : ""), c.t, o,
                                     FA_BFLOAT16);
  }
#endif
}

TEST(CudaBackward, UnsupportedCombinationsAreClearErrors) {
  SKIP_WITHOUT_GPU();
  auto rng = fa_test::make_rng("cuda_backward_errors");
  {
    Case c = make_case(problem(1, 10, 10, 1, 1, 64, FA_FLOAT32), rng);
    const Status s = run_gpu_backward(c);
    EXPECT_EQ(s.code(), FA_ERROR_UNSUPPORTED);
    EXPECT_EQ(s.message().rfind("q: dtype float32", 0), 0u) << s.message();
  }
  {
    Case c = make_case(problem(1, 10, 10, 1, 1, 264, FA_FLOAT16), rng);
    const Status s = run_gpu_backward(c);
    EXPECT_EQ(s.code(), FA_ERROR_NOT_COMPILED);
    EXPECT_EQ(s.message().rfind("q: head dim 264 is not compiled", 0), 0u) << s.message();
  }
  {
    fa_test::Problem p = problem(1, 10, 10, 1, 1, 64, FA_FLOAT16);
    p.head_dim_v = 32;
    Case c = make_case(p, rng);
    const Status s = run_gpu_backward(c);
    EXPECT_EQ(s.code(), FA_ERROR_UNSUPPORTED);
    EXPECT_EQ(s.message().rfind("v: head dim", 0), 0u) << s.message();
  }
}

}  // namespace
