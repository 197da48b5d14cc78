// Host side of the CUDA KV-cache (decode) path, without a GPU: the work partition shared by the kernels
// (decode_work.hpp), the split heuristic and workspace layout (decode_plan.hpp), the CUDA-specific rules and
// their messages, and the decode rows of the generated kernel table.
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "core/mask.hpp"
#include "cuda/decode/decode_plan.hpp"
#include "cuda/decode/decode_work.hpp"
#include "cuda/decode/fp8_layout.hpp"
#include "cuda/dispatch.hpp"
#include "cuda/generated/kernel_table.hpp"
#include "testing.hpp"

namespace {

using flashattn::KvcacheParams;
using flashattn::Status;
using flashattn::WindowMask;
using flashattn::cuda::DeviceLimits;
using flashattn::cuda::KernelEntry;
using flashattn::cuda::KernelKind;
using flashattn::cuda::decode_alternative;
using flashattn::cuda::DecodeRole;
namespace decode = flashattn::cuda::decode;

// H200: 132 SMs, 228 KiB of shared memory per SM (227 KiB per block); A100: 108 SMs, 164 / 163 KiB.
decode::DecodeDevice h200() { return decode::DecodeDevice{0, 9, 0, 132, 227 * 1024, 228 * 1024}; }
decode::DecodeDevice a100() { return decode::DecodeDevice{0, 8, 0, 108, 163 * 1024, 164 * 1024}; }
DeviceLimits limits_of(const decode::DecodeDevice& d) { return DeviceLimits{d.device, d.sm_major, d.sm_minor, d.smem_per_block_optin}; }

// A valid decode call's params (what validate.cpp would produce), with fake 16-byte aligned device pointers.
KvcacheParams decode_params(int batch, int seqlen_q, int heads_q, int heads_k, int head_dim, int capacity) {
  alignas(256) static char fake[256];
  KvcacheParams p{};
  p.dtype = FA_BFLOAT16;
  p.device = FA_DEVICE_CUDA;
  p.batch = batch;
  p.seqlen_q = seqlen_q;
  p.seqlen_k = capacity;
  p.heads_q = heads_q;
  p.heads_k = heads_k;
  p.head_dim = p.head_dim_v = head_dim;
  p.q = p.k = p.v = p.out = fake;
  p.q_head_stride = p.out_head_stride = head_dim;
  p.q_row_stride = p.out_row_stride = int64_t(heads_q) * head_dim;
  p.q_batch_stride = p.out_batch_stride = int64_t(seqlen_q) * heads_q * head_dim;
  p.k_head_stride = p.v_head_stride = head_dim;
  p.k_row_stride = p.v_row_stride = int64_t(heads_k) * head_dim;
  p.k_batch_stride = p.v_batch_stride = int64_t(capacity) * heads_k * head_dim;
  p.cache_seqlens = reinterpret_cast<const int32_t*>(fake);
  p.softmax_scale = 0.125f;
  p.window_left = p.window_right = -1;
  return p;
}

const KernelEntry& decode_kernel_for(const KvcacheParams& p, const decode::DecodeDevice& device) {
  namespace gen = flashattn::cuda::generated;
  int index = -1;
  const Status s = choose_kernel(KernelKind::kKvcache, p, limits_of(device), gen::kKernelTable, gen::kKernelCount,
                                 "80-real 90a-real", &index);
  EXPECT_TRUE(s.ok()) << s.message();
  return gen::kKernelTable[index < 0 ? 0 : index];
}

// Every used split is a non-empty run of whole tiles; together they cover the visible tiles exactly once, in
// order; a split past `used` is empty; runs are per_split long except the last.
TEST(CudaKvcachePlan, SplitWorkPartitionsTheKeyTiles) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 20000; ++trial) {
    const int block_n = trial % 2 ? 64 : 128;
    const int key_begin = int(rng() % 3000), key_end = key_begin + int(rng() % 9000) - 100;
    const int num_splits = 1 + int(rng() % 200), min_tiles = 1 + int(rng() % 4);
    const decode::SplitWork first = decode::split_work(key_begin, key_end, block_n, num_splits, min_tiles, 0);
    if (key_end <= key_begin) {
      EXPECT_EQ(first.used, 0);
      continue;
    }
    const int tile0 = key_begin / block_n, tiles = (key_end - 1) / block_n - tile0 + 1;
    ASSERT_GE(first.used, 1);
    ASSERT_LE(first.used, num_splits);
    ASSERT_LE(first.used, tiles);
    int next = tile0;
    for (int s = 0; s < first.used + 2; ++s) {
      const decode::SplitWork w = decode::split_work(key_begin, key_end, block_n, num_splits, min_tiles, s);
      ASSERT_EQ(w.used, first.used);
      if (s >= w.used) {
        EXPECT_EQ(w.tile_end - w.tile_begin, 0) << "split " << s << " past used " << w.used;
        continue;
      }
      ASSERT_EQ(w.tile_begin, next) << "gap or overlap at split " << s;
      ASSERT_GT(w.tile_end, w.tile_begin) << "empty used split " << s;
      if (s + 1 < w.used) {
        EXPECT_GE(w.tile_end - w.tile_begin, min_tiles);
      }
      next = w.tile_end;
    }
    EXPECT_EQ(next, tile0 + tiles) << "the splits do not reach the last visible tile";
  }
}

// Short sequences use fewer, longer splits (min_tiles_per_split), long ones all that were planned.
TEST(CudaKvcachePlan, ShortSequencesUseFewerSplits) {
  EXPECT_EQ(decode::split_work(0, 64 * 1000, 64, 32, 2, 0).used, 32);
  EXPECT_EQ(decode::split_work(0, 64 * 10, 64, 32, 2, 0).used, 5);
  EXPECT_EQ(decode::split_work(0, 64 * 10, 64, 32, 1, 0).used, 10);
  EXPECT_EQ(decode::split_work(0, 1, 64, 32, 2, 0).used, 1);
  EXPECT_EQ(decode::split_work(5, 5, 64, 32, 2, 0).used, 0);
}

// The packed rows r = i * G + g of the m-blocks cover [0, G * Sq) once, and each m-block's key range is the
// union of its rows' visible ranges (brute force over WindowMask).
TEST(CudaKvcachePlan, BlockRowsCoverPackedRowsAndTheirKeys) {
  struct Shape {
    int group, seqlen_q, seqlen_k, left, right;
  };
  const Shape shapes[] = {{4, 1, 1000, -1, -1}, {4, 70, 300, -1, 0},  {1, 33, 33, -1, 0},   {8, 5, 4097, 100, 0},
                          {3, 17, 17, 2, 3},    {16, 2, 0, -1, -1},   {2, 9, 4, -1, 0},     {5, 40, 1000, 20, -1}};
  for (const Shape& s : shapes) {
    decode::DecodeArgs a{};
    a.p.seqlen_q = s.seqlen_q;
    a.p.window_left = s.left;
    a.p.window_right = s.right;
    a.group = s.group;
    a.packed_rows = s.group * s.seqlen_q;
    a.block_m = 16;
    a.m_blocks = (a.packed_rows + 15) / 16;
    const WindowMask mask(s.left, s.right, s.seqlen_q, s.seqlen_k);
    int covered = 0;
    for (int m = 0; m < a.m_blocks; ++m) {
      const decode::BlockRows r = decode::block_rows(a, m, s.seqlen_k);
      EXPECT_EQ(r.row_begin, covered);
      covered += r.rows;
      int lo = INT_MAX, hi = INT_MIN;
      for (int row = r.row_begin; row < r.row_begin + r.rows; ++row) {
        const int i = row / s.group;
        EXPECT_GE(i, r.query_begin);
        EXPECT_LT(i, r.query_end);
        for (int j = 0; j < s.seqlen_k; ++j)
          if (mask.visible(i, j)) lo = std::min(lo, j), hi = std::max(hi, j + 1);
      }
      if (lo == INT_MAX) {
        EXPECT_LE(r.key_end, r.key_begin) << "m-block " << m << " sees no key";
      } else {
        EXPECT_EQ(r.key_begin, lo) << "m-block " << m;
        EXPECT_EQ(r.key_end, hi) << "m-block " << m;
      }
    }
    EXPECT_EQ(covered, a.packed_rows);
  }
}

TEST(CudaKvcachePlan, CacheLengthRule) {
  EXPECT_TRUE(decode::cache_length_ok(0, 0, 0));
  EXPECT_TRUE(decode::cache_length_ok(399, 1, 400));
  EXPECT_FALSE(decode::cache_length_ok(400, 1, 400));
  EXPECT_FALSE(decode::cache_length_ok(-1, 0, 400));
  EXPECT_FALSE(decode::cache_length_ok(INT_MAX, 5, INT_MAX));  // no int overflow
}

TEST(CudaKvcachePlan, OccupancyEstimate) {
  EXPECT_EQ(decode::ctas_per_sm(100 * 1024, 128, h200()), 2);
  EXPECT_EQ(decode::ctas_per_sm(136 * 1024, 128, h200()), 1);
  EXPECT_EQ(decode::ctas_per_sm(100 * 1024, 128, a100()), 1);
  EXPECT_EQ(decode::ctas_per_sm(1024, 128, h200()), decode::kMaxCtasPerSm);
  EXPECT_EQ(decode::ctas_per_sm(1024, 1024, h200()), 2);  // 2048 threads per SM
  // The runtime's 1 KiB per CTA counts: 2 x 113.5 KiB fit in 228 KiB, 2 x (113.5 + 1) do not.
  EXPECT_EQ(decode::ctas_per_sm(113 * 1024 + 512, 128, h200()), 1);
  EXPECT_EQ(decode::ctas_per_sm(112 * 1024 + 512, 128, h200()), 2);
}

