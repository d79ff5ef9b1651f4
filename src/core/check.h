// Internal error helpers: ATTNKIT_CHECK(cond, parts...) throws attnkit::Error with the parts
// streamed together. Messages name the argument, what is accepted and what was given.
#pragma once

#include <sstream>
#include <string>
#include <utility>

#include "attnkit/types.h"

namespace attnkit::detail {

template <typename... Parts>
std::string concat(Parts&&... parts) {
  std::ostringstream out;
  (out << ... << std::forward<Parts>(parts));
  return out.str();
}

template <typename... Parts>
[[noreturn]] void fail(Parts&&... parts) {
  throw Error(concat(std::forward<Parts>(parts)...));
}

}  // namespace attnkit::detail

#define ATTNKIT_CHECK(cond, ...)                       \
  do {                                                 \
    if (!(cond)) ::attnkit::detail::fail(__VA_ARGS__); \
  } while (0)
