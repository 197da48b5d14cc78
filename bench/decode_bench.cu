// flashattn_decode_bench: the CUDA KV-cache (decode) path through the public API, as bytes of K/V read per
// second, beside the device's streaming-read bandwidth measured in the same run.
//
// Sweep (the issue's): bf16, D = 128, 32 query heads and 8 K/V heads (GQA 4), one new query per sequence,
// batch 1..256, cache 1k..128k keys (every sequence full: cache_seqlens = S), contiguous cache and paged
// cache (page 16, block ids shuffled; "paged-seq": ids in order, to tell table/translation costs apart;
// "paged-local": ids shuffled only within each 2 MiB of the pool (one large page of the allocation), so that a
// sequence's blocks are scattered as in "paged" but reach as few translation pages as "paged-seq"; "paged-sorted" and
// "paged-sortedN": shuffled, then each table row sorted, whole or in runs of N entries: see Shape::sorted_run;
// "paged-rev": as "paged-seq", each row's ids in descending order: see Shape::reversed_pages; "paged-lifo" and
// "paged-lowest": the rows a block allocator hands out after churn, most recently freed block first or lowest free id
// first: see churned_table);
// "contiguous-idx": the contiguous cache through cache_batch_idx (Shape::batch_idx); "contiguous-leftpad": the
// contiguous cache with cache_leftpad, all zeros (Shape::left_pad: the same keys, through the kernel for left padding).
// Points whose K/V exceed --budget-gib are skipped (and listed).
// K/V bytes of a call = B * S * Hk * (D + Dv) * 2; with --kv fp8 (a float8 e4m3 cache, k_scale = v_scale =
// 1/256, random finite codes) 1 byte per element: B * S * Hk * (D + Dv). Each call is planned once (fa_plan_kvcache) and runs with
// the planned workspace; the timed unit is a CUDA graph of one call per copy of the inputs, where copies
// are added until they exceed 2x the L2 (so every call reads from HBM, as in serving), and are at least 4
// where they fit in 4 GiB (kMinCopies); time per call = graph time / copies, median over repetitions.
// "eager" is one call launched normally (launch overhead included), for reference.
// Streaming read: a read-only kernel (16-byte loads, grid-stride) over 4 GiB; device copy: cudaMemcpy D2D,
// read + write bytes counted (DESIGN.md's anchor, 4.27 TB/s on the H200).
// Same-size read floor ("floor us", "vs floor"): per point, a read-only kernel over exactly that point's K and V
// buffers, timed like the calls (a graph of one read per copy), best of four grid sizes. The 4 GiB rate is a
// large-transfer asymptote; a 4 MiB read cannot reach it (launch, ramp-up, drain), and "vs floor" says how
// close a call comes to the time those bytes need at all.
// Layout floor ("layout us"): per point, a read-only kernel that reads the cache in its layout as attention must
// (per sequence and K/V head, that head's row of every key, through the block table when paged; read_slices_kernel),
// best of the split counts 1-64. Its paged / contiguous ratio is what the scattered blocks cost any such reader.
// Rows floor (JSON "us_rows_floor" only): the same kernel reading whole cache rows (every K/V head per CTA), what a
// kernel whose CTA took all K/V heads of a key range would read (2026-12-03: no closer to contiguous when paged).
//
// Order: per point (B, S), every layout in turn, --rounds times (fresh inputs each time), so that paged / contiguous
// compares measurements seconds apart; bench/compare_decode.py takes the median of the rounds.
// Tuning sweeps (one GPU run tells the best heuristic; every knob affects speed only):
//   --splits 0,8,16,...   split counts to time at every point (0 = the library's heuristic)
//   --runners lib,...     "lib" = the public API (timed once per split count: the knobs below are not its);
//                         with -DFLASHATTN_BUILD_TUNING=ON (target flashattn_decode_tiles) also tile variants
//                         such as m16n64w4s3, and e4m3_m16n128w4s3 for --kv fp8 ("all": every one for the
//                         cache of --kv), launched directly with the knobs below and checked against "lib"'s
//                         output; "tl_m16n64w4s3" is the library's tile with a timeline probe: after its timing,
//                         the phases of every CTA of one graph launch (report_timeline; per call also the
//                         distinct SMs its CTAs ran on, and "shared": its streaming CTAs that shared an SM; over all
//                         calls, the loop phase per SM and per CTA index, even calls against odd ones)
//   --pdl 0,1             variants: programmatic dependent launch (DecodeArgs::programmatic_launch)
//   --min-tiles N         variants: DecodeArgs::min_tiles_per_split
//   --cluster -1,0,1      variants: the splits merge in a thread-block cluster (1), through the combine kernel (0),
//                         or as the library's rule says (-1, the default); 1 where splits are 2..16, else 0
//   --cluster-policy 0,1,2 variants: cudaClusterSchedulingPolicy of the cluster launch (0 default, 1 spread, 2 load
//                         balancing)
//   --smem-pad 0,N        variants: N bytes of dynamic shared memory beyond the kernel's (fewer CTAs per SM)
//   --early -1,0,1        variants: DecodeArgs::early_tiles (-1: the library's, kEarlyTiles)
//   --prefetch -1,0,1     variants: DecodeArgs::prefetch_inputs (-1: the library's, kPrefetchInputs)
//   --speculate -1,0,1,2,3 variants: DecodeArgs::speculative_tiles (-1: the library's; 2, 3: wrong guesses, for the check)
//
// Usage: flashattn_decode_bench [--json FILE] [--batches 1,4,16,64,256] [--caches 1024,...,131072]
//                               [--heads 32:8] [--dim 128] [--page 16] [--dtype bf16|f16] [--kv 16|fp8]
//                               [--layouts contiguous,contiguous-idx,paged,paged-seq,paged-rev,...] [--budget-gib 32] [--reps 10] [--rounds 1]
//                               [--splits 0,...] [--runners lib,...] [--pdl 0,1] [--min-tiles N]
//                               [--cluster -1,0,1] [--cluster-policy 0,1,2] [--smem-pad 0,N] [--early -1,0,1]
//                               [--prefetch -1,0,1] [--speculate -1,0,1,2,3]
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <ctime>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "flashattn/flashattn.hpp"

#if defined(FLASHATTN_DECODE_TILE_VARIANTS)
#include "api/validate.hpp"
#include "cuda/decode/decode_launch.cuh"
#include "cuda/decode/decode_plan.hpp"
#endif

namespace {

constexpr int64_t kStreamBytes = int64_t(4) << 30;  // the streaming-read buffer
constexpr int kStreamThreads = 256;
constexpr int kMaxCopies = 64;
// At least kMinCopies copies where they fit in kCopyBudgetBytes: the graph's own launch (a few us) is then shared
// by 4 calls. With one copy (K/V above 2x the L2 but below 1 GiB, e.g. B = 1 at 32k-128k) it was added whole to
// one call. bench/peers_decode.py uses the same rule.
constexpr int64_t kMinCopies = 4;
constexpr int64_t kCopyBudgetBytes = int64_t(4) << 30;

// Reads `words` 16-byte words; the XOR of everything read is stored only if it hits a value that random data
// practically never gives, so the loads cannot be optimised away and almost nothing is written.
__global__ void stream_read_kernel(const uint4* data, int64_t words, unsigned int* sink) {
  uint4 acc = make_uint4(0, 0, 0, 0);
  for (int64_t w = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; w < words; w += int64_t(gridDim.x) * blockDim.x) {
    const uint4 v = __ldcs(data + w);  // streaming: do not keep in L2
    acc.x ^= v.x, acc.y ^= v.y, acc.z ^= v.z, acc.w ^= v.w;
  }
  if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x9E3779B9u) *sink = acc.x;
}

// The same-size read floor of a point: a read-only kernel over exactly the point's K and V buffers (2 x `words`
// 16-byte words), kReadUnroll independent loads in flight per thread. What any kernel that must read those
// bytes once, launched the same way, cannot beat (launch, ramp-up and drain included): at small batches and
// short caches it lies far below the 4 GiB streaming rate.
constexpr int kReadUnroll = 4;
__global__ void read_pair_kernel(const uint4* k, const uint4* v, int64_t words, unsigned int* sink) {
  uint4 acc = make_uint4(0, 0, 0, 0);
  const int64_t total = 2 * words, stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t w0 = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; w0 < total; w0 += kReadUnroll * stride) {
    uint4 x[kReadUnroll];
#pragma unroll
    for (int u = 0; u < kReadUnroll; ++u) {  // all loads issued before any is used
      const int64_t w = w0 + u * stride;
      x[u] = w < total ? __ldcs(w < words ? k + w : v + (w - words)) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kReadUnroll; ++u) acc.x ^= x[u].x, acc.y ^= x[u].y, acc.z ^= x[u].z, acc.w ^= x[u].w;
  }
  if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x9E3779B9u) *sink = acc.x;
}