TEST(CudaKvcachePlan, SplitHeuristic) {
  const int64_t slots = 132 * 2;
  // Enough CTAs without splitting: 1.
  EXPECT_EQ(decode::choose_num_splits(256 * 8, slots, 2048), 1);
  EXPECT_EQ(decode::choose_num_splits(int64_t(0.8 * slots) + 1, slots, 2048), 1);
  // Batch 1, 8 K/V heads, long cache: enough splits for nearly full waves.
  const int s = decode::choose_num_splits(8, slots, 2048);
  EXPECT_GT(s, 16);
  EXPECT_LE(s, decode::kMaxSplits);
  const double waves = 8.0 * s / slots;
  EXPECT_GE(waves / std::ceil(waves), decode::kWaveEfficiencyKept * 0.99) << s << " splits";
  // A short cache caps the splits: each keeps kMinTilesPerSplit tiles.
  EXPECT_EQ(decode::choose_num_splits(8, slots, 10), 10 / decode::kMinTilesPerSplit);
  EXPECT_EQ(decode::choose_num_splits(8, slots, 1), 1);
  EXPECT_EQ(decode::choose_num_splits(8, slots, 0), 1);
  // The issue's shape on an H200 (8 K/V heads, one m-block each, 264 slots of the D = 128 tile): one nearly
  // full wave, the split counts measured fastest (decode_plan.hpp); a 1 k cache (16 tiles) takes two tiles each.
  EXPECT_EQ(decode::choose_num_splits(1 * 8, slots, 2048), 32);
  EXPECT_EQ(decode::choose_num_splits(4 * 8, slots, 2048), 8);
  EXPECT_EQ(decode::choose_num_splits(16 * 8, slots, 128), 2);
  EXPECT_EQ(decode::choose_num_splits(64 * 8, slots, 128), 1);
  EXPECT_EQ(decode::choose_num_splits(1 * 8, slots, 16), 8);
  EXPECT_EQ(decode::choose_num_splits(4 * 8, slots, 16), 8);
  // No split without tiles: one K/V head (8 query heads, B = 1) of a 4k cache (64 tiles) on 132 SMs takes 32 splits
  // of 2 tiles, not 31, which would leave 9 empty (ceil(64 / 31) = 3 tiles each: 22 used). Whatever the shape, the
  // last split of the count chosen has tiles.
  EXPECT_EQ(decode::choose_num_splits(1, 132, 64), 32);
  EXPECT_EQ(decode::choose_num_splits(4, 132, 64), 32);
  // One CTA unsplit takes at most kMaxSplitsOneCta: a 16k cache (256 tiles) 86 splits of 3 tiles (108 asked would
  // leave 22 empty), 32k 103 of 5, 64k 103 of 10; two CTAs keep kMaxSplits (256 tiles: 128 splits of 2).
  EXPECT_EQ(decode::choose_num_splits(1, 132, 256), 86);
  EXPECT_EQ(decode::choose_num_splits(1, 264, 512), 103);
  EXPECT_EQ(decode::choose_num_splits(1, 264, 1024), 103);
  EXPECT_EQ(decode::choose_num_splits(2, 264, 256), 128);
  for (const int64_t tiles : {256, 1000, 4096, 1 << 20}) EXPECT_LE(decode::choose_num_splits(1, 264, tiles), decode::kMaxSplitsOneCta);
  EXPECT_EQ(decode::choose_num_splits(4, 132, 1024), 32);  // every split has tiles already
  for (const int64_t ctas : {1, 3, 4, 7, 40, 100})
    for (const int64_t tiles : {1, 10, 31, 64, 100, 256, 1000, 1024}) {
      const int s = decode::choose_num_splits(ctas, 132, tiles);
      const decode::SplitWork last = decode::split_work(0, int(tiles) * 64, 64, s, decode::kMinTilesPerSplit, s - 1);
      EXPECT_EQ(last.used, s) << ctas << " CTAs, " << tiles << " tiles: " << s << " splits";
    }
  // Monotone in the batch from two CTAs (one CTA has its own cap, above): more sequences never need more splits.
  int previous = decode::kMaxSplits;
  for (int64_t ctas = 2; ctas <= 512; ctas *= 2) {
    const int splits = decode::choose_num_splits(ctas, slots, 4096);
    EXPECT_LE(splits, previous) << ctas << " CTAs";
    previous = splits;
  }
}

TEST(CudaKvcachePlan, ManyWavesSplits) {
  const int64_t slots = 132 * 2;
  // Below 3.5 waves of every slot: no split (the other rules decide).
  EXPECT_EQ(decode::many_waves_splits(64 * 8, slots, 131072), 1);
  EXPECT_EQ(decode::many_waves_splits(int64_t(decode::kManyWavesMinWaves * slots) - 1, slots, 131072), 1);
  // Toward 16 waves, each split >= 4k keys of the capacity.
  EXPECT_EQ(decode::many_waves_splits(256 * 8, slots, 131072), 2);
  EXPECT_EQ(decode::many_waves_splits(128 * 8, slots, 131072), 4);
  EXPECT_EQ(decode::many_waves_splits(128 * 8, slots, 8192), 2);
  EXPECT_EQ(decode::many_waves_splits(128 * 8, slots, 8191), 1);
  EXPECT_EQ(decode::many_waves_splits(512 * 8, slots, 131072), 1);  // 15.5 waves already
  EXPECT_EQ(decode::many_waves_splits(0, slots, 131072), 1);
  EXPECT_EQ(decode::many_waves_splits(2048, 0, 131072), 1);
  // The most splits whose waves stay within the target (1 where the unsplit grid already exceeds it).
  for (int64_t ctas = 924; ctas <= 8192; ctas += 97) {
    const int s = decode::many_waves_splits(ctas, slots, 1 << 20);
    ASSERT_GE(s, 1);
    if (s > 1) {
      EXPECT_LE(double(s) * ctas / slots, double(decode::kManyWavesTarget)) << ctas;
    }
    EXPECT_GT(double(s + 1) * ctas / slots, double(decode::kManyWavesTarget)) << ctas;
  }
}

TEST(CudaKvcachePlan, SlotWaveSplits) {
  const int64_t sms = 132, slots = 2 * sms, keys = decode::kBalancedMinSplitKeys;
  EXPECT_EQ(decode::slot_wave_splits(200, 0, 1 << 20, keys), 1);
  EXPECT_EQ(decode::slot_wave_splits(0, slots, 1 << 20, keys), 1);
  // The H200 points of decode_plan.hpp (8 K/V heads: B x 8 CTAs).
  EXPECT_EQ(decode::slot_wave_splits(160, slots, 8192, keys), 3);    // B = 20: 3.6 of 4 waves (4 splits: 2.4 of 3)
  EXPECT_EQ(decode::slot_wave_splits(160, slots, 32768, keys), 8);   // 4.85 of 5 waves
  EXPECT_EQ(decode::slot_wave_splits(160, slots, 4095, keys), 1);    // no split keeps 2048 keys
  EXPECT_EQ(decode::slot_wave_splits(192, slots, 8192, keys), 4);    // B = 24
  EXPECT_EQ(decode::slot_wave_splits(288, slots, 32768, keys), 6);   // B = 36
  EXPECT_EQ(decode::slot_wave_splits(384, slots, 32768, keys), 2);   // B = 48
  EXPECT_EQ(decode::slot_wave_splits(512, slots, 32768, keys), 1);   // B = 64: 1.94 of 2 waves already
  EXPECT_EQ(decode::slot_wave_splits(72, slots, 4096, decode::kBelowWaveMinSplitKeys), 3);  // B = 9, below one wave
  EXPECT_EQ(decode::slot_wave_splits(88, slots, 4096, decode::kBelowWaveMinSplitKeys), 3);  // B = 11: 264 CTAs
  // Every choice is a listed count that keeps the keys per split and is the smallest whose waves are within 96% of
  // the fullest.
  for (int64_t ctas = 1; ctas < int64_t(decode::kManyWavesMinWaves * slots); ctas += 7)
    for (const int64_t capacity : {1000, 2048, 6000, 8192, 131072})
      for (const int64_t min_keys : {decode::kBelowWaveMinSplitKeys, decode::kBalancedMinSplitKeys}) {
        const int s = decode::slot_wave_splits(ctas, slots, capacity, min_keys);
        auto allowed = [&](int n) { return n == 1 || capacity >= min_keys * n; };
        double best = 0;
        bool listed = false;
        for (const int n : decode::kSlotWaveSplitCounts) {
          if (allowed(n)) best = std::max(best, decode::wave_efficiency(ctas, n, slots));
          listed |= n == s;
        }
        const std::string at = std::to_string(ctas) + " CTAs, " + std::to_string(capacity) + " keys";
        EXPECT_TRUE(listed) << at;
        EXPECT_TRUE(allowed(s)) << at;
        EXPECT_GE(decode::wave_efficiency(ctas, s, slots), decode::kWaveEfficiencyKept * best) << at;
        for (const int n : decode::kSlotWaveSplitCounts) {
          if (n < s && allowed(n)) {
            EXPECT_LT(decode::wave_efficiency(ctas, n, slots), decode::kWaveEfficiencyKept * best) << at << ", " << n;
          }
        }
      }
  EXPECT_DOUBLE_EQ(decode::wave_efficiency(132, 2, 264), 1.0);
  EXPECT_DOUBLE_EQ(decode::wave_efficiency(66, 3, 264), 0.75);
}

TEST(CudaKvcachePlan, ClusterMergeRule) {
  // Two splits at any length, or short splits (at most 8 tiles of the capacity in clusters of 3-4, 2 in clusters of
  // 5-8) merge in clusters (sm_90); longer splits, clusters above 8, one split and more than kMaxClusterSplits
  // splits do not.
  EXPECT_FALSE(decode::wants_cluster_merge(16, 1024, 64));   // 1 tile per split, but a cluster of 16
  EXPECT_FALSE(decode::wants_cluster_merge(16, 2048, 64));   // 2 tiles
  EXPECT_TRUE(decode::wants_cluster_merge(8, 1024, 64));     // 2 tiles in a cluster of 8
  EXPECT_TRUE(decode::wants_cluster_merge(5, 640, 64));      // 2 tiles in a cluster of 5
  EXPECT_FALSE(decode::wants_cluster_merge(8, 2048, 64));    // 4 tiles
  EXPECT_FALSE(decode::wants_cluster_merge(8, 4096, 64));    // 8 tiles
  EXPECT_TRUE(decode::wants_cluster_merge(4, 2048, 64));     // 8 tiles in a cluster of 4
  EXPECT_TRUE(decode::wants_cluster_merge(3, 1536, 64));     // 8 tiles in a cluster of 3
  EXPECT_FALSE(decode::wants_cluster_merge(4, 4096, 64));    // 16 tiles
  EXPECT_FALSE(decode::wants_cluster_merge(5, 8192, 64));    // 26 tiles in a cluster of 5
  EXPECT_FALSE(decode::wants_cluster_merge(16, 131072, 64));
  EXPECT_TRUE(decode::wants_cluster_merge(2, 131072, 64));   // two splits at any length
  EXPECT_FALSE(decode::wants_cluster_merge(1, 1024, 64));
  EXPECT_FALSE(decode::wants_cluster_merge(decode::kMaxClusterSplits + 1, 1024, 64));
  EXPECT_FALSE(decode::wants_cluster_merge(4, 1024, 0));
}

// Short contiguous caches at many waves take the many_waves tile: at least 7 CTAs per SM unsplit (B = 116 of the
// issue's 8 K/V heads on 132 SMs), at most 2k keys, contiguous, 16-bit, no split asked for.
TEST(CudaKvcachePlan, ManyWavesTileRule) {
  const int block_m = 16;  // the 4 query heads of a group fit one m-block
  EXPECT_TRUE(decode::wants_many_waves_tile(decode_params(256, 1, 32, 8, 128, 1024), block_m, h200()));
  EXPECT_TRUE(decode::wants_many_waves_tile(decode_params(116, 1, 32, 8, 128, 2048), block_m, h200()));  // 928 CTAs
  EXPECT_FALSE(decode::wants_many_waves_tile(decode_params(115, 1, 32, 8, 128, 2048), block_m, h200()));  // 920 < 924
  EXPECT_FALSE(decode::wants_many_waves_tile(decode_params(256, 1, 32, 8, 128, 2049), block_m, h200()));  // a longer cache
  EXPECT_TRUE(decode::wants_many_waves_tile(decode_params(100, 1, 32, 8, 128, 1024), block_m, a100()));   // 108 SMs
  KvcacheParams paged = decode_params(256, 1, 32, 8, 128, 1024);
  static int32_t table[1];
  paged.block_table = table;
  EXPECT_FALSE(decode::wants_many_waves_tile(paged, block_m, h200()));
  KvcacheParams fp8 = decode_params(256, 1, 32, 8, 128, 1024);
  fp8.kv_dtype = FA_FLOAT8_E4M3;
  EXPECT_FALSE(decode::wants_many_waves_tile(fp8, block_m, h200()));
  KvcacheParams split = decode_params(256, 1, 32, 8, 128, 1024);
  split.num_splits = 2;
  EXPECT_FALSE(decode::wants_many_waves_tile(split, block_m, h200()));
  split.num_splits = 1;  // asked for, but one: the rule holds
  EXPECT_TRUE(decode::wants_many_waves_tile(split, block_m, h200()));
  // 64 query heads per K/V head and 4 new tokens: 256 packed rows, 16 m-blocks per (sequence, K/V head).
  EXPECT_FALSE(decode::wants_many_waves_tile(decode_params(8, 4, 64, 1, 128, 1024), block_m, h200()));  // 128 CTAs
  EXPECT_TRUE(decode::wants_many_waves_tile(decode_params(58, 4, 64, 1, 128, 1024), block_m, h200()));  // 928 CTAs
}

