/*
 * flashattn: exact, IO-aware attention (the FlashAttention algorithm). C ABI.
 *
 * Everything crosses this boundary as plain structs. Tensors are non-owning views (data pointer,
 * shape, strides in elements, dtype, device), easy to fill from DLPack. Nothing here keeps global
 * state: every call carries its options, its CUDA stream and its workspace.
 *
 * Layouts (the flash_attn layouts):
 *   dense   q (B, Sq, Hq, D), k (B, Sk, Hk, D), v (B, Sk, Hk, Dv), out (B, Sq, Hq, Dv)
 *   varlen  q (total_q, Hq, D) with cu_seqlens_q (B+1) int32, likewise k/v with cu_seqlens_k
 *   paged   k/v cache (num_blocks, block_size, Hk, D), block_table (B, max_blocks) int32
 *   lse     float32, dense (B, Hq, Sq), varlen (Hq, total_q); natural log of the row's sum of exp
 * Any strides are accepted except that the last dimension must be contiguous (stride 1).
 * Hq must be a multiple of Hk (multi-query and grouped-query attention).
 * Every extent but the last (batch, rows, heads; a paged cache's max_blocks * block_size), and B * Hq,
 * is at most 2^31 - 2^20: rows and heads are counted in int32, with room for a tile past the last one.
 *
 * Semantics (identical on every backend):
 *   scores  = softmax_scale * q k^T                (softmax_scale 0 means 1/sqrt(D))
 *   softcap: scores = softcap * tanh(scores / softcap) when softcap > 0
 *   ALiBi:   scores += -slope[h] * |i + Sk - Sq - j|
 *   mask:    key j is visible to query i when
 *              j >= i + Sk - Sq - window_left   (window_left  >= 0; -1 means unbounded)
 *              j <= i + Sk - Sq + window_right  (window_right >= 0; -1 means unbounded)
 *            causal is window_right = 0: aligned to the bottom-right corner when Sq != Sk.
 *   A row with no visible key gives out = 0 and lse = -inf.
 *   dropout: probabilities are kept with probability 1 - p and kept values scaled by 1 / (1 - p);
 *            the keep bit of (b, h, i, j) is a pure function of (seed, offset, b, h, i, j) through
 *            Philox4x32-10 (defined in src/core/philox.hpp), the same on every backend.
 *
 * Errors: every entry point validates shapes, dtypes, devices, strides, alignment and feature
 * support before touching memory and returns a status; the message names the argument and the rule.
 */
#ifndef FLASHATTN_FLASHATTN_H_
#define FLASHATTN_FLASHATTN_H_

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#define FA_API __declspec(dllimport)
#elif defined(__GNUC__)
#define FA_API __attribute__((visibility("default")))
#else
#define FA_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define FA_VERSION_MAJOR 0
#define FA_VERSION_MINOR 1
#define FA_VERSION_PATCH 0
#define FA_MAX_DIMS 4
/* The layout of this header's structs. Raised whenever one of them changes (a field added, even at the end; before
   1.0 that may happen at any minor version). fa_options_init records the version the caller was compiled with in
   options->abi_version, and every entry point refuses options of another version (FA_ERROR_INVALID_ARGUMENT, naming
   both) before it reads any other struct: a program built against another flashattn.h gets an error instead of
   misread arguments. (With options == NULL nothing records the caller's version and nothing is checked.) */
#define FA_ABI_VERSION 1

typedef enum fa_status {
  FA_OK = 0,
  FA_ERROR_INVALID_ARGUMENT = 1, /* a shape, dtype, stride, value or combination breaks a rule */
  FA_ERROR_UNSUPPORTED = 2,      /* valid, but the chosen backend does not implement it */
  FA_ERROR_NOT_COMPILED = 3,     /* valid, but this build holds no kernel for it */
  FA_ERROR_DEVICE = 4,           /* the CUDA runtime reported an error */
  FA_ERROR_OUT_OF_MEMORY = 5,    /* a documented internal allocation failed */
  FA_ERROR_INTERNAL = 6          /* a bug: please report it */
} fa_status;

