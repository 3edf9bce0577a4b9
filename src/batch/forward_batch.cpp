#include "attnrt/batch/forward_batch.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <unordered_map>

#include "attnrt/core/error.h"
#include "src/batch/step_layout_checked.h"
#include "src/core/index_scan.h"

namespace attnrt {

// ---------------------------------------------------------------------------------------------
// SpecInfo

SpecInfo SpecInfo::chain(int batch_size, int num_draft_tokens) {
  ATTNRT_CHECK(batch_size >= 0, "SpecInfo::chain: batch_size = {}; must be >= 0", batch_size);
  ATTNRT_CHECK(num_draft_tokens >= 1,
               "SpecInfo::chain: num_draft_tokens = {}; a verify block holds at least the root (>= 1)",
               num_draft_tokens);
  ATTNRT_CHECK(int64_t{batch_size} * num_draft_tokens <= std::numeric_limits<int32_t>::max(),
               "SpecInfo::chain: batch_size = {} times num_draft_tokens = {} is more block tokens "
               "than a step holds (2^31 - 1)",
               batch_size, num_draft_tokens);
  SpecInfo s;
  s.draft_token_num = num_draft_tokens;
  s.topk = 1;
  s.parents.resize(static_cast<size_t>(batch_size) * num_draft_tokens);
  for (int r = 0; r < batch_size; ++r) {
    for (int t = 0; t < num_draft_tokens; ++t) {
      s.parents[static_cast<size_t>(r) * num_draft_tokens + t] = t - 1;
    }
  }
  return s;
}

SpecInfo SpecInfo::from_retrive(int batch_size, int num_draft_tokens, int topk,
                                const std::vector<int32_t>& next_token,
                                const std::vector<int32_t>& next_sibling) {
  const int n = num_draft_tokens;
  ATTNRT_CHECK(batch_size >= 0, "SpecInfo::from_retrive: batch_size = {}; must be >= 0", batch_size);
  ATTNRT_CHECK(n >= 1, "SpecInfo::from_retrive: num_draft_tokens = {}; must be >= 1", n);
  ATTNRT_CHECK(topk >= 1, "SpecInfo::from_retrive: topk = {}; must be >= 1", topk);
  const size_t total = static_cast<size_t>(batch_size) * n;
  ATTNRT_CHECK(next_token.size() == total,
               "SpecInfo::from_retrive: next_token has {} entries; expected batch_size * "
               "num_draft_tokens = {} * {} = {}",
               next_token.size(), batch_size, n, total);
  ATTNRT_CHECK(next_sibling.size() == total,
               "SpecInfo::from_retrive: next_sibling has {} entries; expected batch_size * "
               "num_draft_tokens = {} * {} = {}",
               next_sibling.size(), batch_size, n, total);
  SpecInfo s;
  s.draft_token_num = n;
  s.topk = topk;
  s.parents.assign(total, -1);
  // A node is "placed" once its parent is known; the root is placed from the start. Assigning a
  // parent twice or linking to an unplaced node means the links do not describe one tree.
  std::vector<uint8_t> placed(static_cast<size_t>(n));
  for (int r = 0; r < batch_size; ++r) {
    const size_t base = static_cast<size_t>(r) * n;
    std::fill(placed.begin(), placed.end(), 0);
    placed[0] = 1;
    auto link = [&](const char* field, int t, int target, int parent) {
      ATTNRT_CHECK(target >= -1 && target < n,
                   "SpecInfo::from_retrive: {}[{}, {}] = {}; allowed: -1 or a block index in [0, {})",
                   field, r, t, target, n);
      if (target < 0) return;
      ATTNRT_CHECK(target > t,
                   "SpecInfo::from_retrive: {}[{}, {}] = {}; a linked node must come after node {} "
                   "(parents precede children, siblings follow each other)",
                   field, r, t, target, t);
      ATTNRT_CHECK(!placed[target],
                   "SpecInfo::from_retrive: request {}: node {} is reached twice ({}[{}] = {}); the "
                   "links must form a tree",
                   r, target, field, t, target);
      s.parents[base + target] = parent;
      placed[target] = 1;
    };
    for (int t = 0; t < n; ++t) {
      ATTNRT_CHECK(placed[t],
                   "SpecInfo::from_retrive: request {}: node {} is not reachable from the root "
                   "through next_token/next_sibling links that precede it",
                   r, t);
      link("next_token", t, next_token[base + t], t);
      const int sibling = next_sibling[base + t];
      ATTNRT_CHECK(!(t == 0 && sibling >= 0),
                   "SpecInfo::from_retrive: next_sibling[{}, 0] = {}; the root has no siblings (-1)",
                   r, sibling);
      link("next_sibling", t, sibling, s.parents[base + t]);
    }
  }
  return s;
}

int SpecInfo::depth(int request, int t) const {
  const int n = draft_token_num;
  ATTNRT_CHECK(t >= 0 && t < n, "SpecInfo::depth: token {} outside the block [0, {})", t, n);
  const size_t base = static_cast<size_t>(request) * n;
  ATTNRT_CHECK(request >= 0 && base + n <= parents.size(),
               "SpecInfo::depth: request {} outside the {} requests described by parents", request,
               n > 0 ? parents.size() / n : 0);
  int d = 0;
  // Parents precede children (checked by the batch validator), so this walk takes at most t steps;
  // the bound keeps a malformed, unvalidated SpecInfo from looping.
  for (int u = t; parents[base + u] >= 0 && d <= n; u = parents[base + u]) ++d;
  ATTNRT_CHECK(d <= n, "SpecInfo::depth: the parents of request {} contain a cycle", request);
  return d;
}

bool SpecInfo::visible(int request, int t, int u) const {
  const int n = draft_token_num;
  ATTNRT_CHECK(t >= 0 && t < n && u >= 0 && u < n,
               "SpecInfo::visible: tokens ({}, {}) outside the block [0, {})", t, u, n);
  const size_t base = static_cast<size_t>(request) * n;
  ATTNRT_CHECK(request >= 0 && base + n <= parents.size(),
               "SpecInfo::visible: request {} outside the {} requests described by parents",
               request, n > 0 ? parents.size() / n : 0);
  int steps = 0;
  for (int a = t; a >= 0 && steps <= n; a = parents[base + a], ++steps) {
    if (a == u) return true;
  }
  return false;
}

std::vector<uint8_t> SpecInfo::full_mask(const std::vector<int32_t>& seq_lens) const {
  const int n = draft_token_num;
  ATTNRT_CHECK(n >= 1, "SpecInfo::full_mask: draft_token_num = {}; must be >= 1", n);
  ATTNRT_CHECK(parents.size() == seq_lens.size() * n,
               "SpecInfo::full_mask: {} seq_lens but parents describe {} requests of {} tokens",
               seq_lens.size(), parents.size() / n, n);
  size_t total = 0;
  for (size_t r = 0; r < seq_lens.size(); ++r) {
    ATTNRT_CHECK(seq_lens[r] >= 0, "SpecInfo::full_mask: seq_lens[{}] = {}; must be >= 0", r,
                 seq_lens[r]);
    total += static_cast<size_t>(n) * (seq_lens[r] + n);
  }
  std::vector<uint8_t> mask(total, 0);
  size_t off = 0;
  for (size_t r = 0; r < seq_lens.size(); ++r) {
    const int cols = seq_lens[r] + n;
    for (int t = 0; t < n; ++t) {
      uint8_t* row = mask.data() + off + static_cast<size_t>(t) * cols;
      std::fill(row, row + seq_lens[r], uint8_t{1});
      for (int u = 0; u < n; ++u) row[seq_lens[r] + u] = visible(static_cast<int>(r), t, u);
    }
    off += static_cast<size_t>(n) * cols;
  }
  return mask;
}

// ---------------------------------------------------------------------------------------------
// ForwardBatch

int64_t ForwardBatch::seq_lens_sum() const {
  return std::accumulate(seq_lens.begin(), seq_lens.end(), int64_t{0});
}

namespace {

// Validation shared by make_step_layout and the builders (which leave out_cache_loc empty).
class LayoutBuilder {
 public:
  // fused = false: the checked path only (make_step_layout_checked), for tests to compare with.
  explicit LayoutBuilder(const ForwardBatch& b, bool fused = true)
      : b_(b), mode_(forward_mode_name(b.mode)), fused_(fused) {}

