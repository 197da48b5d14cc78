// float8 e4m3 -> fp16 / bf16 on the device, exact, for the FP8 K/V cache of the decode kernel.
//
// One path for sm_80 and sm_90a (the hardware cvt.rn.f16x2.e4m3x2 exists from sm_89 only, and bf16 has no
// e4m3 conversion at all): the 7 exponent-mantissa bits of a code are moved into place below the sign, which
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

// Four e4m3 codes (bytes 0..3 of `codes`) -> four Elements: .x holds codes 0, 1; .y codes 2, 3.
template <typename Element>
__device__ __forceinline__ uint2 e4m3x4_to_element4(uint32_t codes) {
  // __byte_perm selectors: result bytes (0, code, 0, code) with 4 = a zero byte of the second operand
  return make_uint2(e4m3x2_to_element2<Element>(__byte_perm(codes, 0u, 0x1404u)),
                    e4m3x2_to_element2<Element>(__byte_perm(codes, 0u, 0x3424u)));
}

}  // namespace flashattn::cuda::decode
