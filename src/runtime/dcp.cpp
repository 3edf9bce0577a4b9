#include "attnrt/runtime/dcp.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "attnrt/core/error.h"
#include "src/runtime/dcp_device.h"

namespace attnrt {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

int v_dim_of(const LayerSpec& l) { return l.v_head_dim > 0 ? l.v_head_dim : l.head_dim; }

const LayerSpec& layer_by_id(const ModelSpec& model, int layer_id, const char* what) {
  for (const LayerSpec& l : model.layers) {
    if (l.layer_id == layer_id) return l;
  }
  fail("{}: model '{}' has no layer {}", what, model.name, layer_id);
}

// Rows `rows` of a [T, H, D] host tensor (any float dtype and strides), contiguous, as `dtype`
// (fp32 for host ranks; the activations' own dtype for cuda ranks, whose kernels take bf16 / fp16).
TensorView gather_rows(const TensorView& src, std::span<const int64_t> rows,
                       std::vector<float>& buf, DType dtype = DType::f32) {
  const int64_t h = src.shape[1], d = src.shape[2];
  const size_t n = rows.size() * h * d;
  buf.resize(std::max<size_t>(1, (n * dtype_size(dtype) + sizeof(float) - 1) / sizeof(float)));
  size_t at = 0;
  for (const int64_t row : rows) {
    for (int64_t i = 0; i < h; ++i) {
      for (int64_t j = 0; j < d; ++j) {
        store_from_float(buf.data(), dtype, at++,
                         load_as_float(src.data, src.dtype,
                                       static_cast<size_t>(row * src.strides[0] +
                                                           i * src.strides[1] +
                                                           j * src.strides[2])));
      }
    }
  }
  return TensorView(buf.data(), dtype, {static_cast<int64_t>(rows.size()), h, d});
}

void check_global_tensor(const char* what, const TensorView& t, DeviceKind device, int64_t d0,
                         int64_t d1, int64_t d2) {
  ATTNRT_CHECK(!t.empty() && t.device.kind == device && is_float(t.dtype) && t.ndim == 3 &&
                   t.shape[0] == d0 && t.shape[1] == d1 && t.shape[2] == d2,
               "DcpAttention: {} is {}; expected a float {} tensor [{}, {}, {}] (q, k, v, out "
               "and lse all on the host or all on the GPU)",
               what, t.empty() ? "empty" : t.describe(),
               device == DeviceKind::cpu ? "host" : "GPU", d0, d1, d2);
}

bool is_tree(const ForwardBatch& batch) {
  if (!is_target_verify(batch.mode) || !batch.spec_info) return false;
  const SpecInfo& s = *batch.spec_info;
  for (size_t k = 0; k < s.parents.size(); ++k) {
    if (s.parents[k] != static_cast<int32_t>(k % s.draft_token_num) - 1) return true;
  }
  return false;
}

}  // namespace

void validate_dcp(const ModelSpec& model, const Options& options) {
  const int n = options.dcp_size;
  ATTNRT_CHECK(n >= 1 && n <= kMaxDcpSize,
               "dcp_size = {}; it must be in [1, {}] (ranks of one decode-context-parallel group)",
               n, kMaxDcpSize);
  if (n == 1) return;
  for (const LayerSpec& l : model.layers) {
    ATTNRT_CHECK(!is_linear_kind(l.kind),
                 "dcp_size = {}: model '{}' layer {} is a {} layer; linear-attention state is "
                 "not split by context. DCP serves full and mla layers (use dcp_size 1)",
                 n, model.name, l.layer_id, layer_kind_name(l.kind));
    ATTNRT_CHECK(l.causal(),
                 "dcp_size = {}: model '{}' layer {} is not causal; DCP splits causal attention "
                 "only (use dcp_size 1)",
                 n, model.name, l.layer_id);
    ATTNRT_CHECK(!l.has_indexer(),
                 "dcp_size = {}: model '{}' layer {} is a DSA layer (index_topk {}); its top-k "
                 "selection over all keys does not decompose by rank (use dcp_size 1)",
                 n, model.name, l.layer_id, l.indexer.index_topk);
  }
}

float dcp_merge(std::span<const float* const> parts, int dv, std::optional<float> sink,
                float* out) {
  double m = sink ? double{*sink} : -std::numeric_limits<double>::infinity();
  for (const float* p : parts) m = std::max(m, double{p[dv]});
  if (m == -std::numeric_limits<double>::infinity()) {
    std::fill_n(out, dv, 0.f);
    return kNegInf;
  }
  double den = sink ? std::exp(double{*sink} - m) : 0.0;
  thread_local std::vector<double> acc;
  acc.assign(dv, 0.0);
  for (const float* p : parts) {
    if (p[dv] == kNegInf) continue;
    const double w = std::exp(double{p[dv]} - m);
    den += w;
    for (int d = 0; d < dv; ++d) acc[d] += w * p[d];
  }
  for (int d = 0; d < dv; ++d) out[d] = static_cast<float>(acc[d] / den);
  return static_cast<float>(m + std::log(den));
}

size_t DcpGraphSizes::total() const {
  return gather[0] + gather[1] + gather[2] + out + lse + send + recv +
         index * static_cast<size_t>(parts);
}

DcpGraphSizes dcp_graph_sizes(const ModelSpec& model, int n, int rank, int64_t tokens) {
  ATTNRT_CHECK(tokens >= 1, "dcp_graph_sizes: {} tokens; a graph step has at least one", tokens);
  ATTNRT_CHECK(n >= 1 && n <= kMaxDcpSize && rank >= 0 && rank < n,
               "dcp_graph_sizes: rank {} of {}; need 1 <= n <= {} and 0 <= rank < n", rank, n,
               kMaxDcpSize);
  const auto rows = static_cast<size_t>(tokens);
  const size_t act = std::max<size_t>(2, dtype_size(model.dtype));
  DcpGraphSizes s;
  s.tokens = tokens;
  std::vector<int> windows;
  for (const LayerSpec& l : model.layers) {
    if (std::find(windows.begin(), windows.end(), l.sliding_window) == windows.end())
      windows.push_back(l.sliding_window);
    const size_t hq = l.num_q_heads, hkv = l.num_kv_heads, d = l.head_dim;
    const size_t dv = v_dim_of(l);
    const auto mine = static_cast<size_t>(dcp_head_begin(rank + 1, l.num_q_heads, n) -
                                          dcp_head_begin(rank, l.num_q_heads, n));
    s.gather[0] = std::max(s.gather[0], rows * hq * d * act);
    s.gather[1] = std::max(s.gather[1], rows * hkv * d * act);
    if (l.kind != LayerKind::mla) s.gather[2] = std::max(s.gather[2], rows * hkv * dv * act);
    s.out = std::max(s.out, rows * hq * dv * act);
    s.lse = std::max(s.lse, rows * hq * sizeof(float));
    s.send = std::max(s.send, rows * hq * (dv + 1) * sizeof(float));
    s.recv = std::max(s.recv, static_cast<size_t>(n) * rows * mine * (dv + 1) * sizeof(float));
  }
  s.index = 2 * rows * sizeof(int64_t);
  s.parts = static_cast<int>(windows.size());
  return s;
}

