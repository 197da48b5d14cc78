// The merge of the forward's split-KV partials (forward_split.hpp): one warp per (sequence, head, query row); for a
// varlen call, also the plan kernel that writes its work list, and the merge of the list's partials (one warp per row
// of the merge list's tiles).
//
// Share s of a row holds O_s = (sum over its keys of p_j v_j) / (sum of p_j) and its LSE l_s (log2 units). Then
//   L = m + log2(sum_s 2^(l_s - m)),  m = max_s l_s,     O = sum_s 2^(l_s - L) O_s,
// the row's attention over all of its keys (the merge of core semantics), in float32, rounded once to the output type.
// A share without a key of the row has l_s = -inf and weighs 0 (its O_s is never read); a row no share saw a key of
// gets O = 0 and LSE = -inf, as the unsplit kernel gives it; a NaN share (a NaN input, a bad block id) makes the row NaN.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cuda/common/check.hpp"
#include "cuda/common/ptx.cuh"
#include "cuda/sm80/forward_packing.hpp"
#include "cuda/sm80/forward_split.hpp"

namespace flashattn::cuda::sm80 {
namespace {

constexpr int kCombineWarps = 4;  // rows per CTA (affects speed only)
constexpr int kCombineCtasPerSlot = 8;  // the work-list merge's grid: at most 8 CTAs per slot of the split kernel
constexpr float kLn2 = 0.6931471805599453f;
constexpr int kMaxColumnsPerLane = 8;  // Dv <= 256: 2 float4 per lane

// Merges one row's shares (one warp; lane s < splits holds share s's LSE in share_lse, -inf elsewhere) into out_row
// (Dv columns) and, when lse_out is set, its LSE (natural log). o_row(s): share s's O partial row.
template <typename Element, typename OPartialRow>
__device__ void merge_row(int splits, float share_lse, OPartialRow o_row, int head_dim_v, Element* out_row, float* lse_out) {
  const int lane = threadIdx.x & 31;
  const bool any_nan = __any_sync(0xffffffffu, isnan(share_lse));
  float m = share_lse;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
  float lse2 = NAN;  // log2 units
  float weight = 0.f;
  if (!any_nan && m == -INFINITY) {
    lse2 = -INFINITY;
  } else if (!any_nan) {
    weight = exp2f(share_lse - m);  // 0 for a share without keys
    float sum = weight;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    lse2 = m + log2f(sum);
    weight /= sum;
  }

  // Lane l owns columns 4 l + 128 k, k = 0, 1 (float4 loads of every share's row; 8-byte stores of 4 outputs).
  float acc[kMaxColumnsPerLane];
#pragma unroll
  for (int c = 0; c < kMaxColumnsPerLane; ++c) acc[c] = any_nan ? NAN : 0.f;
  if (!any_nan && lse2 != -INFINITY) {
    for (int s = 0; s < splits; ++s) {
      const float w = __shfl_sync(0xffffffffu, weight, s);
      if (w == 0.f) continue;  // warp-uniform: a share without keys, or one too small to matter in float32
      const float* row = o_row(s);
#pragma unroll
      for (int k = 0; k < kMaxColumnsPerLane / 4; ++k) {
        const int col = 4 * lane + 128 * k;
        if (col < head_dim_v) {
          const float4 v = *reinterpret_cast<const float4*>(row + col);
          acc[4 * k] = fmaf(w, v.x, acc[4 * k]);
          acc[4 * k + 1] = fmaf(w, v.y, acc[4 * k + 1]);
          acc[4 * k + 2] = fmaf(w, v.z, acc[4 * k + 2]);
          acc[4 * k + 3] = fmaf(w, v.w, acc[4 * k + 3]);
        }
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kMaxColumnsPerLane / 4; ++k) {
    const int col = 4 * lane + 128 * k;
    if (col < head_dim_v)
      *reinterpret_cast<uint2*>(out_row + col) = make_uint2(ElementTraits<Element>::pack(acc[4 * k], acc[4 * k + 1]),
                                                            ElementTraits<Element>::pack(acc[4 * k + 2], acc[4 * k + 3]));
  }
  if (lse_out != nullptr && lane == 0) *lse_out = lse2 * kLn2;
}

// Grid mode: one warp per (sequence, query head, query row).
template <typename Element>
__global__ void __launch_bounds__(kCombineWarps * 32) forward_combine_kernel(const __grid_constant__ AttentionParams p,
                                                                            int splits, const float* o_partial,
                                                                            const float* lse_partial) {
  static_assert(kMaxForwardSplits <= 32, "one share per lane");
  const int lane = threadIdx.x & 31;
  const int i = blockIdx.x * kCombineWarps + (threadIdx.x >> 5);
  const int h = blockIdx.y;
  const int b = blockIdx.z;
  const SequenceExtent ext = sequence_extent(p, b);
  if (i >= ext.seqlen_q) return;
  if (ext.seqlen_q <= int(p.routed_seqlen_q)) return;  // the decode kernels' rows (forward_kernel.cuh skips them too)
  const float share_lse = lane < splits ? lse_partial[split_partial_row(p, lane, b, h, i)] : -INFINITY;
  Element* out = static_cast<Element*>(p.out) + q_offset(p, p.out_batch_stride, p.out_row_stride, p.out_head_stride, b, ext, i, h);
  merge_row(splits, share_lse, [&](int s) { return o_partial + split_partial_row(p, s, b, h, i) * p.head_dim_v; },
            p.head_dim_v, out, p.lse != nullptr ? p.lse + lse_offset(p, b, ext, i, h) : nullptr);
}

// Work list: one warp per row to merge, the rows of the merge list's tiles (M tiles x grid heads x block_m rows, a
// tile's rows consecutive) dealt to the grid's warps in turn. Tile m is item e = merges[1 + m], split 0 of its tile,
// whose shares are items e .. e + splits - 1.
template <typename Element>
__global__ void __launch_bounds__(kCombineWarps * 32) forward_combine_work_kernel(const __grid_constant__ AttentionParams p,
                                                                                 const ForwardWorkShape shape,
                                                                                 const ForwardSplitWork work) {
  const int lane = threadIdx.x & 31;
  const int pack = gqa_pack_factor(p);
  const int64_t tile_rows = int64_t(shape.heads) * shape.block_m;
  const int64_t rows = work.merges[0] * tile_rows;
  for (int64_t f = int64_t(blockIdx.x) * kCombineWarps + (threadIdx.x >> 5); f < rows;
       f += int64_t(gridDim.x) * kCombineWarps) {
    const int e = work.merges[1 + f / tile_rows];
    const int h = int(f % tile_rows) / shape.block_m;  // the grid head (packed: the K/V head)
    const int local = int(f % shape.block_m);
    const SplitWorkItem item = work.items[e];
    const SequenceExtent ext = sequence_extent(p, item.b);
    const int r = item.m_block * shape.block_m + local;
    if (r >= ext.seqlen_q * pack) continue;  // the sequence's last tile, past its rows (warp-uniform)
    const int i = packed_query_row(r, pack);
    const int head = pack > 1 ? packed_query_head(r, h, pack) : h;
    const float share_lse =
        lane < item.splits ? work.lse_partial[work_partial_row(e + lane, shape.heads, h, shape.block_m, local)] : -INFINITY;
    Element* out =
        static_cast<Element*>(p.out) + q_offset(p, p.out_batch_stride, p.out_row_stride, p.out_head_stride, item.b, ext, i, head);
    merge_row(item.splits, share_lse,
              [&](int s) { return work.o_partial + work_partial_row(e + s, shape.heads, h, shape.block_m, local) * p.head_dim_v; },
              p.head_dim_v, out, p.lse != nullptr ? p.lse + lse_offset(p, item.b, ext, i, head) : nullptr);
  }
}

// The plan of a work-list call (forward_split.hpp), one CTA: pass 1 counts the query tiles the split kernel runs (of
// sequences the decode kernels did not take), the cap follows (work_split_cap); pass 2 gives each sequence its splits
// (work_sequence_splits over its key tiles) and writes its items at its offset in the list (an exclusive scan of
// tiles x splits over the sequences, kPlanThreads at a time); the rest of the list is marked empty.
constexpr int kPlanThreads = 512;

__device__ int plan_sequence_tiles(const AttentionParams& p, const ForwardWorkShape& shape, int pack, int b,
                                   int* key_tiles) {
  const SequenceExtent ext = sequence_extent(p, b);
  *key_tiles = (ext.seqlen_k + shape.block_n - 1) / shape.block_n;
  if (ext.seqlen_q <= int(p.routed_seqlen_q)) return 0;  // the decode kernels' (routed_seqlen_q 0: none)
  return (ext.seqlen_q * pack + shape.block_m - 1) / shape.block_m;
}

__global__ void __launch_bounds__(kPlanThreads) forward_split_plan_kernel(const __grid_constant__ AttentionParams p,
                                                                         const ForwardWorkShape shape, ForwardSplitWork work) {
  SplitWorkItem* const items = const_cast<SplitWorkItem*>(work.items);
  using BlockReduce = cub::BlockReduce<int64_t, kPlanThreads>;
  using BlockScan = cub::BlockScan<int64_t, kPlanThreads>;
  __shared__ union {
    typename BlockReduce::TempStorage reduce;
    typename BlockScan::TempStorage scan;
  } temp;
  __shared__ int64_t shared_total;
  const int pack = gqa_pack_factor(p);
  int64_t tiles = 0;
  for (int b = threadIdx.x; b < p.batch; b += kPlanThreads) {
    int key_tiles = 0;
    tiles += plan_sequence_tiles(p, shape, pack, b, &key_tiles);
  }
  const int64_t total = BlockReduce(temp.reduce).Sum(tiles);
  if (threadIdx.x == 0) shared_total = total;
  __syncthreads();
  const int cap = work_split_cap(shared_total * shape.heads, shape.slots, shape.forced);
  int64_t base = 0, merge_base = 0;  // items and tiles to merge of the sequences before this chunk
  for (int chunk = 0; chunk < p.batch; chunk += kPlanThreads) {
    const int b = chunk + int(threadIdx.x);
    int key_tiles = 0;
    const int m_tiles = b < p.batch ? plan_sequence_tiles(p, shape, pack, b, &key_tiles) : 0;
    const int splits = work_sequence_splits(cap, key_tiles, shape.forced);
    int64_t first = 0, chunk_items = 0, first_merge = 0, chunk_merges = 0;
    __syncthreads();  // temp's last use is done
    BlockScan(temp.scan).ExclusiveSum(int64_t(m_tiles) * splits, first, chunk_items);
    __syncthreads();
    BlockScan(temp.scan).ExclusiveSum(splits > 1 ? int64_t(m_tiles) : 0, first_merge, chunk_merges);
    write_sequence_work(shape, b, m_tiles, splits, first + base, first_merge + merge_base, items, work.merges);
    base += chunk_items;
    merge_base += chunk_merges;
  }
  for (int64_t e = base + threadIdx.x; e < shape.max_items; e += kPlanThreads) items[e] = SplitWorkItem{-1, 0, 0, 0};
  if (threadIdx.x == 0) work.merges[0] = int32_t(merge_base < shape.max_merges ? merge_base : shape.max_merges);
}

}  // namespace

Status launch_forward_combine(const AttentionParams& p, int splits, const float* o_partial, const float* lse_partial,
                              void* stream) {
  if (splits < 1 || splits > kMaxForwardSplits || p.head_dim_v > 32 * kMaxColumnsPerLane || p.head_dim_v % 4 != 0)
    return error(FA_ERROR_INTERNAL, "forward combine: %d splits, Dv %d outside its limits", splits, p.head_dim_v);
  const dim3 grid((p.seqlen_q + kCombineWarps - 1) / kCombineWarps, p.heads_q, p.batch);
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return Status();
  const auto s = static_cast<cudaStream_t>(stream);
  if (p.dtype == FA_BFLOAT16)
    forward_combine_kernel<__nv_bfloat16><<<grid, kCombineWarps * 32, 0, s>>>(p, splits, o_partial, lse_partial);
  else
    forward_combine_kernel<__half><<<grid, kCombineWarps * 32, 0, s>>>(p, splits, o_partial, lse_partial);
  FA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status();
}

Status launch_forward_split_plan(const AttentionParams& p, const ForwardWorkShape& shape, const ForwardSplitWork& work,
                                 void* stream) {
  if (shape.max_items < 1 || shape.max_merges < 1 || shape.block_m < 1 || shape.block_n < 1 || shape.heads < 1)
    return error(FA_ERROR_INTERNAL, "forward split plan: a list of %d items of %d-row tiles", shape.max_items, shape.block_m);
  forward_split_plan_kernel<<<1, kPlanThreads, 0, static_cast<cudaStream_t>(stream)>>>(p, shape, work);
  FA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status();
}

Status launch_forward_combine_work(const AttentionParams& p, const ForwardWorkShape& shape, const ForwardSplitWork& work,
                                   void* stream) {
  if (p.head_dim_v > 32 * kMaxColumnsPerLane || p.head_dim_v % 4 != 0)
    return error(FA_ERROR_INTERNAL, "forward combine: Dv %d outside its limits", p.head_dim_v);
  // Warps for every row the merge list may hold, at most kCombineCtasPerSlot CTAs per slot of the split kernel (the
  // warps then take several rows each; affects speed only).
  const int64_t max_rows = int64_t(shape.max_merges) * shape.heads * shape.block_m;
  const int64_t ctas = std::min<int64_t>((max_rows + kCombineWarps - 1) / kCombineWarps, shape.slots * kCombineCtasPerSlot);
  const dim3 grid(uint32_t(std::max<int64_t>(ctas, 1)));
  const auto s = static_cast<cudaStream_t>(stream);
  if (p.dtype == FA_BFLOAT16)
    forward_combine_work_kernel<__nv_bfloat16><<<grid, kCombineWarps * 32, 0, s>>>(p, shape, work);
  else
    forward_combine_work_kernel<__half><<<grid, kCombineWarps * 32, 0, s>>>(p, shape, work);
  FA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status();
}

}  // namespace flashattn::cuda::sm80
