// TokenAllocator: what the scheduler uses to get and return KV slots. PageAllocator-backed for
// plain models; for SWA-hybrid models it also keeps the SWA pool's slots and the full->SWA mapping.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "attnrt/memory/page_allocator.h"

namespace attnrt {

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
  // PageAllocator::check_invariants of every pool (and, for SWA, of the full->SWA mapping); with
  // `owners`, also that the full pool's pages in use are exactly the owners' (no leak, no sharing).
  virtual void check_invariants() const = 0;
  virtual void check_invariants(const SlotOwners& owners) const = 0;
};

// The plain allocator: one PageAllocator over the full pool's slots.
class PagedTokenAllocator final : public TokenAllocator {
 public:
  PagedTokenAllocator(int64_t size, int page_size) : pages_(size, page_size) {}
  std::vector<int64_t> alloc_extend(std::span<const int32_t> prefix_lens,
                                    std::span<const int32_t> seq_lens,
                                    std::span<const int64_t> last_locs) override {
    return pages_.alloc_extend(prefix_lens, seq_lens, last_locs);
  }
  std::vector<int64_t> alloc_decode(std::span<const int32_t> seq_lens,
                                    std::span<const int64_t> last_locs) override {
    return pages_.alloc_decode(seq_lens, last_locs);
  }
  void free(std::span<const int64_t> slots) override { pages_.free(slots); }
  int64_t available_size() const override { return pages_.available_size(); }
  int page_size() const override { return pages_.page_size(); }
  void check_invariants() const override { pages_.check_invariants(); }
  void check_invariants(const SlotOwners& owners) const override {
    pages_.check_invariants(owners);
  }
  const PageAllocator& pages() const { return pages_; }

 private:
  PageAllocator pages_;
};

// SWA-hybrid models (reference-semantics §4.4): every allocated token gets a slot in the full pool
// and one in the smaller SWA pool, with the same page layout in both (slot % P == position % P, one
// SWA page per full page). full_to_swa()[s] is the SWA slot of full slot s, 0 = none; it has
// full rows + 1 entries and the last one is -1, so that the "no last location" index -1 maps to -1.
// SWA slots are released in whole pages: free_swa() requires every token of a page that still has
// an SWA slot to be passed together.
class SWATokenAllocator final : public TokenAllocator {
 public:
  SWATokenAllocator(int64_t full_size, int64_t swa_size, int page_size);

  std::vector<int64_t> alloc_extend(std::span<const int32_t> prefix_lens,
                                    std::span<const int32_t> seq_lens,
                                    std::span<const int64_t> last_locs) override;
  std::vector<int64_t> alloc_decode(std::span<const int32_t> seq_lens,
                                    std::span<const int64_t> last_locs) override;
  void free(std::span<const int64_t> slots) override;
  void free_swa(std::span<const int64_t> slots) override;
  int64_t available_size() const override;
  int page_size() const override { return full_.page_size(); }
  // Besides both pools' own invariants: the map has full rows + 1 entries ending in -1; a mapped
  // full slot lies in a page in use and maps to an SWA slot in a page in use with the same offset;
  // no SWA slot is mapped twice, an SWA page holds tokens of one full page, and every SWA page in
  // use is mapped from some full slot (else it leaked).
  void check_invariants() const override;
  void check_invariants(const SlotOwners& owners) const override;

  const PageAllocator& full() const { return full_; }
  const PageAllocator& swa() const { return swa_; }
  // Shared with the SWA KV cache, which reads it once per step. Its address never changes.
  std::shared_ptr<const std::vector<int64_t>> full_to_swa() const { return map_; }

 private:
  std::vector<int64_t> swa_last_locs(std::span<const int32_t> prefix_lens,
                                     std::span<const int64_t> last_locs, const char* what) const;
  // alloc_extend, or alloc_decode (decode = true; prefix_lens = seq_lens - 1), recording the SWA
  // slot of every new full slot.
  std::vector<int64_t> alloc(std::span<const int32_t> prefix_lens,
                             std::span<const int32_t> seq_lens, std::span<const int64_t> last_locs,
                             bool decode);
  void check_map() const;
  PageAllocator full_, swa_;
  std::shared_ptr<std::vector<int64_t>> map_;
};

}  // namespace attnrt