  StepLayout build(bool check_slots, bool check_positions = true) {
    StepLayout l;
    build(l, check_slots, check_positions);
    return l;
  }

  // Fills `l` in place (its vectors keep their capacity).
  void build(StepLayout& l, bool check_slots, bool check_positions = true) {
    const int bs = b_.batch_size;
    ATTNRT_CHECK(mode_ != "?", "ForwardBatch: mode value {} is not a ForwardMode",
                 static_cast<int>(b_.mode));
    ATTNRT_CHECK(bs >= 0, "ForwardBatch ({}): batch_size = {}; must be >= 0", mode_, bs);
    if (is_idle(b_.mode)) {
      ATTNRT_CHECK(bs == 0, "ForwardBatch (IDLE): batch_size = {}; an IDLE step has no requests (0)",
                   bs);
    }
    check_size("req_pool_indices", b_.req_pool_indices.size(), bs);
    check_size("seq_lens", b_.seq_lens.size(), bs);
    check_rows();

    l.prefix_lens.resize(bs);
    l.query_lens.resize(bs);
    l.query_start.resize(bs + 1);
    if (fused_ && check_slots && check_positions && derive_fused(l)) return;
    l.num_tokens = 0;
    l.max_query_len = 0;
    l.max_kv_len = 0;
    switch (b_.mode) {
      case ForwardMode::IDLE:
        break;
      case ForwardMode::EXTEND:
      case ForwardMode::MIXED:
        derive_extend(l);
        break;
      case ForwardMode::DECODE:
        derive_decode(l);
        break;
      case ForwardMode::TARGET_VERIFY:
        derive_verify(l);
        break;
      case ForwardMode::DRAFT_EXTEND:
      case ForwardMode::DRAFT_EXTEND_V2:
        derive_draft_extend(l);
        break;
    }

    l.query_start.assign(bs + 1, 0);
    for (int i = 0; i < bs; ++i) {
      l.query_start[i + 1] = l.query_start[i] + l.query_lens[i];
      l.max_query_len = std::max(l.max_query_len, l.query_lens[i]);
      l.max_kv_len = std::max(l.max_kv_len, l.kv_len(i));
    }
    l.num_tokens = l.query_start[bs];
    check_start_loc(l);
    if (check_slots) {
      ATTNRT_CHECK(b_.num_tokens() == l.num_tokens,
                   "ForwardBatch ({}): out_cache_loc has {} entries; expected one per query token "
                   "({})",
                   mode_, b_.out_cache_loc.size(), l.num_tokens);
    }
    if (check_positions) this->check_positions(l);
  }

