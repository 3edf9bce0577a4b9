// The cuda backend's host plan (backends/cuda/cuda_plan.h), run without a GPU: random steps of
// every mode, page sizes 1 / 16 / 64, one or two layer classes, eager and graph steps, with and
// without the incremental row table. Every table the plan writes is checked against a direct
// computation from the batch and the request rows (make_step_layout for the requests, SpecInfo for
// the tree, req_to_token for the page ids, the split policy evaluated by brute force), and the
// page table each request resolves (row table entries the kernels stored back, then the step's
// array) against req_to_token.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <tuple>
#include <vector>

#include "attnrt/batch/forward_batch.h"
#include "attnrt/memory/req_to_token_pool.h"
#include "attnrt/runtime/dcp.h"
#include "backends/cuda/cuda_plan.h"
#include "tests/test_cuda_util.h"
#include "tests/test_util.h"

namespace attnrt {
namespace {

using cuda::ClassPlan;
using cuda::GraphLayout;
using cuda::HostPlanner;
using cuda::PlannerConfig;
using cuda::ReqInfo;
using cuda::StepPlan;
using cuda::TileShape;
using cuda::WorkItem;

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Request rows whose tokens fill whole pages in order; a row's slots never move while it is held.
struct Rows {
  ReqToTokenPool pool;
  int page;
  std::vector<int> len;  // tokens with slots, per row
  int64_t next_page = 1;

