# Finds the BLAS that the CPU flash and standard backends call (cblas_sgemm).
#
# We want OpenBLAS built with OpenMP (Debian: libopenblas-openmp-dev): called from inside our own
# OpenMP parallel regions it runs single-threaded instead of starting a second pool of threads.
# The pthread build would oversubscribe the cores. Override with -DFLASHATTN_BLAS_LIBRARY=... and
# -DFLASHATTN_BLAS_INCLUDE_DIR=... for another CBLAS (MKL, BLIS); the code needs only cblas_sgemm.
set(_fa_blas_hints
    /usr/lib/x86_64-linux-gnu/openblas-openmp /usr/lib/aarch64-linux-gnu/openblas-openmp
    /usr/lib64/openblas-openmp /usr/lib/openblas-openmp)
set(_fa_blas_include_hints
    /usr/include/x86_64-linux-gnu/openblas-openmp /usr/include/aarch64-linux-gnu/openblas-openmp
    /usr/include/openblas)
if(FLASHATTN_BLAS_STATIC)
  set(_fa_blas_names libopenblas.a)
else()
  set(_fa_blas_names openblas)
endif()
find_library(FLASHATTN_BLAS_LIBRARY NAMES ${_fa_blas_names} HINTS ${_fa_blas_hints} NO_DEFAULT_PATH)
find_library(FLASHATTN_BLAS_LIBRARY NAMES ${_fa_blas_names})
find_path(FLASHATTN_BLAS_INCLUDE_DIR cblas.h HINTS ${_fa_blas_include_hints} NO_DEFAULT_PATH)
find_path(FLASHATTN_BLAS_INCLUDE_DIR cblas.h)
if(NOT FLASHATTN_BLAS_LIBRARY OR NOT FLASHATTN_BLAS_INCLUDE_DIR)
  message(FATAL_ERROR
    "flashattn: no CBLAS found. Install OpenBLAS with OpenMP (Debian/Ubuntu: "
    "apt-get install libopenblas-openmp-dev) or set FLASHATTN_BLAS_LIBRARY and FLASHATTN_BLAS_INCLUDE_DIR.")
endif()
if(FLASHATTN_BLAS_LIBRARY MATCHES "pthread")
  message(WARNING "flashattn: ${FLASHATTN_BLAS_LIBRARY} is the pthread build of OpenBLAS; called from "
                  "flashattn's threads it may oversubscribe the cores. Prefer libopenblas-openmp-dev.")
endif()
message(STATUS "flashattn: BLAS ${FLASHATTN_BLAS_LIBRARY} (cblas.h in ${FLASHATTN_BLAS_INCLUDE_DIR})")
add_library(flashattn_blas INTERFACE)
target_link_libraries(flashattn_blas INTERFACE ${FLASHATTN_BLAS_LIBRARY})
target_include_directories(flashattn_blas SYSTEM INTERFACE ${FLASHATTN_BLAS_INCLUDE_DIR})
if(FLASHATTN_BLAS_STATIC)
  # a static OpenBLAS needs its Fortran runtime and libm
  find_library(_fa_gfortran NAMES libgfortran.a gfortran
               HINTS /usr/lib/gcc/x86_64-linux-gnu/12 /usr/lib/gcc/x86_64-linux-gnu/13)
  target_link_libraries(flashattn_blas INTERFACE ${_fa_gfortran} quadmath m)
endif()