void dcp_entry_list(std::span<const int64_t> rows, int64_t entries, int64_t tokens, int64_t* out) {
  ATTNRT_CHECK(static_cast<int64_t>(rows.size()) <= entries,
               "dcp_entry_list: {} entries in a list of {}", rows.size(), entries);
  std::copy(rows.begin(), rows.end(), out);
  std::fill(out + rows.size(), out + entries, int64_t{0});
  std::fill_n(out + entries, tokens, int64_t{-1});
  for (size_t e = 0; e < rows.size(); ++e) {
    ATTNRT_CHECK(rows[e] >= 0 && rows[e] < tokens,
                 "dcp_entry_list: entry {} is row {}; the step has rows 0..{}", e, rows[e],
                 tokens - 1);
    out[entries + rows[e]] = static_cast<int64_t>(e);
  }
}

// ---------------------------------------------------------------------------------------------

namespace {

// GPU ranks' plan reads key lists as pages: a prefix of a request's columns is whole pages and a
// partial last one, a window's list (from its first key) is not; a tree verify's neither
// (refused by the step, check_pages).
void check_gpu_rank_pages(const ModelSpec& model, const Options& options, std::string_view backend) {
  if (options.page_size <= 1) return;
  for (const LayerSpec& l : model.layers) {
    ATTNRT_CHECK(l.sliding_window < 0,
                 "dcp_size = {} with the {} backend and page_size {}: model '{}' layer {} has a "
                 "sliding window ({}); its key lists on a rank start inside a page, which the "
                 "cuda plan cannot read. Use page_size 1 for models with sliding windows",
                 options.dcp_size, backend, options.page_size, model.name, l.layer_id,
                 l.sliding_window);
  }
}

}  // namespace

DcpRank::DcpRank(int rank, const ModelSpec& model, const Options& options,
                 const RuntimeConfig& config, Communicator& comm, Communicator* host_comm)
    : rank_(rank), size_(options.dcp_size), model_(model), comm_(&comm), host_comm_(host_comm) {
  ATTNRT_CHECK(host_comm == nullptr || (!host_comm->device_buffers() && host_comm->size() == size_),
               "DcpRank: host_comm must move host buffers between the group's {} ranks; it is "
               "'{}' of {}",
               size_, host_comm->name(), host_comm->size());
  ATTNRT_CHECK(rank >= 0 && rank < size_, "DcpRank: rank {}; the group has ranks 0..{}", rank,
               size_ - 1);
  ATTNRT_CHECK(comm.size() == size_, "DcpRank: the communicator has {} ranks but dcp_size is {}",
               comm.size(), size_);
  Options o = options;
  o.dcp_size = 1;
  RuntimeConfig c = config;
  const int context = config.max_context_len > 0 ? config.max_context_len : model.max_context_len;
  const int block = std::max(options.speculative_num_draft_tokens, 0);
  c.max_context_len = std::min(context, dcp_local_count(context, 0, size_) + block);
  // A part's req_to_token holds a row per request (its compacted columns, Part::local, for the
  // entries that read a prefix of them) and the key lists of a step's other query rows (one row
  // each); every row is taken once here.
  c.max_requests = config.max_requests + config.max_num_tokens;
  // CUDA graphs as the caller configured them: a part runtime's engine-captured graphs (its
  // decode-shaped batch of a graph step's rows) serve the rank's (init_cuda_graph_state).
  for (const LayerSpec& l : model.layers) {
    auto it = std::find_if(parts_.begin(), parts_.end(),
                           [&](const Part& p) { return p.window == l.sliding_window; });
    if (it == parts_.end()) {
      parts_.emplace_back();
      it = parts_.end() - 1;
      it->window = l.sliding_window;
    }
    it->layer_ids.push_back(l.layer_id);
  }
  for (Part& p : parts_) {
    ModelSpec m = model;
    m.layers.clear();
    for (const int id : p.layer_ids) {
      m.layers.push_back(layer_by_id(model, id, "DcpRank"));
      m.layers.back().layer_id = static_cast<int>(m.layers.size()) - 1;
      m.layers.back().has_sinks = false;  // added once, in the merge
    }
    p.runtime = std::make_unique<AttentionRuntime>(std::move(m), o, c);
    if (p.runtime->kv_cache().device().kind == DeviceKind::cuda)
      check_gpu_rank_pages(model, options, p.runtime->selection().backend_for(ForwardMode::DECODE));
    ReqToTokenPool& pool = p.runtime->req_to_token();
    for (int r = 0; r < config.max_requests; ++r) p.req_rows.push_back(pool.alloc());
    for (int r = 0; r < config.max_num_tokens; ++r) p.scratch_rows.push_back(pool.alloc());
    p.local.resize(config.max_requests);
    p.row_valid.assign(config.max_requests, 0);
    p.row_written.assign(config.max_requests, 0);
  }
  // GPU pools: every part of the rank, its gather / pack / merge and its exchange work on one
  // stream, so that each step of a layer follows the one before in stream order. It starts as the
  // device communicator's stream of this rank (the one an engine made it with).
  if (parts_[0].runtime->kv_cache().device().kind == DeviceKind::cuda) {
    stream_ = comm.device_buffers() ? comm.stream(rank) : nullptr;
    for (Part& p : parts_) p.runtime->set_stream(stream_);
  }
  AttentionRuntime& first = *parts_[0].runtime;
  if (first.kv_cache().device().kind != DeviceKind::cuda) {
    graph_off_reason_ = fmt::format(
        "the ranks' pools are on the host (backend '{}'); DCP graph steps need cuda ranks",
        first.selection().backend_for(ForwardMode::DECODE));
  } else if (!comm.device_buffers()) {
    graph_off_reason_ = fmt::format(
        "the communicator '{}' moves host buffers; a graph step exchanges GPU buffers "
        "(device_in_process, nccl)",
        comm.name());
  } else if (!first.cuda_graphs_enabled()) {
    graph_off_reason_ = first.cuda_graphs_off_reason();
  }
}

DcpRank::~DcpRank() = default;

