// Gather and scatter of a paged varlen forward's short sequences (short_sequences.hpp; the tests' way to the routed
// call). Both move 16-byte chunks (D and Dv are multiples of 8 16-bit elements on CUDA, and every row start is 16-byte
// aligned: dispatch.cpp's rules) and depend on no dtype. Grid: (chunks of the rows, B); a sequence's routing is
// recomputed from its extent in each. And the key counts of the routed call and of the in-place decode step (one
// thread per sequence).
// On sm_90+ the gather, the scatter and the key counts launch as programmatic dependents of the kernel before them
// (programmatic_launch.cuh) and let the next kernel launch at once: the decode kernel after the gather (or the key
// counts) is itself such a dependent, and the gather follows the append kernel, which lets it launch at once too; so
// each launch overlaps the kernel before it instead of following its end. Each waits (griddepcontrol.wait) before it
// touches global memory. Affects speed only.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>

#include "cuda/common/check.hpp"
#include "cuda/decode/cache_rows.cuh"
#include "cuda/decode/decode_plan.hpp"
#include "cuda/decode/programmatic_launch.cuh"
#include "cuda/decode/short_sequences.hpp"

namespace flashattn::cuda::decode {
namespace {

constexpr int kCopyThreads = 256;
constexpr int kMaxCopyBlocks = 64;  // per sequence; grid-stride beyond (affects speed only)

// Query rows of sequence b that the decode call computes: all of them when 1 <= n <= T, else none. The forward kernel
// skips exactly the sequences with n <= T (forward_kernel.cuh): those with n <= 0 have no rows.
__device__ __forceinline__ int routed_rows(const SequenceExtent& ext, int max_q) {
  return ext.seqlen_q >= 1 && ext.seqlen_q <= max_q ? ext.seqlen_q : 0;
}
// The cache_seqlens entry of the routed decode call for sequence b: its key count, or 0 where it takes no rows.
__device__ __forceinline__ int32_t routed_key_count(const SequenceExtent& ext, int max_q) {
  return routed_rows(ext, max_q) > 0 ? ext.seqlen_k : 0;
}

__global__ void __launch_bounds__(kCopyThreads) gather_kernel(const __grid_constant__ AttentionParams p,
                                                              const ShortSequenceRows rows) {
  wait_for_previous_grids();  // (programmatic launch) the kernels before it are done and their writes visible
  allow_next_grid_launch();   // the decode kernel waits for this grid's end in its own wait
  const int b = blockIdx.y;
  const SequenceExtent ext = sequence_extent(p, b);
  const int n = routed_rows(ext, rows.max_q);
  if (blockIdx.x == 0 && threadIdx.x == 0) rows.cache_seqlens[b] = routed_key_count(ext, rows.max_q);
  const int chunks_per_row = p.head_dim / 8;
  const int64_t chunks = int64_t(rows.max_q) * p.heads_q * chunks_per_row;  // of this sequence's T padded rows
  const int padding = rows.max_q - n;
  const uint16_t* q = static_cast<const uint16_t*>(p.q);
  uint4* q_rows = static_cast<uint4*>(rows.q) + int64_t(b) * chunks;
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < chunks; idx += int64_t(gridDim.x) * blockDim.x) {
    const int chunk = int(idx % chunks_per_row);
    const int64_t rest = idx / chunks_per_row;
    const int h = int(rest % p.heads_q);
    const int i = int(rest / p.heads_q) - padding;  // query i of the sequence; < 0: a padding row (zeros)
    uint4 value = make_uint4(0u, 0u, 0u, 0u);
    if (i >= 0)
      value = *reinterpret_cast<const uint4*>(q + (int64_t(ext.q_row0) + i) * p.q_row_stride + int64_t(h) * p.q_head_stride +
                                              chunk * 8);
    q_rows[idx] = value;
  }
}

__global__ void __launch_bounds__(kCopyThreads) scatter_kernel(const __grid_constant__ AttentionParams p,
                                                               const ShortSequenceRows rows) {
  wait_for_previous_grids();  // (programmatic launch) the decode call's out and lse are written from here
  allow_next_grid_launch();
  const int b = blockIdx.y;
  const SequenceExtent ext = sequence_extent(p, b);
  const int n = routed_rows(ext, rows.max_q);
  if (n == 0) return;
  const int padding = rows.max_q - n;
  const int chunks_per_row = p.head_dim_v / 8;
  const int64_t chunks = int64_t(n) * p.heads_q * chunks_per_row;
  const uint4* out_rows = static_cast<const uint4*>(rows.out) + int64_t(b) * rows.max_q * p.heads_q * chunks_per_row;
  uint16_t* out = static_cast<uint16_t*>(p.out);
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < chunks; idx += step) {
    const int chunk = int(idx % chunks_per_row);
    const int64_t rest = idx / chunks_per_row;
    const int h = int(rest % p.heads_q);
    const int i = int(rest / p.heads_q);
    *reinterpret_cast<uint4*>(out + (int64_t(ext.q_row0) + i) * p.out_row_stride + int64_t(h) * p.out_head_stride + chunk * 8) =
        out_rows[(int64_t(padding + i) * p.heads_q + h) * chunks_per_row + chunk];
  }
  if (p.lse == nullptr) return;
  const float* lse_rows = rows.lse + int64_t(b) * p.heads_q * rows.max_q;  // (Hq, T) of sequence b
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < int64_t(n) * p.heads_q; idx += step) {
    const int i = int(idx % n);
    const int h = int(idx / n);
    p.lse[int64_t(h) * p.lse_head_stride + (int64_t(ext.q_row0) + i) * p.lse_row_stride] =
        lse_rows[int64_t(h) * rows.max_q + padding + i];
  }
}

