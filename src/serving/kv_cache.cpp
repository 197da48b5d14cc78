// The paged KV-cache manager (include/flashattn/kv_cache.hpp): block allocator, sequences, fork and
// copy-on-write, and the index tensors of one fa_kvcache call. Host code; the only device work is
// memory (allocation, uploads of the index tensors, copy-on-write copies), through the CUDA runtime
// when the pool lives on a GPU (FLASHATTN_WITH_CUDA builds only).
//
// The bookkeeping in one picture (block_size 4, sequence A of 6 tokens forked into B):
//   A.blocks = [7, 2]   ref_counts[7] = 2, ref_counts[2] = 2   rows of block 2: a4 a5 .. ..
//   B.blocks = [7, 2]
// reserve({B}, 1): block 2 is shared and B would write its row 2, so B first gets a fresh block 5
// holding copies of rows 0..1 of block 2 (B.blocks = [7, 5], ref_counts[2] = 1); then A may write
// row 2 of block 2 in place. Full shared blocks (block 7) are never written, so never copied.
#include "flashattn/kv_cache.hpp"

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstring>
#include <limits>
#include <new>
#include <set>
#include <utility>

#include "core/dtype.hpp"
#include "core/status.hpp"

#if defined(FLASHATTN_WITH_CUDA)
#include <cuda_runtime.h>

#include "cuda/common/check.hpp"
#endif

namespace flashattn {
namespace {

// cache_seqlens and block_table are int32: no sequence may hold more tokens than this.
constexpr int64_t kMaxTokens = std::numeric_limits<int32_t>::max();
// CPU allocations start on a cache line (the CPU backend's vector loads prefer it; any works).
constexpr size_t kCpuAlignment = 64;
// 0xFF in every byte is a NaN in float32, float16 and bfloat16 alike (exponent all ones, mantissa != 0).
constexpr uint8_t kNanByte = 0xFF;

#if defined(FLASHATTN_WITH_CUDA)
// Makes `device` current for a scope and restores the caller's device afterwards.
class CudaDeviceScope {
 public:
  explicit CudaDeviceScope(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ != device) status_ = cudaSetDevice(device);
  }
  ~CudaDeviceScope() {
    if (previous_ >= 0 && status_ == cudaSuccess) cudaSetDevice(previous_);
  }
  cudaError_t status() const { return status_; }

 private:
  int previous_ = -1;
  cudaError_t status_ = cudaSuccess;
};
#endif

#if !defined(FLASHATTN_WITH_CUDA)
Status not_compiled(const char* what) {
  return error(FA_ERROR_NOT_COMPILED, "%s: device is CUDA but this build of flashattn has no CUDA support "
                                      "(configure with -DFLASHATTN_CUDA=ON and a CUDA toolkit)", what);
}
#endif

Status check_range(const char* call, int64_t offset, int64_t bytes, int64_t size) {
  if (offset < 0 || bytes < 0 || offset > size || bytes > size - offset)
    return error(FA_ERROR_INVALID_ARGUMENT, "DeviceBuffer::%s: bytes [%" PRId64 ", %" PRId64 ") are outside the buffer of %" PRId64
                 " bytes", call, offset, offset + bytes, size);
  return Status();
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// DeviceBuffer

DeviceBuffer::~DeviceBuffer() { release(); }

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept { *this = std::move(other); }

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    release();
    data_ = other.data_;
    bytes_ = other.bytes_;
    device_ = other.device_;
    device_id_ = other.device_id_;
    other.data_ = nullptr;
    other.bytes_ = 0;
  }
  return *this;
}

void DeviceBuffer::release() {
  if (data_ != nullptr) {
    if (device_ == FA_DEVICE_CPU) {
      ::operator delete(data_, std::align_val_t(kCpuAlignment));
    } else {
#if defined(FLASHATTN_WITH_CUDA)
      CudaDeviceScope scope(device_id_);
      cudaFree(data_);  // a failure here has no one to report to; the context is gone anyway
#endif
    }
  }
  data_ = nullptr;
  bytes_ = 0;
}

Status DeviceBuffer::allocate(int64_t bytes, fa_device_kind device, int device_id) {
  release();
  if (bytes < 0) return error(FA_ERROR_INVALID_ARGUMENT, "DeviceBuffer::allocate: bytes must be >= 0, got %" PRId64, bytes);
  device_ = device;
  device_id_ = device_id;
  if (bytes == 0) return Status();
  if (device == FA_DEVICE_CPU) {
    data_ = ::operator new(size_t(bytes), std::align_val_t(kCpuAlignment), std::nothrow);
    if (data_ == nullptr)
      return error(FA_ERROR_OUT_OF_MEMORY, "DeviceBuffer::allocate: %" PRId64 " bytes of host memory are not available", bytes);
  } else {
#if defined(FLASHATTN_WITH_CUDA)
    CudaDeviceScope scope(device_id);
    FA_CUDA_RETURN_IF_ERROR(scope.status());
    FA_CUDA_RETURN_IF_ERROR(cudaMalloc(&data_, size_t(bytes)));
#else
    return not_compiled("DeviceBuffer::allocate");
#endif
  }
  bytes_ = bytes;
  return Status();
}

