// The two products of a key tile, S = alpha Q K^T and O += P V, for a tile of few query rows: a
// decode step's query heads of one GQA group (4 rows for 32 / 8 heads), or a few speculative
// tokens. Such a tile is a matrix-vector product: 1 FLOP per byte of a 16-bit cache per row (4 for
// 4 rows), so the time should be the time to read K and V. BLAS is the wrong tool there: it needs K
// and V converted and packed first, and with one row block the packing costs as much as the product
// (on the 2-core dev machine a bf16 decode step read its cache at 4.6-4.8 GB/s, a plain read of the
// same rows at 19-32 GB/s; bench/cpu_read_floor.cpp). These kernels instead
//   - read every key / value row once, in place, in its storage type (float32, bfloat16, float16 or
//     float8 e4m3 codes: converted in registers, exactly, as load_row does), through a table of row
//     pointers (so a paged cache costs one block-table read per page, not a division per row);
//   - keep the tile's rows (<= 4 at a time) and 8 lanes of 2-8 keys or columns in AVX2 registers;
//   - prefetch the rows a fixed number of bytes ahead of the row being read, along the order they
//     are read in (this tile's K rows, its V rows, the next tile's first K rows), so that the memory
//     is busy while the FMAs run: without the prefetch a core waits on each row's first miss.
// Results differ from the BLAS path only in the order of float32 additions.
#pragma once

#include <cstdint>

#include "core/dtype.hpp"
#include "cpu/flash/tile_io.hpp"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define FLASHATTN_CPU_FEW_ROWS 1
#else
#define FLASHATTN_CPU_FEW_ROWS 0
#endif

namespace flashattn::cpu::few_rows {

// Tiles of at most this many query rows take these kernels; more rows take the BLAS path, whose
// packing then pays for itself. Affects speed only. Measured on the 2-core dev machine (AMD EPYC
// Zen 3, 2 threads, 2026-12-05, B = 1, 32 / 8 heads, D = 128, 4k cache, Sq = 1-8), these kernels
// against BLAS: bf16 rows 1 (16 / 16 heads) / 4 / 8 / 16 / 32 ran 3.3-4.7x / 2.1-2.3x / 2.3x / 1.6x / 1.1x; float32
// (which BLAS reads in place) rows 4 and 8 1.0-1.2x, 16 0.9x, 32 0.8x; FP8 (table decode, before the
// vector one) rows 4 1.2x, 16 1.1x. docs/PERFORMANCE.md, "CPU decode".
constexpr int kMaxRowsFloat32 = 8;
constexpr int kMaxRowsOtherTypes = 32;
// FP8 (e4m3) tiles of at most this many rows read the codes in place (E4m3Row); larger ones decode
// each K / V row once into float32 scratch and read that (Float32Row), since in place every block of
// 4 rows would decode every code again. Affects speed only. In place against scratch (2-core dev
// machine, 2026-12-05, 32 / 8 heads, 4k cache, 3 rounds on a noisy machine): rows 1 (16 / 16 heads)
// 0.73-1.42x, 4 1.21-1.26x (8k cache: 1.05-1.39x), 8 0.86-1.16x, 16 0.72-0.85x, 32 0.63-0.66x.
constexpr int kMaxRowsFp8InPlace = 4;
// How far ahead of the row being read the kernels prefetch, in bytes of rows (at least one row,
// at most kMaxPrefetchRows rows): a core must keep about latency x bandwidth bytes in flight. On the
// dev machine 2-32 KiB, into L1 or L2, ran alike within its noise; no prefetch ~1.3x slower. Affects speed only.
constexpr int kPrefetchAheadBytes = 8192;
constexpr int kMaxPrefetchRows = 64;
constexpr int kCacheLineBytes = 64;

// Asks for the cache line at `address` (into every level), without waiting for it. An asm
// statement, not __builtin_prefetch: GCC 12 deletes loops whose body is only __builtin_prefetch
// (it counts them as free of side effects), and these loops are.
inline void prefetch_line(uintptr_t address) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht0 (%0)" : : "r"(address));  // a hint: never faults, reads nothing
#else
  __builtin_prefetch(reinterpret_cast<const void*>(address), 0, 3);
#endif
}

