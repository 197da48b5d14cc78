// Tile sizes of the CPU flash kernels.
//
// Affects speed only, never results beyond float rounding order: any entry computes the same
// attention (the tests run several head dims, hence several entries). Measured on the 2-core
// AMD EPYC dev machine of 2026-11-30 (AVX-512, 1 MiB L2 per core, OpenBLAS 0.3.21 with its Cooper
// Lake kernels), one thread, S = 2048, fp32; differences under ~5% were within the noise of a shared
// machine. Later sessions' machine of the same name is a Zen 3 (AVX2, 512 KiB L2, OpenBLAS's ZEN
// kernels); on it (2026-12-05, 2 threads) the D = 128 forward entry 512 x 256 was still the fastest
// of five without a mask, and masked problems take smaller query tiles (kMaskedForwardMaxBlockQ).
#pragma once

namespace flashattn::cpu::flash {

struct TileConfig {
  int block_q;  // query rows per tile (Br): the M of the score GEMM and of O += P V
  int block_k;  // keys per tile (Bc): the N of S = Q K^T and the K of O += P V
};

struct TileConfigEntry {
  int max_head_dim;  // the entry applies to head dims <= this (the first that fits wins)
  TileConfig forward;
  TileConfig backward;
};

// One thread's forward working set is about 4 * (Br * D + 2 * Bc * D + Br * Bc + Br * Dv) bytes
// (1.3 MiB at 512 x 256, D = 128: L2 plus the shared L3). OpenBLAS packs both operands on every
// call, so per query tile it packs all of K and V once more: larger Br means fewer packings of K/V
// per FLOP (packing was ~20% of the forward at Br = 128, D = 128); larger Bc packs the Q and P
// tiles fewer times. Larger Br also means fewer tiles to share among threads and more masked work
// on a causal diagonal (causal S = 4096 measured the same for Br = 128, 256 and 512).
// Measured per core-second of CPU time (immune to other jobs on the shared machine), one thread,
// fp32, S = 4096 forward / 2048 backward; sgemm 4096^3 ran at 97 in the same units:
//   forward   D =  64:  Br x Bc = 128x256: 67   256x128: 70   256x256: 72   512x128: 72   512x256: 71
//             D = 128:  128x256: 74   256x128: 80   256x256: 81   512x128: 83   512x256: 85
//             D = 256:  128x256: 79   256x128: 86   256x256: 86   512x128: 88   512x256: 87
//   backward (7 GEMMs per tile pair, FLOPs counted as 2.5x forward), D = 64 / 128 / 256:
//             64x64: 50 / 58 / 51   128x128: 55 / 56 / 57   256x128: 57 / 60 / 60
// The Zen 3 machine (2026-12-05, 2 threads, D = 128, S = 2048 unless said; bench/results/2026-12-05-
// 0754-cpu-2core-backward-tiles.txt), the fused backward schedule: 256x256 against 256x128 1.05-1.12x,
// GQA 32 / 8 1.07-1.18x, causal S = 4096 1.00-1.21x, causal S = 2048 0.88-1.07x (noisy), bf16
// S = 1024 1.02-1.04x; 128x128 and 512x128 were slower. The three passes (one (b, kv head) item)
// 1.00-1.12x. D = 64 (H = 32; ...-0820-cpu-2core-backward-tiles-d64.txt): 256x256 against 256x128
// 1.02-1.22x (S = 2048 1.02-1.19x, causal 1.08-1.22x, bf16 S = 1024 1.02-1.15x). Hence 256x256 for
// D <= 128; the D = 256 entry was not measured there.
// Head dims above 256 were not tuned; their tiles are kept small for the cache.
constexpr TileConfigEntry kTileConfigs[] = {
    {64, {256, 256}, {256, 256}},
    {128, {512, 256}, {256, 256}},
    {256, {512, 128}, {256, 128}},
    {1024, {32, 64}, {32, 32}},  // validate.cpp's bound
};
constexpr int kTileConfigCount = int(sizeof(kTileConfigs) / sizeof(kTileConfigs[0]));

constexpr bool tile_table_is_valid() {
  for (int n = 0; n < kTileConfigCount; ++n) {
    const TileConfigEntry& e = kTileConfigs[n];
    if (n > 0 && e.max_head_dim <= kTileConfigs[n - 1].max_head_dim) return false;  // increasing
    for (const TileConfig& t : {e.forward, e.backward})
      if (t.block_q < 1 || t.block_q > 512 || t.block_k < 1 || t.block_k > 1024) return false;
  }
  return kTileConfigs[kTileConfigCount - 1].max_head_dim >= 1024;  // covers every valid head dim
}
static_assert(tile_table_is_valid(), "tile table: head dims increasing up to 1024, tiles in [1, 512] x [1, 1024]");

constexpr const TileConfigEntry& tile_config_entry(int head_dim) {
  for (const TileConfigEntry& e : kTileConfigs)
    if (head_dim <= e.max_head_dim) return e;
  return kTileConfigs[kTileConfigCount - 1];
}

// Query tiles of at most this many rows when a causal or sliding-window mask limits the keys.
// Such a tile computes every (row, key) of the key tiles its rows reach, and on the diagonal (each
// window edge) about half of a block_q-wide band is masked: the waste grows with block_q, and with
// 2 threads the unequal tiles also balance worse. Measured on the Zen 3 machine (2026-12-05, fp32
// unless said, 2 threads, 3 alternating rounds; bench/results/2026-12-05-0706-cpu-2core-masked-
// tiles-ab.txt), 256 against 512 rows: D = 128 causal S = 1024 1.16-1.18x, S = 2048 1.08-1.19x
// (bf16 1.07-1.19x), S = 4096 0.96-1.03x; a 256-key window at S = 4096 1.36-1.46x; D = 256 causal
// S = 1024 1.09-1.15x (one round 0.75x), S = 4096 1.00-1.12x. Without a mask 512 stays (D = 128,
// S = 4096: 0.91-0.96x at 256; ...-0703-cpu-2core-masked-tiles.txt).
constexpr int kMaskedForwardMaxBlockQ = 256;

// Tiles for a problem with q/k head dim D and v head dim Dv (the larger decides); `masked`: a
// causal or sliding-window mask (AttentionParams::window_left / window_right >= 0).
inline TileConfig forward_tiles(int head_dim, int head_dim_v, bool masked) {
  TileConfig t = tile_config_entry(head_dim > head_dim_v ? head_dim : head_dim_v).forward;
  if (masked && t.block_q > kMaskedForwardMaxBlockQ) t.block_q = kMaskedForwardMaxBlockQ;
  return t;
}
inline TileConfig backward_tiles(int head_dim, int head_dim_v) {
  return tile_config_entry(head_dim > head_dim_v ? head_dim : head_dim_v).backward;
}

}  // namespace flashattn::cpu::flash
