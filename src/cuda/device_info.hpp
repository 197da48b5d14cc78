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
// Launches a one-thread kernel: fails when the library holds no kernel image for the device.
Status probe_kernel_image(int device, int* compiled_arch);
// "forward: bf16/fp16 x D {64, 128, ...}" from the generated manifest.
std::string compiled_kernels_summary();

}  // namespace flashattn::cuda