typedef enum fa_dtype {
  FA_FLOAT32 = 0,
  FA_FLOAT16 = 1,
  FA_BFLOAT16 = 2,
  FA_INT32 = 3,
  FA_UINT8 = 4, /* raw bytes, for workspaces */
  /* OCP float8 e4m3 ("e4m3fn": bias 7, no infinities, 0x7F / 0xFF are NaN, largest finite 448), with a
     per-tensor dequantisation scale: real value = fp8 value * scale. Accepted only for fa_kvcache's
     k_cache and v_cache (both, together), with q / out / k_new / v_new in float16 or bfloat16. */
  FA_FLOAT8_E4M3 = 5
} fa_dtype;

typedef enum fa_device_kind { FA_DEVICE_CPU = 0, FA_DEVICE_CUDA = 1 } fa_device_kind;

/* A non-owning view of a strided tensor. data == NULL marks an optional tensor as absent. */
typedef struct fa_tensor {
  void* data;
  int32_t ndim;                  /* 0..FA_MAX_DIMS */
  int64_t shape[FA_MAX_DIMS];    /* elements per dimension */
  int64_t strides[FA_MAX_DIMS];  /* in elements, not bytes */
  fa_dtype dtype;
  fa_device_kind device;
  int32_t device_id;             /* CUDA ordinal; 0 for the CPU */
} fa_tensor;

typedef enum fa_backend {
  FA_BACKEND_AUTO = 0,          /* the tensors' device picks: CUDA kernels, or the CPU flash backend */
  FA_BACKEND_CPU_REFERENCE = 1, /* float64 oracle; materialises scores; slow */
  FA_BACKEND_CPU_FLASH = 2,     /* tiled online softmax, threads, BLAS */
  FA_BACKEND_CPU_STANDARD = 3,  /* textbook unfused path on the same BLAS (scores materialised) */
  FA_BACKEND_CUDA = 4
} fa_backend;

/* Optional per-call report, filled when options->stats is set. */
typedef struct fa_stats {
  int64_t scratch_bytes_peak; /* most memory the call held beyond its arguments (host or device);
                                 -1 where the backend does not track it (cpu_reference) */
  int32_t num_splits;         /* split-KV splits used: kvcache's; a CUDA forward's where it split (below), else a CUDA
                                 paged varlen forward's decode call's; else 1 */
  char kernel[128];           /* the backend path / kernel configuration that ran */
} fa_stats;

/* Options shared by every entry point. Fill with fa_options_init(), then change what you need. */
typedef struct fa_options {
  int32_t abi_version;     /* set by fa_options_init: the FA_ABI_VERSION of the caller's header. Stays the first field. */
  float softmax_scale;     /* 0: 1/sqrt(D). Must be finite. */
  int32_t causal;          /* nonzero: causal, bottom-right aligned (window_right = 0) */
  int32_t window_left;     /* -1: unbounded; else >= 0 keys to the left of the diagonal */
  int32_t window_right;    /* -1: unbounded; else >= 0 keys to the right of the diagonal */
  float softcap;           /* 0: off; > 0: scores = softcap * tanh(scores / softcap) */
  fa_tensor alibi_slopes;  /* optional float32, (Hq) or (B, Hq) */
  float dropout_p;         /* in [0, 1): probability of dropping */
  uint64_t dropout_seed;   /* Philox key */
  uint64_t dropout_offset; /* Philox counter offset: give each call (layer, step) its own */
  int32_t deterministic;   /* backward: bit-identical gradients run to run (the CPU backends always are,
                              for a given num_threads) */
  fa_backend backend;      /* FA_BACKEND_AUTO unless you want a specific one */
  int32_t num_threads;     /* CPU backends: 0 = all hardware threads */
  void* stream;            /* CUDA backend: cudaStream_t; NULL = the legacy default stream */
  fa_stats* stats;         /* optional: filled with what the call used and ran */
} fa_options;

