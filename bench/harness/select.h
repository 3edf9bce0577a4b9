// Picking benchmark rows with `--workload`: a comma-separated list of items, each naming rows of a
// suite (all, a family, a row name). Private to the bench sources.
#pragma once

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <string>
#include <string_view>
#include <vector>

#include "attnrt/core/error.h"

namespace attnrt::bench {

// The rows of `all` that some item of `selector` matches (`matches(row, item)`), each once, in the
// order of their first match. An item that matches nothing fails with "unknown <what> '<item>':
// use <choices>, or a row name (<every row name>)"; a selector without items fails with
// "--workload is empty: use <empty_hint>".
template <typename Row, typename Matches>
std::vector<Row> select_rows(std::string_view selector, const std::vector<Row>& all,
                             Matches matches, std::string_view what, std::string_view choices,
                             std::string_view empty_hint) {
  std::vector<Row> out;
  size_t start = 0;
  while (start <= selector.size()) {
    size_t comma = selector.find(',', start);
    if (comma == std::string_view::npos) comma = selector.size();
    const std::string_view item = selector.substr(start, comma - start);
    start = comma + 1;
    if (item.empty()) continue;
    bool matched = false;
    for (const Row& w : all) {
      if (!matches(w, item)) continue;
      matched = true;
      bool seen = false;
      for (const Row& o : out) seen = seen || o.name == w.name;
      if (!seen) out.push_back(w);
    }
    if (!matched) {
      std::vector<std::string> names;
      for (const Row& w : all) names.push_back(w.name);
      fail("unknown {} '{}': use {}, or a row name ({})", what, item, choices,
           fmt::join(names, ", "));
    }
  }
  ATTNRT_CHECK(!out.empty(), "--workload is empty: use {}", empty_hint);
  return out;
}

}  // namespace attnrt::bench
