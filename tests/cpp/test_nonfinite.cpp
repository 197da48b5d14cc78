// The NaN/Inf policy, on every CPU backend (and the GPU where there is one): non-finite inputs
// propagate to the outputs that depend on them, never vanish, and go no further than this:
//   - a NaN in query row i spoils out row i and its lse;
//   - a NaN in key row j spoils every row that sees key j; rows the mask hides it from are untouched;
//     a row whose only visible key is NaN included;
//   - an Inf in one value element spoils that column of the rows that see it; the same column of
//     rows the mask hides it from may also become NaN (0 x Inf inside the P V tile product of every
//     fused backend), and is not checked.
// Every other output is finite and equal to the float64 oracle's. Nothing crashes.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "core/mask.hpp"
#include "testing.hpp"

#if defined(FLASHATTN_WITH_CUDA)
#include <cuda_runtime.h>
#endif

namespace {

using fa_test::HostTensor;

constexpr int B = 2, S = 24, HQ = 4, HK = 2, D = 16;  // S >= 16: the CPU row max runs its vector loop
constexpr int kNanQueryRow = 3, kNanQueryHead = 1;  // batch 0
constexpr int kNanKeyRow = 5, kNanKeyHead = 0;      // batch 0: query heads 0 and 1 read it
constexpr int kInfValueRow = 2, kInfValueHead = 1, kInfValueColumn = 7;  // batch 1: query heads 2 and 3
// Batch 1, key row 0: under the causal mask query row 0 sees this key alone, so its only score is NaN
// (a row max that skipped NaN would find no visible key there and write a finite 0 row).
constexpr int kNanFirstKeyHead = 0;  // query heads 0 and 1

struct Poisoned {
  fa_test::Tensors t;
  fa_options options;
};

Poisoned make_inputs(fa_dtype dtype, fa_backend backend) {
  auto rng = fa_test::make_rng("nonfinite");
  fa_test::Problem p;
  p.batch = B, p.seqlen_q = S, p.seqlen_k = S, p.heads_q = HQ, p.heads_k = HK, p.head_dim = D, p.dtype = dtype;
  Poisoned x{fa_test::make_tensors(p, rng), fa_test::options_for(backend)};
  x.options.causal = 1;  // rows 0..4 cannot see key 5
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  x.t.q.set(((0 * S + kNanQueryRow) * HQ + kNanQueryHead) * D + 4, nan);
  x.t.k.set(((0 * S + kNanKeyRow) * HK + kNanKeyHead) * D + 9, nan);
  x.t.k.set(((1 * S + 0) * HK + kNanFirstKeyHead) * D + 2, nan);
  x.t.v.set(((1 * S + kInfValueRow) * HK + kInfValueHead) * D + kInfValueColumn, inf);
  return x;
}

// Whether out(b, i, h, d) depends on a non-finite input (the lse ignores v: d = -1 asks for the lse).
// The column of the Inf value in rows that cannot see it: NaN allowed (0 x Inf in a tile product).
bool may_be_spoiled(int b, int i, int h, int d) {
  return b == 1 && h / (HQ / HK) == kInfValueHead && d == kInfValueColumn;
}

bool spoiled(int b, int i, int h, int d) {
  const flashattn::WindowMask causal(-1, 0, S, S);
  if (b == 0 && i == kNanQueryRow && h == kNanQueryHead) return true;
  if (b == 0 && h / (HQ / HK) == kNanKeyHead && causal.visible(i, kNanKeyRow)) return true;
  if (b == 1 && h / (HQ / HK) == kInfValueHead && d == kInfValueColumn && causal.visible(i, kInfValueRow)) return true;
  if (b == 1 && h / (HQ / HK) == kNanFirstKeyHead) return true;  // every row sees key 0
  return false;
}

void expect_policy(const char* what, const fa_test::Tensors& got, const fa_test::Tensors& oracle) {
  for (int b = 0; b < B; ++b)
    for (int i = 0; i < S; ++i)
      for (int h = 0; h < HQ; ++h) {
        for (int d = 0; d < D; ++d) {
          const int64_t n = ((int64_t(b) * S + i) * HQ + h) * D + d;
          const double g = got.out.get(n), r = oracle.out.get(n);
          if (!spoiled(b, i, h, d) && may_be_spoiled(b, i, h, d)) continue;
          if (spoiled(b, i, h, d)) {
            EXPECT_FALSE(std::isfinite(g)) << what << " out(" << b << "," << i << "," << h << "," << d << ") should be non-finite";
          } else {
            ASSERT_TRUE(std::isfinite(g)) << what << " out(" << b << "," << i << "," << h << "," << d << ") = " << g;
            EXPECT_NEAR(g, r, 2e-2 * (1 + std::abs(r))) << what;
          }
        }
        const double lse = got.lse.get((int64_t(b) * HQ + h) * S + i);
        EXPECT_EQ(std::isfinite(lse), !spoiled(b, i, h, -1)) << what << " lse(" << b << "," << h << "," << i << ") = " << lse;
      }
}

fa_test::Tensors run_host(fa_dtype dtype, fa_backend backend) {
  Poisoned x = make_inputs(dtype, backend);
  const flashattn::Status s = flashattn::forward(fa_test::forward_args(x.t), x.options);
  EXPECT_TRUE(s.ok()) << s.to_string();
  return x.t;
}

TEST(NonFinite, InputsPropagateToExactlyTheirDependents) {
  for (fa_dtype dtype : {FA_FLOAT32, FA_BFLOAT16}) {
    const fa_test::Tensors oracle = run_host(dtype, FA_BACKEND_CPU_REFERENCE);
    expect_policy("cpu_reference", oracle, oracle);
    expect_policy("cpu_flash", run_host(dtype, FA_BACKEND_CPU_FLASH), oracle);
    expect_policy("cpu_standard", run_host(dtype, FA_BACKEND_CPU_STANDARD), oracle);
  }
}

TEST(NonFinite, CudaFollowsThePolicy) {
  if (fa_cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: the GPU part of the NaN/Inf policy runs on the GPU machine";
#if defined(FLASHATTN_WITH_CUDA)
  const fa_test::Tensors oracle = run_host(FA_BFLOAT16, FA_BACKEND_CPU_REFERENCE);
  Poisoned x = make_inputs(FA_BFLOAT16, FA_BACKEND_CUDA);
  HostTensor* tensors[] = {&x.t.q, &x.t.k, &x.t.v, &x.t.out, &x.t.lse};
  void* device[5] = {};
  for (int n = 0; n < 5; ++n) {
    ASSERT_EQ(cudaMalloc(&device[n], size_t(tensors[n]->storage_bytes())), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(device[n], tensors[n]->data(), size_t(tensors[n]->storage_bytes()), cudaMemcpyHostToDevice), cudaSuccess);
  }
  fa_forward_args a{};
  a.q = x.t.q.view_on(device[0], FA_DEVICE_CUDA, 0);
  a.k = x.t.k.view_on(device[1], FA_DEVICE_CUDA, 0);
  a.v = x.t.v.view_on(device[2], FA_DEVICE_CUDA, 0);
  a.out = x.t.out.view_on(device[3], FA_DEVICE_CUDA, 0);
  a.lse = x.t.lse.view_on(device[4], FA_DEVICE_CUDA, 0);
  const flashattn::Status s = flashattn::forward(a, x.options);
  ASSERT_TRUE(s.ok()) << s.to_string();
  ASSERT_EQ(cudaMemcpy(x.t.out.data(), device[3], size_t(x.t.out.storage_bytes()), cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(x.t.lse.data(), device[4], size_t(x.t.lse.storage_bytes()), cudaMemcpyDeviceToHost), cudaSuccess);
  for (void* p : device) cudaFree(p);
  expect_policy("cuda", x.t, oracle);
#endif
}

}  // namespace
