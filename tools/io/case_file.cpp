#include "tools/io/case_file.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string_view>
#include <type_traits>
#include <utility>

#include "attnrt/backend/registry.h"
#include "attnrt/core/error.h"
#include "attnrt/memory/index_key_cache.h"
#include "attnrt/memory/kv_cache.h"
#include "attnrt/memory/req_to_token_pool.h"

namespace attnrt {

namespace {

using json = nlohmann::ordered_json;
namespace fs = std::filesystem;

constexpr const char* kFormat = "attnrt-case";

// The names of case.json's layer.attn_type, written and read.
constexpr std::pair<AttnType, std::string_view> kAttnTypeNames[] = {
    {AttnType::decoder, "decoder"},
    {AttnType::decoder_bidirectional, "decoder_bidirectional"},
    {AttnType::encoder_only, "encoder_only"}};

std::string_view attn_type_name(AttnType t) {
  for (const auto& [type, name] : kAttnTypeNames) {
    if (type == t) return name;
  }
  return "?";
}

LayerKind parse_layer_kind(const std::string& s, const std::string& where) {
  for (LayerKind k : {LayerKind::full, LayerKind::swa, LayerKind::mla, LayerKind::gdn,
                      LayerKind::mamba2, LayerKind::kda}) {
    if (layer_kind_name(k) == s) return k;
  }
  fail("{}: layer.kind '{}' is not a layer kind (full, swa, mla, gdn, mamba2, kda)", where, s);
}

AttnType parse_attn_type(const std::string& s, const std::string& where) {
  for (const auto& [type, name] : kAttnTypeNames) {
    if (name == s) return type;
  }
  fail("{}: layer.attn_type '{}' is not one of decoder, decoder_bidirectional, encoder_only", where,
       s);
}

// Typed reads from case.json; errors name the file and the dotted field path.
class Reader {
 public:
  explicit Reader(std::string path) : path_(std::move(path)) {}

  const json& at(const json& obj, const std::string& prefix, const char* key) const {
    if (!obj.is_object() || !obj.contains(key))
      fail("{}: missing field '{}{}'", path_, prefix, key);
    return obj.at(key);
  }
  template <typename T>
  T get(const json& obj, const std::string& prefix, const char* key) const {
    const json& v = at(obj, prefix, key);
    if constexpr (is_integer<T>) {
      check_whole<T>(v, prefix, key);
    } else if constexpr (is_integer_vector<T>) {
      if (v.is_array()) {
        for (const json& e : v) check_whole<typename T::value_type>(e, prefix, key);
      }
    }
    try {
      return v.get<T>();
    } catch (const json::exception&) {
      fail("{}: field '{}{}' has the wrong type ({})", path_, prefix, key, v.dump());
    }
  }
  template <typename T>
  T get_or(const json& obj, const std::string& prefix, const char* key, T fallback) const {
    if (!obj.contains(key) || obj.at(key).is_null()) return fallback;
    return get<T>(obj, prefix, key);
  }
  const std::string& path() const { return path_; }

 private:
  template <typename T>
  static constexpr bool is_integer = std::is_integral_v<T> && !std::is_same_v<T, bool>;
  template <typename T>
  struct IsIntegerVector : std::false_type {};
  template <typename I>
  struct IsIntegerVector<std::vector<I>> : std::bool_constant<is_integer<I>> {};
  template <typename T>
  static constexpr bool is_integer_vector = IsIntegerVector<T>::value;

  // nlohmann converts a float or an out-of-range integer to an integer type with a plain cast
  // (undefined behaviour past its range): whole numbers in range only, fields and array elements.
  template <typename T>
  void check_whole(const json& v, const std::string& prefix, const char* key) const {
    if (!v.is_number()) fail("{}: field '{}{}' has the wrong type ({})", path_, prefix, key, v.dump());
    const bool in_range =
        v.is_number_unsigned()
            ? v.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<T>::max())
            : v.is_number_integer() && v.get<int64_t>() >= std::numeric_limits<T>::min() &&
                  v.get<int64_t>() <= static_cast<int64_t>(std::numeric_limits<T>::max());
    if (!in_range)
      fail("{}: field '{}{}' holds {}; expected whole numbers in [{}, {}]", path_, prefix, key,
           v.dump(), std::numeric_limits<T>::min(), std::numeric_limits<T>::max());
  }