 private:
  void check_size(const char* field, size_t got, int64_t want) const {
    ATTNRT_CHECK(static_cast<int64_t>(got) == want,
                 "ForwardBatch ({}): {} has {} entries; expected {}", mode_, field, got, want);
  }

  // Fields that a mode may leave empty but must fill consistently when given.
  bool optional_size(const char* field, size_t got) const {
    if (got == 0) return false;
    check_size(field, got, b_.batch_size);
    return true;
  }

  void check_rows() const {
    if (!fused_ || !rows_distinct_fast()) check_rows_hashed();
  }

  // The common case of check_rows: every row >= 0 and below 2^20, stamped in a table indexed by
  // row (thread-local, grown to the largest row seen) with a per-call stamp, so nothing is hashed
  // or cleared. True when all rows are such and distinct; otherwise check_rows_hashed decides and
  // names the problem.
  bool rows_distinct_fast() const {
    constexpr uint64_t kStampedRows = uint64_t{1} << 20;
    const int64_t* rows = b_.req_pool_indices.data();
    const int bs = b_.batch_size;
    uint64_t bits = 0;  // >= every row; a negative row sets the top bit
    for (int i = 0; i < bs; ++i) bits |= static_cast<uint64_t>(rows[i]);
    if (bits >= kStampedRows) return false;
    struct Stamps {
      std::vector<uint32_t> at;  // [row]: stamp of the call that last saw the row
      uint32_t now = 0;
    };
    thread_local Stamps stamps;
    if (stamps.at.size() <= bits) stamps.at.resize(bits + 1, 0);
    if (++stamps.now == 0) {  // wrapped: forget every stamp
      std::fill(stamps.at.begin(), stamps.at.end(), 0);
      stamps.now = 1;
    }
    uint32_t* at = stamps.at.data();
    const uint32_t now = stamps.now;
    unsigned dup = 0;
    for (int i = 0; i < bs; ++i) {
      dup |= at[rows[i]] == now;
      at[rows[i]] = now;
    }
    return dup == 0;
  }

  // Duplicate rows through an open-addressing table of the rows seen (thread-local scratch: no
  // allocation per step once grown; a hash map allocated a node per request).
  void check_rows_hashed() const {
    const int bs = b_.batch_size;
    // row + 1, 0 = empty (unsigned: row + 1 of row INT64_MAX fits); then the request index.
    thread_local std::vector<uint64_t> slots;
    size_t cap = 16;
    while (cap < 2 * static_cast<size_t>(bs)) cap *= 2;
    slots.assign(2 * cap, 0);
    const size_t mask = cap - 1;
    for (int i = 0; i < bs; ++i) {
      const int64_t row = b_.req_pool_indices[i];
      ATTNRT_CHECK(row >= 0, "ForwardBatch ({}): req_pool_indices[{}] = {}; rows are >= 0", mode_,
                   i, row);
      const uint64_t key = static_cast<uint64_t>(row) + 1;
      size_t h = (static_cast<uint64_t>(row) * 0x9e3779b97f4a7c15ull) >> 32 & mask;
      while (slots[h] != 0 && slots[h] != key) h = (h + 1) & mask;
      ATTNRT_CHECK(slots[h] == 0,
                   "ForwardBatch ({}): req_pool_indices[{}] = {} duplicates req_pool_indices[{}]; "
                   "each request of a step has its own row",
                   mode_, i, row, slots[cap + h]);
      slots[h] = key;
      slots[cap + h] = static_cast<uint64_t>(i);
    }
  }

  // The fused twin of derive_*, the query offsets, check_start_loc, the out_cache_loc size and
  // check_positions for the modes of a serving step: a few branch-free passes whose flags only say
  // whether the batch passes, and no formatting. Fills `l` and returns true exactly when that
  // checked path accepts the batch, with the same layout; false (a bad batch, or a mode not covered
  // here) sends build() down the checked path, which names the first problem. So it decides how
  // fast a good batch goes, never what is accepted.
  bool derive_fused(StepLayout& l) const {
    switch (b_.mode) {
      case ForwardMode::EXTEND:
      case ForwardMode::MIXED:
        return extend_fused(l);
      case ForwardMode::DECODE:
        return decode_fused(l);
      case ForwardMode::TARGET_VERIFY:
        return verify_fused(l);
      default:
        return false;
    }
  }

  // An optional per-request field: empty, or one entry per request.
  bool fits(size_t got) const { return got == 0 || got == static_cast<size_t>(b_.batch_size); }

