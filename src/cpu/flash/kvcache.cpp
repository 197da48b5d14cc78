// PLACEHOLDER (replaced by the CPU flash implementation).
#include "cpu/flash/flash.hpp"
namespace flashattn::cpu::flash {
Status kvcache_plan(const KvcacheParams&, fa_kvcache_plan*) { return error(FA_ERROR_UNSUPPORTED, "cpu_flash: kvcache not implemented yet"); }
Status kvcache(const KvcacheParams&) { return error(FA_ERROR_UNSUPPORTED, "cpu_flash: kvcache not implemented yet"); }
}
