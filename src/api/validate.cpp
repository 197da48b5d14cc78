#include "api/validate.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <string>
#include <utility>
#include <vector>
#include <thread>

#include "core/dtype.hpp"

namespace flashattn::api {
namespace {

constexpr int kMaxHeadDim = 1024;  // a sanity bound for every backend; CUDA compiles fewer
constexpr int64_t kMaxInt32 = std::numeric_limits<int32_t>::max();
// The largest extent of batch, rows and heads (flashattn.h): the backends count rows in int32 and step
// past the last one by a tile (at most 2^20 rows), which must not overflow. (At 2^31 - 48 keys the CPU
// backend's key loop wrapped to negative rows and read outside k.)
constexpr int64_t kMaxExtent = (int64_t(1) << 31) - (int64_t(1) << 20);

// The integer in a C enum field, read without an enum-typed load: a caller may pass any int there,
// and loading a value outside the enumerators as the enum type is undefined behaviour in C++.
template <typename Enum>
int raw_enum(const Enum& field) {
  std::underlying_type_t<Enum> value;
  std::memcpy(&value, &field, sizeof(value));
  return int(value);
}

const char* device_name(fa_device_kind d) { return d == FA_DEVICE_CUDA ? "cuda" : "cpu"; }

// A named tensor argument, so that every message starts with the argument it is about.
struct Arg {
  const char* name;
  const fa_tensor& t;
  bool present() const { return t.data != nullptr; }
};

#define FA_INVALID(...) ::flashattn::error(FA_ERROR_INVALID_ARGUMENT, __VA_ARGS__)

Status check_basic(const Arg& a) {
  if (!a.present()) return FA_INVALID("%s: required tensor is missing (data is NULL)", a.name);
  if (a.t.ndim < 0 || a.t.ndim > FA_MAX_DIMS)
    return FA_INVALID("%s: ndim must be in [0, %d], got %d", a.name, FA_MAX_DIMS, a.t.ndim);
  for (int d = 0; d < a.t.ndim; ++d) {
    if (a.t.shape[d] < 0) return FA_INVALID("%s: dimension %d has negative extent %lld", a.name, d, (long long)a.t.shape[d]);
    if (a.t.strides[d] < 0)
      return FA_INVALID("%s: stride of dimension %d must be non-negative, got %lld", a.name, d, (long long)a.t.strides[d]);
  }
  if (a.t.ndim > 0 && a.t.shape[a.t.ndim - 1] > 1 && a.t.strides[a.t.ndim - 1] != 1)
    return FA_INVALID("%s: last dimension must be contiguous (stride 1), got stride %lld", a.name,
                      (long long)a.t.strides[a.t.ndim - 1]);
  const int device = raw_enum(a.t.device), dtype = raw_enum(a.t.dtype);
  if (device != FA_DEVICE_CPU && device != FA_DEVICE_CUDA) return FA_INVALID("%s: unknown device kind %d", a.name, device);
  // DLPack's convention: a host tensor has device_id 0; a CUDA one a device ordinal (>= 0).
  if (device == FA_DEVICE_CPU && a.t.device_id != 0)
    return FA_INVALID("%s: device_id of a cpu tensor must be 0, got %d", a.name, a.t.device_id);
  if (device == FA_DEVICE_CUDA && a.t.device_id < 0)
    return FA_INVALID("%s: device_id of a cuda tensor must be >= 0, got %d", a.name, a.t.device_id);
  if (dtype < FA_FLOAT32 || dtype > FA_FLOAT8_E4M3) return FA_INVALID("%s: unknown dtype %d", a.name, dtype);
  return Status();
}

Status check_ndim(const Arg& a, int ndim, const char* layout) {
  if (a.t.ndim != ndim) return FA_INVALID("%s: expected %d dimensions %s, got %d", a.name, ndim, layout, a.t.ndim);
  return Status();
}

Status check_dtype(const Arg& a, fa_dtype dtype, const char* why) {
  if (a.t.dtype != dtype)
    return FA_INVALID("%s: dtype must be %s (%s), got %s", a.name, dtype_name(dtype), why, dtype_name(a.t.dtype));
  return Status();
}

Status check_same_device(const Arg& a, const Arg& ref) {
  if (a.t.device != ref.t.device || (a.t.device == FA_DEVICE_CUDA && a.t.device_id != ref.t.device_id))
    return FA_INVALID("%s: must be on the device of %s (%s:%d), got %s:%d", a.name, ref.name, device_name(ref.t.device),
                      ref.t.device_id, device_name(a.t.device), a.t.device_id);
  return Status();
}

// Dimension `dim` of `a` must equal `expected` (which comes from `source`).
Status check_extent(const Arg& a, int dim, const char* dim_name, int64_t expected, const char* source) {
  if (a.t.shape[dim] != expected)
    return FA_INVALID("%s: dimension %d (%s) must be %lld like %s, got %lld", a.name, dim, dim_name, (long long)expected,
                      source, (long long)a.t.shape[dim]);
  return Status();
}

Status check_fits_int32(const Arg& a, int dim, const char* dim_name) {
  if (a.t.shape[dim] > kMaxExtent)
    return FA_INVALID("%s: dimension %d (%s) = %lld exceeds the largest extent, 2^31 - 2^20 = %lld", a.name, dim, dim_name,
                      (long long)a.t.shape[dim], (long long)kMaxExtent);
  return Status();
}

// Index tensors (cu_seqlens, seqused, block_table, cache_seqlens): int32 on the device of q.
Status check_index(const Arg& a, const Arg& q, int ndim, const char* layout) {
  FA_RETURN_IF_ERROR(check_basic(a));
  FA_RETURN_IF_ERROR(check_ndim(a, ndim, layout));
  FA_RETURN_IF_ERROR(check_dtype(a, FA_INT32, "an index tensor"));
  return check_same_device(a, q);
}

Status check_float_input(const Arg& a, const Arg& q) {
  FA_RETURN_IF_ERROR(check_basic(a));
  if (a.t.dtype == FA_FLOAT8_E4M3)
    return FA_INVALID("%s: dtype must be float32, float16 or bfloat16, got float8_e4m3 (float8_e4m3 is accepted only for "
                      "fa_kvcache's k_cache and v_cache)",
                      a.name);
  if (a.t.dtype != FA_FLOAT32 && a.t.dtype != FA_FLOAT16 && a.t.dtype != FA_BFLOAT16)
    return FA_INVALID("%s: dtype must be float32, float16 or bfloat16, got %s", a.name, dtype_name(a.t.dtype));
  if (&a.t != &q.t) {
    if (a.t.dtype != q.t.dtype)
      return FA_INVALID("%s: dtype must match q (%s), got %s", a.name, dtype_name(q.t.dtype), dtype_name(a.t.dtype));
    FA_RETURN_IF_ERROR(check_same_device(a, q));
  }
  return Status();
}

// Strides of a (B, S, H, D) or (total, H, D) tensor as (batch, row, head); batch 0 for varlen.
void strides_of(const fa_tensor& t, int64_t* batch, int64_t* row, int64_t* head) {
  if (t.ndim == 4) {
    *batch = t.strides[0];
    *row = t.strides[1];
    *head = t.strides[2];
  } else {
    *batch = 0;
    *row = t.strides[0];
    *head = t.strides[1];
  }
}

// Reads a host int32 vector (validation of contents is possible only for CPU tensors).
const int32_t* host_index(const fa_tensor& t) {
  return t.device == FA_DEVICE_CPU ? static_cast<const int32_t*>(t.data) : nullptr;
}

Status check_cu_seqlens(const Arg& a, const Arg& q, int batch, int64_t total, int max_seqlen, const char* max_name) {
  FA_RETURN_IF_ERROR(check_index(a, q, 1, "(B+1)"));
  if (a.t.shape[0] != int64_t(batch) + 1)
    return FA_INVALID("%s: must have B+1 = %d entries, got %lld", a.name, batch + 1, (long long)a.t.shape[0]);
  const int32_t* host = host_index(a.t);
  if (host == nullptr) return Status();  // device memory: contents are the caller's contract
  const int64_t stride = a.t.strides[0];
  if (host[0] != 0) return FA_INVALID("%s: must start at 0, got %d", a.name, host[0]);
  for (int b = 0; b < batch; ++b) {
    const int64_t length = int64_t(host[(b + 1) * stride]) - host[b * stride];
    if (length < 0) return FA_INVALID("%s: must be non-decreasing, but entry %d < entry %d", a.name, b + 1, b);
    if (length > max_seqlen)
      return FA_INVALID("%s: sequence %d has length %lld > %s = %d", a.name, b, (long long)length, max_name, max_seqlen);
  }
  if (host[batch * stride] > total)
    return FA_INVALID("%s: last entry %d exceeds the %lld rows of the tensor", a.name, host[batch * stride], (long long)total);
  return Status();
}

// Options common to every entry point; fills the variant fields of params.
Status apply_options(const fa_options& o, const Arg& q, int batch, int heads_q, int head_dim, AttentionParams* p) {
  if (!std::isfinite(o.softmax_scale)) return FA_INVALID("options.softmax_scale: must be finite, got %g", double(o.softmax_scale));
  p->softmax_scale = o.softmax_scale != 0.f ? o.softmax_scale : float(1.0 / std::sqrt(double(head_dim)));
  if (o.window_left < -1) return FA_INVALID("options.window_left: must be -1 (unbounded) or >= 0, got %d", o.window_left);
  if (o.window_right < -1) return FA_INVALID("options.window_right: must be -1 (unbounded) or >= 0, got %d", o.window_right);
  p->causal = o.causal != 0;
  p->window_left = o.window_left;
  p->window_right = o.window_right;
  if (p->causal) {
    if (o.window_right > 0)
      return FA_INVALID("options.window_right: must be -1 or 0 when causal is set (causal means window_right = 0), got %d",
                        o.window_right);
    p->window_right = 0;
  }
  if (!(o.softcap >= 0.f) || !std::isfinite(o.softcap))
    return FA_INVALID("options.softcap: must be finite and >= 0 (0 = off), got %g", double(o.softcap));
  p->softcap = o.softcap;
  p->alibi_slopes = nullptr;
  p->alibi_batch_stride = 0;
  if (o.alibi_slopes.data != nullptr) {
    const Arg a{"options.alibi_slopes", o.alibi_slopes};
    FA_RETURN_IF_ERROR(check_basic(a));
    FA_RETURN_IF_ERROR(check_dtype(a, FA_FLOAT32, "slopes are float32"));
    FA_RETURN_IF_ERROR(check_same_device(a, q));
    if (a.t.ndim == 1) {
      FA_RETURN_IF_ERROR(check_extent(a, 0, "Hq", heads_q, "q"));
    } else if (a.t.ndim == 2) {
      FA_RETURN_IF_ERROR(check_extent(a, 0, "B", batch, "q"));
      FA_RETURN_IF_ERROR(check_extent(a, 1, "Hq", heads_q, "q"));
      p->alibi_batch_stride = a.t.strides[0];
    } else {
      return FA_INVALID("options.alibi_slopes: expected 1 dimension (Hq) or 2 (B, Hq), got %d", a.t.ndim);
    }
    p->alibi_slopes = static_cast<const float*>(a.t.data);
  }
  if (!(o.dropout_p >= 0.f && o.dropout_p < 1.f))
    return FA_INVALID("options.dropout_p: must be in [0, 1), got %g", double(o.dropout_p));
  p->dropout_p = o.dropout_p;
  p->dropout_seed = o.dropout_seed;
  p->dropout_offset = o.dropout_offset;
  if (o.num_threads < 0) return FA_INVALID("options.num_threads: must be >= 0 (0 = all hardware threads), got %d", o.num_threads);
  // Asked once per process: glibc answers by opening and reading /sys/devices/system/cpu/online, a
  // few microseconds of system calls that every call (CUDA ones too) paid before the first byte of work.
  static const unsigned hardware = std::thread::hardware_concurrency();
  p->num_threads = o.num_threads > 0 ? o.num_threads : (hardware > 0 ? int(hardware) : 1);
  p->stream = o.stream;
  p->stats = o.stats;
  fa_backend backend;
  return resolve_backend(o, q.t.device, q.t.device_id, &backend);
}

// q/k/v/out (+ lse, varlen, paged) shared by forward and backward; fills sizes and strides.
struct Core {
  const fa_tensor& q;
  const fa_tensor& k;
  const fa_tensor& v;
  const fa_tensor& out;
  const fa_tensor& lse;
  const fa_tensor& cu_seqlens_q;
  const fa_tensor& cu_seqlens_k;
  int32_t max_seqlen_q, max_seqlen_k;
  const fa_tensor* seqused_k;    // forward only
  const fa_tensor* block_table;  // forward only
  bool lse_required;
  bool check_block_ids;          // kvcache checks them itself, with its own lengths
};

// Every block that holds one of the keys [first(b), length(b)) of sequence b must be a valid block id.
// Only host memory can be read here; entries outside that range are never read by any backend.
template <typename Length, typename First>
Status check_block_ids(const fa_tensor& table, const AttentionParams& p, Length length, First first) {
  const int32_t* host = host_index(table);
  if (host == nullptr) return Status();
  for (int b = 0; b < p.batch; ++b) {
    const int64_t used_blocks = (int64_t(length(b)) + p.page_block_size - 1) / p.page_block_size;
    if (used_blocks > table.shape[1])
      return FA_INVALID("block_table: sequence %d needs %lld blocks but the table has %lld columns", b, (long long)used_blocks,
                        (long long)table.shape[1]);
    for (int64_t n = first(b) / p.page_block_size; n < used_blocks; ++n) {
      const int32_t id = host[b * table.strides[0] + n * table.strides[1]];
      if (id < 0 || id >= p.num_blocks)
        return FA_INVALID("block_table: entry (%d, %lld) = %d is not a block id in [0, %d)", b, (long long)n, id, p.num_blocks);
    }
  }
  return Status();
}

Status fill_core(const Core& c, const fa_options& options, AttentionParams* p) {
  *p = AttentionParams{};
  const Arg q{"q", c.q}, k{"k", c.k}, v{"v", c.v}, out{"out", c.out};
  FA_RETURN_IF_ERROR(check_float_input(q, q));
  FA_RETURN_IF_ERROR(check_float_input(k, q));
  FA_RETURN_IF_ERROR(check_float_input(v, q));
  FA_RETURN_IF_ERROR(check_float_input(out, q));
  const bool varlen = c.cu_seqlens_q.data != nullptr || c.cu_seqlens_k.data != nullptr;
  const bool paged = c.block_table != nullptr && c.block_table->data != nullptr;
  if (varlen && (c.cu_seqlens_q.data == nullptr || c.cu_seqlens_k.data == nullptr))
    return FA_INVALID("%s: cu_seqlens_q and cu_seqlens_k must be given together (variable-length layout)",
                      c.cu_seqlens_q.data == nullptr ? "cu_seqlens_q" : "cu_seqlens_k");
  p->dtype = c.q.dtype;
  p->kv_dtype = c.q.dtype;  // make_kvcache_params sets an FP8 cache's dtype and scales after this
  p->k_scale = 1.f;
  p->v_scale = 1.f;
  p->device = c.q.device;
  p->device_id = c.q.device_id;

  const char* q_layout = varlen ? "(total_q, Hq, D)" : "(B, Sq, Hq, D)";
  FA_RETURN_IF_ERROR(check_ndim(q, varlen ? 3 : 4, q_layout));
  const int hd = varlen ? 1 : 2;  // index of the head dimension in q/out
  for (int d = 0; d < q.t.ndim - 1; ++d) FA_RETURN_IF_ERROR(check_fits_int32(q, d, "extent"));
  if (varlen) {
    if (c.cu_seqlens_q.ndim != 1) return FA_INVALID("cu_seqlens_q: expected 1 dimension (B+1), got %d", c.cu_seqlens_q.ndim);
    if (c.cu_seqlens_q.shape[0] < 1) return FA_INVALID("cu_seqlens_q: must have at least one entry (B+1 >= 1)");
    p->batch = int(c.cu_seqlens_q.shape[0] - 1);
    if (c.max_seqlen_q < 0) return FA_INVALID("max_seqlen_q: must be >= 0, got %d", c.max_seqlen_q);
    if (c.max_seqlen_k < 0) return FA_INVALID("max_seqlen_k: must be >= 0, got %d", c.max_seqlen_k);
    p->seqlen_q = c.max_seqlen_q;
    p->seqlen_k = c.max_seqlen_k;
  } else {
    p->batch = int(c.q.shape[0]);
    p->seqlen_q = int(c.q.shape[1]);
  }
  p->heads_q = int(c.q.shape[hd]);
  if (p->heads_q < 1) return FA_INVALID("q: dimension %d (Hq) must be >= 1, got %d", hd, p->heads_q);
  p->head_dim = int(c.q.shape[hd + 1]);
  if (p->head_dim < 1 || p->head_dim > kMaxHeadDim)
    return FA_INVALID("q: head dim must be in [1, %d], got %d", kMaxHeadDim, p->head_dim);

  // k / v: dense (B, Sk, Hk, D), varlen (total_k, Hk, D), paged (num_blocks, block_size, Hk, D)
  const char* kv_layout = paged ? "(num_blocks, block_size, Hk, D)" : (varlen ? "(total_k, Hk, D)" : "(B, Sk, Hk, D)");
  const int kv_ndim = (paged || !varlen) ? 4 : 3;
  FA_RETURN_IF_ERROR(check_ndim(k, kv_ndim, kv_layout));
  FA_RETURN_IF_ERROR(check_ndim(v, kv_ndim, kv_layout));
  for (int d = 0; d < kv_ndim - 1; ++d) {
    FA_RETURN_IF_ERROR(check_fits_int32(k, d, "extent"));
    FA_RETURN_IF_ERROR(check_extent(v, d, d == kv_ndim - 2 ? "Hk" : (d == 0 ? (paged ? "num_blocks" : (varlen ? "total_k" : "B")) : (paged ? "block_size" : "Sk")),
                                    c.k.shape[d], "k"));
  }
  const int khd = kv_ndim - 2;
  p->heads_k = int(c.k.shape[khd]);
  if (p->heads_k < 1) return FA_INVALID("k: dimension %d (Hk) must be >= 1, got %d", khd, p->heads_k);
  if (p->heads_q % p->heads_k != 0)
    return FA_INVALID("k: dimension %d (Hk) must divide q's Hq = %d, got %d", khd, p->heads_q, p->heads_k);
  // The backends count (batch, head) pairs in int32 (cpu_reference: B * Hq = 3 * 10^9 wrapped negative and it
  // returned without computing anything).
  if (int64_t(p->batch) * p->heads_q > kMaxExtent)
    return FA_INVALID("q: B * Hq = %d * %d = %lld exceeds the largest extent, 2^31 - 2^20 = %lld", p->batch, p->heads_q,
                      (long long)(int64_t(p->batch) * p->heads_q), (long long)kMaxExtent);
  FA_RETURN_IF_ERROR(check_extent(k, khd + 1, "D", p->head_dim, "q"));
  p->head_dim_v = int(c.v.shape[khd + 1]);
  if (p->head_dim_v < 1 || p->head_dim_v > kMaxHeadDim)
    return FA_INVALID("v: head dim must be in [1, %d], got %d", kMaxHeadDim, p->head_dim_v);
  if (!varlen && !paged) {
    FA_RETURN_IF_ERROR(check_extent(k, 0, "B", p->batch, "q"));
    p->seqlen_k = int(c.k.shape[1]);
  }

  // out: layout of q with Dv
  FA_RETURN_IF_ERROR(check_ndim(out, q.t.ndim, q_layout));
  for (int d = 0; d < q.t.ndim - 1; ++d) FA_RETURN_IF_ERROR(check_extent(out, d, d == hd ? "Hq" : "rows", c.q.shape[d], "q"));
  FA_RETURN_IF_ERROR(check_extent(out, hd + 1, "Dv", p->head_dim_v, "v"));

  // varlen index tensors
  if (varlen) {
    FA_RETURN_IF_ERROR(check_cu_seqlens({"cu_seqlens_q", c.cu_seqlens_q}, q, p->batch, c.q.shape[0], c.max_seqlen_q, "max_seqlen_q"));
    const int64_t k_rows = paged ? kMaxInt32 : c.k.shape[0];
    const int max_k = paged ? int(kMaxInt32) : c.max_seqlen_k;
    FA_RETURN_IF_ERROR(check_cu_seqlens({"cu_seqlens_k", c.cu_seqlens_k}, q, p->batch, k_rows, max_k, "max_seqlen_k"));
    p->cu_seqlens_q = static_cast<const int32_t*>(c.cu_seqlens_q.data);
    p->cu_seqlens_k = static_cast<const int32_t*>(c.cu_seqlens_k.data);
    // max_seqlen_q / max_seqlen_k are upper bounds, and no sequence is longer than its tensor's rows: the
    // backends size their grids by the smaller (a loose bound near INT32_MAX overflowed the CPU backend's tile
    // count, which then ran no tile). A paged cache's rows are bounded by its capacity, checked below.
    p->seqlen_q = int(std::min<int64_t>(c.max_seqlen_q, c.q.shape[0]));
    p->varlen_total_q = int32_t(c.q.shape[0]);  // dimension 0 fits int32 (checked above)
    if (!paged) p->seqlen_k = int(std::min<int64_t>(c.max_seqlen_k, c.k.shape[0]));
  }

  // paged K/V
  if (paged) {
    const Arg bt{"block_table", *c.block_table};
    FA_RETURN_IF_ERROR(check_index(bt, q, 2, "(B, max_blocks)"));
    FA_RETURN_IF_ERROR(check_extent(bt, 0, "B", p->batch, "q"));
    p->page_block_size = int(c.k.shape[1]);
    p->num_blocks = int(c.k.shape[0]);
    if (p->page_block_size < 1) return FA_INVALID("k: dimension 1 (block_size) must be >= 1, got %d", p->page_block_size);
    const int64_t capacity = c.block_table->shape[1] * int64_t(p->page_block_size);
    if (capacity > kMaxExtent)
      return FA_INVALID("block_table: max_blocks * block_size = %lld exceeds the largest extent, 2^31 - 2^20 = %lld", (long long)capacity,
                        (long long)kMaxExtent);
    if (!varlen) p->seqlen_k = int(capacity);
    else if (c.max_seqlen_k > capacity)
      return FA_INVALID("max_seqlen_k: %d exceeds the paged capacity max_blocks * block_size = %lld", c.max_seqlen_k, (long long)capacity);
    p->block_table = static_cast<const int32_t*>(c.block_table->data);
    p->block_table_batch_stride = c.block_table->strides[0];
  }
  if (c.seqused_k != nullptr && c.seqused_k->data != nullptr) {
    const Arg su{"seqused_k", *c.seqused_k};
    FA_RETURN_IF_ERROR(check_index(su, q, 1, "(B)"));
    FA_RETURN_IF_ERROR(check_extent(su, 0, "B", p->batch, "q"));
    if (const int32_t* host = host_index(*c.seqused_k)) {
      const int limit = p->seqlen_k;
      for (int b = 0; b < p->batch; ++b) {
        const int32_t n = host[b * c.seqused_k->strides[0]];
        const int available = (varlen && !paged) ? p->cu_seqlens_k[b + 1] - p->cu_seqlens_k[b] : limit;
        if (n < 0 || n > available)
          return FA_INVALID("seqused_k: entry %d = %d must be in [0, %d] (the keys of that sequence)", b, n, available);
      }
    }
    p->seqused_k = static_cast<const int32_t*>(c.seqused_k->data);
  }
  if (paged && c.check_block_ids) {
    const int32_t* used = c.seqused_k != nullptr ? host_index(*c.seqused_k) : nullptr;
    const int32_t* cu_k = varlen ? host_index(c.cu_seqlens_k) : nullptr;
    FA_RETURN_IF_ERROR(check_block_ids(*c.block_table, *p, [&](int b) {
      if (used != nullptr) return used[b * c.seqused_k->strides[0]];
      if (cu_k != nullptr) return cu_k[(b + 1) * c.cu_seqlens_k.strides[0]] - cu_k[b * c.cu_seqlens_k.strides[0]];
      return p->seqlen_k;
    }, [](int) { return 0; }));
  }

  strides_of(c.q, &p->q_batch_stride, &p->q_row_stride, &p->q_head_stride);
  strides_of(c.k, &p->k_batch_stride, &p->k_row_stride, &p->k_head_stride);
  strides_of(c.v, &p->v_batch_stride, &p->v_row_stride, &p->v_head_stride);
  strides_of(c.out, &p->out_batch_stride, &p->out_row_stride, &p->out_head_stride);
  if (paged) {  // (num_blocks, block_size, Hk, D): the block stride plays the batch stride
    p->k_batch_stride = c.k.strides[0];
    p->k_row_stride = c.k.strides[1];
    p->k_head_stride = c.k.strides[2];
    p->v_batch_stride = c.v.strides[0];
    p->v_row_stride = c.v.strides[1];
    p->v_head_stride = c.v.strides[2];
  }
  p->q = c.q.data;
  p->k = c.k.data;
  p->v = c.v.data;
  p->out = c.out.data;

  // lse: float32 (B, Hq, Sq) or varlen (Hq, total_q)
  if (c.lse.data == nullptr) {
    if (c.lse_required) return FA_INVALID("lse: required tensor is missing (data is NULL): backward needs the forward's lse");
  } else {
    const Arg lse{"lse", c.lse};
    FA_RETURN_IF_ERROR(check_basic(lse));
    FA_RETURN_IF_ERROR(check_dtype(lse, FA_FLOAT32, "log-sum-exp is float32"));
    FA_RETURN_IF_ERROR(check_same_device(lse, q));
    if (varlen) {
      FA_RETURN_IF_ERROR(check_ndim(lse, 2, "(Hq, total_q)"));
      FA_RETURN_IF_ERROR(check_extent(lse, 0, "Hq", p->heads_q, "q"));
      FA_RETURN_IF_ERROR(check_extent(lse, 1, "total_q", c.q.shape[0], "q"));
      p->lse_batch_stride = 0;
      p->lse_head_stride = c.lse.strides[0];
      p->lse_row_stride = c.lse.strides[1];
    } else {
      FA_RETURN_IF_ERROR(check_ndim(lse, 3, "(B, Hq, Sq)"));
      FA_RETURN_IF_ERROR(check_extent(lse, 0, "B", p->batch, "q"));
      FA_RETURN_IF_ERROR(check_extent(lse, 1, "Hq", p->heads_q, "q"));
      FA_RETURN_IF_ERROR(check_extent(lse, 2, "Sq", p->seqlen_q, "q"));
      p->lse_batch_stride = c.lse.strides[0];
      p->lse_head_stride = c.lse.strides[1];
      p->lse_row_stride = c.lse.strides[2];
    }
    p->lse = static_cast<float*>(c.lse.data);
  }
  return apply_options(options, q, p->batch, p->heads_q, p->head_dim, p);
}

Status check_like(const Arg& a, const Arg& like, const Arg& q) {
  FA_RETURN_IF_ERROR(check_float_input(a, q));
  if (a.t.ndim != like.t.ndim)
    return FA_INVALID("%s: must have the %d dimensions of %s, got %d", a.name, like.t.ndim, like.name, a.t.ndim);
  for (int d = 0; d < a.t.ndim; ++d) FA_RETURN_IF_ERROR(check_extent(a, d, "extent", like.t.shape[d], like.name));
  return Status();
}

// A caller's workspace (optional: no data, none): raw bytes, one dimension, on q's device.
Status take_workspace(const fa_tensor& workspace, const Arg& q, void** data, int64_t* bytes) {
  if (workspace.data == nullptr) return Status();
  const Arg w{"workspace", workspace};
  FA_RETURN_IF_ERROR(check_basic(w));
  FA_RETURN_IF_ERROR(check_dtype(w, FA_UINT8, "a workspace is raw bytes"));
  FA_RETURN_IF_ERROR(check_ndim(w, 1, "(bytes)"));
  FA_RETURN_IF_ERROR(check_same_device(w, q));
  *data = workspace.data;
  *bytes = workspace.shape[0];
  return Status();
}

}  // namespace

const char* backend_name(fa_backend backend) {
  switch (backend) {
    case FA_BACKEND_AUTO: return "auto";
    case FA_BACKEND_CPU_REFERENCE: return "cpu_reference";
    case FA_BACKEND_CPU_FLASH: return "cpu_flash";
    case FA_BACKEND_CPU_STANDARD: return "cpu_standard";
    case FA_BACKEND_CUDA: return "cuda";
  }
  return "unknown";
}

Status resolve_backend(const fa_options& options, fa_device_kind device, int device_id, fa_backend* backend) {
  const int requested = raw_enum(options.backend);
  if (requested < FA_BACKEND_AUTO || requested > FA_BACKEND_CUDA)
    return FA_INVALID("options.backend: unknown backend %d", requested);
  switch (options.backend) {
    case FA_BACKEND_AUTO:
      *backend = device == FA_DEVICE_CUDA ? FA_BACKEND_CUDA : FA_BACKEND_CPU_FLASH;
      return Status();
    case FA_BACKEND_CPU_REFERENCE:
    case FA_BACKEND_CPU_FLASH:
    case FA_BACKEND_CPU_STANDARD:
      if (device != FA_DEVICE_CPU)
        return FA_INVALID("options.backend: %s reads host memory, but the tensors are on cuda:%d", backend_name(options.backend),
                          device_id);
      *backend = options.backend;
      return Status();
    case FA_BACKEND_CUDA:
      if (device != FA_DEVICE_CUDA)
        return FA_INVALID("options.backend: cuda needs tensors on a CUDA device, but they are on the cpu");
      *backend = options.backend;
      return Status();
  }
  return FA_INVALID("options.backend: unknown backend %d", int(options.backend));
}

Status make_forward_params(const fa_forward_args& a, const fa_options& options, AttentionParams* p) {
  const Core core{a.q, a.k, a.v, a.out, a.lse, a.cu_seqlens_q, a.cu_seqlens_k, a.max_seqlen_q, a.max_seqlen_k,
                  &a.seqused_k, &a.block_table, /*lse_required=*/false, /*check_block_ids=*/true};
  return fill_core(core, options, p);
}

Status make_backward_params(const fa_backward_args& a, const fa_options& options, BackwardParams* p) {
  const Core core{a.q, a.k, a.v, a.out, a.lse, a.cu_seqlens_q, a.cu_seqlens_k, a.max_seqlen_q, a.max_seqlen_k,
                  nullptr, nullptr, /*lse_required=*/true, /*check_block_ids=*/false};
  AttentionParams& base = *p;
  *p = BackwardParams{};
  FA_RETURN_IF_ERROR(fill_core(core, options, &base));
  const Arg q{"q", a.q}, k{"k", a.k}, v{"v", a.v}, out{"out", a.out};
  FA_RETURN_IF_ERROR(check_like({"dout", a.dout}, out, q));
  FA_RETURN_IF_ERROR(check_like({"dq", a.dq}, q, q));
  FA_RETURN_IF_ERROR(check_like({"dk", a.dk}, k, q));
  FA_RETURN_IF_ERROR(check_like({"dv", a.dv}, v, q));
  strides_of(a.dout, &p->dout_batch_stride, &p->dout_row_stride, &p->dout_head_stride);
  strides_of(a.dq, &p->dq_batch_stride, &p->dq_row_stride, &p->dq_head_stride);
  strides_of(a.dk, &p->dk_batch_stride, &p->dk_row_stride, &p->dk_head_stride);
  strides_of(a.dv, &p->dv_batch_stride, &p->dv_row_stride, &p->dv_head_stride);
  p->dout = a.dout.data;
  p->dq = a.dq.data;
  p->dk = a.dk.data;
  p->dv = a.dv.data;
  p->deterministic = options.deterministic != 0;
  FA_RETURN_IF_ERROR(take_workspace(a.workspace, q, &p->workspace, &p->workspace_bytes));
  return Status();
}

// A KV cache's kind: k_cache and v_cache both float8_e4m3 (an FP8 cache: `rows`, the 16-bit tensor that is read or
// appended with it, float16 or bfloat16, and k_scale / v_scale finite and > 0), or neither (the scales 0 or 1, "no
// scale"). The caches' own dtype and device rules follow at the caller.
Status check_cache_kind(const fa_tensor& k_cache, const fa_tensor& v_cache, const Arg& rows, float k_scale, float v_scale,
                        bool* fp8) {
  *fp8 = k_cache.dtype == FA_FLOAT8_E4M3 || v_cache.dtype == FA_FLOAT8_E4M3;
  const struct {
    const char* name;
    float value;
  } scales[] = {{"k_scale", k_scale}, {"v_scale", v_scale}};
  if (!*fp8) {
    for (const auto& sc : scales)
      if (sc.value != 0.f && sc.value != 1.f)
        return FA_INVALID("%s: applies to a float8_e4m3 cache only; with a %s cache it must be 0 or 1 (no scale), got %g",
                          sc.name, dtype_name(k_cache.dtype), double(sc.value));
    return Status();
  }
  if (k_cache.dtype != v_cache.dtype) {
    const bool k_is_fp8 = k_cache.dtype == FA_FLOAT8_E4M3;
    return FA_INVALID("%s: an FP8 cache needs k_cache and v_cache both float8_e4m3, got %s", k_is_fp8 ? "v_cache" : "k_cache",
                      dtype_name(k_is_fp8 ? v_cache.dtype : k_cache.dtype));
  }
  if (rows.t.dtype != FA_FLOAT16 && rows.t.dtype != FA_BFLOAT16)
    return FA_INVALID("%s: dtype must be float16 or bfloat16 with a float8_e4m3 cache, got %s", rows.name, dtype_name(rows.t.dtype));
  for (const auto& sc : scales)
    if (!(sc.value > 0.f) || !std::isfinite(sc.value))
      return FA_INVALID("%s: must be finite and > 0 with a float8_e4m3 cache (real value = fp8 value * scale), got %g", sc.name,
                        double(sc.value));
  return Status();
}

Status make_kvcache_params(const fa_kvcache_args& a, const fa_options& options, KvcacheParams* p) {
  *p = KvcacheParams{};
  const Arg q{"q", a.q}, kc{"k_cache", a.k_cache}, vc{"v_cache", a.v_cache};
  FA_RETURN_IF_ERROR(check_float_input(q, q));
  FA_RETURN_IF_ERROR(check_ndim(q, 4, "(B, Sq, Hq, D)"));
  const bool paged = a.block_table.data != nullptr;
  const char* cache_layout = paged ? "(num_blocks, block_size, Hk, D)" : "(B, S_cache, Hk, D)";
  // An FP8 cache (k_cache and v_cache together) with 16-bit q, and its scales; a 16-bit cache leaves them 0 or 1.
  FA_RETURN_IF_ERROR(check_basic(kc));
  FA_RETURN_IF_ERROR(check_basic(vc));
  bool fp8_cache = false;
  FA_RETURN_IF_ERROR(check_cache_kind(a.k_cache, a.v_cache, q, a.k_scale, a.v_scale, &fp8_cache));
  if (fp8_cache) {
    FA_RETURN_IF_ERROR(check_same_device(kc, q));
    FA_RETURN_IF_ERROR(check_same_device(vc, q));
  } else {
    FA_RETURN_IF_ERROR(check_float_input(kc, q));
    FA_RETURN_IF_ERROR(check_float_input(vc, q));
  }
  FA_RETURN_IF_ERROR(check_ndim(kc, 4, cache_layout));
  FA_RETURN_IF_ERROR(check_ndim(vc, 4, cache_layout));
  // cache_batch_idx: the contiguous cache [cache batch, S_cache, Hk, D] is the paged cache it is, blocks of S_cache
  // rows, with cache_batch_idx as a one-column block table: every backend's paged path then reads and appends to
  // entry cache_batch_idx[b] for sequence b (on CUDA the paged decode kernel, for S_cache a power of two >= 16:
  // decode_plan.cpp, docs/PERFORMANCE.md). Its own rules first, with its own name in the messages.
  const bool batch_idx = a.cache_batch_idx.data != nullptr;
  fa_tensor batch_idx_table{};  // cache_batch_idx as (B, 1)
  if (batch_idx) {
    if (paged)
      return FA_INVALID("cache_batch_idx: applies to a contiguous cache only (a paged cache reaches its blocks through "
                        "block_table)");
    const Arg bi{"cache_batch_idx", a.cache_batch_idx};
    FA_RETURN_IF_ERROR(check_index(bi, q, 1, "(B)"));
    FA_RETURN_IF_ERROR(check_extent(bi, 0, "B", a.q.shape[0], "q"));
    if (a.k_cache.shape[0] < 1)
      return FA_INVALID("k_cache: dimension 0 (the cache's batch) must be >= 1 with cache_batch_idx, got %lld",
                        (long long)a.k_cache.shape[0]);
    FA_RETURN_IF_ERROR(check_extent(vc, 0, "the cache's batch", a.k_cache.shape[0], "k_cache"));
    batch_idx_table = a.cache_batch_idx;
    batch_idx_table.ndim = 2;
    batch_idx_table.shape[1] = 1;
    batch_idx_table.strides[1] = 1;
  }
  // The cache as k / v of a forward problem (paged through block_table, or contiguous per batch); an FP8
  // cache goes through the shape rules under q's dtype, and gets its own dtype and scales afterwards.
  fa_forward_args f{};
  f.q = a.q;
  f.k = a.k_cache;
  f.v = a.v_cache;
  if (fp8_cache) f.k.dtype = f.v.dtype = a.q.dtype;
  f.out = a.out;
  f.lse = a.lse;
  f.block_table = batch_idx ? batch_idx_table : a.block_table;
  const Core core{f.q, f.k, f.v, f.out, f.lse, f.cu_seqlens_q, f.cu_seqlens_k, 0, 0, nullptr, &f.block_table, /*lse_required=*/false,
                  /*check_block_ids=*/false};
  AttentionParams& base = *p;
  // fill_core names the cache "k"/"v" in messages; rename for the caller's benefit.
  Status s = fill_core(core, options, &base);
  if (!s.ok()) {
    std::string m = s.message();
    if (m.rfind("k: ", 0) == 0) m = "k_cache: " + m.substr(3);
    else if (m.rfind("v: ", 0) == 0) m = "v_cache: " + m.substr(3);
    return Status(s.code(), m);
  }
  if (fp8_cache) {
    p->kv_dtype = FA_FLOAT8_E4M3;
    p->k_scale = a.k_scale;
    p->v_scale = a.v_scale;
  }
  const int capacity = p->seqlen_k;

  const Arg cs{"cache_seqlens", a.cache_seqlens};
  FA_RETURN_IF_ERROR(check_index(cs, q, 1, "(B)"));
  FA_RETURN_IF_ERROR(check_extent(cs, 0, "B", p->batch, "q"));
  p->cache_seqlens = static_cast<const int32_t*>(a.cache_seqlens.data);
  p->block_table_is_batch_idx = batch_idx;

  if ((a.k_new.data == nullptr) != (a.v_new.data == nullptr))
    return FA_INVALID("%s: k_new and v_new must be given together", a.k_new.data == nullptr ? "k_new" : "v_new");
  if (a.k_new.data != nullptr) {
    const Arg kn{"k_new", a.k_new}, vn{"v_new", a.v_new};
    FA_RETURN_IF_ERROR(check_float_input(kn, q));
    FA_RETURN_IF_ERROR(check_float_input(vn, q));
    FA_RETURN_IF_ERROR(check_ndim(kn, 4, "(B, S_new, Hk, D)"));
    FA_RETURN_IF_ERROR(check_ndim(vn, 4, "(B, S_new, Hk, Dv)"));
    FA_RETURN_IF_ERROR(check_extent(kn, 0, "B", p->batch, "q"));
    FA_RETURN_IF_ERROR(check_extent(kn, 2, "Hk", p->heads_k, "k_cache"));
    FA_RETURN_IF_ERROR(check_extent(kn, 3, "D", p->head_dim, "q"));
    FA_RETURN_IF_ERROR(check_extent(vn, 0, "B", p->batch, "q"));
    FA_RETURN_IF_ERROR(check_extent(vn, 1, "S_new", a.k_new.shape[1], "k_new"));
    FA_RETURN_IF_ERROR(check_extent(vn, 2, "Hk", p->heads_k, "k_cache"));
    FA_RETURN_IF_ERROR(check_extent(vn, 3, "Dv", p->head_dim_v, "v_cache"));
    FA_RETURN_IF_ERROR(check_fits_int32(kn, 1, "S_new"));
    p->seqlen_new = int(a.k_new.shape[1]);
    strides_of(a.k_new, &p->k_new_batch_stride, &p->k_new_row_stride, &p->k_new_head_stride);
    strides_of(a.v_new, &p->v_new_batch_stride, &p->v_new_row_stride, &p->v_new_head_stride);
    p->k_new = a.k_new.data;
    p->v_new = a.v_new.data;
  }
  if (const int32_t* host = host_index(a.cache_seqlens)) {
    for (int b = 0; b < p->batch; ++b) {
      const int64_t n = host[b * a.cache_seqlens.strides[0]];
      if (n < 0 || n + p->seqlen_new > capacity)
        return FA_INVALID("cache_seqlens: entry %d = %lld plus S_new = %d must be in [0, %d] (the cache capacity)", b,
                          (long long)n, p->seqlen_new, capacity);
    }
  }

  // cache_leftpad: sequence b's keys are rows [cache_leftpad[b], cache_seqlens[b] + S_new) (flash_attn's argument).
  if (a.cache_leftpad.data != nullptr) {
    const Arg lp{"cache_leftpad", a.cache_leftpad};
    FA_RETURN_IF_ERROR(check_index(lp, q, 1, "(B)"));
    FA_RETURN_IF_ERROR(check_extent(lp, 0, "B", p->batch, "q"));
    p->cache_leftpad = static_cast<const int32_t*>(a.cache_leftpad.data);
    const int32_t* host = host_index(a.cache_leftpad);
    const int32_t* cached = host_index(a.cache_seqlens);
    if (host != nullptr && cached != nullptr)
      for (int b = 0; b < p->batch; ++b) {
        const int32_t pad = host[b * a.cache_leftpad.strides[0]], length = cached[b * a.cache_seqlens.strides[0]];
        if (pad < 0 || pad > length)
          return FA_INVALID("cache_leftpad: entry %d = %d must be in [0, cache_seqlens[%d] = %d] (padding rows before the "
                            "sequence's cached keys)",
                            b, pad, b, length);
      }
  }

  if (const int32_t* host = batch_idx ? host_index(a.cache_batch_idx) : nullptr) {
    // In range, and distinct when appending (two sequences writing one cache entry would race).
    std::vector<std::pair<int32_t, int>> entries;  // (cache entry, sequence)
    for (int b = 0; b < p->batch; ++b) {
      const int32_t entry = host[b * a.cache_batch_idx.strides[0]];
      if (entry < 0 || entry >= p->num_blocks)  // the cache's batch (its blocks)
        return FA_INVALID("cache_batch_idx: entry %d = %d is not a batch entry of k_cache in [0, %d)", b, entry, p->num_blocks);
      entries.emplace_back(entry, b);
    }
    if (p->k_new != nullptr) {
      std::sort(entries.begin(), entries.end());
      for (size_t n = 1; n < entries.size(); ++n)
        if (entries[n].first == entries[n - 1].first)
          return FA_INVALID("cache_batch_idx: entries %d and %d are both %d; with k_new each sequence appends to its cache "
                            "entry, so the entries must be distinct",
                            entries[n - 1].second, entries[n].second, entries[n].first);
    }
  }

  if ((a.rotary_cos.data == nullptr) != (a.rotary_sin.data == nullptr))
    return FA_INVALID("%s: rotary_cos and rotary_sin must be given together", a.rotary_cos.data == nullptr ? "rotary_cos" : "rotary_sin");
  if (a.rotary_cos.data != nullptr) {
    const Arg rc{"rotary_cos", a.rotary_cos}, rs{"rotary_sin", a.rotary_sin};
    FA_RETURN_IF_ERROR(check_float_input(rc, q));
    FA_RETURN_IF_ERROR(check_float_input(rs, q));
    FA_RETURN_IF_ERROR(check_ndim(rc, 2, "(S_rotary, rotary_dim / 2)"));
    FA_RETURN_IF_ERROR(check_ndim(rs, 2, "(S_rotary, rotary_dim / 2)"));
    FA_RETURN_IF_ERROR(check_extent(rs, 0, "S_rotary", a.rotary_cos.shape[0], "rotary_cos"));
    FA_RETURN_IF_ERROR(check_extent(rs, 1, "rotary_dim / 2", a.rotary_cos.shape[1], "rotary_cos"));
    const int64_t rotary_dim = 2 * a.rotary_cos.shape[1];
    if (rotary_dim < 2 || rotary_dim > p->head_dim)
      return FA_INVALID("rotary_cos: rotary_dim = 2 * dimension 1 = %lld must be in [2, D = %d]", (long long)rotary_dim, p->head_dim);
    if (p->head_dim_v != p->head_dim)
      return FA_INVALID("rotary_cos: rotary embedding needs Dv == D, got Dv = %d, D = %d", p->head_dim_v, p->head_dim);
    FA_RETURN_IF_ERROR(check_fits_int32(rc, 0, "S_rotary"));
    p->rotary_dim = int(rotary_dim);
    p->seqlen_rotary = int(a.rotary_cos.shape[0]);
    p->rotary_cos = a.rotary_cos.data;
    p->rotary_sin = a.rotary_sin.data;
    p->rotary_cos_row_stride = a.rotary_cos.strides[0];
    p->rotary_sin_row_stride = a.rotary_sin.strides[0];
    p->rotary_interleaved = a.rotary_interleaved != 0;
    if (const int32_t* host = host_index(a.cache_seqlens)) {
      for (int b = 0; b < p->batch; ++b) {
        const int64_t last = int64_t(host[b * a.cache_seqlens.strides[0]]) + std::max(p->seqlen_new, p->seqlen_q);
        if (last > p->seqlen_rotary)
          return FA_INVALID("rotary_cos: dimension 0 (S_rotary) = %d must cover position %lld of sequence %d", p->seqlen_rotary,
                            (long long)last - 1, b);
      }
    } else {
      // Lengths in device memory cannot be read here, and the CUDA kernels read the table at each row's position
      // without a further check: the table must cover every position that a length the kernels accept (up to the
      // capacity - S_new) reaches, max(S_new, Sq) rows past it. (flash_attn asks S_rotary >= the cache's S.)
      const int64_t reach = int64_t(p->seqlen_k) - p->seqlen_new + std::max(p->seqlen_new, p->seqlen_q);
      if (reach > p->seqlen_rotary)
        return FA_INVALID("rotary_cos: dimension 0 (S_rotary) = %d must be >= %lld = the cache capacity %d - S_new %d + "
                          "max(S_new, Sq) when cache_seqlens is in device memory (every position a valid length reaches)",
                          p->seqlen_rotary, (long long)reach, p->seqlen_k, p->seqlen_new);
    }
  }
  if (paged) {
    const int32_t* cached = host_index(a.cache_seqlens);
    const int32_t* leftpad = p->cache_leftpad != nullptr ? host_index(a.cache_leftpad) : nullptr;
    FA_RETURN_IF_ERROR(check_block_ids(
        a.block_table, *p, [&](int b) { return cached ? cached[b * a.cache_seqlens.strides[0]] + p->seqlen_new : 0; },
        [&](int b) { return leftpad ? leftpad[b * a.cache_leftpad.strides[0]] : 0; }));
  }
  // An upper bound so that a count no plan would choose (the CUDA heuristic's cap is 128) cannot ask for
  // partial buffers of terabytes: a caller's typo gets this message, not an allocation failure.
  constexpr int kMaxNumSplits = 1024;
  if (a.num_splits < 0 || a.num_splits > kMaxNumSplits)
    return FA_INVALID("num_splits: must be in [0, %d] (0 = chosen by the backend), got %d", kMaxNumSplits, a.num_splits);
  p->num_splits = a.num_splits;
  p->check_indices = a.check_indices != 0;
  FA_RETURN_IF_ERROR(take_workspace(a.workspace, q, &p->workspace, &p->workspace_bytes));
  return Status();
}

// `a` present, of ref's dtype and on ref's device (the messages name ref, not q).
Status check_same_like(const Arg& a, const Arg& ref) {
  FA_RETURN_IF_ERROR(check_basic(a));
  if (a.t.dtype != ref.t.dtype)
    return FA_INVALID("%s: dtype must match %s (%s), got %s", a.name, ref.name, dtype_name(ref.t.dtype), dtype_name(a.t.dtype));
  return check_same_device(a, ref);
}

Status make_kvcache_append_params(const fa_kvcache_append_args& a, const fa_options& options, KvcacheAppendParams* out) {
  *out = KvcacheAppendParams{};
  KvcacheParams& p = out->cache;
  const Arg kc{"k_cache", a.k_cache}, vc{"v_cache", a.v_cache}, kn{"k_new", a.k_new}, vn{"v_new", a.v_new};
  const bool paged = a.block_table.data != nullptr;
  const char* cache_layout = paged ? "(num_blocks, block_size, Hk, D)" : "(B, S_cache, Hk, D)";
  FA_RETURN_IF_ERROR(check_basic(kc));
  FA_RETURN_IF_ERROR(check_basic(vc));
  // The cache's dtype, and that of the new rows: the same, or float16 / bfloat16 into an FP8 cache (both caches FP8).
  FA_RETURN_IF_ERROR(check_basic(kn));
  bool fp8_cache = false;
  FA_RETURN_IF_ERROR(check_cache_kind(a.k_cache, a.v_cache, kn, a.k_scale, a.v_scale, &fp8_cache));
  if (fp8_cache) {
    FA_RETURN_IF_ERROR(check_same_device(kn, kc));
    FA_RETURN_IF_ERROR(check_same_device(vc, kc));
  } else {
    FA_RETURN_IF_ERROR(check_float_input(kc, kc));
    FA_RETURN_IF_ERROR(check_same_like(vc, kc));
    FA_RETURN_IF_ERROR(check_same_like(kn, kc));
  }
  FA_RETURN_IF_ERROR(check_same_like(vn, kn));
  FA_RETURN_IF_ERROR(check_ndim(kc, 4, cache_layout));
  FA_RETURN_IF_ERROR(check_ndim(vc, 4, cache_layout));
  FA_RETURN_IF_ERROR(check_ndim(kn, 3, "(total_new, Hk, D)"));
  FA_RETURN_IF_ERROR(check_ndim(vn, 3, "(total_new, Hk, Dv)"));
  for (int d = 0; d < 3; ++d) {
    FA_RETURN_IF_ERROR(check_fits_int32(kc, d, "extent"));
    FA_RETURN_IF_ERROR(check_extent(vc, d, d == 0 ? (paged ? "num_blocks" : "B") : (d == 1 ? (paged ? "block_size" : "S_cache") : "Hk"),
                                    a.k_cache.shape[d], "k_cache"));
  }
  FA_RETURN_IF_ERROR(check_fits_int32(kn, 0, "total_new"));
  p.heads_k = p.heads_q = int(a.k_cache.shape[2]);
  if (p.heads_k < 1) return FA_INVALID("k_cache: dimension 2 (Hk) must be >= 1, got %d", p.heads_k);
  p.head_dim = int(a.k_cache.shape[3]);
  p.head_dim_v = int(a.v_cache.shape[3]);
  if (p.head_dim < 1 || p.head_dim > kMaxHeadDim) return FA_INVALID("k_cache: head dim must be in [1, %d], got %d", kMaxHeadDim, p.head_dim);
  if (p.head_dim_v < 1 || p.head_dim_v > kMaxHeadDim)
    return FA_INVALID("v_cache: head dim must be in [1, %d], got %d", kMaxHeadDim, p.head_dim_v);
  FA_RETURN_IF_ERROR(check_extent(kn, 1, "Hk", p.heads_k, "k_cache"));
  FA_RETURN_IF_ERROR(check_extent(kn, 2, "D", p.head_dim, "k_cache"));
  FA_RETURN_IF_ERROR(check_extent(vn, 0, "total_new", a.k_new.shape[0], "k_new"));
  FA_RETURN_IF_ERROR(check_extent(vn, 1, "Hk", p.heads_k, "k_cache"));
  FA_RETURN_IF_ERROR(check_extent(vn, 2, "Dv", p.head_dim_v, "v_cache"));

  // The sequences: B from cu_seqlens_new (B + 1 entries), their rows checked against max_seqlen_new and total_new.
  const Arg cu{"cu_seqlens_new", a.cu_seqlens_new}, cs{"cache_seqlens", a.cache_seqlens};
  FA_RETURN_IF_ERROR(check_index(cu, kc, 1, "(B+1)"));
  if (a.cu_seqlens_new.shape[0] < 1) return FA_INVALID("cu_seqlens_new: must have at least one entry (B+1 >= 1)");
  if (a.cu_seqlens_new.shape[0] - 1 > kMaxExtent)
    return FA_INVALID("cu_seqlens_new: B = %lld sequences exceed the largest extent", (long long)(a.cu_seqlens_new.shape[0] - 1));
  p.batch = int(a.cu_seqlens_new.shape[0] - 1);
  if (a.max_seqlen_new < 0) return FA_INVALID("max_seqlen_new: must be >= 0, got %d", a.max_seqlen_new);
  FA_RETURN_IF_ERROR(check_cu_seqlens(cu, kc, p.batch, a.k_new.shape[0], a.max_seqlen_new, "max_seqlen_new"));
  FA_RETURN_IF_ERROR(check_index(cs, kc, 1, "(B)"));
  FA_RETURN_IF_ERROR(check_extent(cs, 0, "B", p.batch, "cu_seqlens_new"));

  // The cache: contiguous, one entry per sequence; or paged through block_table.
  int64_t capacity = 0;
  if (paged) {
    const Arg bt{"block_table", a.block_table};
    FA_RETURN_IF_ERROR(check_index(bt, kc, 2, "(B, max_blocks)"));
    FA_RETURN_IF_ERROR(check_extent(bt, 0, "B", p.batch, "cu_seqlens_new"));
    p.page_block_size = int(a.k_cache.shape[1]);
    p.num_blocks = int(a.k_cache.shape[0]);
    if (p.page_block_size < 1) return FA_INVALID("k_cache: dimension 1 (block_size) must be >= 1, got %d", p.page_block_size);
    capacity = a.block_table.shape[1] * int64_t(p.page_block_size);
    if (capacity > kMaxExtent)
      return FA_INVALID("block_table: max_blocks * block_size = %lld exceeds the largest extent, 2^31 - 2^20 = %lld",
                        (long long)capacity, (long long)kMaxExtent);
    p.block_table = static_cast<const int32_t*>(a.block_table.data);
    p.block_table_batch_stride = a.block_table.strides[0];
  } else {
    FA_RETURN_IF_ERROR(check_extent(kc, 0, "B", p.batch, "cu_seqlens_new"));
    capacity = a.k_cache.shape[1];
  }
  p.seqlen_k = int(capacity);
  const int32_t* cached = host_index(a.cache_seqlens);
  const int32_t* cu_host = host_index(a.cu_seqlens_new);
  auto rows_of = [&](int b) {
    return cu_host[(b + 1) * a.cu_seqlens_new.strides[0]] - cu_host[b * a.cu_seqlens_new.strides[0]];
  };
  if (cached != nullptr)  // (cu_seqlens_new is host memory too: the same device, checked above)
    for (int b = 0; b < p.batch; ++b) {
      const int64_t n = cached[b * a.cache_seqlens.strides[0]];
      if (n < 0 || n + rows_of(b) > capacity)
        return FA_INVALID("cache_seqlens: entry %d = %lld plus its %d new rows must be in [0, %lld] (the cache capacity)", b,
                          (long long)n, rows_of(b), (long long)capacity);
    }
  if (paged && cached != nullptr)  // the blocks that the new rows [cached, cached + n_b) go to
    FA_RETURN_IF_ERROR(check_block_ids(
        a.block_table, p, [&](int b) { return rows_of(b) > 0 ? cached[b * a.cache_seqlens.strides[0]] + rows_of(b) : 0; },
        [&](int b) { return rows_of(b) > 0 ? cached[b * a.cache_seqlens.strides[0]] : 0; }));

  p.dtype = a.k_new.dtype;
  p.kv_dtype = a.k_cache.dtype;
  p.k_scale = fp8_cache ? a.k_scale : 1.f;
  p.v_scale = fp8_cache ? a.v_scale : 1.f;
  p.device = a.k_cache.device;
  p.device_id = a.k_cache.device_id;
  p.k = a.k_cache.data;
  p.v = a.v_cache.data;
  p.k_batch_stride = a.k_cache.strides[0];  // paged: the block stride
  p.k_row_stride = a.k_cache.strides[1];
  p.k_head_stride = a.k_cache.strides[2];
  p.v_batch_stride = a.v_cache.strides[0];
  p.v_row_stride = a.v_cache.strides[1];
  p.v_head_stride = a.v_cache.strides[2];
  p.cache_seqlens = static_cast<const int32_t*>(a.cache_seqlens.data);
  p.k_new = a.k_new.data;
  p.v_new = a.v_new.data;
  strides_of(a.k_new, &p.k_new_batch_stride, &p.k_new_row_stride, &p.k_new_head_stride);
  strides_of(a.v_new, &p.v_new_batch_stride, &p.v_new_row_stride, &p.v_new_head_stride);
  p.seqlen_new = int(std::min<int64_t>(a.max_seqlen_new, a.k_new.shape[0]));
  p.check_indices = a.check_indices != 0;
  p.window_left = p.window_right = -1;
  out->cu_seqlens_new = static_cast<const int32_t*>(a.cu_seqlens_new.data);
  out->total_new = a.k_new.shape[0];
  if (options.num_threads < 0)
    return FA_INVALID("options.num_threads: must be >= 0 (0 = all hardware threads), got %d", options.num_threads);
  static const unsigned hardware = std::thread::hardware_concurrency();
  p.num_threads = options.num_threads > 0 ? options.num_threads : (hardware > 0 ? int(hardware) : 1);
  p.stream = options.stream;
  p.stats = options.stats;
  fa_backend backend;
  return resolve_backend(options, p.device, p.device_id, &backend);
}

}  // namespace flashattn::api