  // out_cache_loc and positions have one entry per query token.
  bool token_sizes_fit(int64_t tokens) const {
    return b_.num_tokens() == tokens && static_cast<int64_t>(b_.positions.size()) == tokens;
  }

  // v empty, or v[i] == a[i] + d for every request.
  bool empty_or_offset(const std::vector<int32_t>& v, const int32_t* a, int64_t d) const {
    unsigned bad = 0;
    for (size_t i = 0; i < v.size(); ++i) bad |= int64_t{v[i]} != a[i] + d;
    return bad == 0;
  }

  // v empty, or v[i] == x for every request.
  static bool empty_or_all(const std::vector<int32_t>& v, int32_t x) {
    unsigned bad = 0;
    for (const int32_t e : v) bad |= e != x;
    return bad == 0;
  }

  // extend_start_loc empty, or extend_start_loc[i] == i * step for every request.
  bool empty_or_strided_starts(int64_t step) const {
    const std::vector<int32_t>& v = b_.extend_start_loc;
    unsigned bad = 0;
    for (size_t i = 0; i < v.size(); ++i) bad |= int64_t{v[i]} != static_cast<int64_t>(i) * step;
    return bad == 0;
  }

  // positions[query_start[i] + t] == prefix_lens[i] + t for every query token (its sizes checked).
  bool positions_count_up(const StepLayout& l) const {
    return all_count_up(b_.positions.data(), l.query_start.data(), l.prefix_lens.data(),
                        l.query_lens.data(), static_cast<size_t>(b_.batch_size));
  }

  bool extend_fused(StepLayout& l) const {
    const int bs = b_.batch_size;
    const auto n = static_cast<size_t>(bs);
    if (b_.extend_prefix_lens.size() != n || b_.extend_seq_lens.size() != n ||
        b_.extend_start_loc.size() != n) {
      return false;
    }
    const int32_t *pre = b_.extend_prefix_lens.data(), *ext = b_.extend_seq_lens.data();
    const int32_t *seq = b_.seq_lens.data(), *loc = b_.extend_start_loc.data();
    unsigned bad = 0;
    int64_t total = 0;
    int32_t max_q = 0, max_kv = 0;
    for (int i = 0; i < bs; ++i) {
      const int32_t p = pre[i], e = ext[i];
      const int64_t kv = int64_t{p} + e;
      bad |= (p < 0) | (e < 1) | (seq[i] != kv) | (loc[i] != total);
      l.prefix_lens[i] = p;
      l.query_lens[i] = e;
      l.query_start[i] = total;
      total += e;
      max_q = std::max(max_q, e);
      max_kv = std::max(max_kv, static_cast<int32_t>(kv));
    }
    if (bad != 0 || !token_sizes_fit(total)) return false;
    l.query_start[bs] = total;
    l.num_tokens = total;
    l.max_query_len = max_q;
    l.max_kv_len = max_kv;
    return positions_count_up(l);
  }

  bool decode_fused(StepLayout& l) const {
    const int bs = b_.batch_size;
    if (!fits(b_.extend_seq_lens.size()) || !fits(b_.extend_prefix_lens.size()) ||
        !fits(b_.extend_start_loc.size()) || !token_sizes_fit(bs)) {
      return false;
    }
    const int32_t* seq = b_.seq_lens.data();
    unsigned bad = !all_offset(b_.positions.data(), seq, -1, static_cast<size_t>(bs));
    int32_t max_kv = 0;
    for (int i = 0; i < bs; ++i) {
      const int32_t s = seq[i];
      bad |= s < 1;
      l.prefix_lens[i] = static_cast<int32_t>(int64_t{s} - 1);
      l.query_lens[i] = 1;
      l.query_start[i] = i;
      max_kv = std::max(max_kv, s);
    }
    if (bad != 0 || !empty_or_all(b_.extend_seq_lens, 1) ||
        !empty_or_offset(b_.extend_prefix_lens, seq, -1) || !empty_or_strided_starts(1)) {
      return false;
    }
    l.query_start[bs] = bs;
    l.num_tokens = bs;
    l.max_query_len = bs > 0 ? 1 : 0;
    l.max_kv_len = max_kv;
    return true;
  }

