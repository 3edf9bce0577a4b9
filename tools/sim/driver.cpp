#include "tools/sim/driver.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>

#include "attnrt/backend/hybrid_attn_backend.h"
#include "attnrt/backend/hybrid_linear_attn_backend.h"
#include "attnrt/backend/registry.h"
#include "attnrt/core/error.h"
#include "attnrt/memory/kv_cache.h"
#include "attnrt/memory/linear_state_pool.h"
#include "attnrt/memory/req_to_token_pool.h"
#include "attnrt/runtime/attention_runtime.h"
#include "tests/conformance/conformance.h"
#include "tools/io/case_file.h"
#if defined(ATTNRT_HAS_CUDA)
#include "backends/cuda/cuda_kv_cache.h"
#endif

namespace attnrt::sim {

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

constexpr int kMaxFailuresPerMode = 3;

// xoshiro256+: the q/k/v of every layer of every step are fresh random numbers, and there are many
// of them; a small fast generator keeps data generation well below the attention cost.
class FastRng {
 public:
  explicit FastRng(uint64_t seed) {
    for (auto& w : s_) {
      seed += 0x9e3779b97f4a7c15ull;
      uint64_t z = seed;
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
      w = z ^ (z >> 31);
    }
  }
  uint64_t next() {
    const uint64_t result = s_[0] + s_[3];
    const uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = (s_[3] << 45) | (s_[3] >> 19);
    return result;
  }
  // Uniform in [-scale, scale).
  float symmetric(float scale) {
    return static_cast<float>(static_cast<int32_t>(next() >> 32)) * (scale * 0x1.0p-31f);
  }

