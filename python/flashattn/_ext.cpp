// flashattn._ext: the one extension module of the Python package.
//
// Tensors arrive through DLPack (nanobind's ndarray): torch tensors, numpy arrays, anything with
// __dlpack__, or DLPack capsules (flashattn.torch passes torch.utils.dlpack.to_dlpack capsules: nanobind
// would call Tensor.__dlpack__, a Python method, several microseconds a tensor). Nothing is copied: the C ABI receives the caller's data pointers and strides, and
// writes into output tensors that the caller allocated (flashattn.torch allocates them with the
// framework's allocator, so CUDA memory comes from torch's caching allocator). The CUDA stream is
// whatever the caller passes (flashattn.torch passes torch's current stream).
//
// Errors: a failed status becomes a Python exception whose message is the C++ message unchanged;
// the exception classes (defined here, re-exported by flashattn/__init__.py) map the status codes:
//   INVALID_ARGUMENT -> InvalidArgumentError (a ValueError)
//   UNSUPPORTED      -> UnsupportedError (a NotImplementedError)
//   NOT_COMPILED     -> NotCompiledError (an UnsupportedError)
//   OUT_OF_MEMORY    -> OutOfMemoryError (a MemoryError)
//   DEVICE, INTERNAL -> DeviceError, InternalError
// all of them subclasses of flashattn.FlashAttnError (a RuntimeError).
//
// The bound functions are internal (flashattn.torch / flashattn.jax call them positionally);
// their argument names are given for readability of errors and tests.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "_ext_common.hpp"
#include "flashattn/flashattn.h"

namespace nb = nanobind;

