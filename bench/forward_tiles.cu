// Tuning harness of the sm80 forward kernel (not part of the library): instantiates several tile
// configurations side by side, checks each against the library's own choice on the same inputs, and
// times them on points of the standard sweep (bf16, B = 16384 / S, H = 2048 / D). The winner per head
// dim goes into FORWARD_TILES of src/cuda/manifest.py. Built with -DFLASHATTN_BUILD_TUNING=ON.
//   flashattn_forward_tiles [--seqlens 1024,4096,16384] [--reps 10]
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "api/validate.hpp"
#include "core/dtype.hpp"
#include "cuda/sm80/forward_launch.cuh"

namespace {

using flashattn::AttentionParams;
using flashattn::Status;
using flashattn::cuda::KernelConfig;
using flashattn::cuda::launch_forward_sm80;

#define CHECK_CUDA(call)                                                                       \
  do {                                                                                         \
    const cudaError_t e_ = (call);                                                             \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

struct Variant {
  const char* name;
  int head_dim;
  Status (*launch)(const AttentionParams&, cudaStream_t);
};

#define VARIANT(D, M, N, W, S) \
  Variant { "d" #D " m" #M " n" #N " w" #W " s" #S, D, &launch_forward_sm80<KernelConfig<__nv_bfloat16, D, M, N, W, S, false>> }

const Variant kVariants[] = {
    VARIANT(64, 128, 64, 4, 2),  VARIANT(64, 128, 128, 4, 2), VARIANT(64, 128, 64, 4, 1),  VARIANT(64, 64, 64, 4, 2),
    VARIANT(64, 128, 128, 8, 2), VARIANT(128, 128, 64, 4, 2), VARIANT(128, 128, 64, 4, 1), VARIANT(128, 128, 32, 4, 2),
    VARIANT(128, 64, 64, 4, 2),  VARIANT(128, 64, 64, 4, 1),  VARIANT(128, 128, 128, 8, 2), VARIANT(128, 128, 64, 8, 2),
    VARIANT(256, 128, 64, 8, 1), VARIANT(256, 128, 64, 8, 2), VARIANT(256, 64, 64, 4, 1),  VARIANT(256, 128, 32, 8, 2),
};

std::vector<int> parse_ints(const std::string& s) {
  std::vector<int> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) v.push_back(std::stoi(item));
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> seqlens = {1024, 4096, 16384};
  int reps = 10;
  for (int a = 1; a + 1 < argc; a += 2) {
    const std::string arg = argv[a];
    if (arg == "--seqlens") seqlens = parse_ints(argv[a + 1]);
    else if (arg == "--reps") reps = std::stoi(argv[a + 1]);
  }
  constexpr int64_t kTokens = 16384, kHidden = 2048, kElements = kTokens * kHidden;
  void *q, *k, *v, *out, *ref, *lse;
  for (void** p : {&q, &k, &v, &out, &ref}) CHECK_CUDA(cudaMalloc(p, kElements * 2));
  CHECK_CUDA(cudaMalloc(&lse, kTokens * 64 * 4));
  {
    std::vector<uint16_t> host(static_cast<size_t>(kElements));
    std::mt19937_64 rng(7);
    std::normal_distribution<float> normal(0.f, 1.f);
    for (void* dst : {q, k, v}) {
      for (auto& h : host) h = flashattn::to_bf16(normal(rng)).bits;
      CHECK_CUDA(cudaMemcpy(dst, host.data(), host.size() * 2, cudaMemcpyHostToDevice));
    }
  }
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  std::printf("%-22s %6s %6s | %8s %8s | %s\n", "variant", "S", "causal", "ms", "TFLOP/s", "max |diff| vs library");
  for (const Variant& variant : kVariants)
    for (int s : seqlens)
      for (int causal : {0, 1}) {
        const int64_t d = variant.head_dim, b = kTokens / s, h = kHidden / d;
        const int64_t shape[4] = {b, s, h, d};
        fa_forward_args args{};
        args.q = fa_tensor_contiguous(q, 4, shape, FA_BFLOAT16, FA_DEVICE_CUDA, 0);
        args.k = fa_tensor_contiguous(k, 4, shape, FA_BFLOAT16, FA_DEVICE_CUDA, 0);
        args.v = fa_tensor_contiguous(v, 4, shape, FA_BFLOAT16, FA_DEVICE_CUDA, 0);
        args.out = fa_tensor_contiguous(ref, 4, shape, FA_BFLOAT16, FA_DEVICE_CUDA, 0);
        const int64_t lse_shape[3] = {b, h, s};
        args.lse = fa_tensor_contiguous(lse, 3, lse_shape, FA_FLOAT32, FA_DEVICE_CUDA, 0);
        fa_options options;
        fa_options_init(&options);
        options.backend = FA_BACKEND_CUDA;
        options.causal = causal;
        // the library's choice, as the reference output of this variant
        fa_error error{};
        if (fa_forward(&args, &options, &error) != FA_OK) {
          std::printf("library: %s\n", error.message);
          return 1;
        }
        AttentionParams p;
        args.out.data = out;
        Status st = flashattn::api::make_forward_params(args, options, &p);
        if (!st.ok()) {
          std::printf("params: %s\n", st.message().c_str());
          return 1;
        }
        CHECK_CUDA(cudaMemset(out, 0xFF, kElements * 2));  // NaN poison
        st = variant.launch(p, nullptr);
        CHECK_CUDA(cudaDeviceSynchronize());
        if (!st.ok()) {
          std::printf("%-22s %6d %6d | %s\n", variant.name, s, causal, st.message().c_str());
          continue;
        }
        std::vector<uint16_t> got(static_cast<size_t>(kElements)), want(static_cast<size_t>(kElements));
        CHECK_CUDA(cudaMemcpy(got.data(), out, kElements * 2, cudaMemcpyDeviceToHost));
        CHECK_CUDA(cudaMemcpy(want.data(), ref, kElements * 2, cudaMemcpyDeviceToHost));
        double max_diff = 0;
        for (int64_t n = 0; n < kElements; n += 7) {
          const double diff = std::abs(double(flashattn::to_float(flashattn::bf16{got[n]})) -
                                       double(flashattn::to_float(flashattn::bf16{want[n]})));
          max_diff = std::isnan(diff) ? INFINITY : std::max(max_diff, diff);
        }
        for (int w = 0; w < 3; ++w) variant.launch(p, nullptr);
        std::vector<float> times;
        for (int r = 0; r < reps; ++r) {
          CHECK_CUDA(cudaEventRecord(start));
          variant.launch(p, nullptr);
          CHECK_CUDA(cudaEventRecord(stop));
          CHECK_CUDA(cudaEventSynchronize(stop));
          float ms = 0;
          CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
          times.push_back(ms);
        }
        std::sort(times.begin(), times.end());
        const double ms = times[times.size() / 2];
        const double flops = 4.0 * double(b * h) * double(s) * double(s) * double(d) * (causal ? 0.5 : 1.0);
        std::printf("%-22s %6d %6d | %8.3f %8.1f | %.3g\n", variant.name, s, causal, ms, flops / (ms * 1e-3) / 1e12, max_diff);
        std::fflush(stdout);
      }
  return 0;
}