// The layout floor of a point: a read-only kernel that reads K and V as an attention kernel must, one CTA per
// (split of the keys, K/V head, sequence) reading that head's row of every key (D 16-bit elements, 256 bytes at
// D = 128, one K/V row stride apart), through the block table for a paged cache (its ids staged in shared memory
// first, kSliceIds at a time), with no arithmetic. With heads_per_cta > 1 a CTA reads that many neighbouring heads
// of each row (heads_per_cta = Hk: whole cache rows, the "rows floor", what a kernel whose CTA took every K/V head
// of a key range would read). Timed for both layouts, it tells how much of a paged call's gap to a
// contiguous one the scattered blocks cost any reader of these bytes in this order (bench/compare_decode.py's
// "lay p/c" column). Assumes the bench's own layouts: contiguous [B, S, Hk, D], paged [blocks, page, Hk, D]
// with a power-of-two page; every load is a 16-byte word, kSliceUnroll rows of K and of V in flight per thread.
constexpr int kSliceThreads = 256, kSliceUnroll = 8, kSliceIds = 2048;
__global__ void read_slices_kernel(const uint4* k, const uint4* v, const int32_t* table, int64_t table_stride,
                                   int page_shift, int64_t cache, int heads_k, int heads_per_cta, int head_words,
                                   int64_t rows_per_split, unsigned int* sink) {
  __shared__ int32_t ids_smem[kSliceIds];
  const int h = int(blockIdx.y) * heads_per_cta;  // the CTA's first head
  const int row_words = heads_per_cta * head_words;  // 16-byte words the CTA reads of each row
  const int64_t b = blockIdx.z;
  const int64_t begin = int64_t(blockIdx.x) * rows_per_split, end = cache < begin + rows_per_split ? cache : begin + rows_per_split;
  const int rows_per_step = kSliceThreads / row_words;  // row_words divides kSliceThreads (the caller checks)
  const int t_row = int(threadIdx.x) / row_words, t_word = int(threadIdx.x) % row_words;
  const int64_t page_mask = (int64_t(1) << page_shift) - 1;
  const int64_t chunk_rows = table != nullptr ? int64_t(kSliceIds) << page_shift : (end > begin ? end - begin : 1);
  uint4 acc = make_uint4(0, 0, 0, 0);
  for (int64_t c0 = begin; c0 < end; c0 += chunk_rows) {  // begin is a multiple of the page (the caller's rows_per_split)
    const int64_t c1 = end < c0 + chunk_rows ? end : c0 + chunk_rows;
    if (table != nullptr) {
      __syncthreads();  // the previous chunk's ids are no longer read
      const int64_t first_block = c0 >> page_shift, blocks = ((c1 - 1) >> page_shift) - first_block + 1;
      for (int64_t i = threadIdx.x; i < blocks; i += kSliceThreads) ids_smem[i] = table[b * table_stride + first_block + i];
      __syncthreads();
    }
    for (int64_t r0 = c0 + t_row; r0 < c1; r0 += int64_t(kSliceUnroll) * rows_per_step) {
      uint4 x[2 * kSliceUnroll];
#pragma unroll
      for (int u = 0; u < kSliceUnroll; ++u) {  // all loads issued before any is used
        const int64_t r = r0 + int64_t(u) * rows_per_step;
        if (r < c1) {
          const int64_t pool_row = table != nullptr ? (int64_t(ids_smem[(r - c0) >> page_shift]) << page_shift) + (r & page_mask)
                                                    : b * cache + r;
          const int64_t w = (pool_row * heads_k + h) * head_words + t_word;
          x[2 * u] = __ldcs(k + w);
          x[2 * u + 1] = __ldcs(v + w);
        } else {
          x[2 * u] = x[2 * u + 1] = make_uint4(0, 0, 0, 0);
        }
      }
#pragma unroll
      for (int u = 0; u < 2 * kSliceUnroll; ++u) acc.x ^= x[u].x, acc.y ^= x[u].y, acc.z ^= x[u].z, acc.w ^= x[u].w;
    }
  }
  if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x9E3779B9u) *sink = acc.x;
}

// Fills 16-bit elements with hashed values in [-1, 1) (never zeros, no host traffic).
__global__ void fill_kernel(uint16_t* data, int64_t count, uint32_t seed, bool bf16) {
  for (int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; n < count; n += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(n) * 0x9E3779B1u ^ uint32_t(n >> 32) ^ seed;
    h ^= h >> 16, h *= 0x85EBCA6Bu, h ^= h >> 13, h *= 0xC2B2AE35u, h ^= h >> 16;
    const float x = float(h >> 8) * (2.f / 16777216.f) - 1.f;
    data[n] = bf16 ? __bfloat16_as_ushort(__float2bfloat16(x)) : __half_as_ushort(__float2half(x));
  }
}

// Fills float8 e4m3 codes with hashed bytes, NaN codes (0x7F, 0xFF) replaced by 0x7E / 0xFE.
__global__ void fill_fp8_kernel(uint8_t* data, int64_t count, uint32_t seed) {
  for (int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; n < count; n += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(n) * 0x9E3779B1u ^ uint32_t(n >> 32) ^ seed;
    h ^= h >> 16, h *= 0x85EBCA6Bu, h ^= h >> 13, h *= 0xC2B2AE35u, h ^= h >> 16;
    const uint8_t code = uint8_t(h >> 24);
    data[n] = (code & 0x7F) == 0x7F ? uint8_t(code ^ 1u) : code;
  }
}

void fill(void* data, int64_t count, uint32_t seed, fa_dtype dtype) {
  if (dtype == FA_FLOAT8_E4M3) fill_fp8_kernel<<<1024, 256>>>(static_cast<uint8_t*>(data), count, seed);
  else fill_kernel<<<1024, 256>>>(static_cast<uint16_t*>(data), count, seed, dtype == FA_BFLOAT16);
  CHECK_CUDA(cudaGetLastError());
}
constexpr float kFp8BenchScale = 1.f / 256.f;  // --kv fp8: k_scale = v_scale (codes up to 448: values up to 1.75)

// Input memory comes from one arena reserved at the start and reused from offset 0 by every point, as a
// serving engine allocates its KV pool once. With a cudaMalloc / cudaFree per buffer, the same point measured
// up to 15% slower late in a sweep than in a fresh process (H200, 2026-11-30 07:36 UTC: paged B = 4,
// S = 128k: 3.83 TB/s after the contiguous sweep, 4.39 alone; the contiguous pass ran first, so paged /
// contiguous read 0.85 instead of 0.98), which made the sweep's numbers depend on its order.
struct Arena {
  char* base = nullptr;
  int64_t size = 0, used = 0;
};
Arena g_arena;

struct Buffer {
  void* data = nullptr;
  int64_t bytes = 0;
  bool owned = false;  // cudaMalloc'ed (the arena was full or not reserved)
  Buffer() = default;
  explicit Buffer(int64_t n) : bytes(n) {
    const int64_t align = n >= (int64_t(1) << 20) ? (int64_t(2) << 20) : 256;  // large buffers 2 MiB-aligned, as cudaMalloc does
    const int64_t offset = (g_arena.used + align - 1) / align * align;
    if (g_arena.base != nullptr && offset + n <= g_arena.size) {
      data = g_arena.base + offset;
      g_arena.used = offset + n;
    } else {
      CHECK_CUDA(cudaMalloc(&data, size_t(std::max<int64_t>(n, 16))));
      owned = true;
    }
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& o) noexcept : data(o.data), bytes(o.bytes), owned(o.owned) { o.data = nullptr; }
  Buffer& operator=(Buffer&& o) noexcept {
    std::swap(data, o.data);
    std::swap(bytes, o.bytes);
    std::swap(owned, o.owned);
    return *this;
  }
  ~Buffer() {
    if (data && owned) cudaFree(data);
  }
};

fa_tensor tensor(void* data, std::vector<int64_t> shape, fa_dtype dtype) {
  return fa_tensor_contiguous(data, int32_t(shape.size()), shape.data(), dtype, FA_DEVICE_CUDA, 0);
}

struct Shape {
  int64_t batch, cache;
  int heads_q, heads_k, dim, page;
  bool paged;
  bool sequential_pages;  // paged: block ids in order (else shuffled)
  bool local_pages;       // paged, not sequential: ids shuffled within each 2 MiB of the pool only
  fa_dtype dtype;
  bool fp8_cache;  // K/V cache float8 e4m3 (1 byte per element)
  // paged, shuffled: each sequence's table row then sorted ascending in runs of this many entries (0: not sorted).
  // "paged-sorted" (whole rows) and "paged-sortedN" (runs of N entries) are probes: the pool's blocks as scattered as
  // in "paged", visited in address order (what a kernel that reorders its blocks would see).
  int sorted_run = 0;
  // contiguous, "contiguous-idx": the call addresses the cache through cache_batch_idx (sequence b in entry B - 1 - b),
  // what a server with a slot cache passes.
  bool batch_idx = false;
  // contiguous, "contiguous-leftpad": the call passes cache_leftpad, every entry 0: the keys, the bytes and the output of
  // "contiguous", through the library's kernel instantiation for left padding (its cost against the one without).
  bool left_pad = false;
  // paged, sequential: each table row's ids in descending order ("paged-rev": a sequence's blocks in one run of the
  // pool, visited from its end; what a LIFO free list gives the next sequence after one is released in table order).
  bool reversed_pages = false;
  // paged: the table a block allocator gives after churn (churned_table): 1 = most recently freed block first (a LIFO
  // free list, "paged-lifo"), 2 = lowest free id first ("paged-lowest"); 0 = not churned.
  int churn_policy = 0;
  fa_dtype cache_dtype() const { return fp8_cache ? FA_FLOAT8_E4M3 : dtype; }
  int64_t kv_bytes() const { return batch * cache * heads_k * int64_t(2 * dim) * (fp8_cache ? 1 : 2); }
};

// The block table (batch x per_seq ids of a pool of batch x per_seq blocks) that an allocator hands out under churn.
// Older sequences first fill the pool, growing one block per step each, interleaved, to random lengths of 1 to per_seq
// blocks (2 x batch of them, or fewer when the pool is full). Then the batch's sequences grow one block per step each,
// interleaved, from empty to per_seq blocks; before each step, older sequences in a random order finish (their blocks
// freed in table order) until the step's blocks are free. `lowest`: the allocator hands out the lowest free id, else
// the most recently freed block (a LIFO free list, as the library's PagedKvCache has). The free list
// starts in id order either way.
std::vector<int32_t> churned_table(int64_t batch, int64_t per_seq, bool lowest, std::mt19937_64& rng) {
  const int64_t blocks = batch * per_seq;
  std::vector<int32_t> free_list;  // lifo: taken from the back; lowest: a min-heap
  for (int64_t n = blocks - 1; n >= 0; --n) free_list.push_back(int32_t(n));
  if (lowest) std::make_heap(free_list.begin(), free_list.end(), std::greater<int32_t>());
  auto take = [&]() {
    if (lowest) std::pop_heap(free_list.begin(), free_list.end(), std::greater<int32_t>());
    const int32_t id = free_list.back();
    free_list.pop_back();
    return id;
  };
  auto give = [&](int32_t id) {
    free_list.push_back(id);
    if (lowest) std::push_heap(free_list.begin(), free_list.end(), std::greater<int32_t>());
  };
  std::vector<std::vector<int32_t>> older(static_cast<size_t>(2 * batch));
  std::vector<int64_t> target(older.size());
  for (int64_t& t : target) t = 1 + int64_t(rng() % uint64_t(per_seq));
  for (bool grew = true; grew;) {  // one block per older sequence per step, until each has its length or the pool is full
    grew = false;
    for (size_t i = 0; i < older.size() && !free_list.empty(); ++i)
      if (int64_t(older[i].size()) < target[i]) {
        older[i].push_back(take());
        grew = true;
      }
    if (free_list.empty()) break;
  }
  std::vector<size_t> finish_order(older.size());
  std::iota(finish_order.begin(), finish_order.end(), size_t(0));
  std::shuffle(finish_order.begin(), finish_order.end(), rng);
  size_t finished = 0;
  std::vector<int32_t> table(static_cast<size_t>(blocks));
  for (int64_t step = 0; step < per_seq; ++step) {
    while (int64_t(free_list.size()) < batch && finished < finish_order.size())
      for (int32_t id : older[finish_order[finished++]]) give(id);
    for (int64_t b = 0; b < batch; ++b) table[size_t(b * per_seq + step)] = take();
  }
  return table;
}

