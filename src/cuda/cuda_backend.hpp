// The CUDA backend as seen from the host-side API layer. This header is plain C++ (no CUDA
// types), so src/api builds and is tested without a GPU or a CUDA compiler. When the build has
// no CUDA, src/cuda/no_cuda.cpp implements it by returning FA_ERROR_NOT_COMPILED.
#pragma once

#include <string>

#include "core/params.hpp"
#include "core/status.hpp"

namespace flashattn::cuda {

bool compiled();         // this build holds CUDA kernels
int device_count();      // visible CUDA devices (0 without a GPU or driver)
std::string describe();  // devices and compiled kernels, for `flashattn info`

Status forward(const AttentionParams& params);
Status backward(const BackwardParams& params);
Status backward_workspace_size(const BackwardParams& params, int64_t* bytes);
Status kvcache_plan(const KvcacheParams& params, fa_kvcache_plan* plan);
Status kvcache(const KvcacheParams& params);
Status kvcache_append(const KvcacheAppendParams& params);

}  // namespace flashattn::cuda