// Long contiguous caches take the long_contiguous tile at the general row's split count: contiguous, 16-bit, sm_90+,
// >= 2048 keys of the capacity per split, 1.5 to 4 CTAs per SM (B = 25 to 66 of the issue's 8 K/V heads on 132 SMs).
TEST(CudaKvcachePlan, LongContiguousTileRule) {
  auto wants = [](const KvcacheParams& p, int splits, const decode::DecodeDevice& device) {
    const decode::DecodePlan general = decode::decode_layout(p, 16, 64, splits);
    return decode::wants_long_contiguous_tile(p, general, device);
  };
  EXPECT_TRUE(wants(decode_params(64, 1, 32, 8, 128, 131072), 1, h200()));   // 512 CTAs
  EXPECT_TRUE(wants(decode_params(66, 1, 32, 8, 128, 2048), 1, h200()));     // 528 CTAs, 2048 keys
  EXPECT_FALSE(wants(decode_params(67, 1, 32, 8, 128, 131072), 1, h200()));  // 536 > 528
  EXPECT_FALSE(wants(decode_params(64, 1, 32, 8, 128, 2047), 1, h200()));    // too short
  EXPECT_TRUE(wants(decode_params(25, 1, 32, 8, 128, 32768), 1, h200()));    // 200 CTAs
  EXPECT_FALSE(wants(decode_params(24, 1, 32, 8, 128, 32768), 1, h200()));   // 192 < 198
  EXPECT_FALSE(wants(decode_params(1, 1, 32, 8, 128, 131072), 16, h200()));  // 128 CTAs
  EXPECT_TRUE(wants(decode_params(32, 1, 32, 8, 128, 4096), 2, h200()));     // 512 CTAs, 2 splits of 2048 keys
  EXPECT_FALSE(wants(decode_params(32, 1, 32, 8, 128, 4094), 2, h200()));    // of 2047
  EXPECT_FALSE(wants(decode_params(128, 1, 32, 8, 128, 32768), 4, h200()));  // 4096 CTAs
  EXPECT_FALSE(wants(decode_params(64, 1, 32, 8, 128, 131072), 1, a100())) << "measured on sm_90 only";
  KvcacheParams paged = decode_params(64, 1, 32, 8, 128, 131072);
  static int32_t table[1];
  paged.block_table = table;
  EXPECT_FALSE(wants(paged, 1, h200()));
  KvcacheParams fp8 = decode_params(64, 1, 32, 8, 128, 131072);
  fp8.kv_dtype = FA_FLOAT8_E4M3;
  EXPECT_FALSE(wants(fp8, 1, h200()));
  // 64 query heads per K/V head and 4 new tokens: 16 m-blocks per (sequence, K/V head) count as CTAs.
  EXPECT_TRUE(wants(decode_params(33, 4, 64, 1, 128, 8192), 1, h200()));   // 528 CTAs
  EXPECT_FALSE(wants(decode_params(12, 4, 64, 1, 128, 8192), 1, h200()));  // 192
  EXPECT_FALSE(wants(decode_params(34, 4, 64, 1, 128, 8192), 1, h200()));  // 544
}

// The lower part of the one wave, contiguous (decode_plan.hpp, kOneWaveLongTileFill): 4 splits on the long tile where the
// unsplit grid fills 0.7-0.75 of the SMs (B = 12 of 8 K/V heads: 96 CTAs on 132), the capacity has >= 8k keys and the
// general row's plan is 1 split by the heuristic; sm_90+, 16-bit, contiguous.
TEST(CudaKvcachePlan, OneWaveLongTileRule) {
  auto wants = [](KvcacheParams p, const decode::DecodeDevice& device) {
    decode::DecodePlan general;
    EXPECT_TRUE(decode::make_decode_plan(p, decode_kernel_for(p, device), device, &general).ok());
    return decode::wants_one_wave_long_tile(p, general, device);
  };
  EXPECT_TRUE(wants(decode_params(12, 1, 32, 8, 128, 8192), h200()));    // 96 CTAs: 0.727 of the SMs
  EXPECT_TRUE(wants(decode_params(12, 1, 32, 8, 128, 32768), h200()));
  EXPECT_TRUE(wants(decode_params(96, 1, 8, 1, 128, 16384), h200()));    // 8 / 1: 96 CTAs
  EXPECT_TRUE(wants(decode_params(99, 1, 8, 1, 128, 8192), h200()));     // 0.75
  EXPECT_FALSE(wants(decode_params(100, 1, 8, 1, 128, 8192), h200()));   // 0.758
  EXPECT_FALSE(wants(decode_params(92, 1, 8, 1, 128, 8192), h200()));    // 0.697: below one wave
  EXPECT_FALSE(wants(decode_params(13, 1, 32, 8, 128, 8192), h200()));   // 104 CTAs
  EXPECT_FALSE(wants(decode_params(12, 1, 32, 8, 128, 8191), h200()));   // under 8k keys
  EXPECT_FALSE(wants(decode_params(12, 1, 32, 8, 128, 8192), a100()));   // measured on sm_90 only
  KvcacheParams asked = decode_params(12, 1, 32, 8, 128, 8192);
  asked.num_splits = 1;  // an explicit split count is used as given
  EXPECT_FALSE(wants(asked, h200()));
  KvcacheParams paged = decode_params(12, 1, 32, 8, 128, 8192);
  static int32_t table[1];
  paged.block_table = table;
  paged.page_block_size = 16;
  paged.num_blocks = 12 * 512;
  paged.block_table_batch_stride = 512;
  EXPECT_FALSE(wants(paged, h200())) << "paged caches take 4 splits on the general tile (make_decode_plan)";
  KvcacheParams fp8 = decode_params(12, 1, 32, 8, 128, 8192);
  fp8.kv_dtype = FA_FLOAT8_E4M3;
  EXPECT_FALSE(wants(fp8, h200()));
}

// The lower part of the one wave in a general tile of one CTA per SM (D = 256, 16-bit: decode_plan.hpp's
// kOneWaveOneSlotMinKeys): 4 splits from 16k keys up to 0.75 of the SMs, either layout; D = 128 and 192 (two CTAs
// per SM), FP8, sm_80, 104 CTAs and 8k keys keep their plans.
TEST(CudaKvcachePlan, OneWaveOneSlotTileRule) {
  auto splits = [](KvcacheParams p, const decode::DecodeDevice& device) {
    decode::DecodePlan plan;
    EXPECT_TRUE(decode::make_decode_plan(p, decode_kernel_for(p, device), device, &plan).ok());
    return plan.num_splits;
  };
  auto paged = [](KvcacheParams p) {
    static int32_t table[1];
    p.block_table = table;
    p.page_block_size = 16;
    p.num_blocks = int(p.batch * (p.seqlen_k / 16));
    p.block_table_batch_stride = p.seqlen_k / 16;
    return p;
  };
  EXPECT_EQ(decode::ctas_per_sm(decode_kernel_for(decode_params(12, 1, 32, 8, 256, 16384), h200()).smem_bytes, 128, h200()), 1);
  EXPECT_EQ(splits(decode_params(12, 1, 32, 8, 256, 16384), h200()), 4);          // 96 CTAs: 0.727 of the SMs
  EXPECT_EQ(splits(decode_params(12, 1, 32, 8, 256, 131072), h200()), 4);
  EXPECT_EQ(splits(paged(decode_params(12, 1, 32, 8, 256, 16384)), h200()), 4);
  EXPECT_EQ(splits(decode_params(3, 1, 32, 32, 256, 16384), h200()), 4);          // MHA: 96 CTAs
  EXPECT_EQ(splits(decode_params(99, 1, 8, 1, 256, 16384), h200()), 4);           // 0.75
  EXPECT_EQ(splits(decode_params(100, 1, 8, 1, 256, 16384), h200()), 1);          // 0.758
  EXPECT_EQ(splits(decode_params(13, 1, 32, 8, 256, 16384), h200()), 1);          // 104 CTAs
  EXPECT_EQ(splits(decode_params(12, 1, 32, 8, 256, 16383), h200()), 1);          // under 16k keys
  EXPECT_EQ(splits(decode_params(12, 1, 32, 8, 256, 16384), a100()), 1);          // measured on sm_90 only
  EXPECT_EQ(splits(decode_params(12, 1, 32, 8, 192, 16384), h200()), 1);          // two CTAs per SM
  KvcacheParams fp8 = decode_params(12, 1, 32, 8, 256, 8192);
  fp8.kv_dtype = FA_FLOAT8_E4M3;
  EXPECT_EQ(splits(fp8, h200()), 1) << "FP8 caches: their own one-wave rule (8 splits from 16k keys)";
}

// The generated table's rows with a decode role: never chosen by choose_kernel, offered in place of their bucket's
// general row by decode_alternative (the bf16 and fp16 D = 128 decode rows: a many_waves and a long_contiguous row),
// none for other rows.
TEST(CudaKvcachePlan, DecodeAlternativesOfTheGeneratedTable) {
  namespace gen = flashattn::cuda::generated;
  for (const fa_dtype dtype : {FA_BFLOAT16, FA_FLOAT16})
    for (const int d : {64, 128}) {
      KvcacheParams p = decode_params(256, 1, 32, 8, d, 1024);
      p.dtype = dtype;
      int index = -1;
      ASSERT_TRUE(choose_kernel(KernelKind::kKvcache, p, limits_of(h200()), gen::kKernelTable, gen::kKernelCount,
                                "80-real 90a-real", &index)
                      .ok());
      EXPECT_EQ(gen::kKernelTable[index].decode_role, DecodeRole::kGeneral) << gen::kKernelTable[index].name;
      for (const DecodeRole role : {DecodeRole::kManyWaves, DecodeRole::kLongContiguous}) {
        const int alternative = decode_alternative(index, role, limits_of(h200()), gen::kKernelTable, gen::kKernelCount);
        if (d == 128) {
          ASSERT_GE(alternative, 0) << "no row of role " << int(role) << " for D = 128";
          const KernelEntry& e = gen::kKernelTable[alternative];
          EXPECT_EQ(e.decode_role, role);
          EXPECT_EQ(e.dtype, dtype);
          EXPECT_EQ(e.head_dim, 128);
          EXPECT_EQ(e.block_m, gen::kKernelTable[index].block_m) << "the rules counted CTAs of the general row's block_m";
          if (role == DecodeRole::kManyWaves) EXPECT_LT(e.smem_bytes, gen::kKernelTable[index].smem_bytes);
          else EXPECT_GT(e.block_n, gen::kKernelTable[index].block_n);
        } else {
          EXPECT_EQ(alternative, -1);
        }
      }
      EXPECT_EQ(decode_alternative(index, DecodeRole::kGeneral, limits_of(h200()), gen::kKernelTable, gen::kKernelCount), -1);
    }
  EXPECT_EQ(decode_alternative(-1, DecodeRole::kManyWaves, limits_of(h200()), gen::kKernelTable, gen::kKernelCount), -1);
}

