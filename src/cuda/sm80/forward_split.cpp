// The forward's split-KV plan and partials' layout (forward_split.hpp). Plain C++: built and unit-tested without CUDA.
#include "cuda/sm80/forward_split.hpp"

#include <algorithm>
#include <atomic>

namespace flashattn::cuda::sm80 {

namespace {
std::atomic<int> g_splits_for_tests{0};  // set_forward_splits_for_tests
int64_t aligned(int64_t bytes) { return (bytes + 255) / 256 * 256; }
}  // namespace

ForwardSplitLayout forward_split_layout(const AttentionParams& p, int splits) {
  ForwardSplitLayout layout;
  const int64_t rows = split_partial_rows(p, splits);
  layout.o_bytes = aligned(rows * p.head_dim_v * 4);
  layout.lse_bytes = aligned(rows * 4);
  layout.total_bytes = layout.o_bytes + layout.lse_bytes;
  return layout;
}

int forward_split_count(const AttentionParams& p, int block_m, int block_n, int sm_count, int ctas_per_sm) {
  if (p.dropout_p > 0.f || p.seqlen_q < 1 || p.seqlen_k < 1 || block_m < 1 || block_n < 1) return 1;
  const int64_t key_tiles = (int64_t(p.seqlen_k) + block_n - 1) / block_n;  // of the longest sequence
  const int forced = g_splits_for_tests.load(std::memory_order_relaxed);
  if (forced > 0) return std::min(forced, kMaxForwardSplits);
  const int64_t ctas = (int64_t(p.seqlen_q) + block_m - 1) / block_m * p.heads_q * p.batch;
  const int64_t slots = int64_t(std::max(sm_count, 1)) * std::max(ctas_per_sm, 1);
  if (2 * ctas > slots) return 1;  // every SM has a CTA, or nearly
  const int64_t by_slots = slots / ctas;
  const int64_t by_keys = key_tiles / kMinTilesPerSplit;
  const int64_t splits = std::min<int64_t>({by_slots, by_keys, kMaxForwardSplits});
  return splits >= 2 ? int(splits) : 1;
}

ForwardWorkShape forward_work_shape(const AttentionParams& p, int block_m, int block_n, int sm_count, int ctas_per_sm,
                                    int forced) {
  ForwardWorkShape s;
  s.block_m = std::max(block_m, 1);
  s.block_n = std::max(block_n, 1);
  s.heads = std::max(p.heads_q, 1);
  s.slots = int64_t(std::max(sm_count, 1)) * std::max(ctas_per_sm, 1);
  s.forced = forced > 0 ? std::min(forced, kMaxForwardSplits) : 0;
  const int64_t tiles = int64_t(std::max(p.batch, 0)) * ((int64_t(std::max(p.seqlen_q, 0)) + s.block_m - 1) / s.block_m);
  // Unsplit, the list holds every tile (at most B x the longest sequence's); split, at most slots / heads items
  // (work_split_cap: cap x tiles x heads <= slots).
  const int64_t one_wave = s.slots / s.heads;
  const int64_t items = s.forced > 0 ? tiles * s.forced : std::max(tiles, one_wave);
  s.max_items = int(std::min<int64_t>(items, INT32_MAX));
  s.partial_items = s.forced > 0 ? s.max_items : int(std::min<int64_t>(s.max_items, one_wave));
  s.max_merges = std::max(1, s.partial_items / 2);
  return s;
}

ForwardWorkLayout forward_work_layout(const AttentionParams& p, const ForwardWorkShape& shape) {
  ForwardWorkLayout layout;
  const int64_t rows = int64_t(shape.partial_items) * shape.heads * shape.block_m;
  layout.items_bytes = aligned(int64_t(shape.max_items) * int64_t(sizeof(SplitWorkItem)));
  layout.merges_bytes = aligned((1 + int64_t(shape.max_merges)) * 4);
  layout.o_bytes = aligned(rows * p.head_dim_v * 4);
  layout.lse_bytes = aligned(rows * 4);
  layout.total_bytes = layout.items_bytes + layout.merges_bytes + layout.o_bytes + layout.lse_bytes;
  return layout;
}

void set_forward_splits_for_tests(int splits) { g_splits_for_tests.store(std::max(splits, 0), std::memory_order_relaxed); }
int forward_splits_for_tests() { return g_splits_for_tests.load(std::memory_order_relaxed); }

}  // namespace flashattn::cuda::sm80
