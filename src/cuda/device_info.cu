// Device queries for `flashattn info` and for the call paths (cached), and a probe kernel that proves the
// library's kernel image loads on the device (it reports the architecture it was compiled for).
#include <cuda_runtime.h>

#include <cstdio>
#include <mutex>
#include <string>
#include <vector>

#include "cuda/common/check.hpp"
#include "cuda/cuda_backend.hpp"
#include "cuda/device_info.hpp"

namespace flashattn::cuda {
namespace {

__global__ void probe_kernel(int* compiled_arch) {
#if defined(__CUDA_ARCH__)
  *compiled_arch = __CUDA_ARCH__;
#endif
}

}  // namespace

bool compiled() { return true; }

int device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device / no driver" error
    return 0;
  }
  return count;
}

Status device_properties(int device, DeviceProperties* out) {
  cudaDeviceProp prop;
  const cudaError_t e = cudaGetDeviceProperties(&prop, device);
  if (e != cudaSuccess)
    return error(FA_ERROR_DEVICE, "cuda:%d: cudaGetDeviceProperties failed: %s", device, cudaGetErrorString(e));
  out->name = prop.name;
  out->major = prop.major;
  out->minor = prop.minor;
  out->multiprocessors = prop.multiProcessorCount;
  out->shared_memory_per_block_optin = int64_t(prop.sharedMemPerBlockOptin);
  out->l2_bytes = prop.l2CacheSize;
  out->global_memory_bytes = int64_t(prop.totalGlobalMem);
  return Status();
}

Status device_attributes(int device, DeviceAttributes* out) {
  static std::mutex mutex;
  static std::vector<DeviceAttributes> cache;
  {
    std::lock_guard<std::mutex> lock(mutex);
    for (const DeviceAttributes& cached : cache)
      if (cached.device == device) {
        *out = cached;
        return Status();
      }
  }
  DeviceAttributes a;
  a.device = device;
  int smem_optin = 0, smem_sm = 0;
  FA_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&a.sm_major, cudaDevAttrComputeCapabilityMajor, device));
  FA_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&a.sm_minor, cudaDevAttrComputeCapabilityMinor, device));
  FA_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&a.sm_count, cudaDevAttrMultiProcessorCount, device));
  FA_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  FA_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&smem_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
  a.smem_per_block_optin = smem_optin;
  a.smem_per_sm = smem_sm;
  std::lock_guard<std::mutex> lock(mutex);
  cache.push_back(a);
  *out = a;
  return Status();
}

Status probe_kernel_image(int device, int* compiled_arch) {
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(device);
  int* d_arch = nullptr;
  cudaError_t e = cudaMalloc(&d_arch, sizeof(int));
  if (e == cudaSuccess) {
    probe_kernel<<<1, 1>>>(d_arch);
    e = cudaGetLastError();
    if (e == cudaSuccess) e = cudaMemcpy(compiled_arch, d_arch, sizeof(int), cudaMemcpyDeviceToHost);
    cudaFree(d_arch);
  }
  cudaSetDevice(previous);
  if (e != cudaSuccess) return error(FA_ERROR_DEVICE, "cuda:%d: probe kernel failed: %s", device, cudaGetErrorString(e));
  return Status();
}

std::string describe() {
  std::string s = "cuda: compiled for " FLASHATTN_CUDA_ARCH_LIST "; " + compiled_kernels_summary() + "\n";
  const int count = device_count();
  if (count == 0) return s + "cuda devices: none found (no GPU or no driver); the CPU backends work\n";
  for (int d = 0; d < count; ++d) {
    DeviceProperties p;
    const Status st = device_properties(d, &p);
    if (!st.ok()) {
      s += st.message() + "\n";
      continue;
    }
    int arch = 0;
    const Status probe = probe_kernel_image(d, &arch);
    char line[512];
    std::snprintf(line, sizeof(line), "cuda:%d: %s, sm_%d%d, %d SMs, %.1f GiB, %lld KiB smem/block; kernel image: %s\n",
                  d, p.name.c_str(), p.major, p.minor, p.multiprocessors, p.global_memory_bytes / 1073741824.0,
                  (long long)(p.shared_memory_per_block_optin / 1024),
                  probe.ok() ? ("sm_" + std::to_string(arch / 10) + " code loaded").c_str() : probe.message().c_str());
    s += line;
  }
  return s;
}

}  // namespace flashattn::cuda