// fa_kvcache's forward route (decode_plan.hpp, wants_forward_route): from 48 query rows; from 17 for calls that pack
// (G > 1, no ALiBi) over a cache of at least 32k rows; never with rotary, left padding or an FP8 cache.
TEST(CudaKvcachePlan, ForwardRouteRule) {
  EXPECT_EQ(decode::kLongCacheRouteMinRows, 17);
  EXPECT_EQ(decode::kLongCacheRouteMinBytes, int64_t(128) << 20);
  EXPECT_EQ(decode::kL2CacheRouteMinRows, 24);
  EXPECT_EQ(decode::kL2CacheRouteMinBytes, int64_t(64) << 20);
  // B = 2, D = Dv = 128, 16-bit, Hk = 8: 16384 cache rows make 128 MiB of K/V, 8192 64 MiB.
  const int long_cache = 16384, l2_cache = 8192;
  for (const auto& [sq, hq, hk, capacity, alibi, route] :
       {std::tuple<int, int, int, int, bool, bool>{48, 32, 8, 4096, false, true}, {47, 32, 8, 4096, false, false},
        {48, 32, 32, 4096, false, true}, {17, 32, 8, long_cache, false, true}, {16, 32, 8, long_cache, false, false},
        {17, 32, 8, long_cache - 1, false, false}, {17, 32, 32, long_cache, false, false},
        {17, 32, 8, long_cache, true, false}, {47, 32, 1, 131072, false, true}, {47, 32, 1, 65535, false, false},
        {23, 32, 1, 131071, false, false}, {24, 32, 8, l2_cache, false, true}, {23, 32, 8, l2_cache, false, false},
        {24, 32, 8, l2_cache - 1, false, false}, {48, 32, 8, 131072, true, true}}) {
    KvcacheParams p = decode_params(2, sq, hq, hk, 128, capacity);
    p.kv_dtype = p.dtype;  // a 16-bit cache
    static const float kSlopes[32] = {};
    if (alibi) p.alibi_slopes = kSlopes;
    const std::string what = "Sq " + std::to_string(sq) + " Hq " + std::to_string(hq) + " / Hk " + std::to_string(hk) +
                             " capacity " + std::to_string(capacity) + (alibi ? " alibi" : "");
    EXPECT_EQ(decode::wants_forward_route(p), route) << what;
    KvcacheParams rotary = p;
    rotary.rotary_dim = 64;
    EXPECT_FALSE(decode::wants_forward_route(rotary)) << what << " rotary";
    KvcacheParams fp8 = p;
    fp8.kv_dtype = FA_FLOAT8_E4M3;
    EXPECT_FALSE(decode::wants_forward_route(fp8)) << what << " fp8";
  }
}

TEST(CudaKvcachePlan, PlanAndWorkspaceLayout) {
  // The issue's shape: 32 query heads, 8 K/V heads, D = 128, one new token, a 128k cache.
  KvcacheParams p = decode_params(1, 1, 32, 8, 128, 131072);
  const KernelEntry& kernel = decode_kernel_for(p, h200());
  EXPECT_EQ(kernel.head_dim, 128);
  decode::DecodePlan plan;
  ASSERT_TRUE(decode::make_decode_plan(p, kernel, h200(), &plan).ok());
  EXPECT_EQ(plan.m_blocks, 1) << "the 4 query heads of a group share one m-block";
  EXPECT_GT(plan.num_splits, 1);
  EXPECT_EQ(plan.partial_rows, 32);
  EXPECT_EQ(plan.lse_bytes % decode::kWorkspaceAlignment, 0);
  EXPECT_GE(plan.lse_bytes, plan.num_splits * 32 * 4);
  EXPECT_EQ(plan.out_bytes, int64_t(plan.num_splits) * 32 * 128 * 4);
  EXPECT_EQ(plan.workspace_bytes, decode::kWorkspaceAlignment + plan.lse_bytes + plan.out_bytes);
  // Batch 256: no split, no workspace.
  KvcacheParams wide = decode_params(256, 1, 32, 8, 128, 4096);
  ASSERT_TRUE(decode::make_decode_plan(wide, kernel, h200(), &plan).ok());
  EXPECT_EQ(plan.num_splits, 1);
  EXPECT_EQ(plan.workspace_bytes, 0);
  // An explicit num_splits is used as given.
  wide.num_splits = 7;
  ASSERT_TRUE(decode::make_decode_plan(wide, kernel, h200(), &plan).ok());
  EXPECT_EQ(plan.num_splits, 7);
  EXPECT_GT(plan.workspace_bytes, 0);
  // The layout at counts whose LSEs do not fill whole alignment units (3 rows: 5 splits x 3 x 4 = 60 bytes), and at
  // 2 splits, the least that writes partials: the out partials start aligned after the LSEs, all inside the workspace.
  for (const int splits : {2, 5}) {
    const decode::DecodePlan odd = decode::decode_layout(decode_params(1, 1, 3, 1, 64, 4096), 16, 64, splits);
    EXPECT_EQ(odd.partial_rows, 3);
    EXPECT_EQ(odd.lse_bytes % decode::kWorkspaceAlignment, 0) << splits << " splits";
    EXPECT_GE(odd.lse_bytes, splits * 3 * 4);
    EXPECT_EQ(odd.out_bytes, int64_t(splits) * 3 * 64 * 4);
    EXPECT_EQ(odd.workspace_bytes, decode::kWorkspaceAlignment + odd.lse_bytes + odd.out_bytes);
  }
  // A grid of more than INT_MAX CTAs (row blocks x splits) is refused, one row block less is not.
  KvcacheParams tall = decode_params(1, 1, 8, 8, 128, 4096);
  const KernelEntry& tall_kernel = decode_kernel_for(tall, h200());
  tall.num_splits = 1024;
  tall.seqlen_q = (1 << 21) * tall_kernel.block_m;  // 2^21 row blocks of one K/V head's rows
  const Status refused = decode::make_decode_plan(tall, tall_kernel, h200(), &plan);
  EXPECT_EQ(refused.code(), FA_ERROR_UNSUPPORTED) << refused.to_string();
  EXPECT_NE(refused.message().find("grid limit"), std::string::npos) << refused.message();
  tall.seqlen_q -= tall_kernel.block_m;
  EXPECT_TRUE(decode::make_decode_plan(tall, tall_kernel, h200(), &plan).ok());
  EXPECT_EQ(plan.m_blocks, (1 << 21) - 1);
  // The split counts measured fastest on the H200 (decode_plan.hpp): about one CTA per SM for a contiguous
  // cache, every CTA slot (2 per SM) for a paged cache with room for >= 32 k keys (8-32 k below one wave, where the
  // splits keep >= 1024 keys); where the unsplit grid is 0.7-1 CTA per SM (B = 12-16), no split, or 2 for paged caches
  // of >= 8 k keys, or 4 in the lower part of that range; two tiles per split at least.
  // The issue's heads (32 / 8, D = 128, one new token) at batch x cache, contiguous or in pages of 16. The planner only
  // looks at whether there is a table (never read) and at the capacity.
  auto issue_shape = [](int batch, int cache, bool paged) {
    KvcacheParams q = decode_params(batch, 1, 32, 8, 128, cache);
    if (paged) {
      q.page_block_size = 16;
      q.num_blocks = batch * (cache / 16);
      q.block_table = reinterpret_cast<const int32_t*>(uintptr_t(256));
      q.block_table_batch_stride = cache / 16;
    }
    return q;
  };
  struct Case {
    int batch, cache;
    bool paged;
    int splits;
  };
  for (const Case& c : {Case{1, 131072, false, 16}, Case{4, 8192, false, 4}, Case{16, 8192, false, 1}, Case{1, 1024, false, 8},
                        Case{1, 131072, true, 32}, Case{4, 131072, true, 8}, Case{16, 131072, true, 2}, Case{16, 8192, true, 2},
                        Case{16, 4096, true, 1}, Case{8, 8192, true, 4}, Case{4, 8192, true, 8},
                        // paged below one wave, 8k-32k: every slot where the splits keep >= 1024 keys
                        Case{4, 16384, true, 8}, Case{2, 16384, true, 16}, Case{2, 8192, true, 8}, Case{1, 16384, true, 16},
                        Case{8, 4096, true, 2},
                        // about one wave (0.7-1 CTAs per SM unsplit): paged caches of >= 8k keys take 4 splits up to
                        // 0.9 (B = 12-14), else 2; contiguous ones 1 (the selection takes the long tile's 4 splits
                        // at B = 12: OneWaveLongTileRule)
                        Case{12, 8192, false, 1}, Case{12, 32768, false, 1}, Case{13, 8192, false, 1},
                        Case{12, 8192, true, 4}, Case{13, 16384, true, 4}, Case{14, 16384, true, 4}, Case{15, 8192, true, 2},
                        Case{16, 16384, true, 2}, Case{12, 4096, false, 1}, Case{12, 4096, true, 1},
                        Case{12, 32768, true, 8}, Case{24, 131072, true, 4},
                        // between one CTA per SM and 3.5 waves of slots: the slot waves (balanced_splits)
                        Case{24, 8192, false, 4}, Case{20, 8192, false, 3}, Case{20, 2048, false, 1},
                        Case{36, 32768, true, 6}, Case{48, 8192, true, 2}, Case{40, 8192, false, 4},
                        // just below one wave (0.5-0.7 CTAs per SM unsplit): the slot waves too, paged >= 32k aside
                        Case{9, 4096, false, 3}, Case{10, 32768, false, 3}, Case{10, 8192, true, 3}, Case{11, 4096, false, 3},
                        Case{10, 32768, true, 13},
                        Case{256, 131072, true, 1}, Case{1, 1024, true, 8},
                        // contiguous, many waves unsplit: long sequences split toward 16 waves (kManyWavesTarget)
                        Case{256, 32768, false, 2}, Case{256, 8192, false, 2}, Case{256, 4096, false, 1},
                        Case{128, 32768, false, 4}, Case{128, 8192, false, 2}, Case{128, 4096, false, 1},
                        Case{64, 32768, false, 1}, Case{512, 131072, false, 1}, Case{256, 32768, true, 1},
                        Case{128, 16384, true, 1}}) {
    ASSERT_TRUE(decode::make_decode_plan(issue_shape(c.batch, c.cache, c.paged), kernel, h200(), &plan).ok());
    EXPECT_EQ(plan.num_splits, c.splits) << "B " << c.batch << " cache " << c.cache << (c.paged ? " paged" : "");
  }
  // FP8 (e4m3) caches take the slot-wave rules too (H200, 20:41 UTC: bench/results/2026-12-01-2041-h200-decode-fp8-
  // splits-summary.txt): between one CTA per SM and many waves, and just below one wave (paged >= 32k aside); about one
  // wave, their own (decode_plan.hpp, kFp8PagedOneWaveSplitKeys).
  for (const Case& c : {Case{20, 8192, false, 3}, Case{20, 8192, true, 3}, Case{20, 32768, false, 8}, Case{20, 32768, true, 8},
                        Case{24, 8192, false, 4}, Case{36, 8192, true, 4}, Case{36, 32768, false, 6}, Case{36, 32768, true, 6},
                        Case{48, 8192, false, 2}, Case{48, 32768, true, 2}, Case{9, 8192, false, 3}, Case{9, 8192, true, 3},
                        Case{10, 32768, false, 3}, Case{10, 32768, true, 13},
                        // one wave: 2 splits for paged caches from 4k keys; 8 for contiguous ones from 32k up to 0.8 of
                        // the SMs (B = 13: 0.79) and from 16k up to 0.75 (B = 12: 0.73), else 1
                        Case{12, 4096, true, 2}, Case{16, 4096, true, 2}, Case{14, 2048, true, 1}, Case{12, 8192, true, 2},
                        Case{12, 32768, false, 8}, Case{13, 131072, false, 8}, Case{13, 32768, false, 8},
                        Case{12, 16384, false, 8}, Case{13, 16384, false, 1}, Case{12, 8192, false, 1}, Case{14, 16384, false, 1},
                        Case{14, 32768, false, 1}, Case{16, 131072, false, 1}}) {
    KvcacheParams q = issue_shape(c.batch, c.cache, c.paged);
    q.kv_dtype = FA_FLOAT8_E4M3;
    const KernelEntry& fp8_kernel = decode_kernel_for(q, h200());
    ASSERT_TRUE(fp8_kernel.fp8_cache);
    ASSERT_TRUE(decode::make_decode_plan(q, fp8_kernel, h200(), &plan).ok());
    EXPECT_EQ(plan.num_splits, c.splits) << "FP8, B " << c.batch << " cache " << c.cache << (c.paged ? " paged" : "");
  }
  // The issue's sweep (B = 1, 4, 16, 64, 256 x 1k, 8k, 32k, both layouts): the split counts its measurements were taken
  // at (bench/results/2026-12-01-1827-h200-decode-balanced-splits-ab-summary.txt, both plans). A rule change that moves
  // one of them needs the sweep measured again.
  const int batches[] = {1, 4, 16, 64, 256}, caches[] = {1024, 8192, 32768};
  const int contiguous_splits[5][3] = {{8, 16, 16}, {4, 4, 4}, {1, 1, 1}, {1, 1, 1}, {1, 2, 2}};
  const int paged_splits[5][3] = {{8, 16, 32}, {4, 8, 8}, {1, 2, 2}, {1, 1, 1}, {1, 1, 1}};
  for (int bi = 0; bi < 5; ++bi)
    for (int ci = 0; ci < 3; ++ci)
      for (const bool paged : {false, true}) {
        ASSERT_TRUE(decode::make_decode_plan(issue_shape(batches[bi], caches[ci], paged), kernel, h200(), &plan).ok());
        EXPECT_EQ(plan.num_splits, paged ? paged_splits[bi][ci] : contiguous_splits[bi][ci])
            << "the issue's sweep, B " << batches[bi] << " cache " << caches[ci] << (paged ? " paged" : "");
      }
  // Paged caches that the kernel streams with its lean copies (16-bit, blocks of a power of two >= 16 rows that are runs
  // of rows: the usual [num_blocks, block, Hk, D] pool, as the API passes it) take the contiguous cache's split counts,
  // except in the lower part of one wave (4 splits on the general tile, where a contiguous cache takes the long tile) and
  // at many waves (no many-waves split). The cases above keep the paged rules: their block stride is not block x row
  // stride (blocks with room between them), as for FP8 caches and block sizes that are not such powers of two.
  auto lean_shape = [&](int batch, int cache, int block) {
    KvcacheParams q = issue_shape(batch, cache, true);
    q.page_block_size = block;
    q.num_blocks = batch * (cache / block);
    q.block_table_batch_stride = cache / block;
    q.k_batch_stride = int64_t(block) * q.k_row_stride;
    q.v_batch_stride = int64_t(block) * q.v_row_stride;
    return q;
  };
  const int lean_splits[5][3] = {{8, 16, 16}, {4, 4, 4}, {1, 1, 1}, {1, 1, 1}, {1, 1, 1}};
  for (int bi = 0; bi < 5; ++bi)
    for (int ci = 0; ci < 3; ++ci) {
      ASSERT_TRUE(decode::make_decode_plan(lean_shape(batches[bi], caches[ci], 16), kernel, h200(), &plan).ok());
      EXPECT_EQ(plan.num_splits, lean_splits[bi][ci]) << "the issue's sweep, lean paged, B " << batches[bi] << " cache " << caches[ci];
    }
  for (const int batch : {1, 2, 4, 8, 9, 10, 16, 20, 24, 36, 48, 64})
    for (const int cache : {4096, 8192, 16384, 32768, 131072})
      for (const int block : {16, 64, 256}) {
        decode::DecodePlan contiguous_plan{};
        ASSERT_TRUE(decode::make_decode_plan(issue_shape(batch, cache, false), kernel, h200(), &contiguous_plan).ok());
        ASSERT_TRUE(decode::make_decode_plan(lean_shape(batch, cache, block), kernel, h200(), &plan).ok());
        EXPECT_EQ(plan.num_splits, contiguous_plan.num_splits) << "lean paged, B " << batch << " cache " << cache << " block " << block;
      }
  for (const Case& c : {Case{12, 8192, true, 4}, Case{13, 16384, true, 4}, Case{256, 32768, true, 1}, Case{128, 32768, true, 1}}) {
    ASSERT_TRUE(decode::make_decode_plan(lean_shape(c.batch, c.cache, 16), kernel, h200(), &plan).ok());
    EXPECT_EQ(plan.num_splits, c.splits) << "lean paged, B " << c.batch << " cache " << c.cache;
  }
  // An FP8 cache in the same pool keeps the paged rules (every CTA slot from 32k keys).
  KvcacheParams fp8_pool = lean_shape(1, 131072, 16);
  fp8_pool.kv_dtype = FA_FLOAT8_E4M3;
  ASSERT_TRUE(decode::make_decode_plan(fp8_pool, decode_kernel_for(fp8_pool, h200()), h200(), &plan).ok());
  EXPECT_GT(plan.num_splits, 16) << "FP8 paged, B 1 cache 128k";
  // So does a 16-bit cache whose kernel has 128-key tiles (D = 64): the lean copies are for 64-key tiles only. At B = 8 /
  // 16k the paged rules give every CTA slot (4 splits) where the contiguous cache takes 2.
  KvcacheParams d64_pool = decode_params(8, 1, 32, 8, 64, 16384);
  d64_pool.page_block_size = 16;
  d64_pool.num_blocks = 8 * (16384 / 16);
  d64_pool.block_table = reinterpret_cast<const int32_t*>(uintptr_t(256));
  d64_pool.block_table_batch_stride = 16384 / 16;
  d64_pool.k_batch_stride = 16 * d64_pool.k_row_stride;
  d64_pool.v_batch_stride = 16 * d64_pool.v_row_stride;
  const KernelEntry& d64_kernel = decode_kernel_for(d64_pool, h200());
  ASSERT_EQ(d64_kernel.block_n, 128);
  ASSERT_TRUE(decode::make_decode_plan(d64_pool, d64_kernel, h200(), &plan).ok());
  EXPECT_EQ(plan.num_splits, 4) << "D = 64 paged, B 8 cache 16k";
  ASSERT_TRUE(decode::make_decode_plan(decode_params(8, 1, 32, 8, 64, 16384), d64_kernel, h200(), &plan).ok());
  EXPECT_EQ(plan.num_splits, 2) << "D = 64 contiguous, B 8 cache 16k";
  // And a narrow head on the D = 128 tile (D = 120: the kernel takes its checked copies, not the lean ones): at B = 1 / 32k
  // the paged rules' every CTA slot (32 splits), not the contiguous cache's 16.
  KvcacheParams narrow_pool = lean_shape(1, 32768, 16);
  narrow_pool.head_dim = narrow_pool.head_dim_v = 120;
  narrow_pool.q_head_stride = narrow_pool.out_head_stride = narrow_pool.k_head_stride = narrow_pool.v_head_stride = 120;
  narrow_pool.k_row_stride = narrow_pool.v_row_stride = 8 * 120;
  narrow_pool.k_batch_stride = narrow_pool.v_batch_stride = 16 * 8 * 120;
  const KernelEntry& narrow_kernel = decode_kernel_for(narrow_pool, h200());
  ASSERT_EQ(narrow_kernel.head_dim, 128);
  ASSERT_EQ(narrow_kernel.block_n, 64);
  ASSERT_TRUE(decode::make_decode_plan(narrow_pool, narrow_kernel, h200(), &plan).ok());
  EXPECT_EQ(plan.num_splits, 32) << "D = 120 paged, B 1 cache 32k";
  // Chunked prefill: 70 new tokens x 4 heads = 280 packed rows -> 18 m-blocks of 16.
  KvcacheParams prefill = decode_params(2, 70, 32, 8, 128, 4096);
  ASSERT_TRUE(decode::make_decode_plan(prefill, kernel, h200(), &plan).ok());
  EXPECT_EQ(plan.m_blocks, 18);
  // The launcher's layout equals the plan's.
  const decode::DecodePlan layout = decode::decode_layout(prefill, kernel.block_m, kernel.block_n, plan.num_splits);
  EXPECT_EQ(layout.workspace_bytes, plan.workspace_bytes);
  EXPECT_EQ(layout.m_blocks, plan.m_blocks);
}

