#include "tools/sim/driver.h"

#include <omp.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <utility>

#include "attnrt/backend/hybrid_attn_backend.h"
#include "attnrt/backend/hybrid_linear_attn_backend.h"
#include "attnrt/backend/registry.h"
#include "attnrt/backend/selection.h"
#include "attnrt/core/error.h"
#include "attnrt/memory/kv_cache.h"
#include "attnrt/memory/linear_state_pool.h"
#include "attnrt/memory/req_to_token_pool.h"
#include "attnrt/runtime/attention_runtime.h"
#include "tools/sim/case_dumper.h"
#include "tools/sim/checker.h"
#include "tools/sim/dcp_shadow.h"
#include "tools/sim/step_inputs.h"

namespace attnrt::sim {

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The backend that runs the attention layers (not the linear ones) of a `mode` step: the name a
// replay case records, which `attnrt replay` can look up in the registry.
std::string attention_served_by(AttentionBackend& b, ForwardMode mode) {
  if (auto* linear = dynamic_cast<HybridLinearAttnBackend*>(&b)) {
    return attention_served_by(linear->full_backend(), mode);
  }
  if (auto* hybrid = dynamic_cast<HybridAttnBackend*>(&b)) {
    return std::string(hybrid->select(mode).name());
  }
  return std::string(b.name());
}

// The report's backend column: the attention backend, and the linear one of a hybrid model.
std::string served_by(AttentionBackend& b, ForwardMode mode) {
  if (auto* linear = dynamic_cast<HybridLinearAttnBackend*>(&b)) {
    return fmt::format("{}; linear {}", attention_served_by(linear->full_backend(), mode),
                       linear->linear_backend(mode).name());
  }
  return attention_served_by(b, mode);
}

struct Engine {
  ModelSpec model;
  std::unique_ptr<AttentionRuntime> runtime;
  // The checks of this model's outputs (against `reference` when checking is on).
  std::unique_ptr<ReferenceChecker> checker;
  // GPU state pool: its host copy, with the same slot bindings (every alloc_for / free_for is
  // repeated on it), which the reference's linear side reads.
  std::unique_ptr<LinearStatePool> linear_mirror;
  std::vector<int> kv_layers;
  // trace index -> (request row holding a linear-state slot, the row's generation then)
  std::map<int, std::pair<int, uint64_t>> linear_rows;
  // GPU pools: a host copy of the KV pools that the reference (and --dump-step) read. Before a
  // layer is checked, the rows the step reads are copied into it from the GPU, outside the timed
  // region.
  std::unique_ptr<KVCache> mirror;
  // CUDA-graph steps: each attention layer's host q / k / v / out of the step (all layers' inputs
  // are written before the one launch), and whether the sink logits are in the static tensors.
  std::map<int, LayerBuffers> graph_host;
  bool graph_sinks_written = false;
};

// The host copy of a GPU KV cache: every layer's rows in the full slot space (an SWA-hybrid GPU
// cache keeps its sliding-window layers in a smaller SWA pool; download_rows puts each full slot's
// SWA row at that slot, so the reference reads the same keys without the map; windows live in the
// LayerSpec the backends read, not in the pool layout).
std::unique_ptr<KVCache> make_host_mirror(const ModelSpec& model, const KVCache& gpu,
                                          int64_t full_slots, int max_num_tokens) {
  ModelSpec flat = model;
  for (LayerSpec& l : flat.layers) {
    if (l.kind == LayerKind::swa) l.kind = LayerKind::full;
    if (l.uses_kv_cache()) l.sliding_window = -1;
  }
  KVCacheConfig kc;
  kc.full_slots = full_slots;
  kc.page_size = gpu.page_size();
  kc.dtype = gpu.dtype();
  kc.max_num_tokens = max_num_tokens;
  std::unique_ptr<KVCache> mirror = make_host_kv_storage(flat, kc).cache;
  for (const LayerSpec& l : model.layers) {
    if (!l.uses_kv_cache()) continue;
    const KVLayerView g = gpu.layer(l.layer_id), h = mirror->layer(l.layer_id);
    const int64_t full_rows = g.slot_map != nullptr ? g.slot_map_rows : g.num_rows;
    ATTNRT_CHECK(full_rows == h.num_rows && g.k_row_stride == h.k_row_stride &&
                     g.v_row_stride == h.v_row_stride,
                 "attnrt run: the host copy of layer {} has {} rows of {} / {} elements, the GPU "
                 "pool {} full-pool slots of {} / {}",
                 l.layer_id, h.num_rows, h.k_row_stride, h.v_row_stride, full_rows, g.k_row_stride,
                 g.v_row_stride);
    if (g.k_scale != 1.f || g.v_scale != 1.f)
      mirror->set_kv_scales(l.layer_id, g.k_scale, g.v_scale);
  }
  return mirror;
}

// Every slot the step's requests read (their tokens up to the last of this step), ascending.
std::vector<int64_t> step_rows(const ForwardBatch& batch, const ReqToTokenPool& req_to_token) {
  const StepLayout layout = make_step_layout(batch);
  std::vector<int64_t> rows;
  for (int i = 0; i < batch.batch_size; ++i) {
    const int row = static_cast<int>(batch.req_pool_indices[i]);
    const int32_t* slots = req_to_token.row_ptr(row);
    rows.insert(rows.end(), slots, slots + layout.kv_len(i));
  }
  std::sort(rows.begin(), rows.end());
  rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
  return rows;
}

// Brings the host copy of one layer up to date with the GPU pool at `rows` (a DSA layer's index
// keys: the whole layer, which the reference's selection reads).
void refresh_mirror(Engine& e, const LayerSpec& layer, const std::vector<int64_t>& rows) {
  const KVLayerView h = e.mirror->layer(layer.layer_id);
  e.runtime->kv_cache().download_rows(layer.layer_id, rows, h.k, h.v);
  if (layer.has_indexer()) {
    e.runtime->kv_cache().download_index_keys(layer.layer_id,
                                              e.mirror->index_keys(layer.layer_id).data);
  }
}

Engine make_engine(const ModelSpec& model, const Options& options, const RunConfig& config,
                   int max_num_tokens, int max_context_len, bool cuda_graphs = true) {
  Engine e;
  e.model = model;
  RuntimeConfig rc;
  rc.max_requests = config.scheduler.max_running_requests;
  rc.kv_slots = config.max_total_tokens;
  rc.swa_full_tokens_ratio = config.swa_full_tokens_ratio;
  rc.max_num_tokens = max_num_tokens;
  rc.max_context_len = max_context_len;
  rc.cuda_graphs = cuda_graphs;
  e.runtime = std::make_unique<AttentionRuntime>(model, options, rc);
  for (const LayerSpec& l : model.layers) {
    if (l.uses_kv_cache()) e.kv_layers.push_back(l.layer_id);
  }
  const bool gpu_pools = e.runtime->kv_cache().device().kind != DeviceKind::cpu;
  if (gpu_pools && (config.check_every > 0 || config.dump_step >= 0)) {
    e.mirror = make_host_mirror(model, e.runtime->kv_cache(), rc.kv_slots, max_num_tokens);
  }
  if (config.check_every > 0 && e.runtime->has_linear_layers()) {
    LinearStatePool& states = e.runtime->linear_state();
    if (states.device().kind != DeviceKind::cpu) {
      e.linear_mirror = std::make_unique<LinearStatePool>(e.runtime->model(), states.config());
    }
  }
  return e;
}

// The checker of an engine's outputs: with checking on, `reference` with its own plan over the
// runtime's pools or their host copies (re-storing the step's k/v writes identical bytes).
void attach_checker(Engine& e, bool check, const Tolerance& tolerance, FailureLog& log) {
  std::unique_ptr<AttentionBackend> reference, reference_linear;
  LinearStatePool* states = e.runtime->has_linear_layers() ? &e.runtime->linear_state() : nullptr;
  LinearStatePool* reference_states = e.linear_mirror ? e.linear_mirror.get() : states;
  if (check) {
    BackendContext ctx;
    ctx.model = &e.runtime->model();
    ctx.options = &e.runtime->options();
    ctx.kv_cache = e.mirror ? e.mirror.get() : &e.runtime->kv_cache();
    ctx.req_to_token = &e.runtime->req_to_token();
    ctx.device = Device::cpu();
    reference = Registry::global().get("reference").factory(ctx);
    if (states != nullptr) {
      ctx.linear_state = reference_states;
      reference_linear = Registry::global().get("reference").linear_factory(ctx);
    }
  }
  e.checker = std::make_unique<ReferenceChecker>(std::move(reference), std::move(reference_linear),
                                                 states, reference_states, tolerance, log);
}

}  // namespace