/* CUDA forward without dropout whose grid would leave SMs idle (query tiles x Hq x B below half of the device's CTA
   slots, over at least 8 key tiles: a prompt chunk after a long cached prefix, speculative tokens, a short query over a
   long context) runs split-KV: each query tile's keys are dealt to several CTAs, whose float32 partials one more kernel
   merges through their LSEs. The call then holds a stream-ordered scratch for the partials from the library's pool
   (fa_stats.scratch_bytes_peak; capturable in a CUDA graph) and reports the split count (fa_stats.num_splits). The
   count depends on the shapes and the device only; results differ from an unsplit run by float32 rounding. A varlen
   call is split by sequence: where its longest sequence alone would split, one more small kernel reads the sequence
   lengths on the device, counts the query tiles that really run (a serving step's decode tokens go to the decode
   kernels) and gives each sequence its own count (fa_stats.num_splits: the most a sequence may take). A short
   CUDA forward without ALiBi or dropout may run GQA-packed (the Hq / Hk query heads of a k/v head in one query tile,
   so that k/v are read once per tile; fa_stats.kernel ends in "gqa-packed"; rounding only).
   A CUDA forward that is not varlen (dense or paged k/v), without dropout, of at most max(1, min(16, 32 / (Hq / Hk)))
   query rows (64 / (Hq / Hk) over a paged cache; a decode step or speculative tokens over a whole cache) runs in the
   kvcache (decode) kernels instead, on q / out / lse themselves (GQA packed, split-KV; fa_stats.kernel names the dec_
   kernel "in place"; rounding may differ from the forward kernel's). */
typedef struct fa_forward_args {
  fa_tensor q, k, v;     /* dense 4-D or varlen 3-D; k/v may be paged caches (see block_table) */
  fa_tensor out;         /* same layout as q, last dim Dv, dtype of q */
  fa_tensor lse;         /* optional float32 (B, Hq, Sq) or varlen (Hq, total_q) */
  fa_tensor cu_seqlens_q, cu_seqlens_k; /* optional int32 (B+1): both for varlen, or neither. Entries:
                                           0 first, non-decreasing, each length <= max_seqlen, the last
                                           within the tensor's rows. Checked when in host memory; in
                                           device memory (CUDA) they are the caller's contract, as in
                                           flash_attn: bad entries address rows outside the tensors. */
  int32_t max_seqlen_q, max_seqlen_k;   /* varlen: the longest sequence (upper bound) */
  fa_tensor seqused_k;   /* optional int32 (B): only the first seqused_k[b] keys of sequence b
                            (in [0, its keys]; checked in host memory, the caller's on CUDA) */
  fa_tensor block_table; /* optional int32 (B, max_blocks): k/v are paged (num_blocks, block_size, Hk, D).
                            CUDA, with varlen q (a serving step: decode tokens beside prefill chunks): the sequences
                            of 1 to max(1, 16 / (Hq / Hk)) query rows run in the kvcache (decode) kernels, which read
                            a K/V head once for its query heads and split long key ranges, the others in the forward
                            kernel; the call then holds a stream-ordered scratch for the former's padded rows and
                            split partials (fa_stats.scratch_bytes_peak), from a memory pool of the library's own that
                            keeps up to 256 MiB mapped between calls (capturable in a CUDA graph). When every sequence
                            has max_seqlen_q such rows (total_q = B x max_seqlen_q: a decode step), one decode call
                            runs on q / out / lse themselves (key counts from seqused_k in place, else copied) */
} fa_forward_args;