TEST(CudaKvcachePlan, DecodeArgs) {
  KvcacheParams p = decode_params(3, 2, 12, 4, 64, 1000);
  decode::DecodePlan plan = decode::decode_layout(p, 16, 128, 4);
  alignas(256) static char workspace[1 << 17];
  ASSERT_LE(plan.workspace_bytes + 1, int64_t(sizeof(workspace)));
  decode::DecodeArgs a = decode::make_decode_args(p, plan, workspace + 1);  // any start address
  EXPECT_EQ(a.group, 3);
  EXPECT_EQ(a.packed_rows, 6);
  EXPECT_EQ(a.num_splits, 4);
  EXPECT_EQ(a.p.num_splits, 4);
  EXPECT_EQ(a.page_shift, -1) << "contiguous cache";
  EXPECT_EQ(a.programmatic_launch, 0) << "the launcher decides, from the device";
  const auto lse = reinterpret_cast<uintptr_t>(a.partial_lse), ws = reinterpret_cast<uintptr_t>(workspace + 1);
  EXPECT_EQ(lse % decode::kWorkspaceAlignment, 0u);
  EXPECT_GE(lse, ws);
  EXPECT_LT(lse, ws + decode::kWorkspaceAlignment);
  EXPECT_EQ(reinterpret_cast<char*>(a.partial_out) - reinterpret_cast<char*>(a.partial_lse), plan.lse_bytes);
  EXPECT_LE(reinterpret_cast<char*>(a.partial_out) + plan.out_bytes, workspace + 1 + plan.workspace_bytes);
  // Paged: power-of-two block sizes shift, others divide.
  static const int32_t table[4] = {0, 1, 2, 3};
  p.block_table = table;
  for (const auto& [size, shift] : std::vector<std::pair<int, int>>{{1, 0}, {16, 4}, {256, 8}, {3, -1}, {48, -1}}) {
    p.page_block_size = size;
    EXPECT_EQ(decode::make_decode_args(p, plan, nullptr).page_shift, shift) << "block size " << size;
  }
  // Blocks addressed as pool rows only when each is a run of block-size rows (K and V) and the pool has < 2^31 rows.
  EXPECT_EQ(a.paged_rows, 0) << "contiguous cache";
  p.page_block_size = 16;
  p.num_blocks = 4;
  p.k_row_stride = p.v_row_stride = 4 * 64;  // [blocks, 16, Hk = 4, D = 64]
  p.k_batch_stride = p.v_batch_stride = 16 * 4 * 64;
  EXPECT_EQ(decode::make_decode_args(p, plan, nullptr).paged_rows, 1);
  p.v_batch_stride += 64;  // padded V blocks
  EXPECT_EQ(decode::make_decode_args(p, plan, nullptr).paged_rows, 0);
  p.v_batch_stride = p.k_batch_stride;
  p.k_row_stride = p.v_row_stride = 64;  // heads-major blocks: [blocks][Hk][16][D]
  EXPECT_EQ(decode::make_decode_args(p, plan, nullptr).paged_rows, 0);
  p.k_row_stride = p.v_row_stride = 4 * 64;
  p.num_blocks = (1 << 27);  // 2^31 rows
  EXPECT_EQ(decode::make_decode_args(p, plan, nullptr).paged_rows, 0);
  // One split: no workspace pointers.
  plan = decode::decode_layout(p, 16, 128, 1);
  EXPECT_EQ(plan.workspace_bytes, 0);
  EXPECT_EQ(decode::make_decode_args(p, plan, nullptr).partial_lse, nullptr);
}

