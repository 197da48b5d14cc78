// Internal error helpers. The Status type itself is the public one (flashattn.hpp), so that a
// message travels unchanged from the rule that failed to the caller.
#pragma once

#include <cstdarg>
#include <cstdio>
#include <string>

#include "flashattn/flashattn.hpp"

namespace flashattn {

// printf-style message: error(FA_ERROR_INVALID_ARGUMENT, "q: head dim %d is not a multiple of 8", d)
#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
inline Status error(fa_status code, const char* format, ...) {
  char buffer[1024];
  va_list list;
  va_start(list, format);
  std::vsnprintf(buffer, sizeof(buffer), format, list);
  va_end(list);
  return Status(code, buffer);
}

}  // namespace flashattn

// Returns early from the enclosing function when `expr` yields a failed Status.
#define FA_RETURN_IF_ERROR(expr)               \
  do {                                         \
    ::flashattn::Status fa_status_ = (expr);   \
    if (!fa_status_.ok()) return fa_status_;   \
  } while (0)
