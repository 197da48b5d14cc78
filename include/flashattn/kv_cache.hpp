// flashattn: a paged KV-cache manager for serving (C++ only, no C ABI).
//
// This is the one public header besides flashattn.h / flashattn.hpp. It owns the paged K/V storage
// that fa_kvcache reads and writes, and does the bookkeeping around it: a block allocator (free list
// and per-block reference counts), per-sequence block lists and lengths, fork with copy-on-write
// (beam search, shared prompt prefixes), and the index tensors of one fa_kvcache call.
//
// Storage (one pool, the paged layout of flashattn.h):
//   k_cache (num_blocks, block_size, Hk, D), v_cache (num_blocks, block_size, Hk, Dv), contiguous,
//   on the CPU or on a CUDA device (the caller's choice). Token t of a sequence lives in row
//   t % block_size of the sequence's block number t / block_size.
//
// One attention step over sequences S, each taking n new tokens (decode: n = 1; prefill: n = prompt
// or chunk length), is always these three calls, in this order:
//   1. cache.reserve(S, n)           blocks for n more tokens per sequence; a shared, partially filled
//                                    last block is first copied to a fresh block (copy-on-write).
//                                    All or nothing: on exhaustion nothing changes.
//   2. cache.make_batch(S, &batch)   block_table (B, max_blocks) and cache_seqlens (B) = the lengths
//                                    BEFORE the step, on the cache's device; then
//      fa_kvcache(batch.args() + q, k_new, v_new (B, n, Hk, D/Dv), out):
//                                    the library writes k_new/v_new at rows cache_seqlens[b] .. + n - 1
//                                    and attends over cache_seqlens[b] + n keys.
//   3. cache.commit(S)               lengths += n. (cache.cancel(S) instead, when step 2 failed.)
// Sequences that take different numbers of tokens in one step (prefill chunks beside decode tokens): reserve each
// with its own n, then make_step (KvcacheStep, below) for one fa_kvcache_append and one varlen fa_forward.
// The manager never writes K/V rows itself except for copy-on-write copies (and poison()); it
// accounts blocks and lengths. Between reserve and commit a sequence has "pending" tokens; it cannot
// be forked then (the pending rows would land in blocks that the child shares).
//
// Devices and streams: with device = FA_DEVICE_CUDA (builds with CUDA only) every allocation is
// cudaMalloc on device_id, and index uploads and copy-on-write copies are cudaMemcpyAsync on the
// stream given to set_stream(): pass the same stream as fa_options.stream so that they are ordered
// with the attention calls. Not thread-safe: one thread drives one cache.
//
// Errors come back as Status with a message that names the call, the argument and the rule.
#ifndef FLASHATTN_KV_CACHE_HPP_
#define FLASHATTN_KV_CACHE_HPP_

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "flashattn/flashattn.hpp"

namespace flashattn {

// Bytes on the CPU or on one CUDA device, owned; move-only. Used for the K/V pool and the index
// tensors, and handy for staging a call's q / k_new / v_new / out on the cache's device.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  // Frees what is held and allocates `bytes` (>= 0) on the device; contents undefined.
  Status allocate(int64_t bytes, fa_device_kind device, int device_id);
  // Grows to at least `bytes` (contents not kept when it grows); never shrinks.
  Status ensure(int64_t bytes, fa_device_kind device, int device_id);
  // Host <-> buffer copies at byte `offset`. `stream` (cudaStream_t) orders CUDA copies; download
  // waits for its copy to finish. On the CPU both are memcpy.
  Status upload(const void* host, int64_t bytes, int64_t offset = 0, void* stream = nullptr);
  Status download(void* host, int64_t bytes, int64_t offset = 0, void* stream = nullptr) const;
  // Copies `bytes` from byte src_offset to byte dst_offset of this buffer (ranges must not overlap).
  Status copy_within(int64_t dst_offset, int64_t src_offset, int64_t bytes, void* stream = nullptr);
  // Every byte = `value` (0xFF makes every float32 / float16 / bfloat16 element a NaN).
  Status fill_bytes(uint8_t value, void* stream = nullptr);

