// Small helpers shared by the GPU benchmarks and tuning harnesses of bench/ (not part of the library).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
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

// Median milliseconds of `reps` runs of `body` on `stream`, each timed with CUDA events, after `warmups`
// untimed runs (the first run of a kernel pays for loading it and for its attributes).
template <typename Body>
double median_event_ms(cudaStream_t stream, int warmups, int reps, Body body) {
  for (int w = 0; w < warmups; ++w) body();
  CHECK_CUDA(cudaStreamSynchronize(stream));
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<float> times;
  for (int r = 0; r < reps; ++r) {
    CHECK_CUDA(cudaEventRecord(start, stream));
    body();
    CHECK_CUDA(cudaEventRecord(stop, stream));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  if (times.empty()) return -1;
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

}  // namespace flashattn::bench
