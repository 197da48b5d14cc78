// Host-side dispatch of the CUDA backend (src/cuda/dispatch.cpp): kernel choice from the generated
// table, CUDA-specific argument rules and their messages. Plain C++: runs without a GPU or CUDA.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "api/validate.hpp"
#include "cuda/dispatch.hpp"
#include "cuda/generated/kernel_table.hpp"
#include "cuda/sm80/forward_packing.hpp"
#include "cuda/sm80/forward_split.hpp"

namespace {

using flashattn::AttentionParams;
using flashattn::Status;
using flashattn::cuda::choose_kernel;
using flashattn::cuda::DecodeRole;
using flashattn::cuda::DeviceLimits;
using flashattn::cuda::KernelEntry;
using flashattn::cuda::KernelKind;

// Device tensors are never dereferenced by validation or dispatch: fake, 256-byte aligned addresses.
void* fake_device_pointer(int n) { return reinterpret_cast<void*>(uintptr_t(0x7f0000000000ull + 0x100000ull * n)); }

fa_tensor device_tensor(int n, std::initializer_list<int64_t> shape, fa_dtype dtype) {
  const std::vector<int64_t> dims(shape);
  return fa_tensor_contiguous(fake_device_pointer(n), int32_t(dims.size()), dims.data(), dtype, FA_DEVICE_CUDA, 0);
}

struct Case {
  int batch = 2, sq = 100, sk = 130, hq = 4, hk = 2, d = 64, dv = -1;
  fa_dtype dtype = FA_BFLOAT16;
  float dropout = 0.f;
  bool causal = false;
};

// Params as src/api/validate.cpp builds them for a dense call with CUDA tensors.
AttentionParams params_for(const Case& c, fa_forward_args* keep = nullptr) {
  const int dv = c.dv > 0 ? c.dv : c.d;
  fa_forward_args a{};
  a.q = device_tensor(0, {c.batch, c.sq, c.hq, c.d}, c.dtype);
  a.k = device_tensor(1, {c.batch, c.sk, c.hk, c.d}, c.dtype);
  a.v = device_tensor(2, {c.batch, c.sk, c.hk, dv}, c.dtype);
  a.out = device_tensor(3, {c.batch, c.sq, c.hq, dv}, c.dtype);
  fa_options o;
  fa_options_init(&o);
  o.backend = FA_BACKEND_CUDA;
  o.dropout_p = c.dropout;
  o.causal = c.causal;
  if (keep) *keep = a;
  AttentionParams p;
  const Status s = flashattn::api::make_forward_params(a, o, &p);
  EXPECT_TRUE(s.ok()) << s.message();
  return p;
}

DeviceLimits h200() { return DeviceLimits{0, 9, 0, 227 * 1024}; }
DeviceLimits a100() { return DeviceLimits{0, 8, 0, 163 * 1024}; }

// A small table of our own, so the rules are tested independently of what the manifest compiles.
const KernelEntry kTable[] = {
    {KernelKind::kForward, FA_BFLOAT16, 64, 128, 128, 4, 2, false, 80 * 1024, "fwd_bf16_d64"},
    {KernelKind::kForward, FA_BFLOAT16, 128, 128, 64, 4, 2, false, 96 * 1024, "fwd_bf16_d128"},
    {KernelKind::kForward, FA_BFLOAT16, 128, 128, 64, 4, 2, true, 96 * 1024, "fwd_bf16_d128_dropout"},
    {KernelKind::kForward, FA_BFLOAT16, 256, 128, 64, 8, 2, false, 192 * 1024, "fwd_bf16_d256"},
    {KernelKind::kBackward, FA_BFLOAT16, 128, 64, 128, 8, 1, false, 0, "bwd_bf16_d128"},
};
constexpr int kTableRows = sizeof(kTable) / sizeof(kTable[0]);
const std::string kArchs = "80-real 90a-real";

int choose(const Case& c, KernelKind kind = KernelKind::kForward, DeviceLimits device = h200(), Status* status = nullptr) {
  int index = -1;
  const Status s = choose_kernel(kind, params_for(c), device, kTable, kTableRows, kArchs, &index);
  if (status) *status = s;
  return s.ok() ? index : -1;
}

TEST(CudaDispatch, PicksTheSmallestBucketThatHoldsTheHeadDim) {
  Case c;
  c.d = 64;
  EXPECT_STREQ(kTable[choose(c)].name, "fwd_bf16_d64");
  c.d = 72;  // zero-padded into the next bucket
  EXPECT_STREQ(kTable[choose(c)].name, "fwd_bf16_d128");
  c.d = 128;
  EXPECT_STREQ(kTable[choose(c)].name, "fwd_bf16_d128");
  c.d = 136;
  EXPECT_STREQ(kTable[choose(c)].name, "fwd_bf16_d256");
  c.d = 128;
  c.dropout = 0.1f;
  EXPECT_STREQ(kTable[choose(c)].name, "fwd_bf16_d128_dropout");
  c.dropout = 0.f;
  EXPECT_STREQ(kTable[choose(c, KernelKind::kBackward)].name, "bwd_bf16_d128");
}

TEST(CudaDispatch, MissingCombinationsAreNotCompiledErrorsThatListWhatIs) {
  Status s;
  Case c;
  c.d = 264;
  EXPECT_EQ(choose(c, KernelKind::kForward, h200(), &s), -1);
  EXPECT_EQ(s.code(), FA_ERROR_NOT_COMPILED);
  EXPECT_NE(s.message().find("q: head dim 264 is not compiled"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("64, 128, 256"), std::string::npos) << s.message();
  c.d = 160;
  c.dropout = 0.2f;  // dropout only up to 128
  EXPECT_EQ(choose(c, KernelKind::kForward, h200(), &s), -1);
  EXPECT_EQ(s.code(), FA_ERROR_NOT_COMPILED);
  EXPECT_NE(s.message().find("dropout"), std::string::npos) << s.message();
  c.dtype = FA_FLOAT16;
  c.dropout = 0.f;
  EXPECT_EQ(choose(c, KernelKind::kForward, h200(), &s), -1);
  EXPECT_NE(s.message().find("float16"), std::string::npos) << s.message();
  Case b;
  b.d = 136;  // backward holds only 128
  EXPECT_EQ(choose(b, KernelKind::kBackward, h200(), &s), -1);
  EXPECT_NE(s.message().find("backward"), std::string::npos) << s.message();
}

TEST(CudaDispatch, SharedMemoryBeyondTheDeviceIsUnsupportedNotAFallback) {
  Case c;
  c.d = 256;
  Status s;
  EXPECT_GE(choose(c, KernelKind::kForward, h200(), &s), 0) << s.message();
  EXPECT_EQ(choose(c, KernelKind::kForward, a100(), &s), -1);
  EXPECT_EQ(s.code(), FA_ERROR_UNSUPPORTED);
  EXPECT_NE(s.message().find("192 KiB"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("163 KiB"), std::string::npos) << s.message();
}

TEST(CudaDispatch, PreferenceOrderTakesTheFirstTileThatFitsTheDevice) {
  const KernelEntry table[] = {
      {KernelKind::kForward, FA_BFLOAT16, 256, 128, 64, 8, 2, false, 192 * 1024, "fwd_d256_double_buffered"},
      {KernelKind::kForward, FA_BFLOAT16, 256, 128, 64, 8, 1, false, 128 * 1024, "fwd_d256_single_buffered"},
  };
  Case c;
  c.d = 256;
  int index = -1;
  ASSERT_TRUE(choose_kernel(KernelKind::kForward, params_for(c), h200(), table, 2, kArchs, &index).ok());
  EXPECT_STREQ(table[index].name, "fwd_d256_double_buffered");
  ASSERT_TRUE(choose_kernel(KernelKind::kForward, params_for(c), a100(), table, 2, kArchs, &index).ok());
  EXPECT_STREQ(table[index].name, "fwd_d256_single_buffered");
  const Status s = choose_kernel(KernelKind::kForward, params_for(c), DeviceLimits{0, 8, 6, 99 * 1024}, table, 2, kArchs, &index);
  EXPECT_EQ(s.code(), FA_ERROR_UNSUPPORTED);
  EXPECT_NE(s.message().find("fwd_d256_single_buffered) needs 128 KiB"), std::string::npos) << s.message();
  // A row that needs exactly the device's opt-in limit fits.
  ASSERT_TRUE(choose_kernel(KernelKind::kForward, params_for(c), DeviceLimits{0, 9, 0, 192 * 1024}, table, 2, kArchs, &index).ok());
  EXPECT_STREQ(table[index].name, "fwd_d256_double_buffered");
}

// decode_alternative: a role's row of the general row's own kind, dtype, head dim and cache dtype, only where the
// device's shared memory holds it.
TEST(CudaDispatch, DecodeAlternativeMatchesTheRowAndTheDevice) {
  using flashattn::cuda::decode_alternative;
  KernelEntry table[] = {
      {KernelKind::kKvcache, FA_BFLOAT16, 128, 16, 64, 4, 3, false, 100 * 1024, "dec_bf16_general"},
      {KernelKind::kKvcache, FA_BFLOAT16, 128, 16, 64, 4, 3, false, 100 * 1024, "dec_bf16_fp8_general"},
      {KernelKind::kKvcache, FA_BFLOAT16, 128, 16, 128, 4, 2, false, 132 * 1024, "dec_bf16_long"},
      {KernelKind::kKvcache, FA_BFLOAT16, 128, 16, 128, 4, 2, false, 132 * 1024, "dec_bf16_fp8_long"},
  };
  table[1].fp8_cache = table[3].fp8_cache = true;
  table[2].decode_role = table[3].decode_role = DecodeRole::kLongContiguous;
  EXPECT_EQ(decode_alternative(0, DecodeRole::kLongContiguous, h200(), table, 4), 2);
  EXPECT_EQ(decode_alternative(1, DecodeRole::kLongContiguous, h200(), table, 4), 3);
  EXPECT_EQ(decode_alternative(0, DecodeRole::kLongContiguous, DeviceLimits{0, 9, 0, 132 * 1024}, table, 4), 2);
  EXPECT_EQ(decode_alternative(0, DecodeRole::kLongContiguous, DeviceLimits{0, 9, 0, 131 * 1024}, table, 4), -1);
  EXPECT_EQ(decode_alternative(0, DecodeRole::kManyWaves, h200(), table, 4), -1);
  table[3].fp8_cache = false;  // no FP8 row of the role left: none for the FP8 general row, never the 16-bit one
  EXPECT_EQ(decode_alternative(1, DecodeRole::kLongContiguous, h200(), table, 4), -1);
}

TEST(CudaDispatch, ArchitectureRules) {
  using flashattn::cuda::arch_list_runs_on;
  EXPECT_TRUE(arch_list_runs_on("80-real;90a-real", 8, 0));
  EXPECT_TRUE(arch_list_runs_on("80-real;90a-real", 8, 6));   // sm_80 code runs on 8.x
  EXPECT_TRUE(arch_list_runs_on("80-real;90a-real", 9, 0));   // the sm_90a image
  EXPECT_FALSE(arch_list_runs_on("80-real;90a-real", 10, 0)); // no image, no PTX
  EXPECT_FALSE(arch_list_runs_on("80-real;90a-real", 7, 5));
  EXPECT_FALSE(arch_list_runs_on("90a-real", 8, 0));
  EXPECT_TRUE(arch_list_runs_on("80", 10, 0));                // PTX is compiled by the driver
  EXPECT_FALSE(arch_list_runs_on("90a", 10, 0));              // arch-specific code runs on 9.0 only
  EXPECT_FALSE(arch_list_runs_on("86-real", 8, 0));           // machine code runs on its minor version and later only
  EXPECT_TRUE(arch_list_runs_on("86-real", 8, 9));
  EXPECT_TRUE(arch_list_runs_on("100f-real", 10, 3));         // family-specific code: the family's later members too
  EXPECT_FALSE(arch_list_runs_on("103f-real", 10, 0));
  EXPECT_FALSE(arch_list_runs_on("100f", 12, 0));             // ... its PTX as well, but not another major version
  EXPECT_FALSE(arch_list_runs_on("100a-real", 10, 3));
  Status s;
  Case c;
  EXPECT_EQ(choose(c, KernelKind::kForward, DeviceLimits{1, 10, 0, 227 * 1024}, &s), -1);
  EXPECT_EQ(s.code(), FA_ERROR_NOT_COMPILED);
  EXPECT_NE(s.message().find("cuda:1 is sm_100"), std::string::npos) << s.message();
}

// The generated table's choose_kernel remembers per compute capability whether the build runs there (it is asked for
// every call): asked twice per capability, it answers as the uncached rule over the build's own list does, index and
// message alike, whichever architectures this build holds.
TEST(CudaDispatch, GeneratedTableArchitectureCheckIsRemembered) {
  namespace gen = flashattn::cuda::generated;
  Case c;
  c.d = 128;
  const AttentionParams p = params_for(c);
  for (int round = 0; round < 2; ++round)
    for (const auto& cc : {std::pair<int, int>{7, 5}, {8, 0}, {8, 6}, {9, 0}, {10, 0}, {12, 0}}) {
      const DeviceLimits device{0, cc.first, cc.second, 227 * 1024};
      int cached = -1, uncached = -1;
      const Status a = choose_kernel(KernelKind::kForward, p, device, &cached);
      const Status b = choose_kernel(KernelKind::kForward, p, device, gen::kKernelTable, gen::kKernelCount,
                                     flashattn::cuda::compiled_arch_list(), &uncached);
      const std::string what = "sm_" + std::to_string(cc.first) + std::to_string(cc.second) + " round " + std::to_string(round);
      EXPECT_EQ(a.code(), b.code()) << what;
      EXPECT_EQ(a.message(), b.message()) << what;
      if (b.ok()) {
        EXPECT_EQ(cached, uncached) << what;
      }
    }
}

TEST(CudaDispatch, CudaRulesNameTheArgument) {
  using flashattn::cuda::check_forward_support;
  Case c;
  c.dtype = FA_FLOAT32;
  Status s = check_forward_support(params_for(c));
  EXPECT_EQ(s.code(), FA_ERROR_UNSUPPORTED);
  EXPECT_EQ(s.message().rfind("q: dtype float32", 0), 0u) << s.message();

  c = Case{};
  c.d = 60;
  s = check_forward_support(params_for(c));
  EXPECT_EQ(s.code(), FA_ERROR_UNSUPPORTED);
  EXPECT_EQ(s.message().rfind("q: head dim 60 must be a multiple of 8", 0), 0u) << s.message();

  c = Case{};
  c.dv = 32;
  s = check_forward_support(params_for(c));
  EXPECT_EQ(s.message().rfind("v: head dim Dv = 32 must equal", 0), 0u) << s.message();

  c = Case{};
  AttentionParams p = params_for(c);
  p.k = static_cast<const char*>(p.k) + 8;
  s = check_forward_support(p);
  EXPECT_EQ(s.code(), FA_ERROR_UNSUPPORTED);
  EXPECT_EQ(s.message().rfind("k: data pointer must be 16-byte aligned", 0), 0u) << s.message();

  p = params_for(c);
  p.out_row_stride = 4 * 64 + 4;  // 520 bytes: not a multiple of 16
  s = check_forward_support(p);
  EXPECT_EQ(s.message().rfind("out: row stride 260 elements (520 bytes) must be a multiple of 16 bytes", 0), 0u)
      << s.message();

  p = params_for(c);
  EXPECT_TRUE(check_forward_support(p).ok());

  // A stride over an extent of 1 is never used: any value passes (one query row, any row stride).
  c = Case{};
  c.sq = 1;
  p = params_for(c);
  p.q_row_stride = p.out_row_stride = 4 * 64 + 4;
  EXPECT_TRUE(check_forward_support(p).ok()) << check_forward_support(p).message();

  // The grid's y / z limit (heads, batch): 65535 passes, one more is refused by name.
  p = params_for(c);
  p.heads_q = 65535;
  EXPECT_TRUE(check_forward_support(p).ok()) << check_forward_support(p).message();
  p.heads_q = 65536;
  s = check_forward_support(p);
  EXPECT_EQ(s.code(), FA_ERROR_UNSUPPORTED);
  EXPECT_EQ(s.message().rfind("q: 65536 heads exceed the cuda backend's limit of 65535", 0), 0u) << s.message();
  p = params_for(c);
  p.batch = 65535;
  EXPECT_TRUE(check_forward_support(p).ok()) << check_forward_support(p).message();
  p.batch = 65536;
  s = check_forward_support(p);
  EXPECT_EQ(s.message().rfind("q: batch 65536 exceeds the cuda backend's limit of 65535", 0), 0u) << s.message();

  // Paged K / V: the strides that matter are those over the pool's blocks and a block's rows. One sequence (its q
  // one batch entry) still reads many blocks; a block of one row never steps a row.
  static const int32_t kTable = 0;  // never read
  c = Case{};
  c.batch = 1;
  p = params_for(c);
  p.block_table = &kTable;
  p.num_blocks = 10;
  p.page_block_size = 16;
  p.k_batch_stride = 16 * 2 * 64 + 4;
  s = check_forward_support(p);
  EXPECT_EQ(s.message().rfind("k: batch stride 2052 elements", 0), 0u) << s.message();
  p = params_for(c);
  p.block_table = &kTable;
  p.num_blocks = 10;
  p.page_block_size = 1;
  p.k_batch_stride = p.v_batch_stride = 2 * 64;
  p.k_row_stride = p.v_row_stride = 2 * 64 + 4;  // never stepped
  EXPECT_TRUE(check_forward_support(p).ok()) << check_forward_support(p).message();
}

TEST(CudaDispatch, CudaBackwardRulesNameTheArgument) {
  using flashattn::cuda::check_backward_support;
  const int b = 2, sq = 100, sk = 130, hq = 4, hk = 2, d = 64;
  fa_backward_args a{};
  a.q = device_tensor(0, {b, sq, hq, d}, FA_BFLOAT16);
  a.k = device_tensor(1, {b, sk, hk, d}, FA_BFLOAT16);
  a.v = device_tensor(2, {b, sk, hk, d}, FA_BFLOAT16);
  a.out = device_tensor(3, {b, sq, hq, d}, FA_BFLOAT16);
  a.dout = device_tensor(4, {b, sq, hq, d}, FA_BFLOAT16);
  a.lse = device_tensor(5, {b, hq, sq}, FA_FLOAT32);
  a.dq = device_tensor(6, {b, sq, hq, d}, FA_BFLOAT16);
  a.dk = device_tensor(7, {b, sk, hk, d}, FA_BFLOAT16);
  a.dv = device_tensor(8, {b, sk, hk, d}, FA_BFLOAT16);
  fa_options o;
  fa_options_init(&o);
  o.backend = FA_BACKEND_CUDA;
  flashattn::BackwardParams base;
  ASSERT_TRUE(flashattn::api::make_backward_params(a, o, &base).ok());
  EXPECT_TRUE(check_backward_support(base).ok());
  EXPECT_FALSE(base.deterministic);
  o.deterministic = 1;  // the option reaches the backward's params (its split plan)
  flashattn::BackwardParams deterministic;
  ASSERT_TRUE(flashattn::api::make_backward_params(a, o, &deterministic).ok());
  EXPECT_TRUE(deterministic.deterministic);
  struct Broken {
    const char* message;  // the start of the error
    void (*apply)(flashattn::BackwardParams&);
  };
  const Broken broken[] = {
      {"dout: data pointer must be 16-byte aligned", [](flashattn::BackwardParams& p) { p.dout = static_cast<const char*>(p.dout) + 8; }},
      {"dq: data pointer must be 16-byte aligned", [](flashattn::BackwardParams& p) { p.dq = static_cast<char*>(p.dq) + 8; }},
      {"dk: row stride 132 elements", [](flashattn::BackwardParams& p) { p.dk_row_stride = 132; }},
      {"dv: head stride 68 elements", [](flashattn::BackwardParams& p) { p.dv_head_stride = 68; }},
      {"block_table: the cuda backward does not read paged caches", [](flashattn::BackwardParams& p) {
         static const int32_t table = 0;
         p.block_table = &table;
         p.num_blocks = 1;
         p.page_block_size = 16;
       }},
  };
  for (const Broken& x : broken) {
    flashattn::BackwardParams p = base;
    x.apply(p);
    const Status s = check_backward_support(p);
    EXPECT_EQ(s.code(), FA_ERROR_UNSUPPORTED) << x.message;
    EXPECT_EQ(s.message().rfind(x.message, 0), 0u) << s.message();
  }
}

// The forward row dispatch picks for a call of shape `c` from `table` on an H200 (nullptr, and a test failure, when
// it refuses the call).
const KernelEntry* pick_forward(const Case& c, const KernelEntry* table, int count, const std::string& archs) {
  int index = -1;
  const Status s = choose_kernel(KernelKind::kForward, params_for(c), h200(), table, count, archs, &index);
  EXPECT_TRUE(s.ok()) << s.message();
  return s.ok() ? &table[index] : nullptr;
}

// The name of the row picked from the two-row `table` of a conditional-row test, for head dim d.
std::string picked_name(const KernelEntry (&table)[2], int d, int sq, int sk, bool causal) {
  Case c;
  c.d = d;
  c.sq = sq;
  c.sk = sk;
  c.causal = causal;
  const KernelEntry* e = pick_forward(c, table, 2, kArchs);
  return e != nullptr ? std::string(e->name) : std::string();
}

// The generated table's pick for a self-attention call (S = sq for queries and keys) of head dim d.
const KernelEntry* pick_generated(int d, int sq, fa_dtype dtype, bool causal, float dropout) {
  Case c;
  c.d = d;
  c.sq = c.sk = sq;
  c.dtype = dtype;
  c.causal = causal;
  c.dropout = dropout;
  namespace gen = flashattn::cuda::generated;
  return pick_forward(c, gen::kKernelTable, gen::kKernelCount, "80-real 90a-real");
}

TEST(CudaDispatch, ShortCausalRowIsTakenOnlyForShortCausalCalls) {
  KernelEntry short_causal{KernelKind::kForward, FA_BFLOAT16, 256, 64, 64, 4, 1, false, 96 * 1024, "fwd_d256_short_causal"};
  short_causal.causal_max_seqlen_q = 1024;
  const KernelEntry table[2] = {
      short_causal,
      {KernelKind::kForward, FA_BFLOAT16, 256, 64, 64, 4, 1, false, 104 * 1024, "fwd_d256_general"},
  };
  EXPECT_EQ(picked_name(table, 256, 512, 512, true), "fwd_d256_short_causal");
  EXPECT_EQ(picked_name(table, 256, 1024, 1024, true), "fwd_d256_short_causal");
  EXPECT_EQ(picked_name(table, 256, 1025, 1025, true), "fwd_d256_general");
  EXPECT_EQ(picked_name(table, 256, 512, 512, false), "fwd_d256_general");
  // The generated table: D = 256 causal at S <= 1k takes the 16-row-warp tile, else the warp pairs.
  for (fa_dtype dtype : {FA_FLOAT16, FA_BFLOAT16})
    for (int sq : {1, 512, 1024, 1025, 16384})
      for (bool causal : {false, true}) {
        const KernelEntry* e = pick_generated(256, sq, dtype, causal, 0.f);
        ASSERT_NE(e, nullptr);
        EXPECT_EQ(e->group_warps, causal && sq <= 1024 ? 1 : 2) << e->name << " S " << sq << " causal " << causal;
      }
}

TEST(CudaDispatch, ShortCallRowIsTakenOnlyForShortCalls) {
  KernelEntry short_call{KernelKind::kForward, FA_BFLOAT16, 128, 128, 64, 4, 2, false, 96 * 1024, "fwd_d128_short"};
  short_call.max_seqlen_q = 1024;
  const KernelEntry table[2] = {
      short_call,
      {KernelKind::kForward, FA_BFLOAT16, 128, 128, 64, 4, 2, false, 96 * 1024, "fwd_d128_general"},
  };
  EXPECT_EQ(picked_name(table, 128, 512, 512, false), "fwd_d128_short");
  EXPECT_EQ(picked_name(table, 128, 1024, 1024, true), "fwd_d128_short");
  EXPECT_EQ(picked_name(table, 128, 1024, 65536, false), "fwd_d128_short");  // the query rows decide, not the keys
  EXPECT_EQ(picked_name(table, 128, 1025, 1025, false), "fwd_d128_general");
  EXPECT_EQ(picked_name(table, 128, 1025, 64, true), "fwd_d128_general");
  // The generated table: D = 128 without dropout at S <= 64 takes the 64-row compact-epilogue kernel, at S <= 1k the
  // 128-row one, else the general one; with dropout always the general one.
  for (fa_dtype dtype : {FA_FLOAT16, FA_BFLOAT16})
    for (int sq : {1, 64, 65, 512, 1024, 1025, 16384})
      for (float dropout : {0.f, 0.1f}) {
        const KernelEntry* e = pick_generated(128, sq, dtype, false, dropout);
        ASSERT_NE(e, nullptr);
        const bool short_row = dropout == 0.f && sq <= 1024;
        const bool shortest_row = dropout == 0.f && sq <= 64;
        EXPECT_EQ(e->max_seqlen_q, shortest_row ? 64 : short_row ? 1024 : 0) << e->name << " S " << sq << " dropout " << dropout;
        EXPECT_EQ(e->block_m, shortest_row ? 64 : 128) << e->name << " S " << sq;
        EXPECT_EQ(std::string(e->name).find("ce") != std::string::npos, short_row) << e->name;
      }
}

TEST(CudaDispatch, PagedRowIsTakenOnlyForPagedCalls) {
  KernelEntry paged{KernelKind::kForward, FA_BFLOAT16, 128, 128, 64, 4, 2, false, 96 * 1024, "fwd_d128_paged"};
  paged.paged_kv = true;
  const KernelEntry table[2] = {
      paged,
      {KernelKind::kForward, FA_BFLOAT16, 128, 128, 64, 4, 2, false, 96 * 1024, "fwd_d128_general"},
  };
  static const int32_t kTable = 0;  // never read: dispatch looks only at whether a table is there
  auto pick = [&](const KernelEntry* rows, int count, int d, bool with_table, float dropout, fa_dtype dtype,
                  int sq = 0) -> std::string {
    Case c;
    c.d = d;
    c.dtype = dtype;
    c.dropout = dropout;
    if (sq > 0) c.sq = sq;
    AttentionParams p = params_for(c);
    if (with_table) p.block_table = &kTable;
    int index = -1;
    const Status s = choose_kernel(KernelKind::kForward, p, h200(), rows, count, kArchs, &index);
    EXPECT_TRUE(s.ok()) << s.message();
    return s.ok() ? std::string(rows[index].name) : std::string();
  };
  EXPECT_EQ(pick(table, 2, 128, true, 0.f, FA_BFLOAT16), "fwd_d128_paged");
  EXPECT_EQ(pick(table, 2, 128, false, 0.f, FA_BFLOAT16), "fwd_d128_general");
  // The generated table: every bucket without dropout has a paged row, taken by paged calls only; paged calls with
  // dropout run the general kernels. At D = 128 paged calls of at most 64 query rows take the 64-row paged row, which
  // may pack (the 128-row one may not).
  namespace gen = flashattn::cuda::generated;
  for (fa_dtype dtype : {FA_FLOAT16, FA_BFLOAT16})
    for (int d : {32, 64, 96, 128, 192, 256})
      for (float dropout : {0.f, 0.1f})
        for (bool with_table : {false, true})
          for (int sq : {1, 64, 65, 4096}) {
            const std::string name = pick(gen::kKernelTable, gen::kKernelCount, d, with_table, dropout, dtype, sq);
            const bool paged_row = name.find("pk") != std::string::npos;
            EXPECT_EQ(paged_row, with_table && dropout == 0.f) << name << " D " << d << " dropout " << dropout;
            if (!paged_row || d != 128) continue;
            const KernelEntry* e = nullptr;
            for (int r = 0; r < gen::kKernelCount; ++r)
              if (name == gen::kKernelTable[r].name) e = &gen::kKernelTable[r];
            ASSERT_NE(e, nullptr) << name;
            EXPECT_EQ(e->block_m, sq <= 64 ? 64 : 128) << name << " Sq " << sq;
            EXPECT_EQ(e->gqa_packing, sq <= 64) << name << " Sq " << sq;
            EXPECT_EQ(e->max_seqlen_q, sq <= 64 ? 64 : 0) << name << " Sq " << sq;
          }
}

// Split-KV rows (forward_split.hpp): dispatch's general pass never takes one; split_alternative offers each bucket's
// without dropout, paged for paged rows and dense for dense ones, and none for dropout rows; at D = 128 the 64-row
// split tile for calls of at most 64 query rows and the 128-row one above.
TEST(CudaDispatch, SplitRowsAreOfferedBySplitAlternativeOnly) {
  namespace gen = flashattn::cuda::generated;
  static const int32_t kBlockTable = 0;  // never read
  for (fa_dtype dtype : {FA_FLOAT16, FA_BFLOAT16})
    for (int d : {32, 64, 96, 128, 192, 256})
      for (float dropout : {0.f, 0.1f})
        for (bool paged : {false, true})
          for (int sq : {1, 64, 65, 128, 4096}) {
            Case c;
            c.dtype = dtype;
            c.d = d;
            c.dropout = dropout;
            c.sq = sq;
            AttentionParams p = params_for(c);
            if (paged) p.block_table = &kBlockTable;
            int index = -1;
            ASSERT_TRUE(choose_kernel(KernelKind::kForward, p, h200(), gen::kKernelTable, gen::kKernelCount, kArchs, &index).ok());
            const KernelEntry& e = gen::kKernelTable[index];
            EXPECT_FALSE(e.split_kv) << e.name << ": dispatch took a split row";
            const int split = flashattn::cuda::split_alternative(index, p, h200(), gen::kKernelTable, gen::kKernelCount);
            if (dropout > 0.f) {
              EXPECT_EQ(split, -1) << e.name;
              continue;
            }
            ASSERT_GE(split, 0) << e.name << ": no split row";
            const KernelEntry& s = gen::kKernelTable[split];
            EXPECT_TRUE(s.split_kv) << s.name;
            EXPECT_EQ(s.paged_kv, paged) << s.name;
            EXPECT_EQ(s.head_dim, e.head_dim) << s.name;
            EXPECT_EQ(s.dtype, e.dtype) << s.name;
            EXPECT_TRUE(s.max_seqlen_q == 0 || sq <= s.max_seqlen_q) << s.name << " Sq " << sq;
            if (d == 128) {
              EXPECT_EQ(s.block_m, sq <= 64 ? 64 : 128) << s.name << " Sq " << sq;
            }
          }
}

// The split plan: splits where the grid fills fewer than half of the CTA slots, up to one wave of slots, at least
// kMinTilesPerSplit key tiles each, never with dropout; the forced count of the test hook wins (capped).
TEST(CudaDispatch, ForwardSplitPlan) {
  namespace sm80 = flashattn::cuda::sm80;
  auto count = [](int batch, int sq, int sk, int hq, float dropout = 0.f) {
    Case c;
    c.batch = batch;
    c.sq = sq;
    c.sk = sk;
    c.hq = hq;
    c.hk = hq;
    c.d = 128;
    c.dropout = dropout;
    return sm80::forward_split_count(params_for(c), 128, 64, 132, 2);  // an H100 / H200: 132 SMs x 2 CTAs
  };
  EXPECT_EQ(count(1, 128, 32768, 32), 8);     // 32 CTAs, 264 slots
  EXPECT_EQ(count(1, 512, 32768, 32), 2);     // 128 CTAs
  EXPECT_EQ(count(1, 1024, 32768, 32), 1);    // 256 CTAs: every SM busy
  EXPECT_EQ(count(1, 16, 32768, 1), 32);      // 1 CTA: capped at kMaxForwardSplits
  EXPECT_EQ(count(1, 128, 1024, 32), 4);      // 16 key tiles: 4 per split
  EXPECT_EQ(count(1, 128, 448, 32), 1);       // 7 key tiles: too few to split
  EXPECT_EQ(count(1, 128, 449, 32), 2);       // 8 key tiles, the last one partial
  EXPECT_EQ(count(1, 128, 32768, 32, 0.1f), 1);  // dropout: no split rows
  EXPECT_EQ(count(2, 100, 130, 4), 1);
  sm80::set_forward_splits_for_tests(5);
  EXPECT_EQ(count(16, 4096, 4096, 32), 5);
  EXPECT_EQ(count(1, 128, 1024, 32, 0.1f), 1);
  sm80::set_forward_splits_for_tests(100);
  EXPECT_EQ(count(1, 128, 1024, 32), sm80::kMaxForwardSplits);
  sm80::set_forward_splits_for_tests(0);
  EXPECT_EQ(count(1, 128, 32768, 32), 8);
  // The partials: splits x B x Hq x Sq rows of Dv floats, then their LSEs, each 256-byte aligned.
  Case c;
  c.batch = 2, c.sq = 100, c.hq = 4, c.d = 64;
  const AttentionParams p = params_for(c);
  const sm80::ForwardSplitLayout layout = sm80::forward_split_layout(p, 3);
  EXPECT_EQ(layout.o_bytes, (3 * 2 * 4 * 100 * 64 * 4 + 255) / 256 * 256);
  EXPECT_EQ(layout.lse_bytes, (3 * 2 * 4 * 100 * 4 + 255) / 256 * 256);
  EXPECT_EQ(layout.total_bytes, layout.o_bytes + layout.lse_bytes);
  EXPECT_EQ(sm80::split_partial_row(p, 2, 1, 3, 99), ((2 * 2 + 1) * 4 + 3) * 100 + 99);
  // Dv != D (the CPU backends' case; the layout's own rule): rows of Dv floats
  c.dv = 32;
  const sm80::ForwardSplitLayout narrow = sm80::forward_split_layout(params_for(c), 3);
  EXPECT_EQ(narrow.o_bytes, (3 * 2 * 4 * 100 * 32 * 4 + 255) / 256 * 256);
}

// Varlen calls split by sequence (the work list): the rule the plan kernel applies to the tiles that really run, and
// the list's bounds. H100 / H200 slots: 132 SMs x 2 CTAs.
TEST(CudaDispatch, ForwardSplitWorkList) {
  namespace sm80 = flashattn::cuda::sm80;
  // the cap: one wave of slots over the unsplit CTAs, only below half the slots; forced wins, capped
  EXPECT_EQ(sm80::work_split_cap(32, 264, 0), 8);   // a chunk of 512 packed rows in 128-row tiles x 8 K/V heads
  EXPECT_EQ(sm80::work_split_cap(132, 264, 0), 2);
  EXPECT_EQ(sm80::work_split_cap(133, 264, 0), 1);  // more than half the slots
  EXPECT_EQ(sm80::work_split_cap(1, 264, 0), sm80::kMaxForwardSplits);
  EXPECT_EQ(sm80::work_split_cap(0, 264, 0), 1);    // nothing runs
  EXPECT_EQ(sm80::work_split_cap(5000, 264, 3), 3);
  EXPECT_EQ(sm80::work_split_cap(8, 264, 100), sm80::kMaxForwardSplits);
  // a sequence's share of it: at least kMinTilesPerSplit key tiles each; forced takes the cap, empty shares and all
  EXPECT_EQ(sm80::work_sequence_splits(8, 128, 0), 8);  // 8k keys in 64-key tiles
  EXPECT_EQ(sm80::work_sequence_splits(8, 20, 0), 5);
  EXPECT_EQ(sm80::work_sequence_splits(8, 7, 0), 1);    // too few keys: one split, its own out and lse
  EXPECT_EQ(sm80::work_sequence_splits(8, 0, 0), 1);
  EXPECT_EQ(sm80::work_sequence_splits(5, 1, 5), 5);
  EXPECT_EQ(sm80::work_partial_row(3, 8, 5, 128, 7), (3 * 8 + 5) * 128 + 7);
  // the shape: B x tiles items unsplit, or one wave's (slots / heads) if more; partials for that wave's only
  Case c;
  c.batch = 17, c.sq = 512, c.hq = 8, c.hk = 8, c.d = 128;  // as the packed view of 17 sequences of <= 128 rows at G = 4
  const AttentionParams p = params_for(c);
  const sm80::ForwardWorkShape shape = sm80::forward_work_shape(p, 128, 64, 132, 2, 0);
  EXPECT_EQ(shape.heads, 8);
  EXPECT_EQ(shape.slots, 264);
  EXPECT_EQ(shape.max_items, 17 * 4);
  EXPECT_EQ(shape.partial_items, 264 / 8);
  c.batch = 2;
  const sm80::ForwardWorkShape few = sm80::forward_work_shape(params_for(c), 128, 64, 132, 2, 0);
  EXPECT_EQ(few.max_items, 264 / 8);  // 8 tiles, split up to 33 items
  EXPECT_EQ(few.partial_items, 264 / 8);
  const sm80::ForwardWorkShape forced = sm80::forward_work_shape(params_for(c), 128, 64, 132, 2, 5);
  EXPECT_EQ(forced.max_items, 2 * 4 * 5);
  EXPECT_EQ(forced.partial_items, 2 * 4 * 5);
  const sm80::ForwardWorkLayout layout = sm80::forward_work_layout(params_for(c), forced);
  EXPECT_EQ(forced.max_merges, 20);  // each tile to merge has >= 2 of the 40 partial items
  EXPECT_EQ(layout.items_bytes, (40 * 16 + 255) / 256 * 256);
  EXPECT_EQ(layout.merges_bytes, 256);  // the count and 20 entries
  EXPECT_EQ(layout.o_bytes, int64_t(40) * 8 * 128 * 128 * 4);
  EXPECT_EQ(layout.lse_bytes, (40 * 8 * 128 * 4 + 255) / 256 * 256);
  EXPECT_EQ(layout.total_bytes, layout.items_bytes + layout.merges_bytes + layout.o_bytes + layout.lse_bytes);
  // A partial last query tile is a tile: 17 sequences of 513 packed rows, 5 tiles each.
  c.batch = 17, c.sq = 513;
  EXPECT_EQ(sm80::forward_work_shape(params_for(c), 128, 64, 132, 2, 0).max_items, 17 * 5);
  // The forced count is capped as the plan's is; the merge list holds its count before its entries.
  c.batch = 2, c.sq = 512;
  const sm80::ForwardWorkShape capped = sm80::forward_work_shape(params_for(c), 128, 64, 132, 2, 100);
  EXPECT_EQ(capped.forced, sm80::kMaxForwardSplits);
  EXPECT_EQ(capped.max_items, 2 * 4 * sm80::kMaxForwardSplits);
  const sm80::ForwardWorkShape sixteen = sm80::forward_work_shape(params_for(c), 128, 64, 132, 2, 16);
  ASSERT_EQ(sixteen.max_merges, 64);
  EXPECT_EQ(sm80::forward_work_layout(params_for(c), sixteen).merges_bytes, 512);  // 4 + 64 x 4 bytes, aligned
  // Dv != D: partial rows of Dv floats
  c.dv = 32;
  EXPECT_EQ(sm80::forward_work_layout(params_for(c), forced).o_bytes, int64_t(40) * 8 * 128 * 32 * 4);
}

// The list the plan kernel writes, built on the host from the same pieces (its two scans done in order): 16 decode
// tokens the decode kernels take (no tiles), a chunk of 128 rows over 8k keys and one of 40 rows over 300 keys, packed
// at G = 4 into 128-row tiles of 8 K/V heads. Every (sequence, tile) appears once per split, its splits consecutive and
// split 0 first, a sequence's last tile first; the merge list points at split 0 of each tile of >= 2 splits.
TEST(CudaDispatch, ForwardSplitWorkListItems) {
  namespace sm80 = flashattn::cuda::sm80;
  using sm80::SplitWorkItem;
  Case c;
  c.batch = 18, c.sq = 512, c.hq = 8, c.hk = 8, c.d = 128;  // the packed view's shape
  const sm80::ForwardWorkShape shape = sm80::forward_work_shape(params_for(c), 128, 64, 132, 2, 0);
  std::vector<int> m_tiles(18, 0), key_tiles(18, 1);
  m_tiles[16] = 4, key_tiles[16] = 128;  // 512 packed rows; 8192 keys in 64-key tiles
  m_tiles[17] = 2, key_tiles[17] = 5;    // 160 packed rows; 300 keys
  int64_t total = 0;
  for (int t : m_tiles) total += t;
  const int cap = sm80::work_split_cap(total * shape.heads, shape.slots, shape.forced);
  EXPECT_EQ(cap, 264 / 48);
  std::vector<SplitWorkItem> items(shape.max_items, SplitWorkItem{-1, 0, 0, 0});
  std::vector<int32_t> merges(1 + shape.max_merges, -7);
  int64_t first = 0, first_merge = 0;
  for (int b = 0; b < 18; ++b) {
    const int splits = sm80::work_sequence_splits(cap, key_tiles[b], shape.forced);
    sm80::write_sequence_work(shape, b, m_tiles[b], splits, first, first_merge, items.data(), merges.data());
    first += int64_t(m_tiles[b]) * splits;
    if (splits > 1) first_merge += m_tiles[b];
  }
  merges[0] = int32_t(first_merge);
  ASSERT_EQ(first, 4 * 5 + 2);
  ASSERT_LE(first, shape.max_items);
  for (int e = 0; e < 20; ++e) {
    const SplitWorkItem it = items[e];
    EXPECT_EQ(it.b, 16) << e;
    EXPECT_EQ(it.m_block, 3 - e / 5) << e;
    EXPECT_EQ(it.split, e % 5) << e;
    EXPECT_EQ(it.splits, 5) << e;
  }
  for (int e = 20; e < 22; ++e) {
    EXPECT_EQ(items[e].b, 17) << e;
    EXPECT_EQ(items[e].m_block, 21 - e) << e;
    EXPECT_EQ(items[e].splits, 1) << e;
  }
  EXPECT_EQ(items[22].b, -1);
  ASSERT_EQ(merges[0], 4);
  for (int m = 0; m < 4; ++m) {
    EXPECT_EQ(merges[1 + m], 5 * m) << m;
    const SplitWorkItem it = items[merges[1 + m]];
    EXPECT_EQ(it.split, 0) << m;
    EXPECT_EQ(it.splits, 5) << m;
    // its shares are the next items, partials inside the bound the scratch holds
    EXPECT_LE(merges[1 + m] + it.splits, shape.partial_items) << m;
    for (int s = 1; s < it.splits; ++s) {
      EXPECT_EQ(items[merges[1 + m] + s].m_block, it.m_block);
      EXPECT_EQ(items[merges[1 + m] + s].split, s);
    }
  }
}

// GQA packing (src/cuda/sm80/forward_packing.hpp): when a call may pack, its packed view, the row mapping, and when it
// pays; and, through the generated table, which rows short D = 128 calls run packed.
TEST(CudaDispatch, GqaPackingPlan) {
  namespace sm80 = flashattn::cuda::sm80;
  namespace gen = flashattn::cuda::generated;
  auto call = [](int batch, int sq, int sk, int hq, int hk, float dropout = 0.f) {
    Case c;
    c.batch = batch, c.sq = sq, c.sk = sk, c.hq = hq, c.hk = hk, c.d = 128, c.dropout = dropout;
    return params_for(c);
  };
  EXPECT_TRUE(sm80::gqa_packing_allowed(call(1, 16, 4096, 32, 8)));
  EXPECT_FALSE(sm80::gqa_packing_allowed(call(1, 16, 4096, 32, 32)));  // G = 1: nothing to pack
  EXPECT_FALSE(sm80::gqa_packing_allowed(call(1, 16, 4096, 32, 8, 0.1f)));  // dropout
  AttentionParams alibi = call(1, 16, 4096, 32, 8);
  static const float kSlopes[32] = {};
  alibi.alibi_slopes = kSlopes;
  EXPECT_FALSE(sm80::gqa_packing_allowed(alibi));  // a slope per query head
  EXPECT_TRUE(sm80::gqa_packing_allowed(call(1, sm80::kMaxPackedRows / 4, 64, 32, 8)));
  EXPECT_FALSE(sm80::gqa_packing_allowed(call(1, sm80::kMaxPackedRows / 4 + 1, 64, 32, 8)));

  const AttentionParams p = call(2, 24, 4096, 32, 8);
  const AttentionParams view = sm80::gqa_packed_view(p);
  EXPECT_EQ(view.seqlen_q, 96);
  EXPECT_EQ(view.heads_q, 8);
  EXPECT_EQ(view.heads_k, 8);
  EXPECT_EQ(view.pack_gqa, 1);
  EXPECT_EQ(view.q_head_stride, p.q_head_stride);  // the kernel addresses the call's own tensors
  EXPECT_EQ(view.batch, 2);
  EXPECT_EQ(sm80::gqa_pack_factor(p), 1);
  EXPECT_EQ(sm80::gqa_pack_factor(view), 1);  // the view's G is 1; the call's own params carry the factor
  AttentionParams packed = p;
  packed.pack_gqa = 1;
  EXPECT_EQ(sm80::gqa_pack_factor(packed), 4);
  // Packed row r of K/V head hk: query row r / G of query head hk G + r % G (one position's G heads, then the next).
  EXPECT_EQ(sm80::packed_query_row(0, 4), 0);
  EXPECT_EQ(sm80::packed_query_row(7, 4), 1);
  EXPECT_EQ(sm80::packed_query_head(7, 2, 4), 11);
  EXPECT_EQ(sm80::packed_query_row(7, 1), 7);

  KernelEntry m64{}, m128{};
  m64.block_m = 64, m128.block_m = 128;
  m64.gqa_packing = m128.gqa_packing = true;
  EXPECT_TRUE(sm80::gqa_packing_pays(call(1, 16, 4096, 32, 8), m64, m64));    // 1 tile against 4
  EXPECT_TRUE(sm80::gqa_packing_pays(call(1, 48, 4096, 32, 8), m64, m64));    // 3 against 4
  EXPECT_FALSE(sm80::gqa_packing_pays(call(1, 64, 4096, 32, 8), m64, m64));   // 4 and 4
  EXPECT_TRUE(sm80::gqa_packing_pays(call(1, 64, 4096, 32, 8), m64, m128));   // 2 against 4
  EXPECT_TRUE(sm80::gqa_packing_pays(call(1, 1, 4096, 32, 4), m64, m64));     // 1 against 8
  EXPECT_FALSE(sm80::gqa_packing_pays(call(1, 100, 4096, 32, 8), m128, m128));  // 4 and 4
  EXPECT_FALSE(sm80::gqa_packing_pays(call(1, 16, 4096, 32, 32), m64, m64));    // G = 1
  KernelEntry general = m128;
  general.gqa_packing = false;
  EXPECT_FALSE(sm80::gqa_packing_pays(call(1, 16, 4096, 32, 8), m64, general));  // the packed row cannot pack

  // The generated table, D = 128 bf16: a view of at most 64 packed rows takes the 64-row short-call row (which packs)
  // and, when it splits, the 64-row split row; a view of 65-512 packed rows the 128-row split row or, unsplit, the
  // 128-row packed-only row (both pack); an unpacked call of as many rows never takes the packed-only row.
  auto rows_of = [&](const AttentionParams& q, bool split) {
    int index = -1;
    EXPECT_TRUE(choose_kernel(KernelKind::kForward, q, h200(), gen::kKernelTable, gen::kKernelCount, kArchs, &index).ok());
    if (split) index = flashattn::cuda::split_alternative(index, q, h200(), gen::kKernelTable, gen::kKernelCount);
    EXPECT_GE(index, 0);
    return gen::kKernelTable[index];
  };
  for (int sq : {1, 4, 16}) {
    const AttentionParams q = call(64, sq, 4096, 32, 8);
    const AttentionParams v = sm80::gqa_packed_view(q);
    EXPECT_EQ(rows_of(v, false).block_m, 64) << sq;
    EXPECT_TRUE(rows_of(v, false).gqa_packing) << rows_of(v, false).name;
    EXPECT_TRUE(rows_of(v, true).gqa_packing && rows_of(v, true).split_kv && rows_of(v, true).block_m == 64);
    EXPECT_TRUE(sm80::gqa_packing_pays(q, rows_of(q, false), rows_of(v, false))) << sq;
    EXPECT_TRUE(sm80::gqa_packing_pays(q, rows_of(q, true), rows_of(v, true))) << sq;
  }
  const AttentionParams q32 = call(1, 32, 32768, 32, 8);
  const AttentionParams v32 = sm80::gqa_packed_view(q32);
  EXPECT_TRUE(rows_of(v32, false).gqa_packing && rows_of(v32, false).packed_only && rows_of(v32, false).block_m == 128)
      << rows_of(v32, false).name;
  EXPECT_TRUE(rows_of(v32, true).gqa_packing && rows_of(v32, true).block_m == 128);
  EXPECT_TRUE(sm80::gqa_packing_pays(q32, rows_of(q32, true), rows_of(v32, true)));  // 1 tile of 128 against 4 of 64
  EXPECT_TRUE(sm80::gqa_packing_pays(q32, rows_of(q32, false), rows_of(v32, false)));
  for (int sq : {47, 64, 128}) {  // 188 / 256 / 512 packed rows: 2 / 2 / 4 tiles of 128 against 4 / 4 / 4
    const AttentionParams q = call(16, sq, 32768, 32, 8);
    const AttentionParams v = sm80::gqa_packed_view(q);
    EXPECT_TRUE(rows_of(v, false).packed_only && !rows_of(q, false).packed_only) << sq << " " << rows_of(q, false).name;
    EXPECT_EQ(sm80::gqa_packing_pays(q, rows_of(q, false), rows_of(v, false)), sq < 128) << sq;
    AttentionParams unpacked_long = q;  // an unpacked call of as many rows as the view: the compact row
    unpacked_long.seqlen_q = v.seqlen_q;
    EXPECT_FALSE(rows_of(unpacked_long, false).packed_only || rows_of(unpacked_long, false).gqa_packing) << sq;
  }
  const AttentionParams q129 = call(16, 129, 32768, 32, 8);  // 516 packed rows: past the packed-only row
  EXPECT_FALSE(rows_of(sm80::gqa_packed_view(q129), false).gqa_packing);
  // The packed view's split count is of its own grid: Hk heads of packed tiles (B = 1, Sq = 16 at G = 4: 8 CTAs).
  const AttentionParams q16 = call(1, 16, 32768, 32, 8);
  EXPECT_EQ(sm80::forward_split_count(sm80::gqa_packed_view(q16), 64, 64, 132, 2), sm80::kMaxForwardSplits);
  EXPECT_EQ(sm80::forward_split_count(q16, 64, 64, 132, 2), 8);
  // Paged (a varlen serving step of speculative tokens, say): a view of at most 64 packed rows takes the 64-row paged
  // row, which packs; 65-512 the 128-row paged packed-only row; an unpacked paged call never takes that one.
  static const int32_t kBlockTable = 0;  // never read
  for (int sq : {5, 8, 16}) {
    AttentionParams q = call(64, sq, 4096, 32, 8);
    q.block_table = &kBlockTable;
    const AttentionParams v = sm80::gqa_packed_view(q);
    EXPECT_TRUE(rows_of(v, false).paged_kv && rows_of(v, false).gqa_packing && rows_of(v, false).block_m == 64)
        << rows_of(v, false).name;
    EXPECT_TRUE(sm80::gqa_packing_pays(q, rows_of(q, false), rows_of(v, false))) << sq;
  }
  AttentionParams paged32 = call(64, 32, 4096, 32, 8);
  paged32.block_table = &kBlockTable;
  const KernelEntry& paged_view_row = rows_of(sm80::gqa_packed_view(paged32), false);
  EXPECT_TRUE(paged_view_row.paged_kv && paged_view_row.gqa_packing && paged_view_row.packed_only &&
              paged_view_row.block_m == 128) << paged_view_row.name;
  EXPECT_TRUE(sm80::gqa_packing_pays(paged32, rows_of(paged32, false), paged_view_row));  // 1 tile against 4
  AttentionParams paged_unpacked = paged32;
  paged_unpacked.seqlen_q = 128;
  EXPECT_TRUE(rows_of(paged_unpacked, false).paged_kv && !rows_of(paged_unpacked, false).packed_only &&
              !rows_of(paged_unpacked, false).gqa_packing) << rows_of(paged_unpacked, false).name;
  AttentionParams paged129 = paged32;
  paged129.seqlen_q = 129;  // 516 packed rows: the unconditional paged row
  EXPECT_FALSE(rows_of(sm80::gqa_packed_view(paged129), false).gqa_packing);
}

TEST(CudaDispatch, GeneratedTableIsConsistent) {
  namespace gen = flashattn::cuda::generated;
  ASSERT_GT(gen::kKernelCount, 0);
  for (int r = 0; r < gen::kKernelCount; ++r) {
    const KernelEntry& e = gen::kKernelTable[r];
    EXPECT_TRUE(e.dtype == FA_FLOAT16 || e.dtype == FA_BFLOAT16) << e.name;
    EXPECT_EQ(e.head_dim % 32, 0) << e.name;
    EXPECT_EQ(e.block_n % 32, 0) << e.name;
    EXPECT_TRUE(!e.fp8_cache || e.kind == KernelKind::kKvcache) << e.name << ": FP8 caches are a kvcache feature";
    if (e.kind == KernelKind::kForward) {
      ASSERT_TRUE(e.group_warps == 1 || e.group_warps == 2) << e.name;
      EXPECT_EQ(e.block_m % (16 * e.warps / e.group_warps), 0) << e.name;
      // Q and the K / V stages; warp pairs add their P tile and the traded row statistics (forward_launch.cuh).
      const int64_t exchange = e.group_warps > 1 ? int64_t(e.block_m) * e.block_n * 2 + e.block_m * e.group_warps * 4 : 0;
      EXPECT_EQ(e.smem_bytes, int64_t(e.block_m + 2 * e.stages * e.block_n) * e.head_dim * 2 + exchange) << e.name;
    } else {
      EXPECT_EQ(e.group_warps, 1) << e.name;
      EXPECT_LE(e.smem_bytes, 227 * 1024) << e.name << " does not fit an sm_90 CTA";
    }
    EXPECT_TRUE((e.causal_max_seqlen_q == 0 && e.max_seqlen_q == 0) || e.kind == KernelKind::kForward) << e.name;
    EXPECT_TRUE(e.causal_max_seqlen_q == 0 || e.max_seqlen_q == 0) << e.name << ": one call condition per row";
    EXPECT_TRUE(!e.packed_only || (e.gqa_packing && e.max_seqlen_q > 0 && !e.split_kv)) << e.name;
    EXPECT_TRUE(!e.paged_kv || (e.kind == KernelKind::kForward && !e.dropout && e.causal_max_seqlen_q == 0))
        << e.name << ": a paged row is a forward row without dropout or a causal condition";
    if (e.paged_kv && !e.split_kv && e.max_seqlen_q > 0) {  // a paged short-call row: longer paged calls need the bucket's
      bool unconditional_paged_follows = false;            // unconditional paged row after it
      for (int s = r + 1; s < gen::kKernelCount; ++s) {
        const KernelEntry& o = gen::kKernelTable[s];
        if (o.kind == e.kind && o.dtype == e.dtype && o.head_dim == e.head_dim && o.dropout == e.dropout && o.paged_kv &&
            !o.split_kv && o.max_seqlen_q == 0)
          unconditional_paged_follows = true;
      }
      EXPECT_TRUE(unconditional_paged_follows) << e.name << ": no unconditional paged row after it";
    }
    EXPECT_TRUE(!e.split_kv || (e.kind == KernelKind::kForward && !e.dropout && e.causal_max_seqlen_q == 0))
        << e.name << ": a split row is a forward row without dropout or a causal condition";
    EXPECT_TRUE(!e.gqa_packing || (e.kind == KernelKind::kForward && !e.dropout)) << e.name << ": packing has no dropout";
    EXPECT_TRUE(!e.split_kv || e.gqa_packing) << e.name << ": every split row may pack";
    // A conditional row (short causal, short call, a decode role) is taken only for some calls: dispatch then reads on.
    EXPECT_TRUE(e.decode_role == DecodeRole::kGeneral || (e.kind == KernelKind::kKvcache && !e.fp8_cache)) << e.name;
    auto conditional = [](const KernelEntry& k) {
      return k.causal_max_seqlen_q > 0 || k.max_seqlen_q > 0 || k.decode_role != DecodeRole::kGeneral || k.paged_kv ||
             k.split_kv;
    };
    bool general_follows = false;  // a conditional row needs a general row after it (any other call)
    for (int s = 0; s < gen::kKernelCount; ++s) {
      // Several general rows of one (kind, dtype, D, dropout) are an order of preference by shared memory: a
      // later row must need less, or dispatch would never pick it. Short-causal rows come before them.
      const KernelEntry& o = gen::kKernelTable[s];
      if (s == r || o.kind != e.kind || o.dtype != e.dtype || o.head_dim != e.head_dim || o.dropout != e.dropout ||
          o.fp8_cache != e.fp8_cache)
        continue;
      if (s > r && !conditional(o)) general_follows = true;
      if (s < r && !conditional(o) && !conditional(e)) {
        EXPECT_LT(e.smem_bytes, o.smem_bytes) << e.name << " comes after " << o.name << ": dispatch would never pick it";
      }
      if (s < r && !conditional(o) && conditional(e)) {
        ADD_FAILURE() << e.name << " (conditional) comes after the general row " << o.name << ": never picked";
      }
    }
    if (conditional(e)) {
      EXPECT_TRUE(general_follows) << e.name << ": no general row after it";
    }
  }
  // Every head dim of the issue runs (in a bucket), for both dtypes, with and without dropout, on an H200.
  for (fa_dtype dtype : {FA_FLOAT16, FA_BFLOAT16})
    for (int d : {32, 64, 96, 128, 192, 256})
      for (float dropout : {0.f, 0.1f}) {
        Case c;
        c.dtype = dtype;
        c.d = d;
        c.dropout = dropout;
        int index = -1;
        const Status s = choose_kernel(KernelKind::kForward, params_for(c), h200(), gen::kKernelTable, gen::kKernelCount,
                                       "80-real 90a-real", &index);
        ASSERT_TRUE(s.ok()) << s.message();
        EXPECT_EQ(gen::kKernelTable[index].head_dim, d) << gen::kKernelTable[index].name;
        // ... and on an A100 (163 KiB of shared memory per block) too
        ASSERT_TRUE(choose_kernel(KernelKind::kForward, params_for(c), a100(), gen::kKernelTable, gen::kKernelCount,
                                  "80-real 90a-real", &index)
                        .ok());
      }
  const std::string summary = flashattn::cuda::compiled_kernels_summary();
  EXPECT_NE(summary.find("forward: "), std::string::npos) << summary;
  EXPECT_NE(summary.find("32, 64, 96, 128, 192, 256"), std::string::npos) << summary;
}

}  // namespace