 private:
  std::array<uint64_t, 4> s_{};
};

void fill_random(const TensorView& t, FastRng& rng, float scale) {
  const int64_t n = t.numel();
  switch (t.dtype) {
    case DType::f32: {
      float* p = t.ptr<float>();
      for (int64_t i = 0; i < n; ++i) p[i] = rng.symmetric(scale);
      break;
    }
    case DType::bf16: {
      auto* p = t.ptr<uint16_t>();
      for (int64_t i = 0; i < n; ++i) p[i] = float_to_bf16(rng.symmetric(scale));
      break;
    }
    case DType::f16: {
      auto* p = t.ptr<uint16_t>();
      for (int64_t i = 0; i < n; ++i) p[i] = float_to_fp16(rng.symmetric(scale));
      break;
    }
    default:
      fail(
          "attnrt run: activations of dtype {} are not supported; use a model with fp32, fp16 or "
          "bf16 "
          "activations",
          dtype_name(t.dtype));
  }
}

// Fills t with NaN. Typed fills: this runs for every layer of every step.
void poison(const TensorView& t) {
  const int64_t n = t.numel();
  switch (t.dtype) {
    case DType::f32:
      std::fill_n(t.ptr<float>(), n, std::numeric_limits<float>::quiet_NaN());
      return;
    case DType::bf16:
      std::fill_n(t.ptr<uint16_t>(), n, uint16_t{0x7fc0});
      return;
    case DType::f16:
      std::fill_n(t.ptr<uint16_t>(), n, uint16_t{0x7e00});
      return;
    default:
      for (int64_t i = 0; i < n; ++i) {
        store_from_float(t.data, t.dtype, static_cast<size_t>(i),
                         std::numeric_limits<float>::quiet_NaN());
      }
  }
}

std::string served_by(AttentionBackend& b, ForwardMode mode) {
  if (auto* linear = dynamic_cast<HybridLinearAttnBackend*>(&b)) {
    return fmt::format("{}; linear {}", served_by(linear->full_backend(), mode),
                       linear->linear_backend(mode).name());
  }
  if (auto* hybrid = dynamic_cast<HybridAttnBackend*>(&b)) {
    return std::string(hybrid->select(mode).name());
  }
  return std::string(b.name());
}

// Per-layer buffers sized for the largest step; views are cut per step and layer.
struct LayerBuffers {
  HostBuffer q, k, v, out, ref_out;
  std::vector<float> sinks;
  // Linear-attention layers: mixed_qkv, the gate inputs a and b.
  HostBuffer mixed, gate_a, gate_b;
};

struct Engine {
  ModelSpec model;
  std::unique_ptr<AttentionRuntime> runtime;
  std::unique_ptr<AttentionBackend> reference;  // over the runtime's pools; nullptr = no checking
  // Hybrid models: reference's linear side over the runtime's state pool, or over linear_mirror
  // when that pool is on the GPU (checked steps give the reference the state the runtime started
  // from, and on a shared pool put the runtime's result back after).
  std::unique_ptr<AttentionBackend> reference_linear;
  // GPU state pool: its host copy, with the same slot bindings (every alloc_for / free_for is
  // repeated on it); a checked step uploads the step's slots into it first.
  std::unique_ptr<LinearStatePool> linear_mirror;
  std::vector<int> kv_layers;
  std::map<int, int> linear_rows;  // trace index -> request row holding a linear-state slot
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

// Brings the host copy of one layer up to date with the GPU pool at `rows`.
void refresh_mirror(Engine& e, int layer_id, const std::vector<int64_t>& rows) {
#if defined(ATTNRT_HAS_CUDA)
  auto* gpu = dynamic_cast<cuda::CudaKVCache*>(&e.runtime->kv_cache());
  ATTNRT_CHECK(gpu != nullptr, "attnrt run: a host copy of the pools exists only for GPU pools");
  const KVLayerView h = e.mirror->layer(layer_id);
  gpu->download_rows(layer_id, rows, h.k, h.v);
#else
  (void)e;
  (void)rows;
  fail("attnrt run: layer {}: GPU pools in a build without CUDA", layer_id);
#endif
}

Engine make_engine(const ModelSpec& model, const Options& options, const RunConfig& config,
                   int max_num_tokens, int max_context_len) {
  Engine e;
  e.model = model;
  RuntimeConfig rc;
  rc.max_requests = config.scheduler.max_running_requests;
  rc.kv_slots = config.max_total_tokens;
  rc.swa_full_tokens_ratio = config.swa_full_tokens_ratio;
  rc.max_num_tokens = max_num_tokens;
  rc.max_context_len = max_context_len;
  e.runtime = std::make_unique<AttentionRuntime>(model, options, rc);
  for (const LayerSpec& l : model.layers) {
    if (l.uses_kv_cache()) e.kv_layers.push_back(l.layer_id);
  }
  const bool gpu_pools = e.runtime->kv_cache().device().kind != DeviceKind::cpu;
  if (gpu_pools && (config.check_every > 0 || config.dump_step >= 0)) {
    e.mirror = make_host_mirror(model, e.runtime->kv_cache(), rc.kv_slots, max_num_tokens);
  }
  if (config.check_every > 0) {
    // Its own plan over the runtime's pools (or their host copy): re-storing the step's k/v
    // writes identical bytes.
    BackendContext ctx;
    ctx.model = &e.runtime->model();
    ctx.options = &e.runtime->options();
    ctx.kv_cache = gpu_pools ? e.mirror.get() : &e.runtime->kv_cache();
    ctx.req_to_token = &e.runtime->req_to_token();
    ctx.device = Device::cpu();
    e.reference = Registry::global().get("reference").factory(ctx);
    if (e.runtime->has_linear_layers()) {
      LinearStatePool& states = e.runtime->linear_state();
      if (states.device().kind != DeviceKind::cpu) {
        e.linear_mirror = std::make_unique<LinearStatePool>(e.runtime->model(), states.config());
      }
      ctx.linear_state = e.linear_mirror ? e.linear_mirror.get() : &states;
      e.reference_linear = Registry::global().get("reference").linear_factory(ctx);
    }
  }
  return e;
}

// Weights of a linear-attention layer (fixed for the run), fp32 as LinearArgs wants them: conv
// weights and bias, A_log (decay rates exp(A_log) in about [0.2, 1.6]), dt_bias, and D.
struct LinearWeights {
  HostBuffer conv_w, conv_b, A_log, dt_bias, D;
};

LinearWeights make_linear_weights(const LayerSpec& l, FastRng& rng) {
  const LinearStateShape sh = linear_state_shape(l);
  const int64_t heads = sh.heads;
  auto filled = [&](std::initializer_list<int64_t> shape, float center, float scale) {
    HostBuffer b(DType::f32, shape);
    for (int64_t i = 0; i < b.numel(); ++i) b.ptr<float>()[i] = center + rng.symmetric(scale);
    return b;
  };
  LinearWeights w;
  w.conv_w = filled({sh.conv_dim, l.linear.conv_kernel}, 0.f, 0.6f);
  w.conv_b = filled({sh.conv_dim}, 0.f, 0.3f);
  w.A_log = filled({heads}, -0.5f, 1.f);
  w.dt_bias = l.kind == LayerKind::kda ? filled({heads, l.linear.head_k_dim}, 0.f, 1.f)
                                       : filled({heads}, 0.f, 1.f);
  if (l.kind == LayerKind::mamba2) w.D = filled({heads}, 0.f, 1.f);
  return w;
}

// Widths of a linear layer's per-token inputs: mixed_qkv, a, b, and of its output.
struct LinearWidths {
  int64_t mixed = 0, a = 0, b = 0, out = 0;
};

LinearWidths linear_widths(const LayerSpec& l) {
  const LinearStateShape sh = linear_state_shape(l);
  LinearWidths w;
  w.mixed = sh.conv_dim;
  w.a = l.kind == LayerKind::kda ? int64_t{sh.heads} * l.linear.head_k_dim : sh.heads;
  w.b = l.kind == LayerKind::mamba2 ? 0 : sh.heads;
  w.out = int64_t{sh.heads} * sh.rows;
  return w;
}

// The step's fresh random inputs of a linear layer, over the shared buffers.
LinearArgs linear_args(const LayerSpec& l, const LinearWeights& w, const LayerBuffers& buf,
                       int64_t T, DType dtype) {
  const LinearStateShape sh = linear_state_shape(l);
  LinearArgs a;
  a.mixed_qkv = TensorView(buf.mixed.data(), dtype, {T, sh.conv_dim});
  a.conv_weight = w.conv_w.view();
  a.conv_bias = w.conv_b.view();
  a.A_log = w.A_log.view();
  a.dt_bias = w.dt_bias.view();
  if (l.kind == LayerKind::kda) {
    a.a = TensorView(buf.gate_a.data(), dtype, {T, sh.heads, l.linear.head_k_dim});
  } else {
    a.a = TensorView(buf.gate_a.data(), dtype, {T, sh.heads});
  }
  if (l.kind == LayerKind::mamba2) {
    a.D = w.D.view();
  } else {
    a.b = TensorView(buf.gate_b.data(), dtype, {T, sh.heads});
  }
  a.out = TensorView(buf.out.data(), dtype, {T, sh.heads, sh.rows});
  return a;
}

// The part of one linear layer's state a step reads or may change: the slots of its requests and,
// for TARGET_VERIFY, the checkpoints of its rows (the slots stay untouched there).
struct StateRegion {
  bool verify = false;
  std::vector<int64_t> slots;
  int64_t checkpoints = 0;  // verify: batch rows x N
  int draft_tokens = 0;     // verify: N
};

// The region's conv windows and states: the slots first, then the checkpoints.
struct StateCopy {
  std::vector<uint8_t> conv, ssm;
  int64_t count = 0;
};

StateCopy save_state(const LinearStatePool& pool, int layer_id, const StateRegion& r) {
  const LinearLayerState& st = pool.layer(layer_id);
  const size_t cb = static_cast<size_t>(st.shape.conv_elems()) * dtype_size(st.conv_dtype);
  const size_t sb = static_cast<size_t>(st.shape.ssm_elems()) * dtype_size(st.ssm_dtype);
  StateCopy c;
  c.count = static_cast<int64_t>(r.slots.size()) + (r.verify ? r.checkpoints : 0);
  c.conv.resize(cb * static_cast<size_t>(c.count));
  c.ssm.resize(sb * static_cast<size_t>(c.count));
  size_t at = 0;
  for (int64_t slot : r.slots) {
    pool.download_slot(layer_id, static_cast<int>(slot), &c.conv[cb * at], &c.ssm[sb * at]);
    ++at;
  }
  for (int64_t k = 0; r.verify && k < r.checkpoints; ++k, ++at) {
    pool.download_checkpoint(layer_id, static_cast<int>(k / r.draft_tokens),
                             static_cast<int>(k % r.draft_tokens), &c.conv[cb * at],
                             &c.ssm[sb * at]);
  }
  return c;
}

void restore_state(LinearStatePool& pool, int layer_id, const StateRegion& r, const StateCopy& c) {
  const LinearLayerState& st = pool.layer(layer_id);
  const size_t cb = static_cast<size_t>(st.shape.conv_elems()) * dtype_size(st.conv_dtype);
  const size_t sb = static_cast<size_t>(st.shape.ssm_elems()) * dtype_size(st.ssm_dtype);
  size_t at = 0;
  for (int64_t slot : r.slots) {
    pool.upload_slot(layer_id, static_cast<int>(slot), &c.conv[cb * at], &c.ssm[sb * at]);
    ++at;
  }
  for (int64_t k = 0; r.verify && k < r.checkpoints; ++k, ++at) {
    pool.upload_checkpoint(layer_id, static_cast<int>(k / r.draft_tokens),
                           static_cast<int>(k % r.draft_tokens), &c.conv[cb * at], &c.ssm[sb * at]);
  }
}

// Layers the run keeps (RunConfig::layers), and why, for the report.
ModelSpec layers_to_run(const ModelSpec& model, int layers, std::vector<std::string>& notes) {
  ATTNRT_CHECK(layers >= -1, "--layers = {}; use a layer count >= 1, 0 (all) or leave it unset",
               layers);
  ModelSpec m = model;
  size_t keep = model.layers.size();
  if (layers > 0) {
    keep = std::min(keep, static_cast<size_t>(layers));
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
        layers < 0 ? " — one period of the hybrid pattern, the default for linear-attention models"
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

TensorView cut(const HostBuffer& buf, int64_t rows, int heads, int dim) {
  return TensorView(buf.data(), buf.dtype(), {rows, heads, dim});
}

struct Comparison {
  double max_abs = 0, max_rel = 0;
  int64_t bad = 0;
  double worst_excess = -1;
  int64_t token = 0;
  int head = 0, column = 0;
  double got = 0, expected = 0;
};

Comparison compare(const TensorView& got, const TensorView& expected, const Tolerance& tol) {
  Comparison c;
  const int64_t rows = got.shape[0];
  const int heads = static_cast<int>(got.shape[1]), dim = static_cast<int>(got.shape[2]);
  for (int64_t i = 0; i < rows * heads * dim; ++i) {
    const double g = load_as_float(got.data, got.dtype, static_cast<size_t>(i));
    const double r = load_as_float(expected.data, expected.dtype, static_cast<size_t>(i));
    const double d = std::abs(g - r);
    const double allowed = tol.atol + tol.rtol * std::abs(r);
    // NaN (an unwritten, poisoned element) fails every comparison.
    const bool ok = d <= allowed;
    const double excess =
        ok ? 0 : (std::isnan(d) ? std::numeric_limits<double>::infinity() : d - allowed);
    if (!std::isnan(d)) {
      c.max_abs = std::max(c.max_abs, d);
      c.max_rel = std::max(c.max_rel, d / std::max(std::abs(r), tol.atol));
    } else {
      c.max_abs = c.max_rel = std::numeric_limits<double>::infinity();
    }
    if (!ok) {
      ++c.bad;
      if (excess > c.worst_excess) {
        c.worst_excess = excess;
        c.token = i / (heads * dim);
        c.head = static_cast<int>(i / dim % heads);
        c.column = static_cast<int>(i % dim);
        c.got = g;
        c.expected = r;
      }
    }
  }
  return c;
}

// The first unwritten (still poisoned) output element, or -1. NaN tests on the raw bits for the
// 16-bit dtypes: this runs for every layer of every step.
int64_t first_nan(const TensorView& t) {
  const int64_t n = t.numel();
  auto first_nan_bits = [n](const uint16_t* p, uint16_t inf_bits) -> int64_t {
    for (int64_t i = 0; i < n; ++i) {
      if ((p[i] & 0x7fff) > inf_bits) return i;
    }
    return -1;
  };
  switch (t.dtype) {
    case DType::bf16:
      return first_nan_bits(t.ptr<uint16_t>(), 0x7f80);
    case DType::f16:
      return first_nan_bits(t.ptr<uint16_t>(), 0x7c00);
    default:
      for (int64_t i = 0; i < n; ++i) {
        if (std::isnan(load_as_float(t.data, t.dtype, static_cast<size_t>(i)))) return i;
      }
      return -1;
  }
}

// The layer --dump-step writes: the first full-attention layer, else the first layer with a KV
// cache.
int dump_layer(const ModelSpec& m) {
  for (const LayerSpec& l : m.layers) {
    if (l.kind == LayerKind::full && l.sliding_window < 0) return l.layer_id;
  }
  for (const LayerSpec& l : m.layers) {
    if (l.uses_kv_cache()) return l.layer_id;
  }
  return -1;
}

std::string fmt_err(double e) {
  if (std::isinf(e)) return "inf";
  return fmt::format("{:.2e}", e);
}

}  // namespace

Tolerance output_tolerance(DType out_dtype) {
  ATTNRT_CHECK(is_float(out_dtype) && !is_fp8(out_dtype),
               "no output tolerance for dtype {}; outputs are fp32, fp16 or bf16",
               dtype_name(out_dtype));
  // The same bounds as the conformance suite, so that `run` and `check` agree on what passes.
  const conformance::Tolerance t = conformance::tolerance_for(out_dtype);
  return {t.abs, t.rel};
}

ModeStats RunReport::totals() const {
  ModeStats t;
  for (const ModeStats& m : modes) {
    t.steps += m.steps;
    t.tokens += m.tokens;
    t.seconds += m.seconds;
    t.checked_steps += m.checked_steps;
    t.graph_steps += m.graph_steps;
    t.max_abs_err = std::max(t.max_abs_err, m.max_abs_err);
    t.max_rel_err = std::max(t.max_rel_err, m.max_rel_err);
  }
  return t;
}

bool RunReport::ok() const {
  return failure_count == 0 && target_pool.ok && (!draft_pool || draft_pool->ok) &&
         linear_pool_ok && dump_error.empty();
}

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
  const ModelSpec model = layers_to_run(model_in, config.layers, notes);
  const bool hybrid = model.has_linear_layers();
  Trace trace = trace_in;
  if (hybrid) {
    // A shared prefix would need the linear state at the prefix's end, which the state pool does
    // not snapshot (the optional prefix-cache tracking of reference-semantics §4.7.4); engines
    // turn prefix reuse off for such models too.
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
  const Options options = complete_spec_options(options_in);
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

  Engine target = make_engine(model, options, rc, max_tokens, context);
  std::optional<Engine> draft;
  if (sc.spec.enabled()) {
    bool has_kv_layer = false;
    for (const LayerSpec& l : model.layers) has_kv_layer = has_kv_layer || l.uses_kv_cache();
    ModelSpec draft_model;
    if (has_kv_layer || !hybrid) {
      draft_model = make_draft_model(model);
    } else {
      // Every attention layer was left out (MLA): the draft is one full-attention layer with the
      // heads of the model's first attention layer, 128 wide.
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
      draft_model = make_draft_model(stand_in);
      notes.push_back(fmt::format(
          "draft model: one full-attention layer of {} heads x 128 (the model's attention layers "
          "are MLA, left out here)",
          l.num_q_heads));
    }
    draft = make_engine(draft_model, options, rc, max_tokens, context);
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
  if (rc.check_every == 0) rep.check_note = "reference checks off (--check-every 0)";

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
  const int64_t rows = std::max(max_tokens, 1);
  LayerBuffers buf{HostBuffer(model.dtype, {rows, dims[0]}),
                   HostBuffer(model.dtype, {rows, dims[1]}),
                   HostBuffer(model.dtype, {rows, dims[2]}),
                   HostBuffer(model.dtype, {rows, dims[3]}),
                   HostBuffer(model.dtype, {rows, dims[3]}),
                   {},
                   {},
                   {},
                   {}};
  LinearWidths widest;
  for (const LayerSpec& l : model.layers) {
    if (!is_linear_kind(l.kind)) continue;
    const LinearWidths w = linear_widths(l);
    widest.mixed = std::max(widest.mixed, w.mixed);
    widest.a = std::max(widest.a, w.a);
    widest.b = std::max(widest.b, w.b);
  }
  if (hybrid) {
    buf.mixed = HostBuffer(model.dtype, {rows, widest.mixed});
    buf.gate_a = HostBuffer(model.dtype, {rows, widest.a});
    buf.gate_b = HostBuffer(model.dtype, {rows, std::max<int64_t>(widest.b, 1)});
  }

  FastRng rng(config.seed ^ 0x5eed5eedull);
  // Sink logits are weights of the model: fixed per layer for the whole run.
  std::map<std::pair<int, int>, std::vector<float>> sinks;
  for (Engine* e : {&target, draft ? &*draft : nullptr}) {
    if (e == nullptr) continue;
    const int role = e == &target ? 0 : 1;
    for (const LayerSpec& l : e->model.layers) {
      if (!l.has_sinks) continue;
      auto& s = sinks[{role, l.layer_id}];
      for (int h = 0; h < l.num_q_heads; ++h) s.push_back(rng.symmetric(2.f));
    }
  }

  std::map<int, LinearWeights> linear_weights;
  for (const LayerSpec& l : model.layers) {
    if (is_linear_kind(l.kind)) linear_weights.emplace(l.layer_id, make_linear_weights(l, rng));
  }

  // (role, mode) -> stats
  std::map<std::pair<int, int>, ModeStats> stats;
  std::map<std::pair<int, int>, int> failures_listed;
  int64_t tokens_done = 0;
  auto record_failure = [&](const std::pair<int, int>& key, const ScheduledStep& step, int layer_id,
                            const Comparison& c, std::string what) {
    ++rep.failure_count;
    int& listed = failures_listed[key];
    if (listed >= kMaxFailuresPerMode) return;
    ++listed;
    CheckFailure f;
    f.step = step.index;
    f.role = step.role;
    f.mode = step.batch.mode;
    f.layer = layer_id;
    f.token = c.token;
    f.head = c.head;
    f.column = c.column;
    f.got = c.got;
    f.expected = c.expected;
    f.abs_err = std::abs(c.got - c.expected);
    f.what = std::move(what);
    rep.failures.push_back(std::move(f));
  };

  while (!sched.done()) {
    const ScheduledStep& step = sched.next();
    Engine& e = step.role == ModelRole::target ? target : *draft;
    const ForwardBatch& batch = step.batch;
    const int64_t T = batch.num_tokens();
    const auto key = std::make_pair(static_cast<int>(step.role), static_cast<int>(batch.mode));
    ModeStats& ms = stats[key];
    if (ms.steps == 0) {
      ms.role = step.role;
      ms.mode = batch.mode;
      ms.backend = served_by(e.runtime->backend(), batch.mode);
    }
    const bool check = e.reference != nullptr && T > 0 && ms.steps % rc.check_every == 0;
    const bool linear_step = e.runtime->has_linear_layers();
    StateRegion region;
    if (linear_step) {
      // A request's state slot lives as long as the request: taken at its first step.
      LinearStatePool& states = e.runtime->linear_state();
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
          e.linear_rows[step.requests[i]] = row;
        }
        region.slots.push_back(states.slot_of(row));
      }
      region.verify = is_target_verify(batch.mode);
      if (region.verify) {
        region.draft_tokens = batch.spec_info->draft_token_num;
        region.checkpoints = int64_t{batch.batch_size} * region.draft_tokens;
      }
    }
    // DECODE / TARGET_VERIFY steps on GPU pools run as CUDA graphs when the runtime has them:
    // every attention layer's inputs go into the static tensors first, then one launch.
    const bool graph = T > 0 && e.runtime->cuda_graph_bucket(batch) > 0;
    double elapsed = 0;
    Clock::time_point t0 = Clock::now();
    if (!graph) {
      e.runtime->begin_step(batch);
      elapsed += seconds_since(t0);
    }
    if (check) {
      if (e.mirror) e.mirror->begin_step(batch);
      e.reference->init_forward_metadata(batch);
      if (e.reference_linear) e.reference_linear->init_forward_metadata(batch);
    }
    // GPU pools: the rows the reference (or --dump-step) reads, copied to the host per layer.
    std::vector<int64_t> read_rows;
    if (e.mirror && (check || step.index == rc.dump_step) && T > 0)
      read_rows = step_rows(batch, e.runtime->req_to_token());
    // Fresh random q / k / v for an attention layer into `lb`, out poisoned with NaN.
    auto attn_inputs = [&](const LayerSpec& layer, const LayerBuffers& lb) {
      const int Hq = layer.num_q_heads, Hkv = layer.num_kv_heads;
      AttnArgs args;
      args.q = cut(lb.q, T, Hq, layer.head_dim);
      args.k = cut(lb.k, T, Hkv, layer.head_dim);
      args.v = cut(lb.v, T, Hkv, layer.v_head_dim);
      args.out = cut(lb.out, T, Hq, layer.v_head_dim);
      fill_random(args.q, rng, 2.f);
      fill_random(args.k, rng, 1.f);
      if (layer.kind == LayerKind::mla) {
        // The latent row is both K and (its first v_head_dim columns) V.
        const size_t es = dtype_size(model.dtype);
        for (int64_t t = 0; t < T; ++t) {
          std::memcpy(static_cast<char*>(args.v.data) + t * layer.v_head_dim * es,
                      static_cast<char*>(args.k.data) + t * layer.head_dim * es,
                      layer.v_head_dim * es);
        }
      } else {
        fill_random(args.v, rng, 1.f);
      }
      poison(args.out);
      if (layer.has_sinks) args.sinks = sinks.at({key.first, layer.layer_id}).data();
      return args;
    };
    // After the layer ran (its output in args.out on the host): --dump-step, the unwritten-output
    // check and the reference check.
    auto judge = [&](const LayerSpec& layer, const AttnArgs& args) {
      const int Hq = layer.num_q_heads;
      const bool dump =
          step.index == rc.dump_step && T > 0 && layer.layer_id == dump_layer(e.model);
      if (e.mirror && (dump || check)) refresh_mirror(e, layer.layer_id, read_rows);
      if (dump) {
        write_step_case(rc.dump_dir, e.model, layer.layer_id, options, batch,
                        e.runtime->req_to_token(), e.mirror ? *e.mirror : e.runtime->kv_cache(),
                        args, ms.backend);
        rep.dump_written =
            fmt::format("{} (step {}, {} {}, layer {})", rc.dump_dir, step.index,
                        model_role_name(step.role), forward_mode_name(batch.mode), layer.layer_id);
      }
      const int64_t unwritten = first_nan(args.out);
      if (unwritten >= 0 || check) {
        Comparison c;
        if (check) {
          AttnArgs ref = args;
          ref.out = cut(buf.ref_out, T, Hq, layer.v_head_dim);
          poison(ref.out);
          e.reference->forward(ref, layer, batch);
          c = compare(args.out, ref.out, rep.tolerance);
          ms.max_abs_err = std::max(ms.max_abs_err, c.max_abs);
          ms.max_rel_err = std::max(ms.max_rel_err, c.max_rel);
        } else {
          c.bad = 1;
          c.token = unwritten / (Hq * layer.v_head_dim);
          c.head = static_cast<int>(unwritten / layer.v_head_dim % Hq);
          c.column = static_cast<int>(unwritten % layer.v_head_dim);
          c.got = c.expected = std::numeric_limits<double>::quiet_NaN();
          c.max_abs = std::numeric_limits<double>::infinity();
          ms.max_abs_err = ms.max_rel_err = std::numeric_limits<double>::infinity();
        }
        if (c.bad > 0) {
          record_failure(
              key, step, layer.layer_id, c,
              check ? fmt::format(
                          "step {} ({} {}), layer {}: {} of {} outputs beyond tolerance; worst "
                          "at token {}, head {}, column {}: got {:.6g}, reference {:.6g} "
                          "(|error| {}; allowed {:g} + {:g}*|reference|)",
                          step.index, model_role_name(step.role), forward_mode_name(batch.mode),
                          layer.layer_id, c.bad, args.out.numel(), c.token, c.head, c.column, c.got,
                          c.expected, fmt_err(std::abs(c.got - c.expected)), rep.tolerance.atol,
                          rep.tolerance.rtol)
                    : fmt::format(
                          "step {} ({} {}), layer {}: output not written by backend '{}' at "
                          "token {}, head {}, column {} (still the NaN poison)",
                          step.index, model_role_name(step.role), forward_mode_name(batch.mode),
                          layer.layer_id, ms.backend, c.token, c.head, c.column));
        }
      }
    };

    if (graph) {
      ++ms.graph_steps;
      std::vector<std::pair<const LayerSpec*, AttnArgs>> layer_args;
      for (const LayerSpec& layer : e.model.layers) {
        LayerBuffers& lb = e.graph_host[layer.layer_id];
        if (lb.q.data() == nullptr) {  // first graph step of this layer
          const int64_t cap = rows;  // the largest step of the run
          lb.q = HostBuffer(model.dtype, {cap, layer.num_q_heads * layer.head_dim});
          lb.k = HostBuffer(model.dtype, {cap, layer.num_kv_heads * layer.head_dim});
          lb.v = HostBuffer(model.dtype, {cap, layer.num_kv_heads * layer.v_head_dim});
          lb.out = HostBuffer(model.dtype, {cap, layer.num_q_heads * layer.v_head_dim});
        }
        const AttnArgs args = attn_inputs(layer, lb);
        const GraphLayerIO io = e.runtime->graph_io(layer.layer_id, T);
        e.runtime->copy_tensor(io.q, args.q);
        e.runtime->copy_tensor(io.k, args.k);
        e.runtime->copy_tensor(io.v, args.v);
        e.runtime->copy_tensor(io.out, args.out);
        if (layer.has_sinks && !e.graph_sinks_written) {
          e.runtime->copy_tensor(io.sinks, TensorView(const_cast<float*>(args.sinks), DType::f32,
                                                      {layer.num_q_heads}));
        }
        layer_args.emplace_back(&layer, args);
      }
      e.graph_sinks_written = true;
      t0 = Clock::now();
      e.runtime->forward_step_graph(batch);
      e.runtime->synchronize();
      elapsed += seconds_since(t0);
      for (const auto& [layer, args] : layer_args) {
        e.runtime->copy_tensor(args.out, e.runtime->graph_io(layer->layer_id, T).out);
        judge(*layer, args);
      }
    } else {
      for (const LayerSpec& layer : e.model.layers) {
        if (is_linear_kind(layer.kind)) {
          const LinearArgs args =
              linear_args(layer, linear_weights.at(layer.layer_id), buf, T, model.dtype);
          fill_random(args.mixed_qkv, rng, 1.f);
          fill_random(args.a, rng, 2.5f);
          if (!args.b.empty()) fill_random(args.b, rng, 2.5f);
          poison(args.out);
          LinearStatePool& states = e.runtime->linear_state();
          LinearStatePool& ref_states = e.linear_mirror ? *e.linear_mirror : states;
          const LinearLayerState& st = states.layer(layer.layer_id);
          StateCopy before;
          if (check && T > 0) before = save_state(states, layer.layer_id, region);
          t0 = Clock::now();
          e.runtime->forward_linear(layer.layer_id, args);
          elapsed += seconds_since(t0);
          const int64_t unwritten = first_nan(args.out);
          const std::string where = fmt::format(
              "step {} ({} {}), layer {} ({})", step.index, model_role_name(step.role),
              forward_mode_name(batch.mode), layer.layer_id, layer_kind_name(layer.kind));
          if (check) {
            // The reference runs from the state the runtime started from (in the host copy of a
            // GPU pool, or in the same pool, where the runtime's result is put back afterwards,
            // so the run goes on with the backend under test).
            const StateCopy after = save_state(states, layer.layer_id, region);
            restore_state(ref_states, layer.layer_id, region, before);
            LinearArgs ref = args;
            ref.out = TensorView(buf.ref_out.data(), model.dtype,
                                 {T, args.out.shape[1], args.out.shape[2]});
            poison(ref.out);
            e.reference_linear->forward_linear(ref, layer, batch);
            const StateCopy expected = save_state(ref_states, layer.layer_id, region);
            if (&ref_states == &states) restore_state(states, layer.layer_id, region, after);
            const Comparison c = compare(args.out, ref.out, rep.tolerance);
            ms.max_abs_err = std::max(ms.max_abs_err, c.max_abs);
            ms.max_rel_err = std::max(ms.max_rel_err, c.max_rel);
            if (c.bad > 0) {
              record_failure(
                  key, step, layer.layer_id, c,
                  fmt::format("{}: {} of {} outputs beyond tolerance; worst at token {}, "
                              "head {}, column {}: got {:.6g}, reference {:.6g} "
                              "(allowed {:g} + {:g}*|reference|)",
                              where, c.bad, args.out.numel(), c.token, c.head, c.column, c.got,
                              c.expected, rep.tolerance.atol, rep.tolerance.rtol));
            }
            // The state each request (and verify checkpoint) ends with: recurrent state and conv
            // window against reference's.
            const LinearStateShape& sh = st.shape;
            auto where_in = [&](int64_t k) {
              const auto n = static_cast<int64_t>(region.slots.size());
              if (k < n) return fmt::format("request {}", k);
              return fmt::format("checkpoint (request {}, block token {})",
                                 (k - n) / region.draft_tokens, (k - n) % region.draft_tokens);
            };
            const struct {
              const char* what;
              DType dtype;
              const std::vector<uint8_t>& got;
              const std::vector<uint8_t>& want;
              int64_t d1, d2;
            } parts[] = {{"recurrent state", st.ssm_dtype, after.ssm, expected.ssm, sh.heads,
                          int64_t{sh.rows} * sh.cols},
                         {"conv window", st.conv_dtype, after.conv, expected.conv, sh.conv_width,
                          sh.conv_dim}};
            for (const auto& part : parts) {
              if (part.d1 == 0 || after.count == 0) continue;
              const TensorView got(const_cast<uint8_t*>(part.got.data()), part.dtype,
                                   {after.count, part.d1, part.d2});
              const TensorView want(const_cast<uint8_t*>(part.want.data()), part.dtype,
                                    {after.count, part.d1, part.d2});
              const Comparison sc = compare(got, want, rep.tolerance);
              if (sc.bad > 0) {
                record_failure(
                    key, step, layer.layer_id, sc,
                    fmt::format("{}: {} of {} {} values beyond tolerance; worst in {}, [{}, {}]: "
                                "got {:.6g}, reference {:.6g}",
                                where, sc.bad, got.numel(), part.what, where_in(sc.token), sc.head,
                                sc.column, sc.got, sc.expected));
              }
            }
          } else if (unwritten >= 0) {
            Comparison c;
            c.token = unwritten / (args.out.shape[1] * args.out.shape[2]);
            record_failure(key, step, layer.layer_id, c,
                           fmt::format("{}: output not written by backend '{}' at token {} (still "
                                       "the NaN poison)",
                                       where, ms.backend, c.token));
            ms.max_abs_err = ms.max_rel_err = std::numeric_limits<double>::infinity();
          }
          continue;
        }
        const AttnArgs args = attn_inputs(layer, buf);
        t0 = Clock::now();
        e.runtime->forward(layer.layer_id, args);
        elapsed += seconds_since(t0);
        judge(layer, args);
      }
      t0 = Clock::now();
      e.runtime->end_step();
      elapsed += seconds_since(t0);
    }

    ++ms.steps;
    ms.tokens += T;
    ms.seconds += elapsed;
    if (check) ++ms.checked_steps;
    tokens_done += T;
    const ForwardMode mode = batch.mode;
    const ModelRole role = step.role;
    const int done_steps = step.index + 1;
    const bool verified = linear_step && is_target_verify(mode);
    sched.complete();
    if (linear_step) {
      // §8.10: each request keeps the state after the deepest token of its accepted path.
      if (verified) {
        std::vector<int32_t> last;
        for (const std::vector<int>& path : sched.last_accepted_paths()) {
          last.push_back(path.empty() ? -1 : path.back());
        }
        e.runtime->update_state_after_verify(last);
      }
      for (auto it = e.linear_rows.begin(); it != e.linear_rows.end();) {
        if (sched.requests()[static_cast<size_t>(it->first)].phase ==
            RequestState::Phase::finished) {
          e.runtime->linear_state().free_for(it->second);
          if (e.linear_mirror) e.linear_mirror->free_for(it->second);
          it = e.linear_rows.erase(it);
        } else {
          ++it;
        }
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

  for (auto& [key, ms] : stats) rep.modes.push_back(ms);
  for (Engine* e : {&target, draft ? &*draft : nullptr}) {
    if (e == nullptr || e->runtime->kv_cache().device().kind == DeviceKind::cpu) continue;
    const char* who = e == &target ? "target" : "draft";
    const AttentionRuntime& rt = *e->runtime;
    rep.notes.push_back(
        rt.cuda_graphs_enabled()
            ? fmt::format("CUDA graphs ({}): DECODE / TARGET_VERIFY steps of up to {} requests "
                          "replay captured graphs (batch sizes {}); {} captured",
                          who, rt.cuda_graph_batch_sizes().back(),
                          fmt::join(rt.cuda_graph_batch_sizes(), ", "), rt.cuda_graphs_captured())
            : fmt::format("CUDA graphs ({}): off: {}", who, rt.cuda_graphs_off_reason()));
  }
  rep.iterations = sched.iteration();
  for (const RequestState& r : sched.requests()) {
    rep.verify_rounds += static_cast<int64_t>(r.accept_lengths.size());
    for (int a : r.accept_lengths) rep.accepted_drafts += a;
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
  if (rc.dump_step >= 0 && rep.dump_written.empty()) {
    rep.dump_error =
        rc.dump_step >= sched.steps_planned()
            ? fmt::format("--dump-step {}: the run had only {} steps (0 .. {})", rc.dump_step,
                          sched.steps_planned(), sched.steps_planned() - 1)
            : fmt::format(
                  "--dump-step {}: that step is IDLE (no tokens, nothing to "
                  "replay); pick a step with tokens",
                  rc.dump_step);
  }
  rep.wall_seconds = seconds_since(wall0);
  return rep;
}

namespace {

std::string mode_label(const ModeStats& m) {
  return m.role == ModelRole::target ? std::string(forward_mode_name(m.mode))
                                     : fmt::format("{} (draft)", forward_mode_name(m.mode));
}

std::string pool_line(const char* name, const PoolReport& p) {
  if (p.ok) {
    return fmt::format(
        "pool check ({}): ok: all {} request slots free again; {} shared prefix{} held "
        "{} slots until released at the end",
        name, p.total_slots, p.prefixes, p.prefixes == 1 ? "" : "es", p.prefix_slots);
  }
  return fmt::format("pool check ({}): LEAK: {}", name, p.detail);
}

nlohmann::json pool_json(const PoolReport& p) {
  return {{"ok", p.ok},
          {"total_slots", p.total_slots},
          {"free_slots", p.free_slots},
          {"prefix_slots", p.prefix_slots},
          {"prefixes", p.prefixes},
          {"rows_in_use", p.rows_in_use},
          {"free_after_release", p.free_after_release},
          {"detail", p.detail}};
}

}  // namespace

std::string format_report(const RunReport& r) {
  std::string out;
  out += fmt::format(
      "model {} | trace {} ({} requests, {} prompt + {} output tokens) | {} iterations\n", r.model,
      r.trace_origin, r.requests, r.prompt_tokens, r.output_tokens, r.iterations);
  out += fmt::format("backends: prefill {}, decode {}", r.prefill_backend, r.decode_backend);
  if (!r.linear_prefill_backend.empty()) {
    out += fmt::format(", linear prefill {}, linear decode {}", r.linear_prefill_backend,
                       r.linear_decode_backend);
  }
  out += fmt::format(" | kv {} | page size {}", r.kv_dtype, r.page_size);
  if (r.swa_ratio > 0) out += fmt::format(" | SWA pool {:g} x the full slots", r.swa_ratio);
  if (r.spec.enabled()) {
    out += fmt::format(
        " | speculative: {} steps, topk {}, {} draft tokens; {:.2f} drafts accepted per "
        "request and round ({} request-rounds)",
        r.spec.num_steps, r.spec.topk, r.spec.num_draft_tokens,
        r.verify_rounds > 0 ? static_cast<double>(r.accepted_drafts) / r.verify_rounds : 0.0,
        r.verify_rounds);
  }
  out += "\n";
  for (const std::string& note : r.notes) out += "note: " + note + "\n";
  out += "\n";
  const std::string head =
      fmt::format("{:<22} {:>7} {:>9} {:>10} {:>11} {:>8} {:>10} {:>10}  {}\n", "mode", "steps",
                  "tokens", "time (ms)", "tokens/s", "checked", "max abs", "max rel", "backend");
  out += head;
  out += std::string(head.size() - 1, '-') + "\n";
  auto row = [&](const std::string& label, const ModeStats& m) {
    const bool checked = m.checked_steps > 0;
    out += fmt::format("{:<22} {:>7} {:>9} {:>10.1f} {:>11.0f} {:>8} {:>10} {:>10}  {}\n", label,
                       m.steps, m.tokens, m.seconds * 1e3, m.tokens_per_second(), m.checked_steps,
                       checked ? fmt_err(m.max_abs_err) : "-",
                       checked ? fmt_err(m.max_rel_err) : "-", m.backend);
  };
  for (const ModeStats& m : r.modes) row(mode_label(m), m);
  out += std::string(head.size() - 1, '-') + "\n";
  row("total", r.totals());
  out += fmt::format(
      "\nwall time {:.2f} s (attention {:.2f} s; the rest is data generation, "
      "reference checks and scheduling); tolerance {:g} + {:g}*|reference|\n",
      r.wall_seconds, r.totals().seconds, r.tolerance.atol, r.tolerance.rtol);
  if (!r.check_note.empty()) out += r.check_note + "\n";
  out += pool_line("target", r.target_pool) + "\n";
  if (r.draft_pool) out += pool_line("draft", *r.draft_pool) + "\n";
  if (r.linear_slots > 0) {
    out += r.linear_pool_ok
               ? fmt::format("linear state check (target): ok: all {} state slots free again\n",
                             r.linear_slots)
               : fmt::format("linear state check (target): LEAK: {}\n", r.linear_pool_detail);
  }
  if (!r.dump_written.empty()) out += fmt::format("step case written to {}\n", r.dump_written);
  if (!r.dump_error.empty()) out += fmt::format("no step case written: {}\n", r.dump_error);
  if (r.failure_count > 0) {
    out += fmt::format(
        "\nFAILED: {} checked layer outputs beyond tolerance or unwritten; first ones:\n",
        r.failure_count);
    for (const CheckFailure& f : r.failures) out += "  " + f.what + "\n";
  }
  return out;
}

nlohmann::json report_to_json(const RunReport& r) {
  using json = nlohmann::json;
  auto mode_json = [](const ModeStats& m) {
    json j = {{"model", model_role_name(m.role)},
              {"mode", forward_mode_name(m.mode)},
              {"backend", m.backend},
              {"steps", m.steps},
              {"tokens", m.tokens},
              {"time_ms", m.seconds * 1e3},
              {"tokens_per_s", m.tokens_per_second()},
              {"checked_steps", m.checked_steps},
              {"graph_steps", m.graph_steps}};
    // JSON has no infinity: an unwritten output is reported as null error (and as a failure).
    auto err = [](double e) { return std::isfinite(e) ? json(e) : json(nullptr); };
    j["max_abs_err"] = m.checked_steps > 0 ? err(m.max_abs_err) : json(nullptr);
    j["max_rel_err"] = m.checked_steps > 0 ? err(m.max_rel_err) : json(nullptr);
    return j;
  };
  json modes = json::array();
  for (const ModeStats& m : r.modes) modes.push_back(mode_json(m));
  json total = mode_json(r.totals());
  total.erase("model");
  total.erase("mode");
  total.erase("backend");
  json failures = json::array();
  for (const CheckFailure& f : r.failures) {
    failures.push_back({{"step", f.step},
                        {"model", model_role_name(f.role)},
                        {"mode", forward_mode_name(f.mode)},
                        {"layer", f.layer},
                        {"token", f.token},
                        {"head", f.head},
                        {"column", f.column},
                        {"message", f.what}});
  }
  json j = {{"model", r.model},
            {"trace",
             {{"origin", r.trace_origin},
              {"requests", r.requests},
              {"prompt_tokens", r.prompt_tokens},
              {"output_tokens", r.output_tokens}}},
            {"backends", {{"prefill", r.prefill_backend}, {"decode", r.decode_backend}}},
            {"kv_dtype", r.kv_dtype},
            {"page_size", r.page_size},
            {"swa_full_tokens_ratio", r.swa_ratio > 0 ? json(r.swa_ratio) : json()},
            {"iterations", r.iterations},
            {"wall_s", r.wall_seconds},
            {"tolerance", {{"atol", r.tolerance.atol}, {"rtol", r.tolerance.rtol}}},
            {"modes", modes},
            {"total", total},
            {"pool_check", {{"target", pool_json(r.target_pool)}}},
            {"failure_count", r.failure_count},
            {"failures", failures},
            {"ok", r.ok()}};
  if (r.draft_pool) j["pool_check"]["draft"] = pool_json(*r.draft_pool);
  if (r.linear_slots > 0) {
    j["backends"]["linear_prefill"] = r.linear_prefill_backend;
    j["backends"]["linear_decode"] = r.linear_decode_backend;
    j["pool_check"]["linear_state"] = {
        {"ok", r.linear_pool_ok}, {"slots", r.linear_slots}, {"detail", r.linear_pool_detail}};
  }
  if (!r.notes.empty()) j["notes"] = r.notes;
  if (r.spec.enabled()) {
    j["speculative"] = {{"num_steps", r.spec.num_steps},
                        {"topk", r.spec.topk},
                        {"num_draft_tokens", r.spec.num_draft_tokens},
                        {"accept_prob", r.spec.accept_prob},
                        {"verify_rounds", r.verify_rounds},
                        {"accepted_drafts", r.accepted_drafts}};
  }
  if (!r.dump_written.empty()) j["dump"] = r.dump_written;
  if (!r.dump_error.empty()) j["dump_error"] = r.dump_error;
  if (!r.check_note.empty()) j["check_note"] = r.check_note;
  return j;
}

}  // namespace attnrt::sim
