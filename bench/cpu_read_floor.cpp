// The CPU decode's read floor: a read-only pass over the K / V rows a decode step reads, in the same layout
// ([B, S, Hk, D], contiguous), order (per (sequence, K/V head): 256-key tiles, a tile's K rows then its V rows)
// and threads (OpenMP, one (sequence, head) at a time), with the same software prefetch as
// src/cpu/flash/few_rows.hpp (prefetcht0, `ahead` rows ahead; 0 = none). It sums the rows as float32 bit
// patterns (8 lanes, no conversion), so its rate is what the memory gives that pattern, the yardstick for
// `flashattn decode --backend cpu`'s "K/V ... GB/s". On a shared machine the memory's rate moves from minute to
// minute: run the two back to back.
//
//   g++ -O3 -march=x86-64-v3 -fopenmp bench/cpu_read_floor.cpp -o cpu_read_floor
//   OMP_NUM_THREADS=2 ./cpu_read_floor HK S ELEMENT_BYTES AHEAD_ROWS B     e.g. 8 8192 2 32 1
// prints the K/V GB/s of 7 passes (the first ones pay page faults and a cold cache).
#include <immintrin.h>
#include <omp.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace {

constexpr int kHeadDim = 128;
constexpr int kTileKeys = 256;
constexpr int kCacheLineBytes = 64;
constexpr int kPasses = 7;

inline void prefetch_line(const char* address) { asm volatile("prefetcht0 (%0)" : : "r"(address)); }

// Sums `rows` rows of `row_bytes` bytes, `stride` bytes apart, prefetching the row `ahead` rows on (while it
// lies before `end`).
__m256 sum_rows(const char* first, int rows, int64_t stride, int row_bytes, int ahead, const char* end, __m256 acc) {
  for (int j = 0; j < rows; ++j) {
    const char* row = first + j * stride;
    if (ahead > 0 && row + ahead * stride < end)
      for (int line = 0; line < row_bytes; line += kCacheLineBytes) prefetch_line(row + ahead * stride + line);
    for (int byte = 0; byte < row_bytes; byte += 32) acc = _mm256_add_ps(acc, _mm256_loadu_ps(reinterpret_cast<const float*>(row + byte)));
  }
  return acc;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: %s HK S ELEMENT_BYTES AHEAD_ROWS B\n", argv[0]);
    return 2;
  }
  const int heads_k = std::atoi(argv[1]), keys = std::atoi(argv[2]), element_bytes = std::atoi(argv[3]);
  const int ahead = std::atoi(argv[4]), batch = std::atoi(argv[5]);
  const int row_bytes = kHeadDim * element_bytes;
  const int64_t stride = int64_t(heads_k) * row_bytes;  // one key's rows of every head
  const int64_t bytes = int64_t(batch) * keys * stride;
  char* k_cache = static_cast<char*>(std::aligned_alloc(4096, size_t(bytes)));
  char* v_cache = static_cast<char*>(std::aligned_alloc(4096, size_t(bytes)));
  std::memset(k_cache, 1, size_t(bytes));
  std::memset(v_cache, 2, size_t(bytes));
  for (int pass = 0; pass < kPasses; ++pass) {
    const double start = omp_get_wtime();
    float total = 0.f;
#pragma omp parallel for schedule(dynamic, 1) reduction(+ : total)
    for (int item = 0; item < batch * heads_k; ++item) {
      const int64_t first = (int64_t(item / heads_k) * keys * heads_k + item % heads_k) * row_bytes;
      const char* k_end = k_cache + first + int64_t(keys) * stride;
      const char* v_end = v_cache + first + int64_t(keys) * stride;
      __m256 acc = _mm256_setzero_ps();
      for (int tile = 0; tile < keys; tile += kTileKeys) {
        const int rows = keys - tile < kTileKeys ? keys - tile : kTileKeys;
        acc = sum_rows(k_cache + first + tile * stride, rows, stride, row_bytes, ahead, k_end, acc);
        acc = sum_rows(v_cache + first + tile * stride, rows, stride, row_bytes, ahead, v_end, acc);
      }
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, acc);
      for (float lane : lanes) total += lane;
    }
    const double seconds = omp_get_wtime() - start;
    std::printf("%.1f ", 2.0 * double(bytes) / seconds / 1e9);
    if (total == 1.f) std::printf("!");  // keeps the sum alive
  }
  std::printf("GB/s  (K/V %.1f MiB, Hk=%d S=%d element=%d B, prefetch %d rows ahead, B=%d, %d threads)\n",
              2.0 * double(bytes) / (1 << 20), heads_k, keys, element_bytes, ahead, batch, omp_get_max_threads());
  std::free(k_cache);
  std::free(v_cache);
  return 0;
}
