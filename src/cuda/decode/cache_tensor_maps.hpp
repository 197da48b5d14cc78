// Tensor maps of the K/V cache for the decode kernel's bulk tensor copies (DecodeArgs::tma_copies; sm_90+).
#pragma once

#include "core/params.hpp"
#include "cuda/decode/decode_work.hpp"

namespace flashattn::cuda::decode {

// Encodes args->k_map / v_map for a 16-bit cache read by tiles of `head_dim_bucket` columns and sets
// args->tma_copies = 1, when the cache can be copied that way: D == Dv == the bucket, a multiple of 64; paged,
// a power-of-two block size >= 16 (args->page_shift >= 4: whole 16-row slots); K / V 16-byte aligned with
// strides that are multiples of 16 bytes. Else (or when the driver has no cuTensorMapEncodeTiled) it leaves
// tma_copies 0 and the kernel's cp.async copies do the work. Host only, no device call; affects speed only.
void set_cache_tensor_maps(const KvcacheParams& p, int head_dim_bucket, DecodeArgs* args);

}  // namespace flashattn::cuda::decode