typedef struct fa_backward_args {
  fa_tensor q, k, v, out, dout; /* as in forward; dout like out */
  fa_tensor lse;                /* required: the forward's lse */
  fa_tensor dq, dk, dv;         /* outputs, shaped like q, k, v */
  fa_tensor cu_seqlens_q, cu_seqlens_k;
  int32_t max_seqlen_q, max_seqlen_k;
  fa_tensor workspace;          /* optional uint8, >= fa_backward_workspace_size() bytes, on the
                                   device of q; absent: the backend allocates and frees it itself
                                   (CUDA: stream-ordered on the call's stream, capturable in a CUDA
                                   graph, from a memory pool of the library's own that keeps up to
                                   256 MiB mapped between calls; above that the rest goes back to
                                   the driver at each synchronisation and the next call maps it
                                   again, about 0.15 ms at 128 MiB on an H200: pass a workspace in
                                   a loop of large calls) */
} fa_backward_args;

/* Attention of new queries against a KV cache, with an optional append of new keys/values. */
typedef struct fa_kvcache_args {
  fa_tensor q;              /* (B, Sq, Hq, D) */
  fa_tensor k_cache;        /* contiguous (B, S_cache, Hk, D) or paged (num_blocks, block_size, Hk, D).
                               Paged on CUDA: any strides; the fastest blocks are runs of rows (block
                               stride = block_size x row stride, K and V), as a dense tensor of that
                               shape has; others (e.g. heads-major blocks) take more address math. */
  fa_tensor v_cache;        /* like k_cache, last dim Dv */
  fa_tensor block_table;    /* optional int32 (B, max_blocks): present = paged cache. Blocks may repeat
                               (a shared prefix, read by several sequences); a block that k_new rows
                               are appended to must belong to that sequence alone, else sequences race
                               (one writes what another reads or writes). Not checked: a paged cache
                               manager's copy-on-write (flashattn/kv_cache.hpp) keeps it so. */
  fa_tensor cache_seqlens;  /* required int32 (B): tokens already in the cache of sequence b */
  fa_tensor k_new, v_new;   /* optional (B, S_new, Hk, D/Dv): written at cache_seqlens[b].. first */
  fa_tensor rotary_cos, rotary_sin; /* optional (S_rotary, rotary_dim / 2), dtype of q: rotary
                                       embedding of q and k_new at their absolute positions (each
                                       sequence's up to cache_seqlens[b] + max(S_new, Sq) - 1 must be
                                       rows of the table: checked per sequence for host lengths; with
                                       lengths in device memory (CUDA) for every length the call
                                       allows, S_rotary >= capacity - S_new + max(S_new, Sq), where
                                       capacity is S_cache or max_blocks x block_size). The
                                       rotated k_new is stored in the cache's dtype. The rotated q:
                                       CUDA rounds it to q's dtype for the tensor cores (as a q rotated
                                       by a separate kernel would be), the CPU backends attend with it
                                       unrounded (float32 or wider); out and lse may differ by that
                                       rounding (lse by ~1e-3 for one key at |lse| ~ 1 in bf16). */
  int32_t rotary_interleaved; /* nonzero: rotate pairs (0,1),(2,3)..; zero: halves (GPT-NeoX) */
  fa_tensor out;            /* (B, Sq, Hq, Dv) */
  fa_tensor lse;            /* optional float32 (B, Hq, Sq) */
  int32_t num_splits;       /* split-KV: 0 = chosen by the backend (see fa_plan_kvcache); else 1..1024. CUDA runs a
                               call of >= 48 query rows (with Hq > Hk and no ALiBi: >= 17 where B x capacity x Hk x
                               (D + Dv) x 2 bytes >= 128 MiB, >= 24 from 64 MiB)
                               over a 16-bit cache without rotary or cache_leftpad in the
                               forward kernel over the cache (faster there than the decode kernels), whose split-KV
                               takes at most 32 splits (a larger count runs as 32; fa_plan_kvcache reports it) */
  int32_t check_indices;    /* nonzero: on CUDA, check cache_seqlens and block_table on the device and
                               report a bad entry before anything is written (one stream synchronisation;
                               not allowed inside a CUDA graph capture). Zero: bad entries are never
                               read or written through, and their sequence gets NaN in out and lse.
                               Host tensors are always checked. */
  fa_tensor workspace;      /* optional uint8, >= plan.workspace_bytes; absent: allocated inside
                               (CUDA: stream-ordered, from the library's pool as fa_backward_args') */
  /* FP8 cache (k_cache / v_cache of dtype FA_FLOAT8_E4M3): per-tensor dequantisation scales,
     real = fp8 value * scale; required finite and > 0. The cache is read as stored (dequantised), and
     appended k_new / v_new rows (k_new after rotary) are quantised into it as
       code = e4m3(x / scale)   (x / scale in float32, then round to nearest even, saturating to +-448;
                                 NaN stays NaN),
     so append-then-attend equals attending over the quantised concatenation.
     16-bit cache: unused; must be 0 (what a zero-initialised struct holds) or 1, both meaning "no scale". */
  float k_scale;
  float v_scale;
  /* optional int32 (B), contiguous cache only: sequence b reads (and appends to) batch entry
     cache_batch_idx[b] of k_cache / v_cache, whose dimension 0 is then the cache's own batch (any size >= 1)
     instead of B: a server keeps one cache of many slots and decodes the active ones (flash_attn's
     cache_batch_idx). Entries must be in [0, k_cache dimension 0) and, with k_new, distinct (two sequences
     appending to one slot would race). Host tensors are checked; on CUDA, check_indices checks the range on the
     device, and without it a sequence whose entry is out of range gets NaN in out and lse and writes nothing.
     Every backend runs such a call as the paged cache it is (blocks of S_cache rows, cache_batch_idx as a
     one-column block_table); on CUDA S_cache must then be a power of two >= 16 (else FA_ERROR_UNSUPPORTED).
     Absent: sequence b is entry b. */
  fa_tensor cache_batch_idx;
  /* optional int32 (B): left padding (flash_attn's cache_leftpad). Sequence b's keys are cache rows
     [cache_leftpad[b], cache_seqlens[b] + S_new); the rows before are padding that no query sees and that is
     never read. Positions stay those of the cache rows: rotary positions, the causal / window alignment and
     ALiBi distances are the same as without padding (only which keys exist changes). Entries must be in
     [0, cache_seqlens[b]]. Host tensors are checked; on CUDA, check_indices checks them on the device, and
     without it a sequence whose entry is out of range gets NaN in out and lse and writes nothing.
     The CPU backends take it with every cache; CUDA with a contiguous cache only (with block_table or
     cache_batch_idx: FA_ERROR_UNSUPPORTED, as flash_attn refuses it with a paged cache). Absent: every sequence
     starts at row 0. */
  fa_tensor cache_leftpad;
} fa_kvcache_args;

