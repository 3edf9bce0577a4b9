#include "backends/cuda/cuda_backend.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <memory>

#include "attnrt/backend/dsa.h"
#include "attnrt/backend/options.h"
#include "attnrt/core/device.h"
#include "attnrt/core/env.h"
#include "attnrt/core/error.h"
#include "attnrt/memory/kv_cache.h"
#include "attnrt/memory/req_to_token_pool.h"
#include "backends/cuda/cuda_device.h"
#include "backends/cuda/cuda_kv_cache.h"
#include "backends/cuda/cuda_linear_backend.h"
#include "backends/cuda/kernels/attention_generic.h"
#include "backends/cuda/kernels/dispatch.h"
#include "backends/cuda/kernels/launch.h"
#include "backends/cuda/kernels/mla.h"
#include "backends/cuda/kernels/prefill.h"

namespace attnrt::cuda {

namespace {

constexpr size_t kMaxRowTableBytes = size_t{512} << 20;

size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

bool is_device(const TensorView& t) { return t.device.kind == DeviceKind::cuda; }

KvKind kv_kind_of(DType t) {
  return t == DType::e4m3 ? KvKind::e4m3 : t == DType::e5m2 ? KvKind::e5m2 : KvKind::same_as_q;
}

bool is_device_pointer(const void* p) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
}

}  // namespace

