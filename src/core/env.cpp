#include "attnrt/core/env.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdlib>

#include "attnrt/core/error.h"

namespace attnrt {

std::optional<long> env_integer(const char* name, long lo, long hi, std::string_view who,
                                std::string_view allowed) {
  const char* env = std::getenv(name);
  if (env == nullptr || *env == '\0') return std::nullopt;
  char* end = nullptr;
  const long v = std::strtol(env, &end, 10);
  ATTNRT_CHECK(end != env && *end == '\0' && v >= lo && v <= hi, "{}: {}={} is invalid; use {}",
               who, name, env, allowed);
  return v;
}

std::optional<std::string_view> env_choice(const char* name,
                                           std::initializer_list<std::string_view> choices,
                                           std::string_view who) {
  const char* env = std::getenv(name);
  if (env == nullptr || *env == '\0') return std::nullopt;
  for (std::string_view c : choices) {
    if (c == env) return c;
  }
  fail("{}: {}={} is invalid; use one of {} (or leave it unset)", who, name, env,
       fmt::join(choices, ", "));
}

}  // namespace attnrt