  bool verify_fused(StepLayout& l) const {
    if (!b_.spec_info) return false;
    const SpecInfo& s = *b_.spec_info;
    const int bs = b_.batch_size, n = s.draft_token_num;
    const int64_t total = int64_t{bs} * n;
    if (n < 1 || s.topk < 1 || static_cast<int64_t>(s.parents.size()) != total ||
        !fits(b_.extend_seq_lens.size()) || !fits(b_.extend_prefix_lens.size()) ||
        !fits(b_.extend_start_loc.size()) || !token_sizes_fit(total)) {
      return false;
    }
    const int32_t* par = s.parents.data();
    unsigned bad = 0;
    for (int r = 0; r < bs; ++r) {
      const int32_t* p = par + static_cast<size_t>(r) * n;
      if (s.is_chain()) {
        for (int t = 0; t < n; ++t) bad |= p[t] != t - 1;
      } else {
        bad |= p[0] != -1;
        for (int t = 1; t < n; ++t) bad |= (p[t] < 0) | (p[t] >= t);
      }
    }
    const int32_t* seq = b_.seq_lens.data();
    int32_t max_kv = 0;
    for (int i = 0; i < bs; ++i) {
      const int32_t sl = seq[i];
      bad |= (sl < 0) | (int64_t{sl} + n > INT32_MAX);
      l.prefix_lens[i] = sl;
      l.query_lens[i] = n;
      l.query_start[i] = int64_t{i} * n;
      max_kv = std::max(max_kv, static_cast<int32_t>(int64_t{sl} + n));
    }
    if (bad != 0 || !empty_or_all(b_.extend_seq_lens, n) ||
        !empty_or_offset(b_.extend_prefix_lens, seq, 0) || !empty_or_strided_starts(n)) {
      return false;
    }
    l.query_start[bs] = total;
    l.num_tokens = total;
    l.max_query_len = bs > 0 ? n : 0;
    l.max_kv_len = max_kv;
    // A chain's depths are the block indices; an empty step has no tree to walk (and its
    // draft_token_num, unchecked against any parents, must not size the scratch below).
    if (s.is_chain() || bs == 0) return positions_count_up(l);
    thread_local std::vector<int32_t> depth;
    depth.resize(n);
    const int64_t* pos = b_.positions.data();
    for (int i = 0; i < bs; ++i) {
      const int32_t* p = par + static_cast<size_t>(i) * n;
      for (int t = 0; t < n; ++t) depth[t] = p[t] < 0 ? 0 : depth[p[t]] + 1;
      const int64_t* row = pos + static_cast<size_t>(i) * n;
      for (int t = 0; t < n; ++t) bad |= row[t] != int64_t{seq[i]} + depth[t];
    }
    return bad == 0;
  }

  void derive_extend(StepLayout& l) const {
    check_size("extend_prefix_lens", b_.extend_prefix_lens.size(), b_.batch_size);
    check_size("extend_seq_lens", b_.extend_seq_lens.size(), b_.batch_size);
    for (int i = 0; i < b_.batch_size; ++i) {
      const int32_t p = b_.extend_prefix_lens[i], e = b_.extend_seq_lens[i];
      ATTNRT_CHECK(p >= 0, "ForwardBatch ({}): extend_prefix_lens[{}] = {}; must be >= 0", mode_,
                   i, p);
      ATTNRT_CHECK(e >= 1,
                   "ForwardBatch ({}): extend_seq_lens[{}] = {}; every request extends by >= 1 "
                   "token",
                   mode_, i, e);
      ATTNRT_CHECK(b_.seq_lens[i] == static_cast<int64_t>(p) + e,
                   "ForwardBatch ({}): seq_lens[{}] = {}; must equal extend_prefix_lens + "
                   "extend_seq_lens = {} + {} = {}",
                   mode_, i, b_.seq_lens[i], p, e, static_cast<int64_t>(p) + e);
      l.prefix_lens[i] = p;
      l.query_lens[i] = e;
    }
  }

  void derive_decode(StepLayout& l) const {
    const bool has_ext = optional_size("extend_seq_lens", b_.extend_seq_lens.size());
    const bool has_prefix = optional_size("extend_prefix_lens", b_.extend_prefix_lens.size());
    for (int i = 0; i < b_.batch_size; ++i) {
      const int32_t s = b_.seq_lens[i];
      ATTNRT_CHECK(s >= 1,
                   "ForwardBatch (DECODE): seq_lens[{}] = {}; decode seq_lens include the new "
                   "token (>= 1)",
                   i, s);
      if (has_ext) {
        ATTNRT_CHECK(b_.extend_seq_lens[i] == 1,
                     "ForwardBatch (DECODE): extend_seq_lens[{}] = {}; a decode request has "
                     "exactly 1 new token (or leave extend_seq_lens empty)",
                     i, b_.extend_seq_lens[i]);
      }
      if (has_prefix) {
        ATTNRT_CHECK(b_.extend_prefix_lens[i] == s - 1,
                     "ForwardBatch (DECODE): extend_prefix_lens[{}] = {}; must be seq_lens - 1 = "
                     "{} (or leave it empty)",
                     i, b_.extend_prefix_lens[i], s - 1);
      }
      l.prefix_lens[i] = s - 1;
      l.query_lens[i] = 1;
    }
  }

