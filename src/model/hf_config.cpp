// HuggingFace config.json -> ModelSpec: the dense decoder families (llama, mistral, phi3, qwen2/3,
// gemma2/3, gpt-oss), multi-head latent attention (deepseek_v2/v3) and the hybrids of attention
// with linear layers (qwen3_next: Gated DeltaNet; kimi_linear: KDA + MLA; nemotron_h: Mamba2).
// Field names, defaults and per-layer rules follow the transformers config classes of each family;
// defaults are used only where those classes have one, elsewhere a missing field is an error,
// because a config.json without it is more likely the wrong file.
#include <fmt/ranges.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <utility>

#include "attnrt/core/error.h"
#include "attnrt/model/model_spec.h"
#include "src/model/layer_builders.h"

namespace attnrt {

namespace {

using json = nlohmann::json;
using layer_builders::attention_layer;
using layer_builders::linear_layer;

enum class Family { llama, mistral, qwen2, gemma2, gemma3, gpt_oss, mla, qwen3_next, kimi_linear,
                    nemotron_h };

struct ModelType {
  std::string_view name;
  Family family;
};

constexpr ModelType kModelTypes[] = {
    {"llama", Family::llama},        {"mistral", Family::mistral}, {"mixtral", Family::mistral},
    {"qwen2", Family::qwen2},        {"qwen2_moe", Family::qwen2}, {"qwen3", Family::qwen2},
    {"qwen3_moe", Family::qwen2},    {"gemma2", Family::gemma2},   {"gemma3", Family::gemma3},
    {"gemma3_text", Family::gemma3}, {"phi3", Family::mistral},    {"gpt_oss", Family::gpt_oss},
    {"deepseek_v2", Family::mla},    {"deepseek_v3", Family::mla}, {"qwen3_next", Family::qwen3_next},
    {"kimi_linear", Family::kimi_linear}, {"nemotron_h", Family::nemotron_h},
    {"deepseek_v32", Family::mla},
};

std::string supported_types() {
  std::vector<std::string_view> names;
  for (const auto& t : kModelTypes) names.push_back(t.name);
  return fmt::format("{}", fmt::join(names, ", "));
}

// How an error names the type of a JSON value; the integer types are "a number".
constexpr std::pair<json::value_t, std::string_view> kJsonTypes[] = {
    {json::value_t::null, "null"},        {json::value_t::boolean, "a boolean"},
    {json::value_t::string, "a string"},  {json::value_t::array, "an array"},
    {json::value_t::object, "an object"}, {json::value_t::number_float, "a non-integer number"}};

std::string_view json_type(const json& v) {
  for (const auto& [type, name] : kJsonTypes) {
    if (type == v.type()) return name;
  }
  return "a number";
}

// Typed access to one config object; every error names the file and the field.
class Fields {
 public:
  Fields(const json& obj, std::string_view origin) : obj_(obj), origin_(origin) {}

  // Present with a non-null value. HF writes null for "unset" (e.g. "sliding_window": null).
  bool has(const char* key) const { return obj_.contains(key) && !obj_.at(key).is_null(); }
  bool present(const char* key) const { return obj_.contains(key); }

  int require_int(const char* key) const {
    if (!has(key)) fail("{}: missing required field '{}'", origin_, key);
    return as_int(key);
  }
  std::optional<int> opt_int(const char* key) const {
    if (!has(key)) return std::nullopt;
    return as_int(key);
  }
  std::optional<double> opt_number(const char* key) const {
    if (!has(key)) return std::nullopt;
    const json& v = obj_.at(key);
    if (!v.is_number()) fail("{}: field '{}' is {}; expected a number", origin_, key, json_type(v));
    return v.get<double>();
  }
  std::optional<bool> opt_bool(const char* key) const {
    if (!has(key)) return std::nullopt;
    const json& v = obj_.at(key);
    if (!v.is_boolean())
      fail("{}: field '{}' is {}; expected true or false", origin_, key, json_type(v));
    return v.get<bool>();
  }
  std::optional<std::string> opt_string(const char* key) const {
    if (!has(key)) return std::nullopt;
    const json& v = obj_.at(key);
    if (!v.is_string()) fail("{}: field '{}' is {}; expected a string", origin_, key, json_type(v));
    return v.get<std::string>();
  }
  const json& at(const char* key) const { return obj_.at(key); }

