// flashattn: exact, IO-aware attention. C++ API.
//
// A thin, header-only layer over the C ABI in flashattn.h: the same plain structs, plus a Status
// that carries the message, tensor builders, and functions that return Status (no exceptions cross
// the library boundary). The semantics and layouts are documented in flashattn.h.
#ifndef FLASHATTN_FLASHATTN_HPP_
#define FLASHATTN_FLASHATTN_HPP_

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "flashattn/flashattn.h"

namespace flashattn {

using Tensor = fa_tensor;
using Options = fa_options;
using ForwardArgs = fa_forward_args;
using BackwardArgs = fa_backward_args;
using KvcacheArgs = fa_kvcache_args;
using KvcachePlan = fa_kvcache_plan;
using KvcacheAppendArgs = fa_kvcache_append_args;
using DType = fa_dtype;
using Backend = fa_backend;

class Status {
 public:
  Status() = default;
  Status(fa_status code, std::string message) : code_(code), message_(std::move(message)) {}
  explicit Status(const fa_error& error) : code_(error.code), message_(error.message) {}
  bool ok() const { return code_ == FA_OK; }
  fa_status code() const { return code_; }
  const std::string& message() const { return message_; }
  std::string to_string() const {
    return ok() ? std::string("OK") : std::string(fa_status_name(code_)) + ": " + message_;
  }

 private:
  fa_status code_ = FA_OK;
  std::string message_;
};

inline Options default_options() {
  Options options;
  fa_options_init(&options);
  return options;
}

// A contiguous (row-major) view of `data`.
inline Tensor tensor(void* data, std::initializer_list<int64_t> shape, DType dtype,
                     fa_device_kind device = FA_DEVICE_CPU, int32_t device_id = 0) {
  int64_t dims[FA_MAX_DIMS] = {0, 0, 0, 0};
  int32_t ndim = 0;
  for (int64_t extent : shape) {
    if (ndim < FA_MAX_DIMS) dims[ndim] = extent;
    ++ndim;  // more than FA_MAX_DIMS is reported by validation, not truncated silently
  }
  Tensor t = fa_tensor_contiguous(data, ndim > FA_MAX_DIMS ? FA_MAX_DIMS : ndim, dims, dtype, device,
                                  device_id);
  if (ndim > FA_MAX_DIMS) t.ndim = ndim;
  return t;
}

// A strided view: strides in elements.
inline Tensor strided_tensor(void* data, std::initializer_list<int64_t> shape,
                             std::initializer_list<int64_t> strides, DType dtype,
                             fa_device_kind device = FA_DEVICE_CPU, int32_t device_id = 0) {
  Tensor t = tensor(data, shape, dtype, device, device_id);
  int32_t i = 0;
  for (int64_t s : strides) {
    if (i < FA_MAX_DIMS) t.strides[i] = s;
    ++i;
  }
  return t;
}

inline Tensor absent() { return Tensor{}; }

inline Status forward(const ForwardArgs& args, const Options& options) {
  fa_error error{};
  fa_forward(&args, &options, &error);
  return Status(error);
}

inline Status backward(const BackwardArgs& args, const Options& options) {
  fa_error error{};
  fa_backward(&args, &options, &error);
  return Status(error);
}

inline Status backward_workspace_size(const BackwardArgs& args, const Options& options,
                                      int64_t* bytes) {
  fa_error error{};
  fa_backward_workspace_size(&args, &options, bytes, &error);
  return Status(error);
}

inline Status kvcache_plan(const KvcacheArgs& args, const Options& options, KvcachePlan* plan) {
  fa_error error{};
  fa_plan_kvcache(&args, &options, plan, &error);
  return Status(error);
}

inline Status kvcache(const KvcacheArgs& args, const Options& options) {
  fa_error error{};
  fa_kvcache(&args, &options, &error);
  return Status(error);
}

inline Status kvcache_append(const KvcacheAppendArgs& args, const Options& options) {
  fa_error error{};
  fa_kvcache_append(&args, &options, &error);
  return Status(error);
}

inline std::string version() { return fa_version(); }
inline std::string build_info() { return fa_build_info(); }

}  // namespace flashattn

#endif  // FLASHATTN_FLASHATTN_HPP_