// One copy of a point's inputs (device memory) and its call arguments.
struct Copy {
  Buffer q, k, v, out, lse, seqlens, table, slots, leftpad;
  fa_kvcache_args args{};
};

Copy make_copy(const Shape& s, uint32_t seed, std::mt19937_64& rng) {
  Copy c;
  // Paged: the pool holds whole blocks (the last one of a sequence may be partly used).
  const int64_t rows_per_seq = s.paged ? (s.cache + s.page - 1) / s.page * s.page : s.cache;
  const int64_t q_elems = s.batch * s.heads_q * s.dim, kv_elems = s.batch * rows_per_seq * s.heads_k * s.dim;
  c.q = Buffer(q_elems * 2);
  const int64_t kv_element = s.fp8_cache ? 1 : 2;
  c.k = Buffer(kv_elems * kv_element);
  c.v = Buffer(kv_elems * kv_element);
  c.out = Buffer(q_elems * 2);
  c.lse = Buffer(s.batch * s.heads_q * 4);
  c.seqlens = Buffer(s.batch * 4);
  fill(c.q.data, q_elems, seed, s.dtype);
  fill(c.k.data, kv_elems, seed + 1, s.cache_dtype());
  fill(c.v.data, kv_elems, seed + 2, s.cache_dtype());
  const std::vector<int32_t> lengths(size_t(s.batch), int32_t(s.cache));
  CHECK_CUDA(cudaMemcpy(c.seqlens.data, lengths.data(), lengths.size() * 4, cudaMemcpyHostToDevice));
  fa_kvcache_args& a = c.args;
  a.q = tensor(c.q.data, {s.batch, 1, s.heads_q, s.dim}, s.dtype);
  a.out = tensor(c.out.data, {s.batch, 1, s.heads_q, s.dim}, s.dtype);
  a.lse = tensor(c.lse.data, {s.batch, s.heads_q, 1}, FA_FLOAT32);
  a.cache_seqlens = tensor(c.seqlens.data, {s.batch}, FA_INT32);
  if (s.fp8_cache) a.k_scale = a.v_scale = kFp8BenchScale;
  if (s.paged) {
    const int64_t per_seq = (s.cache + s.page - 1) / s.page, blocks = s.batch * per_seq;
    std::vector<int32_t> ids(static_cast<size_t>(blocks));
    std::iota(ids.begin(), ids.end(), 0);
    if (s.churn_policy != 0) {
      ids = churned_table(s.batch, per_seq, s.churn_policy == 2, rng);
    } else if (s.local_pages) {  // within each 2 MiB window of the pool (cudaMalloc aligns large buffers to 2 MiB)
      const int64_t block_bytes = int64_t(s.page) * s.heads_k * s.dim * (s.fp8_cache ? 1 : 2);
      const int64_t window = std::max<int64_t>(1, (int64_t(2) << 20) / block_bytes);
      for (int64_t w = 0; w < blocks; w += window) std::shuffle(ids.begin() + w, ids.begin() + std::min(blocks, w + window), rng);
    } else if (s.reversed_pages) {
      for (int64_t row = 0; row < s.batch; ++row) std::reverse(ids.begin() + row * per_seq, ids.begin() + (row + 1) * per_seq);
    } else if (!s.sequential_pages) {
      std::shuffle(ids.begin(), ids.end(), rng);  // a serving cache's pages are scattered
      if (s.sorted_run > 0)
        for (int64_t row = 0; row < s.batch; ++row)
          for (int64_t e = 0; e < per_seq; e += s.sorted_run)
            std::sort(ids.begin() + row * per_seq + e, ids.begin() + row * per_seq + std::min<int64_t>(per_seq, e + s.sorted_run));
    }
    c.table = Buffer(blocks * 4);
    CHECK_CUDA(cudaMemcpy(c.table.data, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
    a.k_cache = tensor(c.k.data, {blocks, s.page, s.heads_k, s.dim}, s.cache_dtype());
    a.v_cache = tensor(c.v.data, {blocks, s.page, s.heads_k, s.dim}, s.cache_dtype());
    a.block_table = tensor(c.table.data, {s.batch, per_seq}, FA_INT32);
  } else {
    a.k_cache = tensor(c.k.data, {s.batch, s.cache, s.heads_k, s.dim}, s.cache_dtype());
    a.v_cache = tensor(c.v.data, {s.batch, s.cache, s.heads_k, s.dim}, s.cache_dtype());
    if (s.batch_idx) {
      std::vector<int32_t> slots(static_cast<size_t>(s.batch));
      for (int64_t b = 0; b < s.batch; ++b) slots[size_t(b)] = int32_t(s.batch - 1 - b);
      c.slots = Buffer(s.batch * 4);
      CHECK_CUDA(cudaMemcpy(c.slots.data, slots.data(), slots.size() * 4, cudaMemcpyHostToDevice));
      a.cache_batch_idx = tensor(c.slots.data, {s.batch}, FA_INT32);
    }
    if (s.left_pad) {
      c.leftpad = Buffer(s.batch * 4);
      CHECK_CUDA(cudaMemset(c.leftpad.data, 0, size_t(s.batch) * 4));
      a.cache_leftpad = tensor(c.leftpad.data, {s.batch}, FA_INT32);
    }
  }
  return c;
}

// "paged-sortedN" (N >= 1): table rows sorted in runs of N entries (Shape::sorted_run); 0 for any other name.
int sorted_run_of(const std::string& layout) {
  const std::string prefix = "paged-sorted";
  if (layout.rfind(prefix, 0) != 0 || layout.size() == prefix.size()) return 0;
  const std::string digits = layout.substr(prefix.size());
  if (digits.find_first_not_of("0123456789") != std::string::npos || digits.size() > 6) return 0;
  return std::stoi(digits);
}

// Quotes would break the JSON string of an error message.
std::string json_safe(std::string s) {
  std::replace(s.begin(), s.end(), '"', '\'');
  return s;
}

// The knobs of one timed configuration (all affect speed only). -1: the library's default.
struct Knobs {
  std::string runner = "lib";
  int splits = 0;  // 0: the heuristic's
  int pdl = -1, min_tiles = -1;
  int cluster = -1, cluster_policy = 0, smem_pad = 0, early = -1, prefetch = -1, spec = -1;  // variants: see the header
  // The variant knobs that differ from their defaults, for the printed rows ("" when none).
  std::string tag() const {
    std::string t;
    if (cluster >= 0) t += " cl" + std::to_string(cluster);
    if (cluster_policy != 0) t += " pol" + std::to_string(cluster_policy);
    if (smem_pad != 0) t += " pad" + std::to_string(smem_pad);
    if (early >= 0) t += " early" + std::to_string(early);
    if (prefetch >= 0) t += " pf" + std::to_string(prefetch);
    if (spec >= 0) t += " sp" + std::to_string(spec);
    return t;
  }
};

struct Result {
  double us_graph = -1, us_eager = -1, kv_tbs = -1;
  double us_read_floor = -1;  // the same-size read floor of the shape (time_read_floor)
  double us_layout_floor = -1;  // the layout floor of the shape (time_layout_floor; -1: not measured)
  int layout_floor_splits = 0;  // its fastest split count
  double us_rows_floor = -1;    // the layout floor reading whole cache rows, every K/V head per CTA (-1: not measured)
  int rows_floor_splits = 0;    // its fastest split count
  double check = -1;  // variants: relative L2 difference of out from the library's (lib: -1)
  int splits = 0, copies = 0;
  std::string kernel, error;
  std::string timeline;  // "tl_" variants: report_timeline's summary
};

// How one configuration runs a call on copy c: through the public API, or a tile variant launched directly.
using CallFn = std::function<flashattn::Status(Copy& c)>;

#if defined(FLASHATTN_DECODE_TILE_VARIANTS)
// ---- tile variants (tuning only): the decode kernel instantiated here with other tiles ----
namespace cu = flashattn::cuda;
namespace dec = flashattn::cuda::decode;

struct Variant {
  const char* name;
  bool fp8_cache;  // compiled for a float8 e4m3 cache (--kv fp8), else for the 16-bit one
  int block_m, block_n, warps, stages;
  int64_t smem_bytes;
  flashattn::Status (*launch)(const dec::DecodeArgs&, const dec::DecodePlan&, cudaStream_t, const cu::DecodeLaunchTuning&);
  flashattn::Status (*prepare)(int device, bool* programmatic);
  int (*max_active_clusters)(int cluster, int smem_pad, int policy);  // contiguous kernel; -1: the query failed
};
// A config type of this file's own: the library instantiates decode_kernel<DecodeConfig<...>> too, and two
// translation units registering the same kernel (non-rdc) confuse the runtime (cudaFuncSetAttribute on
// one copy, the launch on the other: "invalid argument"). Deriving a new type gives the variants their own
// kernels.
// The variants time calls without cache_leftpad: they leave its kernel out (build time).
template <int M, int N, int W, int S, bool kFp8 = false>
struct BenchConfig : dec::DecodeConfig<__nv_bfloat16, 128, M, N, W, S, false, kFp8> {
  static constexpr bool kLeftPadKernel = false;
};
// How many clusters of `cluster` CTAs of config C's contiguous kernel can be resident at once
// (cudaOccupancyMaxActiveClusters), with `smem_pad` more bytes of shared memory and the scheduling policy `policy`.
template <typename C>
int max_active_clusters(int cluster, int smem_pad, int policy) {
  bool programmatic = false;
  if (!cu::prepare_decode_kernel<C>(0, &programmatic).ok()) return -1;
  const auto kernel = cu::decode_kernel_of<C>(cu::kContiguousKernel);
  const int smem = cu::decode_smem_bytes<C>() + smem_pad;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) return cudaGetLastError(), -1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(unsigned(cluster));
  config.blockDim = dim3(C::kThreads);
  config.dynamicSmemBytes = size_t(smem);
  cudaLaunchAttribute attribute[2];
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = unsigned(cluster);
  attribute[0].val.clusterDim.y = 1;
  attribute[0].val.clusterDim.z = 1;
  attribute[1].id = cudaLaunchAttributeClusterSchedulingPolicyPreference;
  attribute[1].val.clusterSchedulingPolicyPreference = static_cast<cudaClusterSchedulingPolicy>(policy);
  config.attrs = attribute;
  config.numAttrs = 2;
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) != cudaSuccess) return cudaGetLastError(), -1;
  return clusters;
}
#define DECODE_VARIANT_OF(NAME, FP8, M, N, W, S)                                                                     \
  Variant {                                                                                                          \
    NAME, FP8, M, N, W, S, cu::decode_smem_bytes<BenchConfig<M, N, W, S, FP8>>(),                                    \
        &cu::launch_decode_args<BenchConfig<M, N, W, S, FP8>>, &cu::prepare_decode_kernel<BenchConfig<M, N, W, S, FP8>>, \
        &max_active_clusters<BenchConfig<M, N, W, S, FP8>>                                                           \
  }
