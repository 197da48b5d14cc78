// CUDA runtime errors -> Status, with the call that failed named in the message.
#pragma once

#include <cuda_runtime.h>

#include "core/status.hpp"

#define FA_CUDA_RETURN_IF_ERROR(call)                                                              \
  do {                                                                                             \
    const cudaError_t fa_cuda_error_ = (call);                                                     \
    if (fa_cuda_error_ != cudaSuccess)                                                             \
      return ::flashattn::error(fa_cuda_error_ == cudaErrorMemoryAllocation ? FA_ERROR_OUT_OF_MEMORY \
                                                                            : FA_ERROR_DEVICE,     \
                                "%s failed: %s", #call, cudaGetErrorString(fa_cuda_error_));       \
  } while (0)
