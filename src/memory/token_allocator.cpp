#include "attnrt/memory/token_allocator.h"

#include <algorithm>

#include "attnrt/core/error.h"
#include "src/memory/alloc_lens.h"

namespace attnrt {

SWATokenAllocator::SWATokenAllocator(int64_t full_size, int64_t swa_size, int page_size)
    : full_(full_size, page_size), swa_(swa_size, page_size) {
  map_ = std::make_shared<std::vector<int64_t>>(static_cast<size_t>(full_.pool_rows()) + 1, 0);
  map_->back() = -1;
}

std::vector<int64_t> SWATokenAllocator::swa_last_locs(std::span<const int32_t> prefix_lens,
                                                      std::span<const int64_t> last_locs,
                                                      const char* what) const {
  const auto& m = *map_;
  const int P = page_size();
  std::vector<int64_t> out(last_locs.size());
  for (size_t i = 0; i < last_locs.size(); ++i) {
    if (last_locs[i] == -1) {
      out[i] = -1;
      continue;
    }
    const int64_t s = m[static_cast<size_t>(last_locs[i])];
    if (s != 0) {
      out[i] = s;
    } else {
      // The last token left the window; that only matters when its page is to be continued.
      ATTNRT_CHECK(prefix_lens[i] % P == 0,
                   "{}: request {} continues the page of last_loc {}, but that token's SWA slot "
                   "was already released by free_swa; release SWA slots only in whole pages that "
                   "no running request still extends",
                   what, i, last_locs[i]);
      out[i] = -1;
    }
  }
  return out;
}

// Everything is validated, and the SWA pool's capacity checked, before the full pool changes: the
// full allocation is then the only step that can fail, and it fails without a change.
std::vector<int64_t> SWATokenAllocator::alloc(std::span<const int32_t> prefix_lens,
                                              std::span<const int32_t> seq_lens,
                                              std::span<const int64_t> last_locs, bool decode) {
  const char* what = decode ? "alloc_decode" : "alloc_extend";
  full_.check_extend(prefix_lens, seq_lens, last_locs, what);
  const auto swa_last = swa_last_locs(prefix_lens, last_locs, what);
  const int64_t swa_pages =
      swa_.check_extend(prefix_lens, seq_lens, swa_last,
                        decode ? "alloc_decode (SWA pool)" : "alloc_extend (SWA pool)");
  if (swa_pages > swa_.free_pages()) {
    if (decode) {
      fail(
          "alloc_decode: out of SWA KV cache: {} requests need {} new pages of {} slots, but only "
          "{} of {} SWA pages are free; give the SWA pool more slots (swa_slots or a larger "
          "swa_full_tokens_ratio) or release tokens that left the window with free_swa",
          seq_lens.size(), swa_pages, page_size(), swa_.free_pages(), swa_.num_pages());
    }
    fail(
        "alloc_extend: out of SWA KV cache: {} requests need {} new slots ({} new pages of {}), "
        "but only {} of {} SWA slots are free; give the SWA pool more slots (swa_slots or a "
        "larger swa_full_tokens_ratio) or release tokens that left the window with free_swa",
        seq_lens.size(), alloc_lens::new_tokens(prefix_lens, seq_lens), swa_pages, page_size(),
        swa_.available_size(), swa_.num_pages() * page_size());
  }
  const std::vector<int64_t> full_slots =
      decode ? full_.alloc_decode(seq_lens, last_locs)
             : full_.alloc_extend(prefix_lens, seq_lens, last_locs);
  std::vector<int64_t> swa_slots;
  try {
    swa_slots = decode ? swa_.alloc_decode(seq_lens, swa_last)
                       : swa_.alloc_extend(prefix_lens, seq_lens, swa_last);
  } catch (const Error&) {
    // Validated and within capacity above, so only an injected fault lands here: give back the
    // full pages this call took (those whose first slot it handed out; slot % P == position % P),
    // not the partial pages it continued, so that the call changes nothing.
    const int64_t P = page_size();
    std::vector<int64_t> taken;
    for (int64_t s : full_slots) {
      if (s % P == 0) taken.push_back(s);
    }
    if (!taken.empty()) full_.free(taken);
    throw;
  }
  auto& m = *map_;
  for (size_t i = 0; i < full_slots.size(); ++i) {
    m[static_cast<size_t>(full_slots[i])] = swa_slots[i];
  }
  return full_slots;
}

std::vector<int64_t> SWATokenAllocator::alloc_extend(std::span<const int32_t> prefix_lens,
                                                     std::span<const int32_t> seq_lens,
                                                     std::span<const int64_t> last_locs) {
  return alloc(prefix_lens, seq_lens, last_locs, false);
}

std::vector<int64_t> SWATokenAllocator::alloc_decode(std::span<const int32_t> seq_lens,
                                                     std::span<const int64_t> last_locs) {
  return alloc(alloc_lens::decode_prefix_lens(seq_lens), seq_lens, last_locs, true);
}

void SWATokenAllocator::free(std::span<const int64_t> slots) {
  // The full pool frees whole pages, so every token of those pages loses its SWA slot too.
  const auto pages = full_.pages_of(slots, "free");
  auto& m = *map_;
  const int64_t P = page_size();
  std::vector<int64_t> swa_slots;
  for (int64_t p : pages) {
    for (int64_t s = p * P; s < (p + 1) * P; ++s) {
      if (m[static_cast<size_t>(s)] != 0) swa_slots.push_back(m[static_cast<size_t>(s)]);
    }
  }
  full_.free(slots);
  swa_.free(swa_slots);
  for (int64_t p : pages) std::fill(m.begin() + p * P, m.begin() + (p + 1) * P, 0);
}

void SWATokenAllocator::free_swa(std::span<const int64_t> slots) {
  full_.pages_of(slots, "free_swa");  // validates every slot, changes nothing
  auto& m = *map_;
  const int64_t P = page_size();
  std::vector<int64_t> given;
  given.reserve(slots.size());
  for (int64_t s : slots) {
    if (m[static_cast<size_t>(s)] != 0) given.push_back(s);
  }
  std::sort(given.begin(), given.end());
  given.erase(std::unique(given.begin(), given.end()), given.end());
  for (size_t i = 0; i < given.size();) {
    const int64_t page = given[i] / P;
    size_t j = i;
    while (j < given.size() && given[j] / P == page) ++j;
    int64_t mapped = 0;
    for (int64_t s = page * P; s < (page + 1) * P; ++s) mapped += m[static_cast<size_t>(s)] != 0;
    ATTNRT_CHECK(static_cast<int64_t>(j - i) == mapped,
                 "free_swa: full page {} has {} tokens with SWA slots but only {} of them were "
                 "given; SWA slots are released in whole pages of {}, so pass every token of a "
                 "page once all of them have left the window",
                 page, mapped, j - i, P);
    i = j;
  }
  std::vector<int64_t> swa_slots(given.size());
  for (size_t i = 0; i < given.size(); ++i) swa_slots[i] = m[static_cast<size_t>(given[i])];
  swa_.free(swa_slots);
  for (int64_t s : given) m[static_cast<size_t>(s)] = 0;
}

void SWATokenAllocator::check_invariants() const {
  full_.check_invariants();
  swa_.check_invariants();
  check_map();
}

void SWATokenAllocator::check_invariants(const SlotOwners& owners) const {
  full_.check_invariants(owners);
  swa_.check_invariants();
  check_map();
}

void SWATokenAllocator::check_map() const {
  const auto& m = *map_;
  const int64_t P = page_size();
  const int64_t full_rows = full_.pool_rows();
  ATTNRT_CHECK(static_cast<int64_t>(m.size()) == full_rows + 1 && m.back() == -1,
               "SWATokenAllocator invariant: the full->SWA map has {} entries ending in {}; it "
               "must have {} (full rows + 1) ending in -1",
               m.size(), m.empty() ? 0 : m.back(), full_rows + 1);
  std::vector<int64_t> mapped_from(static_cast<size_t>(swa_.pool_rows()), -1);
  std::vector<int64_t> swa_page_owner(static_cast<size_t>(swa_.num_pages()) + 1, -1);
  for (int64_t s = 0; s < full_rows; ++s) {
    const int64_t v = m[static_cast<size_t>(s)];
    if (v == 0) continue;
    ATTNRT_CHECK(s >= P && full_.page_in_use(s / P),
                 "SWATokenAllocator invariant: full slot {} maps to SWA slot {}, but its full page "
                 "{} is not in use; freed full pages must have no SWA slots",
                 s, v, s / P);
    ATTNRT_CHECK(v >= P && v < swa_.pool_rows() && swa_.page_in_use(v / P),
                 "SWATokenAllocator invariant: full slot {} maps to SWA slot {}, which is not in "
                 "an SWA page in use (usable SWA slots {}..{})",
                 s, v, P, swa_.pool_rows() - 1);
    ATTNRT_CHECK(v % P == s % P,
                 "SWATokenAllocator invariant: full slot {} maps to SWA slot {}; offsets in the "
                 "page must match ({} vs {})",
                 s, v, s % P, v % P);
    ATTNRT_CHECK(mapped_from[v] < 0,
                 "SWATokenAllocator invariant: SWA slot {} is mapped from full slots {} and {}; "
                 "an SWA slot belongs to one token",
                 v, mapped_from[v], s);
    mapped_from[v] = s;
    int64_t& owner = swa_page_owner[v / P];
    ATTNRT_CHECK(owner < 0 || owner == s / P,
                 "SWATokenAllocator invariant: SWA page {} holds tokens of full pages {} and {}; "
                 "an SWA page belongs to one full page",
                 v / P, owner, s / P);
    owner = s / P;
  }
  for (int64_t page = 1; page <= swa_.num_pages(); ++page) {
    ATTNRT_CHECK(!swa_.page_in_use(page) || swa_page_owner[page] >= 0,
                 "SWATokenAllocator invariant: SWA page {} is in use but no full slot maps into "
                 "it: leaked",
                 page);
  }
}

int64_t SWATokenAllocator::available_size() const {
  return std::min(full_.available_size(), swa_.available_size());
}

}  // namespace attnrt
