// Small helpers shared by the GPU benchmarks and tuning harnesses of bench/ (not part of the library).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

// Exits with file, line, the call and CUDA's message when a CUDA runtime call fails (benchmarks only:
// the library itself returns a status instead).
#define CHECK_CUDA(call)                                                                           \
  do {                                                                                             \
    const cudaError_t e_ = (call);                                                                 \
    if (e_ != cudaSuccess) {                                                                       \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));   \
      std::exit(1);                                                                                \
    }                                                                                              \
  } while (0)

namespace flashattn::bench {

// "1024,4096,16384" -> {1024, 4096, 16384}
template <typename Int = int>
std::vector<Int> parse_ints(const std::string& s) {
  std::vector<Int> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) v.push_back(static_cast<Int>(std::stoll(item)));
  return v;
}

}  // namespace flashattn::bench
