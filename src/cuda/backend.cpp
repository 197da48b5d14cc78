// Host side of the CUDA backend: chooses a kernel configuration and launches it.
// (Kernels arrive with the sm80 issue; until then every entry point says they are not compiled.)
#include "cuda/cuda_backend.hpp"
#include "cuda/device_info.hpp"

namespace flashattn::cuda {
namespace {
Status no_kernels(const char* what) {
  return error(FA_ERROR_NOT_COMPILED, "q: no CUDA %s kernel is compiled into this build yet", what);
}
}  // namespace

std::string compiled_kernels_summary() { return "kernels: none yet"; }
Status forward(const AttentionParams&) { return no_kernels("forward"); }
Status backward(const BackwardParams&) { return no_kernels("backward"); }
Status backward_workspace_size(const BackwardParams&, int64_t*) { return no_kernels("backward"); }
Status kvcache_plan(const KvcacheParams&, fa_kvcache_plan*) { return no_kernels("kvcache"); }
Status kvcache(const KvcacheParams&) { return no_kernels("kvcache"); }

}  // namespace flashattn::cuda
