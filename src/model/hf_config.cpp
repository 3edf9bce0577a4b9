// HuggingFace config.json -> ModelSpec for the dense decoder families (llama, mistral, qwen2/3,
// gemma2/3). Field names, defaults and per-layer window rules follow the transformers config
// classes of each family; defaults are used only where those classes have one (gemma), elsewhere a
// missing field is an error, because a config.json without it is more likely the wrong file.
#include <fmt/ranges.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "attnrt/core/error.h"
#include "attnrt/model/model_spec.h"

namespace attnrt {

namespace {

using json = nlohmann::json;

enum class Family { llama, mistral, qwen2, gemma2, gemma3 };

struct ModelType {
  std::string_view name;
  Family family;
};

constexpr ModelType kModelTypes[] = {
    {"llama", Family::llama},        {"mistral", Family::mistral}, {"mixtral", Family::mistral},
    {"qwen2", Family::qwen2},        {"qwen2_moe", Family::qwen2}, {"qwen3", Family::qwen2},
    {"qwen3_moe", Family::qwen2},    {"gemma2", Family::gemma2},   {"gemma3", Family::gemma3},
    {"gemma3_text", Family::gemma3},
};

std::string supported_types() {
  std::vector<std::string_view> names;
  for (const auto& t : kModelTypes) names.push_back(t.name);
  return fmt::format("{}", fmt::join(names, ", "));
}

std::string_view json_type(const json& v) {
  switch (v.type()) {
    case json::value_t::null:
      return "null";
    case json::value_t::boolean:
      return "a boolean";
    case json::value_t::string:
      return "a string";
    case json::value_t::array:
      return "an array";
    case json::value_t::object:
      return "an object";
    case json::value_t::number_float:
      return "a non-integer number";
    default:
      return "a number";
  }
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
      // Gemma2 alternates: even layers local (sliding), odd layers global.
      for (int i = 0; i < num_layers; i += 2) kinds[i] = AttnKind::sliding;
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

}  // namespace

ModelSpec load_hf_config_text(std::string_view json_text, std::string_view origin) {
  json top;
  try {
    top = json::parse(json_text);
  } catch (const json::parse_error& e) {
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
  spec.name = top_fields.opt_string("_name_or_path").value_or(std::string(origin));
  if (spec.name.empty()) spec.name = std::string(origin);
  std::optional<std::string> dtype = f.opt_string("torch_dtype");
  if (!dtype) dtype = f.opt_string("dtype");
  if (!dtype) dtype = top_fields.opt_string("torch_dtype");
  if (!dtype) dtype = top_fields.opt_string("dtype");
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
  if (auto ctx = f.opt_int("max_position_embeddings")) {
    spec.max_context_len = *ctx;
  } else if (family == Family::gemma2) {
    spec.max_context_len = 8192;
  }

  for (int i = 0; i < num_layers; ++i) {
    LayerSpec l;
    l.layer_id = i;
    l.num_q_heads = q_heads;
    l.num_kv_heads = kv_heads;
    l.head_dim = head_dim;
    l.v_head_dim = head_dim;
    l.scaling = scaling;
    l.logit_cap = static_cast<float>(softcap);
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
