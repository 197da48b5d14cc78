// The C ABI: validate -> choose backend -> dispatch. The one place that knows every backend.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <new>
#include <string>

#include "api/validate.hpp"
#include "core/dtype.hpp"
#include "cpu/flash/flash.hpp"
#include "cpu/reference/reference.hpp"
#include "cpu/standard/standard.hpp"
#include "cuda/cuda_backend.hpp"
#include "flashattn/flashattn.h"

namespace flashattn::api {
namespace {

#define FA_UNSUPPORTED(...) ::flashattn::error(FA_ERROR_UNSUPPORTED, __VA_ARGS__)

fa_status finish(const Status& status, fa_error* error) {
  if (error != nullptr) {
    error->code = status.code();
    std::snprintf(error->message, sizeof(error->message), "%s", status.message().c_str());
  }
  return status.code();
}

// Runs `body`, turning a stray exception into a status: nothing may unwind through the C ABI.
template <typename Body>
fa_status guarded(fa_error* error, Body body) {
  try {
    return finish(body(), error);
  } catch (const std::bad_alloc&) {
    return finish(flashattn::error(FA_ERROR_OUT_OF_MEMORY, "host allocation failed"), error);
  } catch (const std::exception& e) {
    return finish(flashattn::error(FA_ERROR_INTERNAL, "unexpected exception: %s", e.what()), error);
  } catch (...) {
    return finish(flashattn::error(FA_ERROR_INTERNAL, "unexpected exception"), error);
  }
}

// Options of the caller's header version, checked before anything else of the call is read (FA_ABI_VERSION).
Status check_abi(const fa_options* options) {
  if (options == nullptr || options->abi_version == FA_ABI_VERSION) return Status();
  if (options->abi_version == 0)
    return flashattn::error(FA_ERROR_INVALID_ARGUMENT,
                            "options.abi_version: 0; fill options with fa_options_init() (this library's FA_ABI_VERSION "
                            "is %d)",
                            FA_ABI_VERSION);
  return flashattn::error(FA_ERROR_INVALID_ARGUMENT,
                          "options.abi_version: the caller was built with FA_ABI_VERSION %d, this library (flashattn %s) "
                          "with %d: its structs differ; rebuild against this library's flashattn.h",
                          options->abi_version, fa_version(), FA_ABI_VERSION);
}

fa_options options_or_default(const fa_options* options) {
  fa_options o;
  if (options != nullptr) return *options;
  fa_options_init(&o);
  return o;
}

void report(const AttentionParams& p, const char* kernel, int64_t scratch, int splits) {
  if (p.stats == nullptr) return;
  p.stats->scratch_bytes_peak = scratch;
  p.stats->num_splits = splits;
  std::snprintf(p.stats->kernel, sizeof(p.stats->kernel), "%s", kernel);
}

// The textbook path implements the dense forward only: say so instead of running something else.
Status standard_supports(const AttentionParams& p) {
  if (p.is_varlen()) return FA_UNSUPPORTED("cu_seqlens_q: the cpu_standard backend takes the dense layout only");
  if (p.is_paged()) return FA_UNSUPPORTED("block_table: the cpu_standard backend does not read paged caches");
  if (p.seqused_k != nullptr) return FA_UNSUPPORTED("seqused_k: not supported by the cpu_standard backend");
  return Status();
}

Status forward(const fa_forward_args& args, const fa_options& options) {
  AttentionParams p;
  FA_RETURN_IF_ERROR(make_forward_params(args, options, &p));
  fa_backend backend;
  FA_RETURN_IF_ERROR(resolve_backend(options, p.device, p.device_id, &backend));
  switch (backend) {
    case FA_BACKEND_CPU_REFERENCE:
      report(p, "cpu_reference", -1, 1);
      return cpu::reference::forward(p);
    case FA_BACKEND_CPU_FLASH: return cpu::flash::forward(p);
    case FA_BACKEND_CPU_STANDARD: FA_RETURN_IF_ERROR(standard_supports(p)); return cpu::standard::forward(p);
    case FA_BACKEND_CUDA: return cuda::forward(p);
    default: return flashattn::error(FA_ERROR_INTERNAL, "unresolved backend");
  }
}

Status backward(const fa_backward_args& args, const fa_options& options) {
  BackwardParams p;
  FA_RETURN_IF_ERROR(make_backward_params(args, options, &p));
  fa_backend backend;
  FA_RETURN_IF_ERROR(resolve_backend(options, p.device, p.device_id, &backend));
  switch (backend) {
    case FA_BACKEND_CPU_REFERENCE:
      report(p, "cpu_reference", -1, 1);
      return cpu::reference::backward(p);
    case FA_BACKEND_CPU_FLASH: return cpu::flash::backward(p);
    case FA_BACKEND_CPU_STANDARD: return FA_UNSUPPORTED("options.backend: cpu_standard implements the forward pass only");
    case FA_BACKEND_CUDA: return cuda::backward(p);
    default: return flashattn::error(FA_ERROR_INTERNAL, "unresolved backend");
  }
}

Status backward_workspace_size(const fa_backward_args& args, const fa_options& options, int64_t* bytes) {
  BackwardParams p;
  FA_RETURN_IF_ERROR(make_backward_params(args, options, &p));
  fa_backend backend;
  FA_RETURN_IF_ERROR(resolve_backend(options, p.device, p.device_id, &backend));
  switch (backend) {
    case FA_BACKEND_CPU_REFERENCE: *bytes = 0; return Status();
    case FA_BACKEND_CPU_FLASH: *bytes = cpu::flash::backward_workspace_bytes(p); return Status();
    case FA_BACKEND_CPU_STANDARD: return FA_UNSUPPORTED("options.backend: cpu_standard implements the forward pass only");
    case FA_BACKEND_CUDA: return cuda::backward_workspace_size(p, bytes);
    default: return flashattn::error(FA_ERROR_INTERNAL, "unresolved backend");
  }
}

Status kvcache_plan(const fa_kvcache_args& args, const fa_options& options, fa_kvcache_plan* plan) {
  KvcacheParams p;
  FA_RETURN_IF_ERROR(make_kvcache_params(args, options, &p));
  fa_backend backend;
  FA_RETURN_IF_ERROR(resolve_backend(options, p.device, p.device_id, &backend));
  switch (backend) {
    case FA_BACKEND_CPU_REFERENCE: *plan = fa_kvcache_plan{1, 0}; return Status();
    case FA_BACKEND_CPU_FLASH: return cpu::flash::kvcache_plan(p, plan);
    case FA_BACKEND_CPU_STANDARD: return FA_UNSUPPORTED("options.backend: cpu_standard does not implement KV-cache attention");
    case FA_BACKEND_CUDA: return cuda::kvcache_plan(p, plan);
    default: return flashattn::error(FA_ERROR_INTERNAL, "unresolved backend");
  }
}

Status kvcache(const fa_kvcache_args& args, const fa_options& options) {
  KvcacheParams p;
  FA_RETURN_IF_ERROR(make_kvcache_params(args, options, &p));
  fa_backend backend;
  FA_RETURN_IF_ERROR(resolve_backend(options, p.device, p.device_id, &backend));
  switch (backend) {
    case FA_BACKEND_CPU_REFERENCE:
      report(p, "cpu_reference", -1, 1);
      return cpu::reference::kvcache(p);
    case FA_BACKEND_CPU_FLASH: return cpu::flash::kvcache(p);
    case FA_BACKEND_CPU_STANDARD: return FA_UNSUPPORTED("options.backend: cpu_standard does not implement KV-cache attention");
    case FA_BACKEND_CUDA: return cuda::kvcache(p);
    default: return flashattn::error(FA_ERROR_INTERNAL, "unresolved backend");
  }
}

// The CPU backends share one append (cpu/flash): the rows it writes are those of fa_kvcache's append on every
// backend, the same bits (tests/cpp/test_cpu_kvcache.cpp, KvcacheAppend*).
Status kvcache_append(const fa_kvcache_append_args& args, const fa_options& options) {
  KvcacheAppendParams p;
  FA_RETURN_IF_ERROR(make_kvcache_append_params(args, options, &p));
  fa_backend backend;
  FA_RETURN_IF_ERROR(resolve_backend(options, p.cache.device, p.cache.device_id, &backend));
  switch (backend) {
    case FA_BACKEND_CPU_REFERENCE:
    case FA_BACKEND_CPU_FLASH:
    case FA_BACKEND_CPU_STANDARD: return cpu::flash::kvcache_append(p);
    case FA_BACKEND_CUDA: return cuda::kvcache_append(p);
    default: return flashattn::error(FA_ERROR_INTERNAL, "unresolved backend");
  }
}

Status null_argument(const char* name) {
  return flashattn::error(FA_ERROR_INVALID_ARGUMENT, "%s: must not be NULL", name);
}

}  // namespace
}  // namespace flashattn::api