void DcpRank::set_stream(void* stream) {
  if (parts_[0].runtime->kv_cache().device().kind != DeviceKind::cuda) return;
  // The communicator first: it refuses a rank whose collective is pending, before anything moved.
  // The exchange is enqueued on the rank's own stream rather than ordered with events against
  // the communicator's: NCCL takes any stream per call, and one stream needs no event per layer.
  if (comm_->device_buffers()) comm_->set_stream(rank_, stream);
  for (Part& p : parts_) p.runtime->set_stream(stream);
  if (device_) device_->set_stream(stream);
  stream_ = stream;
}

Communicator& DcpRank::host_communicator() {
  if (!comm_->device_buffers()) return *comm_;
  ATTNRT_CHECK(host_comm_ != nullptr,
               "DcpRank {}: host tensors, but the communicator '{}' moves GPU buffers; pass GPU "
               "tensors (or give the rank a host communicator)",
               rank_, comm_->name());
  return *host_comm_;
}

void DcpRank::synchronize() {
  parts_[0].runtime->synchronize();  // every part, the device work and the exchange: one stream
}

std::pair<DcpRank::Part*, int> DcpRank::part_of(int layer_id) {
  for (Part& p : parts_) {
    const auto it = std::find(p.layer_ids.begin(), p.layer_ids.end(), layer_id);
    if (it != p.layer_ids.end()) return {&p, static_cast<int>(it - p.layer_ids.begin())};
  }
  fail("DcpAttention: model '{}' has no layer {}", model_.name, layer_id);
}

AttentionRuntime& DcpRank::runtime(int part) { return *parts_.at(part).runtime; }

const std::vector<int32_t>& DcpRank::local_row(int row, int part) const {
  return parts_.at(part).local.at(row);
}

int DcpRank::request_row(int row, int part) const { return parts_.at(part).req_rows.at(row); }

void DcpRank::set_kv_scales(int layer_id, float k_scale, float v_scale) {
  const auto [part, id] = part_of(layer_id);
  part->runtime->kv_cache().set_kv_scales(id, k_scale, v_scale);
}

void DcpRank::free_request(int row) {
  ATTNRT_CHECK(row >= 0 && row < static_cast<int>(parts_[0].local.size()),
               "DcpAttention::free_request: row {}; request rows are 0..{}", row,
               parts_[0].local.size() - 1);
  for (Part& p : parts_) {
    std::vector<int32_t>& cols = p.local[row];
    if (!cols.empty()) {
      const std::vector<int64_t> slots(cols.begin(), cols.end());
      p.runtime->allocator().free(slots);
    }
    cols.clear();
    p.row_valid[row] = 0;  // the next write starts at column 0: a new generation of the row
  }
}

void DcpRank::reserve_prefix(int row, int32_t tokens) {
  ATTNRT_CHECK(row >= 0 && row < static_cast<int>(parts_[0].local.size()) && tokens >= 0,
               "DcpAttention::reserve_prefix: row {}, {} tokens; request rows are 0..{}", row,
               tokens, parts_[0].local.size() - 1);
  const int32_t need = dcp_local_count(tokens, rank_, size_);
  for (Part& p : parts_) {
    std::vector<int32_t>& cols = p.local[row];
    const auto have = static_cast<int32_t>(cols.size());
    if (have >= need) continue;
    ATTNRT_CHECK(need <= p.runtime->req_to_token().max_context_len(),
                 "DcpAttention::reserve_prefix: {} tokens need {} columns on rank {}; a rank's "
                 "row holds {}",
                 tokens, need, rank_, p.runtime->req_to_token().max_context_len());
    const std::vector<int32_t> prefix = {have}, seq = {need};
    const std::vector<int64_t> last = {have > 0 ? cols.back() : -1};
    for (const int64_t slot : p.runtime->allocator().alloc_extend(prefix, seq, last)) {
      cols.push_back(static_cast<int32_t>(slot));
    }
  }
}

void DcpRank::check_step(const ForwardBatch& batch, const StepLayout& layout) const {
  check_pages(batch);
  ATTNRT_CHECK(layout.num_tokens <= static_cast<int64_t>(parts_[0].scratch_rows.size()),
               "DcpAttention: the step has {} tokens, more than RuntimeConfig.max_num_tokens = {}; "
               "split the step or raise max_num_tokens",
               layout.num_tokens, parts_[0].scratch_rows.size());
  const auto rows = static_cast<int64_t>(parts_[0].local.size());
  for (int i = 0; i < batch.batch_size; ++i) {
    const int64_t row = batch.req_pool_indices[i];
    ATTNRT_CHECK(row >= 0 && row < rows,
                 "DcpAttention: req_pool_indices[{}] = {}; request rows are 0..{} "
                 "(RuntimeConfig.max_requests)",
                 i, row, rows - 1);
    const int32_t lp = dcp_local_count(layout.prefix_lens[i], rank_, size_);
    const auto stored = static_cast<int32_t>(parts_[0].local[row].size());
    ATTNRT_CHECK(stored >= lp,
                 "DcpAttention: request {} (row {}) has a prefix of {} tokens, but rank {} holds "
                 "{} of its {}: tokens of earlier steps are missing (every token is stored by the "
                 "step that brings it)",
                 i, row, layout.prefix_lens[i], rank_, stored, lp);
  }
}

void DcpRank::check_pages(const ForwardBatch& batch) const {
  AttentionRuntime& rt = *parts_[0].runtime;
  const int page = rt.options().page_size;
  ATTNRT_CHECK(rt.kv_cache().device().kind != DeviceKind::cuda || page == 1 || !is_tree(batch),
               "DcpAttention: a tree TARGET_VERIFY step on cuda ranks with page_size {}: a tree's "
               "key lists (the prefix, then a token's ancestors) are not whole pages, which the "
               "cuda plan reads; use page_size 1, or chain verify (speculative_eagle_topk 1)",
               page);
}

void DcpRank::begin_step(const ForwardBatch& batch) {
  in_step_ = false;
  graph_tokens_ = 0;
  check_pages(batch);
  counts_ = {};
  const StepLayout layout = make_step_layout(batch);
  num_tokens_ = layout.num_tokens;
  for (Part& p : parts_) {
    build_part(p, batch, layout);
    p.runtime->begin_step(p.batch);
  }
  in_step_ = true;
}