namespace flashattn::python {

// Defined in _xla_ffi.cpp (absent when the build found no XLA FFI headers).
void add_xla_ffi_targets(nb::module_& m);

namespace {

using Array = nb::ndarray<>;  // any dtype, any shape, any strides, any device

// ---- exceptions ----

// Python exception class per fa_status, created in the module init below.
PyObject* g_exception_of_status[FA_ERROR_INTERNAL + 1] = {};

PyObject* exception_for(fa_status code) {
  if (code > FA_OK && code <= FA_ERROR_INTERNAL && g_exception_of_status[code]) return g_exception_of_status[code];
  return g_exception_of_status[FA_ERROR_INTERNAL];
}

// ---- tensors ----

const char* dlpack_dtype_name(nb::dlpack::dtype t) {
  switch (static_cast<nb::dlpack::dtype_code>(t.code)) {
    case nb::dlpack::dtype_code::Int: return t.bits == 64 ? "int64" : t.bits == 16 ? "int16" : t.bits == 8 ? "int8" : "int";
    case nb::dlpack::dtype_code::UInt: return "unsigned int";
    case nb::dlpack::dtype_code::Float: return t.bits == 64 ? "float64" : "float";
    case nb::dlpack::dtype_code::Bool: return "bool";
    case nb::dlpack::dtype_code::Complex: return "complex";
    default: return "an unsupported dtype";
  }
}

fa_dtype to_fa_dtype(nb::dlpack::dtype t, const char* name) {
  using Code = nb::dlpack::dtype_code;
  const auto code = static_cast<Code>(t.code);
  if (t.lanes == 1) {
    if (code == Code::Float && t.bits == 32) return FA_FLOAT32;
    if (code == Code::Float && t.bits == 16) return FA_FLOAT16;
    if (code == Code::Bfloat && t.bits == 16) return FA_BFLOAT16;
    if (code == Code::Int && t.bits == 32) return FA_INT32;
    if (code == Code::UInt && t.bits == 8) return FA_UINT8;
  }
  fail(FA_ERROR_INVALID_ARGUMENT,
       std::string(name) + ": dtype must be float32, float16 or bfloat16 (int32 for index tensors, uint8 for "
                           "workspaces), got " + dlpack_dtype_name(t) + " (" + std::to_string(t.bits) + " bits)");
}

fa_device_kind to_fa_device(int device_type, const char* name) {
  if (device_type == nb::device::cpu::value) return FA_DEVICE_CPU;
  if (device_type == nb::device::cuda::value || device_type == nb::device::cuda_managed::value) return FA_DEVICE_CUDA;
  fail(FA_ERROR_INVALID_ARGUMENT,
       std::string(name) + ": tensors must be on the CPU or a CUDA device, got DLPack device type " +
           std::to_string(device_type));
}

// A view of a DLPack tensor as the C ABI's fa_tensor (absent when `a` is None).
fa_tensor view(const Array& a, const char* name) {
  fa_tensor t;
  std::memset(&t, 0, sizeof(t));
  if (!a.is_valid()) return t;
  if (a.ndim() > FA_MAX_DIMS)
    fail(FA_ERROR_INVALID_ARGUMENT, std::string(name) + ": expected at most " + std::to_string(FA_MAX_DIMS) +
                                        " dimensions, got " + std::to_string(a.ndim()));
  t.ndim = int32_t(a.ndim());
  for (size_t d = 0; d < a.ndim(); ++d) {
    t.shape[d] = a.shape(d);
    t.strides[d] = a.stride(d);  // nanobind strides are in elements, like the C ABI's
  }
  t.data = const_cast<void*>(static_cast<const void*>(a.data()));
  if (t.data == nullptr && a.size() == 0) t.data = empty_tensor_address();
  t.dtype = to_fa_dtype(a.dtype(), name);
  t.device = to_fa_device(a.device_type(), name);
  t.device_id = t.device == FA_DEVICE_CUDA ? a.device_id() : 0;
  return t;
}

void* as_stream(uintptr_t stream) { return reinterpret_cast<void*>(stream); }

CallOptions make_options(float softmax_scale, bool causal, int window_left, int window_right, float softcap,
                         float dropout_p, uint64_t seed, uint64_t offset, bool deterministic, int backend,
                         int num_threads, uintptr_t stream) {
  CallOptions o;
  o.softmax_scale = softmax_scale;
  o.causal = causal;
  o.window_left = window_left;
  o.window_right = window_right;
  o.softcap = softcap;
  o.dropout_p = dropout_p;
  o.dropout_seed = seed;
  o.dropout_offset = offset;
  o.deterministic = deterministic;
  o.backend = backend;
  o.num_threads = num_threads;
  o.stream = as_stream(stream);
  return o;
}

// ---- entry points ----

// Returns the kernel / backend path that ran (fa_stats.kernel), for tests and logs.
std::string forward(const Array& q, const Array& k, const Array& v, const Array& out, const Array& lse,
                    const Array& cu_seqlens_q, const Array& cu_seqlens_k, int max_seqlen_q, int max_seqlen_k,
                    const Array& seqused_k, const Array& block_table, const Array& alibi_slopes, float softmax_scale,
                    bool causal, int window_left, int window_right, float softcap, float dropout_p, uint64_t seed,
                    uint64_t offset, int backend, int num_threads, uintptr_t stream) {
  fa_forward_args args;
  std::memset(&args, 0, sizeof(args));
  args.q = view(q, "q");
  args.k = view(k, "k");
  args.v = view(v, "v");
  args.out = view(out, "out");
  args.lse = view(lse, "lse");
  args.cu_seqlens_q = view(cu_seqlens_q, "cu_seqlens_q");
  args.cu_seqlens_k = view(cu_seqlens_k, "cu_seqlens_k");
  args.max_seqlen_q = max_seqlen_q;
  args.max_seqlen_k = max_seqlen_k;
  args.seqused_k = view(seqused_k, "seqused_k");
  args.block_table = view(block_table, "block_table");
  fa_stats stats{};
  const CallOptions o = make_options(softmax_scale, causal, window_left, window_right, softcap, dropout_p, seed,
                                     offset, false, backend, num_threads, stream);
  const fa_options options = to_fa_options(o, view(alibi_slopes, "alibi_slopes"), &stats);
  fa_error error{};
  fa_status status;
  {
    nb::gil_scoped_release release;  // the computation needs no Python objects
    status = fa_forward(&args, &options, &error);
  }
  check(status, error);
  return stats.kernel;
}

fa_backward_args backward_args(const Array& dout, const Array& q, const Array& k, const Array& v, const Array& out,
                               const Array& lse, const Array& dq, const Array& dk, const Array& dv,
                               const Array& cu_seqlens_q, const Array& cu_seqlens_k, int max_seqlen_q,
                               int max_seqlen_k, const Array& workspace) {
  fa_backward_args args;
  std::memset(&args, 0, sizeof(args));
  args.dout = view(dout, "dout");
  args.q = view(q, "q");
  args.k = view(k, "k");
  args.v = view(v, "v");
  args.out = view(out, "out");
  args.lse = view(lse, "lse");
  args.dq = view(dq, "dq");
  args.dk = view(dk, "dk");
  args.dv = view(dv, "dv");
  args.cu_seqlens_q = view(cu_seqlens_q, "cu_seqlens_q");
  args.cu_seqlens_k = view(cu_seqlens_k, "cu_seqlens_k");
  args.max_seqlen_q = max_seqlen_q;
  args.max_seqlen_k = max_seqlen_k;
  args.workspace = view(workspace, "workspace");
  return args;
}

std::string backward(const Array& dout, const Array& q, const Array& k, const Array& v, const Array& out,
                     const Array& lse, const Array& dq, const Array& dk, const Array& dv, const Array& cu_seqlens_q,
                     const Array& cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, const Array& alibi_slopes,
                     const Array& workspace, float softmax_scale, bool causal, int window_left, int window_right,
                     float softcap, float dropout_p, uint64_t seed, uint64_t offset, bool deterministic, int backend,
                     int num_threads, uintptr_t stream) {
  const fa_backward_args args = backward_args(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                              max_seqlen_q, max_seqlen_k, workspace);
  fa_stats stats{};
  const CallOptions o = make_options(softmax_scale, causal, window_left, window_right, softcap, dropout_p, seed,
                                     offset, deterministic, backend, num_threads, stream);
  const fa_options options = to_fa_options(o, view(alibi_slopes, "alibi_slopes"), &stats);
  fa_error error{};
  fa_status status;
  {
    nb::gil_scoped_release release;
    status = fa_backward(&args, &options, &error);
  }
  check(status, error);
  return stats.kernel;
}

int64_t backward_workspace_size(const Array& dout, const Array& q, const Array& k, const Array& v, const Array& out,
                                const Array& lse, const Array& dq, const Array& dk, const Array& dv,
                                const Array& cu_seqlens_q, const Array& cu_seqlens_k, int max_seqlen_q,
                                int max_seqlen_k, const Array& alibi_slopes, float softmax_scale, bool causal,
                                int window_left, int window_right, float softcap, float dropout_p,
                                bool deterministic, int backend) {
  const fa_backward_args args = backward_args(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                              max_seqlen_q, max_seqlen_k, Array());
  const CallOptions o = make_options(softmax_scale, causal, window_left, window_right, softcap, dropout_p, 0, 0,
                                     deterministic, backend, 0, 0);
  const fa_options options = to_fa_options(o, view(alibi_slopes, "alibi_slopes"), nullptr);
  fa_error error{};
  int64_t bytes = 0;
  check(fa_backward_workspace_size(&args, &options, &bytes, &error), error);
  return bytes;
}

// An FP8 cache (fp8_cache) arrives as uint8 views of its codes (torch's float8_e4m3fn has no portable DLPack
// code): its dtype becomes float8 e4m3, with the scales k_scale / v_scale. Otherwise the scales are passed on as
// given (the library accepts 0 or 1 for a 16-bit cache).
fa_tensor fp8_cache_view(const Array& a, const char* name) {
  fa_tensor t = view(a, name);
  if (t.dtype != FA_UINT8)
    fail(FA_ERROR_INVALID_ARGUMENT, std::string(name) + ": an FP8 cache is passed as the uint8 view of its e4m3 codes");
  t.dtype = FA_FLOAT8_E4M3;
  return t;
}

fa_kvcache_args kvcache_args(const Array& q, const Array& k_cache, const Array& v_cache, const Array& block_table,
                             const Array& cache_seqlens, const Array& k_new, const Array& v_new,
                             const Array& rotary_cos, const Array& rotary_sin, bool rotary_interleaved,
                             const Array& out, const Array& lse, int num_splits, const Array& workspace, bool fp8_cache,
                             float k_scale, float v_scale, const Array& cache_batch_idx, const Array& cache_leftpad) {
  fa_kvcache_args args;
  std::memset(&args, 0, sizeof(args));
  args.q = view(q, "q");
  args.k_cache = fp8_cache ? fp8_cache_view(k_cache, "k_cache") : view(k_cache, "k_cache");
  args.v_cache = fp8_cache ? fp8_cache_view(v_cache, "v_cache") : view(v_cache, "v_cache");
  args.k_scale = k_scale;
  args.v_scale = v_scale;
  args.block_table = view(block_table, "block_table");
  args.cache_seqlens = view(cache_seqlens, "cache_seqlens");
  args.k_new = view(k_new, "k");  // flash_attn names the appended keys/values k and v
  args.v_new = view(v_new, "v");
  args.rotary_cos = view(rotary_cos, "rotary_cos");
  args.rotary_sin = view(rotary_sin, "rotary_sin");
  args.rotary_interleaved = rotary_interleaved ? 1 : 0;
  args.out = view(out, "out");
  args.lse = view(lse, "lse");
  args.num_splits = num_splits;
  args.workspace = view(workspace, "workspace");
  args.cache_batch_idx = view(cache_batch_idx, "cache_batch_idx");
  args.cache_leftpad = view(cache_leftpad, "cache_leftpad");
  return args;
}

std::string kvcache(const Array& q, const Array& k_cache, const Array& v_cache, const Array& block_table,
                    const Array& cache_seqlens, const Array& k_new, const Array& v_new, const Array& rotary_cos,
                    const Array& rotary_sin, bool rotary_interleaved, const Array& out, const Array& lse,
                    int num_splits, const Array& workspace, const Array& alibi_slopes, float softmax_scale,
                    bool causal, int window_left, int window_right, float softcap, int backend, int num_threads,
                    uintptr_t stream, bool fp8_cache, float k_scale, float v_scale, const Array& cache_batch_idx,
                    const Array& cache_leftpad) {
  const fa_kvcache_args args = kvcache_args(q, k_cache, v_cache, block_table, cache_seqlens, k_new, v_new, rotary_cos,
                                            rotary_sin, rotary_interleaved, out, lse, num_splits, workspace, fp8_cache,
                                            k_scale, v_scale, cache_batch_idx, cache_leftpad);
  fa_stats stats{};
  const CallOptions o =
      make_options(softmax_scale, causal, window_left, window_right, softcap, 0.f, 0, 0, false, backend, num_threads, stream);
  const fa_options options = to_fa_options(o, view(alibi_slopes, "alibi_slopes"), &stats);
  fa_error error{};
  fa_status status;
  {
    nb::gil_scoped_release release;
    status = fa_kvcache(&args, &options, &error);
  }
  check(status, error);
  return stats.kernel;
}

// fa_kvcache_append: k_new / v_new (total_new, Hk, D) rows into the caches (in place), n_b = cu_seqlens_new[b + 1] -
// cu_seqlens_new[b] of them for sequence b at rows cache_seqlens[b] ... Returns the kernel that ran.
std::string kvcache_append(const Array& k_cache, const Array& v_cache, const Array& block_table, const Array& cache_seqlens,
                           const Array& k_new, const Array& v_new, const Array& cu_seqlens_new, int max_seqlen_new,
                           bool check_indices, int backend, int num_threads, uintptr_t stream, bool fp8_cache, float k_scale,
                           float v_scale) {
  fa_kvcache_append_args args;
  std::memset(&args, 0, sizeof(args));
  args.k_cache = fp8_cache ? fp8_cache_view(k_cache, "k_cache") : view(k_cache, "k_cache");
  args.v_cache = fp8_cache ? fp8_cache_view(v_cache, "v_cache") : view(v_cache, "v_cache");
  args.block_table = view(block_table, "block_table");
  args.cache_seqlens = view(cache_seqlens, "cache_seqlens");
  args.k_new = view(k_new, "k");
  args.v_new = view(v_new, "v");
  args.cu_seqlens_new = view(cu_seqlens_new, "cu_seqlens_new");
  args.max_seqlen_new = max_seqlen_new;
  args.check_indices = check_indices ? 1 : 0;
  args.k_scale = k_scale;
  args.v_scale = v_scale;
  fa_stats stats{};
  const CallOptions o = make_options(0.f, false, -1, -1, 0.f, 0.f, 0, 0, false, backend, num_threads, stream);
  const fa_options options = to_fa_options(o, fa_tensor{}, &stats);
  fa_error error{};
  fa_status status;
  {
    nb::gil_scoped_release release;
    status = fa_kvcache_append(&args, &options, &error);
  }
  check(status, error);
  return stats.kernel;
}

// (num_splits, workspace_bytes) that fa_kvcache will use for this batch shape (host only).
std::tuple<int, int64_t> plan_kvcache(const Array& q, const Array& k_cache, const Array& v_cache,
                                      const Array& block_table, const Array& cache_seqlens, const Array& k_new,
                                      const Array& v_new, const Array& rotary_cos, const Array& rotary_sin,
                                      bool rotary_interleaved, const Array& out, const Array& lse, int num_splits,
                                      const Array& alibi_slopes, float softmax_scale, bool causal, int window_left,
                                      int window_right, float softcap, int backend, bool fp8_cache, float k_scale,
                                      float v_scale, const Array& cache_batch_idx, const Array& cache_leftpad) {
  const fa_kvcache_args args = kvcache_args(q, k_cache, v_cache, block_table, cache_seqlens, k_new, v_new, rotary_cos,
                                            rotary_sin, rotary_interleaved, out, lse, num_splits, Array(), fp8_cache,
                                            k_scale, v_scale, cache_batch_idx, cache_leftpad);
  const CallOptions o =
      make_options(softmax_scale, causal, window_left, window_right, softcap, 0.f, 0, 0, false, backend, 0, 0);
  const fa_options options = to_fa_options(o, view(alibi_slopes, "alibi_slopes"), nullptr);
  fa_error error{};
  fa_kvcache_plan plan{};
  check(fa_plan_kvcache(&args, &options, &plan, &error), error);
  return {plan.num_splits, plan.workspace_bytes};
}

// ---- validation without data (JAX checks its arguments while tracing, before any buffer exists) ----

fa_dtype dtype_from_name(const std::string& name, const char* arg) {
  if (name == "float32") return FA_FLOAT32;
  if (name == "float16") return FA_FLOAT16;
  if (name == "bfloat16") return FA_BFLOAT16;
  fail(FA_ERROR_INVALID_ARGUMENT, std::string(arg) + ": dtype must be float32, float16 or bfloat16, got " + name);
}

fa_tensor placeholder(const std::vector<int64_t>& shape, fa_dtype dtype, const char* name) {
  if (shape.size() > FA_MAX_DIMS)
    fail(FA_ERROR_INVALID_ARGUMENT, std::string(name) + ": expected at most " + std::to_string(FA_MAX_DIMS) +
                                        " dimensions, got " + std::to_string(shape.size()));
  // A contiguous CPU view of nothing: validation reads shapes, strides and dtypes only.
  return fa_tensor_contiguous(empty_tensor_address(), int32_t(shape.size()), shape.data(), dtype, FA_DEVICE_CPU, 0);
}

// Checks a dense attention problem (forward and backward) against every rule of the C ABI's
// validation, with the float64 oracle as the backend so that no device or kernel is involved:
// only argument errors can come out. Raises like the real call would.
void check_dense(const std::vector<int64_t>& q_shape, const std::vector<int64_t>& k_shape,
                 const std::vector<int64_t>& v_shape, const std::string& q_dtype, const std::string& k_dtype,
                 const std::string& v_dtype, std::optional<std::vector<int64_t>> alibi_shape, float softmax_scale,
                 bool causal, int window_left, int window_right, float softcap, float dropout_p) {
  const fa_dtype dtype = dtype_from_name(q_dtype, "query");
  fa_backward_args args;
  std::memset(&args, 0, sizeof(args));
  args.q = placeholder(q_shape, dtype, "q");
  args.k = placeholder(k_shape, dtype_from_name(k_dtype, "key"), "k");
  args.v = placeholder(v_shape, dtype_from_name(v_dtype, "value"), "v");
  std::vector<int64_t> out_shape = q_shape;
  if (!out_shape.empty() && !v_shape.empty()) out_shape.back() = v_shape.back();
  args.out = placeholder(out_shape, dtype, "out");
  args.dout = args.out;
  args.dq = args.q;
  args.dk = args.k;
  args.dv = args.v;
  if (q_shape.size() == 4) {
    const std::vector<int64_t> lse_shape = {q_shape[0], q_shape[2], q_shape[1]};
    args.lse = placeholder(lse_shape, FA_FLOAT32, "lse");
  } else {
    args.lse = args.q;  // q's own rank error comes first
  }
  fa_tensor alibi;
  std::memset(&alibi, 0, sizeof(alibi));
  if (alibi_shape) alibi = placeholder(*alibi_shape, FA_FLOAT32, "alibi_slopes");
  CallOptions o = make_options(softmax_scale, causal, window_left, window_right, softcap, dropout_p, 0, 0, false,
                               FA_BACKEND_CPU_REFERENCE, 1, 0);
  const fa_options options = to_fa_options(o, alibi, nullptr);
  fa_error error{};
  int64_t bytes = 0;
  check(fa_backward_workspace_size(&args, &options, &bytes, &error), error);
}

}  // namespace
}  // namespace flashattn::python