  void derive_verify(StepLayout& l) const {
    ATTNRT_CHECK(b_.spec_info.has_value(),
                 "ForwardBatch (TARGET_VERIFY): spec_info is missing; a verify step needs the "
                 "draft token count and the tree parents");
    const SpecInfo& s = *b_.spec_info;
    const int n = s.draft_token_num;
    ATTNRT_CHECK(n >= 1,
                 "ForwardBatch (TARGET_VERIFY): spec_info.draft_token_num = {}; must be >= 1 (the "
                 "root counts)",
                 n);
    ATTNRT_CHECK(s.topk >= 1, "ForwardBatch (TARGET_VERIFY): spec_info.topk = {}; must be >= 1",
                 s.topk);
    check_size("spec_info.parents", s.parents.size(), static_cast<int64_t>(b_.batch_size) * n);
    for (int r = 0; r < b_.batch_size; ++r) {
      const int32_t* par = s.parents.data() + static_cast<size_t>(r) * n;
      ATTNRT_CHECK(par[0] == -1,
                   "ForwardBatch (TARGET_VERIFY): spec_info.parents[{}] = {} (request {}, token 0); "
                   "the root's parent is -1",
                   static_cast<size_t>(r) * n, par[0], r);
      for (int t = 1; t < n; ++t) {
        ATTNRT_CHECK(par[t] >= 0 && par[t] < t,
                     "ForwardBatch (TARGET_VERIFY): spec_info.parents[{}] = {} (request {}, token "
                     "{}); a parent is an earlier block token in [0, {})",
                     static_cast<size_t>(r) * n + t, par[t], r, t, t);
        ATTNRT_CHECK(!s.is_chain() || par[t] == t - 1,
                     "ForwardBatch (TARGET_VERIFY): spec_info.parents[{}] = {} (request {}, token "
                     "{}) but topk = 1 means a chain (parent {}); set topk > 1 for a tree",
                     static_cast<size_t>(r) * n + t, par[t], r, t, t - 1);
      }
    }
    const bool has_ext = optional_size("extend_seq_lens", b_.extend_seq_lens.size());
    const bool has_prefix = optional_size("extend_prefix_lens", b_.extend_prefix_lens.size());
    for (int i = 0; i < b_.batch_size; ++i) {
      const int32_t sl = b_.seq_lens[i];
      ATTNRT_CHECK(sl >= 0,
                   "ForwardBatch (TARGET_VERIFY): seq_lens[{}] = {}; verify seq_lens count the "
                   "tokens before the drafts (>= 0)",
                   i, sl);
      ATTNRT_CHECK(int64_t{sl} + n <= INT32_MAX,
                   "ForwardBatch (TARGET_VERIFY): seq_lens[{}] = {} plus draft_token_num = {} is "
                   "{} keys; a request holds at most 2^31 - 1",
                   i, sl, n, int64_t{sl} + n);
      if (has_ext) {
        ATTNRT_CHECK(b_.extend_seq_lens[i] == n,
                     "ForwardBatch (TARGET_VERIFY): extend_seq_lens[{}] = {}; must be "
                     "draft_token_num = {} (or leave it empty)",
                     i, b_.extend_seq_lens[i], n);
      }
      if (has_prefix) {
        ATTNRT_CHECK(b_.extend_prefix_lens[i] == sl,
                     "ForwardBatch (TARGET_VERIFY): extend_prefix_lens[{}] = {}; must be seq_lens = "
                     "{} (or leave it empty)",
                     i, b_.extend_prefix_lens[i], sl);
      }
      l.prefix_lens[i] = sl;
      l.query_lens[i] = n;
    }
  }

  void derive_draft_extend(StepLayout& l) const {
    const bool v2 = is_draft_extend_v2(b_.mode);
    check_size("extend_seq_lens", b_.extend_seq_lens.size(), b_.batch_size);
    const bool has_prefix = optional_size("extend_prefix_lens", b_.extend_prefix_lens.size());
    const SpecInfo* s = b_.spec_info ? &*b_.spec_info : nullptr;
    const bool has_accept = s && optional_size("spec_info.accept_length", s->accept_length.size());
    for (int i = 0; i < b_.batch_size; ++i) {
      const int32_t e = b_.extend_seq_lens[i], sl = b_.seq_lens[i];
      ATTNRT_CHECK(e >= 1,
                   "ForwardBatch ({}): extend_seq_lens[{}] = {}; a draft extend re-runs >= 1 token "
                   "(accept_length + 1)",
                   mode_, i, e);
      if (v2) {
        ATTNRT_CHECK(e == b_.extend_seq_lens[0],
                     "ForwardBatch (DRAFT_EXTEND_V2): extend_seq_lens[{}] = {} but "
                     "extend_seq_lens[0] = {}; V2 pads every request to one fixed width",
                     i, e, b_.extend_seq_lens[0]);
        if (s && s->draft_token_num > 0) {
          ATTNRT_CHECK(e == s->draft_token_num,
                       "ForwardBatch (DRAFT_EXTEND_V2): extend_seq_lens[{}] = {}; V2 width must be "
                       "spec_info.draft_token_num = {}",
                       i, e, s->draft_token_num);
        }
      } else if (has_accept) {
        ATTNRT_CHECK(s->accept_length[i] >= 0 && e == int64_t{s->accept_length[i]} + 1,
                     "ForwardBatch (DRAFT_EXTEND): extend_seq_lens[{}] = {} but "
                     "spec_info.accept_length[{}] = {}; must be accept_length + 1",
                     i, e, i, s->accept_length[i]);
      }
      ATTNRT_CHECK(sl >= e,
                   "ForwardBatch ({}): seq_lens[{}] = {} < extend_seq_lens[{}] = {}; draft-extend "
                   "seq_lens count the tokens after acceptance, the re-run ones included",
                   mode_, i, sl, i, e);
      if (has_prefix) {
        ATTNRT_CHECK(b_.extend_prefix_lens[i] == sl - e,
                     "ForwardBatch ({}): extend_prefix_lens[{}] = {}; must be seq_lens - "
                     "extend_seq_lens = {} (or leave it empty)",
                     mode_, i, b_.extend_prefix_lens[i], sl - e);
      }
      l.prefix_lens[i] = sl - e;
      l.query_lens[i] = e;
    }
  }

