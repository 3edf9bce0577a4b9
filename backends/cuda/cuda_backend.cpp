#include "backends/cuda/cuda_backend.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <memory>

#include "attnrt/backend/options.h"
#include "attnrt/core/device.h"
#include "attnrt/core/error.h"
#include "attnrt/memory/kv_cache.h"
#include "attnrt/memory/req_to_token_pool.h"
#include "backends/cuda/cuda_bench.h"
#include "backends/cuda/cuda_kv_cache.h"
#include "backends/cuda/kernels/prefill.h"

namespace attnrt::cuda {

namespace {

// Split-KV policy. A request is split when the step's CTAs would not fill the GPU; a split never
// gets fewer keys than the minimum chunk (the merge costs a partial write and read per split).
constexpr int kMaxSplits = 64;
constexpr int kMinChunkDecode = 256;
constexpr int kMinChunkPrefill = 1024;
// Deterministic mode: splits depend on the request's own length only, so a request's output does
// not change with the rest of the batch.
constexpr int kDeterministicChunk = 1024;
constexpr int kCtasPerSm = 4;
constexpr size_t kMaxRowTableBytes = size_t{512} << 20;

size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Up to 32 (token, head-in-group) rows per request: decode tiles (two CTAs read the K/V of a
// request and KV head, but three CTAs fit an SM; on the H200 a 64 x (4096 + 8) chain at group 4
// took 606 us on decode tiles (first version) and 784 us in half-filled 64-row CTAs). 33..64 rows:
// all of them in one verify CTA, so each K/V tile is read once (the 16-token tree at group 4: 788
// us, against 1152 us on four decode CTAs per request and KV head).
TileShape choose_shape(int max_qlen, int group) {
  const int64_t rows = static_cast<int64_t>(max_qlen) * group;
  return rows <= 32 ? TileShape::decode : rows <= 64 ? TileShape::verify : TileShape::prefill;
}

bool is_device(const TensorView& t) { return t.device.kind == DeviceKind::cuda; }

bool is_device_pointer(const void* p) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
}

}  // namespace

CudaBackend::CudaBackend(const BackendContext& ctx) : AttentionBackend(ctx) {
  const CudaDeviceInfo& info = query_cuda();
  ATTNRT_CHECK(info.usable, "cuda backend: no usable CUDA device ({})", info.reason);
  ATTNRT_CHECK(info.cc_major >= 9,
               "cuda backend: device '{}' has compute capability {}.{}; the kernels are built for "
               "sm_90a (Hopper); use the cpu or reference backend on this GPU",
               info.name, info.cc_major, info.cc_minor);
  ATTNRT_CHECK(ctx.model != nullptr && ctx.kv_cache != nullptr,
               "cuda backend: BackendContext needs the model and the KV cache");
  sm_count_ = info.sm_count;
  device_cache_ = dynamic_cast<CudaKVCache*>(ctx.kv_cache);
  if (device_cache_ != nullptr) {
    stream_ = device_cache_->stream();
  } else {
    ATTNRT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    owns_stream_ = true;
  }
  for (const LayerSpec& l : ctx.model->layers) {
    if (!l.uses_kv_cache() || l.num_kv_heads <= 0) continue;
    const int g = l.num_q_heads / l.num_kv_heads;
    if (std::find(groups_.begin(), groups_.end(), g) == groups_.end()) groups_.push_back(g);
    num_kv_heads_max_ = std::max(num_kv_heads_max_, l.num_kv_heads);
    const int dv = l.v_head_dim > 0 ? l.v_head_dim : l.head_dim;
    max_q_heads_x_dv_ = std::max<int64_t>(max_q_heads_x_dv_, int64_t{l.num_q_heads} * (dv + 1));
  }
  if (groups_.empty()) groups_.push_back(1);
  // Per class: the head dim and the resident CTAs per SM of each shape (for the split choice).
  const bool fp16 = ctx.model->dtype == DType::f16;
  class_dims_.assign(groups_.size(), 128);
  class_occupancy_.assign(groups_.size(), {1, 1, 1});
  for (size_t c = 0; c < groups_.size(); ++c) {
    for (const LayerSpec& l : ctx.model->layers) {
      if (!l.uses_kv_cache() || l.num_kv_heads <= 0 || l.num_q_heads / l.num_kv_heads != groups_[c])
        continue;
      class_dims_[c] = l.head_dim;
      const bool fp8 = is_fp8(ctx.kv_cache->layer(l.layer_id).dtype);
      for (TileShape sh : {TileShape::decode, TileShape::prefill, TileShape::verify})
        class_occupancy_[c][static_cast<int>(sh)] = attention_occupancy(l.head_dim, fp16, fp8, sh);
      break;
    }
  }
}

CudaBackend::~CudaBackend() {
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  if (owns_stream_ && stream_ != nullptr) cudaStreamDestroy(stream_);
}

void CudaBackend::set_stream(cudaStream_t stream) {
  stream_ = stream;
  if (device_cache_ != nullptr) device_cache_->set_stream(stream);
}

void CudaBackend::ensure(DeviceBuffer& buf, size_t bytes, const char* what) {
  if (bytes <= buf.bytes()) return;
  ATTNRT_CHECK(!stream_is_capturing(stream_),
               "cuda backend: the {} buffer must grow from {} to {} bytes during CUDA-graph "
               "capture; capture only steps within init_cuda_graph_state's max_bs / "
               "max_num_tokens",
               what, buf.bytes(), bytes);
  buf.reserve_async(bytes, stream_);
}

int CudaBackend::graph_splits(int group, TileShape shape, int bs, int tokens_per_req) const {
  const int64_t tiles = ceil_div(int64_t{tokens_per_req} * group, tile_rows(shape));
  const int64_t base = int64_t{bs} * tiles * num_kv_heads_max_;
  return static_cast<int>(
      std::clamp<int64_t>(ceil_div(int64_t{sm_count_} * kCtasPerSm, base), 1, kMaxSplits));
}

void CudaBackend::init_forward_metadata(const ForwardBatch& batch) {
  build_plan(batch, batch.batch_size, /*graph=*/false);
}

// Requests of the step (prefix, query rows, first output row) without make_step_layout's general
// validation for the modes the serving loop runs every step: the checks below are what the plan
// and the kernels rely on, at O(bs) with no allocation once the scratch has grown.
void CudaBackend::derive_requests(const ForwardBatch& batch) {
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
void CudaBackend::choose_splits(const ClassPlan& cp, int bs, int64_t cap, int32_t* splits) {
  const int bn = cp.head_dim > 128 ? 32 : 64;  // key tile of the decode and verify shapes
  const int64_t heads = num_kv_heads_max_;
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

void CudaBackend::build_plan(const ForwardBatch& batch, int padded_bs, bool graph) {
  plan_.valid = false;
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
  const ReqToTokenPool* pool = ctx_.req_to_token;
  ATTNRT_CHECK(bs == 0 || pool != nullptr,
               "cuda backend: BackendContext.req_to_token is null; the plan reads page tables "
               "from the request rows");
  const int page = ctx_.kv_cache->page_size();
  ATTNRT_CHECK(page >= 1 && std::has_single_bit(static_cast<unsigned>(page)),
               "cuda backend: page_size {} is not supported; use a power of two (1, 8, 16, 32, "
               "64, 128)",
               page);
  const bool capturing = stream_is_capturing(stream_);
  ATTNRT_CHECK(!(graph && capturing),
               "cuda backend: the graph plan runs while the stream captures; call "
               "init_forward_metadata_capture_cuda_graph before cudaStreamBeginCapture (its "
               "upload must not become part of the graph)");
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
  const size_t nc = groups_.size();
  plan.classes.resize(nc);
  tiles_.resize(bs);
  splits_.resize(nc * bs);
  class_tiles_.resize(nc * bs);
  const bool deterministic = ctx_.options != nullptr && ctx_.options->deterministic;
  bool any_prefill = false;
  for (size_t c = 0; c < nc; ++c) {
    ClassPlan& cp = plan.classes[c];
    cp = ClassPlan{};
    cp.group = groups_[c];
    cp.head_dim = class_dims_[c];
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
    base *= num_kv_heads_max_;
    keys *= num_kv_heads_max_;
    if (graph) {
      std::fill(splits, splits + bs, graph_splits(cp.group, cp.shape, bs, pad_qlen));
    } else if (deterministic) {
      if (cp.shape == TileShape::decode) {
        for (int i = 0; i < bs; ++i)
          splits[i] = static_cast<int32_t>(std::clamp<int64_t>(
              ceil_div(reqs_[i].prefix + reqs_[i].qlen, kDeterministicChunk), 1, kMaxSplits));
      }
    } else if (cp.shape != TileShape::prefill) {
      choose_splits(cp, bs, int64_t{sm_count_} * class_occupancy_[c][static_cast<int>(cp.shape)],
                    splits);
    } else {
      const int64_t target = int64_t{sm_count_} * kCtasPerSm;
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
  if (!capturing && !row_table_ready_ && pool != nullptr) init_row_table();
  const bool incremental = row_table_ready_ && !capturing && !any_prefill;
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
    if (graph) {
      ATTNRT_CHECK(bs <= graph_max_bs_ && static_cast<size_t>(cp.num_items) <= graph_work_cap_,
                   "cuda backend: graph step of {} requests / {} work items exceeds the graph "
                   "state (max_bs {}, {} items); call init_cuda_graph_state with larger sizes",
                   bs, cp.num_items, graph_max_bs_, graph_work_cap_);
      cp.reqs_off = c * graph_reqs_cap_ * sizeof(ReqInfo);
      cp.work_off = nc * graph_reqs_cap_ * sizeof(ReqInfo) + c * graph_work_cap_ * sizeof(WorkItem);
    } else {
      cp.reqs_off = off;
      off += bs * sizeof(ReqInfo);
      cp.work_off = off;
      off += cp.num_items * sizeof(WorkItem);
    }
  }
  if (graph) {
    ATTNRT_CHECK(static_cast<size_t>(tokens) <= graph_tree_cap_,
                 "cuda backend: graph step of {} tokens exceeds max_num_tokens {}", tokens,
                 graph_tree_cap_);
    off = nc * (graph_reqs_cap_ * sizeof(ReqInfo) + graph_work_cap_ * sizeof(WorkItem));
    plan.tree_mask_off = align_up(off, 8);
    plan.tree_depth_off = plan.tree_mask_off + graph_tree_cap_ * sizeof(uint64_t);
    plan.pt_off = align_up(plan.tree_depth_off + graph_tree_cap_ * sizeof(int32_t), 16);
  } else {
    plan.tree_mask_off = align_up(off, 8);
    plan.tree_depth_off = plan.tree_mask_off + (plan.tree ? tokens * sizeof(uint64_t) : 0);
    plan.pt_off = align_up(plan.tree_depth_off + (plan.tree ? tokens * sizeof(int32_t) : 0), 16);
  }
  plan.bytes = plan.pt_off + total_pages * sizeof(int32_t);
  if (graph) {
    ATTNRT_CHECK(plan.bytes <= graph_meta_.bytes(),
                 "cuda backend: graph step needs {} bytes of metadata; the graph state holds {}",
                 plan.bytes, graph_meta_.bytes());
  } else {
    ensure(meta_, plan.bytes, "metadata");
  }

  char* host = static_cast<char*>(staging_.acquire(plan.bytes, stream_, capturing));
  int32_t* pt = reinterpret_cast<int32_t*>(host + plan.pt_off);
  for (int i = 0; i < bs; ++i) {
    const Request& r = reqs_[i];
    const int32_t* row = pool->row_ptr(static_cast<int>(r.row));
    const int64_t pages = (int64_t{r.prefix} + r.qlen + offset_mask) >> plan.page_shift;
    int32_t* dst = pt + pt_start_[i] - pt_known_[i];
    for (int64_t j = pt_known_[i]; j < pages; ++j) {
      const int32_t slot = row[j << plan.page_shift];
      ATTNRT_CHECK(slot >= 0 && (slot & offset_mask) == 0,
                   "cuda backend: req_to_token[{}, {}] = {} does not start a page of {} slots; "
                   "with page_size > 1 a request's tokens must fill whole pages in order "
                   "(reference-semantics §4.2)",
                   r.row, j * page, slot, page);
      dst[j] = slot >> plan.page_shift;
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
  // lacks. A capture records kernels that run later (at replays, with their own plans), so a
  // capture plan commits nothing.
  const bool commit = incremental && !(graph && !graph_replay_);
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
    if (c == 0) plan.reqs.assign(ri, ri + bs);
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
  staging_.upload(graph ? graph_meta_.data() : meta_.data(), plan.bytes, stream_, capturing);
  // A replayed graph always runs its kernels after its plan.
  if (graph && graph_replay_) commits_launched_ = true;
  plan.incremental = incremental;
  plan.valid = true;
  graph_step_ = graph;
}

void CudaBackend::init_row_table() {
  const ReqToTokenPool* pool = ctx_.req_to_token;
  pages_per_row_ = ceil_div(pool->max_context_len(), ctx_.kv_cache->page_size());
  const size_t bytes = static_cast<size_t>(pool->size()) * pages_per_row_ * sizeof(int32_t);
  // A table as large as req_to_token itself divided by the page size; past this the plan keeps
  // uploading whole page tables rather than hold that much device memory.
  if (bytes > kMaxRowTableBytes || int64_t{pool->size()} * pages_per_row_ > INT32_MAX) return;
  ensure(row_table_, bytes, "row page table");
  // Page 0 is the reserved dummy page: entries a padded graph row may read before any step wrote
  // them stay in bounds.
  ATTNRT_CUDA_CHECK(cudaMemsetAsync(row_table_.data(), 0, bytes, stream_));
  row_gen_.assign(pool->size(), ~uint64_t{0});
  row_known_.assign(pool->size(), 0);
  row_table_ready_ = true;
}

void CudaBackend::forward_decode(const AttnArgs& args, const LayerSpec& layer,
                                 const ForwardBatch& batch) {
  ATTNRT_CHECK(is_decode(batch.mode), "cuda backend: forward_decode called for a {} batch",
               forward_mode_name(batch.mode));
  run(args, layer, batch);
}

void CudaBackend::forward_extend(const AttnArgs& args, const LayerSpec& layer,
                                 const ForwardBatch& batch) {
  ATTNRT_CHECK(!is_decode_or_idle(batch.mode),
               "cuda backend: forward_extend called for a {} batch",
               forward_mode_name(batch.mode));
  run(args, layer, batch);
}

namespace {

void check_act(const char* what, const TensorView& t, int64_t tokens, int heads, int dim) {
  ATTNRT_CHECK(t.data != nullptr && t.ndim == 3 && t.shape[0] == tokens && t.shape[1] == heads &&
                   t.shape[2] == dim,
               "cuda backend: {} is {}; expected [{}, {}, {}] (tokens, heads, head dim)", what,
               t.empty() ? std::string("empty") : t.describe(), tokens, heads, dim);
  ATTNRT_CHECK(t.dtype == DType::bf16 || t.dtype == DType::f16,
               "cuda backend: {} is {}; the kernels take bf16 or fp16 activations", what,
               t.describe());
  ATTNRT_CHECK(t.strides[2] == 1 && t.strides[1] % 8 == 0 && t.strides[0] % 8 == 0,
               "cuda backend: {} has strides [{}, {}, {}]; the last dim must be contiguous and "
               "the others multiples of 8 elements (16-byte rows)",
               what, t.strides[0], t.strides[1], t.strides[2]);
}

}  // namespace

void CudaBackend::run(const AttnArgs& args, const LayerSpec& layer, const ForwardBatch& batch) {
  ATTNRT_CHECK(plan_.valid && plan_.mode == batch.mode &&
                   (graph_step_ ? plan_.bs >= batch.batch_size : plan_.bs == batch.batch_size),
               "cuda backend: forward for a {} batch of {} requests without a matching "
               "init_forward_metadata for this step",
               forward_mode_name(batch.mode), batch.batch_size);
  ATTNRT_CHECK(layer.uses_kv_cache() && layer.kind != LayerKind::mla,
               "cuda backend: layer {} is {}; the cuda backend serves full and swa layers",
               layer.layer_id, layer_kind_name(layer.kind));
  const int hq = layer.num_q_heads, hkv = layer.num_kv_heads;
  ATTNRT_CHECK(hq > 0 && hkv > 0 && hq % hkv == 0,
               "cuda backend: layer {} has {} q heads and {} kv heads; q heads must be a positive "
               "multiple of kv heads",
               layer.layer_id, hq, hkv);
  const int d = layer.head_dim, dv = layer.v_head_dim > 0 ? layer.v_head_dim : layer.head_dim;
  ATTNRT_CHECK((d == 64 || d == 128 || d == 256) && dv == d,
               "cuda backend: layer {} has head_dim {} / v_head_dim {}; the kernels support "
               "head_dim 64, 128 or 256 with v_head_dim == head_dim (use the reference or cpu "
               "backend for other shapes)",
               layer.layer_id, d, dv);
  ATTNRT_CHECK(layer.causal() || layer.sliding_window < 0,
               "cuda backend: layer {} is non-causal with sliding_window {}; a window is defined "
               "for causal layers only (use -1)",
               layer.layer_id, layer.sliding_window);
  ATTNRT_CHECK(layer.has_sinks == (args.sinks != nullptr),
               "cuda backend: layer {} {} sinks but AttnArgs.sinks is {}", layer.layer_id,
               layer.has_sinks ? "has" : "has no", args.sinks ? "set" : "null");
  const int64_t tokens = batch.num_tokens();
  const int64_t dev_tokens = graph_step_ ? plan_.num_tokens : tokens;
  check_act("q", args.q, dev_tokens, hq, d);
  check_act("out", args.out, dev_tokens, hq, dv);
  ATTNRT_CHECK(args.out.dtype == args.q.dtype, "cuda backend: out is {} but q is {}; they must match",
               args.out.describe(), args.q.describe());
  ATTNRT_CHECK(args.k.empty() == args.v.empty(),
               "cuda backend: k is {} but v is {}; pass both (store this step's K/V) or neither "
               "(already stored by another layer)",
               args.k.empty() ? "empty" : args.k.describe(),
               args.v.empty() ? "empty" : args.v.describe());
  const bool on_device = is_device(args.q);
  ATTNRT_CHECK(is_device(args.out) == on_device && (args.lse.empty() || is_device(args.lse) == on_device),
               "cuda backend: q is {} but out is {}; q, out and lse must all be on the GPU or all "
               "on the host",
               args.q.describe(), args.out.describe());
  if (!args.lse.empty()) {
    ATTNRT_CHECK(args.lse.dtype == DType::f32 && args.lse.ndim == 2 &&
                     args.lse.shape[0] == dev_tokens && args.lse.shape[1] == hq &&
                     args.lse.strides[1] == 1,
                 "cuda backend: lse is {}; expected fp32[{}, {}] (tokens, q heads), contiguous "
                 "heads",
                 args.lse.describe(), dev_tokens, hq);
  }
  ATTNRT_CHECK(on_device || !stream_is_capturing(stream_),
               "cuda backend: host tensors ({}) cannot be used inside a CUDA-graph capture; pass "
               "GPU tensors",
               args.q.describe());

  KVCache& cache = *ctx_.kv_cache;
  const bool cache_on_device = cache.device().kind == DeviceKind::cuda;
  ATTNRT_CHECK(cache_on_device || !on_device,
               "cuda backend: q is on the GPU but the KV cache is on the host; build the cache "
               "with make_cuda_kv_storage when the activations live on the GPU");
  if (args.save_kv && !args.k.empty()) cache.store_step_kv(layer.layer_id, args.k, args.v);
  const KVLayerView kv = cache.layer(layer.layer_id);
  ATTNRT_CHECK(kv.kv_heads == hkv && kv.head_dim == d && kv.v_head_dim == dv,
               "cuda backend: layer {} KV cache holds [{} heads, {} / {} dims]; the layer needs "
               "[{} heads, {} / {} dims]",
               layer.layer_id, kv.kv_heads, kv.head_dim, kv.v_head_dim, hkv, d, dv);
  const bool fp8 = is_fp8(kv.dtype);
  ATTNRT_CHECK(fp8 || kv.dtype == args.q.dtype,
               "cuda backend: layer {} KV cache is {} but q is {}; the KV dtype must equal the "
               "activation dtype or be fp8_e4m3 / fp8_e5m2",
               layer.layer_id, dtype_name(kv.dtype), args.q.describe());

  const void* k_ptr = kv.k;
  const void* v_ptr = kv.v;
  const int64_t* slot_map = kv.slot_map;
  if (!cache_on_device) {
    // Correctness path: mirror the host layer (and its SWA slot map) to the GPU.
    if (mirrors_.size() <= static_cast<size_t>(layer.layer_id)) mirrors_.resize(layer.layer_id + 1);
    Mirror& m = mirrors_[layer.layer_id];
    const size_t kb = static_cast<size_t>(kv.num_rows) * kv.k_row_stride * dtype_size(kv.dtype);
    const size_t vb = static_cast<size_t>(kv.num_rows) * kv.v_row_stride * dtype_size(kv.dtype);
    ensure(m.k, kb, "mirrored K");
    ensure(m.v, vb, "mirrored V");
    ATTNRT_CUDA_CHECK(cudaMemcpyAsync(m.k.data(), kv.k, kb, cudaMemcpyHostToDevice, stream_));
    ATTNRT_CUDA_CHECK(cudaMemcpyAsync(m.v.data(), kv.v, vb, cudaMemcpyHostToDevice, stream_));
    k_ptr = m.k.data();
    v_ptr = m.v.data();
    if (kv.slot_map != nullptr) {
      const size_t mb = static_cast<size_t>(kv.slot_map_rows + 1) * sizeof(int64_t);
      ensure(m.map, mb, "mirrored slot map");
      ATTNRT_CUDA_CHECK(
          cudaMemcpyAsync(m.map.data(), kv.slot_map, mb, cudaMemcpyHostToDevice, stream_));
      slot_map = m.map.ptr<int64_t>();
    }
  }

  // Host activations: stage q (and sinks) in, out and lse back.
  const size_t act = dtype_size(args.q.dtype);
  const size_t q_bytes = static_cast<size_t>(tokens) * hq * d * act;
  const size_t o_bytes = static_cast<size_t>(tokens) * hq * dv * act;
  const size_t l_bytes = static_cast<size_t>(tokens) * hq * sizeof(float);
  const size_t s_bytes = static_cast<size_t>(hq) * sizeof(float);
  const void* q_ptr = args.q.data;
  void* o_ptr = args.out.data;
  float* lse_ptr = args.lse.empty() ? nullptr : args.lse.ptr<float>();
  const float* sinks = args.sinks;
  int64_t qs_tok = args.q.strides[0], qs_head = args.q.strides[1];
  int64_t os_tok = args.out.strides[0], os_head = args.out.strides[1];
  int64_t ls_tok = args.lse.empty() ? 0 : args.lse.strides[0];
  const bool stage_sinks = sinks != nullptr && !is_device_pointer(sinks);
  if (!on_device || stage_sinks) {
    const size_t o_off = align_up(q_bytes, 256), l_off = o_off + align_up(o_bytes, 256);
    const size_t s_off = l_off + align_up(l_bytes, 256);
    ensure(io_, s_off + s_bytes, "host staging");
    char* base = io_.ptr<char>();
    if (!on_device) {
      ATTNRT_CHECK(args.q.is_contiguous() && args.out.is_contiguous() &&
                       (args.lse.empty() || args.lse.is_contiguous()),
                   "cuda backend: host tensors must be contiguous (q {}, out {})",
                   args.q.describe(), args.out.describe());
      ATTNRT_CUDA_CHECK(cudaMemcpyAsync(base, args.q.data, q_bytes, cudaMemcpyHostToDevice, stream_));
      q_ptr = base;
      o_ptr = base + o_off;
      if (lse_ptr != nullptr) lse_ptr = reinterpret_cast<float*>(base + l_off);
      qs_tok = int64_t{hq} * d;
      qs_head = d;
      os_tok = int64_t{hq} * dv;
      os_head = dv;
      ls_tok = hq;
    }
    if (stage_sinks) {
      ATTNRT_CUDA_CHECK(cudaMemcpyAsync(base + s_off, sinks, s_bytes, cudaMemcpyHostToDevice, stream_));
      sinks = reinterpret_cast<const float*>(base + s_off);
    }
  }

  const int group = hq / hkv;
  const auto cls = std::find_if(plan_.classes.begin(), plan_.classes.end(),
                                [&](const ClassPlan& c) { return c.group == group; });
  ATTNRT_CHECK(cls != plan_.classes.end(),
               "cuda backend: layer {} has GQA group {} which no layer of the model had at "
               "construction",
               layer.layer_id, group);
  const char* meta = static_cast<const char*>(graph_step_ ? graph_meta_.data() : meta_.data());
  DeviceBuffer& parts = graph_step_ ? graph_partials_ : partials_;
  const size_t part_o = static_cast<size_t>(cls->part_rows) * hq * dv * sizeof(float);
  const size_t part_l = static_cast<size_t>(cls->part_rows) * hq * sizeof(float);
  if (graph_step_) {
    ATTNRT_CHECK(part_o + part_l <= parts.bytes(),
                 "cuda backend: graph step needs {} bytes of split-KV partials; the graph state "
                 "holds {}",
                 part_o + part_l, parts.bytes());
  } else {
    ensure(parts, part_o + part_l, "split-KV partials");
  }

  const float scale = layer.softmax_scale() * kv.k_scale;
  AttnParams p{};
  p.q = q_ptr;
  p.out = o_ptr;
  p.q_stride_tok = qs_tok;
  p.q_stride_head = qs_head;
  p.o_stride_tok = os_tok;
  p.o_stride_head = os_head;
  p.lse_out = lse_ptr;
  p.lse_stride_tok = ls_tok;
  p.k = k_ptr;
  p.v = v_ptr;
  p.k_row_stride = kv.k_row_stride;
  p.v_row_stride = kv.v_row_stride;
  p.kv_kind = kv.dtype == DType::e4m3 ? KvKind::e4m3
              : kv.dtype == DType::e5m2 ? KvKind::e5m2
                                        : KvKind::same_as_q;
  p.page_shift = plan_.page_shift;
  p.slot_map = slot_map;
  p.reqs = reinterpret_cast<const ReqInfo*>(meta + cls->reqs_off);
  p.page_table = reinterpret_cast<const int32_t*>(meta + plan_.pt_off);
  p.row_table = row_table_ready_ ? row_table_.ptr<int32_t>() : nullptr;
  p.work = reinterpret_cast<const WorkItem*>(meta + cls->work_off);
  p.tree_mask = reinterpret_cast<const uint64_t*>(meta + plan_.tree_mask_off);
  p.tree_depth = reinterpret_cast<const int32_t*>(meta + plan_.tree_depth_off);
  p.part_o = parts.ptr<float>();
  p.part_lse = reinterpret_cast<float*>(parts.ptr<char>() + part_o);
  p.num_q_heads = hq;
  p.num_kv_heads = hkv;
  p.group = group;
  p.scale_log2 = scale * 1.4426950408889634f;
  p.softmax_scale = scale;
  p.softcap = layer.logit_cap;
  p.v_scale = kv.v_scale;
  p.window = layer.causal() ? layer.sliding_window : -1;
  p.causal = layer.causal() ? 1 : 0;
  p.tree = plan_.tree ? 1 : 0;
  p.sinks = sinks;
  ATTNRT_CHECK(cls->num_items <= 65535,
               "cuda backend: {} work items exceed the grid limit of 65535 (step too large for "
               "one launch)",
               cls->num_items);
  const bool fp16 = args.q.dtype == DType::f16;
  // Long query runs (EXTEND, MIXED, DRAFT_EXTEND with prefill-shaped tiles, causal or not) on
  // 16-bit KV take the prefill kernel; decode, verify and fp8 KV take the general kernel.
  const bool prefill = cls->shape == TileShape::prefill && !fp8 && !is_target_verify(plan_.mode);
  ATTNRT_CUDA_CHECK(prefill ? launch_prefill(p, d, fp16, cls->num_items, stream_)
                            : launch_attention(p, d, fp16, fp8, cls->shape, cls->num_items, stream_));
  commits_launched_ = true;
  if (cls->max_splits > 1) {
    MergeParams mp{};
    mp.reqs = p.reqs;
    mp.num_reqs = plan_.bs;
    mp.part_o = p.part_o;
    mp.part_lse = p.part_lse;
    mp.out = o_ptr;
    mp.o_stride_tok = os_tok;
    mp.o_stride_head = os_head;
    mp.lse_out = lse_ptr;
    mp.lse_stride_tok = ls_tok;
    mp.num_q_heads = hq;
    mp.head_dim = dv;
    mp.v_scale = kv.v_scale;
    mp.sinks = sinks;
    ATTNRT_CUDA_CHECK(launch_merge(mp, fp16, stream_));
  }
  if (!on_device) {
    ATTNRT_CUDA_CHECK(cudaMemcpyAsync(args.out.data, o_ptr, o_bytes, cudaMemcpyDeviceToHost, stream_));
    if (lse_ptr != nullptr)
      ATTNRT_CUDA_CHECK(cudaMemcpyAsync(args.lse.data, lse_ptr, l_bytes, cudaMemcpyDeviceToHost, stream_));
  }
  if (!on_device || !cache_on_device) {
    // Host outputs must be complete, and the host cache must not change under a pending mirror copy.
    ATTNRT_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
}

void CudaBackend::init_cuda_graph_state(int max_bs, int max_num_tokens) {
  ATTNRT_CHECK(max_bs >= 1 && max_num_tokens >= max_bs,
               "cuda backend: init_cuda_graph_state({}, {}); need max_bs >= 1 and max_num_tokens "
               ">= max_bs",
               max_bs, max_num_tokens);
  ATTNRT_CHECK(device_cache_ != nullptr,
               "cuda backend: CUDA graphs need the KV cache on the GPU (make_cuda_kv_storage)");
  graph_max_bs_ = max_bs;
  graph_max_tokens_ = max_num_tokens;
  const int per_req = std::max(1, max_num_tokens / max_bs);
  const int pages = static_cast<int>(ceil_div(ctx_.req_to_token->max_context_len(),
                                              ctx_.kv_cache->page_size()));
  graph_reqs_cap_ = static_cast<size_t>(max_bs);
  graph_tree_cap_ = static_cast<size_t>(max_num_tokens);
  graph_work_cap_ = 0;
  int64_t part_rows = 0;
  // Decode steps (one token per request) are captured beside verify steps of per_req tokens;
  // fewer rows per request mean more splits, so both shapes size the buffers.
  for (int tokens : {1, per_req}) {
    for (int g : groups_) {
      const TileShape shape = choose_shape(tokens, g);
      const int64_t tiles = ceil_div(int64_t{tokens} * g, tile_rows(shape));
      for (int bs = 1; bs <= max_bs; ++bs) {
        const int s = graph_splits(g, shape, bs, tokens);
        graph_work_cap_ = std::max<size_t>(graph_work_cap_, static_cast<size_t>(bs * tiles * s));
        if (s > 1) part_rows = std::max<int64_t>(part_rows, int64_t{bs} * s * tokens);
      }
    }
  }
  const size_t meta = align_up(groups_.size() * (graph_reqs_cap_ * sizeof(ReqInfo) +
                                                 graph_work_cap_ * sizeof(WorkItem)),
                               8) +
                      graph_tree_cap_ * (sizeof(uint64_t) + sizeof(int32_t)) + 16 +
                      static_cast<size_t>(max_bs) * pages * sizeof(int32_t);
  graph_meta_.reserve(meta);
  if (!row_table_ready_) init_row_table();
  graph_partials_.reserve(static_cast<size_t>(part_rows) * max_q_heads_x_dv_ * sizeof(float) + 256);
  graph_ready_ = true;
}

void CudaBackend::init_forward_metadata_capture_cuda_graph(int bs, int num_tokens,
                                                           const ForwardBatch& batch) {
  ATTNRT_CHECK(graph_ready_, "cuda backend: capture before init_cuda_graph_state");
  ATTNRT_CHECK(is_cuda_graph(batch.mode),
               "cuda backend: mode {} cannot be captured; DECODE, TARGET_VERIFY and IDLE can",
               forward_mode_name(batch.mode));
  ATTNRT_CHECK(num_tokens <= graph_max_tokens_ && bs <= graph_max_bs_,
               "cuda backend: capture of {} requests / {} tokens exceeds the graph state ({} / {})",
               bs, num_tokens, graph_max_bs_, graph_max_tokens_);
  graph_replay_ = false;
  build_plan(batch, bs, /*graph=*/true);
}

void CudaBackend::init_forward_metadata_replay_cuda_graph(int bs, int raw_bs,
                                                          const ForwardBatch& batch) {
  ATTNRT_CHECK(graph_ready_, "cuda backend: replay before init_cuda_graph_state");
  ATTNRT_CHECK(batch.batch_size == raw_bs || batch.batch_size == bs,
               "cuda backend: replay with raw_bs {} padded to {} got a batch of {} requests", raw_bs,
               bs, batch.batch_size);
  graph_replay_ = true;
  build_plan(batch, bs, /*graph=*/true);
}

BackendEntry cuda_backend_entry() {
  BackendEntry e;
  e.name = "cuda";
  e.summary = "paged tensor-core attention for Hopper GPUs (split-KV decode, flash-style prefill)";
  e.caps.devices = {DeviceKind::cuda};
  e.caps.page_sizes = {1, 8, 16, 32, 64, 128};
  e.caps.kv_dtypes = {DType::bf16, DType::f16, DType::e4m3, DType::e5m2};
  e.caps.head_dims = {64, 128, 256};
  e.caps.spec_topk1 = true;
  e.caps.spec_topk_gt1 = true;
  e.caps.sliding_window = true;
  e.caps.softcap = true;
  e.caps.sinks = true;
  e.caps.non_causal = true;
  e.caps.mla = false;
  e.caps.cuda_graphs = true;
  e.auto_selectable = true;
  e.unavailable_reason = []() -> std::string {
    const CudaDeviceInfo& info = query_cuda();
    if (!info.usable) return info.reason;
    if (info.cc_major < 9)
      return "the kernels are built for sm_90a; device '" + info.name + "' is sm_" +
             std::to_string(info.cc_major) + std::to_string(info.cc_minor);
    return {};
  };
  e.factory = [](const BackendContext& ctx) -> std::unique_ptr<AttentionBackend> {
    return std::make_unique<CudaBackend>(ctx);
  };
  return e;
}

}  // namespace attnrt::cuda

namespace attnrt {
void register_cuda_backend(Registry& registry) {
  registry.add(cuda::cuda_backend_entry());
  cuda::register_cuda_bench_probes();
}
}  // namespace attnrt