Status DeviceBuffer::ensure(int64_t bytes, fa_device_kind device, int device_id) {
  if (data_ != nullptr && bytes <= bytes_ && device == device_ && device_id == device_id_) return Status();
  return allocate(bytes, device, device_id);
}

Status DeviceBuffer::upload(const void* host, int64_t bytes, int64_t offset, void* stream) {
  FA_RETURN_IF_ERROR(check_range("upload", offset, bytes, bytes_));
  if (bytes == 0) return Status();
  char* dst = static_cast<char*>(data_) + offset;
  if (device_ == FA_DEVICE_CPU) {
    std::memcpy(dst, host, size_t(bytes));
    return Status();
  }
#if defined(FLASHATTN_WITH_CUDA)
  CudaDeviceScope scope(device_id_);
  FA_CUDA_RETURN_IF_ERROR(scope.status());
  // From pageable host memory the runtime stages the bytes before returning, so `host` may be
  // reused at once; the copy itself is ordered on `stream` before the kernels that read it.
  FA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, host, size_t(bytes), cudaMemcpyHostToDevice, static_cast<cudaStream_t>(stream)));
  return Status();
#else
  return not_compiled("DeviceBuffer::upload");
#endif
}

Status DeviceBuffer::download(void* host, int64_t bytes, int64_t offset, void* stream) const {
  FA_RETURN_IF_ERROR(check_range("download", offset, bytes, bytes_));
  if (bytes == 0) return Status();
  const char* src = static_cast<const char*>(data_) + offset;
  if (device_ == FA_DEVICE_CPU) {
    std::memcpy(host, src, size_t(bytes));
    return Status();
  }
#if defined(FLASHATTN_WITH_CUDA)
  CudaDeviceScope scope(device_id_);
  FA_CUDA_RETURN_IF_ERROR(scope.status());
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  FA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host, src, size_t(bytes), cudaMemcpyDeviceToHost, s));
  FA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));  // the caller reads `host` next
  return Status();
#else
  return not_compiled("DeviceBuffer::download");
#endif
}

Status DeviceBuffer::copy_within(int64_t dst_offset, int64_t src_offset, int64_t bytes, void* stream) {
  FA_RETURN_IF_ERROR(check_range("copy_within", dst_offset, bytes, bytes_));
  FA_RETURN_IF_ERROR(check_range("copy_within", src_offset, bytes, bytes_));
  if (bytes == 0) return Status();
  if (std::max(dst_offset, src_offset) < std::min(dst_offset, src_offset) + bytes)
    return error(FA_ERROR_INVALID_ARGUMENT, "DeviceBuffer::copy_within: ranges at %" PRId64 " and %" PRId64 " of %" PRId64
                 " bytes overlap", dst_offset, src_offset, bytes);
  char* base = static_cast<char*>(data_);
  if (device_ == FA_DEVICE_CPU) {
    std::memcpy(base + dst_offset, base + src_offset, size_t(bytes));
    return Status();
  }
#if defined(FLASHATTN_WITH_CUDA)
  CudaDeviceScope scope(device_id_);
  FA_CUDA_RETURN_IF_ERROR(scope.status());
  FA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(base + dst_offset, base + src_offset, size_t(bytes), cudaMemcpyDeviceToDevice,
                                          static_cast<cudaStream_t>(stream)));
  return Status();
#else
  return not_compiled("DeviceBuffer::copy_within");
#endif
}

Status DeviceBuffer::fill_bytes(uint8_t value, void* stream) {
  if (bytes_ == 0) return Status();
  if (device_ == FA_DEVICE_CPU) {
    std::memset(data_, value, size_t(bytes_));
    return Status();
  }
#if defined(FLASHATTN_WITH_CUDA)
  CudaDeviceScope scope(device_id_);
  FA_CUDA_RETURN_IF_ERROR(scope.status());
  FA_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(data_, value, size_t(bytes_), static_cast<cudaStream_t>(stream)));
  return Status();
#else
  return not_compiled("DeviceBuffer::fill_bytes");
#endif
}

// ---------------------------------------------------------------------------------------------
// KvcacheBatch

