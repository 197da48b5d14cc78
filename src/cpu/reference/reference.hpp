// The float64 oracle. Every fast path in this project is checked against it.
//
// It materialises each head's Sq x Sk score matrix in double precision and follows the semantics
// of flashattn.h literally: no tiling, no online softmax, no shared code with the fast paths
// beyond the Philox keep-mask (which is the definition of dropout). Slow on purpose.
#pragma once

#include <vector>

#include "core/params.hpp"
#include "core/status.hpp"

namespace flashattn::cpu::reference {

// One (b, h) attention problem in float64, row-major: q [sq, d], k [sk, d], v [sk, dv].
struct HeadProblem {
  int seqlen_q, seqlen_k, head_dim, head_dim_v;
  std::vector<double> q, k, v;
  double scale;
  int window_left, window_right;  // -1 unbounded; causal is window_right = 0
  int key_floor = 0;              // keys below it are no keys (a KV cache's left padding, cache_leftpad)
  double softcap;                 // 0 off
  double alibi_slope;             // 0 off
  double dropout_p;               // 0 off
  uint64_t seed, offset;
  uint32_t dropout_bh;            // b * Hq + h: the head's index in the Philox counter
  // Test baseline only: round scores, probabilities and score gradients to this dtype, as a naive
  // same-precision computation (e.g. torch math attention in bf16) would. FA_FLOAT32 + !emulate = exact.
  bool emulate = false;
  fa_dtype emulate_dtype = FA_FLOAT32;
};

struct HeadResult {
  std::vector<double> out;  // [sq, dv]
  std::vector<double> lse;  // [sq]; -inf for a row with no visible key
};

struct HeadGradients {
  std::vector<double> dq, dk, dv;  // [sq, d], [sk, d], [sk, dv]
};

HeadResult attend(const HeadProblem& problem);
HeadGradients attend_backward(const HeadProblem& problem, const std::vector<double>& dout);

// The keep multiplier of (i, j): 0 when dropped, 1 / (1 - p) when kept, 1 without dropout.
double dropout_multiplier(const HeadProblem& problem, int i, int j);

// Backend entry points (params validated by src/api). Inputs of any dtype, float64 inside.
Status forward(const AttentionParams& params);
// Gradients from the float64 recomputation: params.out and params.lse are not read.
Status backward(const BackwardParams& params);

// The naive same-precision baseline of the test tolerance rule: the same computation with scores,
// probabilities and score gradients rounded to params.dtype (not an oracle; tests only).
Status forward_naive_same_precision(const AttentionParams& params);
Status backward_naive_same_precision(const BackwardParams& params);
// Appends (with rotary) into the cache, then attends. Splits are irrelevant here.
Status kvcache(const KvcacheParams& params);

}  // namespace flashattn::cpu::reference