TEST(CudaKvcachePlan, SupportRulesAndMessages) {
  auto expect_rule = [](const KvcacheParams& p, const std::string& prefix) {
    const Status s = decode::check_kvcache_support(p);
    EXPECT_EQ(s.code(), FA_ERROR_UNSUPPORTED) << prefix;
    EXPECT_EQ(s.message().rfind(prefix, 0), 0u) << "message: " << s.message();
  };
  const KvcacheParams ok = decode_params(2, 1, 8, 2, 128, 512);
  EXPECT_TRUE(decode::check_kvcache_support(ok).ok());
  KvcacheParams p = ok;
  p.dtype = FA_FLOAT32;
  expect_rule(p, "q: dtype float32 is not supported by the cuda kvcache kernels");
  p = ok;
  p.dropout_p = 0.1f;
  expect_rule(p, "options.dropout_p:");
  p = ok;
  p.head_dim = p.head_dim_v = 36;
  expect_rule(p, "q: head dim 36 must be a multiple of 8");
  p = ok;
  p.head_dim_v = 64;
  expect_rule(p, "v_cache: head dim Dv = 64 must equal");
  p = ok;
  p.k = static_cast<const char*>(ok.k) + 8;  // 8-byte aligned is not enough: a cp.async copy moves 16 bytes
  expect_rule(p, "k_cache: data pointer must be 16-byte aligned");
  p = ok;
  p.v_row_stride = 2 * 128 + 4;  // 520 bytes
  expect_rule(p, "v_cache: row stride 260 elements (520 bytes) must be a multiple of 16 bytes");
  p = ok;
  alignas(16) static char fresh[64];
  p.k_new = p.v_new = fresh;
  p.seqlen_new = 2;
  p.k_new_row_stride = p.v_new_row_stride = 2 * 128;
  p.k_new_head_stride = p.v_new_head_stride = 128;
  p.k_new_batch_stride = p.v_new_batch_stride = 2 * 2 * 128;
  EXPECT_TRUE(decode::check_kvcache_support(p).ok());
  p.k_new_head_stride = 100;
  expect_rule(p, "k_new: head stride 100 elements");
  p = ok;
  p.out_batch_stride = 8 * 128 + 1;
  expect_rule(p, "out: batch (or block) stride 1025 elements");
  // A head stride over one head, or a row stride over one row, is never used: any value is fine.
  p = decode_params(2, 1, 1, 1, 64, 512);
  p.q_head_stride = 3;
  p.q_row_stride = 5;
  EXPECT_TRUE(decode::check_kvcache_support(p).ok()) << decode::check_kvcache_support(p).message();
  // FP8 caches: 1-byte elements (strides are checked in bytes as such) and D % 16 == 0.
  KvcacheParams f = ok;
  f.kv_dtype = FA_FLOAT8_E4M3;
  EXPECT_TRUE(decode::check_kvcache_support(f).ok()) << decode::check_kvcache_support(f).message();
  f.v_row_stride = 2 * 128 + 8;  // 264 bytes
  expect_rule(f, "v_cache: row stride 264 elements (264 bytes) must be a multiple of 16 bytes");
  f.v_row_stride = 2 * 128 + 16;  // 272 bytes: fine for FP8 (the same stride in a 16-bit cache: also fine)
  EXPECT_TRUE(decode::check_kvcache_support(f).ok()) << decode::check_kvcache_support(f).message();
  f = ok;
  f.kv_dtype = FA_FLOAT8_E4M3;
  f.head_dim = f.head_dim_v = 40;
  expect_rule(f, "k_cache: head dim 40 must be a multiple of 16 with a float8_e4m3 cache");

  // cache_batch_idx runs as paged blocks of S_cache rows: only a power of two >= 16 is taken (the other sizes would
  // take the slow per-row block ids), so validate.cpp's one-column table with S_cache = 1000 or 8 is refused here.
  alignas(16) static int32_t table[2] = {1, 0};
  KvcacheParams bi = ok;
  bi.block_table = table;
  bi.block_table_is_batch_idx = true;
  bi.block_table_batch_stride = 1;
  bi.num_blocks = 2;
  bi.page_block_size = 512;  // the capacity of decode_params(2, 1, 8, 2, 128, 512)
  EXPECT_TRUE(decode::check_kvcache_support(bi).ok()) << decode::check_kvcache_support(bi).message();
  for (int size : {1000, 8, 24}) {
    bi.page_block_size = size;
    expect_rule(bi, "cache_batch_idx: on the cuda backend k_cache's dimension 1 (S_cache) must be a power of two >= 16, got " +
                        std::to_string(size));
  }
  // A plain block table of any block size is taken (block size 3: the per-row block ids).
  KvcacheParams paged = bi;
  paged.block_table_is_batch_idx = false;
  paged.page_block_size = 3;
  EXPECT_TRUE(decode::check_kvcache_support(paged).ok()) << decode::check_kvcache_support(paged).message();
  // cache_leftpad: contiguous caches only, the message naming what the cache is instead.
  p = ok;
  p.cache_leftpad = table;
  EXPECT_TRUE(decode::check_kvcache_support(p).ok()) << decode::check_kvcache_support(p).message();
  paged.cache_leftpad = table;
  expect_rule(paged, "cache_leftpad: on the cuda backend with a contiguous cache only, not with block_table");
  bi.page_block_size = 512;
  bi.cache_leftpad = table;
  expect_rule(bi, "cache_leftpad: on the cuda backend with a contiguous cache only, not with cache_batch_idx");
  // Grid limits: K/V heads on gridDim.y and the batch on gridDim.z (65535 each), and the packed rows per K/V head.
  p = decode_params(2, 1, 65536, 65536, 64, 512);
  expect_rule(p, "k_cache: 65536 K/V heads exceed the cuda kvcache limit of 65535");
  p = decode_params(65535, 1, 8, 2, 64, 512);
  EXPECT_TRUE(decode::check_kvcache_support(p).ok()) << decode::check_kvcache_support(p).message();
  p = decode_params(65536, 1, 8, 2, 64, 512);
  expect_rule(p, "q: batch 65536 exceeds the cuda kvcache limit of 65535");
  p = decode_params(1, 1 << 24, 256, 1, 64, 512);  // 2^24 new tokens x 256 query heads per K/V head = 2^32 rows
  expect_rule(p, "q: Sq * Hq / Hk = 4294967296 rows per K/V head exceed the cuda kvcache limit");
}

// Every head dim of the issue has a decode kernel for both dtypes, chosen on an H200 and on an A100; a head
// dim between buckets runs in the next one; the table's shared memory is the kernel's.
TEST(CudaKvcachePlan, GeneratedDecodeRows) {
  namespace gen = flashattn::cuda::generated;
  int rows = 0, fp8_rows = 0;
  for (int r = 0; r < gen::kKernelCount; ++r) {
    const KernelEntry& e = gen::kKernelTable[r];
    if (e.kind != KernelKind::kKvcache) continue;
    ++rows;
    EXPECT_FALSE(e.dropout) << e.name;
    EXPECT_EQ(e.block_m % 16, 0) << e.name;
    EXPECT_EQ((e.block_n / e.warps) % 16, 0) << e.name;
    if (e.fp8_cache)  // Q in 16-bit, the ring in fp8 (decode_config.cuh)
      EXPECT_EQ(e.smem_bytes, int64_t(e.block_m) * e.head_dim * 2 + int64_t(2 * e.stages * e.block_n) * e.head_dim) << e.name;
    else
      EXPECT_EQ(e.smem_bytes, int64_t(e.block_m + 2 * e.stages * e.block_n) * e.head_dim * 2) << e.name;
    EXPECT_LE(e.smem_bytes, 163 * 1024) << e.name << " does not fit an sm_80 CTA";
    EXPECT_EQ(std::string(e.name).rfind("dec_", 0), 0u) << e.name;
    EXPECT_EQ(std::string(e.name).find("_e4m3_") != std::string::npos, e.fp8_cache) << e.name;
    fp8_rows += e.fp8_cache;
  }
  EXPECT_EQ(rows, 22) << "2 dtypes x 6 head-dim buckets, 2 dtypes x 3 FP8-cache buckets, and 2 x (many_waves, "
                        "long_contiguous) rows (D = 128)";
  EXPECT_EQ(fp8_rows, 6);
  for (fa_dtype dtype : {FA_FLOAT16, FA_BFLOAT16})
    for (int d : {32, 40, 64, 80, 96, 128, 160, 192, 256}) {
      KvcacheParams p = decode_params(1, 1, 8, 2, d, 1024);
      p.dtype = dtype;
      for (const auto& device : {h200(), a100()}) {
        const KernelEntry& e = decode_kernel_for(p, device);
        EXPECT_EQ(e.kind, KernelKind::kKvcache);
        EXPECT_EQ(e.dtype, dtype);
        EXPECT_FALSE(e.fp8_cache) << "a 16-bit cache never runs in an FP8 row";
        EXPECT_GE(e.head_dim, d);
        EXPECT_LT(e.head_dim - d, 64) << "the smallest bucket >= D";
      }
    }
  // FP8 caches: only FP8 rows, in the smallest compiled bucket (64, 128, 256) >= D.
  for (fa_dtype dtype : {FA_FLOAT16, FA_BFLOAT16})
    for (int d : {16, 32, 64, 80, 128, 144, 192, 256}) {
      KvcacheParams p = decode_params(1, 1, 8, 2, d, 1024);
      p.dtype = dtype;
      p.kv_dtype = FA_FLOAT8_E4M3;
      for (const auto& device : {h200(), a100()}) {
        const KernelEntry& e = decode_kernel_for(p, device);
        EXPECT_TRUE(e.fp8_cache) << e.name;
        EXPECT_EQ(e.dtype, dtype);
        EXPECT_EQ(e.head_dim, d <= 64 ? 64 : (d <= 128 ? 128 : 256)) << e.name;
      }
    }
  KvcacheParams big = decode_params(1, 1, 8, 2, 264, 1024);
  int index = -1;
  const Status s = choose_kernel(KernelKind::kKvcache, big, limits_of(h200()), gen::kKernelTable, gen::kKernelCount,
                                 "80-real 90a-real", &index);
  EXPECT_EQ(s.code(), FA_ERROR_NOT_COMPILED);
  EXPECT_NE(s.message().find("cuda kvcache"), std::string::npos) << s.message();
  // An FP8 cache whose head dim has no FP8 row is NOT_COMPILED, never a 16-bit row: a table with 16-bit rows only.
  const KernelEntry only16[] = {{KernelKind::kKvcache, FA_BFLOAT16, 128, 16, 64, 4, 3, false, 102400, "dec16", 16, false}};
  KvcacheParams fp8 = decode_params(1, 1, 8, 2, 128, 1024);
  fp8.kv_dtype = FA_FLOAT8_E4M3;
  const Status n = choose_kernel(KernelKind::kKvcache, fp8, limits_of(h200()), only16, 1, "80-real 90a-real", &index);
  EXPECT_EQ(n.code(), FA_ERROR_NOT_COMPILED);
  EXPECT_EQ(n.message(), "q: head dim 128 is not compiled for the cuda kvcache (bfloat16, float8_e4m3 cache); compiled head dims: "
                         "none (any D % 16 == 0 up to a compiled one runs in that one)")
      << n.message();
  fp8.kv_dtype = FA_BFLOAT16;  // ... and the 16-bit cache runs there
  EXPECT_TRUE(choose_kernel(KernelKind::kKvcache, fp8, limits_of(h200()), only16, 1, "80-real 90a-real", &index).ok());
  const std::string summary = flashattn::cuda::compiled_kernels_summary();
  EXPECT_NE(summary.find("kvcache: "), std::string::npos) << summary;
  EXPECT_NE(summary.find("float8_e4m3 cache: D {64, 128, 256}"), std::string::npos) << summary;
}

}  // namespace