void DcpRank::build_part(Part& part, const ForwardBatch& batch, const StepLayout& layout) {
  const int n = size_, r = rank_;
  const bool verify = is_target_verify(batch.mode);
  const bool tree = is_tree(batch);
  const SpecInfo* spec = verify ? &*batch.spec_info : nullptr;
  ReqToTokenPool& pool = part.runtime->req_to_token();
  TokenAllocator& alloc = part.runtime->allocator();
  const int page = alloc.page_size();

  // Global position of query t of request i: verify tokens by depth, everything else in order.
  auto gpos = [&](int i, int32_t t) -> int64_t {
    return int64_t{layout.prefix_lens[i]} + (verify ? spec->depth(i, t) : t);
  };

  // 1. Columns beyond the prefix (drafts of an earlier verify) go back, in whole pages; then the
  //    new tokens this rank owns get slots, after the prefix, in query order.
  std::vector<int32_t> a_prefix, a_seq;
  std::vector<int64_t> a_last;
  std::vector<int> a_req;
  for (int i = 0; i < batch.batch_size; ++i) {
    const int row = static_cast<int>(batch.req_pool_indices[i]);
    const int32_t lp = dcp_local_count(layout.prefix_lens[i], r, n);
    std::vector<int32_t>& cols = part.local[row];
    if (static_cast<int32_t>(cols.size()) > lp) {
      const int32_t keep = (lp + page - 1) / page * page;
      if (static_cast<int32_t>(cols.size()) > keep) {
        const std::vector<int64_t> drop(cols.begin() + keep, cols.end());
        alloc.free(drop);
      }
      cols.resize(lp);
      part.row_valid[row] = std::min(part.row_valid[row], lp);
    }
    int32_t owned = 0;
    for (int32_t t = 0; t < layout.query_lens[i]; ++t) owned += gpos(i, t) % n == r;
    if (owned == 0) continue;
    ATTNRT_CHECK(lp + owned <= pool.max_context_len(),
                 "DcpAttention: request {} needs {} columns on rank {}; a rank's row holds {} "
                 "(max_context_len / dcp_size + the verify block)",
                 i, lp + owned, r, pool.max_context_len());
    a_req.push_back(i);
    a_prefix.push_back(lp);
    a_seq.push_back(lp + owned);
    a_last.push_back(lp > 0 ? cols[lp - 1] : -1);
  }
  const std::vector<int64_t> fresh = alloc.alloc_extend(a_prefix, a_seq, a_last);
  size_t at = 0;
  for (size_t k = 0; k < a_req.size(); ++k) {
    std::vector<int32_t>& cols = part.local[batch.req_pool_indices[a_req[k]]];
    const auto count = static_cast<size_t>(a_seq[k] - a_prefix[k]);
    cols.insert(cols.end(), fresh.begin() + static_cast<std::ptrdiff_t>(at),
                fresh.begin() + static_cast<std::ptrdiff_t>(at + count));
    at += count;
  }

  // 2. One decode-shaped entry per global row that sees a key here: the causal (or tree) rule
  //    on global positions, then the part's window [q - W, q] on them. An entry whose keys are
  //    columns [0, count) of its request (full attention, not a tree) and which is the request's
  //    only entry here (a step's rows are distinct) reads the request's own row, nothing copied:
  //    every DECODE row. The others get a key-list row with a copy of their keys.
  std::vector<int64_t> req_rows;
  std::vector<int32_t> seq_lens;
  std::vector<int64_t> write_slots;
  part.rows.clear();
  size_t scratch = 0;
  std::vector<int64_t>& keys = slots_;
  const int64_t window = part.window;
  const bool direct = direct_rows_ && window < 0 && !tree;
  // The request's entries before they are placed: keys cols[c0, c1) (not a tree), the slot of
  // its token, its global query row.
  struct Pending {
    int32_t c0, c1;
    int64_t slot, qrow;
  };
  std::vector<Pending> pending;
  for (int i = 0; i < batch.batch_size; ++i) {
    const int row = static_cast<int>(batch.req_pool_indices[i]);
    const int32_t lp = dcp_local_count(layout.prefix_lens[i], r, n);
    const int32_t* cols = part.local[row].data();
    const int32_t* parents =
        tree ? spec->parents.data() + static_cast<size_t>(i) * spec->draft_token_num : nullptr;
    // Local column of each owned query token (in query order after the prefix).
    std::vector<int32_t> column(layout.query_lens[i], -1);
    int32_t next = lp;
    for (int32_t t = 0; t < layout.query_lens[i]; ++t) {
      if (gpos(i, t) % n == r) column[t] = next++;
    }
    pending.clear();
    for (int32_t t = 0; t < layout.query_lens[i]; ++t) {
      const int64_t q = gpos(i, t);
      const int64_t first = window < 0 ? 0 : std::max<int64_t>(0, q - window);
      const int64_t slot = column[t] >= 0 ? cols[column[t]] : 0;
      const int64_t qrow = layout.query_start[i] + t;
      if (tree) {
        keys.assign(cols + std::min(lp, dcp_local_count(first, r, n)), cols + lp);
        const size_t base = keys.size();
        for (int32_t a = t; a >= 0; a = parents[a]) {
          if (column[a] >= 0 && gpos(i, a) >= first) keys.push_back(cols[column[a]]);
        }
        std::reverse(keys.begin() + static_cast<std::ptrdiff_t>(base), keys.end());
        if (keys.empty()) continue;
        const int entry_row = part.scratch_rows[scratch++];
        pool.write(entry_row, 0, keys);
        counts_.listed += 1;
        counts_.copied += static_cast<int64_t>(keys.size());
        req_rows.push_back(entry_row);
        seq_lens.push_back(static_cast<int32_t>(keys.size()));
        write_slots.push_back(slot);
        part.rows.push_back(qrow);
        continue;
      }
      const int32_t c0 = dcp_local_count(first, r, n), c1 = dcp_local_count(q + 1, r, n);
      if (c1 > c0) pending.push_back({c0, c1, slot, qrow});
    }
    if (direct && pending.size() == 1 && pending[0].c0 == 0) {
      sync_request_row(part, row, pending[0].c1);
      counts_.direct += 1;
      req_rows.push_back(part.req_rows[row]);
      seq_lens.push_back(pending[0].c1);
      write_slots.push_back(pending[0].slot);
      part.rows.push_back(pending[0].qrow);
      continue;
    }
    for (const Pending& e : pending) {
      keys.assign(cols + e.c0, cols + e.c1);
      const int entry_row = part.scratch_rows[scratch++];
      pool.write(entry_row, 0, keys);
      counts_.listed += 1;
      counts_.copied += e.c1 - e.c0;
      req_rows.push_back(entry_row);
      seq_lens.push_back(e.c1 - e.c0);
      write_slots.push_back(e.slot);
      part.rows.push_back(e.qrow);
    }
  }
  if (part.rows.empty()) {
    part.batch = make_idle_batch();
  } else {
    part.batch = make_decode_batch(req_rows, seq_lens);
    part.batch.out_cache_loc = std::move(write_slots);
    part.batch.dcp_partial = true;
  }
}