  std::string path_;
};

json layer_to_json(const LayerSpec& l) {
  return json{{"layer_id", l.layer_id},
              {"kind", layer_kind_name(l.kind)},
              {"num_q_heads", l.num_q_heads},
              {"num_kv_heads", l.num_kv_heads},
              {"head_dim", l.head_dim},
              {"v_head_dim", l.v_head_dim},
              {"scaling", l.scaling},
              {"logit_cap", l.logit_cap},
              {"sliding_window", l.sliding_window},
              {"attn_type", attn_type_name(l.attn_type)},
              {"has_sinks", l.has_sinks},
              {"kv_lora_rank", l.kv_lora_rank},
              {"qk_rope_head_dim", l.qk_rope_head_dim},
              {"qk_nope_head_dim", l.qk_nope_head_dim},
              {"mha_v_head_dim", l.mha_v_head_dim},
              {"index_topk", l.indexer.index_topk},
              {"index_n_heads", l.indexer.index_n_heads},
              {"index_head_dim", l.indexer.index_head_dim}};
}

LayerSpec layer_from_json(const Reader& r, const json& j) {
  const std::string p = "layer.";
  LayerSpec l;
  l.layer_id = r.get<int>(j, p, "layer_id");
  l.kind = parse_layer_kind(r.get<std::string>(j, p, "kind"), r.path());
  l.num_q_heads = r.get<int>(j, p, "num_q_heads");
  l.num_kv_heads = r.get<int>(j, p, "num_kv_heads");
  l.head_dim = r.get<int>(j, p, "head_dim");
  l.v_head_dim = r.get<int>(j, p, "v_head_dim");
  l.scaling = r.get<float>(j, p, "scaling");
  l.logit_cap = r.get<float>(j, p, "logit_cap");
  l.sliding_window = r.get<int>(j, p, "sliding_window");
  l.attn_type = parse_attn_type(r.get<std::string>(j, p, "attn_type"), r.path());
  l.has_sinks = r.get<bool>(j, p, "has_sinks");
  l.kv_lora_rank = r.get_or<int>(j, p, "kv_lora_rank", 0);
  l.qk_rope_head_dim = r.get_or<int>(j, p, "qk_rope_head_dim", 0);
  l.qk_nope_head_dim = r.get_or<int>(j, p, "qk_nope_head_dim", 0);
  l.mha_v_head_dim = r.get_or<int>(j, p, "mha_v_head_dim", 0);
  l.indexer.index_topk = r.get_or<int>(j, p, "index_topk", 0);
  l.indexer.index_n_heads = r.get_or<int>(j, p, "index_n_heads", 0);
  l.indexer.index_head_dim = r.get_or<int>(j, p, "index_head_dim", 0);
  ATTNRT_CHECK(l.indexer.index_topk >= 0, "{}: layer.index_topk {} must be >= 0 (0: no indexer)",
               r.path(), l.indexer.index_topk);
  if (l.has_indexer()) {
    ATTNRT_CHECK(
        l.kind == LayerKind::mla && l.indexer.index_n_heads > 0 && l.indexer.index_head_dim > 0,
        "{}: layer.index_topk {} needs an mla layer with index_n_heads and "
        "index_head_dim > 0; got a {} layer with {} and {}",
        r.path(), l.indexer.index_topk, layer_kind_name(l.kind), l.indexer.index_n_heads,
        l.indexer.index_head_dim);
  }
  return l;
}

json options_to_json(const Options& o) {
  return json{{"attention_backend", o.attention_backend},
              {"prefill_attention_backend", o.prefill_attention_backend},
              {"decode_attention_backend", o.decode_attention_backend},
              {"speculative_attention_mode", o.speculative_attention_mode},
              {"page_size", o.page_size},
              {"kv_cache_dtype", o.kv_cache_dtype},
              {"speculative_num_steps", o.speculative_num_steps},
              {"speculative_eagle_topk", o.speculative_eagle_topk},
              {"speculative_num_draft_tokens", o.speculative_num_draft_tokens},
              {"num_threads", o.num_threads},
              {"deterministic", o.deterministic},
              {"disable_chunked_prefix_cache", o.disable_chunked_prefix_cache},
              {"chunked_prefix_cache_threshold", o.chunked_prefix_cache_threshold},
              {"max_chunk_capacity", o.max_chunk_capacity}};
}

Options options_from_json(const Reader& r, const json& j) {
  const std::string p = "options.";
  Options o;
  o.attention_backend = r.get_or<std::string>(j, p, "attention_backend", "");
  o.prefill_attention_backend = r.get_or<std::string>(j, p, "prefill_attention_backend", "");
  o.decode_attention_backend = r.get_or<std::string>(j, p, "decode_attention_backend", "");
  o.speculative_attention_mode =
      r.get_or<std::string>(j, p, "speculative_attention_mode", "prefill");
  o.page_size = r.get<int>(j, p, "page_size");
  o.kv_cache_dtype = r.get_or<std::string>(j, p, "kv_cache_dtype", "auto");
  o.speculative_num_steps = r.get_or<int>(j, p, "speculative_num_steps", 0);
  o.speculative_eagle_topk = r.get_or<int>(j, p, "speculative_eagle_topk", 0);
  o.speculative_num_draft_tokens = r.get_or<int>(j, p, "speculative_num_draft_tokens", 0);
  o.num_threads = r.get_or<int>(j, p, "num_threads", 0);
  o.deterministic = r.get_or<bool>(j, p, "deterministic", false);
  const Options defaults;
  o.disable_chunked_prefix_cache = r.get_or<bool>(j, p, "disable_chunked_prefix_cache",
                                                  defaults.disable_chunked_prefix_cache);
  o.chunked_prefix_cache_threshold = r.get_or<int64_t>(j, p, "chunked_prefix_cache_threshold",
                                                       defaults.chunked_prefix_cache_threshold);
  o.max_chunk_capacity =
      r.get_or<int64_t>(j, p, "max_chunk_capacity", defaults.max_chunk_capacity);
  return o;
}

json batch_to_json(const ForwardBatch& b) {
  json j{{"mode", forward_mode_name(b.mode)},
         {"batch_size", b.batch_size},
         {"req_pool_indices", b.req_pool_indices},
         {"seq_lens", b.seq_lens},
         {"extend_prefix_lens", b.extend_prefix_lens},
         {"extend_seq_lens", b.extend_seq_lens},
         {"extend_start_loc", b.extend_start_loc},
         {"out_cache_loc", b.out_cache_loc},
         {"positions", b.positions},
         {"spec_info", nullptr}};
  if (b.spec_info) {
    j["spec_info"] = json{{"draft_token_num", b.spec_info->draft_token_num},
                          {"topk", b.spec_info->topk},
                          {"parents", b.spec_info->parents},
                          {"accept_length", b.spec_info->accept_length}};
  }
  return j;
}

ForwardBatch batch_from_json(const Reader& r, const json& j) {
  const std::string p = "batch.";
  ForwardBatch b;
  b.mode = parse_forward_mode(r.get<std::string>(j, p, "mode"));
  b.batch_size = r.get<int>(j, p, "batch_size");
  b.req_pool_indices = r.get<std::vector<int64_t>>(j, p, "req_pool_indices");
  b.seq_lens = r.get<std::vector<int32_t>>(j, p, "seq_lens");
  b.extend_prefix_lens = r.get<std::vector<int32_t>>(j, p, "extend_prefix_lens");
  b.extend_seq_lens = r.get<std::vector<int32_t>>(j, p, "extend_seq_lens");
  b.extend_start_loc = r.get<std::vector<int32_t>>(j, p, "extend_start_loc");
  b.out_cache_loc = r.get<std::vector<int64_t>>(j, p, "out_cache_loc");
  b.positions = r.get<std::vector<int64_t>>(j, p, "positions");
  const json& spec = r.at(j, p, "spec_info");
  if (!spec.is_null()) {
    const std::string sp = "batch.spec_info.";
    SpecInfo s;
    s.draft_token_num = r.get<int>(spec, sp, "draft_token_num");
    s.topk = r.get<int>(spec, sp, "topk");
    s.parents = r.get<std::vector<int32_t>>(spec, sp, "parents");
    s.accept_length = r.get_or<std::vector<int32_t>>(spec, sp, "accept_length", {});
    b.spec_info = std::move(s);
  }
  return b;
}

// Row bytes of one K (or V) row of the layer's pool.
size_t row_bytes(const KVLayerView& v, int dim) {
  return static_cast<size_t>(v.kv_heads) * dim * dtype_size(v.dtype);
}

// The indexer's part of a case: the call's inputs, the index-key cache rows of `slots` (codes and
// scale of each, copied from the cache's pages) and the selection, when the call asked for it.
IndexerCase capture_indexer(const LayerSpec& layer, const AttnArgs& args, const KVCache& kv_cache,
                            const std::vector<int64_t>& slots, bool save_kv) {
  const IndexerArgs& ix = args.indexer;
  ATTNRT_CHECK(!ix.q.empty() && !ix.weights.empty(),
               "capture_case: layer {} is a DSA layer but its call has no indexer inputs (q {}, "
               "weights {}); the case could not be replayed",
               layer.layer_id, ix.q.describe(), ix.weights.describe());
  IndexerCase c;
  c.q = npy_from_tensor_f32(ix.q);
  c.weights = npy_from_tensor_f32(ix.weights);
  if (save_kv) c.k = npy_from_tensor_f32(ix.k);
  const IndexKeyView keys = kv_cache.index_keys(layer.layer_id);
  const auto s = static_cast<int64_t>(slots.size());
  c.key_codes = make_npy(DType::e4m3, std::vector<int64_t>{s, keys.dim}, nullptr);
  c.key_scales = make_npy(DType::f32, std::vector<int64_t>{s}, nullptr);
  for (int64_t j = 0; j < s; ++j) {
    ATTNRT_CHECK(slots[j] >= 0 && slots[j] < keys.num_rows,
                 "capture_case: slot {} is outside the index-key cache's {} rows", slots[j],
                 keys.num_rows);
    std::memcpy(c.key_codes.bytes.data() + j * keys.dim, keys.codes(slots[j]), keys.dim);
    std::memcpy(c.key_scales.bytes.data() + j * sizeof(float), keys.scale_ptr(slots[j]),
                sizeof(float));
  }
  if (!ix.topk.empty()) {
    ATTNRT_CHECK(ix.topk.dtype == DType::i32 && ix.topk.is_contiguous(),
                 "capture_case: the indexer's topk is {}; cases record a contiguous int32 one",
                 ix.topk.describe());
    c.expected_topk = make_npy(DType::i32, std::vector<int64_t>{ix.topk.shape[0], ix.topk.shape[1]},
                               ix.topk.data);
  }
  return c;
}

}  // namespace