// key_counts[b]: sequence b's count of keys; with routed_max_q > 0, 0 for a sequence the routed decode call does not
// take (routed_rows), so that call skips it.
__global__ void __launch_bounds__(kCopyThreads) key_counts_kernel(const __grid_constant__ AttentionParams p, int routed_max_q,
                                                                  int32_t* key_counts) {
  wait_for_previous_grids();  // (programmatic launch) as the gather
  allow_next_grid_launch();
  const int b = int(blockIdx.x) * kCopyThreads + int(threadIdx.x);
  if (b >= p.batch) return;
  const SequenceExtent ext = sequence_extent(p, b);
  key_counts[b] = routed_max_q == 0 ? ext.seqlen_k : routed_key_count(ext, routed_max_q);
}

__global__ void __launch_bounds__(kCopyThreads) route_key_counts_kernel(const __grid_constant__ KvcacheParams p,
                                                                        int32_t* key_counts, int32_t* bad) {
  const int b = int(blockIdx.x) * kCopyThreads + int(threadIdx.x);
  if (b >= p.batch) return;
  const int32_t cached = p.cache_seqlens[b];
  const bool ok = cached >= 0 && int64_t(cached) + p.seqlen_new <= int64_t(p.seqlen_k);  // seqlen_k: the capacity
  key_counts[b] = ok ? cached + p.seqlen_new : 0;
  bad[b] = ok ? 0 : 1;
}

// Grid: (chunks of a sequence's rows, B); a block of a good sequence returns at once.
__global__ void __launch_bounds__(kCopyThreads) route_poison_kernel(const __grid_constant__ KvcacheParams p, const int32_t* bad) {
  const int b = blockIdx.y;
  if (bad[b] == 0) return;
  const int64_t values = int64_t(p.seqlen_q) * p.heads_q * p.head_dim_v;
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  const uint16_t nan16 = p.dtype == FA_BFLOAT16 ? uint16_t(0x7fc0) : uint16_t(0x7e00);  // quiet NaN of bf16 / fp16
  uint16_t* out = static_cast<uint16_t*>(p.out);
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < values; idx += step) {
    const int x = int(idx % p.head_dim_v);
    const int64_t rest = idx / p.head_dim_v;
    const int h = int(rest % p.heads_q);
    const int i = int(rest / p.heads_q);
    out[int64_t(b) * p.out_batch_stride + int64_t(i) * p.out_row_stride + int64_t(h) * p.out_head_stride + x] = nan16;
  }
  if (p.lse == nullptr) return;
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < int64_t(p.seqlen_q) * p.heads_q; idx += step) {
    const int i = int(idx % p.seqlen_q);
    const int h = int(idx / p.seqlen_q);
    p.lse[int64_t(b) * p.lse_batch_stride + int64_t(h) * p.lse_head_stride + int64_t(i) * p.lse_row_stride] = NAN;
  }
}

unsigned copy_blocks(int64_t chunks) {
  return unsigned(std::clamp<int64_t>((chunks + kCopyThreads - 1) / kCopyThreads, 1, kMaxCopyBlocks));
}