  void* data() const { return data_; }
  int64_t bytes() const { return bytes_; }
  fa_device_kind device() const { return device_; }
  int device_id() const { return device_id_; }

 private:
  void release();
  void* data_ = nullptr;
  int64_t bytes_ = 0;
  fa_device_kind device_ = FA_DEVICE_CPU;
  int device_id_ = 0;
};

using SeqId = int64_t;

struct PagedKvCacheConfig {
  int num_blocks = 0;       // blocks in the pool, >= 1
  int block_size = 16;      // tokens per block, >= 1 (a backend may ask for a multiple of something)
  int heads_k = 0;          // Hk: key/value heads
  int head_dim = 0;         // D of keys
  int head_dim_v = 0;       // Dv of values; 0 means D
  fa_dtype dtype = FA_FLOAT16;                // FA_FLOAT32, FA_FLOAT16, FA_BFLOAT16 or FA_FLOAT8_E4M3
  fa_device_kind device = FA_DEVICE_CPU;      // where the pool and the index tensors live
  int device_id = 0;                          // CUDA ordinal; 0 for the CPU
  // An FP8 (e4m3) pool (vLLM's kv_cache_dtype="fp8_e4m3"): the per-tensor dequantisation scales of
  // fa_kvcache_args, real = code value * scale, finite and > 0; every KvcacheBatch carries them, and
  // fa_kvcache quantises the appended rows with them (flashattn.h). q, k_new, v_new and out are then
  // float16 or bfloat16. Other pools: unused, 0 or 1.
  float k_scale = 0.f;
  float v_scale = 0.f;
};

// The cache-side inputs of one fa_kvcache call. Keep one per call site and reuse it step after
// step: its index storage grows when needed and is otherwise reused (no allocation per step).
struct KvcacheBatch {
  Tensor k_cache, v_cache;    // views of the whole pool: (num_blocks, block_size, Hk, D / Dv)
  Tensor block_table;         // (B, max_blocks) int32 on the cache's device
  Tensor cache_seqlens;       // (B) int32 on the cache's device: lengths before the step
  int batch = 0;              // B: the sequences, in the order given to make_batch
  int new_tokens = 0;         // S_new: rows of k_new / v_new each sequence takes in this call
  int max_blocks = 0;         // columns of block_table: the most blocks any of the B sequences holds
  float k_scale = 0.f, v_scale = 0.f;  // the pool's (PagedKvCacheConfig): an FP8 pool's scales, else 0 / 1
  // Host copies of what was uploaded. Table entries past a sequence's own blocks are block 0 (a valid
  // id, so a kernel may form its address, but never one of the sequence's visible keys).
  std::vector<int32_t> block_table_host, cache_seqlens_host;
  DeviceBuffer block_table_storage, cache_seqlens_storage;

  // fa_kvcache_args with k_cache, v_cache, block_table, cache_seqlens (and k_scale, v_scale) filled; the caller adds
  // q, k_new, v_new, out (and lse, rotary, workspace, num_splits as needed).
  fa_kvcache_args args() const;
};

