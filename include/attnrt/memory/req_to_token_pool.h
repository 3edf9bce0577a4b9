// ReqToTokenPool: request row -> token slots (reference-semantics §4.1).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace attnrt {

class ReqToTokenPool {
 public:
  ReqToTokenPool(int size, int max_context_len);

  int alloc();          // a free row; throws attnrt::Error when every row is in use
  void free(int row);   // throws on a row that is not allocated
  // req_to_token[row, start : start + slots.size()) = slots; checks bounds first.
  void write(int row, int start, std::span<const int64_t> slots);
  int32_t get(int row, int col) const { return table_[static_cast<size_t>(row) * max_context_len_ + col]; }
  const int32_t* row_ptr(int row) const { return table_.data() + static_cast<size_t>(row) * max_context_len_; }
  const int32_t* data() const { return table_.data(); }
  // Changes whenever the row changes hands (alloc, free) or is rewritten from column 0. Between
  // two changes the row belongs to one request whose committed tokens keep their slots, so a
  // backend may keep the page ids of committed columns across steps while this value holds.
  uint64_t generation(int row) const { return generation_[static_cast<size_t>(row)]; }
  // Changes whenever any row's generation does: while it holds, every generation() does too.
  uint64_t generation_epoch() const { return next_generation_; }

  int size() const { return size_; }
  int max_context_len() const { return max_context_len_; }
  int available() const { return static_cast<int>(free_rows_.size()); }
  bool is_allocated(int row) const;

  // Throws attnrt::Error naming the first broken invariant and its row: the free rows are in range
  // 0..size-1, each listed once and none allocated, and free + allocated == size. O(size).
  void check_invariants() const;
  // The same, and the allocated rows are exactly `live_rows` (one per live request: a row listed
  // twice is shared by two requests; an allocated row not listed is leaked).
  void check_invariants(std::span<const int> live_rows) const;

 private:
  int size_;
  int max_context_len_;
  std::vector<int32_t> table_;
  std::vector<int> free_rows_;
  std::vector<uint8_t> in_use_;
  std::vector<uint64_t> generation_;
  uint64_t next_generation_ = 1;
};

}  // namespace attnrt
