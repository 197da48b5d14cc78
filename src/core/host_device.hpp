// FA_HD marks small functions shared by host code and CUDA kernels (masks, Philox, accounting).
#pragma once

#if defined(__CUDACC__)
#define FA_HD __host__ __device__ __forceinline__
#else
#define FA_HD inline
#endif
