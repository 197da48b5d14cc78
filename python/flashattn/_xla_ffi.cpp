// XLA FFI handlers: attention forward and backward, and KV-cache attention (decode), as XLA custom calls (CPU and
// CUDA), for flashattn.jax. Built when CMake found the XLA FFI headers that ship inside jaxlib
// (jax.ffi.include_dir()); otherwise add_xla_ffi_targets() only records that they are absent.
//
// Operands (row-major, XLA's default layout; names as in flashattn.jax):
//   forward  q (B, Sq, Hq, D), k (B, Sk, Hk, D), v (B, Sk, Hk, Dv), alibi_slopes (B, Hq) f32,
//            rng (4) u32 = (seed lo, seed hi, offset lo, offset hi)
//            -> out (B, Sq, Hq, Dv), lse (B, Hq, Sq) f32
//   backward q, k, v, out, lse, dout, alibi_slopes, rng -> dq, dk, dv
// alibi_slopes is read only when the attribute has_alibi is set (otherwise a (0,) placeholder),
// rng only when dropout_p > 0.
//   kvcache  q (B, Sq, Hq, D), k_cache, v_cache (contiguous (B_cache, S_cache, Hk, D) or paged (num_blocks, block_size,
//            Hk, D)), k_new, v_new (B, S_new, Hk, D), cache_seqlens (B) s32, block_table (B, max_blocks) s32,
//            rotary_cos, rotary_sin (S_rotary, rotary_dim / 2), cache_batch_idx (B) s32, cache_leftpad (B) s32,
//            alibi_slopes (Hq) or (B, Hq) f32
//            -> out (B, Sq, Hq, Dv), lse (B, Hq, Sq) f32; the "append" target also -> k_cache, v_cache, which
//            flashattn.jax aliases to the k_cache and v_cache operands (input_output_aliases): the new rows are
//            written into the caches in place, and XLA copies them first only where the caller did not donate them.
//            Optional operands are (0,) placeholders unless their has_* attribute is set. No vmap.
//   kvcache_append_only  k_cache, v_cache, k_new, v_new (total_new, Hk, D), cache_seqlens (B) s32, block_table
//            (B, max_blocks) s32 or a (0,) placeholder, cu_seqlens_new (B + 1) s32 -> k_cache, v_cache (aliased as
//            above): fa_kvcache_append, the rows written without attending. No vmap.
//   varlen_forward  q (total_q, Hq, D), k, v (total_k, Hk, D / Dv) or paged (num_blocks, block_size, Hk, D / Dv),
//            cu_seqlens_q, cu_seqlens_k (B + 1) s32, seqused_k (B) s32, block_table (B, max_blocks) s32,
//            alibi_slopes (Hq) or (B, Hq) f32, rng (4) u32 -> out (total_q, Hq, Dv), lse (Hq, total_q) f32: fa_forward
//            with varlen sequences. Optional operands as above; rng read only when dropout_p > 0. No vmap.
//   varlen_backward  q, k, v (contiguous), out, lse, dout, cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng -> dq, dk,
//            dv: fa_backward with varlen sequences (no seqused_k, no block table: as fa_backward). No vmap.
//
// jax.vmap: flashattn.jax calls these with vmap_method="expand_dims", so under vmap every operand
// gains leading "vmap" dimensions, each either the full vmapped extent or 1 (not mapped: read by
// every vmap entry). The handlers loop over the vmap index and call the C ABI once per entry with
// views at that entry's offset (a batched operand) or at offset 0 (a broadcast one).
#include <nanobind/nanobind.h>

#include <cstring>
#include <string>
#include <vector>

#include "_ext_common.hpp"
#include "flashattn/flashattn.h"

namespace nb = nanobind;

#if defined(FLASHATTN_WITH_XLA_FFI)

#include "xla/ffi/api/ffi.h"

#if defined(FLASHATTN_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace ffi = xla::ffi;