size_t default_cpu_layers(const ModelSpec& model) {
  int64_t work = 0;
  size_t keep = 0;
  for (const LayerSpec& l : model.layers) {
    if (l.uses_kv_cache()) {
      const int v_dim = l.v_head_dim > 0 ? l.v_head_dim : l.head_dim;
      work += int64_t{l.num_q_heads} * (l.head_dim + v_dim);
    }
    if (work > kCpuLayerBudget && keep >= kMinDefaultLayers) return keep;
    ++keep;
  }
  return keep;
}

namespace {

// Layers the run keeps (RunConfig::layers), and why, for the report. on_host: every chosen backend
// runs on the CPU.
ModelSpec layers_to_run(const ModelSpec& model, int layers, bool on_host,
                        std::vector<std::string>& notes) {
  ATTNRT_CHECK(layers >= -1, "--layers = {}; use a layer count >= 1, 0 (all) or leave it unset",
               layers);
  ModelSpec m = model;
  size_t keep = model.layers.size();
  std::string why;
  if (layers > 0) {
    keep = std::min(keep, static_cast<size_t>(layers));
  } else if (layers < 0 && !model.has_linear_layers() && on_host) {
    keep = default_cpu_layers(model);
    why = fmt::format(
        " — on the CPU a model is cut after {}k multiply-adds per query token and key over its "
        "attention layers (the layers are alike; all of them would take {:.0f}x as long)",
        kCpuLayerBudget / 1000, static_cast<double>(model.layers.size()) / keep);
  } else if (layers < 0 && model.has_linear_layers()) {
    // Through the first attention layer that follows a linear layer.
    bool seen_linear = false;
    for (size_t i = 0; i < model.layers.size(); ++i) {
      seen_linear = seen_linear || is_linear_kind(model.layers[i].kind);
      if (seen_linear && !is_linear_kind(model.layers[i].kind)) {
        keep = i + 1;
        break;
      }
    }
  }
  m.layers.resize(keep);
  // MLA layers of a hybrid model run only where a registered backend serves MLA (reference and cpu
  // do; a build whose registry has none still runs the linear layers).
  bool mla_served = false;
  for (const BackendEntry& e : Registry::global().entries()) mla_served = mla_served || e.caps.mla;
  std::vector<int> dropped;
  if (model.has_linear_layers() && !mla_served) {
    for (const LayerSpec& l : m.layers) {
      if (l.kind == LayerKind::mla) dropped.push_back(l.layer_id);
    }
    std::erase_if(m.layers, [](const LayerSpec& l) { return l.kind == LayerKind::mla; });
  }
  if (keep < model.layers.size()) {
    std::map<std::string, int> kinds;
    for (const LayerSpec& l : model.layers) {
      if (l.layer_id <= model.layers[keep - 1].layer_id)
        ++kinds[std::string(layer_kind_name(l.kind))];
    }
    std::vector<std::string> parts;
    for (const auto& [k, n] : kinds) parts.push_back(fmt::format("{} {}", n, k));
    notes.push_back(fmt::format(
        "layers: ran layers {}..{} of {} ({}){}; --layers 0 runs them all",
        model.layers[0].layer_id, model.layers[keep - 1].layer_id, model.layers.size(),
        fmt::join(parts, ", "),
        !why.empty() ? why
        : layers < 0
            ? " — one period of the hybrid pattern, the default for linear-attention models"
            : ""));
  }
  if (!dropped.empty()) {
    notes.push_back(fmt::format(
        "layers: MLA layer{} {} left out: no registered backend serves MLA",
        dropped.size() > 1 ? "s" : "", fmt::join(dropped, ", ")));
  }
  ATTNRT_CHECK(!m.layers.empty(), "model '{}': no layer left to run (--layers {})", model.name,
               layers);
  return m;
}

// Runs the scheduled steps on their model's runtime: fresh random inputs for every layer, eagerly
// layer by layer or as one CUDA-graph launch; every attention output goes to the case dumper and
// every output to the engine's checker. Keeps the statistics of each (model, mode) and each
// request's linear-state slot.
class StepDriver {
 public:
  StepDriver(const ModelSpec& model, int check_every, CheckRows check_rows, int64_t rows,
             uint64_t seed, Engine& target, Engine* draft, CaseDumper& dumper,
             const Options& options);

