#include "attnrt/memory/page_allocator.h"

#include <algorithm>
#include <utility>

#include "attnrt/core/error.h"
#include "attnrt/core/fault_injection.h"
#include "src/memory/alloc_lens.h"

namespace attnrt {

PageAllocator::PageAllocator(int64_t size, int page_size) : page_size_(page_size) {
  ATTNRT_CHECK(page_size >= 1, "PageAllocator: page_size {} is invalid; it must be >= 1",
               page_size);
  ATTNRT_CHECK(size >= page_size,
               "PageAllocator: {} slots hold no whole page of {} slots; give at least page_size "
               "slots",
               size, page_size);
  num_pages_ = size / page_size;
  in_use_.assign(static_cast<size_t>(num_pages_) + 1, 0);
  in_use_[0] = 1;
  free_list_.reserve(static_cast<size_t>(num_pages_));
  // Popped from the back: page 1 is handed out first.
  for (int64_t p = num_pages_; p >= 1; --p) free_list_.push_back(p);
}

int64_t PageAllocator::take_page() {
  int64_t page = free_list_.back();
  free_list_.pop_back();
  in_use_[page] = 1;
  return page;
}

int64_t PageAllocator::check_extend(std::span<const int32_t> prefix_lens,
                                    std::span<const int32_t> seq_lens,
                                    std::span<const int64_t> last_locs, const char* what) const {
  ATTNRT_CHECK(prefix_lens.size() == seq_lens.size() && seq_lens.size() == last_locs.size(),
               "{}: {} prefix lengths, {} sequence lengths and {} last locations given; pass one "
               "of each per request",
               what, prefix_lens.size(), seq_lens.size(), last_locs.size());
  const int64_t P = page_size_;
  int64_t new_pages = 0;
  std::vector<std::pair<int64_t, size_t>> continued;  // (page, request) of partial pages filled
  for (size_t i = 0; i < seq_lens.size(); ++i) {
    const int64_t prefix = prefix_lens[i], seq = seq_lens[i], last = last_locs[i];
    ATTNRT_CHECK(prefix >= 0 && seq >= prefix,
                 "{}: request {} has prefix length {} and sequence length {}; need 0 <= prefix <= "
                 "sequence length",
                 what, i, prefix, seq);
    if (last == -1) {
      ATTNRT_CHECK(prefix % P == 0,
                   "{}: request {} has a prefix of {} tokens that ends inside a page of {} but "
                   "last_loc -1; pass the slot of its last cached token",
                   what, i, prefix, P);
    } else {
      ATTNRT_CHECK(prefix > 0,
                   "{}: request {} has no prefix but last_loc {}; pass -1 for a request without "
                   "cached tokens",
                   what, i, last);
      ATTNRT_CHECK(last >= P && last < pool_rows(),
                   "{}: last_locs[{}] = {} is not a usable slot; usable slots are {}..{} (page 0 "
                   "is reserved)",
                   what, i, last, P, pool_rows() - 1);
      ATTNRT_CHECK(in_use_[last / P] != 0,
                   "{}: last_locs[{}] = {} lies in page {}, which is not allocated; last_loc must "
                   "be the slot of the request's last cached token",
                   what, i, last, last / P);
      ATTNRT_CHECK((last + 1) % P == prefix % P,
                   "{}: last_locs[{}] = {} does not fit a prefix of {} tokens with page size {}: "
                   "slots keep slot % page_size == position % page_size, so (last_loc + 1) % {} "
                   "must be {}, not {}",
                   what, i, last, prefix, P, P, prefix % P, (last + 1) % P);
      if (prefix % P != 0 && seq > prefix) continued.emplace_back(last / P, i);
    }
    new_pages += (seq + P - 1) / P - (prefix + P - 1) / P;
  }
  std::sort(continued.begin(), continued.end());
  for (size_t j = 1; j < continued.size(); ++j) {
    ATTNRT_CHECK(continued[j].first != continued[j - 1].first,
                 "{}: requests {} and {} both continue page {}; a page belongs to one request",
                 what, continued[j - 1].second, continued[j].second, continued[j].first);
  }
  return new_pages;
}

std::vector<int64_t> PageAllocator::fill(std::span<const int32_t> prefix_lens,
                                         std::span<const int32_t> seq_lens,
                                         std::span<const int64_t> last_locs) {
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(alloc_lens::new_tokens(prefix_lens, seq_lens)));
  for (size_t i = 0; i < seq_lens.size(); ++i) {
    int64_t prev = last_locs[i];
    for (int64_t pos = prefix_lens[i]; pos < seq_lens[i]; ++pos) {
      const int64_t slot = pos % page_size_ == 0 ? take_page() * page_size_ : prev + 1;
      out.push_back(slot);
      prev = slot;
    }
  }
  return out;
}

std::vector<int64_t> PageAllocator::alloc_extend(std::span<const int32_t> prefix_lens,
                                                 std::span<const int32_t> seq_lens,
                                                 std::span<const int64_t> last_locs) {
  const int64_t pages = check_extend(prefix_lens, seq_lens, last_locs);
  if (pages > free_pages()) {
    fail(
        "alloc_extend: out of KV cache: {} requests need {} new slots ({} new pages of {}), but "
        "only {} of {} slots ({} pages) are free; use a larger KV pool (more slots) or fewer / "
        "shorter requests per step, or free finished requests first",
        seq_lens.size(), alloc_lens::new_tokens(prefix_lens, seq_lens), pages, page_size_,
        available_size(), num_pages_ * page_size_, free_pages());
  }
  fault_point(FaultSite::slot_alloc, "PageAllocator::alloc_extend");
  return fill(prefix_lens, seq_lens, last_locs);
}