namespace flashattn::python {
namespace {

constexpr int kDenseRank = 4;  // q, k, v, out, dout, dq, dk, dv
constexpr int kLseRank = 3;
constexpr int kAlibiRank = 2;
constexpr int kRngRank = 1;
constexpr int kRngWords = 4;

ffi::Error to_ffi_error(const CallError& e) {
  ffi::ErrorCode code = ffi::ErrorCode::kInternal;
  switch (e.code) {
    case FA_ERROR_INVALID_ARGUMENT: code = ffi::ErrorCode::kInvalidArgument; break;
    case FA_ERROR_UNSUPPORTED:
    case FA_ERROR_NOT_COMPILED: code = ffi::ErrorCode::kUnimplemented; break;
    case FA_ERROR_OUT_OF_MEMORY: code = ffi::ErrorCode::kResourceExhausted; break;
    default: break;
  }
  return ffi::Error(code, "flashattn: " + e.message);
}

fa_dtype to_fa_dtype(ffi::DataType t, const char* name) {
  switch (t) {
    case ffi::DataType::F32: return FA_FLOAT32;
    case ffi::DataType::F16: return FA_FLOAT16;
    case ffi::DataType::BF16: return FA_BFLOAT16;
    case ffi::DataType::U32: return FA_INT32;  // rng words: same width, read as raw bits
    case ffi::DataType::S32: return FA_INT32;  // kvcache: cache_seqlens, block_table, cache_batch_idx
    case ffi::DataType::F8E4M3FN: return FA_FLOAT8_E4M3;  // kvcache: an FP8 cache
    default:
      fail(FA_ERROR_INVALID_ARGUMENT, std::string(name) + ": dtype must be float32, float16, bfloat16, int32 or "
                                                          "float8_e4m3fn (by operand: see flashattn.jax)");
  }
}

// One operand of the custom call: `core_rank` trailing dimensions are the tensor the C ABI sees;
// the leading ones are vmap dimensions (see the file comment).
struct Operand {
  const char* name;
  char* data;
  size_t element_bytes;
  fa_dtype dtype;
  std::vector<int64_t> core_shape;
  std::vector<int64_t> vmap_extent;  // per leading dimension: the full extent or 1
  std::vector<int64_t> vmap_stride;  // in elements; 0 where the extent is 1 (broadcast)
};

Operand operand(const char* name, void* data, ffi::DataType type, ffi::Span<const int64_t> dims, int core_rank) {
  Operand o;
  o.name = name;
  o.data = static_cast<char*>(data);
  o.element_bytes = ffi::ByteWidth(type);
  o.dtype = to_fa_dtype(type, name);
  const int rank = int(dims.size());
  if (rank < core_rank)
    fail(FA_ERROR_INVALID_ARGUMENT, std::string(name) + ": expected " + std::to_string(core_rank) +
                                        " dimensions, got " + std::to_string(rank));
  const int lead = rank - core_rank;
  o.core_shape.assign(dims.begin() + lead, dims.end());
  int64_t stride = 1;
  for (int d = core_rank - 1; d >= 0; --d) stride *= o.core_shape[d];
  o.vmap_extent.assign(dims.begin(), dims.begin() + lead);
  o.vmap_stride.assign(lead, 0);
  for (int d = lead - 1; d >= 0; --d) {
    o.vmap_stride[d] = o.vmap_extent[d] == 1 ? 0 : stride;
    stride *= o.vmap_extent[d];
  }
  return o;
}

Operand operand(const char* name, const ffi::AnyBuffer& b, int core_rank) {
  return operand(name, b.untyped_data(), b.element_type(), b.dimensions(), core_rank);
}

Operand operand(const char* name, ffi::Result<ffi::AnyBuffer>& b, int core_rank) {
  return operand(name, b->untyped_data(), b->element_type(), b->dimensions(), core_rank);
}

// The vmap extents of the call: those of the first output (outputs always carry all of them).
// Every operand must agree with them dimension by dimension (or be 1 there).
std::vector<int64_t> vmap_extents(const Operand& reference, const std::vector<const Operand*>& operands) {
  for (const Operand* o : operands) {
    if (o->vmap_extent.size() != reference.vmap_extent.size())
      fail(FA_ERROR_INVALID_ARGUMENT, std::string(o->name) + ": has " + std::to_string(o->vmap_extent.size()) +
                                          " leading vmap dimensions, expected " +
                                          std::to_string(reference.vmap_extent.size()));
    for (size_t d = 0; d < o->vmap_extent.size(); ++d)
      if (o->vmap_extent[d] != 1 && o->vmap_extent[d] != reference.vmap_extent[d])
        fail(FA_ERROR_INVALID_ARGUMENT, std::string(o->name) + ": vmap dimension " + std::to_string(d) +
                                            " has extent " + std::to_string(o->vmap_extent[d]) + ", expected " +
                                            std::to_string(reference.vmap_extent[d]) + " or 1");
  }
  return reference.vmap_extent;
}

// fa_tensor of operand `o` at vmap entry `index` (multi-index over the vmap dimensions).
fa_tensor view_at(const Operand& o, const std::vector<int64_t>& index, fa_device_kind device, int device_id) {
  int64_t offset = 0;
  for (size_t d = 0; d < index.size(); ++d) offset += index[d] * o.vmap_stride[d];
  char* data = o.data + offset * int64_t(o.element_bytes);
  if (data == nullptr) data = static_cast<char*>(empty_tensor_address());  // zero-size buffers
  return fa_tensor_contiguous(data, int32_t(o.core_shape.size()), o.core_shape.data(), o.dtype, device, device_id);
}

// Calls `body(index)` for every vmap entry (once, with an empty index, outside vmap).
template <typename Body>
void for_each_vmap_entry(const std::vector<int64_t>& extents, Body body) {
  int64_t count = 1;
  for (int64_t e : extents) count *= e;
  std::vector<int64_t> index(extents.size(), 0);
  for (int64_t n = 0; n < count; ++n) {
    int64_t rest = n;
    for (int d = int(extents.size()) - 1; d >= 0; --d) {
      index[d] = rest % extents[d];
      rest /= extents[d];
    }
    body(index);
  }
}

// Reads the 4 rng words at vmap entry `index` into (seed, offset); copies from the device when
// the buffer lives there (a blocking 16-byte copy on the call's stream, only when dropout is on).
void read_rng(const Operand& rng, const std::vector<int64_t>& index, fa_device_kind device, void* stream,
              uint64_t* seed, uint64_t* offset) {
  if (rng.core_shape.size() != 1 || rng.core_shape[0] != kRngWords || rng.element_bytes != 4)
    fail(FA_ERROR_INVALID_ARGUMENT, "dropout_rng: expected 4 uint32 words (seed lo, seed hi, offset lo, offset hi)");
  const fa_tensor t = view_at(rng, index, FA_DEVICE_CPU, 0);
  uint32_t words[kRngWords];
  if (device == FA_DEVICE_CPU) {
    std::memcpy(words, t.data, sizeof(words));
  } else {
#if defined(FLASHATTN_WITH_CUDA)
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (cudaMemcpyAsync(words, t.data, sizeof(words), cudaMemcpyDeviceToHost, s) != cudaSuccess ||
        cudaStreamSynchronize(s) != cudaSuccess)
      fail(FA_ERROR_DEVICE, "dropout_rng: copying the seed words to the host failed");
#else
    fail(FA_ERROR_NOT_COMPILED, "dropout_rng: this build of the extension has no CUDA");
#endif
  }
  *seed = uint64_t(words[0]) | (uint64_t(words[1]) << 32);
  *offset = uint64_t(words[2]) | (uint64_t(words[3]) << 32);
}

struct Attrs {
  float softmax_scale;
  int32_t causal, window_left, window_right;
  float softcap, dropout_p;
  int32_t has_alibi, deterministic, backend;
};

// The options that every entry point takes from its attributes (scale, masks, softcap, backend) and its stream.
template <typename A>
CallOptions score_options(const A& a, void* stream) {
  CallOptions o;
  o.softmax_scale = a.softmax_scale;
  o.causal = a.causal != 0;
  o.window_left = a.window_left;
  o.window_right = a.window_right;
  o.softcap = a.softcap;
  o.backend = a.backend;
  o.stream = stream;
  return o;
}

fa_options options_at(const Attrs& a, const Operand& alibi, const Operand& rng, const std::vector<int64_t>& index,
                      fa_device_kind device, int device_id, void* stream) {
  CallOptions o = score_options(a, stream);
  o.dropout_p = a.dropout_p;
  if (a.dropout_p > 0.f) read_rng(rng, index, device, stream, &o.dropout_seed, &o.dropout_offset);
  o.deterministic = a.deterministic != 0;
  fa_tensor slopes;
  std::memset(&slopes, 0, sizeof(slopes));
  if (a.has_alibi) slopes = view_at(alibi, index, device, device_id);
  return to_fa_options(o, slopes, nullptr);
}

ffi::Error forward(fa_device_kind device, void* stream, int device_id, ffi::AnyBuffer q, ffi::AnyBuffer k,
                   ffi::AnyBuffer v, ffi::AnyBuffer alibi_slopes, ffi::AnyBuffer rng,
                   ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse, const Attrs& attrs) {
  try {
    const Operand o_out = operand("out", out, kDenseRank), o_lse = operand("lse", lse, kLseRank);
    const Operand o_q = operand("q", q, kDenseRank), o_k = operand("k", k, kDenseRank), o_v = operand("v", v, kDenseRank);
    const Operand o_alibi = operand("alibi_slopes", alibi_slopes, attrs.has_alibi ? kAlibiRank : 1);
    const Operand o_rng = operand("dropout_rng", rng, kRngRank);
    std::vector<const Operand*> all = {&o_q, &o_k, &o_v, &o_lse};
    if (attrs.has_alibi) all.push_back(&o_alibi);
    if (attrs.dropout_p > 0.f) all.push_back(&o_rng);
    const std::vector<int64_t> extents = vmap_extents(o_out, all);
    for_each_vmap_entry(extents, [&](const std::vector<int64_t>& index) {
      fa_forward_args args;
      std::memset(&args, 0, sizeof(args));
      args.q = view_at(o_q, index, device, device_id);
      args.k = view_at(o_k, index, device, device_id);
      args.v = view_at(o_v, index, device, device_id);
      args.out = view_at(o_out, index, device, device_id);
      args.lse = view_at(o_lse, index, device, device_id);
      const fa_options options = options_at(attrs, o_alibi, o_rng, index, device, device_id, stream);
      fa_error error{};
      check(fa_forward(&args, &options, &error), error);
    });
  } catch (const CallError& e) {
    return to_ffi_error(e);
  }
  return ffi::Error::Success();
}

ffi::Error backward(fa_device_kind device, void* stream, int device_id, ffi::AnyBuffer q, ffi::AnyBuffer k,
                    ffi::AnyBuffer v, ffi::AnyBuffer out, ffi::AnyBuffer lse, ffi::AnyBuffer dout,
                    ffi::AnyBuffer alibi_slopes, ffi::AnyBuffer rng, ffi::Result<ffi::AnyBuffer> dq,
                    ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv, const Attrs& attrs) {
  try {
    const Operand o_dq = operand("dq", dq, kDenseRank), o_dk = operand("dk", dk, kDenseRank),
                  o_dv = operand("dv", dv, kDenseRank);
    const Operand o_q = operand("q", q, kDenseRank), o_k = operand("k", k, kDenseRank), o_v = operand("v", v, kDenseRank);
    const Operand o_out = operand("out", out, kDenseRank), o_lse = operand("lse", lse, kLseRank),
                  o_dout = operand("dout", dout, kDenseRank);
    const Operand o_alibi = operand("alibi_slopes", alibi_slopes, attrs.has_alibi ? kAlibiRank : 1);
    const Operand o_rng = operand("dropout_rng", rng, kRngRank);
    std::vector<const Operand*> all = {&o_dk, &o_dv, &o_q, &o_k, &o_v, &o_out, &o_lse, &o_dout};
    if (attrs.has_alibi) all.push_back(&o_alibi);
    if (attrs.dropout_p > 0.f) all.push_back(&o_rng);
    const std::vector<int64_t> extents = vmap_extents(o_dq, all);
    for_each_vmap_entry(extents, [&](const std::vector<int64_t>& index) {
      fa_backward_args args;
      std::memset(&args, 0, sizeof(args));
      args.q = view_at(o_q, index, device, device_id);
      args.k = view_at(o_k, index, device, device_id);
      args.v = view_at(o_v, index, device, device_id);
      args.out = view_at(o_out, index, device, device_id);
      args.lse = view_at(o_lse, index, device, device_id);
      args.dout = view_at(o_dout, index, device, device_id);
      args.dq = view_at(o_dq, index, device, device_id);
      args.dk = view_at(o_dk, index, device, device_id);
      args.dv = view_at(o_dv, index, device, device_id);
      const fa_options options = options_at(attrs, o_alibi, o_rng, index, device, device_id, stream);
      fa_error error{};
      check(fa_backward(&args, &options, &error), error);
    });
  } catch (const CallError& e) {
    return to_ffi_error(e);
  }
  return ffi::Error::Success();
}

// ---- KV-cache attention ----
struct KvcacheAttrs {
  float softmax_scale;
  int32_t causal, window_left, window_right;
  float softcap;
  int32_t rotary_interleaved, num_splits;
  float k_scale, v_scale;
  int32_t has_block_table, has_rotary, has_batch_idx, has_leftpad, has_alibi, backend;
};

// The whole of operand b at `data` (the KV-cache targets run without vmap: every dimension is the tensor's).
fa_tensor whole_view(const char* name, void* data, const ffi::AnyBuffer& b, fa_device_kind device, int device_id) {
  const Operand o = operand(name, data, b.element_type(), b.dimensions(), int(b.dimensions().size()));
  return view_at(o, {}, device, device_id);
}

// One fa_kvcache call. k_cache / v_cache are the buffers the call reads and, with k_new, writes: the results of the
// append target (aliased to its cache operands), else the operands themselves (read only). The split partials'
// workspace is the library's own (stream-ordered) allocation: XLA's ffi::ScratchAllocator refused even 0.2 MB under
// jax 0.11 on the H200 machine (RESOURCE_EXHAUSTED, 2026-12-04).
ffi::Error kvcache(fa_device_kind device, void* stream, int device_id, ffi::AnyBuffer q, void* k_cache_data,
                   const ffi::AnyBuffer& k_cache, void* v_cache_data, const ffi::AnyBuffer& v_cache, ffi::AnyBuffer* k_new,
                   ffi::AnyBuffer* v_new, ffi::AnyBuffer cache_seqlens, ffi::AnyBuffer block_table,
                   ffi::AnyBuffer rotary_cos, ffi::AnyBuffer rotary_sin, ffi::AnyBuffer cache_batch_idx, ffi::AnyBuffer cache_leftpad,
                   ffi::AnyBuffer alibi_slopes, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse,
                   const KvcacheAttrs& a) {
  try {
    auto whole = [&](const char* name, void* data, const ffi::AnyBuffer& b) { return whole_view(name, data, b, device, device_id); };
    auto result = [&](const char* name, ffi::Result<ffi::AnyBuffer>& b) {
      return view_at(operand(name, b, int(b->dimensions().size())), {}, device, device_id);
    };
    fa_kvcache_args args;
    std::memset(&args, 0, sizeof(args));
    args.q = whole("q", q.untyped_data(), q);
    args.k_cache = whole("k_cache", k_cache_data, k_cache);
    args.v_cache = whole("v_cache", v_cache_data, v_cache);
    if (k_new != nullptr) {
      args.k_new = whole("k", k_new->untyped_data(), *k_new);
      args.v_new = whole("v", v_new->untyped_data(), *v_new);
    }
    args.cache_seqlens = whole("cache_seqlens", cache_seqlens.untyped_data(), cache_seqlens);
    if (a.has_block_table) args.block_table = whole("block_table", block_table.untyped_data(), block_table);
    if (a.has_rotary) {
      args.rotary_cos = whole("rotary_cos", rotary_cos.untyped_data(), rotary_cos);
      args.rotary_sin = whole("rotary_sin", rotary_sin.untyped_data(), rotary_sin);
    }
    args.rotary_interleaved = a.rotary_interleaved;
    if (a.has_batch_idx) args.cache_batch_idx = whole("cache_batch_idx", cache_batch_idx.untyped_data(), cache_batch_idx);
    if (a.has_leftpad) args.cache_leftpad = whole("cache_leftpad", cache_leftpad.untyped_data(), cache_leftpad);
    args.out = result("out", out);
    args.lse = result("lse", lse);
    args.num_splits = a.num_splits;
    args.k_scale = a.k_scale;
    args.v_scale = a.v_scale;
    const CallOptions o = score_options(a, stream);
    fa_tensor slopes;
    std::memset(&slopes, 0, sizeof(slopes));
    if (a.has_alibi) slopes = whole("alibi_slopes", alibi_slopes.untyped_data(), alibi_slopes);
    const fa_options options = to_fa_options(o, slopes, nullptr);
    fa_error error{};
    check(fa_kvcache(&args, &options, &error), error);
  } catch (const CallError& e) {
    return to_ffi_error(e);
  }
  return ffi::Error::Success();
}

KvcacheAttrs kvcache_attrs_of(float softmax_scale, int32_t causal, int32_t window_left, int32_t window_right,
                              float softcap, int32_t rotary_interleaved, int32_t num_splits, float k_scale, float v_scale,
                              int32_t has_block_table, int32_t has_rotary, int32_t has_batch_idx, int32_t has_leftpad,
                              int32_t has_alibi, int32_t backend) {
  return KvcacheAttrs{softmax_scale, causal,     window_left, window_right,  softcap,     rotary_interleaved, num_splits,
                      k_scale,       v_scale,    has_block_table, has_rotary, has_batch_idx, has_leftpad, has_alibi,
                      backend};
}

// The handlers' attribute parameters, in FA_FFI_KVCACHE_ATTRS' order.
#define FA_KVCACHE_ATTR_PARAMS                                                                                      \
  float softmax_scale, int32_t causal, int32_t window_left, int32_t window_right, float softcap,                   \
      int32_t rotary_interleaved, int32_t num_splits, float k_scale, float v_scale, int32_t has_block_table,        \
      int32_t has_rotary, int32_t has_batch_idx, int32_t has_leftpad, int32_t has_alibi, int32_t backend
#define FA_KVCACHE_ATTR_VALUES                                                                                      \
  kvcache_attrs_of(softmax_scale, causal, window_left, window_right, softcap, rotary_interleaved, num_splits,       \
                   k_scale, v_scale, has_block_table, has_rotary, has_batch_idx, has_leftpad, has_alibi, backend)

// Read only (no k / v): 2 results.
ffi::Error kvcache_read(fa_device_kind device, void* stream, int device_id, ffi::AnyBuffer q, ffi::AnyBuffer k_cache,
                        ffi::AnyBuffer v_cache, ffi::AnyBuffer cache_seqlens, ffi::AnyBuffer block_table,
                        ffi::AnyBuffer rotary_cos, ffi::AnyBuffer rotary_sin, ffi::AnyBuffer cache_batch_idx, ffi::AnyBuffer cache_leftpad,
                        ffi::AnyBuffer alibi, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse,
                        const KvcacheAttrs& a) {
  return kvcache(device, stream, device_id, q, k_cache.untyped_data(), k_cache, v_cache.untyped_data(), v_cache, nullptr,
                 nullptr, cache_seqlens, block_table, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, alibi, out, lse, a);
}

// The aliasing makes each cache result the cache operand's buffer; if XLA ever handed out another one, copy the cache
// there first (the call must see the cache's old rows). False where the sizes differ or the copy failed.
bool caches_aliased(fa_device_kind device, void* stream, const ffi::AnyBuffer& k_cache,
                    ffi::Result<ffi::AnyBuffer>& k_cache_out, const ffi::AnyBuffer& v_cache,
                    ffi::Result<ffi::AnyBuffer>& v_cache_out) {
  auto same_or_copied = [&](const ffi::AnyBuffer& in, ffi::Result<ffi::AnyBuffer>& res) -> bool {
    if (res->untyped_data() == in.untyped_data()) return true;
    if (res->size_bytes() != in.size_bytes()) return false;
    if (device == FA_DEVICE_CPU) {
      std::memcpy(res->untyped_data(), in.untyped_data(), in.size_bytes());
      return true;
    }
#if defined(FLASHATTN_WITH_CUDA)
    return cudaMemcpyAsync(res->untyped_data(), in.untyped_data(), in.size_bytes(), cudaMemcpyDeviceToDevice,
                           static_cast<cudaStream_t>(stream)) == cudaSuccess;
#else
    (void)stream;
    return false;
#endif
  };
  return same_or_copied(k_cache, k_cache_out) && same_or_copied(v_cache, v_cache_out);
}

// Append (k / v written into the caches first): 4 results, the last two the caches (aliased to k_cache, v_cache).
ffi::Error kvcache_append(fa_device_kind device, void* stream, int device_id, ffi::AnyBuffer q, ffi::AnyBuffer k_cache,
                          ffi::AnyBuffer v_cache, ffi::AnyBuffer k_new, ffi::AnyBuffer v_new, ffi::AnyBuffer cache_seqlens,
                          ffi::AnyBuffer block_table, ffi::AnyBuffer rotary_cos, ffi::AnyBuffer rotary_sin,
                          ffi::AnyBuffer cache_batch_idx, ffi::AnyBuffer cache_leftpad, ffi::AnyBuffer alibi, ffi::Result<ffi::AnyBuffer> out,
                          ffi::Result<ffi::AnyBuffer> lse, ffi::Result<ffi::AnyBuffer> k_cache_out,
                          ffi::Result<ffi::AnyBuffer> v_cache_out, const KvcacheAttrs& a) {
  if (!caches_aliased(device, stream, k_cache, k_cache_out, v_cache, v_cache_out))
    return ffi::Error(ffi::ErrorCode::kInternal, "flashattn: the updated caches must have the caches' shapes");
  return kvcache(device, stream, device_id, q, k_cache_out->untyped_data(), k_cache, v_cache_out->untyped_data(), v_cache,
                 &k_new, &v_new, cache_seqlens, block_table, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, alibi, out, lse, a);
}

// Append only (fa_kvcache_append): k_new / v_new's rows into the caches, no attention; 2 results, the caches (aliased).
ffi::Error kvcache_append_only(fa_device_kind device, void* stream, int device_id, ffi::AnyBuffer k_cache,
                               ffi::AnyBuffer v_cache, ffi::AnyBuffer k_new, ffi::AnyBuffer v_new,
                               ffi::AnyBuffer cache_seqlens, ffi::AnyBuffer block_table, ffi::AnyBuffer cu_seqlens_new,
                               ffi::Result<ffi::AnyBuffer> k_cache_out, ffi::Result<ffi::AnyBuffer> v_cache_out,
                               int32_t max_seqlen_new, int32_t check_indices, float k_scale, float v_scale,
                               int32_t has_block_table, int32_t backend) {
  if (!caches_aliased(device, stream, k_cache, k_cache_out, v_cache, v_cache_out))
    return ffi::Error(ffi::ErrorCode::kInternal, "flashattn: the updated caches must have the caches' shapes");
  try {
    auto whole = [&](const char* name, void* data, const ffi::AnyBuffer& b) { return whole_view(name, data, b, device, device_id); };
    fa_kvcache_append_args args;
    std::memset(&args, 0, sizeof(args));
    args.k_cache = whole("k_cache", k_cache_out->untyped_data(), k_cache);
    args.v_cache = whole("v_cache", v_cache_out->untyped_data(), v_cache);
    if (has_block_table) args.block_table = whole("block_table", block_table.untyped_data(), block_table);
    args.cache_seqlens = whole("cache_seqlens", cache_seqlens.untyped_data(), cache_seqlens);
    args.k_new = whole("k", k_new.untyped_data(), k_new);
    args.v_new = whole("v", v_new.untyped_data(), v_new);
    args.cu_seqlens_new = whole("cu_seqlens_new", cu_seqlens_new.untyped_data(), cu_seqlens_new);
    args.max_seqlen_new = max_seqlen_new;
    args.check_indices = check_indices;
    args.k_scale = k_scale;
    args.v_scale = v_scale;
    CallOptions o;
    o.backend = backend;
    o.stream = stream;
    const fa_options options = to_fa_options(o, fa_tensor{}, nullptr);
    fa_error error{};
    check(fa_kvcache_append(&args, &options, &error), error);
  } catch (const CallError& e) {
    return to_ffi_error(e);
  }
  return ffi::Error::Success();
}

// The append-only handlers' attribute parameters, in FA_FFI_APPEND_ONLY_ATTRS' order.
#define FA_APPEND_ONLY_ATTR_PARAMS                                                                                  \
  int32_t max_seqlen_new, int32_t check_indices, float k_scale, float v_scale, int32_t has_block_table,            \
      int32_t backend
#define FA_APPEND_ONLY_ATTR_VALUES max_seqlen_new, check_indices, k_scale, v_scale, has_block_table, backend

ffi::Error kvcache_append_only_cpu(ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache, ffi::AnyBuffer k_new,
                                   ffi::AnyBuffer v_new, ffi::AnyBuffer cache_seqlens, ffi::AnyBuffer block_table,
                                   ffi::AnyBuffer cu_seqlens_new, ffi::Result<ffi::AnyBuffer> k_cache_out,
                                   ffi::Result<ffi::AnyBuffer> v_cache_out, FA_APPEND_ONLY_ATTR_PARAMS) {
  return kvcache_append_only(FA_DEVICE_CPU, nullptr, 0, k_cache, v_cache, k_new, v_new, cache_seqlens, block_table,
                             cu_seqlens_new, k_cache_out, v_cache_out, FA_APPEND_ONLY_ATTR_VALUES);
}

#if defined(FLASHATTN_WITH_CUDA)
ffi::Error kvcache_append_only_cuda(void* stream, int32_t device_ordinal, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                                    ffi::AnyBuffer k_new, ffi::AnyBuffer v_new, ffi::AnyBuffer cache_seqlens,
                                    ffi::AnyBuffer block_table, ffi::AnyBuffer cu_seqlens_new,
                                    ffi::Result<ffi::AnyBuffer> k_cache_out, ffi::Result<ffi::AnyBuffer> v_cache_out,
                                    FA_APPEND_ONLY_ATTR_PARAMS) {
  return kvcache_append_only(FA_DEVICE_CUDA, stream, device_ordinal, k_cache, v_cache, k_new, v_new, cache_seqlens,
                             block_table, cu_seqlens_new, k_cache_out, v_cache_out, FA_APPEND_ONLY_ATTR_VALUES);
}
#endif

// ---- varlen forward (a continuous-batching step over a paged cache, or packed sequences) ----
struct VarlenAttrs {
  float softmax_scale;
  int32_t causal, window_left, window_right;
  float softcap, dropout_p;
  int32_t max_seqlen_q, max_seqlen_k, has_seqused_k, has_block_table, has_alibi, backend;
};

// The options of a varlen call (no vmap: the rng words at entry {}).
template <typename A>
fa_options varlen_options(const A& a, bool deterministic, const ffi::AnyBuffer& alibi_slopes, const ffi::AnyBuffer& rng,
                          fa_device_kind device, int device_id, void* stream) {
  CallOptions o = score_options(a, stream);
  o.dropout_p = a.dropout_p;
  if (a.dropout_p > 0.f) read_rng(operand("dropout_rng", rng, kRngRank), {}, device, stream, &o.dropout_seed, &o.dropout_offset);
  o.deterministic = deterministic;
  fa_tensor slopes;
  std::memset(&slopes, 0, sizeof(slopes));
  if (a.has_alibi) slopes = whole_view("alibi_slopes", alibi_slopes.untyped_data(), alibi_slopes, device, device_id);
  return to_fa_options(o, slopes, nullptr);
}

ffi::Error varlen_forward(fa_device_kind device, void* stream, int device_id, ffi::AnyBuffer q, ffi::AnyBuffer k,
                          ffi::AnyBuffer v, ffi::AnyBuffer cu_seqlens_q, ffi::AnyBuffer cu_seqlens_k,
                          ffi::AnyBuffer seqused_k, ffi::AnyBuffer block_table, ffi::AnyBuffer alibi_slopes,
                          ffi::AnyBuffer rng, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse,
                          const VarlenAttrs& a) {
  try {
    auto whole = [&](const char* name, const ffi::AnyBuffer& b) { return whole_view(name, b.untyped_data(), b, device, device_id); };
    auto result = [&](const char* name, ffi::Result<ffi::AnyBuffer>& b) {
      return view_at(operand(name, b, int(b->dimensions().size())), {}, device, device_id);
    };
    fa_forward_args args;
    std::memset(&args, 0, sizeof(args));
    args.q = whole("q", q);
    args.k = whole("k", k);
    args.v = whole("v", v);
    args.out = result("out", out);
    args.lse = result("lse", lse);
    args.cu_seqlens_q = whole("cu_seqlens_q", cu_seqlens_q);
    args.cu_seqlens_k = whole("cu_seqlens_k", cu_seqlens_k);
    args.max_seqlen_q = a.max_seqlen_q;
    args.max_seqlen_k = a.max_seqlen_k;
    if (a.has_seqused_k) args.seqused_k = whole("seqused_k", seqused_k);
    if (a.has_block_table) args.block_table = whole("block_table", block_table);
    const fa_options options = varlen_options(a, false, alibi_slopes, rng, device, device_id, stream);
    fa_error error{};
    check(fa_forward(&args, &options, &error), error);
  } catch (const CallError& e) {
    return to_ffi_error(e);
  }
  return ffi::Error::Success();
}

struct VarlenBackwardAttrs {
  float softmax_scale;
  int32_t causal, window_left, window_right;
  float softcap, dropout_p;
  int32_t max_seqlen_q, max_seqlen_k, has_alibi, deterministic, backend;
};

ffi::Error varlen_backward(fa_device_kind device, void* stream, int device_id, ffi::AnyBuffer q, ffi::AnyBuffer k,
                           ffi::AnyBuffer v, ffi::AnyBuffer out, ffi::AnyBuffer lse, ffi::AnyBuffer dout,
                           ffi::AnyBuffer cu_seqlens_q, ffi::AnyBuffer cu_seqlens_k, ffi::AnyBuffer alibi_slopes,
                           ffi::AnyBuffer rng, ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                           const VarlenBackwardAttrs& a) {
  try {
    auto whole = [&](const char* name, const ffi::AnyBuffer& b) { return whole_view(name, b.untyped_data(), b, device, device_id); };
    auto result = [&](const char* name, ffi::Result<ffi::AnyBuffer>& b) {
      return view_at(operand(name, b, int(b->dimensions().size())), {}, device, device_id);
    };
    fa_backward_args args;
    std::memset(&args, 0, sizeof(args));
    args.q = whole("q", q);
    args.k = whole("k", k);
    args.v = whole("v", v);
    args.out = whole("out", out);
    args.lse = whole("lse", lse);
    args.dout = whole("dout", dout);
    args.dq = result("dq", dq);
    args.dk = result("dk", dk);
    args.dv = result("dv", dv);
    args.cu_seqlens_q = whole("cu_seqlens_q", cu_seqlens_q);
    args.cu_seqlens_k = whole("cu_seqlens_k", cu_seqlens_k);
    args.max_seqlen_q = a.max_seqlen_q;
    args.max_seqlen_k = a.max_seqlen_k;
    const fa_options options = varlen_options(a, a.deterministic != 0, alibi_slopes, rng, device, device_id, stream);
    fa_error error{};
    check(fa_backward(&args, &options, &error), error);
  } catch (const CallError& e) {
    return to_ffi_error(e);
  }
  return ffi::Error::Success();
}

// The varlen handlers' operand and attribute parameters, in FA_FFI_VARLEN_FORWARD_OPERANDS' / _ATTRS' order.
#define FA_VARLEN_PARAMS                                                                                            \
  ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer cu_seqlens_q, ffi::AnyBuffer cu_seqlens_k,  \
      ffi::AnyBuffer seqused_k, ffi::AnyBuffer block_table, ffi::AnyBuffer alibi, ffi::AnyBuffer rng,               \
      ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse, float softmax_scale, int32_t causal,        \
      int32_t window_left, int32_t window_right, float softcap, float dropout_p, int32_t max_seqlen_q,              \
      int32_t max_seqlen_k, int32_t has_seqused_k, int32_t has_block_table, int32_t has_alibi, int32_t backend
#define FA_VARLEN_VALUES                                                                                            \
  q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, alibi, rng, out, lse,                                \
      VarlenAttrs{softmax_scale, causal,       window_left,   window_right,    softcap,  dropout_p,                 \
                  max_seqlen_q,  max_seqlen_k, has_seqused_k, has_block_table, has_alibi, backend}

// ... and FA_FFI_VARLEN_BACKWARD_OPERANDS' / _ATTRS' order.
#define FA_VARLEN_BACKWARD_PARAMS                                                                                   \
  ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer out, ffi::AnyBuffer lse, ffi::AnyBuffer dout, \
      ffi::AnyBuffer cu_seqlens_q, ffi::AnyBuffer cu_seqlens_k, ffi::AnyBuffer alibi, ffi::AnyBuffer rng,            \
      ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,               \
      float softmax_scale, int32_t causal, int32_t window_left, int32_t window_right, float softcap, float dropout_p, \
      int32_t max_seqlen_q, int32_t max_seqlen_k, int32_t has_alibi, int32_t deterministic, int32_t backend
#define FA_VARLEN_BACKWARD_VALUES                                                                                   \
  q, k, v, out, lse, dout, cu_seqlens_q, cu_seqlens_k, alibi, rng, dq, dk, dv,                                      \
      VarlenBackwardAttrs{softmax_scale, causal,       window_left, window_right,  softcap, dropout_p,              \
                          max_seqlen_q,  max_seqlen_k, has_alibi,   deterministic, backend}

ffi::Error varlen_forward_cpu(FA_VARLEN_PARAMS) { return varlen_forward(FA_DEVICE_CPU, nullptr, 0, FA_VARLEN_VALUES); }
ffi::Error varlen_backward_cpu(FA_VARLEN_BACKWARD_PARAMS) {
  return varlen_backward(FA_DEVICE_CPU, nullptr, 0, FA_VARLEN_BACKWARD_VALUES);
}

#if defined(FLASHATTN_WITH_CUDA)
ffi::Error varlen_forward_cuda(void* stream, int32_t device_ordinal, FA_VARLEN_PARAMS) {
  return varlen_forward(FA_DEVICE_CUDA, stream, device_ordinal, FA_VARLEN_VALUES);
}
ffi::Error varlen_backward_cuda(void* stream, int32_t device_ordinal, FA_VARLEN_BACKWARD_PARAMS) {
  return varlen_backward(FA_DEVICE_CUDA, stream, device_ordinal, FA_VARLEN_BACKWARD_VALUES);
}
#endif

ffi::Error kvcache_read_cpu(ffi::AnyBuffer q, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache, ffi::AnyBuffer cache_seqlens,
                            ffi::AnyBuffer block_table, ffi::AnyBuffer rotary_cos, ffi::AnyBuffer rotary_sin,
                            ffi::AnyBuffer cache_batch_idx, ffi::AnyBuffer cache_leftpad, ffi::AnyBuffer alibi, ffi::Result<ffi::AnyBuffer> out,
                            ffi::Result<ffi::AnyBuffer> lse, FA_KVCACHE_ATTR_PARAMS) {
  return kvcache_read(FA_DEVICE_CPU, nullptr, 0, q, k_cache, v_cache, cache_seqlens, block_table, rotary_cos, rotary_sin,
                      cache_batch_idx, cache_leftpad, alibi, out, lse, FA_KVCACHE_ATTR_VALUES);
}

ffi::Error kvcache_append_cpu(ffi::AnyBuffer q, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache, ffi::AnyBuffer k_new,
                              ffi::AnyBuffer v_new, ffi::AnyBuffer cache_seqlens, ffi::AnyBuffer block_table,
                              ffi::AnyBuffer rotary_cos, ffi::AnyBuffer rotary_sin, ffi::AnyBuffer cache_batch_idx, ffi::AnyBuffer cache_leftpad,
                              ffi::AnyBuffer alibi, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse,
                              ffi::Result<ffi::AnyBuffer> k_cache_out, ffi::Result<ffi::AnyBuffer> v_cache_out,
                              FA_KVCACHE_ATTR_PARAMS) {
  return kvcache_append(FA_DEVICE_CPU, nullptr, 0, q, k_cache, v_cache, k_new, v_new, cache_seqlens, block_table,
                        rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, alibi, out, lse, k_cache_out, v_cache_out,
                        FA_KVCACHE_ATTR_VALUES);
}

#if defined(FLASHATTN_WITH_CUDA)
ffi::Error kvcache_read_cuda(void* stream, int32_t device_ordinal, ffi::AnyBuffer q, ffi::AnyBuffer k_cache,
                             ffi::AnyBuffer v_cache, ffi::AnyBuffer cache_seqlens, ffi::AnyBuffer block_table,
                             ffi::AnyBuffer rotary_cos, ffi::AnyBuffer rotary_sin, ffi::AnyBuffer cache_batch_idx, ffi::AnyBuffer cache_leftpad,
                             ffi::AnyBuffer alibi, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse,
                             FA_KVCACHE_ATTR_PARAMS) {
  return kvcache_read(FA_DEVICE_CUDA, stream, device_ordinal, q, k_cache, v_cache, cache_seqlens, block_table, rotary_cos,
                      rotary_sin, cache_batch_idx, cache_leftpad, alibi, out, lse, FA_KVCACHE_ATTR_VALUES);
}

ffi::Error kvcache_append_cuda(void* stream, int32_t device_ordinal, ffi::AnyBuffer q, ffi::AnyBuffer k_cache,
                               ffi::AnyBuffer v_cache, ffi::AnyBuffer k_new, ffi::AnyBuffer v_new,
                               ffi::AnyBuffer cache_seqlens, ffi::AnyBuffer block_table, ffi::AnyBuffer rotary_cos,
                               ffi::AnyBuffer rotary_sin, ffi::AnyBuffer cache_batch_idx, ffi::AnyBuffer cache_leftpad, ffi::AnyBuffer alibi,
                               ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse,
                               ffi::Result<ffi::AnyBuffer> k_cache_out, ffi::Result<ffi::AnyBuffer> v_cache_out,
                               FA_KVCACHE_ATTR_PARAMS) {
  return kvcache_append(FA_DEVICE_CUDA, stream, device_ordinal, q, k_cache, v_cache, k_new, v_new, cache_seqlens,
                        block_table, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, alibi, out, lse, k_cache_out, v_cache_out,
                        FA_KVCACHE_ATTR_VALUES);
}
#endif

// ---- bindings: one CPU and one CUDA handler per entry point ----

Attrs attrs_of(float softmax_scale, int32_t causal, int32_t window_left, int32_t window_right, float softcap,
               float dropout_p, int32_t has_alibi, int32_t deterministic, int32_t backend) {
  return Attrs{softmax_scale, causal, window_left, window_right, softcap, dropout_p, has_alibi, deterministic, backend};
}

ffi::Error forward_cpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer alibi, ffi::AnyBuffer rng,
                       ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse, float softmax_scale,
                       int32_t causal, int32_t window_left, int32_t window_right, float softcap, float dropout_p,
                       int32_t has_alibi, int32_t backend) {
  return forward(FA_DEVICE_CPU, nullptr, 0, q, k, v, alibi, rng, out, lse,
                 attrs_of(softmax_scale, causal, window_left, window_right, softcap, dropout_p, has_alibi, 0, backend));
}

ffi::Error backward_cpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer out, ffi::AnyBuffer lse,
                        ffi::AnyBuffer dout, ffi::AnyBuffer alibi, ffi::AnyBuffer rng, ffi::Result<ffi::AnyBuffer> dq,
                        ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv, float softmax_scale,
                        int32_t causal, int32_t window_left, int32_t window_right, float softcap, float dropout_p,
                        int32_t has_alibi, int32_t deterministic, int32_t backend) {
  return backward(FA_DEVICE_CPU, nullptr, 0, q, k, v, out, lse, dout, alibi, rng, dq, dk, dv,
                  attrs_of(softmax_scale, causal, window_left, window_right, softcap, dropout_p, has_alibi,
                           deterministic, backend));
}