  // Runs one step: begin_step, every layer, end_step (the timed part), and the checks.
  void run(const ScheduledStep& step);
  // After the scheduler completed a step of `e` (a linear-attention model): the state each request
  // keeps after a verify, and the slots of requests that no longer run freed.
  void release_states(Engine& e, const Scheduler& sched, bool verified);
  // Frees the state slots of requests that finished, were aborted or were retracted (their rows
  // may already have been handed to a request admitted by the step just planned, which takes its
  // slot when it runs).
  static void free_stale_states(Engine& e, const Scheduler& sched);

  std::vector<ModeStats> stats() const;
  // --dcp-size: the target's attention layers also run on this group and are compared.
  void set_dcp(DcpShadow* dcp) { dcp_ = dcp; }

 private:
  // What one running step needs from layer to layer.
  struct Step {
    const ScheduledStep& scheduled;
    Engine& e;
    ModeStats& ms;
    bool check;
    int64_t T;
    std::vector<int64_t> check_tokens;  // checked step: the query rows the reference recomputes
    StateRegion region;
    std::vector<int64_t> read_rows;  // GPU pools: the rows the host copy needs
    LayerSite site(const LayerSpec& layer) const {
      return {scheduled.index, scheduled.role, scheduled.batch.mode, &layer, ms.backend};
    }
  };

  StateRegion take_state_slots(Engine& e, const ScheduledStep& step);
  // Fresh random q / k / v for an attention layer into `lb`, out poisoned with NaN.
  AttnArgs attention_inputs(const Step& s, const LayerSpec& layer, const LayerBuffers& lb);
  // After an attention layer ran (its output in args.out on the host): --dump-step and the checks.
  void finish_attention(const Step& s, const LayerSpec& layer, const AttnArgs& args);
  void run_linear(Step& s, const LayerSpec& layer, double& elapsed);
  // An MLA layer of a step whose form is MHA (docs/mla.md): the causal part, then every prefix
  // chunk gathered from the pool and decompressed with the layer's fixed weights.
  void run_mla_mha(Step& s, const LayerSpec& layer, double& elapsed);
  double run_graph(Step& s);
  // The rows and heads a checked step's layer compares (every row and head: empty lists).
  RowSample check_sample(const Step& s, const LayerSpec& layer) const;
  double run_eager(Step& s);

