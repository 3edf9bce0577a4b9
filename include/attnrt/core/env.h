// Integer settings read from the environment (tuning and A/B switches; docs/backends.md lists them).
#pragma once

#include <initializer_list>
#include <optional>
#include <string_view>

namespace attnrt {

// The value of environment variable `name` as a whole number in [lo, hi], or nullopt when it is
// unset or empty. Anything else is an attnrt::Error "<who>: NAME=VALUE is invalid; use <allowed>".
std::optional<long> env_integer(const char* name, long lo, long hi, std::string_view who,
                                std::string_view allowed);

// The value of environment variable `name` when it is one of `choices`, or nullopt when it is
// unset or empty. Anything else is an attnrt::Error "<who>: NAME=VALUE is invalid; use one of ...".
std::optional<std::string_view> env_choice(const char* name,
                                           std::initializer_list<std::string_view> choices,
                                           std::string_view who);

}  // namespace attnrt
