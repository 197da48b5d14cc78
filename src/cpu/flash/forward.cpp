// PLACEHOLDER (replaced by the CPU flash implementation).
#include "cpu/flash/flash.hpp"
namespace flashattn::cpu::flash {
Status forward(const AttentionParams&) { return error(FA_ERROR_UNSUPPORTED, "cpu_flash: forward not implemented yet"); }
}
