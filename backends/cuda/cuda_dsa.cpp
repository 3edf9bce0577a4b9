// DSA layers on the cuda backend (docs/dsa.md): the same reduction as the cpu backend, on the GPU.
// Per call: the latent rows and index keys are stored, the indexer (kernels/dsa.cu) scores every
// query token's candidates from the GPU index-key cache and writes each token's selected slots
// into a [T, topk] table, and the MLA CTA runs every token as a single-query request over its
// selected slots, reading that table as its page table (page size 1). The lengths of those
// requests, min(topk, |C(t)|), follow from the batch, so the host plan (splits, work items,
// partials) is built before any kernel runs and nothing is read back.
#include "backends/cuda/cuda_dsa.h"

#include <algorithm>
#include <cstring>

#include "attnrt/backend/dsa.h"
#include "attnrt/core/dtype.h"
#include "attnrt/core/error.h"
#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/cuda_device.h"
#include "backends/cuda/cuda_kv_cache.h"
#include "backends/cuda/cuda_plan.h"
#include "backends/cuda/kernels/dispatch.h"
#include "backends/cuda/kernels/launch.h"

namespace attnrt::cuda {

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }
KvKind kv_kind_of_dtype(DType t) {
  return t == DType::e4m3 ? KvKind::e4m3 : t == DType::e5m2 ? KvKind::e5m2 : KvKind::same_as_q;
}

// Split-KV counts of the pseudo-requests of `kv` keys each: none when the step's items fill the
// GPU, else a chunk of keys (whole 64-key tiles, at least kMinChunkDecode) that spreads the keys
// over about one wave; deterministic mode splits by each request's own length.
void choose_splits(const DsaShape& s, int64_t tiles, const std::vector<int32_t>& kv,
                   std::vector<int32_t>& splits) {
  splits.assign(kv.size(), 1);
  if (s.deterministic) {
    for (size_t i = 0; i < kv.size(); ++i) splits[i] = deterministic_splits(kv[i]);
    return;
  }
  const int64_t cap = int64_t{s.sm_count} * std::max(1, s.occupancy);
  const int64_t base = static_cast<int64_t>(kv.size()) * tiles;
  if (base == 0 || base >= cap) return;
  int64_t keys = 0;
  for (int32_t n : kv) keys += n;
  const int64_t chunk =
      ceil_div(std::max<int64_t>(kMinChunkDecode, ceil_div(keys * tiles, cap)), 64) * 64;
  for (size_t i = 0; i < kv.size(); ++i)
    splits[i] = static_cast<int32_t>(std::clamp<int64_t>(ceil_div(kv[i], chunk), 1, kMaxSplits));
}

}  // namespace

DsaGraphSizes dsa_graph_sizes(const DsaShape& shape, int64_t tokens, int64_t max_context_len) {
  DsaGraphSizes g;
  tokens = std::max<int64_t>(tokens, 1);
  g.round_tokens =
      std::clamp<int64_t>(shape.score_budget / std::max<int64_t>(max_context_len, 1), 1, tokens);
  g.scores = max_context_len > shape.topk ? g.round_tokens * max_context_len : 0;
  if (shape.deterministic) {
    g.items = deterministic_splits(shape.topk);
  } else {
    // As the eager choice with every token at topk keys (choose_splits), from the bucket alone:
    // splits when the step's items leave the GPU idle, never below kMinChunkDecode keys a split.
    const int rows =
        std::min(shape.q_heads, tile_rows(choose_shape(1, shape.q_heads, shape.head_dim)));
    const int64_t tiles = ceil_div(shape.q_heads, rows);
    const int64_t cap = int64_t{shape.sm_count} * std::max(1, shape.occupancy);
    const int64_t most = std::max<int64_t>(1, ceil_div(shape.topk, kMinChunkDecode));
    g.items = static_cast<int>(
        std::clamp<int64_t>(cap / (tokens * tiles), 1, std::min<int64_t>(most, kMaxSplits)));
  }
  return g;
}

