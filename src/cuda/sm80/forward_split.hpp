// Split-KV for the forward (flash-decoding's idea applied to fa_forward): the plan, the layout of the split partials,
// and the merge's launch. Plain C++ (the layout functions are FA_HD: the kernels index the partials with them).
//
// Why: the forward kernel gives each (query tile, head, sequence) one CTA that streams all of its keys. A call of few
// query tiles over many keys (a chunk of 128 prompt tokens after 32k cached ones: 32 CTAs at Hq = 32; 64 speculative
// tokens; cross-attention of a short query) leaves most SMs idle: B = 1, Hq = 32 / Hk = 8, D = 128, bf16, Sq = 128 over
// Sk = 32768 took 0.969 ms on an H100, as long as Sq = 512 (0.985 ms), where torch SDPA's flash kernel took 0.258 ms
// (2026-12-06 08:30 UTC). Split, each query tile's key tiles are dealt to `splits` CTAs, each writes its share's
// result in float32 (O / rowsum and the LSE, log2 units), and forward_combine.cu merges the shares through their LSEs
// (the merge of core semantics: exact up to rounding).
#pragma once

#include <cstdint>

#include "core/host_device.hpp"
#include "core/params.hpp"
#include "core/status.hpp"

namespace flashattn::cuda::sm80 {

// The partials of split s, sequence b, query head h, query row i (< p.seqlen_q, the longest sequence's rows): row
// ((s B + b) Hq + h) Sq + i of the LSE partials (float32, log2 units) and of the O partials (float32, Dv columns each).
FA_HD int64_t split_partial_row(const AttentionParams& p, int split, int b, int h, int i) {
  return ((int64_t(split) * p.batch + b) * p.heads_q + h) * p.seqlen_q + i;
}
FA_HD int64_t split_partial_rows(const AttentionParams& p, int splits) {
  return int64_t(splits) * p.batch * p.heads_q * p.seqlen_q;
}

// Scratch of a split call: the O partials, then the LSE partials (each 256-byte aligned).
struct ForwardSplitLayout {
  int64_t o_bytes = 0, lse_bytes = 0, total_bytes = 0;
};
ForwardSplitLayout forward_split_layout(const AttentionParams& p, int splits);

// Split counts (affects speed and rounding only, never results beyond rounding; the same shapes on the same device
// always split alike). A call splits when its CTAs (query tiles x Hq x B, with the longest sequence's tiles for
// varlen) fill fewer than half of the device's CTA slots (SMs x resident CTAs per SM of the split kernel): it then
// takes the most splits that keep the grid within one wave of slots, at most kMaxForwardSplits and at least
// kMinTilesPerSplit key tiles each (key tiles of max_seqlen_k). 1: no split.
constexpr int kMaxForwardSplits = 32;   // the merge reads one LSE per lane of a warp
constexpr int kMinTilesPerSplit = 4;    // below it a share's prologue and the merge cost more than the share saves
int forward_split_count(const AttentionParams& p, int block_m, int block_n, int sm_count, int ctas_per_sm);

// Tests only (not part of the API): every later CUDA forward without dropout runs with `splits` splits (>= 1; 1 = never
// split), capped at kMaxForwardSplits, instead of forward_split_count's; 0 restores the library's. A process-wide switch,
// so that the oracle tests can run the split kernels and the merge through the public API at any count.
void set_forward_splits_for_tests(int splits);
int forward_splits_for_tests();

// The merge (forward_combine.cu): out and lse of every row that the split kernel computed (not the rows of sequences of
// at most p.routed_seqlen_q rows: the decode kernels' in a paged varlen call) from the partials at o_partial /
// lse_partial. A row some of whose shares are NaN gets NaN; a row no share saw a key of gets O = 0 and LSE = -inf.
Status launch_forward_combine(const AttentionParams& p, int splits, const float* o_partial, const float* lse_partial,
                              void* stream);

}  // namespace flashattn::cuda::sm80
