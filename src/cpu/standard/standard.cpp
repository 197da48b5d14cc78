// PLACEHOLDER (replaced by the standard-path implementation).
#include "cpu/standard/standard.hpp"
namespace flashattn::cpu::standard {
Status forward(const AttentionParams&) { return error(FA_ERROR_UNSUPPORTED, "cpu_standard: not implemented yet"); }
}
