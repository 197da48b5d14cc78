// GQA packing for short forward calls: the G = Hq / Hk query heads of a K/V head share one grid row of the forward
// kernel. Plain C++ (the row mapping is FA_HD: the kernels use it; the plan and its tests use the rest).
//
// Why: the forward kernel gives each query head its own query tiles, and every tile streams its K/V head's keys. A call
// of few query rows (speculative tokens, a short chunk over a long prefix, fa_kvcache of tens of rows) then reads each
// K/V tile G times, once per query head, through tiles that are mostly empty: Sq = 16 at G = 4 over 32k keys fills 16
// of a 64-row tile's rows and reads the cache 4 times over (B = 1, Hq 32 / Hk 8, D = 128, bf16: 100.9 us on an H100,
// where one read of its 128 MiB of K/V at the card's ~3 TB/s takes ~45; bench/results/2026-12-06-1049-*). Packed, the
// tile's rows are the K/V head's G query heads x Sq rows, so each K/V tile is read once per packed tile.
//
// Packed row r (0 <= r < G x Sq of sequence b) of the grid row of K/V head hk is query row r / G of query head
// hk x G + r % G: consecutive rows are one query position's G heads, so a tile spans few positions and the causal or
// window mask of its rows stays a narrow band, as unpacked. The kernels that can pack (forward_kernel.cuh,
// GqaPackingOf: the split-KV and compact-epilogue rows; KernelEntry::gqa_packing) read AttentionParams::pack_gqa; the
// others never see it set. Packing changes which CTA computes a row, and so rounding only.
// Measured (H100, 2026-12-06 13:01 UTC, B = 1 / 4 / 16, Hq 32 / Hk 8, D = 128, bf16, causal): 17-32 rows 1.4-2.1x over
// 32k keys or at B >= 4, 48-64 rows 1.05-1.22x, B = 1 over 8k at 48-64 rows 0.92-0.98x (bench/results/
// 2026-12-06-1301-h100-gqa-packing-ab.txt; docs/PERFORMANCE.md "CUDA GQA packing of short forwards").
#pragma once

#include "core/host_device.hpp"
#include "core/params.hpp"
#include "cuda/kernel_entry.hpp"

namespace flashattn::cuda::sm80 {

// Packed rows per query row: G when the call runs packed, else 1.
FA_HD int gqa_pack_factor(const AttentionParams& p) { return p.pack_gqa != 0 ? p.heads_q / p.heads_k : 1; }
// The query row and query head of packed row r of K/V head hk (pack = gqa_pack_factor).
FA_HD int packed_query_row(int r, int pack) { return pack > 1 ? r / pack : r; }
FA_HD int packed_query_head(int r, int hk, int pack) { return hk * pack + r % pack; }

// A call may run packed when G > 1 and nothing of a row depends on its query head beyond the addresses: no ALiBi (a
// slope per head; the kernel takes one per grid row) and no dropout (the split-KV and compact rows have none), and
// G x Sq <= kMaxPackedRows (packing is for short calls; the packed row counts stay far inside 32 bits).
constexpr int kMaxPackedRows = 1 << 16;
bool gqa_packing_allowed(const AttentionParams& p);
// The call as a packed kernel's grid sees it (for the plans: tile choice, split count): Hk heads of G x Sq rows
// (max_seqlen_q x G when varlen), pack_gqa set.
AttentionParams gqa_packed_view(const AttentionParams& p);
// The call packs when the row its packed view runs (`packed_rows`: the split row where the view splits, else its
// dispatch row) may pack and packing reads K/V fewer times than the row the call runs unpacked (`rows`): per K/V head,
// ceil(G x Sq / packed block_m) packed tiles against G x ceil(Sq / block_m) (each tile streams the keys once). Sq = 16,
// G = 4: 1 tile of 64 rows against 4; Sq = 64, G = 4 in 128-row tiles: 2 against 4 (of 64 rows); Sq = 64 in 64-row
// tiles both ways: 4 and 4, no packing. Affects speed only.
bool gqa_packing_pays(const AttentionParams& p, const KernelEntry& rows, const KernelEntry& packed_rows);

}  // namespace flashattn::cuda::sm80
