#include "cuda/dispatch.hpp"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdio>
#include <set>
#include <sstream>
#include <vector>

#include "core/dtype.hpp"
#include "cuda/generated/kernel_table.hpp"

#ifndef FLASHATTN_CUDA_ARCH_LIST
#define FLASHATTN_CUDA_ARCH_LIST ""
#endif

namespace flashattn::cuda {
namespace {

constexpr int64_t kCpAsyncBytes = 16;    // cp.async and the 16-byte output stores move this many bytes
constexpr int64_t kMaxGridYZ = 65535;    // CUDA's limit on gridDim.y / gridDim.z (heads, batch)

#define FA_UNSUPPORTED(...) ::flashattn::error(FA_ERROR_UNSUPPORTED, __VA_ARGS__)

const char* kind_name(KernelKind kind) {
  return kind == KernelKind::kForward ? "forward" : (kind == KernelKind::kBackward ? "backward" : "kvcache");
}

// One strided (rows, heads, batch) tensor of 16-bit elements: base pointer and every stride that
// steps over more than one position must be a multiple of 16 bytes.
struct TensorView {
  const char* name;
  const void* data;
  int64_t batch_stride, row_stride, head_stride;
  int64_t batches, rows, heads;  // extents (a stride over extent 1 is never used)
};

Status check_alignment(const TensorView& t) {
  const auto address = reinterpret_cast<uintptr_t>(t.data);
  if (address % kCpAsyncBytes != 0)
    return FA_UNSUPPORTED("%s: data pointer must be 16-byte aligned for the cuda backend (cp.async), got address %#llx",
                          t.name, (unsigned long long)address);
  const int64_t element_bytes = 2;
  const struct {
    const char* what;
    int64_t stride, extent;
  } strides[] = {{"batch", t.batch_stride, t.batches}, {"row", t.row_stride, t.rows}, {"head", t.head_stride, t.heads}};
  for (const auto& s : strides) {
    if (s.extent > 1 && (s.stride * element_bytes) % kCpAsyncBytes != 0)
      return FA_UNSUPPORTED("%s: %s stride %lld elements (%lld bytes) must be a multiple of 16 bytes for the cuda backend "
                            "(cp.async)",
                            t.name, s.what, (long long)s.stride, (long long)(s.stride * element_bytes));
  }
  return Status();
}

// Rules shared by forward and backward on q, k, v, out.
Status check_common(const AttentionParams& p) {
  if (p.dtype != FA_FLOAT16 && p.dtype != FA_BFLOAT16)
    return FA_UNSUPPORTED("q: dtype %s is not supported by the cuda backend (float16 and bfloat16 only; the cpu "
                          "backends take float32)",
                          dtype_name(p.dtype));
  if (p.head_dim_v != p.head_dim)
    return FA_UNSUPPORTED("v: head dim Dv = %d must equal q's D = %d on the cuda backend", p.head_dim_v, p.head_dim);
  if (p.head_dim % 8 != 0)
    return FA_UNSUPPORTED("q: head dim %d must be a multiple of 8 on the cuda backend (rows move in 16-byte chunks)",
                          p.head_dim);
  if (p.heads_q > kMaxGridYZ) return FA_UNSUPPORTED("q: %d heads exceed the cuda backend's limit of %lld", p.heads_q, (long long)kMaxGridYZ);
  if (p.batch > kMaxGridYZ) return FA_UNSUPPORTED("q: batch %d exceeds the cuda backend's limit of %lld", p.batch, (long long)kMaxGridYZ);
  const int64_t q_batches = p.is_varlen() ? 1 : p.batch;
  const int64_t kv_batches = p.is_paged() ? p.num_blocks : q_batches;
  const int64_t kv_rows = p.is_paged() ? p.page_block_size : p.seqlen_k;
  FA_RETURN_IF_ERROR(check_alignment({"q", p.q, p.q_batch_stride, p.q_row_stride, p.q_head_stride, q_batches, p.seqlen_q, p.heads_q}));
  FA_RETURN_IF_ERROR(check_alignment({"k", p.k, p.k_batch_stride, p.k_row_stride, p.k_head_stride, kv_batches, kv_rows, p.heads_k}));
  FA_RETURN_IF_ERROR(check_alignment({"v", p.v, p.v_batch_stride, p.v_row_stride, p.v_head_stride, kv_batches, kv_rows, p.heads_k}));
  FA_RETURN_IF_ERROR(
      check_alignment({"out", p.out, p.out_batch_stride, p.out_row_stride, p.out_head_stride, q_batches, p.seqlen_q, p.heads_q}));
  return Status();
}

std::string join_ints(const std::set<int>& values) {
  std::string s;
  for (int v : values) s += (s.empty() ? "" : ", ") + std::to_string(v);
  return s.empty() ? "none" : s;
}

}  // namespace

Status check_forward_support(const AttentionParams& p) { return check_common(p); }

Status check_backward_support(const BackwardParams& p) {
  FA_RETURN_IF_ERROR(check_common(p));
  if (p.is_paged()) return FA_UNSUPPORTED("block_table: the cuda backward does not read paged caches");
  const int64_t q_batches = p.is_varlen() ? 1 : p.batch;
  FA_RETURN_IF_ERROR(check_alignment(
      {"dout", p.dout, p.dout_batch_stride, p.dout_row_stride, p.dout_head_stride, q_batches, p.seqlen_q, p.heads_q}));
  FA_RETURN_IF_ERROR(check_alignment({"dq", p.dq, p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride, q_batches, p.seqlen_q, p.heads_q}));
  FA_RETURN_IF_ERROR(check_alignment({"dk", p.dk, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride, q_batches, p.seqlen_k, p.heads_k}));
  FA_RETURN_IF_ERROR(check_alignment({"dv", p.dv, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride, q_batches, p.seqlen_k, p.heads_k}));
  return Status();
}

bool arch_list_runs_on(const std::string& arch_list, int major, int minor) {
  std::string list = arch_list;
  std::replace(list.begin(), list.end(), ';', ' ');
  std::istringstream words(list);
  std::string word;
  const int device = major * 10 + minor;
  while (words >> word) {
    // "90a-real" -> number 90, arch-specific 'a', kind "real"
    size_t digits = 0;
    while (digits < word.size() && std::isdigit(static_cast<unsigned char>(word[digits]))) ++digits;
    if (digits == 0) continue;
    const int arch = std::stoi(word.substr(0, digits));
    // 'a' (arch-specific, e.g. 90a): that compute capability only. 'f' (family-specific, e.g. 100f): the same major
    // version from that minor up, machine code and PTX alike (CUDA 12.9+).
    const bool arch_specific = digits < word.size() && word[digits] == 'a';
    const bool family_specific = digits < word.size() && word[digits] == 'f';
    const bool real_only = word.find("-real") != std::string::npos;
    if (arch_specific) {
      if (arch == device) return true;
    } else if (family_specific) {
      if (arch / 10 == major && arch <= device) return true;
    } else if (arch / 10 == major && arch <= device) {
      return true;  // machine code of the same major version
    } else if (!real_only && arch <= device) {
      return true;  // PTX, compiled by the driver
    }
  }
  return false;
}

namespace {

// choose_kernel once the build is known to run on the device. Every call plans through here (a forward with G > 1 twice,
// its packed view too), so the common path allocates nothing: the compiled head dims are gathered only for the error.
Status choose_row(KernelKind kind, const AttentionParams& p, const DeviceLimits& device, const KernelEntry* table,
                  int count, int* index) {
  const bool dropout = p.dropout_p > 0.f;
  // An FP8 KV cache (kvcache only; validate.cpp rejects it elsewhere) has rows of its own: never a 16-bit row.
  const bool fp8_cache = p.kv_dtype == FA_FLOAT8_E4M3;
  auto same_kind = [&](const KernelEntry& e) {
    return e.kind == kind && e.dtype == p.dtype && e.dropout == dropout && e.fp8_cache == fp8_cache;
  };
  int bucket = -1;  // the smallest compiled head dim >= D
  for (int r = 0; r < count; ++r) {
    const KernelEntry& e = table[r];
    if (same_kind(e) && e.head_dim >= p.head_dim && (bucket < 0 || e.head_dim < bucket)) bucket = e.head_dim;
  }
  if (bucket < 0) {
    std::set<int> compiled;
    for (int r = 0; r < count; ++r)
      if (same_kind(table[r])) compiled.insert(table[r].head_dim);
    return error(FA_ERROR_NOT_COMPILED,
                 "q: head dim %d is not compiled for the cuda %s (%s%s%s); compiled head dims: %s (any D %% %d == 0 up to "
                 "a compiled one runs in that one)",
                 p.head_dim, kind_name(kind), dtype_name(p.dtype), dropout ? ", dropout" : "",
                 fp8_cache ? ", float8_e4m3 cache" : "", join_ints(compiled).c_str(), fp8_cache ? 16 : 8);
  }
  // Rows of the bucket come in the manifest's order of preference: the first whose shared memory fits, among
  // those whose call condition holds (a short-causal row: causal and at most causal_max_seqlen_q query rows; a
  // short-call row: at most max_seqlen_q query rows; a paged-K/V row: a block_table; a packed-only row: a packed view).
  int smallest = -1;
  for (int r = 0; r < count; ++r) {
    const KernelEntry& e = table[r];
    if (e.kind != kind || e.dtype != p.dtype || e.dropout != dropout || e.fp8_cache != fp8_cache || e.head_dim != bucket)
      continue;
    if (e.causal_max_seqlen_q > 0 && !(p.causal && p.seqlen_q <= e.causal_max_seqlen_q)) continue;
    if (e.max_seqlen_q > 0 && p.seqlen_q > e.max_seqlen_q) continue;
    if (e.paged_kv && !p.is_paged()) continue;  // the paged instantiation: calls with a block_table only
    if (e.packed_only && p.pack_gqa == 0) continue;  // a packed view's row only
    if (e.decode_role != DecodeRole::kGeneral) continue;  // offered by decode_alternative to the decode selection only
    if (e.split_kv) continue;  // offered by split_alternative to the forward's split plan only
    if (e.smem_bytes <= device.smem_per_block_optin) {
      *index = r;
      return Status();
    }
    if (smallest < 0 || e.smem_bytes < table[smallest].smem_bytes) smallest = r;
  }
  const KernelEntry& e = table[smallest];
  return FA_UNSUPPORTED("q: head dim %d (kernel %s) needs %lld KiB of shared memory per block, but cuda:%d (sm_%d%d) allows "
                        "%lld KiB",
                        p.head_dim, e.name, (long long)(e.smem_bytes / 1024), device.device, device.sm_major,
                        device.sm_minor, (long long)(device.smem_per_block_optin / 1024));
}

}  // namespace

Status choose_kernel(KernelKind kind, const AttentionParams& p, const DeviceLimits& device, const KernelEntry* table,
                     int count, const std::string& arch_list, int* index) {
  if (!arch_list_runs_on(arch_list, device.sm_major, device.sm_minor))
    return error(FA_ERROR_NOT_COMPILED, "q: cuda:%d is sm_%d%d, but this build holds kernels for \"%s\" only", device.device,
                 device.sm_major, device.sm_minor, arch_list.c_str());
  return choose_row(kind, p, device, table, count, index);
}

int decode_alternative(int index, DecodeRole role, const DeviceLimits& device, const KernelEntry* table, int count) {
  if (index < 0 || index >= count || role == DecodeRole::kGeneral) return -1;
  const KernelEntry& g = table[index];
  for (int r = 0; r < count; ++r) {
    const KernelEntry& e = table[r];
    if (e.decode_role == role && e.kind == g.kind && e.dtype == g.dtype && e.head_dim == g.head_dim && e.dropout == g.dropout &&
        e.fp8_cache == g.fp8_cache && e.smem_bytes <= device.smem_per_block_optin)
      return r;
  }
  return -1;
}

int split_alternative(int index, const AttentionParams& p, const DeviceLimits& device, const KernelEntry* table, int count) {
  if (index < 0 || index >= count) return -1;
  const KernelEntry& g = table[index];
  if (g.kind != KernelKind::kForward || g.dropout) return -1;
  for (int r = 0; r < count; ++r) {
    const KernelEntry& e = table[r];
    if (e.split_kv && e.kind == g.kind && e.dtype == g.dtype && e.head_dim == g.head_dim && !e.dropout &&
        e.paged_kv == g.paged_kv && (e.max_seqlen_q == 0 || p.seqlen_q <= e.max_seqlen_q) &&
        e.smem_bytes <= device.smem_per_block_optin)
      return r;
  }
  return -1;
}

int split_alternative(int index, const AttentionParams& p, const DeviceLimits& device) {
  return split_alternative(index, p, device, generated::kKernelTable, generated::kKernelCount);
}

int decode_alternative(int index, DecodeRole role, const DeviceLimits& device) {
  return decode_alternative(index, role, device, generated::kKernelTable, generated::kKernelCount);
}

Status choose_kernel(KernelKind kind, const AttentionParams& p, const DeviceLimits& device, int* index) {
  // Whether this build's architectures run on compute capability major.minor, parsed once per capability (the list is
  // fixed at build time): 0 not yet known, 1 yes, 2 no (the full check then writes the error).
  static std::atomic<uint8_t> runs_on[128] = {};
  const int cc = device.sm_major * 10 + device.sm_minor;
  const bool cacheable = cc >= 0 && cc < 128;
  uint8_t known = cacheable ? runs_on[cc].load(std::memory_order_relaxed) : 0;
  if (known == 0) {
    known = arch_list_runs_on(compiled_arch_list(), device.sm_major, device.sm_minor) ? 1 : 2;
    if (cacheable) runs_on[cc].store(known, std::memory_order_relaxed);
  }
  if (known == 2)
    return choose_kernel(kind, p, device, generated::kKernelTable, generated::kKernelCount, compiled_arch_list(), index);
  return choose_row(kind, p, device, generated::kKernelTable, generated::kKernelCount, index);
}

const KernelEntry& kernel_entry(int index) { return generated::kKernelTable[index]; }

std::string compiled_arch_list() { return FLASHATTN_CUDA_ARCH_LIST; }

std::string compiled_kernels_summary() {
  std::string s;
  for (KernelKind kind : {KernelKind::kForward, KernelKind::kBackward, KernelKind::kKvcache}) {
    std::set<int> dims, fp8_dims;
    std::set<std::string> dtypes;
    bool dropout = false;
    for (int r = 0; r < generated::kKernelCount; ++r) {
      const KernelEntry& e = generated::kKernelTable[r];
      if (e.kind != kind) continue;
      if (e.fp8_cache) {
        fp8_dims.insert(e.head_dim);
        continue;
      }
      dims.insert(e.head_dim);
      dtypes.insert(dtype_name(e.dtype));
      dropout = dropout || e.dropout;
    }
    std::string types;
    for (const auto& t : dtypes) types += (types.empty() ? "" : "/") + t;
    s += std::string(s.empty() ? "" : "; ") + kind_name(kind) + ": ";
    if (dims.empty()) {
      s += "none";
      continue;
    }
    s += types + " x D {" + join_ints(dims) + "} (D % 8 == 0 runs in the next compiled D, zero-padded)" +
         (dropout ? ", with dropout" : "");
    if (!fp8_dims.empty()) s += "; float8_e4m3 cache: D {" + join_ints(fp8_dims) + "} (D % 16 == 0)";
  }
  return "kernels: " + s;
}

}  // namespace flashattn::cuda
