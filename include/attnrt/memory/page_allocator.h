// PageAllocator: token slots handed out in pages (reference-semantics §4.2).
// Slot = page_id * page_size + offset; page 0 is reserved (dummy rows of padded graph replays write
// there), so a pool backing this allocator has (num_pages + 1) * page_size rows.
// Invariant: a request's token at position `pos` lives in a slot with slot % page_size ==
// pos % page_size, and the tokens of one page belong to one request, in order.
// Every failing call throws attnrt::Error and leaves the allocator unchanged.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace attnrt {

// The slots each holder of KV slots holds (a running request, a cached prefix), one list per
// holder, for the leak checks of check_invariants().
using SlotOwners = std::vector<std::vector<int64_t>>;

class PageAllocator {
 public:
  // `size` usable token slots (rounded down to whole pages, at least one page); page_size >= 1.
  PageAllocator(int64_t size, int page_size);

  // Per request: fill the rest of its partial last page (contiguous after last_loc), then whole new
  // pages, then one partial page. last_loc = slot of the request's last existing token; -1 when it
  // has none (prefix 0), and -1 is also accepted when the prefix ends on a page boundary, since no
  // partial page is continued then. Returns sum(seq_lens - prefix_lens) slots, request-major.
  std::vector<int64_t> alloc_extend(std::span<const int32_t> prefix_lens,
                                    std::span<const int32_t> seq_lens,
                                    std::span<const int64_t> last_locs);
  // One slot per request: last_loc + 1 inside the partial page, else the first slot of a new page.
  // seq_lens include the token being allocated.
  std::vector<int64_t> alloc_decode(std::span<const int32_t> seq_lens,
                                    std::span<const int64_t> last_locs);
  // Validates an alloc_extend call without changing anything and returns the number of new pages it
  // takes (sum over requests of ceil(seq/P) - ceil(prefix/P)). `what` names the caller in messages.
  int64_t check_extend(std::span<const int32_t> prefix_lens, std::span<const int32_t> seq_lens,
                       std::span<const int64_t> last_locs, const char* what = "alloc_extend") const;
  // Frees the pages that hold these slots (every page once; freeing a free page is an error).
  void free(std::span<const int64_t> slots);
  // The distinct pages holding `slots`, ascending; throws (changing nothing) on a slot outside the
  // usable pages or on a page that is not in use.
  std::vector<int64_t> pages_of(std::span<const int64_t> slots, const char* what = "free") const;

  // Throws attnrt::Error naming the first broken invariant and its page: page 0 is reserved; the
  // free list holds usable pages (1..num_pages), each once and none in use; every other usable page
  // is in use (free + in use == num_pages). O(num_pages).
  void check_invariants() const;
  // The same, and the pages in use are exactly those of `owners`' slots, none held by two owners
  // (a page in use that no owner holds is leaked). O(num_pages + slots listed).
  void check_invariants(const SlotOwners& owners) const;

  int page_size() const { return page_size_; }
  int64_t num_pages() const { return num_pages_; }
  int64_t free_pages() const { return static_cast<int64_t>(free_list_.size()); }
  int64_t available_size() const { return free_pages() * page_size_; }
  int64_t pool_rows() const { return (num_pages_ + 1) * page_size_; }  // rows a KV pool needs
  bool page_in_use(int64_t page) const { return in_use_[page] != 0; }

 private:
  int64_t take_page();
  void release_pages(const std::vector<int64_t>& pages);
  std::vector<int64_t> fill(std::span<const int32_t> prefix_lens, std::span<const int32_t> seq_lens,
                            std::span<const int64_t> last_locs);
  int page_size_;
  int64_t num_pages_;
  std::vector<int64_t> free_list_;  // popped from the back
  std::vector<uint8_t> in_use_;     // [num_pages + 1], page 0 always "in use"
};

}  // namespace attnrt