CudaBackend::CudaBackend(const BackendContext& ctx) : OnePathAttnBackend(ctx) {
  const CudaDeviceInfo& info = query_cuda();
  ATTNRT_CHECK(info.usable, "cuda backend: no usable CUDA device ({})", info.reason);
  ATTNRT_CHECK(info.cc_major >= 9,
               "cuda backend: device '{}' has compute capability {}.{}; the kernels are built for "
               "sm_90a (Hopper); use the cpu or reference backend on this GPU",
               info.name, info.cc_major, info.cc_minor);
  ATTNRT_CHECK(ctx.model != nullptr && ctx.kv_cache != nullptr,
               "cuda backend: BackendContext needs the model and the KV cache");
  // The DSA score kernel's switch (read again, without checks, by kernels/dsa.cu): a misspelt
  // value must not quietly measure the default kernel.
  env_choice("ATTNRT_DSA_INDEXER", {"cuda_core", "mma"}, "cuda backend");
  device_cache_ = dynamic_cast<CudaKVCache*>(ctx.kv_cache);
  if (device_cache_ != nullptr) {
    stream_ = device_cache_->stream();
  } else {
    ATTNRT_CUDA_CHECK(cudaStreamCreateWithFlags(&own_stream_, cudaStreamNonBlocking));
    stream_ = own_stream_;
  }
  ensure(sched_, 2 * sizeof(int32_t), "work scheduler");
  // Stream order: zeroed on the stream every kernel that takes tickets from it runs on.
  ATTNRT_CUDA_CHECK(cudaMemsetAsync(sched_.data(), 0, sched_.bytes(), stream_));
  PlannerConfig cfg;
  cfg.sm_count = info.sm_count;
  cfg.deterministic = ctx.options != nullptr && ctx.options->deterministic;
  fp8_prefill_ = ctx.options != nullptr && ctx.options->fp8_prefill_attention;
  if (const auto v = env_integer("ATTNRT_KV_CHUNK", 0, 1L << 30, "cuda backend",
                                 "a number of keys per split (0 = the plan's own choice)"))
    cfg.kv_chunk = static_cast<int>(*v);
  if (const auto v = env_integer("ATTNRT_PLAN_STEADY", 0, 1, "cuda backend",
                                 "0 (every decode step takes the general pass over its requests) "
                                 "or 1 (the default: the steady-decode pass where it applies)"))
    cfg.steady_decode = *v != 0;
  if (const auto v = env_integer("ATTNRT_PLAN_COPY_MIN_BYTES", 0, 1L << 24, "cuda backend",
                                 "a number of bytes from 0 to 16777216 (0 = copy the plan's own "
                                 "size)"))
    copy_min_bytes_ = static_cast<size_t>(*v);
  if (const auto v = env_integer("ATTNRT_DSA_SCORE_BUDGET", 1, 1L << 40, "cuda backend",
                                 "a number of fp32 index scores held at once (DSA layers)"))
    dsa_score_budget_ = *v;
  // The prefill switches are read now, so that a bad value fails the construction, not a step.
  prefill_ws_mode();
  prefill_tma_enabled();
  prefill_ws_persistent();
  prefill_kv8_enabled();
  mla_pairs_enabled();
  mla_pairs_mc_enabled();
  mla_pairs_fp8_max_page();
  mla_pairs_ids_max_page();
  for (const LayerSpec& l : ctx.model->layers) {
    if (!l.uses_kv_cache() || l.num_kv_heads <= 0) continue;
    const int g = l.num_q_heads / l.num_kv_heads;
    if (std::find(cfg.groups.begin(), cfg.groups.end(), g) == cfg.groups.end())
      cfg.groups.push_back(g);
    cfg.num_kv_heads_max = std::max(cfg.num_kv_heads_max, l.num_kv_heads);
    const int dv = l.v_head_dim > 0 ? l.v_head_dim : l.head_dim;
    max_q_heads_x_dv_ = std::max<int64_t>(max_q_heads_x_dv_, int64_t{l.num_q_heads} * (dv + 1));
    dsa_served_ = dsa_served_ || l.has_indexer();
    if (l.has_mha_form() && !mha_served_) mha_heads_ = l.num_q_heads;
    mha_served_ = mha_served_ || l.has_mha_form();
  }
  if (cfg.groups.empty()) cfg.groups.push_back(1);
  // Per class: the head dim, the resident CTAs per SM of each shape (for the split choice) and
  // the keys of a prefill work list's sections of requests (PlannerConfig::section_keys): 24 MiB
  // of K / V a section, or half the L2 where that is less, so that the units running at once
  // read K / V the L2 holds (H100: prefill-8x2048 1.04x, extend-8x2048+512 1.055x against one
  // section, docs/BENCHMARKS.md).
  const bool fp16 = ctx.model->dtype == DType::f16;
  const int64_t section_mb =
      env_integer("ATTNRT_PREFILL_SECTION_MB", 0, 1 << 20, "cuda backend",
                  "MiB of K / V per section of requests in a prefill work list (0 = one section)")
          .value_or(std::min<int64_t>(24, static_cast<int64_t>(info.l2_bytes >> 21)));
  cfg.head_dims.assign(cfg.groups.size(), 128);
  cfg.occupancy.assign(cfg.groups.size(), {1, 1, 1, 1});
  if (section_mb > 0) cfg.section_keys.assign(cfg.groups.size(), 0);
  for (size_t c = 0; c < cfg.groups.size(); ++c) {
    for (const LayerSpec& l : ctx.model->layers) {
      if (!l.uses_kv_cache() || l.num_kv_heads <= 0 ||
          l.num_q_heads / l.num_kv_heads != cfg.groups[c])
        continue;
      cfg.head_dims[c] = l.head_dim;
      const int dv = l.v_head_dim > 0 ? l.v_head_dim : l.head_dim;
      const DType kv_dtype = ctx.kv_cache->layer(l.layer_id).dtype;
      if (section_mb > 0) {
        const int64_t key_bytes = int64_t{l.num_kv_heads} * (l.head_dim + dv) *
                                  static_cast<int64_t>(dtype_size(kv_dtype));
        cfg.section_keys[c] = std::max<int64_t>(1, (section_mb << 20) / key_bytes);
      }
      // Resident CTAs per SM of the CTA that runs each shape (dispatch.h), for the split choice;
      // a decode item holds one token's `group` rows. The prefill shape's entry is read by graph
      // steps only (DECODE and TARGET_VERIFY): it is that of the TARGET_VERIFY CTA.
      AttnKernelKey key{.head_dim = l.head_dim,
                        .v_head_dim = dv,
                        .fp16 = fp16,
                        .kv = kv_kind_of(kv_dtype),
                        .rows = cfg.groups[c]};
      for (TileShape sh :
           {TileShape::decode, TileShape::prefill, TileShape::verify, TileShape::decode32}) {
        key.shape = sh;
        key.target_verify = sh == TileShape::prefill;
        cfg.occupancy[c][static_cast<int>(sh)] = attention_occupancy(key);
      }
      break;
    }
  }
  // The DSA layers' shape for graph plans (the eager plan takes each call's own).
  const LayerSpec* dsa_first = nullptr;
  for (const LayerSpec& l : ctx.model->layers) {
    if (!l.has_indexer()) continue;
    if (dsa_first == nullptr) {
      dsa_first = &l;
      const int dv = l.v_head_dim > 0 ? l.v_head_dim : l.head_dim;
      const AttnKernelKey key{
          .head_dim = l.head_dim,
          .v_head_dim = dv,
          .fp16 = fp16,
          .kv = kv_kind_of(ctx.kv_cache->layer(l.layer_id).dtype),
          .shape = choose_shape(1, l.num_q_heads, l.head_dim),
          .rows = std::min(l.num_q_heads, tile_rows(choose_shape(1, l.num_q_heads, l.head_dim))),
          .target_verify = false};
      dsa_graph_shape_ = DsaShape{.topk = l.indexer.index_topk,
                                  .q_heads = l.num_q_heads,
                                  .head_dim = l.head_dim,
                                  .sm_count = cfg.sm_count,
                                  .occupancy = attention_occupancy(key),
                                  .deterministic = cfg.deterministic,
                                  .score_budget = dsa_score_budget_};
    }
    const LayerSpec& f = *dsa_first;
    dsa_graph_uniform_ =
        dsa_graph_uniform_ && l.indexer.index_topk == f.indexer.index_topk &&
        l.num_q_heads == f.num_q_heads && l.head_dim == f.head_dim &&
        l.v_head_dim == f.v_head_dim &&
        ctx.kv_cache->layer(l.layer_id).dtype == ctx.kv_cache->layer(f.layer_id).dtype;
  }
  planner_ = std::make_unique<HostPlanner>(std::move(cfg));
}

CudaBackend::~CudaBackend() {
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  if (own_stream_ != nullptr) {
    cudaStreamSynchronize(own_stream_);
    cudaStreamDestroy(own_stream_);
  }
}