#define DECODE_VARIANT(M, N, W, S) DECODE_VARIANT_OF("m" #M "n" #N "w" #W "s" #S, false, M, N, W, S)

// ---- timeline probe ("tl_" variants): the same kernel, whose C::stamp (decode_config.cuh) records %globaltimer
// at each phase boundary into g_timeline, one record per CTA (slot taken at the CTA's start). Tuning only: the
// records cost an atomic and a few stores per CTA. ----
constexpr int kTimelineSlots = 1 << 16;
struct TimelineRecord {
  unsigned long long call;   // the call's out pointer (tells the graph's calls apart)
  unsigned int cta, smid;    // linear block index, SM
  unsigned long long t[BenchConfig<16, 64, 4, 3>::kStampCount];  // DecodeConfig::Stamp events (0: not reached)
};
__device__ TimelineRecord g_timeline[kTimelineSlots];
__device__ unsigned int g_timeline_next;
template <int M, int N, int W, int S>
struct TimelineConfig : BenchConfig<M, N, W, S> {
  static __device__ __forceinline__ void stamp(int event, const void* call) {
    __shared__ unsigned int slot;  // thread 0's, for the CTA's later stamps
    if (threadIdx.x != 0) return;
    unsigned long long now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (event == 0) {
      slot = atomicAdd(&g_timeline_next, 1u);
      if (slot >= kTimelineSlots) return;
      unsigned int smid;
      asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
      TimelineRecord& r = g_timeline[slot];
      r.call = reinterpret_cast<unsigned long long>(call);
      r.cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
      r.smid = smid;
      for (int e = 1; e < BenchConfig<16, 64, 4, 3>::kStampCount; ++e) r.t[e] = 0;
    }
    if (slot < kTimelineSlots) g_timeline[slot].t[event] = now;
  }
};
#define DECODE_TIMELINE_VARIANT(M, N, W, S)                                                                             \
  Variant {                                                                                                          \
    "tl_m" #M "n" #N "w" #W "s" #S, false, M, N, W, S, cu::decode_smem_bytes<TimelineConfig<M, N, W, S>>(),          \
        &cu::launch_decode_args<TimelineConfig<M, N, W, S>>, &cu::prepare_decode_kernel<TimelineConfig<M, N, W, S>>,    \
        &max_active_clusters<TimelineConfig<M, N, W, S>>                                                                 \
  }
#define DECODE_VARIANT_FP8(M, N, W, S) DECODE_VARIANT_OF("e4m3_m" #M "n" #N "w" #W "s" #S, true, M, N, W, S)
// bf16, D = 128 (the issue's shape). smem = (16 + 2 stages N) * 256 bytes; CTAs per H200 SM in brackets.
// (Round of 2026-11-30 05:07, B = 1, S = 128k, heuristic splits: n64w4s2 3.92 TB/s, n64w4s3 3.80, n32w2s3 3.71,
// n128w8s2 3.09, n32w2s4 2.85, n128w4s2 2.76, n64w4s4 2.42, n32w2s6 2.22: the 1-CTA-per-SM and 64-thread
// deep-pipeline tiles are out.)
const Variant kVariants[] = {
    DECODE_VARIANT(16, 64, 4, 3),  // 100 KiB [2]: the library's tile
    DECODE_VARIANT(16, 64, 4, 2),  //  68 KiB [3]
    DECODE_VARIANT(16, 32, 2, 3),  //  52 KiB [4], 64 threads
    DECODE_VARIANT(16, 32, 2, 2),  //  36 KiB [4+], 64 threads
    DECODE_VARIANT(16, 64, 2, 2),  //  68 KiB [3], 64 threads, 32 keys per warp
    // 196 KiB [1], 8 warps: two per scheduler where one CTA runs per SM (a 4-warp CTA alone on an SM waits ~2
    // cycles per instruction on fixed-latency dependencies: ncu, B = 16, 2026-11-30). Against the library's
    // tile (H200, 15:25 UTC, bf16, B 1-256 x 1k-32k): 0.75-0.97x at 1k caches of B <= 64, about equal at 8k-32k,
    // +2-7% at B = 256 contiguous, -1-4% paged; not taken.
    DECODE_VARIANT(16, 128, 8, 3),
    // One CTA per SM (B <= 16 at one wave of splits): a deeper ring, or 32 keys per warp (two S chains per warp).
    // H200, 17:29 UTC: within +-3% of the library's tile at B = 1 / 8k-128k and B = 4 / 8k-32k, +11% only at
    // B = 16 / 1k contiguous (m16n128w4s3), -3% to -10% at B = 64 / 1k; not taken (docs/PERFORMANCE.md). Again on
    // 2026-12-01 05:15 UTC, against the library's later kernel: m16n128w4s3 +0-3% at B = 16 x 1k-4k, 0.90-1.00x at B = 8,
    // 32, 64.
    DECODE_VARIANT(16, 64, 4, 4),   // 132 KiB [1]
    DECODE_VARIANT(16, 128, 4, 2),  // 132 KiB [1], 32 keys per warp
    DECODE_VARIANT(16, 128, 4, 3),  // 196 KiB [1], 32 keys per warp
    // FP8 cache (--kv fp8): smem = 16 * 256 + 2 stages N * 128 bytes
    DECODE_VARIANT_FP8(16, 64, 4, 4),   //  68 KiB
    DECODE_VARIANT_FP8(16, 64, 4, 3),   //  52 KiB
    DECODE_VARIANT_FP8(16, 128, 4, 3),  // 100 KiB, 32 keys per warp: the library's tile
    DECODE_VARIANT_FP8(16, 128, 4, 2),  //  68 KiB, 32 keys per warp
    DECODE_VARIANT_FP8(16, 128, 8, 3),  // 100 KiB, 256 threads
    DECODE_TIMELINE_VARIANT(16, 64, 4, 3),  // the library's tile with the timeline probe (report_timeline)
};

const Variant* find_variant(const std::string& name) {
  for (const Variant& v : kVariants)
    if (name == v.name) return &v;
  return nullptr;
}

// A call of variant v with knobs k on copy c (the same plan / workspace rules as the library's launcher).
struct VariantCall {
  const Variant* v;
  Knobs k;
  cudaStream_t stream;
  dec::DecodeDevice device;
  std::vector<Buffer>* workspaces;
  int splits = 0;
  flashattn::Status operator()(Copy& c) {
    fa_options o;
    fa_options_init(&o);
    o.backend = FA_BACKEND_CUDA;
    o.stream = stream;
    flashattn::KvcacheParams p;
    FA_RETURN_IF_ERROR(flashattn::api::make_kvcache_params(c.args, o, &p));
    FA_RETURN_IF_ERROR(dec::check_kvcache_support(p));
    bool programmatic = false;
    FA_RETURN_IF_ERROR(v->prepare(0, &programmatic));
    cu::KernelEntry entry{cu::KernelKind::kKvcache, p.dtype, 128, v->block_m, v->block_n, v->warps, v->stages, false, v->smem_bytes, v->name};
    entry.fp8_cache = v->fp8_cache;
    p.num_splits = k.splits;
    dec::DecodePlan plan;
    FA_RETURN_IF_ERROR(dec::make_decode_plan(p, entry, device, &plan));
    splits = plan.num_splits;
    p.num_splits = plan.num_splits;
    // one workspace per copy (a graph of many copies runs them in order; never shared by two calls in flight)
    size_t index = size_t(&c - copies_base);
    while (workspaces->size() <= index) workspaces->emplace_back();
    if ((*workspaces)[index].bytes < plan.workspace_bytes) (*workspaces)[index] = Buffer(plan.workspace_bytes);
    p.workspace = (*workspaces)[index].data;
    p.workspace_bytes = (*workspaces)[index].bytes;
    dec::DecodeArgs a = dec::make_decode_args(p, plan, p.workspace);
    a.programmatic_launch = (k.pdl < 0 ? dec::kProgrammaticLaunch : k.pdl != 0) && programmatic ? 1 : 0;
    if (k.min_tiles >= 1) a.min_tiles_per_split = k.min_tiles;
    // The cluster merge: the library's rule (its launcher's, without the occupancy query), forced on, or off.
    const bool cluster_ok = programmatic && plan.num_splits >= 2 && plan.num_splits <= dec::kMaxClusterSplits;
    a.cluster_merge = cluster_ok && (k.cluster < 0 ? dec::wants_cluster_merge(plan.num_splits, p.seqlen_k, v->block_n) : k.cluster != 0) ? 1 : 0;
    if (k.early >= 0) a.early_tiles = k.early;
    if (k.prefetch >= 0) a.prefetch_inputs = k.prefetch;
    if (k.spec >= 0) a.speculative_tiles = k.spec;
    cu::DecodeLaunchTuning tuning;
    tuning.extra_smem_bytes = k.smem_pad;
    tuning.cluster_policy = k.cluster_policy;
    return v->launch(a, plan, stream, tuning);
  }
  Copy* copies_base = nullptr;
};
#endif