using namespace flashattn;

extern "C" {

void fa_options_init_abi(fa_options* o, int32_t abi_version) {
  if (o == nullptr) return;
  if (abi_version != FA_ABI_VERSION) {  // a struct of another layout: only its first field is known
    o->abi_version = abi_version;
    return;
  }
  std::memset(o, 0, sizeof(*o));
  o->abi_version = abi_version;
  o->softmax_scale = 0.f;
  o->window_left = -1;
  o->window_right = -1;
  o->backend = FA_BACKEND_AUTO;
}

fa_tensor fa_tensor_contiguous(void* data, int32_t ndim, const int64_t* shape, fa_dtype dtype, fa_device_kind device,
                               int32_t device_id) {
  fa_tensor t;
  std::memset(&t, 0, sizeof(t));
  t.data = data;
  t.ndim = ndim;
  t.dtype = dtype;
  t.device = device;
  t.device_id = device_id;
  if (ndim < 0 || ndim > FA_MAX_DIMS || shape == nullptr) return t;  // validation reports it
  int64_t stride = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    t.shape[d] = shape[d];
    t.strides[d] = stride;
    stride *= shape[d] > 0 ? shape[d] : 1;
  }
  return t;
}

fa_status fa_forward(const fa_forward_args* args, const fa_options* options, fa_error* error) {
  return api::guarded(error, [&] {
    FA_RETURN_IF_ERROR(api::check_abi(options));
    return args ? api::forward(*args, api::options_or_default(options)) : api::null_argument("args");
  });
}

