// Device properties used by dispatch (SM count, shared memory) and by `flashattn info`.
#pragma once

#include <cstdint>
#include <string>

#include "core/status.hpp"

namespace flashattn::cuda {

struct DeviceProperties {
  std::string name;
  int major = 0, minor = 0;
  int multiprocessors = 0;
  int64_t shared_memory_per_block_optin = 0;
  int64_t l2_bytes = 0;
  int64_t global_memory_bytes = 0;
};

Status device_properties(int device, DeviceProperties* out);

// What the call paths read about a device (dispatch: backend.cpp; the decode planner: decode/kvcache.cpp),
// from cudaDeviceGetAttribute once per device and process, then from a cache: attributes cannot change
// while the process runs, and a call should not pay for the queries.
struct DeviceAttributes {
  int device = 0;                    // CUDA ordinal, for messages
  int sm_major = 0, sm_minor = 0;    // compute capability
  int sm_count = 0;                  // streaming multiprocessors
  int64_t smem_per_block_optin = 0;  // bytes a CTA may use after cudaFuncSetAttribute
  int64_t smem_per_sm = 0;           // bytes of shared memory per SM (occupancy)
};
Status device_attributes(int device, DeviceAttributes* out);
// Launches a one-thread kernel: fails when the library holds no kernel image for the device.
Status probe_kernel_image(int device, int* compiled_arch);
// "forward: bf16/fp16 x D {64, 128, ...}" from the generated manifest.
std::string compiled_kernels_summary();

}  // namespace flashattn::cuda
