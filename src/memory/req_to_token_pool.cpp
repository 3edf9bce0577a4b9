#include "attnrt/memory/req_to_token_pool.h"

#include <limits>

#include "attnrt/core/error.h"
#include "attnrt/core/fault_injection.h"

namespace attnrt {

ReqToTokenPool::ReqToTokenPool(int size, int max_context_len)
    : size_(size), max_context_len_(max_context_len) {
  ATTNRT_CHECK(size >= 1, "ReqToTokenPool: size {} is invalid; it needs at least one request row",
               size);
  ATTNRT_CHECK(max_context_len >= 1,
               "ReqToTokenPool: max_context_len {} is invalid; it must be >= 1", max_context_len);
  fault_point(FaultSite::host_alloc, "ReqToTokenPool table");
  table_.assign(static_cast<size_t>(size) * static_cast<size_t>(max_context_len), 0);
  in_use_.assign(static_cast<size_t>(size), 0);
  generation_.assign(static_cast<size_t>(size), 0);
  free_rows_.reserve(static_cast<size_t>(size));
  // Popped from the back: row 0 is handed out first.
  for (int r = size - 1; r >= 0; --r) free_rows_.push_back(r);
}

int ReqToTokenPool::alloc() {
  ATTNRT_CHECK(!free_rows_.empty(),
               "ReqToTokenPool: all {} request rows are in use; allow more running requests "
               "(max_requests) or free finished requests first",
               size_);
  fault_point(FaultSite::slot_alloc, "ReqToTokenPool::alloc");
  const int row = free_rows_.back();
  free_rows_.pop_back();
  in_use_[row] = 1;
  generation_[row] = next_generation_++;
  return row;
}

bool ReqToTokenPool::is_allocated(int row) const {
  return row >= 0 && row < size_ && in_use_[row] != 0;
}

void ReqToTokenPool::free(int row) {
  ATTNRT_CHECK(row >= 0 && row < size_, "ReqToTokenPool::free: row {} is out of range 0..{}", row,
               size_ - 1);
  ATTNRT_CHECK(in_use_[row] != 0, "ReqToTokenPool::free: row {} is not allocated (freed twice?)",
               row);
  in_use_[row] = 0;
  generation_[row] = next_generation_++;
  free_rows_.push_back(row);
}

void ReqToTokenPool::check_invariants() const {
  std::vector<uint8_t> listed(static_cast<size_t>(size_), 0);
  for (size_t i = 0; i < free_rows_.size(); ++i) {
    const int row = free_rows_[i];
    ATTNRT_CHECK(row >= 0 && row < size_,
                 "ReqToTokenPool invariant: free list entry {} is row {}, outside 0..{}", i, row,
                 size_ - 1);
    ATTNRT_CHECK(listed[row] == 0, "ReqToTokenPool invariant: row {} is listed free twice", row);
    ATTNRT_CHECK(in_use_[row] == 0,
                 "ReqToTokenPool invariant: row {} is listed free but marked allocated", row);
    listed[row] = 1;
  }
  for (int row = 0; row < size_; ++row) {
    ATTNRT_CHECK(listed[row] != 0 || in_use_[row] != 0,
                 "ReqToTokenPool invariant: row {} is neither free nor allocated (lost from the "
                 "free list); free + allocated must be the {} rows",
                 row, size_);
  }
}

void ReqToTokenPool::check_invariants(std::span<const int> live_rows) const {
  check_invariants();
  std::vector<int> owner(static_cast<size_t>(size_), -1);
  for (size_t i = 0; i < live_rows.size(); ++i) {
    const int row = live_rows[i];
    ATTNRT_CHECK(is_allocated(row),
                 "ReqToTokenPool invariant: live request {} holds row {}, which is not an "
                 "allocated row (rows 0..{})",
                 i, row, size_ - 1);
    ATTNRT_CHECK(owner[row] < 0,
                 "ReqToTokenPool invariant: row {} is held by live requests {} and {}; a row "
                 "belongs to one request",
                 row, owner[row], i);
    owner[row] = static_cast<int>(i);
  }
  for (int row = 0; row < size_; ++row) {
    ATTNRT_CHECK(in_use_[row] == 0 || owner[row] >= 0,
                 "ReqToTokenPool invariant: row {} is allocated but no live request holds it: "
                 "leaked",
                 row);
  }
}

void ReqToTokenPool::write(int row, int start, std::span<const int64_t> slots) {
  ATTNRT_CHECK(is_allocated(row),
               "ReqToTokenPool::write: row {} is not an allocated request row (rows 0..{}, "
               "allocate one with alloc())",
               row, size_ - 1);
  ATTNRT_CHECK(start >= 0 && static_cast<int64_t>(start) + static_cast<int64_t>(slots.size()) <=
                                 max_context_len_,
               "ReqToTokenPool::write: tokens [{}, {}) of row {} do not fit max_context_len {}",
               start, static_cast<int64_t>(start) + static_cast<int64_t>(slots.size()), row,
               max_context_len_);
  for (size_t i = 0; i < slots.size(); ++i) {
    ATTNRT_CHECK(slots[i] >= 0 && slots[i] <= std::numeric_limits<int32_t>::max(),
                 "ReqToTokenPool::write: slots[{}] = {} is not a KV slot (0..{})", i, slots[i],
                 std::numeric_limits<int32_t>::max());
  }
  if (start == 0 && !slots.empty()) generation_[row] = next_generation_++;
  int32_t* dst = table_.data() + static_cast<size_t>(row) * max_context_len_ + start;
  for (size_t i = 0; i < slots.size(); ++i) dst[i] = static_cast<int32_t>(slots[i]);
}

}  // namespace attnrt