// The FP8 decode kernel's fragment orders (src/cuda/decode/fp8_layout.hpp) against a model of ldmatrix and
// mma.m16n8k16 (the PTX ISA's fragment layouts; thread t = 4 g + q): S over one 16-column group, and the head
// columns of O over two 16-code chunks, come out as the plain sums. Integer values: exact.
TEST(CudaKvcacheFp8Layout, FragmentOrdersMatchAModelOfTheMma) {
  using flashattn::cuda::decode::fp8_o_column;
  using flashattn::cuda::decode::fp8_q_column;
  std::mt19937 rng(2026);
  std::uniform_int_distribution<int> value(-8, 8);
  // ---- S = Q K^T over one group of 16 head columns: 16 query rows, 8 keys (one n8 tile) ----
  int q[16][16], k[8][16], q_smem[16][16], b[16][8];
  for (auto& row : q) for (int& x : row) x = value(rng);
  for (auto& row : k) for (int& x : row) x = value(rng);
  std::vector<int> filled(16, 0);
  for (int d = 0; d < 16; ++d) ++filled[size_t(fp8_q_column(d))];
  for (int c = 0; c < 16; ++c) ASSERT_EQ(filled[size_t(c)], 1) << "fp8_q_column must permute a group, column " << c;
  for (int r = 0; r < 16; ++r)
    for (int d = 0; d < 16; ++d) q_smem[r][fp8_q_column(d)] = q[r][d];  // ldmatrix then gives A[r][k] = q_smem[r][k]
  for (int t = 0; t < 32; ++t) {  // ldmatrix of fp8 key rows: thread t holds codes 4 q_ .. 4 q_ + 3 of key g
    const int g = t / 4, q_ = t % 4;
    b[2 * q_][g] = k[g][4 * q_], b[2 * q_ + 1][g] = k[g][4 * q_ + 1];          // B register 0: k slots 2q, 2q + 1
    b[2 * q_ + 8][g] = k[g][4 * q_ + 2], b[2 * q_ + 9][g] = k[g][4 * q_ + 3];  // register 1: 2q + 8, 2q + 9
  }
  for (int r = 0; r < 16; ++r)
    for (int n = 0; n < 8; ++n) {
      int mma = 0, exact = 0;
      for (int slot = 0; slot < 16; ++slot) mma += q_smem[r][slot] * b[slot][n];
      for (int d = 0; d < 16; ++d) exact += q[r][d] * k[n][d];
      ASSERT_EQ(mma, exact) << "S row " << r << " key " << n;
    }
  // ---- O += P V over 16 keys and two chunks of 16 codes: n8 tiles dt = 0..3 ----
  int p[16][16], v[16][32];
  for (auto& row : p) for (int& x : row) x = value(rng);
  for (auto& row : v) for (int& x : row) x = value(rng);
  std::vector<int> seen(32, 0);
  for (int dt = 0; dt < 4; ++dt) {
    const int chunk = dt / 2, odd = dt % 2;
    int bv[16][8];  // B of tile dt: ldmatrix.trans of the chunk read as 16-bit, thread t: keys 2q, 2q + 1 (+ 8)
    for (int t = 0; t < 32; ++t) {
      const int g = t / 4, q_ = t % 4, column = 16 * chunk + 2 * g + odd;  // the 16-bit element's low / high code
      bv[2 * q_][g] = v[2 * q_][column], bv[2 * q_ + 1][g] = v[2 * q_ + 1][column];
      bv[2 * q_ + 8][g] = v[2 * q_ + 8][column], bv[2 * q_ + 9][g] = v[2 * q_ + 9][column];
    }
    for (int t = 0; t < 32; ++t)  // accumulator (row g and g + 8, n = 2 q + e) of thread t
      for (int e = 0; e < 2; ++e) {
        const int g = t / 4, q_ = t % 4, n = 2 * q_ + e, column = fp8_o_column(dt, q_, e);
        ASSERT_GE(column, 0);
        ASSERT_LT(column, 32);
        if (g == 0) ++seen[size_t(column)];
        for (const int r : {g, g + 8}) {
          int mma = 0, exact = 0;
          for (int key = 0; key < 16; ++key) mma += p[r][key] * bv[key][n];
          for (int key = 0; key < 16; ++key) exact += p[r][key] * v[key][column];
          ASSERT_EQ(mma, exact) << "O row " << r << " tile " << dt << " element " << e << " -> column " << column;
        }
      }
  }
  for (int c = 0; c < 32; ++c) EXPECT_EQ(seen[size_t(c)], 1) << "fp8_o_column must reach each head column once: " << c;
}