using namespace flashattn::python;

NB_MODULE(_ext, m) {
  m.doc() = "flashattn C++ extension (internal; use flashattn.torch or flashattn.jax)";

  // ---- exceptions ----
  PyObject* base = PyErr_NewExceptionWithDoc("flashattn.FlashAttnError",
                                             "A flashattn call failed; the message is the library's.",
                                             PyExc_RuntimeError, nullptr);
  auto derive = [&](const char* name, const char* doc, PyObject* second_base) {
    PyObject* bases = second_base ? PyTuple_Pack(2, base, second_base) : PyTuple_Pack(1, base);
    PyObject* cls = PyErr_NewExceptionWithDoc(name, doc, bases, nullptr);
    Py_DECREF(bases);
    return cls;
  };
  PyObject* invalid = derive("flashattn.InvalidArgumentError",
                             "A shape, dtype, stride, value or combination breaks a rule.", PyExc_ValueError);
  PyObject* unsupported = derive("flashattn.UnsupportedError",
                                 "Valid, but the chosen backend does not implement it.", PyExc_NotImplementedError);
  PyObject* not_compiled_bases = PyTuple_Pack(1, unsupported);
  PyObject* not_compiled = PyErr_NewExceptionWithDoc("flashattn.NotCompiledError",
                                                     "Valid, but this build holds no kernel for it.",
                                                     not_compiled_bases, nullptr);
  Py_DECREF(not_compiled_bases);
  PyObject* device = derive("flashattn.DeviceError", "The CUDA runtime reported an error.", nullptr);
  PyObject* oom = derive("flashattn.OutOfMemoryError", "A documented internal allocation failed.", PyExc_MemoryError);
  PyObject* internal = derive("flashattn.InternalError", "A bug in flashattn: please report it.", nullptr);
  g_exception_of_status[FA_ERROR_INVALID_ARGUMENT] = invalid;
  g_exception_of_status[FA_ERROR_UNSUPPORTED] = unsupported;
  g_exception_of_status[FA_ERROR_NOT_COMPILED] = not_compiled;
  g_exception_of_status[FA_ERROR_DEVICE] = device;
  g_exception_of_status[FA_ERROR_OUT_OF_MEMORY] = oom;
  g_exception_of_status[FA_ERROR_INTERNAL] = internal;
  m.attr("FlashAttnError") = nb::handle(base);
  m.attr("InvalidArgumentError") = nb::handle(invalid);
  m.attr("UnsupportedError") = nb::handle(unsupported);
  m.attr("NotCompiledError") = nb::handle(not_compiled);
  m.attr("DeviceError") = nb::handle(device);
  m.attr("OutOfMemoryError") = nb::handle(oom);
  m.attr("InternalError") = nb::handle(internal);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const CallError& e) {
      PyErr_SetString(exception_for(e.code), e.message.c_str());
    }
  });

  // ---- entry points (positional use by flashattn.torch; see the argument lists) ----
  m.def("forward", &forward, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"), nb::arg("lse").none(),
        nb::arg("cu_seqlens_q").none(), nb::arg("cu_seqlens_k").none(), nb::arg("max_seqlen_q"),
        nb::arg("max_seqlen_k"), nb::arg("seqused_k").none(), nb::arg("block_table").none(),
        nb::arg("alibi_slopes").none(), nb::arg("softmax_scale"), nb::arg("causal"), nb::arg("window_left"),
        nb::arg("window_right"), nb::arg("softcap"), nb::arg("dropout_p"), nb::arg("dropout_seed"),
        nb::arg("dropout_offset"), nb::arg("backend"), nb::arg("num_threads"), nb::arg("stream"),
        "Attention forward into `out` (and `lse`). Returns the kernel that ran.");
  m.def("backward", &backward, nb::arg("dout"), nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"),
        nb::arg("lse"), nb::arg("dq"), nb::arg("dk"), nb::arg("dv"), nb::arg("cu_seqlens_q").none(),
        nb::arg("cu_seqlens_k").none(), nb::arg("max_seqlen_q"), nb::arg("max_seqlen_k"),
        nb::arg("alibi_slopes").none(), nb::arg("workspace").none(), nb::arg("softmax_scale"), nb::arg("causal"),
        nb::arg("window_left"), nb::arg("window_right"), nb::arg("softcap"), nb::arg("dropout_p"),
        nb::arg("dropout_seed"), nb::arg("dropout_offset"), nb::arg("deterministic"), nb::arg("backend"),
        nb::arg("num_threads"), nb::arg("stream"),
        "Attention backward into dq, dk, dv. Returns the kernel that ran.");
  m.def("backward_workspace_size", &backward_workspace_size, nb::arg("dout"), nb::arg("q"), nb::arg("k"),
        nb::arg("v"), nb::arg("out"), nb::arg("lse"), nb::arg("dq"), nb::arg("dk"), nb::arg("dv"),
        nb::arg("cu_seqlens_q").none(), nb::arg("cu_seqlens_k").none(), nb::arg("max_seqlen_q"),
        nb::arg("max_seqlen_k"), nb::arg("alibi_slopes").none(), nb::arg("softmax_scale"), nb::arg("causal"),
        nb::arg("window_left"), nb::arg("window_right"), nb::arg("softcap"), nb::arg("dropout_p"),
        nb::arg("deterministic"), nb::arg("backend"), "Bytes of workspace the backward needs.");
  m.def("kvcache", &kvcache, nb::arg("q"), nb::arg("k_cache"), nb::arg("v_cache"), nb::arg("block_table").none(),
        nb::arg("cache_seqlens"), nb::arg("k_new").none(), nb::arg("v_new").none(), nb::arg("rotary_cos").none(),
        nb::arg("rotary_sin").none(), nb::arg("rotary_interleaved"), nb::arg("out"), nb::arg("lse").none(),
        nb::arg("num_splits"), nb::arg("workspace").none(), nb::arg("alibi_slopes").none(),
        nb::arg("softmax_scale"), nb::arg("causal"), nb::arg("window_left"), nb::arg("window_right"),
        nb::arg("softcap"), nb::arg("backend"), nb::arg("num_threads"), nb::arg("stream"), nb::arg("fp8_cache") = false,
        nb::arg("k_scale") = 0.f, nb::arg("v_scale") = 0.f, nb::arg("cache_batch_idx").none() = nb::none(),
        nb::arg("cache_leftpad").none() = nb::none(),
        "Append k_new/v_new into the cache (in place), then attend. Returns the kernel that ran. fp8_cache: the "
        "caches are uint8 views of float8 e4m3 codes, dequantised with k_scale / v_scale. cache_batch_idx: the "
        "cache's batch entry of each sequence (contiguous caches). cache_leftpad: the first cache row of each "
        "sequence (the rows before are padding).");
  m.def("kvcache_append", &kvcache_append, nb::arg("k_cache"), nb::arg("v_cache"), nb::arg("block_table").none(),
        nb::arg("cache_seqlens"), nb::arg("k_new"), nb::arg("v_new"), nb::arg("cu_seqlens_new"), nb::arg("max_seqlen_new"),
        nb::arg("check_indices"), nb::arg("backend"), nb::arg("num_threads"), nb::arg("stream"), nb::arg("fp8_cache") = false,
        nb::arg("k_scale") = 0.f, nb::arg("v_scale") = 0.f,
        "Write k_new/v_new rows (total_new, Hk, D) into the caches (in place): sequence b's rows cu_seqlens_new[b] .. "
        "at cache rows cache_seqlens[b] ... Returns the kernel that ran.");
  m.def("plan_kvcache", &plan_kvcache, nb::arg("q"), nb::arg("k_cache"), nb::arg("v_cache"),
        nb::arg("block_table").none(), nb::arg("cache_seqlens"), nb::arg("k_new").none(), nb::arg("v_new").none(),
        nb::arg("rotary_cos").none(), nb::arg("rotary_sin").none(), nb::arg("rotary_interleaved"), nb::arg("out"),
        nb::arg("lse").none(), nb::arg("num_splits"), nb::arg("alibi_slopes").none(), nb::arg("softmax_scale"),
        nb::arg("causal"), nb::arg("window_left"), nb::arg("window_right"), nb::arg("softcap"), nb::arg("backend"),
        nb::arg("fp8_cache") = false, nb::arg("k_scale") = 0.f, nb::arg("v_scale") = 0.f,
        nb::arg("cache_batch_idx").none() = nb::none(), nb::arg("cache_leftpad").none() = nb::none(),
        "(num_splits, workspace_bytes) for this batch shape.");
  m.def("check_dense", &check_dense, nb::arg("q_shape"), nb::arg("k_shape"), nb::arg("v_shape"),
        nb::arg("q_dtype"), nb::arg("k_dtype"), nb::arg("v_dtype"), nb::arg("alibi_shape").none(),
        nb::arg("softmax_scale"), nb::arg("causal"), nb::arg("window_left"), nb::arg("window_right"),
        nb::arg("softcap"), nb::arg("dropout_p"),
        "Validates a dense problem from shapes and dtypes alone (raises like a real call).");

  m.def("version", [] { return std::string(fa_version()); });
  m.def("build_info", [] { return std::string(fa_build_info()); });
  m.def("cuda_device_count", [] { return fa_cuda_device_count(); });
#if defined(FLASHATTN_WITH_CUDA)
  m.attr("has_cuda") = true;
#else
  m.attr("has_cuda") = false;
#endif
  m.attr("BACKEND_AUTO") = int(FA_BACKEND_AUTO);
  m.attr("BACKEND_CPU_REFERENCE") = int(FA_BACKEND_CPU_REFERENCE);
  m.attr("BACKEND_CPU_FLASH") = int(FA_BACKEND_CPU_FLASH);
  m.attr("BACKEND_CPU_STANDARD") = int(FA_BACKEND_CPU_STANDARD);
  m.attr("BACKEND_CUDA") = int(FA_BACKEND_CUDA);

  add_xla_ffi_targets(m);
}
