// Tuning harness of the sm80 forward kernel (not part of the library): instantiates several tile
// configurations and kernel options (the config traits of forward_kernel.cuh: kLazyRescale, kFullTileLoads,
// kSumByMma, kMinBlocksPerSm) side by side, checks each against an fp32 reference computed on the GPU from
// the same bf16 inputs (plus feature cases: peaky, Sq != Sk, GQA, window, softcap, odd sizes), and times
// them on points of the standard sweep (bf16, B = 16384 / S, H = 2048 / D; FLOPs 4 B H S^2 D, half when
// causal, as bench/cuda_bench.cpp). The winner per head dim goes into FORWARD_TILES of src/cuda/manifest.py.
// Self-contained (fills AttentionParams itself, links only the CUDA runtime). Built with
// -DFLASHATTN_BUILD_TUNING=ON, or by hand:
//   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -arch=sm_90a -Iinclude -Isrc bench/forward_tiles.cu
//   flashattn_forward_tiles [--seqlens 512,1024,2048,4096,8192,16384] [--reps 20] [--dims 64,128,256]
//                           [--json out.json] [--log full.txt]
//                           [--variants "d256 m64n64w4s1 pairs,d256 m64n64w4s1"]  (exact names; for ncu)
// Prints one summary table (TFLOP/s per variant and point, worst check error) and the feature checks.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "core/dtype.hpp"
#include "core/mask.hpp"
#include "core/params.hpp"
#include "cuda/sm80/forward_launch.cuh"

