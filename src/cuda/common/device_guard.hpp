// Makes a device current for the scope of a call and restores the caller's device afterwards (host code).
#pragma once

#include <cuda_runtime.h>

namespace flashattn::cuda {

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cudaGetDevice(&previous_);
    if (previous_ != device) status_ = cudaSetDevice(device);
  }
  ~DeviceGuard() {
    int current = previous_;
    cudaGetDevice(&current);
    if (current != previous_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  cudaError_t status() const { return status_; }  // of switching to the device

 private:
  int previous_ = 0;
  cudaError_t status_ = cudaSuccess;
};

}  // namespace flashattn::cuda
