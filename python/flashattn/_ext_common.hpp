// Helpers shared by the two halves of the extension: the nanobind entry points (_ext.cpp, used by
// flashattn.torch and by tests) and the XLA FFI handlers (_xla_ffi.cpp, used by flashattn.jax).
//
// Nothing here computes attention: it translates the caller's tensors and keyword arguments into
// the C ABI's plain structs (include/flashattn/flashattn.h) and a failed status into an exception
// or an XLA error that carries the C++ message unchanged.
#pragma once

#include <cstdint>
#include <string>

#include "flashattn/flashattn.h"

namespace flashattn::python {

// A failed call of the C ABI (or a rule of this layer), thrown inside the bound functions and
// turned into the matching Python exception by the translator registered in _ext.cpp.
struct CallError {
  fa_status code;
  std::string message;
};

[[noreturn]] inline void fail(fa_status code, std::string message) { throw CallError{code, std::move(message)}; }

inline void check(fa_status status, const fa_error& error) {
  if (status != FA_OK) fail(status, error.message);
}

// Options of one call, in the order the Python wrappers pass them (positionally, for speed).
struct CallOptions {
  float softmax_scale = 0.f;  // 0: 1/sqrt(D)
  bool causal = false;
  int window_left = -1;
  int window_right = -1;
  float softcap = 0.f;
  float dropout_p = 0.f;
  uint64_t dropout_seed = 0;
  uint64_t dropout_offset = 0;
  bool deterministic = false;
  int backend = FA_BACKEND_AUTO;
  int num_threads = 0;
  void* stream = nullptr;  // cudaStream_t of the caller (its current stream); null on the CPU
};

inline fa_options to_fa_options(const CallOptions& o, const fa_tensor& alibi_slopes, fa_stats* stats) {
  fa_options options;
  fa_options_init(&options);
  options.softmax_scale = o.softmax_scale;
  options.causal = o.causal ? 1 : 0;
  options.window_left = o.window_left;
  options.window_right = o.window_right;
  options.softcap = o.softcap;
  options.alibi_slopes = alibi_slopes;
  options.dropout_p = o.dropout_p;
  options.dropout_seed = o.dropout_seed;
  options.dropout_offset = o.dropout_offset;
  options.deterministic = o.deterministic ? 1 : 0;
  options.backend = static_cast<fa_backend>(o.backend);
  options.num_threads = o.num_threads;
  options.stream = o.stream;
  options.stats = stats;
  return options;
}

// A non-null address for tensors with no elements: the C ABI reads `data == NULL` as "absent",
// but a zero-size tensor from a framework may legitimately carry a null pointer. Never read.
inline void* empty_tensor_address() {
  static char byte;
  return &byte;
}

}  // namespace flashattn::python