namespace {

using flashattn::AttentionParams;
using flashattn::Status;
using flashattn::cuda::KernelConfig;
using flashattn::cuda::launch_forward_sm80;

// The kernel before this session's changes: eager rescale of the online softmax (every tile multiplies O),
// predicated loads of every tile, row sums by FADDs; and single changes, for comparison with the default.
template <typename Base>
struct Baseline : Base {
  static constexpr bool kLazyRescale = false;
  static constexpr bool kFullTileLoads = false;
  static constexpr bool kSumByMma = false;
};
template <typename Base>
struct Eager : Base {
  static constexpr bool kLazyRescale = false;
};
template <typename Base>
struct PredicatedLoads : Base {
  static constexpr bool kFullTileLoads = false;
};

struct Variant {
  const char* name;
  int head_dim;
  Status (*launch)(const AttentionParams&, cudaStream_t);
};

using bf16_t = __nv_bfloat16;
#define VARIANT_OF(WRAP, SUFFIX, D, M, N, W, S) \
  Variant { "d" #D " m" #M "n" #N "w" #W "s" #S SUFFIX, D, &launch_forward_sm80<WRAP<KernelConfig<bf16_t, D, M, N, W, S, false>>> }
template <typename Base>
struct ThreeBlocks : Base {  // launch bounds for 3 CTAs per SM: at most 168 registers at 4 warps
  static constexpr int kMinBlocksPerSm = 3;
};
template <typename Base>
struct SumByMma : Base {  // row sums as P times ones on the tensor cores (faster, LSE with 16-bit rounding)
  static constexpr bool kSumByMma = true;
};
template <typename Base>
struct Pairs : Base {  // warps in pairs on 32 rows: each computes S for half the keys, O for half the columns
  static constexpr int kGroupWarps = 2;
};
template <typename C>
using Default = C;
#define NEW(D, M, N, W, S) VARIANT_OF(Default, "", D, M, N, W, S)
#define BASE(D, M, N, W, S) VARIANT_OF(Baseline, " base", D, M, N, W, S)
#define EAGER(D, M, N, W, S) VARIANT_OF(Eager, " eager", D, M, N, W, S)
#define PRED(D, M, N, W, S) VARIANT_OF(PredicatedLoads, " pred", D, M, N, W, S)
#define MIN3(D, M, N, W, S) VARIANT_OF(ThreeBlocks, " 3cta", D, M, N, W, S)
#define PAIRS(D, M, N, W, S) VARIANT_OF(Pairs, " pairs", D, M, N, W, S)
#define MMASUM(D, M, N, W, S) VARIANT_OF(SumByMma, " mmasum", D, M, N, W, S)  // the option, beside the default
template <typename Base>
using Compact = flashattn::cuda::sm80::WithCompactEpilogue<Base>;  // the short-call rows' epilogue (manifest max_seqlen)
#define COMPACT(D, M, N, W, S) VARIANT_OF(Compact, " compact", D, M, N, W, S)

// The first row of each head dim is the library's tile and kernel before this session (baseline); the second
// is the library's choice now (FORWARD_TILES, default kernel options), except at D = 256, where it is `pairs`.
// History (H200):
//   round 1 (05:07 UTC) dropped the overlapped loop (S of the next tile beside this tile's softmax, 16 rows per
//   warp: 10-40% slower everywhere);
//   round 2 (05:19 UTC) measured the row sums by mma (+2-6%; an option, off by default: see SumByMmaOf);
//   round 3 (09:50 UTC) found warp pairs for D = 256 (`pairs`, KernelConfig::kGroupWarps = 2): +3-6% from
//   S = 2k, -2.5% at S = 512 causal; at D = 128 they lose (its warps already own 32 rows).
const Variant kVariants[] = {
    BASE(64, 128, 64, 4, 2),  NEW(64, 128, 128, 4, 2),  MMASUM(64, 128, 128, 4, 2),
    BASE(96, 128, 64, 4, 2),  NEW(96, 128, 64, 4, 2),   NEW(96, 128, 128, 4, 2),  NEW(96, 128, 64, 4, 1),
    BASE(128, 128, 64, 4, 2), NEW(128, 128, 64, 4, 2),  MMASUM(128, 128, 64, 4, 2),  COMPACT(128, 128, 64, 4, 2),
    BASE(192, 128, 64, 8, 2), NEW(192, 128, 64, 8, 2),  NEW(192, 64, 64, 4, 1),   NEW(192, 64, 64, 4, 2),
    NEW(192, 128, 64, 8, 1),
    BASE(256, 128, 64, 8, 2), NEW(256, 64, 64, 4, 1),   MMASUM(256, 64, 64, 4, 1),  NEW(256, 128, 64, 8, 2),
    PAIRS(256, 64, 64, 4, 1), PAIRS(256, 128, 64, 8, 2),
    PAIRS(128, 128, 64, 8, 2),
};

// ---- fp32 reference: one CTA per (query row, head, batch entry) of the checked heads ----
// Scores of the row in shared memory (Sk floats), softmax in two passes, O = P V with threads over columns.
constexpr int kRefThreads = 128;

__device__ float block_reduce(float v, bool is_max, float* scratch) {
  for (int o = 16; o > 0; o >>= 1) {
    const float w = __shfl_xor_sync(0xffffffffu, v, o);
    v = is_max ? fmaxf(v, w) : v + w;
  }
  const int warp = threadIdx.x / 32;
  __syncthreads();  // scratch reuse across calls
  if (threadIdx.x % 32 == 0) scratch[warp] = v;
  __syncthreads();
  float r = scratch[0];
  for (int w = 1; w < kRefThreads / 32; ++w) r = is_max ? fmaxf(r, scratch[w]) : r + scratch[w];
  return r;
}

// Dense BSHD layout: q [B, Sq, Hq, D], k/v [B, Sk, Hk, D], out [B, Sq, Hq, D] in fp32. `heads` lists the
// (b, h) pairs to compute (blockIdx.y), rows are blockIdx.x.
__global__ void reference_kernel(AttentionParams p, const int2* heads, float* ref_out) {
  extern __shared__ float ref_smem[];
  float* scores = ref_smem + 32;
  const int i = blockIdx.x;
  const int b = heads[blockIdx.y].x, h = heads[blockIdx.y].y;
  const int hk = h / (p.heads_q / p.heads_k);
  const bf16_t* q = static_cast<const bf16_t*>(p.q) + b * p.q_batch_stride + int64_t(i) * p.q_row_stride + h * p.q_head_stride;
  const bf16_t* k = static_cast<const bf16_t*>(p.k) + b * p.k_batch_stride + hk * p.k_head_stride;
  const bf16_t* v = static_cast<const bf16_t*>(p.v) + b * p.v_batch_stride + hk * p.v_head_stride;
  const flashattn::WindowMask mask(p.window_left, p.window_right, p.seqlen_q, p.seqlen_k);
  const flashattn::ScoreTransform transform{p.softcap, 0.f, p.seqlen_k - p.seqlen_q};
  float* q_row = scores + p.seqlen_k;  // the query row in fp32
  for (int d = threadIdx.x; d < p.head_dim; d += kRefThreads) q_row[d] = __bfloat162float(q[d]);
  __syncthreads();
  // One warp per key, lanes over the columns (coalesced), then a warp sum.
  const int lane = threadIdx.x % 32;
  for (int j = threadIdx.x / 32; j < p.seqlen_k; j += kRefThreads / 32) {
    float dot = 0.f;
    for (int d = lane; d < p.head_dim; d += 32) dot += q_row[d] * __bfloat162float(k[int64_t(j) * p.k_row_stride + d]);
    for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    if (lane == 0) scores[j] = mask.visible(i, j) ? transform(dot * p.softmax_scale, i, j) : -INFINITY;
  }
  __syncthreads();
  float local_max = -INFINITY;
  for (int j = threadIdx.x; j < p.seqlen_k; j += kRefThreads) local_max = fmaxf(local_max, scores[j]);
  const float row_max = block_reduce(local_max, true, ref_smem);
  float local_sum = 0.f;
  for (int j = threadIdx.x; j < p.seqlen_k; j += kRefThreads) {
    const float e = row_max == -INFINITY ? 0.f : expf(scores[j] - row_max);
    scores[j] = e;
    local_sum += e;
  }
  const float sum = block_reduce(local_sum, false, ref_smem);
  for (int d = threadIdx.x; d < p.head_dim; d += kRefThreads) {
    float acc = 0.f;
    for (int j = 0; j < p.seqlen_k; ++j) acc += scores[j] * __bfloat162float(v[int64_t(j) * p.v_row_stride + d]);
    ref_out[(int64_t(blockIdx.y) * p.seqlen_q + i) * p.head_dim + d] = sum > 0.f ? acc / sum : 0.f;
  }
}

struct Problem {
  int batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim;
  bool causal;
  int window_left = -1, window_right = -1;
  float softcap = 0.f;
  float scale_multiplier = 1.f;  // > 1: peaky softmax (the max moves by more than kMaxStaleLog2 often)
};

AttentionParams make_params(const Problem& pr, void* q, void* k, void* v, void* out, float* lse) {
  AttentionParams p{};
  p.dtype = FA_BFLOAT16;
  p.device = FA_DEVICE_CUDA;
  p.device_id = 0;
  p.batch = pr.batch;
  p.seqlen_q = pr.seqlen_q;
  p.seqlen_k = pr.seqlen_k;
  p.heads_q = pr.heads_q;
  p.heads_k = pr.heads_k;
  p.head_dim = p.head_dim_v = pr.head_dim;
  const int64_t d = pr.head_dim;
  p.q = q;
  p.q_head_stride = d, p.q_row_stride = d * pr.heads_q, p.q_batch_stride = d * pr.heads_q * pr.seqlen_q;
  p.k = k;
  p.k_head_stride = d, p.k_row_stride = d * pr.heads_k, p.k_batch_stride = d * pr.heads_k * pr.seqlen_k;
  p.v = v;
  p.v_head_stride = d, p.v_row_stride = d * pr.heads_k, p.v_batch_stride = d * pr.heads_k * pr.seqlen_k;
  p.out = out;
  p.out_head_stride = d, p.out_row_stride = d * pr.heads_q, p.out_batch_stride = d * pr.heads_q * pr.seqlen_q;
  p.lse = lse;
  p.lse_row_stride = 1, p.lse_head_stride = pr.seqlen_q, p.lse_batch_stride = int64_t(pr.seqlen_q) * pr.heads_q;
  p.softmax_scale = pr.scale_multiplier / std::sqrt(float(pr.head_dim));
  p.causal = pr.causal;
  p.window_left = pr.window_left;
  p.window_right = pr.causal ? 0 : pr.window_right;
  p.softcap = pr.softcap;
  p.num_threads = 1;
  return p;
}

struct Buffers {
  void *q, *k, *v, *out;
  float *lse, *ref;
  int2* heads;
};

// Fills `ref` (fp32) for the checked heads and returns them.
std::vector<int2> compute_reference(const AttentionParams& p, const Buffers& buf) {
  std::vector<int2> heads = {{0, 0}};
  if (p.batch > 1 || p.heads_q > 1) heads.push_back({p.batch - 1, p.heads_q - 1});
  CHECK_CUDA(cudaMemcpy(buf.heads, heads.data(), heads.size() * sizeof(int2), cudaMemcpyHostToDevice));
  const int smem = (32 + p.seqlen_k + p.head_dim) * 4;
  CHECK_CUDA(cudaFuncSetAttribute(reference_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  reference_kernel<<<dim3(p.seqlen_q, heads.size()), kRefThreads, smem>>>(p, buf.heads, buf.ref);
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaDeviceSynchronize());
  return heads;
}

struct CheckResult {
  double rel_l2 = 0, max_abs = 0;
  double rel_l2_vs_baseline = 0;  // against the first variant of the head dim on the same inputs
  bool ok = true;
  std::string message;
};

// Poisons out (NaN), runs the variant, compares the checked heads against the reference.
// `baseline` (host copy of the first variant's output) is filled when empty, else compared against.
CheckResult check_variant(const Variant& variant, const AttentionParams& p, const Buffers& buf, const std::vector<int2>& heads,
                          std::vector<uint16_t>& baseline) {
  CheckResult r;
  const int64_t out_elements = int64_t(p.batch) * p.seqlen_q * p.heads_q * p.head_dim;
  CHECK_CUDA(cudaMemset(buf.out, 0xFF, out_elements * 2));
  const Status st = variant.launch(p, nullptr);
  CHECK_CUDA(cudaDeviceSynchronize());
  if (!st.ok()) {
    r.ok = false;
    r.message = st.message();
    return r;
  }
  std::vector<uint16_t> got(static_cast<size_t>(out_elements));
  CHECK_CUDA(cudaMemcpy(got.data(), buf.out, out_elements * 2, cudaMemcpyDeviceToHost));
  std::vector<float> want(heads.size() * p.seqlen_q * p.head_dim);
  CHECK_CUDA(cudaMemcpy(want.data(), buf.ref, want.size() * 4, cudaMemcpyDeviceToHost));
  const bool have_baseline = !baseline.empty();
  if (!have_baseline) baseline = got;
  double err2 = 0, ref2 = 0, base_err2 = 0;
  for (size_t hi = 0; hi < heads.size(); ++hi)
    for (int i = 0; i < p.seqlen_q; ++i)
      for (int d = 0; d < p.head_dim; ++d) {
        const int64_t at = heads[hi].x * p.out_batch_stride + i * p.out_row_stride + heads[hi].y * p.out_head_stride + d;
        const double x = flashattn::to_float(flashattn::bf16{got[at]});
        const double y = want[(hi * p.seqlen_q + i) * p.head_dim + d];
        const double diff = std::abs(x - y);
        const double base = flashattn::to_float(flashattn::bf16{baseline[at]});
        base_err2 += (x - base) * (x - base);
        if (!(diff <= 1e30)) r.ok = false;  // NaN (poison left) or Inf
        err2 += diff * diff;
        ref2 += y * y;
        r.max_abs = std::max(r.max_abs, std::isnan(diff) ? INFINITY : diff);
      }
  r.rel_l2 = std::sqrt(err2 / std::max(ref2, 1e-30));
  r.rel_l2_vs_baseline = std::sqrt(base_err2 / std::max(ref2, 1e-30));
  // bf16 output rounding alone gives ~2e-3 relative (2^-9); the eager baseline measures ~2.5e-3.
  if (!(r.rel_l2 < 6e-3)) r.ok = false;
  return r;
}

double time_variant(const Variant& variant, const AttentionParams& p, int reps) {
  return flashattn::bench::median_event_ms(nullptr, 3, reps, [&] { (void)variant.launch(p, nullptr); });
}

void fill_normal(void* dst, int64_t n, uint64_t seed) {
  std::vector<uint16_t> host(static_cast<size_t>(n));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (auto& h : host) h = flashattn::to_bf16(normal(rng)).bits;
  CHECK_CUDA(cudaMemcpy(dst, host.data(), host.size() * 2, cudaMemcpyHostToDevice));
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> seqlens = {512, 1024, 2048, 4096, 8192, 16384};
  std::vector<int> dims = {64, 128, 256};
  int reps = 20;
  std::string json_path, log_path;
  std::vector<std::string> only;  // --variants: exact names, comma-separated (default: every variant)
  for (int a = 1; a + 1 < argc; a += 2) {
    const std::string arg = argv[a];
    if (arg == "--seqlens") seqlens = flashattn::bench::parse_ints(argv[a + 1]);
    else if (arg == "--dims") dims = flashattn::bench::parse_ints(argv[a + 1]);
    else if (arg == "--reps") reps = std::stoi(argv[a + 1]);
    else if (arg == "--json") json_path = argv[a + 1];
    else if (arg == "--log") log_path = argv[a + 1];
    else if (arg == "--variants") {
      std::stringstream names(argv[a + 1]);
      for (std::string name; std::getline(names, name, ',');) only.push_back(name);
    }
  }
  FILE* log = log_path.empty() ? nullptr : std::fopen(log_path.c_str(), "w");
  FILE* json = json_path.empty() ? nullptr : std::fopen(json_path.c_str(), "w");
  if (json) std::fprintf(json, "[\n");
  bool first_json = true;

  constexpr int64_t kTokens = 16384, kHidden = 2048, kElements = kTokens * kHidden;
  Buffers buf;
  for (void** p : {&buf.q, &buf.k, &buf.v, &buf.out}) CHECK_CUDA(cudaMalloc(p, kElements * 2));
  CHECK_CUDA(cudaMalloc(&buf.lse, kTokens * 64 * 4));
  CHECK_CUDA(cudaMalloc(&buf.ref, 2 * 16384 * 256 * 4));
  CHECK_CUDA(cudaMalloc(&buf.heads, 16 * sizeof(int2)));
  fill_normal(buf.q, kElements, 7);
  fill_normal(buf.k, kElements, 8);
  fill_normal(buf.v, kElements, 9);
  int failures = 0;

  // ---- sweep: per head dim, a table of TFLOP/s (columns: S x causal), worst check error per variant ----
  for (int d : dims) {
    std::vector<const Variant*> variants;
    for (const Variant& v : kVariants)
      if (v.head_dim == d && (only.empty() || std::find(only.begin(), only.end(), v.name) != only.end()))
        variants.push_back(&v);
    if (variants.empty()) continue;
    std::vector<std::vector<double>> tflops(variants.size());
    std::vector<double> worst(variants.size(), 0.0), worst_base(variants.size(), 0.0);
    std::vector<std::string> notes(variants.size());
    for (int s : seqlens)
      for (int causal : {0, 1}) {
        Problem pr{int(kTokens / s), s, s, int(kHidden / d), int(kHidden / d), d, causal != 0};
        const AttentionParams p = make_params(pr, buf.q, buf.k, buf.v, buf.out, buf.lse);
        const std::vector<int2> heads = compute_reference(p, buf);
        std::vector<uint16_t> baseline;
        for (size_t vi = 0; vi < variants.size(); ++vi) {
          const Variant& variant = *variants[vi];
          const CheckResult check = check_variant(variant, p, buf, heads, baseline);
          double ms = NAN, tf = NAN;
          if (check.message.empty()) {
            ms = time_variant(variant, p, reps);
            const double flops = 4.0 * pr.batch * pr.heads_q * double(s) * double(s) * d * (causal ? 0.5 : 1.0);
            tf = flops / (ms * 1e-3) / 1e12;
          }
          tflops[vi].push_back(tf);
          worst[vi] = std::max(worst[vi], check.ok ? check.rel_l2 : INFINITY);
          worst_base[vi] = std::max(worst_base[vi], check.rel_l2_vs_baseline);
          if (!check.ok) {
            ++failures;
            notes[vi] = check.message.empty() ? "CHECK FAILED" : check.message;
          }
          if (log)
            std::fprintf(log, "%-26s S %6d causal %d | %8.3f ms %7.1f TFLOP/s | rel_l2 %.3g max_abs %.3g vs_baseline %.3g %s\n",
                         variant.name, s, causal, ms, tf, check.rel_l2, check.max_abs, check.rel_l2_vs_baseline, check.ok ? "ok" : ("FAIL " + check.message).c_str());
          if (json) {
            std::fprintf(json, "%s  {\"variant\": \"%s\", \"head_dim\": %d, \"seqlen\": %d, \"causal\": %d, \"ms\": %.5g, "
                         "\"tflops\": %.5g, \"rel_l2\": %.4g, \"max_abs\": %.4g, \"ok\": %s}",
                         first_json ? "" : ",\n", variant.name, d, s, causal, std::isfinite(ms) ? ms : -1.0, std::isfinite(tf) ? tf : -1.0, check.rel_l2, check.max_abs,
                         check.ok ? "true" : "false");
            first_json = false;
          }
        }
      }
    std::printf("D=%-3d TFLOP/s bf16   S:", d);
    for (int s : seqlens) std::printf(" %4d%s n     c", s >= 1024 ? s / 1024 : s, s >= 1024 ? "k" : " ");
    std::printf("  worst rel_l2 (ref, baseline)\n");
    for (size_t vi = 0; vi < variants.size(); ++vi) {
      std::printf("%-26s", variants[vi]->name);
      for (double t : tflops[vi]) std::printf(" %5.1f", t);
      std::printf("  %.2g %.2g %s\n", worst[vi], worst_base[vi], notes[vi].c_str());
    }
    std::fflush(stdout);
  }

  // ---- feature checks of every variant: peaky softmax, Sq != Sk, GQA, window, softcap, odd sizes ----
  const Problem kFeatureCases[] = {
      {2, 1000, 1000, 4, 4, 0, true, -1, -1, 0.f, 8.f},     // peaky causal: the max moves by > 8 (log2) often
      {1, 127, 4097, 8, 2, 0, true, -1, -1, 0.f, 1.f},      // causal bottom-right, GQA 4:1, partial tiles
      {1, 4097, 127, 4, 1, 0, false, -1, -1, 0.f, 3.f},     // Sq > Sk, MQA, somewhat peaky
      {2, 1000, 1000, 2, 2, 0, false, 100, 17, 0.f, 1.f},   // sliding window (rows with no key inside? none)
      {1, 17, 1000, 4, 4, 0, false, -1, -1, 30.f, 4.f},     // softcap, peaky
      {3, 1, 17, 2, 1, 0, true, -1, -1, 0.f, 1.f},          // one query row
  };
  std::printf("features (peaky, Sq!=Sk, GQA, window, softcap, odd; every variant):");
  for (int d : dims) {
    double feature_worst = 0;
    int checked = 0, failed = 0;
    std::string failed_names;
    for (const Variant& variant : kVariants) {
      if (variant.head_dim != d) continue;
      for (const Problem& base : kFeatureCases) {
        Problem pr = base;
        pr.head_dim = d;
        const AttentionParams p = make_params(pr, buf.q, buf.k, buf.v, buf.out, buf.lse);
        const std::vector<int2> heads = compute_reference(p, buf);
        std::vector<uint16_t> no_baseline;
        const CheckResult check = check_variant(variant, p, buf, heads, no_baseline);
        ++checked;
        feature_worst = std::max(feature_worst, check.ok ? check.rel_l2 : INFINITY);
        if (log)
          std::fprintf(log, "feature %-26s Sq %d Sk %d Hq %d Hk %d causal %d window %d,%d softcap %g x%g | rel_l2 %.3g max_abs %.3g %s\n",
                       variant.name, pr.seqlen_q, pr.seqlen_k, pr.heads_q, pr.heads_k, pr.causal, pr.window_left,
                       pr.window_right, pr.softcap, pr.scale_multiplier, check.rel_l2, check.max_abs,
                       check.ok ? "ok" : ("FAIL " + check.message).c_str());
        if (!check.ok) {
          ++failed;
          ++failures;
          failed_names += std::string(" [") + variant.name + " Sq " + std::to_string(pr.seqlen_q) + "]";
        }
      }
    }
    std::printf(" D%d %d/%d ok, worst %.2g%s;", d, checked - failed, checked, feature_worst, failed_names.c_str());
  }
  std::printf("\n");
  if (json) {
    std::fprintf(json, "\n]\n");
    std::fclose(json);
  }
  if (log) std::fclose(log);
  std::printf("%s: %d check failures\n", failures ? "FAILED" : "PASSED", failures);
  return failures ? 1 : 0;
}
