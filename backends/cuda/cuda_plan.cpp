#include "backends/cuda/cuda_plan.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <utility>

#include "attnrt/core/error.h"

namespace attnrt::cuda {

namespace {

size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Four int32 lanes (GCC / Clang vector extension): one 16-byte store of a quarter of a ReqInfo,
// or one field of four requests in the steady-decode pass. The compiler lowers them to SSE2 on
// plain x86-64 (emulating the 32-bit multiply it lacks) and to NEON on Arm.
using I32x4 = int32_t __attribute__((vector_size(16)));
using U32x4 = uint32_t __attribute__((vector_size(16)));
using U64x2 = uint64_t __attribute__((vector_size(16)));
static_assert(sizeof(ReqInfo) == 3 * sizeof(I32x4));

// 16 bytes at any alignment, as a vector; and a vector into 16 bytes. (A memcpy from a vector
// into a buffer was compiled to two 8-byte stores through the stack.)
template <typename V, typename T>
V load4(const T* p) {
  static_assert(sizeof(V) == 16);
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
template <typename V>
void store4(void* p, V v) {
  using Unaligned [[gnu::vector_size(16), gnu::aligned(1), gnu::may_alias]] = int32_t;
  *static_cast<Unaligned*>(p) = std::bit_cast<Unaligned>(v);
}
// The lane-wise minimum and maximum as compare and select (SSE2 has no 32-bit min / max).
I32x4 min4(I32x4 a, I32x4 b) {
  const I32x4 a_less = a < b;
  return (a & a_less) | (b & ~a_less);
}
I32x4 max4(I32x4 a, I32x4 b) {
  const I32x4 a_less = a < b;
  return (b & a_less) | (a & ~a_less);
}
// The low and the high 32-bit halves of four int64 values (little-endian lanes).
struct Halves {
  U32x4 lo, hi;
};
Halves halves4(const int64_t* p) {
  const U32x4 a = load4<U32x4>(p), b = load4<U32x4>(p + 2);
  return {__builtin_shufflevector(a, b, 0, 2, 4, 6), __builtin_shufflevector(a, b, 1, 3, 5, 7)};
}
// Fields a, b, c, d of four consecutive requests (a lane each) into 16 bytes of each request at
// `dst` (the first request's), through a 4 x 4 transpose.
void store_transposed(char* dst, I32x4 a, I32x4 b, I32x4 c, I32x4 d) {
  const I32x4 ab01 = __builtin_shufflevector(a, b, 0, 4, 1, 5);
  const I32x4 ab23 = __builtin_shufflevector(a, b, 2, 6, 3, 7);
  const I32x4 cd01 = __builtin_shufflevector(c, d, 0, 4, 1, 5);
  const I32x4 cd23 = __builtin_shufflevector(c, d, 2, 6, 3, 7);
  store4(dst, __builtin_shufflevector(ab01, cd01, 0, 1, 4, 5));
  store4(dst + sizeof(ReqInfo), __builtin_shufflevector(ab01, cd01, 2, 3, 6, 7));
  store4(dst + 2 * sizeof(ReqInfo), __builtin_shufflevector(ab23, cd23, 0, 1, 4, 5));
  store4(dst + 3 * sizeof(ReqInfo), __builtin_shufflevector(ab23, cd23, 2, 3, 6, 7));
}

// Split counts up to this many are taken by compares: a length kv <= s * chunk has
// ceil(kv / chunk) = #{k in [0, s): kv > k * chunk} splits, so the split counts of a batch, or
// their sum, are counts of lengths above a few thresholds, four lengths at a time, where a
// division a request (a multiply by 1 / chunk in double) took a dependent convert, multiply and
// convert back per request and candidate.
constexpr int kCompareSplits = 8;

// k * chunk as a compare threshold for int32 lengths (none exceeds INT32_MAX).
int32_t threshold(int64_t k, uint32_t chunk) {
  return static_cast<int32_t>(std::min<int64_t>(k * chunk, INT32_MAX));
}

// How many of the n lengths at kv exceed `above`.
int64_t count_above(const int32_t* kv, int n, int32_t above) {
  I32x4 acc = {0, 0, 0, 0};
  int i = 0;
  for (; i + 4 <= n; i += 4) acc -= load4<I32x4>(kv + i) > above;
  int64_t count = int64_t{acc[0]} + acc[1] + acc[2] + acc[3];
  for (; i < n; ++i) count += kv[i] > above ? 1 : 0;
  return count;
}

}  // namespace

// The lengths of a graph's replays are unknown at capture, so this is choose_chunk's wave model
// for requests long enough that a CTA's start-up and the merge do not count: s splits of a
// request cost (s w + 0.5 (ceil(s w) - s w)) / s of its unsplit stream, w = the unsplit CTAs per
// resident slot, which is least at the most splits whose CTAs still fit one wave. (One more
// split, as in "fill the GPU at least once", starts a second wave: on the H200, 64 x 1024 at four
// CTAs per SM, 2 splits instead of 1 made the graph's 32-layer step 8% slower than eager.)
int graph_splits(const PlannerConfig& cfg, size_t c, TileShape shape, int bs, int tokens_per_req) {
  const int64_t tiles = ceil_div(int64_t{tokens_per_req} * cfg.groups[c], tile_rows(shape));
  const int64_t base = int64_t{bs} * tiles * cfg.num_kv_heads_max;
  const int64_t cap = int64_t{cfg.sm_count} * cfg.occupancy[c][static_cast<int>(shape)];
  return static_cast<int>(std::clamp<int64_t>(cap / std::max<int64_t>(base, 1), 1, kMaxSplits));
}

HostPlanner::HostPlanner(PlannerConfig config) : config_(std::move(config)) {
  ATTNRT_CHECK(!config_.groups.empty() && config_.head_dims.size() == config_.groups.size() &&
                   config_.occupancy.size() == config_.groups.size(),
               "cuda plan: {} layer classes with {} head dims and {} occupancies; expected one "
               "each per class (at least one class)",
               config_.groups.size(), config_.head_dims.size(), config_.occupancy.size());
  classes_.resize(config_.groups.size());
  for (size_t c = 0; c < classes_.size(); ++c)
    classes_[c] = {config_.groups[c], config_.head_dims[c], config_.occupancy[c], {}};
  plan_.classes.resize(config_.groups.size());
}

void HostPlanner::enable_row_table(int rows, int64_t pages_per_row) {
  pages_per_row_ = pages_per_row;
  rows_.assign(rows, kUnknownRow);
  stamp_ = 0;
  num_commits_ = 0;
  commits_launched_ = false;
  steady_n_ = 0;
  steady_ahead_ = false;
}

void HostPlanner::drop_commits(int n) {
  release_steady(false);
  for (int i = 0; i < n; ++i) rows_[row_of_[i]].pending = -1;
}

void HostPlanner::release_steady(bool launched) {
  if (steady_ahead_) {
    const int shift = std::countr_zero(static_cast<unsigned>(steady_page_));
    const int32_t* known = launched ? kv_.data() : kv_last_.data();
    for (int i = 0; i < steady_n_; ++i) {
      RowState& rs = rows_[row_of_[i]];
      rs.known = known[i] >> shift;
      rs.pending = kv_[i] >> shift;
    }
  }
  steady_ahead_ = false;
  steady_n_ = 0;
}

// One pass over the requests: lengths (from `derive`), the checks the plan and the kernels rely
// on, the running token and page offsets, the pages the row table already holds and the commits
// (as if the step were incremental; prepare() drops them in the rare step that is not), each
// request written in the kernels' layout. The commits are kept in the row states (`pending`),
// whose line the request reads anyway, rather than in a list the next plan applies. (Prefetching
// the page-table entry write() reads first was measured slower: 2.55 -> 2.77 us for decode at
// batch 256.) The loop is compiled per row-table use (kTrack: the step may be incremental;
// kCommit: its kernels store pages back) and for DECODE, a failed check leaves it through one
// branch to reject_request(), and the key lengths' statistics are taken in a second pass over
// their array: a request costs few instructions besides its stores (decode at batch 256 here:
// 2.35 -> 1.9 us for the plan).
template <bool kDecode, bool kTrack, bool kCommit, typename Derive>
void HostPlanner::scan(const ForwardBatch& batch, Derive derive) {
  const int raw_bs = batch.batch_size;
  const int shift = shift_;
  const int64_t* rows = batch.req_pool_indices.data();
  const ReqToTokenPool* pool = pool_;
  const uint64_t pool_rows = pool != nullptr ? static_cast<uint64_t>(pool->size()) : 0;
  const int64_t max_ctx = pool != nullptr ? pool->max_context_len() : 0;
  const int64_t offset_mask = (int64_t{1} << shift) - 1;
  const int32_t not_tree = tree_ ? 0 : -1;  // tree_start: the first token, or -1 (| not_tree)
  const int64_t pages_per_row = pages_per_row_;
  RowState* state = rows_.data();
  const uint32_t seen = stamp_;
  const uint64_t epoch = pool != nullptr ? pool->generation_epoch() : 0;
  // DECODE commits the page its token completes too (its key is stored by this step and keeps its
  // slot from then on), so that a steady decode uploads one page per request: the one its own
  // token lies in, which write() takes from out_cache_loc. A later step at a lower prefix (a
  // rejected draft decoded again) clamps `known` below it and its commit rewrites the entry.
  ReqInfo* info = info_;
  int32_t* row_of = row_of_.data();
  int32_t* kvs = kv_.data();
  // DECODE: the bits of the write slots that break write()'s check (the sign, and an offset in the
  // page other than the token's position's); write() takes the token's page from the slot.
  const int64_t* loc = batch.out_cache_loc.data();
  // A DCP rank's batch (docs/dcp.md): a row whose slot is the dummy 0 is a query that is no key
  // here; its last key is in its row, not at its slot, so the step takes the row's pages.
  const uint64_t dcp_dummy = batch.dcp_partial ? 1 : 0;
  const uint64_t slot_bits = static_cast<uint64_t>(offset_mask) | (uint64_t{1} << 63);
  uint64_t bad_slots = 0;
  Stats st;
  int32_t pt = 0;
  auto request = [&](int i) __attribute__((always_inline)) {
    int32_t prefix, qlen;
    const bool lens_ok = derive(i, prefix, qlen);
    const int64_t row = rows[i];
    const int64_t kv = int64_t{prefix} + qlen;
    if (!lens_ok || static_cast<uint64_t>(row) >= pool_rows || kv > max_ctx) [[unlikely]]
      reject_request(batch, i, prefix, qlen);
    RowState& rs = state[row];
    if (rs.stamp == seen) [[unlikely]]
      reject_request(batch, i, prefix, qlen);
    rs.stamp = seen;
    const auto pages = static_cast<int32_t>((kv + offset_mask) >> shift);
    int32_t known = 0, committed = 0, pt_row = -1;
    if constexpr (kTrack) {
      // The last plan of this row was launched (prepare() dropped its commits otherwise).
      rs.known = rs.pending >= 0 ? rs.pending : rs.known;
      if (rs.checked != epoch) [[unlikely]] {
        // A row that changed hands holds none of its pages in the row table, whether or not
        // this plan's kernels run.
        const uint64_t gen = pool->generation(static_cast<int>(row));
        if (rs.gen != gen) {
          rs.gen = gen;
          rs.known = 0;
        }
        rs.checked = epoch;
      }
      known = std::min(rs.known, prefix >> shift);
      const int32_t done = static_cast<int32_t>((kDecode ? kv : prefix) >> shift);
      committed = kCommit ? std::max(done, known) : known;
      pt_row = static_cast<int32_t>(row * pages_per_row);
      rs.pending = kCommit ? committed : -1;
    }
    info[i] = {st.tokens, qlen,  prefix,    static_cast<int32_t>(kv),
               pt,        1,     0,         st.tokens | not_tree,
               pt_row,    known, committed, 0};
    row_of[i] = static_cast<int32_t>(row);
    kvs[i] = static_cast<int32_t>(kv);
    if constexpr (kDecode) {
      const int64_t slot = loc[i];
      bad_slots |= (static_cast<uint64_t>(slot) ^ static_cast<uint64_t>(prefix)) & slot_bits;
      bad_slots |= dcp_dummy & static_cast<uint64_t>(slot == 0);
    }
    st.tokens += qlen;
    pt += pages - known;
    st.min_q = std::min(st.min_q, qlen);
    st.max_q = std::max(st.max_q, qlen);
  };
  // The row states of a batch lie anywhere in the pool: a request's is fetched a few requests
  // ahead, so that the misses of a cold plan overlap.
  constexpr int kAhead = 32;
  const uint64_t last_row = pool_rows > 0 ? pool_rows - 1 : 0;
  auto prefetch = [&](int i) {
    __builtin_prefetch(state + std::min(static_cast<uint64_t>(rows[i]), last_row), 1);
  };
  for (int i = 0; i < std::min(raw_bs, kAhead); ++i) prefetch(i);
  int i = 0;
  for (; i + kAhead < raw_bs; ++i) {
    prefetch(i + kAhead);
    request(i);
  }
  for (; i < raw_bs; ++i) request(i);
  for (int j = 0; j < raw_bs; ++j) {
    const auto kv = static_cast<uint32_t>(kvs[j]);
    st.min_kv = std::min(st.min_kv, kv);
    st.max_kv = std::max(st.max_kv, kv);
    st.sum_kv += kv;
  }
  st.pages = pt;
  stats_ = st;
  // A request misses at least its last page, so the step uploads one page per request when each
  // misses only that one.
  token_pages_ = kDecode && pt == raw_bs && bad_slots == 0;
}

template <bool kDecode, typename Derive>
void HostPlanner::scan(const ForwardBatch& batch, Derive derive) {
  if (!track_) {
    scan<kDecode, false, false>(batch, derive);
  } else if (!commit_if_incremental_) {
    scan<kDecode, true, false>(batch, derive);
  } else {
    scan<kDecode, true, true>(batch, derive);
  }
}

bool HostPlanner::steady_decode(const ForwardBatch& batch, const ReqToTokenPool* pool, int page,
                                const GraphLayout* graph, bool graph_replay,
                                bool capturing) const {
  return steady_n_ > 0 && steady_n_ == batch.batch_size && batch.mode == ForwardMode::DECODE &&
         !batch.dcp_partial && commits_launched_ && !capturing &&
         (graph == nullptr || graph_replay) && pool == steady_pool_ && page == steady_page_ &&
         pool->generation_epoch() == steady_epoch_;
}

// scan<true, true, true>() for a steady decode step (steady_decode()): what the row states would
// give comes from the last plan's key lengths (its commits, launched, so each request's known
// pages now: kv_last_ >> shift once kv_ and kv_last_ have swapped); the rows are checked by
// comparison with the last plan's (which passed the range and repeat checks, in a pool whose rows
// have not changed hands since), and the lengths by one unsigned compare. The checks are
// accumulated without branches and looked at once at the end: the pass writes only the plan's
// scratch (kv_) and the requests before it. A request costs a few loads and its stores, on dense
// arrays only (no row state line per request): per request it reads its row, length and slot
// (20 bytes of the batch) and 8 bytes of scratch (its last row and length) and writes its
// ReqInfo and 4 bytes of scratch (its length). (It kept the commits and the token's page in
// three more scratch arrays before: 12 more bytes a request, 48 more cache lines at batch 256,
// each a miss when the plan starts cold.)
// Four requests at a time, each field in the lanes of one vector: the requests in the kernels'
// layout (ReqInfo) are then transposes of those vectors, and the page offsets a prefix sum over
// the lanes. (One request at a time, building each request's three 16-byte stores from scalars
// took most of the pass: the warm decode plan at batch 256 on the 2-core development machine went
// from 1.5-1.9 to 1.0-1.1 us.)
bool HostPlanner::scan_steady_decode(const ForwardBatch& batch) {
  const int n = batch.batch_size;
  const int shift = shift_;
  const int64_t* rows = batch.req_pool_indices.data();
  const int32_t* seq = batch.seq_lens.data();
  const int64_t* loc = batch.out_cache_loc.data();
  const auto max_ctx = static_cast<uint32_t>(pool_->max_context_len());
  // Row table offsets are int32 (the backend checks rows x pages_per_row against INT32_MAX): the
  // low 32 bits of the product, as the general pass stores them.
  const auto pages_per_row = static_cast<uint32_t>(pages_per_row_);
  const uint32_t offset_mask = (uint32_t{1} << shift) - 1;
  const U32x4 zero = {0, 0, 0, 0};
  I32x4 moved = {0, 0, 0, 0}, bad_len = moved, bad_slots = moved;
  U32x4 pt = zero;  // pages of the requests so far, in every lane
  // The key lengths' statistics, lane-wise: signed, as lengths that pass the checks are at most
  // max_context_len (an int).
  I32x4 min_kv = {INT32_MAX, INT32_MAX, INT32_MAX, INT32_MAX}, max_kv = {0, 0, 0, 0};
  U64x2 sum_kv = {0, 0};
  char* info = reinterpret_cast<char*>(info_);
  // The last plan's lengths become kv_last_; this plan's go into the buffer of the one before.
  kv_.swap(kv_last_);
  // Requests [i, i + 4), a lane each: their inputs and the plan's scratch at those offsets. The
  // last one to three requests go through four-lane copies, zeros past the batch (but for the
  // lengths, copies of the first of them, which leave the minimum and maximum as they are), and
  // `live` masks those lanes out of every check and sum.
  struct Four {
    const int64_t* rows;
    const int32_t* seq;
    const int64_t* loc;
    const int32_t* row_of;
    const int32_t* kv_last;
    int32_t* kv;
    char* info;
  };
  struct Staged {
    int64_t rows[4], loc[4];
    int32_t seq[4], row_of[4], kv_last[4], kv[4];
    char info[4 * sizeof(ReqInfo)];
  } staged;
  for (int i = 0; i < n; i += 4) {
    const int m = std::min(n - i, 4);
    Four f = {rows + i,
              seq + i,
              loc + i,
              row_of_.data() + i,
              kv_last_.data() + i,
              kv_.data() + i,
              info + static_cast<size_t>(i) * sizeof(ReqInfo)};
    if (m < 4) [[unlikely]] {
      staged = {};
      std::copy_n(f.rows, m, staged.rows);
      std::fill_n(staged.seq, 4, f.seq[0]);
      std::copy_n(f.seq, m, staged.seq);
      std::copy_n(f.loc, m, staged.loc);
      std::copy_n(f.row_of, m, staged.row_of);
      std::copy_n(f.kv_last, m, staged.kv_last);
      f = {staged.rows,    staged.seq, staged.loc, staged.row_of,
           staged.kv_last, staged.kv,  staged.info};
    }
    const I32x4 live = I32x4{0, 1, 2, 3} < m;
    const Halves row = halves4(f.rows);
    // Rows are below 2^31 (the last plan checked them), so equal rows have equal low halves and
    // a zero high half.
    moved |=
        ((std::bit_cast<I32x4>(row.lo) ^ load4<I32x4>(f.row_of)) | std::bit_cast<I32x4>(row.hi)) &
        live;
    // 1 <= seq_lens <= max_context_len: prefix >= 0 and the keys fit the row.
    const U32x4 kv = load4<U32x4>(f.seq);
    bad_len |= (kv - 1 >= max_ctx) & live;
    // A decode request's keys are its seq_len.
    store4(f.kv, kv);
    min_kv = min4(min_kv, std::bit_cast<I32x4>(kv));
    max_kv = max4(max_kv, std::bit_cast<I32x4>(kv));
    const U32x4 counted = kv & std::bit_cast<U32x4>(live);
    sum_kv += std::bit_cast<U64x2>(__builtin_shufflevector(counted, zero, 0, 4, 1, 5)) +
              std::bit_cast<U64x2>(__builtin_shufflevector(counted, zero, 2, 6, 3, 7));
    const auto prefix = std::bit_cast<I32x4>(kv - 1);
    // The last plan committed kv_last >> shift pages; this one commits kv >> shift (at least the
    // pages it knows, which lie before its prefix).
    const I32x4 known = min4(load4<I32x4>(f.kv_last) >> shift, prefix >> shift);
    const auto committed = std::bit_cast<I32x4>(kv >> shift);
    const U32x4 pages = (kv + offset_mask) >> shift;
    // Each request's first page id: the pages before it, a prefix sum over the lanes.
    const U32x4 missing = (pages - std::bit_cast<U32x4>(known)) & std::bit_cast<U32x4>(live);
    U32x4 through = missing + __builtin_shufflevector(zero, missing, 0, 4, 5, 6);
    through += __builtin_shufflevector(zero, through, 0, 1, 4, 5);
    const auto pt_start = std::bit_cast<I32x4>(pt + through - missing);
    pt += __builtin_shufflevector(through, through, 3, 3, 3, 3);
    // The slot's checks (see scan(); write() takes the token's page from it): its offset in the
    // page, and the sign bit of the slot against that of the sign-extended prefix.
    const Halves slot = halves4(f.loc);
    bad_slots |= std::bit_cast<I32x4>(((slot.lo ^ std::bit_cast<U32x4>(prefix)) & offset_mask) |
                                      ((slot.hi ^ std::bit_cast<U32x4>(prefix)) & 0x80000000u)) &
                 live;
    // The requests in the kernels' layout, three 16-byte stores each:
    // {qo_start, qlen 1, prefix, kv_len}, {pt_start, 1 split, part_start 0, no tree},
    // {pt_row, known, committed, 0}.
    const I32x4 index = I32x4{0, 1, 2, 3} + i;
    const I32x4 one = {1, 1, 1, 1};
    const auto pt_row = std::bit_cast<I32x4>(row.lo * pages_per_row);
    store_transposed(f.info, index, one, prefix, std::bit_cast<I32x4>(kv));
    store_transposed(f.info + 32, pt_row, known, committed, std::bit_cast<I32x4>(zero));
    const I32x4 mid = {0, 1, 0, -1};
    store4(f.info + 16, __builtin_shufflevector(pt_start, mid, 0, 5, 6, 7));
    store4(f.info + 16 + sizeof(ReqInfo), __builtin_shufflevector(pt_start, mid, 1, 5, 6, 7));
    store4(f.info + 16 + 2 * sizeof(ReqInfo), __builtin_shufflevector(pt_start, mid, 2, 5, 6, 7));
    store4(f.info + 16 + 3 * sizeof(ReqInfo), __builtin_shufflevector(pt_start, mid, 3, 5, 6, 7));
    if (m < 4) [[unlikely]] {
      std::copy_n(staged.kv, m, kv_.data() + i);
      std::memcpy(info + static_cast<size_t>(i) * sizeof(ReqInfo), staged.info,
                  m * sizeof(ReqInfo));
    }
  }
  bool any = false;
  for (int k = 0; k < 4; ++k) any = any || moved[k] != 0 || bad_len[k] != 0;
  if (any) {
    kv_.swap(kv_last_);
    return false;
  }
  // The lanes' statistics together (every lane holds a request's length: n >= 1 here).
  Stats st;
  st.tokens = n;
  st.min_q = st.max_q = 1;
  int32_t slots_off = 0;
  for (int k = 0; k < 4; ++k) {
    st.min_kv = std::min(st.min_kv, static_cast<uint32_t>(min_kv[k]));
    st.max_kv = std::max(st.max_kv, static_cast<uint32_t>(max_kv[k]));
    slots_off |= bad_slots[k];
  }
  st.sum_kv = static_cast<int64_t>(sum_kv[0] + sum_kv[1]);
  const auto pages = static_cast<int32_t>(pt[0]);
  st.pages = pages;
  stats_ = st;
  token_pages_ = pages == n && slots_off == 0;
  // The row states would now hold known = the last commits, pending = this plan's.
  steady_ahead_ = true;
  return true;
}

void HostPlanner::reject_request(const ForwardBatch& batch, int i, int32_t prefix,
                                 int32_t qlen) const {
  const int32_t seq = batch.seq_lens[i];
  ATTNRT_CHECK(
      batch.mode != ForwardMode::EXTEND || (qlen >= 1 && int64_t{seq} == int64_t{prefix} + qlen),
      "cuda backend: EXTEND request {} has extend_seq_lens {} and seq_lens {} with "
      "extend_prefix_lens {}; need extend_seq_lens >= 1 and seq_lens = prefix + extend",
      i, qlen, seq, prefix);
  ATTNRT_CHECK(prefix >= 0, "cuda backend: {} request {} has seq_lens {}; too short for the mode",
               forward_mode_name(batch.mode), i, seq);
  const int64_t row = batch.req_pool_indices[i];
  const int64_t pool_rows = pool_->size();
  ATTNRT_CHECK(row >= 0 && row < pool_rows,
               "cuda backend: req_pool_indices[{}] = {}; the request pool has rows [0, {})", i, row,
               pool_rows);
  const int64_t kv = int64_t{prefix} + qlen;
  ATTNRT_CHECK(kv <= pool_->max_context_len(),
               "cuda backend: request {} needs {} keys but a request row holds at most "
               "max_context_len = {}",
               i, kv, pool_->max_context_len());
  fail(
      "cuda backend: req_pool_indices[{}] = {} repeats an earlier request's row; each request "
      "of a step has its own row",
      i, row);
}

// Requests of the step (prefix, query rows, first output row) without make_step_layout's general
// validation for the modes the serving loop runs every step: the checks are what the plan and
// the kernels rely on, at O(bs) with no allocation once the scratch has grown. `derive` says
// whether the mode's own lengths are valid (reject_request() says why not).
void HostPlanner::derive_requests(const ForwardBatch& batch, bool steady) {
  const int bs = batch.batch_size;
  ATTNRT_CHECK(bs >= 0 && batch.req_pool_indices.size() == static_cast<size_t>(bs) &&
                   batch.seq_lens.size() == static_cast<size_t>(bs),
               "cuda backend: {} batch of {} requests has {} req_pool_indices and {} seq_lens; "
               "expected one each per request",
               forward_mode_name(batch.mode), bs, batch.req_pool_indices.size(),
               batch.seq_lens.size());
  const ForwardMode mode = batch.mode;
  const int32_t* seq = batch.seq_lens.data();
  ATTNRT_CHECK(!batch.dcp_partial || mode == ForwardMode::DECODE,
               "cuda backend: a {} batch is marked dcp_partial; a DCP rank's batch is DECODE "
               "(decode-shaped rows over key lists, docs/dcp.md)",
               forward_mode_name(mode));
  if (mode == ForwardMode::DECODE) {
    ATTNRT_CHECK(batch.out_cache_loc.size() == static_cast<size_t>(bs),
                 "cuda backend: {} batch has {} out_cache_loc entries; expected one per query "
                 "token ({})",
                 forward_mode_name(mode), batch.out_cache_loc.size(), bs);
    if (!steady || !scan_steady_decode(batch)) {
      // A steady pass is tried only after the last plan's kernels ran.
      release_steady(true);
      scan<true>(batch, [seq](int i, int32_t& prefix, int32_t& qlen) {
        prefix = seq[i] - 1;
        qlen = 1;
        return prefix >= 0;
      });
    }
  } else if (mode == ForwardMode::TARGET_VERIFY) {
    ATTNRT_CHECK(batch.spec_info.has_value() && batch.spec_info->draft_token_num >= 1,
                 "cuda backend: TARGET_VERIFY batch without spec_info (draft_token_num >= 1)");
    const int32_t draft = batch.spec_info->draft_token_num;
    scan<false>(batch, [seq, draft](int i, int32_t& prefix, int32_t& qlen) {
      prefix = seq[i];
      qlen = draft;
      return prefix >= 0;
    });
  } else if (mode == ForwardMode::EXTEND) {
    ATTNRT_CHECK(batch.extend_prefix_lens.size() == static_cast<size_t>(bs) &&
                     batch.extend_seq_lens.size() == static_cast<size_t>(bs),
                 "cuda backend: EXTEND batch of {} requests has {} extend_prefix_lens and {} "
                 "extend_seq_lens; expected one each per request",
                 bs, batch.extend_prefix_lens.size(), batch.extend_seq_lens.size());
    const int32_t* pre = batch.extend_prefix_lens.data();
    const int32_t* ext = batch.extend_seq_lens.data();
    scan<false>(batch, [seq, pre, ext](int i, int32_t& prefix, int32_t& qlen) {
      prefix = pre[i];
      qlen = ext[i];
      return qlen >= 1 && int64_t{seq[i]} == int64_t{prefix} + qlen && prefix >= 0;
    });
  } else {
    const StepLayout layout = make_step_layout(batch);
    scan<false>(batch, [&layout](int i, int32_t& prefix, int32_t& qlen) {
      prefix = layout.prefix_lens[i];
      qlen = layout.query_lens[i];
      return true;
    });
  }
  ATTNRT_CHECK(batch.num_tokens() == stats_.tokens,
               "cuda backend: {} batch has {} out_cache_loc entries; expected one per query token "
               "({})",
               forward_mode_name(mode), batch.num_tokens(), stats_.tokens);
}

namespace {

// ceil(n / d) for 0 <= n, d < 2^31 by a multiply with 1/d (no integer division in per-request
// loops): (n + d - 0.5) / d lies at least 0.5 / d away from any integer, far more than the
// rounding error of the product (about (n + d) / d * 2^-52), so truncating it gives
// floor((n + d - 1) / d).
struct CeilDiv {
  CeilDiv() = default;
  explicit CeilDiv(uint32_t d) : bias(d - 0.5), inv(1.0 / d) {}
  int32_t operator()(int32_t n) const {
    return static_cast<int32_t>((static_cast<double>(n) + bias) * inv);
  }
  double bias = 0, inv = 0;
};

}  // namespace

// Splits of the decode / verify shapes: the count whose CTA waves over the resident slots
// (SMs x CTAs per SM) finish first, modelling a CTA as its key tiles plus one tile of start-up,
// the last, partly filled wave at half its empty slots (the CTAs left in it stream faster: they
// are memory-bound and keep several tiles in flight), and a split step as its merge: two tiles
// plus one per wave of the merge's (query token, q head) rows at 8 per SM. Filling all slots in
// one wave beats a few more splits that spill into a second, mostly empty wave; at large batches
// the merge outweighs the tail. Measured on the H200 (ATTNRT_KV_CHUNK sweep, docs/BENCHMARKS.md):
// 256 x 2048 ran 541 us on 2 or 4 splits and 517 us on 1 (the model before this one, which
// counted every wave whole and a merge as one tile, chose 2); 64 x 4096 270 us on 3 splits
// against 279 / 328 us on 2 / 1, 128 x 8192 999 us on 3 against 1026 us on 1 (all at three CTAs
// per SM; at four, 64 x 4096 fits one wave unsplit: 263 us). Returns the key chunk of a split.
uint32_t HostPlanner::choose_chunk(size_t c, int bs, int64_t cap, int64_t base) {
  const ClassState& cs = classes_[c];
  const int bn = cs.head_dim > 128 ? 32 : 64;  // key tile of the decode and verify shapes
  const int64_t heads = config_.num_kv_heads_max;
  const uint32_t max_len = stats_.max_kv;
  const ClassWork& w = cs.work;
  // Large batches only look at a few split counts, keeping the plan O(4 bs).
  const int64_t by_len = std::max<int64_t>(1, max_len / kMinChunkDecode);
  const int s_max = static_cast<int>(
      std::min<int64_t>({kMaxSplits, by_len, base * heads >= cap ? 4 : kMaxSplits}));
  // CTAs of each candidate: O(1) when every request has the same length, else one pass over the
  // requests for all candidates at once.
  // Only the first s_max entries are used (zeroing all kMaxSplits took a third of this call).
  std::array<uint32_t, kMaxSplits> chunks;
  std::array<int64_t, kMaxSplits> ctas;
  for (int s = 1; s <= s_max; ++s) {
    const uint32_t per_split = (max_len + static_cast<uint32_t>(s) - 1) / static_cast<uint32_t>(s);
    chunks[s - 1] = (per_split + bn - 1) & ~static_cast<uint32_t>(bn - 1);
  }
  const int32_t* kv = kv_.data();
  if (stats_.min_kv == max_len) {
    for (int s = 0; s < s_max; ++s) ctas[s] = base * ((max_len + chunks[s] - 1) / chunks[s]);
  } else if (w.tiles > 0 && s_max <= kCompareSplits) {
    // Candidate s + 1 splits no length into more than s + 1 (its chunk is at least
    // max_len / (s + 1)): by compares (kCompareSplits). Large batches, whose lengths differ in
    // serving, take this way (s_max 4): the divisions took 29% of the ragged decode plan at
    // batch 256 here.
    const int64_t some = count_above(kv, bs, 0);
    for (int s = 0; s < s_max; ++s) {
      int64_t splits = some;
      for (int k = 1; k <= s; ++k) splits += count_above(kv, bs, threshold(k, chunks[s]));
      ctas[s] = w.tiles * splits;
    }
  } else {
    std::array<CeilDiv, kMaxSplits> div;
    for (int s = 0; s < s_max; ++s) {
      div[s] = CeilDiv(chunks[s]);
      ctas[s] = 0;
    }
    const int32_t* tiles = class_tiles_.data() + c * bs;
    for (int i = 0; i < bs; ++i) {
      const int64_t t = w.tiles > 0 ? w.tiles : tiles[i];
      for (int s = 0; s < s_max; ++s) ctas[s] += t * div[s](kv[i]);
    }
  }
  const int64_t merge_rows = int64_t{stats_.tokens} * cs.group * heads;
  const double merge =
      2.0 + static_cast<double>(ceil_div(merge_rows, int64_t{config_.sm_count} * 8));
  // The cheapest candidate; a later one must be strictly cheaper.
  double best_cost = 0;
  uint32_t best_chunk = 0;
  for (int s = 0; s < s_max; ++s) {
    const double waves = static_cast<double>(ctas[s] * heads) / static_cast<double>(cap);
    const double tail = std::ceil(waves) - waves;
    const double cost = (waves + 0.5 * tail) * (chunks[s] / bn + 1.0) + (s > 0 ? merge : 0.0);
    if (s == 0 || cost < best_cost) {
      best_cost = cost;
      best_chunk = chunks[s];
    }
  }
  return best_chunk;
}

// Shape, query tiles, split counts and the number of work items of class c.
void HostPlanner::plan_class(size_t c, int bs) {
  ClassPlan& cp = plan_.classes[c];
  ClassState& cs = classes_[c];
  ClassWork& w = cs.work;
  cp = ClassPlan{};
  w.pad_splits = 0;
  cp.group = cs.group;
  cp.head_dim = cs.head_dim;
  cp.shape = choose_shape(stats_.max_q, cp.group, cp.head_dim);
  cp.item_rows = static_cast<int>(
      std::min<int64_t>(int64_t{stats_.max_q} * cp.group, tile_rows(cp.shape)));
  const int rows_shift = std::countr_zero(static_cast<unsigned>(tile_rows(cp.shape)));
  const int64_t rows_mask = (int64_t{1} << rows_shift) - 1;
  auto tiles_of = [&](int32_t qlen) {
    return static_cast<int32_t>((int64_t{qlen} * cp.group + rows_mask) >> rows_shift);
  };
  const ReqInfo* r = info_;
  int32_t* tiles = class_tiles_.data() + c * bs;
  int32_t* splits = splits_.data() + c * bs;
  // Tiles: one count for all when the query lengths are equal (padding uses pad_qlen).
  int64_t base = 0;
  w.tiles = 0;
  if (stats_.min_q == stats_.max_q || bs == 0) {
    w.tiles = bs > 0 ? tiles_of(stats_.max_q) : 0;
    base = int64_t{bs} * w.tiles;
  } else {
    for (int i = 0; i < bs; ++i) base += tiles[i] = tiles_of(r[i].qlen);
  }
  const bool split_shape = deterministic_split_shape(cp.shape);
  // A batch-invariant graph step: each request's own deterministic split count, its items padded
  // to the graph's fixed count per (request, tile).
  const int32_t pad = graph_ != nullptr && config_.deterministic && split_shape
                          ? graph_->det_splits
                          : 0;
  const bool uniform_kv = stats_.min_kv == stats_.max_kv && pad == 0;
  const int64_t heads = config_.num_kv_heads_max;
  // Splits: one count for all, or a chunk of keys that each request divides its length by.
  int32_t uniform = 1;
  uint32_t chunk = 0;
  if (graph_ != nullptr && !config_.deterministic) {
    uniform = graph_splits(config_, c, cp.shape, bs, pad_qlen_);
  } else if (config_.deterministic) {
    if (split_shape) chunk = static_cast<uint32_t>(deterministic_chunk(cp.shape));
  } else if (cp.shape != TileShape::prefill) {
    if (base > 0) {
      const int64_t cap =
          int64_t{config_.sm_count} * cs.occupancy[static_cast<int>(cp.shape)];
      chunk = config_.kv_chunk > 0 ? static_cast<uint32_t>(config_.kv_chunk)
                                   : choose_chunk(c, bs, cap, base);
    }
  } else {
    const int64_t target = int64_t{config_.sm_count} * kCtasPerSm;
    if (base * heads < target && base > 0) {
      int64_t keys = 0;
      if (w.tiles > 0) {
        keys = w.tiles * stats_.sum_kv;
      } else {
        for (int i = 0; i < bs; ++i) keys += int64_t{tiles[i]} * r[i].kv_len;
      }
      // At most the longest request (every request then has one split, as with a longer chunk).
      chunk = static_cast<uint32_t>(std::min<int64_t>(
          stats_.max_kv, std::max<int64_t>(kMinChunkPrefill, ceil_div(keys * heads, target))));
    }
  }
  if (chunk != 0 && uniform_kv) {
    uniform = static_cast<int32_t>(
        std::clamp<int64_t>(ceil_div(stats_.max_kv, chunk), 1, kMaxSplits));
    chunk = 0;
  }
  if (chunk == 0) {
    w.splits = uniform;
    if (w.tiles > 0) {
      cp.num_items = static_cast<int>(int64_t{bs} * w.tiles * uniform);
    } else {
      cp.num_items = static_cast<int>(base * uniform);
    }
    cp.part_rows = uniform > 1 ? int64_t{uniform} * stats_.tokens : 0;
    cp.max_splits = bs > 0 ? uniform : 1;
    return;
  }
  // Ragged lengths: a split count per request.
  w.splits = 0;
  const int32_t* kv = kv_.data();
  const int64_t most = ceil_div(stats_.max_kv, chunk);
  if (w.tiles > 0 && pad == 0 && most <= kCompareSplits) {
    // By compares (kCompareSplits), four requests at a time. The query lengths are equal (one
    // tile count), so the partial rows are the split requests' splits times that length.
    std::array<int32_t, kCompareSplits> above;
    for (int k = 0; k < most; ++k) above[k] = threshold(k, chunk);
    const auto split_of = [&](int32_t len) {
      int32_t s = 0;
      for (int k = 0; k < most; ++k) s += len > above[k] ? 1 : 0;
      return std::max(s, 1);
    };
    const I32x4 one = {1, 1, 1, 1};
    I32x4 sum = {0, 0, 0, 0}, split_sum = sum, max_s = one;
    int i = 0;
    for (; i + 4 <= bs; i += 4) {
      const I32x4 len = load4<I32x4>(kv + i);
      I32x4 s = {0, 0, 0, 0};
      for (int k = 0; k < most; ++k) s -= len > above[k];
      s = max4(s, one);
      store4(splits + i, s);
      sum += s;
      split_sum += s & (s > one);
      max_s = max4(max_s, s);
    }
    int64_t all = int64_t{sum[0]} + sum[1] + sum[2] + sum[3];
    int64_t split = int64_t{split_sum[0]} + split_sum[1] + split_sum[2] + split_sum[3];
    int32_t max_splits = std::max(std::max(max_s[0], max_s[1]), std::max(max_s[2], max_s[3]));
    for (; i < bs; ++i) {
      const int32_t s = splits[i] = split_of(kv[i]);
      all += s;
      split += s > 1 ? s : 0;
      max_splits = std::max(max_splits, s);
    }
    cp.num_items = static_cast<int>(all * w.tiles);
    cp.part_rows = split * stats_.max_q;
    cp.max_splits = max_splits;
    return;
  }
  const CeilDiv div(chunk);
  int64_t items = 0, part_rows = 0;
  int32_t max_splits = 1;
  for (int i = 0; i < bs; ++i) {
    const int32_t s = std::clamp<int32_t>(div(kv[i]), 1, kMaxSplits);
    splits[i] = s;
    items += int64_t{w.tiles > 0 ? w.tiles : tiles[i]} * (pad > 0 ? pad : s);
    part_rows += s > 1 ? int64_t{s} * r[i].qlen : 0;
    max_splits = std::max(max_splits, s);
  }
  if (pad > 0) {
    ATTNRT_CHECK(max_splits <= pad,
                 "cuda backend: a deterministic graph step has a request of {} splits ({} keys "
                 "each); the graph state holds {} per request, sized by max_context_len at "
                 "init_cuda_graph_state",
                 max_splits, chunk, pad);
    // The merge is captured whenever a replay may need it, and the partials' size (which places
    // the lse after the outputs in the captured kernels' parameters) is that of the most splits.
    // (pad 1: no replay splits, so there are no partials; init_cuda_graph_state reserves none.)
    max_splits = std::max(max_splits, pad);
    part_rows = pad > 1 ? int64_t{bs} * pad * pad_qlen_ : 0;
  }
  w.pad_splits = pad;
  cp.num_items = static_cast<int>(items);
  cp.part_rows = part_rows;
  cp.max_splits = max_splits;
}

size_t HostPlanner::prepare_bytes(const ForwardBatch& batch, int padded_bs) {
  // A batch whose size disagrees with its rows is rejected by prepare() before it writes a
  // request, so its slot never needs more than the rows (nor a pinned allocation of a bogus size).
  const size_t reqs = std::min(static_cast<size_t>(std::max(batch.batch_size, 0)),
                               batch.req_pool_indices.size());
  return std::max(reqs, static_cast<size_t>(std::max(padded_bs, 0))) * sizeof(ReqInfo);
}

const StepPlan& HostPlanner::prepare(const ForwardBatch& batch, const ReqToTokenPool* pool,
                                     int page, int padded_bs, const GraphLayout* graph,
                                     bool graph_replay, bool capturing, void* dst) {
  // The first lines of the arrays the scan reads and writes, fetched while the checks run: the
  // plan starts cold in serving, and the scan's first requests would wait on each in turn.
  __builtin_prefetch(batch.req_pool_indices.data());
  __builtin_prefetch(batch.seq_lens.data());
  __builtin_prefetch(batch.out_cache_loc.data());
  __builtin_prefetch(row_of_.data(), 1);
  __builtin_prefetch(kv_.data(), 1);
  __builtin_prefetch(kv_last_.data());
  __builtin_prefetch(dst, 1);
  __builtin_prefetch(classes_.data(), 1);
  __builtin_prefetch(plan_.classes.data(), 1);
  plan_.valid = false;
  batch_ = nullptr;
  // A steady decode step reads its requests' row states from the steady arrays; any other step
  // reads the row states, which get the steady state back first.
  const bool steady = steady_decode(batch, pool, page, graph, graph_replay, capturing);
  if (!steady) release_steady(commits_launched_);
  // Commits of the previous plan become the row table's state once one of its kernels ran (they
  // store the pages back); a plan that never reached a kernel leaves the row table as it was.
  if (!commits_launched_) drop_commits(num_commits_);
  num_commits_ = 0;
  commits_launched_ = false;

  const int raw_bs = batch.batch_size;
  const int bs = std::max(raw_bs, padded_bs);
  ATTNRT_CHECK(bs == 0 || pool != nullptr,
               "cuda backend: BackendContext.req_to_token is null; the plan reads page tables "
               "from the request rows");
  ATTNRT_CHECK(page >= 1 && std::has_single_bit(static_cast<unsigned>(page)),
               "cuda backend: page_size {} is not supported; use a power of two (1, 8, 16, 32, "
               "64, 128)",
               page);
  const int shift = std::countr_zero(static_cast<unsigned>(page));
  const bool verify = is_target_verify(batch.mode);
  const SpecInfo* spec = batch.spec_info ? &*batch.spec_info : nullptr;
  pool_ = pool;
  graph_ = graph;
  shift_ = shift;
  track_ = row_table_enabled() && !capturing;
  // A capture records kernels that run later (at replays, with their own plans), so a capture
  // plan commits nothing.
  commit_if_incremental_ = track_ && !(graph != nullptr && !graph_replay);
  // Tree verify: ancestor-or-self bit masks and depths per draft token (a chain is causal and
  // takes the causal path).
  tree_ = verify && spec != nullptr && !spec->is_chain();
  info_ = static_cast<ReqInfo*>(dst);
  if (row_of_.size() < static_cast<size_t>(bs)) {
    row_of_.resize(bs);
    kv_.resize(bs);
    kv_last_.resize(bs);
  }
  if (pool != nullptr && rows_.size() < static_cast<size_t>(pool->size()))
    rows_.resize(pool->size(), kUnknownRow);
  if (++stamp_ == 0) {  // wrapped: forget every stamp
    for (RowState& rs : rows_) rs.stamp = 0;
    stamp_ = 1;
  }
  try {
    derive_requests(batch, steady);
  } catch (...) {
    // A step that fails its checks commits nothing: the rows it reached drop their commits.
    if (commit_if_incremental_) {
      for (const int64_t row : batch.req_pool_indices) {
        if (row >= 0 && static_cast<size_t>(row) < rows_.size() && rows_[row].stamp == stamp_)
          rows_[row].pending = -1;
      }
    }
    throw;
  }
  // Pending until a kernel of this plan is launched (or the plan turns out not incremental).
  num_commits_ = commit_if_incremental_ ? raw_bs : 0;

  StepPlan& plan = plan_;
  plan.mode = batch.mode;
  plan.bs = bs;
  plan.page_shift = shift;
  plan.tree = tree_;

  // Padding requests (graph replay) with the fill value: seq_len 1 on a valid row.
  pad_qlen_ = verify && spec != nullptr ? spec->draft_token_num : 1;
  if (bs > raw_bs) {
    const int32_t row = raw_bs > 0 ? row_of_[0] : 0;
    const int32_t prefix = verify ? 1 : 0;
    const int32_t kv = prefix + pad_qlen_;
    ATTNRT_CHECK(row < pool->size(),
                 "cuda backend: req_pool_indices[{}] = {}; the request pool has rows [0, {})",
                 raw_bs, row, pool->size());
    ATTNRT_CHECK(kv <= pool->max_context_len(),
                 "cuda backend: request {} needs {} keys but a request row holds at most "
                 "max_context_len = {}",
                 raw_bs, kv, pool->max_context_len());
    const int32_t pages = (kv + page - 1) >> shift;
    Stats& st = stats_;
    for (int i = raw_bs; i < bs; ++i) {
      info_[i] = {st.tokens, pad_qlen_, prefix, kv, static_cast<int32_t>(st.pages), 1, 0,
                  tree_ ? st.tokens : -1, -1, 0, 0, 0};
      row_of_[i] = row;
      kv_[i] = kv;
      st.tokens += pad_qlen_;
      st.pages += pages;
    }
    st.min_q = std::min(st.min_q, pad_qlen_);
    st.max_q = std::max(st.max_q, pad_qlen_);
    st.min_kv = std::min(st.min_kv, static_cast<uint32_t>(kv));
    st.max_kv = std::max(st.max_kv, static_cast<uint32_t>(kv));
    st.sum_kv += int64_t{kv} * (bs - raw_bs);
  }
  const int32_t tokens = stats_.tokens;
  plan.num_tokens = tokens;

  int n_draft = 0;
  if (tree_) {
    n_draft = spec->draft_token_num;
    ATTNRT_CHECK(n_draft >= 1 && n_draft <= 64,
                 "cuda backend: tree verify with {} draft tokens per request; the kernels support "
                 "1..64",
                 n_draft);
    ATTNRT_CHECK(spec->parents.size() >= static_cast<size_t>(raw_bs) * n_draft,
                 "cuda backend: spec_info.parents has {} entries; a tree verify of {} requests "
                 "needs {}",
                 spec->parents.size(), raw_bs, static_cast<size_t>(raw_bs) * n_draft);
  }

  // Per class: shape, split counts and the number of work items.
  const size_t nc = classes_.size();
  if (splits_.size() < nc * bs) {
    splits_.resize(nc * bs);
    class_tiles_.resize(nc * bs);
  }
  bool any_prefill = false;
  for (size_t c = 0; c < nc; ++c) {
    plan_class(c, bs);
    any_prefill = any_prefill || plan.classes[c].shape == TileShape::prefill;
  }

  // Page tables. Incremental (the persistent row table holds each row's committed pages; only the
  // others travel) unless the stream is capturing an eager step, or a step runs the prefill shape
  // (whose kernels read the whole table from the step's array), or the row table does not exist.
  const bool incremental = track_ && !any_prefill;
  int64_t total_pages = stats_.pages;
  if (track_ && !incremental) {
    const int32_t mask = page - 1;
    total_pages = 0;
    token_pages_ = false;
    for (int i = 0; i < bs; ++i) {
      ReqInfo& ri = info_[i];
      ri.pt_start = static_cast<int32_t>(total_pages);
      ri.pt_row = -1;
      ri.pt_known = 0;
      ri.pt_commit = 0;
      total_pages += (ri.kv_len + mask) >> shift;
    }
  }

  // Byte layout: [per class: reqs, work] [tree masks] [tree depths] [page ids]; under graphs at the
  // fixed offsets the captured kernels were given.
  size_t off = 0;
  for (size_t c = 0; c < nc; ++c) {
    ClassPlan& cp = plan.classes[c];
    if (graph != nullptr) {
      ATTNRT_CHECK(bs <= graph->max_bs && static_cast<size_t>(cp.num_items) <= graph->work_cap,
                   "cuda backend: graph step of {} requests / {} work items exceeds the graph "
                   "state (max_bs {}, {} items); call init_cuda_graph_state with larger sizes",
                   bs, cp.num_items, graph->max_bs, graph->work_cap);
      cp.reqs_off = c * graph->reqs_cap * sizeof(ReqInfo);
      cp.work_off = nc * graph->reqs_cap * sizeof(ReqInfo) + c * graph->work_cap * sizeof(WorkItem);
    } else {
      cp.reqs_off = off;
      off += bs * sizeof(ReqInfo);
      cp.work_off = off;
      off += cp.num_items * sizeof(WorkItem);
    }
  }
  if (graph != nullptr) {
    ATTNRT_CHECK(static_cast<size_t>(tokens) <= graph->tree_cap,
                 "cuda backend: graph step of {} tokens exceeds max_num_tokens {}", tokens,
                 graph->tree_cap);
    off = nc * (graph->reqs_cap * sizeof(ReqInfo) + graph->work_cap * sizeof(WorkItem));
    plan.tree_mask_off = align_up(off, 8);
    plan.tree_depth_off = plan.tree_mask_off + graph->tree_cap * sizeof(uint64_t);
    plan.pt_off = align_up(plan.tree_depth_off + graph->tree_cap * sizeof(int32_t), 16);
  } else {
    plan.tree_mask_off = align_up(off, 8);
    plan.tree_depth_off = plan.tree_mask_off + (plan.tree ? tokens * sizeof(uint64_t) : 0);
    plan.pt_off = align_up(plan.tree_depth_off + (plan.tree ? tokens * sizeof(int32_t) : 0), 16);
  }
  plan.bytes = plan.pt_off + total_pages * sizeof(int32_t);
  if (graph != nullptr) {
    ATTNRT_CHECK(plan.bytes <= graph->meta_bytes,
                 "cuda backend: graph step needs {} bytes of metadata; the graph state holds {}",
                 plan.bytes, graph->meta_bytes);
  }
  plan.incremental = incremental;
  plan.steady = steady_ahead_;

  batch_ = &batch;
  raw_bs_ = raw_bs;
  n_draft_ = n_draft;
  commit_ = incremental && commit_if_incremental_;
  if (!commit_) {
    drop_commits(num_commits_);
    num_commits_ = 0;
  } else if (batch.mode == ForwardMode::DECODE && !batch.dcp_partial && raw_bs > 0 &&
             config_.steady_decode) {
    // The scan left the requests' row states in the steady arrays: the next step may be steady.
    steady_n_ = raw_bs;
    steady_pool_ = pool;
    steady_epoch_ = pool->generation_epoch();
    steady_page_ = page;
  }
  return plan_;
}

int64_t HostPlanner::write_work_request_major(size_t c, WorkItem* items,
                                              const WorkItem* end) const {
  const int bs = plan_.bs;
  const ClassWork& w = classes_[c].work;
  const int rows = tile_rows(plan_.classes[c].shape);
  const int32_t* tiles = class_tiles_.data() + c * bs;
  const int32_t* splits = splits_.data() + c * bs;
  WorkItem* item = items;
  if (w.tiles > 0 && (w.pad_splits > 0 || w.splits > 0)) {
    // One tile and split count for all (a steady decode step): loops the branch predictor knows.
    const int32_t t = w.tiles, s_n = w.pad_splits > 0 ? w.pad_splits : w.splits;
    if (t == 2 && s_n == 1) {  // a 128-head MLA decode step
      I32x4 a = {0, rows, 0, 0}, b = {0, 0, 0, 0};
      for (int i = 0; i < bs; ++i) {
        store4(item, a);
        store4(item + 1, b);
        item += 2;
        a += I32x4{1, 0, 0, 0};
        b += I32x4{1, 0, 0, 0};
      }
      return item - items;
    }
    // (A verify step: t row tiles a request, one split for all: t stores a request, the tile's
    // row offset stepped down.)
    I32x4 first = {0, (t - 1) * rows, 0, 0};
    for (int i = 0; i < bs; ++i) {
      I32x4 v = first;
      for (int32_t s = 0; s < s_n; ++s) {
        I32x4 x = v;
        for (int32_t k = 0; k < t; ++k) {
          store4(item++, x);
          x -= I32x4{0, rows, 0, 0};
        }
        v += I32x4{0, 0, 1, 0};
      }
      first += I32x4{1, 0, 0, 0};
    }
    return item - items;
  }
  for (int i = 0; i < bs; ++i) {
    const int32_t t = w.tiles > 0 ? w.tiles : tiles[i];
    const int32_t s_n = w.pad_splits > 0 ? w.pad_splits : w.splits > 0 ? w.splits : splits[i];
    if (t == 2 && end - item >= 2 * int64_t{s_n} + 2) {
      // A 128-head MLA token's two items a split: two splits a pass, four 16-byte stores, the
      // next request's items overwriting an extra one (a loop of one store an item took the
      // ragged MLA decode plan at batch 256 from 4.7 to 10.1 us here; four splits a pass wrote
      // too many for the one or two splits most requests have).
      I32x4 a = {i, rows, 0, 0}, b = {i, 0, 0, 0};
      for (int32_t s = 0; s < s_n; s += 2) {
        WorkItem* x = item + 2 * s;
        store4(x, a);
        store4(x + 1, b);
        store4(x + 2, a + I32x4{0, 0, 1, 0});
        store4(x + 3, b + I32x4{0, 0, 1, 0});
        a += I32x4{0, 0, 2, 0};
        b += I32x4{0, 0, 2, 0};
      }
      item += 2 * s_n;
      continue;
    }
    for (int32_t s = 0; s < s_n; ++s) {
      I32x4 v = {i, (t - 1) * rows, s, 0};
      for (int32_t k = 0; k < t; ++k) {
        store4(item++, v);
        v -= I32x4{0, rows, 0, 0};
      }
    }
  }
  return item - items;
}

// Work items of requests [i0, i1) of a class whose requests differ in tile or split counts (or
// of a section of its requests).
int64_t HostPlanner::write_work_ragged(size_t c, WorkItem* items, const WorkItem* end, int i0,
                                       int i1) const {
  const int bs = plan_.bs;
  const ClassWork& w = classes_[c].work;
  const int rows = tile_rows(plan_.classes[c].shape);
  const int32_t* tiles = class_tiles_.data() + c * bs;
  const int32_t* splits = splits_.data() + c * bs;
  if (w.tiles > 0) {
    // One tile count: a request's items four at a time, as many stores as its splits round up
    // to, the next request's items starting after its own (they overwrite the rest), while the
    // stores stay inside the list. With ragged lengths the split count is as good as random, and
    // a loop of one store an item mispredicted its exit every other request.
    const int32_t num_tiles = w.tiles, pad = w.pad_splits;
    WorkItem* item = items;
    for (int32_t k = 0; k < num_tiles; ++k) {
      const int32_t f0 = (num_tiles - 1 - k) * rows;
      I32x4 first = {i0, f0, 0, 0};
      for (int i = i0; i < i1; ++i) {
        const int32_t s_n = pad > 0 ? pad : splits[i];
        if (end - item >= s_n + 3) {
          I32x4 next = first;
          for (int32_t s = 0; s < s_n; s += 4) {
            store4(item + s, next);
            store4(item + s + 1, next + I32x4{0, 0, 1, 0});
            store4(item + s + 2, next + I32x4{0, 0, 2, 0});
            store4(item + s + 3, next + I32x4{0, 0, 3, 0});
            next += I32x4{0, 0, 4, 0};
          }
        } else {
          for (int32_t s = 0; s < s_n; ++s) item[s] = {i, f0, s, 0};
        }
        item += s_n;
        first += I32x4{1, 0, 0, 0};
      }
    }
    return item - items;
  }
  const int32_t max_tiles = i1 > i0 ? *std::max_element(tiles + i0, tiles + i1) : 0;
  int64_t n = 0;
  for (int32_t k = 0; k < max_tiles; ++k) {
    for (int i = i0; i < i1; ++i) {
      const int32_t t = tiles[i];
      if (k >= t) continue;
      const int32_t s_n = w.pad_splits > 0 ? w.pad_splits : w.splits > 0 ? w.splits : splits[i];
      for (int32_t s = 0; s < s_n; ++s) items[n++] = {i, (t - 1 - k) * rows, s, 0};
    }
  }
  return n;
}

void HostPlanner::write(void* dst) {
  ATTNRT_CHECK(batch_ != nullptr, "cuda plan: write() without a prepared step");
  StepPlan& plan = plan_;
  const ReqToTokenPool* pool = pool_;
  const int bs = plan.bs, raw_bs = raw_bs_, n_draft = n_draft_;
  const int shift = plan.page_shift;
  const int32_t offset_mask = (1 << shift) - 1;
  const size_t nc = plan.classes.size();
  char* host = static_cast<char*>(dst);
  // The requests prepare() wrote (the first class's table), moved along with a buffer that grew.
  if (dst != info_) {
    std::memcpy(dst, info_, bs * sizeof(ReqInfo));
    info_ = static_cast<ReqInfo*>(dst);
  }
  const ReqInfo* info = info_;

  // Page ids the row table does not hold. A decode request missing only its last page takes it
  // from its token's write slot: req_to_token[row, prefix] equals out_cache_loc (the scheduler
  // writes the mapping before the forward, reference-semantics §2.2), and reading it there
  // instead of in the request's row saves a cache line and a TLB entry per request, which is
  // most of a cold plan's time.
  int32_t* pt = reinterpret_cast<int32_t*>(host + plan.pt_off);
  const int64_t* loc = plan.mode == ForwardMode::DECODE ? batch_->out_cache_loc.data() : nullptr;
  // A steady decode: the scan found every request's page there (its checks passed).
  int first = 0;
  if (token_pages_) {
    // Bits shift.. of each slot, four at a time from their 32-bit halves (the high half moves up
    // in two steps: a shift by 32 is not defined at page size 1).
    int i = 0;
    for (; i + 4 <= raw_bs; i += 4) {
      const Halves slot = halves4(loc + i);
      store4(pt + i, (slot.lo >> shift) | ((slot.hi << (31 - shift)) << 1));
    }
    for (; i < raw_bs; ++i) pt[i] = static_cast<int32_t>(loc[i] >> shift);
    first = raw_bs;
  }
  for (int i = first; i < bs; ++i) {
    const ReqInfo& r = info[i];
    const int32_t pages = (r.kv_len + offset_mask) >> shift;
    int32_t* dst_pt = pt + r.pt_start - r.pt_known;
    if (loc != nullptr && i < raw_bs && r.pt_known == pages - 1 &&
        !(batch_->dcp_partial && loc[r.qo_start] == 0)) {
      const int64_t slot = loc[r.qo_start];
      ATTNRT_CHECK(slot >= 0 && (slot & offset_mask) == (r.prefix & offset_mask),
                   "cuda backend: out_cache_loc[{}] = {} cannot hold position {} of request {} "
                   "with pages of {} slots (slot mod page size must equal position mod page "
                   "size; reference-semantics §4.2)",
                   r.qo_start, slot, r.prefix, i, 1 << shift);
      dst_pt[pages - 1] = static_cast<int32_t>(slot >> shift);
      continue;
    }
    const int32_t* row = pool->row_ptr(row_of_[i]);
    for (int32_t j = r.pt_known; j < pages; ++j) {
      const int32_t slot = row[static_cast<int64_t>(j) << shift];
      ATTNRT_CHECK(slot >= 0 && (slot & offset_mask) == 0,
                   "cuda backend: req_to_token[{}, {}] = {} does not start a page of {} slots; "
                   "with page_size > 1 a request's tokens must fill whole pages in order "
                   "(reference-semantics §4.2)",
                   row_of_[i], int64_t{j} << shift, slot, 1 << shift);
      dst_pt[j] = slot >> shift;
    }
  }

  // The last class first: the first class's table holds the requests the others copy, with one
  // split each until its own splits are set.
  for (size_t c = nc; c-- > 0;) {
    const ClassPlan& cp = plan.classes[c];
    const ClassWork& w = classes_[c].work;
    const int32_t* splits = splits_.data() + c * bs;
    auto* ri = reinterpret_cast<ReqInfo*>(host + cp.reqs_off);
    if (ri != info) std::memcpy(ri, info, bs * sizeof(ReqInfo));
    if (w.splits != 1) {
      // Without branches: with ragged lengths whether a request is split is as good as random
      // (one mispredicted branch every other request took ~0.3 us of the ragged decode plan).
      int32_t part = 0;
      for (int i = 0; i < bs; ++i) {
        const int32_t s = w.splits > 0 ? w.splits : splits[i];
        const int32_t split = s > 1 ? -1 : 0;
        ri[i].num_splits = s;
        ri[i].part_start = part & split;
        part += (s * info[i].qlen) & split;
      }
    }
    // Work items, heaviest tiles first (the last query tiles of causal requests see the most
    // keys), then request, then split; for a prefill class with section_keys whose requests span
    // more than one query tile, section by section (with one tile a request, no two units share
    // a request's K / V, and the order does not matter to the L2). Other shapes with several
    // row tiles a request (MLA at 128 heads: two 64-row items a decode token; verify blocks) go
    // request by request, split by split, the tiles of one split side by side: those CTAs read
    // the same keys and, launched together, share them through the L2 (tile-major, the two
    // CTAs of an MLA token ran a wave apart at batch 128, and each read the latent from DRAM).
    auto* items = reinterpret_cast<WorkItem*>(host + cp.work_off);
    const int rows = tile_rows(cp.shape);
    if (cp.shape != TileShape::prefill && int64_t{stats_.max_q} * cp.group > rows) {
      const int64_t n = write_work_request_major(c, items, items + cp.num_items);
      ATTNRT_CHECK(n == cp.num_items,
                   "cuda plan: {} work items written for a class planned with {}", n, cp.num_items);
      continue;
    }
    const int64_t section = cp.shape == TileShape::prefill && c < config_.section_keys.size() &&
                                    int64_t{stats_.max_q} * cp.group > rows
                                ? config_.section_keys[c]
                                : 0;
    // With one tile and split count for all, requests [i0, i1) are written without reading
    // anything (write_work_ragged's loop also covers this case, but took the warm decode plan at
    // batch 256 from ~2.0 to ~2.4 us here, and an 8 x 2048 prefill in sections from 1.7 to 2.9).
    // Keeping the list across steps and copying it was about as fast warm and slower cold, its
    // copy's source one more array to miss on (decode at batch 256 here: 0.06 us faster warm,
    // 0.5 us slower with 64 MiB evicted between plans).
    const bool uniform = w.tiles > 0 && w.splits > 0;
    const WorkItem* end = items + cp.num_items;
    auto write_range = [&](WorkItem* item, int i0, int i1) -> WorkItem* {
      if (!uniform) return item + write_work_ragged(c, item, end, i0, i1);
      for (int32_t k = 0; k < w.tiles; ++k) {
        const int32_t f0 = (w.tiles - 1 - k) * rows;
        if (w.splits == 1) {
          // One 16-byte store an item (the compiler wrote each field on its own).
          I32x4 next = {i0, f0, 0, 0};
          for (int i = i0; i < i1; ++i) {
            store4(item++, next);
            next += I32x4{1, 0, 0, 0};
          }
        } else {
          for (int i = i0; i < i1; ++i)
            for (int32_t s = 0; s < w.splits; ++s) *item++ = {i, f0, s, 0};
        }
      }
      return item;
    };
    if (section > 0 && bs > 1) {
      // Sections of consecutive requests of at most `section` keys (PlannerConfig).
      WorkItem* item = items;
      for (int i0 = 0; i0 < bs;) {
        int64_t keys = info[i0].kv_len;
        int i1 = i0 + 1;
        while (i1 < bs && keys + info[i1].kv_len <= section) keys += info[i1++].kv_len;
        item = write_range(item, i0, i1);
        i0 = i1;
      }
    } else {
      write_range(items, 0, bs);
    }
  }

  if (plan.tree) {
    const SpecInfo* spec = &*batch_->spec_info;
    uint64_t* mask = reinterpret_cast<uint64_t*>(host + plan.tree_mask_off);
    int32_t* depth = reinterpret_cast<int32_t*>(host + plan.tree_depth_off);
    for (int i = 0; i < bs; ++i) {
      const int32_t q0 = info[i].qo_start;
      for (int32_t t = 0; t < info[i].qlen; ++t) {
        int32_t parent = t - 1;
        if (i < raw_bs) {
          parent = spec->parents[static_cast<size_t>(i) * n_draft + t];
          ATTNRT_CHECK(parent < t,
                       "cuda backend: spec_info.parents[{}] = {} for draft {} of request {}; a "
                       "parent must precede its child",
                       static_cast<size_t>(i) * n_draft + t, parent, t, i);
        }
        mask[q0 + t] = (uint64_t{1} << t) | (parent >= 0 ? mask[q0 + parent] : 0);
        depth[q0 + t] = parent >= 0 ? depth[q0 + parent] + 1 : 0;
      }
    }
  }
  // A replayed graph always runs its kernels after its plan.
  if (graph_ != nullptr && commit_) commits_launched_ = true;
  plan.valid = true;
  batch_ = nullptr;
}

}  // namespace attnrt::cuda