#if defined(FLASHATTN_WITH_CUDA)
ffi::Error forward_cuda(void* stream, int32_t device_ordinal, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                        ffi::AnyBuffer alibi, ffi::AnyBuffer rng, ffi::Result<ffi::AnyBuffer> out,
                        ffi::Result<ffi::AnyBuffer> lse, float softmax_scale, int32_t causal, int32_t window_left,
                        int32_t window_right, float softcap, float dropout_p, int32_t has_alibi, int32_t backend) {
  return forward(FA_DEVICE_CUDA, stream, device_ordinal, q, k, v, alibi, rng, out, lse,
                 attrs_of(softmax_scale, causal, window_left, window_right, softcap, dropout_p, has_alibi, 0, backend));
}

ffi::Error backward_cuda(void* stream, int32_t device_ordinal, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                         ffi::AnyBuffer out, ffi::AnyBuffer lse, ffi::AnyBuffer dout, ffi::AnyBuffer alibi,
                         ffi::AnyBuffer rng, ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                         ffi::Result<ffi::AnyBuffer> dv, float softmax_scale, int32_t causal, int32_t window_left,
                         int32_t window_right, float softcap, float dropout_p, int32_t has_alibi,
                         int32_t deterministic, int32_t backend) {
  return backward(FA_DEVICE_CUDA, stream, device_ordinal, q, k, v, out, lse, dout, alibi, rng, dq, dk, dv,
                  attrs_of(softmax_scale, causal, window_left, window_right, softcap, dropout_p, has_alibi,
                           deterministic, backend));
}
#endif

}  // namespace
}  // namespace flashattn::python