  void check_start_loc(const StepLayout& l) const {
    const bool required = is_extend_or_draft_extend_or_mixed(b_.mode, /*include_v2=*/true);
    if (!required && b_.extend_start_loc.empty()) return;
    check_size("extend_start_loc", b_.extend_start_loc.size(), b_.batch_size);
    for (int i = 0; i < b_.batch_size; ++i) {
      ATTNRT_CHECK(b_.extend_start_loc[i] == l.query_start[i],
                   "ForwardBatch ({}): extend_start_loc[{}] = {}; must be the exclusive prefix sum "
                   "of the query lengths ({})",
                   mode_, i, b_.extend_start_loc[i], l.query_start[i]);
    }
  }

  void check_positions(const StepLayout& l) const {
    ATTNRT_CHECK(static_cast<int64_t>(b_.positions.size()) == l.num_tokens,
                 "ForwardBatch ({}): positions has {} entries; expected one per query token ({})",
                 mode_, b_.positions.size(), l.num_tokens);
    const bool verify = is_target_verify(b_.mode);
    // Verify: depths from the parents, which derive_verify checked (a parent precedes its child).
    thread_local std::vector<int32_t> depth;
    const int n = verify ? b_.spec_info->draft_token_num : 0;
    if (verify) depth.resize(n);
    for (int i = 0; i < b_.batch_size; ++i) {
      if (verify) {
        const int32_t* par = b_.spec_info->parents.data() + static_cast<size_t>(i) * n;
        for (int t = 0; t < n; ++t) depth[t] = par[t] < 0 ? 0 : depth[par[t]] + 1;
      }
      for (int t = 0; t < l.query_lens[i]; ++t) {
        const int64_t want = verify ? int64_t{l.prefix_lens[i]} + depth[t]
                                    : int64_t{l.prefix_lens[i]} + t;
        const int64_t row = l.query_start[i] + t;
        ATTNRT_CHECK(b_.positions[row] == want,
                     "ForwardBatch ({}): positions[{}] = {} (request {}, query {}); expected {} ({})",
                     mode_, row, b_.positions[row], i, t, want,
                     verify ? "seq_len + depth in the draft tree" : "prefix length + query index");
      }
    }
  }

