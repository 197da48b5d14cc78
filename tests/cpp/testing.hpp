// Test support shared by every C++ test (CPU and GPU): host tensors of any dtype with any strides,
// fresh random inputs, poisoning, error metrics against the float64 oracle, and the tolerance rule
// of DESIGN.md (a fast path may be at most a small multiple of the error of a naive same-precision
// computation, plus a tiny absolute term; float32 paths within 1e-5 relative).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "flashattn/flashattn.hpp"

// First line of a GPU test: skips it, saying why, where no CUDA device exists (CI, or a build without CUDA);
// it runs in full on the GPU machine (scripts/gpu/run_gpu.sh).
#define SKIP_WITHOUT_GPU()                                                                               \
  do {                                                                                                   \
    if (fa_cuda_device_count() == 0)                                                                     \
      GTEST_SKIP() << "no CUDA device (or no CUDA in this build): the GPU tests run on the GPU machine"; \
  } while (0)

namespace fa_test {

// A host tensor that owns its storage. Logical element order is row-major over `shape`;
// `strides` (in elements) may be anything with a contiguous last dimension.
class HostTensor {
 public:
  HostTensor() = default;
  // Contiguous.
  HostTensor(std::vector<int64_t> shape, fa_dtype dtype);
  // Strided: storage large enough for the given strides.
  HostTensor(std::vector<int64_t> shape, std::vector<int64_t> strides, fa_dtype dtype);

  fa_tensor view();                 // CPU view (device = FA_DEVICE_CPU)
  fa_tensor view_on(void* data, fa_device_kind device, int device_id) const;  // same shape/strides
  const std::vector<int64_t>& shape() const { return shape_; }
  const std::vector<int64_t>& strides() const { return strides_; }
  fa_dtype dtype() const { return dtype_; }
  int64_t numel() const;
  int64_t storage_bytes() const { return int64_t(storage_.size()); }
  void* data() { return storage_.data(); }
  const void* data() const { return storage_.data(); }

  // Element access by logical (row-major) index, through the strides.
  int64_t offset_of(int64_t logical) const;
  double get(int64_t logical) const;
  void set(int64_t logical, double value);  // rounds to the dtype
  int32_t get_int(int64_t logical) const;
  void set_int(int64_t logical, int32_t value);

  std::vector<double> to_double() const;    // logical order
  // The same shape, strides and (rounded to `dtype`) values in another dtype.
  HostTensor converted(fa_dtype dtype) const;
  // Logical element n of `from` into logical element n of this (same numel), rounded to this dtype.
  void copy_values_from(const HostTensor& from);
  // Random values. A tensor of more than 2^20 elements is filled in chunks of 2^20 on every core, each chunk from its
  // own generator seeded by one draw of `rng` (its values depend on `rng` alone, not on the thread count).
  void fill_normal(std::mt19937_64& rng, double stddev = 1.0, double mean = 0.0);
  void fill_uniform(std::mt19937_64& rng, double lo, double hi);
  // NaN in every element slot (floats) / 0x7eadbeef (ints), padding included.
  void poison();
  // Number of NaN / Inf values in the logical elements.
  int64_t count_nonfinite() const;

 private:
  std::vector<int64_t> shape_, strides_;
  template <class Distribution>
  void fill_from(std::mt19937_64& rng, const Distribution& distribution);
  bool row_major_ = false;  // strides_ are the row-major ones of shape_: offset_of(n) is n (no divisions)
  bool distinct_offsets_ = true;  // no two logical elements share a storage slot (threads may write them at once)
  fa_dtype dtype_ = FA_FLOAT32;
  std::vector<uint8_t> storage_;
};

// body(begin, end) for consecutive ranges of `chunk` indices covering [0, count), spread over the machine's cores: host
// work on the GPU tests' big tensors (K/V caches of 10^8 elements take seconds per pass on one core). Each index must
// write its own places (HostTensor::set on distinct elements is safe); `body` must not throw.
void parallel_chunks(int64_t count, int64_t chunk, const std::function<void(int64_t begin, int64_t end)>& body);

std::mt19937_64 make_rng(const std::string& salt);  // fresh seed per test run, printed on failure

// A host view of `data` with any shape and strides (elements), e.g. rows at stride 0 for huge extents.
fa_tensor host_view(void* data, fa_dtype dtype, const std::vector<int64_t>& shape, const std::vector<int64_t>& strides);

struct ErrorStats {
  double max_abs = 0;        // max |got - ref|
  double rel_l2 = 0;         // ||got - ref|| / ||ref|| (ref norm floored at 1e-30)
  int64_t mismatched_inf = 0;  // places where exactly one side is +-inf, or infinities of opposite sign
  int64_t nan = 0;           // NaN in got (a never-written or broken output)
  std::string to_string() const;
};
ErrorStats compare(const std::vector<double>& got, const std::vector<double>& ref);
ErrorStats compare(const HostTensor& got, const HostTensor& ref);

// The tolerance rule. For float32 outputs: rel_l2 <= 1e-5 (and max_abs <= 1e-5 * max|ref| + 1e-6).
// For float16/bfloat16: got's error against the oracle at most `factor` times the error of the naive
// same-precision computation (both max_abs and rel_l2), plus `abs_slack`, plus `input_floor`'s error where given:
// the error that rounding an input to the dtype alone makes (computed exactly; e.g. a rotated q, which the oracle
// keeps exact), which the naive computation carries too but whose own roundings can cancel.
::testing::AssertionResult within_tolerance(const std::string& what, fa_dtype dtype, const ErrorStats& fast,
                                            const ErrorStats* naive, double factor = 3.0,
                                            double abs_slack = 1e-5, const ErrorStats* input_floor = nullptr);

// ---- attention problems ----
struct Problem {
  int batch = 1, seqlen_q = 17, seqlen_k = 17, heads_q = 2, heads_k = 2, head_dim = 64, head_dim_v = -1;
  fa_dtype dtype = FA_FLOAT32;
  std::vector<int> varlen_q, varlen_k;  // non-empty: variable-length layout with these lengths
  double input_std = 1.0;               // > 3 makes the softmax peaky
  int dv() const { return head_dim_v > 0 ? head_dim_v : head_dim; }
  std::string to_string() const;
};

// Host tensors of one forward/backward problem, with random q/k/v/dout and poisoned outputs.
struct Tensors {
  HostTensor q, k, v, out, lse, dout, dq, dk, dv;
  HostTensor cu_seqlens_q, cu_seqlens_k;
  int max_seqlen_q = 0, max_seqlen_k = 0;
  void poison_outputs();
};
Tensors make_tensors(const Problem& problem, std::mt19937_64& rng);

fa_forward_args forward_args(Tensors& t);
fa_backward_args backward_args(Tensors& t);

fa_options options_for(fa_backend backend);

// Runs the oracle (float64) and the naive same-precision baseline into fresh tensors of t's shapes.
struct Oracle {
  HostTensor out, lse, dq, dk, dv;             // float64 results rounded to the output dtype
  std::vector<double> out64, lse64, dq64, dk64, dv64;  // unrounded (exact up to float64)
  HostTensor naive_out, naive_dq, naive_dk, naive_dv;  // baseline (16-bit dtypes only)
};
Oracle run_oracle(Tensors& t, const fa_options& options, bool with_backward);

// Compares a forward result (t.out, t.lse) with the oracle under the tolerance rule.
void expect_forward_matches(const std::string& what, const Tensors& t, const Oracle& oracle, fa_dtype dtype);
void expect_backward_matches(const std::string& what, const Tensors& t, const Oracle& oracle, fa_dtype dtype);

}  // namespace fa_test