// The attribute names are the keyword arguments flashattn.jax passes to jax.ffi.ffi_call.
#define FA_FFI_FORWARD_OPERANDS                                                                        \
  .Arg<ffi::AnyBuffer>() /* q */.Arg<ffi::AnyBuffer>() /* k */.Arg<ffi::AnyBuffer>() /* v */           \
      .Arg<ffi::AnyBuffer>() /* alibi_slopes */.Arg<ffi::AnyBuffer>() /* rng */                        \
      .Ret<ffi::AnyBuffer>() /* out */.Ret<ffi::AnyBuffer>() /* lse */
#define FA_FFI_BACKWARD_OPERANDS                                                                       \
  .Arg<ffi::AnyBuffer>() /* q */.Arg<ffi::AnyBuffer>() /* k */.Arg<ffi::AnyBuffer>() /* v */           \
      .Arg<ffi::AnyBuffer>() /* out */.Arg<ffi::AnyBuffer>() /* lse */.Arg<ffi::AnyBuffer>() /* dout */ \
      .Arg<ffi::AnyBuffer>() /* alibi_slopes */.Arg<ffi::AnyBuffer>() /* rng */                        \
      .Ret<ffi::AnyBuffer>() /* dq */.Ret<ffi::AnyBuffer>() /* dk */.Ret<ffi::AnyBuffer>() /* dv */
