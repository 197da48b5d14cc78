// Hopper (sm_90) bulk tensor copies (TMA) and the shared-memory barriers (mbarrier) that count their bytes.
// Each wrapper compiles to its one PTX instruction on sm_90+ and to nothing below (callers test kTmaArch, so
// the sm_80 image never reaches them).
//
// The pattern (decode_kernel.cuh): one thread arms a stage's barrier with the bytes that will land
// (arrive_expect_tx), threads issue tensor copies that complete bytes on that barrier, and every thread that
// reads the stage waits for the barrier's phase to flip (wait_parity: acquire, so the copied bytes are
// visible to it). A barrier's phase flips once per fill; a waiter tracks the parity it expects.
#pragma once

#include <cstdint>

#include "cuda/common/tensor_map_bytes.hpp"

namespace flashattn::cuda {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
constexpr bool kTmaArch = true;
#else
constexpr bool kTmaArch = false;
#endif

__device__ __forceinline__ void mbarrier_init(uint32_t bar, uint32_t arrivals) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals) : "memory");
#endif
}
// Makes the initialised barriers visible to the async proxy (the tensor copies that complete on them).
__device__ __forceinline__ void fence_mbarrier_init() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}
// One arrival that also expects `bytes` more bytes of copies before the phase may complete.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
#endif
}
// Spins until the barrier's phase of parity `parity` has completed.
__device__ __forceinline__ void mbarrier_wait_parity(uint32_t bar, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
#endif
}
// Copies the box of a 4-d tensor map at coordinates (c0 innermost .. c3) to shared memory at `dst` (this CTA's;
// aligned as the map's swizzle needs: 1024 bytes for 128-byte swizzling), completing its bytes on `bar`.
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const TensorMapBytes* map, uint32_t bar, int c0, int c1, int c2,
                                            int c3) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
#endif
}

}  // namespace flashattn::cuda
