// attnrt::Error: the one exception type. Messages say what was wrong, the value seen, and what is
// allowed, so a user can act on them without reading our source.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace attnrt {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace attnrt

// ATTNRT_CHECK(cond, "fmt", args...): throws attnrt::Error with the formatted message when cond is false.
#define ATTNRT_CHECK(cond, ...)        \
  do {                                 \
    if (!(cond)) ::attnrt::fail(__VA_ARGS__); \
  } while (0)
