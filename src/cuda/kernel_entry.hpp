// The row type of the generated kernel table (src/cuda/generated/kernel_table.hpp, written by
// src/cuda/manifest.py). Plain C++: dispatch and its unit tests read the table without CUDA.
#pragma once

#include <cstdint>

#include "core/params.hpp"
#include "core/status.hpp"

namespace flashattn::cuda {

namespace sm80 {
struct ForwardSplitWork;  // sm80/forward_split.hpp: a work-list call's list and partials
}  // namespace sm80

enum class KernelKind { kForward, kBackward, kKvcache };  // kKvcache: src/cuda/decode/ (split-KV decode)
// Which calls a decode row serves: the bucket's general row, or one taken in its place where decode_plan.hpp's rule
// holds (kManyWaves: wants_many_waves_tile; kLongContiguous: wants_long_contiguous_tile). Affects speed only.
enum class DecodeRole { kGeneral, kManyWaves, kLongContiguous };

// One compiled instantiation. The tile fields affect speed, registers and shared memory only.
struct KernelEntry {
  KernelKind kind;
  fa_dtype dtype;       // FA_FLOAT16 or FA_BFLOAT16
  int head_dim;         // the bucket: runs any D with D % 8 == 0 and D <= head_dim (zero-padded)
  int block_m;          // query rows per CTA
  int block_n;          // key rows per K/V tile
  int warps;            // warps per CTA
  int stages;           // K/V shared-memory stages
  bool dropout;         // compiled with the Philox dropout path
  int64_t smem_bytes;   // dynamic shared memory per CTA (0: the launcher decides)
  const char* name;     // also the name of its generated launch function
  int warp_keys = 16;   // backward: keys per warp (16 or 32); 16 for the other kinds
  int group_warps = 1;  // forward: warps sharing a group of query rows (1 or 2); 1 for the other kinds
  bool fp8_cache = false;  // kvcache: reads (and appends to) a float8 e4m3 K/V cache; q / out are `dtype`
  int causal_max_seqlen_q = 0;  // forward: > 0 = taken only for causal calls of at most this many query rows
                                // (dispatch skips it otherwise); 0 = any call
  int max_seqlen_q = 0;  // forward: > 0 = taken only for calls (any mask) of at most this many query rows; 0 = any
                         // (a split_kv row: split_alternative's choice for split calls of at most this many rows)
  DecodeRole decode_role = DecodeRole::kGeneral;  // kvcache: a role's row is taken only where decode_plan.hpp's rule for
                                                  // it holds (choose_kernel skips it; decode_alternative offers it)
  bool paged_kv = false;  // forward: compiled for paged K/V (kPagedKv): taken only for calls with a block_table, which
                          // find it ahead of the bucket's other rows
  bool split_kv = false;  // forward: compiled for split-KV (kSplitKv): choose_kernel skips it; split_alternative offers
                          // it where the forward's split plan splits (src/cuda/sm80/forward_split.hpp)
  bool gqa_packing = false;  // forward: may run a call GQA-packed (the split-KV and compact-epilogue rows;
                             // src/cuda/sm80/forward_packing.hpp); the plan packs only where the rows it takes may
  bool packed_only = false;  // forward: taken only by a call's packed view (AttentionParams::pack_gqa set); unpacked
                             // calls skip it
};

// The launch functions of one row (exactly one is set, by kind). `stream` is a cudaStream_t.
using ForwardLaunchFn = Status (*)(const AttentionParams& params, void* stream);
using BackwardLaunchFn = Status (*)(const BackwardParams& params, void* stream);
// kvcache: params.num_splits resolved by the plan, params.workspace aligned (src/cuda/decode/kvcache.cpp).
using KvcacheLaunchFn = Status (*)(const KvcacheParams& params, void* stream);
// forward split-KV rows: params.out / params.lse are the split partials (forward_split.hpp), or, a work-list call
// (work.items set), the call's out and lse; ctas_per_sm non-null: report the kernel's resident CTAs per SM on
// params.device_id instead of launching.
using ForwardSplitLaunchFn = Status (*)(const AttentionParams& params, int num_splits, const sm80::ForwardSplitWork& work,
                                        int* ctas_per_sm, void* stream);
struct KernelLaunch {
  ForwardLaunchFn forward;
  BackwardLaunchFn backward;
  KvcacheLaunchFn kvcache;
  ForwardSplitLaunchFn forward_split;
};

namespace generated {
extern const KernelLaunch kKernelLaunch[];  // parallel to kKernelTable; CUDA builds only
}  // namespace generated

}  // namespace flashattn::cuda