// The cache-side inputs of one mixed step: sequences that take different numbers of new rows (prefill chunks beside
// decode tokens), appended by ONE fa_kvcache_append and attended by ONE varlen fa_forward over the paged pool:
//   1. cache.reserve({s}, n_s) for each sequence (any counts, >= 0), as for fa_kvcache;
//   2. cache.make_step(S, &step), then
//      fa_kvcache_append(step.append_args() + k_new, v_new (total_new, Hk, D / Dv), rows in the order of S), and
//      fa_forward(step.forward_args() + q, out (total_new, Hq, D / Dv), options.causal = 1);
//   3. cache.commit(S).
// Sequence b's rows are cu_seqlens_new[b] .. cu_seqlens_new[b + 1] - 1 of k_new, v_new, q and out; it attends its
// cache_seqlens[b] + n_b keys (cu_seqlens_k), bottom-right aligned: new token i sees the cached keys and new tokens
// 0 .. i. A decode token (n_b = 1) sees every key, as in fa_kvcache. fa_forward reads 16-bit and float32 pools (an FP8
// pool: one fa_kvcache call per count instead). Keep one per call site: its index storage grows, then stays.
// Cost: `flashattn step` times this against fa_kvcache per group of equal counts and against a split step (the one
// append, then fa_kvcache over the decodes and the varlen fa_forward over the chunks); on CUDA the paged varlen forward
// runs the decode tokens in the decode kernels (README, "Append only"; docs/PERFORMANCE.md, "CUDA serving step").
struct KvcacheStep {
  Tensor k_cache, v_cache;     // views of the whole pool
  Tensor block_table;          // (B, max_blocks) int32 on the cache's device
  Tensor cache_seqlens;        // (B) int32: lengths before the step
  Tensor cu_seqlens_new;       // (B + 1) int32: running sum of the pending counts n_b (the rows of k_new / q / out)
  Tensor cu_seqlens_k;         // (B + 1) int32: running sum of cache_seqlens[b] + n_b (the keys each attends)
  int batch = 0;               // B
  int total_new = 0;           // sum of n_b: rows of k_new, v_new, q, out
  int max_new = 0, max_keys = 0;  // the largest n_b and cache_seqlens[b] + n_b
  int max_blocks = 0;
  float k_scale = 0.f, v_scale = 0.f;
  std::vector<int32_t> block_table_host, cache_seqlens_host, cu_seqlens_new_host, cu_seqlens_k_host;
  std::vector<int32_t> index_host;  // the four, one after the other: what index_storage holds
  DeviceBuffer index_storage;       // the four index tensors, one after the other

  // k_cache, v_cache, block_table, cache_seqlens, cu_seqlens_new, max_seqlen_new (and the scales) filled; the
  // caller adds k_new and v_new.
  fa_kvcache_append_args append_args() const;
  // k, v (the pool), block_table, cu_seqlens_q (= cu_seqlens_new), cu_seqlens_k and the maxima filled; the caller
  // adds q and out (and lse).
  fa_forward_args forward_args() const;
};

class PagedKvCache {
 public:
  // Validates `config` (each field named in the message) and allocates the pool.
  static Status create(const PagedKvCacheConfig& config, std::unique_ptr<PagedKvCache>* cache);
  PagedKvCache(const PagedKvCache&) = delete;
  PagedKvCache& operator=(const PagedKvCache&) = delete;

  const PagedKvCacheConfig& config() const { return config_; }
  // cudaStream_t for uploads and copy-on-write copies (CUDA caches); nullptr = the legacy stream.
  void set_stream(void* stream) { stream_ = stream; }

  // ---- sequences ----
  SeqId add_sequence();                           // an empty sequence: length 0, no blocks
  // A new sequence holding the same tokens as `parent` by sharing all its blocks (reference counts
  // go up; nothing is copied). `parent` must have no pending tokens.
  Status fork(SeqId parent, SeqId* child);
  // Drops the sequence; each block whose count reaches 0 goes back to the free list.
  Status release(SeqId seq);