Case capture_case(const ModelSpec& model, int layer_id, const Options& options,
                  const ForwardBatch& batch, const ReqToTokenPool& req_to_token,
                  const KVCache& kv_cache, const AttnArgs& args, const std::string& backend) {
  ATTNRT_CHECK(layer_id >= 0 && static_cast<size_t>(layer_id) < model.layers.size(),
               "capture_case: layer {} does not exist; model '{}' has layers 0..{}", layer_id,
               model.name, model.layers.size() - 1);
  const LayerSpec& layer = model.layers[layer_id];
  ATTNRT_CHECK(layer.uses_kv_cache(),
               "capture_case: layer {} of model '{}' is a {} layer; replay cases hold attention "
               "layers with a KV cache",
               layer_id, model.name, layer_kind_name(layer.kind));
  const StepLayout layout = make_step_layout(batch);
  const KVLayerView view = kv_cache.layer(layer_id);

  Case c;
  c.model_name = model.name;
  c.act_dtype = model.dtype;
  c.max_context_len = req_to_token.max_context_len();
  c.layer = layer;
  c.options = options;
  c.options.page_size = kv_cache.page_size();
  c.backend = backend;
  c.kv_dtype = view.dtype;
  c.k_scale = view.k_scale;
  c.v_scale = view.v_scale;
  c.batch = batch;
  c.save_kv = args.save_kv && !args.k.empty();

  std::vector<int64_t> slots(batch.out_cache_loc.begin(), batch.out_cache_loc.end());
  for (int i = 0; i < batch.batch_size; ++i) {
    const int64_t row = batch.req_pool_indices[i];
    ATTNRT_CHECK(row >= 0 && row < req_to_token.size(),
                 "capture_case: req_pool_indices[{}] = {} is not a request row (0..{})", i, row,
                 req_to_token.size() - 1);
    const int32_t* p = req_to_token.row_ptr(static_cast<int>(row));
    c.req_to_token.emplace_back(p, p + layout.kv_len(i));
    slots.insert(slots.end(), p, p + layout.kv_len(i));
  }
  std::sort(slots.begin(), slots.end());
  slots.erase(std::unique(slots.begin(), slots.end()), slots.end());
  c.kv_slots = slots;

  const auto s = static_cast<int64_t>(slots.size());
  const int64_t hkv = view.kv_heads;
  c.k_cache = make_npy(view.dtype, std::vector<int64_t>{s, hkv, view.head_dim}, nullptr);
  c.v_cache = make_npy(view.dtype, std::vector<int64_t>{s, hkv, view.v_head_dim}, nullptr);
  const size_t kb = row_bytes(view, view.head_dim), vb = row_bytes(view, view.v_head_dim);
  const size_t esize = dtype_size(view.dtype);
  for (int64_t j = 0; j < s; ++j) {
    const int64_t full = slots[j];
    ATTNRT_CHECK(
        full >= 0 && (view.slot_map == nullptr ? full < view.num_rows : full < view.slot_map_rows),
        "capture_case: slot {} is outside the KV pool", full);
    const int64_t row = view.pool_slot(full);
    ATTNRT_CHECK(row >= 0 && row < view.num_rows,
                 "capture_case: slot {} maps to pool row {}, outside the pool's {} rows", full, row,
                 view.num_rows);
    std::memcpy(c.k_cache.bytes.data() + j * kb,
                static_cast<const uint8_t*>(view.k) + row * view.k_row_stride * esize, kb);
    std::memcpy(c.v_cache.bytes.data() + j * vb,
                static_cast<const uint8_t*>(view.v) + row * view.v_row_stride * esize, vb);
  }

  c.q = npy_from_tensor_f32(args.q);
  if (c.save_kv) {
    c.k = npy_from_tensor_f32(args.k);
    // An MLA layer's V is the first kv_lora_rank columns of its latent k row (args.v may be empty).
    TensorView v = args.v;
    if (layer.kind == LayerKind::mla && v.empty()) {
      v = args.k;
      v.shape[2] = layer.kv_lora_rank;
    }
    c.v = npy_from_tensor_f32(v);
  }
  if (layer.has_sinks && args.sinks != nullptr) {
    c.sinks = make_npy(DType::f32, std::vector<int64_t>{layer.num_q_heads}, args.sinks);
  }
  if (!args.out.empty()) c.expected_out = npy_from_tensor_f32(args.out);
  if (!args.lse.empty()) c.expected_lse = npy_from_tensor_f32(args.lse);
  if (layer.has_indexer()) c.indexer = capture_indexer(layer, args, kv_cache, slots, c.save_kv);
  return c;
}