fa_kvcache_args KvcacheBatch::args() const {
  fa_kvcache_args a{};
  a.k_cache = k_cache;
  a.v_cache = v_cache;
  a.block_table = block_table;
  a.cache_seqlens = cache_seqlens;
  a.k_scale = k_scale;
  a.v_scale = v_scale;
  return a;
}

fa_kvcache_append_args KvcacheStep::append_args() const {
  fa_kvcache_append_args a{};
  a.k_cache = k_cache;
  a.v_cache = v_cache;
  a.block_table = block_table;
  a.cache_seqlens = cache_seqlens;
  a.cu_seqlens_new = cu_seqlens_new;
  a.max_seqlen_new = max_new;
  a.k_scale = k_scale;
  a.v_scale = v_scale;
  return a;
}

fa_forward_args KvcacheStep::forward_args() const {
  fa_forward_args a{};
  a.k = k_cache;
  a.v = v_cache;
  a.block_table = block_table;
  a.cu_seqlens_q = cu_seqlens_new;
  a.cu_seqlens_k = cu_seqlens_k;
  a.max_seqlen_q = max_new;
  a.max_seqlen_k = max_keys;
  return a;
}

// ---------------------------------------------------------------------------------------------
// PagedKvCache: creation and small helpers

Status PagedKvCache::create(const PagedKvCacheConfig& config, std::unique_ptr<PagedKvCache>* cache) {
  if (cache == nullptr) return error(FA_ERROR_INVALID_ARGUMENT, "PagedKvCache::create: cache must not be NULL");
  cache->reset();
  PagedKvCacheConfig c = config;
  if (c.head_dim_v == 0) c.head_dim_v = c.head_dim;
  auto invalid = [](const char* field, const char* rule, int64_t got) {
    return error(FA_ERROR_INVALID_ARGUMENT, "PagedKvCacheConfig.%s: %s, got %" PRId64, field, rule, got);
  };
  if (c.num_blocks < 1) return invalid("num_blocks", "must be >= 1", c.num_blocks);
  if (c.block_size < 1) return invalid("block_size", "must be >= 1", c.block_size);
  if (c.heads_k < 1) return invalid("heads_k", "must be >= 1", c.heads_k);
  if (c.head_dim < 1) return invalid("head_dim", "must be >= 1", c.head_dim);
  if (c.head_dim_v < 1) return invalid("head_dim_v", "must be >= 1 (or 0 for head_dim)", config.head_dim_v);
  if (c.dtype != FA_FLOAT32 && c.dtype != FA_FLOAT16 && c.dtype != FA_BFLOAT16 && c.dtype != FA_FLOAT8_E4M3)
    return error(FA_ERROR_INVALID_ARGUMENT,
                 "PagedKvCacheConfig.dtype: must be float32, float16, bfloat16 or float8_e4m3, got %s", dtype_name(c.dtype));
  for (const auto& [field, scale] : {std::pair<const char*, float>{"k_scale", c.k_scale}, {"v_scale", c.v_scale}}) {
    if (c.dtype == FA_FLOAT8_E4M3 && !(std::isfinite(scale) && scale > 0.f))
      return error(FA_ERROR_INVALID_ARGUMENT, "PagedKvCacheConfig.%s: must be finite and > 0 for a float8_e4m3 pool, got %g",
                   field, double(scale));
    if (c.dtype != FA_FLOAT8_E4M3 && scale != 0.f && scale != 1.f)
      return error(FA_ERROR_INVALID_ARGUMENT,
                   "PagedKvCacheConfig.%s: a %s pool has no scale (0 or 1, as fa_kvcache asks), got %g", field,
                   dtype_name(c.dtype), double(scale));
  }
  if (c.device == FA_DEVICE_CPU) {
    if (c.device_id != 0) return invalid("device_id", "must be 0 for the CPU", c.device_id);
  } else if (c.device == FA_DEVICE_CUDA) {
#if defined(FLASHATTN_WITH_CUDA)
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
    if (c.device_id < 0 || c.device_id >= count)
      return error(FA_ERROR_DEVICE, "PagedKvCacheConfig.device_id: CUDA device %d does not exist (%d visible)", c.device_id, count);
#else
    return not_compiled("PagedKvCacheConfig.device");
#endif
  } else {
    return invalid("device", "must be FA_DEVICE_CPU or FA_DEVICE_CUDA", int64_t(c.device));
  }
  // Pool bytes: num_blocks * block_size * Hk * max(D, Dv) * 2 bytes must fit in int64 comfortably.
  const int64_t tokens = int64_t(c.num_blocks) * c.block_size;
  const int64_t row_elems = int64_t(c.heads_k) * std::max(c.head_dim, c.head_dim_v);
  if (row_elems > (int64_t(1) << 40) / tokens)
    return error(FA_ERROR_INVALID_ARGUMENT, "PagedKvCacheConfig: num_blocks * block_size * heads_k * head_dim = %" PRId64 " * %" PRId64
                 " elements is beyond 2^40", tokens, row_elems);

  std::unique_ptr<PagedKvCache> made(new PagedKvCache());
  made->config_ = c;
  FA_RETURN_IF_ERROR(made->k_storage_.allocate(tokens * made->k_row_bytes(), c.device, c.device_id));
  FA_RETURN_IF_ERROR(made->v_storage_.allocate(tokens * made->v_row_bytes(), c.device, c.device_id));
  made->ref_counts_.assign(size_t(c.num_blocks), 0);
  // Free list popped from the back: block 0 is handed out first (easy to read in logs and tests).
  made->free_list_.resize(size_t(c.num_blocks));
  for (int n = 0; n < c.num_blocks; ++n) made->free_list_[size_t(n)] = c.num_blocks - 1 - n;
  *cache = std::move(made);
  return Status();
}