 private:
  int as_int(const char* key) const {
    const json& v = obj_.at(key);
    if (v.is_number_integer() || v.is_number_unsigned()) {
      const auto x = v.get<int64_t>();
      if (x >= INT32_MIN && x <= INT32_MAX) return static_cast<int>(x);
    } else if (v.is_number_float()) {
      const double x = v.get<double>();
      if (x == std::floor(x) && std::fabs(x) <= INT32_MAX) return static_cast<int>(x);
    }
    fail("{}: field '{}' is {} ({}); expected an integer", origin_, key, json_type(v), v.dump());
  }

  const json& obj_;
  std::string_view origin_;
};

enum class AttnKind { full, sliding };

// Per-layer attention kind: from `layer_types` when the file has it (transformers >= 4.53 writes
// it), else from each family's rule.
std::vector<AttnKind> layer_kinds(Family family, const Fields& f, int num_layers,
                                  bool qwen_sliding_enabled, std::string_view origin) {
  std::vector<AttnKind> kinds(num_layers, AttnKind::full);
  if (f.has("layer_types")) {
    const json& types = f.at("layer_types");
    if (!types.is_array()) {
      fail(
          "{}: field 'layer_types' is {}; expected an array of \"full_attention\" / "
          "\"sliding_attention\"",
          origin, json_type(types));
    }
    if (static_cast<int>(types.size()) != num_layers) {
      fail("{}: field 'layer_types' has {} entries; num_hidden_layers is {}", origin, types.size(),
           num_layers);
    }
    for (int i = 0; i < num_layers; ++i) {
      const json& t = types[i];
      if (t == "full_attention") continue;
      if (t == "sliding_attention") {
        kinds[i] = AttnKind::sliding;
        continue;
      }
      fail(
          "{}: layer_types[{}] is {}; this loader supports \"full_attention\" and "
          "\"sliding_attention\"",
          origin, i, t.dump());
    }
    return kinds;
  }
  switch (family) {
    case Family::llama:
      break;
    case Family::mistral:
      // Mistral/Mixtral: one window for every layer; "sliding_window": null means none.
      if (f.has("sliding_window")) kinds.assign(num_layers, AttnKind::sliding);
      break;
    case Family::qwen2: {
      // Qwen2/Qwen3: with use_sliding_window, layers with index >= max_window_layers use the window
      // and the first max_window_layers layers attend fully (transformers' Qwen2Config derives
      // layer_types as "sliding_attention" iff i >= max_window_layers).
      if (!qwen_sliding_enabled) break;
      const int max_window_layers = f.opt_int("max_window_layers").value_or(28);
      for (int i = std::max(max_window_layers, 0); i < num_layers; ++i)
        kinds[i] = AttnKind::sliding;
      break;
    }
    case Family::gemma2:
    case Family::gpt_oss:
      // Gemma2 and gpt-oss alternate: even layers local (sliding), odd layers global.
      for (int i = 0; i < num_layers; i += 2) kinds[i] = AttnKind::sliding;
      break;
    default:
      break;
    case Family::gemma3: {
      // Gemma3: every pattern-th layer is global: layer i is local iff (i + 1) % pattern != 0.
      std::optional<int> pattern = f.opt_int("sliding_window_pattern");
      if (!pattern) pattern = f.opt_int("_sliding_window_pattern");
      const int p = pattern.value_or(6);
      if (p < 1) fail("{}: field 'sliding_window_pattern' is {}; it must be >= 1", origin, p);
      for (int i = 0; i < num_layers; ++i) {
        if ((i + 1) % p != 0) kinds[i] = AttnKind::sliding;
      }
      break;
    }
  }
  return kinds;
}

// The config object describing the language model: multimodal wrappers (gemma3) nest it in
// text_config.
struct Located {
  const json* cfg;
  std::string model_type;
};

Located locate_text_config(const json& top, std::string_view origin) {
  const json* cfg = &top;
  if (top.contains("text_config") && top.at("text_config").is_object())
    cfg = &top.at("text_config");
  std::optional<std::string> type = Fields(*cfg, origin).opt_string("model_type");
  if (!type) type = Fields(top, origin).opt_string("model_type");
  if (!type) {
    fail("{}: missing required field 'model_type'; supported model types are {}", origin,
         supported_types());
  }
  return {cfg, *type};
}

// The model's name, activation dtype and context length, common to every family.
void fill_model_fields(ModelSpec& spec, const Fields& f, const Fields& top, std::string_view origin) {
  spec.name = top.opt_string("_name_or_path").value_or(std::string(origin));
  if (spec.name.empty()) spec.name = std::string(origin);
  std::optional<std::string> dtype = f.opt_string("torch_dtype");
  if (!dtype) dtype = f.opt_string("dtype");
  if (!dtype) dtype = top.opt_string("torch_dtype");
  if (!dtype) dtype = top.opt_string("dtype");
  if (dtype) {
    if (*dtype == "float32" || *dtype == "float16" || *dtype == "bfloat16") {
      spec.dtype = parse_dtype(*dtype);
    } else {
      fail(
          "{}: field 'torch_dtype' is \"{}\"; attnrt runs activations in float32, float16 or "
          "bfloat16",
          origin, *dtype);
    }
  }
  if (auto ctx = f.opt_int("max_position_embeddings")) spec.max_context_len = *ctx;
}

int positive(const Fields& f, const char* key, std::string_view origin) {
  const int v = f.require_int(key);
  ATTNRT_CHECK(v > 0, "{}: field '{}' is {}; it must be > 0", origin, key, v);
  return v;
}

// The softmax scale of an MLA layer: (qk_nope + qk_rope)^-1/2, times mscale^2 when the RoPE
// scaling is YaRN-like with mscale_all_dim (DeepSeek's reference code and transformers'
// yarn_apply_mscale: mscale = 0.1 * mscale_all_dim * ln(factor) + 1 for factor > 1).
float mla_scaling(const Fields& f, int qk_head_dim, std::string_view origin) {
  double scale = 1.0 / std::sqrt(static_cast<double>(qk_head_dim));
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    if (!f.has(key)) continue;
    const json& r = f.at(key);
    if (!r.is_object()) fail("{}: field '{}' is {}; expected an object", origin, key, json_type(r));
    const Fields rf(r, origin);
    std::optional<std::string> type = rf.opt_string("rope_type");
    if (!type) type = rf.opt_string("type");
    if (!type || *type == "default") break;
    const double all_dim = rf.opt_number("mscale_all_dim").value_or(0.0);
    const double factor = rf.opt_number("factor").value_or(1.0);
    if (all_dim != 0.0 && factor > 1.0) {
      const double mscale = 0.1 * all_dim * std::log(factor) + 1.0;
      scale *= mscale * mscale;
    }
    break;
  }
  return static_cast<float>(scale);
}

LayerSpec mla_layer(const Fields& f, int id, std::string_view origin) {
  const int q_heads = positive(f, "num_attention_heads", origin);
  const int kv_lora_rank = positive(f, "kv_lora_rank", origin);
  const int rope = positive(f, "qk_rope_head_dim", origin);
  const int nope = positive(f, "qk_nope_head_dim", origin);
  LayerSpec l = layer_builders::mla_layer(id, q_heads, kv_lora_rank, rope);
  l.scaling = mla_scaling(f, nope + rope, origin);
  l.qk_nope_head_dim = nope;
  // The MHA form's v heads; configs without v_head_dim serve the absorbed form only.
  l.mha_v_head_dim = f.has("v_head_dim") ? positive(f, "v_head_dim", origin) : 0;
  return l;
}

// Layer ids listed 1-based in an array field of `obj` (kimi_linear's linear_attn_config).
std::vector<int> one_based_ids(const Fields& obj, const char* key, int num_layers,
                               std::string_view origin) {
  std::vector<int> ids;
  if (!obj.has(key)) return ids;
  const json& a = obj.at(key);
  if (!a.is_array()) fail("{}: field '{}' is {}; expected an array of layer numbers", origin, key,
                          json_type(a));
  for (const json& x : a) {
    if (!x.is_number_integer() || x.get<int64_t>() < 1 || x.get<int64_t>() > num_layers) {
      fail("{}: field '{}' holds {}; entries are layer numbers 1..{} (1-based)", origin, key,
           x.dump(), num_layers);
    }
    ids.push_back(static_cast<int>(x.get<int64_t>()) - 1);
  }
  return ids;
}

// deepseek_v2 / deepseek_v3 / deepseek_v32: every layer is MLA (the dense / MoE split is the MLP's
// business). A config with `index_topk` (DeepSeek-V3.2: model_type deepseek_v32, architecture
// DeepseekV32ForCausalLM; the reference engine also takes a DeepseekV3ForCausalLM that has one)
// gives every layer an indexer (DSA) of index_n_heads x index_head_dim.
ModelSpec load_mla_model(const Fields& f, std::string_view origin) {
  ModelSpec spec;
  const int n = positive(f, "num_hidden_layers", origin);
  IndexerSpec indexer;
  if (f.has("index_topk")) {
    indexer.index_topk = positive(f, "index_topk", origin);
    indexer.index_n_heads = positive(f, "index_n_heads", origin);
    indexer.index_head_dim = positive(f, "index_head_dim", origin);
  }
  for (int i = 0; i < n; ++i) {
    spec.layers.push_back(mla_layer(f, i, origin));
    spec.layers.back().indexer = indexer;
  }
  return spec;
}

// qwen3_next: `layer_types` ("linear_attention" / "full_attention"), else every
// full_attention_interval-th layer (1-based) is full attention; Gated DeltaNet elsewhere.
ModelSpec load_qwen3_next(const Fields& f, std::string_view origin) {
  ModelSpec spec;
  const int n = positive(f, "num_hidden_layers", origin);
  const int q_heads = positive(f, "num_attention_heads", origin);
  const int kv_heads = f.opt_int("num_key_value_heads").value_or(q_heads);
  const int head_dim = f.opt_int("head_dim").value_or(256);
  LinearSpec gdn;
  gdn.num_k_heads = positive(f, "linear_num_key_heads", origin);
  gdn.num_v_heads = positive(f, "linear_num_value_heads", origin);
  gdn.head_k_dim = positive(f, "linear_key_head_dim", origin);
  gdn.head_v_dim = positive(f, "linear_value_head_dim", origin);
  gdn.conv_kernel = f.opt_int("linear_conv_kernel_dim").value_or(4);
  gdn.chunk_size = 64;
  std::vector<bool> full(n, false);
  if (f.has("layer_types")) {
    const json& t = f.at("layer_types");
    if (!t.is_array() || static_cast<int>(t.size()) != n) {
      fail("{}: field 'layer_types' must be an array of {} entries (num_hidden_layers)", origin, n);
    }
    for (int i = 0; i < n; ++i) {
      if (t[i] == "full_attention") {
        full[i] = true;
      } else if (t[i] != "linear_attention") {
        fail("{}: layer_types[{}] is {}; qwen3_next layers are \"linear_attention\" or "
             "\"full_attention\"",
             origin, i, t[i].dump());
      }
    }
  } else {
    const int interval = f.opt_int("full_attention_interval").value_or(4);
    ATTNRT_CHECK(interval >= 1, "{}: field 'full_attention_interval' is {}; it must be >= 1",
                 origin, interval);
    for (int i = 0; i < n; ++i) full[i] = (i + 1) % interval == 0;
  }
  for (int i = 0; i < n; ++i) {
    spec.layers.push_back(full[i] ? attention_layer(i, q_heads, kv_heads, head_dim)
                                  : linear_layer(i, LayerKind::gdn, gdn));
  }
  return spec;
}

// kimi_linear: linear_attn_config lists the KDA and the full-attention layers (1-based); full
// layers are MLA.
ModelSpec load_kimi_linear(const Fields& f, std::string_view origin) {
  ModelSpec spec;
  const int n = positive(f, "num_hidden_layers", origin);
  if (!f.has("linear_attn_config") || !f.at("linear_attn_config").is_object()) {
    fail("{}: missing required object 'linear_attn_config' (kda_layers, full_attn_layers, "
         "num_heads, head_dim)",
         origin);
  }
  const Fields lc(f.at("linear_attn_config"), origin);
  LinearSpec kda;
  kda.num_k_heads = kda.num_v_heads = positive(lc, "num_heads", origin);
  kda.head_k_dim = kda.head_v_dim = positive(lc, "head_dim", origin);
  kda.conv_kernel = lc.opt_int("short_conv_kernel_size").value_or(4);
  kda.chunk_size = 64;
  std::vector<int> kind(n, -1);  // 0 = KDA, 1 = full (MLA)
  for (int id : one_based_ids(lc, "kda_layers", n, origin)) kind[id] = 0;
  for (int id : one_based_ids(lc, "full_attn_layers", n, origin)) kind[id] = 1;
  for (int i = 0; i < n; ++i) {
    if (kind[i] < 0) {
      fail("{}: layer {} (1-based {}) is in neither linear_attn_config.kda_layers nor "
           "full_attn_layers",
           origin, i, i + 1);
    }
    spec.layers.push_back(kind[i] == 1 ? mla_layer(f, i, origin)
                                       : linear_layer(i, LayerKind::kda, kda));
  }
  return spec;
}

// nemotron_h: hybrid_override_pattern, one character per block: 'M' Mamba2, '*' attention, '-'
// MLP, 'E' MoE. Blocks without a mixer hold no attention state and are not layers here: the
// model's layers are its 'M' and '*' blocks in pattern order, numbered from 0 (as the preset).
ModelSpec load_nemotron_h(const Fields& f, std::string_view origin) {
  ModelSpec spec;
  const std::optional<std::string> pattern = f.opt_string("hybrid_override_pattern");
  if (!pattern) fail("{}: missing required field 'hybrid_override_pattern'", origin);
  const int q_heads = positive(f, "num_attention_heads", origin);
  const int kv_heads = f.opt_int("num_key_value_heads").value_or(q_heads);
  int head_dim = 0;
  if (auto hd = f.opt_int("attention_head_dim")) {
    head_dim = *hd;
  } else if (auto hd2 = f.opt_int("head_dim")) {
    head_dim = *hd2;
  } else {
    head_dim = positive(f, "hidden_size", origin) / q_heads;
  }
  LinearSpec mamba;
  mamba.num_v_heads = positive(f, "mamba_num_heads", origin);
  mamba.head_v_dim = positive(f, "mamba_head_dim", origin);
  mamba.d_state = positive(f, "ssm_state_size", origin);
  mamba.n_groups = positive(f, "n_groups", origin);
  mamba.conv_kernel = f.opt_int("conv_kernel").value_or(4);
  mamba.chunk_size = f.opt_int("chunk_size").value_or(128);
  for (size_t i = 0; i < pattern->size(); ++i) {
    const char c = (*pattern)[i];
    const int id = static_cast<int>(spec.layers.size());
    if (c == 'M') {
      spec.layers.push_back(linear_layer(id, LayerKind::mamba2, mamba));
    } else if (c == '*') {
      spec.layers.push_back(attention_layer(id, q_heads, kv_heads, head_dim));
    } else if (c != '-' && c != 'E') {
      fail("{}: hybrid_override_pattern[{}] is '{}'; blocks are 'M' (Mamba2), '*' (attention), "
           "'-' (MLP) or 'E' (MoE)",
           origin, i, c);
    }
  }
  return spec;
}

}  // namespace