  ModelSpec model_;
  const Options& options_;
  int check_every_;
  CheckRows check_rows_;
  uint64_t seed_;
  int64_t rows_;  // tokens of the largest step
  Engine& target_;
  Engine* draft_;
  CaseDumper& dumper_;
  HostBuffer dump_topk_;  // the dumped DSA layer's selection, [T, index_topk] int32
  FastRng rng_;
  LayerBuffers buf_;
  // Sink logits are weights of the model: fixed per (role, layer) for the whole run.
  std::map<std::pair<int, int>, std::vector<float>> sinks_;
  std::map<int, LinearWeights> linear_weights_;
  std::map<std::pair<int, int>, MlaWeights> mla_weights_;  // (role, layer) -> W_UK, W_UV
  std::map<std::pair<int, int>, ModeStats> stats_;  // (role, mode) -> stats
  DcpShadow* dcp_ = nullptr;
};

StepDriver::StepDriver(const ModelSpec& model, int check_every, CheckRows check_rows, int64_t rows,
                       uint64_t seed, Engine& target, Engine* draft, CaseDumper& dumper,
                       const Options& options)
    : model_(model),
      options_(options),
      check_every_(check_every),
      check_rows_(check_rows),
      seed_(seed),
      rows_(rows),
      target_(target),
      draft_(draft),
      dumper_(dumper),
      rng_(seed ^ 0x5eed5eedull) {
  // Buffers for the largest layer shape of either model and the largest step.
  auto max_dims = [](const ModelSpec& m, std::array<int, 4>& d) {
    for (const LayerSpec& l : m.layers) {
      if (is_linear_kind(l.kind)) {
        d[3] = std::max(d[3], static_cast<int>(linear_widths(l).out));
        continue;
      }
      d[0] = std::max(d[0], l.num_q_heads * l.head_dim);
      d[1] = std::max(d[1], l.num_kv_heads * l.head_dim);
      d[2] = std::max(d[2], l.num_kv_heads * l.v_head_dim);
      d[3] = std::max(d[3], l.num_q_heads * l.v_head_dim);
    }
  };
  std::array<int, 4> dims{1, 1, 1, 1};
  max_dims(model, dims);
  if (draft) max_dims(draft->model, dims);
  buf_.q = HostBuffer(model.dtype, {rows, dims[0]});
  buf_.k = HostBuffer(model.dtype, {rows, dims[1]});
  buf_.v = HostBuffer(model.dtype, {rows, dims[2]});
  buf_.out = HostBuffer(model.dtype, {rows, dims[3]});
  if (model.has_linear_layers()) {
    LinearWidths widest;
    for (const LayerSpec& l : model.layers) {
      if (!is_linear_kind(l.kind)) continue;
      const LinearWidths w = linear_widths(l);
      widest.mixed = std::max(widest.mixed, w.mixed);
      widest.a = std::max(widest.a, w.a);
      widest.b = std::max(widest.b, w.b);
    }
    buf_.mixed = HostBuffer(model.dtype, {rows, widest.mixed});
    buf_.gate_a = HostBuffer(model.dtype, {rows, widest.a});
    buf_.gate_b = HostBuffer(model.dtype, {rows, std::max<int64_t>(widest.b, 1)});
  }
  // DSA layers of either model: the indexer's inputs.
  int64_t index_q = 0, index_k = 0, index_w = 0;
  for (const ModelSpec* m : {&model, draft != nullptr ? &std::as_const(draft->model) : nullptr}) {
    if (m == nullptr) continue;
    for (const LayerSpec& l : m->layers) {
      if (!l.has_indexer()) continue;
      const IndexerSpec& ix = l.indexer;
      index_q = std::max<int64_t>(index_q, int64_t{ix.index_n_heads} * ix.index_head_dim);
      index_k = std::max<int64_t>(index_k, ix.index_head_dim);
      index_w = std::max<int64_t>(index_w, ix.index_n_heads);
    }
  }
  if (index_q > 0) {
    buf_.index_q = HostBuffer(model.dtype, {rows, index_q});
    buf_.index_k = HostBuffer(model.dtype, {rows, index_k});
    buf_.index_w = HostBuffer(model.dtype, {rows, index_w});
  }
  for (Engine* e : {&target, draft}) {
    if (e == nullptr) continue;
    const int role = e == &target ? 0 : 1;
    for (const LayerSpec& l : e->model.layers) {
      if (!l.has_sinks) continue;
      auto& s = sinks_[{role, l.layer_id}];
      for (int h = 0; h < l.num_q_heads; ++h) s.push_back(rng_.symmetric(2.f));
    }
  }
  for (const LayerSpec& l : model.layers) {
    if (is_linear_kind(l.kind)) linear_weights_.emplace(l.layer_id, make_linear_weights(l, rng_));
  }
}

std::vector<ModeStats> StepDriver::stats() const {
  std::vector<ModeStats> out;
  for (const auto& [key, ms] : stats_) out.push_back(ms);
  return out;
}

// A request's state slot lives as long as the request: taken at its first step.
StateRegion StepDriver::take_state_slots(Engine& e, const ScheduledStep& step) {
  const ForwardBatch& batch = step.batch;
  LinearStatePool& states = e.runtime->linear_state();
  StateRegion region;
  for (size_t i = 0; i < step.requests.size(); ++i) {
    const int row = static_cast<int>(batch.req_pool_indices[i]);
    if (states.slot_of(row) < 0) {
      const int slot = states.alloc_for(row);
      if (e.linear_mirror) {
        const int copy = e.linear_mirror->alloc_for(row);
        ATTNRT_CHECK(copy == slot,
                     "attnrt run: the host copy of the linear state pool gave request row {} "
                     "slot {}, the GPU pool slot {}",
                     row, copy, slot);
      }
      e.linear_rows[step.requests[i]] = {row, e.runtime->req_to_token().generation(row)};
    }
    region.slots.push_back(states.slot_of(row));
  }
  region.verify = is_target_verify(batch.mode);
  if (region.verify) {
    region.draft_tokens = batch.spec_info->draft_token_num;
    region.checkpoints = int64_t{batch.batch_size} * region.draft_tokens;
  }
  return region;
}

void StepDriver::run(const ScheduledStep& step) {
  Engine& e = step.role == ModelRole::target ? target_ : *draft_;
  const ForwardBatch& batch = step.batch;
  const int64_t T = batch.num_tokens();
  ModeStats& ms = stats_[{static_cast<int>(step.role), static_cast<int>(batch.mode)}];
  if (ms.steps == 0) {
    ms.role = step.role;
    ms.mode = batch.mode;
    ms.backend = served_by(e.runtime->backend(), batch.mode);
  }
  const bool check = e.checker->has_reference() && T > 0 && ms.steps % check_every_ == 0;
  Step s{step, e, ms, check, T, {}, {}, {}};
  if (check) {
    s.check_tokens = sample_tokens(batch, check_rows_.max_tokens,
                                   seed_ ^ (0x9e3779b97f4a7c15ull * (step.index + 1)));
  }
  if (e.runtime->has_linear_layers()) s.region = take_state_slots(e, step);
  // DECODE / TARGET_VERIFY steps on GPU pools run as CUDA graphs when the runtime has them:
  // every attention layer's inputs go into the static tensors first, then one launch.
  const bool graph = T > 0 && e.runtime->cuda_graph_bucket(batch) > 0;
  double elapsed = 0;
  if (!graph) {
    const Clock::time_point t0 = Clock::now();
    e.runtime->begin_step(batch);
    elapsed += seconds_since(t0);
    if (dcp_ != nullptr && &e == &target_) dcp_->begin_step(batch);
  }
  if (check) {
    if (e.mirror) e.mirror->begin_step(batch);
    e.checker->begin_step(batch);
  }
  if (e.mirror && (check || dumper_.wants_step(step.index, T)))
    s.read_rows = step_rows(batch, e.runtime->req_to_token());
  elapsed += graph ? run_graph(s) : run_eager(s);
  ms.steps += step.iterations;
  ms.tokens += T;
  ms.seconds += elapsed;
  if (check) ++ms.checked_steps;
}

AttnArgs StepDriver::attention_inputs(const Step& s, const LayerSpec& layer,
                                      const LayerBuffers& lb) {
  const int64_t T = s.T;
  const int Hq = layer.num_q_heads, Hkv = layer.num_kv_heads;
  AttnArgs args;
  args.q = cut(lb.q, T, Hq, layer.head_dim);
  args.k = cut(lb.k, T, Hkv, layer.head_dim);
  args.v = cut(lb.v, T, Hkv, layer.v_head_dim);
  args.out = cut(lb.out, T, Hq, layer.v_head_dim);
  fill_random(args.q, rng_, 2.f);
  fill_random(args.k, rng_, 1.f);
  if (layer.kind == LayerKind::mla) {
    // The latent row is both K and (its first v_head_dim columns) V.
    const size_t es = dtype_size(model_.dtype);
    for (int64_t t = 0; t < T; ++t) {
      std::memcpy(static_cast<char*>(args.v.data) + t * layer.v_head_dim * es,
                  static_cast<char*>(args.k.data) + t * layer.head_dim * es,
                  layer.v_head_dim * es);
    }
  } else {
    fill_random(args.v, rng_, 1.f);
  }
  if (layer.has_indexer()) {
    // DSA (docs/dsa.md): the indexer's q [T, Hi, Di], the step's index keys [T, Di] (stored in
    // the index-key cache with the latent rows) and the per-head weights [T, Hi].
    const IndexerSpec& ix = layer.indexer;
    ATTNRT_CHECK(lb.index_q.data() != nullptr, "attnrt run: no indexer buffers for DSA layer {}",
                 layer.layer_id);
    args.indexer.q = cut(lb.index_q, T, ix.index_n_heads, ix.index_head_dim);
    args.indexer.k = TensorView(lb.index_k.data(), lb.index_k.dtype(), {T, ix.index_head_dim});
    args.indexer.weights = TensorView(lb.index_w.data(), lb.index_w.dtype(), {T, ix.index_n_heads});
    fill_random(args.indexer.q, rng_, 1.f);
    fill_random(args.indexer.k, rng_, 1.f);
    fill_random(args.indexer.weights, rng_, 1.f);
    // The layer --dump-step writes records its selection too (docs/replay.md).
    if (dumper_.wants_layer(s.scheduled.index, T, s.e.model, layer.layer_id)) {
      dump_topk_ = HostBuffer(DType::i32, {T, ix.index_topk});
      args.indexer.topk = dump_topk_.view();
    }
  }
  poison(args.out);
  if (layer.has_sinks) {
    args.sinks = sinks_.at({static_cast<int>(s.scheduled.role), layer.layer_id}).data();
  }
  return args;
}

void StepDriver::finish_attention(const Step& s, const LayerSpec& layer, const AttnArgs& args) {
  Engine& e = s.e;
  const ScheduledStep& step = s.scheduled;
  const bool dump = dumper_.wants_layer(step.index, s.T, e.model, layer.layer_id);
  if (e.mirror && (dump || s.check)) refresh_mirror(e, layer, s.read_rows);
  if (dump) {
    dumper_.write(step.index, step.role, e.model, layer.layer_id, options_, step.batch,
                  e.runtime->req_to_token(), e.mirror ? *e.mirror : e.runtime->kv_cache(), args,
                  attention_served_by(e.runtime->backend(), step.batch.mode));
  }
  e.checker->check_attention(s.site(layer), step.batch, args, s.check, check_sample(s, layer),
                             s.ms);
}

RowSample StepDriver::check_sample(const Step& s, const LayerSpec& layer) const {
  RowSample sample;
  if (s.check) {
    sample.tokens = s.check_tokens;
    if (static_cast<int64_t>(sample.tokens.size()) == s.T) sample.tokens.clear();
    // Successive checks of a mode, and the layers of one check, start at other heads.
    sample.heads =
        sample_heads(layer.num_q_heads, check_rows_.max_heads, s.ms.checked_steps + layer.layer_id);
    if (static_cast<int>(sample.heads.size()) == layer.num_q_heads) sample.heads.clear();
  }
  return sample;
}

double StepDriver::run_graph(Step& s) {
  Engine& e = s.e;
  const ForwardBatch& batch = s.scheduled.batch;
  ++s.ms.graph_steps;
  std::vector<std::pair<const LayerSpec*, AttnArgs>> layer_args;
  for (const LayerSpec& layer : e.model.layers) {
    LayerBuffers& lb = e.graph_host[layer.layer_id];
    if (lb.q.data() == nullptr) {  // first graph step of this layer
      lb.q = HostBuffer(model_.dtype, {rows_, layer.num_q_heads * layer.head_dim});
      lb.k = HostBuffer(model_.dtype, {rows_, layer.num_kv_heads * layer.head_dim});
      lb.v = HostBuffer(model_.dtype, {rows_, layer.num_kv_heads * layer.v_head_dim});
      lb.out = HostBuffer(model_.dtype, {rows_, layer.num_q_heads * layer.v_head_dim});
      if (layer.has_indexer()) {
        const IndexerSpec& ix = layer.indexer;
        lb.index_q = HostBuffer(model_.dtype, {rows_, ix.index_n_heads * ix.index_head_dim});
        lb.index_k = HostBuffer(model_.dtype, {rows_, ix.index_head_dim});
        lb.index_w = HostBuffer(model_.dtype, {rows_, ix.index_n_heads});
      }
    }
    const AttnArgs args = attention_inputs(s, layer, lb);
    const GraphLayerIO io = e.runtime->graph_io(layer.layer_id, s.T);
    e.runtime->copy_tensor(io.q, args.q);
    e.runtime->copy_tensor(io.k, args.k);
    e.runtime->copy_tensor(io.v, args.v);
    e.runtime->copy_tensor(io.out, args.out);
    if (layer.has_indexer()) {
      e.runtime->copy_tensor(io.index_q, args.indexer.q);
      e.runtime->copy_tensor(io.index_k, args.indexer.k);
      e.runtime->copy_tensor(io.index_weights, args.indexer.weights);
    }
    if (layer.has_sinks && !e.graph_sinks_written) {
      e.runtime->copy_tensor(io.sinks, TensorView(const_cast<float*>(args.sinks), DType::f32,
                                                  {layer.num_q_heads}));
    }
    layer_args.emplace_back(&layer, args);
  }
  e.graph_sinks_written = true;
  const Clock::time_point t0 = Clock::now();
  e.runtime->forward_step_graph(batch);
  e.runtime->synchronize();
  const double elapsed = seconds_since(t0);
  for (const auto& [layer, args] : layer_args) {
    const GraphLayerIO io = e.runtime->graph_io(layer->layer_id, s.T);
    e.runtime->copy_tensor(args.out, io.out);
    if (!args.indexer.topk.empty()) e.runtime->copy_tensor(args.indexer.topk, io.index_topk);
    finish_attention(s, *layer, args);
  }
  return elapsed;
}

void StepDriver::run_linear(Step& s, const LayerSpec& layer, double& elapsed) {
  Engine& e = s.e;
  const LinearArgs args =
      linear_args(layer, linear_weights_.at(layer.layer_id), buf_, s.T, model_.dtype);
  fill_random(args.mixed_qkv, rng_, 1.f);
  fill_random(args.a, rng_, 2.5f);
  if (!args.b.empty()) fill_random(args.b, rng_, 2.5f);
  poison(args.out);
  StateCopy before;
  if (s.check) before = save_state(e.runtime->linear_state(), layer.layer_id, s.region);
  const Clock::time_point t0 = Clock::now();
  e.runtime->forward_linear(layer.layer_id, args);
  elapsed += seconds_since(t0);
  e.checker->check_linear(s.site(layer), s.scheduled.batch, args, s.check, s.region, before,
                          s.ms);
}

double StepDriver::run_eager(Step& s) {
  Engine& e = s.e;
  double elapsed = 0;
  for (const LayerSpec& layer : e.model.layers) {
    if (is_linear_kind(layer.kind)) {
      run_linear(s, layer, elapsed);
      continue;
    }
    // DSA layers have no MHA form (docs/dsa.md): they always run absorbed.
    if (layer.has_mha_form() && e.runtime->mla_form() == MlaForm::mha) {
      run_mla_mha(s, layer, elapsed);
      continue;
    }
    const AttnArgs args = attention_inputs(s, layer, buf_);
    const Clock::time_point t0 = Clock::now();
    e.runtime->forward(layer.layer_id, args);
    elapsed += seconds_since(t0);
    if (dcp_ != nullptr && &e == &target_ && dcp_->splits(layer.layer_id)) {
      dcp_->forward(s.site(layer), args);
    }
    finish_attention(s, layer, args);
  }
  const Clock::time_point t0 = Clock::now();
  e.runtime->end_step();
  elapsed += seconds_since(t0);
  if (dcp_ != nullptr && &e == &target_) dcp_->end_step();
  return elapsed;
}

void StepDriver::run_mla_mha(Step& s, const LayerSpec& layer, double& elapsed) {
  Engine& e = s.e;
  const int role = static_cast<int>(s.scheduled.role);
  auto w = mla_weights_.find({role, layer.layer_id});
  if (w == mla_weights_.end()) {
    const uint64_t seed = rng_.next() ^ static_cast<uint64_t>(layer.layer_id);
    // The run's host threads (--threads), as the backends and the checker take them.
    const int threads = host_num_threads(&options_, "attnrt run", omp_get_num_procs());
    w = mla_weights_.emplace(std::pair{role, layer.layer_id}, MlaWeights(layer, seed, threads))
            .first;
  }
  const DType dt = model_.dtype;
  const int64_t T = s.T;
  const int Hq = layer.num_q_heads;
  const MlaMhaDims d = mla_mha_dims(layer);
  HostBuffer q(dt, {T, Hq, d.qk}), latent(dt, {T, 1, layer.head_dim}), k(dt, {T, Hq, d.qk}),
      v(dt, {T, Hq, d.v}), out(dt, {T, Hq, d.v}), lse(DType::f32, {T, Hq});
  fill_random(q.view(), rng_, 2.f);
  fill_random(latent.view(), rng_, 1.f);
  w->second.decompress(latent.view(), k.view(), v.view());
  poison(out.view());
  Clock::time_point t0 = Clock::now();
  e.runtime->forward_mla_mha(layer.layer_id, {.q = q.view(), .k = k.view(), .v = v.view(),
                                              .out = out.view(), .lse = lse.view(),
                                              .latent = latent.view()});
  elapsed += seconds_since(t0);
  if (dcp_ != nullptr && &e == &target_ && dcp_->splits(layer.layer_id)) {
    dcp_->store_latent(s.site(layer), latent.view());
  }
  const PrefixChunkPlan& plan = e.runtime->prefix_chunk_plan();
  for (int c = 0; c < plan.num_chunks(); ++c) {
    const int64_t n = plan.chunks[c].num_tokens;
    HostBuffer lat(dt, {n, 1, layer.head_dim}), kc(dt, {n, Hq, d.qk}), vc(dt, {n, Hq, d.v});
    t0 = Clock::now();
    e.runtime->gather_prefix_chunk(layer.layer_id, c, lat.view());
    elapsed += seconds_since(t0);
    w->second.decompress(lat.view(), kc.view(), vc.view());  // the model's GEMM, not timed
    t0 = Clock::now();
    e.runtime->forward_mla_prefix_chunk(
        layer.layer_id, c,
        {.q = q.view(), .k = kc.view(), .v = vc.view(), .out = out.view(), .lse = lse.view()});
    elapsed += seconds_since(t0);
  }
  ++s.ms.mha_layers;
  s.ms.prefix_chunks += plan.num_chunks();
  // A GPU pool: the checker reads the host mirror, with the rows this step stored.
  if (e.mirror && s.check) refresh_mirror(e, layer, s.read_rows);
  e.checker->check_mla_mha(s.site(layer), s.scheduled.batch, q.view(), out.view(), w->second,
                           s.check, check_sample(s, layer), s.ms);
}

void StepDriver::release_states(Engine& e, const Scheduler& sched, bool verified) {
  // §8.10: each request keeps the state after the deepest token of its accepted path.
  if (verified) {
    std::vector<int32_t> last;
    for (const std::vector<int>& path : sched.last_accepted_paths()) {
      last.push_back(path.empty() ? -1 : path.back());
    }
    e.runtime->update_state_after_verify(last);
  }
  free_stale_states(e, sched);
}

void StepDriver::free_stale_states(Engine& e, const Scheduler& sched) {
  for (auto it = e.linear_rows.begin(); it != e.linear_rows.end();) {
    const RequestState& r = sched.requests()[static_cast<size_t>(it->first)];
    const auto [row, generation] = it->second;
    // A row that changed hands since (freed, perhaps given to this request again) holds the state
    // of a request that no longer runs.
    const bool runs =
        r.phase == RequestState::Phase::prefill || r.phase == RequestState::Phase::decode;
    if (!runs || r.target_row != row || e.runtime->req_to_token().generation(row) != generation) {
      e.runtime->linear_state().free_for(row);
      if (e.linear_mirror) e.linear_mirror->free_for(row);
      it = e.linear_rows.erase(it);
    } else {
      ++it;
    }
  }
}

// A shared prefix would need the linear state at the prefix's end, which the state pool does not
// snapshot (the optional prefix-cache tracking of reference-semantics §4.7.4); engines turn prefix
// reuse off for such models too.
void drop_shared_prefixes(Trace& trace, std::vector<std::string>& notes) {
  int stripped = 0;
  for (TraceRequest& r : trace.requests) {
    if (r.shared_prefix.empty()) continue;
    r.shared_prefix.clear();
    r.shared_prefix_len = 0;
    ++stripped;
  }
  if (stripped > 0) {
    notes.push_back(fmt::format(
        "shared prefixes: not reused ({} requests prefill them themselves): the linear-attention "
        "state at a prefix's end is not snapshotted",
        stripped));
  }
}

// The draft model of a run of `model` (the layers kept of `model_in`).
ModelSpec draft_model_for(const ModelSpec& model, const ModelSpec& model_in,
                          std::vector<std::string>& notes) {
  bool has_kv_layer = false;
  for (const LayerSpec& l : model.layers) has_kv_layer = has_kv_layer || l.uses_kv_cache();
  if (has_kv_layer || !model.has_linear_layers()) return make_draft_model(model);
  // Every attention layer was left out (MLA): the draft is one full-attention layer with the heads
  // of the model's first attention layer, 128 wide.
  const auto first = std::find_if(model_in.layers.begin(), model_in.layers.end(),
                                  [](const LayerSpec& l) { return l.uses_kv_cache(); });
  ATTNRT_CHECK(first != model_in.layers.end(),
               "model '{}' has no attention layer, so it has no draft model for speculative "
               "decoding",
               model.name);
  ModelSpec stand_in = model;
  LayerSpec l;
  l.kind = LayerKind::full;
  l.num_q_heads = l.num_kv_heads = first->num_q_heads;
  l.head_dim = l.v_head_dim = 128;
  stand_in.layers = {l};
  notes.push_back(fmt::format(
      "draft model: one full-attention layer of {} heads x 128 (the model's attention layers are "
      "MLA, left out here)",
      l.num_q_heads));
  return make_draft_model(stand_in);
}

// The report's note on the CUDA graphs of a runtime with GPU pools.
std::string graph_note(const AttentionRuntime& rt, const char* who) {
  if (!rt.cuda_graphs_enabled()) {
    return fmt::format("CUDA graphs ({}): off: {}", who, rt.cuda_graphs_off_reason());
  }
  return fmt::format(
      "CUDA graphs ({}): DECODE / TARGET_VERIFY steps of up to {} requests replay captured graphs "
      "(batch sizes {}); {} captured",
      who, rt.cuda_graph_batch_sizes().back(), fmt::join(rt.cuda_graph_batch_sizes(), ", "),
      rt.cuda_graphs_captured());
}

}  // namespace

