#include "cuda/decode/decode_plan.hpp"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>

#include "core/dtype.hpp"
#include "cuda/sm80/forward_packing.hpp"

namespace flashattn::cuda::decode {
namespace {

#define FA_UNSUPPORTED(...) ::flashattn::error(FA_ERROR_UNSUPPORTED, __VA_ARGS__)

constexpr int64_t kCopyBytes = 16;     // cp.async and the output stores move 16 bytes
constexpr int64_t kMaxGridYZ = 65535;  // CUDA's limit on gridDim.y (K/V heads) and gridDim.z (batch)

// A strided (batch or block, row, head) tensor: its base pointer and every stride that steps over more than
// one position must be multiples of 16 bytes.
struct Strided {
  const char* name;
  const void* data;
  int64_t strides[3];  // batch (or block), row, head, in elements
  int64_t extents[3];
  int64_t element_bytes = 2;  // 16-bit; 1 for an FP8 cache
};

Status check_alignment(const Strided& t) {
  const auto address = reinterpret_cast<uintptr_t>(t.data);
  if (address % kCopyBytes != 0)
    return FA_UNSUPPORTED("%s: data pointer must be 16-byte aligned for the cuda kvcache kernels (cp.async), got address %#llx",
                          t.name, (unsigned long long)address);
  static const char* const kWhat[3] = {"batch (or block)", "row", "head"};
  for (int d = 0; d < 3; ++d)
    if (t.extents[d] > 1 && (t.strides[d] * t.element_bytes) % kCopyBytes != 0)
      return FA_UNSUPPORTED("%s: %s stride %lld elements (%lld bytes) must be a multiple of 16 bytes for the cuda kvcache "
                            "kernels (cp.async)",
                            t.name, kWhat[d], (long long)t.strides[d], (long long)(t.strides[d] * t.element_bytes));
  return Status();
}

int64_t align_up(int64_t bytes, int64_t alignment) { return (bytes + alignment - 1) / alignment * alignment; }

}  // namespace

Status check_kvcache_support(const KvcacheParams& p) {
  if (p.dtype != FA_FLOAT16 && p.dtype != FA_BFLOAT16)
    return FA_UNSUPPORTED("q: dtype %s is not supported by the cuda kvcache kernels (float16 and bfloat16 only; the cpu "
                          "backends take float32)",
                          dtype_name(p.dtype));
  if (p.head_dim_v != p.head_dim)
    return FA_UNSUPPORTED("v_cache: head dim Dv = %d must equal q's D = %d on the cuda backend", p.head_dim_v, p.head_dim);
  if (p.head_dim % 8 != 0)
    return FA_UNSUPPORTED("q: head dim %d must be a multiple of 8 on the cuda backend (rows move in 16-byte chunks)",
                          p.head_dim);
  // cache_batch_idx runs as paged blocks of S_cache rows (validate.cpp); blocks that are not a power of two >= 16 take
  // the per-row block ids, 0.41-0.65x of the contiguous call (H200, 2026-12-04 15:12 UTC, S_cache 1000 and 8000):
  // refused instead of slow.
  const bool pow2_block = p.page_block_size >= 16 && (p.page_block_size & (p.page_block_size - 1)) == 0;
  if (p.block_table_is_batch_idx && !pow2_block)
    return FA_UNSUPPORTED("cache_batch_idx: on the cuda backend k_cache's dimension 1 (S_cache) must be a power of two "
                          ">= 16, got %d (the cache runs as paged blocks of S_cache rows; other sizes would take the "
                          "slow per-row block path). Allocate a power-of-two capacity, or pass the cache as paged blocks "
                          "with block_table",
                          p.page_block_size);
  // cache_leftpad: contiguous caches only, through a kernel instantiation of their own (decode_kernel.cuh, kLeftPad).
  // Paged ones would take a fourth instantiation per config (build time) for a pair flash_attn refuses everywhere.
  if (p.cache_leftpad != nullptr && p.block_table != nullptr)
    return FA_UNSUPPORTED("cache_leftpad: on the cuda backend with a contiguous cache only, not with %s (flash_attn "
                          "refuses the pair too); the cpu backends take both",
                          p.block_table_is_batch_idx ? "cache_batch_idx, which runs as a paged cache" : "block_table");
  if (p.dropout_p > 0.f)
    return FA_UNSUPPORTED("options.dropout_p: the cuda kvcache (decode) kernels do not implement dropout (got p = %g); "
                          "use p = 0, or a cpu backend",
                          double(p.dropout_p));
  if (p.heads_k > kMaxGridYZ)
    return FA_UNSUPPORTED("k_cache: %d K/V heads exceed the cuda kvcache limit of %lld", p.heads_k, (long long)kMaxGridYZ);
  if (p.batch > kMaxGridYZ)
    return FA_UNSUPPORTED("q: batch %d exceeds the cuda kvcache limit of %lld", p.batch, (long long)kMaxGridYZ);
  if (int64_t(p.heads_q / p.heads_k) * p.seqlen_q > INT_MAX / 2)
    return FA_UNSUPPORTED("q: Sq * Hq / Hk = %lld rows per K/V head exceed the cuda kvcache limit",
                          (long long)(int64_t(p.heads_q / p.heads_k) * p.seqlen_q));
  const bool fp8_cache = p.kv_dtype == FA_FLOAT8_E4M3;
  if (fp8_cache && p.head_dim % 16 != 0)
    return FA_UNSUPPORTED("k_cache: head dim %d must be a multiple of 16 with a float8_e4m3 cache on the cuda backend (rows "
                          "move in 16-byte chunks of 16 elements)",
                          p.head_dim);
  const int64_t cache_element_bytes = fp8_cache ? 1 : 2;
  const bool paged = p.block_table != nullptr;
  const int64_t cache_batches = paged ? p.num_blocks : p.batch;
  const int64_t cache_rows = paged ? p.page_block_size : p.seqlen_k;
  FA_RETURN_IF_ERROR(check_alignment({"q", p.q, {p.q_batch_stride, p.q_row_stride, p.q_head_stride}, {p.batch, p.seqlen_q, p.heads_q}}));
  FA_RETURN_IF_ERROR(
      check_alignment({"out", p.out, {p.out_batch_stride, p.out_row_stride, p.out_head_stride}, {p.batch, p.seqlen_q, p.heads_q}}));
  FA_RETURN_IF_ERROR(check_alignment(
      {"k_cache", p.k, {p.k_batch_stride, p.k_row_stride, p.k_head_stride}, {cache_batches, cache_rows, p.heads_k}, cache_element_bytes}));
  FA_RETURN_IF_ERROR(check_alignment(
      {"v_cache", p.v, {p.v_batch_stride, p.v_row_stride, p.v_head_stride}, {cache_batches, cache_rows, p.heads_k}, cache_element_bytes}));
  if (p.k_new != nullptr) {
    FA_RETURN_IF_ERROR(check_alignment({"k_new", p.k_new, {p.k_new_batch_stride, p.k_new_row_stride, p.k_new_head_stride},
                                        {p.batch, p.seqlen_new, p.heads_k}}));
    FA_RETURN_IF_ERROR(check_alignment({"v_new", p.v_new, {p.v_new_batch_stride, p.v_new_row_stride, p.v_new_head_stride},
                                        {p.batch, p.seqlen_new, p.heads_k}}));
  }
  return Status();
}

Status check_kvcache_append_support(const KvcacheParams& p, int64_t total_new) {
  if (p.dtype != FA_FLOAT16 && p.dtype != FA_BFLOAT16)
    return FA_UNSUPPORTED("k_new: dtype %s is not supported by the cuda append kernel (float16 and bfloat16, into a cache "
                          "of that dtype or a float8_e4m3 one; the cpu backends take float32)",
                          dtype_name(p.dtype));
  if (p.head_dim_v != p.head_dim)
    return FA_UNSUPPORTED("v_cache: head dim Dv = %d must equal k_cache's D = %d on the cuda backend", p.head_dim_v, p.head_dim);
  const bool fp8_cache = p.kv_dtype == FA_FLOAT8_E4M3;
  if (p.head_dim % (fp8_cache ? 16 : 8) != 0)
    return FA_UNSUPPORTED("k_cache: head dim %d must be a multiple of %d on the cuda backend (rows move in 16-byte chunks)",
                          p.head_dim, fp8_cache ? 16 : 8);
  const int64_t cache_element_bytes = fp8_cache ? 1 : 2;
  const bool paged = p.block_table != nullptr;
  const int64_t cache_batches = paged ? p.num_blocks : p.batch;
  const int64_t cache_rows = paged ? p.page_block_size : p.seqlen_k;
  FA_RETURN_IF_ERROR(check_alignment(
      {"k_cache", p.k, {p.k_batch_stride, p.k_row_stride, p.k_head_stride}, {cache_batches, cache_rows, p.heads_k}, cache_element_bytes}));
  FA_RETURN_IF_ERROR(check_alignment(
      {"v_cache", p.v, {p.v_batch_stride, p.v_row_stride, p.v_head_stride}, {cache_batches, cache_rows, p.heads_k}, cache_element_bytes}));
  FA_RETURN_IF_ERROR(check_alignment({"k_new", p.k_new, {0, p.k_new_row_stride, p.k_new_head_stride}, {1, total_new, p.heads_k}}));
  FA_RETURN_IF_ERROR(check_alignment({"v_new", p.v_new, {0, p.v_new_row_stride, p.v_new_head_stride}, {1, total_new, p.heads_k}}));
  return Status();
}

int ctas_per_sm(int64_t smem_bytes, int threads, const DecodeDevice& device) {
  constexpr int64_t kReservedSmemPerCta = 1024;  // the runtime reserves 1 KiB of shared memory per CTA
  constexpr int kMaxThreadsPerSm = 2048;
  int64_t by_smem = device.smem_per_sm > 0 ? device.smem_per_sm / (smem_bytes + kReservedSmemPerCta) : 1;
  const int64_t by_threads = kMaxThreadsPerSm / std::max(threads, 1);
  return int(std::max<int64_t>(1, std::min<int64_t>({by_smem, by_threads, kMaxCtasPerSm})));
}

int choose_num_splits(int64_t ctas, int64_t slots, int64_t capacity_tiles) {
  if (ctas <= 0 || slots <= 0) return 1;
  if (double(ctas) >= kFullOccupancy * double(slots)) return 1;
  const int64_t by_length = capacity_tiles / kMinTilesPerSplit;
  const int max_splits = int(std::min<int64_t>(ctas == 1 ? kMaxSplitsOneCta : kMaxSplits, std::max<int64_t>(1, by_length)));
  auto efficiency = [&](int s) { return wave_efficiency(ctas, s, slots); };
  double best = 0;
  for (int s = 1; s <= max_splits; ++s) best = std::max(best, efficiency(s));
  int chosen = 1;
  for (int s = 1; s <= max_splits; ++s)
    if (efficiency(s) >= kWaveEfficiencyKept * best) {
      chosen = s;
      break;
    }
  // Splits that would get no tile of the capacity (split_work gives each ceil(tiles / s): 31 splits of 64 tiles take
  // 3 each, 22 splits' worth, 9 empty): the next count at which every split has tiles, where it needs no more waves;
  // else as many splits as get tiles (the same partition, without the empty CTAs). Affects speed only. H200,
  // 2026-12-01 16:33 UTC, bf16, D = 128, against the rule before, 2 runs each alternating
  // (bench/results/2026-12-01-1633-h200-decode-split-rule-ab-summary.txt): 8 query heads / 1 K/V head, B = 1 / 4k 31 ->
  // 32 splits +11.4% contiguous, +12.5% paged, B = 2 / 4k +5.2% / +8.6%, B = 4 / 4k +1-2%, paged B = 2 / 64k 123 -> 128
  // +7.7%, but paged B = 1 / 16k 123 -> 128 -5.2% (9.79 -> 10.33 us; contiguous +0.1%); 28 / 4, B = 1 / 4k +2%; every
  // other point of B = 1-4 x 4k-64k (8 / 1, 28 / 4, 32 / 8) within 1.1%, the shape (32 / 8) unchanged.
  const auto tiles_used = [&](int s) {  // split_work over the capacity's tiles (one "key" per tile)
    return split_work(0, int(std::min<int64_t>(capacity_tiles, INT_MAX)), 1, s, kMinTilesPerSplit, 0).used;
  };
  const auto waves = [&](int64_t s) { return (ctas * s + slots - 1) / slots; };
  if (capacity_tiles <= 0 || tiles_used(chosen) >= chosen) return chosen;
  for (int s = chosen + 1; s <= max_splits; ++s)
    if (tiles_used(s) == s) {
      if (waves(s) == waves(chosen)) return s;
      break;
    }
  return tiles_used(chosen);
}

int slot_wave_splits(int64_t ctas, int64_t slots, int64_t capacity_keys, int64_t min_split_keys) {
  if (ctas <= 0 || slots <= 0) return 1;
  auto allowed = [&](int s) { return s == 1 || capacity_keys >= min_split_keys * s; };
  double best = 0;
  for (const int s : kSlotWaveSplitCounts)
    if (allowed(s)) best = std::max(best, wave_efficiency(ctas, s, slots));
  for (const int s : kSlotWaveSplitCounts)
    if (allowed(s) && wave_efficiency(ctas, s, slots) >= kWaveEfficiencyKept * best) return s;
  return 1;
}

int many_waves_splits(int64_t ctas, int64_t slots, int64_t capacity_keys) {
  if (ctas <= 0 || slots <= 0 || double(ctas) < kManyWavesMinWaves * double(slots)) return 1;
  const int64_t by_waves = kManyWavesTarget * slots / ctas;
  const int64_t by_length = capacity_keys / kManyWavesMinSplitKeys;
  return int(std::max<int64_t>(1, std::min<int64_t>({by_waves, by_length, kMaxSplits})));
}

DecodePlan decode_layout(const KvcacheParams& p, int block_m, int block_n, int num_splits) {
  DecodePlan plan;
  plan.block_m = block_m;
  plan.block_n = block_n;
  plan.m_blocks = int(row_blocks(p, block_m));
  plan.num_splits = num_splits < 1 ? 1 : num_splits;
  plan.partial_rows = int64_t(p.batch) * p.heads_q * p.seqlen_q;
  if (plan.num_splits > 1 && plan.partial_rows > 0) {
    plan.lse_bytes = align_up(plan.num_splits * plan.partial_rows * int64_t(sizeof(float)), kWorkspaceAlignment);
    plan.out_bytes = plan.num_splits * plan.partial_rows * p.head_dim_v * int64_t(sizeof(float));
    plan.workspace_bytes = kWorkspaceAlignment + plan.lse_bytes + plan.out_bytes;
  }
  return plan;
}

namespace {
// Whether a paged cache's blocks are runs of rows (the usual [num_blocks, block, Hk, D] layout): DecodeArgs::paged_rows.
bool blocks_are_row_runs(const KvcacheParams& p) {
  return p.block_table != nullptr && p.k_batch_stride == int64_t(p.page_block_size) * p.k_row_stride &&
         p.v_batch_stride == int64_t(p.page_block_size) * p.v_row_stride && int64_t(p.num_blocks) * p.page_block_size <= INT32_MAX;
}
// Whether the kernel streams this cache with its lean paged copies: the plan's copy of decode_kernel.cuh's lean_paged
// (kLeanPagedTile: 16-bit, 64-key tiles; slot ids: blocks of a power of two >= 16; paged_rows; full-width heads; byte
// strides below 2^31). Keep the two in step: a cache the plan counts as lean but the kernel does not still runs
// correctly, at the contiguous split counts, which the other paged copies were not measured with.
bool lean_paged_copies(const KvcacheParams& p, const KernelEntry& kernel) {
  constexpr int64_t kElementBytes = 2;
  const bool strides_32bit = p.k_row_stride * kElementBytes <= INT32_MAX && p.v_row_stride * kElementBytes <= INT32_MAX &&
                             p.k_batch_stride * kElementBytes <= INT32_MAX && p.v_batch_stride * kElementBytes <= INT32_MAX;
  return p.block_table != nullptr && p.kv_dtype != FA_FLOAT8_E4M3 && kernel.block_n == 64 && p.page_block_size >= 16 &&
         (p.page_block_size & (p.page_block_size - 1)) == 0 && blocks_are_row_runs(p) && p.head_dim == kernel.head_dim &&
         strides_32bit;
}
}  // namespace

Status make_decode_plan(const KvcacheParams& p, const KernelEntry& kernel, const DecodeDevice& device, DecodePlan* plan) {
  const int64_t m_blocks = row_blocks(p, kernel.block_m);
  int splits = p.num_splits;
  if (splits <= 0) {
    const int64_t ctas = unsplit_ctas(p, kernel.block_m);
    const bool paged = p.block_table != nullptr;
    const int per_sm = ctas_per_sm(kernel.smem_bytes, 32 * kernel.warps, device);
    const int64_t capacity_tiles = (int64_t(p.seqlen_k) + kernel.block_n - 1) / kernel.block_n;
    // CTAs per SM of the unsplit grid (decode_plan.hpp): between one per SM and many waves, the slot waves
    // (slot_wave_splits); every slot for paged caches that may hold long sequences; about one wave: 1 split, or 2
    // for medium paged caches, or 4 in its lower part for paged 16-bit ones and for tiles of one CTA per SM, or 8 for
    // long contiguous FP8 ones; just below that, the slot waves again; else about one CTA per SM.
    const double fill = double(ctas) / double(device.sm_count);
    const int64_t slots = int64_t(device.sm_count) * per_sm;
    const bool sixteen_bit = p.kv_dtype != FA_FLOAT8_E4M3;
    // Paged caches that the kernel streams with its lean copies (lean_paged_copies above) take the contiguous cache's
    // split counts; the paged rules below (every CTA slot, 2 splits at one wave) are for the other paged caches.
    const bool paged_slot_rules = paged && !lean_paged_copies(p, kernel);
    const int full_slots_splits = paged_slot_rules ? choose_num_splits(ctas, slots, capacity_tiles) : 1;
    if (fill > 1.0 && double(ctas) < kManyWavesMinWaves * double(slots)) {
      splits = slot_wave_splits(ctas, slots, p.seqlen_k, kBalancedMinSplitKeys);  // between one CTA per SM and many waves
    } else if (paged_slot_rules && p.seqlen_k >= kPagedFullSlotsKeys) {
      splits = full_slots_splits;
    } else if (fill >= kOneWaveFill && fill <= 1.0) {
      // (contiguous 16-bit caches in the lower part take the long tile's 4 splits in the selection:
      // wants_one_wave_long_tile)
      const bool two_fit = per_sm >= 2 && capacity_tiles >= 2 * kMinTilesPerSplit;
      // contiguous FP8: the shortest cache that takes kFp8ContiguousOneWaveSplits at this fill
      const int64_t fp8_split_keys = fill <= kFp8ContiguousShortSplitMaxFill ? kFp8ContiguousShortSplitKeys : kFp8ContiguousOneWaveSplitKeys;
      if (paged && sixteen_bit && device.sm_major >= 9 && per_sm == 2 && p.seqlen_k >= kOneWaveFourSplitsMinKeys &&
          fill <= kOneWaveFourSplitsPagedFill)
        splits = kOneWaveFourSplits;
      else if (sixteen_bit && device.sm_major >= 9 && per_sm == 1 && p.seqlen_k >= kOneWaveOneSlotMinKeys &&
               fill <= kOneWaveLongTileFill)
        splits = kOneWaveFourSplits;  // a tile of one CTA per SM (D = 256), either layout
      else if (paged_slot_rules && two_fit && p.seqlen_k >= (sixteen_bit ? kPagedOneWaveSplitKeys : kFp8PagedOneWaveSplitKeys))
        splits = 2;
      else if (!paged && !sixteen_bit && per_sm >= 2 && fill <= kFp8ContiguousOneWaveMaxFill && p.seqlen_k >= fp8_split_keys)
        splits = kFp8ContiguousOneWaveSplits;  // long contiguous FP8 caches, up to 0.8 of the SMs (16k-32k: 0.75)
      else
        splits = 1;
    } else if (per_sm >= 2 && fill > kBelowWaveMinFill && fill < kOneWaveFill && p.seqlen_k >= kBelowWaveMinKeys) {
      splits = slot_wave_splits(ctas, slots, p.seqlen_k, kBelowWaveMinSplitKeys);  // just below one wave
    } else if (paged_slot_rules && p.seqlen_k >= kPagedOneWaveSplitKeys && p.seqlen_k >= kPagedFullSlotsMinSplitKeys * full_slots_splits) {
      splits = full_slots_splits;  // below one wave, medium paged caches: every slot where the splits stay long enough
    } else {
      // Many waves of a contiguous 16-bit cache may still split (many_waves_splits); else the heuristic (which
      // leaves a grid of many waves unsplit).
      splits = !paged && p.kv_dtype != FA_FLOAT8_E4M3 ? many_waves_splits(ctas, slots, p.seqlen_k) : 1;
      if (splits == 1) splits = choose_num_splits(ctas, device.sm_count, capacity_tiles);
    }
  }
  if (m_blocks * splits > INT_MAX)
    return FA_UNSUPPORTED("num_splits: %d splits x %lld row blocks exceed CUDA's grid limit", splits, (long long)m_blocks);
  *plan = decode_layout(p, kernel.block_m, kernel.block_n, splits);
  return Status();
}

namespace {
std::atomic<int> g_speculation_for_tests{-1};  // set_speculation_for_tests
}  // namespace

void set_speculation_for_tests(int mode) { g_speculation_for_tests.store(mode, std::memory_order_relaxed); }

int64_t route_cache_bytes(const KvcacheParams& p) {
  return int64_t(p.batch) * p.seqlen_k * p.heads_k * (p.head_dim + p.head_dim_v) * dtype_size(p.kv_dtype);
}

int forward_route_min_rows(const KvcacheParams& p) {
  // Beyond L2, a call whose forward packs reads each K/V tile once per packed tile, the decode kernels once per 16-row
  // m-block (decode_plan.hpp).
  if (!sm80::gqa_packing_allowed(p)) return kForwardRouteMinRows;
  const int64_t bytes = route_cache_bytes(p);
  return bytes >= kLongCacheRouteMinBytes ? kLongCacheRouteMinRows
         : bytes >= kL2CacheRouteMinBytes ? kL2CacheRouteMinRows
                                          : kForwardRouteMinRows;
}

int short_call_max_q(int heads_q, int heads_k, bool paged) {
  const int group = heads_q / heads_k;
  return std::max(1, std::min(kShortSequencePackedRows, (paged ? kShortPagedCallPackedRows : kShortCallPackedRows) / group));
}

int short_sequence_max_q(const AttentionParams& p) {
  if (p.dropout_p > 0.f || p.seqlen_q < 1 || p.batch < 1 || p.heads_k < 1) return 0;
  const int group = p.heads_q / p.heads_k;
  const int max_q = std::min(std::max(1, kShortSequencePackedRows / group), p.seqlen_q);
  // Not varlen (dense or paged K/V, every sequence Sq rows): all or nothing, in place (uniform_short_sequences).
  if (!p.is_varlen())
    return p.cu_seqlens_k == nullptr && p.seqlen_q <= short_call_max_q(p.heads_q, p.heads_k, p.is_paged()) ? p.seqlen_q : 0;
  if (!p.is_paged()) return 0;  // varlen dense K/V: sequence b's keys start at cu_seqlens_k[b], no cache's batch stride
  // Some sequence has at most max_q rows only if the other B - 1 (each at most max_seqlen_q) leave it room.
  if (int64_t(p.varlen_total_q) > int64_t(p.batch - 1) * p.seqlen_q + max_q) return 0;
  return max_q;
}

int routed_sequences_bound(const AttentionParams& p, int max_q) {
  const int64_t batch = p.batch, longest = p.seqlen_q;  // varlen: seqlen_q is max_seqlen_q
  if (batch < 1 || max_q < 1 || longest <= max_q) return p.batch < 1 ? 1 : p.batch;
  const int64_t excess = int64_t(p.varlen_total_q) - batch * max_q;  // rows beyond T per sequence, all of the longer ones'
  const int64_t longer = excess <= 0 ? 0 : (excess + (longest - max_q) - 1) / (longest - max_q);
  return int(std::max<int64_t>(1, batch - longer));
}

namespace {
// The forward's cache, heads, scale, mask, softcap, ALiBi and stream as a fa_kvcache-shaped call over `cache_seqlens`
// key counts: no varlen indices, no append, rotary, left padding or index checks; num_splits 0 (planned).
KvcacheParams decode_call_of(const AttentionParams& p, const int32_t* cache_seqlens) {
  KvcacheParams kv{};
  static_cast<AttentionParams&>(kv) = p;
  kv.routed_seqlen_q = 0;
  kv.cu_seqlens_q = nullptr;
  kv.cu_seqlens_k = nullptr;
  kv.seqused_k = nullptr;
  kv.cache_seqlens = cache_seqlens;
  kv.stats = nullptr;
  return kv;
}
}  // namespace

KvcacheParams short_sequence_call(const AttentionParams& p, int max_q, void* q, void* out, float* lse,
                                  const int32_t* cache_seqlens) {
  KvcacheParams kv = decode_call_of(p, cache_seqlens);
  kv.seqlen_q = max_q;
  kv.q = q;
  kv.q_head_stride = p.head_dim;
  kv.q_row_stride = int64_t(p.heads_q) * p.head_dim;
  kv.q_batch_stride = int64_t(max_q) * kv.q_row_stride;
  kv.out = out;
  kv.out_head_stride = p.head_dim_v;
  kv.out_row_stride = int64_t(p.heads_q) * p.head_dim_v;
  kv.out_batch_stride = int64_t(max_q) * kv.out_row_stride;
  kv.lse = lse;
  kv.lse_row_stride = 1;
  kv.lse_head_stride = max_q;
  kv.lse_batch_stride = int64_t(p.heads_q) * max_q;
  return kv;
}

KvcacheParams varlen_rows_call(const AttentionParams& p, int max_q, const int32_t* cache_seqlens) {
  KvcacheParams kv = decode_call_of(p, cache_seqlens);  // q / out / lse and their row and head strides: the forward's
  kv.seqlen_q = max_q;
  kv.cu_seqlens_q = p.cu_seqlens_q;
  kv.q_batch_stride = 0;
  kv.out_batch_stride = 0;
  kv.lse_batch_stride = 0;
  return kv;
}

bool uniform_short_sequences(const AttentionParams& p, int max_q) {
  return max_q > 0 && p.seqlen_q <= max_q && (!p.is_varlen() || int64_t(p.varlen_total_q) == int64_t(p.batch) * p.seqlen_q);
}

KvcacheParams uniform_sequence_call(const AttentionParams& p, const int32_t* cache_seqlens) {
  KvcacheParams kv = decode_call_of(p, cache_seqlens);
  if (!p.is_varlen()) return kv;  // (B, Sq, ...) tensors with the forward's own batch strides
  kv.q_batch_stride = p.seqlen_q * p.q_row_stride;  // varlen rows: sequence b's S rows start at row b x S
  kv.out_batch_stride = p.seqlen_q * p.out_row_stride;
  kv.lse_batch_stride = p.seqlen_q * p.lse_row_stride;  // varlen lse (Hq, total_q): the row stride steps a row
  return kv;
}

DecodeArgs make_decode_args(const KvcacheParams& p, const DecodePlan& plan, void* workspace) {
  DecodeArgs a{};
  a.p = p;
  a.p.num_splits = plan.num_splits;
  a.group = p.heads_q / p.heads_k;
  a.packed_rows = a.group * p.seqlen_q;
  a.block_m = plan.block_m;
  a.block_n = plan.block_n;
  a.m_blocks = plan.m_blocks;
  a.num_splits = plan.num_splits;
  a.min_tiles_per_split = kMinTilesPerSplit;
  a.page_shift = -1;
  a.programmatic_launch = 0;  // the launcher turns these on where the device supports them
  a.cluster_merge = 0;
  a.early_tiles = kEarlyTiles ? 1 : 0;
  a.prefetch_inputs = kPrefetchInputs ? 1 : 0;
  const int forced = g_speculation_for_tests.load(std::memory_order_relaxed);
  a.speculative_tiles = forced >= 0 ? forced : (kSpeculativeTiles ? 1 : 0);
  if (p.block_table != nullptr && (p.page_block_size & (p.page_block_size - 1)) == 0) {
    a.page_shift = 0;
    while ((1 << a.page_shift) < p.page_block_size) ++a.page_shift;
  }
  a.paged_rows = blocks_are_row_runs(p);
  if (plan.workspace_bytes > 0 && workspace != nullptr) {
    const auto address = reinterpret_cast<uintptr_t>(workspace);
    char* aligned = static_cast<char*>(workspace) + (kWorkspaceAlignment - address % kWorkspaceAlignment) % kWorkspaceAlignment;
    a.partial_lse = reinterpret_cast<float*>(aligned);
    a.partial_out = reinterpret_cast<float*>(aligned + plan.lse_bytes);
  }
  return a;
}

}  // namespace flashattn::cuda::decode
