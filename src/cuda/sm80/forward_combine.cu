// The merge of the forward's split-KV partials (forward_split.hpp): one warp per (sequence, head, query row).
//
// Share s of a row holds O_s = (sum over its keys of p_j v_j) / (sum of p_j) and its LSE l_s (log2 units). Then
//   L = m + log2(sum_s 2^(l_s - m)),  m = max_s l_s,     O = sum_s 2^(l_s - L) O_s,
// the row's attention over all of its keys (the merge of core semantics), in float32, rounded once to the output type.
// A share without a key of the row has l_s = -inf and weighs 0 (its O_s is never read); a row no share saw a key of
// gets O = 0 and LSE = -inf, as the unsplit kernel gives it; a NaN share (a NaN input, a bad block id) makes the row NaN.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cuda/common/check.hpp"
#include "cuda/common/ptx.cuh"
#include "cuda/sm80/forward_split.hpp"

namespace flashattn::cuda::sm80 {
namespace {

constexpr int kCombineWarps = 4;  // rows per CTA (affects speed only)
constexpr float kLn2 = 0.6931471805599453f;
constexpr int kMaxColumnsPerLane = 8;  // Dv <= 256: 2 float4 per lane

template <typename Element>
__global__ void __launch_bounds__(kCombineWarps * 32) forward_combine_kernel(const __grid_constant__ AttentionParams p,
                                                                            int splits, const float* o_partial,
                                                                            const float* lse_partial) {
  static_assert(kMaxForwardSplits <= 32, "one share per lane");
  const int lane = threadIdx.x & 31;
  const int i = blockIdx.x * kCombineWarps + (threadIdx.x >> 5);
  const int h = blockIdx.y;
  const int b = blockIdx.z;
  const SequenceExtent ext = sequence_extent(p, b);
  if (i >= ext.seqlen_q) return;
  if (ext.seqlen_q <= int(p.routed_seqlen_q)) return;  // the decode kernels' rows (forward_kernel.cuh skips them too)

  const float share_lse = lane < splits ? lse_partial[split_partial_row(p, lane, b, h, i)] : -INFINITY;
  const bool any_nan = __any_sync(0xffffffffu, isnan(share_lse));
  float m = share_lse;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
  float lse2 = NAN;  // log2 units
  float weight = 0.f;
  if (!any_nan && m == -INFINITY) {
    lse2 = -INFINITY;
  } else if (!any_nan) {
    weight = exp2f(share_lse - m);  // 0 for a share without keys
    float sum = weight;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    lse2 = m + log2f(sum);
    weight /= sum;
  }

  // Lane l owns columns 4 l + 128 k, k = 0, 1 (float4 loads of every share's row; 8-byte stores of 4 outputs).
  float acc[kMaxColumnsPerLane];
#pragma unroll
  for (int c = 0; c < kMaxColumnsPerLane; ++c) acc[c] = any_nan ? NAN : 0.f;
  if (!any_nan && lse2 != -INFINITY) {
    for (int s = 0; s < splits; ++s) {
      const float w = __shfl_sync(0xffffffffu, weight, s);
      if (w == 0.f) continue;  // warp-uniform: a share without keys, or one too small to matter in float32
      const float* row = o_partial + split_partial_row(p, s, b, h, i) * p.head_dim_v;
#pragma unroll
      for (int k = 0; k < kMaxColumnsPerLane / 4; ++k) {
        const int col = 4 * lane + 128 * k;
        if (col < p.head_dim_v) {
          const float4 v = *reinterpret_cast<const float4*>(row + col);
          acc[4 * k] = fmaf(w, v.x, acc[4 * k]);
          acc[4 * k + 1] = fmaf(w, v.y, acc[4 * k + 1]);
          acc[4 * k + 2] = fmaf(w, v.z, acc[4 * k + 2]);
          acc[4 * k + 3] = fmaf(w, v.w, acc[4 * k + 3]);
        }
      }
    }
  }
  Element* out = static_cast<Element*>(p.out) + q_offset(p, p.out_batch_stride, p.out_row_stride, p.out_head_stride, b, ext, i, h);
#pragma unroll
  for (int k = 0; k < kMaxColumnsPerLane / 4; ++k) {
    const int col = 4 * lane + 128 * k;
    if (col < p.head_dim_v)
      *reinterpret_cast<uint2*>(out + col) = make_uint2(ElementTraits<Element>::pack(acc[4 * k], acc[4 * k + 1]),
                                                        ElementTraits<Element>::pack(acc[4 * k + 2], acc[4 * k + 3]));
  }
  if (p.lse != nullptr && lane == 0) p.lse[lse_offset(p, b, ext, i, h)] = lse2 * kLn2;
}

}  // namespace

Status launch_forward_combine(const AttentionParams& p, int splits, const float* o_partial, const float* lse_partial,
                              void* stream) {
  if (splits < 1 || splits > kMaxForwardSplits || p.head_dim_v > 32 * kMaxColumnsPerLane || p.head_dim_v % 4 != 0)
    return error(FA_ERROR_INTERNAL, "forward combine: %d splits, Dv %d outside its limits", splits, p.head_dim_v);
  const dim3 grid((p.seqlen_q + kCombineWarps - 1) / kCombineWarps, p.heads_q, p.batch);
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return Status();
  const auto s = static_cast<cudaStream_t>(stream);
  if (p.dtype == FA_BFLOAT16)
    forward_combine_kernel<__nv_bfloat16><<<grid, kCombineWarps * 32, 0, s>>>(p, splits, o_partial, lse_partial);
  else
    forward_combine_kernel<__half><<<grid, kCombineWarps * 32, 0, s>>>(p, splits, o_partial, lse_partial);
  FA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status();
}

}  // namespace flashattn::cuda::sm80
