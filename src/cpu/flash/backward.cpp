// PLACEHOLDER (replaced by the CPU flash implementation).
#include "cpu/flash/flash.hpp"
namespace flashattn::cpu::flash {
Status backward(const BackwardParams&) { return error(FA_ERROR_UNSUPPORTED, "cpu_flash: backward not implemented yet"); }
int64_t backward_workspace_bytes(const BackwardParams&) { return 0; }
}
