// The library's scratch pools, one per device, created on first use and kept for the process (scratch_pool.hpp).
#include "cuda/common/scratch_pool.hpp"

#include <mutex>

#include "cuda/common/check.hpp"

namespace flashattn::cuda {
namespace {

constexpr int kMaxDevices = 64;

struct Pools {
  std::mutex mutex;
  cudaMemPool_t pool[kMaxDevices] = {};
};

Pools& pools() {
  static Pools p;
  return p;
}

Status pool_of(int device, cudaMemPool_t* out) {
  if (device < 0 || device >= kMaxDevices)
    return error(FA_ERROR_UNSUPPORTED, "q: cuda device %d is beyond the %d devices the scratch pools serve", device, kMaxDevices);
  Pools& p = pools();
  std::lock_guard<std::mutex> lock(p.mutex);
  if (p.pool[device] == nullptr) {
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    cudaMemPool_t pool = nullptr;
    FA_CUDA_RETURN_IF_ERROR(cudaMemPoolCreate(&pool, &props));
    uint64_t keep = kScratchPoolKeepBytes;
    const cudaError_t set = cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);
    if (set != cudaSuccess) {
      cudaMemPoolDestroy(pool);
      FA_CUDA_RETURN_IF_ERROR(set);
    }
    p.pool[device] = pool;
  }
  *out = p.pool[device];
  return Status();
}

}  // namespace

Status scratch_alloc(int device, size_t bytes, cudaStream_t stream, void** ptr) {
  cudaMemPool_t pool = nullptr;
  FA_RETURN_IF_ERROR(pool_of(device, &pool));
  FA_CUDA_RETURN_IF_ERROR(cudaMallocFromPoolAsync(ptr, bytes, pool, stream));
  return Status();
}

}  // namespace flashattn::cuda