  const ForwardBatch& b_;
  std::string_view mode_;
  bool fused_;
};

void fill_positions_and_starts(ForwardBatch& b, const std::vector<int32_t>& prefix,
                               const std::vector<int32_t>& ext) {
  b.extend_start_loc.resize(b.batch_size);
  b.positions.clear();
  int32_t start = 0;
  for (int i = 0; i < b.batch_size; ++i) {
    b.extend_start_loc[i] = start;
    start += ext[i];
    for (int t = 0; t < ext[i]; ++t) b.positions.push_back(int64_t{prefix[i]} + t);
  }
}

void check_builder_sizes(const char* builder, const char* field, size_t got, size_t want) {
  ATTNRT_CHECK(got == want, "{}: {} has {} entries but req_rows has {}", builder, field, got, want);
}

}  // namespace

StepLayout make_step_layout(const ForwardBatch& batch) {
  return LayoutBuilder(batch).build(/*check_slots=*/true);
}

void make_step_layout(const ForwardBatch& batch, StepLayout& layout) {
  LayoutBuilder(batch).build(layout, /*check_slots=*/true);
}

void make_step_layout_checked(const ForwardBatch& batch, StepLayout& layout) {
  LayoutBuilder(batch, /*fused=*/false).build(layout, /*check_slots=*/true);
}

ForwardBatch make_extend_batch(const std::vector<int64_t>& req_rows,
                               const std::vector<int32_t>& prefix_lens,
                               const std::vector<int32_t>& extend_lens, ForwardMode mode) {
  ATTNRT_CHECK(mode == ForwardMode::EXTEND || mode == ForwardMode::MIXED,
               "make_extend_batch: mode {}; allowed: EXTEND, MIXED (use make_verify_batch or "
               "make_draft_extend_batch for speculative steps)",
               forward_mode_name(mode));
  check_builder_sizes("make_extend_batch", "prefix_lens", prefix_lens.size(), req_rows.size());
  check_builder_sizes("make_extend_batch", "extend_lens", extend_lens.size(), req_rows.size());
  ForwardBatch b;
  b.mode = mode;
  b.batch_size = static_cast<int>(req_rows.size());
  b.req_pool_indices = req_rows;
  b.extend_prefix_lens = prefix_lens;
  b.extend_seq_lens = extend_lens;
  b.seq_lens.resize(b.batch_size);
  for (int i = 0; i < b.batch_size; ++i) b.seq_lens[i] = prefix_lens[i] + extend_lens[i];
  fill_positions_and_starts(b, prefix_lens, extend_lens);
  LayoutBuilder(b).build(/*check_slots=*/false);
  return b;
}

ForwardBatch make_decode_batch(const std::vector<int64_t>& req_rows,
                               const std::vector<int32_t>& seq_lens_including_new) {
  check_builder_sizes("make_decode_batch", "seq_lens", seq_lens_including_new.size(),
                      req_rows.size());
  ForwardBatch b;
  b.mode = ForwardMode::DECODE;
  b.batch_size = static_cast<int>(req_rows.size());
  b.req_pool_indices = req_rows;
  b.seq_lens = seq_lens_including_new;
  b.extend_seq_lens.assign(b.batch_size, 1);
  b.extend_prefix_lens.resize(b.batch_size);
  for (int i = 0; i < b.batch_size; ++i) b.extend_prefix_lens[i] = b.seq_lens[i] - 1;
  fill_positions_and_starts(b, b.extend_prefix_lens, b.extend_seq_lens);
  LayoutBuilder(b).build(/*check_slots=*/false);
  return b;
}

ForwardBatch make_verify_batch(const std::vector<int64_t>& req_rows,
                               const std::vector<int32_t>& seq_lens_before_drafts, SpecInfo spec) {
  check_builder_sizes("make_verify_batch", "seq_lens", seq_lens_before_drafts.size(),
                      req_rows.size());
  ForwardBatch b;
  b.mode = ForwardMode::TARGET_VERIFY;
  b.batch_size = static_cast<int>(req_rows.size());
  b.req_pool_indices = req_rows;
  b.seq_lens = seq_lens_before_drafts;
  b.extend_prefix_lens = seq_lens_before_drafts;
  b.extend_seq_lens.assign(b.batch_size, spec.draft_token_num);
  b.spec_info = std::move(spec);
  b.extend_start_loc.resize(b.batch_size);
  const int n = b.spec_info->draft_token_num;
  for (int i = 0; i < b.batch_size; ++i) b.extend_start_loc[i] = i * n;
  // Positions come from the tree depths, which are only meaningful once the parents are validated.
  LayoutBuilder(b).build(/*check_slots=*/false, /*check_positions=*/false);
  b.positions.resize(static_cast<size_t>(b.batch_size) * n);
  for (int i = 0; i < b.batch_size; ++i) {
    for (int t = 0; t < n; ++t) {
      b.positions[static_cast<size_t>(i) * n + t] =
          int64_t{b.seq_lens[i]} + b.spec_info->depth(i, t);
    }
  }
  return b;
}

ForwardBatch make_draft_extend_batch(const std::vector<int64_t>& req_rows,
                                     const std::vector<int32_t>& seq_lens_after_accept,
                                     const std::vector<int32_t>& accept_lengths) {
  check_builder_sizes("make_draft_extend_batch", "seq_lens", seq_lens_after_accept.size(),
                      req_rows.size());
  check_builder_sizes("make_draft_extend_batch", "accept_lengths", accept_lengths.size(),
                      req_rows.size());
  ForwardBatch b;
  b.mode = ForwardMode::DRAFT_EXTEND;
  b.batch_size = static_cast<int>(req_rows.size());
  b.req_pool_indices = req_rows;
  b.seq_lens = seq_lens_after_accept;
  b.extend_seq_lens.resize(b.batch_size);
  b.extend_prefix_lens.resize(b.batch_size);
  for (int i = 0; i < b.batch_size; ++i) {
    ATTNRT_CHECK(accept_lengths[i] >= 0 && accept_lengths[i] < INT32_MAX,
                 "make_draft_extend_batch: accept_lengths[{}] = {}; must be in [0, 2^31 - 2]", i,
                 accept_lengths[i]);
    b.extend_seq_lens[i] = accept_lengths[i] + 1;
    b.extend_prefix_lens[i] = b.seq_lens[i] - b.extend_seq_lens[i];
  }
  SpecInfo s;
  s.accept_length = accept_lengths;
  b.spec_info = std::move(s);
  fill_positions_and_starts(b, b.extend_prefix_lens, b.extend_seq_lens);
  LayoutBuilder(b).build(/*check_slots=*/false);
  return b;
}

ForwardBatch make_draft_extend_v2_batch(const std::vector<int64_t>& req_rows,
                                        const std::vector<int32_t>& seq_lens, int width) {
  check_builder_sizes("make_draft_extend_v2_batch", "seq_lens", seq_lens.size(), req_rows.size());
  ATTNRT_CHECK(width >= 1, "make_draft_extend_v2_batch: width = {}; must be >= 1", width);
  ForwardBatch b;
  b.mode = ForwardMode::DRAFT_EXTEND_V2;
  b.batch_size = static_cast<int>(req_rows.size());
  b.req_pool_indices = req_rows;
  b.seq_lens = seq_lens;
  b.extend_seq_lens.assign(b.batch_size, width);
  b.extend_prefix_lens.resize(b.batch_size);
  for (int i = 0; i < b.batch_size; ++i) b.extend_prefix_lens[i] = seq_lens[i] - width;
  SpecInfo s;
  s.draft_token_num = width;
  b.spec_info = std::move(s);
  fill_positions_and_starts(b, b.extend_prefix_lens, b.extend_seq_lens);
  LayoutBuilder(b).build(/*check_slots=*/false);
  return b;
}

ForwardBatch make_idle_batch() {
  ForwardBatch b;
  b.mode = ForwardMode::IDLE;
  return b;
}

}  // namespace attnrt