int PagedKvCache::blocks_for(int64_t tokens) const { return int((tokens + config_.block_size - 1) / config_.block_size); }
int64_t PagedKvCache::k_row_bytes() const { return int64_t(config_.heads_k) * config_.head_dim * dtype_size(config_.dtype); }
int64_t PagedKvCache::v_row_bytes() const { return int64_t(config_.heads_k) * config_.head_dim_v * dtype_size(config_.dtype); }

int32_t PagedKvCache::take_block() {
  const int32_t block = free_list_.back();
  free_list_.pop_back();
  ref_counts_[size_t(block)] = 1;
  return block;
}

void PagedKvCache::drop_block(int32_t block) {
  // A count that would go below 0 is a double free: leave it at 0 and keep it off the free list a
  // second time; check_invariants() reports the breach (it cannot arise through the public calls).
  int32_t& count = ref_counts_[size_t(block)];
  if (count <= 0) return;
  if (--count == 0) free_list_.push_back(block);
}

Status PagedKvCache::copy_block_rows(int32_t dst, int32_t src, int rows) {
  // Rows [0, rows) of a block are contiguous: (block_size, Hk, D) per block, row-major.
  const int64_t block_tokens = config_.block_size;
  FA_RETURN_IF_ERROR(k_storage_.copy_within(dst * block_tokens * k_row_bytes(), src * block_tokens * k_row_bytes(),
                                            rows * k_row_bytes(), stream_));
  return v_storage_.copy_within(dst * block_tokens * v_row_bytes(), src * block_tokens * v_row_bytes(), rows * v_row_bytes(),
                                stream_);
}

Tensor PagedKvCache::k_cache() const {
  const int64_t shape[4] = {config_.num_blocks, config_.block_size, config_.heads_k, config_.head_dim};
  return fa_tensor_contiguous(k_storage_.data(), 4, shape, config_.dtype, config_.device, config_.device_id);
}

Tensor PagedKvCache::v_cache() const {
  const int64_t shape[4] = {config_.num_blocks, config_.block_size, config_.heads_k, config_.head_dim_v};
  return fa_tensor_contiguous(v_storage_.data(), 4, shape, config_.dtype, config_.device, config_.device_id);
}

// ---------------------------------------------------------------------------------------------
// Sequences

namespace {

// Every id in `seqs` names a live sequence, and none appears twice (two entries of one call would
// write the same rows).
template <typename Map>
Status check_sequence_list(const char* call, const Map& sequences, const std::vector<SeqId>& seqs) {
  std::set<SeqId> seen;
  for (size_t n = 0; n < seqs.size(); ++n) {
    if (sequences.count(seqs[n]) == 0)
      return error(FA_ERROR_INVALID_ARGUMENT, "%s: seqs[%zu] = %" PRId64 " is not a live sequence (never added, or released)", call,
                   n, seqs[n]);
    if (!seen.insert(seqs[n]).second)
      return error(FA_ERROR_INVALID_ARGUMENT, "%s: seqs[%zu] = %" PRId64 " appears twice; each sequence may appear once per call",
                   call, n, seqs[n]);
  }
  return Status();
}

}  // namespace

SeqId PagedKvCache::add_sequence() {
  const SeqId id = next_id_++;
  sequences_[id] = Sequence{};
  return id;
}