Options complete_spec_options(Options o) {
  if (o.speculative_num_steps <= 0) {
    ATTNRT_CHECK(
        o.speculative_eagle_topk == 0 && o.speculative_num_draft_tokens == 0,
        "--speculative-eagle-topk / --speculative-num-draft-tokens are given without "
        "--speculative-num-steps; set --speculative-num-steps K to turn speculative decoding "
        "on");
    return o;
  }
  if (o.speculative_eagle_topk == 0) o.speculative_eagle_topk = 1;
  if (o.speculative_num_draft_tokens == 0) {
    ATTNRT_CHECK(o.speculative_eagle_topk == 1,
                 "--speculative-eagle-topk {} builds a draft tree: give its size with "
                 "--speculative-num-draft-tokens N (at most the full tree of depth "
                 "--speculative-num-steps)",
                 o.speculative_eagle_topk);
    o.speculative_num_draft_tokens = o.speculative_num_steps + 1;
  }
  return o;
}

ModelSpec make_draft_model(const ModelSpec& target) {
  for (const LayerSpec& l : target.layers) {
    if (!l.uses_kv_cache()) continue;
    ModelSpec draft;
    draft.name = target.name + "-draft";
    draft.dtype = target.dtype;
    draft.max_context_len = target.max_context_len;
    draft.tp_size = target.tp_size;
    draft.layers.push_back(l);
    draft.layers.back().layer_id = 0;
    return draft;
  }
  fail("model '{}' has no layer with a KV cache, so it has no draft model for speculative decoding",
       target.name);
}

