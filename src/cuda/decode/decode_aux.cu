// The small kernels around the decode attention kernel: append (+ rotary of the new keys), the split
// combine, and the checked mode's guard. See decode_aux.hpp for what each does. Instantiated here for both
// 16-bit dtypes (none of them depends on the head-dim bucket: they loop over D at run time).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/fp8.hpp"
#include "cuda/common/check.hpp"
#include "cuda/common/ptx.cuh"
#include "cuda/decode/cache_rows.cuh"
#include "cuda/decode/decode_aux.hpp"
#include "cuda/decode/programmatic_launch.cuh"

namespace flashattn::cuda::decode {
namespace {

constexpr int kAppendThreads = 256;
constexpr int64_t kMaxAppendBlocks = 1 << 16;  // grid-stride beyond this (affects speed only)
constexpr int kCombineWarps = 4;               // combine CTA: 128 threads
constexpr int kGuardThreads = 128;

// ---- append: one thread per (sequence, new token, K/V head, pair of elements) ----
// kFp8: the cache is float8 e4m3: each value x (k after rotary) is stored as e4m3(x / scale), the division in
// float32 (__fdiv_rn: IEEE, as the CPU backends divide) and the rounding of core/fp8.hpp (nearest even,
// saturating), so the bytes are the CPU backends' bytes.
template <typename Element, bool kFp8>
__global__ void __launch_bounds__(kAppendThreads) append_kernel(const __grid_constant__ DecodeArgs args) {
  const KvcacheParams& p = args.p;
  wait_for_previous_grids();  // programmatic dependent launch (sm_90): the caller's writes are visible from here
  allow_next_grid_launch();
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
    const Element* v_src = v_new + b * p.v_new_batch_stride + int64_t(t) * p.v_new_row_stride + hk * p.v_new_head_stride;
    if constexpr (kFp8) {
      uint8_t* k_codes = static_cast<uint8_t*>(const_cast<void*>(p.k));
      uint8_t* v_codes = static_cast<uint8_t*>(const_cast<void*>(p.v));
      k_codes[k_row + pair.first] = float_to_e4m3(__fdiv_rn(x0, p.k_scale));
      k_codes[k_row + pair.second] = float_to_e4m3(__fdiv_rn(x1, p.k_scale));
      // V: elements 2q, 2q + 1 (2 aligned bytes: D % 16 == 0 and 16-byte aligned rows)
      const uint32_t v0 = float_to_e4m3(__fdiv_rn(float(v_src[2 * q]), p.v_scale));
      const uint32_t v1 = float_to_e4m3(__fdiv_rn(float(v_src[2 * q + 1]), p.v_scale));
      *reinterpret_cast<uint16_t*>(v_codes + v_row + 2 * q) = uint16_t(v0 | (v1 << 8));
    } else {
      k_cache[k_row + pair.first] = Element(x0);
      k_cache[k_row + pair.second] = Element(x1);
      // V: elements 2q, 2q + 1 copied bit for bit (4 aligned bytes: D % 8 == 0 and 16-byte aligned rows).
      *reinterpret_cast<uint32_t*>(v_cache + v_row + 2 * q) = *reinterpret_cast<const uint32_t*>(v_src + 2 * q);
    }
  }
}

// ---- combine: one CTA per (m-block, K/V head, sequence) ----
// Latency-bound at small batch (a few rows, a few dozen splits): every memory access is in as few dependent
// rounds as possible. cache_seqlens is read before the wait for the attention kernel (it is an input of the
// call, complete before that kernel let this one launch), so its latency overlaps that kernel's tail. Then one
// round: one thread per (row, 4 columns) loads the LSEs and partials of kCombineUnroll splits at once and merges
// them with a running maximum (the sums rescaled when a later batch of splits has a larger LSE), in split
// order, so the result is the same on every run. (Two rounds before, 2026-11-30: the row's LSEs reduced by a
// warp, a barrier, then the partials.)
constexpr int kCombineUnroll = 16;  // splits loaded at once per thread (affects speed and registers only)

template <typename Element>
__global__ void __launch_bounds__(32 * kCombineWarps) combine_kernel(const __grid_constant__ DecodeArgs args) {
  const KvcacheParams& p = args.p;
  const int m_block = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  // Programmatic dependent launch (sm_90): this CTA may be resident before the attention kernel ends. That
  // kernel let it launch only after its own wait for the call's producers (of q, the caches, cache_seqlens), so
  // cache_seqlens is readable now; the partials are complete and visible only after the wait.
  const int cached = p.cache_seqlens[b];
  wait_for_previous_grids();
  allow_next_grid_launch();
  if (!cache_length_ok(cached, p.seqlen_new, p.seqlen_k)) return;  // the attention kernel wrote NaN directly
  const BlockRows rows = block_rows(args, m_block, cached + p.seqlen_new);
  const int used = split_work(rows.key_begin, rows.key_end, args.block_n, args.num_splits, args.min_tiles_per_split, 0).used;
  if (used < 2) return;  // written directly by the attention kernel
  const int64_t split_stride = int64_t(p.batch) * p.heads_q * p.seqlen_q;  // partial rows per split
  const int dv = p.head_dim_v;
  Element* out = static_cast<Element*>(p.out);

  // out = sum_s exp(lse_s - max) out_s / sum_s exp(lse_s - max), lse = max + log(sum); max over the splits
  // (weights <= 1: no overflow). NaN from a split that met a bad block id poisons the row; no split saw a
  // key: out = 0, lse = -inf (never NaN).
  const int quads = dv / 4;  // Dv % 8 == 0
  for (int idx = threadIdx.x; idx < rows.rows * quads; idx += 32 * kCombineWarps) {
    const int row = idx / quads, col = (idx % quads) * 4;
    const int r = rows.row_begin + row;
    const int i = r / args.group, h = hk * args.group + r % args.group;
    const int64_t prow = partial_row(p, b, h, i);
    float lse_max = -INFINITY, weight_sum = 0.f;
    bool any_nan = false;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s0 = 0; s0 < used; s0 += kCombineUnroll) {
      float lse[kCombineUnroll];
      float4 part[kCombineUnroll];
#pragma unroll
      for (int u = 0; u < kCombineUnroll; ++u) {  // all loads first: one round of memory latency
        const int s = s0 + u;
        lse[u] = s < used ? args.partial_lse[s * split_stride + prow] : -INFINITY;
        part[u] = s < used ? *reinterpret_cast<const float4*>(args.partial_out + (s * split_stride + prow) * dv + col)
                           : make_float4(0.f, 0.f, 0.f, 0.f);
      }
      float batch_max = -INFINITY;
#pragma unroll
      for (int u = 0; u < kCombineUnroll; ++u) {
        any_nan = any_nan || isnan(lse[u]);
        batch_max = fmaxf(batch_max, lse[u]);  // fmaxf skips NaN
      }
      const float new_max = fmaxf(lse_max, batch_max);
      if (new_max == -INFINITY) continue;  // no split so far saw a key of this row
      const float rescale = expf(lse_max - new_max);  // 0 when lse_max = -inf (nothing summed yet)
      weight_sum *= rescale;
      acc.x *= rescale, acc.y *= rescale, acc.z *= rescale, acc.w *= rescale;
#pragma unroll
      for (int u = 0; u < kCombineUnroll; ++u) {  // in split order; weight 0 for a split that saw no key of the row
        const float w = expf(lse[u] - new_max);
        weight_sum += w;
        acc.x += w * part[u].x, acc.y += w * part[u].y, acc.z += w * part[u].z, acc.w += w * part[u].w;
      }
      lse_max = new_max;
    }
    const float inv = any_nan ? NAN : (weight_sum > 0.f ? 1.f / weight_sum : 0.f);
    Element* out_row = out + b * p.out_batch_stride + int64_t(i) * p.out_row_stride + h * p.out_head_stride + col;
    const uint2 packed = make_uint2(ElementTraits<Element>::pack(acc.x * inv, acc.y * inv), ElementTraits<Element>::pack(acc.z * inv, acc.w * inv));
    *reinterpret_cast<uint2*>(out_row) = packed;  // 8-byte aligned: 16-byte aligned rows, col % 4 == 0
    if (col == 0 && p.lse != nullptr)
      p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + int64_t(i) * p.lse_row_stride] =
          any_nan ? NAN : (weight_sum > 0.f ? lse_max + logf(weight_sum) : -INFINITY);
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

template <typename Element, bool kFp8>
Status launch_append_typed(const DecodeArgs& args, cudaStream_t stream) {
  const KvcacheParams& p = args.p;
  const int64_t total = int64_t(p.batch) * p.seqlen_new * p.heads_k * (p.head_dim / 2);
  const int64_t blocks = std::min<int64_t>((total + kAppendThreads - 1) / kAppendThreads, kMaxAppendBlocks);
  FA_CUDA_RETURN_IF_ERROR(launch_decode_kernel(&append_kernel<Element, kFp8>, dim3(unsigned(blocks)), dim3(kAppendThreads), 0, stream,
                                               args.programmatic_launch != 0, 0u, 0, args));
  return Status();
}

template <typename Element>
Status launch_combine_typed(const DecodeArgs& args, cudaStream_t stream) {
  const dim3 grid(args.m_blocks, args.p.heads_k, args.p.batch);
  FA_CUDA_RETURN_IF_ERROR(launch_decode_kernel(&combine_kernel<Element>, grid, dim3(32 * kCombineWarps), 0, stream,
                                               args.programmatic_launch != 0, 0u, 0, args));
  return Status();
}

}  // namespace

Status launch_append(const DecodeArgs& args, void* stream) {
  const KvcacheParams& p = args.p;
  if (p.k_new == nullptr || p.seqlen_new == 0 || p.batch == 0) return Status();
  const auto s = static_cast<cudaStream_t>(stream);
  if (p.kv_dtype == FA_FLOAT8_E4M3)
    return p.dtype == FA_BFLOAT16 ? launch_append_typed<__nv_bfloat16, true>(args, s) : launch_append_typed<__half, true>(args, s);
  return p.dtype == FA_BFLOAT16 ? launch_append_typed<__nv_bfloat16, false>(args, s) : launch_append_typed<__half, false>(args, s);
}

Status launch_combine(const DecodeArgs& args, void* stream) {
  if (args.num_splits < 2 || args.m_blocks == 0 || args.p.batch == 0) return Status();
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