Status PagedKvCache::fork(SeqId parent, SeqId* child) {
  if (child == nullptr) return error(FA_ERROR_INVALID_ARGUMENT, "fork: child must not be NULL");
  FA_RETURN_IF_ERROR(check_sequence_list("fork", sequences_, {parent}));
  const Sequence& source = sequences_.at(parent);
  if (source.pending != 0)
    return error(FA_ERROR_INVALID_ARGUMENT, "fork: sequence %" PRId64 " has %d pending tokens (reserve() without commit()); "
                 "commit or cancel them before forking", parent, source.pending);
  for (int32_t block : source.blocks) ++ref_counts_[size_t(block)];
  const SeqId id = next_id_++;
  Sequence copy = source;  // the same block ids, in the same order: the tokens are shared, not copied
  sequences_[id] = std::move(copy);
  *child = id;
  return Status();
}

Status PagedKvCache::release(SeqId seq) {
  FA_RETURN_IF_ERROR(check_sequence_list("release", sequences_, {seq}));
  for (int32_t block : sequences_.at(seq).blocks) drop_block(block);
  sequences_.erase(seq);
  return Status();
}

Status PagedKvCache::reserve(const std::vector<SeqId>& seqs, int new_tokens) {
  if (new_tokens < 0) return error(FA_ERROR_INVALID_ARGUMENT, "reserve: new_tokens must be >= 0, got %d", new_tokens);
  FA_RETURN_IF_ERROR(check_sequence_list("reserve", sequences_, seqs));

  // ---- plan: count blocks taken and given back; nothing changes until the count is known to fit ----
  // A sequence writes rows length .. length + new_tokens - 1. The only block of those that can be
  // shared is the partially filled last one (index length / block_size, when length % block_size
  // != 0): blocks past it are fresh. It needs a private copy while another sequence still holds it.
  // Several sequences of this call may share one such block: all but the last to come get a copy,
  // so the plan follows the counts as the copies would lower them.
  std::vector<bool> copies(seqs.size(), false);
  std::map<int32_t, int32_t> planned_counts;  // shared partial blocks: holders left after earlier copies
  int64_t new_blocks = 0, copy_blocks = 0, returned_blocks = 0;
  for (size_t n = 0; n < seqs.size(); ++n) {
    const Sequence& s = sequences_.at(seqs[n]);
    if (s.length + int64_t(new_tokens) > kMaxTokens)
      return error(FA_ERROR_INVALID_ARGUMENT, "reserve: sequence %" PRId64 " would hold %" PRId64 " tokens; cache_seqlens is int32 "
                   "(at most %" PRId64 ")", seqs[n], s.length + int64_t(new_tokens), kMaxTokens);
    const int64_t target = blocks_for(int64_t(s.length) + new_tokens);
    const int64_t held = int64_t(s.blocks.size());
    if (target > held) new_blocks += target - held;
    else returned_blocks += held - target;  // surplus pending blocks: private, empty
    if (new_tokens > 0 && s.length % config_.block_size != 0) {
      const int32_t partial = s.blocks[size_t(s.length / config_.block_size)];
      auto it = planned_counts.emplace(partial, ref_counts_[size_t(partial)]).first;
      if (it->second > 1) {
        copies[n] = true;
        --it->second;
        ++copy_blocks;
      }
    }
  }
  const int64_t available = int64_t(free_list_.size()) + returned_blocks;
  if (new_blocks + copy_blocks > available)
    return error(FA_ERROR_OUT_OF_MEMORY, "reserve: %zu sequence(s) taking %d token(s) each need %" PRId64 " free blocks (%" PRId64
                 " new, %" PRId64 " copy-on-write) but %" PRId64 " of %d are free; nothing was changed (release sequences, "
                 "or create a larger cache)", seqs.size(), new_tokens, new_blocks + copy_blocks, new_blocks, copy_blocks,
                 available, config_.num_blocks);

  // ---- apply. Pass 1: sequences that shrink give their surplus pending blocks back (so that pass 2
  // can use them). Pass 2: copies, then growth. After each sequence the invariants hold again. ----
  for (SeqId id : seqs) {
    Sequence& s = sequences_.at(id);
    const size_t target = size_t(blocks_for(int64_t(s.length) + new_tokens));
    if (target >= s.blocks.size()) continue;  // not shrinking: pass 2
    while (s.blocks.size() > target) {
      drop_block(s.blocks.back());
      s.blocks.pop_back();
    }
    s.pending = new_tokens;
  }
  for (size_t n = 0; n < seqs.size(); ++n) {
    Sequence& s = sequences_.at(seqs[n]);
    const size_t target = size_t(blocks_for(int64_t(s.length) + new_tokens));
    if (copies[n]) {
      // Copy the rows this sequence holds (0 .. length % block_size - 1) to a fresh block, then
      // swap it in. On a device error the fresh block goes back and this sequence is unchanged.
      const size_t index = size_t(s.length / config_.block_size);
      const int32_t shared = s.blocks[index];
      const int32_t fresh = take_block();
      const Status copied = copy_block_rows(fresh, shared, s.length % config_.block_size);
      if (!copied.ok()) {
        drop_block(fresh);
        return copied;  // earlier sequences of this call may already hold their (equal) copies
      }
      s.blocks[index] = fresh;
      drop_block(shared);  // still held by another sequence: the plan counted it > 1
      ++copies_made_;
    }
    while (s.blocks.size() < target) s.blocks.push_back(take_block());
    s.pending = new_tokens;
  }
  return Status();
}

