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
// always split alike). A call splits when its CTAs (query tiles x Hq x B; a varlen call of several sequences: its
// longest sequence's tiles x Hq, then by sequence on the device, below) fill fewer than half of the device's CTA slots
// (SMs x resident CTAs per SM of the split kernel): it then takes the most splits that keep the grid within one wave of
// slots, at most kMaxForwardSplits and at least kMinTilesPerSplit key tiles each (key tiles of max_seqlen_k). 1: no
// split.
constexpr int kMaxForwardSplits = 32;   // the merge reads one LSE per lane of a warp
constexpr int kMinTilesPerSplit = 4;    // below it a share's prologue and the merge cost more than the share saves
int forward_split_count(const AttentionParams& p, int block_m, int block_n, int sm_count, int ctas_per_sm);

// Varlen calls split by sequence (the work list). The rule above counts B x the longest sequence's query tiles, as the
// grid of a varlen call does; but a serving step of 16 decode tokens (run by the decode kernels) beside one chunk of
// 128 prompt tokens over an 8k prefix has 17 x 4 x 8 such CTAs, of which only the chunk's 32 do any work, each over 8k
// keys: it never split (H100, 2026-12-06 16:29 UTC: 635 us, where the chunk alone, split, and the decodes took 290).
// The sequences' lengths are on the device, so for a varlen call of several sequences whose longest one alone would
// split (the rule above at B = 1; not where q's rows surely fill half the slots), a one-CTA plan kernel
// (forward_combine.cu) reads cu_seqlens_q / cu_seqlens_k / seqused_k, counts the query tiles the split kernel really
// runs (the sequences the decode kernels took excluded), applies the same rule to that count and gives each sequence
// its own split count (fewer where its keys are few), and writes the list of (sequence, query tile, split) items that
// the split kernel's CTAs take by blockIdx.x. An item of a sequence of one split writes out and lse itself; the others
// write partials, which the merge combines. Affects speed and rounding only.
//
// The split count cap for all sequences, given the unsplit CTAs of the sequences that run (query tiles x grid heads)
// and the device's slots; forced > 0 (tests): that many.
FA_HD int work_split_cap(int64_t ctas, int64_t slots, int forced) {
  if (forced > 0) return forced < kMaxForwardSplits ? forced : kMaxForwardSplits;
  if (ctas < 1 || 2 * ctas > slots) return 1;
  const int64_t cap = slots / ctas;
  return cap < kMaxForwardSplits ? int(cap) : kMaxForwardSplits;
}
// The splits of one sequence of key_tiles key tiles under that cap: at least kMinTilesPerSplit tiles each (forced:
// the cap, empty shares and all).
FA_HD int work_sequence_splits(int cap, int64_t key_tiles, int forced) {
  if (forced > 0) return cap;
  const int64_t by_keys = key_tiles / kMinTilesPerSplit;
  return by_keys < 2 ? 1 : (by_keys < cap ? int(by_keys) : cap);
}

// One item of the list: query tile m_block of sequence b, share `split` of `splits` of its key tiles. b < 0: past the
// list's end (the CTA has nothing to do). The items of one (sequence, tile) are consecutive, split 0 first.
struct SplitWorkItem {
  int32_t b, m_block, split, splits;
};
// What the split kernel and the merge read of a work-list call (a kernel parameter beside AttentionParams; items null:
// not a work-list call).
struct ForwardSplitWork {
  const SplitWorkItem* items = nullptr;
  float* o_partial = nullptr;    // [partial_items][heads][block_m][Dv], float32, O / rowsum of the item's share
  float* lse_partial = nullptr;  // [partial_items][heads][block_m], log2 units
  int32_t* merges = nullptr;     // [0]: M, then the M items that are split 0 of a tile of >= 2 splits (the merge's)
  int max_items = 0;             // the list's length: the split kernel's grid x
};
// The partial row of packed (or query) row `local` of item `item`'s tile, grid head h.
FA_HD int64_t work_partial_row(int item, int heads, int h, int block_m, int local) {
  return (int64_t(item) * heads + h) * block_m + local;
}

// A work-list call's shape, fixed by the host plan (sizes depend on it only).
struct ForwardWorkShape {
  int block_m = 0, block_n = 0;  // the split row's tile
  int heads = 0;                 // the grid's heads: Hk packed, else Hq
  int64_t slots = 0;             // SMs x resident CTAs of the split row
  int forced = 0;                // > 0: every sequence takes that many splits (the tests' count)
  int max_items = 0;             // the list's length (the split kernel's grid x): B x tiles, or slots / heads if more
  int partial_items = 0;         // the items that may write partials: split items exist only where the whole list
                                 // fits one wave (<= slots / heads); forced: all
  int max_merges = 0;            // tiles to merge: each has >= 2 of the partial items
};
// `p`: the call as the plan sees it (its packed view when packed: Hk heads of G x Sq rows).
ForwardWorkShape forward_work_shape(const AttentionParams& p, int block_m, int block_n, int sm_count, int ctas_per_sm,
                                    int forced);
// Writes sequence b's items, its m_tiles tiles x splits (the last tile, causal: the heaviest, first; a tile's splits
// consecutive, split 0 first) from list index `first`, and, where it splits, the list index of each tile's split 0
// into merges[1 + first_merge ...] in the same order. Nothing past the shape's bounds (which the plan's counts never
// reach). The plan kernel calls it per sequence after its scans; the host tests build whole lists with it.
FA_HD void write_sequence_work(const ForwardWorkShape& shape, int b, int m_tiles, int splits, int64_t first,
                               int64_t first_merge, SplitWorkItem* items, int32_t* merges) {
  for (int m = 0; m < m_tiles; ++m) {
    const int64_t tile_first = first + int64_t(m_tiles - 1 - m) * splits;
    for (int s = 0; s < splits; ++s)
      if (tile_first + s < shape.max_items) items[tile_first + s] = SplitWorkItem{b, m, s, splits};
    const int64_t merge = first_merge + (m_tiles - 1 - m);
    if (splits > 1 && merge < shape.max_merges) merges[1 + merge] = int32_t(tile_first);
  }
}
// Scratch of a work-list call: the list, the merge list, then the O and LSE partials (each 256-byte aligned).
struct ForwardWorkLayout {
  int64_t items_bytes = 0, merges_bytes = 0, o_bytes = 0, lse_bytes = 0, total_bytes = 0;
};
ForwardWorkLayout forward_work_layout(const AttentionParams& p, const ForwardWorkShape& shape);

// The plan kernel (writes shape.max_items items at work.items and the merge list at work.merges) and the merge of a
// work-list call; `p` is the call with pack_gqa set as it runs.
Status launch_forward_split_plan(const AttentionParams& p, const ForwardWorkShape& shape, const ForwardSplitWork& work,
                                 void* stream);
Status launch_forward_combine_work(const AttentionParams& p, const ForwardWorkShape& shape, const ForwardSplitWork& work,
                                   void* stream);

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
