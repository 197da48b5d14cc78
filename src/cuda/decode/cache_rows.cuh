// Device helpers shared by the decode kernels (decode_kernel.cuh, decode_aux.cu): where key row j of a
// sequence lives in a contiguous or paged cache, and the rotary embedding of one pair of a row.
#pragma once

#include <cstdint>

#include "core/params.hpp"
#include "cuda/decode/decode_work.hpp"

namespace flashattn::cuda::decode {

// ---- cache rows: contiguous (B, S_cache, Hk, D) or paged (num_blocks, block_size, Hk, D) ----

// Block-table column (page) of key row j: a shift for power-of-two block sizes, else a division.
__device__ __forceinline__ int page_of(const DecodeArgs& a, int j) {
  return a.page_shift >= 0 ? (j >> a.page_shift) : (j / a.p.page_block_size);
}

// Row of key row j inside its block.
__device__ __forceinline__ int page_slot_of(const DecodeArgs& a, int j) {
  return a.page_shift >= 0 ? (j & ((1 << a.page_shift) - 1)) : (j % a.p.page_block_size);
}

// Block id of key row j of sequence b (paged caches only; j must be below the sequence's key count, so the
// table entry read is one of its first ceil(Sk / block_size) <= max_blocks columns).
__device__ __forceinline__ int32_t page_id_of(const DecodeArgs& a, int b, int j) {
  const KvcacheParams& p = a.p;
  return p.block_table[b * p.block_table_batch_stride + page_of(a, j)];
}

// ---- decode-only PTX (the shared ones are in cuda/common/ptx.cuh) ----
// Programmatic dependent launch (sm_90+; the launcher sets the attribute only there, and without it both
// are no-ops). wait: block until the grids this one depends on (the previous kernels of the stream) have
// finished and their writes are visible; every decode kernel calls it before touching global memory.
// launch_dependents: let the next kernel of the stream start its launch now (it waits for us in its own
// wait), hiding its launch latency behind our work.
__device__ __forceinline__ void wait_for_previous_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void allow_next_grid_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Starts bringing the 128-byte line at `address` into L2 (no register result, never faults on a valid address).
__device__ __forceinline__ void prefetch_l2(const void* address) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(address));
}

// Element offsets of key row j (head hk) in the K and V caches, given its block id when paged (`id` is
// unused for a contiguous cache). False when the id is not a block of the cache: nothing may be read there.
__device__ __forceinline__ bool cache_row_offsets(const DecodeArgs& a, int b, int hk, int j, int32_t id, int64_t* k_offset,
                                                  int64_t* v_offset) {
  const KvcacheParams& p = a.p;
  if (p.block_table == nullptr) {
    *k_offset = b * p.k_batch_stride + int64_t(j) * p.k_row_stride + hk * p.k_head_stride;
    *v_offset = b * p.v_batch_stride + int64_t(j) * p.v_row_stride + hk * p.v_head_stride;
    return true;
  }
  if (uint32_t(id) >= uint32_t(p.num_blocks)) return false;  // also catches negative ids
  const int slot = page_slot_of(a, j);
  *k_offset = id * p.k_batch_stride + int64_t(slot) * p.k_row_stride + hk * p.k_head_stride;
  *v_offset = id * p.v_batch_stride + int64_t(slot) * p.v_row_stride + hk * p.v_head_stride;
  return true;
}

// Rotary embedding of one pair of a row at `position` (core semantics: src/cpu/reference/reference.cpp).
// Pair q in [0, D / 2) of a row: the rotated pairs come first (q < rotary_dim / 2: elements (2q, 2q + 1)
// interleaved, or (q, q + rotary_dim / 2) GPT-NeoX halves), then the untouched elements in adjacent pairs.
struct RotaryPair {
  int first, second;  // element indices
  bool rotated;
};
__device__ __forceinline__ RotaryPair rotary_pair(const KvcacheParams& p, int q) {
  const int half = p.rotary_dim / 2;
  if (q < half) return p.rotary_interleaved ? RotaryPair{2 * q, 2 * q + 1, true} : RotaryPair{q, q + half, true};
  const int e = p.rotary_dim + 2 * (q - half);
  return RotaryPair{e, e + 1, false};
}

// The rotation of a pair (x0, x1) by the angle of table row `position`, column q: (x0 c - x1 s, x0 s + x1 c). The
// products of two 16-bit floats are exact in fp32, so each result is the exact value rounded once to fp32, as the
// float64 reference computes it before its own fp32 rounding: appended keys come out bit-identical to the reference's.
// rotated_first / rotated_second are its two halves (the append kernel rotates element by element: decode_aux.cu).
template <typename Element>
__device__ __forceinline__ float2 rotary_cos_sin(const KvcacheParams& p, int position, int q) {
  const float c = float(static_cast<const Element*>(p.rotary_cos)[int64_t(position) * p.rotary_cos_row_stride + q]);
  const float s = float(static_cast<const Element*>(p.rotary_sin)[int64_t(position) * p.rotary_sin_row_stride + q]);
  return make_float2(c, s);
}
__device__ __forceinline__ float rotated_first(float x0, float x1, float2 cs) { return fmaf(x0, cs.x, -(x1 * cs.y)); }
__device__ __forceinline__ float rotated_second(float x0, float x1, float2 cs) { return fmaf(x0, cs.y, x1 * cs.x); }
template <typename Element>
__device__ __forceinline__ void rotate_pair(const KvcacheParams& p, int position, int q, float* x0, float* x1) {
  const float2 cs = rotary_cos_sin<Element>(p, position, q);
  const float a = *x0, b = *x1;
  *x0 = rotated_first(a, b, cs);
  *x1 = rotated_second(a, b, cs);
}

}  // namespace flashattn::cuda::decode
