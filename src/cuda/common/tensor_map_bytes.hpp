// The 128 bytes of a CUtensorMap (cuda.h) as the host encodes it (src/cuda/decode/cache_tensor_maps.cpp), kept
// opaque so that plain C++ argument structs (decode_work.hpp) need no driver header. A kernel reads one only
// through its address in the parameter space (a member of a __grid_constant__ argument; common/tma.cuh).
#pragma once

#include <cstdint>

namespace flashattn::cuda {

struct alignas(64) TensorMapBytes {
  uint64_t opaque[16];
};

}  // namespace flashattn::cuda