void plan_dsa(const ForwardBatch& batch, const StepLayout& layout, bool tree, const DsaShape& shape,
              DsaHostPlan& out) {
  const int64_t T = layout.num_tokens;
  const bool graph = shape.graph_round_tokens > 0;
  out.tokens.assign(static_cast<size_t>(T), DsaToken{});
  out.scored.clear();
  if (graph) out.scored.assign(static_cast<size_t>(T), 0);
  out.rounds.clear();
  out.round_scored.clear();
  out.max_cand = 0;
  out.num_scores = 0;
  DsaRound round;
  int32_t next_scored = 0;  // where the next scored row goes in out.scored
  auto close_round = [&](int64_t row) {
    round.row1 = row;
    round.scored1 = next_scored;
    out.rounds.push_back(round);
    out.round_scored.push_back(round.scored1 - round.scored0);
    // A graph step's round keeps its scored rows from its first row on (fixed offsets).
    if (graph) next_scored = static_cast<int32_t>(row);
    round = DsaRound{.row0 = row, .scored0 = next_scored};
  };
  std::vector<int32_t> kv(static_cast<size_t>(T));
  const int bs = static_cast<int>(layout.prefix_lens.size());
  for (int i = 0; i < bs; ++i) {
    const int32_t prefix = layout.prefix_lens[i];
    // Padded requests of a graph step (past batch_size) are chains.
    const bool tree_req = tree && i < batch.batch_size;
    for (int32_t t = 0; t < layout.query_lens[i]; ++t) {
      const int64_t row = layout.query_start[i] + t;
      if (graph && row - round.row0 >= shape.graph_round_tokens) close_round(row);
      const int32_t n = prefix + 1 + (tree_req ? batch.spec_info->depth(i, t) : t);
      DsaToken& tok = out.tokens[row];
      tok = DsaToken{.req = i, .t = t, .num_cand = n, .pad = 0, .score_off = -1};
      if (n > shape.topk) {
        if (!graph && round.num_scores > 0 && round.num_scores + n > shape.score_budget)
          close_round(row);
        tok.score_off = round.num_scores;
        round.num_scores += n;
        round.max_cand = std::max(round.max_cand, n);
        if (graph) {
          out.scored[next_scored++] = static_cast<int32_t>(row);
        } else {
          out.scored.push_back(static_cast<int32_t>(row));
          ++next_scored;
        }
        out.max_cand = std::max(out.max_cand, n);
        out.num_scores = std::max(out.num_scores, round.num_scores);
      }
      kv[row] = std::min(n, shape.topk);
    }
  }
  if (T > 0) close_round(T);

  // The sparse MLA: token t is a request of one query over its kv[t] selected slots, all visible
  // (causal, the query at the last position), its page table at t * topk with page size 1.
  out.shape = choose_shape(1, shape.q_heads, shape.head_dim);
  const int rows = tile_rows(out.shape);
  out.item_rows = std::min(shape.q_heads, rows);
  const int64_t tiles = ceil_div(shape.q_heads, rows);
  std::vector<int32_t> splits;
  choose_splits(shape, tiles, kv, splits);
  // A graph step: graph_items items per token; its split count is that many, or in deterministic
  // mode its own (choose_splits), the items past it empty.
  if (graph && !shape.deterministic) splits.assign(splits.size(), shape.graph_items);
  const int32_t items = graph ? shape.graph_items : 0;
  out.reqs.assign(static_cast<size_t>(T), ReqInfo{});
  out.work.clear();
  out.part_rows = 0;
  out.max_splits = 1;
  for (int64_t t = 0; t < T; ++t) {
    const int32_t s = splits[t];
    const int32_t n_items = items > 0 ? items : s;
    out.reqs[t] = ReqInfo{.qo_start = static_cast<int32_t>(t),
                          .qlen = 1,
                          .prefix = kv[t] - 1,
                          .kv_len = kv[t],
                          .pt_start = static_cast<int32_t>(t * shape.topk),
                          .num_splits = s,
                          .part_start = n_items > 1 ? static_cast<int32_t>(out.part_rows) : 0,
                          .tree_start = -1,
                          .pt_row = 0,
                          .pt_known = 0,
                          .pt_commit = 0,
                          .pad = 0};
    if (n_items > 1) out.part_rows += n_items;
    out.max_splits = std::max(out.max_splits, static_cast<int>(n_items));
    for (int64_t k = 0; k < tiles; ++k)
      for (int32_t sp = 0; sp < n_items; ++sp)
        out.work.push_back({static_cast<int32_t>(t), static_cast<int32_t>(k * rows), sp, 0});
  }
}

