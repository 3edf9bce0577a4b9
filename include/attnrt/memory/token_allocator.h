// TokenAllocator: what the scheduler uses to get and return KV slots. PageAllocator-backed for plain
// models; for SWA-hybrid models it also keeps the SWA pool's slots and the full->SWA mapping.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

namespace attnrt {

class PageAllocator;

class TokenAllocator {
 public:
  virtual ~TokenAllocator() = default;
  // Same contracts as PageAllocator (full-pool slots); throw attnrt::Error and change nothing on
  // exhaustion.
  virtual std::vector<int64_t> alloc_extend(std::span<const int32_t> prefix_lens,
                                            std::span<const int32_t> seq_lens,
                                            std::span<const int64_t> last_locs) = 0;
  virtual std::vector<int64_t> alloc_decode(std::span<const int32_t> seq_lens,
                                            std::span<const int64_t> last_locs) = 0;
  virtual void free(std::span<const int64_t> slots) = 0;
  // SWA: these full slots left every request's window; their SWA slots may be reused. No-op else.
  virtual void free_swa(std::span<const int64_t> slots) { (void)slots; }
  virtual int64_t available_size() const = 0;
  virtual int page_size() const = 0;
};

}  // namespace attnrt
