// Helpers shared by the test files.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "attnrt/core/error.h"

namespace attnrt::test {

// Runs fn and expects an attnrt::Error whose message contains every fragment.
inline void expect_error(const std::function<void()>& fn, const std::vector<std::string>& fragments) {
  try {
    fn();
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const std::string& f : fragments) {
      EXPECT_NE(msg.find(f), std::string::npos) << "missing '" << f << "' in: " << msg;
    }
    return;
  }
  ADD_FAILURE() << "no attnrt::Error thrown; expected one mentioning '" << fragments.front() << "'";
}

}  // namespace attnrt::test
