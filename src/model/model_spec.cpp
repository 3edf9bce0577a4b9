// LayerSpec / ModelSpec helpers, validation, tensor-parallel split and model resolution.
#include "attnrt/model/model_spec.h"

#include <fmt/ranges.h>

#include <cmath>
#include <filesystem>
#include <utility>

#include "attnrt/core/error.h"

namespace attnrt {

namespace {

constexpr std::pair<LayerKind, std::string_view> kLayerKindNames[] = {
    {LayerKind::full, "full"}, {LayerKind::swa, "swa"},       {LayerKind::mla, "mla"},
    {LayerKind::gdn, "gdn"},   {LayerKind::mamba2, "mamba2"}, {LayerKind::kda, "kda"}};

}  // namespace

std::string_view layer_kind_name(LayerKind k) {
  for (const auto& [kind, name] : kLayerKindNames) {
    if (kind == k) return name;
  }
  return "?";
}

bool is_linear_kind(LayerKind k) {
  return k == LayerKind::gdn || k == LayerKind::mamba2 || k == LayerKind::kda;
}

float LayerSpec::softmax_scale() const {
  if (scaling > 0.f) return scaling;
  // Linear layers scale q by the key head dim inside the recurrence (§8.9); Mamba2 has no q scale.
  if (kind == LayerKind::mamba2) return 1.f;
  const int dim = is_linear_kind(kind) ? linear.head_k_dim : head_dim;
  return dim > 0 ? 1.f / std::sqrt(static_cast<float>(dim)) : 0.f;
}

std::vector<int> ModelSpec::full_attention_layer_ids() const {
  std::vector<int> ids;
  for (const auto& l : layers) {
    if (l.uses_kv_cache()) ids.push_back(l.layer_id);
  }
  return ids;
}

bool ModelSpec::has_kind(LayerKind k) const {
  for (const auto& l : layers) {
    if (l.kind == k) return true;
  }
  return false;
}

bool ModelSpec::has_linear_layers() const {
  for (const auto& l : layers) {
    if (is_linear_kind(l.kind)) return true;
  }
  return false;
}

bool ModelSpec::has_indexer() const {
  for (const auto& l : layers) {
    if (l.has_indexer()) return true;
  }
  return false;
}

bool ModelSpec::has_sliding_window() const {
  for (const auto& l : layers) {
    if (l.sliding_window >= 0) return true;
  }
  return false;
}

namespace {

// Limits of a layer's shape. Real models stay far below them (128 q heads, head dims up to 576
// with MLA's latent rows); beyond them the per-head buffers of the kernels and the KV rows of a
// pool would be absurd or overflow their 32-bit offsets.
constexpr int kMaxHeads = 1024;        // q, kv, linear and indexer heads of a layer
constexpr int kMaxHeadDim = 1024;      // head_dim, v_head_dim, linear and indexer dims
constexpr int kMaxLinearState = 1024;  // mamba2 d_state
constexpr int kMaxConvKernel = 64;     // linear layers' short convolution

// Every message starts with the model and layer so that a user with a 60-layer config can find the
// offending entry.
#define LAYER_CHECK(cond, fmtstr, ...)                                      \
  ATTNRT_CHECK(cond, "model '{}' layer {} ({}): " fmtstr, name, l.layer_id, \
               layer_kind_name(l.kind), __VA_ARGS__)

void validate_attention_layer(const std::string& name, const LayerSpec& l) {
  LAYER_CHECK(l.num_q_heads > 0 && l.num_q_heads <= kMaxHeads, "num_q_heads = {}; allowed: 1 to {}",
              l.num_q_heads, kMaxHeads);
  LAYER_CHECK(l.num_kv_heads > 0 && l.num_kv_heads <= kMaxHeads,
              "num_kv_heads = {}; allowed: 1 to {}", l.num_kv_heads, kMaxHeads);
  LAYER_CHECK(l.num_q_heads % l.num_kv_heads == 0,
              "num_q_heads = {} is not a multiple of num_kv_heads = {}; every kv head must serve "
              "the same number of q heads",
              l.num_q_heads, l.num_kv_heads);
  LAYER_CHECK(l.head_dim > 0 && l.head_dim <= kMaxHeadDim, "head_dim = {}; allowed: 1 to {}",
              l.head_dim, kMaxHeadDim);
  LAYER_CHECK(l.v_head_dim > 0, "v_head_dim = {}; it must be set (> 0; usually = head_dim {})",
              l.v_head_dim, l.head_dim);
  LAYER_CHECK(l.v_head_dim <= kMaxHeadDim, "v_head_dim = {}; allowed: 1 to {}", l.v_head_dim,
              kMaxHeadDim);
  LAYER_CHECK(std::isfinite(l.scaling) && l.scaling >= 0.f,
              "scaling = {}; it must be a finite value >= 0 (0 = head_dim^-1/2)", l.scaling);
  LAYER_CHECK(std::isfinite(l.logit_cap) && l.logit_cap >= 0.f,
              "logit_cap = {}; it must be a finite value >= 0 (0 = off)", l.logit_cap);
  LAYER_CHECK(l.sliding_window >= -1, "sliding_window = {}; allowed: -1 (off) or W >= 0",
              l.sliding_window);
  if (l.kind == LayerKind::swa) {
    LAYER_CHECK(l.sliding_window >= 0,
                "sliding_window = {}; a swa layer needs a window W >= 0 (keys with "
                "0 <= i - j <= W are visible)",
                l.sliding_window);
  } else {
    // A window on a layer of another kind would be silently served by the full pool.
    LAYER_CHECK(l.sliding_window == -1,
                "sliding_window = {} on a {} layer; use kind swa for windowed layers, or -1",
                l.sliding_window, layer_kind_name(l.kind));
  }
  if (l.kind == LayerKind::mla) {
    LAYER_CHECK(l.kv_lora_rank > 0, "kv_lora_rank = {}; an mla layer needs it > 0", l.kv_lora_rank);
    LAYER_CHECK(l.qk_rope_head_dim >= 0, "qk_rope_head_dim = {}; it must be >= 0",
                l.qk_rope_head_dim);
    LAYER_CHECK(
        l.head_dim == l.kv_lora_rank + l.qk_rope_head_dim,
        "head_dim = {}; the latent form needs kv_lora_rank + qk_rope_head_dim = {} + {} = {}",
        l.head_dim, l.kv_lora_rank, l.qk_rope_head_dim, l.kv_lora_rank + l.qk_rope_head_dim);
    LAYER_CHECK(l.v_head_dim == l.kv_lora_rank,
                "v_head_dim = {}; the latent form reads V as the first kv_lora_rank = {} columns",
                l.v_head_dim, l.kv_lora_rank);
    LAYER_CHECK(l.num_kv_heads == 1, "num_kv_heads = {}; the latent form has exactly 1 kv head",
                l.num_kv_heads);
    LAYER_CHECK(l.qk_nope_head_dim >= 0 && l.mha_v_head_dim >= 0,
                "qk_nope_head_dim = {}, mha_v_head_dim = {}; both must be >= 0 (0 = no MHA form)",
                l.qk_nope_head_dim, l.mha_v_head_dim);
  }
  const IndexerSpec& ix = l.indexer;
  if (ix.index_topk == 0 && ix.index_n_heads == 0 && ix.index_head_dim == 0) return;
  LAYER_CHECK(l.kind == LayerKind::mla,
              "index_topk = {}; an indexer (DSA) belongs to an mla layer only", ix.index_topk);
  LAYER_CHECK(ix.index_topk > 0 && ix.index_n_heads > 0 && ix.index_head_dim > 0,
              "indexer index_topk = {}, index_n_heads = {}, index_head_dim = {}; a DSA layer needs "
              "all three > 0 (or all 0 for no indexer)",
              ix.index_topk, ix.index_n_heads, ix.index_head_dim);
  LAYER_CHECK(
      ix.index_n_heads <= kMaxHeads && ix.index_head_dim <= kMaxHeadDim,
      "indexer index_n_heads = {}, index_head_dim = {}; allowed: heads 1 to {}, dim 1 to {}",
      ix.index_n_heads, ix.index_head_dim, kMaxHeads, kMaxHeadDim);
  LAYER_CHECK(l.causal(), "index_topk = {}; the indexer selects among earlier tokens, so a DSA "
              "layer must be causal (attn_type decoder)", ix.index_topk);
}

void validate_linear_layer(const std::string& name, const LayerSpec& l) {
  const LinearSpec& s = l.linear;
  LAYER_CHECK(s.conv_kernel >= 1 && s.conv_kernel <= kMaxConvKernel,
              "linear.conv_kernel = {}; allowed: 1 to {}", s.conv_kernel, kMaxConvKernel);
  LAYER_CHECK(s.chunk_size >= 1, "linear.chunk_size = {}; it must be >= 1", s.chunk_size);
  LAYER_CHECK(s.head_v_dim > 0 && s.head_v_dim <= kMaxHeadDim,
              "linear.head_v_dim = {}; allowed: 1 to {}", s.head_v_dim, kMaxHeadDim);
  LAYER_CHECK(s.num_v_heads > 0 && s.num_v_heads <= kMaxHeads,
              "linear.num_v_heads = {}; allowed: 1 to {}", s.num_v_heads, kMaxHeads);
  LAYER_CHECK(s.num_k_heads <= kMaxHeads && s.head_k_dim <= kMaxHeadDim,
              "linear.num_k_heads = {}, linear.head_k_dim = {}; allowed: heads up to {}, dim up to "
              "{}",
              s.num_k_heads, s.head_k_dim, kMaxHeads, kMaxHeadDim);
  switch (l.kind) {
    case LayerKind::gdn:
      LAYER_CHECK(s.num_k_heads > 0, "linear.num_k_heads = {}; it must be > 0", s.num_k_heads);
      LAYER_CHECK(s.num_v_heads % s.num_k_heads == 0,
                  "linear.num_v_heads = {} is not a multiple of linear.num_k_heads = {}",
                  s.num_v_heads, s.num_k_heads);
      LAYER_CHECK(s.head_k_dim > 0, "linear.head_k_dim = {}; it must be > 0", s.head_k_dim);
      break;
    case LayerKind::kda:
      LAYER_CHECK(s.num_k_heads == s.num_v_heads,
                  "linear.num_k_heads = {} differs from linear.num_v_heads = {}; KDA has one head "
                  "count for q, k and v",
                  s.num_k_heads, s.num_v_heads);
      LAYER_CHECK(s.head_k_dim > 0, "linear.head_k_dim = {}; it must be > 0", s.head_k_dim);
      break;
    case LayerKind::mamba2:
      LAYER_CHECK(s.d_state > 0 && s.d_state <= kMaxLinearState,
                  "linear.d_state = {}; allowed: 1 to {}", s.d_state, kMaxLinearState);
      LAYER_CHECK(s.n_groups > 0, "linear.n_groups = {}; it must be > 0", s.n_groups);
      LAYER_CHECK(s.num_v_heads % s.n_groups == 0,
                  "linear.num_v_heads = {} (heads) is not a multiple of linear.n_groups = {}",
                  s.num_v_heads, s.n_groups);
      break;
    default:
      break;
  }
}

#undef LAYER_CHECK

}  // namespace

void ModelSpec::validate() const {
  ATTNRT_CHECK(!layers.empty(), "model '{}' has no layers; it needs at least one", name);
  ATTNRT_CHECK(dtype == DType::f32 || dtype == DType::f16 || dtype == DType::bf16,
               "model '{}': activation dtype {} is not supported; use fp32, fp16 or bf16", name,
               dtype_name(dtype));
  ATTNRT_CHECK(max_context_len > 0, "model '{}': max_context_len = {}; it must be > 0", name,
               max_context_len);
  ATTNRT_CHECK(tp_size >= 1, "model '{}': tp_size = {}; it must be >= 1", name, tp_size);
  for (size_t i = 0; i < layers.size(); ++i) {
    ATTNRT_CHECK(layers[i].layer_id == static_cast<int>(i),
                 "model '{}': layers[{}] has layer_id {}; layer ids must be 0..{} in order", name,
                 i, layers[i].layer_id, layers.size() - 1);
    if (is_linear_kind(layers[i].kind)) {
      validate_linear_layer(name, layers[i]);
    } else {
      validate_attention_layer(name, layers[i]);
    }
  }
}

namespace {

// kv heads per rank. When the ranks outnumber the kv heads every rank keeps one whole kv head and
// tp / kv ranks hold copies of the same head (the rule serving engines use: replicate, never split
// a head).
int split_kv_heads(const std::string& model, const LayerSpec& l, int kv, int tp) {
  if (kv % tp == 0) return kv / tp;
  if (tp % kv == 0) return 1;
  fail(
      "model '{}' layer {}: num_kv_heads = {} cannot be split over tp = {}: either tp must divide "
      "the kv heads or the kv heads must divide tp (then each is replicated on tp / kv ranks)",
      model, l.layer_id, kv, tp);
}

int split_heads(const std::string& model, const LayerSpec& l, std::string_view field, int heads,
                int tp) {
  ATTNRT_CHECK(heads % tp == 0,
               "model '{}' layer {} ({}): {} = {} is not divisible by tp = {}; use a tp size that "
               "divides it",
               model, l.layer_id, layer_kind_name(l.kind), field, heads, tp);
  return heads / tp;
}

}  // namespace

ModelSpec apply_tensor_parallel(const ModelSpec& spec, int tp_size) {
  ATTNRT_CHECK(tp_size >= 1, "tensor-parallel size {} is invalid; it must be >= 1", tp_size);
  ATTNRT_CHECK(spec.tp_size == 1,
               "model '{}' is already split for tp = {}; apply the tensor-parallel split to the "
               "unsplit model",
               spec.name, spec.tp_size);
  ModelSpec out = spec;
  out.tp_size = tp_size;
  if (tp_size == 1) return out;
  for (auto& l : out.layers) {
    if (is_linear_kind(l.kind)) {
      LinearSpec& s = l.linear;
      switch (l.kind) {
        case LayerKind::gdn:
        case LayerKind::kda:
          s.num_k_heads = split_heads(spec.name, l, "linear.num_k_heads", s.num_k_heads, tp_size);
          s.num_v_heads = split_heads(spec.name, l, "linear.num_v_heads", s.num_v_heads, tp_size);
          break;
        case LayerKind::mamba2:
          s.num_v_heads = split_heads(spec.name, l, "linear.num_v_heads", s.num_v_heads, tp_size);
          // B/C groups: split when they divide; a single group is replicated on every rank.
          if (s.n_groups % tp_size == 0) {
            s.n_groups /= tp_size;
          } else {
            ATTNRT_CHECK(s.n_groups == 1,
                         "model '{}' layer {} (mamba2): linear.n_groups = {} cannot be split over "
                         "tp = {}: tp must divide the groups, or the model must have 1 group",
                         spec.name, l.layer_id, s.n_groups, tp_size);
          }
          break;
        default:
          break;
      }
      continue;
    }
    l.num_q_heads = split_heads(spec.name, l, "num_q_heads", l.num_q_heads, tp_size);
    // MLA: the single latent kv head is shared by all q heads and lives on every rank.
    if (l.kind != LayerKind::mla) {
      l.num_kv_heads = split_kv_heads(spec.name, l, l.num_kv_heads, tp_size);
    }
  }
  return out;
}

ModelSpec resolve_model(std::string_view name_or_path) {
  namespace fs = std::filesystem;
  const std::string s(name_or_path);
  std::error_code ec;
  if (s.ends_with(".json") || fs::is_regular_file(s, ec)) return load_hf_config(s);
  if (fs::is_directory(s, ec) && fs::is_regular_file(fs::path(s) / "config.json", ec)) {
    return load_hf_config((fs::path(s) / "config.json").string());
  }
  for (const auto& p : preset_names()) {
    if (p == s) return model_preset(s);
  }
  fail(
      "unknown model '{}': use a preset ({}) or the path of a HuggingFace config.json (or of a "
      "directory holding one)",
      s, fmt::join(preset_names(), ", "));
}

}  // namespace attnrt