  Rows(int rows, int max_ctx, int page_size) : pool(rows, max_ctx), page(page_size), len(rows, 0) {
    for (int r = 0; r < rows; ++r) pool.alloc();
  }
  // Slots for tokens [0, n) of the row (new pages at page starts).
  void grow(int row, int n) {
    if (n <= len[row]) return;
    std::vector<int64_t> slots;
    int64_t last = len[row] > 0 ? pool.get(row, len[row] - 1) : 0;
    for (int p = len[row]; p < n; ++p) {
      last = p % page == 0 ? (next_page++) * page : last + 1;
      slots.push_back(last);
    }
    pool.write(row, len[row], slots);
    len[row] = n;
  }
  // The row changes hands: freed, allocated again and written from column 0.
  void recycle(int row) {
    pool.free(row);
    const int again = pool.alloc();
    EXPECT_EQ(again, row);
    len[row] = 0;
  }
};

// The device side of incremental page tables, and what the plan should know of it.
struct DeviceModel {
  int64_t pages_per_row = 0;
  std::vector<int32_t> table;  // the row table the kernels store into
  std::vector<uint64_t> gen;
  std::vector<int32_t> known;
  bool enabled() const { return pages_per_row > 0; }
};

struct Step {
  ForwardBatch batch;
  int padded_bs = 0;
  const GraphLayout* graph = nullptr;
  bool replay = false;
  bool capturing = false;
  bool launch = true;
  // prepare() writes into a buffer of prepare_bytes() only and write() into a larger one, as when
  // the backend's staging slot grows between the two.
  bool moved = false;
};

struct Expected {
  std::vector<int64_t> row;
  std::vector<int32_t> prefix, qlen, qo;
};

// Requests of the step from make_step_layout, padded like a graph replay.
Expected expected_requests(const Step& st) {
  const ForwardBatch& b = st.batch;
  const StepLayout l = make_step_layout(b);
  Expected e;
  const bool verify = is_target_verify(b.mode);
  for (int i = 0; i < b.batch_size; ++i) {
    e.row.push_back(b.req_pool_indices[i]);
    e.prefix.push_back(l.prefix_lens[i]);
    e.qlen.push_back(l.query_lens[i]);
    e.qo.push_back(static_cast<int32_t>(l.query_start[i]));
  }
  int32_t tokens = static_cast<int32_t>(l.num_tokens);
  const int pad_q = verify && b.spec_info ? b.spec_info->draft_token_num : 1;
  for (int i = b.batch_size; i < std::max(b.batch_size, st.padded_bs); ++i) {
    e.row.push_back(b.batch_size > 0 ? b.req_pool_indices[0] : 0);
    e.prefix.push_back(verify ? 1 : 0);
    e.qlen.push_back(pad_q);
    e.qo.push_back(tokens);
    tokens += pad_q;
  }
  return e;
}

// The split policy evaluated directly: every candidate count, every request.
std::vector<int32_t> expected_splits(const PlannerConfig& cfg, size_t c, TileShape shape,
                                     const Expected& e, const std::vector<int32_t>& tiles,
                                     const Step& st) {
  const int bs = static_cast<int>(e.row.size());
  const int64_t heads = cfg.num_kv_heads_max;
  std::vector<int32_t> splits(bs, 1);
  auto kv = [&](int i) { return int64_t{e.prefix[i]} + e.qlen[i]; };
  if (st.graph != nullptr && !cfg.deterministic) {
    const bool verify = is_target_verify(st.batch.mode);
    const int pad_q = verify && st.batch.spec_info ? st.batch.spec_info->draft_token_num : 1;
    const int64_t t = cdiv(int64_t{pad_q} * cfg.groups[c], cuda::tile_rows(shape));
    // As many splits as fit one wave of the class's resident CTAs, at least 1.
    const int64_t cap = int64_t{cfg.sm_count} * cfg.occupancy[c][static_cast<int>(shape)];
    const int64_t s = std::clamp<int64_t>(cap / (bs * t * heads), 1, 64);
    std::fill(splits.begin(), splits.end(), static_cast<int32_t>(s));
    return splits;
  }
  if (cfg.deterministic) {
    if (shape != TileShape::prefill)
      for (int i = 0; i < bs; ++i)
        splits[i] = static_cast<int32_t>(std::clamp<int64_t>(
            cdiv(kv(i), shape == TileShape::decode ? 1024 : 8192), 1, 64));
    return splits;
  }
  int64_t base = 0, keys = 0, max_len = 0;
  for (int i = 0; i < bs; ++i) {
    base += tiles[i];
    keys += tiles[i] * kv(i);
    max_len = std::max(max_len, kv(i));
  }
  if (shape == TileShape::prefill) {
    const int64_t target = int64_t{cfg.sm_count} * 4;
    if (base * heads < target && base > 0) {
      const int64_t chunk = std::max<int64_t>(1024, cdiv(keys * heads, target));
      for (int i = 0; i < bs; ++i)
        splits[i] = static_cast<int32_t>(std::clamp<int64_t>(cdiv(kv(i), chunk), 1, 64));
    }
    return splits;
  }
  if (base == 0) return splits;
  if (cfg.kv_chunk > 0) {
    for (int i = 0; i < bs; ++i)
      splits[i] = static_cast<int32_t>(std::clamp<int64_t>(cdiv(kv(i), cfg.kv_chunk), 1, 64));
    return splits;
  }
  const int64_t cap = int64_t{cfg.sm_count} * cfg.occupancy[c][static_cast<int>(shape)];
  const int64_t bn = cfg.head_dims[c] > 128 ? 32 : 64;
  const int64_t s_max = std::min<int64_t>(
      {64, std::max<int64_t>(1, max_len / 256), base * heads >= cap ? 4 : 64});
  int64_t tokens = 0;
  for (int i = 0; i < bs; ++i) tokens += e.qlen[i];
  const double merge = 2.0 + static_cast<double>(cdiv(tokens * cfg.groups[c] * heads,
                                                      int64_t{cfg.sm_count} * 8));
  double best_cost = 0;
  int64_t best_chunk = 0;
  for (int64_t s = 1; s <= s_max; ++s) {
    const int64_t chunk = cdiv(cdiv(max_len, s), bn) * bn;
    if (s > 1 && chunk == best_chunk) continue;
    int64_t ctas = 0;
    for (int i = 0; i < bs; ++i) ctas += tiles[i] * cdiv(kv(i), chunk) * heads;
    const double waves = static_cast<double>(ctas) / static_cast<double>(cap);
    const double cost = (waves + 0.5 * (std::ceil(waves) - waves)) *
                            (static_cast<double>(chunk / bn) + 1.0) +
                        (s > 1 ? merge : 0.0);
    if (s == 1 || cost < best_cost) {
      best_cost = cost;
      best_chunk = chunk;
    }
  }
  for (int i = 0; i < bs; ++i)
    splits[i] = static_cast<int32_t>(std::clamp<int64_t>(cdiv(kv(i), best_chunk), 1, 64));
  return splits;
}

// Plans one step and checks every table; then, if the step's kernels "ran", stores the committed
// pages into the device model as the attention kernel does.
void plan_and_check(HostPlanner& planner, Rows& rows, DeviceModel& dev, const Step& st) {
  const PlannerConfig& cfg = planner.config();
  const ForwardBatch& b = st.batch;
  const int page = rows.page;
  const int shift = std::countr_zero(static_cast<unsigned>(page));
  // Unwritten bytes read as a pattern no table holds. Without `moved`, write() fills prepare's
  // buffer when the step fits it.
  constexpr uint64_t kFill = 0xdeadbeefdeadbeefull;
  const size_t first = HostPlanner::prepare_bytes(b, st.padded_bs);
  std::vector<uint64_t> prepared(st.moved ? first / 8 + 1 : std::max<size_t>(first, 1 << 20) / 8,
                                 kFill);
  const StepPlan& plan = planner.prepare(b, &rows.pool, page, st.padded_bs, st.graph, st.replay,
                                         st.capturing, prepared.data());
  std::vector<uint64_t> storage;
  if (st.moved || plan.bytes > prepared.size() * 8) storage.assign(plan.bytes / 8 + 1, kFill);
  char* host = reinterpret_cast<char*>(storage.empty() ? prepared.data() : storage.data());
  planner.write(host);
  ASSERT_TRUE(plan.valid);

  const Expected e = expected_requests(st);
  const int bs = static_cast<int>(e.row.size());
  const int raw_bs = b.batch_size;
  ASSERT_EQ(plan.bs, bs);
  ASSERT_EQ(plan.mode, b.mode);
  ASSERT_EQ(plan.page_shift, shift);
  int64_t tokens = 0;
  int max_q = 0;
  for (int i = 0; i < bs; ++i) {
    tokens += e.qlen[i];
    max_q = std::max(max_q, e.qlen[i]);
  }
  ASSERT_EQ(plan.num_tokens, tokens);
  const bool verify = is_target_verify(b.mode);
  const bool tree = verify && b.spec_info && b.spec_info->topk > 1;
  ASSERT_EQ(plan.tree, tree);

  // Shapes, tiles, splits, work items and offsets per class.
  const size_t nc = cfg.groups.size();
  ASSERT_EQ(plan.classes.size(), nc);
  bool any_prefill = false;
  size_t off = 0;
  std::vector<std::vector<int32_t>> class_splits;
  for (size_t c = 0; c < nc; ++c) {
    const ClassPlan& cp = plan.classes[c];
    const int64_t rows_per_req = int64_t{max_q} * cfg.groups[c];
    // MLA's 576-column layers never take the prefill shape (their CTAs hold 64 rows).
    const TileShape shape = rows_per_req <= 16   ? TileShape::decode
                            : rows_per_req <= 32 ? TileShape::decode32
                            : rows_per_req <= 64 || cfg.head_dims[c] == cuda::kMlaHeadDim
                                ? TileShape::verify
                                : TileShape::prefill;
    any_prefill = any_prefill || shape == TileShape::prefill;
    ASSERT_EQ(cp.shape, shape) << "class " << c;
    ASSERT_EQ(cp.group, cfg.groups[c]);
    ASSERT_EQ(cp.head_dim, cfg.head_dims[c]);
    std::vector<int32_t> tiles(bs);
    for (int i = 0; i < bs; ++i)
      tiles[i] = static_cast<int32_t>(
          cdiv(int64_t{e.qlen[i]} * cfg.groups[c], cuda::tile_rows(shape)));
    const std::vector<int32_t> splits = expected_splits(cfg, c, shape, e, tiles, st);
    class_splits.push_back(splits);
    // A deterministic graph step pads every request's items to the graph's count (the kernels
    // skip those past its own splits), and always captures the merge.
    const int32_t pad = st.graph != nullptr && cfg.deterministic &&
                                shape != TileShape::prefill
                            ? st.graph->det_splits
                            : 0;
    int64_t items = 0, part_rows = 0;
    int max_splits = pad > 0 ? pad : 1;
    for (int i = 0; i < bs; ++i) {
      items += int64_t{tiles[i]} * (pad > 0 ? pad : splits[i]);
      if (splits[i] > 1) part_rows += int64_t{splits[i]} * e.qlen[i];
      max_splits = std::max(max_splits, splits[i]);
      if (pad > 0) ASSERT_LE(splits[i], pad) << "request " << i;
    }
    // ... and the partials of the most splits, whatever the lengths (the captured kernels find
    // the lse after the outputs at an offset fixed by this size).
    if (pad > 1) part_rows = int64_t{bs} * pad * e.qlen[0];
    ASSERT_EQ(cp.num_items, items) << "class " << c;
    ASSERT_EQ(cp.part_rows, part_rows) << "class " << c;
    ASSERT_EQ(cp.max_splits, max_splits) << "class " << c;
    if (st.graph != nullptr) {
      ASSERT_EQ(cp.reqs_off, c * st.graph->reqs_cap * sizeof(ReqInfo));
      ASSERT_EQ(cp.work_off, nc * st.graph->reqs_cap * sizeof(ReqInfo) +
                                 c * st.graph->work_cap * sizeof(WorkItem));
    } else {
      ASSERT_EQ(cp.reqs_off, off);
      off += bs * sizeof(ReqInfo);
      ASSERT_EQ(cp.work_off, off);
      off += items * sizeof(WorkItem);
    }
    // Work items: heaviest (last) query tiles first, then request, then split; a prefill class
    // with section_keys, whose requests span more than one query tile, first by section
    // (consecutive requests of at most that many keys, one request at least). Other shapes with
    // more than one tile a request: by request, then split, then tile (the CTAs reading the same
    // keys side by side).
    const bool request_major = shape != TileShape::prefill && rows_per_req > cuda::tile_rows(shape);
    const int64_t section_keys = shape == TileShape::prefill && c < cfg.section_keys.size() &&
                                         rows_per_req > cuda::tile_rows(shape)
                                     ? cfg.section_keys[c]
                                     : 0;
    std::vector<int> section(bs, 0);
    if (section_keys > 0) {
      int64_t keys = 0;
      for (int i = 0; i < bs; ++i) {
        const int64_t kv = int64_t{e.prefix[i]} + e.qlen[i];
        if (i > 0 && keys + kv > section_keys) {
          section[i] = section[i - 1] + 1;
          keys = 0;
        } else if (i > 0) {
          section[i] = section[i - 1];
        }
        keys += kv;
      }
    }
    std::vector<std::tuple<int, int32_t, int32_t, int32_t>> want;
    for (int i = 0; i < bs; ++i)
      for (int32_t k = 0; k < tiles[i]; ++k)
        for (int32_t s = 0; s < (pad > 0 ? pad : splits[i]); ++s)
          want.emplace_back(section[i], k, i, s);
    std::sort(want.begin(), want.end());
    if (request_major) {
      std::sort(want.begin(), want.end(), [](const auto& x, const auto& y) {
        return std::tuple(std::get<2>(x), std::get<3>(x), std::get<1>(x)) <
               std::tuple(std::get<2>(y), std::get<3>(y), std::get<1>(y));
      });
    }
    const WorkItem* w = reinterpret_cast<const WorkItem*>(host + cp.work_off);
    for (size_t n = 0; n < want.size(); ++n) {
      [[maybe_unused]] const auto [sec, k, i, s] = want[n];
      ASSERT_EQ(w[n].req, i) << "class " << c << " item " << n;
      ASSERT_EQ(w[n].f0, (tiles[i] - 1 - k) * cuda::tile_rows(shape)) << "item " << n;
      ASSERT_EQ(w[n].split, s) << "item " << n;
      ASSERT_EQ(w[n].kvh, 0);
    }
  }

  // Page tables: which pages the row table holds, and where the rest lie.
  const bool incremental = dev.enabled() && !st.capturing && !any_prefill;
  ASSERT_EQ(plan.incremental, incremental);
  const bool commit = incremental && !(st.graph != nullptr && !st.replay);
  std::vector<int32_t> known(bs, 0), start(bs, 0), pages(bs, 0);
  int64_t total = 0;
  for (int i = 0; i < bs; ++i) {
    const int row = static_cast<int>(e.row[i]);
    if (incremental && i < raw_bs && dev.gen[row] == rows.pool.generation(row))
      known[i] = std::min(dev.known[row], e.prefix[i] >> shift);
    pages[i] = static_cast<int32_t>(cdiv(int64_t{e.prefix[i]} + e.qlen[i], page));
    start[i] = static_cast<int32_t>(total);
    total += pages[i] - known[i];
  }
  size_t mask_off, depth_off, pt_off;
  if (st.graph != nullptr) {
    const size_t end = nc * (st.graph->reqs_cap * sizeof(ReqInfo) +
                             st.graph->work_cap * sizeof(WorkItem));
    mask_off = cdiv(end, 8) * 8;
    depth_off = mask_off + st.graph->tree_cap * 8;
    pt_off = cdiv(depth_off + st.graph->tree_cap * 4, 16) * 16;
  } else {
    mask_off = cdiv(off, 8) * 8;
    depth_off = mask_off + (tree ? tokens * 8 : 0);
    pt_off = cdiv(depth_off + (tree ? tokens * 4 : 0), 16) * 16;
  }
  ASSERT_EQ(plan.tree_mask_off, mask_off);
  ASSERT_EQ(plan.tree_depth_off, depth_off);
  ASSERT_EQ(plan.pt_off, pt_off);
  ASSERT_EQ(plan.bytes, pt_off + total * sizeof(int32_t));

  // Requests of every class.
  const int32_t* pt = reinterpret_cast<const int32_t*>(host + pt_off);
  for (size_t c = 0; c < nc; ++c) {
    const ReqInfo* ri = reinterpret_cast<const ReqInfo*>(host + plan.classes[c].reqs_off);
    int32_t part = 0;
    for (int i = 0; i < bs; ++i) {
      const int32_t s = class_splits[c][i];
      const bool real = incremental && i < raw_bs;
      // DECODE also commits the page its token completes.
      const int32_t done = (b.mode == ForwardMode::DECODE ? e.prefix[i] + e.qlen[i] : e.prefix[i]) >> shift;
      const int32_t committed = commit && i < raw_bs ? std::max(done, known[i]) : known[i];
      SCOPED_TRACE(testing::Message() << "class " << c << " request " << i);
      ASSERT_EQ(ri[i].qo_start, e.qo[i]);
      ASSERT_EQ(ri[i].qlen, e.qlen[i]);
      ASSERT_EQ(ri[i].prefix, e.prefix[i]);
      ASSERT_EQ(ri[i].kv_len, e.prefix[i] + e.qlen[i]);
      ASSERT_EQ(ri[i].pt_start, start[i]);
      ASSERT_EQ(ri[i].num_splits, s);
      ASSERT_EQ(ri[i].part_start, s > 1 ? part : 0);
      ASSERT_EQ(ri[i].tree_start, tree ? e.qo[i] : -1);
      ASSERT_EQ(ri[i].pt_row, real ? static_cast<int32_t>(e.row[i] * dev.pages_per_row) : -1);
      ASSERT_EQ(ri[i].pt_known, known[i]);
      ASSERT_EQ(ri[i].pt_commit, committed);
      ASSERT_EQ(ri[i].pad, 0);
      if (s > 1) part += s * e.qlen[i];
    }
  }
  // Each request's page j as the kernels resolve it, against req_to_token.
  const ReqInfo* r0 = reinterpret_cast<const ReqInfo*>(host + plan.classes[0].reqs_off);
  for (int i = 0; i < bs; ++i) {
    const int row = static_cast<int>(e.row[i]);
    for (int j = 0; j < pages[i]; ++j) {
      const int32_t got = j < r0[i].pt_known ? dev.table[r0[i].pt_row + j]
                                             : pt[r0[i].pt_start + j - r0[i].pt_known];
      ASSERT_EQ(got, rows.pool.get(row, j * page) / page) << "request " << i << " page " << j;
    }
  }
  // Tree masks and depths.
  if (tree) {
    const uint64_t* mask = reinterpret_cast<const uint64_t*>(host + mask_off);
    const int32_t* depth = reinterpret_cast<const int32_t*>(host + depth_off);
    const SpecInfo& spec = *b.spec_info;
    for (int i = 0; i < bs; ++i) {
      for (int t = 0; t < e.qlen[i]; ++t) {
        uint64_t m = 0;
        for (int u = 0; u < e.qlen[i]; ++u) {
          const bool vis = i < raw_bs ? spec.visible(i, t, u) : u <= t;
          if (vis) m |= uint64_t{1} << u;
        }
        ASSERT_EQ(mask[e.qo[i] + t], m) << "request " << i << " token " << t;
        ASSERT_EQ(depth[e.qo[i] + t], i < raw_bs ? spec.depth(i, t) : t);
      }
    }
  }

  // The step's kernels store pages [pt_known, pt_commit) of every request into the row table; the
  // plan counts them once a kernel ran (a replayed graph always runs).
  const bool ran = st.launch || (st.graph != nullptr && st.replay);
  if (ran && incremental) {
    for (int i = 0; i < bs; ++i) {
      if (r0[i].pt_row < 0) continue;
      for (int j = r0[i].pt_known; j < r0[i].pt_commit; ++j)
        dev.table[r0[i].pt_row + j] = pt[r0[i].pt_start + j - r0[i].pt_known];
    }
  }
  if (st.launch && st.graph == nullptr) planner.launched();
  if (ran && commit) {
    for (int i = 0; i < raw_bs; ++i) {
      const int row = static_cast<int>(e.row[i]);
      dev.gen[row] = rows.pool.generation(row);
      dev.known[row] = r0[i].pt_commit;
    }
  }
}

struct Scenario {
  int page;
  PlannerConfig cfg;
  bool row_table;
  bool graphs;
  int max_ctx = 6000;  // the rows' longest context (graphs: what det_splits is sized by)
};

PlannerConfig config(std::vector<int> groups, std::vector<int> dims, int heads, bool det,
                     int sm_count = 132) {
  PlannerConfig c;
  c.groups = std::move(groups);
  c.head_dims = std::move(dims);
  for (size_t i = 0; i < c.groups.size(); ++i)
    c.occupancy.push_back(
        {static_cast<int>(i % 3) + 2, 1, static_cast<int>(i % 2) + 1, static_cast<int>(i % 2) + 2});
  c.num_kv_heads_max = heads;
  c.sm_count = sm_count;
  c.deterministic = det;
  return c;
}

PlannerConfig with_kv_chunk(PlannerConfig c, int kv_chunk) {
  c.kv_chunk = kv_chunk;
  return c;
}

PlannerConfig with_sections(PlannerConfig c, std::vector<int64_t> keys) {
  c.section_keys = std::move(keys);
  return c;
}

// A random tree of n tokens (parents precede children); topk > 1 marks it a tree.
SpecInfo random_spec(std::mt19937& rng, int bs, int n, bool chain) {
  if (chain) return SpecInfo::chain(bs, n);
  SpecInfo s;
  s.draft_token_num = n;
  s.topk = 2;
  for (int r = 0; r < bs; ++r) {
    s.parents.push_back(-1);
    for (int t = 1; t < n; ++t) s.parents.push_back(static_cast<int32_t>(rng() % t));
  }
  return s;
}

void fill_slots(ForwardBatch& b, Rows& rows, const std::vector<int32_t>& prefix,
                const std::vector<int32_t>& qlen) {
  b.out_cache_loc.clear();
  for (int i = 0; i < b.batch_size; ++i)
    for (int t = 0; t < qlen[i]; ++t)
      b.out_cache_loc.push_back(
          rows.pool.get(static_cast<int>(b.req_pool_indices[i]), prefix[i] + t));
}

void run_scenario(const Scenario& sc, uint32_t seed, int steps) {
  std::mt19937 rng(seed);
  constexpr int kRows = 48;
  const int kMaxCtx = sc.max_ctx;
  Rows rows(kRows, kMaxCtx, sc.page);
  HostPlanner planner(sc.cfg);
  DeviceModel dev;
  if (sc.row_table) {
    dev.pages_per_row = cdiv(kMaxCtx, sc.page);
    dev.table.assign(kRows * dev.pages_per_row, 0);
    dev.gen.assign(kRows, ~uint64_t{0});
    dev.known.assign(kRows, 0);
    planner.enable_row_table(kRows, dev.pages_per_row);
  }
  GraphLayout gl;
  gl.max_bs = 40;
  gl.reqs_cap = 40;
  gl.work_cap = 40 * 64 * 8;
  gl.tree_cap = 40 * 16;
  gl.meta_bytes = size_t{64} << 20;
  gl.det_splits = sc.cfg.deterministic ? cuda::deterministic_splits(kMaxCtx) : 0;
  for (int r = 0; r < kRows; ++r) rows.grow(r, 1 + static_cast<int>(rng() % (kMaxCtx / 2)));

  for (int step = 0; step < steps; ++step) {
    SCOPED_TRACE(testing::Message() << "seed " << seed << " step " << step);
    if (rng() % 8 == 0) {  // a row changes hands
      const int r = static_cast<int>(rng() % kRows);
      rows.recycle(r);
      rows.grow(r, 1 + static_cast<int>(rng() % (kMaxCtx / 3)));
    }
    // Batch size: mostly small or large (splits vs. a full GPU), some at 1.
    const int pick = static_cast<int>(rng() % 4);
    const int bs = pick == 0 ? 1 : pick == 1 ? 2 + static_cast<int>(rng() % 6)
                                             : 8 + static_cast<int>(rng() % 33);
    std::vector<int> all(kRows);
    for (int r = 0; r < kRows; ++r) all[r] = r;
    std::shuffle(all.begin(), all.end(), rng);
    std::vector<int64_t> req(all.begin(), all.begin() + bs);

    Step st;
    const int mode = static_cast<int>(rng() % 7);
    std::vector<int32_t> prefix(bs), qlen(bs);
    // Prefixes reach back into committed pages (the row's held tokens) or sit at their end.
    auto take_prefix = [&](int i, int q) {
      const int row = static_cast<int>(req[i]);
      int p = rows.len[row];
      if (rng() % 4 == 0) p = static_cast<int>(rng() % (rows.len[row] + 1));
      p = std::min(p, kMaxCtx - q);
      rows.grow(row, p + q);
      return p;
    };
    // Equal query lengths: short (decode / verify tiles) or long (several prefill tiles).
    const int uniform_q = rng() % 4 == 0 ? 100 + static_cast<int>(rng() % 600)
                                         : 1 + static_cast<int>(rng() % 16);
    if (mode == 0 || mode == 1) {  // DECODE (1: every request the same length)
      std::vector<int32_t> seq(bs);
      const int same = 1 + static_cast<int>(rng() % (kMaxCtx * 2 / 3));
      for (int i = 0; i < bs; ++i) {
        qlen[i] = 1;
        if (mode == 1) {
          rows.grow(static_cast<int>(req[i]), same);
          prefix[i] = same - 1;
        } else {
          prefix[i] = take_prefix(i, 1);
        }
        seq[i] = prefix[i] + 1;
      }
      st.batch = make_decode_batch(req, seq);
    } else if (mode == 2 || mode == 3) {  // EXTEND / MIXED, short or long new runs
      for (int i = 0; i < bs; ++i) {
        qlen[i] = rng() % 3 == 0 ? 1 + static_cast<int>(rng() % 300) : uniform_q;
        prefix[i] = take_prefix(i, qlen[i]);
      }
      st.batch = make_extend_batch(req, prefix, qlen,
                                   mode == 2 ? ForwardMode::EXTEND : ForwardMode::MIXED);
    } else if (mode == 4 || mode == 5) {  // TARGET_VERIFY chain / tree
      const int n = mode == 4 ? 1 + static_cast<int>(rng() % 12) : 2 + static_cast<int>(rng() % 15);
      for (int i = 0; i < bs; ++i) {
        qlen[i] = n;
        prefix[i] = take_prefix(i, n);
      }
      st.batch = make_verify_batch(req, prefix, random_spec(rng, bs, n, mode == 4));
    } else {  // DRAFT_EXTEND
      std::vector<int32_t> seq(bs), accept(bs);
      for (int i = 0; i < bs; ++i) {
        accept[i] = static_cast<int>(rng() % 5);
        qlen[i] = accept[i] + 1;
        prefix[i] = take_prefix(i, qlen[i]);
        seq[i] = prefix[i] + qlen[i];
      }
      st.batch = make_draft_extend_batch(req, seq, accept);
    }
    fill_slots(st.batch, rows, prefix, qlen);

    const bool graph_mode = sc.graphs && (mode <= 1 || mode == 4 || mode == 5) && rng() % 2 == 0;
    if (graph_mode && static_cast<int>(st.batch.num_tokens()) <= 40 * 16 - 16 * 8) {
      st.graph = &gl;
      st.padded_bs = std::min(40, bs + static_cast<int>(rng() % 8));
      st.replay = rng() % 4 != 0;
    } else {
      st.capturing = rng() % 10 == 0;
    }
    st.launch = rng() % 6 != 0;
    st.moved = rng() % 3 == 0;
    // Now and then a step that fails its checks first (a repeated row, found by the pass over the
    // requests; one out_cache_loc entry too many, found after it; a graph state too small, found
    // when the step is laid out): it must leave the row table's state as it was.
    if (rng() % 5 == 0 && bs >= 2) {
      Step bad = st;
      const int how = static_cast<int>(rng() % 3);
      GraphLayout tiny = gl;
      tiny.max_bs = 1;
      if (how == 0) bad.batch.req_pool_indices[bs - 1] = bad.batch.req_pool_indices[0];
      if (how == 1) bad.batch.out_cache_loc.push_back(0);
      std::vector<ReqInfo> dst(bs);
      EXPECT_THROW(planner.prepare(bad.batch, &rows.pool, sc.page, how == 2 ? bs : 0,
                                   how == 2 ? &tiny : nullptr, true, false, dst.data()),
                   Error);
    }
    plan_and_check(planner, rows, dev, st);
    if (testing::Test::HasFatalFailure()) return;
    // Accepted tokens become the rows' held length (slots of rejected drafts stay in place).
    for (int i = 0; i < bs; ++i) {
      const int row = static_cast<int>(req[i]);
      rows.len[row] = std::max(rows.len[row], prefix[i] + 1);
    }
  }
}

TEST(CudaHostPlan, RandomStepsMatchDirectComputation) {
  const std::vector<Scenario> scenarios = {
      {16, config({4}, {128}, 8, false), true, false},
      {1, config({4}, {128}, 8, false), true, true},
      {64, config({4}, {128}, 8, false), true, false},
      {16, config({1, 8}, {64, 256}, 4, false), true, true},
      {64, config({2, 4}, {256, 128}, 2, false, 8), false, false},
      {16, config({4}, {128}, 8, true), true, true},
      {1, config({8, 1}, {128, 64}, 1, true), false, false},
      {16, with_kv_chunk(config({4, 8}, {128, 64}, 8, false), 700), true, true},
      // Deterministic graphs whose longest context takes one split: no partials at all (the
      // graph state reserves none; `attnrt run --deterministic` on the demo trace found it).
      {16, config({4}, {128}, 8, true), true, true, 1000},
      // Prefill work lists in sections of requests: sections of a few requests, of one request
      // each (every request longer than the budget), and a second class left whole.
      {16, with_sections(config({4}, {128}, 8, false), {700}), true, false},
      {1, with_sections(config({4, 8}, {128, 64}, 8, false), {1, 0}), true, true},
      {64, with_sections(config({2, 4}, {256, 128}, 2, false, 8), {3000, 400}), false, false},
      // MLA at 128 heads (one latent KV head): every step's requests span several 64-row items,
      // written request by request (the items of one split side by side), with graphs and
      // deterministic splits too.
      {64, config({128}, {cuda::kMlaHeadDim}, 1, false), true, false},
      {16, config({128}, {cuda::kMlaHeadDim}, 1, true), true, true},
      {1, config({128}, {cuda::kMlaHeadDim}, 1, false), true, true},
  };
  for (size_t s = 0; s < scenarios.size(); ++s) {
    SCOPED_TRACE(testing::Message() << "scenario " << s << " page " << scenarios[s].page);
    run_scenario(scenarios[s], 1234u + static_cast<uint32_t>(s), 60);
    if (HasFatalFailure()) return;
  }
}

// Steps of 256 requests (the benchmark's shapes): decode, chain verify, extend, a few times in a
// row so the incremental tables are exercised as in serving.
TEST(CudaHostPlan, Batch256StepsMatchDirectComputation) {
  for (int page : {1, 16, 64}) {
    SCOPED_TRACE(testing::Message() << "page " << page);
    Rows rows(256, 2200, page);
    HostPlanner planner(config({4}, {128}, 8, false));
    DeviceModel dev;
    dev.pages_per_row = cdiv(2200, page);
    dev.table.assign(256 * dev.pages_per_row, 0);
    dev.gen.assign(256, ~uint64_t{0});
    dev.known.assign(256, 0);
    planner.enable_row_table(256, dev.pages_per_row);
    std::vector<int64_t> req(256);
    for (int r = 0; r < 256; ++r) {
      req[r] = r;
      rows.grow(r, 2048 + 16);
    }
    for (int rep = 0; rep < 3; ++rep) {
      for (int kind = 0; kind < 3; ++kind) {
        Step st;
        const int q = kind == 0 ? 1 : kind == 1 ? 8 : 16;
        const std::vector<int32_t> prefix(256, kind == 0 ? 2047 : 2048), qlen(256, q);
        if (kind == 0) {
          st.batch = make_decode_batch(req, std::vector<int32_t>(256, 2048));
        } else if (kind == 1) {
          st.batch = make_verify_batch(req, prefix, SpecInfo::chain(256, 8));
        } else {
          st.batch = make_extend_batch(req, prefix, qlen);
        }
        fill_slots(st.batch, rows, prefix, qlen);
        st.moved = rep == 1;
        plan_and_check(planner, rows, dev, st);
        if (HasFatalFailure()) return;
      }
    }
  }
}

// Ragged decode at batch 256 (the benchmark's kDecodeRagged): lengths across [256, 2048], a quarter
// of them on either side of a page edge, growing by one each step, so that requests of one, two
// and more splits share a step and some cross a split boundary on the way; a request leaving and
// one joining between steps. The split counts (taken by compares at this batch size), the work
// list and the partial offsets against the direct computation, on the steady pass and off it.
TEST(CudaHostPlan, RaggedDecodeBatch256StepsMatchDirectComputation) {
  for (int page : {1, 16, 64}) {
    SCOPED_TRACE(testing::Message() << "page " << page);
    constexpr int kRowsN = 260, kMaxCtx = 2200;
    Rows rows(kRowsN, kMaxCtx, page);
    HostPlanner planner(config({4}, {128}, 8, false));
    DeviceModel dev;
    dev.pages_per_row = cdiv(kMaxCtx, page);
    dev.table.assign(kRowsN * dev.pages_per_row, 0);
    dev.gen.assign(kRowsN, ~uint64_t{0});
    dev.known.assign(kRowsN, 0);
    planner.enable_row_table(kRowsN, dev.pages_per_row);
    std::mt19937 rng(91 + page);
    std::vector<int64_t> req(256);
    std::vector<int32_t> seq(256);
    for (int r = 0; r < 256; ++r) {
      req[r] = r;
      seq[r] = 256 + static_cast<int32_t>(rng() % 1793);
      if (r % 8 == 0) seq[r] = seq[r] / 64 * 64;      // on a page edge (every page size here)
      if (r % 8 == 1) seq[r] = seq[r] / 64 * 64 + 1;  // just past one
    }
    int steady_steps = 0;
    for (int step = 0; step < 12; ++step) {
      SCOPED_TRACE(testing::Message() << "step " << step);
      if (step == 5) {  // a request leaves
        req.erase(req.begin() + 17);
        seq.erase(seq.begin() + 17);
      }
      if (step == 8) {  // one joins
        req.push_back(256);
        seq.push_back(300);
      }
      const int bs = static_cast<int>(req.size());
      std::vector<int32_t> prefix(bs), qlen(bs, 1);
      for (int i = 0; i < bs; ++i) {
        rows.grow(static_cast<int>(req[i]), seq[i]);
        prefix[i] = seq[i] - 1;
      }
      Step st;
      st.batch = make_decode_batch(req, seq);
      fill_slots(st.batch, rows, prefix, qlen);
      plan_and_check(planner, rows, dev, st);
      if (HasFatalFailure()) return;
      const ClassPlan& cp = planner.plan().classes[0];
      EXPECT_GT(cp.max_splits, 1);
      EXPECT_LT(cp.num_items, int64_t{bs} * cp.max_splits);  // not every request splits alike
      if (planner.plan().steady) ++steady_steps;
      for (int32_t& s : seq) ++s;
    }
    EXPECT_GE(steady_steps, 8);
  }
}

// The steady-decode pass (a decode step on the last committing DECODE plan's rows, in order,
// after its kernels ran) against the general pass, byte for byte: two planners, one with the
// steady pass off, fed the same serving-like sequence. The batch decodes one token per request
// per step mostly, and between those: requests finish (their rows change hands) or arrive,
// lengths repeat or go back (a rejected draft decoded again) or jump, verify / extend / capture
// steps, graph replays padded to a larger size, plans whose kernels never ran, a row elsewhere
// in the pool rewritten (the generation epoch moves), the last request replaced by a new one on
// the same row (the same rows, one changed hands), steps that fail their checks, decode
// slots off their position. Every plan's fields and bytes must match, and the steady pass must
// have run.
struct SteadyCase {
  int page;
  PlannerConfig cfg;
};

// prepare() + write() of one step into a buffer pre-filled with a pattern; the plan's bytes, or
// nothing when a check threw (the message then).
struct Planned {
  std::vector<char> bytes;
  StepPlan plan;
  std::string error;
};

Planned plan_step_bytes(HostPlanner& planner, const Step& st, const ReqToTokenPool& pool,
                        int page) {
  Planned out;
  const size_t first = HostPlanner::prepare_bytes(st.batch, st.padded_bs);
  std::vector<uint64_t> buf(std::max<size_t>(first, 1 << 16) / 8 + 1, 0x5a5a5a5a5a5a5a5aull);
  try {
    const StepPlan& plan = planner.prepare(st.batch, &pool, page, st.padded_bs, st.graph,
                                           st.replay, st.capturing, buf.data());
    if (plan.bytes > buf.size() * 8) {
      std::vector<uint64_t> grown(plan.bytes / 8 + 1, 0x5a5a5a5a5a5a5a5aull);
      planner.write(grown.data());
      buf.swap(grown);
    } else {
      planner.write(buf.data());
    }
    out.plan = planner.plan();
    out.bytes.assign(reinterpret_cast<const char*>(buf.data()),
                     reinterpret_cast<const char*>(buf.data()) + out.plan.bytes);
  } catch (const Error& e) {
    out.error = e.what();
    return out;
  }
  if (st.launch && st.graph == nullptr) planner.launched();
  return out;
}

void expect_same_plan(const Planned& a, const Planned& b) {
  ASSERT_EQ(a.error, b.error);
  if (!a.error.empty()) return;
  const StepPlan &p = a.plan, &q = b.plan;
  ASSERT_EQ(p.valid, q.valid);
  ASSERT_EQ(p.mode, q.mode);
  ASSERT_EQ(p.bs, q.bs);
  ASSERT_EQ(p.num_tokens, q.num_tokens);
  ASSERT_EQ(p.page_shift, q.page_shift);
  ASSERT_EQ(p.tree, q.tree);
  ASSERT_EQ(p.tree_mask_off, q.tree_mask_off);
  ASSERT_EQ(p.tree_depth_off, q.tree_depth_off);
  ASSERT_EQ(p.pt_off, q.pt_off);
  ASSERT_EQ(p.bytes, q.bytes);
  ASSERT_EQ(p.incremental, q.incremental);
  ASSERT_EQ(p.classes.size(), q.classes.size());
  for (size_t c = 0; c < p.classes.size(); ++c) {
    const ClassPlan &x = p.classes[c], &y = q.classes[c];
    ASSERT_EQ(x.shape, y.shape);
    ASSERT_EQ(x.item_rows, y.item_rows);
    ASSERT_EQ(x.reqs_off, y.reqs_off);
    ASSERT_EQ(x.work_off, y.work_off);
    ASSERT_EQ(x.num_items, y.num_items);
    ASSERT_EQ(x.part_rows, y.part_rows);
    ASSERT_EQ(x.max_splits, y.max_splits);
  }
  ASSERT_EQ(a.bytes.size(), b.bytes.size());
  for (size_t k = 0; k < a.bytes.size(); k += sizeof(int32_t)) {
    ASSERT_EQ(0, std::memcmp(a.bytes.data() + k, b.bytes.data() + k,
                             std::min(sizeof(int32_t), a.bytes.size() - k)))
        << "byte " << k << " of " << a.bytes.size();
  }
}

void run_steady_sequence(const SteadyCase& sc, uint32_t seed, int steps, int max_bs,
                         int* steady_steps) {
  std::mt19937 rng(seed);
  const int rows_n = max_bs + 16;
  const int max_ctx = 3000;
  Rows rows(rows_n, max_ctx, sc.page);
  PlannerConfig general_cfg = sc.cfg;
  general_cfg.steady_decode = false;
  HostPlanner steady(sc.cfg), general(general_cfg);
  const int64_t pages_per_row = cdiv(max_ctx, sc.page);
  steady.enable_row_table(rows_n, pages_per_row);
  general.enable_row_table(rows_n, pages_per_row);
  GraphLayout gl;
  gl.max_bs = max_bs + 8;
  gl.reqs_cap = gl.max_bs;
  gl.work_cap = static_cast<size_t>(gl.max_bs) * 64 * 8;
  gl.tree_cap = static_cast<size_t>(gl.max_bs) * 16;
  gl.meta_bytes = size_t{64} << 20;
  gl.det_splits = sc.cfg.deterministic ? cuda::deterministic_splits(max_ctx) : 0;

  // The running batch: its rows in order; free rows are the others.
  std::vector<int64_t> batch;
  std::vector<int> free_rows;
  for (int r = 0; r < rows_n; ++r) free_rows.push_back(r);
  std::shuffle(free_rows.begin(), free_rows.end(), rng);
  auto arrive = [&] {
    const int row = free_rows.back();
    free_rows.pop_back();
    rows.recycle(row);
    rows.grow(row, 1 + static_cast<int>(rng() % (max_ctx / 2)));
    batch.push_back(row);
  };
  const int start = 1 + static_cast<int>(rng() % max_bs);
  for (int i = 0; i < start; ++i) arrive();

  for (int step = 0; step < steps; ++step) {
    SCOPED_TRACE(testing::Message() << "seed " << seed << " step " << step);
    const int event = static_cast<int>(rng() % 40);
    if (event == 0 && batch.size() > 1) {  // a request finishes; the others keep their order
      const size_t k = rng() % batch.size();
      free_rows.push_back(static_cast<int>(batch[k]));
      batch.erase(batch.begin() + static_cast<std::ptrdiff_t>(k));
    } else if (event == 1 && static_cast<int>(batch.size()) < max_bs) {
      arrive();
    } else if (event == 2 && !free_rows.empty()) {  // a row outside the batch rewritten
      const int row = free_rows[rng() % free_rows.size()];
      rows.recycle(row);
      rows.grow(row, 1 + static_cast<int>(rng() % 100));
    } else if (event == 3 || event == 4) {
      // The last request finishes and the next one takes its row, at the same place in the
      // batch: the same rows as the last step, one of them a new request's.
      const int row = static_cast<int>(batch.back());
      rows.recycle(row);
      rows.grow(row, 1 + static_cast<int>(rng() % (max_ctx / 2)));
    }
    const int bs = static_cast<int>(batch.size());
    std::vector<int32_t> prefix(bs), qlen(bs);
    Step st;
    const int kind = static_cast<int>(rng() % 20);
    if (kind == 0 || kind == 1) {  // verify (chain / tree) or extend over the same rows
      const int n = 2 + static_cast<int>(rng() % 7);
      for (int i = 0; i < bs; ++i) {
        const int row = static_cast<int>(batch[i]);
        prefix[i] = std::min(rows.len[row], max_ctx - n);
        qlen[i] = n;
        rows.grow(row, prefix[i] + n);
      }
      st.batch = kind == 0 ? make_verify_batch(batch, prefix, random_spec(rng, bs, n, rng() % 2))
                           : make_extend_batch(batch, prefix, qlen);
    } else {  // DECODE
      std::vector<int32_t> seq(bs);
      const int how = static_cast<int>(rng() % 16);
      for (int i = 0; i < bs; ++i) {
        const int row = static_cast<int>(batch[i]);
        int p = rows.len[row];                                                // the next token
        if (how == 0) p = std::max(0, p - 1);                                 // the same again
        if (how == 1) p = static_cast<int>(rng() % (rows.len[row] + 1));      // back
        if (how == 2) p += static_cast<int>(rng() % (3 * sc.page));          // a jump
        p = std::min(p, max_ctx - 1);
        rows.grow(row, p + 1);
        prefix[i] = p;
        qlen[i] = 1;
        seq[i] = p + 1;
      }
      st.batch = make_decode_batch(batch, seq);
    }
    fill_slots(st.batch, rows, prefix, qlen);
    const bool decode = st.batch.mode == ForwardMode::DECODE;
    const bool verify = st.batch.mode == ForwardMode::TARGET_VERIFY;
    const int place = static_cast<int>(rng() % 12);
    if ((decode || verify) && place <= 2) {  // graph replay (padded) or capture
      st.graph = &gl;
      st.padded_bs = std::min(gl.max_bs, bs + static_cast<int>(rng() % 8));
      st.replay = place != 0;
    } else if (place == 3) {
      st.capturing = true;
    }
    st.launch = rng() % 8 != 0;
    // Now and then a step that fails a check, and a decode slot off its position (write() throws
    // on it; the steady pass must leave that to write()'s pass, as the general pass does). The
    // steady pass reads rows and slots as 32-bit halves, four requests at a time: a row or a slot
    // that differs from a valid one in its high half only must come out as the general pass's
    // (a row out of range; a slot whose page id has bits from both halves; a slot whose sign bit
    // alone is wrong, refused).
    const int fault = static_cast<int>(rng() % 30);
    if (fault == 0 && bs >= 2) st.batch.req_pool_indices[bs - 1] = st.batch.req_pool_indices[0];
    if (fault == 1 && decode) st.batch.seq_lens[rng() % bs] = rng() % 2 ? 0 : max_ctx + 1;
    if (fault == 2 && decode) st.batch.out_cache_loc[rng() % bs] += 1;
    if (fault == 3) st.batch.out_cache_loc.push_back(0);
    if (fault == 4 && decode) st.batch.req_pool_indices[rng() % bs] += int64_t{1} << 32;
    if (fault == 5 && decode) st.batch.out_cache_loc[rng() % bs] += int64_t{1} << 32;
    if (fault == 6 && decode) st.batch.out_cache_loc[rng() % bs] |= INT64_MIN;

    const Planned a = plan_step_bytes(steady, st, rows.pool, sc.page);
    const Planned b = plan_step_bytes(general, st, rows.pool, sc.page);
    expect_same_plan(a, b);
    if (testing::Test::HasFatalFailure()) return;
    ASSERT_FALSE(b.plan.steady);
    if (a.error.empty() && a.plan.steady) ++*steady_steps;
    // Accepted tokens become the rows' held length.
    if (a.error.empty()) {
      for (int i = 0; i < bs; ++i) {
        const int row = static_cast<int>(batch[i]);
        const int accepted = verify ? static_cast<int>(rng() % (qlen[i] + 1)) : qlen[i];
        rows.len[row] = std::max(rows.len[row], prefix[i] + std::min(accepted, qlen[i]));
      }
    }
  }
}

TEST(CudaHostPlan, SteadyDecodePlansEqualTheGeneralPass) {
  const uint32_t seed = test::test_seed();
  SCOPED_TRACE(testing::Message() << "ATTNRT_TEST_SEED=" << seed);
  const std::vector<SteadyCase> cases = {
      {16, config({4}, {128}, 8, false)},
      {1, config({4}, {128}, 8, false)},
      {8, config({4}, {128}, 8, false)},
      {128, config({4}, {128}, 8, false)},
      {64, config({1, 8}, {64, 256}, 4, false)},
      {16, config({4}, {128}, 8, true)},
      {16, with_kv_chunk(config({4, 8}, {128, 64}, 8, false), 700)},
      {64, config({128}, {cuda::kMlaHeadDim}, 1, false)},
  };
  for (size_t c = 0; c < cases.size(); ++c) {
    SCOPED_TRACE(testing::Message() << "case " << c << " page " << cases[c].page);
    int steady_steps = 0;
    run_steady_sequence(cases[c], seed + static_cast<uint32_t>(c), 400, 24, &steady_steps);
    if (HasFatalFailure()) return;
    EXPECT_GT(steady_steps, 40);
  }
}

// The same at batch 256 (the benchmark's size), fewer steps.
TEST(CudaHostPlan, SteadyDecodePlansEqualTheGeneralPassAtBatch256) {
  const uint32_t seed = test::test_seed();
  SCOPED_TRACE(testing::Message() << "ATTNRT_TEST_SEED=" << seed);
  int steady_steps = 0;
  run_steady_sequence({16, config({4}, {128}, 8, false)}, seed, 200, 256, &steady_steps);
  EXPECT_GT(steady_steps, 20);
}

// Each way out of the steady-decode pass, one at a time, against the general pass byte for
// byte: which steps take the steady pass (plan.steady) is pinned down as well. The steady pass
// keeps each request's committed pages as the last plan's key length over the page size, so the
// cases where that state has to go back into the row states are the ones listed: a request
// finishing, one joining, another row in the last place (the pass starts and gives up), a
// different page size, a padded graph replay, a capture, a plan whose kernels never ran (once,
// and twice in a row), a step that fails its checks, lengths that repeat, go back or jump, and
// page boundaries crossed on the way (five requests: the last one goes through the pass's
// partial group of four).
TEST(CudaHostPlan, SteadyDecodeFallsBackOnEachTrigger) {
  constexpr int kRows = 16, kMaxCtx = 512;
  Rows rows(kRows, kMaxCtx, 16);
  PlannerConfig steady_cfg = config({4}, {128}, 8, false);
  PlannerConfig general_cfg = steady_cfg;
  general_cfg.steady_decode = false;
  HostPlanner steady(steady_cfg), general(general_cfg);
  steady.enable_row_table(kRows, cdiv(kMaxCtx, 16));
  general.enable_row_table(kRows, cdiv(kMaxCtx, 16));
  GraphLayout gl;
  gl.max_bs = 12;
  gl.reqs_cap = gl.max_bs;
  gl.work_cap = static_cast<size_t>(gl.max_bs) * 64 * 8;
  gl.tree_cap = static_cast<size_t>(gl.max_bs) * 16;
  gl.meta_bytes = size_t{1} << 20;

  std::vector<int64_t> batch = {3, 7, 1, 9, 12};
  std::vector<int32_t> seq = {13, 30, 47, 64, 100};
  struct How {
    int page = 16;
    int padded_bs = 0;
    bool replay = false, capturing = false, launch = true;
    int zero_len_at = -1;  // a request whose seq_len is 0 (the step fails its checks)
  };
  int step = 0;
  // One decode step of `batch` at `seq` through both planners; whether the steady one took the
  // steady pass (false when the step failed its checks, which must fail alike).
  auto plan = [&](How how = {}) {
    SCOPED_TRACE(testing::Message() << "step " << step++);
    Step st;
    std::vector<int32_t> prefix(batch.size()), qlen(batch.size(), 1);
    for (size_t i = 0; i < batch.size(); ++i) {
      rows.grow(static_cast<int>(batch[i]), seq[i]);
      prefix[i] = seq[i] - 1;
    }
    st.batch = make_decode_batch(batch, seq);
    fill_slots(st.batch, rows, prefix, qlen);
    if (how.zero_len_at >= 0) st.batch.seq_lens[how.zero_len_at] = 0;
    if (how.padded_bs > 0) {
      st.graph = &gl;
      st.padded_bs = how.padded_bs;
      st.replay = how.replay;
    }
    st.capturing = how.capturing;
    st.launch = how.launch;
    const Planned a = plan_step_bytes(steady, st, rows.pool, how.page);
    const Planned b = plan_step_bytes(general, st, rows.pool, how.page);
    expect_same_plan(a, b);
    EXPECT_FALSE(b.plan.steady);
    return a.error.empty() && a.plan.steady;
  };
  auto grow = [&](int n = 1) {
    for (int32_t& s : seq) s += n;
  };

  EXPECT_FALSE(plan());           // the first step commits; the next ones may be steady
  for (int k = 0; k < 20; ++k) {  // every request crosses at least one page boundary
    grow();
    EXPECT_TRUE(plan());
  }
  ASSERT_FALSE(HasFailure());

  batch.erase(batch.begin() + 2);  // a request finishes
  seq.erase(seq.begin() + 2);
  grow();
  EXPECT_FALSE(plan());
  grow();
  EXPECT_TRUE(plan());

  rows.recycle(5);  // one joins
  batch.push_back(5);
  seq.push_back(40);
  grow();
  EXPECT_FALSE(plan());
  grow();
  EXPECT_TRUE(plan());

  rows.recycle(14);  // the last request's place goes to another row (the same batch size)
  batch.back() = 14;
  seq.back() = 20;
  grow();
  EXPECT_FALSE(plan());
  grow();
  EXPECT_TRUE(plan());

  grow();  // another page size (pages of 8 hold the slots of pages of 16)
  EXPECT_FALSE(plan({.page = 8}));
  grow();
  EXPECT_TRUE(plan({.page = 8}));
  grow();
  EXPECT_FALSE(plan());
  grow();
  EXPECT_TRUE(plan());

  grow();  // a padded graph replay takes the steady pass, and so does the eager step after it
  EXPECT_TRUE(plan({.padded_bs = 9, .replay = true}));
  grow();
  EXPECT_TRUE(plan());
  grow();  // a capture commits nothing
  EXPECT_FALSE(plan({.padded_bs = 9, .replay = false}));
  grow();
  EXPECT_FALSE(plan());
  grow();
  EXPECT_TRUE(plan());
  grow();  // the stream captures an eager step
  EXPECT_FALSE(plan({.capturing = true}));
  grow();
  EXPECT_FALSE(plan());
  grow();
  EXPECT_TRUE(plan());

  // Kernels that never ran: the next step knows the commits of the plan before. Those differ
  // from the dropped plan's where its token completed a page: three steps a round, 16 rounds,
  // so that every request's dropped plan ends on a page boundary in one of them.
  for (int k = 0; k < 16; ++k) {
    grow();
    EXPECT_TRUE(plan({.launch = false}));
    grow();
    EXPECT_FALSE(plan());
    grow();
    EXPECT_TRUE(plan());
  }
  grow();
  EXPECT_TRUE(plan({.launch = false}));
  EXPECT_FALSE(plan({.launch = false}));  // the same step again, twice not run
  EXPECT_FALSE(plan());
  grow();
  EXPECT_TRUE(plan());

  grow();  // a step that fails its checks (after the steady pass began)
  EXPECT_FALSE(plan({.zero_len_at = 1}));
  EXPECT_FALSE(plan());
  grow();
  EXPECT_TRUE(plan());

  EXPECT_TRUE(plan());  // the same lengths again
  grow(-20);            // back over a page boundary (rejected drafts decoded again)
  EXPECT_TRUE(plan());
  grow(40);  // a jump: several pages missing
  EXPECT_TRUE(plan());
  for (int k = 0; k < 18; ++k) {
    grow();
    EXPECT_TRUE(plan());
  }
}

TEST(CudaHostPlan, RejectsRepeatedRowsAndSlotsOffPageStarts) {
  Rows rows(4, 256, 16);
  for (int r = 0; r < 4; ++r) rows.grow(r, 100);
  HostPlanner planner(config({4}, {128}, 8, false));
  ForwardBatch dup = make_decode_batch({1, 2, 3}, {50, 60, 70});
  dup.req_pool_indices[2] = 1;
  dup.out_cache_loc.assign(3, 0);
  std::vector<uint64_t> buf(4096);
  test::expect_error(
      [&] { planner.prepare(dup, &rows.pool, 16, 0, nullptr, false, false, buf.data()); },
      {"req_pool_indices[2] = 1", "repeats"});
  ForwardBatch ok = make_decode_batch({3}, {40});
  ok.out_cache_loc.assign(1, 0);
  rows.pool.write(3, 16, std::vector<int64_t>{7});  // page 1 of row 3 starts mid-page
  planner.prepare(ok, &rows.pool, 16, 0, nullptr, false, false, buf.data());
  ASSERT_LE(planner.plan().bytes, buf.size() * 8);
  test::expect_error([&] { planner.write(buf.data()); },
                     {"req_to_token[3, 16] = 7", "does not start a page"});
}

// A steady decode takes its last page from out_cache_loc, so a write slot that cannot hold the
// token's position (its offset inside the page differs) is refused there.
TEST(CudaHostPlan, RejectsDecodeSlotOffItsPosition) {
  Rows rows(2, 256, 16);
  rows.grow(1, 60);
  HostPlanner planner(config({4}, {128}, 8, false));
  planner.enable_row_table(2, 16);
  std::vector<uint64_t> buf(4096);
  for (int len : {40, 41}) {  // the first step uploads every page and commits the full ones
    ForwardBatch b = make_decode_batch({1}, {len});
    b.out_cache_loc.assign(1, rows.pool.get(1, len - 1));
    planner.prepare(b, &rows.pool, 16, 0, nullptr, false, false, buf.data());
    ASSERT_LE(planner.plan().bytes, buf.size() * 8);
    planner.write(buf.data());
    planner.launched();
  }
  ForwardBatch bad = make_decode_batch({1}, {42});
  bad.out_cache_loc.assign(1, rows.pool.get(1, 41) + 1);
  planner.prepare(bad, &rows.pool, 16, 0, nullptr, false, false, buf.data());
  ASSERT_TRUE(planner.plan().incremental);
  test::expect_error([&] { planner.write(buf.data()); },
                     {"out_cache_loc[0] = ", "position 41", "slot mod page size"});
}

// The backend acquires the staging slot before prepare() checks the batch: a batch_size that
// disagrees with its rows must not size that slot (prepare rejects such a batch before writing).
TEST(CudaHostPlan, PrepareBytesFollowTheRowsOfABadBatch) {
  ForwardBatch b = make_decode_batch({1, 2}, {50, 60});
  EXPECT_EQ(HostPlanner::prepare_bytes(b, 0), 2 * sizeof(cuda::ReqInfo));
  EXPECT_EQ(HostPlanner::prepare_bytes(b, 8), 8 * sizeof(cuda::ReqInfo));
  b.batch_size = 1 << 30;
  EXPECT_EQ(HostPlanner::prepare_bytes(b, 0), 2 * sizeof(cuda::ReqInfo));
  b.batch_size = -5;
  EXPECT_EQ(HostPlanner::prepare_bytes(b, 0), 0u);
  Rows rows(4, 256, 16);
  for (int r = 0; r < 4; ++r) rows.grow(r, 100);
  HostPlanner planner(config({4}, {128}, 8, false));
  b.batch_size = 1 << 30;
  std::vector<cuda::ReqInfo> slot(2);
  test::expect_error(
      [&] { planner.prepare(b, &rows.pool, 16, 0, nullptr, false, false, slot.data()); },
      {"requests has 2 req_pool_indices"});
}

}  // namespace
}  // namespace attnrt