void write_case(const std::string& dir, const Case& c) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  ATTNRT_CHECK(!ec && fs::is_directory(dir), "cannot create case directory '{}': {}", dir,
               ec.message());
  const fs::path d(dir);

  // The request table as one padded array: row i holds req_to_token of request i, -1 past its
  // kv length.
  size_t width = 0;
  for (const auto& r : c.req_to_token) width = std::max(width, r.size());
  std::vector<int32_t> table(c.req_to_token.size() * width, -1);
  std::vector<int32_t> kv_lens;
  for (size_t i = 0; i < c.req_to_token.size(); ++i) {
    std::copy(c.req_to_token[i].begin(), c.req_to_token[i].end(), table.begin() + i * width);
    kv_lens.push_back(static_cast<int32_t>(c.req_to_token[i].size()));
  }
  write_npy((d / "req_to_token.npy").string(), DType::i32,
            std::vector<int64_t>{static_cast<int64_t>(c.req_to_token.size()),
                                 static_cast<int64_t>(width)},
            table.data());
  write_npy((d / "kv_slots.npy").string(), DType::i64,
            std::vector<int64_t>{static_cast<int64_t>(c.kv_slots.size())}, c.kv_slots.data());
  write_npy((d / "k_cache.npy").string(), c.k_cache);
  write_npy((d / "v_cache.npy").string(), c.v_cache);
  write_npy((d / "q.npy").string(), c.q);
  if (c.save_kv) {
    write_npy((d / "k.npy").string(), c.k);
    write_npy((d / "v.npy").string(), c.v);
  }
  if (c.sinks) write_npy((d / "sinks.npy").string(), *c.sinks);
  if (c.expected_out) write_npy((d / "expected_out.npy").string(), *c.expected_out);
  if (c.expected_lse) write_npy((d / "expected_lse.npy").string(), *c.expected_lse);
  if (c.indexer) {
    write_npy((d / "index_q.npy").string(), c.indexer->q);
    if (c.save_kv) write_npy((d / "index_k.npy").string(), c.indexer->k);
    write_npy((d / "index_weights.npy").string(), c.indexer->weights);
    write_npy((d / "index_key_codes.npy").string(), c.indexer->key_codes);
    write_npy((d / "index_key_scales.npy").string(), c.indexer->key_scales);
    if (c.indexer->expected_topk) {
      write_npy((d / "expected_topk.npy").string(), *c.indexer->expected_topk);
    }
  }

  json j{{"format", kFormat},
         {"version", c.indexer ? kCaseFormatVersion : kCaseFormatVersionWithoutIndexer},
         {"model", json{{"name", c.model_name},
                        {"dtype", dtype_name(c.act_dtype)},
                        {"max_context_len", c.max_context_len}}},
         {"layer", layer_to_json(c.layer)},
         {"options", options_to_json(c.options)},
         {"backend", c.backend},
         {"kv_cache", json{{"dtype", dtype_name(c.kv_dtype)},
                           {"k_scale", c.k_scale},
                           {"v_scale", c.v_scale},
                           {"page_size", c.options.page_size}}},
         {"batch", batch_to_json(c.batch)},
         {"kv_lens", kv_lens},
         {"save_kv", c.save_kv},
         {"has_sinks_file", c.sinks.has_value()},
         {"has_expected_out", c.expected_out.has_value()},
         {"has_expected_lse", c.expected_lse.has_value()},
         {"has_expected_topk", c.indexer && c.indexer->expected_topk.has_value()}};
  const std::string path = (d / "case.json").string();
  std::ofstream out(path, std::ios::trunc);
  ATTNRT_CHECK(out.good(), "cannot create '{}' for writing", path);
  out << j.dump(2) << "\n";
  out.flush();
  ATTNRT_CHECK(out.good(), "writing '{}' failed", path);
}