// The row pointers of one key tile, in the order the kernels read them: K rows [0, n), V rows
// [n, 2n), then the next tile's first K rows [2n, 2n + next) (prefetched only).
struct RowStream {
  const void** rows;  // [2 * block_k + kMaxPrefetchRows] pointers to each row's first element
  int n;              // keys in this tile
  int next;           // K rows of the next tile listed after the V rows (<= kMaxPrefetchRows)
  int k_row_bytes, v_row_bytes;
  int ahead;          // prefetch distance in rows; 0 = no prefetch (rows in a scratch buffer)

  const void* const* k_rows() const { return rows; }
  const void* const* v_rows() const { return rows + n; }
  int length() const { return 2 * n + next; }
  int row_bytes(int index) const { return index >= n && index < 2 * n ? v_row_bytes : k_row_bytes; }

  // Prefetches rows [begin, end) of the stream, shifted `ahead` rows forward (clipped to the stream).
  void prefetch_ahead_of(int begin, int end) const {
    if (ahead == 0) return;
    begin += ahead;
    end += ahead;
    end = end < length() ? end : length();
    for (int index = begin; index < end; ++index) {
      // every cache line the row touches, from its first byte's line on
      const uintptr_t row = reinterpret_cast<uintptr_t>(rows[index]);
      const uintptr_t first_line = row - row % kCacheLineBytes;
      const int lines = int((row + row_bytes(index) - first_line + kCacheLineBytes - 1) / kCacheLineBytes);
      for (int line = 0; line < lines; ++line) prefetch_line(first_line + uintptr_t(line) * kCacheLineBytes);
    }
  }
};

// Prefetch distance in rows for rows of `row_bytes`.
inline int prefetch_rows_for(int row_bytes) {
  const int rows = (kPrefetchAheadBytes + row_bytes - 1) / row_bytes;
  return rows < 1 ? 1 : (rows > kMaxPrefetchRows ? kMaxPrefetchRows : rows);
}

// S[rows x n] = alpha * Q K^T and O[rows x Dv] += P[rows x n] V for a tile of n = stream.n keys,
// Row being the storage type of the K / V rows (Float32Row, BFloat16Row, Float16Row below). Defined
// only where AVX2, FMA and F16C are (applies() says false elsewhere and nothing calls them).
template <class Row>
void scores(int rows, int head_dim, float alpha, const float* q, int64_t ld_q, const RowStream& stream, float* s,
            int64_t ld_s);
template <class Row>
void accumulate_pv(int rows, int head_dim_v, const float* p, int64_t ld_p, const RowStream& stream, float* o,
                   int64_t ld_o);

#if FLASHATTN_CPU_FEW_ROWS

// ---- element types: 8 consecutive elements of a row as 8 floats (exact), or one ----

struct Float32Row {
  static __m256 load8(const void* row, int c) { return _mm256_loadu_ps(static_cast<const float*>(row) + c); }
  static float load1(const void* row, int c) { return static_cast<const float*>(row)[c]; }
};
struct BFloat16Row {  // bfloat16 = the top half of a float32: widen and shift
  static __m256 load8(const void* row, int c) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(row) + c));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  }
  static float load1(const void* row, int c) { return to_float(bf16{static_cast<const uint16_t*>(row)[c]}); }
};
struct Float16Row {  // F16C's conversion is exact, as to_float(f16) is
  static __m256 load8(const void* row, int c) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(row) + c)));
  }
  static float load1(const void* row, int c) { return to_float(f16{static_cast<const uint16_t*>(row)[c]}); }
};
struct E4m3Row {  // float8 e4m3 codes, decoded as load_row decodes them; the caller applies the cache's scale
  static __m256 load8(const void* row, int c) { return e4m3x8_to_float(static_cast<const uint8_t*>(row) + c); }
  static float load1(const void* row, int c) { return e4m3_value_table()[static_cast<const uint8_t*>(row)[c]]; }
};

constexpr int kLanes = 8;

