// Tensor maps of the K/V cache (cache_tensor_maps.hpp). The driver's encoder is reached through the runtime's
// entry-point query, so the library links no libcuda.
#include "cuda/decode/cache_tensor_maps.hpp"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

namespace flashattn::cuda::decode {
namespace {

static_assert(sizeof(CUtensorMap) == sizeof(TensorMapBytes), "TensorMapBytes holds a CUtensorMap (copied: memcpy)");

PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encoder = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();  // an answer, not an error of the caller's
      fn = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encoder;
}

// One cache (K or V) as a 4-d tensor of 16-bit elements {D, rows, Hk, count} with the given element strides of
// dims 1..3, in boxes of 16 rows x 64 columns of one head, 128-byte swizzled (the kernel's SwizzledTile rows of
// 64-column blocks). False when the encoder refuses it.
bool encode(const void* base, int64_t cols, int64_t rows, int64_t heads, int64_t count, int64_t row_stride,
            int64_t head_stride, int64_t count_stride, TensorMapBytes* map) {
  const auto encoder = tensor_map_encoder();
  if (encoder == nullptr) return false;
  const cuuint64_t dims[4] = {cuuint64_t(cols), cuuint64_t(rows), cuuint64_t(heads), cuuint64_t(count)};
  const cuuint64_t strides[3] = {cuuint64_t(row_stride * 2), cuuint64_t(head_stride * 2), cuuint64_t(count_stride * 2)};
  const cuuint32_t box[4] = {64, 16, 1, 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  CUtensorMap encoded;
  const CUresult result = encoder(&encoded, CU_TENSOR_MAP_DATA_TYPE_UINT16, 4, const_cast<void*>(base), dims, strides, box,
                                  element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                  CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (result != CUDA_SUCCESS) return false;
  std::memcpy(map, &encoded, sizeof(encoded));
  return true;
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
bool stride_ok(int64_t elements) { return elements > 0 && (elements * 2) % 16 == 0 && elements * 2 < (int64_t(1) << 40); }

}  // namespace

void set_cache_tensor_maps(const KvcacheParams& p, int head_dim_bucket, DecodeArgs* args) {
  args->tma_copies = 0;
  const bool paged = p.block_table != nullptr;
  const bool shape_ok = p.kv_dtype == p.dtype && p.head_dim == head_dim_bucket && p.head_dim_v == head_dim_bucket &&
                        head_dim_bucket % 64 == 0 && (!paged || args->page_shift >= 4);
  if (!shape_ok || !aligned16(p.k) || !aligned16(p.v)) return;
  // Paged: {D, block size, Hk, num_blocks}, block stride = the batch stride; contiguous: {D, capacity, Hk, B}.
  const int64_t rows = paged ? p.page_block_size : p.seqlen_k;
  const int64_t count = paged ? p.num_blocks : p.batch;
  for (const int64_t s : {p.k_row_stride, p.k_head_stride, p.k_batch_stride, p.v_row_stride, p.v_head_stride, p.v_batch_stride})
    if (!stride_ok(s)) return;
  if (rows < 16 || count < 1 || p.heads_k < 1) return;
  if (!encode(p.k, p.head_dim, rows, p.heads_k, count, p.k_row_stride, p.k_head_stride, p.k_batch_stride, &args->k_map)) return;
  if (!encode(p.v, p.head_dim_v, rows, p.heads_k, count, p.v_row_stride, p.v_head_stride, p.v_batch_stride, &args->v_map)) return;
  args->tma_copies = 1;
}

}  // namespace flashattn::cuda::decode
