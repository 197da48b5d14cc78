// Where the FP8 decode kernel (decode_kernel.cuh) puts Q's columns and finds O's, host and device (FA_HD), so
// that tests/cpp/test_cuda_kvcache_plan.cpp can check them against a model of the fragments without a GPU.
//
// An ldmatrix of fp8 rows read as 16-bit elements hands thread t (quad column q = t % 4, group g = t / 4) 4
// adjacent codes of a row, where the m16n8k16 fragment wants 2 + 2 elements 8 apart:
//   S = Q K^T   K's B registers 0, 1 of a 16-column group get codes d = 4q, 4q + 1 and 4q + 2, 4q + 3 of key g,
//               standing in the MMA's k slots 2q, 2q + 1 and 2q + 8, 2q + 9: Q is stored in the same order
//   O += P V    ldmatrix.trans gives thread t codes 2g and 2g + 1 of keys 2q, 2q + 1 (+ 8): the even ones feed
//               n8 tile 2c of a 16-column chunk c, the odd ones tile 2c + 1
#pragma once

#include "core/host_device.hpp"

namespace flashattn::cuda::decode {

// Shared-memory column of Q's element d: pair p = (d / 2) % 8 of a 16-column group is stored at pair
// (p / 2) + 4 (p % 2), i.e. pairs 0, 2, 4, 6 fill the group's first 16-byte chunk and 1, 3, 5, 7 the second.
FA_HD int fp8_q_column(int d) {
  const int pair = (d >> 1) & 7;
  return (d & ~15) | ((((pair >> 1) + 4 * (pair & 1)) << 1) | (d & 1));
}

// Head column of O accumulator element e (0, 1: columns 2 quad_col + e of the n8 tile) of n8 tile dt: tile dt
// holds columns 16 (dt / 2) + 2 n + dt % 2, n = 0..7.
FA_HD int fp8_o_column(int dt, int quad_col, int e) { return 16 * (dt >> 1) + 2 * (2 * quad_col + e) + (dt & 1); }

}  // namespace flashattn::cuda::decode
