// Tuning harness of the sm80 backward kernel (not part of the library): instantiates several tile
// configurations side by side, checks each against the library's own choice on the same inputs, and
// times them on points of the standard sweep (bf16, B = 16384 / S, H = 2048 / D; backward FLOPs =
// 2.5 x forward's 4 B H S^2 D, half when causal). The winner per head dim goes into BACKWARD_TILES of
// src/cuda/manifest.py. Built with -DFLASHATTN_BUILD_TUNING=ON.
//   flashattn_backward_tiles [--seqlens 1024,4096,16384] [--reps 10] [--dims 64,128,256]
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "api/validate.hpp"
#include "core/dtype.hpp"
#include "cuda/sm80/backward_launch.cuh"

namespace {

using flashattn::BackwardParams;
using flashattn::Status;
using flashattn::cuda::KernelConfig;
using flashattn::cuda::launch_backward_sm80;

struct Variant {
  const char* name;
  int head_dim;
  Status (*launch)(const BackwardParams&, cudaStream_t);
  int (*ctas_per_sm)();  // occupancy of the main kernel (after its first launch set the smem attribute)
};

template <class Config>
int main_kernel_ctas_per_sm() {
  using T = flashattn::cuda::sm80::bwd::BackwardTraits<Config>;
  int blocks = 0;
  CHECK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &blocks, flashattn::cuda::sm80::bwd::backward_main_kernel<Config, false>, T::kThreads, T::kSmemBytes));
  return blocks;
}

// D, block_m, block_n, warps, keys per warp
#define VARIANT(D, M, N, W, K)                                                            \
  Variant {                                                                               \
    "d" #D " m" #M " n" #N " w" #W " k" #K, D,                                            \
        &launch_backward_sm80<KernelConfig<__nv_bfloat16, D, M, N, W, 2, false, K>>,      \
        &main_kernel_ctas_per_sm<KernelConfig<__nv_bfloat16, D, M, N, W, 2, false, K>>    \
  }

const Variant kVariants[] = {
    VARIANT(64, 64, 128, 4, 32), VARIANT(128, 64, 128, 8, 32), VARIANT(256, 64, 64, 8, 32),
    VARIANT(256, 64, 64, 8, 16), VARIANT(96, 64, 128, 8, 16),  VARIANT(192, 64, 64, 8, 32),
};

