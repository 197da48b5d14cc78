// The small kernels around the decode attention kernel: append (+ rotary of the new keys), the split
// combine, and the checked mode's guard. See decode_aux.hpp for what each does. Instantiated here for both
// 16-bit dtypes (none of them depends on the head-dim bucket: they loop over D at run time).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cuda/common/check.hpp"
#include "cuda/decode/cache_rows.cuh"
#include "cuda/decode/decode_aux.hpp"

namespace flashattn::cuda::decode {
namespace {

constexpr int kAppendThreads = 256;
constexpr int64_t kMaxAppendBlocks = 1 << 16;  // grid-stride beyond this (affects speed only)
constexpr int kCombineWarps = 4;               // one warp per output row of an m-block
constexpr int kMaxDvPerLane = 256 / 32;        // Dv <= 256 (the largest bucket): 8 columns per lane
constexpr int kGuardThreads = 128;

// ---- append: one thread per (sequence, new token, K/V head, pair of elements) ----
template <typename Element>
__global__ void __launch_bounds__(kAppendThreads) append_kernel(const __grid_constant__ DecodeArgs args) {
  const KvcacheParams& p = args.p;
  const int pairs = p.head_dim / 2;
  const int64_t total = int64_t(p.batch) * p.seqlen_new * p.heads_k * pairs;
  Element* k_cache = static_cast<Element*>(const_cast<void*>(p.k));
  Element* v_cache = static_cast<Element*>(const_cast<void*>(p.v));
  const Element* k_new = static_cast<const Element*>(p.k_new);
  const Element* v_new = static_cast<const Element*>(p.v_new);
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < total; idx += int64_t(gridDim.x) * blockDim.x) {
    const int q = int(idx % pairs);
    int64_t rest = idx / pairs;
    const int hk = int(rest % p.heads_k);
    rest /= p.heads_k;
    const int t = int(rest % p.seqlen_new);
    const int b = int(rest / p.seqlen_new);
    const int cached = p.cache_seqlens[b];
    if (!cache_length_ok(cached, p.seqlen_new, p.seqlen_k)) continue;  // the attention kernel reports it (NaN)
    const int j = cached + t;  // the new row's position, also its rotary position
    const int32_t id = p.block_table != nullptr ? page_id_of(args, b, j) : 0;
    int64_t k_row = 0, v_row = 0;
    if (!cache_row_offsets(args, b, hk, j, id, &k_row, &v_row)) continue;  // never write through a bad block id
    // K: the pair rotated (or copied: a 16-bit value survives the round trip through float exactly).
    const Element* k_src = k_new + b * p.k_new_batch_stride + int64_t(t) * p.k_new_row_stride + hk * p.k_new_head_stride;
    const RotaryPair pair = rotary_pair(p, q);
    float x0 = float(k_src[pair.first]), x1 = float(k_src[pair.second]);
    if (pair.rotated) rotate_pair<Element>(p, j, q, &x0, &x1);
    k_cache[k_row + pair.first] = Element(x0);
    k_cache[k_row + pair.second] = Element(x1);
    // V: elements 2q, 2q + 1 copied bit for bit (4 aligned bytes: D % 8 == 0 and 16-byte aligned rows).
    const Element* v_src = v_new + b * p.v_new_batch_stride + int64_t(t) * p.v_new_row_stride + hk * p.v_new_head_stride;
    *reinterpret_cast<uint32_t*>(v_cache + v_row + 2 * q) = *reinterpret_cast<const uint32_t*>(v_src + 2 * q);
  }
}

// ---- combine: one CTA per (m-block, K/V head, sequence), one warp per packed row ----
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}
template <typename Element>
__global__ void __launch_bounds__(32 * kCombineWarps) combine_kernel(const __grid_constant__ DecodeArgs args) {
  const KvcacheParams& p = args.p;
  const int m_block = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  const int cached = p.cache_seqlens[b];
  if (!cache_length_ok(cached, p.seqlen_new, p.seqlen_k)) return;  // the attention kernel wrote NaN directly
  const BlockRows rows = block_rows(args, m_block, cached + p.seqlen_new);
  const int used = split_work(rows.key_begin, rows.key_end, args.block_n, args.num_splits, args.min_tiles_per_split, 0).used;
  if (used < 2) return;  // written directly by the attention kernel
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t split_stride = int64_t(p.batch) * p.heads_q * p.seqlen_q;  // partial rows per split
  const int dv = p.head_dim_v;
  Element* out = static_cast<Element*>(p.out);
  for (int row = warp; row < rows.rows; row += kCombineWarps) {
    const int r = rows.row_begin + row;
    const int i = r / args.group, h = hk * args.group + r % args.group;
    const int64_t prow = partial_row(p, b, h, i);
    // The largest split LSE (weights exp(lse_s - max) <= 1: no overflow); NaN from a split that met a bad block id.
    float lse_max = -INFINITY;
    bool any_nan = false;
    for (int s = lane; s < used; s += 32) {
      const float lse = args.partial_lse[s * split_stride + prow];
      any_nan = any_nan || isnan(lse);
      lse_max = fmaxf(lse_max, lse);
    }
    lse_max = warp_max(lse_max);
    any_nan = __any_sync(0xffffffffu, any_nan);
    float acc[kMaxDvPerLane];
#pragma unroll
    for (int k = 0; k < kMaxDvPerLane; ++k) acc[k] = 0.f;
    float weight_sum = 0.f;
    if (lse_max != -INFINITY) {
#pragma unroll 4
      for (int s = 0; s < used; ++s) {  // split order: the same sums on every run (independent loads in flight)
        const float lse = args.partial_lse[s * split_stride + prow];
        const float weight = expf(lse - lse_max);  // 0 for a split whose keys this row does not see (lse_s = -inf)
        weight_sum += weight;
        const float* part = args.partial_out + (s * split_stride + prow) * dv;
#pragma unroll
        for (int k = 0; k < kMaxDvPerLane; ++k)
          if (lane + 32 * k < dv) acc[k] += weight * part[lane + 32 * k];
      }
    }
    // No split saw a key: out = 0, lse = -inf (never NaN).
    const float inv = weight_sum > 0.f ? 1.f / weight_sum : 0.f;
    const float lse = any_nan ? NAN : (weight_sum > 0.f ? lse_max + logf(weight_sum) : -INFINITY);
    Element* out_row = out + b * p.out_batch_stride + int64_t(i) * p.out_row_stride + h * p.out_head_stride;
#pragma unroll
    for (int k = 0; k < kMaxDvPerLane; ++k)
      if (lane + 32 * k < dv) out_row[lane + 32 * k] = Element(any_nan ? NAN : acc[k] * inv);
    if (lane == 0 && p.lse != nullptr) p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + int64_t(i) * p.lse_row_stride] = lse;
  }
}

