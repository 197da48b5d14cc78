// Host-side dispatch of the CUDA backend: the CUDA-specific argument rules and the choice of a
// compiled kernel from the one generated table (src/cuda/generated/kernel_table.hpp). Plain C++
// with no device access, so it builds and is unit-tested without CUDA (tests/cpp/test_cuda_dispatch.cpp).
//
// The choice: rows of the kind whose dtype matches, whose dropout flag matches (dropout_p > 0), and
// whose head-dim bucket is the smallest one >= D (D % 8 == 0, Dv == D; smaller D is zero-padded to the
// bucket inside the kernel); among the rows of that bucket, the manifest's order of preference decides:
// the first whose shared memory fits the device (e.g. a double-buffered tile on sm_90, a single-buffered
// one on sm_80). No row -> FA_ERROR_NOT_COMPILED listing what is compiled; no row that fits the device's
// shared memory -> FA_ERROR_UNSUPPORTED. Never a silent fallback to another kind of computation.
#pragma once

#include <cstdint>
#include <string>

#include "core/params.hpp"
#include "core/status.hpp"
#include "cuda/kernel_entry.hpp"

namespace flashattn::cuda {

// What dispatch needs to know about the device (read once per call by backend.cpp).
struct DeviceLimits {
  int device = 0;                     // CUDA ordinal, for messages
  int sm_major = 0, sm_minor = 0;     // compute capability
  int64_t smem_per_block_optin = 0;   // bytes a CTA may use after cudaFuncSetAttribute
};

// CUDA-specific rules of a call (after src/api/validate.cpp): dtype fp16/bf16, Dv == D, D % 8 == 0,
// 16-byte aligned base pointers and row/head/batch strides (cp.async moves 16 bytes), grid limits.
Status check_forward_support(const AttentionParams& p);
Status check_backward_support(const BackwardParams& p);

// True when a build for `arch_list` (CMake's CUDA_ARCHITECTURES, e.g. "80-real 90a-real") holds code
// that runs on compute capability major.minor: sm_XY runs on X.Y..X.9, sm_XYa only on X.Y, sm_XYf (family) on
// X.Y..X.9 (its PTX too), PTX ("-virtual" or no suffix) on anything >= X.Y.
bool arch_list_runs_on(const std::string& arch_list, int major, int minor);

// Index of the table row that runs this call. `table`/`count` default to the generated table.
Status choose_kernel(KernelKind kind, const AttentionParams& p, const DeviceLimits& device, int* index);
Status choose_kernel(KernelKind kind, const AttentionParams& p, const DeviceLimits& device,
                     const KernelEntry* table, int count, const std::string& arch_list, int* index);

// The row of decode role `role` (kernel_entry.hpp: a decode tile for some calls only) of the same kind, dtype, head dim,
// dropout and cache type as row `index`, whose shared memory fits; -1 when there is none (or role is kGeneral). The
// decode selection takes it in place of row `index` where decode_plan.hpp's rule for the role holds.
int decode_alternative(int index, DecodeRole role, const DeviceLimits& device);
int decode_alternative(int index, DecodeRole role, const DeviceLimits& device, const KernelEntry* table, int count);
// The split-KV row (KernelEntry::split_kv) of forward row `index`'s bucket for call `p`: same dtype, head dim and
// paged_kv, no dropout, fitting the device, the first in the manifest's order whose max_seqlen_q (0: any) admits
// p.seqlen_q; -1 when there is none (the call then runs unsplit). choose_kernel never takes such a row.
int split_alternative(int index, const AttentionParams& p, const DeviceLimits& device);
int split_alternative(int index, const AttentionParams& p, const DeviceLimits& device, const KernelEntry* table, int count);

const KernelEntry& kernel_entry(int index);  // a row of the generated table
std::string compiled_arch_list();            // FLASHATTN_CUDA_ARCHS of this build ("" without CUDA)
// "forward: float16, bfloat16 x D 32, 64, ...; backward: ..." from the generated table.
std::string compiled_kernels_summary();

}  // namespace flashattn::cuda