// A DSA layer's call (attend() hands it over after check_call): every check first, so that a
// rejected call leaves the latent pool and the index-key cache as they were.
void CudaBackend::attend_dsa(const AttnArgs& args, const LayerSpec& layer,
                             const ForwardBatch& batch, const StepPlan& plan, const CallDims& c) {
  const IndexerSpec& ix = layer.indexer;
  // A graph step (captured, or an eager call on a graph plan) reads the DSA graph plan that
  // build_plan uploaded with the step's: its shape must be this layer's.
  const bool graph = graph_step_;
  ATTNRT_CHECK(graph ? dsa_graph_ready_ && dsa_graph_shape_.topk == ix.index_topk &&
                           dsa_graph_shape_.q_heads == c.hq && dsa_graph_shape_.head_dim == c.d
                     : !stream_is_capturing(stream_),
               "cuda backend: DSA layer {} in a CUDA-graph step{}; DSA layers are captured only "
               "while DSA graphs are on (not ATTNRT_DSA_GRAPHS=0) at init_cuda_graph_state, in a graph step planned "
               "by init_forward_metadata_capture_cuda_graph / _replay_cuda_graph, with every DSA "
               "layer of one shape",
               layer.layer_id, graph ? "" : " (the stream captures an eager plan)");
  ATTNRT_CHECK(c.mla, "cuda backend: layer {} has an indexer but is {}; DSA layers are MLA layers",
               layer.layer_id, layer_kind_name(layer.kind));
  ATTNRT_CHECK(!batch.dcp_partial,
               "cuda backend: DSA layer {} in a decode-context-parallel step; DSA selects over "
               "every key of a request, which one rank does not hold",
               layer.layer_id);
  ATTNRT_CHECK(ix.index_head_dim % 4 == 0 && ix.index_head_dim <= kDsaMaxIndexDim &&
                   ix.index_n_heads <= kDsaMaxIndexHeads,
               "cuda backend: DSA layer {} has index_n_heads {} and index_head_dim {}; the "
               "indexer kernels take up to {} heads and head dims that are multiples of 4 up to "
               "{}",
               layer.layer_id, ix.index_n_heads, ix.index_head_dim, kDsaMaxIndexHeads,
               kDsaMaxIndexDim);
  // A graph step runs the bucket's padded tokens (the static tensors' rows).
  const int64_t T = graph ? c.dev_tokens : c.tokens;
  check_indexer_args("cuda", args, layer, T, c.on_device ? DeviceKind::cuda : DeviceKind::cpu);
  // The plan of the step's DSA calls, built by the first (the batch is the step's).
  if (!graph && (!dsa_planned_ || dsa_shape_.q_heads != c.hq || dsa_shape_.head_dim != c.d ||
                 dsa_shape_.topk != ix.index_topk)) {
    dsa_shape_ = DsaShape{.topk = ix.index_topk,
                          .q_heads = c.hq,
                          .head_dim = c.d,
                          .sm_count = planner_->config().sm_count,
                          .occupancy = 1,
                          .deterministic = planner_->config().deterministic,
                          .score_budget = dsa_score_budget_};
    AttnKernelKey key{.head_dim = c.d,
                      .v_head_dim = c.dv,
                      .fp16 = args.q.dtype == DType::f16,
                      .kv = kv_kind_of_dtype(ctx_.kv_cache->layer(layer.layer_id).dtype),
                      .shape = choose_shape(1, c.hq, c.d),
                      .rows = std::min(c.hq, tile_rows(choose_shape(1, c.hq, c.d))),
                      .target_verify = false};
    dsa_shape_.occupancy = attention_occupancy(key);
    make_step_layout(batch, dsa_layout_);
    plan_dsa(batch, dsa_layout_, plan.tree, dsa_shape_, dsa_plan_);
    ATTNRT_CHECK(ceil_div(dsa_plan_.max_cand, 128) <= 65535 && dsa_plan_.work.size() <= INT32_MAX &&
                     int64_t{c.tokens} * ix.index_topk <= INT32_MAX,
                 "cuda backend: DSA layer {}: {} candidates of one token, {} work items, {} "
                 "tokens x index_topk {}: past the launch limits (8388480 candidates, 2^31 "
                 "items, 2^31 selected slots)",
                 layer.layer_id, dsa_plan_.max_cand, dsa_plan_.work.size(), c.tokens,
                 ix.index_topk);
    DsaOffsets& o = dsa_offsets_;
    o.tokens = 0;
    o.scored = align_up(dsa_plan_.tokens.size() * sizeof(DsaToken), 16);
    o.round_scored = 0;  // eager rounds pass their counts as launch parameters
    o.reqs = o.scored + align_up(dsa_plan_.scored.size() * sizeof(int32_t), 16);
    o.work = o.reqs + align_up(dsa_plan_.reqs.size() * sizeof(ReqInfo), 16);
    upload_dsa_plan(dsa_plan_, o, dsa_meta_);
    dsa_planned_ = true;
  }

  KVCache& cache = *ctx_.kv_cache;
  LayerKv kv = store_and_view_kv(args, layer, c);
  if (args.save_kv && !args.k.empty()) cache.store_step_index_k(layer.layer_id, args.indexer.k);
  if (T == 0) return;
  // A host cache (the correctness path) is mirrored whole, index keys included; the call
  // synchronises before the host pools change again.
  const IndexKeyView keys = cache.index_keys(layer.layer_id);
  const uint8_t* key_bytes = keys.data;
  if (!kv.cache_on_device) {
    mirror_host_layer(layer.layer_id, kv);
    const size_t kb = static_cast<size_t>(keys.num_rows) * (keys.dim + 4);
    ensure(dsa_key_mirror_, kb, "mirrored index keys");
    ATTNRT_CUDA_CHECK(
        cudaMemcpyAsync(dsa_key_mirror_.data(), keys.data, kb, cudaMemcpyHostToDevice, stream_));
    key_bytes = dsa_key_mirror_.ptr<uint8_t>();
  }
  const DeviceIo io = stage_activations(args, c);

  // Indexer inputs: GPU tensors in place; host ones as fp32 rows through the DSA staging.
  // Graph steps: the fixed buffers of init_dsa_graph_state (the eager ones may move as they grow).
  const DsaHostPlan& dp = graph ? dsa_graph_plan_ : dsa_plan_;
  const DsaOffsets& offs = graph ? dsa_graph_offsets_ : dsa_offsets_;
  const int64_t K = ix.index_topk;
  const int hi = ix.index_n_heads, di = ix.index_head_dim;
  if (!graph) {
    ensure(dsa_scores_, std::max<int64_t>(dp.num_scores, 1) * sizeof(float), "DSA scores");
    ensure(dsa_slots_, static_cast<size_t>(T * K) * sizeof(int32_t), "DSA selected slots");
  }
  DeviceBuffer& scores_buf = graph ? graph_dsa_scores_ : dsa_scores_;
  DeviceBuffer& slots_buf = graph ? graph_dsa_slots_ : dsa_slots_;
  const char* meta = (graph ? graph_dsa_meta_ : dsa_meta_).ptr<char>();
  const char* step_meta = (graph ? graph_meta_ : meta_).ptr<char>();
  DsaParams d{};
  d.reqs = reinterpret_cast<const ReqInfo*>(step_meta + plan.classes[0].reqs_off);
  d.page_table = reinterpret_cast<const int32_t*>(step_meta + plan.pt_off);
  d.row_table = row_table_ready_ ? row_table_.ptr<int32_t>() : nullptr;
  d.tree_mask = reinterpret_cast<const uint64_t*>(step_meta + plan.tree_mask_off);
  d.page_shift = plan.page_shift;
  d.tree = plan.tree ? 1 : 0;
  d.tokens = reinterpret_cast<const DsaToken*>(meta + offs.tokens);
  d.heads = hi;
  d.dim = di;
  d.score_scale = index_score_scale(layer);
  d.keys = key_bytes;
  d.key_page = keys.page_size;
  d.scores = scores_buf.ptr<float>();
  d.topk = static_cast<int32_t>(K);
  d.sel_slots = slots_buf.ptr<int32_t>();
  const TensorView& iq = args.indexer.q;
  const TensorView& iw = args.indexer.weights;
  const TensorView& topk = args.indexer.topk;
  if (c.on_device) {
    d.q = iq.data;
    d.q_dtype = static_cast<int32_t>(iq.dtype);
    d.q_s0 = iq.strides[0];
    d.q_s1 = iq.strides[1];
    d.q_s2 = iq.strides[2];
    d.w = iw.data;
    d.w_dtype = static_cast<int32_t>(iw.dtype);
    d.w_s0 = iw.strides[0];
    d.w_s1 = iw.strides[1];
    if (!topk.empty()) {
      d.topk_out = topk.ptr<int32_t>();
      d.topk_s0 = topk.strides[0];
      d.topk_s1 = topk.strides[1];
    }
  } else {
    // Host inputs (the correctness path: the call synchronises at its end).
    std::vector<float>& h = dsa_host_in_;
    const size_t qn = static_cast<size_t>(T) * hi * di, wn = static_cast<size_t>(T) * hi;
    h.resize(qn + wn);
    for (int64_t t = 0; t < T; ++t)
      for (int a = 0; a < hi; ++a) {
        for (int e = 0; e < di; ++e)
          h[(t * hi + a) * di + e] = load_as_float(
              iq.data, iq.dtype,
              static_cast<size_t>(t * iq.strides[0] + a * iq.strides[1] + e * iq.strides[2]));
        h[qn + t * hi + a] = load_as_float(
            iw.data, iw.dtype, static_cast<size_t>(t * iw.strides[0] + a * iw.strides[1]));
      }
    const size_t w_off = align_up(qn * sizeof(float), 256);
    const size_t t_off = w_off + align_up(wn * sizeof(float), 256);
    ensure(dsa_io_, t_off + static_cast<size_t>(T * K) * sizeof(int32_t), "DSA host inputs");
    ATTNRT_CUDA_CHECK(cudaMemcpyAsync(dsa_io_.data(), h.data(), qn * sizeof(float),
                                      cudaMemcpyHostToDevice, stream_));
    ATTNRT_CUDA_CHECK(cudaMemcpyAsync(dsa_io_.ptr<char>() + w_off, h.data() + qn,
                                      wn * sizeof(float), cudaMemcpyHostToDevice, stream_));
    d.q = dsa_io_.data();
    d.q_dtype = static_cast<int32_t>(DType::f32);
    d.q_s0 = int64_t{hi} * di;
    d.q_s1 = di;
    d.q_s2 = 1;
    d.w = dsa_io_.ptr<char>() + w_off;
    d.w_dtype = static_cast<int32_t>(DType::f32);
    d.w_s0 = hi;
    d.w_s1 = 1;
    if (!topk.empty()) {
      d.topk_out = reinterpret_cast<int32_t*>(dsa_io_.ptr<char>() + t_off);
      d.topk_s0 = K;
      d.topk_s1 = 1;
    }
  }
  // Round by round: a round's scores are selected before the next round overwrites them. A
  // graph step's rounds are the bucket's (fixed rows); what varies, its scored tokens and their
  // candidates, is read on the device: the count per round, the rows, the tokens.
  const auto* scored = reinterpret_cast<const int32_t*>(meta + offs.scored);
  const auto* round_scored = reinterpret_cast<const int32_t*>(meta + offs.round_scored);
  for (size_t i = 0; i < dp.rounds.size(); ++i) {
    const DsaRound& r = dp.rounds[i];
    d.row0 = r.row0;
    d.num_tokens = r.row1 - r.row0;
    d.scored = scored + r.scored0;
    if (graph) {
      const bool scorable = dsa_graph_context_ > K;
      d.num_scored = scorable ? static_cast<int32_t>(d.num_tokens) : 0;
      d.max_cand = static_cast<int32_t>(dsa_graph_context_);
      d.num_scored_dev = round_scored + i;
      // A DSA-only model's graph has no other kernel to store the plan's commits.
      d.row_table_out = row_table_ready_ ? row_table_.ptr<int32_t>() : nullptr;
    } else {
      d.num_scored = r.scored1 - r.scored0;
      d.max_cand = r.max_cand;
    }
    ATTNRT_CUDA_CHECK(launch_dsa_select(d, stream_));
  }

  // The sparse MLA over the selected slots.
  ClassPlan cls;
  cls.group = c.hq;
  cls.head_dim = c.d;
  cls.shape = dp.shape;
  cls.item_rows = dp.item_rows;
  cls.num_items = static_cast<int>(dp.work.size());
  cls.part_rows = dp.part_rows;
  cls.max_splits = dp.max_splits;
  ensure_partials(cls, c, kv);
  AttnParams p = attn_params(layer, plan, cls, c, kv, io);
  p.reqs = reinterpret_cast<const ReqInfo*>(meta + offs.reqs);
  p.work = reinterpret_cast<const WorkItem*>(meta + offs.work);
  p.page_table = slots_buf.ptr<int32_t>();
  p.row_table = nullptr;
  p.page_shift = 0;
  p.slot_map = nullptr;
  p.tree = 0;
  p.window = -1;
  p.causal = 1;
  p.item_rows = dp.item_rows;
  const bool fp16 = args.q.dtype == DType::f16;
  const AttnKernelKey key{.head_dim = c.d,
                          .v_head_dim = c.dv,
                          .fp16 = fp16,
                          .kv = p.kv_kind,
                          .shape = dp.shape,
                          .rows = dp.item_rows,
                          .target_verify = false};
  // A grid holds at most 65535 items on y (a long prefill has two MLA items a token): launches of
  // consecutive slices of the work list (the CTAs read p.work[blockIdx.y] and nothing else of
  // their position).
  constexpr int kGridItems = 65535;
  for (int base = 0; base < cls.num_items; base += kGridItems) {
    AttnParams slice = p;
    slice.work = p.work + base;
    ATTNRT_CUDA_CHECK(launch_attention(slice, key, std::min(kGridItems, cls.num_items - base),
                                       stream_, /*dependent=*/false));
  }
  if (dp.max_splits > 1) {
    merge_partials(p, c, io, static_cast<int>(T), dp.max_splits, fp16, /*dependent=*/true);
  }
  if (!c.on_device && !topk.empty()) {
    std::vector<int32_t>& sel = dsa_host_topk_;
    sel.resize(static_cast<size_t>(T * K));
    ATTNRT_CUDA_CHECK(cudaMemcpyAsync(sel.data(), d.topk_out, sel.size() * sizeof(int32_t),
                                      cudaMemcpyDeviceToHost, stream_));
    ATTNRT_CUDA_CHECK(cudaStreamSynchronize(stream_));
    int32_t* dst = topk.ptr<int32_t>();
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < K; ++k)
        dst[t * topk.strides[0] + k * topk.strides[1]] = sel[t * K + k];
  }
  finish_call(args, c, io, kv);
}

