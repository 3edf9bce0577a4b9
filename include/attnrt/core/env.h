// Integer settings read from the environment (tuning and A/B switches; docs/backends.md lists them).
#pragma once

#include <atomic>
#include <climits>
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

// A process-wide switch: environment variable `name` (env_integer over [lo, hi], else `fallback`)
// read at the first get() unless set() chose first; later reads are one atomic load. get() and
// set() may race: a set() before the first read wins over the environment.
class EnvSwitch {
 public:
  constexpr EnvSwitch(const char* name, long lo, long hi, long fallback, std::string_view who,
                      std::string_view allowed)
      : name_(name), lo_(lo), hi_(hi), fallback_(fallback), who_(who), allowed_(allowed) {}
  long get() {
    long v = value_.load(std::memory_order_relaxed);
    if (v != kUnread) return v;
    v = env_integer(name_, lo_, hi_, who_, allowed_).value_or(fallback_);
    long expected = kUnread;
    if (!value_.compare_exchange_strong(expected, v)) v = expected;
    return v;
  }
  void set(long v) { value_.store(v); }

 private:
  static constexpr long kUnread = LONG_MIN;
  const char* name_;
  long lo_, hi_, fallback_;
  std::string_view who_, allowed_;
  std::atomic<long> value_{kUnread};
};

}  // namespace attnrt