// Whether the gather, scatter and key-count kernels above may launch as programmatic dependents on `device`: compute
// capability 9.0+ and their image compiled for it (a build for sm_80 only runs on an H100 through compute_80 PTX, whose
// kernels have no griddepcontrol.wait: as dependents they would read before the kernel before them is done;
// decode_launch.cuh, the same rule). Asked once per device (< 64; others: never).
bool programmatic_on(int device) {
  static std::atomic<uint64_t> asked{0}, yes{0};  // bit d: device d asked; and the answer was yes
  if (!kProgrammaticLaunch || device < 0 || device >= 64) return false;
  const uint64_t bit = uint64_t(1) << device;
  if ((asked.load(std::memory_order_acquire) & bit) != 0) return (yes.load(std::memory_order_relaxed) & bit) != 0;
  int major = 0;
  cudaFuncAttributes gather{}, scatter{}, counts{};
  const bool ok = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
                  cudaFuncGetAttributes(&gather, gather_kernel) == cudaSuccess &&
                  cudaFuncGetAttributes(&scatter, scatter_kernel) == cudaSuccess &&
                  cudaFuncGetAttributes(&counts, key_counts_kernel) == cudaSuccess;
  if (!ok) {
    cudaGetLastError();  // (clear it: an ordinary launch then reports any real fault)
    return false;
  }
  const bool on = major >= 9 && gather.ptxVersion >= 90 && scatter.ptxVersion >= 90 && counts.ptxVersion >= 90;
  if (on) yes.fetch_or(bit, std::memory_order_relaxed);
  asked.fetch_or(bit, std::memory_order_release);
  return on;
}

}  // namespace

Status launch_gather_short_sequences(const AttentionParams& p, const ShortSequenceRows& rows, void* stream) {
  if (p.batch == 0 || rows.max_q == 0) return Status();
  const dim3 grid(copy_blocks(int64_t(rows.max_q) * p.heads_q * (p.head_dim / 8)), unsigned(p.batch));
  FA_CUDA_RETURN_IF_ERROR(launch_decode_kernel(&gather_kernel, grid, dim3(kCopyThreads), 0, static_cast<cudaStream_t>(stream),
                                               programmatic_on(p.device_id), 0u, 0, p, rows));
  return Status();
}

Status launch_key_counts(const AttentionParams& p, int routed_max_q, int32_t* key_counts, void* stream) {
  if (p.batch == 0) return Status();
  FA_CUDA_RETURN_IF_ERROR(launch_decode_kernel(&key_counts_kernel, dim3(unsigned((p.batch + kCopyThreads - 1) / kCopyThreads)),
                                               dim3(kCopyThreads), 0, static_cast<cudaStream_t>(stream),
                                               programmatic_on(p.device_id), 0u, 0, p, routed_max_q, key_counts));
  return Status();
}

Status launch_route_key_counts(const KvcacheParams& p, int32_t* key_counts, int32_t* bad, void* stream) {
  if (p.batch == 0) return Status();
  route_key_counts_kernel<<<unsigned((p.batch + kCopyThreads - 1) / kCopyThreads), kCopyThreads, 0,
                            static_cast<cudaStream_t>(stream)>>>(p, key_counts, bad);
  FA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status();
}

Status launch_route_poison_bad(const KvcacheParams& p, const int32_t* bad, void* stream) {
  if (p.batch == 0 || p.seqlen_q == 0) return Status();
  const dim3 grid(copy_blocks(int64_t(p.seqlen_q) * p.heads_q * p.head_dim_v / 8), unsigned(p.batch));
  route_poison_kernel<<<grid, kCopyThreads, 0, static_cast<cudaStream_t>(stream)>>>(p, bad);
  FA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status();
}

Status launch_scatter_short_sequences(const AttentionParams& p, const ShortSequenceRows& rows, void* stream) {
  if (p.batch == 0 || rows.max_q == 0) return Status();
  const dim3 grid(copy_blocks(int64_t(rows.max_q) * p.heads_q * (p.head_dim_v / 8)), unsigned(p.batch));
  FA_CUDA_RETURN_IF_ERROR(launch_decode_kernel(&scatter_kernel, grid, dim3(kCopyThreads), 0, static_cast<cudaStream_t>(stream),
                                               programmatic_on(p.device_id), 0u, 0, p, rows));
  return Status();
}

}  // namespace flashattn::cuda::decode