// The DSA plan's bytes into `dst` at offsets `o` (one copy through the DSA staging ring,
// stream-ordered before every kernel of the step's DSA calls, or before the replayed graph).
void CudaBackend::upload_dsa_plan(const DsaHostPlan& dp, const DsaOffsets& o, DeviceBuffer& dst) {
  const size_t bytes = std::max<size_t>(o.work + dp.work.size() * sizeof(WorkItem), 16);
  if (&dst != &graph_dsa_meta_) ensure(dst, bytes, "DSA metadata");
  ATTNRT_CHECK(bytes <= dst.bytes(),
               "cuda backend: DSA graph plan of {} bytes; the graph state holds {}", bytes,
               dst.bytes());
  auto* host = static_cast<char*>(dsa_staging_.acquire(bytes, stream_));
  std::memcpy(host + o.tokens, dp.tokens.data(), dp.tokens.size() * sizeof(DsaToken));
  std::memcpy(host + o.scored, dp.scored.data(), dp.scored.size() * sizeof(int32_t));
  if (o.round_scored > 0) {
    std::memcpy(host + o.round_scored, dp.round_scored.data(),
                dp.round_scored.size() * sizeof(int32_t));
  }
  std::memcpy(host + o.reqs, dp.reqs.data(), dp.reqs.size() * sizeof(ReqInfo));
  std::memcpy(host + o.work, dp.work.data(), dp.work.size() * sizeof(WorkItem));
  dsa_staging_.upload(dst.data(), bytes, stream_);
}

