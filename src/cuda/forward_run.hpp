// The forward kernel's part of a CUDA call, planned and run apart (src/cuda/backend.cpp): fa_forward runs it after the
// routed short sequences, and fa_kvcache's forward route (decode_plan.hpp, wants_forward_route) runs it over the cache.
// CUDA builds only.
#pragma once

#include <cstdint>

#include "core/params.hpp"
#include "core/status.hpp"
#include "cuda/sm80/forward_split.hpp"

namespace flashattn::cuda {

struct ForwardKernelPlan {
  int index = -1;            // the kernel table row dispatch chose
  int split_index = -1;      // its split-KV row, when the call splits
  int splits = 1;            // 1: the row's own kernel; else the split kernel and the merge (sm80/forward_split.hpp)
  int64_t scratch_bytes = 0;  // the split partials (0 unsplit)
  bool pack_gqa = false;     // the call runs GQA-packed (sm80/forward_packing.hpp): index / split_index are the packed
                             // call's rows, splits its split count
  bool work_list = false;    // a varlen call split by sequence (sm80/forward_split.hpp): splits is the most splits of
                             // a sequence, the device's plan kernel picks each sequence's; scratch holds the list too
  sm80::ForwardWorkShape work;  // work_list: the list's shape
};

// forced_splits > 0: that many splits (capped at sm80::kMaxForwardSplits) where the bucket has a split row; 0: the plan's.
Status plan_forward_kernel(const AttentionParams& params, int forced_splits, ForwardKernelPlan* plan);
// scratch: plan.scratch_bytes of device memory, or null (then a stream-ordered allocation from the library's pool).
Status run_forward_kernel(const AttentionParams& params, const ForwardKernelPlan& plan, void* scratch);

}  // namespace flashattn::cuda