// ---- guard: one CTA per sequence ----
__global__ void __launch_bounds__(kGuardThreads) guard_kernel(const __grid_constant__ DecodeArgs args, unsigned long long* status) {
  const KvcacheParams& p = args.p;
  const int b = blockIdx.x;
  const int cached = p.cache_seqlens[b];
  if (!cache_length_ok(cached, p.seqlen_new, p.seqlen_k)) {
    if (threadIdx.x == 0) atomicMin(status, guard_key(b, -1));
    return;
  }
  if (p.block_table == nullptr) return;
  const int used_blocks = (cached + p.seqlen_new + p.page_block_size - 1) / p.page_block_size;
  for (int n = threadIdx.x; n < used_blocks; n += blockDim.x) {
    const int32_t id = p.block_table[b * p.block_table_batch_stride + n];
    if (uint32_t(id) >= uint32_t(p.num_blocks)) atomicMin(status, guard_key(b, n));
  }
}

template <typename Element>
Status launch_append_typed(const DecodeArgs& args, cudaStream_t stream) {
  const KvcacheParams& p = args.p;
  const int64_t total = int64_t(p.batch) * p.seqlen_new * p.heads_k * (p.head_dim / 2);
  const int64_t blocks = std::min<int64_t>((total + kAppendThreads - 1) / kAppendThreads, kMaxAppendBlocks);
  append_kernel<Element><<<unsigned(blocks), kAppendThreads, 0, stream>>>(args);
  FA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status();
}

template <typename Element>
Status launch_combine_typed(const DecodeArgs& args, cudaStream_t stream) {
  const dim3 grid(args.m_blocks, args.p.heads_k, args.p.batch);
  combine_kernel<Element><<<grid, 32 * kCombineWarps, 0, stream>>>(args);
  FA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status();
}

}  // namespace

Status launch_append(const DecodeArgs& args, void* stream) {
  const KvcacheParams& p = args.p;
  if (p.k_new == nullptr || p.seqlen_new == 0 || p.batch == 0) return Status();
  const auto s = static_cast<cudaStream_t>(stream);
  return p.dtype == FA_BFLOAT16 ? launch_append_typed<__nv_bfloat16>(args, s) : launch_append_typed<__half>(args, s);
}

Status launch_combine(const DecodeArgs& args, void* stream) {
  if (args.num_splits < 2 || args.m_blocks == 0 || args.p.batch == 0) return Status();
  if (args.p.head_dim_v > 32 * kMaxDvPerLane) return error(FA_ERROR_INTERNAL, "combine: Dv %d > 256", args.p.head_dim_v);
  const auto s = static_cast<cudaStream_t>(stream);
  return args.p.dtype == FA_BFLOAT16 ? launch_combine_typed<__nv_bfloat16>(args, s) : launch_combine_typed<__half>(args, s);
}

Status launch_guard(const DecodeArgs& args, unsigned long long* status, void* stream) {
  if (args.p.batch == 0) return Status();
  guard_kernel<<<args.p.batch, kGuardThreads, 0, static_cast<cudaStream_t>(stream)>>>(args, status);
  FA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status();
}

}  // namespace flashattn::cuda::decode
