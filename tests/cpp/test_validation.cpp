// Every validation rule: each case starts from a valid call, breaks one thing, and checks that the
// call fails with the right status, that the message names the argument and the rule, and that no
// output was touched (outputs are poisoned before the call and must still be poison after it).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>

#include "api/validate.hpp"
#include "testing.hpp"

namespace flashattn {
namespace {

using fa_test::HostTensor;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// A valid dense forward + backward problem on the CPU (B=2, Sq=5, Sk=7, Hq=4, Hk=2, D=8, Dv=8).
struct DenseCall {
  HostTensor q{{2, 5, 4, 8}, FA_FLOAT32}, k{{2, 7, 2, 8}, FA_FLOAT32}, v{{2, 7, 2, 8}, FA_FLOAT32};
  HostTensor out{{2, 5, 4, 8}, FA_FLOAT32}, lse{{2, 4, 5}, FA_FLOAT32}, dout{{2, 5, 4, 8}, FA_FLOAT32};
  HostTensor dq{{2, 5, 4, 8}, FA_FLOAT32}, dk{{2, 7, 2, 8}, FA_FLOAT32}, dv{{2, 7, 2, 8}, FA_FLOAT32};
  HostTensor slopes{{4}, FA_FLOAT32};
  fa_forward_args fwd{};
  fa_backward_args bwd{};
  fa_options options;
  DenseCall() {
    auto rng = fa_test::make_rng("validation");
    for (HostTensor* t : {&q, &k, &v, &dout, &slopes}) t->fill_normal(rng);
    fwd.q = q.view();
    fwd.k = k.view();
    fwd.v = v.view();
    fwd.out = out.view();
    fwd.lse = lse.view();
    bwd.q = fwd.q;
    bwd.k = fwd.k;
    bwd.v = fwd.v;
    bwd.out = fwd.out;
    bwd.lse = fwd.lse;
    bwd.dout = dout.view();
    bwd.dq = dq.view();
    bwd.dk = dk.view();
    bwd.dv = dv.view();
    options = fa_test::options_for(FA_BACKEND_CPU_REFERENCE);
  }
  void poison() {
    for (HostTensor* t : {&out, &lse, &dq, &dk, &dv}) t->poison();
  }
  bool outputs_untouched() const {
    for (const HostTensor* t : {&out, &lse, &dq, &dk, &dv})
      for (int64_t n = 0; n < t->numel(); ++n)
        if (!std::isnan(t->get(n))) return false;
    return true;
  }
};

struct Expect {
  fa_status code;
  std::string message_part;  // must appear in the message (argument name + rule)
};

void expect_rejected(const Status& s, const Expect& e, const std::string& what) {
  EXPECT_EQ(s.code(), e.code) << what << ": " << s.to_string();
  EXPECT_NE(s.message().find(e.message_part), std::string::npos)
      << what << ": message \"" << s.message() << "\" lacks \"" << e.message_part << "\"";
}

void check_forward_rule(const std::string& what, const std::function<void(DenseCall&)>& breaker, Expect e) {
  DenseCall c;
  ASSERT_TRUE(forward(c.fwd, c.options).ok()) << "baseline call must be valid";
  breaker(c);
  c.poison();
  expect_rejected(forward(c.fwd, c.options), e, what);
  EXPECT_TRUE(c.outputs_untouched()) << what << ": an output was written before the error";
}

void check_backward_rule(const std::string& what, const std::function<void(DenseCall&)>& breaker, Expect e) {
  DenseCall c;
  ASSERT_TRUE(backward(c.bwd, c.options).ok()) << "baseline call must be valid";
  breaker(c);
  c.poison();
  expect_rejected(backward(c.bwd, c.options), e, what);
  EXPECT_TRUE(c.outputs_untouched()) << what << ": an output was written before the error";
}

constexpr fa_status kInvalid = FA_ERROR_INVALID_ARGUMENT;

// Stores an arbitrary integer in a C enum field, as a C caller can (without a C++ enum conversion).
template <typename Enum>
void set_raw(Enum& field, int value) {
  std::memcpy(&field, &value, sizeof(field));
}

// Drops the leading dimension of a contiguous view (keeps the last dimension contiguous), so that
// a rank rule is what fails, not the stride rule.
void drop_leading_dim(fa_tensor& t) {
  for (int d = 0; d + 1 < t.ndim; ++d) {
    t.shape[d] = t.shape[d + 1];
    t.strides[d] = t.strides[d + 1];
  }
  t.ndim -= 1;
}

TEST(Validation, TensorBasics) {
  check_forward_rule("missing q", [](DenseCall& c) { c.fwd.q.data = nullptr; }, {kInvalid, "q: required tensor is missing"});
  check_forward_rule("missing v", [](DenseCall& c) { c.fwd.v.data = nullptr; }, {kInvalid, "v: required tensor is missing"});
  check_forward_rule("missing out", [](DenseCall& c) { c.fwd.out.data = nullptr; }, {kInvalid, "out: required tensor is missing"});
  check_forward_rule("ndim too big", [](DenseCall& c) { c.fwd.k.ndim = 5; }, {kInvalid, "k: ndim must be in [0, 4]"});
  check_forward_rule("negative extent", [](DenseCall& c) { c.fwd.k.shape[1] = -1; }, {kInvalid, "k: dimension 1 has negative extent"});
  check_forward_rule("negative stride", [](DenseCall& c) { c.fwd.v.strides[0] = -5; }, {kInvalid, "v: stride of dimension 0 must be non-negative"});
  check_forward_rule("last dim strided", [](DenseCall& c) { c.fwd.q.strides[3] = 2; }, {kInvalid, "q: last dimension must be contiguous"});
  check_forward_rule("unknown device", [](DenseCall& c) { set_raw(c.fwd.k.device, 7); }, {kInvalid, "k: unknown device kind"});
  check_forward_rule("cpu device_id", [](DenseCall& c) { c.fwd.lse.device_id = 3; }, {kInvalid, "lse: device_id of a cpu tensor must be 0, got 3"});
  check_forward_rule("negative cuda device_id", [](DenseCall& c) {
    for (fa_tensor* t : {&c.fwd.q, &c.fwd.k, &c.fwd.v, &c.fwd.out, &c.fwd.lse}) t->device = FA_DEVICE_CUDA;
    c.fwd.k.device_id = -1;
    c.options.backend = FA_BACKEND_CUDA;
  }, {kInvalid, "k: device_id of a cuda tensor must be >= 0, got -1"});
  check_forward_rule("unknown dtype", [](DenseCall& c) { set_raw(c.fwd.k.dtype, 42); }, {kInvalid, "k: unknown dtype"});
  check_forward_rule("negative dtype", [](DenseCall& c) { set_raw(c.fwd.k.dtype, -1); }, {kInvalid, "k: unknown dtype -1"});
  check_forward_rule("float8 q", [](DenseCall& c) { c.fwd.q.dtype = FA_FLOAT8_E4M3; },
                     {kInvalid, "q: dtype must be float32, float16 or bfloat16, got float8_e4m3 (float8_e4m3 is accepted only for fa_kvcache's"});
  check_forward_rule("int q", [](DenseCall& c) { c.fwd.q.dtype = FA_INT32; }, {kInvalid, "q: dtype must be float32, float16 or bfloat16"});
  check_forward_rule("mixed dtypes", [](DenseCall& c) { c.fwd.v.dtype = FA_FLOAT16; }, {kInvalid, "v: dtype must match q"});
  check_forward_rule("out dtype", [](DenseCall& c) { c.fwd.out.dtype = FA_BFLOAT16; }, {kInvalid, "out: dtype must match q"});
  check_forward_rule("mixed devices", [](DenseCall& c) { c.fwd.k.device = FA_DEVICE_CUDA; }, {kInvalid, "k: must be on the device of q"});
  check_forward_rule("other gpu", [](DenseCall& c) {
    for (fa_tensor* t : {&c.fwd.q, &c.fwd.k, &c.fwd.v, &c.fwd.out, &c.fwd.lse}) t->device = FA_DEVICE_CUDA;
    c.fwd.v.device_id = 1;
    c.options.backend = FA_BACKEND_CUDA;
  }, {kInvalid, "v: must be on the device of q (cuda:0), got cuda:1"});
}

TEST(Validation, Shapes) {
  check_forward_rule("q 3-D without cu_seqlens", [](DenseCall& c) { drop_leading_dim(c.fwd.q); }, {kInvalid, "q: expected 4 dimensions (B, Sq, Hq, D)"});
  check_forward_rule("k 3-D", [](DenseCall& c) { drop_leading_dim(c.fwd.k); }, {kInvalid, "k: expected 4 dimensions (B, Sk, Hk, D)"});
  check_forward_rule("batch mismatch", [](DenseCall& c) { c.fwd.k.shape[0] = 1; c.fwd.v.shape[0] = 1; }, {kInvalid, "k: dimension 0 (B) must be 2 like q"});
  check_forward_rule("v rows", [](DenseCall& c) { c.fwd.v.shape[1] = 6; }, {kInvalid, "v: dimension 1 (Sk) must be 7 like k"});
  check_forward_rule("v heads", [](DenseCall& c) { c.fwd.v.shape[2] = 1; }, {kInvalid, "v: dimension 2 (Hk) must be 2 like k"});
  check_forward_rule("Hk does not divide Hq", [](DenseCall& c) { c.fwd.k.shape[2] = 3; c.fwd.v.shape[2] = 3; }, {kInvalid, "k: dimension 2 (Hk) must divide q's Hq = 4, got 3"});
  check_forward_rule("Hq zero", [](DenseCall& c) { c.fwd.q.shape[2] = 0; }, {kInvalid, "q: dimension 2 (Hq) must be >= 1"});
  check_forward_rule("Hk zero", [](DenseCall& c) { c.fwd.k.shape[2] = 0; c.fwd.v.shape[2] = 0; }, {kInvalid, "k: dimension 2 (Hk) must be >= 1"});
  check_forward_rule("head dim mismatch", [](DenseCall& c) { c.fwd.k.shape[3] = 4; }, {kInvalid, "k: dimension 3 (D) must be 8 like q"});
  check_forward_rule("head dim too big", [](DenseCall& c) { c.fwd.q.shape[3] = 2048; }, {kInvalid, "q: head dim must be in [1, 1024]"});
  check_forward_rule("head dim zero", [](DenseCall& c) { c.fwd.q.shape[3] = 0; }, {kInvalid, "q: head dim must be in [1, 1024]"});
  check_forward_rule("head dim one past", [](DenseCall& c) { c.fwd.q.shape[3] = 1025; }, {kInvalid, "q: head dim must be in [1, 1024], got 1025"});
  check_forward_rule("Dv one past", [](DenseCall& c) { c.fwd.v.shape[3] = c.fwd.out.shape[3] = 1025; }, {kInvalid, "v: head dim must be in [1, 1024], got 1025"});
  check_forward_rule("out rows", [](DenseCall& c) { c.fwd.out.shape[1] = 4; }, {kInvalid, "out: dimension 1 (rows) must be 5 like q"});
  check_forward_rule("out heads", [](DenseCall& c) { c.fwd.out.shape[2] = 2; }, {kInvalid, "out: dimension 2 (Hq) must be 4 like q"});
  check_forward_rule("out Dv", [](DenseCall& c) { c.fwd.out.shape[3] = 4; }, {kInvalid, "out: dimension 3 (Dv) must be 8 like v"});
  check_forward_rule("out ndim", [](DenseCall& c) { drop_leading_dim(c.fwd.out); }, {kInvalid, "out: expected 4 dimensions"});
  check_forward_rule("too long", [](DenseCall& c) { c.fwd.q.shape[1] = int64_t(1) << 33; }, {kInvalid, "q: dimension 1 (extent)"});
  // 2^31 - 2^20 is the largest extent (flashattn.h); k's rows all at one address (stride 0) make it cheap.
  constexpr int64_t kLargest = (int64_t(1) << 31) - (int64_t(1) << 20);
  check_forward_rule("keys past the largest extent", [](DenseCall& c) {
    for (fa_tensor* t : {&c.fwd.k, &c.fwd.v}) t->shape[1] = kLargest + 1, t->strides[0] = t->strides[1] = 0;
  }, {kInvalid, "k: dimension 1 (extent) = 2146435073 exceeds the largest extent, 2^31 - 2^20 = 2146435072"});
  check_forward_rule("B * Hq past the largest extent", [](DenseCall& c) {
    for (fa_tensor* t : {&c.fwd.q, &c.fwd.out}) t->shape[2] = int64_t(1) << 30, t->strides[0] = t->strides[1] = t->strides[2] = 0;
  }, {kInvalid, "q: B * Hq = 2 * 1073741824 = 2147483648 exceeds the largest extent"});
  // At its edge: B * Hq = 2^31 - 2^20 passes that rule (k's batch is what fails then), one more does not (19 x
  // 112970267; K / V of one head).
  check_forward_rule("B * Hq at the largest extent", [](DenseCall& c) {
    for (fa_tensor* t : {&c.fwd.q, &c.fwd.out}) t->shape[0] = 2047, t->shape[2] = int64_t(1) << 20, t->strides[0] = t->strides[1] = t->strides[2] = 0;
    for (fa_tensor* t : {&c.fwd.k, &c.fwd.v}) t->shape[2] = 1;
  }, {kInvalid, "k: dimension 0 (B) must be 2047 like q"});
  check_forward_rule("B * Hq one past the largest extent", [](DenseCall& c) {
    for (fa_tensor* t : {&c.fwd.q, &c.fwd.out}) t->shape[0] = 19, t->shape[2] = 112970267, t->strides[0] = t->strides[1] = t->strides[2] = 0;
    for (fa_tensor* t : {&c.fwd.k, &c.fwd.v}) t->shape[2] = 1;
  }, {kInvalid, "q: B * Hq = 19 * 112970267 = 2146435073 exceeds the largest extent"});
}

TEST(Validation, Lse) {
  check_forward_rule("lse dtype", [](DenseCall& c) { c.fwd.lse.dtype = FA_FLOAT16; }, {kInvalid, "lse: dtype must be float32"});
  check_forward_rule("lse ndim", [](DenseCall& c) { drop_leading_dim(c.fwd.lse); }, {kInvalid, "lse: expected 3 dimensions (B, Hq, Sq)"});
  check_forward_rule("lse Sq", [](DenseCall& c) { c.fwd.lse.shape[2] = 4; }, {kInvalid, "lse: dimension 2 (Sq) must be 5 like q"});
  check_forward_rule("lse heads", [](DenseCall& c) { c.fwd.lse.shape[1] = 2; }, {kInvalid, "lse: dimension 1 (Hq) must be 4 like q"});
  check_forward_rule("lse device", [](DenseCall& c) { c.fwd.lse.device = FA_DEVICE_CUDA; }, {kInvalid, "lse: must be on the device of q"});
  check_backward_rule("lse missing in backward", [](DenseCall& c) { c.bwd.lse.data = nullptr; }, {kInvalid, "lse: required tensor is missing"});
}

TEST(Validation, Options) {
  check_forward_rule("scale inf", [](DenseCall& c) { c.options.softmax_scale = INFINITY; }, {kInvalid, "options.softmax_scale: must be finite"});
  check_forward_rule("scale nan", [](DenseCall& c) { c.options.softmax_scale = kNaN; }, {kInvalid, "options.softmax_scale: must be finite"});
  check_forward_rule("window left", [](DenseCall& c) { c.options.window_left = -2; }, {kInvalid, "options.window_left: must be -1 (unbounded) or >= 0"});
  check_forward_rule("window right", [](DenseCall& c) { c.options.window_right = -3; }, {kInvalid, "options.window_right: must be -1 (unbounded) or >= 0"});
  check_forward_rule("window right -2", [](DenseCall& c) { c.options.window_right = -2; }, {kInvalid, "options.window_right: must be -1 (unbounded) or >= 0, got -2"});
  check_forward_rule("causal + right window", [](DenseCall& c) { c.options.causal = 1; c.options.window_right = 4; }, {kInvalid, "options.window_right: must be -1 or 0 when causal"});
  check_forward_rule("causal + right window 1", [](DenseCall& c) { c.options.causal = 1; c.options.window_right = 1; }, {kInvalid, "options.window_right: must be -1 or 0 when causal is set (causal means window_right = 0), got 1"});
  check_forward_rule("softcap negative", [](DenseCall& c) { c.options.softcap = -1; }, {kInvalid, "options.softcap: must be finite and >= 0"});
  check_forward_rule("softcap nan", [](DenseCall& c) { c.options.softcap = kNaN; }, {kInvalid, "options.softcap: must be finite and >= 0"});
  check_forward_rule("dropout 1", [](DenseCall& c) { c.options.dropout_p = 1.f; }, {kInvalid, "options.dropout_p: must be in [0, 1)"});
  check_forward_rule("dropout negative", [](DenseCall& c) { c.options.dropout_p = -0.1f; }, {kInvalid, "options.dropout_p: must be in [0, 1)"});
  check_forward_rule("dropout nan", [](DenseCall& c) { c.options.dropout_p = kNaN; }, {kInvalid, "options.dropout_p: must be in [0, 1)"});
  check_forward_rule("threads", [](DenseCall& c) { c.options.num_threads = -1; }, {kInvalid, "options.num_threads: must be >= 0"});
  check_forward_rule("backend unknown", [](DenseCall& c) { set_raw(c.options.backend, 9); }, {kInvalid, "options.backend: unknown backend 9"});
  check_forward_rule("backend negative", [](DenseCall& c) { set_raw(c.options.backend, -1); }, {kInvalid, "options.backend: unknown backend -1"});
  check_forward_rule("cuda backend on cpu tensors", [](DenseCall& c) { c.options.backend = FA_BACKEND_CUDA; }, {kInvalid, "options.backend: cuda needs tensors on a CUDA device"});
  check_forward_rule("cpu backend on cuda tensors", [](DenseCall& c) {
    for (fa_tensor* t : {&c.fwd.q, &c.fwd.k, &c.fwd.v, &c.fwd.out, &c.fwd.lse}) t->device = FA_DEVICE_CUDA;
    c.options.backend = FA_BACKEND_CPU_FLASH;
  }, {kInvalid, "options.backend: cpu_flash reads host memory, but the tensors are on cuda:0"});
}

TEST(Validation, Alibi) {
  check_forward_rule("alibi Hq", [](DenseCall& c) { c.options.alibi_slopes = c.slopes.view(); c.options.alibi_slopes.shape[0] = 3; }, {kInvalid, "options.alibi_slopes: dimension 0 (Hq) must be 4 like q"});
  check_forward_rule("alibi B", [](DenseCall& c) {
    c.options.alibi_slopes = c.slopes.view();
    c.options.alibi_slopes.ndim = 2;
    c.options.alibi_slopes.shape[0] = 3;
    c.options.alibi_slopes.shape[1] = 4;
    c.options.alibi_slopes.strides[0] = 4;
    c.options.alibi_slopes.strides[1] = 1;
  }, {kInvalid, "options.alibi_slopes: dimension 0 (B) must be 2 like q"});
  check_forward_rule("alibi 3-D", [](DenseCall& c) { c.options.alibi_slopes = c.slopes.view(); c.options.alibi_slopes.ndim = 3; }, {kInvalid, "options.alibi_slopes: expected 1 dimension (Hq) or 2 (B, Hq)"});
  check_forward_rule("alibi dtype", [](DenseCall& c) { c.options.alibi_slopes = c.slopes.view(); c.options.alibi_slopes.dtype = FA_FLOAT16; }, {kInvalid, "options.alibi_slopes: dtype must be float32"});
  check_forward_rule("alibi device", [](DenseCall& c) { c.options.alibi_slopes = c.slopes.view(); c.options.alibi_slopes.device = FA_DEVICE_CUDA; }, {kInvalid, "options.alibi_slopes: must be on the device of q"});
}

TEST(Validation, BackwardTensors) {
  check_backward_rule("dout shape", [](DenseCall& c) { c.bwd.dout.shape[1] = 4; }, {kInvalid, "dout: dimension 1 (extent) must be 5 like out"});
  check_backward_rule("dq ndim", [](DenseCall& c) { drop_leading_dim(c.bwd.dq); }, {kInvalid, "dq: must have the 4 dimensions of q"});
  check_backward_rule("dk shape", [](DenseCall& c) { c.bwd.dk.shape[2] = 4; }, {kInvalid, "dk: dimension 2 (extent) must be 2 like k"});
  check_backward_rule("dv dtype", [](DenseCall& c) { c.bwd.dv.dtype = FA_BFLOAT16; }, {kInvalid, "dv: dtype must match q"});
  check_backward_rule("dv missing", [](DenseCall& c) { c.bwd.dv.data = nullptr; }, {kInvalid, "dv: required tensor is missing"});
  HostTensor workspace({16}, FA_FLOAT32);
  check_backward_rule("workspace dtype", [&](DenseCall& c) { c.bwd.workspace = workspace.view(); }, {kInvalid, "workspace: dtype must be uint8"});
  HostTensor bytes({64}, FA_UINT8);
  check_backward_rule("workspace device", [&](DenseCall& c) {
    c.bwd.workspace = bytes.view();
    c.bwd.workspace.device = FA_DEVICE_CUDA;
  }, {kInvalid, "workspace: must be on the device of q (cpu:0), got cuda:0"});
  check_backward_rule("standard backend has no backward", [](DenseCall& c) { c.options.backend = FA_BACKEND_CPU_STANDARD; }, {FA_ERROR_UNSUPPORTED, "cpu_standard implements the forward pass only"});
}

// ---- variable length ----
struct VarlenCall {
  HostTensor q{{9, 2, 8}, FA_FLOAT32}, k{{12, 2, 8}, FA_FLOAT32}, v{{12, 2, 8}, FA_FLOAT32}, out{{9, 2, 8}, FA_FLOAT32};
  HostTensor lse{{2, 9}, FA_FLOAT32}, cu_q{{3}, FA_INT32}, cu_k{{3}, FA_INT32}, used{{2}, FA_INT32};
  fa_forward_args fwd{};
  fa_options options = fa_test::options_for(FA_BACKEND_CPU_REFERENCE);
  VarlenCall() {
    auto rng = fa_test::make_rng("varlen-validation");
    for (HostTensor* t : {&q, &k, &v}) t->fill_normal(rng);
    cu_q.set_int(0, 0), cu_q.set_int(1, 4), cu_q.set_int(2, 9);
    cu_k.set_int(0, 0), cu_k.set_int(1, 5), cu_k.set_int(2, 12);
    fwd.q = q.view();
    fwd.k = k.view();
    fwd.v = v.view();
    fwd.out = out.view();
    fwd.lse = lse.view();
    fwd.cu_seqlens_q = cu_q.view();
    fwd.cu_seqlens_k = cu_k.view();
    fwd.max_seqlen_q = 5;
    fwd.max_seqlen_k = 7;
  }
};

void check_varlen_rule(const std::string& what, const std::function<void(VarlenCall&)>& breaker, Expect e) {
  VarlenCall c;
  ASSERT_TRUE(forward(c.fwd, c.options).ok());
  breaker(c);
  c.out.poison();
  expect_rejected(forward(c.fwd, c.options), e, what);
  for (int64_t n = 0; n < c.out.numel(); ++n) ASSERT_TRUE(std::isnan(c.out.get(n))) << what << ": out written";
}

TEST(Validation, Varlen) {
  check_varlen_rule("only cu_q", [](VarlenCall& c) { c.fwd.cu_seqlens_k.data = nullptr; }, {kInvalid, "cu_seqlens_k: cu_seqlens_q and cu_seqlens_k must be given together"});
  check_varlen_rule("q 4-D", [](VarlenCall& c) { c.fwd.q.ndim = 4; }, {kInvalid, "q: expected 3 dimensions (total_q, Hq, D)"});
  check_varlen_rule("cu dtype", [](VarlenCall& c) { c.fwd.cu_seqlens_k.dtype = FA_FLOAT32; }, {kInvalid, "cu_seqlens_k: dtype must be int32"});
  check_varlen_rule("cu count", [](VarlenCall& c) { c.fwd.cu_seqlens_k.shape[0] = 2; }, {kInvalid, "cu_seqlens_k: must have B+1 = 3 entries"});
  check_varlen_rule("cu start", [](VarlenCall& c) { c.cu_q.set_int(0, 1); }, {kInvalid, "cu_seqlens_q: must start at 0"});
  check_varlen_rule("cu decreasing", [](VarlenCall& c) { c.cu_k.set_int(1, 13); c.fwd.max_seqlen_k = 20; }, {kInvalid, "cu_seqlens_k: must be non-decreasing"});
  check_varlen_rule("cu beyond rows", [](VarlenCall& c) { c.cu_q.set_int(2, 10); c.fwd.max_seqlen_q = 6; }, {kInvalid, "cu_seqlens_q: last entry 10 exceeds the 9 rows"});
  check_varlen_rule("longer than max", [](VarlenCall& c) { c.fwd.max_seqlen_k = 6; }, {kInvalid, "cu_seqlens_k: sequence 1 has length 7 > max_seqlen_k = 6"});
  check_varlen_rule("negative max", [](VarlenCall& c) { c.fwd.max_seqlen_q = -1; }, {kInvalid, "max_seqlen_q: must be >= 0"});
  check_varlen_rule("negative max k", [](VarlenCall& c) { c.fwd.max_seqlen_k = -1; }, {kInvalid, "max_seqlen_k: must be >= 0, got -1"});
  check_varlen_rule("no cu_seqlens entries", [](VarlenCall& c) { c.fwd.cu_seqlens_q.shape[0] = 0; }, {kInvalid, "cu_seqlens_q: must have at least one entry"});
  check_varlen_rule("cu_k beyond rows", [](VarlenCall& c) { c.cu_k.set_int(2, 13); c.fwd.max_seqlen_k = 8; }, {kInvalid, "cu_seqlens_k: last entry 13 exceeds the 12 rows"});
  check_varlen_rule("seqused negative", [](VarlenCall& c) {
    c.used.set_int(0, -1), c.used.set_int(1, 1);
    c.fwd.seqused_k = c.used.view();
  }, {kInvalid, "seqused_k: entry 0 = -1 must be in [0, 5]"});
  check_varlen_rule("lse layout", [](VarlenCall& c) { c.fwd.lse.shape[1] = 8; }, {kInvalid, "lse: dimension 1 (total_q) must be 9 like q"});
  check_varlen_rule("seqused range", [](VarlenCall& c) {
    c.used.set_int(0, 6), c.used.set_int(1, 1);
    c.fwd.seqused_k = c.used.view();
  }, {kInvalid, "seqused_k: entry 0 = 6 must be in [0, 5]"});
  check_varlen_rule("seqused count", [](VarlenCall& c) { c.fwd.seqused_k = c.used.view(); c.fwd.seqused_k.shape[0] = 3; }, {kInvalid, "seqused_k: dimension 0 (B) must be 2 like q"});
  check_varlen_rule("standard backend varlen", [](VarlenCall& c) { c.options.backend = FA_BACKEND_CPU_STANDARD; }, {FA_ERROR_UNSUPPORTED, "cu_seqlens_q: the cpu_standard backend takes the dense layout only"});
}

// max_seqlen_q / max_seqlen_k are upper bounds only: bounds near INT32_MAX give the very result of the tight call
// (both CPU backends; a loose bound once overflowed the CPU backend's tile count, which then ran no tile).
TEST(Validation, VarlenLooseBounds) {
  for (const fa_backend backend : {FA_BACKEND_CPU_REFERENCE, FA_BACKEND_CPU_FLASH}) {
    VarlenCall tight;
    tight.options = fa_test::options_for(backend);
    ASSERT_TRUE(forward(tight.fwd, tight.options).ok());
    VarlenCall loose;
    loose.options = tight.options;
    loose.q.copy_values_from(tight.q);
    loose.k.copy_values_from(tight.k);
    loose.v.copy_values_from(tight.v);
    loose.fwd.max_seqlen_k = std::numeric_limits<int32_t>::max() - 1;
    loose.fwd.max_seqlen_q = std::numeric_limits<int32_t>::max() - 1;
    const Status s = forward(loose.fwd, loose.options);
    ASSERT_TRUE(s.ok()) << s.to_string();
    for (int64_t n = 0; n < tight.out.numel(); ++n) ASSERT_EQ(loose.out.get(n), tight.out.get(n)) << "out " << n;
    for (int64_t n = 0; n < tight.lse.numel(); ++n) ASSERT_EQ(loose.lse.get(n), tight.lse.get(n)) << "lse " << n;
  }
}

// ---- paged forward and KV cache ----
struct KvcacheCall {
  static constexpr int kBlocks = 6, kBlockSize = 4;
  HostTensor q{{2, 3, 4, 8}, FA_FLOAT32}, k_cache{{kBlocks, kBlockSize, 2, 8}, FA_FLOAT32}, v_cache{{kBlocks, kBlockSize, 2, 8}, FA_FLOAT32};
  HostTensor k_new{{2, 2, 2, 8}, FA_FLOAT32}, v_new{{2, 2, 2, 8}, FA_FLOAT32}, out{{2, 3, 4, 8}, FA_FLOAT32};
  HostTensor table{{2, 3}, FA_INT32}, seqlens{{2}, FA_INT32};
  HostTensor cos{{16, 4}, FA_FLOAT32}, sin{{16, 4}, FA_FLOAT32};
  HostTensor leftpad{{2}, FA_INT32};  // cache_leftpad, attached by the rules that need it (entries 5 and 3 at first)
  fa_kvcache_args args{};
  fa_options options = fa_test::options_for(FA_BACKEND_CPU_REFERENCE);
  KvcacheCall() {
    auto rng = fa_test::make_rng("kvcache-validation");
    for (HostTensor* t : {&q, &k_cache, &v_cache, &k_new, &v_new, &cos, &sin}) t->fill_normal(rng);
    const int ids[6] = {5, 0, 3, 2, 2, 4};  // repeated and out of order on purpose
    for (int n = 0; n < 6; ++n) table.set_int(n, ids[n]);
    seqlens.set_int(0, 7), seqlens.set_int(1, 3);
    leftpad.set_int(0, 5), leftpad.set_int(1, 3);
    args.q = q.view();
    args.k_cache = k_cache.view();
    args.v_cache = v_cache.view();
    args.block_table = table.view();
    args.cache_seqlens = seqlens.view();
    args.k_new = k_new.view();
    args.v_new = v_new.view();
    args.rotary_cos = cos.view();
    args.rotary_sin = sin.view();
    args.out = out.view();
  }
};

// A valid call of type Call (KvcacheCall, SlotCall) broken by `breaker`: rejected as `e` says, nothing written.
template <typename Call>
void check_call_rule(const std::string& what, const std::function<void(Call&)>& breaker, Expect e) {
  Call c;
  {
    Call valid;
    ASSERT_TRUE(kvcache(valid.args, valid.options).ok()) << "baseline call must be valid";
  }
  breaker(c);
  const HostTensor k_before = c.k_cache;
  c.out.poison();
  expect_rejected(kvcache(c.args, c.options), e, what);
  for (int64_t n = 0; n < c.out.numel(); ++n) ASSERT_TRUE(std::isnan(c.out.get(n))) << what << ": out written";
  for (int64_t n = 0; n < c.k_cache.numel(); ++n) ASSERT_EQ(c.k_cache.get(n), k_before.get(n)) << what << ": cache written";
}

void check_kvcache_rule(const std::string& what, const std::function<void(KvcacheCall&)>& breaker, Expect e) {
  check_call_rule<KvcacheCall>(what, breaker, e);
}

TEST(Validation, Kvcache) {
  check_kvcache_rule("q 3-D", [](KvcacheCall& c) { drop_leading_dim(c.args.q); }, {kInvalid, "q: expected 4 dimensions (B, Sq, Hq, D)"});
  check_kvcache_rule("cache ndim", [](KvcacheCall& c) { drop_leading_dim(c.args.k_cache); }, {kInvalid, "k_cache: expected 4 dimensions (num_blocks, block_size, Hk, D)"});
  check_kvcache_rule("v cache heads", [](KvcacheCall& c) { c.args.v_cache.shape[2] = 1; }, {kInvalid, "v_cache: dimension 2 (Hk) must be 2 like k"});
  check_kvcache_rule("cache_seqlens missing", [](KvcacheCall& c) { c.args.cache_seqlens.data = nullptr; }, {kInvalid, "cache_seqlens: required tensor is missing"});
  check_kvcache_rule("cache_seqlens B", [](KvcacheCall& c) { c.args.cache_seqlens.shape[0] = 1; }, {kInvalid, "cache_seqlens: dimension 0 (B) must be 2 like q"});
  check_kvcache_rule("overflow", [](KvcacheCall& c) { c.seqlens.set_int(0, 11); }, {kInvalid, "cache_seqlens: entry 0 = 11 plus S_new = 2 must be in [0, 12]"});
  check_kvcache_rule("negative length", [](KvcacheCall& c) { c.seqlens.set_int(1, -1); }, {kInvalid, "cache_seqlens: entry 1 = -1"});
  check_kvcache_rule("k_new alone", [](KvcacheCall& c) { c.args.v_new.data = nullptr; }, {kInvalid, "v_new: k_new and v_new must be given together"});
  check_kvcache_rule("k_new heads", [](KvcacheCall& c) { c.args.k_new.shape[2] = 4; }, {kInvalid, "k_new: dimension 2 (Hk) must be 2 like k_cache"});
  check_kvcache_rule("v_new rows", [](KvcacheCall& c) { c.args.v_new.shape[1] = 1; }, {kInvalid, "v_new: dimension 1 (S_new) must be 2 like k_new"});
  check_kvcache_rule("bad block id", [](KvcacheCall& c) { c.table.set_int(1, 6); }, {kInvalid, "block_table: entry (0, 1) = 6 is not a block id in [0, 6)"});
  check_kvcache_rule("negative block id", [](KvcacheCall& c) { c.table.set_int(3, -1); }, {kInvalid, "block_table: entry (1, 0) = -1"});
  check_kvcache_rule("block table B", [](KvcacheCall& c) { c.args.block_table.shape[0] = 1; }, {kInvalid, "block_table: dimension 0 (B) must be 2 like q"});
  check_kvcache_rule("rotary alone", [](KvcacheCall& c) { c.args.rotary_sin.data = nullptr; }, {kInvalid, "rotary_sin: rotary_cos and rotary_sin must be given together"});
  check_kvcache_rule("rotary too wide", [](KvcacheCall& c) { c.args.rotary_cos.shape[1] = 5; c.args.rotary_sin.shape[1] = 5; }, {kInvalid, "rotary_cos: rotary_dim = 2 * dimension 1 = 10 must be in [2, D = 8]"});
  check_kvcache_rule("rotary sin shape", [](KvcacheCall& c) { c.args.rotary_sin.shape[0] = 15; }, {kInvalid, "rotary_sin: dimension 0 (S_rotary) must be 16 like rotary_cos"});
  check_kvcache_rule("rotary too short", [](KvcacheCall& c) { c.args.rotary_cos.shape[0] = 9; c.args.rotary_sin.shape[0] = 9; }, {kInvalid, "rotary_cos: dimension 0 (S_rotary) = 9 must cover position 9"});
  check_kvcache_rule("rotary with Dv != D", [](KvcacheCall& c) {
    for (fa_tensor* t : {&c.args.v_cache, &c.args.v_new, &c.args.out}) t->shape[3] = 4;  // views of the first 4 columns
  }, {kInvalid, "rotary_cos: rotary embedding needs Dv == D, got Dv = 4, D = 8"});
  check_kvcache_rule("splits", [](KvcacheCall& c) { c.args.num_splits = -2; }, {kInvalid, "num_splits: must be in [0, 1024]"});
  check_kvcache_rule("too many splits", [](KvcacheCall& c) { c.args.num_splits = 1025; }, {kInvalid, "num_splits: must be in [0, 1024] (0 = chosen by the backend), got 1025"});
  check_kvcache_rule("leftpad past the length", [](KvcacheCall& c) { c.args.cache_leftpad = c.leftpad.view(); c.leftpad.set_int(1, 4); }, {kInvalid, "cache_leftpad: entry 1 = 4 must be in [0, cache_seqlens[1] = 3]"});
  check_kvcache_rule("leftpad negative", [](KvcacheCall& c) { c.args.cache_leftpad = c.leftpad.view(); c.leftpad.set_int(0, -1); }, {kInvalid, "cache_leftpad: entry 0 = -1 must be in [0, cache_seqlens[0] = 7]"});
  check_kvcache_rule("leftpad dtype", [](KvcacheCall& c) { c.args.cache_leftpad = c.leftpad.view(); c.args.cache_leftpad.dtype = FA_FLOAT32; }, {kInvalid, "cache_leftpad: dtype must be int32"});
  check_kvcache_rule("leftpad B", [](KvcacheCall& c) { c.args.cache_leftpad = c.leftpad.view(); c.args.cache_leftpad.shape[0] = 1; }, {kInvalid, "cache_leftpad: dimension 0 (B) must be 2 like q"});
  // Blocks wholly in the padding are never read, so their ids are not checked: sequence 0's first block (rows 0-3,
  // below its padding of 5) may be anything; its second (rows 4-7) holds keys 5-6 and must be a block.
  {
    KvcacheCall c;
    c.args.cache_leftpad = c.leftpad.view();
    c.table.set_int(0, -7);
    EXPECT_TRUE(kvcache(c.args, c.options).ok()) << "a padding block's id is never read";
  }
  check_kvcache_rule("leftpad block id", [](KvcacheCall& c) { c.args.cache_leftpad = c.leftpad.view(); c.table.set_int(1, -7); }, {kInvalid, "block_table: entry (0, 1) = -7 is not a block id in [0, 6)"});
  check_kvcache_rule("standard has no kvcache", [](KvcacheCall& c) { c.options.backend = FA_BACKEND_CPU_STANDARD; }, {FA_ERROR_UNSUPPORTED, "cpu_standard does not implement KV-cache attention"});
}

// With cache_seqlens in device memory (CUDA) the lengths cannot be read before the kernels, which read the rotary
// table at each row's position: the table must then cover every position a valid length reaches. Host lengths are
// checked one by one (above). Parameters only (no GPU needed): the tensors are labelled CUDA, never dereferenced.
TEST(Validation, KvcacheRotaryTableWithDeviceLengths) {
  auto params = [](int s_rotary, bool device) {
    KvcacheCall c;
    c.args.rotary_cos.shape[0] = c.args.rotary_sin.shape[0] = s_rotary;
    if (device) {
      for (fa_tensor* t : {&c.args.q, &c.args.k_cache, &c.args.v_cache, &c.args.block_table, &c.args.cache_seqlens, &c.args.k_new,
                           &c.args.v_new, &c.args.rotary_cos, &c.args.rotary_sin, &c.args.out})
        t->device = FA_DEVICE_CUDA;
      c.options.backend = FA_BACKEND_CUDA;
    }
    flashattn::KvcacheParams p;
    return flashattn::api::make_kvcache_params(c.args, c.options, &p);
  };
  // capacity 3 blocks x 4 rows = 12, S_new = 2, Sq = 3: every valid length (<= 10) reaches position 10 + 3 - 1 = 12
  EXPECT_TRUE(params(13, true).ok());
  const Status s = params(12, true);
  EXPECT_EQ(s.code(), FA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(s.message().find("rotary_cos: dimension 0 (S_rotary) = 12 must be >= 13 = the cache capacity 12 - S_new 2 + "
                             "max(S_new, Sq)"),
            std::string::npos)
      << s.to_string();
  // the host lengths (7 and 3) reach position 9 only
  EXPECT_TRUE(params(10, false).ok());
  EXPECT_FALSE(params(9, false).ok());
}

// A contiguous cache of 5 slots, sequences 0 and 1 in slots 4 and 1 (cache_batch_idx).
struct SlotCall {
  HostTensor q{{2, 3, 4, 8}, FA_FLOAT32}, k_cache{{5, 12, 2, 8}, FA_FLOAT32}, v_cache{{5, 12, 2, 8}, FA_FLOAT32};
  HostTensor k_new{{2, 2, 2, 8}, FA_FLOAT32}, v_new{{2, 2, 2, 8}, FA_FLOAT32}, out{{2, 3, 4, 8}, FA_FLOAT32};
  HostTensor seqlens{{2}, FA_INT32}, slots{{2}, FA_INT32};
  fa_kvcache_args args{};
  fa_options options = fa_test::options_for(FA_BACKEND_CPU_REFERENCE);
  SlotCall() {
    auto rng = fa_test::make_rng("slot-validation");
    for (HostTensor* t : {&q, &k_cache, &v_cache, &k_new, &v_new}) t->fill_normal(rng);
    seqlens.set_int(0, 7), seqlens.set_int(1, 3);
    slots.set_int(0, 4), slots.set_int(1, 1);
    args.q = q.view();
    args.k_cache = k_cache.view();
    args.v_cache = v_cache.view();
    args.cache_seqlens = seqlens.view();
    args.cache_batch_idx = slots.view();
    args.k_new = k_new.view();
    args.v_new = v_new.view();
    args.out = out.view();
  }
};

void check_slot_rule(const std::string& what, const std::function<void(SlotCall&)>& breaker, Expect e) {
  check_call_rule<SlotCall>(what, breaker, e);
}

TEST(Validation, KvcacheBatchIdx) {
  check_slot_rule("entry past the slots", [](SlotCall& c) { c.slots.set_int(0, 5); }, {kInvalid, "cache_batch_idx: entry 0 = 5 is not a batch entry of k_cache in [0, 5)"});
  check_slot_rule("negative entry", [](SlotCall& c) { c.slots.set_int(1, -1); }, {kInvalid, "cache_batch_idx: entry 1 = -1 is not a batch entry"});
  check_slot_rule("repeated entry with append", [](SlotCall& c) { c.slots.set_int(0, 1); }, {kInvalid, "cache_batch_idx: entries 0 and 1 are both 1; with k_new"});
  check_slot_rule("B", [](SlotCall& c) { c.args.cache_batch_idx.shape[0] = 1; }, {kInvalid, "cache_batch_idx: dimension 0 (B) must be 2 like q"});
  check_slot_rule("dtype", [](SlotCall& c) { c.args.cache_batch_idx.dtype = FA_FLOAT32; }, {kInvalid, "cache_batch_idx: dtype must be int32"});
  check_slot_rule("2-D", [](SlotCall& c) { c.args.cache_batch_idx.ndim = 2; c.args.cache_batch_idx.shape[1] = 1; c.args.cache_batch_idx.strides[1] = 1; }, {kInvalid, "cache_batch_idx: expected 1 dimensions (B)"});
  check_slot_rule("v_cache slots", [](SlotCall& c) { c.args.v_cache.shape[0] = 4; }, {kInvalid, "v_cache: dimension 0 (the cache's batch) must be 5 like k_cache"});
  check_slot_rule("no slots", [](SlotCall& c) { c.args.k_cache.shape[0] = c.args.v_cache.shape[0] = 0; }, {kInvalid, "k_cache: dimension 0 (the cache's batch) must be >= 1 with cache_batch_idx"});
  check_slot_rule("without cache_batch_idx", [](SlotCall& c) { c.args.cache_batch_idx = fa_tensor{}; }, {kInvalid, "k_cache: dimension 0 (B) must be 2 like q"});
  check_kvcache_rule("with a paged cache", [](KvcacheCall& c) { c.args.cache_batch_idx = c.seqlens.view(); }, {kInvalid, "cache_batch_idx: applies to a contiguous cache only"});
  // Without an append, sequences may share a slot (they only read it).
  SlotCall shared;
  shared.slots.set_int(0, 1);
  shared.args.k_new = shared.args.v_new = fa_tensor{};
  EXPECT_TRUE(kvcache(shared.args, shared.options).ok());
}

TEST(Validation, PagedForward) {
  KvcacheCall c;
  HostTensor used({2}, FA_INT32);
  used.set_int(0, 9), used.set_int(1, 13);  // sequence 1 needs 4 blocks; the table has 3 columns
  fa_forward_args f{};
  f.q = c.q.view();
  f.k = c.k_cache.view();
  f.v = c.v_cache.view();
  f.out = c.out.view();
  f.block_table = c.table.view();
  f.seqused_k = used.view();
  expect_rejected(forward(f, c.options), {kInvalid, "seqused_k: entry 1 = 13 must be in [0, 12]"}, "seqused beyond capacity");
  used.set_int(1, 5);
  c.table.set_int(2, 77);  // beyond sequence 0's 3 used blocks? no: 9 keys use blocks 0..2 -> rejected
  expect_rejected(forward(f, c.options), {kInvalid, "block_table: entry (0, 2) = 77"}, "bad block id");
  used.set_int(0, 8);  // now sequence 0 uses 2 blocks: entry (0, 2) is never read, so it is allowed
  EXPECT_TRUE(forward(f, c.options).ok());
  fa_forward_args empty_blocks = f;
  empty_blocks.k.shape[1] = empty_blocks.v.shape[1] = 0;
  expect_rejected(forward(empty_blocks, c.options), {kInvalid, "k: dimension 1 (block_size) must be >= 1, got 0"}, "blocks of no row");
  // varlen over the paged cache: max_seqlen_k within the table's capacity, 3 blocks of 4 keys
  HostTensor cu_q({3}, FA_INT32), cu_k({3}, FA_INT32), q({6, 4, 8}, FA_FLOAT32), out({6, 4, 8}, FA_FLOAT32);
  cu_q.set_int(0, 0), cu_q.set_int(1, 3), cu_q.set_int(2, 6);
  cu_k.set_int(0, 0), cu_k.set_int(1, 8), cu_k.set_int(2, 13);
  auto rng = fa_test::make_rng("paged-varlen-validation");
  q.fill_normal(rng);
  fa_forward_args v = f;
  v.q = q.view(), v.out = out.view(), v.seqused_k = fa_tensor{};
  v.cu_seqlens_q = cu_q.view(), v.cu_seqlens_k = cu_k.view();
  v.max_seqlen_q = 3;
  v.max_seqlen_k = 12;
  EXPECT_TRUE(forward(v, c.options).ok());
  v.max_seqlen_k = 13;
  expect_rejected(forward(v, c.options), {kInvalid, "max_seqlen_k: 13 exceeds the paged capacity max_blocks * block_size = 12"}, "varlen past the capacity");
}

TEST(Validation, NullArguments) {
  fa_error e{};
  EXPECT_EQ(fa_forward(nullptr, nullptr, &e), kInvalid);
  EXPECT_NE(std::string(e.message).find("args: must not be NULL"), std::string::npos);
  DenseCall c;
  int64_t bytes = 0;
  EXPECT_EQ(fa_backward_workspace_size(&c.bwd, &c.options, nullptr, &e), kInvalid);
  EXPECT_NE(std::string(e.message).find("bytes: must not be NULL"), std::string::npos);
  EXPECT_EQ(fa_backward_workspace_size(&c.bwd, &c.options, &bytes, nullptr), FA_OK);  // error may be NULL
  EXPECT_EQ(fa_plan_kvcache(nullptr, nullptr, nullptr, &e), kInvalid);
  EXPECT_EQ(fa_kvcache(nullptr, nullptr, &e), kInvalid);
  EXPECT_EQ(fa_backward(nullptr, nullptr, &e), kInvalid);
}

TEST(Validation, DefaultsAndEmptyProblems) {
  fa_options o;
  fa_options_init(&o);
  EXPECT_EQ(o.window_left, -1);
  EXPECT_EQ(o.window_right, -1);
  EXPECT_EQ(o.backend, FA_BACKEND_AUTO);
  EXPECT_EQ(o.softmax_scale, 0.f);
  // Sq = 0 and B = 0 are valid and do nothing.
  HostTensor q({1, 0, 2, 8}, FA_FLOAT32), k({1, 3, 2, 8}, FA_FLOAT32), v({1, 3, 2, 8}, FA_FLOAT32), out({1, 0, 2, 8}, FA_FLOAT32);
  fa_forward_args a{};
  a.q = q.view(), a.k = k.view(), a.v = v.view(), a.out = out.view();
  fa_options ref = fa_test::options_for(FA_BACKEND_CPU_REFERENCE);
  EXPECT_TRUE(forward(a, ref).ok());
}

// CUDA tensors in a build or on a machine without a usable GPU: an error naming the device, never
// a silent CPU fallback and never a crash.
TEST(Validation, CudaTensorsWithoutUsableGpu) {
  if (fa_cuda_device_count() > 0) GTEST_SKIP() << "a GPU is present: covered by the CUDA tests";
  DenseCall c;
  for (fa_tensor* t : {&c.fwd.q, &c.fwd.k, &c.fwd.v, &c.fwd.out, &c.fwd.lse}) t->device = FA_DEVICE_CUDA;
  for (fa_tensor* t : {&c.fwd.q, &c.fwd.k, &c.fwd.v, &c.fwd.out}) t->dtype = FA_BFLOAT16;  // a dtype CUDA takes
  c.options.backend = FA_BACKEND_AUTO;
  c.poison();
  const Status s = forward(c.fwd, c.options);
  EXPECT_FALSE(s.ok());
  EXPECT_TRUE(s.code() == FA_ERROR_NOT_COMPILED || s.code() == FA_ERROR_DEVICE) << s.to_string();
  EXPECT_TRUE(c.outputs_untouched());
}

}  // namespace
}  // namespace flashattn