namespace attnrt {
namespace {

// A DCP rank's batch (ForwardBatch::dcp_partial, docs/dcp.md): a row on the dummy slot 0 is a query
// that is no key here, so every page it reads comes from its (key-list) row, never from the slot:
// one of one page at position 8 (the slot's offset would be refused) and one at position 0 (the
// slot would name page 0); a row that owns its token still takes its page from the slot. Another
// mode marked dcp_partial is refused.
TEST(CudaHostPlan, DcpPartialRowsOnTheDummySlotReadTheirRow) {
  Rows rows(3, 256, 16);
  rows.grow(0, 9);
  rows.grow(1, 1);
  rows.grow(2, 40);
  HostPlanner planner(config({4}, {128}, 8, false));
  std::vector<uint64_t> buf(4096);
  ForwardBatch b = make_decode_batch({0, 1, 2}, {9, 1, 40});
  b.dcp_partial = true;
  b.out_cache_loc = {0, 0, rows.pool.get(2, 39)};
  planner.prepare(b, &rows.pool, 16, 0, nullptr, false, false, buf.data());
  ASSERT_LE(planner.plan().bytes, buf.size() * 8);
  planner.write(buf.data());
  const char* host = reinterpret_cast<const char*>(buf.data());
  const StepPlan& plan = planner.plan();
  const auto* ri = reinterpret_cast<const ReqInfo*>(host + plan.classes[0].reqs_off);
  const auto* pt = reinterpret_cast<const int32_t*>(host + plan.pt_off);
  for (int i = 0; i < 3; ++i) {
    const int row = static_cast<int>(b.req_pool_indices[i]);
    for (int32_t j = ri[i].pt_known; j < static_cast<int32_t>(cdiv(b.seq_lens[i], 16)); ++j) {
      EXPECT_EQ(pt[ri[i].pt_start - ri[i].pt_known + j], rows.pool.get(row, j * 16) / 16)
          << "request " << i << " (row " << row << ", out_cache_loc " << b.out_cache_loc[i]
          << ") page " << j << ": the page table should hold req_to_token's page";
    }
  }
  ForwardBatch e = make_extend_batch({0}, {0}, {9});
  e.out_cache_loc.assign(9, 0);
  e.dcp_partial = true;
  test::expect_error(
      [&] { planner.prepare(e, &rows.pool, 16, 0, nullptr, false, false, buf.data()); },
      {"EXTEND batch is marked dcp_partial", "DECODE"});
}

// A DCP rank's batches at page sizes 16 and 64 (docs/dcp.md "Each rank's batch"): entries on
// their request's own row (DECODE) and on key-list copies of a row prefix (EXTEND, MIXED, chain
// verify) are whole pages and a partial last one, so the plan resolves every key j of an entry,
// page_table[j / page] * page + j % page, to req_to_token[row, j], across steps with the
// incremental row table: growing decodes, a chain verify whose rejected drafts are dropped, a
// decode at a lower length whose dropped pages went to another request first (the request row's
// columns change: its generation must too), a request freed and its row reused. Host ranks
// (`reference`) build the batches; one planner per rank, as each cuda rank's backend has.
TEST(CudaHostPlan, DcpRankBatchesResolveTheirKeysAtPageSizes16And64) {
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  auto rnd = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  for (const int page : {16, 64}) {
    for (const int n : {2, 3}) {
      SCOPED_TRACE(testing::Message() << "page " << page << ", " << n << " ranks");
      const int shift = std::countr_zero(static_cast<unsigned>(page));
      ModelSpec model = test::make_model("dcp-plan", DType::f32, 2048,
                                         {test::attention_layer(0, 4, 2, 16)});
      Options o;
      o.attention_backend = "reference";
      o.kv_cache_dtype = "fp32";
      o.page_size = page;
      o.dcp_size = n;
      DcpAttention g(model, o, test::host_config(4, 16384, 512));
      std::vector<HostPlanner> planners;
      std::vector<DeviceModel> devs(n);
      for (int r = 0; r < n; ++r) {
        planners.emplace_back(config({2}, {16}, 2, false));
        const ReqToTokenPool& pool = g.rank(r).runtime().req_to_token();
        devs[r].pages_per_row = cdiv(pool.max_context_len(), page);
        planners.back().enable_row_table(pool.size(), devs[r].pages_per_row);
        devs[r].table.assign(pool.size() * devs[r].pages_per_row, -1);
        devs[r].gen.assign(pool.size(), ~uint64_t{0});
        devs[r].known.assign(pool.size(), 0);
      }
      int bumps = 0;  // new generations of request rows in the steps after going back
      auto step = [&](ForwardBatch b, const std::string& what, bool count_bumps = false) {
        SCOPED_TRACE(what);
        b.out_cache_loc.assign(b.positions.size(), 0);
        // The request rows' columns before the step, to tell when a column changes.
        std::vector<std::vector<std::vector<int32_t>>> before(n);
        for (int r = 0; r < n; ++r) {
          for (int row = 0; row < 4; ++row) {
            const ReqToTokenPool& pool = g.rank(r).runtime().req_to_token();
            const int32_t* p = pool.row_ptr(g.rank(r).request_row(row));
            before[r].emplace_back(p, p + pool.max_context_len());
          }
        }
        std::vector<std::vector<uint64_t>> gen_before(n);
        for (int r = 0; r < n; ++r) {
          for (int row = 0; row < 4; ++row) {
            gen_before[r].push_back(
                g.rank(r).runtime().req_to_token().generation(g.rank(r).request_row(row)));
          }
        }
        g.begin_step(b);
        for (int r = 0; r < n; ++r) {
          const ForwardBatch& rb = g.rank(r).part_batch();
          if (rb.mode == ForwardMode::IDLE) continue;
          ASSERT_TRUE(rb.dcp_partial);
          const ReqToTokenPool& pool = g.rank(r).runtime().req_to_token();
          for (int row = 0; row < 4; ++row) {
            const int pr = g.rank(r).request_row(row);
            if (pool.generation(pr) != gen_before[r][row]) {
              bumps += count_bumps;
              continue;
            }
            // Same generation: the columns the plan may hold pages of are unchanged.
            for (int j = 0; j < devs[r].known[pr] * page; ++j) {
              ASSERT_EQ(pool.get(pr, j), before[r][row][j])
                  << "rank " << r << " request row " << row << " column " << j
                  << " changed while its generation held";
            }
          }
          std::vector<uint64_t> buf(HostPlanner::prepare_bytes(rb, 0) / 8 + (1 << 16));
          const StepPlan& plan =
              planners[r].prepare(rb, &pool, page, 0, nullptr, false, false, buf.data());
          if (plan.bytes > buf.size() * 8) {
            buf.resize(plan.bytes / 8 + 1);
          }
          planners[r].write(buf.data());
          const char* host = reinterpret_cast<const char*>(buf.data());
          const auto* ri = reinterpret_cast<const ReqInfo*>(host + plan.classes[0].reqs_off);
          const auto* pt = reinterpret_cast<const int32_t*>(host + plan.pt_off);
          for (int i = 0; i < rb.batch_size; ++i) {
            const int row = static_cast<int>(rb.req_pool_indices[i]);
            for (int32_t j = 0; j < rb.seq_lens[i]; ++j) {
              const int32_t pj = j >> shift;
              const int32_t pg = pj < ri[i].pt_known ? devs[r].table[ri[i].pt_row + pj]
                                                     : pt[ri[i].pt_start + pj - ri[i].pt_known];
              ASSERT_EQ(int64_t{pg} * page + (j & (page - 1)), pool.get(row, j))
                  << "rank " << r << " entry " << i << " (pool row " << row << ", "
                  << rb.seq_lens[i] << " keys) key " << j;
            }
            if (rb.out_cache_loc[i] != 0) {
              ASSERT_EQ(rb.out_cache_loc[i], pool.get(row, rb.seq_lens[i] - 1)) << "entry " << i;
            }
          }
          // The kernels store the committed pages back; the plan counts them once launched.
          for (int i = 0; i < rb.batch_size; ++i) {
            if (ri[i].pt_row < 0) continue;
            for (int j = ri[i].pt_known; j < ri[i].pt_commit; ++j)
              devs[r].table[ri[i].pt_row + j] = pt[ri[i].pt_start + j - ri[i].pt_known];
          }
          planners[r].launched();
          for (int i = 0; i < rb.batch_size; ++i) {
            if (ri[i].pt_row < 0) continue;
            const int row = static_cast<int>(rb.req_pool_indices[i]);
            devs[r].gen[row] = pool.generation(row);
            devs[r].known[row] = ri[i].pt_commit;
          }
        }
        g.end_step();
      };
      // Prefills of ragged lengths around page edges on the ranks (n * page global tokens make a
      // page of local columns), in chunks.
      std::vector<int64_t> rows = {0, 1, 2};
      std::vector<int32_t> len;
      for (int i = 0; i < 3; ++i) len.push_back(n * page * rnd(2, 3) + rnd(-n, n));
      for (int i = 0; i < 3; ++i) {
        for (int32_t done = 0; done < len[i]; done += 300) {
          step(make_extend_batch({rows[i]}, {done}, {std::min(300, len[i] - done)}), "prefill");
        }
      }
      std::vector<int32_t> seq = len;
      for (int k = 0; k < n * page + 3; ++k) {
        for (int32_t& s : seq) ++s;
        step(make_decode_batch(rows, seq), "decode " + std::to_string(k));
      }
      step(make_verify_batch(rows, seq, SpecInfo::chain(3, 5)), "chain verify");
      for (int32_t& s : seq) s += rnd(0, 4) + 1;
      step(make_decode_batch(rows, seq), "decode after verify");
      // Request 0 goes back by two pages of local columns and extends by two columns per rank
      // (key lists: its row is in no plan at the lower length); request 3 (new) takes the freed
      // pages first.
      seq[0] -= 2 * n * page;
      step(make_extend_batch({3, rows[0], rows[1], rows[2]}, {0, seq[0] - 2 * n, seq[1], seq[2]},
                             {2 * n * page + 1, 2 * n, 1, 1}, ForwardMode::MIXED),
           "mixed: request 0 at a lower length");
      ++seq[1];
      ++seq[2];
      // Past the kept page into columns whose pages request 3 took: request 0's row changes.
      for (int k = 0; k < n * page + 2; ++k) {
        for (int32_t& s : seq) ++s;
        step(make_decode_batch(rows, seq), "decode after going back " + std::to_string(k), true);
      }
      g.free_request(1);
      step(make_extend_batch({rows[1]}, {0}, {n * page + 1}), "row 1 reused");
      seq[1] = n * page + 1;
      for (int k = 0; k < 3; ++k) {
        for (int32_t& s : seq) ++s;
        step(make_decode_batch(rows, seq), "decode of the reused row " + std::to_string(k));
      }
      EXPECT_GT(bumps, 0) << "request 0's row never changed after going back";
    }
  }
}

}  // namespace
}  // namespace attnrt