Status PagedKvCache::commit(const std::vector<SeqId>& seqs) {
  FA_RETURN_IF_ERROR(check_sequence_list("commit", sequences_, seqs));
  for (SeqId id : seqs) {
    Sequence& s = sequences_.at(id);
    s.length += s.pending;
    s.pending = 0;
  }
  return Status();
}

Status PagedKvCache::make_batch(const std::vector<SeqId>& seqs, KvcacheBatch* batch) const {
  if (batch == nullptr) return error(FA_ERROR_INVALID_ARGUMENT, "make_batch: batch must not be NULL");
  if (seqs.empty()) return error(FA_ERROR_INVALID_ARGUMENT, "make_batch: seqs must name at least one sequence");
  FA_RETURN_IF_ERROR(check_sequence_list("make_batch", sequences_, seqs));
  const int new_tokens = sequences_.at(seqs[0]).pending;
  for (size_t n = 0; n < seqs.size(); ++n) {
    const Sequence& s = sequences_.at(seqs[n]);
    if (s.pending != new_tokens)
      return error(FA_ERROR_INVALID_ARGUMENT, "make_batch: seqs[%zu] = %" PRId64 " has %d pending tokens but seqs[0] = %" PRId64
                   " has %d; one fa_kvcache call appends the same number of rows (S_new) to every sequence, so reserve() "
                   "them together (or make_step: fa_kvcache_append + a varlen fa_forward)", n, seqs[n], s.pending, seqs[0],
                   new_tokens);
  }
  const int64_t b_count = int64_t(seqs.size());
  int max_blocks = 0;
  fill_table(seqs, &batch->block_table_host, &max_blocks, &batch->cache_seqlens_host);
  batch->batch = int(b_count);
  batch->new_tokens = new_tokens;
  batch->max_blocks = max_blocks;
  const int64_t table_bytes = b_count * int64_t(max_blocks) * int64_t(sizeof(int32_t));
  const int64_t seqlens_bytes = b_count * int64_t(sizeof(int32_t));
  FA_RETURN_IF_ERROR(batch->block_table_storage.ensure(table_bytes, config_.device, config_.device_id));
  FA_RETURN_IF_ERROR(batch->cache_seqlens_storage.ensure(seqlens_bytes, config_.device, config_.device_id));
  FA_RETURN_IF_ERROR(batch->block_table_storage.upload(batch->block_table_host.data(), table_bytes, 0, stream_));
  FA_RETURN_IF_ERROR(batch->cache_seqlens_storage.upload(batch->cache_seqlens_host.data(), seqlens_bytes, 0, stream_));
  const int64_t table_shape[2] = {b_count, int64_t(max_blocks)};
  batch->block_table = fa_tensor_contiguous(batch->block_table_storage.data(), 2, table_shape, FA_INT32, config_.device,
                                            config_.device_id);
  batch->cache_seqlens = fa_tensor_contiguous(batch->cache_seqlens_storage.data(), 1, &b_count, FA_INT32, config_.device,
                                              config_.device_id);
  batch->k_cache = k_cache();
  batch->v_cache = v_cache();
  batch->k_scale = config_.k_scale;
  batch->v_scale = config_.v_scale;
  return Status();
}

void PagedKvCache::fill_table(const std::vector<SeqId>& seqs, std::vector<int32_t>* table, int* max_blocks,
                              std::vector<int32_t>* lengths) const {
  size_t columns = 1;  // at least one column, even when every sequence is still empty
  for (SeqId id : seqs) columns = std::max(columns, sequences_.at(id).blocks.size());
  table->assign(seqs.size() * columns, 0);  // padding: block 0 (see the header)
  lengths->resize(seqs.size());
  for (size_t n = 0; n < seqs.size(); ++n) {
    const Sequence& s = sequences_.at(seqs[n]);
    std::copy(s.blocks.begin(), s.blocks.end(), table->begin() + int64_t(n * columns));
    (*lengths)[n] = s.length;  // BEFORE the step: the new rows go at this row
  }
  *max_blocks = int(columns);
}