#define FA_FFI_KVCACHE_LEAD_OPERANDS                                                                   \
  .Arg<ffi::AnyBuffer>() /* q */.Arg<ffi::AnyBuffer>() /* k_cache */.Arg<ffi::AnyBuffer>() /* v_cache */
#define FA_FFI_KVCACHE_TAIL_OPERANDS                                                                   \
  .Arg<ffi::AnyBuffer>() /* cache_seqlens */.Arg<ffi::AnyBuffer>() /* block_table */                   \
      .Arg<ffi::AnyBuffer>() /* rotary_cos */.Arg<ffi::AnyBuffer>() /* rotary_sin */                   \
      .Arg<ffi::AnyBuffer>() /* cache_batch_idx */.Arg<ffi::AnyBuffer>() /* cache_leftpad */           \
      .Arg<ffi::AnyBuffer>() /* alibi_slopes */                                                        \
      .Ret<ffi::AnyBuffer>() /* out */.Ret<ffi::AnyBuffer>() /* lse */
#define FA_FFI_KVCACHE_READ_OPERANDS FA_FFI_KVCACHE_LEAD_OPERANDS FA_FFI_KVCACHE_TAIL_OPERANDS
#define FA_FFI_KVCACHE_APPEND_OPERANDS                                                                 \
  FA_FFI_KVCACHE_LEAD_OPERANDS.Arg<ffi::AnyBuffer>() /* k */.Arg<ffi::AnyBuffer>() /* v */             \
      FA_FFI_KVCACHE_TAIL_OPERANDS.Ret<ffi::AnyBuffer>() /* k_cache */.Ret<ffi::AnyBuffer>() /* v_cache */