// The forward's short sequences (decode_plan.hpp): T = max(1, 16 / G) capped by max_seqlen_q, for paged varlen calls
// without dropout, or for a whole call that is not varlen of at most T rows; every DECODE_TILES row packs 16 rows (the rule's premise); the decode call's
// padded q / out / lse are dense (B, T, Hq, D) and (B, Hq, T) and carry the forward's cache and attention variant.
TEST(CudaKvcachePlan, ShortSequencesOfAPagedVarlenForward) {
  alignas(256) static char fake[256];
  const int32_t* index = reinterpret_cast<const int32_t*>(fake);
  flashattn::AttentionParams p{};
  p.dtype = FA_BFLOAT16;
  p.batch = 6;
  p.seqlen_q = 300;  // max_seqlen_q
  p.seqlen_k = 5000;  // max_seqlen_k
  p.heads_q = 32;
  p.heads_k = 8;
  p.head_dim = p.head_dim_v = 128;
  p.q = p.k = p.v = p.out = fake;
  p.q_row_stride = p.out_row_stride = 3 * 32 * 128;  // strided rows: the padded copy is dense whatever the forward's
  p.q_head_stride = p.out_head_stride = 128;
  p.cu_seqlens_q = p.cu_seqlens_k = index;
  p.block_table = index;
  p.block_table_batch_stride = 40;
  p.page_block_size = 128;
  p.num_blocks = 300;
  p.k_batch_stride = p.v_batch_stride = 128 * 8 * 128;
  p.softmax_scale = 0.1f;
  p.window_left = 64;
  p.window_right = 0;
  p.softcap = 30.f;
  p.stream = fake;
  EXPECT_EQ(decode::short_sequence_max_q(p), 4);
  for (int hq : {1, 2, 4, 8, 16, 32, 64, 128}) {
    flashattn::AttentionParams g = p;
    g.heads_q = hq;
    g.heads_k = hq >= 8 ? 8 : hq;
    EXPECT_EQ(decode::short_sequence_max_q(g), std::max(1, 16 / (g.heads_q / g.heads_k))) << hq;
  }
  flashattn::AttentionParams one = p;
  one.seqlen_q = 2;
  EXPECT_EQ(decode::short_sequence_max_q(one), 2);  // capped by max_seqlen_q: every sequence routed
  flashattn::AttentionParams no = p;
  no.block_table = nullptr;
  EXPECT_EQ(decode::short_sequence_max_q(no), 0);  // varlen, not paged
  no = p;
  no.cu_seqlens_q = no.cu_seqlens_k = nullptr;
  EXPECT_EQ(decode::short_sequence_max_q(no), 0);  // paged, not varlen, 300 rows: not short
  // Not varlen, Sq <= max(1, min(16, 32 / G)) (G = 4 here: 8), over a paged cache max(1, min(16, 64 / G)) (16): the
  // whole call, Sq rows per sequence; more rows or a cu_seqlens_k: none.
  for (const auto& [hq, hk, dense, paged] : {std::tuple<int, int, int, int>{8, 8, 16, 16}, {16, 8, 16, 16}, {32, 8, 8, 16},
                                             {64, 8, 4, 8}, {128, 8, 2, 4}, {64, 1, 1, 1}, {128, 1, 1, 1}}) {
    EXPECT_EQ(decode::short_call_max_q(hq, hk, false), dense) << hq << " / " << hk;
    EXPECT_EQ(decode::short_call_max_q(hq, hk, true), paged) << hq << " / " << hk << " paged";
  }
  for (const bool paged : {true, false})
    for (int sq : {1, 4, 5, 8, 9, 16, 17, 40}) {
      flashattn::AttentionParams whole = no;
      if (!paged) whole.block_table = nullptr;
      whole.seqlen_q = sq;
      const int bound = paged ? 16 : 8;
      EXPECT_EQ(decode::short_sequence_max_q(whole), sq <= bound ? sq : 0) << "Sq " << sq << (paged ? " paged" : " dense");
      EXPECT_EQ(decode::uniform_short_sequences(whole, decode::short_sequence_max_q(whole)), sq <= bound) << "Sq " << sq;
      whole.cu_seqlens_k = index;
      EXPECT_EQ(decode::short_sequence_max_q(whole), 0) << "Sq " << sq << ": keys varlen, queries not";
    }
  no = p;
  no.dropout_p = 0.1f;
  EXPECT_EQ(decode::short_sequence_max_q(no), 0);
  no = p;
  no.seqlen_q = 0;
  EXPECT_EQ(decode::short_sequence_max_q(no), 0);
  // total_q = 6 x 300 + ...: room for a sequence of <= 4 rows only up to 5 x 300 + 4 rows
  flashattn::AttentionParams rows = p;
  rows.varlen_total_q = 5 * 300 + 4;
  EXPECT_EQ(decode::short_sequence_max_q(rows), 4);
  rows.varlen_total_q = 5 * 300 + 5;  // every sequence has >= 5 rows
  EXPECT_EQ(decode::short_sequence_max_q(rows), 0);
  rows.varlen_total_q = 6 * 300;  // six chunks of 300
  EXPECT_EQ(decode::short_sequence_max_q(rows), 0);

  namespace gen = flashattn::cuda::generated;
  for (int n = 0; n < gen::kKernelCount; ++n) {
    if (gen::kKernelTable[n].kind == KernelKind::kKvcache) {
      EXPECT_EQ(gen::kKernelTable[n].block_m, decode::kShortSequencePackedRows) << gen::kKernelTable[n].name;
    }
  }

  alignas(256) static char buffers[3][256];
  char* q = buffers[0];
  char* out = buffers[1];
  float* lse = reinterpret_cast<float*>(buffers[2]);
  const KvcacheParams kv = decode::short_sequence_call(p, 4, q, out, lse, index);
  EXPECT_EQ(kv.q, static_cast<const void*>(q));
  EXPECT_EQ(kv.out, static_cast<void*>(out));
  EXPECT_EQ(kv.lse, lse);
  EXPECT_EQ(kv.cache_seqlens, index);
  EXPECT_EQ(kv.seqlen_q, 4);
  EXPECT_EQ(kv.seqlen_k, 5000);  // max_seqlen_k bounds every length
  EXPECT_EQ(kv.q_head_stride, 128);
  EXPECT_EQ(kv.q_row_stride, 32 * 128);
  EXPECT_EQ(kv.q_batch_stride, 4 * 32 * 128);
  EXPECT_EQ(kv.out_batch_stride, 4 * 32 * 128);
  EXPECT_EQ(kv.lse_row_stride, 1);
  EXPECT_EQ(kv.lse_head_stride, 4);
  EXPECT_EQ(kv.lse_batch_stride, 4 * 32);
  EXPECT_EQ(kv.cu_seqlens_q, nullptr);
  EXPECT_EQ(kv.cu_seqlens_k, nullptr);
  EXPECT_EQ(kv.seqused_k, nullptr);
  EXPECT_EQ(kv.block_table, p.block_table);
  EXPECT_EQ(kv.block_table_batch_stride, 40);
  EXPECT_EQ(kv.page_block_size, 128);
  EXPECT_EQ(kv.num_blocks, 300);
  EXPECT_EQ(kv.k_batch_stride, p.k_batch_stride);
  EXPECT_EQ(kv.window_left, 64);
  EXPECT_EQ(kv.window_right, 0);
  EXPECT_EQ(kv.softcap, 30.f);
  EXPECT_EQ(kv.softmax_scale, 0.1f);
  EXPECT_EQ(kv.stream, p.stream);
  EXPECT_EQ(kv.k_new, nullptr);
  EXPECT_EQ(kv.seqlen_new, 0);
  EXPECT_EQ(kv.rotary_dim, 0);
  EXPECT_EQ(kv.num_splits, 0);
  EXPECT_FALSE(kv.check_indices);
  EXPECT_EQ(kv.cache_leftpad, nullptr);
  EXPECT_EQ(kv.routed_seqlen_q, 0);
  EXPECT_TRUE(decode::check_kvcache_support(kv).ok()) << decode::check_kvcache_support(kv).message();

  // The call the forward runs: over its own q / out / lse, varlen rows (decode_work.hpp). Sequences of 1, 0, 4, 5, 2
  // and 300 rows at T = 4: rows left-padded to 4 in place; the 0-, 5- and 300-row ones are the forward kernel's.
  {
    flashattn::AttentionParams f = p;
    static const int32_t cu_q[] = {0, 1, 1, 5, 10, 12, 312};
    f.cu_seqlens_q = cu_q;
    f.q = q;
    f.out = out;
    f.lse = lse;
    f.q_row_stride = 32 * 128 + 64;  // the forward's own strides, padded rows
    f.out_row_stride = 32 * 128 + 8;
    f.lse_row_stride = 1;
    f.lse_head_stride = 312;  // varlen lse (Hq, total_q)
    const KvcacheParams rows = decode::varlen_rows_call(f, 4, index);
    EXPECT_EQ(rows.cu_seqlens_q, cu_q);
    EXPECT_EQ(rows.q, static_cast<const void*>(q));
    EXPECT_EQ(rows.out, static_cast<void*>(out));
    EXPECT_EQ(rows.lse, lse);
    EXPECT_EQ(rows.cache_seqlens, index);
    EXPECT_EQ(rows.seqlen_q, 4);
    EXPECT_EQ(rows.q_row_stride, 32 * 128 + 64);
    EXPECT_EQ(rows.out_row_stride, 32 * 128 + 8);
    EXPECT_EQ(rows.lse_head_stride, 312);
    EXPECT_EQ(rows.q_batch_stride, 0);
    EXPECT_EQ(rows.out_batch_stride, 0);
    EXPECT_EQ(rows.lse_batch_stride, 0);
    EXPECT_EQ(rows.cu_seqlens_k, nullptr);
    EXPECT_EQ(rows.routed_seqlen_q, 0);
    EXPECT_TRUE(decode::check_kvcache_support(rows).ok()) << decode::check_kvcache_support(rows).message();
    // Row i of sequence b is the forward's row cu[b + 1] - 4 + i; rows below `first` are padding (none: 4).
    const int row0[] = {-3, -3, 1, 6, 8, 308}, first[] = {3, 4, 0, 4, 2, 4};
    for (int b = 0; b < 6; ++b) {
      const decode::QueryRows r = decode::varlen_query_rows(rows, b);
      EXPECT_EQ(r.row0, row0[b]) << b;
      EXPECT_EQ(r.first, first[b]) << b;
      EXPECT_EQ(decode::query_rows_offset(rows, r, b, 0, rows.out_row_stride), int64_t(row0[b]) * (32 * 128 + 8)) << b;
      // a row the call writes is one of the sequence's own
      for (int i = r.first; i < 4; ++i) {
        EXPECT_GE(r.row0 + i, cu_q[b]) << b;
        EXPECT_LT(r.row0 + i, cu_q[b + 1]) << b;
      }
    }
    // A dense call keeps its batch strides.
    const decode::QueryRows dense{};
    EXPECT_EQ(decode::query_rows_offset(kv, dense, 3, kv.out_batch_stride, kv.out_row_stride), 3 * kv.out_batch_stride);
  }

  // In place when every sequence has max_seqlen_q <= T rows (total_q = B x max_seqlen_q): the forward's own tensors.
  flashattn::AttentionParams step = p;
  step.seqlen_q = 2;
  step.varlen_total_q = 6 * 2;
  step.lse = lse;
  step.lse_head_stride = 12;  // varlen lse (Hq, total_q)
  step.lse_row_stride = 1;
  step.seqused_k = index;
  EXPECT_TRUE(decode::uniform_short_sequences(step, decode::short_sequence_max_q(step)));
  flashattn::AttentionParams ragged = step;
  ragged.varlen_total_q = 6 * 2 - 1;  // one sequence of 1 row, or 0
  EXPECT_FALSE(decode::uniform_short_sequences(ragged, decode::short_sequence_max_q(ragged)));
  EXPECT_FALSE(decode::uniform_short_sequences(p, decode::short_sequence_max_q(p)));  // 300 rows each: not short
  EXPECT_FALSE(decode::uniform_short_sequences(step, 0));  // no route
  const KvcacheParams in_place = decode::uniform_sequence_call(step, index);
  EXPECT_EQ(in_place.q, p.q);
  EXPECT_EQ(in_place.out, p.out);
  EXPECT_EQ(in_place.lse, lse);
  EXPECT_EQ(in_place.seqlen_q, 2);
  EXPECT_EQ(in_place.q_row_stride, 3 * 32 * 128);  // the forward's strides, sequence b at row 2 b
  EXPECT_EQ(in_place.q_head_stride, 128);
  EXPECT_EQ(in_place.q_batch_stride, 2 * 3 * 32 * 128);
  EXPECT_EQ(in_place.out_batch_stride, 2 * 3 * 32 * 128);
  EXPECT_EQ(in_place.lse_row_stride, 1);
  EXPECT_EQ(in_place.lse_head_stride, 12);
  EXPECT_EQ(in_place.lse_batch_stride, 2);
  EXPECT_EQ(in_place.cache_seqlens, index);
  EXPECT_EQ(in_place.cu_seqlens_q, nullptr);
  EXPECT_EQ(in_place.cu_seqlens_k, nullptr);
  EXPECT_EQ(in_place.seqused_k, nullptr);
  EXPECT_EQ(in_place.block_table, p.block_table);
  EXPECT_EQ(in_place.window_left, 64);
  EXPECT_EQ(in_place.softcap, 30.f);
  EXPECT_EQ(in_place.k_new, nullptr);
  EXPECT_EQ(in_place.num_splits, 0);
  EXPECT_EQ(in_place.routed_seqlen_q, 0);
  EXPECT_TRUE(decode::check_kvcache_support(in_place).ok()) << decode::check_kvcache_support(in_place).message();
  // Not varlen (a dense (B, Sq, ...) call): the forward's own batch strides, untouched.
  flashattn::AttentionParams dense = step;
  dense.cu_seqlens_q = dense.cu_seqlens_k = nullptr;
  dense.block_table = nullptr;
  dense.q_batch_stride = dense.out_batch_stride = 7 * 32 * 128;
  dense.lse_batch_stride = 99;
  const KvcacheParams whole = decode::uniform_sequence_call(dense, index);
  EXPECT_EQ(whole.q_batch_stride, 7 * 32 * 128);
  EXPECT_EQ(whole.out_batch_stride, 7 * 32 * 128);
  EXPECT_EQ(whole.lse_batch_stride, 99);
  EXPECT_EQ(whole.k_batch_stride, p.k_batch_stride);
  EXPECT_EQ(whole.block_table, nullptr);
  EXPECT_TRUE(decode::check_kvcache_support(whole).ok()) << decode::check_kvcache_support(whole).message();
}

// The routed call's split count is planned for routed_sequences_bound sequences (decode_plan.hpp): at least every
// sequence of at most T rows there can be, whatever the counts; the steps of `flashattn step` exactly; at least 1.
TEST(CudaKvcachePlan, RoutedSequencesBound) {
  auto call = [](int batch, int max_seqlen_q, int64_t total_q) {
    flashattn::AttentionParams p{};
    p.batch = batch;
    p.seqlen_q = max_seqlen_q;
    p.varlen_total_q = total_q;
    return p;
  };
  EXPECT_EQ(decode::routed_sequences_bound(call(17, 128, 16 + 128), 4), 16);            // 16 decodes + a chunk of 128
  EXPECT_EQ(decode::routed_sequences_bound(call(66, 512, 64 + 2 * 512), 4), 64);        // 64 + 2 chunks of 512
  EXPECT_EQ(decode::routed_sequences_bound(call(6, 64, 4 + 2 * 64), 4), 4);             // 4 + 2 chunks of 64
  EXPECT_EQ(decode::routed_sequences_bound(call(260, 256, 256 + 4 * 256), 4), 259);     // 256 + 4 chunks of 256
  EXPECT_EQ(decode::routed_sequences_bound(call(8, 4, 8 * 3), 4), 8);                   // every sequence short
  EXPECT_EQ(decode::routed_sequences_bound(call(3, 600, 3 * 600), 4), 1);               // no short one: at least 1
  EXPECT_EQ(decode::routed_sequences_bound(call(9, 40, 8 * 5 + 40), 5), 8);             // 8 of T rows + one of 40
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 20000; ++trial) {
    const int batch = 1 + int(rng() % 300), t = 1 + int(rng() % 16);
    std::vector<int> counts(static_cast<size_t>(batch));
    int longest = 0, routed = 0;
    int64_t total = 0;
    for (int& n : counts) {
      n = rng() % 3 == 0 ? int(rng() % 2000) : int(rng() % (t + 1));  // chunks (any count) and short sequences (0..T)
      longest = std::max(longest, n);
      total += n;
      routed += n >= 1 && n <= t ? 1 : 0;
    }
    const int max_seqlen_q = longest + int(rng() % 3);  // an upper bound, not always the longest itself
    if (max_seqlen_q < 1) continue;
    const int bound = decode::routed_sequences_bound(call(batch, max_seqlen_q, total), std::min(t, max_seqlen_q));
    EXPECT_GE(bound, routed) << "B " << batch << " T " << t << " total " << total;
    EXPECT_GE(bound, 1);
    EXPECT_LE(bound, batch);
  }
}