// The block kernels below keep their accumulators in arrays indexed by loops of compile-time trip
// counts. GCC 12 keeps such an array in registers only when the loops are unrolled before it
// decides (`#pragma GCC unroll`); otherwise it stores every accumulator to the stack after each
// FMA (seen in the profile: half the time of the P V block). The blocks are forced inline for
// the same reason: a call per block also paid a stack frame and a zeroing of the array.
#define FLASHATTN_FEW_ROWS_INLINE inline __attribute__((always_inline))
#define FLASHATTN_UNROLL _Pragma("GCC unroll 8")

// One vector whose lane i is the sum of the 8 lanes of v[i] (a transpose and add through hadd).
inline __m256 sum_lanes_of_8(const __m256 v[kLanes]) {
  const __m256 s01 = _mm256_hadd_ps(v[0], v[1]), s23 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 s45 = _mm256_hadd_ps(v[4], v[5]), s67 = _mm256_hadd_ps(v[6], v[7]);
  // per 128-bit half: [sum v0, sum v1, sum v2, sum v3] of that half's lanes
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  const __m256 low_halves = _mm256_permute2f128_ps(s0123, s4567, 0x20);
  const __m256 high_halves = _mm256_permute2f128_ps(s0123, s4567, 0x31);
  return _mm256_add_ps(low_halves, high_halves);
}

// s[r][kk] = alpha * q_r . k_kk for R rows of q and KEYS keys (R * KEYS <= 8 accumulators).
template <class Row, int R, int KEYS>
FLASHATTN_FEW_ROWS_INLINE void score_block(int head_dim, float alpha, const float* q, int64_t ld_q,
                                           const void* const* k_rows, float* s, int64_t ld_s) {
  static_assert(R * KEYS <= kLanes, "one accumulator per (row, key), at most 8");
  __m256 acc[kLanes];
  FLASHATTN_UNROLL
  for (int a = 0; a < kLanes; ++a) acc[a] = _mm256_setzero_ps();
  const int vector_end = head_dim / kLanes * kLanes;
  for (int c = 0; c < vector_end; c += kLanes) {
    __m256 q_chunk[R];
    FLASHATTN_UNROLL
    for (int r = 0; r < R; ++r) q_chunk[r] = _mm256_loadu_ps(q + r * ld_q + c);
    FLASHATTN_UNROLL
    for (int kk = 0; kk < KEYS; ++kk) {
      const __m256 k_chunk = Row::load8(k_rows[kk], c);
      FLASHATTN_UNROLL
      for (int r = 0; r < R; ++r) acc[r * KEYS + kk] = _mm256_fmadd_ps(q_chunk[r], k_chunk, acc[r * KEYS + kk]);
    }
  }
  alignas(32) float dot[kLanes];
  _mm256_store_ps(dot, sum_lanes_of_8(acc));
  for (int c = vector_end; c < head_dim; ++c) {  // head dims that are not a multiple of 8
    for (int kk = 0; kk < KEYS; ++kk) {
      const float k_value = Row::load1(k_rows[kk], c);
      for (int r = 0; r < R; ++r) dot[r * KEYS + kk] += q[r * ld_q + c] * k_value;
    }
  }
  for (int r = 0; r < R; ++r)
    for (int kk = 0; kk < KEYS; ++kk) s[r * ld_s + kk] = alpha * dot[r * KEYS + kk];
}