RunReport run_trace(const ModelSpec& model_in, const Options& options_in, const Trace& trace_in,
                    const RunConfig& config, const ProgressFn& progress) {
  const Clock::time_point wall0 = Clock::now();
  ATTNRT_CHECK(config.check_every >= 0, "--check-every = {}; must be >= 0 (0 = no checking)",
               config.check_every);
  std::vector<std::string> notes;
  // --dcp-size N: the runtimes stay single ranks; a DcpShadow runs the N simulated ranks.
  const int dcp_size = options_in.dcp_size;
  Options options = complete_spec_options(options_in);
  options.dcp_size = 1;
  if (dcp_size != 1) {
    Options o = options;
    o.dcp_size = dcp_size;
    validate_dcp(ModelSpec{}, o);
  }
  const bool on_host =
      config.layers < 0 && kv_pool_device(resolve_backends(options, model_in)) == DeviceKind::cpu;
  const ModelSpec model = layers_to_run(model_in, config.layers, on_host, notes);
  const bool hybrid = model.has_linear_layers();
  Trace trace = trace_in;
  if (hybrid) drop_shared_prefixes(trace, notes);
  if (dcp_size > 1) {
    int stripped = 0;
    for (TraceRequest& r : trace.requests) {
      stripped += r.shared_prefix.empty() ? 0 : 1;
      r.shared_prefix.clear();
      r.shared_prefix_len = 0;
    }
    if (stripped > 0) {
      notes.push_back(
          fmt::format("shared prefixes: not reused ({} requests prefill them "
                      "themselves): the DCP ranks keep each request's tokens apart",
                      stripped));
    }
  }
  SchedulerConfig sc = config.scheduler;
  sc.page_size = options.page_size;
  sc.seed = config.seed;
  sc.spec.num_steps = options.speculative_num_steps;
  sc.spec.topk = std::max(options.speculative_eagle_topk, 1);
  sc.spec.num_draft_tokens = options.speculative_num_draft_tokens;
  const int N = sc.spec.enabled() ? sc.spec.num_draft_tokens : 1;
  const int max_tokens = std::max(sc.chunked_prefill_size, sc.max_running_requests * N);
  RunConfig rc = config;
  rc.scheduler = sc;
  // Request rows as long as the longest request gets (the scheduler rejects any request longer than
  // the model's context with a message naming it).
  int64_t longest = 1;
  for (const TraceRequest& r : trace.requests) {
    longest = std::max<int64_t>(longest, int64_t{r.prompt_len} + r.output_len + N);
  }
  const int context = static_cast<int>(std::min<int64_t>(longest, model.max_context_len));

  // --dcp-size: every target step runs eagerly, so that the ranks take each layer's inputs.
  Engine target = make_engine(model, options, rc, max_tokens, context, dcp_size == 1);
  std::optional<Engine> draft;
  if (sc.spec.enabled()) {
    draft = make_engine(draft_model_for(model, model_in, notes), options, rc, max_tokens, context);
  }

  auto space = [](Engine& e) {
    return KvSpace{&e.runtime->req_to_token(), &e.runtime->allocator(), &e.runtime->kv_cache(),
                   e.kv_layers};
  };
  Scheduler sched(trace, sc, space(target),
                  draft ? std::optional<KvSpace>(space(*draft)) : std::nullopt);

  RunReport rep;
  rep.model = model.name;
  rep.trace_origin = trace.origin;
  rep.requests = static_cast<int>(trace.requests.size());
  rep.prompt_tokens = trace.total_prompt_tokens();
  rep.output_tokens = trace.total_output_tokens();
  const Selection& sel = target.runtime->selection();
  rep.prefill_backend = sel.prefill;
  rep.decode_backend = sel.decode;
  rep.linear_prefill_backend = sel.linear_prefill;
  rep.linear_decode_backend = sel.linear_decode;
  rep.notes = notes;
  rep.kv_dtype = std::string(dtype_name(sel.kv_dtype));
  rep.page_size = options.page_size;
  rep.swa_ratio = is_swa_hybrid(model) ? config.swa_full_tokens_ratio : 0;
  rep.spec = sc.spec;
  rep.tolerance = output_tolerance(model.dtype);
  if (options.fp8_prefill_attention) {
    // Prefill tiles with q and the softmax weights rounded to e4m3, 2^-4 relative each
    // (docs/backends.md "fp8 prefill").
    rep.tolerance.atol = std::max(rep.tolerance.atol, 0.125);
    rep.tolerance.rtol = std::max(rep.tolerance.rtol, 0.125);
  }
  rep.check_rows = rc.check_rows;
  if (rc.check_every == 0) rep.check_note = "reference checks off (--check-every 0)";
  FailureLog failures;
  for (Engine* e : {&target, draft ? &*draft : nullptr}) {
    if (e != nullptr) attach_checker(*e, rc.check_every > 0, rep.tolerance, failures);
  }

  CaseDumper dumper(rc.dump_step, rc.dump_dir);
  StepDriver driver(model, rc.check_every, rc.check_rows, std::max(max_tokens, 1), config.seed,
                    target, draft ? &*draft : nullptr, dumper, options);
  std::unique_ptr<DcpShadow> dcp;
  if (dcp_size > 1) {
    Options o = options;
    o.dcp_size = dcp_size;
    RuntimeConfig dc;
    dc.max_requests = sc.max_running_requests;
    dc.kv_slots = config.max_total_tokens;
    dc.max_num_tokens = std::max(max_tokens, 1);
    dc.max_context_len = context;
    // cuda ranks replay their DECODE / TARGET_VERIFY steps from CUDA graphs (DcpShadow).
    dc.cuda_graphs = true;
    dcp = std::make_unique<DcpShadow>(model, o, dc, rep.tolerance, failures);
    driver.set_dcp(dcp.get());
  }
  int64_t tokens_done = 0;
  const bool linear_target = target.runtime->has_linear_layers();
  auto check_invariants = [&](int64_t after_step) {
    try {
      sched.check_invariants();
      if (linear_target) {
        target.runtime->linear_state().check_invariants(sched.live_target_rows());
        if (target.linear_mirror) target.linear_mirror->check_invariants(sched.live_target_rows());
      }
    } catch (const Error& err) {
      fail("attnrt run: a pool invariant is broken after step {}: {}", after_step, err.what());
    }
    ++rep.invariant_checks;
  };
  // Per step: its first index, its target tokens (0 for a draft step) and the seconds of its whole
  // loop iteration (planning, inputs, layers, checks, commit).
  struct StepTime {
    int64_t index, tokens;
    double seconds;
  };
  std::vector<StepTime> times;
  int64_t next_check = rc.check_invariants_every;
  while (!sched.done()) {
    const Clock::time_point step0 = Clock::now();
    const int64_t events_before = sched.aborts().total() + sched.retractions();
    const ScheduledStep& step = sched.next();
    Engine& e = step.role == ModelRole::target ? target : *draft;
    if (e.runtime->has_linear_layers()) StepDriver::free_stale_states(e, sched);
    driver.run(step);
    tokens_done += step.batch.num_tokens();
    const int64_t step_tokens = step.role == ModelRole::target ? step.batch.num_tokens() : 0;
    const int64_t step_index = step.index;
    // `step` is the scheduler's, and complete() moves on from it.
    const ForwardMode mode = step.batch.mode;
    const ModelRole role = step.role;
    const int done_steps = step.index + step.iterations;
    std::optional<ForwardBatch> verified;
    if (dcp && role == ModelRole::target && is_target_verify(mode)) verified = step.batch;
    sched.complete();
    if (verified) {
      // A request aborted in the verify step has no path; the ranks keep its root, and the row is
      // rewritten from column 0 by the next request that gets it.
      std::vector<std::vector<int>> paths = sched.last_accepted_paths();
      for (std::vector<int>& p : paths) {
        if (p.empty()) p = {0};
      }
      dcp->commit_verify(*verified, paths);
    }
    if (e.runtime->has_linear_layers()) driver.release_states(e, sched, is_target_verify(mode));
    times.push_back({step_index, step_tokens, seconds_since(step0)});
    if (rc.check_invariants_every > 0) {
      const bool events = sched.aborts().total() + sched.retractions() != events_before;
      if (events || done_steps >= next_check) {
        check_invariants(done_steps);
        while (next_check <= done_steps) next_check += rc.check_invariants_every;
      }
    }
    if (progress) {
      Progress p;
      p.steps_done = done_steps;
      p.steps_estimate = done_steps + sched.estimate_remaining_steps();
      p.tokens = tokens_done;
      p.wall_seconds = seconds_since(wall0);
      p.role = role;
      p.mode = mode;
      progress(p);
    }
  }

  rep.modes = driver.stats();
  if (dcp) {
    for (std::string& n : dcp->notes()) rep.notes.push_back(std::move(n));
  }
  rep.failures = failures.listed();
  rep.failure_count = failures.count();
  for (Engine* e : {&target, draft ? &*draft : nullptr}) {
    if (e == nullptr || e->runtime->kv_cache().device().kind == DeviceKind::cpu) continue;
    rep.notes.push_back(graph_note(*e->runtime, e == &target ? "target" : "draft"));
  }
  rep.iterations = sched.iteration();
  for (const RequestState& r : sched.requests()) {
    rep.verify_rounds += static_cast<int64_t>(r.accept_lengths.size());
    for (int a : r.accept_lengths) rep.accepted_drafts += a;
  }
  check_invariants(sched.steps_planned());
  rep.aborts = sched.aborts();
  rep.retractions = sched.retractions();
  rep.steps = sched.steps_planned();
  if (rep.steps >= 10) {
    auto rate = [&](int64_t from, int64_t to) {
      int64_t tokens = 0;
      double seconds = 0;
      for (const StepTime& t : times) {
        if (t.index < from || t.index >= to) continue;
        tokens += t.tokens;
        seconds += t.seconds;
      }
      return seconds > 0 ? static_cast<double>(tokens) / seconds : 0.0;
    };
    for (int64_t k = 0; k < 10; ++k) {
      rep.tenth_tokens_per_s.push_back(rate(rep.steps * k / 10, rep.steps * (k + 1) / 10));
    }
    rep.first_tenth_tokens_per_s = rep.tenth_tokens_per_s.front();
    rep.last_tenth_tokens_per_s = rep.tenth_tokens_per_s.back();
  }
  rep.target_pool = sched.finish_and_check_pools(ModelRole::target);
  if (hybrid) {
    const LinearStatePool& states = target.runtime->linear_state();
    rep.linear_slots = states.size();
    rep.linear_pool_ok = states.available() == states.size() && target.linear_rows.empty();
    if (!rep.linear_pool_ok) {
      rep.linear_pool_detail = fmt::format("{} of {} linear-state slots still allocated",
                                           states.size() - states.available(), states.size());
    }
  }
  if (draft) rep.draft_pool = sched.finish_and_check_pools(ModelRole::draft);
  rep.dump_written = dumper.written();
  rep.dump_error = dumper.error(sched.steps_planned());
  rep.wall_seconds = seconds_since(wall0);
  return rep;
}

}  // namespace attnrt::sim