// The DSA graph buffers, for every bucket of up to max_bs requests of 1 (DECODE) or per_req
// (TARGET_VERIFY) tokens: the plan's bytes at fixed offsets, the scores of a round (its tokens x
// max_context_len), the selected slots [max_tokens, topk].
int64_t CudaBackend::init_dsa_graph_state(int max_bs, int max_tokens, int per_req) {
  const DsaShape& s = dsa_graph_shape_;
  dsa_graph_context_ = ctx_.req_to_token->max_context_len();
  const int rows = std::min(s.q_heads, tile_rows(choose_shape(1, s.q_heads, s.head_dim)));
  const int64_t tiles = ceil_div(s.q_heads, rows);
  int64_t scores = 0, part_rows = 0, work = 0, rounds = 1;
  for (int tokens : {1, per_req}) {
    for (int bs = 1; bs <= max_bs; ++bs) {
      const int64_t T = int64_t{bs} * tokens;
      if (T > max_tokens) break;
      const DsaGraphSizes g = dsa_graph_sizes(s, T, dsa_graph_context_);
      scores = std::max(scores, g.scores);
      work = std::max(work, T * tiles * g.items);
      if (g.items > 1) part_rows = std::max(part_rows, T * g.items);
      rounds = std::max(rounds, ceil_div(T, g.round_tokens));
    }
  }
  const auto mt = static_cast<size_t>(max_tokens);
  DsaOffsets& o = dsa_graph_offsets_;
  o.tokens = 0;
  o.scored = align_up(mt * sizeof(DsaToken), 16);
  o.round_scored = o.scored + align_up(mt * sizeof(int32_t), 16);
  o.reqs = o.round_scored + align_up(static_cast<size_t>(rounds) * sizeof(int32_t), 16);
  o.work = o.reqs + align_up(mt * sizeof(ReqInfo), 16);
  dsa_graph_work_cap_ = static_cast<size_t>(work);
  dsa_graph_round_cap_ = static_cast<size_t>(rounds);
  graph_dsa_meta_.reserve(o.work + dsa_graph_work_cap_ * sizeof(WorkItem));
  graph_dsa_scores_.reserve(static_cast<size_t>(std::max<int64_t>(scores, 1)) * sizeof(float));
  graph_dsa_slots_.reserve(mt * static_cast<size_t>(s.topk) * sizeof(int32_t));
  dsa_graph_ready_ = true;
  return part_rows;
}