fa_status fa_backward(const fa_backward_args* args, const fa_options* options, fa_error* error) {
  return api::guarded(error, [&] {
    FA_RETURN_IF_ERROR(api::check_abi(options));
    return args ? api::backward(*args, api::options_or_default(options)) : api::null_argument("args");
  });
}

fa_status fa_backward_workspace_size(const fa_backward_args* args, const fa_options* options, int64_t* bytes,
                                     fa_error* error) {
  return api::guarded(error, [&] {
    FA_RETURN_IF_ERROR(api::check_abi(options));
    if (!args) return api::null_argument("args");
    if (!bytes) return api::null_argument("bytes");
    return api::backward_workspace_size(*args, api::options_or_default(options), bytes);
  });
}

fa_status fa_plan_kvcache(const fa_kvcache_args* args, const fa_options* options, fa_kvcache_plan* plan,
                          fa_error* error) {
  return api::guarded(error, [&] {
    FA_RETURN_IF_ERROR(api::check_abi(options));
    if (!args) return api::null_argument("args");
    if (!plan) return api::null_argument("plan");
    return api::kvcache_plan(*args, api::options_or_default(options), plan);
  });
}

fa_status fa_kvcache(const fa_kvcache_args* args, const fa_options* options, fa_error* error) {
  return api::guarded(error, [&] {
    FA_RETURN_IF_ERROR(api::check_abi(options));
    return args ? api::kvcache(*args, api::options_or_default(options)) : api::null_argument("args");
  });
}

fa_status fa_kvcache_append(const fa_kvcache_append_args* args, const fa_options* options, fa_error* error) {
  return api::guarded(error, [&] {
    FA_RETURN_IF_ERROR(api::check_abi(options));
    return args ? api::kvcache_append(*args, api::options_or_default(options)) : api::null_argument("args");
  });
}

const char* fa_status_name(fa_status status) {
  switch (status) {
    case FA_OK: return "OK";
    case FA_ERROR_INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case FA_ERROR_UNSUPPORTED: return "UNSUPPORTED";
    case FA_ERROR_NOT_COMPILED: return "NOT_COMPILED";
    case FA_ERROR_DEVICE: return "DEVICE_ERROR";
    case FA_ERROR_OUT_OF_MEMORY: return "OUT_OF_MEMORY";
    case FA_ERROR_INTERNAL: return "INTERNAL";
  }
  return "UNKNOWN";
}

int32_t fa_abi_version(void) { return FA_ABI_VERSION; }

const char* fa_version(void) {
#define FA_STR2(x) #x
#define FA_STR(x) FA_STR2(x)
  return FA_STR(FA_VERSION_MAJOR) "." FA_STR(FA_VERSION_MINOR) "." FA_STR(FA_VERSION_PATCH);
}

const char* fa_build_info(void) {
  static const std::string info = [] {
    std::string s = std::string("flashattn ") + fa_version() + " (C ABI " + std::to_string(FA_ABI_VERSION) + ")\n";
    s += "backends: cpu_reference (float64 oracle), cpu_flash, cpu_standard";
    s += cuda::compiled() ? ", cuda\n" : "\n";
    s += "cpu dtypes: float32, float16, bfloat16 (float32 accumulation); any head dim in [1, 1024]\n";
    s += cuda::describe();
    return s;
  }();
  return info.c_str();
}

int32_t fa_cuda_device_count(void) { return cuda::compiled() ? cuda::device_count() : 0; }

}  // extern "C"