Case read_case(const std::string& dir) {
  const fs::path d(dir);
  ATTNRT_CHECK(fs::is_directory(d), "'{}' is not a case directory (it does not exist)", dir);
  return parse_case(
      [&](const std::string& name) -> std::optional<std::string> {
        std::ifstream in(d / name, std::ios::binary);
        if (!in.good()) return std::nullopt;
        std::ostringstream text;
        text << in.rdbuf();
        ATTNRT_CHECK(!in.bad(), "{}: read error", (d / name).string());
        return text.str();
      },
      dir);
}

Case parse_case(const CaseFileReader& read_file, const std::string& dir) {
  const fs::path d(dir);
  const std::string path = (d / "case.json").string();
  const std::optional<std::string> text = read_file("case.json");
  ATTNRT_CHECK(text.has_value(), "'{}' is not a case directory: it has no case.json", dir);
  json j;
  try {
    j = json::parse(*text);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for numbers like 1e999
    fail("{}: malformed JSON: {}", path, e.what());
  }
  const Reader r(path);
  // (json::value throws type_error for a "format" that is not a string: checked by hand.)
  const auto format = j.is_object() ? j.find("format") : j.end();
  ATTNRT_CHECK(format != j.end() && format->is_string() && *format == kFormat,
               "{}: not an attnrt case (field 'format' must be \"{}\")", path, kFormat);
  const int version = r.get<int>(j, "", "version");
  ATTNRT_CHECK(version >= kCaseFormatVersionWithoutIndexer && version <= kCaseFormatVersion,
               "{}: case format version {} is not supported; this build reads versions {} to {}",
               path, version, kCaseFormatVersionWithoutIndexer, kCaseFormatVersion);

  Case c;
  const json& model = r.at(j, "", "model");
  c.model_name = r.get<std::string>(model, "model.", "name");
  c.act_dtype = parse_dtype(r.get<std::string>(model, "model.", "dtype"));
  c.max_context_len = r.get<int>(model, "model.", "max_context_len");
  c.layer = layer_from_json(r, r.at(j, "", "layer"));
  ATTNRT_CHECK(!c.layer.has_indexer() || version >= 2,
               "{}: layer.index_topk {} (a DSA layer) needs case format version 2; the file says "
               "version {}",
               path, c.layer.indexer.index_topk, version);
  c.options = options_from_json(r, r.at(j, "", "options"));
  c.backend = r.get_or<std::string>(j, "", "backend", "");
  const json& kv = r.at(j, "", "kv_cache");
  c.kv_dtype = parse_dtype(r.get<std::string>(kv, "kv_cache.", "dtype"));
  c.k_scale = r.get<float>(kv, "kv_cache.", "k_scale");
  c.v_scale = r.get<float>(kv, "kv_cache.", "v_scale");
  c.options.page_size = r.get<int>(kv, "kv_cache.", "page_size");
  c.batch = batch_from_json(r, r.at(j, "", "batch"));
  c.save_kv = r.get<bool>(j, "", "save_kv");
  ATTNRT_CHECK(c.act_dtype == DType::f32 || c.act_dtype == DType::f16 || c.act_dtype == DType::bf16,
               "{}: model.dtype {} is not an activation dtype (fp32, fp16, bf16)", path,
               dtype_name(c.act_dtype));
  ATTNRT_CHECK(c.options.page_size >= 1, "{}: kv_cache.page_size {} must be >= 1", path,
               c.options.page_size);
  ATTNRT_CHECK(c.layer.uses_kv_cache(),
               "{}: layer.kind {} has no KV cache; cases hold attention "
               "layers",
               path, layer_kind_name(c.layer.kind));

  const StepLayout layout = make_step_layout(c.batch);
  const auto kv_lens = r.get<std::vector<int32_t>>(j, "", "kv_lens");
  ATTNRT_CHECK(static_cast<int>(kv_lens.size()) == c.batch.batch_size,
               "{}: kv_lens has {} entries for a batch of {}", path, kv_lens.size(),
               c.batch.batch_size);
  for (int i = 0; i < c.batch.batch_size; ++i) {
    ATTNRT_CHECK(kv_lens[i] == layout.kv_len(i),
                 "{}: kv_lens[{}] = {} but the batch gives request {} {} keys", path, i, kv_lens[i],
                 i, layout.kv_len(i));
  }

  auto load = [&](const char* name) {
    const std::string file = (d / name).string();
    const std::optional<std::string> bytes = read_file(name);
    if (!bytes) fail("cannot open '{}': no such file or not readable", file);
    return parse_npy(*bytes, file);
  };
  const auto bs = static_cast<int64_t>(c.batch.batch_size);
  NpyArray table = load("req_to_token.npy");
  table.expect(DType::i32, {bs, -1});
  const int64_t width = table.shape[1];
  for (int64_t i = 0; i < bs; ++i) {
    ATTNRT_CHECK(kv_lens[i] <= width, "{}: request {} needs {} columns, the file has {}",
                 table.origin, i, kv_lens[i], width);
    const int32_t* row = table.as<int32_t>() + i * width;
    c.req_to_token.emplace_back(row, row + kv_lens[i]);
  }
  NpyArray slots = load("kv_slots.npy");
  slots.expect(DType::i64, {-1});
  c.kv_slots.assign(slots.as<int64_t>(), slots.as<int64_t>() + slots.numel());
  ATTNRT_CHECK(std::is_sorted(c.kv_slots.begin(), c.kv_slots.end()) &&
                   std::adjacent_find(c.kv_slots.begin(), c.kv_slots.end()) == c.kv_slots.end(),
               "{}: slots must be unique and ascending", slots.origin);
  auto has_slot = [&](int64_t s) {
    return std::binary_search(c.kv_slots.begin(), c.kv_slots.end(), s);
  };
  for (size_t i = 0; i < c.batch.out_cache_loc.size(); ++i) {
    ATTNRT_CHECK(has_slot(c.batch.out_cache_loc[i]),
                 "{}: out_cache_loc[{}] = {} has no row in kv_slots.npy", path, i,
                 c.batch.out_cache_loc[i]);
  }
  for (int64_t i = 0; i < bs; ++i) {
    for (size_t t = 0; t < c.req_to_token[i].size(); ++t) {
      ATTNRT_CHECK(has_slot(c.req_to_token[i][t]),
                   "{}: req_to_token[{}, {}] = {} has no row in kv_slots.npy", table.origin, i, t,
                   c.req_to_token[i][t]);
    }
  }

  const LayerSpec& l = c.layer;
  const int64_t s = static_cast<int64_t>(c.kv_slots.size()), t = c.num_tokens();
  c.k_cache = load("k_cache.npy");
  c.k_cache.expect(c.kv_dtype, {s, l.num_kv_heads, l.head_dim});
  c.v_cache = load("v_cache.npy");
  c.v_cache.expect(c.kv_dtype, {s, l.num_kv_heads, l.v_head_dim});
  c.q = load("q.npy");
  c.q.expect(DType::f32, {t, l.num_q_heads, l.head_dim});
  if (c.save_kv) {
    c.k = load("k.npy");
    c.k.expect(DType::f32, {t, l.num_kv_heads, l.head_dim});
    c.v = load("v.npy");
    c.v.expect(DType::f32, {t, l.num_kv_heads, l.v_head_dim});
  }
  if (r.get_or<bool>(j, "", "has_sinks_file", false)) {
    c.sinks = load("sinks.npy");
    c.sinks->expect(DType::f32, {l.num_q_heads});
  }
  if (r.get_or<bool>(j, "", "has_expected_out", false)) {
    c.expected_out = load("expected_out.npy");
    c.expected_out->expect(DType::f32, {t, l.num_q_heads, l.v_head_dim});
  }
  if (r.get_or<bool>(j, "", "has_expected_lse", false)) {
    c.expected_lse = load("expected_lse.npy");
    c.expected_lse->expect(DType::f32, {t, l.num_q_heads});
  }
  if (l.has_indexer()) {
    const int64_t hi = l.indexer.index_n_heads, di = l.indexer.index_head_dim;
    IndexerCase& ix = c.indexer.emplace();
    ix.q = load("index_q.npy");
    ix.q.expect(DType::f32, {t, hi, di});
    if (c.save_kv) {
      ix.k = load("index_k.npy");
      ix.k.expect(DType::f32, {t, di});
    }
    ix.weights = load("index_weights.npy");
    ix.weights.expect(DType::f32, {t, hi});
    ix.key_codes = load("index_key_codes.npy");
    ix.key_codes.expect(DType::e4m3, {s, di});
    ix.key_scales = load("index_key_scales.npy");
    ix.key_scales.expect(DType::f32, {s});
    if (r.get_or<bool>(j, "", "has_expected_topk", false)) {
      ix.expected_topk = load("expected_topk.npy");
      ix.expected_topk->expect(DType::i32, {t, l.indexer.index_topk});
    }
  }
  return c;
}