DcpDeviceRank& DcpRank::device() {
  if (!device_) device_ = make_dcp_device_rank(stream_);
  return *device_;
}

void DcpRank::init_cuda_graph_state(int max_num_tokens) {
  ATTNRT_CHECK(cuda_graphs_enabled(), "DcpRank {}: init_cuda_graph_state: CUDA graphs are off: {}",
               rank_, graph_off_reason_);
  const auto limit = static_cast<int>(parts_[0].scratch_rows.size());
  ATTNRT_CHECK(max_num_tokens >= 1 && max_num_tokens <= limit,
               "DcpRank {}: init_cuda_graph_state({}): need 1 <= max_num_tokens <= "
               "RuntimeConfig.max_num_tokens ({})",
               rank_, max_num_tokens, limit);
  ATTNRT_CHECK(graph_max_tokens_ == 0 || graph_max_tokens_ == max_num_tokens,
               "DcpRank {}: init_cuda_graph_state({}): it was called with {} already, and the "
               "graphs captured since read its buffers; call it once, with the largest step "
               "captured",
               rank_, max_num_tokens, graph_max_tokens_);
  if (graph_max_tokens_ == max_num_tokens) return;
  ATTNRT_CHECK(!in_step_,
               "DcpRank {}: init_cuda_graph_state inside a step; call it between steps (before "
               "the first capture)",
               rank_);
  // Every entry of a graph step is a decode-shaped request of the part runtime: its graph state
  // holds `max_num_tokens` of them.
  for (Part& p : parts_) p.runtime->init_cuda_graph_state(max_num_tokens, max_num_tokens);
  device().reserve_graph(dcp_graph_sizes(model_, size_, rank_, max_num_tokens));
  graph_max_tokens_ = max_num_tokens;
}

void DcpRank::check_graph_tokens(const char* call, int64_t tokens) const {
  ATTNRT_CHECK(cuda_graphs_enabled(), "DcpRank {}: {}: CUDA graphs are off: {}", rank_, call,
               graph_off_reason_);
  ATTNRT_CHECK(graph_max_tokens_ > 0,
               "DcpRank {}: {}: no graph state; call init_cuda_graph_state(max_num_tokens) "
               "first (it allocates every buffer a captured step touches)",
               rank_, call);
  ATTNRT_CHECK(tokens >= 1 && tokens <= graph_max_tokens_,
               "DcpRank {}: {}({} tokens): init_cuda_graph_state sized the graph buffers for "
               "steps of 1..{} tokens, and a captured step cannot grow them; call "
               "init_cuda_graph_state with max_num_tokens >= {} before the first capture",
               rank_, call, tokens, graph_max_tokens_, tokens);
}

void DcpRank::begin_capture_step(int tokens) {
  in_step_ = false;
  graph_tokens_ = 0;
  check_graph_tokens("begin_capture_step", tokens);
  DcpDeviceRank& dev = device();
  ATTNRT_CHECK(!dev.capturing(),
               "DcpRank {}: begin_capture_step while the rank's stream captures; call it before "
               "the capture begins (its placeholder plan is uploaded now and must not become "
               "part of the graph)",
               rank_);
  counts_ = {};
  // The placeholder step: no entry of its own, every one of the `tokens` rows padded (the
  // replays write the real ones into the same buffers).
  for (size_t i = 0; i < parts_.size(); ++i) {
    Part& p = parts_[i];
    p.rows.clear();
    p.batch = make_decode_batch({}, {});
    p.batch.dcp_partial = true;
    p.runtime->begin_capture_step(p.batch, tokens);
    dev.set_graph_entries(static_cast<int>(i), {}, tokens);
  }
  num_tokens_ = tokens;
  graph_tokens_ = tokens;
  in_step_ = true;
}

void DcpRank::begin_replay_step(const ForwardBatch& batch, int tokens) {
  in_step_ = false;
  graph_tokens_ = 0;
  check_graph_tokens("begin_replay_step", tokens);
  check_pages(batch);
  const StepLayout layout = make_step_layout(batch);
  ATTNRT_CHECK(layout.num_tokens <= tokens,
               "DcpRank {}: begin_replay_step: the step has {} tokens, more than the {} rows of "
               "the graph; replay it in a graph captured with at least {} rows, or run it with "
               "begin_step",
               rank_, layout.num_tokens, tokens, layout.num_tokens);
  DcpDeviceRank& dev = device();
  ATTNRT_CHECK(!dev.capturing(),
               "DcpRank {}: begin_replay_step while the rank's stream captures; call it before "
               "the graph's launch, outside any capture",
               rank_);
  counts_ = {};
  num_tokens_ = tokens;
  for (size_t i = 0; i < parts_.size(); ++i) {
    Part& p = parts_[i];
    build_part(p, batch, layout);
    if (p.rows.empty()) {  // every row padded: a decode of no request of its own
      p.batch = make_decode_batch({}, {});
      p.batch.dcp_partial = true;
    }
    p.runtime->begin_replay_step(p.batch, tokens);
    dev.set_graph_entries(static_cast<int>(i), p.rows, tokens);
  }
  graph_tokens_ = tokens;
  in_step_ = true;
}

void DcpRank::sync_request_row(Part& part, int row, int32_t count) {
  int32_t& valid = part.row_valid[row];
  if (count <= valid) return;
  int32_t& written = part.row_written[row];
  ReqToTokenPool& pool = part.runtime->req_to_token();
  const int pool_row = part.req_rows[row];
  const std::vector<int32_t>& cols = part.local[row];
  int32_t from = valid;
  if (from < written) {
    // Columns [valid, written) held columns dropped since (drafts, a request that ended): the
    // unchanged ones stay; a changed one means a new generation of the row (write() gives one
    // from column 0), since a backend may keep the pages of a row's columns while it holds.
    const int32_t end = std::min(written, count);
    const int32_t* old = pool.row_ptr(pool_row);
    while (from < end && old[from] == cols[from]) ++from;
    if (from < end) from = 0;
  }
  slots_.assign(cols.begin() + from, cols.begin() + count);
  pool.write(pool_row, from, slots_);
  counts_.copied += count - from;
  valid = count;
  written = from == 0 ? count : std::max(written, count);
}