// Keys [j, j + KEYS_PER_GROUP) (8, or 1 at the end of a tile) for every row, in row blocks of 4
// rows x 2 keys, 3 x 2, 2 x 4 or 1 x 8: each q chunk serves 2-8 keys, each k chunk 1-4 rows. The
// stream rows `ahead` of these keys are prefetched a block at a time, spread over the first row
// block's work rather than issued at once.
template <class Row, int KEYS_PER_GROUP>
inline void score_key_group(int rows, int head_dim, float alpha, const float* q, int64_t ld_q, const RowStream& stream,
                            int j, float* s, int64_t ld_s) {
  constexpr int kKeys4 = KEYS_PER_GROUP < 2 ? 1 : 2, kKeys2 = KEYS_PER_GROUP < 4 ? 1 : 4;
  const void* const* k_rows = stream.k_rows() + j;
  s += j;
  int r = 0;
  for (; r + 4 <= rows; r += 4)
    for (int kk = 0; kk < KEYS_PER_GROUP; kk += kKeys4) {
      if (r == 0) stream.prefetch_ahead_of(j + kk, j + kk + kKeys4);
      score_block<Row, 4, kKeys4>(head_dim, alpha, q + r * ld_q, ld_q, k_rows + kk, s + r * ld_s + kk, ld_s);
    }
  if (rows - r == 3)
    for (int kk = 0; kk < KEYS_PER_GROUP; kk += kKeys4) {
      if (r == 0) stream.prefetch_ahead_of(j + kk, j + kk + kKeys4);
      score_block<Row, 3, kKeys4>(head_dim, alpha, q + r * ld_q, ld_q, k_rows + kk, s + r * ld_s + kk, ld_s);
    }
  if (rows - r == 2)
    for (int kk = 0; kk < KEYS_PER_GROUP; kk += kKeys2) {
      if (r == 0) stream.prefetch_ahead_of(j + kk, j + kk + kKeys2);
      score_block<Row, 2, kKeys2>(head_dim, alpha, q + r * ld_q, ld_q, k_rows + kk, s + r * ld_s + kk, ld_s);
    }
  if (rows - r == 1) {
    if (r == 0) stream.prefetch_ahead_of(j, j + KEYS_PER_GROUP);
    score_block<Row, 1, KEYS_PER_GROUP>(head_dim, alpha, q + r * ld_q, ld_q, k_rows, s + r * ld_s, ld_s);
  }
}

// S[rows x n] = alpha * Q K^T, K's rows read in place through stream.k_rows().
template <class Row>
void scores(int rows, int head_dim, float alpha, const float* q, int64_t ld_q, const RowStream& stream, float* s,
            int64_t ld_s) {
  constexpr int kKeyGroup = 8;
  int j = 0;
  for (; j + kKeyGroup <= stream.n; j += kKeyGroup)
    score_key_group<Row, kKeyGroup>(rows, head_dim, alpha, q, ld_q, stream, j, s, ld_s);
  for (; j < stream.n; ++j) score_key_group<Row, 1>(rows, head_dim, alpha, q, ld_q, stream, j, s, ld_s);
}

// o[r][c0, c0 + 8 C) += sum over keys jj of [0, keys) of p[r][jj] * v_jj[c0, c0 + 8 C), R rows.
// With `prefetch`, each key also prefetches the stream row `ahead` of its own, stream_index + jj.
template <class Row, int R, int C>
FLASHATTN_FEW_ROWS_INLINE void pv_block(int c0, int keys, const float* p, int64_t ld_p, const void* const* v_rows,
                                        float* o, int64_t ld_o, const RowStream* prefetch, int stream_index) {
  __m256 acc[R][C];
  FLASHATTN_UNROLL
  for (int r = 0; r < R; ++r) {
    FLASHATTN_UNROLL
    for (int cc = 0; cc < C; ++cc) acc[r][cc] = _mm256_loadu_ps(o + r * ld_o + c0 + kLanes * cc);
  }
  for (int jj = 0; jj < keys; ++jj) {
    if (prefetch != nullptr) prefetch->prefetch_ahead_of(stream_index + jj, stream_index + jj + 1);
    __m256 v_chunk[C];
    FLASHATTN_UNROLL
    for (int cc = 0; cc < C; ++cc) v_chunk[cc] = Row::load8(v_rows[jj], c0 + kLanes * cc);
    FLASHATTN_UNROLL
    for (int r = 0; r < R; ++r) {
      const __m256 p_rj = _mm256_broadcast_ss(p + r * ld_p + jj);
      FLASHATTN_UNROLL
      for (int cc = 0; cc < C; ++cc) acc[r][cc] = _mm256_fmadd_ps(p_rj, v_chunk[cc], acc[r][cc]);
    }
  }
  FLASHATTN_UNROLL
  for (int r = 0; r < R; ++r) {
    FLASHATTN_UNROLL
    for (int cc = 0; cc < C; ++cc) _mm256_storeu_ps(o + r * ld_o + c0 + kLanes * cc, acc[r][cc]);
  }
}

