// Stream-ordered scratch for CUDA calls without a workspace of the caller's (the paged varlen forward's routed short
// sequences and fa_kvcache's split partials, src/cuda/decode/kvcache.cpp; the backward's workspace,
// src/cuda/sm80/backward_launch.cuh). Allocated with cudaMallocFromPoolAsync from a memory pool of the library's
// own per device, whose release threshold keeps up to kScratchPoolKeepBytes mapped across synchronisations. The
// device's default pool releases everything at each synchronisation (threshold 0), so every call after one mapped its
// scratch again: a serving step of 8 decodes beside one 128-token chunk took 207.8 us instead of 75.8 (H100, 2026-12-06,
// `flashattn step`, whose --keep-pool raised the default pool's threshold for the second number). Stream-ordered like
// cudaMallocAsync: usable from any stream, and inside a CUDA graph capture (an allocation node). Host code.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/status.hpp"

namespace flashattn::cuda {

// Memory the pool keeps mapped when it is free (affects speed and the process's reserved device memory only).
constexpr uint64_t kScratchPoolKeepBytes = uint64_t(256) << 20;

// `bytes` of scratch on `device` (the current device), ordered on `stream`; free it with scratch_free on a stream.
Status scratch_alloc(int device, size_t bytes, cudaStream_t stream, void** ptr);
inline cudaError_t scratch_free(void* ptr, cudaStream_t stream) { return cudaFreeAsync(ptr, stream); }

}  // namespace flashattn::cuda
