// Test support for the KV-cache entry point (fa_kvcache), shared by the CPU tests (test_cpu_kvcache.cpp) and the CUDA
// tests (test_cuda_kvcache.cpp): one case's description, its host tensors with fresh random values, and the cache's
// logical addressing. Each test file keeps its own defaults (a derived KvCase), options and judges.
#pragma once

#include <random>
#include <string>
#include <vector>

#include "testing.hpp"

namespace fa_test {

// One fa_kvcache call. The defaults are a GPU-sized GQA case; the CPU tests start from smaller ones.
struct KvCase {
  int batch = 2, seqlen_q = 1, heads_q = 8, heads_k = 2, head_dim = 128;
  std::vector<int> cached = {37, 300};  // cache_seqlens per sequence
  std::vector<int> leftpad;             // cache_leftpad per sequence (empty: none); make_kv fills the padding with NaN
  int seqlen_new = 0;
  bool check_indices = false;           // fa_kvcache_args.check_indices (the checked mode)
  int capacity = 400;                   // keys per sequence the cache holds
  int block_size = 0;                   // 0: contiguous cache; else paged with this block size
  bool repeat_blocks = false;           // paged: table entries drawn with repeats (read-only cases)
  bool heads_major_blocks = false;      // paged: each block stored [Hk][block size][D] (FlashInfer's HND), not as
                                        // block-size runs of [Hk][D] rows: the kernel's general block addressing
  int cache_row_pad = 0;                // contiguous: extra elements per cache row (a strided cache)
  int rotary = 0;                       // 0 none, 1 halves (GPT-NeoX), 2 interleaved
  int rotary_dim = 0;                   // 0: head_dim
  bool causal = false;
  int window_left = -1, window_right = -1;
  float softcap = 0.f;
  float softmax_scale = 0.f;
  bool alibi = false;
  float dropout_p = 0.f;                // the CPU backends only
  int num_splits = 0;
  int num_threads = 0;                  // fa_options.num_threads (the CPU backends)
  double input_std = 1.0;               // > 3: peaky softmax
  fa_dtype dtype = FA_BFLOAT16;
  bool fp8 = false;                     // float8 e4m3 k_cache / v_cache with these scales (dtype 16-bit)
  float k_scale = 0.05f, v_scale = 0.03f;

  std::string to_string() const;
  int floor_of(int b) const { return leftpad.empty() ? 0 : leftpad[size_t(b)]; }  // the first key row of sequence b
};

inline bool present(const HostTensor& t) { return !t.shape().empty(); }

// The host tensors of one case. The paged cache hands out shuffled block ids and keeps spare blocks.
struct KvTensors {
  HostTensor q, k_cache, v_cache, block_table, cache_seqlens, k_new, v_new, cos, sin, out, lse, slopes;
  HostTensor cache_batch_idx;  // optional (contiguous caches): the cache's batch entry of each sequence
  HostTensor cache_leftpad;    // optional
  bool rotary_interleaved = false;
  float k_scale = 0.f, v_scale = 0.f;  // an FP8 cache's scales (0: a 16-bit cache)
  fa_kvcache_args args();              // the views of the tensors present (alibi slopes: fa_options)
};

// Fresh random inputs for `c`: q, the caches (every row, FP8 codes of about input_std / scale), k_new / v_new, rotary
// tables for every position a call may reach (the table's whole blocks + Sq), ALiBi slopes; out and lse poisoned
// (NaN). Left padding: its rows hold NaN (a result that read one would show it), and the table entries of blocks
// wholly inside it are no block id (a kernel or oracle that addressed one would fail).
KvTensors make_kv(const KvCase& c, std::mt19937_64& rng);

// The logical (row-major) index of element (b, j, hk, x) of a cache, contiguous or through the block table; the
// tensors' strides do the rest (heads-major blocks, padded rows).
int64_t cache_index(const KvCase& c, const KvTensors& t, int b, int j, int hk, int x);

// NaN into rows [j_begin, j_end) of sequence b, every K/V head, in both caches.
void poison_cache_rows(const KvCase& c, KvTensors& t, int b, int j_begin, int j_end);

bool same_bytes(const HostTensor& a, const HostTensor& b);

}  // namespace fa_test
