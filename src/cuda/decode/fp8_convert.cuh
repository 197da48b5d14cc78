// float8 e4m3 -> fp16 / bf16 on the device, exact, for the FP8 K/V cache of the decode kernel. The kernel
// converts each code in registers right before its MMA, so the instructions per code set the FP8 kernel's
// speed once it is no longer bound by memory (decode_kernel.cuh).
//
// sm_89 and later (sm_90a here): the hardware conversion cvt.rn.f16x2.e4m3x2 (exact, NaN codes give NaN), one
// instruction per pair of codes. bf16 has no e4m3 conversion: fp16 -> fp32 -> bf16, exact since every e4m3
// value is a bf16 value (3 instructions more per pair).
// sm_80 (no e4m3 hardware): the 7 exponent-mantissa bits of a code are moved into place below the sign, which
// reads them as the 16-bit type with an exponent bias that is too large by 8 (fp16: bias 15 - 7) or 120 (bf16:
// bias 127 - 7), subnormal codes included (a subnormal e4m3 lands on a subnormal of the wider type with the
// same mantissa); one multiply by 2^8 or 2^120 (exact: a power of two, no overflow, subnormals kept by
// fma.rn without .ftz) makes the value. NaN codes (0x7F / 0xFF) are patched to a NaN before the multiply.
// Per pair of codes: 1 byte permute, 4 integer ops, 1 fma.
// Scales (real = code * scale) are not applied here: the kernel folds k_scale into the softmax scale and
// v_scale into the output normalisation. The host-side definition is src/core/fp8.hpp.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace flashattn::cuda::decode {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
// Codes a (bits 0..7) and b (bits 8..15) of `pair` -> (a, b) as Elements, a in the low half.
template <typename Element>
__device__ __forceinline__ uint32_t e4m3_pair_to_element2(uint32_t pair) {
  uint32_t halves;
  asm("{\n  .reg .b16 lo, hi;\n  mov.b32 {lo, hi}, %1;\n  cvt.rn.f16x2.e4m3x2 %0, lo;\n}\n" : "=r"(halves) : "r"(pair));
  if constexpr (std::is_same_v<Element, __half>) {
    return halves;
  } else {
    uint32_t value;
    asm("{\n  .reg .b16 lo, hi;\n  .reg .f32 flo, fhi;\n  mov.b32 {lo, hi}, %1;\n  cvt.f32.f16 flo, lo;\n"
        "  cvt.f32.f16 fhi, hi;\n  cvt.rn.bf16x2.f32 %0, fhi, flo;\n}\n"
        : "=r"(value)
        : "r"(halves));
    return value;
  }
}
#else
// Two e4m3 codes placed in the high byte of each 16-bit half of `spread` (other bits zero) -> the two values
// as a packed pair of Element (code of the low half in the low half).
template <typename Element>
__device__ __forceinline__ uint32_t e4m3x2_to_element2(uint32_t spread) {
  constexpr bool kHalf = std::is_same_v<Element, __half>;
  constexpr int kShift = kHalf ? 1 : 4;  // exponent-mantissa bits from 14..8 down to 13..7 (fp16) or 10..4 (bf16)
  // 2^8 as fp16 (exponent 15 + 8), 2^120 as bf16 (exponent 127 + 120), in both halves; -0 in both halves
  constexpr uint32_t kRebias = kHalf ? 0x5C005C00u : 0x7B807B80u;
  constexpr uint32_t kNegZero = 0x80008000u;
  const uint32_t magnitude = spread & 0x7F007F00u;
  const uint32_t nan = (magnitude + 0x01000100u) & 0x80008000u;  // bit 15 of a half set iff its code is NaN
  const uint32_t bits = (spread & 0x80008000u) | (magnitude >> kShift) | (nan - (nan >> 15));  // NaN: | 0x7FFF
  uint32_t value;
  if constexpr (kHalf) {
    asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(value) : "r"(bits), "r"(kRebias), "r"(kNegZero));
  } else {
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(value) : "r"(bits), "r"(kRebias), "r"(kNegZero));
  }
  return value;
}
#endif

// Four e4m3 codes (bytes 0..3 of `codes`) -> four Elements: .x holds codes 0, 1; .y codes 2, 3.
template <typename Element>
__device__ __forceinline__ uint2 e4m3x4_to_element4(uint32_t codes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  return make_uint2(e4m3_pair_to_element2<Element>(codes), e4m3_pair_to_element2<Element>(codes >> 16));
#else
  // __byte_perm selectors: result bytes (0, code, 0, code) with 4 = a zero byte of the second operand
  return make_uint2(e4m3x2_to_element2<Element>(__byte_perm(codes, 0u, 0x1404u)),
                    e4m3x2_to_element2<Element>(__byte_perm(codes, 0u, 0x3424u)));
#endif
}

// Codes 0 and 2 (kOdd false) or 1 and 3 (kOdd true) of `codes` -> two Elements (the first in the low half). An
// ldmatrix.trans of fp8 rows read as 16-bit elements gives each thread (row r, bytes c, c + 1) and (row r + 1,
// bytes c, c + 1): these are column c (kOdd false) or c + 1 (kOdd true) of the two rows.
template <typename Element, bool kOdd>
__device__ __forceinline__ uint32_t e4m3_column_to_element2(uint32_t codes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  return e4m3_pair_to_element2<Element>(__byte_perm(codes, 0u, kOdd ? 0x4431u : 0x4420u));
#else
  return e4m3x2_to_element2<Element>(__byte_perm(codes, 0u, kOdd ? 0x3414u : 0x2404u));
#endif
}

}  // namespace flashattn::cuda::decode