void write_step_case(const std::string& dir, const ModelSpec& model, int layer_id,
                     const Options& options, const ForwardBatch& batch,
                     const ReqToTokenPool& req_to_token, const KVCache& kv_cache,
                     const AttnArgs& args, const std::string& backend) {
  write_case(dir,
             capture_case(model, layer_id, options, batch, req_to_token, kv_cache, args, backend));
}

namespace {

HostBuffer to_act_dtype(const NpyArray& a, DType dtype) {
  std::array<int64_t, kMaxDims> shape{};
  std::copy(a.shape.begin(), a.shape.end(), shape.begin());
  HostBuffer b(dtype, shape, static_cast<int>(a.shape.size()));
  const float* src = a.as<float>();
  for (int64_t i = 0; i < a.numel(); ++i)
    store_from_float(b.data(), dtype, static_cast<size_t>(i), src[i]);
  return b;
}

}  // namespace

ReplayResult replay_case(const Case& c, const std::string& backend, bool want_lse) {
  const BackendEntry& entry = Registry::global().get(backend);
  if (entry.unavailable_reason) {
    const std::string why = entry.unavailable_reason();
    ATTNRT_CHECK(why.empty(), "backend '{}' cannot run here: {}", backend, why);
  }

  // A one-layer model: the layer keeps its dims and mask settings, renumbered to id 0.
  ModelSpec model;
  model.name = c.model_name;
  model.dtype = c.act_dtype;
  model.max_context_len = c.max_context_len;
  model.layers = {c.layer};
  model.layers[0].layer_id = 0;
  const LayerSpec& layer = model.layers[0];

  // Pages renumbered 1..n in ascending order (page 0, the dummy page, stays 0); offsets inside a
  // page are kept, so slot % page_size == position % page_size still holds for page-native
  // backends while the pool holds only the rows the case has.
  const int page = c.options.page_size;
  std::map<int64_t, int64_t> page_map{{0, 0}};
  for (int64_t s : c.kv_slots) page_map.emplace(s / page, 0);
  int64_t next = 1;
  for (auto& [old_page, new_page] : page_map) {
    if (old_page != 0) new_page = next++;
  }
  auto remap = [&](int64_t s) { return page_map.at(s / page) * page + s % page; };

  KVCacheConfig cfg;
  cfg.full_slots = (next - 1 > 0 ? next - 1 : 1) * page;
  cfg.page_size = page;
  cfg.dtype = c.kv_dtype;
  cfg.max_num_tokens = static_cast<int>(std::max<int64_t>(c.num_tokens(), 1));
  std::unique_ptr<KVCache> kv = make_host_kv_cache(model, cfg);
  if (c.k_scale != 1.f || c.v_scale != 1.f) kv->set_kv_scales(0, c.k_scale, c.v_scale);
  const KVLayerView view = kv->layer(0);
  const size_t kb = row_bytes(view, view.head_dim), vb = row_bytes(view, view.v_head_dim);
  const size_t esize = dtype_size(view.dtype);
  for (size_t j = 0; j < c.kv_slots.size(); ++j) {
    const int64_t row = view.pool_slot(remap(c.kv_slots[j]));
    std::memcpy(static_cast<uint8_t*>(view.k) + row * view.k_row_stride * esize,
                c.k_cache.bytes.data() + j * kb, kb);
    std::memcpy(static_cast<uint8_t*>(view.v) + row * view.v_row_stride * esize,
                c.v_cache.bytes.data() + j * vb, vb);
  }
  if (c.indexer) {
    // The index-key cache shares the latent pool's slot space: the same renumbering.
    IndexKeyView keys = kv->index_keys(0);
    for (size_t j = 0; j < c.kv_slots.size(); ++j) {
      const int64_t slot = remap(c.kv_slots[j]);
      std::memcpy(keys.codes(slot), c.indexer->key_codes.bytes.data() + j * keys.dim, keys.dim);
      std::memcpy(const_cast<uint8_t*>(keys.scale_ptr(slot)),
                  c.indexer->key_scales.bytes.data() + j * sizeof(float), sizeof(float));
    }
  }

  // Request rows renumbered in order of first use.
  ForwardBatch batch = c.batch;
  std::map<int64_t, int> rows;
  for (int64_t r : batch.req_pool_indices) rows.emplace(r, -1);
  ReqToTokenPool req_to_token(static_cast<int>(std::max<size_t>(rows.size(), 1)),
                              c.max_context_len);
  for (auto& [old_row, new_row] : rows) new_row = req_to_token.alloc();
  for (int i = 0; i < batch.batch_size; ++i) {
    batch.req_pool_indices[i] = rows.at(batch.req_pool_indices[i]);
    std::vector<int64_t> slots;
    for (int32_t s : c.req_to_token[i]) slots.push_back(remap(s));
    req_to_token.write(static_cast<int>(batch.req_pool_indices[i]), 0, slots);
  }
  for (int64_t& s : batch.out_cache_loc) s = remap(s);

  Options options = c.options;
  options.attention_backend = backend;
  options.prefill_attention_backend.clear();
  options.decode_attention_backend.clear();
  BackendContext ctx;
  ctx.model = &model;
  ctx.options = &options;
  ctx.kv_cache = kv.get();
  ctx.req_to_token = &req_to_token;
  ctx.device = Device::cpu();
  std::unique_ptr<AttentionBackend> impl = entry.factory(ctx);

  kv->begin_step(batch);
  impl->init_forward_metadata(batch);

  const int64_t t = c.num_tokens();
  HostBuffer q = to_act_dtype(c.q, c.act_dtype);
  HostBuffer k, v;
  AttnArgs args;
  args.q = q.view();
  if (c.save_kv) {
    k = to_act_dtype(c.k, c.act_dtype);
    v = to_act_dtype(c.v, c.act_dtype);
    args.k = k.view();
    // MLA: the latent rows alone (V is a view of them, nothing of its own is stored).
    if (layer.kind != LayerKind::mla) args.v = v.view();
  }
  args.save_kv = c.save_kv;
  if (c.sinks) args.sinks = c.sinks->as<float>();
  ReplayResult result;
  result.backend = backend;
  result.out = HostBuffer(c.act_dtype, {t, layer.num_q_heads, layer.v_head_dim});
  std::memset(result.out.data(), 0, result.out.bytes());
  args.out = result.out.view();
  if (want_lse) {
    result.lse = HostBuffer(DType::f32, {t, layer.num_q_heads});
    args.lse = result.lse.view();
  }
  HostBuffer index_q, index_k, index_w;
  if (c.indexer) {
    index_q = to_act_dtype(c.indexer->q, c.act_dtype);
    index_w = to_act_dtype(c.indexer->weights, c.act_dtype);
    args.indexer.q = index_q.view();
    args.indexer.weights = index_w.view();
    if (c.save_kv) {
      index_k = to_act_dtype(c.indexer->k, c.act_dtype);
      args.indexer.k = index_k.view();
    }
    result.topk = HostBuffer(DType::i32, {t, layer.indexer.index_topk});
    args.indexer.topk = result.topk.view();
  }
  impl->forward(args, layer, batch);
  return result;
}

void write_replay_result(const std::string& dir, const ReplayResult& result) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  ATTNRT_CHECK(!ec && fs::is_directory(dir), "cannot create output directory '{}': {}", dir,
               ec.message());
  write_npy((fs::path(dir) / "out.npy").string(), npy_from_tensor_f32(result.out.view()));
  if (result.lse.data() != nullptr) {
    write_npy((fs::path(dir) / "lse.npy").string(), npy_from_tensor_f32(result.lse.view()));
  }
  if (result.topk.data() != nullptr) {
    const TensorView t = result.topk.view();
    write_npy((fs::path(dir) / "topk.npy").string(), DType::i32,
              std::vector<int64_t>{t.shape[0], t.shape[1]}, t.data);
  }
}

}  // namespace attnrt