ModelSpec load_hf_config_text(std::string_view json_text, std::string_view origin) {
  json top;
  try {
    top = json::parse(json_text);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for numbers like 1e999
    fail("{}: malformed JSON: {}", origin, e.what());
  }
  if (!top.is_object())
    fail("{}: expected a JSON object at the top level, found {}", origin, json_type(top));

  const Located loc = locate_text_config(top, origin);
  const ModelType* type = nullptr;
  for (const auto& t : kModelTypes) {
    if (t.name == loc.model_type) type = &t;
  }
  if (type == nullptr) {
    fail(
        "{}: model_type '{}' is not supported by the config loader; supported model types are {} "
        "(other models: use a preset)",
        origin, loc.model_type, supported_types());
  }
  const Family family = type->family;
  const bool gemma = family == Family::gemma2 || family == Family::gemma3;
  const Fields f(*loc.cfg, origin);
  const Fields top_fields(top, origin);

  if (family == Family::mla || family == Family::qwen3_next || family == Family::kimi_linear ||
      family == Family::nemotron_h) {
    ModelSpec spec = family == Family::mla          ? load_mla_model(f, origin)
                     : family == Family::qwen3_next ? load_qwen3_next(f, origin)
                     : family == Family::kimi_linear ? load_kimi_linear(f, origin)
                                                     : load_nemotron_h(f, origin);
    fill_model_fields(spec, f, top_fields, origin);
    try {
      spec.validate();
    } catch (const Error& e) {
      fail("{}: {}", origin, e.what());
    }
    return spec;
  }

  // transformers' Gemma2Config / Gemma3TextConfig defaults (published gemma configs omit some).
  const int num_layers =
      gemma ? f.opt_int("num_hidden_layers").value_or(26) : f.require_int("num_hidden_layers");
  const int q_heads =
      gemma ? f.opt_int("num_attention_heads").value_or(8) : f.require_int("num_attention_heads");
  const int kv_heads = f.opt_int("num_key_value_heads").value_or(gemma ? 4 : q_heads);
  ATTNRT_CHECK(num_layers > 0, "{}: field 'num_hidden_layers' is {}; it must be > 0", origin,
               num_layers);
  ATTNRT_CHECK(q_heads > 0, "{}: field 'num_attention_heads' is {}; it must be > 0", origin,
               q_heads);

  int head_dim = 0;
  if (auto hd = f.opt_int("head_dim")) {
    head_dim = *hd;
  } else if (gemma) {
    head_dim = 256;
  } else {
    if (!f.has("hidden_size")) {
      fail(
          "{}: missing required field 'hidden_size' (needed for head_dim = hidden_size / "
          "num_attention_heads when 'head_dim' is absent)",
          origin);
    }
    const int hidden = f.require_int("hidden_size");
    ATTNRT_CHECK(hidden % q_heads == 0,
                 "{}: hidden_size {} is not divisible by num_attention_heads {}; set 'head_dim'",
                 origin, hidden, q_heads);
    head_dim = hidden / q_heads;
  }

  // Window size in HF's convention (the query counts itself); -1 when the layers have none.
  std::optional<int> hf_window;
  bool qwen_sliding_enabled = false;
  if (family == Family::qwen2) {
    qwen_sliding_enabled = f.opt_bool("use_sliding_window").value_or(false);
    if (qwen_sliding_enabled) hf_window = f.opt_int("sliding_window");
  } else if (family == Family::llama) {
    hf_window = f.opt_int("sliding_window");
  } else if (family == Family::mistral) {
    hf_window = f.opt_int("sliding_window");
  } else if (family == Family::gpt_oss) {
    hf_window = f.present("sliding_window") ? f.opt_int("sliding_window") : std::optional<int>(128);
  } else {
    hf_window =
        f.present("sliding_window") ? f.opt_int("sliding_window") : std::optional<int>(4096);
  }
  const std::vector<AttnKind> kinds =
      layer_kinds(family, f, num_layers, qwen_sliding_enabled, origin);

  float scaling = 0.f;
  if (gemma) {
    const double scalar = f.present("query_pre_attn_scalar")
                              ? f.opt_number("query_pre_attn_scalar").value_or(256.0)
                              : 256.0;
    ATTNRT_CHECK(scalar > 0, "{}: field 'query_pre_attn_scalar' is {}; it must be > 0", origin,
                 scalar);
    scaling = static_cast<float>(1.0 / std::sqrt(scalar));
  }
  double softcap = 0.0;
  if (f.present("attn_logit_softcapping")) {
    softcap = f.opt_number("attn_logit_softcapping").value_or(0.0);  // null = off
  } else if (family == Family::gemma2) {
    softcap = 50.0;
  }
  ATTNRT_CHECK(softcap >= 0, "{}: field 'attn_logit_softcapping' is {}; it must be >= 0 or null",
               origin, softcap);

  ModelSpec spec;
  fill_model_fields(spec, f, top_fields, origin);
  if (!f.has("max_position_embeddings") && family == Family::gemma2) spec.max_context_len = 8192;

  for (int i = 0; i < num_layers; ++i) {
    LayerSpec l = attention_layer(i, q_heads, kv_heads, head_dim);
    l.scaling = scaling;
    l.logit_cap = static_cast<float>(softcap);
    l.has_sinks = family == Family::gpt_oss;  // a learned sink logit per head on every layer
    if (kinds[i] == AttnKind::sliding) {
      if (!hf_window) {
        fail("{}: layer {} uses sliding-window attention but 'sliding_window' is missing or null{}",
             origin, i,
             family == Family::qwen2 && !qwen_sliding_enabled
                 ? " (and 'use_sliding_window' is not true)"
                 : "");
      }
      ATTNRT_CHECK(*hf_window >= 1, "{}: field 'sliding_window' is {}; it must be >= 1", origin,
                   *hf_window);
      l.kind = LayerKind::swa;
      l.sliding_window = *hf_window - 1;  // §8.5: HF counts the query itself
    }
    spec.layers.push_back(l);
  }
  try {
    spec.validate();
  } catch (const Error& e) {
    fail("{}: {}", origin, e.what());
  }
  return spec;
}

ModelSpec load_hf_config(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot open model config '{}': no such file or not readable", path);
  std::ostringstream text;
  text << in.rdbuf();
  return load_hf_config_text(text.str(), path);
}

}  // namespace attnrt