  // ---- one step (see the top of this file) ----
  // Makes every sequence in `seqs` able to take `new_tokens` (>= 0) rows beyond its length:
  // allocates blocks, copies a shared partially filled last block first. Sets the pending count to
  // new_tokens (a second reserve before commit replaces it; 0 cancels and frees surplus blocks).
  // Fails with FA_ERROR_OUT_OF_MEMORY, changing nothing, when the free blocks do not suffice.
  Status reserve(const std::vector<SeqId>& seqs, int new_tokens);
  // Fills `batch` for one fa_kvcache call over `seqs` (distinct, all with the same pending count).
  Status make_batch(const std::vector<SeqId>& seqs, KvcacheBatch* batch) const;
  // Fills `step` for one mixed step over `seqs` (distinct; each with its own pending count): see KvcacheStep.
  Status make_step(const std::vector<SeqId>& seqs, KvcacheStep* step) const;
  // length += pending, pending = 0: the rows that fa_kvcache wrote become part of the sequences.
  Status commit(const std::vector<SeqId>& seqs);
  // pending = 0 and the blocks it needed go back (the call in between failed or was skipped).
  Status cancel(const std::vector<SeqId>& seqs) { return reserve(seqs, 0); }

  // ---- inspection ----
  int num_blocks() const { return config_.num_blocks; }
  int free_blocks() const { return int(free_list_.size()); }
  int num_sequences() const { return int(sequences_.size()); }
  bool contains(SeqId seq) const { return sequences_.count(seq) != 0; }
  int length(SeqId seq) const;                    // committed tokens; -1 for an unknown sequence
  int pending(SeqId seq) const;                   // reserved, uncommitted tokens; -1 if unknown
  std::vector<int32_t> blocks(SeqId seq) const;   // block ids in token order; empty if unknown
  std::vector<SeqId> sequences() const;           // every live sequence, ascending
  int ref_count(int32_t block) const;             // sequences holding the block; -1 if not an id
  int64_t copies_made() const { return copies_made_; }  // copy-on-write block copies so far
  // Full audit of the allocator: every block's count equals the number of sequences holding it, the
  // free list holds exactly the blocks with count 0, once each, and every sequence holds exactly
  // ceil((length + pending) / block_size) distinct blocks. FA_ERROR_INTERNAL naming the first breach.
  Status check_invariants() const;

  // Views of the pool, for fa_kvcache (also in every KvcacheBatch).
  Tensor k_cache() const;
  Tensor v_cache() const;
  // Copies rows [first, first + count) of the sequence (committed or pending rows) to host memory:
  // k_host (count, Hk, D), v_host (count, Hk, Dv), contiguous, in the cache's dtype. Either may be null.
  Status read_rows(SeqId seq, int first, int count, void* k_host, void* v_host) const;
  // Fills the whole pool with NaN, every byte 0xFF (a NaN in every dtype, e4m3 included; debug aid: a read of a
  // row that was never written shows up).
  Status poison();

 private:
  struct Sequence {
    std::vector<int32_t> blocks;  // block ids in token order: ceil((length + pending) / block_size)
    int length = 0;               // committed tokens
    int pending = 0;              // reserved tokens that the next call writes at rows length ..
  };

  PagedKvCache() = default;
  int blocks_for(int64_t tokens) const;
  // The block table of `seqs` (B, max_blocks), its padding block 0 (see KvcacheBatch), and their lengths.
  void fill_table(const std::vector<SeqId>& seqs, std::vector<int32_t>* table, int* max_blocks, std::vector<int32_t>* lengths) const;
  int64_t k_row_bytes() const;    // one token of all key heads
  int64_t v_row_bytes() const;
  int32_t take_block();           // pops the free list (caller checked it is not empty)
  void drop_block(int32_t block); // count--, back to the free list at 0
  Status copy_block_rows(int32_t dst, int32_t src, int rows);

  PagedKvCacheConfig config_;
  DeviceBuffer k_storage_, v_storage_;
  std::vector<int32_t> ref_counts_;  // [num_blocks]
  std::vector<int32_t> free_list_;   // ids with count 0; taken from the back (recently freed first)
  std::map<SeqId, Sequence> sequences_;
  SeqId next_id_ = 0;
  int64_t copies_made_ = 0;
  void* stream_ = nullptr;
};

}  // namespace flashattn

#endif  // FLASHATTN_KV_CACHE_HPP_