void DcpRank::partial(int layer_id, const AttnArgs& args) {
  ATTNRT_CHECK(in_step_, "DcpRank {}: forward(layer {}) outside a step; call begin_step first",
               rank_, layer_id);
  if (args.q.device.kind == DeviceKind::cuda) return forward_device(layer_id, args);
  ATTNRT_CHECK(graph_tokens_ == 0,
               "DcpRank {}: q is {}; a CUDA-graph step (begin_capture_step / begin_replay_step) "
               "takes GPU tensors",
               rank_, args.q.describe());
  const LayerSpec& layer = layer_by_id(model_, layer_id, "DcpAttention::forward");
  const auto [part, local_id] = part_of(layer_id);
  const std::vector<int64_t>& entries = part->rows;
  const int hq = layer.num_q_heads, dv = v_dim_of(layer), n = size_;
  const int64_t T = num_tokens_, rows = static_cast<int64_t>(entries.size());
  const int64_t packed = dv + 1;

  // The partial of every row this rank sees; rows it does not see stay (0, -inf).
  send_.assign(static_cast<size_t>(T * hq * packed), 0.f);
  // Host ranks attend fp32 copies; cuda ranks (host tensors staged by their backend) the
  // activations' dtype, which their kernels take, with the partial output in it too.
  const bool gpu = part->runtime->kv_cache().device().kind == DeviceKind::cuda;
  const DType dt = gpu ? args.q.dtype : DType::f32;
  if (rows > 0) {
    AttnArgs a;
    a.q = gather_rows(args.q, entries, q_, dt);
    if (!args.k.empty()) a.k = gather_rows(args.k, entries, k_, dt);
    if (!args.v.empty() && layer.kind != LayerKind::mla) a.v = gather_rows(args.v, entries, v_, dt);
    out_.resize(static_cast<size_t>(rows * hq * dv));
    lse_.resize(static_cast<size_t>(rows * hq));
    a.out = TensorView(out_.data(), dt, {rows, hq, dv});
    a.lse = TensorView(lse_.data(), DType::f32, {rows, hq});
    a.save_kv = args.save_kv;
    part->runtime->forward(local_id, a);
  }
  std::vector<int64_t> entry(T, -1);
  for (int64_t e = 0; e < rows; ++e) entry[entries[e]] = e;
  std::vector<int64_t>& send_counts = send_counts_;
  std::vector<int64_t>& recv_counts = recv_counts_;
  send_counts.assign(n, 0);
  recv_counts.assign(n, 0);
  const int mine = dcp_head_begin(rank_ + 1, hq, n) - dcp_head_begin(rank_, hq, n);
  int64_t block = 0;
  for (int d = 0; d < n; ++d) {
    const int h0 = dcp_head_begin(d, hq, n), h1 = dcp_head_begin(d + 1, hq, n);
    for (int64_t t = 0; t < T; ++t) {
      for (int h = h0; h < h1; ++h) {
        float* dst = send_.data() + block + (t * (h1 - h0) + (h - h0)) * packed;
        if (entry[t] < 0) {
          dst[dv] = kNegInf;
          continue;
        }
        for (int j = 0; j < dv; ++j) {
          dst[j] = load_as_float(out_.data(), dt, static_cast<size_t>((entry[t] * hq + h) * dv + j));
        }
        dst[dv] = lse_[entry[t] * hq + h];
      }
    }
    send_counts[d] = T * (h1 - h0) * packed;
    recv_counts[d] = T * mine * packed;
    block += send_counts[d];
  }
  recv_.assign(static_cast<size_t>(n * T * mine * packed), 0.f);
  exchange_comm_ = &host_communicator();
  exchange_send_ = send_;
  exchange_recv_ = recv_;
}

// The counts of the all-to-all of a layer: block d (heads of rank d) of every row to rank d.
namespace {
void exchange_counts(int rank, int n, int hq, int dv, int64_t T, std::vector<int64_t>& send_counts,
                     std::vector<int64_t>& recv_counts) {
  send_counts.assign(n, 0);
  recv_counts.assign(n, 0);
  const int64_t mine = dcp_head_begin(rank + 1, hq, n) - dcp_head_begin(rank, hq, n);
  for (int d = 0; d < n; ++d) {
    send_counts[d] = T * (dcp_head_begin(d + 1, hq, n) - dcp_head_begin(d, hq, n)) * (dv + 1);
    recv_counts[d] = T * mine * (dv + 1);
  }
}
}  // namespace

void DcpRank::forward_device(int layer_id, const AttnArgs& args) {
  ATTNRT_CHECK(comm_->device_buffers(),
               "DcpRank {}: q is on the GPU but the communicator '{}' moves host buffers; GPU "
               "ranks exchange through device_in_process (one GPU) or nccl",
               rank_, comm_->name());
  const LayerSpec& layer = layer_by_id(model_, layer_id, "DcpAttention::forward");
  const auto [part, local_id] = part_of(layer_id);
  const std::vector<int64_t>& entries = part->rows;
  const int hq = layer.num_q_heads, dv = v_dim_of(layer), n = size_;
  const int64_t T = num_tokens_;
  DcpDeviceRank& dev = device();
  const int list = static_cast<int>(part - parts_.data());
  int64_t rows = static_cast<int64_t>(entries.size());
  if (graph_tokens_ > 0) {
    // The merge reads the sinks at every replay: a host array would have to be copied by the
    // graph from memory that is the caller's again by then.
    ATTNRT_CHECK(!layer.has_sinks || args.sinks == nullptr || dev.on_device(args.sinks),
                 "DcpRank {}: layer {}'s sinks are host memory in a CUDA-graph step; pass them as "
                 "a GPU tensor (fp32 [num_q_heads]): the captured merge reads them at every "
                 "replay",
                 rank_, layer_id);
    // Every one of the graph's rows is an entry (the padded ones attend and are dropped by the
    // packing); the list was uploaded by begin_capture_step / begin_replay_step.
    dev.use_graph_entries(list, graph_tokens_);
    rows = graph_tokens_;
  } else {
    ATTNRT_CHECK(!dev.capturing(),
                 "DcpRank {}: forward(layer {}) is being captured into a CUDA graph, but the step "
                 "was begun with begin_step: its entry lists are uploaded per call and its "
                 "buffers grow with the steps. Capture steps begun with begin_capture_step(tokens) "
                 "after init_cuda_graph_state, and replay them after begin_replay_step",
                 rank_, layer_id);
    dev.set_entries(list, entries, T);
  }
  if (rows > 0) {
    AttnArgs a;
    a.q = dev.gather(0, args.q);
    if (!args.k.empty()) a.k = dev.gather(1, args.k);
    if (!args.v.empty() && layer.kind != LayerKind::mla) a.v = dev.gather(2, args.v);
    a.out = dev.partial_out(args.q.dtype, rows, hq, dv);
    a.lse = dev.partial_lse(rows, hq);
    a.save_kv = args.save_kv;
    part->runtime->forward(local_id, a);
  }
  exchange_send_ = dev.pack(hq, dv, n);
  exchange_counts(rank_, n, hq, dv, T, send_counts_, recv_counts_);
  exchange_recv_ = dev.recv(n * recv_counts_[0]);
  exchange_comm_ = comm_;
}

