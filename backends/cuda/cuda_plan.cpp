#include "backends/cuda/cuda_plan.h"

#include <algorithm>
#include <bit>
#include <utility>

#include "attnrt/core/error.h"

namespace attnrt::cuda {

namespace {

size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

// Up to 32 (token, head-in-group) rows per request: decode tiles (two CTAs read the K/V of a
// request and KV head, but three CTAs fit an SM; on the H200 a 64 x (4096 + 8) chain at group 4
// took 606 us on decode tiles (first version) and 784 us in half-filled 64-row CTAs). 33..64 rows:
// all of them in one verify CTA, so each K/V tile is read once (the 16-token tree at group 4: 788
// us, against 1152 us on four decode CTAs per request and KV head).
TileShape choose_shape(int max_qlen, int group) {
  const int64_t rows = static_cast<int64_t>(max_qlen) * group;
  return rows <= 32 ? TileShape::decode : rows <= 64 ? TileShape::verify : TileShape::prefill;
}

int graph_splits(const PlannerConfig& cfg, int group, TileShape shape, int bs, int tokens_per_req) {
  const int64_t tiles = ceil_div(int64_t{tokens_per_req} * group, tile_rows(shape));
  const int64_t base = int64_t{bs} * tiles * cfg.num_kv_heads_max;
  return static_cast<int>(
      std::clamp<int64_t>(ceil_div(int64_t{cfg.sm_count} * kCtasPerSm, base), 1, kMaxSplits));
}

HostPlanner::HostPlanner(PlannerConfig config) : config_(std::move(config)) {
  ATTNRT_CHECK(!config_.groups.empty() && config_.head_dims.size() == config_.groups.size() &&
                   config_.occupancy.size() == config_.groups.size(),
               "cuda plan: {} layer classes with {} head dims and {} occupancies; expected one "
               "each per class (at least one class)",
               config_.groups.size(), config_.head_dims.size(), config_.occupancy.size());
}

void HostPlanner::enable_row_table(int rows, int64_t pages_per_row) {
  pages_per_row_ = pages_per_row;
  row_gen_.assign(rows, ~uint64_t{0});
  row_known_.assign(rows, 0);
  commits_.clear();
  commits_launched_ = false;
}

// Requests of the step (prefix, query rows, first output row) without make_step_layout's general
// validation for the modes the serving loop runs every step: the checks below are what the plan
// and the kernels rely on, at O(bs) with no allocation once the scratch has grown.
void HostPlanner::derive_requests(const ForwardBatch& batch) {
  const int bs = batch.batch_size;
  ATTNRT_CHECK(bs >= 0 && batch.req_pool_indices.size() == static_cast<size_t>(bs) &&
                   batch.seq_lens.size() == static_cast<size_t>(bs),
               "cuda backend: {} batch of {} requests has {} req_pool_indices and {} seq_lens; "
               "expected one each per request",
               forward_mode_name(batch.mode), bs, batch.req_pool_indices.size(),
               batch.seq_lens.size());
  reqs_.resize(bs);
  const ForwardMode mode = batch.mode;
  const bool fast = mode == ForwardMode::DECODE || mode == ForwardMode::TARGET_VERIFY ||
                    mode == ForwardMode::EXTEND;
  if (!fast) {
    const StepLayout layout = make_step_layout(batch);
    for (int i = 0; i < bs; ++i)
      reqs_[i] = {batch.req_pool_indices[i], layout.prefix_lens[i], layout.query_lens[i],
                  static_cast<int32_t>(layout.query_start[i])};
    return;
  }
  int32_t draft = 0;
  if (mode == ForwardMode::TARGET_VERIFY) {
    ATTNRT_CHECK(batch.spec_info.has_value() && batch.spec_info->draft_token_num >= 1,
                 "cuda backend: TARGET_VERIFY batch without spec_info (draft_token_num >= 1)");
    draft = batch.spec_info->draft_token_num;
  } else if (mode == ForwardMode::EXTEND) {
    ATTNRT_CHECK(batch.extend_prefix_lens.size() == static_cast<size_t>(bs) &&
                     batch.extend_seq_lens.size() == static_cast<size_t>(bs),
                 "cuda backend: EXTEND batch of {} requests has {} extend_prefix_lens and {} "
                 "extend_seq_lens; expected one each per request",
                 bs, batch.extend_prefix_lens.size(), batch.extend_seq_lens.size());
  }
  int64_t tokens = 0;
  for (int i = 0; i < bs; ++i) {
    int32_t prefix, qlen;
    if (mode == ForwardMode::DECODE) {
      prefix = batch.seq_lens[i] - 1;
      qlen = 1;
    } else if (mode == ForwardMode::TARGET_VERIFY) {
      prefix = batch.seq_lens[i];
      qlen = draft;
    } else {
      prefix = batch.extend_prefix_lens[i];
      qlen = batch.extend_seq_lens[i];
      ATTNRT_CHECK(qlen >= 1 && int64_t{batch.seq_lens[i]} == int64_t{prefix} + qlen,
                   "cuda backend: EXTEND request {} has extend_seq_lens {} and seq_lens {} with "
                   "extend_prefix_lens {}; need extend_seq_lens >= 1 and seq_lens = prefix + "
                   "extend",
                   i, qlen, batch.seq_lens[i], prefix);
    }
    ATTNRT_CHECK(prefix >= 0, "cuda backend: {} request {} has seq_lens {}; too short for the mode",
                 forward_mode_name(mode), i, batch.seq_lens[i]);
    reqs_[i] = {batch.req_pool_indices[i], prefix, qlen, static_cast<int32_t>(tokens)};
    tokens += qlen;
  }
  ATTNRT_CHECK(batch.num_tokens() == tokens,
               "cuda backend: {} batch has {} out_cache_loc entries; expected one per query token "
               "({})",
               forward_mode_name(mode), batch.num_tokens(), tokens);
}

// Splits of the decode / verify shapes: the count whose CTA waves over the resident slots
// (SMs x CTAs per SM) finish first, modelling a CTA as its key tiles plus one tile of start-up
// and a split step as one tile of merge. Filling all slots in one wave beats a few more splits
// that spill into a second, mostly empty wave.
void HostPlanner::choose_splits(const ClassPlan& cp, int bs, int64_t cap, int32_t* splits) {
  const int bn = cp.head_dim > 128 ? 32 : 64;  // key tile of the decode and verify shapes
  const int64_t heads = config_.num_kv_heads_max;
  uint32_t max_len = 0, min_len = UINT32_MAX;
  int64_t base = 0;
  for (int i = 0; i < bs; ++i) {
    const uint32_t len = static_cast<uint32_t>(reqs_[i].prefix + reqs_[i].qlen);
    max_len = std::max(max_len, len);
    min_len = std::min(min_len, len);
    base += tiles_[i];
  }
  if (base == 0) return;
  const bool uniform = min_len == max_len;
  // Large batches only look at a few split counts, keeping the plan O(4 bs) (32-bit divisions;
  // O(1) per count when every request has the same length).
  const int64_t by_len = std::max<int64_t>(1, max_len / kMinChunkDecode);
  const int64_t s_max =
      std::min<int64_t>({kMaxSplits, by_len, base * heads >= cap ? 4 : kMaxSplits});
  double best_cost = 0;
  uint32_t best_chunk = 0;
  for (int64_t s = 1; s <= s_max; ++s) {
    const uint32_t per_split = (max_len + static_cast<uint32_t>(s) - 1) / static_cast<uint32_t>(s);
    const uint32_t chunk = (per_split + bn - 1) & ~static_cast<uint32_t>(bn - 1);
    if (s > 1 && chunk == best_chunk) continue;
    int64_t ctas = 0;
    if (uniform) {
      ctas = base * ((max_len + chunk - 1) / chunk);
    } else {
      for (int i = 0; i < bs; ++i)
        ctas += tiles_[i] * ((static_cast<uint32_t>(reqs_[i].prefix + reqs_[i].qlen) + chunk - 1) /
                             chunk);
    }
    ctas *= heads;
    const double cost = static_cast<double>((ctas + cap - 1) / cap) * (chunk / bn + 1.0) +
                        (s > 1 ? 1.0 : 0.0);
    if (s == 1 || cost < best_cost) {
      best_cost = cost;
      best_chunk = chunk;
    }
  }
  for (int i = 0; i < bs; ++i) {
    const uint32_t len = static_cast<uint32_t>(reqs_[i].prefix + reqs_[i].qlen);
    splits[i] = static_cast<int32_t>(
        std::clamp<uint32_t>((len + best_chunk - 1) / best_chunk, 1, kMaxSplits));
  }
}

const StepPlan& HostPlanner::prepare(const ForwardBatch& batch, const ReqToTokenPool* pool,
                                     int page, int padded_bs, const GraphLayout* graph,
                                     bool graph_replay, bool capturing) {
  plan_.valid = false;
  batch_ = nullptr;
  // Commits of the previous plan become the row table's state once one of its kernels ran (they
  // store the pages back); a plan that never reached a kernel leaves the row table as it was.
  if (commits_launched_) {
    for (const Commit& c : commits_) {
      row_gen_[c.row] = c.gen;
      row_known_[c.row] = c.pages;
    }
  }
  commits_.clear();
  commits_launched_ = false;

  derive_requests(batch);
  const int raw_bs = batch.batch_size;
  const int bs = std::max(raw_bs, padded_bs);
  const bool verify = is_target_verify(batch.mode);
  ATTNRT_CHECK(bs == 0 || pool != nullptr,
               "cuda backend: BackendContext.req_to_token is null; the plan reads page tables "
               "from the request rows");
  ATTNRT_CHECK(page >= 1 && std::has_single_bit(static_cast<unsigned>(page)),
               "cuda backend: page_size {} is not supported; use a power of two (1, 8, 16, 32, "
               "64, 128)",
               page);
  StepPlan& plan = plan_;
  plan.mode = batch.mode;
  plan.bs = bs;
  plan.page_shift = std::countr_zero(static_cast<unsigned>(page));

  // Requests, padded (graph replay) with the fill value: seq_len 1 on a valid row.
  const int pad_qlen = verify && batch.spec_info ? batch.spec_info->draft_token_num : 1;
  int32_t tokens = raw_bs > 0 ? reqs_[raw_bs - 1].qo_start + reqs_[raw_bs - 1].qlen : 0;
  int max_qlen = 0;
  reqs_.resize(bs);
  if (row_stamp_.size() < static_cast<size_t>(pool ? pool->size() : 0))
    row_stamp_.assign(pool->size(), 0);
  ++stamp_;
  for (int i = 0; i < bs; ++i) {
    if (i >= raw_bs) {
      reqs_[i] = {raw_bs > 0 ? batch.req_pool_indices[0] : 0, verify ? 1 : 0, pad_qlen, tokens};
      tokens += pad_qlen;
    }
    const Request& r = reqs_[i];
    max_qlen = std::max(max_qlen, r.qlen);
    ATTNRT_CHECK(r.row >= 0 && r.row < pool->size(),
                 "cuda backend: req_pool_indices[{}] = {}; the request pool has rows [0, {})", i,
                 r.row, pool->size());
    ATTNRT_CHECK(int64_t{r.prefix} + r.qlen <= pool->max_context_len(),
                 "cuda backend: request {} needs {} keys but a request row holds at most "
                 "max_context_len = {}",
                 i, int64_t{r.prefix} + r.qlen, pool->max_context_len());
    if (i < raw_bs) {
      ATTNRT_CHECK(row_stamp_[r.row] != stamp_,
                   "cuda backend: req_pool_indices[{}] = {} repeats an earlier request's row; "
                   "each request of a step has its own row",
                   i, r.row);
      row_stamp_[r.row] = stamp_;
    }
  }
  plan.num_tokens = tokens;

  // Tree verify: ancestor-or-self bit masks and depths per draft token (a chain is causal and
  // takes the causal path).
  const SpecInfo* spec = batch.spec_info ? &*batch.spec_info : nullptr;
  plan.tree = verify && spec != nullptr && !spec->is_chain();
  int n_draft = 0;
  if (plan.tree) {
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
  const size_t nc = config_.groups.size();
  plan.classes.resize(nc);
  tiles_.resize(bs);
  splits_.resize(nc * bs);
  class_tiles_.resize(nc * bs);
  bool any_prefill = false;
  for (size_t c = 0; c < nc; ++c) {
    ClassPlan& cp = plan.classes[c];
    cp = ClassPlan{};
    cp.group = config_.groups[c];
    cp.head_dim = config_.head_dims[c];
    cp.shape = choose_shape(max_qlen, cp.group);
    any_prefill = any_prefill || cp.shape == TileShape::prefill;
    const int rows_shift = std::countr_zero(static_cast<unsigned>(tile_rows(cp.shape)));
    const int64_t rows_mask = (int64_t{1} << rows_shift) - 1;
    int32_t* splits = splits_.data() + c * bs;
    int32_t* tiles = class_tiles_.data() + c * bs;
    int64_t base = 0, keys = 0;
    for (int i = 0; i < bs; ++i) {
      tiles[i] = tiles_[i] =
          static_cast<int32_t>((int64_t{reqs_[i].qlen} * cp.group + rows_mask) >> rows_shift);
      base += tiles_[i];
      keys += int64_t{tiles_[i]} * (reqs_[i].prefix + reqs_[i].qlen);
      splits[i] = 1;
    }
    base *= config_.num_kv_heads_max;
    keys *= config_.num_kv_heads_max;
    if (graph != nullptr) {
      std::fill(splits, splits + bs, graph_splits(config_, cp.group, cp.shape, bs, pad_qlen));
    } else if (config_.deterministic) {
      if (cp.shape == TileShape::decode) {
        for (int i = 0; i < bs; ++i)
          splits[i] = static_cast<int32_t>(std::clamp<int64_t>(
              ceil_div(reqs_[i].prefix + reqs_[i].qlen, kDeterministicChunk), 1, kMaxSplits));
      }
    } else if (cp.shape != TileShape::prefill) {
      choose_splits(cp, bs,
                    int64_t{config_.sm_count} * config_.occupancy[c][static_cast<int>(cp.shape)],
                    splits);
    } else {
      const int64_t target = int64_t{config_.sm_count} * kCtasPerSm;
      if (base < target && base > 0) {
        const int64_t chunk = std::max<int64_t>(kMinChunkPrefill, ceil_div(keys, target));
        for (int i = 0; i < bs; ++i)
          splits[i] = static_cast<int32_t>(std::clamp<int64_t>(
              ceil_div(reqs_[i].prefix + reqs_[i].qlen, chunk), 1, kMaxSplits));
      }
    }
    int64_t items = 0;
    for (int i = 0; i < bs; ++i) {
      items += int64_t{tiles_[i]} * splits[i];
      if (splits[i] > 1) cp.part_rows += int64_t{splits[i]} * reqs_[i].qlen;
      cp.max_splits = std::max(cp.max_splits, static_cast<int>(splits[i]));
    }
    cp.num_items = static_cast<int>(items);
  }

  // Page tables. Incremental (the persistent row table holds each row's committed pages; only the
  // others travel) unless the stream is capturing an eager step, or a step runs the prefill shape
  // (whose kernels read the whole table from the step's array), or the row table does not exist.
  const bool incremental = row_table_enabled() && !capturing && !any_prefill;
  const int32_t offset_mask = page - 1;
  pt_start_.resize(bs);
  pt_known_.resize(bs);
  int64_t total_pages = 0;
  for (int i = 0; i < bs; ++i) {
    const Request& r = reqs_[i];
    int32_t known = 0;
    if (incremental && i < raw_bs && row_gen_[r.row] == pool->generation(static_cast<int>(r.row)))
      known = std::min(row_known_[r.row], r.prefix >> plan.page_shift);
    pt_known_[i] = known;
    pt_start_[i] = static_cast<int32_t>(total_pages);
    total_pages += ((int64_t{r.prefix} + r.qlen + offset_mask) >> plan.page_shift) - known;
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

  batch_ = &batch;
  pool_ = pool;
  graph_ = graph;
  raw_bs_ = raw_bs;
  n_draft_ = n_draft;
  // A capture records kernels that run later (at replays, with their own plans), so a capture
  // plan commits nothing.
  commit_ = incremental && !(graph != nullptr && !graph_replay);
  return plan_;
}

void HostPlanner::write(void* dst) {
  ATTNRT_CHECK(batch_ != nullptr, "cuda plan: write() without a prepared step");
  StepPlan& plan = plan_;
  const ReqToTokenPool* pool = pool_;
  const int bs = plan.bs, raw_bs = raw_bs_, n_draft = n_draft_;
  const int page = 1 << plan.page_shift;
  const int32_t offset_mask = page - 1;
  const SpecInfo* spec = batch_->spec_info ? &*batch_->spec_info : nullptr;
  const size_t nc = plan.classes.size();
  char* host = static_cast<char*>(dst);

  int32_t* pt = reinterpret_cast<int32_t*>(host + plan.pt_off);
  for (int i = 0; i < bs; ++i) {
    const Request& r = reqs_[i];
    const int32_t* row = pool->row_ptr(static_cast<int>(r.row));
    const int64_t pages = (int64_t{r.prefix} + r.qlen + offset_mask) >> plan.page_shift;
    int32_t* dst_pt = pt + pt_start_[i] - pt_known_[i];
    for (int64_t j = pt_known_[i]; j < pages; ++j) {
      const int32_t slot = row[j << plan.page_shift];
      ATTNRT_CHECK(slot >= 0 && (slot & offset_mask) == 0,
                   "cuda backend: req_to_token[{}, {}] = {} does not start a page of {} slots; "
                   "with page_size > 1 a request's tokens must fill whole pages in order "
                   "(reference-semantics §4.2)",
                   r.row, j * page, slot, page);
      dst_pt[j] = slot >> plan.page_shift;
    }
  }
  if (plan.tree) {
    uint64_t* mask = reinterpret_cast<uint64_t*>(host + plan.tree_mask_off);
    int32_t* depth = reinterpret_cast<int32_t*>(host + plan.tree_depth_off);
    for (int i = 0; i < bs; ++i) {
      const int32_t q0 = reqs_[i].qo_start;
      for (int32_t t = 0; t < reqs_[i].qlen; ++t) {
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
  // Commits: pages wholly below the prefix are committed; the kernels store the ones the row table
  // lacks.
  const bool incremental = plan.incremental;
  const bool commit = commit_;
  commits_.clear();
  for (size_t c = 0; c < nc; ++c) {
    const ClassPlan& cp = plan.classes[c];
    const int32_t* splits = splits_.data() + c * bs;
    ReqInfo* ri = reinterpret_cast<ReqInfo*>(host + cp.reqs_off);
    int32_t part = 0;
    for (int i = 0; i < bs; ++i) {
      const Request& r = reqs_[i];
      const int32_t s = splits[i];
      const bool real = incremental && i < raw_bs;
      const int32_t committed = commit && i < raw_bs ? r.prefix >> plan.page_shift : pt_known_[i];
      ri[i] = {r.qo_start,
               r.qlen,
               r.prefix,
               r.prefix + r.qlen,
               pt_start_[i],
               s,
               s > 1 ? part : 0,
               plan.tree ? r.qo_start : -1,
               real ? static_cast<int32_t>(r.row * pages_per_row_) : -1,
               pt_known_[i],
               std::max(committed, pt_known_[i]),
               0};
      if (s > 1) part += s * r.qlen;
      if (c == 0 && commit && i < raw_bs)
        commits_.push_back({static_cast<int32_t>(r.row), std::max(committed, pt_known_[i]),
                            pool->generation(static_cast<int>(r.row))});
    }
    // Heaviest tiles first (the last query tiles of causal requests see the most keys).
    WorkItem* items = reinterpret_cast<WorkItem*>(host + cp.work_off);
    const int rows = tile_rows(cp.shape);
    const int32_t* tiles = class_tiles_.data() + c * bs;
    const int32_t max_tiles = bs > 0 ? *std::max_element(tiles, tiles + bs) : 0;
    int n = 0;
    for (int32_t k = 0; k < max_tiles; ++k) {
      for (int i = 0; i < bs; ++i) {
        const int32_t t = tiles[i];
        if (k >= t) continue;
        for (int32_t s = 0; s < splits[i]; ++s) items[n++] = {i, (t - 1 - k) * rows, s, 0};
      }
    }
  }
  // A replayed graph always runs its kernels after its plan.
  if (graph_ != nullptr && commit_) commits_launched_ = true;
  plan.valid = true;
  batch_ = nullptr;
}

}  // namespace attnrt::cuda
