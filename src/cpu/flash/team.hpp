// Thread teams of the CPU kernels: how many threads a parallel region gets, and how each thread
// keeps the BLAS it calls single-threaded.
#pragma once

#include <omp.h>

#include <cstdint>

namespace flashattn::cpu {

// Threads for a region over `items` independent units: options.num_threads, but never more
// threads (each with its own scratch tiles) than there is work.
inline int team_size(int num_threads, int64_t items) {
  if (items < 1) return 1;
  return items < num_threads ? int(items) : (num_threads > 0 ? num_threads : 1);
}

// OpenBLAS's OpenMP build sizes its own parallelism by omp_get_max_threads(). Inside our parallel
// regions every thread runs its GEMMs single-threaded; a team of one thread is an *inactive*
// region, though, where OpenBLAS would still fan out over every core, ignoring
// options.num_threads. Each parallel region therefore starts with this call, which sets the ICV of
// the calling thread's implicit task only (it does not outlive the region).
inline void blas_single_threaded_here() { omp_set_num_threads(1); }

}  // namespace flashattn::cpu
