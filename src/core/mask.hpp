// The attention variants as small functors shared by every backend: which keys a query sees
// (causal / sliding window, bottom-right aligned), and how a raw score is transformed
// (scale, softcap, ALiBi). A new variant is a few lines here, not a change to a mainloop.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/host_device.hpp"
#include "core/params.hpp"

namespace flashattn {

// Key j is visible to query i of a sequence with lengths (sq, sk) when
//   i + (sk - sq) - window_left <= j <= i + (sk - sq) + window_right,
// each bound dropped when its window is -1. Causal is window_right = 0. j must also be in [0, sk).
struct WindowMask {
  int window_left;   // -1 = unbounded
  int window_right;  // -1 = unbounded
  int diagonal;      // sk - sq: the key aligned with query i is i + diagonal

  FA_HD WindowMask(int left, int right, int seqlen_q, int seqlen_k)
      : window_left(left), window_right(right), diagonal(seqlen_k - seqlen_q) {}

  FA_HD bool visible(int i, int j) const {
    const int64_t aligned = int64_t(i) + diagonal;
    if (window_left >= 0 && j < aligned - window_left) return false;
    if (window_right >= 0 && j > aligned + window_right) return false;
    return true;
  }
  // First key visible to any query in [i_begin, i_end), clamped to >= 0.
  FA_HD int key_begin(int i_begin) const {
    if (window_left < 0) return 0;
    const int64_t j = int64_t(i_begin) + diagonal - window_left;
    return j < 0 ? 0 : int(j);
  }
  // One past the last key visible to any query in [i_begin, i_end), clamped to [0, seqlen_k].
  FA_HD int key_end(int i_end, int seqlen_k) const {
    if (window_right < 0) return seqlen_k;
    const int64_t j = int64_t(i_end) - 1 + diagonal + window_right + 1;
    return j < 0 ? 0 : (j > seqlen_k ? seqlen_k : int(j));
  }
  // True when every (i, j) of the tile [i0, i1) x [j0, j1) is visible: no mask needed there.
  FA_HD bool tile_fully_visible(int i0, int i1, int j0, int j1) const {
    return visible(i1 - 1, j0) && visible(i0, j1 - 1);
  }
};

// A KV-cache call's mask (fa_kvcache_args.cache_leftpad): the WindowMask of the call over the cache's own positions,
// and keys below key_floor, the sequence's left padding, visible to no query. The padding changes which keys exist,
// not where they are: the diagonal, the window and ALiBi distances are those of the call without it. A separate type so
// that the forward and backward kernels' masks stay as they are.
struct PaddedWindowMask : WindowMask {
  int key_floor;  // the first key of the sequence (0: no padding)

  FA_HD PaddedWindowMask(int left, int right, int seqlen_q, int seqlen_k, int floor)
      : WindowMask(left, right, seqlen_q, seqlen_k), key_floor(floor) {}

  FA_HD bool visible(int i, int j) const { return j >= key_floor && WindowMask::visible(i, j); }
  // First key visible to any query in [i_begin, i_end): at least key_floor.
  FA_HD int key_begin(int i_begin) const {
    const int j = WindowMask::key_begin(i_begin);
    return j > key_floor ? j : key_floor;
  }
  FA_HD bool tile_fully_visible(int i0, int i1, int j0, int j1) const {
    return visible(i1 - 1, j0) && visible(i0, j1 - 1);
  }
};

// The transform of a scaled score before masking: softcap, then ALiBi. Pure function of (i, j).
struct ScoreTransform {
  float softcap;       // 0 = off
  float alibi_slope;   // 0 = off (the slope of this (b, h))
  int diagonal;        // sk - sq

  FA_HD float operator()(float scaled_score, int i, int j) const {
    float s = scaled_score;
    if (softcap > 0.f) s = softcap * tanhf(s / softcap);
    if (alibi_slope != 0.f) {
      const int distance = i + diagonal - j;
      s -= alibi_slope * float(distance < 0 ? -distance : distance);
    }
    return s;
  }
};

FA_HD float alibi_slope(const AttentionParams& p, int b, int h) {
  return p.alibi_slopes == nullptr ? 0.f : p.alibi_slopes[b * p.alibi_batch_stride + h];
}

}  // namespace flashattn