void DcpRank::forward(int layer_id, const AttnArgs& args) {
  partial(layer_id, args);
  exchange();
}

void DcpRank::exchange() {
  ATTNRT_CHECK(exchange_comm_ != nullptr,
               "DcpRank {}: exchange() without a partial to send; call partial(layer, args) first",
               rank_);
  Communicator* comm = exchange_comm_;
  exchange_comm_ = nullptr;
  comm->all_to_all(rank_, exchange_send_, send_counts_, exchange_recv_, recv_counts_);
}

void DcpRank::merge_device(int layer_id, const AttnArgs& args) {
  const LayerSpec& layer = layer_by_id(model_, layer_id, "DcpAttention::forward");
  const int hq = layer.num_q_heads, n = size_;
  device_->merge(n, dcp_head_begin(rank_, hq, n), dcp_head_begin(rank_ + 1, hq, n),
                 v_dim_of(layer), layer.has_sinks ? args.sinks : nullptr, args.out, args.lse);
}

void DcpRank::merge(int layer_id, const AttnArgs& args) {
  if (args.q.device.kind == DeviceKind::cuda) return merge_device(layer_id, args);
  const LayerSpec& layer = layer_by_id(model_, layer_id, "DcpAttention::forward");
  const int hq = layer.num_q_heads, dv = v_dim_of(layer), n = size_;
  const int64_t T = num_tokens_, packed = dv + 1;
  const int h0 = dcp_head_begin(rank_, hq, n), h1 = dcp_head_begin(rank_ + 1, hq, n);
  const int64_t mine = h1 - h0, block = T * mine * packed;
  std::vector<const float*> parts(n);
  std::vector<float> o(dv);
  const TensorView& out = args.out;
  for (int64_t t = 0; t < T; ++t) {
    for (int h = h0; h < h1; ++h) {
      for (int s = 0; s < n; ++s)
        parts[s] = recv_.data() + s * block + (t * mine + h - h0) * packed;
      const std::optional<float> sink =
          layer.has_sinks ? std::optional<float>(args.sinks[h]) : std::nullopt;
      const float lse = dcp_merge(parts, dv, sink, o.data());
      for (int d = 0; d < dv; ++d) {
        store_from_float(
            out.data, out.dtype,
            static_cast<size_t>(t * out.strides[0] + h * out.strides[1] + d * out.strides[2]),
            o[d]);
      }
      if (!args.lse.empty())
        args.lse.ptr<float>()[t * args.lse.strides[0] + h * args.lse.strides[1]] = lse;
    }
  }
}

void DcpRank::commit_verify(const ForwardBatch& batch,
                            std::span<const std::vector<int32_t>> accepted) {
  ATTNRT_CHECK(is_target_verify(batch.mode) && batch.spec_info.has_value(),
               "DcpAttention::commit_verify: the batch is {}; pass the TARGET_VERIFY step that ran",
               forward_mode_name(batch.mode));
  ATTNRT_CHECK(accepted.size() == static_cast<size_t>(batch.batch_size),
               "DcpAttention::commit_verify: {} accepted paths for a step of {} requests",
               accepted.size(), batch.batch_size);
  const SpecInfo& spec = *batch.spec_info;
  const int N = spec.draft_token_num, n = size_, r = rank_;
  std::vector<std::vector<std::pair<int64_t, int64_t>>> moves(parts_.size());
  for (int i = 0; i < batch.batch_size; ++i) {
    const std::vector<int32_t>& path = accepted[i];
    const int32_t* parents = spec.parents.data() + static_cast<size_t>(i) * N;
    bool ok = !path.empty() && path[0] == 0 && static_cast<int>(path.size()) <= N;
    for (size_t k = 1; ok && k < path.size(); ++k) {
      ok = path[k] > 0 && path[k] < N && parents[path[k]] == path[k - 1];
    }
    ATTNRT_CHECK(ok,
                 "DcpAttention::commit_verify: accepted[{}] = [{}] is not a path of block indices "
                 "from the root (0) down the request's tree",
                 i, fmt::join(path, ", "));
    const int row = static_cast<int>(batch.req_pool_indices[i]);
    const int32_t s = batch.seq_lens[i], lp = dcp_local_count(s, r, n);
    std::vector<int32_t>& cols = parts_[0].local[row];
    // The columns this rank gave the block's tokens (begin_step: after the prefix, block order).
    std::vector<int32_t> column(N, -1);
    int32_t next = lp;
    for (int t = 0; t < N; ++t) {
      if ((s + spec.depth(i, t)) % n == r) column[t] = next++;
    }
    ATTNRT_CHECK(static_cast<int32_t>(cols.size()) == next,
                 "DcpAttention::commit_verify: request {} (row {}) has {} columns on rank {}; the "
                 "verify step left {}: commit right after the verify step",
                 i, row, cols.size(), r, next);
    // The accepted node at depth k goes to the column of position s + k on its owner.
    for (size_t p = 0; p < parts_.size(); ++p) {
      const std::vector<int32_t>& pc = parts_[p].local[row];
      int32_t keep = lp;
      for (size_t k = 0; k < path.size(); ++k) {
        if ((s + static_cast<int64_t>(k)) % n != r) continue;
        if (column[path[k]] != keep) moves[p].emplace_back(pc[column[path[k]]], pc[keep]);
        ++keep;
      }
    }
  }
  for (size_t p = 0; p < parts_.size(); ++p) {
    if (moves[p].empty()) continue;
    std::vector<int> layers(parts_[p].layer_ids.size());
    for (size_t id = 0; id < layers.size(); ++id) layers[id] = static_cast<int>(id);
    parts_[p].runtime->kv_cache().copy_rows(layers, moves[p]);
  }
}

void DcpRank::end_step() {
  if (in_step_) {
    for (Part& p : parts_) p.runtime->end_step();
  }
  in_step_ = false;
  graph_tokens_ = 0;
}

// ---------------------------------------------------------------------------------------------

