// Host side of the CUDA KV-cache (decode) path, plain C++ (no CUDA, no device access), unit-tested without a
// GPU in tests/cpp/test_cuda_kvcache_plan.cpp:
//   check_kvcache_support   the CUDA-specific rules of a call (after src/api/validate.cpp)
//   choose_num_splits       the split-KV heuristic (from batch, K/V heads, m-blocks, capacity and SM count)
//   make_decode_plan        splits + workspace layout of a call: fa_plan_kvcache reports it, fa_kvcache runs it
//   make_decode_args        the kernels' argument struct from the params and an aligned workspace
//
// The plan depends on the shapes only (B, Sq, Hq, Hk, D, capacity, S_new) and on the device, never on the
// lengths in cache_seqlens (device memory): plan once per batch shape, run every step with the planned
// workspace, allocation-free and CUDA-graph capturable. See decode_work.hpp for how each sequence then
// uses as many of the planned splits as its length warrants.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/params.hpp"
#include "core/status.hpp"
#include "cuda/decode/decode_work.hpp"
#include "cuda/kernel_entry.hpp"

namespace flashattn::cuda::decode {

// ---- split-KV tuning: affects speed only, never results (every split count gives the same attention up
// to float rounding of the merge) ----
// Measured on the H200 (2026-11-30 07:40 UTC, bf16, D = 128, Hq 32 / Hk 8, the m16n64w4s3 tile, which fits
// 2 CTAs per SM; flashattn_decode_bench --splits sweeps, inputs in one arena): a contiguous cache is fastest
// with about one CTA per SM: B = 1: 16 splits (8 k 2.00 TB/s, 128 k 4.11) against 32 (1.84, 4.01); B = 4: 4
// (8 k 3.24) against 8 (3.15); B = 16: 1 (1 k 3.13, 8 k 4.25) against 2 (2.59, 4.04). A paged cache with room
// for long sequences is fastest with the CTA slots of 2 per SM: B = 16, 128 k: 2 splits 4.40 against 1 4.31;
// B = 4: 8 splits 4.32 against 4 4.22 (its block-table reads add latency that more CTAs hide); up to
// 16 k keys one CTA per SM was as fast or faster (not at B = 12-16 now: see kOneWaveFill).
// Short caches: with the cluster merge (one kernel), two tiles per split beat one. B = 1, 1 k cache (16 tiles),
// us per step, 8 splits against 16 (H200, 2026-11-30 10:05 UTC): contiguous 7.52 against 8.23, paged 8.00
// against 8.73; 4 splits 8.26 / 9.15. (Before the cluster merge, with the combine kernel, one tile per split
// was fastest.) The floor also applies on the device to a sequence much shorter than the planned capacity.
constexpr int kMinTilesPerSplit = 2;       // a split streams >= 2 key tiles (when the sequence has them)
// The paged rules below (every CTA slot, 2 splits at one wave) were measured with the paged copies that look up and
// check ids per tile. Since 2026-12-03 the usual 16-bit pool on 64-key tiles takes the kernel's lean paged copies
// (decode_kernel.cuh, lean_paged) and the contiguous cache's split counts (make_decode_plan): with them, against the
// paged rules, B = 1 / 32k 37.71 -> 36.42 us (16 splits instead of 32), B = 4 / 8k 37.04 -> 36.46 (4 instead of 8), 3
// rounds (bench/results/2026-12-03-2023-h200-decode-lean-paged-landed-ab-summary.txt). The paged rules stay for FP8
// caches, 128-key tiles (D = 32 / 64), blocks stored heads-major and block sizes that are not powers of two >= 16.
constexpr int64_t kPagedFullSlotsKeys = 32768;  // paged, capacity >= this many keys: plan for every CTA slot
// Paged caches of kPagedOneWaveSplitKeys to kPagedFullSlotsKeys keys whose unsplit grid is below kOneWaveFill of a wave
// also plan for every CTA slot where that plan keeps >= this many keys of the capacity per split. H200, 2026-12-01 14:25 UTC, bf16, Hq 32 / Hk 8, flashattn_decode_bench --splits 0,2,4,8,16,32,
// 3 rounds (bench/results/2026-12-01-1425-h200-decode-splits-b1-b8-8k-16k-summary.txt), paged, every slot's split
// count against one CTA per SM's: B = 4 (8 against 4 splits) 8k 1.018, 16k 1.026; B = 8 (4 against 2) 8k 0.996, 16k
// 1.017; B = 2 (16 against 8) 16k 1.009, but 8k (512 keys per split) 0.997; B = 1 (32 against 16, 256-512 keys) 0.93-0.96.
constexpr int64_t kPagedFullSlotsMinSplitKeys = 1024;
// One wave: where the unsplit grid gives kOneWaveFill to 1 CTA per SM, no split; but a paged cache of >=
// kPagedOneWaveSplitKeys keys takes 2 splits (two CTAs per SM hide the block table's latency; the pair merges
// in a cluster). The heuristic alone split these into 4 or left them at 1. H200, 2026-11-30, bf16, Hq 32 /
// Hk 8, us per step, two runs each (shortly before 15:46 UTC; B = 12 / 14 at 15:54 UTC as the JSON prints it,
// `bench/results/2026-11-30-1554-h200-decode-splits-b12-b14-*.json`):
//   B = 12 (96 CTAs, 0.73 per SM), 8k: contiguous 1 split 104.2-104.6, 2: 108.5-110.2, 4 (the heuristic's):
//     109.4-110.4; paged 1: 112.5-112.7, 2: 102.4-103.4, 4: 108.5-108.6. 16k alike (contiguous 1: 200.0,
//     4: 203-207; paged 2: 194.6-194.8, 4: 201-203).
//   B = 14 (112 CTAs), paged 8k: 1 split 117.5-119.1, 2: 114.7-114.9; contiguous 1: 108.8-108.9, 2: 116-117.
//   Contiguous, longer (16:03 UTC, `...-1603-h200-decode-splits-b12-b14-long-*.json`): B = 12, 1 split against
//     4: 16k 212.7-212.9 / 205.7-206.7 (15:54: 200.0 / 203-207), 32k 389-392 / 397-399, 128k 1533-1545 /
//     1566-1577; B = 14: 1 split 2-7% ahead of 2 and 4 at 16k-128k.
//   B = 16 (128 CTAs), paged: 2 splits against 1: 4k 70.2 / 70.5, 8k 129.0-130.2 / 132.2-133.1, 16k
//     249.9-251.0 / 258.0-258.7; contiguous stays faster with 1: 75.8 / 77.3, 125.5 / 128.5, 243.8 / 245.9.
//   B = 8 (64 CTAs, below one wave): the heuristic's 2 splits (paged 8k 72.0, every slot's 4: 73.9).
constexpr double kOneWaveFill = 0.7;
constexpr int64_t kPagedOneWaveSplitKeys = 8192;
// Those counts were fitted with the kernels of 2026-11-30. With today's (2026-12-01), the lower part of the one wave
// takes 4 splits, for 16-bit caches of >= kOneWaveFourSplitsMinKeys keys on sm_90+:
// - paged, up to kOneWaveFourSplitsPagedFill, in a tile of 2 CTAs per SM (the general one; paged caches of >=
//   kPagedFullSlotsKeys keep their every-slot plan, which comes first);
// - contiguous, up to kOneWaveLongTileFill, and only on the long_contiguous tile (one CTA per SM; the selection takes
//   it, wants_one_wave_long_tile below): 96 CTAs become 384, 2.9 waves of the 132 SMs. At 104 CTAs the fourth wave
//   holds 0.15 of one and 4 splits lose (0.88-0.93); the general tile at 4 splits lost too (D = 64, no long tile:
//   16k 0.926, 32k 0.934).
// H200, 2026-12-01 20:21 UTC, bf16, D = 128, flashattn_decode_bench --splits 0,1,2,3,4,6,8, 2 rounds
// (bench/results/2026-12-01-2021-h200-decode-splits-one-wave-summary.txt; 32 / 8 B = 12, 28 / 4 B = 24, 8 / 1 B = 96
// and 32 / 32 B = 3 are all 96 CTAs and time alike), 4 splits against the counts before (1 contiguous, 2 paged):
//   96 CTAs (0.73 per SM): contiguous 8k 1.027-1.056, 16k 1.081-1.095, 32k 1.104-1.112; paged 8k 1.092-1.100, 16k
//     1.106-1.117; 4k: 0.97 contiguous, 1.00 paged (hence kOneWaveFourSplitsMinKeys);
//   104 CTAs (0.79): paged 8k 1.061-1.067, 16k 1.073-1.080; contiguous 0.88-0.93 (1 split stays);
//   112 CTAs (0.85, B = 14, 18:30 UTC, bench/results/2026-12-01-1830-h200-decode-splits-b9-b16-summary.txt): paged 8k
//     1.022, 16k 1.047; 128 CTAs (0.97, B = 16): paged 0.96-0.99 against 2 splits (2 stays).
// The library against the rules before, 3 alternating runs (20:35 UTC, ...-2035-h200-decode-one-wave-splits-ab-summary.txt),
// where the count changed: 32 / 8 B = 12-14 geometric mean 1.080 (1.024-1.131; contiguous B = 12 / 32k 402.5 -> 356.0 us),
// 8 / 1 B = 96-112 1.080 (1.023-1.110), D = 64 paged B = 12-14 1.036 (0.980 at B = 14 / 8k, to 1.092); the issue's
// sweep keeps its counts (0.995-1.003).
// - either layout, up to kOneWaveLongTileFill, in a general tile of one CTA per SM (D = 256: 128 KiB), from
//   kOneWaveOneSlotMinKeys keys: the same 2.9 waves as the long tile's. H200, 23:36 UTC, --splits 0,1,2,4,8,12,16, 2
//   rounds, best us (bench/results/2026-12-01-2336-h200-decode-splits-d64-d256-one-wave-summary.txt), 32 / 8 D = 256
//   B = 12 (96 CTAs), 4 splits against 1: contiguous 16k 1.052, 32k 1.062; paged 16k 1.087 (32k: every slot's 4 stay);
//   B = 13 (104 CTAs): 0.90-0.92 (1 stays). D = 64 (two CTAs per SM) gained nothing from 8-16 splits contiguous
//   (0.93-1.00). The library against main, D = 256, 3 alternating runs (23:50 UTC,
//   ...-2350-h200-decode-d256-one-wave-four-splits-ab-summary.txt): where the count changed (32 / 8 B = 12, 28 / 4
//   B = 24, 8 / 1 B = 96, 32 / 32 B = 3 at 16k-128k) 1.041-1.106 (B = 12 / 16k paged 419.2 -> 382.7 us), every other
//   point 0.997-1.004.
constexpr double kOneWaveFourSplitsPagedFill = 0.9;
constexpr double kOneWaveLongTileFill = 0.75;
constexpr int64_t kOneWaveFourSplitsMinKeys = 8192;
constexpr int64_t kOneWaveOneSlotMinKeys = 16384;
constexpr int kOneWaveFourSplits = 4;
// FP8 (e4m3) caches at one wave: paged caches of >= kFp8PagedOneWaveSplitKeys keys (not 8k) take 2 splits, and
// contiguous ones of >= kFp8ContiguousOneWaveSplitKeys up to kFp8ContiguousOneWaveMaxFill, and of >=
// kFp8ContiguousShortSplitKeys up to kFp8ContiguousShortSplitMaxFill, take kFp8ContiguousOneWaveSplits (2.9-3.2 waves of
// the two CTA slots per SM, as the 16-bit long tile's 4 splits at one per SM). H200, --kv fp8 --splits, 2 rounds:
// - 21:05 UTC (bench/results/2026-12-01-2105-h200-decode-fp8-splits-one-wave-summary.txt): 2 splits are the fastest
//   count for paged 4k at B = 12-16 of 8 K/V heads. Alternating runs of the library (21:09 UTC, 3 each,
//   ...-2109-h200-decode-fp8-one-wave-ab-summary.txt), 2 splits against 1: paged 4k 32 / 8 B = 12-16 1.062-1.234,
//   28 / 4 B = 24 and 28 1.208 and 1.118, 8 / 1 B = 96 and 104 1.202 and 1.168. Contiguous 32k, 2 splits by fill: 0.73
//   (96 CTAs) 1.090-1.103, 0.79 (104) 1.035-1.054, 0.85 (112) 0.996-0.999, 0.97 (128) 0.974, 128k at 0.97 0.979: hence
//   kFp8ContiguousOneWaveMaxFill. From 0.85, 8 splits were 0.85-1.00 against 1 in the sweep.
// - 22:47 UTC (bench/results/2026-12-01-2247-h200-decode-fp8-splits-one-wave-contiguous-summary.txt, best us),
//   contiguous, 8 splits against the rule before (1 split at 16k, 2 from 32k up to 0.8):
//   96 CTAs (0.73 of the SMs): 32 / 8 B = 12 16k-128k 1.112-1.157 (32k 218.3 -> 193.9 us), 28 / 4 B = 24 1.133-1.175,
//   8 / 1 B = 96 1.117-1.147, 64 / 8 B = 12 1.122-1.140, D = 64 1.086-1.249 (12-16 splits up to 1.31 at 16k), D = 256
//   1.138-1.241; 104 CTAs (0.79): 32 / 8 B = 13 16k 1.018 (12 splits 1.053), 32k 1.069, 64k 1.134, 128k 1.075.
//   At 8k, 8 splits were 1.065 at 96 CTAs but 0.958 at 104: 1 split stays there.
//   The library with 8 splits from 16k up to 0.8 against main (23:01 UTC, 3 alternating runs, medians;
//   bench/results/2026-12-01-2301-h200-decode-fp8-one-wave-eight-splits-ab-summary.txt): 96 CTAs (32 / 8 B = 12, 28 / 4
//   B = 24, 8 / 1 B = 96, D = 64 and 256) 1.041-1.215; 104 CTAs 32k-128k 1.007-1.133, but 16k 0.976-1.003 (28 / 4
//   B = 26, 8 / 1 B = 104, 32 / 8 B = 13): hence 16k-32k only up to 0.75 of the SMs. The kept rule against main
//   (23:07 UTC, 3 alternating runs, ...-2307-h200-decode-fp8-one-wave-eight-splits-final-ab-summary.txt): where the
//   count changed 1.009-1.169 (32 / 8 B = 12 / 32k 215.5 -> 194.2 us), every other point 0.994-1.008.
constexpr int64_t kFp8PagedOneWaveSplitKeys = 4096;
constexpr int64_t kFp8ContiguousOneWaveSplitKeys = 32768;
constexpr double kFp8ContiguousOneWaveMaxFill = 0.8;
constexpr int64_t kFp8ContiguousShortSplitKeys = 16384;
constexpr double kFp8ContiguousShortSplitMaxFill = 0.75;
constexpr int kFp8ContiguousOneWaveSplits = 8;
// Contiguous caches at large batch: an unsplit grid of many waves still splits the long sequences, toward
// kManyWavesTarget waves of CTA slots, each split keeping >= kManyWavesMinSplitKeys keys (16-bit caches; paged
// caches do not gain). H200, 2026-11-30 23:58 UTC, bf16, Hq 32 / Hk 8, flashattn_decode_bench --splits 0,2,3,4,
// 4 rounds (speed-up against 1 split, median [range]; bench/results/2026-11-30-2358-h200-decode-splits-many-waves.json):
//   B = 256 (2048 CTAs, 7.8 waves of 264 slots), 2 splits: 4k 1.006, 8k 1.022 [1.021, 1.024], 16k 1.032, 32k
//   1.035 [1.034, 1.039]; B = 128, 4 splits: 4k 0.984, 8k 0.996, 16k 1.012, 32k 1.023 (3 splits: 0.97-1.03;
//   2: 1.00); B = 64 (1.9 waves): 2-4 splits 0.93-1.00 at 4k-32k. Paged, the same points: 0.95-1.01.
// The split CTAs read the two halves of a sequence at once, and the contiguous cache then reads at 99-101% of the
// same-size read floor (97-98% unsplit), as fast as the paged cache's shuffled blocks; why the contiguous cache's
// address order costs ~2-3% unsplit is not known (staggering each CTA's tile order did not help, see
// docs/PERFORMANCE.md, 18:22 UTC). The rule against the plan before it (2026-12-01 00:07 UTC, alternating, two runs
// each; bench/results/2026-12-01-0007-h200-decode-many-waves-ab.json): B = 256 / 8k +2.3%, 32k +3.7%; B = 128 / 8k
// (2 splits) +0.5%, 32k (4) +2.5%; every other point of B = 64-256 x 4k-32k, both layouts, unchanged (+-0.3%).
constexpr double kManyWavesMinWaves = 3.5;      // unsplit grid of >= this many waves of every CTA slot
constexpr int64_t kManyWavesTarget = 16;        // splits = floor(16 waves / unsplit waves)
constexpr int64_t kManyWavesMinSplitKeys = 4096;
// Between one CTA per SM and kManyWavesMinWaves waves of every CTA slot (any cache, either layout): the unsplit
// grid's last round of CTAs can leave most slots idle (B = 20: 160 CTAs on 132 SMs of 2 slots; B = 36: 288 CTAs, a
// second round of 24). The split count then comes from the slot waves: the smallest of kSlotWaveSplitCounts whose
// waves of slots are within kWaveEfficiencyKept of the fullest, each split keeping >= kBalancedMinSplitKeys keys of
// the capacity (slot_wave_splits). H200, 2026-12-01 18:18 UTC, bf16, Hq 32 / Hk 8, flashattn_decode_bench --splits
// 0,1,2,3,4,6,8, 2 rounds, B = 12-96 x 2k / 8k / 32k (bench/results/2026-12-01-1818-h200-decode-splits-b12-b96.json,
// -summary.txt): at the 30 points of each layout of B = 20-96, the counts this rule takes against those of the rule
// before, geometric mean 1.031 (contiguous) and 1.046 (paged) faster, up to 1.25 (contiguous B = 20 / 8k, 3 splits:
// 202.2 -> 161.2 us) and 1.26 (paged B = 36 / 32k, 6 splits: 1399.9 -> 1108.9 us); slower only at contiguous B = 48
// / 8k and 32k, 0.972 and 0.979 (2 splits where 1 was fastest). The library with the rule against the rule before,
// 18:27 UTC, 3 alternating runs (...-1827-h200-decode-balanced-splits-ab-summary.txt): 32 / 8, B = 20-80 x 2k-32k, both
// layouts, geometric mean 1.043 (0.971-1.267); 28 / 4 B = 40-56 / 8k 1.063; MHA B = 6-10 / 8k 1.104; D = 64 and
// D = 256, B = 20 and 36 / 8k, 1.153 and 1.179; the sweep unchanged (the same split counts at its 30 points).
// Also 8 / 1 B = 160-300 and 16 / 16 D = 256 B = 10 (18:48 UTC, ...-1848-...): up to 1.24 and 1.27, but contiguous
// 8 / 1 B = 300 / 4k 0.945 (2 splits; 2.3 CTAs per SM unsplit, like B = 48's 2.9 above).
// At most one CTA per SM (B <= 16 here) the rules above stay. FP8 caches take this rule and the one below too
// (2026-12-01 20:41 UTC, --kv fp8 --splits 0,1,2,3,4,6,8, 2 rounds, 32 / 8 B = 9-48 x 8k / 32k; bench/results/
// 2026-12-01-2041-h200-decode-fp8-splits-summary.txt): the counts they take against the rules before (which left FP8
// out), B = 20-48: contiguous 1.07-1.29 (from 1 split), paged 1.00-1.45 (from 1-8; B = 36 / 32k: 844.4
// -> 581.9 us); B = 9-10 (below one wave): 1.02-1.23.
constexpr int kSlotWaveSplitCounts[] = {1, 2, 3, 4, 6, 8};  // the counts measured
constexpr int64_t kBalancedMinSplitKeys = 2048;
// Just below one wave (kBelowWaveMinFill to kOneWaveFill CTAs per SM unsplit; B = 9-11 of 8 K/V heads), caches
// of >= kBelowWaveMinKeys keys in a tile of >= 2 CTAs per SM (the one measured): the slot waves too, each split keeping >= kBelowWaveMinSplitKeys keys. Paged caches of
// >= kPagedFullSlotsKeys keep their every-slot plan. H200, 2026-12-01 18:30 UTC,
// bf16, Hq 32 / Hk 8, --splits 0,1,2,3,4,6,8, 2 rounds (bench/results/2026-12-01-1830-h200-decode-splits-b9-b16-
// summary.txt): B = 9 and 10 (72 and 80 CTAs), 3 splits were the fastest at 4k-32k; against the heuristic's 8-13,
// 1.05-1.10x contiguous, 0.99-1.14x paged at 4k-16k. The library with the rule against the rule before (18:44 UTC, 3
// alternating runs, bench/results/2026-12-01-1844-h200-decode-below-wave-splits-ab-summary.txt): 32 / 8, the 14 points
// of B = 9-10 x 4k-32k whose count changed, geometric mean 1.067 (0.986-1.135); 28 / 4, B = 17-23 x 4k / 16k (68-92
// CTAs), 1.053 (0.968 at B = 23 / 4k, 2 splits where the heuristic's 7 were faster, to 1.175); B = 8, 11 and 12 unchanged.
constexpr double kBelowWaveMinFill = 0.5;
constexpr int64_t kBelowWaveMinKeys = 4096;  // capacities of at least this many keys (the ones measured)
constexpr int64_t kBelowWaveMinSplitKeys = 1024;
constexpr int kMaxSplits = 128;            // the heuristic's cap (an explicit num_splits may be larger)
// The cap where the whole call is one CTA unsplit (B = 1, one K/V head, one m-block: e.g. 8 query heads of one K/V
// head, a tensor-parallel shard of a GQA model). Affects speed only. H200 (132 SMs), bf16, D = 128, 8 / 1, B = 1,
// --splits sweeps (bench/results/2026-12-02-0103-h200-decode-splits-one-cta-summary.txt, -0111-...-splits-cliff-...):
// at 16k and 64k keys, 118-128 splits ran 4-10% slower than 96-116: paged with either build of the kernel, contiguous
// with the lean copy addresses (decode_kernel.cuh; 16k, 01:11 UTC: contiguous 116 splits 8.56 us, 118 9.32, 120 9.44;
// paged, main's kernel, 116 9.47, 118 9.97). Asked 116 and 118 both run 86 working splits of 3 tiles at 16k: the
// slowdown follows the grid, not the work. Why was not found: the timeline probe (-0109-...) showed the same phases and
// no two streaming CTAs on one SM, and the largest shared-memory carveout for the combine kernel changed nothing
// (-0116-..., not kept). Two CTAs unsplit keep kMaxSplits (-0119-...: paged 64k, 128 splits 24.07 us against
// 24.46-24.88 at 96-116). The library against main (01:35 UTC, -0135-...): 8 / 1 B = 1 / 16k paged 10.29 -> 9.40 us
// (128 -> 86 splits), 64k 17.10 -> 16.26 (103), contiguous 1.031-1.038.
constexpr int kMaxSplitsOneCta = 112;
constexpr double kFullOccupancy = 0.8;     // at >= 80% of one wave of CTA slots without splitting: no split
constexpr double kWaveEfficiencyKept = 0.96;  // smallest split count whose last-wave efficiency is within 96% of the best
                                              // (B = 1: 32 of 264 slots; 0.97 would jump B = 4 from 8 to 33 splits)
constexpr int kMaxCtasPerSm = 4;           // occupancy estimate cap (the kernels use <= 255 registers x 128 threads)
constexpr int64_t kWorkspaceAlignment = 256;  // the partial buffers start 256-byte aligned in any caller workspace
// Split 0 of a contiguous cache copies Q and its first tiles before it knows the sequence's length
// (DecodeArgs::early_tiles, decode_kernel.cuh). Affects speed only. H200, 2026-12-01 08:21 UTC, bf16, Hq 32 / Hk 8,
// contiguous, the library's tile with the knob off / on, 3 rounds alternating, median us per call
// (bench/results/2026-12-01-0821-h200-decode-early-tiles.txt): B = 16 / 1k 19.58 -> 19.03 (+2.9%), B = 1 / 1k 7.21 ->
// 7.02 (+2.7%), B = 64 / 1k 65.02 -> 63.93 (+1.7%), B = 1 / 32k +0.7%, B = 16 / 8k +0.2%; 8k-32k at B = 16-64 within
// +-0.3% (the length's round trip is a smaller part of a longer call).
constexpr bool kEarlyTiles = true;
// Before its wait for the previous grids, a decode CTA prefetches into L2 the line of cache_seqlens[b] and, paged,
// the block-table lines it reads first (DecodeArgs::prefetch_inputs, decode_kernel.cuh), so that the reads after the
// wait hit L2 instead of DRAM. Affects speed only. H200, 2026-12-01 10:52 UTC, bf16, Hq 32 / Hk 8, the library's tile
// with the knob off / on, 3 rounds (bench/results/2026-12-01-1052-h200-decode-prefetch-ab-summary.txt): paged B = 1 /
// 1k +3.3%, B = 4 / 1k +2.8%, B = 1 / 32k +1.2%, contiguous B = 1 / 1k +1.8%; every other point of B = 1-64 x 1k-32k
// within -0.4% .. +0.9%. (Marking the prefetched lines evict-last, or the K/V stream evict-first, gained no more:
// 1102 UTC, same folder.)
constexpr bool kPrefetchInputs = true;
// While it waits for the previous grids, a decode CTA guesses its length (and paged, its first block ids) and copies
// the guessed split's first tiles right after the wait, kept if the real values agree (DecodeArgs::speculative_tiles,
// decode_kernel.cuh). Affects speed only. H200, 2026-12-01 11:29 UTC, same shapes, the knob off / on with the
// prefetch on, 5 rounds, median us per call (bench/results/2026-12-01-1129-h200-decode-speculate-ab-summary.txt):
// contiguous B = 1 / 1k 7.08 -> 6.66 (+6.4%), 2k-4k +5.0-5.6%, 32k +1.5%, B = 2 / 2k-4k +2.8-3.1%; paged B = 1 / 1k
// 7.34 -> 6.84 (+7.4%), B = 2 / 1k +9.3%, B = 4 / 1k +5.0%, B = 8 / 1k +5.1%, B = 16 / 1k +2.1%; 32k at B = 1-16
// +0-1.5%. Below 1: contiguous B = 2 / 1k 0.995, B = 4 / 1k-2k 0.993-0.997 (3-4 splits in clusters; their spread
// is as wide).
constexpr bool kSpeculativeTiles = true;
constexpr bool kProgrammaticLaunch = true; // sm_90+: launch the decode kernels as programmatic dependents
// sm_90+: the splits of an m-block form a thread-block cluster and merge their partials through distributed
// shared memory, instead of a combine kernel after the attention kernel (up to kMaxClusterSplits splits;
// clusters above 8 CTAs are "non-portable" but run on the H100 / H200). Affects speed only: the same merge
// in the same split order. It pays where the splits are short and the second kernel's latency is a large
// part of the step, and costs where long splits stream in big clusters (the clusters then keep fewer CTAs
// resident). Measured (H200, 2026-11-30 08:03 and 08:07 UTC, bf16, D = 128, Hq 32 / Hk 8, cluster against
// combine kernel, same tile): 1k caches +16-21% at B = 1-8 (B = 1: 8.2 against 9.6 us per step); 8 splits
// of 16 tiles (B = 2, 8k) +3-7%; 2 splits +0-5% at every length; 16 splits of 8 tiles (B = 1, 8k) -4% to +4%
// (paged -4%); 16 splits of 32+ tiles -4-12% contiguous; paged, 4-16 splits at 32k-128k, -19-29%. Again with
// the kernels of 15:32 UTC (15:53 UTC, best of two runs, kClusterMergeMaxTiles16 = 16 against 4): B = 1, 16
// splits of 8 / 16 tiles (8k / 16k): contiguous -3.2% / -3.5%, paged -0.8% / +0.3%: still the combine kernel.
// With the one-round combine kernel (decode_aux.cu; H200, 18:39 UTC, two runs each, both layouts, clusters against
// no clusters at all): clusters still lead with 2 splits (+1-10%) and with splits of 2-4 tiles at 1k caches
// (B = 1-4: +3-12%); the combine now leads at 16 splits of 4 tiles (B = 1, 4k: +9%) and 8 splits of 16 tiles
// (B = 2, 8k: +6.4-6.8%); 8 x 8 and 4 x 16 tiles are even (-1.6% to +1.1%). Hence 8 and 2 tiles below (were 16, 4);
// raw: bench/results/2026-11-30-1839-h200-decode-clusters-*.json.
// Why long splits lose in big clusters (H200, 2026-12-01 08:21 UTC, flashattn_decode_tiles --cluster 0,1
// --cluster-policy 0,1 --smem-pad 0,40000; bench/results/2026-12-01-0821-h200-decode-cluster-policy-pad.txt): clusters
// are placed within a GPC, and at one CTA per SM (the tile padded to 140 KB) only 7 clusters of 16, 15 of 8 or 30 of 4
// CTAs are resident at once (cudaOccupancyMaxActiveClusters): 112-120 of the 132 SMs. At two CTAs per SM (the
// tile's own 100 KB) 14 / 30 / 62 are, and the 128 CTAs of B = 1 / 32k in 16-CTA clusters shared SMs: 112, 98, 82
// and 66 distinct SMs in 4 successive calls (the timeline's SM count; each call's clusters, launched early as
// programmatic dependents, wait in the second slots of the SMs the call before them streams on): 46.0 us per call
// against 36.8 with the combine kernel; padded to one CTA per SM, 112 SMs and a second wave: 56.7. B = 4 / 8k in
// 4-CTA clusters: 37.5 / 56.8 against 36.5. The spread scheduling policy (cudaClusterSchedulingPolicySpread) changed
// nothing. So the combine kernel stays for one-wave grids of long splits.
constexpr bool kClusterMerge = true;
constexpr int kMaxClusterSplits = 16;
// The rule with 8 tiles for 3-8 splits ran against the rule before it (16 tiles; 19:43 UTC, two binaries
// alternating, two runs each, B = 1-4 x 1k-8k, bench/results/2026-11-30-1943-h200-decode-cluster-rule-ab.json):
// B = 1 / 4k +2.9% contiguous, +5.2% paged; B = 2 / 8k +3.2% / +5.1%; but 4 splits of 16 tiles (B = 4 / 4k) -0.8%
// / -2.0%: clusters of 3-4 splits keep 16 tiles (kClusterMergeMaxTiles4).
// Again on 2026-12-01 08:29 UTC (H200, B = 1-8 x 1k-4k, both layouts): the combine kernel (flashattn_decode_tiles
// --cluster 0, the library's tile, 2 rounds; bench/results/2026-12-01-0829-h200-decode-cluster-vs-combine.txt) against
// the cluster merge as the rule of then chose it (main f3cd604's library, 2 runs; ...-0829-h200-decode-lib-main_{1,2}
// .json), median us per call, combine / cluster, contiguous and paged: 16 splits of 2 tiles (B = 1 / 2k) 8.89 / 9.30,
// 9.24 / 9.60; 8 splits of 2 tiles, B = 1 / 1k 7.70 / 7.16, 8.21 / 7.40, B = 2 / 1k 9.0 / 8.87, 9.20 / 9.14; of 4
// tiles (B = 2 / 2k) 10.70 / 11.21, 11.15 / 11.78; of 8 tiles (B = 2 / 4k) 14.97 / 15.34, 15.59 / 15.86; 4 splits of
// 4 tiles (B = 4 / 1k) 10.78 / 10.54, 11.3 / 10.84; of 8 (B = 4 / 2k) 15.02 / 15.13, 15.84 / 15.62; of 16 (B = 4 / 4k)
// 22.64 / 23.41, 23.55 / 24.12; 2 splits (B = 8) 15.10 / 13.94 at 1k, 37.6 / 36.9 at 4k (paged alike). Hence 8, 2 and
// no tiles below (were 16, 8 and 2); clusters of 9-16 CTAs are left to explicit tuning (bench/decode_bench.cu).
constexpr int64_t kClusterMergeMaxTiles4 = 8;      // tiles of the capacity per split, clusters of 3-4
constexpr int64_t kClusterMergeMaxTiles = 2;       // ... of 5-8
constexpr int64_t kClusterMergeMaxTiles16 = 0;     // ... of 9 to kMaxClusterSplits CTAs: none (the combine kernel)

// Whether the splits of a call merge inside thread-block clusters (where the device has them and they fit):
// 2 splits at any length; up to 4 splits of at most kClusterMergeMaxTiles4 key tiles of the capacity, up to 8
// of at most kClusterMergeMaxTiles; up to kMaxClusterSplits splits of at most kClusterMergeMaxTiles16 (none).
inline bool wants_cluster_merge(int num_splits, int64_t capacity_keys, int block_n) {
  if (!kClusterMerge || num_splits < 2 || num_splits > kMaxClusterSplits || block_n <= 0) return false;
  const int64_t capacity_tiles = (capacity_keys + block_n - 1) / block_n;
  const int64_t tiles_per_split = (capacity_tiles + num_splits - 1) / num_splits;
  const int64_t most = num_splits <= 4 ? kClusterMergeMaxTiles4 : num_splits <= 8 ? kClusterMergeMaxTiles : kClusterMergeMaxTiles16;
  return num_splits == 2 || tiles_per_split <= most;
}

// What planning needs to know about the device.
struct DecodeDevice {
  int device = 0;                    // CUDA ordinal, for messages
  int sm_major = 0, sm_minor = 0;
  int sm_count = 0;                  // streaming multiprocessors
  int64_t smem_per_block_optin = 0;  // bytes a CTA may use after cudaFuncSetAttribute
  int64_t smem_per_sm = 0;           // bytes of shared memory per SM (occupancy)
};

// Short contiguous caches at many waves of CTAs: the many_waves row of the manifest (D = 128: two K/V stages, 68 KiB,
// three CTAs per SM, against the general row's three stages, 100 KiB, two per SM) hides each CTA's fixed start and
// epilogue behind more resident CTAs. H200, 2026-12-01 08:38 UTC, bf16, Hq 32 / Hk 8, flashattn_decode_tiles, 2
// rounds (bench/results/2026-12-01-0838-h200-decode-tiles-b128-b256-short.json), contiguous, TB/s of m16n64w4s2 /
// the general row: B = 128 (1024 CTAs, 7.8 per SM) 1k 4.32 / 4.16, 2k 4.40 / 4.32; B = 256 1k 4.30-4.31 / 4.24-4.26,
// 2k 4.35-4.36 / 4.33-4.34. Paged it was mixed (B = 128 +1.6-1.7%, B = 256 -1% to -1.6%): contiguous only.
constexpr int kManyWavesTileMinCtasPerSm = 7;    // the unsplit grid has at least this many CTAs per SM
constexpr int64_t kManyWavesTileMaxKeys = 2048;  // and the capacity is at most this many keys

// Long contiguous caches at 1.5 to 4 CTAs per SM: the long_contiguous row of the manifest (D = 128: two stages of
// 128-key tiles, 32 keys per warp, 132 KiB, one CTA per SM) streams K/V 1-2.5% faster than the general row (64-key
// tiles, three stages, two CTAs per SM) at the general row's split count. H200, 2026-12-01, bf16, Hq 32 / Hk 8, contiguous,
// flashattn_decode_tiles --runners m16n64w4s3,m16n128w4s2, speed-up of the long row, median of 2-3 rounds
// (bench/results/2026-12-01-1337-h200-decode-long-tile-*.json, -summary.txt):
//   B = 1-4 (16 / 8 / 4 splits), 32k-128k: 1.007-1.010 (13:39 UTC); B = 2-4 / 16k 1.008-1.009, but B = 1 / 16k (16 splits
//     of 1k keys) 0.993: hence kLongTileMinSplitKeys;
//   B = 8 (2 splits) 8k-128k 1.002-1.018, B = 16 (1 split) 1.002-1.011, B = 32 1.014-1.025 (13:38 UTC);
//   B = 64, 1 split (512 CTAs, 3.9 per SM): 8k 1.011, 16k-128k 1.022-1.024 (13:40 UTC); at 4 splits (the long row's own
//     plan) 128k 1.007-1.009, 8k 0.966 (13:37-13:38 UTC); MHA (Hq = Hk = 32) B = 8 / 32k 1.025, B = 16, 1 split: 32k 1.012, 128k 0.989;
//   B = 128 at its 2-4 splits (1024-4096 CTAs): 8k 0.972-0.979, 16k-128k 0.989-1.031 by split count; B = 256, 2 splits:
//     0.973-0.991: hence kLongTileMaxCtasPerSm. Paged caches: 0.95-0.99 at every point (13:38 UTC): contiguous only.
//   The library with the rule at >= 1 CTA per SM against the general row launched directly (13:49 UTC, 3 rounds,
//     `...-1349-h200-decode-long-tile-lib-vs-general-summary.txt`): B = 32-64 x 8k-128k 1.011-1.023 again, but B = 1-16
//     (128 CTAs) 0.991-1.010, within the rounds' spread: hence kLongTileMinCtasPerSm.
// Measured on the H200 only: sm_90+ (the sm_80 parts keep the general row).
constexpr int64_t kLongTileMinSplitKeys = 2048;  // keys of the capacity per split, at the general row's split count
constexpr double kLongTileMinCtasPerSm = 1.5;    // the grid (splits included) has at least this many CTAs per SM
constexpr int kLongTileMaxCtasPerSm = 4;         // ... and at most this many

// The m-blocks of one (sequence, K/V head): ceil(G * Sq / block_m) packed rows of block_m (decode_work.hpp), and the
// CTAs of a call's grid without splits: B * Hk of them.
inline int64_t row_blocks(const KvcacheParams& p, int block_m) {
  const int64_t packed_rows = int64_t(p.heads_q / p.heads_k) * p.seqlen_q;
  return (packed_rows + block_m - 1) / block_m;
}
inline int64_t unsplit_ctas(const KvcacheParams& p, int block_m) { return int64_t(p.batch) * p.heads_k * row_blocks(p, block_m); }

// Whether a call takes the many_waves tile: a contiguous 16-bit cache of at most kManyWavesTileMaxKeys keys, no
// split asked for, and an unsplit grid of at least kManyWavesTileMinCtasPerSm CTAs (of `block_m` packed rows) per SM.
inline bool wants_many_waves_tile(const KvcacheParams& p, int block_m, const DecodeDevice& device) {
  if (p.block_table != nullptr || p.kv_dtype == FA_FLOAT8_E4M3 || p.num_splits > 1 || block_m <= 0 || device.sm_count <= 0)
    return false;
  return p.seqlen_k <= kManyWavesTileMaxKeys && unsplit_ctas(p, block_m) >= int64_t(kManyWavesTileMinCtasPerSm) * device.sm_count;
}

// CUDA rules of a kvcache call: fp16 / bf16, Dv == D, D % 8 == 0, no dropout, 16-byte aligned base pointers
// and strides of q, out, the caches and k_new / v_new (cp.async and the 16-byte stores), grid limits.
Status check_kvcache_support(const KvcacheParams& p);
// CUDA rules of a kvcache_append call (the append kernel's): fp16 / bf16 rows into a cache of their dtype or an FP8
// one, Dv == D, D % 8 == 0 (FP8: % 16), the alignment of the caches and of k_new / v_new (total_new rows).
Status check_kvcache_append_support(const KvcacheParams& p, int64_t total_new);

// CTAs of `smem_bytes` shared memory and `threads` threads that fit one SM at a time (an estimate that
// ignores registers beyond kMaxCtasPerSm).
int ctas_per_sm(int64_t smem_bytes, int threads, const DecodeDevice& device);

// Split-KV heuristic. `ctas` = B * Hk * m_blocks (CTAs without splitting); `slots` = the CTAs to aim for at
// once (make_decode_plan: one per SM, or SMs x CTAs per SM for long paged caches);
// `capacity_tiles` = key tiles of the longest possible sequence. Returns 1 when the unsplit grid already
// fills the device; else the smallest split count whose waves are nearly as full as the best one, capped
// by kMaxSplits (kMaxSplitsOneCta for one CTA) and by capacity_tiles / kMinTilesPerSplit, and then a count at
// which every split gets tiles of the capacity (decode_plan.cpp says which).
int choose_num_splits(int64_t ctas, int64_t slots, int64_t capacity_tiles);

// The fraction of CTA-slot time that `ctas` x `splits` equal CTAs keep busy over waves of `slots`: waves / ceil(waves).
inline double wave_efficiency(int64_t ctas, int splits, int64_t slots) {
  const double waves = double(ctas) * splits / double(slots);
  return waves / std::ceil(waves);
}

// The split count from the slot waves (make_decode_plan takes it between one CTA per SM and kManyWavesMinWaves waves
// of slots, and just below one wave): the smallest of kSlotWaveSplitCounts whose wave_efficiency over `slots` (every
// CTA slot) is within kWaveEfficiencyKept of the best, each split keeping >= min_split_keys of the capacity's keys.
int slot_wave_splits(int64_t ctas, int64_t slots, int64_t capacity_keys, int64_t min_split_keys);

// Contiguous 16-bit caches whose unsplit grid is >= kManyWavesMinWaves waves of `slots` CTAs: splits toward
// kManyWavesTarget waves, each of >= kManyWavesMinSplitKeys keys of the capacity; 1 below that.
int many_waves_splits(int64_t ctas, int64_t slots, int64_t capacity_keys);

struct DecodePlan {
  int block_m = 0, block_n = 0;  // of the chosen kernel
  int m_blocks = 0;              // ceil(G * Sq / block_m)
  int num_splits = 1;            // the explicit num_splits, or the heuristic's
  int64_t partial_rows = 0;      // B * Hq * Sq
  int64_t lse_bytes = 0;         // partial LSEs, rounded up to kWorkspaceAlignment (0 when num_splits == 1)
  int64_t out_bytes = 0;         // partial outputs (0 when num_splits == 1)
  int64_t workspace_bytes = 0;   // alignment slack + lse_bytes + out_bytes; 0 when num_splits == 1
};

// Whether a call takes the long_contiguous tile (at the split count of `general`, the plan of the bucket's general row):
// a contiguous 16-bit cache on sm_90+, at least kLongTileMinSplitKeys keys of the capacity per split, and a grid of
// kLongTileMinCtasPerSm to kLongTileMaxCtasPerSm CTAs per SM.
inline bool wants_long_contiguous_tile(const KvcacheParams& p, const DecodePlan& general, const DecodeDevice& device) {
  if (p.block_table != nullptr || p.kv_dtype == FA_FLOAT8_E4M3 || device.sm_major < 9 || device.sm_count <= 0 ||
      general.num_splits < 1)
    return false;
  const int64_t ctas = int64_t(p.batch) * p.heads_k * general.m_blocks * general.num_splits;
  return int64_t(p.seqlen_k) >= kLongTileMinSplitKeys * general.num_splits &&
         double(ctas) >= kLongTileMinCtasPerSm * device.sm_count && ctas <= int64_t(kLongTileMaxCtasPerSm) * device.sm_count;
}

// Whether a call takes kOneWaveFourSplits splits on the long_contiguous tile (the lower part of the one wave, see
// kOneWaveLongTileFill): a contiguous 16-bit cache of >= kOneWaveFourSplitsMinKeys keys on sm_90+, the heuristic's split
// count (no explicit one) at 1 split for the general row, whose unsplit grid fills kOneWaveFill to kOneWaveLongTileFill
// of the SMs.
inline bool wants_one_wave_long_tile(const KvcacheParams& p, const DecodePlan& general, const DecodeDevice& device) {
  if (p.block_table != nullptr || p.kv_dtype == FA_FLOAT8_E4M3 || device.sm_major < 9 || device.sm_count <= 0 ||
      p.num_splits > 0 || general.num_splits != 1)
    return false;
  const double fill = double(int64_t(p.batch) * p.heads_k * general.m_blocks) / double(device.sm_count);
  return p.seqlen_k >= kOneWaveFourSplitsMinKeys && fill >= kOneWaveFill && fill <= kOneWaveLongTileFill;
}

// The layout of a call with a given split count on a kernel of block_m x block_n tiles (make_decode_plan's
// second half; the launcher recomputes it from the resolved params.num_splits).
DecodePlan decode_layout(const KvcacheParams& p, int block_m, int block_n, int num_splits);

// The plan of a call on the kernel `kernel` (a kKvcache row of the generated table): p.num_splits when > 0,
// else the heuristic's. Fails only when the grid would exceed CUDA's limits.
Status make_decode_plan(const KvcacheParams& p, const KernelEntry& kernel, const DecodeDevice& device, DecodePlan* plan);

// The kernels' arguments. `workspace` is the caller's (or an internal) buffer of plan.workspace_bytes
// (null when num_splits == 1); it is aligned up here.
DecodeArgs make_decode_args(const KvcacheParams& p, const DecodePlan& plan, void* workspace);

// ---- the forward's short sequences (a paged varlen fa_forward's decode tokens, or a whole short call, on CUDA) ----
// A serving step's decode tokens beside its prefill chunks. The forward kernel gives every sequence whole query tiles of
// 128 rows per query head: a decode token takes Hq tiles of one row each, every tile streaming the sequence's keys (a
// K/V head read G = Hq / Hk times, one row of 128 on the tensor cores, no split of a long key range). The decode kernels
// pack the G query heads of a K/V head into one 16-row m-block and split long key ranges over the SMs. So the CUDA
// forward hands them the sequences of 1 to short_sequence_max_q(p) query rows (kvcache.cpp, run_short_sequences) and
// its own kernel skips those (AttentionParams::routed_seqlen_q). Which kernel computes a row changes rounding only.
// T = max(1, kShortSequencePackedRows / G), capped by max_seqlen_q: G x T packed rows fill at most one m-block, so a
// sequence streams its keys once per K/V head (G = 4: T = 4; G = 8: 2; G >= 16: 1). A call that is not varlen (dense
// or paged K/V, B x Sq rows: a decode step through fa_forward, as torch SDPA or jax.nn.dot_product_attention users make
// it) is routed whole, in place (uniform_short_sequences), when Sq <= max(1, min(16, kShortCallPackedRows / G)) (G = 1,
// 2: 16 rows; G = 4: 8; G = 8: 4; G = 16: 2): with no copies to pay, the decode kernels stay the faster up to 32 packed
// rows (2 m-blocks, each streaming the keys); from there the forward kernel's GQA packing (one tile of up to 64 or 128
// packed rows streams them once: src/cuda/sm80/forward_packing.hpp) leads over long caches. Over a paged cache the
// bound is kShortPagedCallPackedRows (G = 4: 16 rows): the paged forward row that a call of many sequences runs unsplit
// does not pack (only the split rows and the dense 64-row row do), and there the decode kernels led the unpacked forward.
// B = 1, Sq = 1, Hq 32 / Hk 8, D = 128, bf16 over 32k keys took 102.5 us in the forward kernel (split 8 ways; torch
// SDPA cuDNN 68.4) on an H100 (2026-12-06 10:36 UTC, bench/results/2026-12-06-1034-h100-split-kv-forward-64-row-tile.txt),
// where the decode kernels read that cache at ~0.9 of the card's streaming rate; at G = 4 the decode kernels led at 8
// rows by 1.45-2.5x (B = 16 over 4k: 103.7 against 262 us) and at 16 rows but for two ties (11:01 UTC,
// bench/results/2026-12-06-1101-h100-decode-or-forward-8-to-40-rows.txt); from 32 rows over 32k keys the forward led.
// Those were against the unpacked forward. Packed (H100, 2026-12-06 13:01-13:11 UTC; bench/results/2026-12-06-1301-*,
// -1309-*), 17 rows at G = 4 took 84.6 us at B = 1 over 32k and 210.8 at B = 4, where the decode kernels took 16 rows in
// 106.7 (13:09) and 350.3 (11:01); over 8k 46.1 against 43.5 at B = 1. So the bound is 32 packed rows (8 at G = 4),
// where the decode kernels led the unpacked forward by 1.45-2.5x; rows 9-16 at G = 4 were not timed in the packed
// forward themselves (the A/B is .gpucarry/s53e.sh, for a later session).
// Otherwise 0 (no route) unless the call is
// paged and varlen, without dropout (the decode kernels have none), and its rows leave room for a short sequence:
// total_q <= (B - 1) x max_seqlen_q + T, so that a batch of equal prefill chunks pays no copies and launches for
// nothing (routing none, they made `flashattn step`'s split step, 8 decodes at 1k through fa_kvcache and one 128-token
// chunk through this forward, 64.8 us instead of 53.0 on an H100, 2026-12-06). Affects speed only.
constexpr int kShortSequencePackedRows = 16;  // every DECODE_TILES row of src/cuda/manifest.py has block_m 16
constexpr int kShortCallPackedRows = 32;      // a call that is not varlen: up to 2 m-blocks of packed rows, in place
constexpr int kShortPagedCallPackedRows = 64;  // ... over a paged cache: up to 4
int short_sequence_max_q(const AttentionParams& p);
// The most query rows of a call that is not varlen that the decode kernels take whole: max(1, min(16, 32 / G)), over a
// paged cache max(1, min(16, 64 / G)).
int short_call_max_q(int heads_q, int heads_k, bool paged);

// The decode call over padded copies of the short sequences (the tests' other way to varlen_rows_call below, which the
// forward runs): their queries left-padded to T rows, q / out (B, T, Hq, D / Dv) and lse
// (B, Hq, T) dense at the given addresses (lse null when the forward has none), cache_seqlens the key counts (0 for the
// sequences the forward kernel keeps), and the forward's pool, block table, heads, scale, mask, softcap, ALiBi and
// stream. Left padding puts query i of a sequence of n rows at row T - n + i, whose bottom-right alignment (Sk - T + row)
// is the forward's (Sk - n + i); the padding rows' results are never copied out. The capacity is the forward's
// max_seqlen_k (p.seqlen_k), which bounds every length.
KvcacheParams short_sequence_call(const AttentionParams& p, int max_q, void* q, void* out, float* lse,
                                  const int32_t* cache_seqlens);
// The same call over the forward's own q / out / lse (varlen rows, decode_work.hpp's varlen_query_rows): cu_seqlens_q
// the forward's, seqlen_q = T, the batch strides 0, the row and head strides the forward's; its kernels read each
// routed sequence's queries where they are and write its rows of out and lse there, and touch no other row. What the
// paged varlen forward runs (kvcache.cpp, run_short_sequences): no gather before it, no scatter after it.
KvcacheParams varlen_rows_call(const AttentionParams& p, int max_q, const int32_t* cache_seqlens);
// The most sequences of such a varlen call that can have at most T = max_q rows (the decode call's working rows): the
// others have more than T and at most max_seqlen_q = M, so total_q <= x M + (B - x) T for x of them, and
// x >= (total_q - B T) / (M - T). The decode call's grid keeps a row of CTAs per sequence, but its split count is
// planned for this many (at least 1): the longer sequences' CTAs find no key and leave at once, so a step of 16
// decodes beside one prompt chunk splits as 16 decodes do (B = 17 planned as 17 took 3 splits, 2 slot waves of 132
// SMs, where 16 take 1: one CTA per SM). An upper bound: at G = 4 (T = 4), 16 decodes + a chunk of 128 give 16, 64 +
// 2 chunks of 512 give 64, 4 + 2 chunks of 64 give 4, 256 + 4 chunks of 256 give 259. Affects speed only.
int routed_sequences_bound(const AttentionParams& p, int max_q);

// Every sequence has the same count of rows S = max_seqlen_q <= max_q (total_q = B x S, none more than S; or a call that
// is not varlen): a decode step of one token per sequence (vLLM's varlen call with a block table, or fa_forward over a
// dense cache), or S speculative tokens each. Then the
// forward's own q / out / lse are the decode call's dense (B, S, ...) tensors (sequence b's rows at b x S): no gather,
// no scatter, and with seqused_k not even the key counts to copy (uniform_sequence_call).
bool uniform_short_sequences(const AttentionParams& p, int max_q);
// The decode call over such a step, in place: q, out and lse the forward's (batch strides S rows), cache_seqlens the key
// counts (seqused_k, or a copy of cu_seqlens_k's differences), as short_sequence_call otherwise.
KvcacheParams uniform_sequence_call(const AttentionParams& p, const int32_t* cache_seqlens);

// ---- fa_kvcache through the forward kernel ----
// The decode kernels tile G x Sq packed rows in 16-row m-blocks, each streaming the sequence's keys: with many query rows
// a K/V tile is read once per 16 rows, and the forward kernel (128-row tiles, split-KV where the grid leaves SMs idle,
// src/cuda/sm80/forward_split.hpp) is the faster. Measured (H100, 2026-12-06 09:00 UTC, bf16, D = 128, causal, B = 1 and
// 4, Hq 32 with Hk 32 / 8 / 4, 4k and 32k keys; bench/results/2026-12-06-0830-h100-split-kv-forward.txt, call 6): from
// Sq = 64 the forward is the faster at every point (1.1-2.3x; Sq = 128 over 32k at Hk 8: 0.218 ms against 0.493); at
// Sq = 32 it depends on the cache (4k: the decode kernels up to 1.1x; 32k: the forward 1.2x); at Sq <= 16 the decode
// kernels lead (up to 2.4x). With D = 128's 64-row split tile (session 52, H100, 10:37 UTC, B = 1, causal, Hq 32,
// fa_forward / fa_kvcache in us; bench/results/2026-12-06-1034-h100-split-kv-forward-64-row-tile.txt): Sq = 48 over 4k
// 38 / 59.2 (Hk 8), 53 / 59.5 (Hk 32), over 32k 131 / 202.5, 203 / 224.0: the forward at every point; Sq = 32 over 4k
// 39 / 38.8 and 53 / 40.7 (the decode kernels), over 32k 136 / 193.0 and 199 / 206.4; Sq = 16 a tie or the decode
// kernels. So an fa_kvcache call of at least kForwardRouteMinRows query rows over a 16-bit cache without
// rotary or left padding runs: the append (as the decode path's), the key counts (cache_seqlens + S_new; a bad entry
// reads nothing), the forward kernel over the cache with those counts as seqused_k, and NaN for the sequences whose
// cache_seqlens entry was bad (kvcache.cpp, run_forward_route). Its num_splits is the forward's split count (at most 32).
// With GQA packing (src/cuda/sm80/forward_packing.hpp: the forward reads a K/V tile once per packed tile) a call that
// packs takes the route earlier when its K/V at capacity (B x capacity x Hk x (D + Dv) x the element size; the lengths
// are in device memory) is large: from kLongCacheRouteMinRows rows at kLongCacheRouteMinBytes, from kL2CacheRouteMinRows
// at kL2CacheRouteMinBytes. Why bytes: the decode kernels tile G x Sq packed rows in 16-row m-blocks that each stream
// the keys, cheap while the call's K/V stays in L2 (50 MiB on an H100 or H200), a DRAM read per m-block beyond it.
// H100, bf16, D = 128, Hq 32 / Hk 8, causal, decode kernels against the route, us (2026-12-06 16:30 and 17:24 UTC,
// bench/results/2026-12-06-1629-h100-kvcache-route-long-cache-and-t64.txt, 2026-12-06-1723-h100-route-by-bytes-and-
// packed-128.txt): 32 MiB (B = 1 over 8k) 17 rows 40.0 against the packed forward's 47.3 at 16; 64 MiB: B = 1 over 16k
// 17 rows 59.0 against 70.6, 32 rows 100.4 against 73.2, B = 4 over 4k 24 rows 71.0 against 67.6, B = 16 over 1k 32
// rows 76.7 against 74.7; 128 MiB: B = 1 over 32k 17 / 24 / 32 / 47 rows 102.4 / 113.8 / 185.5 / 202.6 against 98.4 /
// 95.9 / 98.5 / 134.4, B = 4 over 8k 32 rows 144.2 against 90.6; 256 MiB and more: B = 16 over 4k 24 rows 185.6
// against 133.7, over 8k 47 rows 749.1 against 439.6 (407.2 with the 128-row packed-only tile), over 32k 17 / 24 / 32
// rows 1260.6 / 1373.9 / 1839.2 against 759.1 / 758.3 / 783.3.
// Affects speed (and rounding) only.
constexpr int kForwardRouteMinRows = 48;
constexpr int kLongCacheRouteMinRows = 17;                        // calls that pack, with K/V of at least:
constexpr int64_t kLongCacheRouteMinBytes = int64_t(128) << 20;
constexpr int kL2CacheRouteMinRows = 24;                          // and from this many rows with K/V of at least:
constexpr int64_t kL2CacheRouteMinBytes = int64_t(64) << 20;
// The call's K/V at capacity, as the route rule counts it.
int64_t route_cache_bytes(const KvcacheParams& p);
// The fewest query rows that take the forward route (a 16-bit cache without rotary, left padding or dropout): those
// of a call that packs (sm80::gqa_packing_allowed) take it from kLongCacheRouteMinRows or kL2CacheRouteMinRows by
// route_cache_bytes, else from kForwardRouteMinRows.
int forward_route_min_rows(const KvcacheParams& p);
inline bool wants_forward_route(const KvcacheParams& p) {
  return p.seqlen_q >= forward_route_min_rows(p) && p.kv_dtype == p.dtype && p.rotary_dim == 0 &&
         p.cache_leftpad == nullptr && p.dropout_p == 0.f;
}

// Tests only (not part of the API): every later make_decode_args sets DecodeArgs::speculative_tiles to `mode` (0 off,
// 1 on, 2 / 3 wrong guesses: decode_work.hpp) instead of kSpeculativeTiles; -1 restores the library's. A process-wide
// switch, so that the oracle tests can run the kernels' wrong-guess paths through the public API.
void set_speculation_for_tests(int mode);

}  // namespace flashattn::cuda::decode
