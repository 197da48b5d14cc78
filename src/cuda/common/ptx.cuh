// Thin, documented wrappers of the PTX instructions the sm80 kernels use (they also run on
// sm_90 and later). Each is one inline-asm statement; names say the shape and the memory spaces.
//
//   mma_m16n8k16      tensor-core MMA, A row-major 16x16, B col-major 16x8, fp32 accumulate
//   ldmatrix_x4/_x2   shared -> registers, 8x8 b16 tiles in the mma fragment layout (.trans too)
//   cp_async_16       global -> shared, 16 bytes, bypassing registers (zero-fill when !valid);
//                     cp_async_16_full: always 16 bytes, no predicate
//   exp2_approx       ex2.approx.ftz.f32: 2^x in ~2 ulp; the softmax uses exp2 with log2(e) folded
//                     into the scale
//   log2_approx       lg2.approx.ftz.f32: log2(x), absolute error <= 2^-22.6 on [0.5, 2], else 2 ulp (CUDA's
//                     __log2f)
//   rcp_approx        rcp.approx.ftz.f32: 1 / x in 1 ulp (one MUFU.RCP; 1.f / x is the IEEE division's
//                     multi-instruction sequence with a slow-path branch)
//   named_barrier_sync  bar.sync on barrier id 1..15 for a subset of the CTA's warps
//   st_shared_b32 / ld_shared_f32  32-bit shared-memory accesses at a shared-space address
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

namespace flashattn::cuda {

// ---- element types ----
template <typename T>
struct ElementTraits;
template <>
struct ElementTraits<__half> {
  static constexpr const char* kName = "f16";
  // mma .atype/.btype spelling
  __device__ static __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};
template <>
struct ElementTraits<__nv_bfloat16> {
  static constexpr const char* kName = "bf16";
  __device__ static __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};

// ---- tensor-core MMA: D = A * B + C, m16n8k16, fp32 accumulators ----
// Fragments per thread (lane = 4 * group + t): a[4] (8 halves), b[2] (4 halves), c/d[4] floats
// holding C[group][2t..2t+1] and C[group + 8][2t..2t+1].
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]);

template <>
__device__ __forceinline__ void mma_m16n8k16<__half>(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <>
__device__ __forceinline__ void mma_m16n8k16<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4],
                                                           const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// ---- ldmatrix: lanes 8m..8m+7 give the row addresses of 8x8 tile m ----
__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t smem_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t smem_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr));
}
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], uint32_t smem_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_addr));
}
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&r)[2], uint32_t smem_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_addr));
}

// ---- cp.async: 16 bytes global -> shared; when !valid, writes 16 zero bytes and reads nothing ----
__device__ __forceinline__ void cp_async_16(uint32_t smem_addr, const void* global_ptr, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(global_ptr), "r"(src_bytes));
}
// Unpredicated form for tiles known to be whole (no zero-fill): no source-size register, no select.
__device__ __forceinline__ void cp_async_16_full(uint32_t smem_addr, const void* global_ptr) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr), "l"(global_ptr));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most `kPending` committed groups are still in flight (this thread's copies only:
// follow with __syncthreads() before reading what other threads copied).
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// ---- named barriers: bar.sync `id` (1..15; 0 is __syncthreads) for `threads` threads (a multiple of 32),
// with the ordering of shared-memory accesses of __syncthreads among the threads taking part. With a
// run-time id ptxas reserves all 16 barriers of the CTA (at most 4 such CTAs per SM on sm_90).
// compute-sanitizer racecheck (CUDA 13.0) reports false WAR / RAW hazards between accesses that a
// __syncthreads orders when the warp groups of a CTA passed different numbers of named barriers since the
// last __syncthreads; kernels that skip work per group keep the counts equal (forward_kernel.cuh). The
// probe scripts/gpu/racecheck_named_barriers.cu shows it on a kernel that is race-free by construction. ----
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// 32-bit shared-memory store / load at a shared-space address (volatile: kept in order with the barriers).
__device__ __forceinline__ void st_shared_b32(uint32_t smem_addr, uint32_t value) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(smem_addr), "r"(value) : "memory");
}
__device__ __forceinline__ float ld_shared_f32(uint32_t smem_addr) {
  float value;
  asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(value) : "r"(smem_addr) : "memory");
  return value;
}

// ---- math ----
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float log2_approx(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float rcp_approx(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Butterfly reductions over the 4 lanes of an mma quad (lanes 4g..4g+3 share accumulator rows).
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

}  // namespace flashattn::cuda