// The DSA part of a graph plan: the step's requests, then the padded ones as the planner pads
// them (cuda_plan.cpp: a prefix of 1 in verify, 0 in decode, chains), planned with the bucket's
// rounds and items and uploaded to the fixed graph buffer.
void CudaBackend::plan_dsa_graph(const ForwardBatch& batch, int padded_bs) {
  const StepPlan& plan = planner_->plan();
  StepLayout& l = dsa_graph_layout_;
  if (batch.batch_size > 0) {
    make_step_layout(batch, l);
  } else {
    l.prefix_lens.clear();
    l.query_lens.clear();
    l.query_start.assign(1, 0);
  }
  const bool verify = is_target_verify(batch.mode);
  const int32_t per = verify && batch.spec_info ? batch.spec_info->draft_token_num : 1;
  for (int i = batch.batch_size; i < padded_bs; ++i) {
    l.prefix_lens.push_back(verify ? 1 : 0);
    l.query_lens.push_back(per);
    l.query_start.push_back(l.query_start.back() + per);
  }
  l.num_tokens = l.query_start.back();
  ATTNRT_CHECK(l.num_tokens == plan.num_tokens,
               "cuda backend: DSA graph plan of {} tokens for a step plan of {}", l.num_tokens,
               plan.num_tokens);
  DsaShape s = dsa_graph_shape_;
  const DsaGraphSizes g = dsa_graph_sizes(s, l.num_tokens, dsa_graph_context_);
  s.graph_round_tokens = g.round_tokens;
  s.graph_items = g.items;
  plan_dsa(batch, l, plan.tree, s, dsa_graph_plan_);
  const DsaHostPlan& dp = dsa_graph_plan_;
  ATTNRT_CHECK(dp.num_scores <= g.scores && dp.work.size() <= dsa_graph_work_cap_ &&
                   dp.rounds.size() <= dsa_graph_round_cap_,
               "cuda backend: DSA graph step of {} tokens needs {} scores, {} work items and {} "
               "rounds; the graph state holds {}, {} and {} (init_cuda_graph_state's sizes)",
               l.num_tokens, dp.num_scores, dp.work.size(), dp.rounds.size(), g.scores,
               dsa_graph_work_cap_, dsa_graph_round_cap_);
  upload_dsa_plan(dp, dsa_graph_offsets_, graph_dsa_meta_);
}

}  // namespace attnrt::cuda