std::vector<int64_t> PageAllocator::alloc_decode(std::span<const int32_t> seq_lens,
                                                 std::span<const int64_t> last_locs) {
  const std::vector<int32_t> prefix = alloc_lens::decode_prefix_lens(seq_lens);
  const int64_t pages = check_extend(prefix, seq_lens, last_locs, "alloc_decode");
  if (pages > free_pages()) {
    fail(
        "alloc_decode: out of KV cache: {} requests need {} new pages of {} slots, but only {} "
        "of {} pages are free; use a larger KV pool (more slots) or fewer running requests, or "
        "free finished requests first",
        seq_lens.size(), pages, page_size_, free_pages(), num_pages_);
  }
  fault_point(FaultSite::slot_alloc, "PageAllocator::alloc_decode");
  return fill(prefix, seq_lens, last_locs);
}

std::vector<int64_t> PageAllocator::pages_of(std::span<const int64_t> slots,
                                             const char* what) const {
  std::vector<int64_t> pages;
  pages.reserve(slots.size());
  for (size_t i = 0; i < slots.size(); ++i) {
    const int64_t s = slots[i];
    ATTNRT_CHECK(s >= page_size_ && s < pool_rows(),
                 "{}: slots[{}] = {} is not a usable slot; usable slots are {}..{} (page 0 is "
                 "reserved)",
                 what, i, s, page_size_, pool_rows() - 1);
    const int64_t page = s / page_size_;
    ATTNRT_CHECK(in_use_[page] != 0,
                 "{}: slots[{}] = {} lies in page {}, which is not allocated (freed twice?)", what,
                 i, s, page);
    pages.push_back(page);
  }
  std::sort(pages.begin(), pages.end());
  pages.erase(std::unique(pages.begin(), pages.end()), pages.end());
  return pages;
}

void PageAllocator::release_pages(const std::vector<int64_t>& pages) {
  // Descending, so that the lowest freed page is reused first.
  for (auto it = pages.rbegin(); it != pages.rend(); ++it) {
    in_use_[*it] = 0;
    free_list_.push_back(*it);
  }
}

void PageAllocator::free(std::span<const int64_t> slots) { release_pages(pages_of(slots)); }

void PageAllocator::check_invariants() const {
  ATTNRT_CHECK(in_use_.size() == static_cast<size_t>(num_pages_) + 1 && in_use_[0] != 0,
               "PageAllocator invariant: page 0 is reserved and must stay in use; it is {} ({} "
               "page flags for {} pages)",
               in_use_.empty() || in_use_[0] == 0 ? "free" : "in use", in_use_.size(), num_pages_);
  std::vector<uint8_t> listed(in_use_.size(), 0);
  for (size_t i = 0; i < free_list_.size(); ++i) {
    const int64_t page = free_list_[i];
    ATTNRT_CHECK(page >= 1 && page <= num_pages_,
                 "PageAllocator invariant: free list entry {} is page {}, outside the usable "
                 "pages 1..{}",
                 i, page, num_pages_);
    ATTNRT_CHECK(listed[page] == 0, "PageAllocator invariant: page {} is listed free twice", page);
    ATTNRT_CHECK(in_use_[page] == 0,
                 "PageAllocator invariant: page {} is listed free but marked in use", page);
    listed[page] = 1;
  }
  for (int64_t page = 1; page <= num_pages_; ++page) {
    ATTNRT_CHECK(listed[page] != 0 || in_use_[page] != 0,
                 "PageAllocator invariant: page {} is neither free nor in use (lost from the free "
                 "list); free + in use must be the {} usable pages",
                 page, num_pages_);
  }
}

void PageAllocator::check_invariants(const SlotOwners& owners) const {
  check_invariants();
  std::vector<int64_t> owner_of(in_use_.size(), -1);
  for (size_t o = 0; o < owners.size(); ++o) {
    for (int64_t s : owners[o]) {
      ATTNRT_CHECK(s >= page_size_ && s < pool_rows(),
                   "PageAllocator invariant: owner {} holds slot {}, which is not a usable slot "
                   "({}..{})",
                   o, s, page_size_, pool_rows() - 1);
      const int64_t page = s / page_size_;
      ATTNRT_CHECK(in_use_[page] != 0,
                   "PageAllocator invariant: owner {} holds slot {} in page {}, which is free", o,
                   s, page);
      const int64_t prev = owner_of[page];
      ATTNRT_CHECK(prev < 0 || prev == static_cast<int64_t>(o),
                   "PageAllocator invariant: page {} (slot {}) is held by owners {} and {}; a "
                   "page belongs to one owner",
                   page, s, prev, o);
      owner_of[page] = static_cast<int64_t>(o);
    }
  }
  for (int64_t page = 1; page <= num_pages_; ++page) {
    ATTNRT_CHECK(in_use_[page] == 0 || owner_of[page] >= 0,
                 "PageAllocator invariant: page {} (slots {}..{}) is in use but no owner holds "
                 "it: leaked",
                 page, page * page_size_, (page + 1) * page_size_ - 1);
  }
}

}  // namespace attnrt
