// GQA packing's plan rules (forward_packing.hpp). Plain C++: built and unit-tested without CUDA.
#include "cuda/sm80/forward_packing.hpp"

namespace flashattn::cuda::sm80 {

bool gqa_packing_allowed(const AttentionParams& p) {
  return p.heads_k > 0 && p.heads_q > p.heads_k && p.heads_q % p.heads_k == 0 && p.alibi_slopes == nullptr &&
         p.dropout_p == 0.f && p.seqlen_q > 0 && int64_t(p.seqlen_q) * (p.heads_q / p.heads_k) <= kMaxPackedRows;
}

AttentionParams gqa_packed_view(const AttentionParams& p) {
  AttentionParams view = p;
  const int group = p.heads_q / p.heads_k;
  view.seqlen_q = p.seqlen_q * group;
  view.heads_q = p.heads_k;
  view.pack_gqa = 1;
  return view;
}

bool gqa_packing_pays(const AttentionParams& p, const KernelEntry& rows, const KernelEntry& packed_rows) {
  if (!gqa_packing_allowed(p) || !packed_rows.gqa_packing || packed_rows.block_m < 1 || rows.block_m < 1) return false;
  const int group = p.heads_q / p.heads_k;
  const int64_t packed_tiles = (int64_t(p.seqlen_q) * group + packed_rows.block_m - 1) / packed_rows.block_m;
  const int64_t tiles = int64_t(group) * ((int64_t(p.seqlen_q) + rows.block_m - 1) / rows.block_m);
  return packed_tiles < tiles;
}

}  // namespace flashattn::cuda::sm80