DcpAttention::DcpAttention(ModelSpec model, Options options, const RuntimeConfig& config)
    : model_(std::move(model)), options_(std::move(options)) {
  validate_dcp(model_, options_);
  max_context_len_ = config.max_context_len > 0 ? config.max_context_len : model_.max_context_len;
  Options rank_options = options_;
  rank_options.dcp_size = 1;
  const Selection selection = resolve_backends(rank_options, model_);
  // GPU ranks share the caller's GPU (one runtime each): they measure correctness, not speed.
  // Their plan reads key lists as pages: a prefix of a request's columns is whole pages and a
  // partial last one, a window's list (from its first key) is not; a tree verify's neither
  // (refused by the step, check_pages).
  if (kv_pool_device(selection) != DeviceKind::cpu) {
    check_gpu_rank_pages(model_, options_, selection.backend_for(ForwardMode::DECODE));
  }
  if (kv_pool_device(selection) == DeviceKind::cpu) {
    comm_ = make_communicator("in_process", options_.dcp_size);
  } else {
    comm_ = make_communicator("device_in_process", options_.dcp_size);
    host_comm_ = make_communicator("in_process", options_.dcp_size);
  }
  for (int r = 0; r < options_.dcp_size; ++r) {
    ranks_.push_back(
        std::make_unique<DcpRank>(r, model_, options_, config, *comm_, host_comm_.get()));
  }
}

DcpRank& DcpAttention::rank(int r) {
  ATTNRT_CHECK(r >= 0 && r < size(), "DcpAttention::rank({}): the group has ranks 0..{}", r,
               size() - 1);
  return *ranks_[r];
}

void DcpAttention::free_request(int row) {
  for (auto& r : ranks_) r->free_request(row);
}

void DcpAttention::reserve_prefix(int row, int32_t tokens) {
  ATTNRT_CHECK(tokens <= max_context_len_,
               "DcpAttention::reserve_prefix: {} tokens, more than max_context_len = {}", tokens,
               max_context_len_);
  for (auto& r : ranks_) r->reserve_prefix(row, tokens);
}

void DcpAttention::set_kv_scales(int layer_id, float k_scale, float v_scale) {
  for (auto& r : ranks_) r->set_kv_scales(layer_id, k_scale, v_scale);
}

void DcpAttention::set_direct_rows(bool on) {
  for (auto& r : ranks_) r->set_direct_rows(on);
}

void DcpAttention::set_stream(void* stream) {
  for (auto& r : ranks_) r->set_stream(stream);
}

void DcpAttention::check_batch(const ForwardBatch& batch, const StepLayout& layout) const {
  for (int i = 0; i < batch.batch_size; ++i) {
    ATTNRT_CHECK(layout.kv_len(i) <= max_context_len_,
                 "DcpAttention: request {} spans {} tokens, more than max_context_len = {}", i,
                 layout.kv_len(i), max_context_len_);
  }
  for (const auto& r : ranks_) r->check_step(batch, layout);
}

void DcpAttention::begin_step(const ForwardBatch& batch) {
  step_rows_ = -1;
  const StepLayout layout = make_step_layout(batch);
  check_batch(batch, layout);
  for (auto& r : ranks_) r->begin_step(batch);
  step_rows_ = layout.num_tokens;
}

void DcpAttention::init_cuda_graph_state(int max_num_tokens) {
  for (auto& r : ranks_) r->init_cuda_graph_state(max_num_tokens);
}

void DcpAttention::begin_capture_step(int tokens) {
  step_rows_ = -1;
  // The ranks' checks are the same: a refused capture is refused by rank 0, before any change.
  for (auto& r : ranks_) r->begin_capture_step(tokens);
  step_rows_ = tokens;
}

void DcpAttention::begin_replay_step(const ForwardBatch& batch, int tokens) {
  step_rows_ = -1;
  const StepLayout layout = make_step_layout(batch);
  check_batch(batch, layout);
  for (auto& r : ranks_) r->begin_replay_step(batch, tokens);
  step_rows_ = tokens;
}

void DcpAttention::forward(int layer_id, const AttnArgs& args) {
  ATTNRT_CHECK(step_rows_ >= 0,
               "DcpAttention: forward(layer {}) outside a step; call begin_step(batch) first",
               layer_id);
  const LayerSpec& layer = layer_by_id(model_, layer_id, "DcpAttention::forward");
  // The rows of the step's tensors: its tokens, or a graph step's rows.
  const int64_t T = step_rows_;
  if (T == 0) return;  // IDLE (or no tokens): nothing to attend, the pools untouched
  const int hq = layer.num_q_heads, hkv = layer.num_kv_heads, dv = v_dim_of(layer);
  const DeviceKind dev = args.q.device.kind;
  ATTNRT_CHECK(dev == DeviceKind::cpu || comm_->device_buffers(),
               "DcpAttention: q is {}; the ranks run on host backends, pass host tensors "
               "(GPU tensors need --attention-backend cuda ranks)",
               args.q.describe());
  check_global_tensor("q", args.q, dev, T, hq, layer.head_dim);
  check_global_tensor("out", args.out, dev, T, hq, dv);
  if (!args.k.empty()) check_global_tensor("k", args.k, dev, T, hkv, layer.head_dim);
  if (!args.v.empty() && layer.kind != LayerKind::mla) {
    check_global_tensor("v", args.v, dev, T, hkv, dv);
  }
  ATTNRT_CHECK(layer.has_sinks == (args.sinks != nullptr),
               "DcpAttention: layer {} {} sinks but AttnArgs.sinks is {}", layer_id,
               layer.has_sinks ? "has" : "has no", args.sinks ? "set" : "null");
  ATTNRT_CHECK(args.lse.empty() ||
                   (args.lse.device.kind == dev && args.lse.dtype == DType::f32 &&
                    args.lse.ndim == 2 && args.lse.shape[0] == T && args.lse.shape[1] == hq),
               "DcpAttention: lse is {}; expected fp32[{}, {}] (tokens, q heads) on the {}",
               args.lse.describe(), T, hq, dev == DeviceKind::cpu ? "host" : "GPU");
  ATTNRT_CHECK(args.indexer.empty(),
               "DcpAttention: layer {} got indexer inputs; DSA layers are "
               "not split by context",
               layer_id);
  // GPU tensors: every rank and the exchange run on the group's one stream, so the merged rows
  // are in its order like one runtime's output; the host goes on.
  for (auto& r : ranks_) r->forward(layer_id, args);
  for (auto& r : ranks_) r->merge(layer_id, args);
}

void DcpAttention::commit_verify(const ForwardBatch& batch,
                                 std::span<const std::vector<int32_t>> accepted) {
  for (auto& r : ranks_) r->commit_verify(batch, accepted);
}

void DcpAttention::end_step() {
  for (auto& r : ranks_) r->end_step();
  step_rows_ = -1;
}

}  // namespace attnrt
