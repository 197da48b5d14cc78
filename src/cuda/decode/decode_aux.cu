// The small kernels around the decode attention kernel: append (+ rotary of the new keys), the split
// combine, and the checked mode's guard. See decode_aux.hpp for what each does. Instantiated here for both
// 16-bit dtypes (none of them depends on the head-dim bucket: they loop over D at run time).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/fp8.hpp"
#include "cuda/common/check.hpp"
#include "cuda/common/ptx.cuh"
#include "cuda/decode/cache_rows.cuh"
#include "cuda/decode/decode_aux.hpp"
#include "cuda/decode/programmatic_launch.cuh"

namespace flashattn::cuda::decode {
namespace {

constexpr int kAppendThreads = 256;
constexpr int kAppendRowsPerCta = 4;         // new rows of one sequence per append CTA (affects speed only)
constexpr int kAppendUnroll = 2;             // chunks an append thread loads before it stores (affects speed only)
constexpr unsigned kMaxAppendSequenceCtas = 65535;  // grid.y limit; CTAs loop over sequences beyond it
constexpr int kGuardThreads = 128;

// The new rows of sequence b: fa_kvcache's S_new rows of its batch entry of k_new, or fa_kvcache_append's n_b rows
// from row cu_seqlens_new[b] of its (total_new, Hk, D) k_new (count -1 when those entries are out of range, or for
// sequence 0 when cu_seqlens_new does not start at 0, the host rule: nothing is written for the sequence, and the
// checked mode's guard reports it).
struct NewRows {
  int count;
  int64_t first;
};
__device__ __forceinline__ NewRows new_rows_of(const KvcacheParams& p, const int32_t* cu_seqlens_new, int64_t total_new, int b) {
  if (cu_seqlens_new == nullptr) return NewRows{p.seqlen_new, 0};
  const int32_t first = cu_seqlens_new[b];
  if (b == 0 && first != 0) return NewRows{-1, 0};
  return NewRows{appended_rows(cu_seqlens_new, total_new, p.seqlen_new, b), first};
}

// ---- append: CTAs of (up to kAppendRowsPerCta new rows, sequence); each thread moves 16-byte chunks (8 elements) of
// the rows' K and V, kAppendUnroll chunks at a time ----
// cu_seqlens_new (fa_kvcache_append) or null (fa_kvcache: S_new rows per sequence); the grid covers p.seqlen_new rows
// per sequence, the longest sequence's count, and a CTA past its sequence's own count moves on at once. Each CTA
// reads its sequence's count, cache length and key floor once; the items' indices are 32-bit divisions by per-call
// constants. A thread first loads all of its chunks (K, V, block id: one round of memory latency), then stores them
// (one chunk at a time, its stores could alias the next chunk's loads for the compiler: a round per chunk).
// H100, 2026-12-06 (`flashattn step`, eager synchronised calls; the call alone costs ~11 us): until then one thread
// per (sequence, row slot, head, pair of elements) of the whole batch x seqlen_new grid, 64-bit divisions, 2- and
// 4-byte stores, took 118.6-121.4 us for 1088 rows (64 sequences of 1, 2 of 512) and 66.6 us for 4 x 2048; per
// sequence, pairs one at a time: 30.5 and 49.9 us; pairs 8 at a time (122 registers): 33.3 and 86.2 us.
// kFp8: the cache is float8 e4m3: each value x (k after rotary) is stored as e4m3(x / scale), the division in
// float32 (__fdiv_rn: IEEE, as the CPU backends divide) and the rounding of core/fp8.hpp (nearest even,
// saturating), so the bytes are the CPU backends' bytes.
constexpr int kAppendChunk = 8;  // elements per chunk (16 bytes of a 16-bit row: D % 8 == 0, 16-byte aligned rows)

struct AppendChunk {
  int64_t k_row = -1, v_row = 0;  // cache element offsets of the chunk's K / V row (k_row -1: nothing to store)
  int e0 = 0;                     // its first element in the row
  int j = 0;                      // the row's position in the cache (also its rotary position)
  int64_t k_src = 0;              // k_new element offset of the row (rotary reads the partners there)
  uint4 k, v;                     // the 8 K and V elements as loaded
};

template <typename Element>
__device__ __forceinline__ AppendChunk load_append_chunk(const DecodeArgs& args, const NewRows& rows, int b, int cached,
                                                         int t_begin, int row_chunks, int item, int items) {
  const KvcacheParams& p = args.p;
  AppendChunk c;
  if (item >= items) return c;
  const int chunks = p.head_dim / kAppendChunk;
  const int t = t_begin + item / row_chunks;
  const int hk = (item % row_chunks) / chunks;
  c.e0 = (item % chunks) * kAppendChunk;
  c.j = cached + t;
  // The sources first (always inside k_new / v_new: the sequence's count was checked), then the block id.
  const int64_t src_row = rows.first + t;  // (fa_kvcache_append: batch strides 0)
  c.k_src = b * p.k_new_batch_stride + src_row * p.k_new_row_stride + hk * p.k_new_head_stride;
  const int64_t v_src = b * p.v_new_batch_stride + src_row * p.v_new_row_stride + hk * p.v_new_head_stride;
  c.k = *reinterpret_cast<const uint4*>(static_cast<const Element*>(p.k_new) + c.k_src + c.e0);
  c.v = *reinterpret_cast<const uint4*>(static_cast<const Element*>(p.v_new) + v_src + c.e0);
  const int32_t id = p.block_table != nullptr ? page_id_of(args, b, c.j) : 0;
  int64_t k_row = 0, v_row = 0;
  if (cache_row_offsets(args, b, hk, c.j, id, &k_row, &v_row)) c.k_row = k_row, c.v_row = v_row;  // never through a bad id
  return c;
}

// Element e of a K row at position j after rotary (core semantics: src/cpu/reference/reference.cpp), x = its value:
// the half of rotate_pair's rotation (cache_rows.cuh) that gives element e, its partner read from the row.
template <typename Element>
__device__ __forceinline__ float rotated_key(const KvcacheParams& p, const Element* k_row, int j, int e, float x) {
  const int half = p.rotary_dim / 2;
  bool first;
  int q, partner;
  if (p.rotary_interleaved) {
    first = e % 2 == 0, q = e / 2, partner = first ? e + 1 : e - 1;
  } else {
    first = e < half, q = first ? e : e - half, partner = first ? e + half : e - half;
  }
  const float2 cs = rotary_cos_sin<Element>(p, j, q);
  const float y = float(k_row[partner]);
  return first ? rotated_first(x, y, cs) : rotated_second(y, x, cs);
}

template <typename Element, bool kFp8>
__device__ __forceinline__ void store_append_chunk(const KvcacheParams& p, const AppendChunk& c) {
  if (c.k_row < 0) return;
  Element k[kAppendChunk];
  memcpy(k, &c.k, sizeof(k));
  const bool rotated = c.e0 < p.rotary_dim;  // (rotary_dim 0: none)
  float x[kAppendChunk];
#pragma unroll
  for (int i = 0; i < kAppendChunk; ++i) x[i] = float(k[i]);  // (a 16-bit value survives the trip through float)
  if (rotated) {
    const Element* k_row = static_cast<const Element*>(p.k_new) + c.k_src;
#pragma unroll
    for (int i = 0; i < kAppendChunk; ++i)
      if (c.e0 + i < p.rotary_dim) x[i] = rotated_key(p, k_row, c.j, c.e0 + i, x[i]);
  }
  if constexpr (kFp8) {
    Element v[kAppendChunk];
    memcpy(v, &c.v, sizeof(v));
    uint8_t k_codes[kAppendChunk], v_codes[kAppendChunk];
#pragma unroll
    for (int i = 0; i < kAppendChunk; ++i) {
      k_codes[i] = float_to_e4m3(__fdiv_rn(x[i], p.k_scale));
      v_codes[i] = float_to_e4m3(__fdiv_rn(float(v[i]), p.v_scale));
    }
    // 8 aligned bytes: D % 16 == 0 and 16-byte aligned rows
    uint2 k_bits, v_bits;
    memcpy(&k_bits, k_codes, sizeof(k_bits));
    memcpy(&v_bits, v_codes, sizeof(v_bits));
    *reinterpret_cast<uint2*>(static_cast<uint8_t*>(const_cast<void*>(p.k)) + c.k_row + c.e0) = k_bits;
    *reinterpret_cast<uint2*>(static_cast<uint8_t*>(const_cast<void*>(p.v)) + c.v_row + c.e0) = v_bits;
  } else {
    uint4 k_bits = c.k;  // copied bit for bit unless rotated
    if (rotated) {
#pragma unroll
      for (int i = 0; i < kAppendChunk; ++i) k[i] = Element(x[i]);
      memcpy(&k_bits, k, sizeof(k_bits));
    }
    *reinterpret_cast<uint4*>(static_cast<Element*>(const_cast<void*>(p.k)) + c.k_row + c.e0) = k_bits;
    *reinterpret_cast<uint4*>(static_cast<Element*>(const_cast<void*>(p.v)) + c.v_row + c.e0) = c.v;
  }
}

template <typename Element, bool kFp8>
__global__ void __launch_bounds__(kAppendThreads) append_kernel(const __grid_constant__ DecodeArgs args,
                                                                 const int32_t* cu_seqlens_new, int64_t total_new) {
  const KvcacheParams& p = args.p;
  wait_for_previous_grids();  // programmatic dependent launch (sm_90): the caller's writes are visible from here
  allow_next_grid_launch();
  const int row_chunks = p.heads_k * (p.head_dim / kAppendChunk);  // (K/V head, chunk) items of one new row
  const int t_begin = int(blockIdx.x) * kAppendRowsPerCta;
  for (int b = int(blockIdx.y); b < p.batch; b += int(gridDim.y)) {  // (the branches below are uniform per CTA)
    const NewRows rows = new_rows_of(p, cu_seqlens_new, total_new, b);
    if (t_begin >= rows.count) continue;  // past this sequence's rows (or all of them: bad cu_seqlens_new entries)
    const int cached = p.cache_seqlens[b];
    if (!cache_keys_ok(cached, key_floor_of(p, b), rows.count, p.seqlen_k)) continue;  // the attention kernel reports it (NaN)
    const int items = (min(rows.count, t_begin + kAppendRowsPerCta) - t_begin) * row_chunks;
    for (int item0 = int(threadIdx.x); item0 < items; item0 += kAppendThreads * kAppendUnroll) {
      AppendChunk c[kAppendUnroll];
#pragma unroll
      for (int u = 0; u < kAppendUnroll; ++u)
        c[u] = load_append_chunk<Element>(args, rows, b, cached, t_begin, row_chunks, item0 + u * kAppendThreads, items);
#pragma unroll
      for (int u = 0; u < kAppendUnroll; ++u) store_append_chunk<Element, kFp8>(p, c[u]);
    }
  }
}

// ---- combine: CTAs of (chunk of an m-block's output, K/V head, sequence) ----
// Latency-bound at small batch (a few rows, up to a hundred splits): the call waits for it, so after the wait for
// the attention kernel it does as little as it can, in as few dependent rounds of memory access as it can, spread
// over as many threads as there are loads.
//   Before the wait: cache_seqlens (an input of the call, complete before the attention kernel let this one
//   launch) and everything that follows from the length: the m-block's rows and split count, the item's
//   addresses (block_rows and split_work are divisions, a few hundred instructions).
//   After it, one round: each (row, 4 columns) item of the output is a group of combine_lanes(num_splits)
//   neighbouring lanes of a warp; lane t of the group loads the LSEs and partials of splits t, t + lanes, ... (up
//   to kCombineUnroll at once) and merges them with a running maximum (the sums rescaled when a later batch of its
//   splits has a larger LSE); then the group's lanes merge their (max, sum, 4 sums) by shuffles, lane 0 storing.
// The order of the fp32 sums depends only on the split count, so the result is the same on every run. H200,
// 2026-12-01 16:18 UTC (bench/results/2026-12-01-1618-h200-decode-combine-*): working out the length's consequences
// before the wait took 3-14% off every split call of B = 1-4 (B = 1 / 4k, 16 splits: 10.73 -> 9.44 us; 32k 37.92 ->
// 36.90), nothing off unsplit ones. Before 16:00 UTC one thread per item merged every split, kCombineUnroll at a
// time, one CTA per m-block looping over its items, all after the wait: 123 splits of one K/V head (8 query heads)
// took 8 rounds of loads per item and 2 items per thread, ~10 us
// (bench/results/2026-12-01-1553-h200-decode-fewkv-timeline.txt).
constexpr int kCombineUnroll = kCombineSplitsPerLane;  // splits loaded at once per lane (decode_work.hpp)

// kLanes = combine_lanes(args.num_splits), a power of two <= 32 (the groups never straddle a warp), and `chunks` =
// combine_chunks(args) come from the launcher.
template <typename Element, int kLanes>
__global__ void __launch_bounds__(kCombineThreads) combine_kernel(const __grid_constant__ DecodeArgs args, int chunks) {
  const KvcacheParams& p = args.p;
  constexpr int kItemsPerCta = kCombineThreads / kLanes;
  const int m_block = blockIdx.x / chunks, chunk = blockIdx.x % chunks, hk = blockIdx.y, b = blockIdx.z;
  // Programmatic dependent launch (sm_90): this CTA may be resident before the attention kernel ends. That
  // kernel let it launch only after its own wait for the call's producers (of q, the caches, cache_seqlens), so
  // cache_seqlens is readable now; the partials are complete and visible only after the wait. What follows from the
  // length is worked out before the wait, while the attention kernel still runs (see above).
  const int cached = p.cache_seqlens[b];
  const int key_floor = key_floor_of(p, b);
  const int64_t split_stride = int64_t(p.batch) * p.heads_q * p.seqlen_q;  // partial rows per split
  const int dv = p.head_dim_v;
  const int quads = dv / 4;  // Dv % 8 == 0
  const int lane = threadIdx.x % kLanes;
  const int idx = chunk * kItemsPerCta + threadIdx.x / kLanes;  // this group's item
  int used = 0;             // splits to merge; < 2: nothing to do (the whole group agrees: the shuffles need it)
  // The LSE and partial of split `lane` for the item, and the steps to split lane + kLanes.
  const float* lse_p = args.partial_lse;
  const float4* part_p = reinterpret_cast<const float4*>(args.partial_out);
  const int64_t lse_step = kLanes * split_stride, part_step = lse_step * (dv / 4);
  int64_t out_at = 0;  // elements from out to the item's 4 columns
  int64_t lse_at = -1;  // from lse to its row's LSE (-1: none stored by this group)
  if (cache_keys_ok(cached, key_floor, p.seqlen_new, p.seqlen_k)) {  // else the attention kernel wrote NaN directly
    const BlockRows rows = padded_block_rows(args, m_block, cached + p.seqlen_new, key_floor);
    used = split_work(rows.key_begin, rows.key_end, args.block_n, args.num_splits, args.min_tiles_per_split, 0).used;
    if (idx >= rows.rows * quads) used = 0;
    if (used >= 2) {  // else written directly by the attention kernel
      const int row = idx / quads, col = (idx % quads) * 4;
      const int r = rows.row_begin + row;
      const int i = r / args.group, h = hk * args.group + r % args.group;
      // Varlen rows (decode_work.hpp; the forward's cu_seqlens_q, written before the call like cache_seqlens): the
      // forward's rows, and none for a padding row (the whole group has this item: it agrees).
      const QueryRows q_rows = p.cu_seqlens_q != nullptr ? varlen_query_rows(p, b) : QueryRows{};
      if (i < q_rows.first) used = 0;
      const int64_t prow = partial_row(p, b, h, i);
      lse_p += prow + lane * split_stride;
      part_p += ((prow + lane * split_stride) * dv + col) / 4;
      out_at = query_rows_offset(p, q_rows, b, p.out_batch_stride, p.out_row_stride) + int64_t(i) * p.out_row_stride +
               h * p.out_head_stride + col;
      if (col == 0 && p.lse != nullptr)
        lse_at = query_rows_offset(p, q_rows, b, p.lse_batch_stride, p.lse_row_stride) + h * p.lse_head_stride +
                 int64_t(i) * p.lse_row_stride;
    }
  }
  // Kept before the wait (an empty volatile asm is never moved across the wait's).
  asm volatile("" : "+r"(used), "+l"(lse_p), "+l"(part_p), "+l"(out_at), "+l"(lse_at));
  wait_for_previous_grids();
  allow_next_grid_launch();
  if (used < 2) return;
  Element* out = static_cast<Element*>(p.out);

  // out = sum_s exp2(lse_s - max) out_s / sum_s exp2(lse_s - max), lse = (max + log2(sum)) ln 2; the split LSEs
  // are in log2 units (decode_work.hpp), max over the splits (weights <= 1: no overflow); exp2, log2 and the
  // reciprocal are single MUFU instructions (ptx.cuh). NaN from a split that met a bad block id poisons the row;
  // no split saw a key: out = 0, lse = -inf (never NaN).
  float lse_max = -INFINITY, weight_sum = 0.f;
  bool any_nan = false;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int s0 = lane; s0 < used;
       s0 += kCombineUnroll * kLanes, lse_p += kCombineUnroll * lse_step, part_p += kCombineUnroll * part_step) {
    float lse[kCombineUnroll];
    float4 part[kCombineUnroll];
#pragma unroll
    for (int u = 0; u < kCombineUnroll; ++u) {  // all loads first: one round of memory latency
      const bool valid = s0 + u * kLanes < used;
      lse[u] = valid ? __ldcg(lse_p + u * lse_step) : -INFINITY;  // global loads through L2 (the asm above hid the space)
      part[u] = valid ? __ldcg(part_p + u * part_step) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    float batch_max = -INFINITY;
#pragma unroll
    for (int u = 0; u < kCombineUnroll; ++u) {
      any_nan = any_nan || isnan(lse[u]);
      batch_max = fmaxf(batch_max, lse[u]);  // fmaxf skips NaN
    }
    const float new_max = fmaxf(lse_max, batch_max);
    if (new_max == -INFINITY) continue;  // no split so far saw a key of this row
    const float rescale = exp2_approx(lse_max - new_max);  // 0 when lse_max = -inf (nothing summed yet)
    weight_sum *= rescale;
    acc.x *= rescale, acc.y *= rescale, acc.z *= rescale, acc.w *= rescale;
#pragma unroll
    for (int u = 0; u < kCombineUnroll; ++u) {  // in split order; weight 0 for a split that saw no key of the row
      const float w = exp2_approx(lse[u] - new_max);
      weight_sum += w;
      acc.x += w * part[u].x, acc.y += w * part[u].y, acc.z += w * part[u].z, acc.w += w * part[u].w;
    }
    lse_max = new_max;
  }
  // The group's lanes merge pairwise (xor butterfly: every lane ends with the same values). A lane that summed
  // nothing has lse_max = -inf and weight 0.
  const unsigned group_mask = kLanes == 32 ? 0xffffffffu : ((1u << kLanes) - 1u) << (threadIdx.x % 32 / kLanes * kLanes);
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset /= 2) {
    const float other_max = __shfl_xor_sync(group_mask, lse_max, offset);
    const float other_sum = __shfl_xor_sync(group_mask, weight_sum, offset);
    const float4 other = make_float4(__shfl_xor_sync(group_mask, acc.x, offset), __shfl_xor_sync(group_mask, acc.y, offset),
                                     __shfl_xor_sync(group_mask, acc.z, offset), __shfl_xor_sync(group_mask, acc.w, offset));
    any_nan = __shfl_xor_sync(group_mask, int(any_nan), offset) != 0 || any_nan;
    const float new_max = fmaxf(lse_max, other_max);
    const bool none = new_max == -INFINITY;  // neither lane saw a key: both weights 0 (exp2(-inf - -inf) would be NaN)
    const float mine = none ? 0.f : exp2_approx(lse_max - new_max);
    const float theirs = none ? 0.f : exp2_approx(other_max - new_max);
    weight_sum = weight_sum * mine + other_sum * theirs;
    acc.x = acc.x * mine + other.x * theirs, acc.y = acc.y * mine + other.y * theirs;
    acc.z = acc.z * mine + other.z * theirs, acc.w = acc.w * mine + other.w * theirs;
    lse_max = new_max;
  }
  if (lane != 0) return;
  const float inv = any_nan ? NAN : (weight_sum > 0.f ? rcp_approx(weight_sum) : 0.f);
  const uint2 packed = make_uint2(ElementTraits<Element>::pack(acc.x * inv, acc.y * inv), ElementTraits<Element>::pack(acc.z * inv, acc.w * inv));
  *reinterpret_cast<uint2*>(out + out_at) = packed;  // 8-byte aligned: 16-byte aligned rows, col % 4 == 0
  if (lse_at >= 0)
    p.lse[lse_at] = any_nan ? NAN : (weight_sum > 0.f ? (lse_max + log2_approx(weight_sum)) * kLn2 : -INFINITY);
}

// ---- guard: one CTA per sequence ----
// fa_kvcache: the blocks of keys [key_floor, cached + S_new); fa_kvcache_append (cu_seqlens_new): those of the rows
// written, [cached, cached + n_b), and column -2 for bad cu_seqlens_new entries.
__global__ void __launch_bounds__(kGuardThreads) guard_kernel(const __grid_constant__ DecodeArgs args, unsigned long long* status,
                                                              const int32_t* cu_seqlens_new, int64_t total_new) {
  const KvcacheParams& p = args.p;
  const int b = blockIdx.x;
  const NewRows rows = new_rows_of(p, cu_seqlens_new, total_new, b);
  if (rows.count < 0) {
    if (threadIdx.x == 0) atomicMin(status, guard_key(b, -2));
    return;
  }
  const int cached = p.cache_seqlens[b];
  const int key_floor = key_floor_of(p, b);
  if (!cache_keys_ok(cached, key_floor, rows.count, p.seqlen_k)) {
    if (threadIdx.x == 0) atomicMin(status, guard_key(b, -1));
    return;
  }
  if (p.block_table == nullptr) return;
  const int used_blocks = (cached + rows.count + p.page_block_size - 1) / p.page_block_size;
  const int first_block = cu_seqlens_new == nullptr ? key_floor / p.page_block_size
                                                   : (rows.count > 0 ? cached / p.page_block_size : used_blocks);
  for (int n = first_block + threadIdx.x; n < used_blocks; n += blockDim.x) {
    const int32_t id = p.block_table[b * p.block_table_batch_stride + n];
    if (uint32_t(id) >= uint32_t(p.num_blocks)) atomicMin(status, guard_key(b, n));
  }
}

template <typename Element, bool kFp8>
Status launch_append_typed(const DecodeArgs& args, cudaStream_t stream, const int32_t* cu_seqlens_new, int64_t total_new) {
  const KvcacheParams& p = args.p;
  const dim3 grid(unsigned((p.seqlen_new + kAppendRowsPerCta - 1) / kAppendRowsPerCta),
                  std::min(unsigned(p.batch), kMaxAppendSequenceCtas));
  FA_CUDA_RETURN_IF_ERROR(launch_decode_kernel(&append_kernel<Element, kFp8>, grid, dim3(kAppendThreads), 0, stream,
                                               args.programmatic_launch != 0, 0u, 0, args, cu_seqlens_new, total_new));
  return Status();
}

template <typename Element, int kLanes>
Status launch_combine_lanes(const DecodeArgs& args, cudaStream_t stream) {
  const int chunks = combine_chunks(args);
  const dim3 grid(unsigned(args.m_blocks) * unsigned(chunks), args.p.heads_k, args.p.batch);
  FA_CUDA_RETURN_IF_ERROR(launch_decode_kernel(&combine_kernel<Element, kLanes>, grid, dim3(kCombineThreads), 0, stream,
                                               args.programmatic_launch != 0, 0u, 0, args, chunks));
  return Status();
}

template <typename Element>
Status launch_combine_typed(const DecodeArgs& args, cudaStream_t stream) {
  switch (combine_lanes(args.num_splits)) {
    case 1: return launch_combine_lanes<Element, 1>(args, stream);
    case 2: return launch_combine_lanes<Element, 2>(args, stream);
    case 4: return launch_combine_lanes<Element, 4>(args, stream);
    case 8: return launch_combine_lanes<Element, 8>(args, stream);
    case 16: return launch_combine_lanes<Element, 16>(args, stream);
    default: return launch_combine_lanes<Element, 32>(args, stream);
  }
}

}  // namespace

