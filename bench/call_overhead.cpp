// Host cost of one call: flashattn::forward on a tiny CPU problem (q, k, v, out of shape (1, 1, 1, 64), float32,
// no lse, no stats), median over 7 runs of 20000 calls. What the C++ / C API costs before and around the work.
// A CPU-only build (BUILD_DIR=build-cpu bash scripts/build.sh -DFLASHATTN_CUDA=OFF), then
//   g++ -O2 -std=c++17 -I include bench/call_overhead.cpp build-cpu/src/libflashattn.a -fopenmp -lopenblas -o call_overhead
#include <flashattn/flashattn.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

int main() {
  std::vector<float> q(64, 0.1f), k(64, 0.2f), v(64, 0.3f), o(64);
  flashattn::ForwardArgs a{};
  a.q = flashattn::tensor(q.data(), {1, 1, 1, 64}, FA_FLOAT32, FA_DEVICE_CPU, 0);
  a.k = flashattn::tensor(k.data(), {1, 1, 1, 64}, FA_FLOAT32, FA_DEVICE_CPU, 0);
  a.v = flashattn::tensor(v.data(), {1, 1, 1, 64}, FA_FLOAT32, FA_DEVICE_CPU, 0);
  a.out = flashattn::tensor(o.data(), {1, 1, 1, 64}, FA_FLOAT32, FA_DEVICE_CPU, 0);
  flashattn::Options opt = flashattn::default_options();
  std::vector<double> t;
  for (int rep = 0; rep < 7; ++rep) {
    const int n = 20000;
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < n; ++i) if (!flashattn::forward(a, opt).ok()) return 1;
    t.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / n);
  }
  std::sort(t.begin(), t.end());
  std::printf("%.2f us per call (median of 7 x 20000)\n", t[3]);
}