Status PagedKvCache::make_step(const std::vector<SeqId>& seqs, KvcacheStep* step) const {
  if (step == nullptr) return error(FA_ERROR_INVALID_ARGUMENT, "make_step: step must not be NULL");
  if (seqs.empty()) return error(FA_ERROR_INVALID_ARGUMENT, "make_step: seqs must name at least one sequence");
  FA_RETURN_IF_ERROR(check_sequence_list("make_step", sequences_, seqs));
  const size_t b_count = seqs.size();
  fill_table(seqs, &step->block_table_host, &step->max_blocks, &step->cache_seqlens_host);
  step->cu_seqlens_new_host.assign(b_count + 1, 0);
  step->cu_seqlens_k_host.assign(b_count + 1, 0);
  step->max_new = step->max_keys = 0;
  for (size_t n = 0; n < b_count; ++n) {
    const Sequence& s = sequences_.at(seqs[n]);
    const int keys = s.length + s.pending;  // reserve() kept it within kMaxTokens: no int32 overflow
    if (int64_t(step->cu_seqlens_new_host[n]) + s.pending > kMaxTokens || int64_t(step->cu_seqlens_k_host[n]) + keys > kMaxTokens)
      return error(FA_ERROR_INVALID_ARGUMENT, "make_step: the %zu sequences hold more than %" PRId64 " rows together; "
                   "cu_seqlens is int32 (split the step)", b_count, kMaxTokens);
    step->cu_seqlens_new_host[n + 1] = step->cu_seqlens_new_host[n] + s.pending;
    step->cu_seqlens_k_host[n + 1] = step->cu_seqlens_k_host[n] + keys;
    step->max_new = std::max(step->max_new, s.pending);
    step->max_keys = std::max(step->max_keys, keys);
  }
  step->batch = int(b_count);
  step->total_new = step->cu_seqlens_new_host[b_count];
  // One upload of the four index tensors (int32 each, so every part stays 4-byte aligned).
  const int64_t b = int64_t(b_count), table_n = b * step->max_blocks;
  const int64_t entries = table_n + b + 2 * (b + 1);
  // (The packed copy lives in the step, as make_batch's host tables do: an asynchronous upload may read it later.)
  std::vector<int32_t>& packed = step->index_host;
  packed.clear();
  packed.reserve(size_t(entries));
  for (const std::vector<int32_t>* part :
       {&step->block_table_host, &step->cache_seqlens_host, &step->cu_seqlens_new_host, &step->cu_seqlens_k_host})
    packed.insert(packed.end(), part->begin(), part->end());
  const int64_t bytes = entries * int64_t(sizeof(int32_t));
  FA_RETURN_IF_ERROR(step->index_storage.ensure(bytes, config_.device, config_.device_id));
  FA_RETURN_IF_ERROR(step->index_storage.upload(packed.data(), bytes, 0, stream_));
  int32_t* base = static_cast<int32_t*>(step->index_storage.data());
  const int64_t table_shape[2] = {b, int64_t(step->max_blocks)}, cu_count = b + 1;
  step->block_table = fa_tensor_contiguous(base, 2, table_shape, FA_INT32, config_.device, config_.device_id);
  step->cache_seqlens = fa_tensor_contiguous(base + table_n, 1, &b, FA_INT32, config_.device, config_.device_id);
  step->cu_seqlens_new = fa_tensor_contiguous(base + table_n + b, 1, &cu_count, FA_INT32, config_.device, config_.device_id);
  step->cu_seqlens_k = fa_tensor_contiguous(base + table_n + 2 * b + 1, 1, &cu_count, FA_INT32, config_.device, config_.device_id);
  step->k_cache = k_cache();
  step->v_cache = v_cache();
  step->k_scale = config_.k_scale;
  step->v_scale = config_.v_scale;
  return Status();
}

// ---------------------------------------------------------------------------------------------
// Inspection

int PagedKvCache::length(SeqId seq) const {
  auto it = sequences_.find(seq);
  return it == sequences_.end() ? -1 : it->second.length;
}

int PagedKvCache::pending(SeqId seq) const {
  auto it = sequences_.find(seq);
  return it == sequences_.end() ? -1 : it->second.pending;
}

std::vector<int32_t> PagedKvCache::blocks(SeqId seq) const {
  auto it = sequences_.find(seq);
  return it == sequences_.end() ? std::vector<int32_t>{} : it->second.blocks;
}

std::vector<SeqId> PagedKvCache::sequences() const {
  std::vector<SeqId> ids;
  for (const auto& entry : sequences_) ids.push_back(entry.first);
  return ids;
}

