// The CPU flash backend: the FlashAttention algorithm on the CPU. Tiles of Q, K, V sized for the
// caches, online softmax (running max and sum per query row), never an Sq x Sk buffer; backward by
// recomputation from the saved LSE; KV-cache attention with split-KV across threads.
// fp32 / fp16 / bf16 inputs, fp32 accumulation; threads over (batch, head, query tile).
#pragma once

#include "core/params.hpp"
#include "core/status.hpp"

namespace flashattn::cpu::flash {

Status forward(const AttentionParams& params);
Status backward(const BackwardParams& params);
// Host scratch the backward needs (reported; the CPU backend allocates it itself).
int64_t backward_workspace_bytes(const BackwardParams& params);
Status kvcache_plan(const KvcacheParams& params, fa_kvcache_plan* plan);
Status kvcache(const KvcacheParams& params);
// fa_kvcache_append on every CPU backend: kvcache()'s append (the same rows, the same bits) with n_b rows per sequence.
Status kvcache_append(const KvcacheAppendParams& params);

}  // namespace flashattn::cpu::flash