// Every column of R rows for keys [0, keys): C chunks of 8 columns at a time (R * C <= 8
// accumulators), then single chunks, then the columns past the last multiple of 8.
// The first column block prefetches (when `prefetch`), one stream row per key.
template <class Row, int R, int C>
inline void pv_rows(int head_dim_v, int keys, const float* p, int64_t ld_p, const void* const* v_rows, float* o,
                    int64_t ld_o, const RowStream* prefetch, int stream_index) {
  static_assert(R * C <= kLanes, "at most 8 accumulators");
  const int vector_end = head_dim_v / kLanes * kLanes;
  int c0 = 0;
  for (; c0 + C * kLanes <= vector_end; c0 += C * kLanes, prefetch = nullptr)
    pv_block<Row, R, C>(c0, keys, p, ld_p, v_rows, o, ld_o, prefetch, stream_index);
  for (; c0 < vector_end; c0 += kLanes, prefetch = nullptr)
    pv_block<Row, R, 1>(c0, keys, p, ld_p, v_rows, o, ld_o, prefetch, stream_index);
  if (prefetch != nullptr) prefetch->prefetch_ahead_of(stream_index, stream_index + keys);  // Dv < 8
  for (int c = vector_end; c < head_dim_v; ++c)
    for (int r = 0; r < R; ++r) {
      float sum = o[r * ld_o + c];
      for (int jj = 0; jj < keys; ++jj) sum += p[r * ld_p + jj] * Row::load1(v_rows[jj], c);
      o[r * ld_o + c] = sum;
    }
}

// O[rows x Dv] += P[rows x n] V, V's rows read in place through stream.v_rows(), in groups of
// keys small enough to stay in L1 while every column pass reads them.
template <class Row>
void accumulate_pv(int rows, int head_dim_v, const float* p, int64_t ld_p, const RowStream& stream, float* o,
                   int64_t ld_o) {
  constexpr int kKeyGroup = 32;
  const void* const* v_rows = stream.v_rows();
  for (int j = 0; j < stream.n; j += kKeyGroup) {
    const int keys = stream.n - j < kKeyGroup ? stream.n - j : kKeyGroup;
    const RowStream* prefetch = &stream;  // by the first row block only
    int r = 0;
    for (; r + 4 <= rows; r += 4, prefetch = nullptr)
      pv_rows<Row, 4, 2>(head_dim_v, keys, p + r * ld_p + j, ld_p, v_rows + j, o + r * ld_o, ld_o, prefetch,
                         stream.n + j);
    if (rows - r == 3)
      pv_rows<Row, 3, 2>(head_dim_v, keys, p + r * ld_p + j, ld_p, v_rows + j, o + r * ld_o, ld_o, prefetch,
                         stream.n + j);
    if (rows - r == 2)
      pv_rows<Row, 2, 4>(head_dim_v, keys, p + r * ld_p + j, ld_p, v_rows + j, o + r * ld_o, ld_o, prefetch,
                         stream.n + j);
    if (rows - r == 1)
      pv_rows<Row, 1, 4>(head_dim_v, keys, p + r * ld_p + j, ld_p, v_rows + j, o + r * ld_o, ld_o, prefetch,
                         stream.n + j);
  }
}

#endif  // FLASHATTN_CPU_FEW_ROWS

// Whether a tile of `rows` query rows over K / V of type `kv_dtype` takes these kernels (FP8 caches
// too: see fp8_in_place).
inline bool applies(int rows, fa_dtype kv_dtype) {
  return FLASHATTN_CPU_FEW_ROWS && rows <= (kv_dtype == FA_FLOAT32 ? kMaxRowsFloat32 : kMaxRowsOtherTypes);
}

// Whether a few-rows tile over an FP8 cache reads the codes in place (E4m3Row) rather than from
// float32 scratch.
inline bool fp8_in_place(int rows) { return rows <= kMaxRowsFp8InPlace; }

}  // namespace flashattn::cpu::few_rows