double max_abs_diff(const void* got_device, const void* want_device, int64_t n, double* want_max) {
  std::vector<uint16_t> got(static_cast<size_t>(n)), want(static_cast<size_t>(n));
  CHECK_CUDA(cudaMemcpy(got.data(), got_device, n * 2, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(want.data(), want_device, n * 2, cudaMemcpyDeviceToHost));
  double max_diff = 0, max_want = 0;
  for (int64_t i = 0; i < n; i += 7) {
    const double g = flashattn::to_float(flashattn::bf16{got[i]}), w = flashattn::to_float(flashattn::bf16{want[i]});
    const double diff = std::abs(g - w);
    max_diff = std::isnan(diff) ? INFINITY : std::max(max_diff, diff);
    max_want = std::max(max_want, std::abs(w));
  }
  *want_max = max_want;
  return max_diff;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> seqlens = {1024, 4096, 16384};
  std::vector<int> dims = {64, 96, 128, 192, 256};
  int reps = 10;
  for (int a = 1; a + 1 < argc; a += 2) {
    const std::string arg = argv[a];
    if (arg == "--seqlens") seqlens = flashattn::bench::parse_ints(argv[a + 1]);
    else if (arg == "--dims") dims = flashattn::bench::parse_ints(argv[a + 1]);
    else if (arg == "--reps") reps = std::stoi(argv[a + 1]);
  }
  constexpr int64_t kTokens = 16384, kHidden = 2048, kElements = kTokens * kHidden;
  constexpr int64_t kWorkspaceBytes = int64_t(1) << 30;  // >= any layout of these shapes
  void *q, *k, *v, *out, *dout, *lse, *dq, *dk, *dv, *dq_ref, *dk_ref, *dv_ref, *workspace;
  for (void** p : {&q, &k, &v, &out, &dout, &dq, &dk, &dv, &dq_ref, &dk_ref, &dv_ref})
    CHECK_CUDA(cudaMalloc(p, kElements * 2));
  CHECK_CUDA(cudaMalloc(&lse, kTokens * 64 * 4));
  CHECK_CUDA(cudaMalloc(&workspace, kWorkspaceBytes));
  {
    std::vector<uint16_t> host(static_cast<size_t>(kElements));
    std::mt19937_64 rng(7);
    std::normal_distribution<float> normal(0.f, 1.f);
    for (void* dst : {q, k, v, dout}) {
      for (auto& h : host) h = flashattn::to_bf16(normal(rng)).bits;
      CHECK_CUDA(cudaMemcpy(dst, host.data(), host.size() * 2, cudaMemcpyHostToDevice));
    }
  }
  std::printf("%-24s %6s %6s | %8s %8s | %s\n", "variant", "S", "causal", "ms", "TFLOP/s",
              "max |diff| / max |lib| (dq dk dv) vs library");
  for (const Variant& variant : kVariants) {
    if (std::find(dims.begin(), dims.end(), variant.head_dim) == dims.end()) continue;
    for (int s : seqlens)
      for (int causal : {0, 1}) {
        const int64_t d = variant.head_dim, b = kTokens / s, h = kHidden / d;
        const int64_t shape[4] = {b, s, h, d};
        auto tensor = [&](void* data) { return fa_tensor_contiguous(data, 4, shape, FA_BFLOAT16, FA_DEVICE_CUDA, 0); };
        const int64_t lse_shape[3] = {b, h, s};
        fa_options options;
        fa_options_init(&options);
        options.backend = FA_BACKEND_CUDA;
        options.causal = causal;
        fa_error error{};
        fa_forward_args fwd{};
        fwd.q = tensor(q);
        fwd.k = tensor(k);
        fwd.v = tensor(v);
        fwd.out = tensor(out);
        fwd.lse = fa_tensor_contiguous(lse, 3, lse_shape, FA_FLOAT32, FA_DEVICE_CUDA, 0);
        if (fa_forward(&fwd, &options, &error) != FA_OK) {
          std::printf("forward: %s\n", error.message);
          return 1;
        }
        fa_backward_args args{};
        args.q = fwd.q;
        args.k = fwd.k;
        args.v = fwd.v;
        args.out = fwd.out;
        args.lse = fwd.lse;
        args.dout = tensor(dout);
        args.dq = tensor(dq_ref);
        args.dk = tensor(dk_ref);
        args.dv = tensor(dv_ref);
        // the library's choice, as the reference gradients of this variant
        if (fa_backward(&args, &options, &error) != FA_OK) {
          std::printf("library backward: %s\n", error.message);
          return 1;
        }
        args.dq = tensor(dq);
        args.dk = tensor(dk);
        args.dv = tensor(dv);
        BackwardParams p;
        Status st = flashattn::api::make_backward_params(args, options, &p);
        if (!st.ok()) {
          std::printf("params: %s\n", st.message().c_str());
          return 1;
        }
        p.workspace = workspace;
        p.workspace_bytes = kWorkspaceBytes;
        for (void* g : {dq, dk, dv}) CHECK_CUDA(cudaMemset(g, 0xFF, kElements * 2));  // NaN poison
        st = variant.launch(p, nullptr);
        CHECK_CUDA(cudaDeviceSynchronize());
        if (!st.ok()) {
          std::printf("%-24s %6d %6d | %s\n", variant.name, s, causal, st.message().c_str());
          continue;
        }
        double rel[3];
        void* got[3] = {dq, dk, dv};
        void* want[3] = {dq_ref, dk_ref, dv_ref};
        for (int g = 0; g < 3; ++g) {
          double want_max = 0;
          const double diff = max_abs_diff(got[g], want[g], b * s * h * d, &want_max);  // the used part
          rel[g] = diff / std::max(want_max, 1e-30);
        }
        const double ms = flashattn::bench::median_event_ms(nullptr, 3, reps, [&] { variant.launch(p, nullptr); });
        const double flops = 2.5 * 4.0 * double(b * h) * double(s) * double(s) * double(d) * (causal ? 0.5 : 1.0);
        std::printf("%-24s %6d %6d | %8.3f %8.1f | %.2e %.2e %.2e | %d CTA/SM\n", variant.name, s, causal, ms,
                    flops / (ms * 1e-3) / 1e12, rel[0], rel[1], rel[2], variant.ctas_per_sm());
        std::fflush(stdout);
      }
  }
  return 0;
}