/* Writes new key/value rows into a KV cache without attending: the write half of fa_kvcache, with a number of new
   rows of its own for every sequence. Sequence b's rows k_new[cu_seqlens_new[b] .. cu_seqlens_new[b + 1]) land at
   cache rows cache_seqlens[b], cache_seqlens[b] + 1, ... (paged: through block_table), as fa_kvcache's append writes
   them (the same bits; FP8 caches quantised the same way). cache_seqlens is read, not updated.
   A continuous-batching step whose requests bring different numbers of tokens (prefill chunks beside decode tokens)
   is then two calls: fa_kvcache_append of every request's new rows, and one fa_forward over the paged cache (q
   varlen with cu_seqlens_q, k / v = k_cache / v_cache with block_table, cu_seqlens_k the running sum of
   cache_seqlens[b] + new rows, causal); examples/continuous_batching.cpp, --mixed-step. */
typedef struct fa_kvcache_append_args {
  fa_tensor k_cache, v_cache; /* as in fa_kvcache_args: contiguous (B, S_cache, Hk, D / Dv) or paged
                                 (num_blocks, block_size, Hk, D / Dv); float32, float16, bfloat16 or float8_e4m3 */
  fa_tensor block_table;      /* optional int32 (B, max_blocks): present = paged cache. A block that rows are
                                 written to must belong to that sequence alone (as in fa_kvcache) */
  fa_tensor cache_seqlens;    /* required int32 (B): rows already in the cache of sequence b */
  fa_tensor k_new, v_new;     /* (total_new, Hk, D / Dv), in the cache's dtype (float16 or bfloat16 with an FP8 cache) */
  fa_tensor cu_seqlens_new;   /* required int32 (B + 1): 0 first, non-decreasing, the last <= total_new (rows past
                                 it belong to no sequence and are not written); sequence b
                                 takes n_b = cu_seqlens_new[b + 1] - cu_seqlens_new[b] rows (0 allowed), and
                                 cache_seqlens[b] + n_b must be at most the capacity (S_cache, or max_blocks x
                                 block_size). Host tensors are checked; on CUDA, check_indices checks them on the
                                 device, and without it a sequence whose entries are out of range writes nothing. */
  int32_t max_seqlen_new;     /* the largest n_b (an upper bound; every n_b must be <= it). Affects speed only: the
                                 CUDA append's grid covers B x max_seqlen_new rows, so pass the true maximum */
  int32_t check_indices;      /* as in fa_kvcache_args (CUDA: cache_seqlens, cu_seqlens_new, block_table) */
  float k_scale, v_scale;     /* FP8 cache: the dequantisation scales (finite, > 0); else 0 or 1 */
} fa_kvcache_append_args;

