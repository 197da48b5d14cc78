# Flags of the CUDA translation units (included from src/CMakeLists.txt).
target_compile_options(flashattn_objects PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -lineinfo -Xcompiler=-fPIC>)
string(REPLACE ";" " " _fa_arch_list "${FLASHATTN_CUDA_ARCHS}")
target_compile_definitions(flashattn_objects PRIVATE FLASHATTN_CUDA_ARCH_LIST="${_fa_arch_list}")
# Registers / spills / shared memory of every kernel in the build log (ptxas -v), for tuning.
option(FLASHATTN_CUDA_RESOURCE_USAGE "Print each kernel's registers, spills and shared memory (ptxas -v)" OFF)
if(FLASHATTN_CUDA_RESOURCE_USAGE)
  target_compile_options(flashattn_objects PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xptxas=-v>)
endif()