Status launch_append(const DecodeArgs& args, void* stream, const int32_t* cu_seqlens_new, int64_t total_new) {
  const KvcacheParams& p = args.p;
  if (p.k_new == nullptr || p.seqlen_new == 0 || p.batch == 0) return Status();
  const auto s = static_cast<cudaStream_t>(stream);
  const int32_t* cu = cu_seqlens_new;
  if (p.kv_dtype == FA_FLOAT8_E4M3)
    return p.dtype == FA_BFLOAT16 ? launch_append_typed<__nv_bfloat16, true>(args, s, cu, total_new)
                                  : launch_append_typed<__half, true>(args, s, cu, total_new);
  return p.dtype == FA_BFLOAT16 ? launch_append_typed<__nv_bfloat16, false>(args, s, cu, total_new)
                                : launch_append_typed<__half, false>(args, s, cu, total_new);
}

Status launch_combine(const DecodeArgs& args, void* stream) {
  if (args.num_splits < 2 || args.m_blocks == 0 || args.p.batch == 0) return Status();
  const auto s = static_cast<cudaStream_t>(stream);
  return args.p.dtype == FA_BFLOAT16 ? launch_combine_typed<__nv_bfloat16>(args, s) : launch_combine_typed<__half>(args, s);
}

Status launch_guard(const DecodeArgs& args, unsigned long long* status, void* stream, const int32_t* cu_seqlens_new,
                    int64_t total_new) {
  if (args.p.batch == 0) return Status();
  guard_kernel<<<args.p.batch, kGuardThreads, 0, static_cast<cudaStream_t>(stream)>>>(args, status, cu_seqlens_new, total_new);
  FA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status();
}

}  // namespace flashattn::cuda::decode