#define FA_FFI_KVCACHE_ATTRS                                                                           \
  .Attr<float>("softmax_scale").Attr<int32_t>("causal").Attr<int32_t>("window_left")                   \
      .Attr<int32_t>("window_right").Attr<float>("softcap").Attr<int32_t>("rotary_interleaved")        \
      .Attr<int32_t>("num_splits").Attr<float>("k_scale").Attr<float>("v_scale")                       \
      .Attr<int32_t>("has_block_table").Attr<int32_t>("has_rotary").Attr<int32_t>("has_batch_idx")     \
      .Attr<int32_t>("has_leftpad").Attr<int32_t>("has_alibi").Attr<int32_t>("backend")
#define FA_FFI_APPEND_ONLY_OPERANDS                                                                    \
  .Arg<ffi::AnyBuffer>() /* k_cache */.Arg<ffi::AnyBuffer>() /* v_cache */.Arg<ffi::AnyBuffer>() /* k */ \
      .Arg<ffi::AnyBuffer>() /* v */.Arg<ffi::AnyBuffer>() /* cache_seqlens */                         \
      .Arg<ffi::AnyBuffer>() /* block_table */.Arg<ffi::AnyBuffer>() /* cu_seqlens_new */              \
      .Ret<ffi::AnyBuffer>() /* k_cache */.Ret<ffi::AnyBuffer>() /* v_cache */