int PagedKvCache::ref_count(int32_t block) const {
  return block >= 0 && block < config_.num_blocks ? ref_counts_[size_t(block)] : -1;
}

Status PagedKvCache::check_invariants() const {
  const int num_blocks = config_.num_blocks;
  if (int(ref_counts_.size()) != num_blocks)
    return error(FA_ERROR_INTERNAL, "kv cache: %zu reference counts for %d blocks", ref_counts_.size(), num_blocks);
  std::vector<int32_t> holders(size_t(num_blocks), 0);
  for (const auto& entry : sequences_) {
    const Sequence& s = entry.second;
    if (s.length < 0 || s.pending < 0)
      return error(FA_ERROR_INTERNAL, "kv cache: sequence %" PRId64 " has length %d, pending %d", entry.first, s.length, s.pending);
    const int expected = blocks_for(int64_t(s.length) + s.pending);
    if (int(s.blocks.size()) != expected)
      return error(FA_ERROR_INTERNAL, "kv cache: sequence %" PRId64 " holds %zu blocks for %d + %d tokens (expected %d)", entry.first,
                   s.blocks.size(), s.length, s.pending, expected);
    std::set<int32_t> own;
    for (int32_t block : s.blocks) {
      if (block < 0 || block >= num_blocks)
        return error(FA_ERROR_INTERNAL, "kv cache: sequence %" PRId64 " holds block %d outside [0, %d)", entry.first, block, num_blocks);
      if (!own.insert(block).second)
        return error(FA_ERROR_INTERNAL, "kv cache: sequence %" PRId64 " holds block %d twice", entry.first, block);
      ++holders[size_t(block)];
    }
  }
  std::vector<bool> on_free_list(size_t(num_blocks), false);
  for (int32_t block : free_list_) {
    if (block < 0 || block >= num_blocks) return error(FA_ERROR_INTERNAL, "kv cache: free list holds %d, outside [0, %d)", block, num_blocks);
    if (on_free_list[size_t(block)]) return error(FA_ERROR_INTERNAL, "kv cache: block %d is on the free list twice", block);
    on_free_list[size_t(block)] = true;
  }
  for (int block = 0; block < num_blocks; ++block) {
    if (ref_counts_[size_t(block)] != holders[size_t(block)])
      return error(FA_ERROR_INTERNAL, "kv cache: block %d has count %d but %d sequences hold it", block, ref_counts_[size_t(block)],
                   holders[size_t(block)]);
    if (on_free_list[size_t(block)] != (holders[size_t(block)] == 0))
      return error(FA_ERROR_INTERNAL, "kv cache: block %d is held by %d sequences and %s the free list", block, holders[size_t(block)],
                   on_free_list[size_t(block)] ? "on" : "not on");
  }
  return Status();
}

Status PagedKvCache::read_rows(SeqId seq, int first, int count, void* k_host, void* v_host) const {
  FA_RETURN_IF_ERROR(check_sequence_list("read_rows", sequences_, {seq}));
  const Sequence& s = sequences_.at(seq);
  const int64_t rows = int64_t(s.length) + s.pending;
  if (first < 0 || count < 0 || first + int64_t(count) > rows)
    return error(FA_ERROR_INVALID_ARGUMENT, "read_rows: rows [%d, %" PRId64 ") of sequence %" PRId64 " must lie in [0, %" PRId64
                 ") (length + pending)", first, first + int64_t(count), seq, rows);
  const int block_size = config_.block_size;
  // One copy per run of rows inside one block (rows of a block are contiguous).
  for (int t = first; t < first + count;) {
    const int in_block = t % block_size;
    const int run = std::min(block_size - in_block, first + count - t);
    const int64_t block = s.blocks[size_t(t / block_size)];
    const int64_t row0 = block * block_size + in_block;  // token row in the pool
    if (k_host != nullptr)
      FA_RETURN_IF_ERROR(k_storage_.download(static_cast<char*>(k_host) + int64_t(t - first) * k_row_bytes(), run * k_row_bytes(),
                                             row0 * k_row_bytes(), stream_));
    if (v_host != nullptr)
      FA_RETURN_IF_ERROR(v_storage_.download(static_cast<char*>(v_host) + int64_t(t - first) * v_row_bytes(), run * v_row_bytes(),
                                             row0 * v_row_bytes(), stream_));
    t += run;
  }
  return Status();
}

Status PagedKvCache::poison() {
  FA_RETURN_IF_ERROR(k_storage_.fill_bytes(kNanByte, stream_));
  return v_storage_.fill_bytes(kNanByte, stream_);
}

}  // namespace flashattn