typedef struct fa_kvcache_plan {
  int32_t num_splits;       /* splits of the key range the backend will use */
  int64_t workspace_bytes;  /* workspace that fa_kvcache needs with this plan */
} fa_kvcache_plan;

/* A status and its message. Every entry point takes an optional fa_error* (may be NULL). */
typedef struct fa_error {
  fa_status code;
  char message[1024];
} fa_error;

/* Fills *options with the defaults and records abi_version (FA_ABI_VERSION of the caller's header, through the
   macro). Of options of another ABI version it sets abi_version only (the first field in every version), so that
   the entry points report the mismatch. */
FA_API void fa_options_init_abi(fa_options* options, int32_t abi_version);
#define fa_options_init(options) fa_options_init_abi((options), FA_ABI_VERSION)
/* FA_ABI_VERSION of the header this library was built with. */
FA_API int32_t fa_abi_version(void);
/* A dense row-major (contiguous) view: strides derived from shape. */
FA_API fa_tensor fa_tensor_contiguous(void* data, int32_t ndim, const int64_t* shape, fa_dtype dtype,
                                      fa_device_kind device, int32_t device_id);

FA_API fa_status fa_forward(const fa_forward_args* args, const fa_options* options, fa_error* error);
FA_API fa_status fa_backward(const fa_backward_args* args, const fa_options* options, fa_error* error);
FA_API fa_status fa_backward_workspace_size(const fa_backward_args* args, const fa_options* options,
                                            int64_t* bytes, fa_error* error);
/* Plans split-KV once per batch shape (host only, no device access); fa_kvcache then runs with
   args->num_splits = plan.num_splits and a workspace of plan.workspace_bytes, allocating nothing. */
FA_API fa_status fa_plan_kvcache(const fa_kvcache_args* args, const fa_options* options,
                                 fa_kvcache_plan* plan, fa_error* error);
FA_API fa_status fa_kvcache(const fa_kvcache_args* args, const fa_options* options, fa_error* error);
/* Only options.backend, options.num_threads and options.stream apply. */
FA_API fa_status fa_kvcache_append(const fa_kvcache_append_args* args, const fa_options* options, fa_error* error);

FA_API const char* fa_status_name(fa_status status);
FA_API const char* fa_version(void);
/* A human-readable description of this build: backends, compiled CUDA head dims and dtypes. */
FA_API const char* fa_build_info(void);
/* Number of visible CUDA devices (0 when the build has no CUDA or no GPU is present). */
FA_API int32_t fa_cuda_device_count(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* FLASHATTN_FLASHATTN_H_ */