#define FA_FFI_APPEND_ONLY_ATTRS                                                                       \
  .Attr<int32_t>("max_seqlen_new").Attr<int32_t>("check_indices").Attr<float>("k_scale")               \
      .Attr<float>("v_scale").Attr<int32_t>("has_block_table").Attr<int32_t>("backend")
#define FA_FFI_COMMON_ATTRS                                                                            \
  .Attr<float>("softmax_scale").Attr<int32_t>("causal").Attr<int32_t>("window_left")                   \
      .Attr<int32_t>("window_right").Attr<float>("softcap").Attr<float>("dropout_p")                   \
      .Attr<int32_t>("has_alibi")

#define FA_FFI_VARLEN_FORWARD_OPERANDS                                                                 \
  .Arg<ffi::AnyBuffer>() /* q */.Arg<ffi::AnyBuffer>() /* k */.Arg<ffi::AnyBuffer>() /* v */           \
      .Arg<ffi::AnyBuffer>() /* cu_seqlens_q */.Arg<ffi::AnyBuffer>() /* cu_seqlens_k */               \
      .Arg<ffi::AnyBuffer>() /* seqused_k */.Arg<ffi::AnyBuffer>() /* block_table */                   \
      .Arg<ffi::AnyBuffer>() /* alibi_slopes */.Arg<ffi::AnyBuffer>() /* rng */                        \
      .Ret<ffi::AnyBuffer>() /* out */.Ret<ffi::AnyBuffer>() /* lse */
#define FA_FFI_VARLEN_FORWARD_ATTRS                                                                    \
  .Attr<float>("softmax_scale").Attr<int32_t>("causal").Attr<int32_t>("window_left")                   \
      .Attr<int32_t>("window_right").Attr<float>("softcap").Attr<float>("dropout_p")                   \
      .Attr<int32_t>("max_seqlen_q").Attr<int32_t>("max_seqlen_k").Attr<int32_t>("has_seqused_k")      \
      .Attr<int32_t>("has_block_table").Attr<int32_t>("has_alibi").Attr<int32_t>("backend")