void CudaBackend::set_stream(void* stream_ptr) {
  const auto stream = static_cast<cudaStream_t>(stream_ptr);
  // What this backend queued on the old stream (the scheduler counter's and the row table's
  // zeroing, the last plan's upload) comes before anything the new one runs.
  // A stream that captures (an engine's torch.cuda.graph) records instead of running: the engine
  // synchronised before its capture began, and an event of another stream cannot join it.
  if (!stream_is_capturing(stream)) order_after(stream, stream_);
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

void CudaBackend::init_forward_metadata(const ForwardBatch& batch) {
  build_plan(batch, batch.batch_size, /*graph=*/false);
}

void CudaBackend::build_plan(const ForwardBatch& batch, int padded_bs, bool graph) {
  using Clock = std::chrono::steady_clock;
  Clock::time_point t[6];
  if (plan_timing_) t[0] = Clock::now();
  const bool capturing = stream_is_capturing(stream_);
  ATTNRT_CHECK(!(graph && capturing),
               "cuda backend: the graph plan runs while the stream captures; call "
               "init_forward_metadata_capture_cuda_graph before cudaStreamBeginCapture (its "
               "upload must not become part of the graph)");
  if (plan_timing_) t[1] = Clock::now();
  // The slot comes first: prepare() writes the requests into it as it derives them.
  // Stream order of the plan: the host writes the pinned slot only after the copy that last read
  // it has run (StagingRing::acquire); the copy below into meta_ / graph_meta_ is enqueued on
  // stream_ before every kernel of the step (and before a replayed graph), which read it in stream
  // order; the next step's copy into the same device buffer comes after them.
  void* slot =
      staging_.acquire(HostPlanner::prepare_bytes(batch, padded_bs), stream_, capturing);
  if (plan_timing_) t[2] = Clock::now();
  if (!capturing && !row_table_ready_ && ctx_.req_to_token != nullptr) init_row_table();
  const StepPlan& plan =
      planner_->prepare(batch, ctx_.req_to_token, ctx_.kv_cache->page_size(), padded_bs,
                        graph ? &graph_layout_ : nullptr, graph_replay_, capturing, slot);
  // The upload may carry the slot's stale tail past the plan (ATTNRT_PLAN_COPY_MIN_BYTES), up to
  // what the destination holds; nothing reads those bytes.
  size_t copy_bytes = plan.bytes;
  if (copy_min_bytes_ > copy_bytes) {
    copy_bytes = graph ? std::max(copy_bytes, std::min(copy_min_bytes_, graph_meta_.bytes()))
                       : copy_min_bytes_;
  }
  if (!graph) ensure(meta_, copy_bytes, "metadata");
  if (plan_timing_) t[3] = Clock::now();
  planner_->write(staging_.reserve(copy_bytes, capturing));
  if (plan_timing_) t[4] = Clock::now();
  staging_.upload(graph ? graph_meta_.data() : meta_.data(), copy_bytes, stream_, capturing);
  graph_step_ = graph;
  dsa_planned_ = false;
  if (graph && dsa_graph_ready_) plan_dsa_graph(batch, padded_bs);
  if (mha_served_) plan_mla_mha(batch);
  if (plan_timing_) {
    t[5] = Clock::now();
    auto s = [&](int i) { return std::chrono::duration<double>(t[i + 1] - t[i]).count(); };
    plan_parts_.capture = s(0);
    plan_parts_.staging = s(1);
    plan_parts_.prepare = s(2);
    plan_parts_.write = s(3);
    plan_parts_.copy = s(4);
  }
}

void CudaBackend::init_row_table() {
  const ReqToTokenPool* pool = ctx_.req_to_token;
  const int64_t pages_per_row = ceil_div(pool->max_context_len(), ctx_.kv_cache->page_size());
  const size_t bytes = static_cast<size_t>(pool->size()) * pages_per_row * sizeof(int32_t);
  // A table as large as req_to_token itself divided by the page size; past this the plan keeps
  // uploading whole page tables rather than hold that much device memory.
  if (bytes > kMaxRowTableBytes || int64_t{pool->size()} * pages_per_row > INT32_MAX) return;
  ensure(row_table_, bytes, "row page table");
  // Page 0 is the reserved dummy page: entries a padded graph row may read before any step wrote
  // them stay in bounds. Stream order: zeroed on stream_, before the first kernel that reads or
  // writes back a page (every attention kernel runs there).
  ATTNRT_CUDA_CHECK(cudaMemsetAsync(row_table_.data(), 0, bytes, stream_));
  planner_->enable_row_table(pool->size(), pages_per_row);
  row_table_ready_ = true;
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

// One forward call: check it against the plan and the layer, store this step's K/V, find the
// layer's K/V on the GPU, bring host activations over, launch the class's CTA (and the split
// merge), and hand host outputs back.
void CudaBackend::attend(const AttnArgs& args, const LayerSpec& layer,
                         const ForwardBatch& batch) {
  const StepPlan& plan = planner_->plan();
  const CallDims dims = check_call(args, layer, batch, plan);
  if (layer.has_indexer()) {
    attend_dsa(args, layer, batch, plan, dims);
    return;
  }
  if (!args.indexer.empty()) check_indexer_args("cuda", args, layer, dims.tokens, DeviceKind::cuda);
  LayerKv kv = store_and_view_kv(args, layer, dims);
  if (!kv.cache_on_device) mirror_host_layer(layer.layer_id, kv);
  const DeviceIo io = stage_activations(args, dims);
  const ClassPlan& cls = class_plan(plan, layer, dims);
  ensure_partials(cls, dims, kv);
  const AttnParams p = attn_params(layer, plan, cls, dims, kv, io);
  launch_step(p, args, plan, cls, dims, kv, io);
  finish_call(args, dims, io, kv);
}

CudaBackend::CallDims CudaBackend::check_call(const AttnArgs& args, const LayerSpec& layer,
                                              const ForwardBatch& batch,
                                              const StepPlan& plan) const {
  ATTNRT_CHECK(plan.valid && plan.mode == batch.mode &&
                   (graph_step_ ? plan.bs >= batch.batch_size : plan.bs == batch.batch_size),
               "cuda backend: forward for a {} batch of {} requests without a matching "
               "init_forward_metadata for this step",
               forward_mode_name(batch.mode), batch.batch_size);
  ATTNRT_CHECK(layer.uses_kv_cache(),
               "cuda backend: layer {} is {}; the cuda backend serves full, swa and mla layers",
               layer.layer_id, layer_kind_name(layer.kind));
  ATTNRT_CHECK(!batch.dcp_partial || (layer.causal() && !layer.has_indexer()),
               "cuda backend: layer {} is {}; a DCP rank's batch (dcp_partial) serves causal "
               "full, swa and mla layers without a DSA indexer (docs/dcp.md)",
               layer.layer_id, layer.has_indexer() ? "a DSA layer" : "not causal");
  CallDims c;
  c.mla = layer.kind == LayerKind::mla;
  c.hq = layer.num_q_heads;
  c.hkv = layer.num_kv_heads;
  const int hq = c.hq, hkv = c.hkv;
  ATTNRT_CHECK(hq > 0 && hkv > 0 && hq % hkv == 0,
               "cuda backend: layer {} has {} q heads and {} kv heads; q heads must be a positive "
               "multiple of kv heads",
               layer.layer_id, hq, hkv);
  c.d = layer.head_dim;
  c.dv = layer.v_head_dim > 0 ? layer.v_head_dim : layer.head_dim;
  const int d = c.d, dv = c.dv;
  const bool generic = !has_tensor_core_kernel(d, dv);
  ATTNRT_CHECK(!generic || (d > 0 && dv > 0 && d % 8 == 0 && dv % 8 == 0 && d <= kGenericMaxDim &&
                            dv <= kGenericMaxDim),
               "cuda backend: layer {} has head_dim {} / v_head_dim {}; the kernels take "
               "multiples of 8 up to {} (tensor cores for 64, 128, 256 with v_head_dim == "
               "head_dim; a generic kernel otherwise); use the cpu or reference backend for "
               "other shapes",
               layer.layer_id, d, dv, kGenericMaxDim);
  ATTNRT_CHECK(!c.mla || (hkv == 1 && dv <= d),
               "cuda backend: mla layer {} has {} kv heads, head_dim {}, v_head_dim {}; MLA "
               "attends over one latent kv head whose first v_head_dim columns are V",
               layer.layer_id, hkv, d, dv);
  ATTNRT_CHECK(layer.causal() || layer.sliding_window < 0,
               "cuda backend: layer {} is non-causal with sliding_window {}; a window is defined "
               "for causal layers only (use -1)",
               layer.layer_id, layer.sliding_window);
  ATTNRT_CHECK(layer.has_sinks == (args.sinks != nullptr),
               "cuda backend: layer {} {} sinks but AttnArgs.sinks is {}", layer.layer_id,
               layer.has_sinks ? "has" : "has no", args.sinks ? "set" : "null");
  c.tokens = batch.num_tokens();
  c.dev_tokens = graph_step_ ? plan.num_tokens : c.tokens;
  check_act("q", args.q, c.dev_tokens, hq, d);
  check_act("out", args.out, c.dev_tokens, hq, dv);
  ATTNRT_CHECK(args.out.dtype == args.q.dtype,
               "cuda backend: out is {} but q is {}; they must match", args.out.describe(),
               args.q.describe());
  // MLA stores the latent k rows only (V is a view of them), so v may be left empty there.
  ATTNRT_CHECK(c.mla ? !(args.k.empty() && !args.v.empty()) : args.k.empty() == args.v.empty(),
               "cuda backend: k is {} but v is {}; pass both (store this step's K/V) or neither "
               "(already stored by another layer){}",
               args.k.empty() ? "empty" : args.k.describe(),
               args.v.empty() ? "empty" : args.v.describe(),
               c.mla ? "; an mla layer takes k alone too" : "");
  c.on_device = is_device(args.q);
  ATTNRT_CHECK(is_device(args.out) == c.on_device &&
                   (args.lse.empty() || is_device(args.lse) == c.on_device),
               "cuda backend: q is {} but out is {}; q, out and lse must all be on the GPU or all "
               "on the host",
               args.q.describe(), args.out.describe());
  if (!args.lse.empty()) {
    ATTNRT_CHECK(args.lse.dtype == DType::f32 && args.lse.ndim == 2 &&
                     args.lse.shape[0] == c.dev_tokens && args.lse.shape[1] == hq &&
                     args.lse.strides[1] == 1,
                 "cuda backend: lse is {}; expected fp32[{}, {}] (tokens, q heads), contiguous "
                 "heads",
                 args.lse.describe(), c.dev_tokens, hq);
  }
  ATTNRT_CHECK(c.on_device || !stream_is_capturing(stream_),
               "cuda backend: host tensors ({}) cannot be used inside a CUDA-graph capture; pass "
               "GPU tensors",
               args.q.describe());
  return c;
}

CudaBackend::LayerKv CudaBackend::store_and_view_kv(const AttnArgs& args, const LayerSpec& layer,
                                                    const CallDims& c) {
  KVCache& cache = *ctx_.kv_cache;
  LayerKv kv;
  kv.cache_on_device = cache.device().kind == DeviceKind::cuda;
  ATTNRT_CHECK(kv.cache_on_device || !c.on_device,
               "cuda backend: q is on the GPU but the KV cache is on the host; build the cache "
               "with make_cuda_kv_storage when the activations live on the GPU");
  const bool store = args.save_kv && !args.k.empty();
  if (store) cache.store_step_kv(layer.layer_id, args.k, args.v);
  // Whether the last work on the stream is now this step's KV-store kernels (the GPU cache on this
  // stream stored rows), which the attention kernel may overlap unless a copy comes between.
  kv.stored = store && device_cache_ != nullptr && device_cache_->stream() == stream_ &&
              device_cache_->step_tokens() > 0;
  kv.view = cache.layer(layer.layer_id);
  const KVLayerView& v = kv.view;
  ATTNRT_CHECK(v.kv_heads == c.hkv && v.head_dim == c.d && v.v_head_dim == c.dv,
               "cuda backend: layer {} KV cache holds [{} heads, {} / {} dims]; the layer needs "
               "[{} heads, {} / {} dims]",
               layer.layer_id, v.kv_heads, v.head_dim, v.v_head_dim, c.hkv, c.d, c.dv);
  ATTNRT_CHECK(!c.mla || (v.v == v.k && v.v_row_stride == v.k_row_stride),
               "cuda backend: mla layer {} KV cache has separate V storage; an mla layer needs the "
               "latent pool, whose V is a view of the K row",
               layer.layer_id);
  ATTNRT_CHECK(is_fp8(v.dtype) || v.dtype == args.q.dtype,
               "cuda backend: layer {} KV cache is {} but q is {}; the KV dtype must equal the "
               "activation dtype or be fp8_e4m3 / fp8_e5m2",
               layer.layer_id, dtype_name(v.dtype), args.q.describe());
  kv.k = v.k;
  kv.v = v.v;
  kv.slot_map = v.slot_map;
  return kv;
}

// Correctness path: mirror the host layer (and its SWA slot map) to the GPU.
void CudaBackend::mirror_host_layer(int layer_id, LayerKv& kv) {
  const KVLayerView& v = kv.view;
  if (mirrors_.size() <= static_cast<size_t>(layer_id)) mirrors_.resize(layer_id + 1);
  Mirror& m = mirrors_[layer_id];
  const size_t kb = static_cast<size_t>(v.num_rows) * v.k_row_stride * dtype_size(v.dtype);
  const size_t vb = static_cast<size_t>(v.num_rows) * v.v_row_stride * dtype_size(v.dtype);
  ensure(m.k, kb, "mirrored K");
  ATTNRT_CUDA_CHECK(cudaMemcpyAsync(m.k.data(), v.k, kb, cudaMemcpyHostToDevice, stream_));
  kv.k = m.k.data();
  kv.v = m.k.data();  // MLA: V is a view of the K rows
  if (v.v != v.k) {
    ensure(m.v, vb, "mirrored V");
    ATTNRT_CUDA_CHECK(cudaMemcpyAsync(m.v.data(), v.v, vb, cudaMemcpyHostToDevice, stream_));
    kv.v = m.v.data();
  }
  if (v.slot_map != nullptr) {
    const size_t mb = static_cast<size_t>(v.slot_map_rows + 1) * sizeof(int64_t);
    ensure(m.map, mb, "mirrored slot map");
    ATTNRT_CUDA_CHECK(
        cudaMemcpyAsync(m.map.data(), v.slot_map, mb, cudaMemcpyHostToDevice, stream_));
    kv.slot_map = m.map.ptr<int64_t>();
  }
}

// Host activations: q (and host sinks) staged in; out and lse written to staging, copied back by
// finish_call.
CudaBackend::DeviceIo CudaBackend::stage_activations(const AttnArgs& args, const CallDims& c) {
  const int hq = c.hq, d = c.d, dv = c.dv;
  const size_t act = dtype_size(args.q.dtype);
  const size_t q_bytes = static_cast<size_t>(c.tokens) * hq * d * act;
  DeviceIo io;
  io.o_bytes = static_cast<size_t>(c.tokens) * hq * dv * act;
  io.l_bytes = static_cast<size_t>(c.tokens) * hq * sizeof(float);
  const size_t s_bytes = static_cast<size_t>(hq) * sizeof(float);
  io.q = args.q.data;
  io.out = args.out.data;
  io.lse = args.lse.empty() ? nullptr : args.lse.ptr<float>();
  io.sinks = args.sinks;
  io.q_tok = args.q.strides[0];
  io.q_head = args.q.strides[1];
  io.o_tok = args.out.strides[0];
  io.o_head = args.out.strides[1];
  io.lse_tok = args.lse.empty() ? 0 : args.lse.strides[0];
  io.staged_sinks = io.sinks != nullptr && !is_device_pointer(io.sinks);
  if (c.on_device && !io.staged_sinks) return io;
  const size_t o_off = align_up(q_bytes, 256), l_off = o_off + align_up(io.o_bytes, 256);
  const size_t s_off = l_off + align_up(io.l_bytes, 256);
  ensure(io_, s_off + s_bytes, "host staging");
  char* base = io_.ptr<char>();
  // Stream order: host q and sinks are copied on stream_ before the kernel; the host path
  // waits for the stream at the end of attend(), so the caller's buffers are free on return (a
  // sink array staged for device activations is a weight, read by a copy that runs before this
  // layer's kernel; io_ is rewritten only by a later layer's copies, after this kernel).
  if (!c.on_device) {
    ATTNRT_CHECK(args.q.is_contiguous() && args.out.is_contiguous() &&
                     (args.lse.empty() || args.lse.is_contiguous()),
                 "cuda backend: host tensors must be contiguous (q {}, out {})", args.q.describe(),
                 args.out.describe());
    ATTNRT_CUDA_CHECK(cudaMemcpyAsync(base, args.q.data, q_bytes, cudaMemcpyHostToDevice, stream_));
    io.q = base;
    io.out = base + o_off;
    if (io.lse != nullptr) io.lse = reinterpret_cast<float*>(base + l_off);
    io.q_tok = int64_t{hq} * d;
    io.q_head = d;
    io.o_tok = int64_t{hq} * dv;
    io.o_head = dv;
    io.lse_tok = hq;
  }
  if (io.staged_sinks) {
    ATTNRT_CUDA_CHECK(
        cudaMemcpyAsync(base + s_off, io.sinks, s_bytes, cudaMemcpyHostToDevice, stream_));
    io.sinks = reinterpret_cast<const float*>(base + s_off);
  }
  return io;
}

const ClassPlan& CudaBackend::class_plan(const StepPlan& plan, const LayerSpec& layer,
                                         const CallDims& c) const {
  const int group = c.hq / c.hkv;
  const auto cls = std::find_if(plan.classes.begin(), plan.classes.end(),
                                [&](const ClassPlan& k) { return k.group == group; });
  ATTNRT_CHECK(cls != plan.classes.end(),
               "cuda backend: layer {} has GQA group {} which no layer of the model had at "
               "construction",
               layer.layer_id, group);
  return *cls;
}

// The split-KV partials of the class: a graph step's fixed buffer must hold them; an eager step
// grows its own (a stream-ordered reallocation then stands between the stores and the attention
// kernel, which may no longer overlap them).
void CudaBackend::ensure_partials(const ClassPlan& cls, const CallDims& c, LayerKv& kv) {
  DeviceBuffer& parts = graph_step_ ? graph_partials_ : partials_;
  const size_t bytes = static_cast<size_t>(cls.part_rows) * c.hq * (c.dv + 1) * sizeof(float);
  if (graph_step_) {
    ATTNRT_CHECK(bytes <= parts.bytes(),
                 "cuda backend: graph step needs {} bytes of split-KV partials; the graph state "
                 "holds {}",
                 bytes, parts.bytes());
  } else {
    const size_t held = parts.bytes();
    ensure(parts, bytes, "split-KV partials");
    kv.stored = kv.stored && parts.bytes() == held;
  }
}

// The kernel parameters of the call.
AttnParams CudaBackend::attn_params(const LayerSpec& layer, const StepPlan& plan,
                                    const ClassPlan& cls, const CallDims& c, const LayerKv& kv,
                                    const DeviceIo& io) const {
  const int hq = c.hq;
  const char* meta = static_cast<const char*>(graph_step_ ? graph_meta_.data() : meta_.data());
  const DeviceBuffer& parts = graph_step_ ? graph_partials_ : partials_;
  const size_t part_o = static_cast<size_t>(cls.part_rows) * hq * c.dv * sizeof(float);
  const KVLayerView& v = kv.view;
  const float scale = layer.softmax_scale() * v.k_scale;
  AttnParams p{};
  p.q = io.q;
  p.out = io.out;
  p.q_stride_tok = io.q_tok;
  p.q_stride_head = io.q_head;
  p.o_stride_tok = io.o_tok;
  p.o_stride_head = io.o_head;
  p.lse_out = io.lse;
  p.lse_stride_tok = io.lse_tok;
  p.k = kv.k;
  p.v = kv.v;
  p.k_row_stride = v.k_row_stride;
  p.v_row_stride = v.v_row_stride;
  p.kv_kind = kv_kind_of(v.dtype);
  p.page_shift = plan.page_shift;
  p.slot_map = kv.slot_map;
  p.kv_rows = v.num_rows;
  // q on the GPU has dev_tokens rows (a graph step's: the graph's, whatever this replay's batch);
  // a host q is staged as the batch's tokens.
  p.q_rows = c.on_device ? c.dev_tokens : c.tokens;
  p.reqs = reinterpret_cast<const ReqInfo*>(meta + cls.reqs_off);
  p.page_table = reinterpret_cast<const int32_t*>(meta + plan.pt_off);
  p.row_table = row_table_ready_ ? row_table_.ptr<int32_t>() : nullptr;
  p.work = reinterpret_cast<const WorkItem*>(meta + cls.work_off);
  p.tree_mask = reinterpret_cast<const uint64_t*>(meta + plan.tree_mask_off);
  p.tree_depth = reinterpret_cast<const int32_t*>(meta + plan.tree_depth_off);
  p.part_o = parts.ptr<float>();
  p.part_lse = reinterpret_cast<float*>(parts.ptr<char>() + part_o);
  p.num_q_heads = hq;
  p.num_kv_heads = c.hkv;
  p.group = hq / c.hkv;
  p.scale_log2 = scale * 1.4426950408889634f;
  p.softmax_scale = scale;
  p.softcap = layer.logit_cap;
  p.v_scale = v.v_scale;
  p.window = layer.causal() ? layer.sliding_window : -1;
  p.causal = layer.causal() ? 1 : 0;
  p.tree = plan.tree ? 1 : 0;
  p.item_rows = cls.item_rows;
  p.sinks = io.sinks;
  p.sched = sched_.ptr<int32_t>();
  return p;
}

// The class's CTA (dispatch.h), then the merge of its split-KV partials.
void CudaBackend::launch_step(const AttnParams& p, const AttnArgs& args, const StepPlan& plan,
                              const ClassPlan& cls, const CallDims& c, const LayerKv& kv,
                              const DeviceIo& io) {
  ATTNRT_CHECK(cls.num_items <= 65535,
               "cuda backend: {} work items exceed the grid limit of 65535 (step too large for "
               "one launch)",
               cls.num_items);
  const bool fp16 = args.q.dtype == DType::f16;
  // The CTAs that may be dependents (dispatch.h) overlap the stores: q, the work list and the
  // requests were complete before the K store was launched.
  const bool after_stores = kv.stored && c.on_device && !io.staged_sinks;
  const AttnKernelKey key{.head_dim = c.d,
                          .v_head_dim = c.dv,
                          .fp16 = fp16,
                          .kv = p.kv_kind,
                          .shape = cls.shape,
                          .rows = cls.item_rows,
                          .target_verify = is_target_verify(plan.mode),
                          .fp8_prefill = fp8_prefill_};
  ATTNRT_CUDA_CHECK(launch_attention(p, key, cls.num_items, stream_, after_stores));
  planner_->launched();
  if (cls.max_splits > 1) {
    merge_partials(p, c, io, plan.bs, cls.max_splits, fp16, /*dependent=*/cls.num_items > 0);
  }
}

void CudaBackend::merge_partials(const AttnParams& p, const CallDims& c, const DeviceIo& io,
                                 int num_reqs, int max_splits, bool fp16, bool dependent) {
  const MergeParams mp{.reqs = p.reqs,
                       .num_reqs = num_reqs,
                       .part_o = p.part_o,
                       .part_lse = p.part_lse,
                       .out = io.out,
                       .o_stride_tok = io.o_tok,
                       .o_stride_head = io.o_head,
                       .lse_out = io.lse,
                       .lse_stride_tok = io.lse_tok,
                       .num_q_heads = c.hq,
                       .head_dim = c.dv,
                       .v_scale = p.v_scale,
                       .sinks = io.sinks,
                       .max_splits = max_splits};
  ATTNRT_CUDA_CHECK(launch_merge(mp, fp16, stream_, dependent));
}

// Host outputs back to the caller's tensors.
void CudaBackend::finish_call(const AttnArgs& args, const CallDims& c, const DeviceIo& io,
                              const LayerKv& kv) {
  if (!c.on_device) {
    ATTNRT_CUDA_CHECK(
        cudaMemcpyAsync(args.out.data, io.out, io.o_bytes, cudaMemcpyDeviceToHost, stream_));
    if (io.lse != nullptr)
      ATTNRT_CUDA_CHECK(
          cudaMemcpyAsync(args.lse.data, io.lse, io.l_bytes, cudaMemcpyDeviceToHost, stream_));
  }
  if (!c.on_device || !kv.cache_on_device) {
    // Host outputs must be complete, and the host cache must not change under a pending mirror
    // copy.
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
  graph_max_tokens_ = max_num_tokens;
  const PlannerConfig& cfg = planner_->config();
  const int per_req = std::max(1, max_num_tokens / max_bs);
  const int pages =
      static_cast<int>(ceil_div(ctx_.req_to_token->max_context_len(), ctx_.kv_cache->page_size()));
  GraphLayout& gl = graph_layout_;
  gl.max_bs = max_bs;
  gl.reqs_cap = static_cast<size_t>(max_bs);
  gl.tree_cap = static_cast<size_t>(max_num_tokens);
  gl.work_cap = 0;
  // Deterministic mode: every request's own split count, at most that of the longest context.
  gl.det_splits =
      cfg.deterministic ? deterministic_splits(ctx_.req_to_token->max_context_len()) : 0;
  int64_t part_rows = 0;
  // Decode steps (one token per request) are captured beside verify steps of per_req tokens;
  // fewer rows per request mean more splits, so both shapes size the buffers.
  for (int tokens : {1, per_req}) {
    for (size_t c = 0; c < cfg.groups.size(); ++c) {
      const TileShape shape = choose_shape(tokens, cfg.groups[c], cfg.head_dims[c]);
      const int64_t tiles = ceil_div(int64_t{tokens} * cfg.groups[c], tile_rows(shape));
      for (int bs = 1; bs <= max_bs; ++bs) {
        const int s = !cfg.deterministic ? graph_splits(cfg, c, shape, bs, tokens)
                      : deterministic_split_shape(shape) ? gl.det_splits
                                         : 1;
        gl.work_cap = std::max<size_t>(gl.work_cap, static_cast<size_t>(bs * tiles * s));
        if (s > 1) part_rows = std::max<int64_t>(part_rows, int64_t{bs} * s * tokens);
      }
    }
  }
  const size_t meta =
      align_up(cfg.groups.size() * (gl.reqs_cap * sizeof(ReqInfo) + gl.work_cap * sizeof(WorkItem)),
               8) +
      gl.tree_cap * (sizeof(uint64_t) + sizeof(int32_t)) + 16 +
      static_cast<size_t>(max_bs) * pages * sizeof(int32_t);
  graph_meta_.reserve(meta);
  gl.meta_bytes = graph_meta_.bytes();
  if (!row_table_ready_) init_row_table();
  if (dsa_served_ && dsa_graphs_enabled() && dsa_graph_uniform_)
    part_rows = std::max(part_rows, init_dsa_graph_state(max_bs, max_num_tokens, per_req));
  graph_partials_.reserve(static_cast<size_t>(part_rows) * max_q_heads_x_dv_ * sizeof(float) + 256);
  graph_ready_ = true;
}

void CudaBackend::init_forward_metadata_capture_cuda_graph(int bs, int num_tokens,
                                                           const ForwardBatch& batch) {
  ATTNRT_CHECK(graph_ready_, "cuda backend: capture before init_cuda_graph_state");
  ATTNRT_CHECK(!dsa_served_ || dsa_graph_ready_,
               "cuda backend: the model has DSA layers, which are captured only "
               "while DSA graphs are on (not ATTNRT_DSA_GRAPHS=0, set before "
               "init_cuda_graph_state) and when every DSA layer "
               "has the same index_topk, heads, head dims and KV dtype ({}); leave CUDA graphs "
               "off for it",
               dsa_graph_uniform_ ? "they have" : "they do not");
  ATTNRT_CHECK(is_cuda_graph(batch.mode),
               "cuda backend: mode {} cannot be captured; DECODE, TARGET_VERIFY and IDLE can",
               forward_mode_name(batch.mode));
  ATTNRT_CHECK(num_tokens <= graph_max_tokens_ && bs <= graph_layout_.max_bs,
               "cuda backend: capture of {} requests / {} tokens exceeds the graph state ({} / {})",
               bs, num_tokens, graph_layout_.max_bs, graph_max_tokens_);
  graph_replay_ = false;
  build_plan(batch, bs, /*graph=*/true);
}

void CudaBackend::init_forward_metadata_replay_cuda_graph(int bs, int raw_bs,
                                                          const ForwardBatch& batch) {
  ATTNRT_CHECK(graph_ready_, "cuda backend: replay before init_cuda_graph_state");
  ATTNRT_CHECK(batch.batch_size == raw_bs || batch.batch_size == bs,
               "cuda backend: replay with raw_bs {} padded to {} got a batch of {} requests",
               raw_bs, bs, batch.batch_size);
  graph_replay_ = true;
  build_plan(batch, bs, /*graph=*/true);
}

BackendEntry cuda_backend_entry() {
  BackendEntry e;
  e.name = "cuda";
  e.summary = "paged tensor-core attention for Hopper GPUs (split-KV decode, flash-style prefill)";
  e.caps.devices = {DeviceKind::cuda};
  e.device = cuda_device_services();
  e.caps.page_sizes = {1, 8, 16, 32, 64, 128};
  e.caps.kv_dtypes = {DType::bf16, DType::f16, DType::e4m3, DType::e5m2};
  // Any head dim: tensor cores for 64 / 128 / 256 (v_head_dim == head_dim), the generic kernel
  // for other multiples of 8 up to 576 (forward says so for anything else).
  e.caps.head_dims = {};
  claim_every_feature(e.caps);
  // DSA layers: the indexer and the sparse MLA on the GPU (cuda_dsa.cpp).
  e.caps.dsa = true;
  e.caps.cuda_graphs = true;
  // The plan and kernels capture --deterministic steps batch-invariantly (docs/cuda_graphs.md).
  e.caps.deterministic_graphs = true;
  // DSA layers in captured steps (cuda_dsa.cpp), while ATTNRT_DSA_GRAPHS=1.
  e.caps.dsa_graphs = true;
  // --fp8-prefill-attention: the fp8 prefill CTA (kernels/prefill_fp8.cuh).
  e.caps.fp8_prefill_attention = true;
  e.auto_selectable = true;
  e.unavailable_reason = []() -> std::string {
    const CudaDeviceInfo& info = query_cuda();
    if (!info.usable) return info.reason;
    if (info.cc_major < 9)
      return "the kernels are built for sm_90a; device '" + info.name + "' is sm_" +
             std::to_string(info.cc_major) + std::to_string(info.cc_minor);
    return {};
  };
  e.factory = backend_factory<CudaBackend>();
  e.linear_factory = backend_factory<CudaLinearBackend>();
  e.explain_kernels = &explain_cuda_kernels;
  return e;
}

}  // namespace attnrt::cuda

namespace attnrt {
void register_cuda_backend(Registry& registry) {
  registry.add(cuda::cuda_backend_entry());
}
}  // namespace attnrt