// A CUDA graph of what `enqueue` launches on `stream` (captured at construction; instantiate() before launch()),
// destroyed with the object: the timed unit of every measurement below.
class CapturedGraph {
 public:
  CapturedGraph(cudaStream_t stream, const std::function<void()>& enqueue) : stream_(stream) {
    CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    enqueue();
    CHECK_CUDA(cudaStreamEndCapture(stream, &graph_));
  }
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;
  ~CapturedGraph() {
    if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
    if (graph_ != nullptr) cudaGraphDestroy(graph_);
  }
  void instantiate() { CHECK_CUDA(cudaGraphInstantiate(&exec_, graph_, 0)); }
  void launch() { CHECK_CUDA(cudaGraphLaunch(exec_, stream_)); }

 private:
  cudaStream_t stream_;
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

#if defined(FLASHATTN_DECODE_TILE_VARIANTS)
// The timeline of one graph launch of `call` over every copy (a "tl_" variant; the graph warmed up twice):
// per call, the phases of its CTAs relative to the call's first CTA start (median and max over CTAs, us), its
// span (first start to last end), and the gap from its last CTA's end to the next call's last "waited" stamp
// (the combine kernel and the launch chain). Printed; the medians over the calls go to `summary`.
// The stamps' names (DecodeConfig::Stamp: the same events in every config).
using St = BenchConfig<16, 64, 4, 3>;

void report_timeline(std::vector<Copy>& copies, const CallFn& call, cudaStream_t stream, std::string* summary) {
  {
    CapturedGraph graph(stream, [&] {
      for (Copy& c : copies) (void)call(c);
    });
    graph.instantiate();
    for (int warm = 0; warm < 2; ++warm) graph.launch();
    CHECK_CUDA(cudaStreamSynchronize(stream));
    const unsigned int zero = 0;
    CHECK_CUDA(cudaMemcpyToSymbol(g_timeline_next, &zero, sizeof(zero)));
    graph.launch();
    CHECK_CUDA(cudaStreamSynchronize(stream));
  }
  unsigned int used = 0;
  CHECK_CUDA(cudaMemcpyFromSymbol(&used, g_timeline_next, sizeof(used)));
  used = std::min<unsigned int>(used, kTimelineSlots);
  std::vector<TimelineRecord> rec(used);
  CHECK_CUDA(cudaMemcpyFromSymbol(rec.data(), g_timeline, sizeof(TimelineRecord) * used));
  // Calls in the order of their first CTA start.
  std::map<unsigned long long, std::vector<TimelineRecord>> by_call;
  for (const TimelineRecord& r : rec) by_call[r.call].push_back(r);
  struct CallTimes {
    unsigned long long first_start, last_end, last_waited;
    std::vector<TimelineRecord> ctas;
  };
  std::vector<CallTimes> calls;
  for (auto& kv : by_call) {
    CallTimes c{~0ull, 0, 0, kv.second};
    for (const TimelineRecord& r : kv.second) {
      c.first_start = std::min(c.first_start, r.t[St::kStampStart]);
      c.last_end = std::max(c.last_end, r.t[St::kStampEnd]);
      c.last_waited = std::max(c.last_waited, r.t[St::kStampWaited]);
    }
    calls.push_back(std::move(c));
  }
  std::sort(calls.begin(), calls.end(), [](const CallTimes& a, const CallTimes& b) { return a.first_start < b.first_start; });
  auto median = [](std::vector<double> v) {
    if (v.empty()) return -1.0;
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  auto maxof = [](const std::vector<double>& v) { return v.empty() ? -1.0 : *std::max_element(v.begin(), v.end()); };
  // Phase columns: waited - start, planned - waited, first tile - planned, loop, the epilogue's drain (barrier after
  // the loop), warp merge and stores, start, end (from the call's first start), all us.
  const char* names[] = {"wait", "plan", "1st tile", "loop", "drain", "merge", "store", "start@", "end@"};
  constexpr int kPhases = 9;
  std::vector<std::vector<double>> call_medians(kPhases + 2), call_maxes(kPhases + 2);
  // Every streaming CTA of every call: the means below (the timer's steps are 0.256 us on the H200, so a median of
  // short phases is a multiple of them; a mean over many CTAs is not).
  std::vector<std::vector<double>> all_phases(kPhases), cluster_phase(3);
  // The loop phase per SM, over the calls of even and of odd index (is a slow CTA's SM slow in every call?).
  std::map<unsigned int, std::vector<double>> loop_on_sm[2], loop_of_cta[2];
  std::map<unsigned int, std::set<unsigned int>> sms_of_cta;  // does a CTA index land on the same SM in every call?
  std::printf("    timeline (us; per call: median / max over its CTAs that streamed tiles)\n");
  std::printf("    %4s %5s |", "call", "ctas");
  for (const char* n : names) std::printf(" %13s", n);
  std::printf(" | %6s %6s %6s %6s\n", "span", "gap", "SMs", "shared");
  for (size_t ci = 0; ci < calls.size(); ++ci) {
    const CallTimes& c = calls[ci];
    std::vector<std::vector<double>> phase(kPhases);
    std::set<unsigned int> sms;
    std::map<unsigned int, int> streaming_on_sm;  // CTAs that streamed tiles, per SM
    for (const TimelineRecord& r : c.ctas) {
      sms.insert(r.smid);
      if (r.t[St::kStampEnd] == 0 || r.t[St::kStampFirstTile] == 0) continue;  // returned early (no tiles)
      ++streaming_on_sm[r.smid];
      const double t0 = double(c.first_start);
      auto us = [&](int from, int to) { return (double(r.t[to]) - double(r.t[from])) * 1e-3; };  // stamp to stamp
      phase[0].push_back(us(St::kStampStart, St::kStampWaited));
      phase[1].push_back(us(St::kStampWaited, St::kStampPlanned));
      phase[2].push_back(us(St::kStampPlanned, St::kStampFirstTile));
      phase[3].push_back(us(St::kStampFirstTile, St::kStampLoopDone));
      phase[4].push_back(us(St::kStampLoopDone, St::kStampDrained));
      phase[5].push_back(us(St::kStampDrained, St::kStampMerged));
      phase[6].push_back(us(St::kStampMerged, St::kStampEnd));
      phase[7].push_back((double(r.t[St::kStampStart]) - t0) * 1e-3);
      phase[8].push_back((double(r.t[St::kStampEnd]) - t0) * 1e-3);
      // A cluster merge: its barriers and its reads (the "store" phase split up).
      if (r.t[St::kStampClusterSynced] != 0 && r.t[St::kStampClusterRead] != 0) {
        cluster_phase[0].push_back(us(St::kStampMerged, St::kStampClusterSynced));
        cluster_phase[1].push_back(us(St::kStampClusterSynced, St::kStampClusterRead));
        cluster_phase[2].push_back(us(St::kStampClusterRead, St::kStampEnd));
      }
      for (int k = 0; k < kPhases; ++k) all_phases[k].push_back(phase[k].back());
      loop_on_sm[ci % 2][r.smid].push_back(phase[3].back());
      loop_of_cta[ci % 2][r.cta].push_back(phase[3].back());
      sms_of_cta[r.cta].insert(r.smid);
    }
    const double span = (double(c.last_end) - double(c.first_start)) * 1e-3;
    const double gap = ci + 1 < calls.size() ? (double(calls[ci + 1].last_waited) - double(c.last_end)) * 1e-3 : -1;
    std::printf("    %4zu %5zu |", ci, c.ctas.size());
    for (int k = 0; k < kPhases; ++k) {
      std::printf(" %6.2f/%6.2f", median(phase[k]), maxof(phase[k]));
      call_medians[k].push_back(median(phase[k]));
      call_maxes[k].push_back(maxof(phase[k]));
    }
    int sharing = 0;  // streaming CTAs on an SM that another of the call's streaming CTAs also ran on
    for (const auto& kv : streaming_on_sm) sharing += kv.second > 1 ? kv.second : 0;
    std::printf(" | %6.2f %6.2f %6zu %6d\n", span, gap, sms.size(), sharing);
    call_medians[kPhases].push_back(span);
    if (gap >= 0) call_medians[kPhases + 1].push_back(gap);
  }
  char line[512];
  int at = std::snprintf(line, sizeof(line), "median over %zu calls:", calls.size());
  for (int k = 0; k < kPhases; ++k)
    at += std::snprintf(line + at, sizeof(line) - size_t(at), " %s %.2f/%.2f", names[k], median(call_medians[k]), median(call_maxes[k]));
  std::snprintf(line + at, sizeof(line) - size_t(at), "; span %.2f, gap %.2f", median(call_medians[kPhases]), median(call_medians[kPhases + 1]));
  std::printf("    %s\n", line);
  auto mean = [](const std::vector<double>& v) { return v.empty() ? -1.0 : std::accumulate(v.begin(), v.end(), 0.0) / double(v.size()); };
  std::printf("    mean over %zu CTAs:", all_phases[0].size());
  for (int k = 0; k < kPhases; ++k) std::printf(" %s %.2f", names[k], mean(all_phases[k]));
  std::printf("\n");
  if (!cluster_phase[0].empty())
    std::printf("    cluster merge, mean (median) over %zu CTAs: store + first barrier %.2f (%.2f), reads + stores %.2f (%.2f), "
                "second barrier %.2f (%.2f)\n", cluster_phase[0].size(), mean(cluster_phase[0]), median(cluster_phase[0]),
                mean(cluster_phase[1]), median(cluster_phase[1]), mean(cluster_phase[2]), median(cluster_phase[2]));
  // Per SM and per CTA index: the correlation of the mean loop times over the even and the odd calls (a slow SM, or a
  // slow CTA's data, seen again in the other half), and the slowest / fastest SMs.
  auto halves = [&](const std::map<unsigned int, std::vector<double>>* by, const char* what) {
    std::vector<std::pair<double, double>> xy;
    std::vector<std::pair<double, unsigned int>> ranked;
    for (const auto& kv : by[0]) {
      auto other = by[1].find(kv.first);
      if (other == by[1].end()) continue;
      const double a = mean(kv.second), b = mean(other->second);
      xy.emplace_back(a, b);
      ranked.emplace_back((a + b) / 2, kv.first);
    }
    if (xy.size() < 8) return;
    double mx = 0, my = 0;
    for (auto& p : xy) mx += p.first, my += p.second;
    mx /= double(xy.size()), my /= double(xy.size());
    double sxy = 0, sxx = 0, syy = 0;
    for (auto& p : xy) {
      const double dx = p.first - mx, dy = p.second - my;
      sxy += dx * dy, sxx += dx * dx, syy += dy * dy;
    }
    std::sort(ranked.begin(), ranked.end());
    const double correlation = sxy / std::sqrt(sxx * syy + 1e-30);
    std::printf("    loop per %s over %zu: even/odd-call correlation %.2f; fastest", what, xy.size(), correlation);
    for (size_t k = 0; k < 4; ++k) std::printf(" %u:%.2f", ranked[k].second, ranked[k].first);
    std::printf("; slowest");
    for (size_t k = ranked.size() - 4; k < ranked.size(); ++k)
      std::printf(" %u:%.2f", ranked[k].second, ranked[k].first);
    std::printf("\n");
  };
  halves(loop_on_sm, "SM");
  halves(loop_of_cta, "CTA index");
  size_t same_sm = 0;
  for (const auto& kv : sms_of_cta) same_sm += kv.second.size() == 1;
  std::printf("    CTA indices on one SM in every call: %zu of %zu\n", same_sm, sms_of_cta.size());
  *summary = line;
}
#endif

// Relative L2 difference of two device bf16/f16 arrays (both finite expected; NaN propagates).
[[maybe_unused]] double rel_l2(const void* a, const void* b, int64_t count, fa_dtype dtype) {
  std::vector<uint16_t> ha(static_cast<size_t>(count)), hb(static_cast<size_t>(count));
  CHECK_CUDA(cudaMemcpy(ha.data(), a, size_t(count) * 2, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(hb.data(), b, size_t(count) * 2, cudaMemcpyDeviceToHost));
  auto value = [&](uint16_t x) {
    uint32_t bits = uint32_t(x) << 16;
    if (dtype == FA_BFLOAT16) {
      float f;
      std::memcpy(&f, &bits, 4);
      return double(f);
    }
    __half h;
    std::memcpy(&h, &x, 2);
    return double(__half2float(h));
  };
  double diff = 0, norm = 0;
  for (int64_t n = 0; n < count; ++n) {
    const double x = value(ha[size_t(n)]), y = value(hb[size_t(n)]);
    diff += (x - y) * (x - y);
    norm += y * y;
  }
  return std::sqrt(diff / std::max(norm, 1e-300));
}

// Times `call` over all copies: eager (copy 0) and as one CUDA graph of every copy.
Result time_calls(const Shape& s, std::vector<Copy>& copies, const CallFn& call, int reps, cudaStream_t stream) {
  Result r;
  r.copies = int(copies.size());
  flashattn::Status st = call(copies[0]);  // eager warm-up (also sets the kernel attributes)
  CHECK_CUDA(cudaStreamSynchronize(stream));
  if (!st.ok()) {
    cudaGetLastError();  // a failed launch leaves its error behind: clear it for the next points
    r.error = st.to_string();
    return r;
  }
  r.us_eager = 1000 * flashattn::bench::median_event_ms(stream, 1, reps, [&] { call(copies[0]); });
  for (Copy& c : copies) st = call(c);  // every copy once outside the capture (a variant allocates its workspace here)
  CHECK_CUDA(cudaStreamSynchronize(stream));
  if (!st.ok()) {
    cudaGetLastError();
    r.error = st.to_string();
    return r;
  }
  CapturedGraph graph(stream, [&] {
    for (Copy& c : copies) {
      const flashattn::Status one = call(c);
      if (!one.ok()) st = one;
    }
  });
  if (!st.ok()) {
    cudaGetLastError();
    r.error = "capture: " + st.to_string();
    return r;
  }
  graph.instantiate();
  const double ms = flashattn::bench::median_event_ms(stream, 1, reps, [&] { graph.launch(); });
  r.us_graph = 1000 * ms / r.copies;
  r.kv_tbs = double(s.kv_bytes()) / (r.us_graph * 1e-6) / 1e12;
  return r;
}

// Microseconds per copy of `launch_all` (one launch per copy) run once, then timed as one CUDA graph, as time_calls
// times the library's calls.
double graph_us_per_copy(cudaStream_t stream, int reps, size_t copies, const std::function<void()>& launch_all) {
  launch_all();
  CHECK_CUDA(cudaStreamSynchronize(stream));
  CapturedGraph graph(stream, launch_all);
  graph.instantiate();
  const double ms = flashattn::bench::median_event_ms(stream, 1, reps, [&] { graph.launch(); });
  return 1000 * ms / double(copies);
}

// The same-size read floor (read_pair_kernel) over every copy's K and V, timed like time_calls (a CUDA graph of
// one read per copy); the best of a few grid sizes. Microseconds per copy.
double time_read_floor(const Shape& s, std::vector<Copy>& copies, int reps, cudaStream_t stream, int sms) {
  Buffer sink(64);
  const int64_t words = s.kv_bytes() / 2 / 16;
  double best_us = -1;
  for (const int blocks_per_sm : {2, 4, 8, 16}) {
    const int64_t needed = (2 * words + kStreamThreads - 1) / kStreamThreads;
    const int blocks = int(std::max<int64_t>(1, std::min<int64_t>(int64_t(sms) * blocks_per_sm, needed)));
    const double us = graph_us_per_copy(stream, reps, copies.size(), [&] {
      for (Copy& c : copies)
        read_pair_kernel<<<blocks, kStreamThreads, 0, stream>>>(static_cast<const uint4*>(c.k.data),
                                                                 static_cast<const uint4*>(c.v.data), words,
                                                                 static_cast<unsigned int*>(sink.data));
    });
    if (best_us < 0 || us < best_us) best_us = us;
  }
  return best_us;
}

// The layout floor (read_slices_kernel) over every copy's cache in the point's layout, timed like time_calls (a
// CUDA graph of one read per copy); the best of the split counts 1, 2, 4, ..., 64 x heads_per_cta that keep at most 16 CTAs per SM
// and give every split rows (whole pages each). Microseconds per copy (-1 where the shape is not one it reads: a page that is
// not a power of two, or rows that are not a divisor of its CTA's threads in 16-byte words).
double time_layout_floor(const Shape& s, std::vector<Copy>& copies, int reps, cudaStream_t stream, int sms, int* best_splits,
                         int heads_per_cta = 1) {
  const int64_t head_bytes = int64_t(s.dim) * (s.fp8_cache ? 1 : 2);
  const int64_t row_bytes = head_bytes * heads_per_cta;
  const int head_words = int(head_bytes / 16), row_words = int(row_bytes / 16);
  int page_shift = 0;
  while (s.paged && (int64_t(1) << page_shift) < s.page) ++page_shift;
  if (head_bytes % 16 != 0 || row_words == 0 || kSliceThreads % row_words != 0 || s.heads_k % heads_per_cta != 0 ||
      (s.paged && (int64_t(1) << page_shift) != s.page))
    return -1;
  const int head_groups = s.heads_k / heads_per_cta;
  const int64_t per_seq_blocks = (s.cache + s.page - 1) / s.page;
  Buffer sink(64);
  double best_us = -1;
  for (int64_t splits = 1; splits <= 64 * heads_per_cta; splits *= 2) {
    const int64_t ctas = splits * head_groups * s.batch;
    const int64_t rows_per_split = ((s.cache + splits - 1) / splits + s.page - 1) / s.page * s.page;
    if (splits > 1 && (ctas > int64_t(16) * sms || rows_per_split * (splits - 1) >= s.cache)) break;
    const dim3 grid(unsigned(splits), unsigned(head_groups), unsigned(s.batch));
    const double us = graph_us_per_copy(stream, reps, copies.size(), [&] {
      for (Copy& c : copies)
        read_slices_kernel<<<grid, kSliceThreads, 0, stream>>>(
            static_cast<const uint4*>(c.k.data), static_cast<const uint4*>(c.v.data),
            s.paged ? static_cast<const int32_t*>(c.table.data) : nullptr, per_seq_blocks, page_shift, s.cache, s.heads_k,
            heads_per_cta, head_words, rows_per_split, static_cast<unsigned int*>(sink.data));
    });
    if (best_us < 0 || us < best_us) best_us = us, *best_splits = int(splits);
  }
  return best_us;
}

// Every knob combination on one shape: the inputs are made once (copies until they exceed 2x the L2).
std::vector<std::pair<Knobs, Result>> run_shape(const Shape& s, const std::vector<Knobs>& configs, int reps, int64_t l2_bytes,
                                                cudaStream_t stream, const cudaDeviceProp& prop) {
  std::vector<std::pair<Knobs, Result>> results;
  g_arena.used = 0;  // the previous point's buffers are gone: every point starts at the arena's base
  std::mt19937_64 rng(uint64_t(s.batch * 1315423911u + s.cache));
  const int64_t l2_copies = (2 * l2_bytes) / s.kv_bytes() + 1;
  const int64_t launch_copies = std::min<int64_t>(kMinCopies, kCopyBudgetBytes / s.kv_bytes());
  const int n_copies = int(std::min<int64_t>(kMaxCopies, std::max<int64_t>({int64_t(1), l2_copies, launch_copies})));
  std::vector<Copy> copies;
  for (int c = 0; c < n_copies; ++c) copies.push_back(make_copy(s, uint32_t(1000 * c + 7), rng));
  const int64_t out_elems = s.batch * s.heads_q * s.dim;
  fa_options o;
  fa_options_init(&o);
  o.backend = FA_BACKEND_CUDA;
  o.stream = stream;
  // The library's output on copy 0 (heuristic splits, its own workspace): what the variants are checked against.
  Buffer reference_out(out_elems * 2);
  [[maybe_unused]] bool have_reference = false;  // read by the tile variants only
  for (Copy& c : copies) {
    c.args.num_splits = 0;
    c.args.workspace = fa_tensor{};
  }
  const flashattn::Status reference_status = flashattn::kvcache(copies[0].args, o);
  CHECK_CUDA(cudaStreamSynchronize(stream));
  if (!reference_status.ok()) {
    cudaGetLastError();
    std::fprintf(stderr, "reference call (library): %s\n", reference_status.to_string().c_str());
  } else {
    CHECK_CUDA(cudaMemcpy(reference_out.data, copies[0].out.data, size_t(out_elems) * 2, cudaMemcpyDeviceToDevice));
    have_reference = true;
  }
  for (const Knobs& k : configs) {
    Result r;
    std::vector<Buffer> workspaces;
    for (Copy& c : copies) {
      c.args.num_splits = 0;
      c.args.workspace = fa_tensor{};
    }
    CallFn call;
    if (k.runner == "lib") {
      for (Copy& c : copies) c.args.num_splits = k.splits;
      fa_kvcache_plan plan{};
      const flashattn::Status st = flashattn::kvcache_plan(copies[0].args, o, &plan);
      if (!st.ok()) {
        r.error = st.to_string();
        results.emplace_back(k, r);
        continue;
      }
      r.splits = plan.num_splits;
      for (Copy& c : copies) {
        c.args.num_splits = plan.num_splits;
        if (plan.workspace_bytes > 0) {
          workspaces.emplace_back(plan.workspace_bytes);
          c.args.workspace = tensor(workspaces.back().data, {plan.workspace_bytes}, FA_UINT8);
        }
      }
      fa_stats stats{};
      fa_options so = o;
      so.stats = &stats;
      if (flashattn::kvcache(copies[0].args, so).ok()) r.kernel = stats.kernel;
      else cudaGetLastError();
      call = [o](Copy& c) { return flashattn::kvcache(c.args, o); };
      const std::string kernel = r.kernel;
      const int splits = r.splits;
      r = time_calls(s, copies, call, reps, stream);
      r.kernel = kernel;
      r.splits = splits;
    } else {
#if defined(FLASHATTN_DECODE_TILE_VARIANTS)
      const Variant* v = find_variant(k.runner);
      if (v == nullptr || s.dim != 128 || s.dtype != FA_BFLOAT16 || s.fp8_cache != v->fp8_cache) {
        r.error = "no variant " + k.runner + " for this shape (bf16, D = 128; e4m3_ variants with --kv fp8 only)";
        results.emplace_back(k, r);
        continue;
      }
      auto vc = std::make_shared<VariantCall>();
      vc->v = v;
      vc->k = k;
      vc->stream = stream;
      vc->device = dec::DecodeDevice{0, prop.major, prop.minor, prop.multiProcessorCount, int64_t(prop.sharedMemPerBlockOptin),
                                     int64_t(prop.sharedMemPerMultiprocessor)};
      vc->workspaces = &workspaces;
      vc->copies_base = copies.data();
      call = [vc](Copy& c) { return (*vc)(c); };
      r = time_calls(s, copies, call, reps, stream);
      r.splits = vc->splits;
      r.kernel = std::string("variant ") + v->name;
      if (r.error.empty() && std::string(v->name).rfind("tl_", 0) == 0) report_timeline(copies, call, stream, &r.timeline);
      if (r.error.empty() && have_reference) {
        CHECK_CUDA(cudaMemset(copies[0].out.data, 0xFF, size_t(out_elems) * 2));  // NaN: a call that writes nothing fails
        const flashattn::Status st = call(copies[0]);
        CHECK_CUDA(cudaStreamSynchronize(stream));
        r.check = st.ok() ? rel_l2(copies[0].out.data, reference_out.data, out_elems, s.dtype) : -2;
        if (!std::isfinite(r.check)) r.check = 99;  // NaN in the output (JSON has no NaN)
      }
#else
      r.error = "runner " + k.runner + ": tile variants are in flashattn_decode_tiles (-DFLASHATTN_BUILD_TUNING=ON)";
#endif
    }
    results.emplace_back(k, r);
  }
  const double floor_us = time_read_floor(s, copies, reps, stream, prop.multiProcessorCount);
  int layout_splits = 0;
  const double layout_us = time_layout_floor(s, copies, reps, stream, prop.multiProcessorCount, &layout_splits);
  int rows_splits = layout_splits;  // one K/V head: a row is one head's, the layout floor already read it
  const double rows_us =
      s.heads_k > 1 ? time_layout_floor(s, copies, reps, stream, prop.multiProcessorCount, &rows_splits, s.heads_k) : layout_us;
  for (auto& kr : results) {
    kr.second.us_read_floor = floor_us;
    kr.second.us_layout_floor = layout_us;
    kr.second.layout_floor_splits = layout_splits;
    kr.second.us_rows_floor = rows_us;
    kr.second.rows_floor_splits = rows_splits;
  }
  return results;
}

}  // namespace

int main(int argc, char** argv) {
  std::string json_path, batches_arg = "1,4,16,64,256", caches_arg = "1024,4096,16384,65536,131072", heads_arg = "32:8",
                         dtype_arg = "bf16", layouts_arg = "contiguous,paged", splits_arg = "0", runners_arg = "lib",
                         pdl_arg = "-1", kv_arg = "16", cluster_arg = "-1", policy_arg = "0", pad_arg = "0",
                         early_arg = "-1", prefetch_arg = "-1", spec_arg = "-1";
  int dim = 128, page = 16, reps = 10, min_tiles = -1, rounds = 1;
  double budget_gib = 32;
  for (int a = 1; a < argc; ++a) {
    const std::string arg = argv[a];
    auto next = [&]() -> std::string {
      if (a + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", arg.c_str());
        std::exit(2);
      }
      return argv[++a];
    };
    if (arg == "--json") json_path = next();
    else if (arg == "--batches") batches_arg = next();
    else if (arg == "--caches") caches_arg = next();
    else if (arg == "--heads") heads_arg = next();
    else if (arg == "--dim") dim = std::stoi(next());
    else if (arg == "--page") page = std::stoi(next());
    else if (arg == "--dtype") dtype_arg = next();
    else if (arg == "--layouts") layouts_arg = next();
    else if (arg == "--budget-gib") budget_gib = std::stod(next());
    else if (arg == "--reps") reps = std::stoi(next());
    else if (arg == "--rounds") rounds = std::max(1, std::stoi(next()));
    else if (arg == "--splits") splits_arg = next();
    else if (arg == "--runners") runners_arg = next();
    else if (arg == "--pdl") pdl_arg = next();
    else if (arg == "--min-tiles") min_tiles = std::stoi(next());
    else if (arg == "--cluster") cluster_arg = next();
    else if (arg == "--cluster-policy") policy_arg = next();
    else if (arg == "--smem-pad") pad_arg = next();
    else if (arg == "--early") early_arg = next();
    else if (arg == "--prefetch") prefetch_arg = next();
    else if (arg == "--speculate") spec_arg = next();
    else if (arg == "--kv") kv_arg = next();
    else {
      std::fprintf(stderr, "unknown argument %s (see the header of bench/decode_bench.cu)\n", arg.c_str());
      return 2;
    }
  }
  const int heads_q = std::stoi(heads_arg.substr(0, heads_arg.find(':')));
  const int heads_k = std::stoi(heads_arg.substr(heads_arg.find(':') + 1));
  const fa_dtype dtype = dtype_arg == "f16" ? FA_FLOAT16 : FA_BFLOAT16;
  if (kv_arg != "16" && kv_arg != "fp8") {
    std::fprintf(stderr, "--kv must be 16 (the cache in --dtype) or fp8 (float8 e4m3), got %s\n", kv_arg.c_str());
    return 2;
  }
  const bool fp8_cache = kv_arg == "fp8";
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  // The configurations timed at every point: runners x splits x pdl (lib takes the library's pdl only).
  std::vector<std::string> runners;
  {
    std::stringstream ss(runners_arg);
    std::string item;
    while (std::getline(ss, item, ',')) {
#if defined(FLASHATTN_DECODE_TILE_VARIANTS)
      if (item == "all") {
        for (const Variant& v : kVariants)
          if (v.fp8_cache == (kv_arg == "fp8")) runners.push_back(v.name);  // those for this cache
        continue;
      }
#endif
      runners.push_back(item);
    }
  }
  std::vector<Knobs> configs;
  for (const std::string& runner : runners)
    for (const int64_t splits : flashattn::bench::parse_ints<int64_t>(splits_arg)) {
      Knobs k;
      k.runner = runner;
      k.splits = int(splits);
      k.min_tiles = min_tiles;
      if (runner == "lib") {  // the knobs are not settable through the API: once, with the library's
        configs.push_back(k);
        continue;
      }
      // Every combination of the variant knobs' lists (the first list outermost).
      std::vector<Knobs> combos{k};
      auto times = [&](const std::string& list, int Knobs::*knob) {
        std::vector<Knobs> next;
        for (const Knobs& base : combos)
          for (const int64_t value : flashattn::bench::parse_ints<int64_t>(list)) {
            next.push_back(base);
            next.back().*knob = int(value);
          }
        combos = std::move(next);
      };
      times(pdl_arg, &Knobs::pdl);
      times(cluster_arg, &Knobs::cluster);
      times(policy_arg, &Knobs::cluster_policy);
      times(pad_arg, &Knobs::smem_pad);
      times(early_arg, &Knobs::early);
      times(prefetch_arg, &Knobs::prefetch);
      times(spec_arg, &Knobs::spec);
      configs.insert(configs.end(), combos.begin(), combos.end());
    }
  if (configs.empty()) {
    std::fprintf(stderr, "no configuration to time\n");
    return 2;
  }

  // ---- the device's own streaming bandwidth, in this run ----
  double stream_tbs = 0, copy_tbs = 0;
  {
    Buffer data(kStreamBytes), sink(64), copy_to(kStreamBytes / 2);
    fill(data.data, kStreamBytes / 2, 99, FA_BFLOAT16);
    const int blocks = prop.multiProcessorCount * 8;
    const double read_ms = flashattn::bench::median_event_ms(stream, 1, 10, [&] {
      stream_read_kernel<<<blocks, kStreamThreads, 0, stream>>>(static_cast<const uint4*>(data.data), kStreamBytes / 16,
                                                                 static_cast<unsigned int*>(sink.data));
    });
    stream_tbs = double(kStreamBytes) / (read_ms * 1e-3) / 1e12;
    const double copy_ms = flashattn::bench::median_event_ms(stream, 1, 10, [&] {
      CHECK_CUDA(cudaMemcpyAsync(copy_to.data, data.data, size_t(kStreamBytes / 2), cudaMemcpyDeviceToDevice, stream));
    });
    copy_tbs = double(kStreamBytes) / (copy_ms * 1e-3) / 1e12;  // read + write
  }
  // The most K/V one point may hold on this device: the arena less its 1 GiB for the rest of the point's buffers, or
  // without an arena what the device had free less 2 GiB. Points above it are skipped (and listed), so that a sweep
  // with a budget for the largest card (--budget-gib 128: B = 256 / 128k on an H200) runs on a smaller one too.
  double device_kv_gib = 0;
  {  // the input arena: the largest point's K/V (--budget-gib) plus 1 GiB, within what the device has free
    size_t free_bytes = 0, total_bytes = 0;
    CHECK_CUDA(cudaMemGetInfo(&free_bytes, &total_bytes));
    const int64_t want = int64_t(budget_gib * double(int64_t(1) << 30)) + (int64_t(1) << 30);
    const int64_t size = std::min<int64_t>(want, int64_t(free_bytes) - (int64_t(2) << 30));
    if (size > 0 && cudaMalloc(reinterpret_cast<void**>(&g_arena.base), size_t(size)) == cudaSuccess) g_arena.size = size;
    else cudaGetLastError();  // no arena: every buffer is its own cudaMalloc
    const int64_t kv_capacity = g_arena.base != nullptr ? g_arena.size - (int64_t(1) << 30) : int64_t(free_bytes) - (int64_t(2) << 30);
    device_kv_gib = double(kv_capacity) / double(int64_t(1) << 30);
  }
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof(date), "%Y-%m-%d %H:%M UTC", std::gmtime(&now));
  std::printf("flashattn_decode_bench %s on %s (%d SMs, L2 %d MiB), %s\n", date, prop.name, prop.multiProcessorCount,
              prop.l2CacheSize >> 20, fa_version());
  std::printf("streaming read %.2f TB/s; device copy (read + write) %.2f TB/s\n", stream_tbs, copy_tbs);
  std::printf("%s, K/V cache %s, D=%d, Hq=%d, Hk=%d, 1 query per sequence, page %d\n", dtype_arg.c_str(),
              fp8_cache ? "float8_e4m3 (1 byte per element)" : dtype_arg.c_str(), dim, heads_q, heads_k, page);
  std::printf("vs read = K/V TB/s / streaming read; floor = the same bytes read by a read-only kernel, launched alike\n");
#if defined(FLASHATTN_DECODE_TILE_VARIANTS)
  // Cluster residency of each variant asked with --cluster 1: clusters of 2-16 CTAs resident at once
  // (cudaOccupancyMaxActiveClusters, contiguous kernel), per --smem-pad and --cluster-policy.
  {
    std::set<std::string> asked;
    for (const Knobs& k : configs) {
      const Variant* v = k.cluster == 1 ? find_variant(k.runner) : nullptr;
      const std::string key = k.runner + k.tag();
      if (v == nullptr || !asked.insert(key).second) continue;
      std::printf("resident clusters of %s%s (smem %lld + %d bytes):", v->name, k.tag().c_str(), (long long)v->smem_bytes, k.smem_pad);
      for (const int size : {2, 4, 8, 16}) std::printf(" %d CTAs: %d", size, v->max_active_clusters(size, k.smem_pad, k.cluster_policy));
      std::printf("\n");
    }
  }
#endif
  std::printf("%-10s %4s %6s | %-11s %2s | %6s %9s %9s %8s %7s %9s %8s %9s %8s | %s\n", "layout", "B", "S", "runner", "pd",
              "splits", "us/call", "us eager", "K/V TB/s", "vs read", "floor us", "vs floor", "layout us", "check", "kernel");

  std::string json = "{\n \"tool\": \"flashattn_decode_bench\",\n \"date\": \"" + std::string(date) + "\",\n \"gpu\": \"" +
                     prop.name + "\",\n";
  char line[2048];
  std::snprintf(line, sizeof(line),
                " \"stream_read_tbs\": %.4f,\n \"device_copy_tbs\": %.4f,\n \"config\": {\"dtype\": \"%s\", \"kv_cache\": \"%s\", "
                "\"dim\": %d, \"heads_q\": %d, \"heads_k\": %d, \"page\": %d, \"seqlen_q\": 1},\n \"points\": [\n",
                stream_tbs, copy_tbs, dtype_arg.c_str(), fp8_cache ? "float8_e4m3" : dtype_arg.c_str(), dim, heads_q, heads_k,
                page);
  json += line;
  bool first = true;
  const std::vector<int64_t> batches = flashattn::bench::parse_ints<int64_t>(batches_arg);
  const std::vector<int64_t> caches = flashattn::bench::parse_ints<int64_t>(caches_arg);
  std::vector<std::string> layouts;
  {
    std::stringstream ss(layouts_arg);
    std::string item;
    while (std::getline(ss, item, ',')) layouts.push_back(item);
  }
  for (const std::string& layout : layouts)
    if (layout != "contiguous" && layout != "paged" && layout != "paged-seq" && layout != "paged-local" &&
        layout != "paged-sorted" && sorted_run_of(layout) == 0 && layout != "contiguous-idx" && layout != "paged-rev" &&
        layout != "paged-lifo" && layout != "paged-lowest" && layout != "contiguous-leftpad") {
      std::fprintf(stderr,
                   "unknown layout %s (contiguous, contiguous-idx, paged, paged-seq, paged-rev, paged-local, paged-sorted, "
                   "paged-sortedN, paged-lifo, paged-lowest, contiguous-leftpad)\n",
                   layout.c_str());
      return 2;
    }
  // Per point, the layouts (and --rounds repetitions) run back to back, so that a ratio between layouts compares
  // measurements seconds apart, not a whole sweep apart.
  for (const int64_t batch : batches)
    for (const int64_t cache : caches)
      for (int round = 0; round < rounds; ++round)
      for (const std::string& layout : layouts) {
        Shape s{batch, cache, heads_q, heads_k, dim, page, layout.rfind("paged", 0) == 0, layout == "paged-seq",
                      layout == "paged-local", dtype, fp8_cache};
        s.sorted_run = layout == "paged-sorted" ? 1 << 30 : sorted_run_of(layout);
        s.batch_idx = layout == "contiguous-idx";
        s.left_pad = layout == "contiguous-leftpad";
        s.reversed_pages = layout == "paged-rev";
        s.churn_policy = layout == "paged-lifo" ? 1 : layout == "paged-lowest" ? 2 : 0;
        std::vector<std::pair<Knobs, Result>> results;
        const double kv_gib = double(s.kv_bytes()) / double(int64_t(1) << 30);
        if (kv_gib > budget_gib || kv_gib > device_kv_gib) {
          if (round > 0) continue;  // listed once
          Result r;
          char why[160];
          if (kv_gib > budget_gib) std::snprintf(why, sizeof(why), "skipped: K/V %.0f GiB > --budget-gib", kv_gib);
          else std::snprintf(why, sizeof(why), "skipped: K/V %.0f GiB > the %.0f GiB this device holds for a point", kv_gib, device_kv_gib);
          r.error = why;
          for (const Knobs& k : configs) results.emplace_back(k, r);
        } else {
          results = run_shape(s, configs, reps, prop.l2CacheSize, stream, prop);
        }
        for (const auto& [k, r] : results) {
          const double vs_floor = r.us_graph > 0 && r.us_read_floor > 0 ? r.us_read_floor / r.us_graph : -1;
          std::printf("%-10s %4lld %6lld | %-11s %2d | %6d %9.2f %9.2f %8.3f %6.1f%% %9.2f %7.1f%% %9.2f %8.1e | %s%s%s\n",
                      layout.c_str(), (long long)batch, (long long)cache, k.runner.c_str(), k.pdl, r.splits, r.us_graph,
                      r.us_eager, r.kv_tbs, 100 * r.kv_tbs / stream_tbs, r.us_read_floor, 100 * vs_floor, r.us_layout_floor, r.check,
                      r.kernel.c_str(), k.tag().c_str(), r.error.c_str());
          std::fflush(stdout);
          std::snprintf(line, sizeof(line),
                        "  %s{\"layout\": \"%s\", \"batch\": %lld, \"cache\": %lld, \"kv_bytes\": %lld, \"runner\": \"%s\", "
                        "\"splits_asked\": %d, \"pdl\": %d, \"min_tiles\": %d, \"cluster\": %d, \"cluster_policy\": %d, "
                        "\"smem_pad\": %d, \"early\": %d, \"prefetch\": %d, \"speculate\": %d, \"splits\": %d, \"copies\": %d, "
                        "\"us_per_call\": %.3f, \"us_eager\": %.3f, \"kv_tbs\": %.4f, \"fraction_of_stream_read\": %.4f, "
                        "\"us_read_floor\": %.3f, \"fraction_of_read_floor\": %.4f, \"us_layout_floor\": %.3f, "
                        "\"layout_floor_splits\": %d, \"us_rows_floor\": %.3f, \"rows_floor_splits\": %d, \"round\": %d, "
                        "\"check_rel_l2\": %.3g, \"kernel\": \"%s\", \"timeline\": \"%s\", \"error\": \"%s\"}",
                        first ? "" : ",", layout.c_str(), (long long)batch, (long long)cache, (long long)s.kv_bytes(),
                        k.runner.c_str(), k.splits, k.pdl, k.min_tiles, k.cluster, k.cluster_policy, k.smem_pad, k.early, k.prefetch, k.spec, r.splits,
                        r.copies, r.us_graph, r.us_eager,
                        r.kv_tbs, r.kv_tbs / stream_tbs, r.us_read_floor, vs_floor, r.us_layout_floor, r.layout_floor_splits, r.us_rows_floor, r.rows_floor_splits, round, r.check, r.kernel.c_str(),
                        r.timeline.c_str(), json_safe(r.error).c_str());
          json += std::string(first ? "" : "\n") + line;
          first = false;
        }
      }
  json += "\n ]\n}\n";
  if (!json_path.empty()) {
    FILE* f = std::fopen(json_path.c_str(), "w");
    if (f == nullptr) {
      std::fprintf(stderr, "cannot write %s\n", json_path.c_str());
      return 1;
    }
    std::fputs(json.c_str(), f);
    std::fclose(f);
  }
  cudaStreamDestroy(stream);
  return 0;
}