#define FA_FFI_VARLEN_BACKWARD_OPERANDS                                                                \
  .Arg<ffi::AnyBuffer>() /* q */.Arg<ffi::AnyBuffer>() /* k */.Arg<ffi::AnyBuffer>() /* v */           \
      .Arg<ffi::AnyBuffer>() /* out */.Arg<ffi::AnyBuffer>() /* lse */.Arg<ffi::AnyBuffer>() /* dout */ \
      .Arg<ffi::AnyBuffer>() /* cu_seqlens_q */.Arg<ffi::AnyBuffer>() /* cu_seqlens_k */               \
      .Arg<ffi::AnyBuffer>() /* alibi_slopes */.Arg<ffi::AnyBuffer>() /* rng */                        \
      .Ret<ffi::AnyBuffer>() /* dq */.Ret<ffi::AnyBuffer>() /* dk */.Ret<ffi::AnyBuffer>() /* dv */
#define FA_FFI_VARLEN_BACKWARD_ATTRS                                                                   \
  .Attr<float>("softmax_scale").Attr<int32_t>("causal").Attr<int32_t>("window_left")                   \
      .Attr<int32_t>("window_right").Attr<float>("softcap").Attr<float>("dropout_p")                   \
      .Attr<int32_t>("max_seqlen_q").Attr<int32_t>("max_seqlen_k").Attr<int32_t>("has_alibi")          \
      .Attr<int32_t>("deterministic").Attr<int32_t>("backend")

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashattnVarlenForwardCpu, flashattn::python::varlen_forward_cpu,
                              ffi::Ffi::Bind() FA_FFI_VARLEN_FORWARD_OPERANDS FA_FFI_VARLEN_FORWARD_ATTRS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashattnVarlenBackwardCpu, flashattn::python::varlen_backward_cpu,
                              ffi::Ffi::Bind() FA_FFI_VARLEN_BACKWARD_OPERANDS FA_FFI_VARLEN_BACKWARD_ATTRS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashattnForwardCpu, flashattn::python::forward_cpu,
                              ffi::Ffi::Bind() FA_FFI_FORWARD_OPERANDS FA_FFI_COMMON_ATTRS.Attr<int32_t>("backend"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashattnBackwardCpu, flashattn::python::backward_cpu,
                              ffi::Ffi::Bind() FA_FFI_BACKWARD_OPERANDS FA_FFI_COMMON_ATTRS
                                  .Attr<int32_t>("deterministic")
                                  .Attr<int32_t>("backend"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashattnKvcacheCpu, flashattn::python::kvcache_read_cpu,
                              ffi::Ffi::Bind() FA_FFI_KVCACHE_READ_OPERANDS FA_FFI_KVCACHE_ATTRS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashattnKvcacheAppendCpu, flashattn::python::kvcache_append_cpu,
                              ffi::Ffi::Bind() FA_FFI_KVCACHE_APPEND_OPERANDS FA_FFI_KVCACHE_ATTRS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashattnKvcacheAppendOnlyCpu, flashattn::python::kvcache_append_only_cpu,
                              ffi::Ffi::Bind() FA_FFI_APPEND_ONLY_OPERANDS FA_FFI_APPEND_ONLY_ATTRS);
#if defined(FLASHATTN_WITH_CUDA)
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashattnVarlenForwardCuda, flashattn::python::varlen_forward_cuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .Ctx<ffi::DeviceOrdinal>() FA_FFI_VARLEN_FORWARD_OPERANDS FA_FFI_VARLEN_FORWARD_ATTRS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashattnVarlenBackwardCuda, flashattn::python::varlen_backward_cuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .Ctx<ffi::DeviceOrdinal>() FA_FFI_VARLEN_BACKWARD_OPERANDS FA_FFI_VARLEN_BACKWARD_ATTRS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashattnKvcacheAppendOnlyCuda, flashattn::python::kvcache_append_only_cuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .Ctx<ffi::DeviceOrdinal>() FA_FFI_APPEND_ONLY_OPERANDS FA_FFI_APPEND_ONLY_ATTRS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashattnKvcacheCuda, flashattn::python::kvcache_read_cuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .Ctx<ffi::DeviceOrdinal>() FA_FFI_KVCACHE_READ_OPERANDS FA_FFI_KVCACHE_ATTRS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashattnKvcacheAppendCuda, flashattn::python::kvcache_append_cuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .Ctx<ffi::DeviceOrdinal>() FA_FFI_KVCACHE_APPEND_OPERANDS FA_FFI_KVCACHE_ATTRS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashattnForwardCuda, flashattn::python::forward_cuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .Ctx<ffi::DeviceOrdinal>() FA_FFI_FORWARD_OPERANDS FA_FFI_COMMON_ATTRS
                                  .Attr<int32_t>("backend"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashattnBackwardCuda, flashattn::python::backward_cuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .Ctx<ffi::DeviceOrdinal>() FA_FFI_BACKWARD_OPERANDS FA_FFI_COMMON_ATTRS
                                  .Attr<int32_t>("deterministic")
                                  .Attr<int32_t>("backend"));
#endif

namespace flashattn::python {

nb::object handler_capsule(XLA_FFI_Handler* handler) {
  // jax.ffi.register_ffi_target takes a PyCapsule holding the handler's address (no name).
  return nb::steal(PyCapsule_New(reinterpret_cast<void*>(handler), nullptr, nullptr));
}

void add_xla_ffi_targets(nb::module_& m) {
  nb::dict targets;
  nb::dict forward, backward, kvcache, kvcache_append, kvcache_append_only, varlen_forward, varlen_backward;
  forward["cpu"] = handler_capsule(FlashattnForwardCpu);
  backward["cpu"] = handler_capsule(FlashattnBackwardCpu);
  kvcache["cpu"] = handler_capsule(FlashattnKvcacheCpu);
  kvcache_append["cpu"] = handler_capsule(FlashattnKvcacheAppendCpu);
  kvcache_append_only["cpu"] = handler_capsule(FlashattnKvcacheAppendOnlyCpu);
  varlen_forward["cpu"] = handler_capsule(FlashattnVarlenForwardCpu);
  varlen_backward["cpu"] = handler_capsule(FlashattnVarlenBackwardCpu);
#if defined(FLASHATTN_WITH_CUDA)
  forward["CUDA"] = handler_capsule(FlashattnForwardCuda);
  backward["CUDA"] = handler_capsule(FlashattnBackwardCuda);
  kvcache["CUDA"] = handler_capsule(FlashattnKvcacheCuda);
  kvcache_append["CUDA"] = handler_capsule(FlashattnKvcacheAppendCuda);
  kvcache_append_only["CUDA"] = handler_capsule(FlashattnKvcacheAppendOnlyCuda);
  varlen_forward["CUDA"] = handler_capsule(FlashattnVarlenForwardCuda);
  varlen_backward["CUDA"] = handler_capsule(FlashattnVarlenBackwardCuda);
#endif
  targets["flashattn_forward"] = forward;
  targets["flashattn_backward"] = backward;
  targets["flashattn_kvcache"] = kvcache;
  targets["flashattn_kvcache_append"] = kvcache_append;
  targets["flashattn_kvcache_append_only"] = kvcache_append_only;
  targets["flashattn_varlen_forward"] = varlen_forward;
  targets["flashattn_varlen_backward"] = varlen_backward;
  m.attr("xla_ffi_targets") = targets;
  m.attr("has_xla_ffi") = true;
}

}  // namespace flashattn::python

#else  // !FLASHATTN_WITH_XLA_FFI

namespace flashattn::python {
void add_xla_ffi_targets(nb::module_& m) {
  m.attr("xla_ffi_targets") = nb::dict();
  m.attr("has_xla_ffi") = false;
}
}  // namespace flashattn::python

#endif
