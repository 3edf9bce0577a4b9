// Request lengths of an allocation step, shared by PageAllocator and SWATokenAllocator so that
// both derive them, and reject bad ones, the same way.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "attnrt/core/error.h"

namespace attnrt::alloc_lens {

// The cached length of each request of a decode step: seq_lens - 1. Throws attnrt::Error for a
// length below 1 (decode lengths include the new token).
inline std::vector<int32_t> decode_prefix_lens(std::span<const int32_t> seq_lens) {
  std::vector<int32_t> prefix(seq_lens.size());
  for (size_t i = 0; i < seq_lens.size(); ++i) {
    ATTNRT_CHECK(seq_lens[i] >= 1,
                 "alloc_decode: seq_lens[{}] = {}; decode lengths include the new token, so they "
                 "are >= 1",
                 i, seq_lens[i]);
    prefix[i] = seq_lens[i] - 1;
  }
  return prefix;
}

// The tokens an extend step adds: the sum of seq_lens - prefix_lens.
inline int64_t new_tokens(std::span<const int32_t> prefix_lens, std::span<const int32_t> seq_lens) {
  int64_t tokens = 0;
  for (size_t i = 0; i < seq_lens.size(); ++i) tokens += seq_lens[i] - prefix_lens[i];
  return tokens;
}

}  // namespace attnrt::alloc_lens
