// The CUDA backend of a build without CUDA: every entry point says so. (Not a stub of kernels:
// validation and dispatch are host code and run in full; only the device part is absent.)
#include "cuda/cuda_backend.hpp"

namespace flashattn::cuda {
namespace {
Status not_compiled() {
  return error(FA_ERROR_NOT_COMPILED, "q: tensors are on a CUDA device but this build of flashattn has no CUDA backend "
                                      "(configure with -DFLASHATTN_CUDA=ON and a CUDA toolkit)");
}
}  // namespace

bool compiled() { return false; }
int device_count() { return 0; }
std::string describe() { return "cuda: not compiled into this build\n"; }
Status forward(const AttentionParams&) { return not_compiled(); }
Status backward(const BackwardParams&) { return not_compiled(); }
Status backward_workspace_size(const BackwardParams&, int64_t*) { return not_compiled(); }
Status kvcache_plan(const KvcacheParams&, fa_kvcache_plan*) { return not_compiled(); }
Status kvcache(const KvcacheParams&) { return not_compiled(); }
Status kvcache_append(const KvcacheAppendParams&) { return not_compiled(); }

}  // namespace flashattn::cuda
