// float8 e4m3 -> fp16 on the device, exact, for the FP8 K/V cache of the decode kernel. The kernel converts each
// code in registers right before its MMA, so the instructions per code set the FP8 kernel's speed once it is no
// longer bound by memory (decode_kernel.cuh). The FP8 kernels' MMAs are fp16 whatever q's type (a bf16 q is
// scaled into fp16 there): every e4m3 value is an fp16 value, and fp16 is the type the hardware converts to.
//
// sm_89 and later (sm_90a here): the hardware conversion cvt.rn.f16x2.e4m3x2 (exact, NaN codes give NaN), one
// instruction per pair of codes.
// sm_80 (no e4m3 hardware): the 7 exponent-mantissa bits of a code are moved into place below the sign, which
// reads them as fp16 with an exponent bias too large by 8 (15 - 7), subnormal codes included (a subnormal e4m3
// lands on a subnormal fp16 with the same mantissa); one multiply by 2^8 (exact: a power of two, no overflow,
// subnormals kept by fma.rn without .ftz) makes the value. NaN codes (0x7F / 0xFF) are patched to a NaN before
// the multiply. Per pair of codes: 1 byte permute, 4 integer ops, 1 fma.
// Scales (real = code * scale) are not applied here: the kernel folds k_scale into the softmax scale and
// v_scale into the output normalisation. The host-side definition is src/core/fp8.hpp.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

namespace flashattn::cuda::decode {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
// Codes a (bits 0..7) and b (bits 8..15) of `pair` -> (a, b) as fp16, a in the low half.
__device__ __forceinline__ uint32_t e4m3_pair_to_half2(uint32_t pair) {
  uint32_t halves;
  asm("{\n  .reg .b16 lo, hi;\n  mov.b32 {lo, hi}, %1;\n  cvt.rn.f16x2.e4m3x2 %0, lo;\n}\n" : "=r"(halves) : "r"(pair));
  return halves;
}
#else
// Two e4m3 codes placed in the high byte of each 16-bit half of `spread` (other bits zero) -> the two values
// as a packed fp16 pair (code of the low half in the low half).
__device__ __forceinline__ uint32_t e4m3x2_spread_to_half2(uint32_t spread) {
  constexpr uint32_t kRebias = 0x5C005C00u;   // 2^8 as fp16 (exponent 15 + 8) in both halves
  constexpr uint32_t kNegZero = 0x80008000u;  // -0 in both halves
  const uint32_t magnitude = spread & 0x7F007F00u;
  const uint32_t nan = (magnitude + 0x01000100u) & 0x80008000u;  // bit 15 of a half set iff its code is NaN
  // exponent-mantissa bits from 14..8 down to 13..7; NaN: | 0x7FFF
  const uint32_t bits = (spread & 0x80008000u) | (magnitude >> 1) | (nan - (nan >> 15));
  uint32_t value;
  asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(value) : "r"(bits), "r"(kRebias), "r"(kNegZero));
  return value;
}
#endif

// Four e4m3 codes (bytes 0..3 of `codes`) -> four fp16: .x holds codes 0, 1; .y codes 2, 3.
__device__ __forceinline__ uint2 e4m3x4_to_half4(uint32_t codes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  return make_uint2(e4m3_pair_to_half2(codes), e4m3_pair_to_half2(codes >> 16));
#else
  // __byte_perm selectors: result bytes (0, code, 0, code) with 4 = a zero byte of the second operand
  return make_uint2(e4m3x2_spread_to_half2(__byte_perm(codes, 0u, 0x1404u)),
                    e4m3x2_spread_to_half2(__byte_perm(codes, 0u, 0x3424u)));
#endif
}

// Codes 0 and 2 (kOdd false) or 1 and 3 (kOdd true) of `codes` -> two fp16 (the first in the low half). An
// ldmatrix.trans of fp8 rows read as 16-bit elements gives each thread (row r, bytes c, c + 1) and (row r + 1,
// bytes c, c + 1): these are column c (kOdd false) or c + 1 (kOdd true) of the two rows.
template <bool kOdd>
__device__ __forceinline__ uint32_t e4m3_column_to_half2(uint32_t codes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  return e4m3_pair_to_half2(__byte_perm(codes, 0u, kOdd ? 0x4431u : 0x4420u));
#else
  return e4m3x2_spread_to_half2(__byte_perm(codes, 0u, kOdd ? 0x3414u : 0x2404u));
#endif
}

}  // namespace flashattn::cuda::decode
