// The textbook, unfused attention on the same BLAS as the flash backend: S = scale * Q K^T is
// materialised (Sq x Sk per head), then masked, soft-maxed and multiplied by V. It exists only to
// show what the flash algorithm saves: its memory grows with Sq * Sk.
#pragma once

#include "core/params.hpp"
#include "core/status.hpp"

namespace flashattn::cpu::standard {

Status forward(const AttentionParams& params);

}  // namespace flashattn::cpu::standard
